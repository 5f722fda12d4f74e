"""The probes with a logit soft cap ``c · tanh(x / c)``: Jacobians and gradients with respect to the pre-cap
logits against float64 NumPy and finite differences, the bounds a cap puts on a sweep's rows, and the
uncapped default left as it was."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import probes
from jaxattn.probes import _sweep  # the sweep's internals, tested on purpose
from tests.test_probes import np_entropy, np_softmax  # the float64 references, shared


@pytest.fixture
def rng(request):
    """A NumPy generator seeded per test (by name), so a test's data never depends on which others ran."""
    return np.random.default_rng(sum(map(ord, request.node.name)))


# ----------------------------------------------------------------------------------------------------
# float64 NumPy references, written out from the definitions.
# ----------------------------------------------------------------------------------------------------


def np_cap(x, c):
    return c * np.tanh(np.asarray(x, np.float64) / c)


def np_cap_slope(x, c):
    """d/dx of c·tanh(x/c) = 1 - tanh²(x/c) = 1/cosh²(x/c), in the form that keeps its digits for large |x/c|."""
    return 1.0 / np.cosh(np.asarray(x, np.float64) / c) ** 2


def np_capped_jacobian(x, c, keep=None):
    """∂p/∂x for p = softmax(c·tanh(x/c)) by the chain rule: (diag(p) - p pᵀ) diag(1 - tanh²(x/c)), [..., S, S]."""
    p = np_softmax(np_cap(x, c), keep)
    inner = p[..., :, None] * np.eye(p.shape[-1]) - p[..., :, None] * p[..., None, :]  # ∂p/∂(capped logits)
    slope = np_cap_slope(x, c)
    if keep is not None:
        slope = np.where(keep, slope, 0.0)
    return inner * slope[..., None, :]


def max_weight_bound(c, S):
    """The largest weight a softmax over S keys can give when every logit lies in [-c, c]: one key at +c, the
    other S - 1 at -c, ``e^{2c} / (e^{2c} + S - 1)``."""
    return math.exp(2 * c) / (math.exp(2 * c) + S - 1)


def vertex_entropy(c, S, m):
    """Entropy of the softmax of m logits at +c and S - m at -c."""
    hi = math.exp(2 * c) / (m * math.exp(2 * c) + S - m)
    lo = 1.0 / (m * math.exp(2 * c) + S - m)
    return -(m * hi * math.log(hi) + (S - m) * lo * math.log(lo))


def entropy_floor(c, S):
    """The smallest entropy of a softmax over S keys whose logits lie in [-c, c].

    Along one logit z_s (the others fixed) the entropy's derivative is ``-p_s (z_s - Σ p z)``, whose sign is
    that of ``Σ_{s'≠s} e^{z_s'} (z_s - z_s')``, increasing in z_s: the entropy rises, then falls, so its
    minimum over [-c, c] is at an end. Moving one logit at a time to its better end never raises the entropy,
    so the minimum is at a corner of the box: m logits at +c, S - m at -c, the smallest over m = 1 … S - 1.

    With m = 1 the corner is the distribution with one weight at the bound ``e^{2c} / (e^{2c} + S - 1)`` and
    the rest shared equally, the floor that goes with the max-weight bound. It is the floor only for a cap
    large enough: for S = 8 from about c = 1.12 on (below, m = 2 … 4 keys at +c give less entropy; as c → 0
    the entropy near uniform falls fastest with m = S/2), see
    :func:`test_one_hot_corner_is_the_entropy_floor_only_for_a_large_enough_cap`.
    """
    return min(vertex_entropy(c, S, m) for m in range(1, S))


# ----------------------------------------------------------------------------------------------------
# (a) The Jacobian and gradient probes with a cap, in float64.
# ----------------------------------------------------------------------------------------------------


