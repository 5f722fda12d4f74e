"""The laws the unscaled sweep follows (float64 NumPy), and fits of measurements to them."""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from jaxattn._checks import check_int, softmax_dtype
from jaxattn.probes._sweep import _check_head_dims

# ----------------------------------------------------------------------------------------------------
# The laws (float64 NumPy): extreme-value statistics of the gap between the two largest logits.
# ----------------------------------------------------------------------------------------------------
#
# Unscaled, the logits of one query are z_s = q·k_s; given q they are S i.i.d. N(0, σ²) with σ = |q| ≈
# √d_k. Write z_(1) > z_(2) for the two largest and D = (z_(1) - z_(2)) / σ, the gap of S standard
# normals, whose law does not depend on d_k. Once σD is large the row is one-hot up to p_2 ≈ e^{-σD}, and
#   ‖J‖_F ≈ 2 e^{-σD},  entropy ≈ (1 + σD) e^{-σD},  1 - max weight ≈ e^{-σD}.
# Typical row (median): σD ≈ √d_k · median(D), so the median falls like exp(-median(D) · √d_k).
# Mean: dominated by near ties, D ≲ 1/σ, where the density of D is f_D(0); over the two-key profile
#   ∫₀^∞ 2p₁p₂ dy = 1, ∫₀^∞ H_b dy = π²/6, ∫₀^∞ p₂ dy = ln 2, and E‖∂L/∂z‖ picks up E|g₁ - g₂|/√2 = √(2/π)·…,
# so every mean falls like f_D(0) · c / √d_k: a power law with exponent -1/2.
# Exact zeros: a row's gradient is exactly 0 once every weight but the largest is flushed to 0, i.e.
#   σD > g_dtype ≈ -ln(smallest normal number the gradient is held in); so zero_fraction = P(σD > g).


