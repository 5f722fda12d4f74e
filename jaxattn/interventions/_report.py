"""Every head's effect by every method, side by side: tables, rank correlations and figures.

What ``experiments/heads.py`` prints and writes, as functions that return data (numbers, strings, PNG
bytes); nothing here prints or writes files.

Axis alphabet: B inputs of a batch, L layers, N heads, T queries, S keys.
"""

from __future__ import annotations

import io
from typing import Any, Mapping, Sequence

import numpy as np

from jaxattn.interventions._effects import (
    ablation_effects,
    attention_gradient,
    attribution_patching,
    gate_gradients,
    patching_effects,
)
from jaxattn.interventions._model import Bound
from jaxattn.interventions._stats import spearman
from jaxattn.interventions._text import encode_choices

# What each table means, in the order reports show them.
METHODS = {
    "ablation": "metric(head zeroed) - metric(clean)",
    "mean_ablation": "metric(head's z replaced by its mean over a reference set) - metric(clean)",
    "patch_z": "metric(head's z from the source input) - metric(clean)",
    "patch_attn": "metric(head's attention weights from the source input) - metric(clean)",
    "gate_estimate": "-d metric / d head_mask at 1: the first-order estimate of 'ablation'",
    "attribution": "(z_source - z_clean) . d metric / d z: the first-order estimate of 'patch_z'",
}


def choice_pair(tokenizer: Any, clean: str, source: str, choices: Sequence[str]) -> dict[str, Any]:
    """Two-choice inputs for a clean and a source prompt, padded to one length, and how they line up.

    Returns:
      ``{"clean", "source"}`` (each :func:`encode_choices`' dict), ``"aligned"`` (the two rows have the
      same real tokens everywhere but where the prompts differ, so position ``t`` of one is position
      ``t`` of the other: patching is meaningful) and ``"differ"`` (the positions whose tokens differ).
    """
    a = encode_choices(tokenizer, clean, choices)
    b = encode_choices(tokenizer, source, choices)
    T = max(a["input_ids"].shape[1], b["input_ids"].shape[1])
    a = encode_choices(tokenizer, clean, choices, length=T)
    b = encode_choices(tokenizer, source, choices, length=T)
    same_mask = bool(np.array_equal(a["attention_mask"], b["attention_mask"]))
    differ = np.flatnonzero(np.any(a["input_ids"] != b["input_ids"], axis=0)) if same_mask else np.arange(T)
    return {"clean": a, "source": b, "aligned": same_mask, "differ": differ.tolist()}


def attention_row_reduce(x: Any, row: int | Sequence[int], keys: tuple[int, int] | None = None) -> np.ndarray:
    """``[L, N]``: ``x [(B,) L, N, T, S]`` at query ``row`` (one per batch row, or one for all), summed over
    the keys ``keys = (start, stop)`` (all when ``None``) and over the batch."""
    a = np.asarray(x, np.float64)
    if a.ndim == 4:
        a = a[None]
    if a.ndim != 5:
        raise ValueError(f"x must be [L, N, T, S] or [B, L, N, T, S], received shape {np.shape(x)}")
    rows = np.broadcast_to(np.asarray(row), (a.shape[0],))
    out = np.zeros(a.shape[1:3])
    for b, r in enumerate(rows):
        picked = a[b, :, :, int(r), :]  # [L, N, S]
        out += picked[..., keys[0]:keys[1]].sum(-1) if keys is not None else picked.sum(-1)
    return out