def capped_rows(rng, c):
    """``[4, 6]`` pre-cap logits: ordinary rows, one far inside the cap's flat part (|x/c| up to 20, where
    1 - tanh² rounds to 0 in float64 and 1/cosh² does not), a keep-mask with a fully masked row and one key
    alone in its row."""
    x = rng.standard_normal((4, 6)) * 3 * c
    x[2] = [40.0 * c / 2, -3.0, 1.0, 0.5, -40.0 * c / 2, 2.0]
    keep = rng.random((4, 6)) > 0.25
    keep[2] = True
    keep[1] = False  # no key
    keep[3] = False
    keep[3, 4] = True  # one key
    return x, keep


def test_softmax_jacobian_with_a_cap_against_float64_chain_rule_and_finite_differences(x64, rng):
    c = 2.0
    x, keep = capped_rows(rng, c)
    jac = np.asarray(probes.softmax_jacobian(x, keep, logit_cap=c))
    assert jac.dtype == np.float64 and jac.shape == (4, 6, 6)
    ref = np_capped_jacobian(x, c, keep)
    np.testing.assert_allclose(jac, ref, rtol=1e-12, atol=1e-300)
    # The far row keeps its tiny columns (slope 4e^{-40} ≈ 1.7e-17 at x = ±40), relative to their size.
    assert 0 < abs(jac[2, 0, 4]) < 1e-17 and 0 < abs(jac[2, 4, 0]) < 1e-17
    assert np.all(jac[1] == 0) and np.all(jac[3] == 0)  # no key, one key: nothing moves
    np.testing.assert_allclose(jac.sum(-2), 0.0, atol=1e-15)  # the weights still sum to 1
    # Central differences of the NumPy map softmax(c·tanh(x/c)) on the unmasked rows.
    h = 1e-6
    for t in (0, 2):
        f = lambda z: np_softmax(np_cap(z, c), keep[t])
        fd = np.stack([(f(x[t] + h * e) - f(x[t] - h * e)) / (2 * h) for e in np.eye(6)], axis=-1)
        np.testing.assert_allclose(jac[t], fd, rtol=0, atol=1e-9)


