"""Sliding windows and logit soft caps in every function of the core, against the float64 oracle.

The window is written in the oracle as the boolean mask of its definition (query i sees key j iff
i + offset - left <= j <= i + offset + right); a causal window of W keys is is_causal with (W - 1, 0),
so query t sees key s iff 0 <= t - s < W. The cap is c·tanh(logits / c) before the mask.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxattn
from tests._oracle import assert_close, reference_forward, reference_vjp, window_keep


def _qkv(T, S, H=4, V=3, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(n, H)).astype(dtype) * 1.5 for n in (T, S))
    v = rng.normal(size=(S, V)).astype(dtype)
    d_out = rng.normal(size=(T, V)).astype(dtype)
    return q, k, v, d_out


def _keep(T, S, window, causal, mask=None):
    keep = window_keep(T, S, *window) if window is not None else np.ones((T, S), bool)
    if causal:
        keep &= np.tril(np.ones((T, S), bool))
    if mask is not None:
        keep &= np.broadcast_to(mask, (T, S))
    return keep


# (T, S, window, is_causal, cap): the causal window's edge at T > W, a two-sided window, a window wider
# than the keys, a zero window, T > S with rows seeing nothing (non-causal (0, 0) past S).
CASES = [
    (11, 11, (3, 0), True, None),
    (11, 11, (3, 0), True, 2.0),
    (9, 12, (2, 3), False, None),
    (9, 12, (2, 3), False, 0.7),
    (7, 7, (50, 50), False, None),
    (10, 6, (0, 0), False, 1.5),
    (8, 8, None, True, 1.0),
]


@pytest.mark.parametrize("T,S,window,causal,cap", CASES)
def test_dense_and_blockwise_match_the_oracle_with_a_window_and_a_cap(T, S, window, causal, cap):
    q, k, v, d_out = _qkv(T, S, seed=T + S)
    keep = _keep(T, S, window, causal)
    want_out, want_p = reference_forward(q, k, v, keep, None, None, cap)
    want_grads = reference_vjp(q, k, v, d_out, keep, None, None, cap)
    kw = dict(local_window_size=window, is_causal=causal, logit_cap=cap)

    out, p = jaxattn.attention(q, k, v, **kw)
    assert_close(out, want_out, err_msg="attention out")
    assert_close(p, want_p, err_msg="attention weights")
    assert_close(jaxattn.attention_weights(q, k, **kw), want_p, err_msg="attention_weights")
    _, vjp = jax.vjp(lambda q, k, v: jaxattn.attention(q, k, v, **kw)[0], q, k, v)
    for got, want, name in zip(vjp(d_out), want_grads, "qkv"):
        assert_close(got, want, err_msg=f"attention d{name}")

    out_b, lse = jaxattn.blockwise_attention(q, k, v, block_q=4, block_k=3, **kw)
    assert_close(out_b, want_out, err_msg="blockwise out")
    _, vjp = jax.vjp(lambda q, k, v: jaxattn.blockwise_attention(q, k, v, block_q=4, block_k=3, **kw)[0], q, k, v)
    for got, want, name in zip(vjp(d_out), want_grads, "qkv"):
        assert_close(got, want, err_msg=f"blockwise d{name}")
    rows = jaxattn.weights_from_lse(q, k, lse, **kw)
    assert_close(rows, want_p, err_msg="weights_from_lse")
    empty = ~keep.any(axis=1)
    assert np.all(np.asarray(out)[empty] == 0) and np.all(np.asarray(out_b)[empty] == 0)  # rows seeing no key
    assert np.all(np.isneginf(np.asarray(lse)[empty]))


def test_the_causal_window_of_w_keys_is_zero_at_t_minus_s_equal_w_and_positive_below():
    T, W = 12, 4
    q, k, _, _ = _qkv(T, T, seed=3)
    p = np.asarray(jaxattn.attention_weights(q, k, is_causal=True, local_window_size=(W - 1, 0)))
    t, s = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
    assert np.all(p[(t - s >= 0) & (t - s < W)] > 0)
    assert np.all(p[(t - s >= W) | (t - s < 0)] == 0)
    np.testing.assert_array_equal(np.asarray(jaxattn.window_mask(T, T, (W - 1, 0))) & (s <= t), (t - s >= 0) & (t - s < W))


def test_multi_head_dense_and_blockwise_take_a_window_and_cap_per_call_with_gqa():
    T, N, K, H = 10, 4, 2, 4
    rng = np.random.default_rng(5)
    q = rng.normal(size=(T, N, H)).astype(np.float32)
    k, v = (rng.normal(size=(T, K, H)).astype(np.float32) for _ in range(2))
    kw = dict(is_causal=True, local_window_size=(2, 0), logit_cap=1.2)
    out, w = jaxattn.multi_head_attention(q, k, v, **kw)
    out_b, _ = jaxattn.multi_head_blockwise_attention(q, k, v, block_q=3, block_k=4, **kw)
    keep = _keep(T, T, (2, 0), True)
    for n in range(N):
        want_out, want_p = reference_forward(q[:, n], k[:, n // 2], v[:, n // 2], keep, None, None, 1.2)
        assert_close(out[:, n], want_out, err_msg=f"head {n}")
        assert_close(w[n], want_p, err_msg=f"head {n} weights")
        assert_close(out_b[:, n], want_out, err_msg=f"blockwise head {n}")


@pytest.mark.parametrize("fn", ["attention", "blockwise"])
def test_second_derivatives_with_a_window_and_a_cap(fn, x64):
    q, k, v, _ = (x.astype(np.float64) for x in _qkv(7, 7, seed=11))
    kw = dict(is_causal=True, local_window_size=(2, 0), logit_cap=1.3)
    if fn == "attention":
        f = lambda q, k, v: jaxattn.attention(q, k, v, **kw)[0]
    else:
        f = lambda q, k, v: jaxattn.blockwise_attention(q, k, v, block_q=3, block_k=2, **kw)[0]
    check_grads(f, (q, k, v), order=2, modes=["rev"], atol=1e-5, rtol=1e-5)


def test_a_traced_cap_is_differentiable_in_the_dense_core(x64):
    q, k, v, _ = (x.astype(np.float64) for x in _qkv(6, 6, seed=2))
    f = lambda c: jnp.sum(jaxattn.attention(q, k, v, logit_cap=c)[0] ** 2)
    check_grads(f, (1.1,), order=2, atol=1e-6, rtol=1e-6)


def test_non_finite_entries_outside_the_window_do_not_matter_and_inside_they_show():
    T = 9
    q, k, v, _ = _qkv(T, T, seed=7)
    kw = dict(is_causal=True, local_window_size=(2, 0))
    clean_out, _ = jaxattn.attention(q, k, v, **kw)
    clean_b, _ = jaxattn.blockwise_attention(q, k, v, block_q=2, block_k=2, **kw)
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[1, 0] = np.nan  # seen by rows 1, 2, 3 only
    v_bad[1, 2] = np.inf
    out, w = jaxattn.attention(q, k_bad, v_bad, **kw)
    out_b, _ = jaxattn.blockwise_attention(q, k_bad, v_bad, block_q=2, block_k=2, **kw)
    seen = np.zeros(T, bool)
    seen[1:4] = True
    for got, clean in ((out, clean_out), (out_b, clean_b)):
        got = np.asarray(got)
        assert np.all(np.isnan(got[seen]))
        np.testing.assert_allclose(got[~seen], np.asarray(clean)[~seen], rtol=1e-6)
    q_bad = q.copy()
    q_bad[5, 1] = np.nan
    w = np.asarray(jaxattn.attention_weights(q_bad, k, logit_cap=1.0, **kw))
    assert np.all(np.isnan(w[5])) and np.all(np.isfinite(np.delete(w, 5, axis=0)))


def test_cap_bounds_the_largest_weight():
    """Over S kept keys with a cap c, no weight exceeds e^{2c} / (e^{2c} + S - 1)."""
    q, k, _, _ = _qkv(16, 10, H=64, seed=9)
    for c in (0.5, 1.0, 3.0):
        w = np.asarray(jaxattn.attention_weights(q * 30, k * 30, logit_cap=c))
        bound = np.exp(2 * c) / (np.exp(2 * c) + 10 - 1)
        assert w.max() <= bound * (1 + 1e-6)


def test_blockwise_windows_skip_the_key_blocks_outside_every_row_window():
    """The tiles visited grow with the window, not with S; those wholly inside every row's window run
    without a mask; the backward visits the same tiles with the same decision."""
    from jaxattn._blockwise import _k_range, _loop_counts, _plan, _q_range

    plan = _plan(4096, 4096, 128, 128, True, False, window=(511, 0))
    fwd = [_k_range(plan, i) for i in range(plan.nq)]
    assert sum(hi - lo for lo, _, _, hi in fwd) == 1 + 2 + 3 + 4 + 28 * 5  # of 32·33/2 = 528 causal tiles
    assert all(f_hi - f_lo == 3 for _, f_lo, f_hi, _ in fwd[4:])  # keys i-3 .. i-1: wholly in every window
    assert _loop_counts(plan) == ((3, 2), (2, 3))
    bwd = [_q_range(plan, j) for j in range(plan.nk)]
    visited_fwd = {((i, j), f_lo <= j < f_hi) for i, (lo, f_lo, f_hi, hi) in enumerate(fwd) for j in range(lo, hi)}
    visited_bwd = {((i, j), f_lo <= i < f_hi) for j, (lo, f_lo, f_hi, hi) in enumerate(bwd) for i in range(lo, hi)}
    assert visited_fwd == visited_bwd
    full = _plan(4096, 4096, 256, 256, True, False)
    assert sum(hi - lo for lo, _, _, hi in (_k_range(full, i) for i in range(16))) == 136


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(local_window_size=-1), ValueError, "local_window_size must be >= 0"),
    (dict(local_window_size=(1, 2, 3)), TypeError, "local_window_size must be None"),
    (dict(local_window_size=1.5), TypeError, "local_window_size must be None"),
    (dict(logit_cap=0.0), ValueError, "logit_cap must be finite and > 0"),
    (dict(logit_cap="big"), TypeError, "logit_cap must be None or a positive real number"),
    (dict(causal_offset=2), ValueError, "needs is_causal=True \\(or local_window_size"),
])
def test_bad_windows_and_caps_are_refused_by_name(kwargs, error, match):
    q, k, v, _ = _qkv(4, 4)
    with pytest.raises(error, match=match):
        jaxattn.attention(q, k, v, **kwargs)


def test_blockwise_refuses_a_traced_cap_and_the_library_kernels_a_cap():
    q, k, v, _ = _qkv(4, 4)
    with pytest.raises(TypeError, match="logit_cap must be a Python number for the blockwise kernel"):
        jax.jit(lambda c: jaxattn.blockwise_attention(q, k, v, logit_cap=c))(1.0)
    with pytest.raises(ValueError, match="logit_cap"):
        jaxattn.blockwise_attention(q, k, v, logit_cap=1.0, implementation="xla")


def test_the_caps_derivative_is_right_where_tanh_rounds_to_one_in_float32():
    """d(c·tanh(x/c))/dx = sech²(x/c): about 4e-7 at x/c = 8, 4e-26 at 30, where 1 - tanh² is exactly 0."""
    q = np.zeros((1, 4), np.float32)
    k = np.zeros((5, 4), np.float32)
    x = np.array([[0.5, 8.0, 12.0, 30.0, -20.0]], np.float32)  # the logits are the bias here (q kᵀ = 0)
    got = jax.grad(lambda b: jnp.sum(jaxattn.attention_logits(q, k, bias=b, logit_cap=1.0)))(x)
    want = 1.0 / np.cosh(x.astype(np.float64)) ** 2
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5)
    assert np.all(np.asarray(got) > 0)
    q1 = np.eye(1, 4, dtype=np.float32)  # q·k_s = k[s, 0] = x_s
    k1 = np.zeros((5, 4), np.float32)
    k1[:, 0] = x[0]
    v1 = np.eye(5, dtype=np.float32)
    f = lambda k, fn: jnp.sum(fn(q1, k, v1, scale=1.0, logit_cap=1.0)[0] * np.arange(5.0, dtype=np.float32)[None, :])
    dense = jax.grad(f)(k1, jaxattn.attention)
    blockwise = jax.grad(f)(k1, jaxattn.blockwise_attention)
    np.testing.assert_allclose(np.asarray(blockwise), np.asarray(dense), rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("fn", ["attention", "blockwise"])
def test_a_masked_nan_bias_under_a_cap_reaches_no_gradient(fn):
    """The cap's derivative at a NaN logit is 0, so a masked NaN bias entry changes no gradient (not 0·NaN)."""
    rng = np.random.default_rng(3)
    T, S = 4, 5
    q, k, v = (rng.normal(size=(n, 4)).astype(np.float32) for n in (T, S, S))
    bias = rng.normal(size=(T, S)).astype(np.float32)
    mask = np.ones((T, S), bool)
    mask[2, 1] = False
    bias_nan, bias_zero = bias.copy(), bias.copy()
    bias_nan[2, 1], bias_zero[2, 1] = np.nan, 0.0
    call = jaxattn.attention if fn == "attention" else functools.partial(jaxattn.blockwise_attention, block_q=2, block_k=2)
    loss = lambda q, k, v, b: jnp.sum(call(q, k, v, bias=b, mask=mask, logit_cap=2.0)[0])
    got = jax.grad(loss, (0, 1, 2))(q, k, v, bias_nan)
    want = jax.grad(loss, (0, 1, 2))(q, k, v, bias_zero)
    for a, b in zip(got, want):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("value", [np.inf, -np.inf])
