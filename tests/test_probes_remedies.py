"""The saturation sweep with remedies: every remedy's rows against float64 NumPy on the same draws, the cap's
bounds on every row, the default sweep unchanged, the laws' fits on exact data, and bad specs refused before
anything is compiled."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import probes
from jaxattn.probes import _remedies, _sweep  # the sweep's internals, tested on purpose
from tests.test_probes import np_entropy, np_jacobian, np_softmax  # the float64 references, shared
from tests.test_probes_cap import entropy_floor as np_cap_entropy_floor
from tests.test_probes_cap import max_weight_bound as np_cap_max_weight
from tests.test_probes_cap import np_cap, np_cap_slope, np_capped_jacobian

# Small shapes: d_k = 8 (no row near saturation) and 256 (the unscaled rows nearly one-hot, the capped ones
# pushed against their bounds); S = 8 keys.
CONFIG = dict(head_dims=(8, 256), num_trials=3, num_queries=6, num_keys=8, value_dim=3)
SEED = 5
REMEDIES = probes.DEFAULT_REMEDIES + (("cap", 0.5), probes.Remedy("sqrt_dk_cap_1", sqrt_dk=True, logit_cap=1.0),
                                      probes.Remedy("qk_norm_temperature_4", qk_norm=True, temperature=4.0))
FIELDS = ("entropy", "normalized_entropy", "max_weight", "jacobian_norm", "logit_grad_norm", "q_grad_norm", "k_grad_norm",
          "dot_sq", "dot_mean")


@pytest.fixture
def rng(request):
    """A NumPy generator seeded per test (by name), so a test's data never depends on which others ran."""
    return np.random.default_rng(sum(map(ord, request.node.name)))


@pytest.fixture(scope="module")
def sweep():
    """Every default remedy, a small cap, a scaled cap and a normed temperature, in one float32 sweep."""
    return probes.saturation_sweep(SEED, remedies=REMEDIES, **CONFIG)


# ----------------------------------------------------------------------------------------------------
# float64 NumPy reference of one remedy on one trial's draws.
# ----------------------------------------------------------------------------------------------------


def np_rms_normalize(x):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True))


def np_remedy_trial(remedy, q, k, v, r, sigma=None):
    """Every field of one remedy on one trial in float64, gradients by the hand-derived formulas.

    ``q', k'`` (the drawn q, k, their RMS-normalised rows, or the σReparam projections ``x W / σ(W)``, given as
    ``sigma = (x, W_q, W_k, σ_q, σ_k)``), logits ``x = s q' k'ᵀ``, ``p = softmax(c tanh(x / c))`` (no cap: of x),
    ``g = r vᵀ``, ``∂L/∂x = slope ⊙ p ⊙ (g - Σ p g)``, ``∂L/∂q' = s ∂L/∂x k'``, ``∂L/∂k' = s (∂L/∂x)ᵀ q'``.
    """
    H = q.shape[1]
    if remedy.sigma_reparam:
        x_tok, w_q, w_k, s_q, s_k = (np.asarray(a, np.float64) for a in sigma)
        T = q.shape[0]
        q, k = x_tok[:T] @ (w_q / s_q), x_tok[T:] @ (w_k / s_k)
    q, k, v, r = (np.asarray(a, np.float64) for a in (q, k, v, r))
    if remedy.qk_norm:
        q, k = np_rms_normalize(q), np_rms_normalize(k)
    s = (1 / math.sqrt(H) if remedy.sqrt_dk else 1.0) / remedy.temperature
    dots = q @ k.T
    x = s * dots
    c = remedy.logit_cap
    p = np_softmax(x if c is None else np_cap(x, c))
    g = r @ v.T
    slope = 1.0 if c is None else np_cap_slope(x, c)
    dx = slope * p * (g - (p * g).sum(-1, keepdims=True))
    jac = np_jacobian(p) if c is None else np_capped_jacobian(x, c)
    h = np_entropy(p)
    ref = {
        "entropy": h,
        "normalized_entropy": h / math.log(k.shape[0]),
        "max_weight": p.max(-1),
        "jacobian_norm": np.sqrt((jac**2).sum((-1, -2))),
        "logit_grad_norm": np.linalg.norm(dx, axis=-1),
        "q_grad_norm": np.linalg.norm(s * dx @ k, axis=-1),
        "k_grad_norm": np.linalg.norm(s * dx.T @ q, axis=-1),
        "dot_sq": np.mean(dots**2),
        "dot_mean": np.mean(dots),
    }
    return ref, x


