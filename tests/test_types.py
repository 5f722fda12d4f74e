"""The shape annotations of the public API, checked at run time so that they cannot drift from the code.

Each public function is wrapped with ``jaxtyping.jaxtyped(typechecker=beartype.beartype)`` (only here: in
normal use annotations are inert) and called on valid inputs of small concrete shapes, NumPy and JAX,
so every argument and the return value are checked against ``Float[ArrayLike, "T H"]`` & co., with the
axis names bound consistently across one call. A few calls break an annotation on purpose to show the
checker is live. Axes: T=3 queries, S=5 keys, N=4 query heads, K=2 key/value heads, H=8, V=6.
"""

import inspect
import subprocess
import sys
import typing

import beartype
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

import jaxattn
from jaxattn import probes

T, S, N, K, H, V = 3, 5, 4, 2, 8, 6
rng = np.random.default_rng(0)
f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)


def checked(fn):
    """``fn`` with its annotations enforced: a violation raises ``jaxtyping.TypeCheckError``."""
    return jaxtyping.jaxtyped(typechecker=beartype.beartype)(fn)


def call(fn, *args, **kwargs):
    return checked(fn)(*args, **kwargs)


q, k, v = f32(T, H), f32(S, H), f32(S, V)
Q, KK, VV = f32(T, N, H), f32(S, K, H), f32(S, K, V)
mask_ts = np.tril(np.ones((T, S), bool))
mask_s = np.arange(S) < 4


# ----------------------------------------------------------------------------------------------------
# Valid calls pass the checker.
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("to", [np.asarray, pytest.param(jnp.asarray, marks=pytest.mark.slow)], ids=["numpy", "jax"])
def test_single_head(to):
    qq, kk, vv = to(q), to(k), to(v)
    out, w = call(jaxattn.attention, qq, kk, vv, mask=to(mask_ts), bias=to(f32(T, S)), scale=0.5)
    assert out.shape == (T, V) and w.shape == (T, S)
    call(jaxattn.attention, qq, kk, vv, mask=to(mask_s), bias=to(f32(S)), is_causal=True, scale=1)
    call(jaxattn.attention_weights, qq, kk, mask=to(mask_ts[:, :1]), scale=np.float32(0.3))
    call(jaxattn.attention_logits, qq.astype(jnp.bfloat16), kk.astype(jnp.float16), bias=to(f32(1, S)))
    out, lse = call(jaxattn.blockwise_attention, qq, kk, vv, mask=to(mask_s), block_q=2, block_k=2)
    assert lse.shape == (T,)
    assert call(jaxattn.weights_from_lse, qq, kk, lse, mask=to(mask_s)).shape == (T, S)
    assert call(jaxattn.weights_from_lse, qq, kk, to(np.asarray(lse)), rows=to(np.array([2, 0]))).shape == (2, S)
    grads = call(probes.attention_grads, qq, kk, vv, to(f32(T, V)), mask=to(mask_ts), is_causal=True)
    norms = call(probes.grad_norms, grads)
    assert norms["k"].shape == (S,) and norms["q_zero"].dtype == bool


@pytest.mark.slow  # the single-head checks stay in make test
@pytest.mark.parametrize("to", [np.asarray, jnp.asarray], ids=["numpy", "jax"])
def test_multi_head(to):
    qq, kk, vv = to(Q), to(KK), to(VV)
    out, w = call(jaxattn.multi_head_attention, qq, kk, vv, mask=to(np.ones((N, T, S), bool)), bias=to(f32(T, S)))
    assert out.shape == (T, N, V) and w.shape == (N, T, S)
    call(jaxattn.multi_head_attention, qq, kk, vv, mask=to(mask_s), is_causal=True)
    out, lse = call(jaxattn.multi_head_blockwise_attention, qq, kk, vv, mask=to(mask_ts), block_q=2, block_k=3)
    assert lse.shape == (N, T)
    x = call(jaxattn.split_heads, to(f32(T, N * H)), N)
    assert x.shape == (T, N, H)
    assert call(jaxattn.merge_heads, x).shape == (T, N * H)


