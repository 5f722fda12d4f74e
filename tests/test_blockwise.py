"""blockwise_attention: equal to the dense core on outputs and gradients, O(T + S) memory, causal skipping."""

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxattn
from jaxattn._blockwise import _k_range, _plan, _q_range

# Tolerances, defined once per dtype: |blockwise - dense| <= atol + rtol * |dense|.
TOL = {
    np.float32: dict(atol=1e-5, rtol=1e-5),
    np.float64: dict(atol=1e-12, rtol=1e-12),
    jnp.bfloat16: dict(atol=2e-2, rtol=2e-2),
    np.float16: dict(atol=2e-3, rtol=2e-3),
}


def _close(actual, expected, dtype=np.float32):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64), **TOL[dtype])


def _qkv(seed, T, S, H=8, V=5, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, H)).astype(dtype)
    k = rng.standard_normal((S, H)).astype(dtype)
    v = rng.standard_normal((S, V)).astype(dtype)
    return q, k, v


def _mask(kind, T, S, seed=1):
    rng = np.random.default_rng(seed)
    if kind is None:
        return None
    if kind == "padding":  # [S]: the last 3 keys are padding
        return np.arange(S) < S - 3
    if kind == "random":  # [T, S], with row 1 fully masked
        m = rng.random((T, S)) < 0.7
        m[1] = False
        return m
    raise AssertionError(kind)