def trial_draws(p, r):
    """The draws of trial r at d_k = head_dims[p] of the fixture's sweep: (q, k, v, r) and the σReparam
    tokens and projections (x, W_q, W_k), float32, from the sweep's own key."""
    H = CONFIG["head_dims"][p]
    T, S, V = CONFIG["num_queries"], CONFIG["num_keys"], CONFIG["value_dim"]
    key = jax.random.split(jax.random.key(SEED), (len(CONFIG["head_dims"]), CONFIG["num_trials"]))[p, r]
    plain = jax.jit(lambda key: _sweep._draw(key, head_dim=H, T=T, S=S, V=V, dtype=jnp.float32))(key)
    sigma = jax.jit(lambda key: _remedies._sigma_draw(key, head_dim=H, T=T, S=S, acc=jnp.float32))(key)
    return plain, sigma


@pytest.mark.parametrize("p, r", [(0, 1), (1, 2)])
def test_every_remedy_row_against_float64_numpy_on_the_same_draws(sweep, p, r):
    (q, k, v, r_), (x_tok, w_q, w_k) = trial_draws(p, r)
    sig_q, sig_k = sweep["spectral_norm_q"], sweep["spectral_norm_k"]
    eps32 = float(np.finfo(np.float32).eps)
    names = list(sweep["remedy_names"])
    assert names[:4] == ["none", "sqrt_dk", "qk_norm", "qk_norm_sqrt_dk"] and "cap_2" in names and "temperature_8" in names
    for m, remedy in enumerate(sweep["remedies"]):
        assert remedy.name == names[m]
        if remedy.sigma_reparam:
            # σ(W) of the sweep against LAPACK's in float64 (Lanczos is never above it, up to rounding).
            exact = np.linalg.norm(np.asarray(w_q, np.float64), 2), np.linalg.norm(np.asarray(w_k, np.float64), 2)
            np.testing.assert_allclose([sig_q[m, p, r], sig_k[m, p, r]], exact, rtol=2e-6)
            sigma = (x_tok, w_q, w_k, sig_q[m, p, r], sig_k[m, p, r])
        else:
            assert np.isnan(sig_q[m, p, r]) and np.isnan(sig_k[m, p, r])
            sigma = None
        ref, x = np_remedy_trial(remedy, q, k, v, r_, sigma)
        np.testing.assert_allclose(sweep["logit_scale"][m, p],
                                   (1 / math.sqrt(CONFIG["head_dims"][p]) if remedy.sqrt_dk else 1.0) / remedy.temperature)
        # float32 against float64, as in tests/test_probes.py: relative errors grow like eps32 times the
        # largest logit (the unscaled d_k = 256 rows reach |x| ≈ 50); absolute floors for rows rounded to
        # one-hot, whose entropy and ∂L/∂x cancel to about eps32.
        rtol = 40 * eps32 * max(np.abs(x).max(), 1.0)
        tol = {
            "entropy": dict(rtol=rtol, atol=1e-6),
            "normalized_entropy": dict(rtol=rtol, atol=1e-6),
            "max_weight": dict(rtol=rtol, atol=0),
            "jacobian_norm": dict(rtol=rtol, atol=1e-30),
            "logit_grad_norm": dict(rtol=rtol, atol=1e-6),
            "q_grad_norm": dict(rtol=4 * rtol, atol=1e-5),
            "k_grad_norm": dict(rtol=4 * rtol, atol=1e-5),
            "dot_sq": dict(rtol=1e-5, atol=0),
            "dot_mean": dict(rtol=0, atol=1e-5 * math.sqrt(CONFIG["head_dims"][p])),
        }
        for name in FIELDS:
            np.testing.assert_allclose(sweep[name][m, p, r], ref[name], err_msg=f"{remedy.name}, {name}", **tol[name])
        # Exactly-zero flags. Uncapped: the rows whose float64 top-two logit gap is past float32's underflow
        # gap g (every other weight flushed to 0). Capped: the weights stay apart, but ∂L/∂x and the Jacobian
        # carry the cap's slope 4e^{-2|x/c|}, which flushes to 0 past |x/c| = g/2; a row is zero when every
        # key's is (with c = 0.5, all |x| > 22: not in this sweep, but at larger d_k).
        g = probes.underflow_gap(jnp.float32)
        if remedy.logit_cap is None:
            z = np.sort(x, -1)
            margin = z[:, -1] - z[:, -2] - g
        else:
            margin = np.abs(x / remedy.logit_cap).min(-1) - g / 2
        zero = margin > 0
        assert np.all(np.abs(margin) > 0.5), remedy.name  # no row at the edge
        np.testing.assert_array_equal(sweep["logit_grad_zero"][m, p, r], zero, err_msg=remedy.name)
        np.testing.assert_array_equal(sweep["jacobian_zero"][m, p, r], zero, err_msg=remedy.name)


