"""Probes against independent references: closed forms, jax.jacfwd, float64 NumPy; and the sweep's laws."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import probes
from jaxattn.probes import _sweep  # the sweep's internals, tested on purpose



@pytest.fixture
def rng(request):
    """A NumPy generator seeded per test (by name), so a test's data never depends on which others ran."""
    return np.random.default_rng(sum(map(ord, request.node.name)))


# ----------------------------------------------------------------------------------------------------
# float64 NumPy references.
# ----------------------------------------------------------------------------------------------------


def np_softmax(z, keep=None):
    z = np.asarray(z, np.float64)
    if keep is not None:
        z = np.where(keep, z, -np.inf)
    m = np.max(z, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(z - m)
    if keep is not None:
        e = np.where(keep, e, 0.0)
    s = e.sum(-1, keepdims=True)
    return e / np.where(s == 0, 1.0, s)


def np_entropy(p):
    p = np.asarray(p, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    return -terms.sum(-1)


def np_jacobian(p):
    """diag(p) - p pᵀ in float64, with 1 - p_s summed from the other weights (leave-one-out)."""
    p = np.asarray(p, np.float64)
    eye = np.eye(p.shape[-1])
    others = p @ (1.0 - eye)  # [..., S], Σ_{s'≠s} p_s'
    return np.where(eye > 0, (p * others)[..., None, :], -p[..., :, None] * p[..., None, :])


# ----------------------------------------------------------------------------------------------------
# Row statistics.
# ----------------------------------------------------------------------------------------------------


def test_row_stats_match_numpy_with_mask(rng):
    logits = rng.standard_normal((3, 5, 7)).astype(np.float32) * 2
    keep = rng.random((3, 5, 7)) > 0.3
    keep[0, 0] = False  # one fully masked row
    keep[1, 1] = False
    keep[1, 1, 2] = True  # one row with a single key
    p = np_softmax(logits, keep)
    stats = probes.row_stats(p.astype(np.float32), keep)
    h = np_entropy(p)
    n = keep.sum(-1)
    np.testing.assert_allclose(stats["entropy"], h, atol=1e-6)
    np.testing.assert_allclose(probes.entropy(p.astype(np.float32), keep), h, atol=1e-6)
    np.testing.assert_array_equal(stats["num_keys"], n)
    expected_norm = np.where(n > 1, h / np.log(np.maximum(n, 2)), 0.0)
    np.testing.assert_allclose(stats["normalized_entropy"], expected_norm, atol=1e-6)
    np.testing.assert_allclose(probes.normalized_entropy(p.astype(np.float32), keep), expected_norm, atol=1e-6)
    np.testing.assert_allclose(stats["max_weight"], p.max(-1), atol=1e-7)
    np.testing.assert_allclose(probes.max_weight(p.astype(np.float32), keep), p.max(-1), atol=1e-7)
    expected_support = np.where(n > 0, np.exp(h), 0.0)
    np.testing.assert_allclose(stats["effective_support"], expected_support, rtol=1e-6)
    np.testing.assert_allclose(probes.effective_support(p.astype(np.float32), keep), expected_support, rtol=1e-6)
    assert stats["entropy"][0, 0] == 0 and stats["max_weight"][0, 0] == 0 and stats["effective_support"][0, 0] == 0
    assert stats["entropy"][1, 1] == 0 and stats["normalized_entropy"][1, 1] == 0


def test_row_stats_closed_forms_uniform_and_one_hot():
    S = 8
    uniform = np.full((2, S), 1.0 / S, np.float32)
    np.testing.assert_allclose(probes.entropy(uniform), math.log(S), rtol=1e-6)
    np.testing.assert_allclose(probes.normalized_entropy(uniform), 1.0, rtol=1e-6)
    np.testing.assert_allclose(probes.effective_support(uniform), S, rtol=1e-5)
    one_hot = np.eye(S, dtype=np.float32)[:3]
    np.testing.assert_array_equal(probes.entropy(one_hot), 0.0)
    np.testing.assert_array_equal(probes.max_weight(one_hot), 1.0)
    np.testing.assert_array_equal(probes.effective_support(one_hot), 1.0)


def test_entropy_is_exactly_zero_not_nan_for_saturated_rows():
    # Unscaled attention at large d_k: the other weights underflow to exactly 0 in float32.
    q = np.full((1, 4096), 1.0, np.float32)
    k = np.stack([np.full(4096, 1.0), np.full(4096, 0.9), np.full(4096, -1.0)]).astype(np.float32)
    w = jaxattn.attention_weights(q, k, scale=1.0)  # logit gaps 410 and 8192: e^-410 = 0 in float32
    np.testing.assert_array_equal(np.asarray(w), [[1.0, 0.0, 0.0]])
    h = probes.entropy(w)
    assert np.asarray(h).tolist() == [0.0]
    naive = -jnp.sum(w * jnp.log(jnp.clip(w, 0.0)), axis=-1)  # what the probe must not do
    assert bool(jnp.isnan(naive[0]))
    assert np.asarray(probes.normalized_entropy(w)).tolist() == [0.0]
    grad = jax.grad(lambda w: probes.entropy(w).sum())(w)
    assert bool(jnp.all(jnp.isfinite(grad)))


def test_entropy_keeps_the_largest_weights_term_when_it_rounds_to_one():
    # Logit gaps 5 … 80: from a gap of ~17 the largest float32 weight is exactly 1 and p·log p = 0 there,
    # yet the row's entropy is ε(1 + gap) with ε the other weights' sum; the lost ε is 1/(1 + gap) of it.
    gaps = np.array([5.0, 12.0, 17.0, 20.0, 30.0, 50.0, 80.0])
    z = np.stack([np.zeros_like(gaps), -gaps, -gaps - 1.0, -gaps - 3.0], axis=-1)  # [7, 4] logits
    w = jax.nn.softmax(jnp.asarray(z, jnp.float32), axis=-1)
    assert np.all(np.asarray(w)[2:, 0] == 1.0)
    e = np.exp(z - z.max(-1, keepdims=True))
    eps = e[:, 1:].sum(-1)
    p = e / (1 + eps)[:, None]
    exact = np.log1p(eps) + (p * (z.max(-1, keepdims=True) - z)).sum(-1)  # log Z + Σ p (max z - z), float64
    np.testing.assert_allclose(probes.entropy(w), exact, rtol=1e-6)
    np.testing.assert_allclose(probes.row_stats(w)["entropy"], exact, rtol=1e-6)
    np.testing.assert_allclose(probes.normalized_entropy(w), exact / np.log(4), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.vmap(probes.entropy))(w), exact, rtol=1e-6)
    plain = -jnp.sum(jnp.where(w > 0, w * jnp.log(jnp.where(w > 0, w, 1.0)), 0.0), axis=-1)
    assert np.asarray(plain / exact - 1)[3] < -0.04  # the plain sum loses ~1/21 at a gap of 20
    # The derivative is the plain sum's, -(log p + 1); a row that is not a distribution is summed as it is.
    g = jax.grad(lambda w: probes.entropy(w).sum())(w)
    np.testing.assert_allclose(g[:2], -(np.log(np.asarray(w[:2], np.float64)) + 1), rtol=1e-5)
    assert probes.entropy(np.array([0.5, 0.2])) == pytest.approx(-(0.5 * math.log(0.5) + 0.2 * math.log(0.2)), rel=1e-6)
    # Half-precision maps: the largest weight rounds to 1 much earlier (logit gap 10 in float16), and the
    # sum-to-1 test allows for the rounding of the input dtype; a non-distribution stays a plain sum.
    z16 = np.array([[0.0, -10.0], [0.0, -7.0]])
    w16 = jax.nn.softmax(jnp.asarray(z16, jnp.float32), axis=-1).astype(jnp.float16)
    assert np.asarray(w16)[0, 0] == 1.0
    e16 = np.exp(-np.array([10.0, 7.0]))
    exact16 = np.log1p(e16) + e16 / (1 + e16) * np.array([10.0, 7.0])
    np.testing.assert_allclose(probes.entropy(w16), exact16, rtol=2e-3)  # float16 rounding of the small weight
    for dtype in (jnp.float16, jnp.bfloat16):
        half = jnp.asarray([0.5, 0.2], dtype)
        plain_half = -sum(float(x) * math.log(float(x)) for x in np.asarray(half, np.float64))
        assert float(probes.entropy(half)) == pytest.approx(plain_half, rel=1e-6)


def test_entropy_of_a_long_row_is_corrected_only_when_it_is_a_distribution():
    """S = 32768 keys: a row that does not sum to 1 (a key masked out of a distribution) is summed as it is,
    ``-Σ p log p`` over the kept keys; a saturated softmax row of that length keeps its largest weight's term."""
    S = 32768
    w = np.zeros(S, np.float32)
    w[:3] = 0.9, 0.085, 0.015
    keep = np.ones(S, bool)
    keep[2] = False
    kept = np.asarray(w[:2], np.float64)
    plain = -np.sum(kept * np.log(kept))
    np.testing.assert_allclose(probes.entropy(w, keep), plain, rtol=1e-6)
    np.testing.assert_allclose(probes.entropy(np.where(keep, w, 0)), plain, rtol=1e-6)
    np.testing.assert_allclose(probes.row_stats(w, keep)["effective_support"], np.exp(plain), rtol=1e-6)
    z = np.full(S, -30.0)  # one logit 30 above 32767 others: ε = 32767 e^-30, the largest weight rounds to 1
    z[0] = 0.0
    soft = jax.nn.softmax(jnp.asarray(z, jnp.float32))
    assert float(soft[0]) == 1.0
    eps = (S - 1) * np.exp(-30.0)
    exact = np.log1p(eps) + eps / (1 + eps) * 30.0
    np.testing.assert_allclose(probes.entropy(soft), exact, rtol=1e-4)


def test_head_entropy_causal_mask_matches_numpy(rng):
    L, N, T = 2, 3, 5
    logits = rng.standard_normal((L, N, T, T)).astype(np.float32)
    causal = np.asarray(jaxattn.causal_mask(T))
    p = np_softmax(logits, causal)
    got = probes.head_entropy(p.astype(np.float32), causal)
    np.testing.assert_allclose(got, np_entropy(p).mean(-1), atol=1e-6)
    n = causal.sum(-1)
    norm = np.where(n > 1, np_entropy(p) / np.log(np.maximum(n, 2)), 0.0).mean(-1)
    np.testing.assert_allclose(probes.head_entropy(p.astype(np.float32), causal, normalized=True), norm, atol=1e-6)
    assert got.shape == (L, N)


@pytest.mark.parametrize(
    "call, exc, message",
    [
        (lambda: probes.entropy(np.ones((2, 3), np.int32)), TypeError, "weights must have a floating dtype"),
        (lambda: probes.entropy(np.ones((2, 3), np.float32), np.ones((2, 3))), TypeError, "boolean keep-mask"),
        (lambda: probes.entropy(np.ones((2, 3), np.float32), np.ones((4, 3), bool)), ValueError, r"broadcastable"),
        (lambda: probes.entropy(np.float32(1.0)), ValueError, "at least 1 dimension"),
        (lambda: probes.head_entropy(np.ones(3, np.float32)), ValueError, r"\[..., T, S\]"),
        (lambda: probes.softmax_jacobian(np.ones(3, np.int8)), TypeError, "logits"),
        (lambda: probes.saturation_sweep(0, head_dims=()), ValueError, "head_dims"),
        (lambda: probes.saturation_sweep(0, num_keys=1), ValueError, "num_keys"),
        (lambda: probes.saturation_sweep(0, dtype=jnp.float64), ValueError, "enable_x64"),
        (lambda: probes.attention_grads(np.ones((2, 4)), np.ones((3, 4)), np.ones((3, 5)), np.ones((2, 4))), ValueError, "cotangent"),
        # q, k, v are checked (by the core's checks) before the cotangent is blamed
        (lambda: probes.attention_grads(np.ones(4), np.ones((3, 4)), np.ones((3, 5)), np.ones((2, 5))), ValueError, r"q must have 2 dimensions \[T, H\], received shape \(4,\)"),
        (lambda: probes.attention_grads(np.ones((2, 4)), np.ones((3, 4)), np.ones(3), np.ones((2, 5))), ValueError, r"v must have 2 dimensions \[S, V\], received shape \(3,\)"),
        (lambda: probes.attention_grads(np.ones((2, 4)), np.ones((3, 6)), np.ones((3, 5)), np.ones((2, 5))), ValueError, "same head dimension H"),
        (lambda: probes.attention_grads(np.ones((2, 4), np.int32), np.ones((3, 4)), np.ones((3, 5)), np.ones((2, 5))), TypeError, "q must have a floating dtype"),
        (lambda: probes.attention_grads(np.ones((2, 4)), np.ones((3, 4)), np.ones((3, 5)), np.ones((2, 5)), mask=np.ones((4, 3), bool)), ValueError, r"mask must be broadcastable"),
        # negative or non-finite gaps: P(D > x) would exceed 1
        (lambda: probes.gap_survival(-0.5, 8), ValueError, r"x must be finite and >= 0.*-0\.5"),
        (lambda: probes.gap_survival([0.1, np.inf], 8), ValueError, r"x must be finite and >= 0.*inf"),
        (lambda: probes.gap_survival("1", 8), TypeError, "x must be a real number"),
        (lambda: probes.predicted_laws((64,), 8, gap_threshold=-1.0), ValueError, r"gap_threshold must be finite and >= 0.*-1\.0"),
        (lambda: probes.predicted_laws((64,), 8, gap_threshold=float("nan")), ValueError, r"gap_threshold must be finite.*nan"),
        (lambda: probes.predicted_laws((64,), 8, gap_threshold=[1.0, 2.0]), ValueError, r"gap_threshold must be a scalar, received shape \(2,\)"),
        (lambda: probes.underflow_gap(np.int32), TypeError, "dtype must be a floating dtype.*received int32"),
        (lambda: probes.underflow_gap(bool), TypeError, "dtype must be a floating dtype.*received bool"),
        # fits in log space: zeros, negatives, non-finite values, mismatched shapes
        (lambda: probes.fit_power_law([0.0, 1.0, 2.0], [1.0, 2.0, 3.0]), ValueError, r"x must be finite and > 0.*\[0\. 1\. 2\.\]"),
        (lambda: probes.fit_power_law([-1.0, 2.0], [1.0, 2.0]), ValueError, r"x must be finite and > 0"),
        (lambda: probes.fit_power_law([1.0, 2.0], [1.0, 0.0]), ValueError, r"y must be finite and > 0"),
        (lambda: probes.fit_power_law([1.0, 2.0, 3.0], [1.0, 2.0]), ValueError, r"x and y must both have shape \[P\], received x \(3,\) and y \(2,\)"),
        (lambda: probes.fit_stretched_exp([-4.0, 4.0], [1.0, 2.0]), ValueError, r"x must be finite and >= 0"),
        (lambda: probes.fit_stretched_exp([1.0, np.nan], [1.0, 2.0]), ValueError, r"x must be finite"),
        (lambda: probes.fit_stretched_exp([1.0, 4.0], [1.0, np.inf]), ValueError, r"y must be finite and > 0"),
        (lambda: probes.fit_stretched_exp([4.0, 4.0], [1.0, 2.0]), ValueError, "at least 2 distinct values"),
    ],
)
def test_invalid_input_messages(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


# ----------------------------------------------------------------------------------------------------
# The softmax Jacobian.
# ----------------------------------------------------------------------------------------------------


def test_softmax_jacobian_equals_jacfwd(rng):
    logits = jnp.asarray(rng.standard_normal((4, 6, 9)) * 3, jnp.float32)
    jac = probes.softmax_jacobian(logits)
    auto = jax.vmap(jax.vmap(jax.jacfwd(jax.nn.softmax)))(logits)
    assert jac.shape == (4, 6, 9, 9)
    np.testing.assert_allclose(jac, auto, atol=1e-6)


def test_masked_softmax_jacobian_equals_jacfwd_of_the_core(rng):
    T, S = 5, 6
    logits = jnp.asarray(rng.standard_normal((T, S)) * 2, jnp.float32)
    keep = jnp.asarray(rng.random((T, S)) > 0.4).at[0].set(False)
    q = jnp.eye(T, S, dtype=jnp.float32)
    # The core's weights as a function of an additive bias = d softmax / d logits (same masked softmax).
    auto = jax.jit(jax.jacfwd(lambda b: jaxattn.attention_weights(q, jnp.zeros((S, S), jnp.float32), mask=keep, bias=b)))(logits)
    auto_rows = jnp.stack([auto[t, :, t, :] for t in range(T)])  # [T, S, S]
    np.testing.assert_allclose(probes.softmax_jacobian(logits, keep), auto_rows, atol=1e-6)
    assert float(jnp.abs(probes.softmax_jacobian(logits, keep)[0]).max()) == 0.0


def test_jacobian_norms_match_float64_reference_including_saturated_rows(rng):
    z = rng.standard_normal((64, 12)) * np.array([0.5, 3.0, 20.0, 60.0])[rng.integers(0, 4, 64)][:, None]
    z[0] = [0.0, -70.0] + [-200.0] * 10  # p2 = e^-70: p2² underflows float32, p2 does not
    z[1] = [0.0, -20.0, -20.0] + [-300.0] * 9  # 1 - p_max rounds to 0 in float32
    z[2] = 0.0  # uniform
    norms = probes.softmax_jacobian_norms(jnp.asarray(z, jnp.float32))
    ref = np_jacobian(np_softmax(z))
    frob = np.sqrt((ref**2).sum((-1, -2)))
    np.testing.assert_allclose(norms["frobenius"], frob, rtol=2e-5, atol=1e-37)  # atol: below float32's range
    np.testing.assert_allclose(norms["nuclear"], np.trace(ref, axis1=-2, axis2=-1), rtol=2e-5, atol=1e-37)
    # nuclear norm = sum of eigenvalues (J is PSD); closed form on the uniform row: ‖J‖_F² = (S-1)/S²
    eig = np.linalg.eigvalsh(ref[3:])
    assert eig.min() > -1e-12
    np.testing.assert_allclose(np.asarray(norms["nuclear"])[3:], eig.sum(-1), rtol=1e-5, atol=1e-37)
    np.testing.assert_allclose(norms["frobenius"][2], math.sqrt(11) / 12, rtol=1e-6)
    # two keys, closed form: ‖J‖_F = 2 p (1 - p)
    p = 1 / (1 + math.exp(-3.0))
    two = probes.softmax_jacobian_norms(jnp.array([[3.0, 0.0]], jnp.float32))
    np.testing.assert_allclose(two["frobenius"], [2 * p * (1 - p)], rtol=1e-6)


def test_closed_form_jacobian_diagonal_does_not_round_to_zero():
    z = jnp.array([[0.0, -20.0]], jnp.float32)  # p_max = 1 - 2e-9 rounds to 1.0 in float32
    jac = probes.softmax_jacobian(z)[0]
    np.testing.assert_allclose(jac, np_jacobian(np_softmax(np.array([0.0, -20.0]))), rtol=1e-6)


# ----------------------------------------------------------------------------------------------------
# Gradient probes.
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [None, 1.0, 0.3])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_grads_match_float64_closed_form(scale, masked, rng):
    T, S, H, V = 4, 6, 8, 5
    q, k = rng.standard_normal((T, H)), rng.standard_normal((S, H))
    v, r = rng.standard_normal((S, V)), rng.standard_normal((T, V))
    keep = (rng.random((T, S)) > 0.3) if masked else None
    f32 = lambda x: np.asarray(x, np.float32)
    grads = probes.attention_grads(f32(q), f32(k), f32(v), f32(r), scale=scale, mask=keep)
    c = 1 / math.sqrt(H) if scale is None else scale
    p = np_softmax(c * q @ k.T, keep)
    g = r @ v.T  # [T, S], dL/dp
    dz = p * (g - (p * g).sum(-1, keepdims=True))
    np.testing.assert_allclose(grads["logits"], dz, atol=2e-6)
    np.testing.assert_allclose(grads["q"], c * dz @ k, atol=1e-5)
    np.testing.assert_allclose(grads["k"], c * dz.T @ q, atol=1e-5)
    np.testing.assert_allclose(grads["v"], p.T @ r, atol=1e-5)
    np.testing.assert_allclose(grads["loss"], (r * (p @ v)).sum(), rtol=1e-5)
    norms = probes.grad_norms(grads)
    np.testing.assert_allclose(norms["logits"], np.linalg.norm(dz, axis=-1), atol=2e-6)
    np.testing.assert_allclose(norms["k"], np.linalg.norm(c * dz.T @ q, axis=-1), atol=1e-5)
    # a row with at most one kept key has p one-hot (or zero): its softmax gradient is exactly zero
    single = np.zeros(T, bool) if keep is None else keep.sum(-1) <= 1
    np.testing.assert_array_equal(norms["logits_zero"], single)


def test_grad_norms_flag_rows_whose_gradient_underflows_per_dtype():
    q = np.array([[1.0, 0.0], [1.0, 0.0]])
    k = np.array([[0.0, 0.0], [-20.0, 0.0], [-120.0, 0.0]])  # gaps 20 (row alive in f32) and 120
    v = np.array([[1.0], [-1.0], [0.5]])
    r = np.ones((2, 1))
    grads = jax.jit(probes.attention_grads, static_argnames="scale")
    for dtype, zero in [(np.float32, False), (np.float16, True)]:
        g = grads(*(x.astype(dtype) for x in (q, k, v, r)), scale=1.0)
        assert g["logits"].dtype == dtype
        norms = probes.grad_norms(g)
        assert np.asarray(norms["logits_zero"]).tolist() == [zero, zero]
    kk = np.array([[0.0, 0.0], [-100.0, 0.0]])  # gap 100 > 87.3: exactly zero in float32 too
    g = grads(*(x.astype(np.float32) for x in (q, kk, v[:2], r)), scale=1.0)
    assert np.asarray(probes.grad_norms(g)["logits_zero"]).tolist() == [True, True]


# ----------------------------------------------------------------------------------------------------
# Var(q·k) and the sweep.
# ----------------------------------------------------------------------------------------------------


def test_dot_product_variance_is_d_k_for_every_d_k():
    res = probes.dot_product_variance(0, probes.DEFAULT_HEAD_DIMS, num_samples=2048)
    assert res["head_dims"].tolist() == [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert np.all(np.abs(res["ratio"] - 1) < 0.1), res["ratio"]
    assert np.all(res["std_error"] < 0.05)


SMALL = dict(num_trials=8, num_queries=32, num_keys=16, value_dim=4)


@pytest.fixture(scope="module")
def small_sweep():
    """A small sweep in float32 over the default d_k = 8 … 4096."""
    return probes.saturation_sweep(7, **SMALL)


def test_sweep_shapes_and_var_ratio(small_sweep):
    res = small_sweep
    P, R = len(probes.DEFAULT_HEAD_DIMS), res["num_trials"]
    assert res["entropy"].shape == (2, P, R, 32)
    assert res["k_grad_norm"].shape == (2, P, R, 16)
    assert res["dot_sq"].shape == (2, P, R)
    summary = probes.summarize_sweep(res)
    assert np.all(np.abs(summary["var_ratio"] - 1) < 0.1), summary["var_ratio"]
    assert summary["entropy"]["quantiles"].shape == (2, P, 3)


def test_sweep_unscaled_entropy_falls_monotonically_scaled_stays_in_a_band(small_sweep):
    s = probes.summarize_sweep(small_sweep)
    median = s["entropy"]["median"][1]
    assert np.all(np.diff(median) < 0), median
    # The mean is carried by rare near-ties (noisy with 256 rows): monotone over factors of 4 in d_k.
    mean = s["entropy"]["mean"][1]
    assert np.all(np.diff(mean[::2]) < 0) and np.all(np.diff(mean[1::2]) < 0), mean
    assert mean[-1] < 0.1 * mean[0]
    assert s["entropy"]["median"][1][-1] < 1e-3  # toward one-hot
    assert s["max_weight"]["median"][1][-1] > 0.999
    # Scaled: flat across d_k = 8 … 4096. The bands are about twice the largest spread seen on sweeps of
    # 256 to 1024 rows per d_k (1.049 for max weight and 1.134 for ‖∂L/∂logits‖ at 256 rows).
    for name, band in [("entropy", 1.03), ("max_weight", 1.1), ("jacobian_norm", 1.03), ("logit_grad_norm", 1.25),
                       ("q_grad_norm", 1.25), ("k_grad_norm", 1.25)]:
        scaled = s[name]["mean"][0]
        assert scaled.max() / scaled.min() < band, (name, scaled.max() / scaled.min())


def np_scaled_rows(d, S, V, n, rng):
    """float64 NumPy rows of the scaled model, drawn from their law: given q, the logits q·k_s/√d are S
    i.i.d. N(0, |q|²/d) with |q|² ~ χ²_d; given r, the read-outs r·v_s are i.i.d. N(0, |r|²), |r|² ~ χ²_V / V."""
    z = np.sqrt(rng.chisquare(d, (n, 1)) / d) * rng.standard_normal((n, S))
    u = np.sqrt(rng.chisquare(V, (n, 1)) / V) * rng.standard_normal((n, S))
    p = np_softmax(z)
    g = p * (u - (p * u).sum(-1, keepdims=True))  # ∂L/∂z
    return {"entropy": np_entropy(p), "max_weight": p.max(-1), "jacobian_norm": np.sqrt((np_jacobian(p) ** 2).sum((-1, -2))),
            "logit_grad_norm": np.linalg.norm(g, axis=-1)}


def test_sweep_scaled_level_matches_a_float64_numpy_monte_carlo(small_sweep, rng):
    # The level, not only the flatness: the sweep's scaled means against 20 000 NumPy rows per d_k drawn
    # from the same law. A scale of 1/d_k or 1/√(2d_k) keeps the band flat but moves the level.
    s = probes.summarize_sweep(small_sweep)
    R, T, S, V = (small_sweep[n] for n in ("num_trials", "num_queries", "num_keys", "value_dim"))
    for name in ("entropy", "max_weight", "jacobian_norm", "logit_grad_norm"):
        ref = np.array([np_scaled_rows(d, S, V, 20_000, rng)[name].mean() for d in probes.DEFAULT_HEAD_DIMS])
        x = np.asarray(small_sweep[name][0], np.float64)  # [P, R, T]
        # standard error of the pooled mean with the trial as the independent unit (rows of a trial share k, v)
        se = x.mean(-1).std() / math.sqrt(x.shape[0] * R)
        assert abs(s[name]["mean"][0].mean() - ref.mean()) < 5 * se + 1e-3, (name, s[name]["mean"][0].mean(), ref.mean(), se)


def test_vmapped_sweep_equals_the_single_trial_function(small_sweep):
    keys = jax.random.split(jax.random.key(7), (10, SMALL["num_trials"]))
    # Unscaled float32 logits reach ~100; the two programs sum them in different orders, and e^{-gap}
    # turns their last-bit differences into relative differences of up to ~1e-2 on saturated rows. A
    # saturated row's gradient is a cancellation, p (g - sum p g), so its error is absolute: about eps32
    # times the array's largest entry, whatever the entry's own size (a 1e-6 entry beside a 1.6 moved by
    # 3.4e-7 between the programs), hence atol in the unscaled case.
    for p, r, mode, rtol in [(0, 0, 0, 1e-4), (9, 5, 0, 1e-4), (0, 3, 1, 5e-2), (9, 1, 1, 5e-2)]:
        trial = probes.sweep_trial_fn(probes.DEFAULT_HEAD_DIMS[p], num_queries=32, num_keys=16, value_dim=4)
        one = trial(keys[p, r], mode == 0)
        assert set(one) == set(small_sweep) - {"head_dims", "scaled", "num_trials", "num_queries", "num_keys", "value_dim", "dtype"}
        for name in ("entropy", "jacobian_norm", "logit_grad_norm", "q_grad_norm", "k_grad_norm", "dot_sq"):
            expected = small_sweep[name][mode, p, r]
            atol = 1e-6 * float(np.max(np.abs(expected))) if mode == 1 else 1e-30
            np.testing.assert_allclose(one[name], expected, rtol=rtol, atol=atol, err_msg=f"{name}, mode {mode}")
    assert probes.sweep_trial_fn(8) is probes.sweep_trial_fn(8, num_queries=16)  # compiled once per configuration
    with pytest.raises(ValueError, match=r"^head_dim must be a positive int \(d_k\), received 0$"):
        probes.sweep_trial_fn(0)


def test_a_bfloat16_sweeps_entropy_is_probes_entropy_of_its_own_map():
    """The sweep's row statistics read the map in the dtype it was made in, as ``probes.entropy`` does: a
    bfloat16 map's saturated rows keep the largest weight's term (cast to float32 first, they lost up to
    12% at d_k = 256, unscaled)."""
    T = S = V = 16
    H = 256
    key = jax.random.split(jax.random.key(0), (1, 1))[0, 0]  # the sweep's trial (0, 0) key
    trial = probes.sweep_trial_fn(H, dtype=jnp.bfloat16)(key, False)  # unscaled
    z = jax.random.normal(key, ((T + S) * (H + V),)).reshape(T + S, H + V)  # the trial's draws
    q, k, v, r = (z[:T, :H].astype(jnp.bfloat16), z[T:, :H].astype(jnp.bfloat16), z[T:, H:].astype(jnp.bfloat16),
                  (z[:T, H:] / math.sqrt(V)).astype(jnp.bfloat16))
    weights = probes.attention_grads(q, k, v, r, scale=1.0)["weights"]
    np.testing.assert_array_equal(trial["entropy"], probes.entropy(weights))
    x = np.asarray(q, np.float64) @ np.asarray(k, np.float64).T
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    exact = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)
    np.testing.assert_allclose(trial["entropy"], exact, rtol=5e-3)


def test_one_trial_against_float64_numpy():
    T, S, V, H = 8, 8, 4, 32
    draw = jax.jit(lambda key: _sweep._draw(key, head_dim=H, T=T, S=S, V=V, dtype=jnp.float32))
    q, k, v, r = draw(jax.random.key(3))
    assert q.shape == (T, H) and k.shape == (S, H) and v.shape == (S, V) and r.shape == (T, V)
    rows = jax.jit(_sweep._probe_rows)(q, k, v, r, jnp.float32(1.0))
    qn, kn, vn, rn = (np.asarray(x, np.float64) for x in (q, k, v, r))
    p = np_softmax(qn @ kn.T)
    dz = p * (rn @ vn.T - (p * (rn @ vn.T)).sum(-1, keepdims=True))
    np.testing.assert_allclose(rows["entropy"], np_entropy(p), atol=1e-5)
    np.testing.assert_allclose(rows["jacobian_norm"], np.sqrt((np_jacobian(p) ** 2).sum((-1, -2))), rtol=1e-4, atol=1e-30)
    # The float32 softmax VJP computes ∂L/∂z at the largest weight as p·(g - Σ p g): on a nearly one-hot
    # row that cancels to about eps32 · |g| ≈ 1e-7 absolute, hence the atol.
    np.testing.assert_allclose(rows["logit_grad_norm"], np.linalg.norm(dz, axis=-1), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(rows["q_grad_norm"], np.linalg.norm(dz @ kn, axis=-1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(rows["dot_sq"], np.mean((qn @ kn.T) ** 2), rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# The laws.
# ----------------------------------------------------------------------------------------------------


def test_gap_law_closed_form_for_two_keys_and_monte_carlo():
    # S = 2: D = |Z1 - Z2| is half-normal with scale √2: P(D > x) = 2 (1 - Φ(x/√2)), f_D(0) = 1/√π.
    x = np.array([0.0, 0.5, 1.0, 2.5])
    erfc = np.array([math.erfc(t / 2) for t in x])
    np.testing.assert_allclose(probes.gap_survival(x, 2), erfc, atol=1e-9)
    np.testing.assert_allclose(probes.gap_density_at_zero(2), 1 / math.sqrt(math.pi), rtol=1e-9)
    # S = 16 against a NumPy Monte Carlo of the top-two gap.
    z = np.sort(np.random.default_rng(0).standard_normal((200_000, 16)), axis=-1)
    d = z[:, -1] - z[:, -2]
    for t in (0.1, 0.4, 1.0):
        assert abs(probes.gap_survival(t, 16) - (d > t).mean()) < 4e-3
    assert abs(probes.gap_median(16) - np.median(d)) < 5e-3
    h = 0.02
    density = (d < h).mean() / h
    assert abs(probes.gap_density_at_zero(16) - density) < 0.05 * density
    assert abs(probes.gap_survival(probes.gap_median(16), 16) - 0.5) < 1e-9


def test_underflow_gaps():
    assert probes.underflow_gap(jnp.float32) == pytest.approx(126 * math.log(2))
    assert probes.underflow_gap(jnp.bfloat16) == pytest.approx(126 * math.log(2))
    assert probes.underflow_gap(jnp.float16) == pytest.approx(25 * math.log(2))
    assert probes.underflow_gap(np.float64) == pytest.approx(1022 * math.log(2))


LAW_DIMS = (64, 128, 256, 512, 1024)


@pytest.fixture(scope="module")
def law_sweep():
    with jax.enable_x64(True):
        return probes.saturation_sweep(11, head_dims=LAW_DIMS, num_trials=128, num_queries=64, num_keys=8, value_dim=16, dtype=jnp.float64)


@pytest.mark.slow  # a long statistical run: `make test-slow`
def test_median_law_stretched_exponential_in_sqrt_d_k(law_sweep):
    s = probes.summarize_sweep(law_sweep)
    m = probes.gap_median(8)
    b, c = probes.fit_stretched_exp(LAW_DIMS, s["jacobian_norm"]["median"][1])
    assert abs(b / m - 1) < 0.1, (b, m)
    assert abs(c / 2 - 1) < 0.3, c  # predicted 2 as d_k → ∞; this fit (d_k = 64 … 1024, seed 11) gives 1.80
    b, _ = probes.fit_stretched_exp(LAW_DIMS, s["entropy"]["median"][1] / (1 + m * np.sqrt(LAW_DIMS)))
    assert abs(b / m - 1) < 0.1, (b, m)
    b, _ = probes.fit_stretched_exp(LAW_DIMS, s["logit_grad_norm"]["median"][1])
    assert abs(b / m - 1) < 0.1, (b, m)
    b, c = probes.fit_stretched_exp(LAW_DIMS, 1 - s["max_weight"]["median"][1])
    assert abs(b / m - 1) < 0.1 and abs(c - 1) < 0.2, (b, c)  # 1 - p_max ≈ p_2 ≈ e^{-gap}


@pytest.mark.slow  # a long statistical run: `make test-slow`
def test_median_laws_of_the_query_and_key_gradients(law_sweep):
    # ∂L/∂q_t = Σ_s ∂L/∂z_ts k_s carries |k_a - k_b| ≈ √(2 d_k): median c·√d_k·exp(-m_S √d_k).
    # ∂L/∂k_s = Σ_t ∂L/∂z_ts q_t is led by the row where key s is closest to the top: b = median_s min_t G_ts.
    from jaxattn import lab

    s = probes.summarize_sweep(law_sweep)
    sqrt_d = np.sqrt(LAW_DIMS)
    b, _ = probes.fit_stretched_exp(LAW_DIMS, s["q_grad_norm"]["median"][1] / sqrt_d)
    assert abs(b / probes.gap_median(8) - 1) < 0.1, b  # measured 0.4303, predicted 0.4429
    b_key = lab.key_gap_median(64, 8)  # 0.030: 64 rows give each key a small gap somewhere
    b, _ = probes.fit_stretched_exp(LAW_DIMS, s["k_grad_norm"]["median"][1] / sqrt_d)
    # Not yet asymptotic here (√d_k·b ≈ 1 at d_k = 1024): the fit lands above b_key, measured 0.0414 (1.37×).
    # Over seeds 11 … 16: 1.22 … 1.41× with these 128 trials, 1.09 … 1.31× with 32 trials of the vectors.
    # (The row gap m_S = 0.44 in its place would be 14×; at the lab's T = S = 16 the fit is within 5%.)
    assert 1.0 < b / b_key < 1.6, (b, b_key)
    # The mean ∂L/∂q tends to the constant √(2/π) f_D(0) E‖r‖ (not to 0): 1.055 at d_k = 1024, limit 1.118.
    limit = math.sqrt(2 / math.pi) * probes.gap_density_at_zero(8) * lab.readout_norm_mean(16)
    assert abs(s["q_grad_norm"]["mean"][1][-1] / limit - 1) < 0.1
    assert abs(probes.fit_power_law(LAW_DIMS, s["q_grad_norm"]["mean"][1])[0]) < 0.15  # exponent ≈ 0, not -1/2


@pytest.mark.slow  # a long statistical run: `make test-slow`
def test_mean_law_power_minus_one_half(law_sweep):
    s = probes.summarize_sweep(law_sweep)
    laws = probes.predicted_laws(LAW_DIMS, 8)
    sqrt_d = np.sqrt(LAW_DIMS)
    for name, key in [("jacobian_norm", "mean_jacobian"), ("entropy", "mean_entropy"), ("logit_grad_norm", "mean_logit_grad")]:
        a, c = probes.fit_power_law(LAW_DIMS, s[name]["mean"][1])
        assert abs(a + 0.5) < 0.1, (name, a)
        # the constant, pooled over d_k (each mean rests on a few dozen near-tied rows)
        constant = np.mean(s[name]["mean"][1] * sqrt_d)
        assert abs(constant / np.mean(laws[key] * sqrt_d) - 1) < 0.15, (name, constant)
    constant = np.mean((1 - s["max_weight"]["mean"][1]) * sqrt_d)
    assert abs(constant / np.mean(laws["mean_one_minus_max"] * sqrt_d) - 1) < 0.15


@pytest.mark.slow  # a long statistical run: `make test-slow`
@pytest.mark.parametrize(
    "dtype, head_dims, S",
    [(jnp.float16, (1024,), 4), (jnp.float32, (4096,), 2), (jnp.bfloat16, (4096,), 2)],  # one d_k each: compile time
)
def test_zero_gradient_fraction_law_per_dtype(dtype, head_dims, S):
    res = probes.saturation_sweep(5, head_dims=head_dims, num_trials=4, num_queries=96, num_keys=S, value_dim=2, dtype=dtype)
    zero = probes.summarize_sweep(res)["zero_fraction"]["logit_grad"]
    predicted = probes.predicted_laws(head_dims, S, gap_threshold=probes.underflow_gap(dtype))["zero_fraction"]
    n = 4 * 96
    assert np.all(np.abs(zero[1] - predicted) < 4 * np.sqrt(predicted * (1 - predicted) / n) + 0.02), (zero[1], predicted)
    assert np.all(predicted > 0.15)
    assert np.all(zero[0] == 0)  # scaled: never


def test_chunked_sweep_gives_the_same_numbers():
    # lax.map over chunks of 3 trials (and a remainder of 2) against the single-trial function, key by key.
    config = dict(num_queries=4, num_keys=8, value_dim=2)
    chunked = probes.saturation_sweep(7, head_dims=(64,), num_trials=5, trials_per_batch=3, **config)
    keys = jax.random.split(jax.random.key(7), (1, 5))
    trial = probes.sweep_trial_fn(64, **config)
    for r in range(5):
        for mode in (0, 1):
            one = trial(keys[0, r], mode == 0)
            for name in ("entropy", "jacobian_norm", "logit_grad_norm", "dot_sq"):
                np.testing.assert_allclose(chunked[name][mode, 0, r], one[name], rtol=1e-3, atol=1e-30)
    assert chunked["entropy"].shape == (2, 1, 5, 4)


# --- independent references and input checks ---


def np_trial(q, k, v, r, scale):
    """Every field of one sweep trial in float64 NumPy, gradients by the hand-derived formulas.

    ``L = Σ r ⊙ softmax(c q kᵀ) v``: with ``g = r vᵀ``, ``∂L/∂z = p ⊙ (g - Σ_s p g)``, ``∂L/∂q = c ∂L/∂z k``,
    ``∂L/∂k = c (∂L/∂z)ᵀ q``; the softmax Jacobian ``diag(p) - p pᵀ`` is formed and its Frobenius norm taken.
    """
    q, k, v, r = (np.asarray(x, np.float64) for x in (q, k, v, r))
    dots = q @ k.T  # [T, S]
    p = np_softmax(scale * dots)
    g = r @ v.T  # [T, S], ∂L/∂p
    dz = p * (g - (p * g).sum(-1, keepdims=True))
    h = np_entropy(p)
    return {
        "entropy": h,
        "normalized_entropy": h / math.log(k.shape[0]),
        "max_weight": p.max(-1),
        "jacobian_norm": np.sqrt((np_jacobian(p) ** 2).sum((-1, -2))),
        "logit_grad_norm": np.linalg.norm(dz, axis=-1),
        "q_grad_norm": np.linalg.norm(scale * dz @ k, axis=-1),
        "k_grad_norm": np.linalg.norm(scale * dz.T @ q, axis=-1),
        "dot_sq": np.mean(dots**2),
        "dot_mean": np.mean(dots),
    }, np.sort(scale * dots, -1)


# (d_k index into DEFAULT_HEAD_DIMS, trial, unscaled rows past float32's underflow gap) of the small
# sweep: d_k = 8 (no row near saturation) and d_k = 4096 (unscaled: 3 rows whose top-two logit gap exceeds
# float32's 87.3, all at least 10 from it). The same d_k as test_vmapped_sweep_equals_the_single_trial_function.
TRIAL_CASES = [(0, 2, 0), (9, 7, 3)]


@pytest.mark.parametrize("p, r, saturated", TRIAL_CASES)
@pytest.mark.parametrize("scaled", [True, False])
def test_every_trial_field_against_float64_numpy_and_the_sweep(scaled, p, r, saturated, small_sweep):
    H = probes.DEFAULT_HEAD_DIMS[p]
    sweep = small_sweep
    T, S, V, R = (sweep[name] for name in ("num_queries", "num_keys", "value_dim", "num_trials"))
    key = jax.random.split(jax.random.key(7), (len(probes.DEFAULT_HEAD_DIMS), R))[p, r]
    draw = lambda key: _sweep._draw(key, head_dim=H, T=T, S=S, V=V, dtype=jnp.float32)
    q, k, v, r_ = jax.jit(draw)(key)
    one = probes.sweep_trial_fn(H, num_queries=T, num_keys=S, value_dim=V)(key, scaled)
    entry = {name: sweep[name][0 if scaled else 1, p, r] for name in one}
    ref, z = np_trial(q, k, v, r_, 1 / math.sqrt(H) if scaled else 1.0)
    assert set(one) == set(ref) | {"logit_grad_zero", "q_grad_zero", "jacobian_zero"}
    # Rows whose other weights are all below float32's smallest normal number are exactly one-hot there:
    # every gradient of the row, and the Jacobian, is exactly 0. The float64 gap says which rows.
    gap = z[:, -1] - z[:, -2]
    zero = gap > probes.underflow_gap(jnp.float32)
    assert np.all(np.abs(gap - probes.underflow_gap(jnp.float32)) > 1.0)  # no row at the edge
    assert zero.sum() == (0 if scaled else saturated)
    # float32 against float64. float32 rounds each logit by ~eps32·Σ_h |q_h k_h|, and quantities of size
    # e^{-gap} inherit that times the gap: relative errors up to ~10·eps32·max|z| (1e-4 at the unscaled
    # d_k = 4096's |z| ≈ 220); ∂L/∂q and ∂L/∂k sum signed terms of those (×4). Absolute floors: a saturated
    # row's p_max rounds to 1, dropping its -p_max·log p_max ≈ 1 - p_max < eps32 from the entropy, and
    # the float32 VJP's p·(g - Σ p g) at the largest weight cancels to ~eps32·|g| (times |k_s| for ∂L/∂q).
    rtol = 40 * np.finfo(np.float32).eps * np.abs(z).max()
    c_sqrt_h = 1.0 if scaled else math.sqrt(H)  # scale · √d_k
    tol = {
        "entropy": dict(rtol=rtol, atol=1e-7),
        "normalized_entropy": dict(rtol=rtol, atol=1e-7),
        "max_weight": dict(rtol=rtol, atol=0),
        "jacobian_norm": dict(rtol=rtol, atol=1e-30),
        "logit_grad_norm": dict(rtol=rtol, atol=1e-6),
        "q_grad_norm": dict(rtol=4 * rtol, atol=1e-6 * c_sqrt_h),
        "k_grad_norm": dict(rtol=4 * rtol, atol=1e-6 * c_sqrt_h),
        "dot_sq": dict(rtol=1e-5, atol=0),
        "dot_mean": dict(rtol=0, atol=1e-6 * math.sqrt(H)),
    }
    for source in (one, entry):
        for name, expected in ref.items():
            np.testing.assert_allclose(source[name], expected, err_msg=name, **tol[name])
        for name in ("logit_grad_zero", "q_grad_zero", "jacobian_zero"):
            np.testing.assert_array_equal(source[name], zero, err_msg=name)
        assert np.all(np.asarray(source["jacobian_norm"])[zero] == 0) and np.all(np.asarray(source["logit_grad_norm"])[zero] == 0)


def test_fits_recover_exact_constants_in_float64():
    x = np.array([8.0, 64.0, 256.0, 1024.0, 4096.0])
    a, c = probes.fit_power_law(x, 1.7 * x**-0.5)
    assert abs(a + 0.5) < 1e-10 and abs(c / 1.7 - 1) < 1e-10, (a, c)
    a, c = probes.fit_power_law([1, 2, 3], [3.0, 3.0 * 2**2.25, 3.0 * 3**2.25])  # int x, positive exponent
    assert abs(a - 2.25) < 1e-10 and abs(c / 3 - 1) < 1e-10, (a, c)
    b, c = probes.fit_stretched_exp(x, 2.0 * np.exp(-0.37 * np.sqrt(x)))  # y down to e^-23.7
    assert abs(b - 0.37) < 1e-10 and abs(c / 2 - 1) < 1e-10, (b, c)
    xz = np.array([0.0, 1.0, 9.0])  # x = 0 is a valid point of c·exp(-b√x)
    b, c = probes.fit_stretched_exp(xz, 0.5 * np.exp(-1.3 * np.sqrt(xz)))
    assert abs(b - 1.3) < 1e-10 and abs(c / 0.5 - 1) < 1e-10, (b, c)


def test_grad_norms_against_numpy_on_known_gradients():
    # float16 gradients: a zero row, a row of subnormal-sized entries (its square underflows float16, the
    # entries do not), a row whose squares overflow float16 (300² > 65504): norms must be taken in float32.
    rows = np.array([[0.0, 0.0, 0.0], [1e-7, 0.0, -1e-7], [300.0, -300.0, 1.0], [0.5, 2.0, -1.0]], np.float16)
    grads = {"logits": rows, "q": rows[::-1], "k": rows[:3, :2], "v": rows}
    norms = probes.grad_norms({name: jnp.asarray(x) for name, x in grads.items()})
    for name, g in grads.items():
        expected = np.linalg.norm(g.astype(np.float64), axis=-1)
        assert norms[name].dtype == jnp.float32
        np.testing.assert_allclose(norms[name], expected, rtol=1e-6, atol=0, err_msg=name)
    assert np.asarray(norms["logits_zero"]).tolist() == [True, False, False, False]
    assert np.asarray(norms["q_zero"]).tolist() == [False, False, False, True]
    # float32 rows of entries whose squares underflow (1e-27² is 0): their norms, not 0; inf and NaN kept
    tiny = np.array([[0.0, -8.756511e-27], [3e-30, 4e-30], [np.inf, 1.0], [np.nan, 1.0]], np.float32)
    norms = probes.grad_norms({"logits": tiny, "q": tiny, "k": tiny, "v": tiny})
    np.testing.assert_allclose(norms["logits"][:2], [8.756511e-27, 5e-30], rtol=1e-6)
    assert np.isinf(norms["q"][2]) and np.isnan(norms["k"][3])
    assert np.asarray(norms["logits_zero"]).tolist() == [False, False, False, False]
    # A real underflow row: query 0 sees a logit gap of 100 > 87.3 (its row of ∂L/∂logits and ∂L/∂q is
    # exactly 0 in float32), query 1 a gap of 2. v's gradient is pᵀ r, alive for both.
    q = np.array([[1.0, 0.0], [0.02, 0.0]], np.float32)
    k = np.array([[0.0, 1.0], [-100.0, 1.0]], np.float32)
    v = np.array([[1.0, 2.0], [-1.0, 0.5]], np.float32)
    r = np.array([[1.0, -1.0], [0.5, 2.0]], np.float32)
    norms = probes.grad_norms(jax.jit(probes.attention_grads, static_argnames="scale")(q, k, v, r, scale=1.0))
    p = np_softmax(q.astype(np.float64) @ k.T)
    g = r.astype(np.float64) @ v.T
    dz = p * (g - (p * g).sum(-1, keepdims=True))
    np.testing.assert_allclose(norms["q"], np.linalg.norm(dz @ k, axis=-1), rtol=1e-5, atol=1e-30)
    np.testing.assert_allclose(norms["v"], np.linalg.norm(p.T @ r, axis=-1), rtol=1e-6)
    assert np.asarray(norms["q_zero"]).tolist() == [True, False]
    assert np.asarray(norms["logits_zero"]).tolist() == [True, False]


ROW_PROBES = {
    "entropy": probes.entropy,
    "normalized_entropy": probes.normalized_entropy,
    "max_weight": probes.max_weight,
    "effective_support": probes.effective_support,
    "row_stats": probes.row_stats,
    "head_entropy": probes.head_entropy,
    "head_entropy_normalized": lambda w, m: probes.head_entropy(w, m, normalized=True),
    "softmax_jacobian": probes.softmax_jacobian,
    "softmax_jacobian_norms": probes.softmax_jacobian_norms,
}


ROW_PROBES_SLOW = {"normalized_entropy", "max_weight", "effective_support", "head_entropy_normalized",
                   "softmax_jacobian_norms"}  # make test-slow; the other four in make test


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ROW_PROBES_SLOW else n
                                  for n in sorted(ROW_PROBES)])
def test_row_probes_under_jit_and_vmap_equal_eager(name, rng):
    B, T, S = 2, 4, 5
    logits = rng.standard_normal((B, T, S)).astype(np.float32) * 3
    keep = rng.random((B, T, S)) > 0.3
    keep[0, 0] = False  # a fully masked row
    keep[1, 1] = [False, False, True, False, False]  # a single key
    f = ROW_PROBES[name]
    xs = logits if name.startswith("softmax_jacobian") else np_softmax(logits, keep).astype(np.float32)
    eager = [f(xs[b], keep[b]) for b in range(B)]
    jitted = jax.jit(f)
    for b in range(B):
        jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7), jitted(xs[b], keep[b]), eager[b])
    stacked = jax.tree.map(lambda *ys: np.stack(ys), *eager)
    jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7), jax.vmap(f)(xs, keep), stacked)
    assert np.all(np.isfinite(np.concatenate([np.ravel(x) for x in jax.tree.leaves(stacked)])))


