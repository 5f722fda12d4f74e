"""The library side of the lab's parts 1 and 2: compute the numbers, return data, render to strings/figures.

Part 1: a few tokens through :func:`jaxattn.attention`: Q, K, V, the map A, and each row's sum, verified.
Part 2: the same attention with and without the division by ``sqrt(d_k)``: entropies side by side, then the
saturation sweep over ``d_k`` (:func:`jaxattn.probes.saturation_sweep`) as a table, the laws its unscaled
statistics follow (predicted and fitted), the fraction of exactly-zero gradients per dtype, and a log-log
figure. Nothing here prints; the lab script renders and writes files (atomically, with
:func:`jaxattn.io.write_json` and :func:`save_figure`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import attention, probes
from jaxattn.io import atomic_write

ROW_SUM_TOLERANCE = 1e-6
LOW_PRECISION_DTYPES = ("bfloat16", "float16", "float64")
FIT_MIN_HEAD_DIM = 256  # the laws are asymptotic: fit on d_k >= 256


# ----------------------------------------------------------------------------------------------------
# Part 1.
# ----------------------------------------------------------------------------------------------------


def part1(seed: int, *, num_tokens: int = 4, head_dim: int = 8) -> dict[str, Any]:
    """Q, K, V ``[T, H]`` with N(0, 1) entries (NumPy ``default_rng(seed)``), A and the output, row sums checked.

    Returns:
      dict: ``q, k, v [T, H]``, ``weights [T, T]``, ``out [T, H]`` (float32 NumPy), ``row_sums [T]``
      (float64 sums of the float32 weights), ``max_row_error`` (``max |sum - 1|``), ``rows_ok`` (within
      :data:`ROW_SUM_TOLERANCE`), ``tolerance``, ``seed``.
    """
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((num_tokens, head_dim)).astype(np.float32) for _ in range(3))
    out, weights = attention(q, k, v)
    weights = np.asarray(weights)
    sums = weights.astype(np.float64).sum(axis=-1)
    err = float(np.max(np.abs(sums - 1.0)))
    return {
        "seed": seed,
        "q": q,
        "k": k,
        "v": v,
        "weights": weights,
        "out": np.asarray(out),
        "row_sums": sums,
        "max_row_error": err,
        "rows_ok": bool(err <= ROW_SUM_TOLERANCE),
        "tolerance": ROW_SUM_TOLERANCE,
    }


def _matrix(name: str, x: np.ndarray) -> str:
    rows = "\n".join("  [" + " ".join(f"{v:7.3f}" for v in row) + " ]" for row in np.asarray(x))
    return f"{name} {list(x.shape)}:\n{rows}"


def render_part1(data: dict[str, Any]) -> str:
    """Part 1 as text: Q, K, V, A with three decimals, the row sums and the verdict of the check."""
    T, H = data["q"].shape
    lines = [
        f"Part 1: the attention map in numbers ({T} tokens, d_k = {H}, seed {data['seed']})",
        _matrix("Q", data["q"]),
        _matrix("K", data["k"]),
        _matrix("V", data["v"]),
        _matrix("A = softmax(Q Kᵀ / √d_k)", data["weights"]),
        "row sums of A: " + " ".join(f"{s:.3f}" for s in data["row_sums"]),
        (
            f"verified: every row sums to 1 within {data['tolerance']:.0e} "
            f"(max |sum - 1| = {data['max_row_error']:.1e})"
            if data["rows_ok"]
            else f"CHECK FAILED: a row sum is off by {data['max_row_error']:.1e} > {data['tolerance']:.0e}"
        ),
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Part 2: side by side.
# ----------------------------------------------------------------------------------------------------


def side_by_side(seed: int, *, num_tokens: int = 6, head_dims: Sequence[int] = (8, 64, 512)) -> dict[str, Any]:
    """The same q, k (N(0, 1) entries) attended with ``scale=1/sqrt(d_k)`` and ``scale=1``: per-row entropy.

    Returns:
      dict: ``num_tokens``, ``max_entropy`` (``log T``) and ``rows``: one dict per ``d_k`` with
      ``head_dim``, ``entropy_scaled [T]``, ``entropy_unscaled [T]``, ``max_weight_scaled [T]``,
      ``max_weight_unscaled [T]``, ``weights_unscaled [T, T]``.
    """
    rng = np.random.default_rng(seed + 1)
    rows = []
    for H in head_dims:
        q, k, v = (rng.standard_normal((num_tokens, H)).astype(np.float32) for _ in range(3))
        _, w_scaled = attention(q, k, v)
        _, w_unscaled = attention(q, k, v, scale=1.0)
        rows.append(
            {
                "head_dim": int(H),
                "entropy_scaled": np.asarray(probes.entropy(w_scaled)),
                "entropy_unscaled": np.asarray(probes.entropy(w_unscaled)),
                "max_weight_scaled": np.asarray(probes.max_weight(w_scaled)),
                "max_weight_unscaled": np.asarray(probes.max_weight(w_unscaled)),
                "weights_unscaled": np.asarray(w_unscaled),
            }
        )
    return {"seed": seed, "num_tokens": num_tokens, "max_entropy": math.log(num_tokens), "rows": rows}


def render_side_by_side(data: dict[str, Any]) -> str:
    """Entropies per query row, scaled and unscaled, for each ``d_k``."""
    T = data["num_tokens"]
    lines = [
        f"Part 2a: the same attention with and without / √d_k ({T} tokens; entropy in nats, "
        f"uniform = log {T} = {data['max_entropy']:.3f}, one-hot = 0)"
    ]
    for row in data["rows"]:
        lines.append(f"  d_k = {row['head_dim']}")
        lines.append("    row            " + " ".join(f"{i:>7d}" for i in range(T)))
        lines.append("    H scaled       " + " ".join(f"{x:7.3f}" for x in row["entropy_scaled"]))
        lines.append("    H unscaled     " + " ".join(f"{x:7.3f}" for x in row["entropy_unscaled"]))
        lines.append("    max w unscaled " + " ".join(f"{x:7.3f}" for x in row["max_weight_unscaled"]))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Part 2: the sweep, the table, the laws.
# ----------------------------------------------------------------------------------------------------


def sweep(
    seed: int,
    *,
    head_dims: Sequence[int] = probes.DEFAULT_HEAD_DIMS,
    num_trials: int = 32,
    num_queries: int = 16,
    num_keys: int = 16,
    value_dim: int = 16,
    dtypes: Sequence[str] = ("float32",) + LOW_PRECISION_DTYPES,
    trials_per_batch: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> dict[str, Any]:
    """The saturation sweep in each dtype (same key, so the draws are paired across dtypes), summarised.

    float64 runs inside ``jax.enable_x64``. Each dtype is one program, compiled on its first run.
    ``progress``, if given, is called as ``progress(done, total, what)`` before each dtype's program
    (``what`` names it) and once at the end, e.g. with a :class:`jaxattn.progress.ProgressBar`.
    Returns ``{"config": ..., "summaries": {dtype: summary}}`` (see :func:`jaxattn.probes.summarize_sweep`).
    """
    config = dict(num_trials=num_trials, num_queries=num_queries, num_keys=num_keys, value_dim=value_dim)
    summaries = {}
    for i, name in enumerate(dtypes):
        if progress is not None:
            progress(i, len(dtypes), f"{name}: {len(head_dims)} d_k x {num_trials} trials")
        with jax.enable_x64(name == "float64"):
            res = probes.saturation_sweep(
                jax.random.key(seed), head_dims=head_dims, dtype=jnp.dtype(name), trials_per_batch=trials_per_batch, **config
            )
            summaries[name] = probes.summarize_sweep(res)
    if progress is not None:
        progress(len(dtypes), len(dtypes), "done")
    return {"seed": seed, "config": dict(config, head_dims=list(map(int, head_dims))), "summaries": summaries}


def sweep_table(summary: dict[str, Any]) -> list[dict[str, float]]:
    """One row per ``d_k``: Var(q·k), entropy, max weight, gradient and Jacobian norms, scaled and unscaled.

    ``grad_*`` are ``‖∂L/∂logits‖`` per query row (median and mean; ``ratio`` is scaled / unscaled);
    ``q_grad_*`` ``‖∂L/∂q‖`` per query row and ``k_grad_*`` ``‖∂L/∂k‖`` per key (median and mean).
    :data:`TABLE_COLUMNS` and :data:`QK_COLUMNS` pick the printed columns.
    """
    rows = []
    for i, d in enumerate(summary["head_dims"]):
        g = summary["logit_grad_norm"]
        row = {
            "d_k": int(d),
            "var_qk": float(summary["var_qk"][i]),
            "var_ratio": float(summary["var_ratio"][i]),
            "entropy_scaled": float(summary["entropy"]["mean"][0, i]),
            "entropy_unscaled": float(summary["entropy"]["mean"][1, i]),
            "entropy_median_unscaled": float(summary["entropy"]["median"][1, i]),
            "max_weight_scaled": float(summary["max_weight"]["mean"][0, i]),
            "max_weight_unscaled": float(summary["max_weight"]["mean"][1, i]),
            "grad_median_scaled": float(g["median"][0, i]),
            "grad_median_unscaled": float(g["median"][1, i]),
            "grad_mean_scaled": float(g["mean"][0, i]),
            "grad_mean_unscaled": float(g["mean"][1, i]),
            "jacobian_median_unscaled": float(summary["jacobian_norm"]["median"][1, i]),
            "jacobian_mean_unscaled": float(summary["jacobian_norm"]["mean"][1, i]),
            "zero_grad_fraction_unscaled": float(summary["zero_fraction"]["logit_grad"][1, i]),
        }
        for name, tag in (("q_grad_norm", "q"), ("k_grad_norm", "k")):
            for stat in ("median", "mean"):
                row[f"{tag}_grad_{stat}_scaled"] = float(summary[name][stat][0, i])
                row[f"{tag}_grad_{stat}_unscaled"] = float(summary[name][stat][1, i])
        row["grad_median_ratio"] = _ratio(row["grad_median_scaled"], row["grad_median_unscaled"])
        row["grad_mean_ratio"] = _ratio(row["grad_mean_scaled"], row["grad_mean_unscaled"])
        rows.append(row)
    return rows


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


TABLE_COLUMNS = (
    ("d_k", "d_k", "{:d}"),
    ("var_qk", "Var(q·k)", "{:.4g}"),
    ("entropy_scaled", "H sc", "{:.3f}"),
    ("entropy_unscaled", "H unsc", "{:.3f}"),
    ("entropy_median_unscaled", "H unsc med", "{:.2e}"),
    ("max_weight_scaled", "maxw sc", "{:.3f}"),
    ("max_weight_unscaled", "maxw unsc", "{:.3f}"),
    ("grad_median_scaled", "|g| med sc", "{:.3f}"),
    ("grad_median_unscaled", "|g| med unsc", "{:.2e}"),
    ("grad_median_ratio", "med ratio", "{:.3g}"),
    ("grad_mean_scaled", "|g| mean sc", "{:.3f}"),
    ("grad_mean_unscaled", "|g| mean unsc", "{:.4f}"),
    ("grad_mean_ratio", "mean ratio", "{:.3g}"),
    ("jacobian_median_unscaled", "|J| med unsc", "{:.2e}"),
    ("zero_grad_fraction_unscaled", "zero unsc", "{:.4f}"),
)


# The q and k gradient norms' columns: median and mean, scaled and unscaled, for q then k (the unscaled
# median, which collapses, in exponent notation).
QK_COLUMNS = (("d_k", "d_k", "{:d}"),) + tuple(
    (f"{g}_grad_{stat}_{mode}", f"|∂{g}| {stat.replace('median', 'med')} {mode.replace('scaled', 'sc')}",
     "{:.2e}" if (stat, mode) == ("median", "unscaled") else "{:.3f}")
    for g in "qk" for stat in ("median", "mean") for mode in ("scaled", "unscaled")
)


def render_table(rows: list[dict[str, float]], *, markdown: bool = False, columns: Sequence[tuple[str, str, str]] = TABLE_COLUMNS) -> str:
    """The sweep table as fixed-width text (or a Markdown table); ``columns`` (key, heading, format)."""
    heads = [h for _, h, _ in columns]
    cells = [[fmt.format(row[key]) for key, _, fmt in columns] for row in rows]
    if markdown:
        out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        out += ["| " + " | ".join(c) + " |" for c in cells]
        return "\n".join(out)
    widths = [max(len(h), *(len(c[j]) for c in cells)) for j, h in enumerate(heads)]
    line = lambda items: "  ".join(s.rjust(w) for s, w in zip(items, widths))
    return "\n".join([line(heads)] + [line(c) for c in cells])


def scaled_band(summary: dict[str, Any]) -> dict[str, dict[str, float]]:
    """For the scaled mode: min, max and max/min over ``d_k`` of each statistic's mean and median."""
    band = {}
    for name in ("entropy", "max_weight", "jacobian_norm", "logit_grad_norm", "q_grad_norm", "k_grad_norm"):
        for stat in ("mean", "median"):
            x = np.asarray(summary[name][stat][0], np.float64)
            lo, hi = float(x.min()), float(x.max())
            band[f"{name}_{stat}"] = {"min": lo, "max": hi, "ratio": hi / lo if lo > 0 else math.inf}
    return band


