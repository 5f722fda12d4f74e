"""The core: closed forms, a float64 NumPy oracle, parity with jax.nn, gradients, transformations, dtypes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxattn
from tests._oracle import assert_close, reference_forward, reference_vjp


def _random_case(seed, dtype=np.float32):
    """A random single-head problem: shapes, a mask (sometimes with fully masked rows), a bias, a scale."""
    rng = np.random.default_rng(seed)
    T, S, H, V = (int(rng.integers(1, 10)), int(rng.integers(1, 10)), int(rng.integers(1, 17)), int(rng.integers(1, 6)))
    q = rng.standard_normal((T, H)).astype(dtype)
    k = rng.standard_normal((S, H)).astype(dtype)
    v = rng.standard_normal((S, V)).astype(dtype)
    mask = rng.random((T, S)) < 0.7 if seed % 3 else None
    if mask is not None and seed % 2:
        mask[0] = False  # a fully masked row
    bias = rng.standard_normal((T, S)).astype(dtype) if seed % 4 == 1 else None
    scale = [None, 1.0, 0.3, 2.0][seed % 4]
    d_out = rng.standard_normal((T, V)).astype(dtype)
    return q, k, v, mask, bias, scale, d_out


# ---------------------------------------------------------------------------------------------- closed form


def test_two_keys_differing_by_one_give_one_e_over_one_plus_e():
    q = np.array([[1.0]], np.float32)
    k = np.array([[0.0], [1.0]], np.float32)
    w = jaxattn.attention_weights(q, k, scale=1.0)
    np.testing.assert_allclose(np.asarray(w[0]), np.array([1.0, math.e]) / (1.0 + math.e), rtol=1e-6)


def test_default_scale_is_one_over_sqrt_head_dim():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((3, 16)).astype(np.float32), rng.standard_normal((5, 16)).astype(np.float32)
    np.testing.assert_array_equal(jaxattn.attention_weights(q, k), jaxattn.attention_weights(q, k, scale=0.25))
    np.testing.assert_allclose(jaxattn.attention_logits(q, k, scale=1.0), q @ k.T, rtol=1e-5, atol=1e-5)


def test_identical_keys_give_uniform_weights_and_the_mean_value():
    k = np.ones((4, 3), np.float32)
    v = np.arange(8, dtype=np.float32).reshape(4, 2)
    out, w = jaxattn.attention(np.ones((2, 3), np.float32), k, v)
    np.testing.assert_allclose(w, np.full((2, 4), 0.25), rtol=1e-6)
    np.testing.assert_allclose(out, np.tile(v.mean(0), (2, 1)), rtol=1e-6)


def test_output_is_weights_times_values_from_one_computation():
    q, k, v, mask, bias, scale, _ = _random_case(7)
    out, w = jaxattn.attention(q, k, v, mask=mask, bias=bias, scale=scale)
    np.testing.assert_allclose(out, np.asarray(w) @ v, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(w, jaxattn.attention_weights(q, k, mask=mask, bias=bias, scale=scale))


def test_causal_first_row_returns_first_value():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((5, 4)).astype(np.float32) for _ in range(3))
    out, w = jaxattn.attention(q, k, v, is_causal=True)
    np.testing.assert_array_equal(np.asarray(w[0]), np.eye(5, dtype=np.float32)[0])
    np.testing.assert_allclose(out[0], v[0], rtol=1e-6)
    assert np.all(np.asarray(w)[np.triu_indices(5, 1)] == 0.0)


def _offset_case():
    rng = np.random.default_rng(3)
    q, k = (rng.standard_normal((n, 4)).astype(np.float32) for n in (3, 7))
    v = rng.standard_normal((7, 2)).astype(np.float32)
    return q, k, v, (np.arange(7) != 1)[None, :]  # key 1 is padding


@pytest.mark.parametrize("c", [4, pytest.param(-1, marks=pytest.mark.slow), pytest.param(0, marks=pytest.mark.slow),
                               pytest.param(2, marks=pytest.mark.slow)])
def test_causal_offset_moves_the_diagonal_as_causal_mask_does(c):
    """``is_causal=True, causal_offset=c`` is the keep-mask ``causal_mask(T, S, c)`` (here with a padding
    mask on top), bit for bit; ``c = S - T = 4`` is queries continuing earlier keys."""
    q, k, v, pad = _offset_case()
    out, w = jaxattn.attention(q, k, v, mask=pad, is_causal=True, causal_offset=c)
    ref_out, ref_w = jaxattn.attention(q, k, v, mask=jaxattn.causal_mask(3, 7, c) & pad)
    np.testing.assert_array_equal(w, ref_w)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(w, jaxattn.attention_weights(q, k, mask=pad, is_causal=True, causal_offset=c))


@pytest.mark.slow
def test_causal_offset_under_gqa_and_with_a_nan_value_past_the_diagonal():
    """Grouped-query attention takes the offset too; a NaN value past the moved diagonal reaches no row
    that cannot see it, and the gradients of the finite rows stay finite."""
    q, k, v, pad = _offset_case()
    rng = np.random.default_rng(4)
    qm = rng.standard_normal((3, 4, 4)).astype(np.float32)  # N=4 query heads over K=2 key/value heads
    km, vm = (rng.standard_normal((7, 2, 4)).astype(np.float32) for _ in range(2))
    out, w = jaxattn.multi_head_attention(qm, km, vm, mask=pad, is_causal=True, causal_offset=4)
    ref_out, ref_w = jaxattn.multi_head_attention(qm, km, vm, mask=jaxattn.causal_mask(3, 7, 4) & pad)
    np.testing.assert_array_equal(w, ref_w)
    np.testing.assert_array_equal(out, ref_out)
    v_bad = v.copy()
    v_bad[5] = np.nan  # visible from row 1 on at offset 4 (5 <= 1 + 4), to no row at offset 2
    for c, finite_rows in ((4, [True, False, False]), (2, [True, True, True])):
        out, _ = jaxattn.attention(q, k, v_bad, is_causal=True, causal_offset=c)
        assert np.isfinite(np.asarray(out)).all(axis=1).tolist() == finite_rows
    grads = jax.grad(lambda q, k, v: jaxattn.attention(q, k, v, is_causal=True, causal_offset=2)[0].sum(),
                     argnums=(0, 1, 2))(q, k, v_bad)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(causal_offset=1), ValueError, r"causal_offset=1 moves the causal diagonal and needs is_causal=True"),
    (dict(is_causal=True, causal_offset=1.5), TypeError, r"causal_offset must be a Python int .* received 1.5"),
    (dict(is_causal=True, causal_offset=True), TypeError, r"causal_offset must be a Python int"),
])
def test_causal_offset_is_a_python_int_with_is_causal(kwargs, error, match):
    q = np.ones((2, 4), np.float32)
    with pytest.raises(error, match=match):
        jaxattn.attention(q, q, q, **kwargs)


# ---------------------------------------------------------------------------------------------- oracle


# Random shapes: a few in `make test`, the rest (each compiles its own program) in `make test-slow`.
@pytest.mark.parametrize("seed", [s if s < 2 else pytest.param(s, marks=pytest.mark.slow) for s in range(24)])
def test_float32_matches_float64_oracle_on_outputs_and_vjp(seed):
    q, k, v, mask, bias, scale, d_out = _random_case(seed)
    out, w = jaxattn.attention(q, k, v, mask=mask, bias=bias, scale=scale)
    ref_out, ref_w = reference_forward(q, k, v, mask, bias, scale)
    assert_close(out, ref_out, "float32")
    assert_close(w, ref_w, "float32")
    _, vjp = jax.vjp(lambda a, b, c: jaxattn.attention(a, b, c, mask=mask, bias=bias, scale=scale)[0], q, k, v)
    # Normwise over the whole gradient (dq, dk, dv): near saturation dq and dk are differences of O(1)
    # terms, so their own magnitude is no measure of the float32 rounding they carry.
    got = np.concatenate([np.ravel(g) for g in vjp(d_out)])
    want = np.concatenate([np.ravel(g) for g in reference_vjp(q, k, v, d_out, mask, bias, scale)])
    assert_close(got, want, "float32", err_msg="(dq, dk, dv)")


@pytest.mark.parametrize("seed", [s if s < 1 else pytest.param(s, marks=pytest.mark.slow) for s in range(12)])
def test_float64_matches_float64_oracle_to_1e_12(seed, x64):
    q, k, v, mask, bias, scale, d_out = _random_case(seed, np.float64)
    out, w = jaxattn.attention(q, k, v, mask=mask, bias=bias, scale=scale)
    assert out.dtype == jnp.float64 and w.dtype == jnp.float64
    ref_out, ref_w = reference_forward(q, k, v, mask, bias, scale)
    assert_close(out, ref_out, "float64")
    assert_close(w, ref_w, "float64")
    _, vjp = jax.vjp(lambda a, b, c: jaxattn.attention(a, b, c, mask=mask, bias=bias, scale=scale)[0], q, k, v)
    got = np.concatenate([np.ravel(g) for g in vjp(d_out)])
    want = np.concatenate([np.ravel(g) for g in reference_vjp(q, k, v, d_out, mask, bias, scale)])
    assert_close(got, want, "float64", err_msg="(dq, dk, dv)")


@pytest.mark.slow  # every mask kind in make test-slow; make test checks second derivatives through blockwise's
@pytest.mark.parametrize("mask_kind", ["causal", "none", "random"])
def test_check_grads_order_two_forward_and_reverse(mask_kind, x64):
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((4, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    mask = {"none": None, "random": rng.random((4, 5)) < 0.6, "causal": jaxattn.causal_mask(4, 5)}[mask_kind]
    if mask is not None:
        mask = np.array(mask)
        mask[1] = False  # also a fully masked row
    fn = lambda a, b, c: jaxattn.attention(a, b, c, mask=mask, scale=0.7)[0]
    check_grads(fn, (q, k, v), order=2, modes=("fwd", "rev"))


# ---------------------------------------------------------------------------------------------- jax.nn parity


def _jax_nn_batched(q, k, v, **kw):
    return jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)


@pytest.mark.parametrize("N,K", [(4, 4), (6, 2), pytest.param(4, 1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])
def test_parity_with_jax_nn_dot_product_attention(N, K, causal):
    rng = np.random.default_rng(N * 10 + K)
    B, T, S, H = 2, 5, 7 if not causal else 5, 8
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k = rng.standard_normal((B, S, K, H)).astype(np.float32)
    v = rng.standard_normal((B, S, K, H)).astype(np.float32)
    ours, weights = jax.vmap(lambda a, b, c: jaxattn.multi_head_attention(a, b, c, is_causal=causal))(q, k, v)
    theirs = _jax_nn_batched(q, k, v, is_causal=causal)
    assert_close(ours, theirs, "float32")
    assert weights.shape == (B, N, T, S)


def test_parity_with_jax_nn_with_mask_bias_and_scale():
    rng = np.random.default_rng(11)
    B, T, S, N, H = 2, 6, 6, 4, 8
    q, k, v = (rng.standard_normal((B, n, N, H)).astype(np.float32) for n in (T, S, S))
    mask = rng.random((B, N, T, S)) < 0.8
    mask[..., 0] = True  # jax.nn gives fully masked rows a uniform average, jaxattn gives zero: avoid them
    bias = rng.standard_normal((B, N, T, S)).astype(np.float32)
    ours, _ = jax.vmap(lambda a, b, c, m, bb: jaxattn.multi_head_attention(a, b, c, mask=m, bias=bb, scale=0.2))(
        q, k, v, mask, bias
    )
    theirs = _jax_nn_batched(q, k, v, mask=mask, bias=bias, scale=0.2)
    assert_close(ours, theirs, "float32")


def test_multi_head_is_the_single_head_core_per_head_with_gqa_grouping():
    rng = np.random.default_rng(5)
    T, S, N, K, H, V = 3, 4, 6, 3, 5, 2
    q = rng.standard_normal((T, N, H)).astype(np.float32)
    k = rng.standard_normal((S, K, H)).astype(np.float32)
    v = rng.standard_normal((S, K, V)).astype(np.float32)
    mask = rng.random((N, T, S)) < 0.7
    out, w = jaxattn.multi_head_attention(q, k, v, mask=mask)
    for n in range(N):
        o1, w1 = jaxattn.attention(q[:, n], k[:, n // (N // K)], v[:, n // (N // K)], mask=mask[n])
        np.testing.assert_allclose(out[:, n], o1, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(w[n], w1, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------- layer


def test_attention_layer_equals_projections_by_hand():
    rng = np.random.default_rng(2)
    T, D, N, K = 5, 12, 4, 2
    params = jaxattn.init_attention_params(jax.random.key(0), D, N, num_kv_heads=K, use_bias=True)
    params = {name: np.asarray(p) + 0.1 * rng.standard_normal(p.shape).astype(np.float32) for name, p in params.items()}
    h = rng.standard_normal((T, D)).astype(np.float32)
    out, w = jaxattn.attention_layer(params, h, num_heads=N, num_kv_heads=K, is_causal=True)
    H = D // N
    q = (h @ params["W_Q"] + params["b_Q"]).reshape(T, N, H)
    k = (h @ params["W_K"] + params["b_K"]).reshape(T, K, H)
    v = (h @ params["W_V"] + params["b_V"]).reshape(T, K, H)
    heads = []
    for n in range(N):
        ref_o, ref_w = reference_forward(q[:, n], k[:, n // 2], v[:, n // 2], mask=np.tril(np.ones((T, T), bool)))
        assert_close(w[n], ref_w, "float32")
        heads.append(ref_o)
    ref = np.concatenate(heads, axis=1) @ np.asarray(params["W_O"], np.float64) + params["b_O"]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert out.shape == (T, D) and w.shape == (N, T, T)


def test_split_and_merge_heads_are_inverse():
    x = np.arange(24, dtype=np.float32).reshape(2, 12)
    heads = jaxattn.split_heads(x, 3)
    assert heads.shape == (2, 3, 4)
    np.testing.assert_array_equal(heads[1, 2], x[1, 8:12])
    np.testing.assert_array_equal(jaxattn.merge_heads(heads), x)


def test_init_attention_params_shapes_and_variance():
    p = jaxattn.init_attention_params(jax.random.key(1), 256, 8, num_kv_heads=2)
    assert {n: tuple(a.shape) for n, a in p.items()} == {
        "W_Q": (256, 256), "W_K": (256, 64), "W_V": (256, 64), "W_O": (256, 256)
    }
    assert abs(float(jnp.var(p["W_Q"])) * 256 - 1.0) < 0.05


# ---------------------------------------------------------------------------------------------- transforms


def test_jit_vmap_and_eager_agree():
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((3, 4, 6)).astype(np.float32) for _ in range(3))
    mask = rng.random((3, 4, 4)) < 0.7
    fn = lambda a, b, c, m: jaxattn.attention(a, b, c, mask=m)
    eager = [fn(q[i], k[i], v[i], mask[i]) for i in range(3)]
    jitted = [jax.jit(fn)(q[i], k[i], v[i], mask[i]) for i in range(3)]
    vmapped = jax.vmap(fn)(q, k, v, mask)
    for i in range(3):
        for j in range(2):
            np.testing.assert_allclose(jitted[i][j], eager[i][j], rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(vmapped[j][i], eager[i][j], rtol=1e-6, atol=1e-7)


def test_traced_scale_is_accepted_for_sweeps():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((3, 8)).astype(np.float32) for _ in range(3))
    scales = jnp.array([1.0, 0.5, 1 / math.sqrt(8)])
    outs = jax.jit(jax.vmap(lambda s: jaxattn.attention(q, k, v, scale=s)[0]))(scales)
    for s, o in zip(scales, outs):
        np.testing.assert_allclose(o, jaxattn.attention(q, k, v, scale=float(s))[0], rtol=1e-6, atol=1e-6)
    grad = jax.grad(lambda s: jaxattn.attention(q, k, v, scale=s)[0].sum())(0.5)
    assert np.isfinite(grad)


# ---------------------------------------------------------------------------------------------- dtypes, edges


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)])
def test_half_precision_inputs_with_huge_logits_stay_finite_in_their_dtype(dtype):
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((4, 8)) * 40.0, dtype)  # logits of magnitude ~1e4 once scaled
    k = jnp.asarray(rng.standard_normal((6, 8)) * 40.0, dtype)
    v = jnp.asarray(rng.standard_normal((6, 3)), dtype)
    assert float(jnp.abs(jaxattn.attention_logits(q, k)).max()) > 1e3
    out, w = jaxattn.attention(q, k, v)
    assert out.dtype == dtype and w.dtype == dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32))) and np.all(np.isfinite(np.asarray(w, np.float32)))
    ref_out, _ = reference_forward(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    assert_close(out, ref_out, jnp.dtype(dtype).name)
    grads = jax.grad(lambda a: jaxattn.attention(a, k, v)[0].astype(jnp.float32).sum())(q)
    assert grads.dtype == dtype and np.all(np.isfinite(np.asarray(grads, np.float32)))


def test_fully_masked_rows_give_zero_weights_zero_output_finite_gradients():
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((3, 4)).astype(np.float32) for _ in range(3))
    mask = np.ones((3, 3), bool)
    mask[1] = False
    out, w = jaxattn.attention(q, k, v, mask=mask)
    np.testing.assert_array_equal(w[1], np.zeros(3))
    np.testing.assert_array_equal(out[1], np.zeros(4))
    grads = jax.grad(lambda a, b, c: jaxattn.attention(a, b, c, mask=mask)[0].sum(), argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.all(np.isfinite(g))
    np.testing.assert_array_equal(grads[0][1], np.zeros(4))  # the masked query gets no gradient


def test_empty_sequences_work_with_empty_or_zero_outputs():
    q0, k3, v3 = np.zeros((0, 4), np.float32), np.ones((3, 4), np.float32), np.ones((3, 2), np.float32)
    out, w = jaxattn.attention(q0, k3, v3)
    assert out.shape == (0, 2) and w.shape == (0, 3)
    out, w = jaxattn.attention(q0, k3, v3, mask=np.ones((0, 3), bool))  # a [T, S] mask of no row
    assert out.shape == (0, 2) and w.shape == (0, 3)
    assert jax.grad(lambda q: jnp.sum(jaxattn.attention(q, k3, v3, mask=np.ones((0, 3), bool))[0]))(q0).shape == (0, 4)
    for T, S in ((0, 3), (3, 0)):  # the heads vmapped, differentiated: zero gradients of the right shapes
        q, k, v = (np.ones((n, 2, 4), np.float32) for n in (T, S, S))
        grads = jax.grad(lambda q, k, v: jnp.sum(jaxattn.multi_head_attention(q, k, v, is_causal=True)[0]), (0, 1, 2))(q, k, v)
        assert [g.shape for g in grads] == [(T, 2, 4), (S, 2, 4), (S, 2, 4)] and all(np.all(g == 0) for g in grads)
    out, w = jaxattn.attention(np.ones((2, 4), np.float32), np.zeros((0, 4), np.float32), np.zeros((0, 2), np.float32))
    assert w.shape == (2, 0)
    np.testing.assert_array_equal(out, np.zeros((2, 2)))


def test_nan_and_inf_in_kept_positions_propagate_visibly():
    q, k, v = (np.ones((2, 3), np.float32) for _ in range(3))
    v_nan = v.copy()
    v_nan[1, 0] = np.nan
    out, _ = jaxattn.attention(q, k, v_nan)
    assert np.all(np.isnan(out[:, 0])) and np.all(np.isfinite(out[:, 1:]))
    k_inf = k.copy()
    k_inf[0, 0] = np.inf
    out, w = jaxattn.attention(q, k_inf, v)
    assert np.any(~np.isfinite(w))


# ---------------------------------------------------------------------------------------------- non-finite inputs
# A masked position must not influence any output or gradient, whatever its value (NaN, +Inf, -Inf); a
# kept non-finite value still shows: v[s, c] makes entry (t, c) NaN for every row t that keeps s, a q or
# k row makes the whole row NaN, a NaN or +Inf bias makes its row NaN (-Inf bias is a weight of 0).


def _keep_np(T, S, mask, is_causal):
    keep = np.ones((T, S), bool) if mask is None else np.broadcast_to(np.asarray(mask, bool), (T, S)).copy()
    if is_causal:
        keep &= np.arange(S)[None, :] <= np.arange(T)[:, None]
    return keep


def _expected_nan(keep, field, where):
    """Which outputs [T, V] a non-finite entry at ``where`` of ``field`` must make NaN (it propagates iff kept)."""
    T, S = keep.shape
    if field == "v":
        bad = np.zeros((S, 3), bool)
        bad[where] = True
        return (keep.astype(int) @ bad.astype(int)) > 0
    if field == "k":
        bad = np.zeros(S, bool)
        bad[where[0]] = True
        return np.broadcast_to(((keep.astype(int) @ bad.astype(int)) > 0)[:, None], (T, 3))
    if field == "q":
        bad = np.zeros(T, bool)
        bad[where[0]] = True
        return np.broadcast_to((bad & keep.any(axis=1))[:, None], (T, 3))
    raise AssertionError(field)


# (T, S, mask kind, is_causal, field, the poisoned entries): a future key under causal (kept by the last
# rows only), T > S and T < S, padded keys (masked for every row), a general mask, a q row with no kept key.
_SLOW = pytest.mark.slow  # make test keeps one case per field and mask kind; make test-slow runs them all
NONFINITE_CASES = [
    (6, 6, None, True, "v", (5, 1)),
    pytest.param(6, 6, None, True, "v", (np.s_[4:], np.s_[:]), marks=_SLOW),
    pytest.param(7, 5, None, True, "v", (3, 0), marks=_SLOW),
    (5, 7, "padding", False, "v", (np.s_[5:], 2)),
    pytest.param(6, 6, "padding", True, "v", (np.s_[3:], np.s_[:]), marks=_SLOW),
    pytest.param(6, 6, "general", False, "v", (2, 1), marks=_SLOW),
    pytest.param(6, 6, None, True, "k", (4, 2), marks=_SLOW),
    pytest.param(5, 7, "padding", True, "k", (np.s_[5:], np.s_[:]), marks=_SLOW),
    (6, 6, "general", True, "k", (2, 0)),
    (6, 6, "general", False, "q", (1, 3)),
]


def _nonfinite_mask(kind, T, S):
    if kind is None:
        return None
    if kind == "padding":
        return np.arange(S) < S - 2  # [S]
    m = np.random.default_rng(5).random((T, S)) < 0.6  # [T, S]
    m[:, 2] = [t % 2 == 0 for t in range(T)]  # key 2 kept by some rows only
    m[1] = False  # row 1 keeps nothing
    return m


def _poisoned(T, S, field, where, value, seed=11):
    rng = np.random.default_rng(seed)
    clean = {"q": rng.standard_normal((T, 4)), "k": rng.standard_normal((S, 4)), "v": rng.standard_normal((S, 3))}
    clean = {n: x.astype(np.float32) for n, x in clean.items()}
    bad = {n: x.copy() for n, x in clean.items()}
    bad[field][where] = value
    zero = {n: x.copy() for n, x in clean.items()}
    zero[field][where] = 0.0
    return bad, zero


def _loss_off_nan(f, nan_out, ct):
    """``Σ ct ⊙ out`` over the outputs expected finite (``where`` drops the NaN ones, and their gradient)."""
    return lambda q, k, v: jnp.sum(jnp.where(nan_out, 0.0, f(q, k, v)) * ct)


# NaN in `make test`; ±Inf in `make test-slow`.
@pytest.mark.parametrize("value", [np.nan, pytest.param(np.inf, marks=pytest.mark.slow), pytest.param(-np.inf, marks=pytest.mark.slow)])
@pytest.mark.parametrize("T,S,mask_kind,is_causal,field,where", NONFINITE_CASES)
def test_masked_non_finite_inputs_do_not_leak_into_outputs_or_gradients(T, S, mask_kind, is_causal, field, where, value):
    mask = _nonfinite_mask(mask_kind, T, S)
    bad, zero = _poisoned(T, S, field, where, value)
    keep = _keep_np(T, S, mask, is_causal)
    nan_out = _expected_nan(keep, field, where)
    f = lambda q, k, v: jaxattn.attention(q, k, v, mask=mask, is_causal=is_causal)[0]
    out_bad, out_zero = np.asarray(f(bad["q"], bad["k"], bad["v"])), np.asarray(f(zero["q"], zero["k"], zero["v"]))
    np.testing.assert_array_equal(np.isnan(out_bad), nan_out)  # a kept non-finite value shows, a masked one not
    np.testing.assert_allclose(out_bad[~nan_out], out_zero[~nan_out], rtol=1e-6, atol=1e-6)
    ct = np.random.default_rng(3).standard_normal((T, 3)).astype(np.float32)
    loss = _loss_off_nan(f, nan_out, ct)
    g_bad = jax.grad(loss, (0, 1, 2))(bad["q"], bad["k"], bad["v"])
    g_zero = jax.grad(loss, (0, 1, 2))(zero["q"], zero["k"], zero["v"])
    for name, a, b in zip("qkv", g_bad, g_zero):
        assert np.all(np.isfinite(a)), f"d{name} is not finite"
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=f"d{name}")


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_forward_mode_through_non_finite_values_masked_and_kept_agrees_with_reverse_mode(value):
    """A non-finite ``v[s, c]`` (one masked, one kept by some rows): the output tangents are finite, zero at
    the NaN outputs, equal to those with the entries zeroed, and agree with the reverse-mode gradient."""
    T, S = 6, 6
    bad, zero = _poisoned(T, S, "v", (5, 1), value)  # key 5: every row but the last masks it (causal)
    bad["v"][2, 0], zero["v"][2, 0] = value, 0.0  # key 2: kept by rows 2..5
    keep = _keep_np(T, S, None, True)
    nan_out = _expected_nan(keep, "v", ([5, 2], [1, 0]))
    f = lambda q, k, v: jaxattn.attention(q, k, v, is_causal=True)[0]
    rng = np.random.default_rng(6)
    tangents = tuple(rng.standard_normal(x.shape).astype(np.float32) for x in (bad["q"], bad["k"], bad["v"]))
    out, t_out = jax.jvp(f, (bad["q"], bad["k"], bad["v"]), tangents)
    np.testing.assert_array_equal(np.isnan(out), nan_out)
    t_out = np.asarray(t_out)
    assert np.all(np.isfinite(t_out)) and np.all(t_out[nan_out] == 0.0)
    _, t_zero = jax.jvp(f, (zero["q"], zero["k"], zero["v"]), tangents)
    np.testing.assert_allclose(t_out[~nan_out], np.asarray(t_zero)[~nan_out], rtol=1e-5, atol=1e-6)
    ct = rng.standard_normal((T, 3)).astype(np.float32)
    grads = jax.grad(_loss_off_nan(f, nan_out, ct), (0, 1, 2))(bad["q"], bad["k"], bad["v"])
    assert all(np.all(np.isfinite(g)) for g in grads)
    np.testing.assert_allclose(np.sum(t_out * ct), sum(np.sum(g * t) for g, t in zip(grads, tangents)), rtol=1e-5)


def test_float64_values_beyond_float32_with_float32_queries_are_summed_in_float64(x64):
    """q, k float32 (weights in float32), v float64 holding 1e39: the weighted sum runs in float64, so the
    value is neither dropped nor turned into inf; its gradient is the weights' column, as for any value."""
    rng = np.random.default_rng(8)
    q, k = (rng.standard_normal((4, 4)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((4, 2))
    v[1, 0] = 1e39  # finite in float64, past float32's largest
    f = lambda q, k, v: jaxattn.attention(q, k, v, is_causal=True)
    out, w = (np.asarray(x) for x in f(q, k, v))
    assert out.dtype == np.float64 and w.dtype == np.float32 and np.all(np.isfinite(out))
    np.testing.assert_allclose(out, w.astype(np.float64) @ v, rtol=1e-12)  # row 0 masks key 1: unaffected
    np.testing.assert_allclose(out[1:, 0] / 1e39, w[1:, 1], rtol=1e-6)
    dv = np.asarray(jax.grad(lambda v: jnp.sum(f(q, k, v)[0][:, 0]))(v))
    np.testing.assert_allclose(dv[:, 0], w.sum(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(dv[:, 1], 0.0)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_masked_non_finite_bias_does_not_leak_and_a_kept_one_shows(value):
    T, S = 5, 6
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((T, 4), (S, 4), (S, 3)))
    bias = rng.standard_normal((T, S)).astype(np.float32)
    keep = _keep_np(T, S, None, True)
    bias_bad, bias_zero = bias.copy(), bias.copy()
    bias_bad[~keep], bias_zero[~keep] = value, 0.0  # every masked position (the future under causal)
    f = lambda q, k, v, b: jaxattn.attention(q, k, v, bias=b, is_causal=True)[0]
    np.testing.assert_array_equal(f(q, k, v, bias_bad), f(q, k, v, bias_zero))
    ct = rng.standard_normal((T, 3)).astype(np.float32)
    loss = lambda *a: jnp.sum(f(*a) * ct)
    for a, b in zip(jax.grad(loss, (0, 1, 2, 3))(q, k, v, bias_bad), jax.grad(loss, (0, 1, 2, 3))(q, k, v, bias_zero)):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # kept: NaN or +inf makes the row NaN; -inf is a weight of 0, i.e. the key is masked for that row
    kept = bias.copy()
    kept[3, 1] = value
    out = np.asarray(f(q, k, v, kept))
    if np.isnan(value) or value > 0:
        assert np.all(np.isnan(out[3])) and np.all(np.isfinite(np.delete(out, 3, axis=0)))
    else:
        row_mask = keep.copy()
        row_mask[3, 1] = False
        np.testing.assert_allclose(out, jaxattn.attention(q, k, v, bias=bias, mask=row_mask)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_a_row_whose_every_kept_logit_is_minus_inf_has_zero_weights(causal):
    """No key of the row has any weight: zeros, as a fully masked row, never 0/0 (with and without a mask)."""
    T, S = 4, 6
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((T, 4), (S, 4), (S, 3)))
    bias = np.zeros((T, S), np.float32)
    bias[2] = -np.inf
    out, w = (np.asarray(x) for x in jaxattn.attention(q, k, v, bias=bias, is_causal=causal))
    np.testing.assert_array_equal(w[2], 0.0)
    np.testing.assert_array_equal(out[2], 0.0)
    assert np.all(np.isfinite(w)) and np.allclose(np.delete(w, 2, axis=0).sum(axis=1), 1.0, rtol=1e-6)
    grads = jax.grad(lambda q, k, v: jnp.sum(jaxattn.attention(q, k, v, bias=bias, is_causal=causal)[0]), (0, 1, 2))(q, k, v)
    assert all(np.all(np.isfinite(g)) for g in grads)


@pytest.mark.parametrize("value", [np.nan, pytest.param(np.inf, marks=pytest.mark.slow)])
def test_multi_head_gqa_masked_non_finite_keys_and_values_do_not_leak(value):
    T, N, K, H, V = 7, 4, 2, 4, 3
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((T, N, H), (T, K, H), (T, K, V)))
    pad = np.arange(T) < T - 2
    k_bad, v_bad, k0, v0 = k.copy(), v.copy(), k.copy(), v.copy()
    k_bad[-2:, 1], v_bad[-1, 0], k0[-2:, 1], v0[-1, 0] = value, value, 0.0, 0.0  # padded keys of both kv heads
    f = lambda q, k, v: jaxattn.multi_head_attention(q, k, v, mask=pad, is_causal=True)[0]
    np.testing.assert_array_equal(f(q, k_bad, v_bad), f(q, k0, v0))
    loss = lambda *a: jnp.sum(f(*a) ** 2)
    for a, b in zip(jax.grad(loss, (0, 1, 2))(q, k_bad, v_bad), jax.grad(loss, (0, 1, 2))(q, k0, v0)):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # a kept key: a non-finite value there shows in the query heads that read its kv head only
    v_kept = v.copy()
    v_kept[-3, 0, 1] = value  # key T-3 (not padding), kv head 0, column 1: kept by rows >= T-3 (causal)
    out = np.asarray(jaxattn.multi_head_attention(q, k, v_kept, mask=pad, is_causal=True)[0])
    expect = np.zeros(out.shape, bool)
    expect[T - 3:, :2, 1] = True  # rows that keep key T-3, query heads 0 and 1 (read kv head 0), column 1
    np.testing.assert_array_equal(np.isnan(out), expect)


def test_masked_non_finite_values_cost_little_when_every_value_is_finite():
    """The bookkeeping for a padding or causal mask is O(S·V): no [T, S] x [S, V] product is added."""
    def dots(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                yield e
            for p in e.params.values():
                inner = getattr(p, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    yield from dots(inner)

    q = np.zeros((64, 8), np.float32)
    for kw in (dict(is_causal=True), dict(mask=np.arange(64) < 60), dict(mask=np.arange(64) < 60, is_causal=True)):
        found = list(dots(jax.make_jaxpr(lambda q: jaxattn.attention(q, q, q, **kw)[0])(q).jaxpr))
        assert len(found) == 2, (kw, [d.outvars[0].aval.shape for d in found])  # q kᵀ and weights v