def test_attention_layer():
    D = 16
    params = call(jaxattn.init_attention_params, jax.random.key(0), D, N, num_kv_heads=K, use_bias=True)
    call(jaxattn.init_attention_params, 0, D, N, num_kv_heads=K)
    call(jaxattn.init_attention_params, np.array([0, 1], np.uint32), D, N, num_kv_heads=K)
    h = f32(T, D)
    out, w = call(jaxattn.attention_layer, params, h, num_heads=N, num_kv_heads=K, is_causal=True)
    assert out.shape == (T, D) and w.shape == (N, T, T)
    out, w = call(jaxattn.attention_layer, params, jnp.asarray(h), num_heads=N, num_kv_heads=K,
                  context=f32(S, D), mask=mask_s)
    assert w.shape == (N, T, S)


def test_masks():
    assert call(jaxattn.causal_mask, T).shape == (T, T)
    assert call(jaxattn.causal_mask, T, S, offset=S - T).shape == (T, S)
    assert call(jaxattn.padding_mask, np.array([2, 5]), S).shape == (2, S)
    assert call(jaxattn.padding_mask, 3, S).shape == (S,)
    assert call(jaxattn.combine_masks, mask_s, None, jnp.asarray(mask_ts)).shape == (T, S)
    assert call(jaxattn.combine_masks, mask_ts, mask_s).shape == (T, S)
    assert call(jaxattn.combine_masks, None) is None


@pytest.mark.parametrize("to", [np.asarray, pytest.param(jnp.asarray, marks=pytest.mark.slow)], ids=["numpy", "jax"])
def test_row_probes(to):
    w = to(np.asarray(jax.nn.softmax(f32(N, T, S), axis=-1)))
    for fn in (probes.entropy, probes.normalized_entropy, probes.max_weight, probes.effective_support):
        assert call(fn, w, to(mask_ts)).shape == (N, T)
    assert call(probes.row_stats, w, to(mask_s))["num_keys"].shape == (N, T)
    assert call(probes.head_entropy, w, to(mask_ts)).shape == (N,)
    assert call(probes.head_entropy, w, to(mask_s), normalized=True).shape == (N,)
    logits = to(f32(T, S))
    assert call(probes.softmax_jacobian, logits, to(mask_s)).shape == (T, S, S)
    assert call(probes.softmax_jacobian_norms, logits, to(mask_ts))["frobenius"].shape == (T,)


@pytest.mark.slow
def test_ring_and_sharded_on_one_device():
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((1,), ("x",))
    on = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec("x")))
    out, lse = call(jaxattn.ring_attention, on(Q), on(KK), on(VV), mesh=mesh, axis_name="x", kv_mask=on(mask_s))
    assert out.shape == (T, N, V) and lse.shape == (N, T)
    out, lse = call(jaxattn.sharded_attention, on(Q[None]), on(KK[None]), on(VV[None]), mesh=mesh, batch_axis="x")
    assert out.shape == (1, T, N, V) and lse.shape == (1, N, T)


def test_gpt2_forward():
    from jaxattn import gpt2

    config = gpt2.GPT2Config.make(vocab_size=40, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    params = gpt2.init_params(0, config)
    out = call(gpt2.forward, params, config, np.array([1, 2, 3], np.int32), scale=1.0)
    assert out.logits.shape == (3, 40)
    call(gpt2.forward, params, config, jnp.arange(4))


def test_bert_forward():
    from jaxattn import bert

    config = bert.BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=16, max_position_embeddings=8, type_vocab_size=2,
                             layer_norm_eps=1e-12)
    params: dict = {}
    for _, dest, shape, transpose in bert._weight_table(config):
        node = params
        for p in dest[:-1]:
            node = node.setdefault(p, {})
        node[dest[-1]] = jnp.asarray(f32(*(shape[::-1] if transpose else shape)))
    ids = np.array([1, 5, 7, 2], np.int64)
    out = call(bert.forward, params, config, ids, attention_mask=np.array([1, 1, 1, 0]), token_type_ids=np.zeros(4, int))
    assert out.attentions.shape == (1, 2, 4, 4)
    call(bert.forward, params, config, jnp.asarray(ids), attention_mask=np.array([True, True, False, False]))