def readout_norm_mean(value_dim: int) -> float:
    """``E‖r‖`` for the sweep's read-out row ``r ~ N(0, I_V / V)``: ``√(2/V) Γ((V+1)/2) / Γ(V/2)`` (→ 1).

    Given ``r``, the read-out difference of two keys' values ``r·(v_a - v_b)`` is ``N(0, 2‖r‖²)``, so
    ``E|r·(v_a - v_b)| = (2/√π) E‖r‖``: every gradient law carries this factor (0.985 at V = 16).
    """
    V = int(value_dim)
    return math.sqrt(2.0 / V) * math.exp(math.lgamma((V + 1) / 2) - math.lgamma(V / 2))


def key_gap_median(num_queries: int, num_keys: int, *, samples: int = 20_000, seed: int = 0) -> float:
    """Median of a key's smallest gap over the T query rows, for T × S standard normal logits (Monte Carlo).

    ``‖∂L/∂k_s‖`` sums the rows' ``∂L/∂z_ts · q_t``, each ``≈ e^{-σ G_ts}`` with ``G_ts`` the gap between
    row t's largest logit and key s's (or, where s is the largest, to the second largest); the smallest
    over t dominates, so the median falls like ``exp(-√d_k · median_s min_t G_ts)``. float64 NumPy,
    ``samples`` draws of the T × S matrix, seeded: deterministic.
    """
    z = np.random.default_rng(seed).standard_normal((samples, num_queries, num_keys))  # [n, T, S]
    top2 = np.sort(z, axis=-1)[..., -2:]  # [n, T, 2]
    gap = np.where(z == top2[..., 1:], z - top2[..., :1], top2[..., 1:] - z)  # [n, T, S]
    return float(np.median(gap.min(axis=1)))