def test_forward_mode_through_a_cap_at_an_infinite_logit_is_finite_and_agrees_with_reverse(value):
    """A capped ±inf logit is ±cap, a finite row: jvp (d/dcap's ±1 there, not inf·0) equals jacrev's product."""
    rng = np.random.default_rng(4)
    q, k = rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=(4, 2)).astype(np.float32)
    bias = np.zeros((3, 4), np.float32)
    bias[1, 2] = value
    f = lambda q: jaxattn.attention_weights(q, k, bias=bias, logit_cap=1.5)
    dq = rng.normal(size=q.shape).astype(np.float32)
    w, dw = jax.jvp(f, (q,), (dq,))
    assert np.all(np.isfinite(w)) and np.all(np.isfinite(dw))
    np.testing.assert_allclose(dw, np.einsum("tsab,ab->ts", jax.jacrev(f)(q), dq), rtol=1e-5, atol=1e-6)


def test_blockwise_tile_ranges_skip_no_kept_key_and_free_tiles_hold_no_masked_one():
    """Every plan of a grid of lengths, blocks, windows, causal and masks: a tile holding a kept key is
    visited, a mask-free tile holds no masked entry, and the backward visits what the forward does."""
    import itertools

    from jaxattn._blockwise import _k_range, _loop_counts, _plan, _q_range

    plans = 0
    for T, S, bq, bk, causal, window, has_mask in itertools.product(
            [1, 7, 13, 32], [1, 6, 13, 33], [1, 4, 5], [1, 3, 8], [False, True],
            [None, (0, 0), (2, 1), (5, 0), (0, 4), (40, 40)], [False, True]):
        p = _plan(T, S, bq, bk, causal, has_mask, window)
        rows, cols = np.arange(p.nq * p.bq)[:, None], np.arange(p.nk * p.bk)[None, :]
        keep = cols < S
        if causal:
            keep = keep & (cols <= rows)
        if p.window is not None:
            keep = keep & (cols >= rows - p.window[0]) & (cols <= rows + p.window[1])
        tile = lambda i, j: keep[i * p.bq:(i + 1) * p.bq, j * p.bk:(j + 1) * p.bk]
        fwd, bwd = {}, {}
        for i in range(p.nq):
            lo, f_lo, f_hi, hi = _k_range(p, i)
            assert 0 <= lo <= f_lo <= f_hi <= hi <= p.nk
            for j in range(p.nk):
                assert lo <= j < hi or not tile(i, j).any(), (T, S, bq, bk, causal, window, has_mask, i, j)
                if lo <= j < hi:
                    fwd[i, j] = f_lo <= j < f_hi
                    assert not fwd[i, j] or tile(i, j).all()
        for j in range(p.nk):
            lo, f_lo, f_hi, hi = _q_range(p, j)
            for i in range(lo, hi):
                bwd[i, j] = f_lo <= i < f_hi
        assert {ij: f for ij, f in fwd.items() if tile(*ij).any()} == {ij: f for ij, f in bwd.items() if tile(*ij).any()}
        _loop_counts(p)
        plans += 1
    assert plans == 3456
