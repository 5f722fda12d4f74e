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
    by the trapezoid rule in float64.

    Args:
      x: gaps ``[...]``, finite and >= 0 (``ValueError`` otherwise: ``P(D > x)`` is 1 for x < 0).
      num_keys: S >= 2.

    Returns:
      ``[...]`` float64.
    """
    S = check_int(num_keys, "num_keys", 2)
    x = _check_gaps(x, "x")
    t = _GRID
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
    dtype = jnp.dtype(dtype)
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