def _normal_pdf(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _normal_cdf(x: np.ndarray) -> np.ndarray:
    from scipy.special import ndtr

    return ndtr(x)


_GRID = np.linspace(-12.0, 12.0, 24001)  # quadrature grid for the top-two gap integrals (step 1e-3)


def _check_gaps(x: Any, name: str) -> np.ndarray:
    """``x`` as float64, each entry finite and >= 0 (a gap between two logits, in any unit)."""
    arr = np.asarray(x)
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise TypeError(f"{name} must be a real number or array of gaps >= 0, received dtype {arr.dtype.name}")
    arr = arr.astype(np.float64)
    bad = ~(np.isfinite(arr) & (arr >= 0))
    if np.any(bad):
        raise ValueError(
            f"{name} must be finite and >= 0 (a gap between the two largest logits), received "
            f"{arr[bad].ravel()[:4].tolist()} among shape {arr.shape}"
        )
    return arr


def gap_survival(x: Any, num_keys: int) -> np.ndarray:
    """``P(D > x)`` for ``D`` the gap between the two largest of ``num_keys`` i.i.d. N(0, 1) values.

    ``P(D > x) = S ∫ φ(t) Φ(t - x)^{S-1} dt`` (the largest is at ``t``, all others below ``t - x``),
    by the trapezoid rule in float64 on a grid of step 1e-3 over ±12 around the integrand's peak, which
    moves to about ``t = x (S - 1) / S`` as the gap grows: so the tail keeps its relative accuracy (at
    ``S = 16``, ``x = 30``: about 4e-194, where a grid fixed around 0 gives 0).

    Args:
      x: gaps ``[...]``, finite and >= 0 (``ValueError`` otherwise: ``P(D > x)`` is 1 for x < 0).
      num_keys: S >= 2.

    Returns:
      ``[...]`` float64.
    """
    S = check_int(num_keys, "num_keys", 2)
    x = _check_gaps(x, "x")
    t = x[..., None] * ((S - 1) / S) + _GRID  # [..., G], centred on each gap's peak
    integrand = _normal_pdf(t) * _normal_cdf(t - x[..., None]) ** (S - 1)
    return S * np.trapezoid(integrand, t, axis=-1)


def gap_density_at_zero(num_keys: int) -> float:
    """``f_D(0) = S(S-1) ∫ φ(t)² Φ(t)^{S-2} dt``: how likely the two largest logits nearly tie."""
    S = check_int(num_keys, "num_keys", 2)
    t = _GRID
    return float(S * (S - 1) * np.trapezoid(_normal_pdf(t) ** 2 * _normal_cdf(t) ** (S - 2), t))


def gap_median(num_keys: int) -> float:
    """The median of ``D`` (solves ``P(D > x) = 1/2`` by bisection)."""
    lo, hi = 0.0, 10.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if gap_survival(mid, num_keys) > 0.5 else (lo, mid)
    return 0.5 * (lo + hi)


def underflow_gap(dtype: Any) -> float:
    """The logit gap past which a row's ``∂L/∂logits`` is exactly 0 in ``dtype`` (as the core computes it).

    The gradient of the other weights is ``≈ e^{-gap}`` times an O(1) factor. The core computes it in
    float32 (float64 for float64 input), where XLA on CPU flushes subnormal results to zero, so for
    float32 and bfloat16 (which shares float32's exponent range) the threshold is
    ``-ln(smallest normal float32) = 126 ln 2 = 87.3``; float64: ``1022 ln 2 = 708.4``. float16 input
    gets the float32 gradient rounded to float16, which keeps subnormals and rounds below half the
    smallest one to 0: ``25 ln 2 = 17.3``.

    Args:
      dtype: a floating dtype (``TypeError`` for integer or boolean dtypes, which have no underflow).

    Returns:
      the gap in nats, a float.
    """
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a floating dtype (float16, bfloat16, float32 or float64), received {dtype!r}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype (float16, bfloat16, float32 or float64), received {dtype.name}")
    if dtype == jnp.float16:
        return 25.0 * math.log(2.0)
    return float(-math.log(float(jnp.finfo(softmax_dtype(dtype)).tiny)))


def predicted_laws(head_dims: Sequence[int], num_keys: int, *, gap_threshold: float | None = None) -> dict[str, Any]:
    """The predicted unscaled statistics for rows of ``num_keys`` logits with σ = √d_k (float64).

    Args:
      head_dims: ``d_k`` values ``[P]``.
      num_keys: S.
      gap_threshold: if given (a finite scalar >= 0), the logit gap past which a row's gradient is exactly zero (see
        :func:`underflow_gap`); adds ``zero_fraction [P] = P(√d_k · D > gap_threshold)``.

    Returns:
      dict with constants ``gap_median`` (m_S), ``gap_density_at_zero`` (f_D(0)) and ``[P]`` arrays:
      ``median_jacobian = 2 exp(-m_S √d_k)``, ``median_entropy = (1 + m_S √d_k) exp(-m_S √d_k)``,
      ``mean_jacobian = f_D(0) / √d_k``, ``mean_entropy = (π²/6) f_D(0) / √d_k``,
      ``mean_one_minus_max = ln 2 · f_D(0) / √d_k``, ``mean_logit_grad = √(2/π) f_D(0) / √d_k``
      (for a read-out of norm exactly 1 against unit-variance values; the sweep's ``r ~ N(0, I/V)`` has
      ``E‖r‖ = √(2/V) Γ((V+1)/2) / Γ(V/2)``, 0.985 at V = 16, which multiplies it: see the lab's ``fit_laws``).
    """
    dims = np.asarray(_check_head_dims(head_dims), np.float64)
    m = gap_median(num_keys)
    f0 = gap_density_at_zero(num_keys)
    y = m * np.sqrt(dims)
    laws = {
        "head_dims": dims,
        "gap_median": m,
        "gap_density_at_zero": f0,
        "median_jacobian": 2.0 * np.exp(-y),
        "median_entropy": (1.0 + y) * np.exp(-y),
        "mean_jacobian": f0 / np.sqrt(dims),
        "mean_entropy": (math.pi**2 / 6.0) * f0 / np.sqrt(dims),
        "mean_one_minus_max": math.log(2.0) * f0 / np.sqrt(dims),
        "mean_logit_grad": math.sqrt(2.0 / math.pi) * f0 / np.sqrt(dims),
    }
    if gap_threshold is not None:
        threshold = _check_gaps(gap_threshold, "gap_threshold")
        if threshold.ndim != 0:
            raise ValueError(f"gap_threshold must be a scalar, received shape {threshold.shape}")
        laws["zero_fraction"] = gap_survival(threshold / np.sqrt(dims), num_keys)
    return laws


def _fit_data(x: Any, y: Any, *, x_min: str) -> tuple[np.ndarray, np.ndarray]:
    """``x [P]``, ``y [P]`` as float64 for a fit in log space: y finite and > 0, x finite and ``x_min``."""
    x, y = np.asarray(x), np.asarray(y)
    for name, arr in (("x", x), ("y", y)):
        if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
            raise TypeError(f"{name} must be a real array [P], received dtype {arr.dtype.name}")
    x, y = x.astype(np.float64), y.astype(np.float64)
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"x and y must both have shape [P], received x {x.shape} and y {y.shape}")
    if not np.all(np.isfinite(y) & (y > 0)):
        raise ValueError(f"y must be finite and > 0 to fit in log space (an underflowed statistic?), received {y}")
    x_ok = x > 0 if x_min == "> 0" else x >= 0
    if not np.all(np.isfinite(x) & x_ok):
        raise ValueError(f"x must be finite and {x_min} for this fit, received {x}")
    if np.unique(x).size < 2:
        raise ValueError(f"x must hold at least 2 distinct values to fit a line, received {x}")
    return x, y