# (T, S, block_q, block_k, is_causal, mask): blocks dividing the lengths, not dividing them, larger than
# them, T != S both ways; each shape causal and not, unmasked, padded and randomly masked.
# make test runs four (T < S and T > S, causal and not, padded and random); make test-slow all eight.
CASES = [
    pytest.param(16, 16, 4, 8, False, None, marks=pytest.mark.slow),
    (16, 16, 4, 8, True, "random"),
    pytest.param(13, 13, 4, 5, True, None, marks=pytest.mark.slow),
    (13, 13, 4, 5, False, "padding"),
    (7, 19, 3, 4, True, "padding"),
    pytest.param(7, 19, 3, 4, False, "random", marks=pytest.mark.slow),
    (19, 6, 8, 4, True, "random"),
    pytest.param(5, 5, 64, 64, True, "padding", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("T,S,bq,bk,is_causal,mask_kind", CASES)
def test_equals_dense_attention_outputs_and_gradients(T, S, bq, bk, is_causal, mask_kind):
    q, k, v = _qkv(0, T, S)
    mask = _mask(mask_kind, T, S)

    d_out = np.random.default_rng(2).standard_normal((T, v.shape[1])).astype(np.float32)

    @jax.jit
    def outputs_and_gradients(q, k, v):
        def blockwise(q, k, v):
            return jaxattn.blockwise_attention(q, k, v, mask=mask, is_causal=is_causal, block_q=bq, block_k=bk)[0]

        def dense(q, k, v):
            return jaxattn.attention(q, k, v, mask=mask, is_causal=is_causal)[0]

        out, vjp = jax.vjp(blockwise, q, k, v)
        out_ref, vjp_ref = jax.vjp(dense, q, k, v)
        return (out, *vjp(d_out)), (out_ref, *vjp_ref(d_out))

    results, expected = outputs_and_gradients(q, k, v)
    for name, x, x_ref in zip(["out", "dq", "dk", "dv"], results, expected):
        assert x.shape == x_ref.shape, name
        _close(x, x_ref)


def test_lse_is_the_row_logsumexp_and_recovers_the_weights():
    T, S, is_causal = 11, 14, True
    q, k, v = _qkv(3, T, S)
    mask = _mask("random", T, S)
    blockwise = jax.jit(lambda q, k, v: jaxattn.blockwise_attention(q, k, v, mask=mask, is_causal=is_causal, block_q=4, block_k=4))
    out, lse = blockwise(q, k, v)
    keep = np.asarray(jaxattn.combine_masks(mask, jaxattn.causal_mask(T, S) if is_causal else None))
    logits = np.asarray(jaxattn.attention_logits(q, k), np.float64)
    with np.errstate(divide="ignore"):
        expected = np.log(np.where(keep, np.exp(logits), 0.0).sum(axis=1))
    assert np.isneginf(lse[1]) and np.isneginf(expected[1])  # row 1 has no kept key: log 0
    _close(np.where(np.isneginf(lse), 0, lse), np.where(np.isneginf(expected), 0, expected))
    weights = jaxattn.attention_weights(q, k, mask=mask, is_causal=is_causal)
    recover = jax.jit(lambda q, k, lse, rows: jaxattn.weights_from_lse(q, k, lse, rows=rows, mask=mask, is_causal=is_causal))
    _close(recover(q, k, lse, None), weights)
    rows = np.array([0, 5, 10])
    _close(recover(q, k, lse, rows), weights[rows])


@pytest.mark.parametrize("bias_shape", [(11, 14), (14,), (11, 1)])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_weights_from_lse_recovers_the_rows_of_a_biased_capped_map(bias_shape, cap):
    T, S = 11, 14
    q, k, v = _qkv(5, T, S)
    bias = np.random.default_rng(6).standard_normal(bias_shape).astype(np.float32)
    out, lse = jaxattn.blockwise_attention(q, k, v, bias=bias, is_causal=True, logit_cap=cap, block_q=4, block_k=4)
    weights = np.asarray(jaxattn.attention_weights(q, k, bias=bias, is_causal=True, logit_cap=cap))
    rows = np.array([0, 5, 10])
    got = jaxattn.weights_from_lse(q, k, lse, rows=rows, bias=bias, is_causal=True, logit_cap=cap)
    _close(got, weights[rows])
    np.testing.assert_allclose(np.sum(got, axis=1), 1.0, atol=1e-5)
    # without the bias the same lse gives rows that are not the map's: they do not sum to 1
    assert np.max(np.abs(np.sum(jaxattn.weights_from_lse(q, k, lse, rows=rows, is_causal=True, logit_cap=cap), axis=1) - 1)) > 1e-2


def test_gradient_through_lse_and_scale_matches_dense():
    T, S = 9, 10
    q, k, v = _qkv(4, T, S)
    mask = _mask("padding", T, S)

    def loss_blockwise(q, k, v, scale):
        out, lse = jaxattn.blockwise_attention(q, k, v, mask=mask, is_causal=True, scale=scale, block_q=4, block_k=3)
        return jnp.sum(out**2) + jnp.sum(jnp.sin(lse))

    def loss_dense(q, k, v, scale):
        out, _ = jaxattn.attention(q, k, v, mask=mask, is_causal=True, scale=scale)
        logits = jaxattn.attention_logits(q, k, scale=scale)
        keep = jnp.logical_and(jaxattn.causal_mask(T, S), mask[None, :])
        lse = jax.nn.logsumexp(jnp.where(keep, logits, -jnp.inf), axis=1)
        return jnp.sum(out**2) + jnp.sum(jnp.sin(lse))

    scale = jnp.float32(0.4)
    grads = jax.jit(jax.grad(loss_blockwise, argnums=(0, 1, 2, 3)))(q, k, v, scale)
    grads_ref = jax.jit(jax.grad(loss_dense, argnums=(0, 1, 2, 3)))(q, k, v, scale)
    for g, g_ref in zip(grads, grads_ref):
        _close(g, g_ref)


@pytest.mark.parametrize("is_causal,mask_kind", [pytest.param(False, None, marks=pytest.mark.slow), (True, "padding")])
def test_check_grads_float64(x64, is_causal, mask_kind):
    q, k, v = _qkv(5, 7, 9, H=4, V=3, dtype=np.float64)
    mask = _mask(mask_kind, 7, 9)

    @jax.jit
    def f(q, k, v):
        out, lse = jaxattn.blockwise_attention(q, k, v, mask=mask, is_causal=is_causal, block_q=3, block_k=4)
        assert out.dtype == jnp.float64 and lse.dtype == jnp.float64
        return out, lse

    check_grads(f, (q, k, v), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)
    out, _ = f(q, k, v)
    _close(out, jaxattn.attention(q, k, v, mask=mask, is_causal=is_causal)[0], np.float64)


@pytest.mark.parametrize("is_causal,mask_kind", [pytest.param(False, None, marks=pytest.mark.slow), (True, "per_head")])
def test_grouped_query_heads_match_multi_head_attention(mask_kind, is_causal):
    T, S, N, K, H = 10, 12, 6, 2, 4
    rng = np.random.default_rng(6)
    q = rng.standard_normal((T, N, H)).astype(np.float32)
    k = rng.standard_normal((S, K, H)).astype(np.float32)
    v = rng.standard_normal((S, K, 3)).astype(np.float32)
    mask = None if mask_kind is None else rng.random((N, T, S)) < 0.8

    def blockwise(q, k, v):
        return jaxattn.multi_head_blockwise_attention(q, k, v, mask=mask, is_causal=is_causal, block_q=4, block_k=5)

    d_out = rng.standard_normal((T, N, 3)).astype(np.float32)

    @jax.jit
    def outputs_and_gradients(q, k, v):
        (out, lse), vjp = jax.vjp(blockwise, q, k, v)
        out_ref, vjp_ref = jax.vjp(
            lambda q, k, v: jaxattn.multi_head_attention(q, k, v, mask=mask, is_causal=is_causal)[0], q, k, v
        )
        return lse, (out, *vjp((d_out, jnp.zeros_like(lse)))), (out_ref, *vjp_ref(d_out))

    lse, results, expected = outputs_and_gradients(q, k, v)
    assert results[0].shape == (T, N, 3)
    for x, x_ref in zip(results, expected):
        _close(x, x_ref)
    # the head convention: query head n reads key/value head n // G
    assert lse.shape == (N, T)
    n = 5
    m1 = None if mask is None else mask[n]
    _, lse1 = jaxattn.blockwise_attention(q[:, n], k[:, n // 3], v[:, n // 3], mask=m1, is_causal=is_causal)
    _close(lse[n], lse1)


def test_heads_go_side_by_side_on_a_gpu_or_tpu_and_give_what_one_after_another_gives(monkeypatch):
    """On one CPU device the heads run one after another (a lax.map); on a GPU or TPU side by side (a vmap:
    one loop's launches instead of one loop per head). Both orders give the same outputs and gradients."""
    from jaxattn import _blockwise

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((20, 4, 8)), jnp.float32)  # 4 query heads over 2 key/value heads
    k, v = (jnp.asarray(rng.standard_normal((20, 2, 8)), jnp.float32) for _ in range(2))
    on_one_cpu = jax.default_backend() == "cpu" and jax.device_count() == 1
    assert _blockwise._heads_side_by_side(q, k) != on_one_cpu
    for backend in ("gpu", "tpu"):
        monkeypatch.setattr(jax, "default_backend", lambda: backend)
        assert _blockwise._heads_side_by_side(q, k), backend
    monkeypatch.undo()
    scale = jnp.asarray(8 ** -0.5, jnp.float32)

    def run(side_by_side):
        f = lambda q, k, v: _blockwise._multi_head_flash(q, k, v, None, scale, True, 8, 8, side_by_side)[0]
        return f(q, k, v), jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(q, k, v)

    (out_a, grads_a), (out_b, grads_b) = run(False), run(True)
    np.testing.assert_allclose(out_b, out_a, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads_a, grads_b):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(np.float16, marks=pytest.mark.slow)])
def test_half_precision_inputs_accumulate_in_float32(dtype):
    q, k, v = _qkv(7, 33, 40, H=16, V=8)
    half = [jnp.asarray(x, dtype) for x in (q, k, v)]
    out, lse = jax.jit(lambda *a: jaxattn.blockwise_attention(*a, is_causal=True, block_q=8, block_k=16))(*half)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    ref, _ = jaxattn.attention(*[np.asarray(x, np.float32) for x in half], is_causal=True)
    _close(out, ref, dtype)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(jaxattn.blockwise_attention(*a, block_q=8, block_k=16)[0].astype(jnp.float32)), (0, 1, 2)))(*half)
    assert all(g.dtype == dtype and bool(jnp.all(jnp.isfinite(g))) for g in grads)