def test_softmax_jacobian_norms_with_a_cap_against_float64(x64, rng):
    c = 1.5
    x, keep = capped_rows(rng, c)
    norms = probes.softmax_jacobian_norms(x, keep, logit_cap=c)
    ref = np_capped_jacobian(x, c, keep)
    np.testing.assert_allclose(norms["frobenius"], np.sqrt((ref**2).sum((-1, -2))), rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(norms["nuclear"], np.linalg.svd(ref, compute_uv=False).sum(-1), rtol=1e-10, atol=1e-300)
    # J diag(σ) is not symmetric: its trace is below its nuclear norm on a row with mixed slopes.
    trace = np.trace(ref, axis1=-2, axis2=-1)
    assert np.asarray(norms["nuclear"])[0] > trace[0] * (1 + 1e-6)


def test_attention_grads_with_a_cap_against_float64_closed_form(x64, rng):
    T, S, H, V, c, scale = 5, 7, 4, 3, 2.5, 0.8
    q, k = rng.standard_normal((T, H)) * 2, rng.standard_normal((S, H)) * 2
    v, r = rng.standard_normal((S, V)), rng.standard_normal((T, V))
    keep = rng.random((T, S)) > 0.2
    keep[0] = True
    grads = probes.attention_grads(q, k, v, r, mask=keep, scale=scale, logit_cap=c)
    x = scale * q @ k.T  # [T, S], the pre-cap logits
    p = np_softmax(np_cap(x, c), keep)
    g = r @ v.T  # [T, S], ∂L/∂p
    dy = p * (g - (p * g).sum(-1, keepdims=True))  # ∂L/∂(capped logits)
    dx = np_cap_slope(x, c) * dy  # ∂L/∂x, the pre-cap logits
    np.testing.assert_allclose(grads["weights"], p, rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(grads["logits"], dx, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(grads["q"], scale * dx @ k, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(grads["k"], scale * dx.T @ q, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(grads["v"], p.T @ r, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(grads["loss"], np.sum(r * (p @ v)), rtol=1e-12)
    # ∂L/∂logits is the softmax Jacobian probe's transpose applied to ∂L/∂p (the same pre-cap logits).
    jac = np.asarray(probes.softmax_jacobian(x, keep, logit_cap=c))
    np.testing.assert_allclose(grads["logits"], np.einsum("tsu,ts->tu", jac, g), rtol=1e-9, atol=1e-14)
    norms = probes.grad_norms(grads)
    np.testing.assert_allclose(norms["logits"], np.linalg.norm(dx, axis=-1), rtol=1e-10)


def test_traced_cap_under_jit_and_vmap_equals_eager(rng):
    x = (rng.standard_normal((3, 5)) * 4).astype(np.float32)
    caps = np.array([0.5, 2.0, 8.0], np.float32)
    norms = jax.jit(jax.vmap(lambda c: probes.softmax_jacobian_norms(x, logit_cap=c)))(caps)
    for i, c in enumerate(caps):
        eager = probes.softmax_jacobian_norms(x, logit_cap=float(c))
        for name in ("frobenius", "nuclear"):
            np.testing.assert_allclose(norms[name][i], eager[name], rtol=1e-5, err_msg=name)
    q, k, v = (rng.standard_normal((n, 4)).astype(np.float32) for n in (2, 3, 3))
    r = rng.standard_normal((2, 4)).astype(np.float32)
    traced = jax.jit(lambda c: probes.attention_grads(q, k, v, r, logit_cap=c)["logits"])(np.float32(1.5))
    np.testing.assert_allclose(traced, probes.attention_grads(q, k, v, r, logit_cap=1.5)["logits"], rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------------------
# (b) A capped sweep: the bounds, every row, at large d_k without the 1/√d_k.
# ----------------------------------------------------------------------------------------------------

CAP = 2.0
SWEEP = dict(head_dims=(8, 1024), num_trials=4, num_queries=16, num_keys=8, value_dim=4)


@pytest.fixture(scope="module")
def capped_sweep():
    """A small float32 sweep with ``logit_cap=2`` over d_k = 8 and 1024 (S = 8 keys)."""
    return probes.saturation_sweep(3, logit_cap=CAP, **SWEEP)


@pytest.fixture(scope="module")
def plain_sweep():
    """The same sweep without a cap (the same draws)."""
    return probes.saturation_sweep(3, **SWEEP)


def test_capped_sweep_respects_the_max_weight_and_entropy_bounds(capped_sweep, plain_sweep):
    """Every capped row: max weight <= e^{2c}/(e^{2c}+S-1) and entropy >= the entropy of the distribution with
    one weight at that bound and the other S - 1 sharing the rest equally (the floor for c = 2, S = 8; see
    :func:`entropy_floor`); the uncapped rows at d_k = 1024 without the scale break both."""
    S = SWEEP["num_keys"]
    bound = max_weight_bound(CAP, S)
    b = bound
    one_hot_corner = -(b * math.log(b) + (1 - b) * math.log((1 - b) / (S - 1)))
    assert one_hot_corner == pytest.approx(entropy_floor(CAP, S), rel=1e-12)
    assert one_hot_corner == pytest.approx(vertex_entropy(CAP, S, 1), rel=1e-12)
    res = capped_sweep
    assert res["logit_cap"] == CAP and res["max_weight"].shape == (2, 2, 4, 16)
    eps32 = float(np.finfo(np.float32).eps)
    assert np.all(res["max_weight"] <= bound * (1 + 4 * eps32)), res["max_weight"].max()
    assert np.all(res["entropy"] >= one_hot_corner - 1e-5), res["entropy"].min()
    unscaled_large = plain_sweep["max_weight"][1, 1]  # [R, T], d_k = 1024, no scale, no cap
    assert np.median(unscaled_large) > 0.999 and unscaled_large.max() > bound
    assert plain_sweep["entropy"][1, 1].min() < one_hot_corner
    # The capped, unscaled rows at d_k = 1024 sit on the box's corners: their capped logits are ±c but for
    # |q·k| within a few c of 0, so each row's weights are close to those of its count m of keys at +c.
    assert np.all(res["entropy"][1, 1] > 0.5)
    summary = probes.summarize_sweep(res)
    assert summary["logit_cap"] == CAP and summary["entropy"]["mean"].shape == (2, 2)
    # The capped map is never one-hot, and the Jacobian's slope 1/cosh²(x/c) stays positive in float32 up to
    # |x/c| ≈ 44; the core's ∂L/∂x is the autodiff derivative of tanh, 1 - tanh², which is exactly 0 in
    # float32 once tanh(x/c) is ±1 (XLA's CPU float32 tanh: from |x/c| ≈ 7.9 to 8, by code generator):
    # unscaled rows whose every logit is that far out get ∂L/∂x = 0 while their Jacobian norm, below 1e-6,
    # is not.
    assert np.all(summary["zero_fraction"]["jacobian"] == 0)
    assert np.all(summary["zero_fraction"]["logit_grad"][0] == 0)
    assert np.all(res["jacobian_norm"][res["logit_grad_zero"]] < 1e-6)


def test_capped_sweep_trial_against_float64_numpy(capped_sweep):
    """One capped trial (d_k = 1024, unscaled and scaled) of the sweep and of sweep_trial_fn against float64
    NumPy on the same draw: the capped map, its Jacobian norm and ‖∂L/∂x‖ for the pre-cap logits x."""
    H, r_index, S, T, V = 1024, 2, SWEEP["num_keys"], SWEEP["num_queries"], SWEEP["value_dim"]
    key = jax.random.split(jax.random.key(3), (2, SWEEP["num_trials"]))[1, r_index]
    q, k, v, r = jax.jit(lambda key: _sweep._draw(key, head_dim=H, T=T, S=S, V=V, dtype=jnp.float32))(key)
    q, k, v, r = (np.asarray(a, np.float64) for a in (q, k, v, r))
    trial = probes.sweep_trial_fn(H, num_queries=T, num_keys=S, value_dim=V, logit_cap=CAP)
    assert trial is probes.sweep_trial_fn(H, num_queries=T, num_keys=S, value_dim=V, logit_cap=int(CAP))
    for mode, scale in ((0, 1 / math.sqrt(H)), (1, 1.0)):
        x = scale * q @ k.T  # [T, S]
        p = np_softmax(np_cap(x, CAP))
        g = r @ v.T
        dx = np_cap_slope(x, CAP) * p * (g - (p * g).sum(-1, keepdims=True))
        jac = np_capped_jacobian(x, CAP)
        ref = {
            "entropy": np_entropy(p),
            "max_weight": p.max(-1),
            "jacobian_norm": np.sqrt((jac**2).sum((-1, -2))),
            "logit_grad_norm": np.linalg.norm(dx, axis=-1),
            "q_grad_norm": np.linalg.norm(scale * dx @ k, axis=-1),
            "dot_sq": np.mean((q @ k.T) ** 2),
        }
        one = trial(key, mode == 0)
        for source in (one, {name: capped_sweep[name][mode, 1, r_index] for name in ref}):
            for name, expected in ref.items():
                # float32 logits up to |q·k| ≈ 150 unscaled: rounding ~1e-5 of a logit, which the cap's slope
                # (1/cosh², relative derivative 2 tanh(x/c)/c ≤ 1) passes on at most as is.
                np.testing.assert_allclose(source[name], expected, rtol=2e-4, atol=1e-6, err_msg=f"{name}, mode {mode}")


def test_one_hot_corner_is_the_entropy_floor_only_for_a_large_enough_cap():
    """For a small cap the one-hot corner is not the entropy floor: the core's capped map with three of eight
    logits at +c has less entropy than one weight at the bound and the rest shared equally."""
    S, c = 8, 0.5
    assert entropy_floor(c, S) < vertex_entropy(c, S, 1) - 1e-3
    bias = np.where(np.arange(S) < 3, 100.0, -100.0)[None, :]  # capped to ±c
    zeros = np.zeros((1, 2), np.float32)
    w = jaxattn.attention_weights(zeros, np.zeros((S, 2), np.float32), bias=bias.astype(np.float32), logit_cap=c)
    h = float(probes.entropy(w)[0])
    assert h == pytest.approx(vertex_entropy(c, S, 3), rel=1e-5)
    assert h < vertex_entropy(c, S, 1) - 1e-3
    assert float(probes.max_weight(w)[0]) <= max_weight_bound(c, S)


# ----------------------------------------------------------------------------------------------------
# (c) logit_cap=None is the uncapped probe, unchanged.
# ----------------------------------------------------------------------------------------------------


def test_no_cap_gives_exactly_the_uncapped_results(plain_sweep, rng):
    same = probes.saturation_sweep(3, logit_cap=None, **SWEEP)  # the cached program of plain_sweep
    assert set(same) == set(plain_sweep) and "logit_cap" not in same
    for name, value in plain_sweep.items():
        np.testing.assert_array_equal(same[name], value, err_msg=name)
    assert "logit_cap" not in probes.summarize_sweep(same)
    # The uncapped program holds no tanh: the cap adds nothing to it.
    keys = jax.random.split(jax.random.key(3), (1, 2))
    static = dict(head_dims=(8,), T=2, S=3, V=2, dtype=jnp.dtype(jnp.float32), batch=None)
    plain = str(jax.make_jaxpr(lambda keys: _sweep._sweep_program(keys, **static))(keys))
    assert "tanh" not in plain and "tanh" in str(jax.make_jaxpr(lambda keys: _sweep._sweep_program(keys, 2.0, **static))(keys))
    assert probes.sweep_trial_fn(8, logit_cap=None) is probes.sweep_trial_fn(8)
    # The Jacobian and gradient probes: bit for bit the call without the argument.
    x = (rng.standard_normal((3, 5)) * 4).astype(np.float32)
    for f in (probes.softmax_jacobian, probes.softmax_jacobian_norms):
        jax.tree.map(np.testing.assert_array_equal, f(x, logit_cap=None), f(x))
    q, k, v, r = (rng.standard_normal((3, 4)).astype(np.float32) for _ in range(4))
    jax.tree.map(np.testing.assert_array_equal, probes.attention_grads(q, k, v, r, scale=1.0, logit_cap=None),
                 probes.attention_grads(q, k, v, r, scale=1.0))


# ----------------------------------------------------------------------------------------------------
# (d) Bad caps are refused, with the argument named.
# ----------------------------------------------------------------------------------------------------

X = np.zeros((2, 3), np.float32)
Q = np.ones((2, 4), np.float32)


@pytest.mark.parametrize("cap, error", [(0, ValueError), (0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                        (float("inf"), ValueError), ("2", TypeError), (True, TypeError), ([1.0], TypeError)])
@pytest.mark.parametrize("probe", ["softmax_jacobian", "softmax_jacobian_norms", "attention_grads", "saturation_sweep",
                                   "sweep_trial_fn"])
def test_bad_caps_are_refused_with_the_argument_named(probe, cap, error):
    calls = {
        "softmax_jacobian": lambda: probes.softmax_jacobian(X, logit_cap=cap),
        "softmax_jacobian_norms": lambda: probes.softmax_jacobian_norms(X, logit_cap=cap),
        "attention_grads": lambda: probes.attention_grads(Q, Q, Q, Q, logit_cap=cap),
        "saturation_sweep": lambda: probes.saturation_sweep(0, head_dims=(8,), num_trials=1, logit_cap=cap),
        "sweep_trial_fn": lambda: probes.sweep_trial_fn(8, logit_cap=cap),
    }
    with pytest.raises(error, match="logit_cap"):
        calls[probe]()


def test_saturation_sweep_refuses_a_traced_cap():
    with pytest.raises(TypeError, match="logit_cap"):
        jax.jit(lambda c: probes.saturation_sweep(0, head_dims=(8,), num_trials=1, logit_cap=c))(2.0)