def fit_laws(summary: dict[str, Any], *, dtype: str, min_head_dim: int = FIT_MIN_HEAD_DIM) -> dict[str, Any]:
    """The unscaled statistics' laws: predicted (extreme-value theory) against fitted on ``d_k >= min_head_dim``.

    Medians: ``c · exp(-b √d_k)`` (Jacobian, ``∂L/∂logits``, ``1 - max weight``) and ``c · √d_k · exp(-b √d_k)``
    (``∂L/∂q`` and ``∂L/∂k`` carry a key or query vector of norm ≈ √d_k); predicted ``b = m_S`` (median
    top-two gap of S standard normals; for ``∂L/∂k`` the median of a key's smallest gap over the T rows,
    :func:`key_gap_median`) and ``c = 2`` for the Jacobian. Means: ``c · d_k^a``, predicted ``a = -1/2`` and
    ``c`` from the gap density at 0, ``f_D(0)``; ``∂L/∂q`` and ``∂L/∂k`` tend to constants,
    ``√(2/π) f_D(0) E‖r‖`` and ``(2T/S) f_D(0) E‖r‖ / √π``, fitted as ``C (1 + κ/√d_k)``. A statistic that
    cannot be fitted is reported as ``{"form": ..., "not_fitted": reason}`` instead of raising: one that is 0
    (gradients in float16, ``1 - max weight`` already in float32; or a tiny sweep whose few rows all
    underflowed), negative or not finite at some fitted ``d_k`` (the reason names those ``d_k``), fewer than
    2 distinct ``d_k >= min_head_dim``, or a constant fit whose ``C`` is 0.
    Zero-gradient fraction: ``P(√d_k · D > g_dtype)``.
    """
    dims = np.asarray(summary["head_dims"])
    use = dims >= min_head_dim
    fit_dims = dims[use]
    S, T, V = summary["num_keys"], summary["num_queries"], summary["value_dim"]
    m, f0 = probes.gap_median(S), probes.gap_density_at_zero(S)
    r_norm = readout_norm_mean(V)
    med = lambda name: np.asarray(summary[name]["median"][1], np.float64)[use]
    mean = lambda name: np.asarray(summary[name]["mean"][1], np.float64)[use]
    fit = functools.partial(_fit_or_reason, fit_dims, dtype=dtype, min_head_dim=min_head_dim)
    out: dict[str, Any] = {
        "dtype": dtype, "num_keys": S, "num_queries": T, "value_dim": V, "fit_head_dims": fit_dims.tolist(),
        "gap_median": m, "gap_density_at_zero": f0, "readout_norm_mean": r_norm,
    }
    medians = (  # key, y, times √d_k, b predicted, c predicted
        ("median_jacobian_norm", med("jacobian_norm"), False, m, 2.0),
        ("median_logit_grad_norm", med("logit_grad_norm"), False, m, None),
        ("median_q_grad_norm", med("q_grad_norm"), True, m, None),
        ("median_k_grad_norm", med("k_grad_norm"), True, key_gap_median(T, S), None),
        # in float32, 1 - p_max rounds to 0 once p_2 < 6e-8
        ("median_one_minus_max_weight", 1 - med("max_weight"), False, m, 1.0),
    )
    for key, y, times_sqrt_d, b_pred, c_pred in medians:
        form = "c·√d_k·exp(-b·√d_k)" if times_sqrt_d else "c·exp(-b·√d_k)"
        out[key] = fit(form, y, functools.partial(_stretched_exp_law, times_sqrt_d=times_sqrt_d, b_predicted=b_pred,
                                                  c_predicted=c_pred))
    y = m * np.sqrt(fit_dims.astype(np.float64))
    out["median_entropy"] = {
        "form": "(1 + m√d_k)·exp(-m√d_k)",
        "measured_over_predicted": (med("entropy") / ((1 + y) * np.exp(-y))).tolist(),
    }
    means = (  # key, y, c predicted
        ("mean_jacobian_norm", mean("jacobian_norm"), f0),
        ("mean_entropy", mean("entropy"), math.pi**2 / 6 * f0),
        ("mean_logit_grad_norm", mean("logit_grad_norm"), math.sqrt(2 / math.pi) * f0 * r_norm),
        ("mean_one_minus_max_weight", 1 - mean("max_weight"), math.log(2) * f0),
    )
    for key, y, c_pred in means:
        out[key] = fit("c·d_k^a; and C/√d_k·(1 + κ/√d_k)", y, functools.partial(_power_law, c_predicted=c_pred))
    limits = (  # key, statistic, the constant predicted
        ("mean_q_grad_norm", "q_grad_norm", math.sqrt(2 / math.pi) * f0 * r_norm),
        ("mean_k_grad_norm", "k_grad_norm", 2 * T / S * f0 * r_norm / math.sqrt(math.pi)),
    )
    for key, name, limit in limits:
        out[key] = fit("C·(1 + κ/√d_k) -> C", mean(name), functools.partial(_constant_law, limit_predicted=limit),
                       on_failure={"limit_predicted": limit})
    return out