def test_causal_tiles_above_the_diagonal_are_never_read():
    """A NaN in the values of key block 1 reaches query block 0 only if that tile is visited.

    A masked tile would still multiply its zero weights by the NaN values (0 · NaN = NaN); a skipped
    tile does not exist. So rows 0..3 stay finite, in the output and in the gradient of q.
    """
    q, k, v = _qkv(8, 8, 8)
    v[4:] = np.nan

    def f(q):
        return jaxattn.blockwise_attention(q, k, v, is_causal=True, block_q=4, block_k=4)[0]

    out = np.asarray(jax.jit(f)(q))
    assert np.isfinite(out[:4]).all() and np.isnan(out[4:]).all()
    dq = np.asarray(jax.jit(jax.grad(lambda q: jnp.sum(f(q)[:4])))(q))
    assert np.isfinite(dq[:4]).all()
    _close(out[:4], jaxattn.attention(q[:4], k[:4], v[:4], is_causal=True)[0])


@pytest.mark.parametrize("T,S,bq,bk", [(8, 8, 2, 2), (13, 13, 4, 5), (7, 19, 3, 4), (19, 6, 8, 4)])
def test_causal_plan_visits_exactly_the_tiles_that_touch_the_lower_triangle(T, S, bq, bk):
    plan = _plan(T, S, bq, bk, causal=True, has_mask=False)
    keep = np.array(jaxattn.causal_mask(plan.nq * bq, plan.nk * bk))
    keep[:, S:] = False
    forward, backward = set(), set()
    for i in range(plan.nq):
        lo, f_lo, n_full, n_hi = (int(x) for x in _k_range(plan, i))
        assert lo == f_lo == 0  # without a window every query block starts at key block 0, mask-free
        for j in range(plan.nk):
            tile = keep[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            assert (j < n_hi) == tile.any(), (i, j)  # visited iff some key of the tile is kept
            assert (j < n_full) == tile.all(), (i, j)  # mask-free iff every key of the tile is kept
            if j < n_hi:
                forward.add((i, j, j < n_full))
    for j in range(plan.nk):
        i_lo, i_full, f_hi, i_hi = (int(x) for x in _q_range(plan, j))
        assert f_hi == i_hi == plan.nq  # without a window every key block runs to the last query block
        for i in range(i_lo, plan.nq):
            backward.add((i, j, i >= i_full))
    assert forward == backward


def _max_intermediate_size(jaxpr):
    """The largest array any equation of ``jaxpr`` (or of its sub-jaxprs) produces."""
    biggest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            biggest = max(biggest, int(np.prod(getattr(var.aval, "shape", ()))))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            biggest = max(biggest, _max_intermediate_size(sub))
    return biggest


@pytest.mark.parametrize("heads", [None, 2])
def test_gradient_never_builds_a_T_by_S_buffer(heads):
    """Single head, and heads under the map (a scan, whose partial evaluation must not hoist tiles out)."""
    T = S = 64
    q, k, v = _qkv(9, T, S)

    def loss(q, k, v):
        if heads is None:
            return jnp.sum(jaxattn.blockwise_attention(q, k, v, is_causal=True, block_q=16, block_k=16)[0])
        q, k, v = (jnp.stack([x] * heads, axis=1) for x in (q, k, v))  # [T, N, H], [S, N, H], [S, N, V]
        return jnp.sum(jaxattn.multi_head_blockwise_attention(q, k, v, is_causal=True, block_q=16, block_k=16)[0])

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    assert _max_intermediate_size(jaxpr) <= 16 * 16 * 4  # tiles and O(T) vectors only; T*S = 4096
    dense = jax.make_jaxpr(jax.grad(lambda q, k, v: jnp.sum(jaxattn.attention(q, k, v)[0]), (0, 1, 2)))(q, k, v)
    assert _max_intermediate_size(dense.jaxpr) >= T * S  # the check can fail: the dense path does build it


@pytest.mark.parametrize("bias_shape", [(6, 5), (5,), (6, 1)])
def test_a_bias_gradient_with_key_blocks_of_one_key(bias_shape):
    """block_k = 1: the bias's key axis is told by its shape, not by the key block's size (the gradient has
    the bias's shape and equals the dense core's)."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.normal(size=(n, 4)).astype(np.float32) for n in (6, 5, 5))
    bias = rng.normal(size=bias_shape).astype(np.float32)
    loss = lambda fn: (lambda b: jnp.sum(fn(q, k, v, bias=b, is_causal=True)[0] ** 2))
    got = jax.grad(loss(functools.partial(jaxattn.blockwise_attention, block_q=2, block_k=1)))(bias)
    want = jax.grad(loss(jaxattn.attention))(bias)
    assert got.shape == bias.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_empty_lengths():
    q, k, v = _qkv(10, 3, 0)
    out, lse = jaxattn.blockwise_attention(q, k, v)
    assert out.shape == (3, 5) and not np.asarray(out).any() and np.isneginf(lse).all()
    q, k, v = _qkv(10, 0, 4)
    out, lse = jaxattn.blockwise_attention(q, k, v)
    assert out.shape == (0, 5) and lse.shape == (0,)


def test_jit_and_batch_vmap_compose():
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((2, 9, 3, 4)).astype(np.float32) for _ in range(3))
    f = jax.jit(jax.vmap(lambda q, k, v: jaxattn.multi_head_blockwise_attention(q, k, v, is_causal=True, block_q=4, block_k=4)[0]))
    g = jax.vmap(lambda q, k, v: jaxattn.multi_head_attention(q, k, v, is_causal=True)[0])
    _close(f(q, k, v), g(q, k, v))


BAD_INPUTS = [
    (dict(q=np.zeros((4, 8, 1), np.float32)), ValueError, r"q must have 2 dimensions \[T, H\]"),
    (dict(k=np.zeros((6, 7), np.float32)), ValueError, r"same head dimension H"),
    (dict(v=np.zeros((5, 3), np.float32)), ValueError, r"same length S"),
    (dict(q=np.zeros((4, 8), np.int32)), TypeError, r"q must have a floating dtype"),
    (dict(mask=np.ones((4, 6), np.int32)), TypeError, r"mask must be a boolean keep-mask"),
    (dict(mask=np.ones((5, 6), bool)), ValueError, r"mask must be broadcastable to \[T, S\] = \(4, 6\)"),
    (dict(scale=-1.0), ValueError, r"scale must be finite and > 0"),
    (dict(block_q=0), ValueError, r"block_q must be a positive int"),
    (dict(block_k=2.5), ValueError, r"block_k must be a positive int"),
]


@pytest.mark.parametrize("override,error,message", BAD_INPUTS)
def test_bad_inputs_raise_errors_naming_the_argument(override, error, message):
    args = dict(q=np.zeros((4, 8), np.float32), k=np.zeros((6, 8), np.float32), v=np.zeros((6, 3), np.float32))
    args.update(override)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(error, match=message):
        jaxattn.blockwise_attention(q, k, v, **args)


def test_weights_from_lse_rejects_a_mismatched_lse():
    q, k, _ = _qkv(12, 4, 6)
    with pytest.raises(ValueError, match=r"lse must have shape \[T\] = \(4,\)"):
        jaxattn.weights_from_lse(q, k, np.zeros(5, np.float32))


# ---------------------------------------------------------------------------------------------- bf16/fp16 scale
# The scale multiplies the float32 product q·k (as the dense core does), never q in its bf16/fp16 dtype:
# scale 1e-8 must not round to 0 (uniform weights), scale·q must not overflow fp16 (NaN), and at ordinary
# scales the error against float64 must stay that of dense attention.


def _half_errors(dtype, q, k, v, d_out, scale, bq=16, bk=16):
    """Max abs errors of (out, dq, dk, dv) against the float64 oracle, for dense and blockwise."""
    from tests._oracle import reference_forward, reference_vjp

    f64 = lambda x: np.asarray(x, np.float64)
    ref = [reference_forward(f64(q), f64(k), f64(v), scale=scale)[0], *reference_vjp(f64(q), f64(k), f64(v), f64(d_out), scale=scale)]
    errors = {}
    for name, fn in (
        ("dense", lambda q, k, v: jaxattn.attention(q, k, v, scale=scale)[0]),
        ("blockwise", lambda q, k, v: jaxattn.blockwise_attention(q, k, v, scale=scale, block_q=bq, block_k=bk)[0]),
    ):
        out = fn(q, k, v)
        assert out.dtype == dtype
        grads = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * jnp.asarray(d_out, jnp.float32)), (0, 1, 2))(q, k, v)
        errors[name] = np.array([np.max(np.abs(f64(a) - b)) for a, b in zip((out, *grads), ref)])
        assert np.all(np.isfinite(errors[name])), (name, errors[name])
    return errors


# (scale, |q|, |k|): logits scale·q·k of order 1; fp16's scale 1e-8 rounds to 0, and scale·q = 8e4 > 65504
HALF_SCALES = [pytest.param(1e-8, 1e4, 1e4, marks=pytest.mark.slow), pytest.param(1000.0, 80.0, 1e-5, marks=pytest.mark.slow),
               pytest.param(0.0123, 30.0, 1.0, marks=pytest.mark.slow)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(np.float16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("scale,q_size,k_size", HALF_SCALES)
def test_half_precision_extreme_scales_match_dense_and_float64(dtype, scale, q_size, k_size):
    rng = np.random.default_rng(21)
    T, S, H, V = 24, 40, 16, 4
    q = jnp.asarray(rng.standard_normal((T, H)) * q_size, dtype)
    k = jnp.asarray(rng.standard_normal((S, H)) * k_size, dtype)
    v = jnp.asarray(rng.standard_normal((S, V)), dtype)
    d_out = 0.05 * rng.standard_normal((T, V)).astype(np.float32)  # keeps dk = scale·dsᵀq below fp16's 65504
    err = _half_errors(dtype, q, k, v, d_out, scale)
    # the weights are far from uniform (so a scale rounded to 0 would show) and both agree with float64
    w = jaxattn.attention_weights(q, k, scale=scale)
    assert float(jnp.max(w.astype(jnp.float32))) > 3.0 / S
    assert np.all(err["blockwise"] <= 1.5 * err["dense"] + 1e-6), err


def test_half_precision_tiny_and_huge_scales_in_float16():
    # the tiled kernel itself (on a GPU, implementation=None would give these float16 calls to Pallas)
    block_attention = functools.partial(jaxattn.blockwise_attention, implementation="blockwise")
    q = jnp.asarray(np.random.default_rng(0).standard_normal((4, 16)) * 1e4, jnp.float16)
    v = jnp.asarray(np.eye(4, 2), jnp.float16)
    dense = jaxattn.attention(q, q, v, scale=1e-8)[0]
    block = block_attention(q, q, v, scale=1e-8)[0]
    np.testing.assert_array_equal(block, dense)
    assert float(block[0, 0]) > 0.99  # not the uniform 0.25 of a scale rounded to 0
    q2, k2 = jnp.full((2, 4), 300.0, jnp.float16), jnp.ones((3, 4), jnp.float16)
    out = block_attention(q2, k2, k2[:, :2], scale=1000.0)[0]  # scale·q = 3e5 overflows fp16
    np.testing.assert_array_equal(out, np.ones((2, 2)))
    grads = jax.grad(lambda q, k: block_attention(q, k, k[:, :2], scale=1000.0)[0].astype(jnp.float32).sum(), (0, 1))(q2, k2)
    assert all(np.all(np.isfinite(np.asarray(g, np.float32))) for g in grads)


@pytest.mark.slow  # a statistical comparison of errors over many draws: `make test-slow`
@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16])
def test_half_precision_error_at_head_dim_48_is_dense_error(dtype):
    """The default scale 1/sqrt(48) is not a bf16/fp16 number: rounding it (and scale·q) cost blockwise 2-7x dense's error."""
    ratios = []
    for seed in range(4):
        rng = np.random.default_rng(seed)
        q, k, v = (jnp.asarray(rng.standard_normal(s), dtype) for s in ((40, 48), (56, 48), (56, 8)))
        d_out = rng.standard_normal((40, 8)).astype(np.float32)
        err = _half_errors(dtype, q, k, v, d_out, None)
        ratios.append(err["blockwise"] / err["dense"])
    assert np.all(np.mean(ratios, axis=0) <= 1.5), np.mean(ratios, axis=0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16])