def test_dot_product_variance_memory_does_not_grow_with_samples():
    # XLA's temporary buffers for the compiled program, d_k = 8 … 4096 and n = 2048 (the configuration of
    # test_dot_product_variance_is_d_k_for_every_d_k, whose compiled program this is): one draw of every
    # pair at once took 575 MiB (1.15 GiB at n = 4096); a block of rows at a time takes 13 MiB at any n.
    compiled = _sweep._dots.lower(jax.random.key(0), probes.DEFAULT_HEAD_DIMS, 2048).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 32 * 2**20
    four_times = _sweep._dots.lower(jax.random.key(0), probes.DEFAULT_HEAD_DIMS, 8192).compile()  # not run
    assert four_times.memory_analysis().temp_size_in_bytes <= 1.1 * compiled.memory_analysis().temp_size_in_bytes
    tiny = probes.dot_product_variance(1, (5, 7), num_samples=3)  # a ragged last block, cut to n
    assert np.all(np.isfinite(tiny["std_error"])) and tiny["variance"].shape == (2,)
    np.testing.assert_array_equal(np.asarray(_sweep._dots(jax.random.key(1), (5, 7), 3)).shape, (2, 3))


def test_a_nan_row_has_nan_jacobian_norms_not_zero():
    """Exactly 0 is what the sweep and head_saturation count as saturated, so a NaN row (a kept NaN or a
    +inf logit) must not give it: NaN in, NaN out, with and without a cap."""
    x = np.array([[0.0, np.nan, 2.0], [0.0, np.inf, 2.0], [0.0, 1.0, 200.0]], np.float32)
    for name, value in probes.softmax_jacobian_norms(x).items():
        assert np.all(np.isnan(np.asarray(value)[:2])), name
    for name, value in probes.softmax_jacobian_norms(x, logit_cap=2.0).items():  # the cap makes +inf a finite 2
        assert np.isnan(np.asarray(value)[0]) and np.all(np.isfinite(np.asarray(value)[1:])), name
    assert float(probes.softmax_jacobian_norms(x)["frobenius"][2]) == 0.0  # a saturated row: exactly 0