def _fit_or_reason(d: np.ndarray, form: str, y: np.ndarray, law: Callable[..., dict[str, Any]], *, dtype: str,
                   min_head_dim: int, on_failure: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"form": form, **law(d, y)}``, or ``{"form": form, "not_fitted": reason, **on_failure}`` when
    ``y [P]`` over ``d [P]`` cannot be fitted (:func:`_check_fittable`) or the fit raises ``ValueError``."""
    try:
        _check_fittable(d, y, dtype=dtype, min_head_dim=min_head_dim)
        return {"form": form, **law(d, y)}
    except ValueError as e:
        return {"form": form, "not_fitted": str(e), **(on_failure or {})}


def _stretched_exp_law(d: np.ndarray, y: np.ndarray, *, times_sqrt_d: bool, b_predicted: float,
                       c_predicted: float | None) -> dict[str, Any]:
    """A median's ``c·exp(-b·√d_k)``, or ``c·√d_k·exp(-b·√d_k)`` with ``times_sqrt_d``, fitted."""
    b, c = probes.fit_stretched_exp(d, y / np.sqrt(d.astype(np.float64)) if times_sqrt_d else y)
    return {"b": b, "c": c, "b_predicted": b_predicted, "c_predicted": c_predicted}


def _power_law(d: np.ndarray, y: np.ndarray, *, c_predicted: float) -> dict[str, Any]:
    """A mean's ``c·d_k^a`` (predicted ``a = -1/2``) and its refinement ``C/√d_k·(1 + κ/√d_k)``, fitted."""
    a, c = probes.fit_power_law(d, y)
    c_inf, kappa = _fit_inverse_sqrt(d, y)
    return {"a": a, "c": c, "a_predicted": -0.5, "c_predicted": c_predicted, "C": c_inf, "kappa": kappa}