@pytest.mark.parametrize("scale,q_size,k_size", HALF_SCALES)
def test_half_precision_gradient_with_respect_to_a_traced_scale(dtype, scale, q_size, k_size):
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((12, 8)) * q_size, dtype)
    k = jnp.asarray(rng.standard_normal((20, 8)) * k_size, dtype)
    v = jnp.asarray(rng.standard_normal((20, 3)), dtype)
    d_out = jnp.asarray(rng.standard_normal((12, 3)), jnp.float32)
    loss = lambda f: jax.jit(jax.grad(lambda s: jnp.sum(f(s).astype(jnp.float32) * d_out)))(jnp.float32(scale))
    dense = loss(lambda s: jaxattn.attention(q, k, v, scale=s, is_causal=True)[0])
    block = loss(lambda s: jaxattn.blockwise_attention(q, k, v, scale=s, is_causal=True, block_q=4, block_k=8)[0])
    assert np.isfinite(float(block)) and float(dense) != 0.0
    np.testing.assert_allclose(float(block), float(dense), rtol=2e-2 if dtype == jnp.bfloat16 else 3e-3)


# ---------------------------------------------------------------------------------------------- non-finite inputs
# As for the dense core (see test_attention.py): a masked position must not influence any output or
# gradient, whatever its value; a kept one still shows. Blockwise skips whole masked tiles, but a partly
# masked tile (and any tile under a padding mask) multiplies masked weights 0 by the values.