def test_temperature_and_cap_leave_q_k_alone_and_sigma_is_bai_yin(sweep):
    """A temperature and a cap act on the logits only: the moments of q'·k' are those of the remedy without
    them; σ(W) of the square N(0, 1) projections is about 2 sqrt(D) (Bai-Yin)."""
    names = list(sweep["remedy_names"])
    at = {n: names.index(n) for n in names}
    # A temperature and a cap act on the logits, not on q'·k' (1/τ = 1/2, 1/4: no rounding).
    for field in ("dot_sq", "dot_mean"):
        for a, b in (("temperature_2", "none"), ("cap_2", "none"), ("qk_norm_temperature_4", "qk_norm")):
            np.testing.assert_allclose(sweep[field][at[a]], sweep[field][at[b]], rtol=1e-6, atol=1e-6, err_msg=f"{a} {field}")
    summary = probes.summarize_sweep(sweep)
    assert summary["var_qk"].shape == (len(names), 2)
    # σ(W) of a square N(0, 1) matrix: about 2 sqrt(D) (Bai-Yin), within 20% at D = 8 and 5% at D = 256.
    sq = summary["spectral_norm_q"][at["sigma_reparam"]] / (2 * np.sqrt(CONFIG["head_dims"]))
    assert 0.7 < sq[0] < 1.2 and 0.95 < sq[1] < 1.01, sq


def test_sqrt_dk_and_none_reproduce_the_default_sweep(sweep):
    """The default sweep's two modes are the remedies sqrt_dk and none, on the same draws, chunked or not."""
    plain = probes.saturation_sweep(SEED, **CONFIG)
    two = probes.saturation_sweep(SEED, remedies=("sqrt_dk", "none"), trials_per_batch=2, **CONFIG)
    assert "scaled" not in two and "scaled" in plain and "remedies" not in plain
    assert list(two["remedy_names"]) == ["sqrt_dk", "none"]
    names = list(sweep["remedy_names"])
    for mode, name in ((0, "sqrt_dk"), (1, "none")):
        for field in FIELDS + ("q_grad_zero", "logit_grad_zero", "jacobian_zero"):
            # Another program sums the logits in another order: their last bits move (|x| ≤ 50 here, so by
            # ~4e-6), and quantities ∝ e^{-gap} inherit that times the gap (relative ~1e-4) on unscaled rows.
            rtol = 1e-5 if mode == 0 else 2e-3
            for got, what in ((sweep[field][names.index(name)], "in the remedy sweep"), (two[field][mode], "alone, chunked")):
                np.testing.assert_allclose(got, plain[field][mode], rtol=rtol, atol=1e-30, err_msg=f"{name} {field} {what}")


# ----------------------------------------------------------------------------------------------------
# The bounds of a cap, on every row.
# ----------------------------------------------------------------------------------------------------