def head_tables(bound: Bound, metric: Any, *, source: Bound | None = None, reference: Any = None,
                rows: Mapping[str, Any] | None = None, chunk: int | None = 16) -> dict[str, np.ndarray]:
    """Every method's ``[L, N]`` table for one metric (see :data:`METHODS`), plus attention × gradient rows.

    Args:
      bound: the model on the clean input.
      metric: ``output -> scalar``.
      source: the model on the source input, of the clean one's shape (for ``patch_z``, ``patch_attn``,
        ``attribution``); ``None`` leaves those out.
      reference: a :func:`reference_mean` of ``z`` (for ``mean_ablation``); ``None`` leaves it out.
      rows: ``{name: query row}`` (an index, or one per batch row): adds ``attn_grad[name]``, the
        attention × gradient of that query row summed over its keys; ``attn_grad[all]``, over every row
        and key, is always added (it equals ``-gate_estimate``).
      chunk: interventions run at once inside each compiled program.
    """
    tables = {"ablation": ablation_effects(bound, metric, chunk=chunk)}
    if reference is not None:
        tables["mean_ablation"] = patching_effects(bound, metric, reference, chunk=chunk)
    if source is not None:
        captured = source(capture=("z", "attn_weights")).captured
        tables["patch_z"] = patching_effects(bound, metric, captured["z"], chunk=chunk)
        tables["patch_attn"] = patching_effects(bound, metric, captured["attn_weights"], name="attn_weights", chunk=chunk)
    tables["gate_estimate"] = -gate_gradients(bound, metric)
    if source is not None:
        tables["attribution"] = attribution_patching(bound, metric, captured["z"])
    ag = attention_gradient(bound, metric)  # [(B,) L, N, T, S]
    for name, row in (rows or {}).items():
        tables[f"attn_grad[{name}]"] = attention_row_reduce(ag, row)
    agn = np.asarray(ag, np.float64)
    tables["attn_grad[all]"] = agn.sum((-2, -1)) if agn.ndim == 4 else agn.sum((0, -2, -1))
    return {k: np.asarray(v, np.float64) for k, v in tables.items()}


def correlations(tables: Mapping[str, Any], *, absolute: bool = False) -> dict[str, dict[str, float]]:
    """Spearman's rho between every two tables (over the L·N heads); ``absolute``: of their magnitudes."""
    f = (lambda t: np.abs(np.asarray(t))) if absolute else np.asarray
    names = list(tables)
    return {a: {b: spearman(f(tables[a]), f(tables[b])) for b in names} for a in names}


def render_correlations(rho: Mapping[str, Mapping[str, float]], *, title: str = "") -> str:
    """A correlation matrix as text (names shortened to 12 characters)."""
    names = list(rho)
    width = max(12, max(len(n) for n in names))
    lines = [title] if title else []
    lines.append(" " * (width + 1) + " ".join(f"{n[:12]:>12}" for n in names))
    for a in names:
        lines.append(f"{a:<{width}} " + " ".join(f"{rho[a][b]:>12.2f}" for b in names))
    return "\n".join(lines)


def top_heads(tables: Mapping[str, Any], by: str, *, k: int = 10, columns: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The ``k`` heads with the largest ``|tables[by]|``, each with every table's value (or ``columns``)."""
    key = np.abs(np.asarray(tables[by]))
    order = np.argsort(-key, axis=None, kind="stable")[:k]
    columns = list(tables) if columns is None else list(columns)
    out = []
    for flat in order:
        l, n = np.unravel_index(int(flat), key.shape)
        out.append({"layer": int(l), "head": int(n), **{c: float(np.asarray(tables[c])[l, n]) for c in columns}})
    return out


def render_top(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], *, title: str = "") -> str:
    """:func:`top_heads` as a Markdown table."""
    lines = [title] if title else []
    lines.append("| layer | head | " + " | ".join(columns) + " |")
    lines.append("|---|---|" + "---|" * len(columns))
    for r in rows:
        lines.append(f"| {r['layer']} | {r['head']} | " + " | ".join(f"{r[c]:+.4f}" for c in columns) + " |")
    return "\n".join(lines)