def _constant_law(d: np.ndarray, y: np.ndarray, *, limit_predicted: float) -> dict[str, Any]:
    """A mean that tends to a constant: ``c·d_k^a`` (predicted ``a = 0``) and ``C·(1 + κ/√d_k)``, fitted."""
    a, c = probes.fit_power_law(d, y)
    c_inf, kappa = _fit_constant(d, y)
    return {"a": a, "c": c, "a_predicted": 0.0, "C": c_inf, "kappa": kappa, "limit_predicted": limit_predicted,
            "at_largest_d_k": float(y[-1])}


def _check_fittable(d: np.ndarray, y: np.ndarray, *, dtype: str, min_head_dim: int) -> None:
    """``ValueError`` saying why ``y [P]`` over ``d [P]`` cannot be fitted in log space (None if it can).

    A fit needs at least 2 distinct ``d_k >= min_head_dim`` and every ``y`` finite and > 0 (a median or
    mean that underflowed to 0, or a ``1 - max weight`` that rounded to 0 or below, cannot be).
    """
    d, y = np.asarray(d), np.asarray(y, np.float64)
    if np.unique(d).size < 2:
        raise ValueError(f"needs at least 2 distinct d_k >= {min_head_dim}, the sweep has {d.tolist()}")
    reasons = []
    for what, bad in (("0", y == 0), ("negative", y < 0), ("not finite", ~np.isfinite(y))):
        if np.any(bad):
            reasons.append(f"{what} in {dtype} at d_k = {d[bad].tolist()}")
    if reasons:
        raise ValueError("; ".join(reasons))


