"""Two statistics the tables and the Winograd scores are reported with: Spearman's rho, Wilson's interval."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy.stats import rankdata  # scipy comes with jax


def spearman(a: Any, b: Any) -> float:
    """Spearman's rank correlation of two tables of one shape (e.g. two ``[L, N]`` effect tables).

    The Pearson correlation of the ranks (ties get their average rank), in float64; ``nan`` when either
    table is constant (no ranking to correlate).
    """
    x = np.asarray(a, np.float64)
    y = np.asarray(b, np.float64)
    if x.shape != y.shape:
        raise ValueError(f"a and b must have one shape, received {x.shape} and {y.shape}")
    if x.size < 2:
        raise ValueError(f"a and b need at least 2 entries, received shape {x.shape}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("a and b must be finite")
    rx = rankdata(x.ravel()).astype(np.float64)
    ry = rankdata(y.ravel()).astype(np.float64)
    rx -= rx.mean()
    ry -= ry.mean()
    denom = math.sqrt(float(np.dot(rx, rx)) * float(np.dot(ry, ry)))
    return float(np.dot(rx, ry) / denom) if denom > 0 else float("nan")


def wilson_interval(successes: int, trials: int, *, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson's score interval for a binomial proportion: ``(low, high)``, 95% by default (z = 1.96).

    ``(p̂ + z²/2n ± z √(p̂(1-p̂)/n + z²/4n²)) / (1 + z²/n)``; unlike ``p̂ ± z√(p̂(1-p̂)/n)`` it stays inside
    [0, 1] and is not empty at 0 or n successes.
    """
    for name, value in (("successes", successes), ("trials", trials)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, received {value!r}")
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials and trials >= 1, received {successes} of {trials}")
    n, p = float(trials), successes / trials
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, center - half), min(1.0, center + half)