def fit_power_law(x: Any, y: Any) -> tuple[float, float]:
    """Least-squares ``y ≈ c · x^a`` in log-log (float64); returns ``(a, c)``.

    Args:
      x: ``[P]``, finite and > 0 (e.g. the ``d_k`` values), at least 2 distinct.
      y: ``[P]``, finite and > 0 (an underflowed 0 cannot be fitted in log space).

    Returns:
      ``(a, c)`` as floats. ``ValueError``/``TypeError`` for input outside those ranges.
    """
    x, y = _fit_data(x, y, x_min="> 0")
    a, b = np.polyfit(np.log(x), np.log(y), 1)
    return float(a), float(np.exp(b))


def fit_stretched_exp(x: Any, y: Any) -> tuple[float, float]:
    """Least-squares ``y ≈ c · exp(-b √x)`` (``ln y`` linear in ``√x``, float64); returns ``(b, c)``.

    Args:
      x: ``[P]``, finite and >= 0, at least 2 distinct.
      y: ``[P]``, finite and > 0.

    Returns:
      ``(b, c)`` as floats. ``ValueError``/``TypeError`` for input outside those ranges.
    """
    x, y = _fit_data(x, y, x_min=">= 0")
    slope, intercept = np.polyfit(np.sqrt(x), np.log(y), 1)
    return float(-slope), float(np.exp(intercept))