def test_capped_rows_respect_the_max_weight_and_entropy_bounds_on_every_row(sweep):
    S = CONFIG["num_keys"]
    eps32 = float(np.finfo(np.float32).eps)
    capped = [(m, r) for m, r in enumerate(sweep["remedies"]) if r.logit_cap is not None]
    assert sorted(r.logit_cap for _, r in capped) == [0.5, 1.0, 1.0, 2.0, 5.0]
    for m, remedy in capped:
        c = remedy.logit_cap
        bound, floor = np_cap_max_weight(c, S), np_cap_entropy_floor(c, S)
        assert sweep["remedy_caps"][m] == c
        assert sweep["max_weight_bound"][m] == pytest.approx(bound, rel=1e-6)
        assert sweep["entropy_floor"][m] == pytest.approx(floor, rel=1e-5)
        w, h = sweep["max_weight"][m], sweep["entropy"][m]  # [P, R, T]
        assert np.all(w <= bound * (1 + 4 * eps32)), (remedy.name, w.max(), bound)
        assert np.all(h >= floor - 1e-5), (remedy.name, h.min(), floor)
    for m, remedy in enumerate(sweep["remedies"]):
        if remedy.logit_cap is None:
            assert np.isnan(sweep["remedy_caps"][m]) and sweep["max_weight_bound"][m] == 1 and sweep["entropy_floor"][m] == 0
    # Uncapped and unscaled, the same draws break every cap's bounds: the check above can fail.
    none = list(sweep["remedy_names"]).index("none")
    assert sweep["max_weight"][none, 1].max() > np_cap_max_weight(5.0, S)
    assert sweep["entropy"][none, 1].min() < np_cap_entropy_floor(5.0, S)


def test_capped_jacobian_norm_keeps_rows_far_out_on_the_cap():
    """Rows whose every logit is 24 to 40 caps from 0: the cap's slopes 4e^{-2|x/c|} are 6e-21 to 7e-35, their
    squares below float32's range; the Frobenius norm, taken relative to the row's largest slope, keeps them."""
    c = 0.5
    x = c * np.array([[24.0, -30.0, 35.0, -24.5, 40.0, 28.0, -26.0, 33.0], [24.0, 25.0, -26.0, 27.0, -28.0, 29.0, 30.0, -31.0]])
    got = np.asarray(probes.softmax_jacobian_norms(x.astype(np.float32), logit_cap=c)["frobenius"])
    ref = np.sqrt((np_capped_jacobian(x, c) ** 2).sum((-1, -2)))
    assert np.all(ref > 1e-23) and np.all(ref < 1e-20)  # squared: below float32's smallest normal, 1.2e-38
    np.testing.assert_allclose(got, ref, rtol=1e-4)


@pytest.mark.parametrize("c", [0.1, 0.5, 1.0, 1.2, 2.0, 5.0, 10.0])
@pytest.mark.parametrize("S", [2, 3, 8, 16])
def test_logit_cap_bounds_against_float64_corners(c, S):
    bounds = probes.logit_cap_bounds(c, S)
    assert bounds["max_weight"] == pytest.approx(np_cap_max_weight(c, S), rel=1e-6)
    # The float64 reference sums p log p with p = 1 - O(e^{-2c}): it keeps ~16 - 8.7 digits at c = 10.
    assert bounds["entropy"] == pytest.approx(np_cap_entropy_floor(c, S), rel=1e-5, abs=1e-30)
    # max_weight_ceiling is the max weight at spread β = 2c (elementwise over arrays, too).
    ceiling = probes.max_weight_ceiling(np.array([2 * c, 0.0]), S)
    np.testing.assert_allclose(ceiling, [np_cap_max_weight(c, S), 1 / S], rtol=1e-6)


def test_logit_cap_bounds_hold_on_random_capped_rows(rng):
    """Random logits, capped: no row beats either bound, and the corners of the box attain them."""
    S, c = 8, 1.5
    x = rng.standard_normal((20000, S)) * rng.choice([0.5, 5.0, 50.0], (20000, 1))
    p = np_softmax(np_cap(x, c))
    bounds = probes.logit_cap_bounds(c, S)
    assert p.max() <= bounds["max_weight"] * (1 + 1e-6)
    assert np_entropy(p).min() >= bounds["entropy"] * (1 - 1e-6)
    corner = np_softmax(np.where(np.arange(S) == 0, c, -c))
    assert corner.max() == pytest.approx(bounds["max_weight"], rel=1e-6)


# ----------------------------------------------------------------------------------------------------
# The spectral norm, and the laws' fits on exact data.
# ----------------------------------------------------------------------------------------------------