def _nonfinite_case(T, S, mask_kind, is_causal):
    if mask_kind is None:
        mask = None
    elif mask_kind == "padding":
        mask = np.arange(S) < S - 2  # [S]
    else:
        mask = np.random.default_rng(5).random((T, S)) < 0.6  # [T, S], row 1 keeps nothing
        mask[1] = False
    keep = np.ones((T, S), bool) if mask is None else np.broadcast_to(mask, (T, S)).copy()
    if is_causal:
        keep &= np.arange(S)[None, :] <= np.arange(T)[:, None]
    return mask, keep


# (T, S, block_q, block_k, is_causal, mask kind, field, poisoned entries)
BLOCK_NONFINITE_CASES = [
    (7, 7, 7, 1, True, None, "v", (6, 1)),  # block_k = 1: the key's own tile is the diagonal tile
    (7, 7, 2, 3, True, None, "v", (5, np.s_[:])),  # a partial tile (3 does not divide 7), partly masked
    (9, 5, 4, 2, True, None, "v", (3, 0)),  # T > S: rows past S keep every key
    (5, 9, 2, 4, False, "padding", "v", (np.s_[7:], 2)),  # padded keys, in a partial last tile
    (8, 8, 3, 3, True, "padding", "v", (np.s_[6:], np.s_[:])),
    (8, 8, 4, 4, False, "general", "v", (2, 1)),
    (8, 8, 4, 4, True, "general", "v", (np.s_[:], 0)),
    (7, 7, 7, 1, True, None, "k", (6, 2)),
    (7, 7, 2, 3, True, None, "k", (4, np.s_[:])),
    (5, 9, 2, 4, True, "padding", "k", (np.s_[7:], 1)),
    (8, 8, 4, 4, False, "general", "k", (3, 0)),
    (8, 8, 4, 4, False, "general", "q", (1, 2)),  # a query row with no kept key
]


