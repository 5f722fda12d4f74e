"""jaxattn.nnx against Flax's own: MultiHeadAttention as a drop-in, dot_product_attention as an attention_fn.

Parity with ``flax.nnx.MultiHeadAttention`` on copied weights within 1e-6 (float32): outputs, sown maps,
batch dims, cross-attention, masks, grouped-query heads, normalize_qk, dropout and decoding with a cache.
``make test`` runs one case of each kind; the rest is marked slow.
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxattn
from jaxattn.nnx import MultiHeadAttention, dot_product_attention

ATOL = 1e-6  # float32 parity with Flax: the same function, summed in a different order

rng = np.random.default_rng(0)


def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def pair(*args, seed=0, **kwargs):
    """jaxattn's module and Flax's, built from the same arguments and the same rngs (so the same weights)."""
    kwargs.setdefault("decode", False)
    ours = MultiHeadAttention(*args, rngs=nnx.Rngs(seed), **kwargs)
    flax = nnx.MultiHeadAttention(*args, rngs=nnx.Rngs(seed), **kwargs)
    return ours, flax


@functools.cache
def _compiled(static):
    """One compiled forward per set of static call arguments (and per module graph, by nnx.jit)."""
    kw = dict(static)
    call = lambda m, x, ctx, mask: m(x, ctx, mask=mask, sow_weights=True, **kw)
    return nnx.jit(nnx.capture(call, nnx.Intermediate))


def forward(module, x, ctx=None, *, mask=None, **static):
    """``(module(x, ctx, mask=mask, **static), the attention_weights it sows)``, compiled."""
    out, intermediates = _compiled(tuple(sorted(static.items())))(module, x, ctx, mask)
    return out, intermediates["attention_weights"][0]  # one call, one map


def close(a, b, atol=ATOL):
    err = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
    assert err <= atol, err
    return err


# ----------------------------------------------------------------------------------------------------
# The module is Flax's: signature, parameters, state.
# ----------------------------------------------------------------------------------------------------


def test_constructor_is_flaxs_with_jaxattn_as_attention_fn():
    ours = inspect.signature(MultiHeadAttention.__init__).parameters
    flax = inspect.signature(nnx.MultiHeadAttention.__init__).parameters
    assert list(ours) == list(flax)  # num_heads, in_features, qkv_features, out_features, ...
    assert [p.kind for p in ours.values()] == [p.kind for p in flax.values()]
    differ = [name for name in ours if ours[name].default is not flax[name].default]
    assert differ == ["attention_fn"] and ours["attention_fn"].default is dot_product_attention
    assert issubclass(MultiHeadAttention, nnx.MultiHeadAttention)

    m = MultiHeadAttention(4, 16, rngs=nnx.Rngs(0))  # num_heads=4, in_features=16, use_bias=True
    assert (m.num_heads, m.in_features, m.head_dim) == (4, 16, 4)
    assert m.attention_fn is dot_product_attention
    assert m.query.kernel.shape == (16, 4, 4) and m.out.kernel.shape == (4, 4, 16)
    assert m.query.bias.shape == (4, 4) and m.out.bias.shape == (16,)
    with pytest.raises(ValueError, match="must be divisible by 'num_heads'"):
        MultiHeadAttention(16, 4, rngs=nnx.Rngs(0))  # 16 heads cannot split 4 features, as in Flax


def test_state_moves_both_ways_and_gives_flaxs_outputs():
    kwargs = dict(qkv_features=8, out_features=6, num_kv_heads=2, decode=False)
    ours = MultiHeadAttention(4, 12, rngs=nnx.Rngs(0), **kwargs)
    flax = nnx.MultiHeadAttention(4, 12, rngs=nnx.Rngs(1), **kwargs)
    x = f32(2, 5, 12)
    assert jax.tree.structure(nnx.state(ours, nnx.Param)) == jax.tree.structure(nnx.state(flax, nnx.Param))
    assert not np.allclose(forward(ours, x)[0], forward(flax, x)[0])  # different seeds: different weights
    nnx.update(ours, nnx.state(flax, nnx.Param))  # Flax -> jaxattn
    close(forward(ours, x)[0], forward(flax, x)[0])
    ours2 = MultiHeadAttention(4, 12, rngs=nnx.Rngs(2), **kwargs)
    flax2 = nnx.merge(nnx.graphdef(flax), nnx.state(ours2))  # jaxattn -> Flax
    assert type(flax2) is nnx.MultiHeadAttention
    close(forward(flax2, x)[0], forward(ours2, x)[0])


@pytest.mark.slow  # about 3 s on 2 cores
def test_params_feed_attention_layer():
    ours, _ = pair(4, 16, qkv_features=8, num_kv_heads=2, in_kv_features=6)
    h, c = f32(5, 16), f32(7, 6)
    out, weights = jaxattn.attention_layer(ours.params(), h, num_heads=4, num_kv_heads=2, context=c)
    out_module, weights_module = forward(ours, h, c)
    close(out, out_module)
    close(weights, weights_module)
    normalized, _ = pair(2, 8, normalize_qk=True)
    with pytest.raises(ValueError, match="normalize_qk=True"):
        normalized.params()


# ----------------------------------------------------------------------------------------------------
# Parity with Flax on copied weights (the same rngs give the same weights).
# ----------------------------------------------------------------------------------------------------

CASES = {  # constructor kwargs, batch dims, T, S (S != T: cross-attention), mask
    "batch_gqa_cross_padding": (dict(num_kv_heads=2, in_kv_features=6), (3,), 4, 6, "padding"),
    "two_batch_dims_causal_mask": (dict(qkv_features=8, out_features=10), (2, 3), 5, 5, "causal"),
    "normalize_qk_head_mask": (dict(normalize_qk=True, use_bias=False), (2,), 4, 4, "per_head"),
}


def case_inputs(kwargs, batch, T, S, mask_kind):
    x = f32(*batch, T, 16)
    ctx = f32(*batch, S, kwargs["in_kv_features"]) if "in_kv_features" in kwargs else None
    if mask_kind == "padding":  # [batch, 1, 1, S]: the last keys of the second and third examples padded
        lengths = np.array([S, S - 2, 1])
        return x, ctx, (np.arange(S)[None, :] < lengths[:, None])[:, None, None, :]
    if mask_kind == "causal":
        return x, ctx, nnx.make_causal_mask(np.zeros((*batch, T)))  # float [batch..., 1, T, T], Flax's helper
    mask = rng.random((4, T, S)) < 0.7  # [N, T, S], the same for every example, one pattern per head
    mask[..., 0] = True  # no fully masked row (where Flax and jaxattn differ on purpose)
    return x, ctx, mask


@pytest.mark.parametrize(
    "case", [c if c == "batch_gqa_cross_padding" else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)  # one case in make test (about 2 s on 2 cores), all in make test-slow
def test_parity_with_flax_outputs_and_sown_weights(case):
    kwargs, batch, T, S, mask_kind = CASES[case]
    ours, flax = pair(4, 16, **kwargs)
    x, ctx, mask = case_inputs(kwargs, batch, T, S, mask_kind)
    out, w = forward(ours, x, ctx, mask=mask)
    out_flax, w_flax = forward(flax, x, ctx, mask=mask)
    assert out.shape == (*batch, T, kwargs.get("out_features", 16)) and w.shape == (*batch, 4, T, S)
    close(out, out_flax)
    close(w, w_flax)
    # the sown maps are jaxattn's own: multi_head_attention of the module's projections, example by example
    c = x if ctx is None else ctx
    q, k, v = ours.query(x), ours.key(c), ours.value(c)
    if ours.normalize_qk:
        q, k = ours.query_ln(q), ours.key_ln(k)
    m = np.broadcast_to(np.asarray(mask) != 0, (*batch, 4, T, S))
    maps = jax.jit(jax.vmap(lambda q, k, v, m: jaxattn.multi_head_attention(q, k, v, mask=m)[1]))
    flat = lambda a: a.reshape((-1,) + a.shape[len(batch):])
    close(flat(w), maps(flat(q), flat(k), flat(v), flat(m)))


@pytest.mark.slow  # uncompiled calls, op by op: about 5 s on 2 cores
def test_inputs_k_and_inputs_v_as_flaxs_and_no_batch_dims():
    ours, flax = pair(2, 8)
    q, k, v = f32(3, 8), f32(4, 8), f32(4, 8)
    close(ours(q, k, v), flax(q, k, v))  # uncompiled, no batch dims: Flax's jax.nn.dot_product_attention path
    np.testing.assert_array_equal(ours(q, k), ours(q, k, k))
    np.testing.assert_array_equal(ours(q), ours(q, q, q))


@pytest.mark.slow  # the whole sequence, about 3 s on 2 cores; test_decode_first_steps_match_flax runs by default
def test_decode_one_token_at_a_time_equals_the_causal_output_and_flaxs():
    B, L, D = 2, 5, 8
    ours, flax = pair(2, D, num_kv_heads=1)
    x = f32(B, L, D)
    full, _ = forward(ours, x, is_causal=True)
    close(full, forward(flax, x, mask=nnx.make_causal_mask(np.zeros((B, L))))[0])
    for m in (ours, flax):
        m.init_cache((B, L, D))
    for t in range(L):
        step, w = forward(ours, x[:, t : t + 1], decode=True)  # [B, 1, D], [B, N, 1, L]
        close(step, full[:, t : t + 1])
        close(step, forward(flax, x[:, t : t + 1], decode=True)[0])
        assert np.all(np.asarray(w)[..., t + 1 :] == 0.0)  # keys not yet cached are masked
    assert int(ours.cache_index[...]) == L
    np.testing.assert_array_equal(ours.cached_key[...], flax.cached_key[...])


def test_decode_first_steps_match_flax():
    B, L, D = 2, 4, 8
    ours, flax = pair(2, D)
    x = f32(B, L, D)
    for m in (ours, flax):
        m.init_cache((B, L, D))
    for t in range(2):
        step, w = forward(ours, x[:, t : t + 1], decode=True)
        step_flax, w_flax = forward(flax, x[:, t : t + 1], decode=True)
        close(step, step_flax)
        close(w, w_flax)
    assert int(ours.cache_index[...]) == 2


def test_dropout_deterministic_or_not():
    ours, flax = pair(2, 8, dropout_rate=0.5)
    plain, _ = pair(2, 8)
    x = f32(2, 6, 8)
    close(forward(ours, x, deterministic=True)[0], forward(plain, x)[0])
    dropped, w = forward(ours, x, deterministic=False)
    assert dropped.shape == (2, 6, 8) and not np.allclose(dropped, forward(plain, x)[0], atol=1e-3)
    close(dropped, forward(flax, x, deterministic=False)[0])  # the same rng stream: Flax drops the same weights
    np.testing.assert_allclose(np.sum(w, axis=-1), 1.0, rtol=1e-6)  # sown before dropout, as Flax does
    assert not np.allclose(forward(ours, x, deterministic=False)[0], dropped)  # the stream moves on each call
    with pytest.raises(ValueError, match="No `deterministic` argument"):  # Flax's rule: say which
        ours(x)


@pytest.mark.slow  # a compiled backward pass, about 1 s on 2 cores
def test_module_differentiates_under_nnx_jit():
    ours, _ = pair(2, 8)
    x = f32(2, 4, 8)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x, is_causal=True) ** 2)))(ours)
    g = grads["query"]["kernel"][...]
    assert g.shape == (8, 2, 4) and np.all(np.isfinite(g)) and np.any(g != 0)


# ----------------------------------------------------------------------------------------------------
# dot_product_attention as Flax's attention_fn.
# ----------------------------------------------------------------------------------------------------


def test_attention_fn_in_flaxs_own_module_matches_flaxs_default():
    kwargs = dict(num_kv_heads=2, decode=False)
    ours = nnx.MultiHeadAttention(4, 16, attention_fn=dot_product_attention, rngs=nnx.Rngs(0), **kwargs)
    flax = nnx.MultiHeadAttention(4, 16, rngs=nnx.Rngs(0), **kwargs)
    x, mask = f32(3, 5, 16), nnx.make_causal_mask(np.zeros((3, 5)))
    out, w = forward(ours, x, mask=mask)
    out_flax, w_flax = forward(flax, x, mask=mask)
    close(out, out_flax)
    close(w, w_flax)


def captured(fn, *args, **kwargs):
    """``fn(*args, module=m, **kwargs)``, compiled, and the map it sows into a fresh module ``m``."""
    call = nnx.jit(nnx.capture(lambda m, args: fn(*args, module=m, **kwargs), nnx.Intermediate))
    out, intermediates = call(nnx.Module(), args)
    return out, intermediates["attention_weights"][0]


@pytest.mark.slow  # about 2 s on 2 cores
def test_attention_fn_with_bias_and_scale():
    q, k, v = f32(2, 4, 2, 8), f32(2, 6, 1, 8), f32(2, 6, 1, 8)
    bias = f32(2, 1, 4, 6)
    out, w = captured(dot_product_attention, q, k, v, bias=bias)
    out_flax, w_flax = captured(nnx.dot_product_attention, q, k, v, bias=bias)
    close(out, out_flax)
    close(w, w_flax)
    no_module = jax.jit(lambda f, *a: f(*a), static_argnums=0)  # Flax's other path: jax.nn.dot_product_attention
    close(no_module(dot_product_attention, q, k, v, bias), no_module(nnx.dot_product_attention, q, k, v, bias))
    _, w = captured(functools.partial(dot_product_attention, scale=1.0), q, k, v)  # unscaled, as an attention_fn
    close(w, jax.jit(jax.vmap(lambda q, k, v: jaxattn.multi_head_attention(q, k, v, scale=1.0)[1]))(q, k, v))


def test_fully_masked_row_gives_zeros():
    q, k, v = f32(3, 1, 4), f32(4, 1, 4), f32(4, 1, 4)
    mask = np.ones((1, 3, 4), bool)
    mask[:, 1] = False  # query 1 sees no key
    out = np.asarray(jax.jit(dot_product_attention)(q, k, v, mask=mask))
    np.testing.assert_array_equal(out[1], 0.0)  # Flax gives the mean of v there
    close(out[[0, 2]], np.asarray(jax.jit(nnx.dot_product_attention)(q, k, v, mask=mask))[[0, 2]])


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda q: dot_product_attention(q[0, 0], q[0, 0], q[0, 0]), ValueError,
         "query must have shape [batch..., T, N, H] (3 or more dimensions), received (2, 2)"),
        (lambda q: dot_product_attention(q, q[:1], q[:1]), ValueError,
         "key must have shape [batch..., S, K, H] with the batch dims of query (2, 4, 2, 2)"),
        (lambda q: dot_product_attention(q, q, q[:, :3]), ValueError, "key and value must have the same length S"),
        (lambda q: dot_product_attention(q, q, q, mask=np.ones((3, 4, 4), bool)), ValueError,
         "mask must be broadcastable to [batch..., N, T, S] = (2, 2, 4, 4), received shape (3, 4, 4)"),
        (lambda q: dot_product_attention(q, q, q, bias=np.ones((2, 1, 4, 5), np.float32)), ValueError,
         "bias must be broadcastable to [batch..., N, T, S]"),
        (lambda q: dot_product_attention(q, q, q, dropout_rate=0.1), ValueError, "dropout_rng is required"),
        (lambda q: dot_product_attention(q, q, q, dropout_rate=1.0, dropout_rng=jax.random.key(0)), ValueError,
         "dropout_rate must be in [0, 1), received 1.0"),
        (lambda q: dot_product_attention(q, q, q, precision=3), TypeError, "precision must be None"),
        (lambda q: dot_product_attention(q, q, q, is_causal="yes"), TypeError, "is_causal"),
    ],
    ids=["query_rank", "key_batch", "value_length", "mask_shape", "bias_shape", "dropout_rng", "dropout_rate",
         "precision", "is_causal"],
)
def test_attention_fn_bad_input_raises_by_name(call, error, message):
    with pytest.raises(error) as info:
        call(f32(2, 4, 2, 2))
    assert message in str(info.value)


def test_precision_reaches_the_core():
    q = f32(3, 1, 4)
    jaxpr = str(jax.make_jaxpr(lambda q: dot_product_attention(q, q, q, precision=jax.lax.Precision.HIGHEST))(q))
    assert "Precision.HIGHEST" in jaxpr
    assert "Precision.HIGHEST" not in str(jax.make_jaxpr(lambda q: dot_product_attention(q, q, q))(q))