def test_spectral_norm_against_lapack(rng):
    n = 64
    u, _ = np.linalg.qr(rng.standard_normal((n, n)))
    v, _ = np.linalg.qr(rng.standard_normal((n, n)))
    s = np.linspace(0.1, 2.97, n)
    s[-1] = 3.0  # the top two singular values 1% apart
    # Square (8 and 256 are in the sweep's test above), wide, and a spectrum with a 1% gap at the top.
    cases = [rng.standard_normal((64, 64)), rng.standard_normal((30, 100)), u @ np.diag(s) @ v.T]
    norm = jax.jit(_remedies._spectral_norm)
    for w in cases:
        got = float(norm(jnp.asarray(w, jnp.float32), jax.random.key(0)))
        assert got == pytest.approx(np.linalg.norm(w, 2), rel=2e-6), w.shape


def test_fit_remedy_laws_recovers_exact_constants():
    """A summary whose statistics follow the laws exactly for effective temperatures 1 and 2: the fits give
    b = m_S / τ and C = f_D(0) τ back; capped and √d_k remedies are not fitted, and say why."""
    S = 8
    d = np.array([16.0, 64.0, 256.0, 1024.0, 4096.0])
    m_S, f0 = probes.gap_median(S), probes.gap_density_at_zero(S)
    remedies = (probes.Remedy.parse("none"), probes.Remedy.parse(("temperature", 2.0)), probes.Remedy.parse(("cap", 2.0)),
                probes.Remedy.parse("sqrt_dk"), probes.Remedy.parse(("temperature", 64.0)))
    tau = np.array([1.0, 2.0, 1.0, 1.0, 64.0])[:, None]
    std = np.sqrt(d)[None] / tau
    summary = {
        "head_dims": d, "num_keys": S, "remedies": remedies,
        "logit_scale": 1 / tau * np.ones_like(d), "var_qk": np.ones((5, 1)) * d,
        "jacobian_norm": {"median": 2 * np.exp(-m_S * std), "mean": f0 / std},
        "logit_grad_norm": {"median": 0.7 * np.exp(-m_S * std), "mean": np.ones_like(std)},
        "entropy": {"median": np.ones_like(std), "mean": (math.pi**2 / 6) * f0 / std},
    }
    laws = probes.fit_remedy_laws(summary)
    for name, t in (("none", 1.0), ("temperature_2", 2.0)):
        law = laws[name]
        assert law["applies"] and law["temperature"] == pytest.approx(t)
        for key in ("median_jacobian", "median_logit_grad"):
            assert law[key]["b"] == pytest.approx(m_S / t, rel=1e-9) and law[key]["b_predicted"] == pytest.approx(m_S / t)
        assert law["median_jacobian"]["c"] == pytest.approx(2.0, rel=1e-9)
        assert law["mean_jacobian"]["a"] == pytest.approx(-0.5, abs=1e-9)
        assert law["mean_jacobian"]["C"] == pytest.approx(f0 * t, rel=1e-9) == law["mean_jacobian"]["C_predicted"]
        assert law["mean_entropy"]["C"] == pytest.approx(law["mean_entropy"]["C_predicted"], rel=1e-9)
    np.testing.assert_array_equal(laws["temperature_2"]["head_dims"], d[2:])  # σ = √d_k / 2 is 8 from d_k = 256 on
    assert not laws["cap_2"]["applies"] and "cap" in laws["cap_2"]["reason"]
    assert not laws["sqrt_dk"]["applies"] and "sqrt(d_k)" in laws["sqrt_dk"]["reason"]
    assert not laws["temperature_64"]["applies"] and "only 0 d_k" in laws["temperature_64"]["reason"]
    with pytest.raises(ValueError, match="remedies"):
        probes.fit_remedy_laws({"head_dims": d})
    with pytest.raises(ValueError, match="min_logit_std"):
        probes.fit_remedy_laws(summary, min_logit_std=0)


def test_fit_remedy_laws_on_the_sweep_measures_the_effective_temperature(sweep):
    laws = probes.fit_remedy_laws(probes.summarize_sweep(sweep), min_logit_std=0.5, min_points=2)
    # The logit std is measured from Var(q'·k') of the sweep: sqrt(d_k) / τ within the noise of 3 × 6 × 8 pairs.
    assert laws["none"]["temperature"] == pytest.approx(1.0, rel=0.2)
    assert laws["temperature_2"]["temperature"] == pytest.approx(2.0, rel=0.2)
    assert laws["qk_norm_temperature_4"]["temperature"] == pytest.approx(4.0, rel=0.2)
    assert not laws["sqrt_dk_cap_1"]["applies"]