# NaN in `make test`; ±Inf (each case compiles its own programs) in `make test-slow`.
@pytest.mark.parametrize("value", [np.nan, pytest.param(np.inf, marks=pytest.mark.slow), pytest.param(-np.inf, marks=pytest.mark.slow)])
@pytest.mark.parametrize("T,S,bq,bk,is_causal,mask_kind,field,where", [
    c if i == 11 else pytest.param(*c, marks=pytest.mark.slow) for i, c in enumerate(BLOCK_NONFINITE_CASES)
])  # `make test`: q under a general mask (a query row with no kept key); `make test-slow`: every case
def test_masked_non_finite_inputs_do_not_leak_blockwise(T, S, bq, bk, is_causal, mask_kind, field, where, value):
    mask, keep = _nonfinite_case(T, S, mask_kind, is_causal)
    rng = np.random.default_rng(11)
    clean = {"q": rng.standard_normal((T, 4)), "k": rng.standard_normal((S, 4)), "v": rng.standard_normal((S, 3))}
    clean = {n: x.astype(np.float32) for n, x in clean.items()}
    bad, zero = ({n: x.copy() for n, x in clean.items()} for _ in range(2))
    bad[field][where], zero[field][where] = value, 0.0
    # the outputs a kept non-finite entry must make NaN
    hit = np.zeros(clean[field].shape, bool)
    hit[where] = True
    if field == "v":
        nan_out = (keep.astype(int) @ hit.astype(int)) > 0
    elif field == "k":
        nan_out = np.broadcast_to(((keep.astype(int) @ hit.any(1).astype(int)) > 0)[:, None], (T, 3))
    else:
        nan_out = np.broadcast_to((hit.any(1) & keep.any(1))[:, None], (T, 3))
    nan_row = nan_out.all(1) if field != "v" else np.zeros(T, bool)

    blockwise = lambda q, k, v: jaxattn.blockwise_attention(q, k, v, mask=mask, is_causal=is_causal, block_q=bq, block_k=bk)
    out_bad, lse_bad = (np.asarray(x) for x in blockwise(bad["q"], bad["k"], bad["v"]))
    out_zero, lse_zero = (np.asarray(x) for x in blockwise(zero["q"], zero["k"], zero["v"]))
    np.testing.assert_array_equal(np.isnan(out_bad), nan_out)
    np.testing.assert_allclose(out_bad[~nan_out], out_zero[~nan_out], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.isnan(lse_bad), nan_row)
    np.testing.assert_allclose(lse_bad[~nan_row], lse_zero[~nan_row], rtol=1e-6, atol=1e-6)
    # the dense core gives the same outputs, NaN for NaN
    dense = np.asarray(jaxattn.attention(bad["q"], bad["k"], bad["v"], mask=mask, is_causal=is_causal)[0])
    np.testing.assert_array_equal(np.isnan(dense), nan_out)
    _close(out_bad[~nan_out], dense[~nan_out])

    ct = np.random.default_rng(3).standard_normal((T, 3)).astype(np.float32)
    loss = lambda f: (lambda q, k, v: jnp.sum(jnp.where(nan_out, 0.0, f(q, k, v)) * ct))
    g_bad = jax.grad(loss(lambda *a: blockwise(*a)[0]), (0, 1, 2))(bad["q"], bad["k"], bad["v"])
    g_zero = jax.grad(loss(lambda *a: blockwise(*a)[0]), (0, 1, 2))(zero["q"], zero["k"], zero["v"])
    g_dense = jax.grad(loss(lambda *a: jaxattn.attention(*a, mask=mask, is_causal=is_causal)[0]), (0, 1, 2))(bad["q"], bad["k"], bad["v"])
    for name, a, b, c in zip("qkv", g_bad, g_zero, g_dense):
        assert np.all(np.isfinite(a)), f"d{name} is not finite"
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=f"d{name}")
        _close(a, c)