# ----------------------------------------------------------------------------------------------------
# Calls that break an annotation are caught by the checker, before the library's own validation.
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn, args, kwargs",
    [
        (jaxattn.attention, (q, f32(S, H + 1), v), {}),  # k's H differs from q's
        (jaxattn.attention, (q, k, f32(S + 1, V)), {}),  # v's S differs from k's
        (jaxattn.attention, (q, k, v), {"mask": np.ones((T + 1, S), bool)}),  # mask not broadcastable to [T, S]
        (jaxattn.attention, (q.astype(np.int32), k, v), {}),  # not a float dtype
        (jaxattn.attention, (q, k, v), {"mask": np.ones((T, S), np.int32)}),  # not a boolean mask
        (jaxattn.multi_head_attention, (Q, KK, f32(S, K + 1, V)), {}),  # v's K differs from k's
        (jaxattn.multi_head_blockwise_attention, (Q, f32(S, K, H + 1), VV), {}),
        (jaxattn.weights_from_lse, (q, k, f32(T + 1)), {}),  # lse is not [T]
        (probes.attention_grads, (q, k, v, f32(T, V + 1)), {}),  # cotangent is not [T, V]
        (probes.entropy, (f32(T, S), np.ones((T, S + 1), bool)), {}),  # mask's S differs from weights'
        (jaxattn.padding_mask, (np.array([1.5]), S), {}),  # lengths not integer
    ],
)
def test_checker_catches_annotation_mismatch(fn, args, kwargs):
    with pytest.raises(jaxtyping.TypeCheckError):
        call(fn, *args, **kwargs)


def test_checker_catches_a_wrong_return_annotation():
    """A return shape that contradicts the arguments' axes is caught too (here: a deliberately wrong wrapper)."""

    def wrong(q: jaxtyping.Float[jaxtyping.ArrayLike, "T H"]) -> jaxtyping.Float[jaxtyping.Array, "H T"]:
        return jaxattn.attention_logits(q, q)  # [T, T]

    with pytest.raises(jaxtyping.TypeCheckError):
        call(wrong, q)


# ----------------------------------------------------------------------------------------------------
# Every public function is annotated, and the annotations resolve with and without jaxtyping.
# ----------------------------------------------------------------------------------------------------


def _public_functions():
    from jaxattn import bert, gpt2

    fns = [getattr(jaxattn, n) for n in jaxattn.__all__] + [getattr(probes, n) for n in probes.__all__]
    return [f for f in fns if inspect.isfunction(f)] + [gpt2.forward, bert.forward]


@pytest.mark.parametrize("fn", _public_functions(), ids=lambda f: f"{f.__module__}.{f.__qualname__}")
def test_public_function_is_fully_annotated(fn):
    sig = inspect.signature(fn)
    missing = [p.name for p in sig.parameters.values() if p.annotation is inspect.Parameter.empty]
    assert not missing, f"{fn.__qualname__}: parameters without an annotation: {missing}"
    assert sig.return_annotation is not inspect.Signature.empty, f"{fn.__qualname__}: no return annotation"
    typing.get_type_hints(fn)  # every name an annotation uses is importable from the function's module


def test_annotations_resolve_without_jaxtyping():
    code = (
        "import sys, typing, inspect; sys.modules['jaxtyping'] = None\n"
        "import jaxattn, jaxattn.probes\n"
        "from jaxattn import bert, gpt2\n"
        "fns = [getattr(m, n) for m in (jaxattn, jaxattn.probes) for n in m.__all__] + [gpt2.forward, bert.forward]\n"
        "for f in fns:\n"
        "    if inspect.isfunction(f): typing.get_type_hints(f)\n"
        "assert 'jaxtyping' not in repr(typing.get_type_hints(jaxattn.attention))\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