def heatmaps_png(tables: Mapping[str, Any], *, title: str = "", dpi: int = 100) -> bytes:
    """One ``[L, N]`` heatmap per table (layers down, heads across), each on its own symmetric color scale.

    The tables' names and ``title`` are drawn literally (no mathtext or TeX: a ``$`` is a dollar sign)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(tables)
    cols = min(4, len(names))
    rows = -(-len(names) // cols)
    L, N = np.asarray(tables[names[0]]).shape
    fig = Figure(figsize=(cols * (1.2 + 0.35 * N), rows * (1.0 + 0.16 * L) + 0.6))
    FigureCanvasAgg(fig)
    for i, name in enumerate(names):
        ax = fig.add_subplot(rows, cols, i + 1)
        t = np.asarray(tables[name], np.float64)
        finite = np.abs(t[np.isfinite(t)])  # NaN entries (a NaN table cell) drawn blank, not the scale's end
        lim = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
        im = ax.imshow(t, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
        ax.set_title(str(name), fontsize=9, parse_math=False, usetex=False)
        ax.set_xlabel("head", fontsize=8)
        ax.set_ylabel("layer", fontsize=8)
        ax.tick_params(labelsize=7)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04).ax.tick_params(labelsize=7)
    if title:
        fig.suptitle(title, fontsize=10, parse_math=False, usetex=False)
    fig.tight_layout(rect=(0, 0, 1, 0.97) if title else (0, 0, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def bound_summary(result: Mapping[str, Any]) -> dict[str, Any]:
    """The entropy floor against the measured entropy (:func:`entropy_bounds`' result), per layer and overall.

    Rows with a single key (the first row of a causal map) are left out: their entropy and floor are 0.
    """
    bound = np.asarray(result["bound"], np.float64)  # [L, N, T]
    ent = np.asarray(result["entropy"], np.float64)
    beta = np.asarray(result["spread_bound"], np.float64)
    spread = np.asarray(result["spread"], np.float64)
    keep = np.ones(bound.shape[-1], bool)
    if np.all(bound[..., 0] == 0) and np.all(np.abs(ent[..., 0]) < 1e-6):
        keep[0] = False  # a causal first row: one key
    b, e, s, sp = bound[..., keep], ent[..., keep], beta[..., keep], spread[..., keep]
    per_layer = [{"layer": i, "bound": float(b[i].mean()), "entropy": float(e[i].mean()),
                  "spread_bound": float(np.median(s[i])), "spread": float(np.median(sp[i])),
                  "sigma": float(np.median(np.asarray(result["sigma"])[i]))} for i in range(b.shape[0])]
    return {
        "heads": int(b.shape[0] * b.shape[1]),
        "rows": int(b.size),
        "holds": bool(np.all(b <= e + 1e-5)),
        "min_gap": float(np.min(e - b)),
        "informative_rows": float(np.mean(b > 1e-6)),
        "mean_bound": float(b.mean()),
        "mean_entropy": float(e.mean()),
        "median_spread_bound": float(np.median(s)),
        "median_spread": float(np.median(sp)),
        "median_sigma": float(np.median(result["sigma"])),
        "per_layer": per_layer,
    }


def render_bound(summary: Mapping[str, Any], *, name: str = "") -> str:
    """:func:`bound_summary` as Markdown: the overall line, then one row per layer."""
    s = summary
    lines = [f"{name}: {s['heads']} heads, {s['rows']} rows; floor <= measured on every row: {s['holds']} "
             f"(smallest gap {s['min_gap']:.3g} nats); rows where the floor is above 0: {100 * s['informative_rows']:.1f}%",
             f"mean floor {s['mean_bound']:.4f} nats vs mean measured entropy {s['mean_entropy']:.4f} nats; median "
             f"logit-spread bound beta {s['median_spread_bound']:.3g} vs the logits' actual spread {s['median_spread']:.3g}; "
             f"median sigma {s['median_sigma']:.3g}",
             "",
             "| layer | mean floor (nats) | mean entropy (nats) | median beta | median actual spread | median sigma |",
             "|---|---|---|---|---|---|"]
    for r in s["per_layer"]:
        lines.append(f"| {r['layer']} | {r['bound']:.4f} | {r['entropy']:.4f} | {r['spread_bound']:.3g} | "
                     f"{r['spread']:.3g} | {r['sigma']:.3g} |")
    return "\n".join(lines)