@pytest.mark.parametrize("value", [np.nan, pytest.param(np.inf, marks=pytest.mark.slow)])
def test_multi_head_blockwise_gqa_masked_non_finite_inputs_do_not_leak(value):
    T, N, K, H, V = 9, 4, 2, 4, 3
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((T, N, H), (T, K, H), (T, K, V)))
    pad = np.arange(T) < T - 3
    k_bad, v_bad, k0, v0 = k.copy(), v.copy(), k.copy(), v.copy()
    k_bad[-3:, 1], v_bad[-2, 0], k0[-3:, 1], v0[-2, 0] = value, value, 0.0, 0.0
    f = lambda q, k, v: jaxattn.multi_head_blockwise_attention(q, k, v, mask=pad, is_causal=True, block_q=2, block_k=4)
    for a, b in zip(f(q, k_bad, v_bad), f(q, k0, v0)):
        np.testing.assert_array_equal(a, b)
    loss = lambda *a: jnp.sum(f(*a)[0] ** 2)
    for a, b in zip(jax.grad(loss, (0, 1, 2))(q, k_bad, v_bad), jax.grad(loss, (0, 1, 2))(q, k0, v0)):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_ring_attention_masked_non_finite_inputs_do_not_leak():
    """Ring attention reuses the blockwise tiles; on a one-device ring its forward and backward still run."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((1,), ("seq",))
    T, N, K, H, V = 8, 4, 2, 4, 3
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((T, N, H), (T, K, H), (T, K, V)))
    kv_mask = np.arange(T) < T - 3
    k_bad, v_bad, k0, v0 = k.copy(), v.copy(), k.copy(), v.copy()
    k_bad[-1], v_bad[-2:, 1], k0[-1], v0[-2:, 1] = np.nan, np.inf, 0.0, 0.0

    def ring(q, k, v):
        put = lambda x: jax.reshard(jnp.asarray(x), NamedSharding(mesh, PartitionSpec("seq")))
        return jaxattn.ring_attention(put(q), put(k), put(v), mesh=mesh, axis_name="seq", kv_mask=put(kv_mask),
                                      is_causal=True, block_q=3, block_k=2)

    with jax.set_mesh(mesh):
        f = jax.jit(ring)
        for a, b in zip(f(q, k_bad, v_bad), f(q, k0, v0)):
            np.testing.assert_array_equal(a, b)
        loss = jax.jit(jax.grad(lambda *a: jnp.sum(ring(*a)[0] ** 2), (0, 1, 2)))
        for a, b in zip(loss(q, k_bad, v_bad), loss(q, k0, v0)):
            assert np.all(np.isfinite(a))
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        v_kept = v.copy()
        v_kept[2, 0, 1] = np.nan  # kept by rows >= 2 (causal, not padding), query heads 0 and 1
        out = np.asarray(f(q, k, v_kept)[0])
        expect = np.zeros(out.shape, bool)
        expect[2:, :2, 1] = True
        np.testing.assert_array_equal(np.isnan(out), expect)


# ---------------------------------------------------------------------------------------------- second order
# The forward and the backward skip tiles with loops of traced trip count (while loops); their own
# derivatives come from the same loops with static trip counts (a cond per tile). jax.grad of jax.grad
# (reverse over reverse) and jax.jvp of jax.grad (forward over reverse) must equal those of dense
# attention, without a mask, causal, with a padding mask and with a general mask holding an empty row.


def _second_order_losses(T, S, V, mask, is_causal, bq, bk, seed=14):
    rng = np.random.default_rng(seed)
    w_out = rng.standard_normal((T, V))
    w_lse = rng.standard_normal(T)
    keep = np.ones((T, S), bool) if mask is None else np.broadcast_to(mask, (T, S)).copy()
    if is_causal:
        keep &= np.arange(S)[None, :] <= np.arange(T)[:, None]
    has_key = keep.any(axis=1)  # [T]

    def blockwise(q, k, v):
        out, lse = jaxattn.blockwise_attention(q, k, v, mask=mask, is_causal=is_causal, block_q=bq, block_k=bk)
        return jnp.sum(jnp.sin(out) * w_out) + jnp.sum(jnp.where(has_key, lse, 0.0) * w_lse)

    def dense(q, k, v):
        out, _ = jaxattn.attention(q, k, v, mask=mask, is_causal=is_causal)
        logits = jnp.where(keep, jaxattn.attention_logits(q, k), -jnp.inf)  # [T, S]
        lse = jax.nn.logsumexp(jnp.where(has_key[:, None], logits, 0.0), axis=1)  # [T]
        return jnp.sum(jnp.sin(out) * w_out) + jnp.sum(jnp.where(has_key, lse, 0.0) * w_lse)

    return blockwise, dense


# (T, S, block_q, block_k, is_causal, mask kind): blocks that do not divide the lengths (padded tiles).
SECOND_ORDER_CASES = [
    (7, 9, 3, 4, True, None),
    (7, 7, 3, 2, False, None),
    (9, 9, 4, 4, True, "padding"),
    (8, 6, 3, 4, False, "random"),
]


# Each case compiles two second-order programs: reverse over reverse for the causal case in `make test`
# (the mode the loops with traced trip counts could not take), every case and mode in `make test-slow`.
@pytest.mark.parametrize("mode,T,S,bq,bk,is_causal,mask_kind", [
    pytest.param(mode, *case, marks=() if (mode, case) == ("rev", SECOND_ORDER_CASES[0]) else pytest.mark.slow)
    for case in SECOND_ORDER_CASES for mode in ("rev", "fwd")
])
def test_second_derivatives_equal_dense_attention(x64, mode, T, S, bq, bk, is_causal, mask_kind):
    q, k, v = _qkv(15, T, S, H=4, V=3, dtype=np.float64)
    mask = _mask(mask_kind, T, S)
    blockwise, dense = _second_order_losses(T, S, 3, mask, is_causal, bq, bk)
    rng = np.random.default_rng(16)
    directions = tuple(rng.standard_normal(x.shape) for x in (q, k, v))

    def hessian_times_directions(loss):
        grad = jax.grad(loss, argnums=(0, 1, 2))
        if mode == "rev":  # reverse over reverse: the gradient of <grad, directions>
            inner = lambda q, k, v: sum(jnp.sum(g * d) for g, d in zip(grad(q, k, v), directions))
            return jax.jit(jax.grad(inner, (0, 1, 2)))(q, k, v)
        return jax.jit(lambda q, k, v: jax.jvp(grad, (q, k, v), directions)[1])(q, k, v)  # forward over reverse

    for name, a, b in zip(["dq", "dk", "dv"], hessian_times_directions(blockwise), hessian_times_directions(dense)):
        assert np.all(np.isfinite(a)), name
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10, err_msg=f"{mode} {name}")


@pytest.mark.slow  # numerical second derivatives: many evaluations
@pytest.mark.parametrize("is_causal,mask_kind", [(True, None), (False, None), (True, "random")])
def test_check_grads_order_two_float64(x64, is_causal, mask_kind):
    q, k, v = _qkv(17, 6, 7, H=3, V=2, dtype=np.float64)
    mask = _mask(mask_kind, 6, 7)

    @jax.jit
    def f(q, k, v):
        out, lse = jaxattn.blockwise_attention(q, k, v, mask=mask, is_causal=is_causal, block_q=4, block_k=3)
        return out, jnp.where(jnp.isfinite(lse), lse, 0.0)

    check_grads(f, (q, k, v), order=2, modes=["rev"], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_grouped_query_second_derivatives_equal_dense(x64):
    T, S, N, K, H = 6, 7, 4, 2, 3
    rng = np.random.default_rng(18)
    q, k, v = rng.standard_normal((T, N, H)), rng.standard_normal((S, K, H)), rng.standard_normal((S, K, 2))
    w = rng.standard_normal((T, N, 2))

    def hvp(attn):
        loss = lambda q, k, v: jnp.sum(jnp.sin(attn(q, k, v)[0]) * w)
        return jax.grad(lambda q, k, v: jnp.sum(jax.grad(loss, (0, 1, 2))(q, k, v)[0] ** 2), (0, 1, 2))(q, k, v)

    got = jax.jit(lambda: hvp(lambda *a: jaxattn.multi_head_blockwise_attention(*a, is_causal=True, block_q=4, block_k=3)))()
    expected = jax.jit(lambda: hvp(lambda *a: jaxattn.multi_head_attention(*a, is_causal=True)))()
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10)


# ---------------------------------------------------------------------------------------------- sharding
# jit(vmap(multi_head_blockwise_attention)) on inputs split over ('batch', 'heads') returns outputs split the
# same way, as jax.nn.dot_product_attention does, with automatic and explicit sharding. The main process
# has one CPU device, so the check runs in a subprocess with 4 host devices (as tests/test_ring.py does).

_SHARDING_SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jaxattn

jax.config.update("jax_numpy_rank_promotion", "raise")
rng = np.random.default_rng(0)
B, T, S, N, K, H = 4, 12, 10, 4, 2, 8
host = [rng.standard_normal(shape).astype(np.float32) for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H))]
f = jax.vmap(lambda q, k, v: jaxattn.multi_head_blockwise_attention(q, k, v, is_causal=True, block_q=4, block_k=4))
loss = lambda q, k, v: jnp.sum(f(q, k, v)[0] ** 2)
expected = f(*host), jax.grad(loss, (0, 1, 2))(*host)  # one device's program (heads mapped one after another)
results = {"devices": jax.device_count()}
for kind in ("auto", "explicit"):
    mesh = jax.make_mesh((2, 2), ("batch", "heads"), axis_types=(getattr(AxisType, kind.capitalize()),) * 2)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("batch", None, "heads", None)))
    q, k, v = (put(x) for x in host)
    (out, lse), grads = jax.jit(f)(q, k, v), jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
    reference = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, jnp.repeat(k, 2, 2), jnp.repeat(v, 2, 2), is_causal=True))(q, k, v)
    close = all(np.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip((out, lse, *grads), (*expected[0], *expected[1])))
    spec = lambda x: list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))  # axis names, one per axis
    results[kind] = dict(out=spec(out), lse=spec(lse), dq=spec(grads[0]), dk=spec(grads[1]), jax_nn=spec(reference),
                         close=bool(close))
print(json.dumps(results))
"""