# ----------------------------------------------------------------------------------------------------
# Specs: parsed, and bad ones refused with the argument named, before anything is compiled.
# ----------------------------------------------------------------------------------------------------


def test_specs_parse_to_the_documented_remedies():
    parse = probes.Remedy.parse
    assert parse("none") == probes.Remedy("none")
    assert parse("qk_norm_sqrt_dk") == probes.Remedy("qk_norm_sqrt_dk", sqrt_dk=True, qk_norm=True)
    assert parse("sigma_reparam_sqrt_dk") == probes.Remedy("sigma_reparam_sqrt_dk", sqrt_dk=True, sigma_reparam=True)
    assert parse(("cap", 2)) == probes.Remedy("cap_2", logit_cap=2.0)
    assert parse(("temperature", 0.5)) == probes.Remedy("temperature_0.5", temperature=0.5)
    names = [parse(s).name for s in probes.DEFAULT_REMEDIES]
    for word in ("none", "sqrt_dk", "qk_norm", "cap", "sigma_reparam", "temperature"):
        assert any(word in n for n in names), word


BAD = [
    ("cap", ValueError, r"remedies\[0\].*takes a value"),
    ("bogus", ValueError, r"remedies\[0\].*'bogus'"),
    (("cap", 0), ValueError, r"remedies\[0\] \('cap', c\): c must be finite and > 0, received 0"),
    (("cap", -1.0), ValueError, r"remedies\[0\] \('cap', c\)"),
    (("temperature", float("nan")), ValueError, r"remedies\[0\] \('temperature', tau\)"),
    (("temperature", "2"), TypeError, r"remedies\[0\] \('temperature', tau\): tau must be a real number"),
    (("cap", True), TypeError, r"remedies\[0\] \('cap', c\)"),
    (("scale", 2.0), ValueError, r"remedies\[0\].*first entry"),
    (3, TypeError, r"remedies\[0\] must be a Remedy"),
    (probes.Remedy(""), TypeError, r"remedies\[0\]\.name"),
    (probes.Remedy("x", temperature=0.0), ValueError, r"remedies\[0\]\.temperature"),
    (probes.Remedy("x", qk_norm=1), TypeError, r"remedies\[0\]\.qk_norm must be a bool"),
    (probes.Remedy("x", logit_cap=-2.0), ValueError, r"remedies\[0\]\.logit_cap"),
]


@pytest.fixture
def no_compile(monkeypatch):
    """The sweep's program replaced by one that fails the test: the checks must stop a bad call first."""
    def fail(*args, **kwargs):
        raise AssertionError("the sweep's program ran on bad input")
    monkeypatch.setattr(_sweep, "_remedy_program", fail)
    monkeypatch.setattr(_sweep, "_sweep_program", fail)


@pytest.mark.parametrize("spec, error, message", BAD, ids=[repr(b[0]) for b in BAD])
def test_bad_specs_are_refused_with_the_argument_named(spec, error, message, no_compile):
    with pytest.raises(error, match=message):
        probes.saturation_sweep(0, head_dims=(8,), num_trials=1, remedies=[spec])


@pytest.mark.parametrize("remedies, kwargs, error, message", [
    ((), {}, ValueError, "remedies must hold at least one"),
    ("none", {}, TypeError, "remedies must be a list or tuple"),
    (probes.Remedy("none"), {}, TypeError, "remedies must be a list or tuple"),
    (("none", ("temperature", 1.0), "none"), {}, ValueError, r"distinct names, received \['none'\]"),
    (("none",), {"logit_cap": 2.0}, ValueError, r"logit_cap must be None when remedies are given.*\('cap', c\)"),
    (("none",), {"head_dims": (0,)}, ValueError, "head_dims"),
])
def test_bad_remedy_lists_are_refused(remedies, kwargs, error, message, no_compile):
    call = dict(head_dims=(8,), num_trials=1) | kwargs
    with pytest.raises(error, match=message):
        probes.saturation_sweep(0, remedies=remedies, **call)