def test_head_saturation_of_a_head_with_a_nan_row_is_nan():
    x = np.array([[[[0, 1, 2], [0, np.nan, 2], [0, 5, 1]], [[0, 1, 2], [0, 3, 2], [0, 5, 1]]]], np.float32)  # [1, 2, 3, 3]
    out = probes.head_saturation(x, np.ones((3, 3), bool))
    np.testing.assert_array_equal(out["rows"], [[3.0, 3.0]])
    for name in ("entropy_mean", "jacobian_median", "max_weight_median", "saturated_fraction", "zero_jacobian_fraction",
                 "spread_median"):
        value = np.asarray(out[name])
        assert np.isnan(value[0, 0]) and np.isfinite(value[0, 1]), name
    keep = np.ones((3, 3), bool)
    keep[1, 1] = False  # the NaN masked: head 0 now equals a NaN-free head
    masked = probes.head_saturation(x, keep)
    assert np.isfinite(np.asarray(masked["entropy_mean"])).all()


def test_gap_survival_keeps_its_relative_accuracy_in_the_tail():
    from scipy import integrate, stats

    S = 16
    for x in (0.5, 5.0, 15.0, 30.0):
        c = x * (S - 1) / S  # where the integrand peaks
        ref = integrate.quad(lambda t: S * stats.norm.pdf(t) * stats.norm.cdf(t - x) ** (S - 1), c - 15, c + 15,
                             points=[c], limit=500, epsabs=0, epsrel=1e-12)[0]
        np.testing.assert_allclose(float(probes.gap_survival(x, S)), ref, rtol=1e-9)