@pytest.mark.slow  # a 4-device subprocess: jax start-up and eight compilations, about 15 s on 2 cores
def test_head_sharding_carries_through_jit_of_vmap():
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    proc = subprocess.run([sys.executable, "-c", _SHARDING_SCRIPT], env=env, capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results["devices"] == 4
    for kind in ("auto", "explicit"):
        r = results[kind]
        assert r["jax_nn"] == ["batch", None, "heads", None], r  # what jax.nn.dot_product_attention does
        assert r["out"] == r["jax_nn"] and r["dq"] == r["jax_nn"] and r["dk"] == r["jax_nn"], (kind, r)
        assert r["lse"] == ["batch", "heads", None], (kind, r)
        assert r["close"], (kind, r)


@pytest.mark.parametrize("shape", [(13, 11), (11,), (13, 1), (1, 1)])
def test_a_bias_in_every_broadcast_shape_equals_the_dense_cores_with_its_gradient(shape, x64):
    """The bias is added in each tile (after the scale, before the cap); its gradient comes back in its
    own shape, summed along the axes it broadcasts; float64 against the dense core, causal and windowed."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.normal(size=(n, 4)) for n in (13, 11, 11))
    bias = rng.normal(size=shape)
    for kw in (dict(is_causal=True), dict(local_window_size=(2, 1), logit_cap=1.5)):
        dense = lambda q, k, v, b: jnp.sum(jaxattn.attention(q, k, v, bias=b, **kw)[0] ** 2)
        tiled = lambda q, k, v, b: jnp.sum(jaxattn.blockwise_attention(q, k, v, bias=b, block_q=4, block_k=3, **kw)[0] ** 2)
        np.testing.assert_allclose(tiled(q, k, v, bias), dense(q, k, v, bias), rtol=1e-12)
        for got, want in zip(jax.grad(tiled, (0, 1, 2, 3))(q, k, v, bias), jax.grad(dense, (0, 1, 2, 3))(q, k, v, bias)):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_a_per_head_bias_in_multi_head_blockwise_and_a_kept_nan_bias_makes_its_row_nan():
    rng = np.random.default_rng(5)
    q = rng.normal(size=(9, 4, 4)).astype(np.float32)
    k, v = (rng.normal(size=(9, 2, 4)).astype(np.float32) for _ in range(2))
    bias = rng.normal(size=(4, 9, 9)).astype(np.float32)
    out, _ = jaxattn.multi_head_blockwise_attention(q, k, v, bias=bias, is_causal=True, block_q=4, block_k=2)
    want, _ = jaxattn.multi_head_attention(q, k, v, bias=bias, is_causal=True)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    bias[1, 5, 7] = np.nan  # row 5 of head 1 does not keep key 7 (causal): nothing changes
    bias[2, 6, 3] = np.nan  # row 6 of head 2 keeps key 3: that row is NaN
    out, _ = jaxattn.multi_head_blockwise_attention(q, k, v, bias=bias, is_causal=True, block_q=4, block_k=2)
    nan = np.isnan(np.asarray(out))
    assert nan[6, 2].all() and nan.sum() == out.shape[2]