def _fit_constant(d: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares ``y = C + Cκ/√d`` (a constant with its first correction); returns ``(C, κ)``.

    ``ValueError`` when the fitted ``C`` is 0 or either coefficient is not finite (κ undefined).
    """
    d = np.asarray(d, np.float64)
    A = np.stack([np.ones_like(d), 1 / np.sqrt(d)], axis=1)
    (c0, c1), *_ = np.linalg.lstsq(A, np.asarray(y, np.float64), rcond=None)
    if not (np.isfinite(c0) and np.isfinite(c1) and c0 != 0):
        raise ValueError(f"the fitted constant C is {float(c0)}, so κ = (Cκ)/C is undefined")
    return float(c0), float(c1 / c0)


def _fit_inverse_sqrt(d: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares ``y·√d = C + Cκ/√d`` (the law with its first correction); returns ``(C, κ)``."""
    return _fit_constant(d, np.asarray(y, np.float64) * np.sqrt(np.asarray(d, np.float64)))


def zero_fractions(sweep_data: dict[str, Any]) -> dict[str, Any]:
    """Fraction of unscaled rows whose ``∂L/∂logits`` is exactly zero, per dtype, measured and predicted."""
    out = {}
    for name, summary in sweep_data["summaries"].items():
        laws = probes.predicted_laws(summary["head_dims"], summary["num_keys"], gap_threshold=probes.underflow_gap(name))
        out[name] = {
            "underflow_gap": probes.underflow_gap(name),
            "measured": np.asarray(summary["zero_fraction"]["logit_grad"][1]).tolist(),
            "measured_scaled": np.asarray(summary["zero_fraction"]["logit_grad"][0]).tolist(),
            "predicted": np.asarray(laws["zero_fraction"]).tolist(),
        }
    return out


def render_zero_fractions(zeros: dict[str, Any], head_dims: Sequence[int]) -> str:
    """:func:`zero_fractions` as a text table: per dtype, the measured and predicted fraction of unscaled
    rows whose logit gradient is exactly zero at each head dimension, then the scaled rows' largest."""
    lines = ["fraction of unscaled rows with exactly-zero ∂L/∂logits (measured / predicted P(√d_k·D > g)):"]
    lines.append("  dtype      g     " + " ".join(f"{d:>13d}" for d in head_dims))
    for name, z in zeros.items():
        cells = " ".join(f"{m:6.4f}/{p:6.4f}" for m, p in zip(z["measured"], z["predicted"]))
        lines.append(f"  {name:9s} {z['underflow_gap']:5.1f}  {cells}")
    lines.append("  (scaled rows: " + ", ".join(f"{n} max {max(z['measured_scaled']):.4f}" for n, z in zeros.items()) + ")")
    return "\n".join(lines)


def render_laws(laws: dict[str, Any]) -> str:
    """The fitted laws against the predicted constants, one line each."""
    L = laws
    dims = L["fit_head_dims"]
    span = f"d_k = {dims[0]} … {dims[-1]}" if dims else "no d_k"
    lines = [
        f"laws of the unscaled statistics ({L['dtype']}, T = {L['num_queries']} rows, S = {L['num_keys']} keys, fit on "
        f"{span}; m_S = median top-two gap = {L['gap_median']:.4f}, "
        f"f_D(0) = {L['gap_density_at_zero']:.4f}, E‖r‖ = {L['readout_norm_mean']:.4f}):"
    ]
    def median(f):
        pred_c = "" if f["c_predicted"] is None else f", predicted c = {f['c_predicted']:.3g}"
        return f"{f['form']}: b = {f['b']:.4f} (predicted {f['b_predicted']:.4f}), c = {f['c']:.3g}{pred_c}"

    lines += _law_lines(L, ("median_jacobian_norm", "median_logit_grad_norm", "median_q_grad_norm",
                            "median_k_grad_norm", "median_one_minus_max_weight"), median, "{form}: not fitted")
    ratio = L["median_entropy"]["measured_over_predicted"]
    lines.append(f"  {'median_entropy':30s} {L['median_entropy']['form']}: measured/predicted = " + " ".join(f"{r:.2f}" for r in ratio))
    lines += _law_lines(L, ("mean_jacobian_norm", "mean_entropy", "mean_logit_grad_norm", "mean_one_minus_max_weight"),
                        lambda f: f"c·d_k^a: a = {f['a']:.3f} (predicted -0.5), c = {f['c']:.3f}; C/√d_k·(1+κ/√d_k): "
                                  f"C = {f['C']:.3f} (predicted {f['c_predicted']:.3f}), κ = {f['kappa']:.2f}",
                        "not fitted")
    lines += _law_lines(L, ("mean_q_grad_norm", "mean_k_grad_norm"),
                        lambda f: f"tends to a constant: c·d_k^a: a = {f['a']:.3f}; C·(1+κ/√d_k): C = {f['C']:.3f} "
                                  f"(predicted limit {f['limit_predicted']:.3f}), κ = {f['kappa']:.2f}; at the largest "
                                  f"d_k {f['at_largest_d_k']:.3f}",
                        "tends to a constant (predicted limit {limit_predicted:.3f}): not fitted")
    return "\n".join(lines)


def _law_lines(laws: dict[str, Any], keys: Sequence[str], fitted: Callable[[dict[str, Any]], str],
               unfitted: str) -> list[str]:
    """One line per law of :func:`render_laws`: ``fitted(law)``, or ``unfitted`` (formatted with the law's
    fields) and the reason when it could not be fitted."""
    out = []
    for key in keys:
        f = laws[key]
        text = f"{unfitted.format(**f)}, {f['not_fitted']}" if "not_fitted" in f else fitted(f)
        out.append(f"  {key:30s} {text}")
    return out


# ----------------------------------------------------------------------------------------------------
# The figure.
# ----------------------------------------------------------------------------------------------------


def plot_sweep(summary: dict[str, Any], zeros: dict[str, Any] | None = None, *, title: str = ""):
    """A 2×2 log-log figure: Var(q·k); entropy; Jacobian norm (median, mean, 10–90% band) with the laws;
    zero-gradient fraction per dtype. Returns a matplotlib ``Figure`` (Agg canvas, nothing displayed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    d = np.asarray(summary["head_dims"], np.float64)
    S = summary["num_keys"]
    laws = probes.predicted_laws(d.astype(int), S)
    fig = Figure(figsize=(10, 7.5), dpi=80)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)

    ax = axes[0, 0]
    ax.loglog(d, summary["var_qk"], "o-", label="Monte Carlo Var(q·k)")
    ax.loglog(d, d, "k--", lw=1, label="d_k")
    _finish_panel(ax, "Var(q·k) = d_k", legend_size=None)

    ax = axes[0, 1]
    for mode, style in ((0, "-"), (1, "--")):
        tag = "scaled" if mode == 0 else "unscaled"
        ax.loglog(d, summary["entropy"]["mean"][mode], "o" + style, label=f"mean, {tag}")
        ax.loglog(d, summary["entropy"]["median"][mode], "s" + style, label=f"median, {tag}")
    _finish_panel(ax, "row entropy (nats)", d, mean_law=(laws["mean_entropy"], "(π²/6) f_D(0)/√d_k"),
                  median_law=(laws["median_entropy"], "(1+m√d_k)·exp(-m√d_k)"))

    ax = axes[1, 0]
    for mode, color in ((0, "C0"), (1, "C3")):
        tag = "scaled" if mode == 0 else "unscaled"
        j = summary["jacobian_norm"]
        qs = j["quantiles"][mode]
        lo, hi = np.maximum(qs[:, 0], 1e-300), np.maximum(qs[:, -1], 1e-300)
        ax.fill_between(d, lo, hi, color=color, alpha=0.15)
        ax.loglog(d, j["median"][mode], "s-", color=color, label=f"median ‖J‖_F, {tag}")
        ax.loglog(d, j["mean"][mode], "o--", color=color, label=f"mean ‖J‖_F, {tag}")
    _finish_panel(ax, "softmax Jacobian norm (band: 10–90%)", d, mean_law=(laws["mean_jacobian"], "f_D(0)/√d_k"),
                  median_law=(laws["median_jacobian"], "2·exp(-m√d_k)"))

    ax = axes[1, 1]
    if zeros:
        for i, (name, z) in enumerate(zeros.items()):
            ax.semilogx(d, z["measured"], "o-", color=f"C{i}", label=f"{name} measured")
            ax.semilogx(d, z["predicted"], ":", color=f"C{i}", label=f"{name} P(√d_k D > {z['underflow_gap']:.1f})")
    ax.set_ylim(-0.02, 1.0)
    _finish_panel(ax, "unscaled rows with exactly-zero ∂L/∂logits")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _finish_panel(ax, title: str, d: np.ndarray | None = None, *, mean_law: tuple[Any, str] | None = None,
                  median_law: tuple[Any, str] | None = None, legend_size: int | None = 7) -> None:
    """A panel of :func:`plot_sweep` completed: the predicted laws ``(values over d, label)`` in black
    (the mean's dotted, the median's dash-dotted), then its title, the ``d_k`` axis and the legend."""
    for law, style in ((mean_law, "k:"), (median_law, "k-.")):
        if law is not None:
            ax.loglog(d, law[0], style, lw=1, label=law[1])
    ax.set_title(title)
    ax.set_xlabel("d_k")
    ax.legend(fontsize=legend_size)


# ----------------------------------------------------------------------------------------------------
# Files, written atomically.
# ----------------------------------------------------------------------------------------------------


def save_figure(fig, path: str) -> str:
    """Save a matplotlib figure as PNG at ``path`` atomically; returns the absolute path."""
    return str(atomic_write(path, lambda f: fig.savefig(f, format="png")))