def fit_remedy_laws(summary: dict[str, Any], *, min_logit_std: float = 8.0, min_points: int = 3) -> dict[str, Any]:
    """The unscaled laws fitted to each remedy of a :func:`summarize_sweep` of a sweep with ``remedies``.

    The laws above hold for any logits that, given the query, are S i.i.d. N(0, σ²) with σ growing like
    ``sqrt(d_k)``: only σ changes. A remedy without ``sqrt_dk`` and without a cap has logit standard
    deviation ``σ_p = logit_scale[m, p] · sqrt(var_qk[m, p])`` at ``d_k = head_dims[p]`` (``var_qk`` is
    the variance of its ``q'·k'``), that is ``σ = sqrt(d_k) / τ_eff`` with ``τ_eff`` the remedy's
    effective temperature (1 for none and q/k RMS norm, τ for a temperature, ``≈ σ(W_q) σ(W_k) /
    sqrt(D)``-scaled for σReparam: measured, not assumed). On the ``d_k`` with ``σ ≥ min_logit_std``
    (the asymptotic regime) the medians are fitted to ``c · exp(-b sqrt(d_k))`` with predicted
    ``b = m_S / τ_eff`` (:func:`gap_median`); the means to ``d_k^a`` (free exponent, predicted ``a = -1/2``)
    and, with the exponent held at ``-1/2``, to ``C / sqrt(d_k)`` with predicted ``C = f_D(0) τ_eff`` for the
    Jacobian norm and ``(π²/6) f_D(0) τ_eff`` for the entropy (the ``C`` of :func:`predicted_laws` times
    τ_eff; ``C`` is the geometric mean of ``sqrt(d_k) · mean``, the least-squares fit in log space).

    A capped remedy's logits stay in ``(-c, c)`` and a ``sqrt_dk`` remedy's spread does not grow with
    ``d_k``: the laws do not apply to them (their entry says why; the cap's bounds are
    :func:`logit_cap_bounds`).

    Args:
      summary: :func:`summarize_sweep` of a sweep with ``remedies`` (it needs the medians: quantiles with 0.5).
      min_logit_std: the least σ a ``d_k`` needs to enter the fits (8 by default: the median row's top
        two logits then differ by ``m_S σ ≈ 2.9`` at S = 16, and the one-hot form of the laws holds).
      min_points: the fewest such ``d_k`` for a fit.

    Returns:
      dict keyed by remedy name: ``applies`` (bool), ``reason`` (str, when it does not), and where it
      does ``head_dims`` (those fitted), ``logit_std [P]`` (σ at every swept ``d_k``), ``temperature``
      (τ_eff, the mean of ``sqrt(d_k) / σ`` over the fitted ``d_k``), ``median_jacobian`` and
      ``median_logit_grad`` (``b``, ``c``, ``b_predicted``), ``mean_jacobian`` and ``mean_entropy``
      (``a``, the free exponent; ``C``, at exponent -1/2; ``C_predicted``); a fit that cannot be made (a
      statistic underflowed to 0) is a string saying why.
    """
    if "remedies" not in summary:
        raise ValueError("summary must come from a sweep with remedies (summarize_sweep(saturation_sweep(..., "
                         "remedies=...))); this one has the two scale modes, whose laws predicted_laws gives")
    if "median" not in summary["jacobian_norm"]:
        raise ValueError("summary must hold medians: summarize_sweep(..., quantiles=...) with 0.5 among the quantiles")
    if isinstance(min_logit_std, bool) or not isinstance(min_logit_std, (int, float)) or not math.isfinite(min_logit_std) or min_logit_std <= 0:
        raise ValueError(f"min_logit_std must be a finite number > 0, received {min_logit_std!r}")
    n_min = check_int(min_points, "min_points", 2)
    dims = np.asarray(summary["head_dims"], np.float64)
    S = int(summary["num_keys"])
    m_S, f0 = gap_median(S), gap_density_at_zero(S)
    laws: dict[str, Any] = {}
    for i, remedy in enumerate(summary["remedies"]):
        if remedy.logit_cap is not None:
            laws[remedy.name] = {"applies": False, "reason": f"capped at c = {remedy.logit_cap:g}: the logits stay in "
                                 "(-c, c) whatever d_k; the cap's bounds apply (logit_cap_bounds)"}
            continue
        if remedy.sqrt_dk:
            laws[remedy.name] = {"applies": False, "reason": "scaled by 1/sqrt(d_k): the logits' spread does not grow "
                                 "with d_k, so the statistics stay in a band"}
            continue
        std = np.asarray(summary["logit_scale"], np.float64)[i] * np.sqrt(np.asarray(summary["var_qk"], np.float64)[i])
        fit = std >= min_logit_std
        if fit.sum() < n_min:
            laws[remedy.name] = {"applies": False, "logit_std": std,
                                 "reason": f"only {int(fit.sum())} d_k with logit std >= {min_logit_std:g} "
                                           f"(largest {std.max():.3g}); a fit needs {n_min}"}
            continue
        d = dims[fit]
        tau = float(np.mean(np.sqrt(d) / std[fit]))
        entry: dict[str, Any] = {"applies": True, "head_dims": d, "logit_std": std, "temperature": tau}
        for key, field, stat in (("median_jacobian", "jacobian_norm", "median"),
                                 ("median_logit_grad", "logit_grad_norm", "median"),
                                 ("mean_jacobian", "jacobian_norm", "mean"),
                                 ("mean_entropy", "entropy", "mean")):
            y = np.asarray(summary[field][stat], np.float64)[i][fit]
            try:
                if stat == "median":
                    b, c = fit_stretched_exp(d, y)
                    entry[key] = {"b": b, "c": c, "b_predicted": m_S / tau}
                else:
                    a, _ = fit_power_law(d, y)
                    C = float(np.exp(np.mean(np.log(y * np.sqrt(d)))))  # y ≈ C / sqrt(d_k), least squares in log space
                    entry[key] = {"a": a, "C": C, "C_predicted": f0 * tau * (math.pi**2 / 6.0 if field == "entropy" else 1.0)}
            except ValueError as e:
                entry[key] = f"not fitted: {e}"
        laws[remedy.name] = entry
    return laws
