"""Beyond √d_k: the saturation sweep under remedies for saturated attention, on the same random draws.

One jit(vmap) program (jaxattn.probes.saturation_sweep with remedies=) runs every remedy over d_k: none,
1/√d_k, q/k RMS norm (with and without 1/√d_k), logit caps c, fixed temperatures τ, and σReparam's spectral
reparametrisation of the q/k projections (with and without 1/√d_k). Writes into the output folder named on
screen:

- remedies.json: one record per remedy and d_k: {"remedy", "d_k", "num_keys", "cap", "mean_entropy",
  "median_max_weight", "median_logit_grad_norm"};
- remedies_details.json: the configuration, each remedy's definition, the bounds a cap guarantees and the
  extremes its rows reached, the laws fitted where they apply, σ(W) under σReparam, the timings;
- remedies.png (the statistics over d_k) and remedies_bounds.png (the capped rows against their bounds).

--quick: d_k = 16 … 1024, 8 trials (a smoke run, well under 2 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's jaxattn, whatever is installed

import numpy as np

from jaxattn import lab, probes
from jaxattn.io import NO_CACHE_VARIABLE, OutputFolderError, int_at_least, prepare_output_folder, use_compilation_cache, write_json
from jaxattn.progress import step

OUTPUTS = ("remedies.json", "remedies_details.json", "remedies.png", "remedies_bounds.png")
QUICK = dict(head_dims=(16, 64, 256, 1024), trials=8)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="remedies-output", help="output folder (created; default remedies-output/)")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="an int >= 0 (default 0)")
    p.add_argument("--head-dims", type=int_at_least(1), nargs="+", default=list(probes.DEFAULT_HEAD_DIMS),
                   help="d_k values (default 8 16 … 4096)")
    p.add_argument("--trials", type=int_at_least(1), default=32, help="random trials per d_k (default 32)")
    p.add_argument("--queries", type=int_at_least(1), default=16, help="query rows per trial (default 16)")
    p.add_argument("--keys", type=int_at_least(2, " (a row needs at least two keys to choose between)"), default=16,
                   help="keys per row, S >= 2 (default 16)")
    p.add_argument("--trials-per-batch", type=int_at_least(1), default=4,
                   help="vmap this many trials of each d_k at a time inside the one program (bounds the memory of "
                        "σReparam's d_k × d_k projections; default 4)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: d_k {' '.join(map(str, QUICK['head_dims']))}, {QUICK['trials']} trials "
                        f"(in place of --head-dims and --trials, whatever they say)")
    p.add_argument("--no-cache", dest="cache", action="store_false",
                   help="do not keep compiled programs across runs (default: kept in $XDG_CACHE_HOME/jaxattn, "
                        f"else ~/.cache/jaxattn; {NO_CACHE_VARIABLE}=1 does the same)")
    args = p.parse_args(argv)
    if args.quick:
        args.head_dims, args.trials = list(QUICK["head_dims"]), QUICK["trials"]
    args.head_dims = sorted(set(args.head_dims))
    return args


# ----------------------------------------------------------------------------------------------------
# Numbers.
# ----------------------------------------------------------------------------------------------------


def records(summary: dict) -> list[dict]:
    """One record per remedy and d_k (the fields of remedies.json)."""
    out = []
    for m, remedy in enumerate(summary["remedies"]):
        for p, d in enumerate(summary["head_dims"]):
            out.append({
                "remedy": remedy.name,
                "d_k": int(d),
                "num_keys": int(summary["num_keys"]),
                "cap": remedy.logit_cap,
                "mean_entropy": float(summary["entropy"]["mean"][m, p]),
                "median_max_weight": float(summary["max_weight"]["median"][m, p]),
                "median_logit_grad_norm": float(summary["logit_grad_norm"]["median"][m, p]),
            })
    return out


def bound_checks(result: dict) -> list[dict]:
    """Per capped remedy and d_k: the bounds and the extremes the rows reached (max weight, entropy)."""
    out = []
    for m, remedy in enumerate(result["remedies"]):
        if remedy.logit_cap is None:
            continue
        for p, d in enumerate(result["head_dims"]):
            w, h = result["max_weight"][m, p], result["entropy"][m, p]
            out.append({
                "remedy": remedy.name, "d_k": int(d), "cap": remedy.logit_cap,
                "max_weight_bound": float(result["max_weight_bound"][m]), "max_weight_max": float(w.max()),
                "entropy_floor": float(result["entropy_floor"][m]), "entropy_min": float(h.min()),
                "rows": int(w.size),
                "rows_within_bounds": int(np.sum((w <= result["max_weight_bound"][m] * (1 + 4 * np.finfo(np.float32).eps))
                                                 & (h >= result["entropy_floor"][m] - 1e-5))),
            })
    return out


def logit_std(summary: dict) -> np.ndarray:
    """``[M, P]``: the standard deviation of each remedy's logits before the cap, ``scale · sqrt(Var(q'·k'))``."""
    return np.asarray(summary["logit_scale"]) * np.sqrt(np.asarray(summary["var_qk"]))


# ----------------------------------------------------------------------------------------------------
# Text.
# ----------------------------------------------------------------------------------------------------


def render_table(summary: dict) -> str:
    """Markdown: one line per remedy and d_k."""
    lines = ["| remedy | d_k | logit std | H mean | H median | max w median | ‖∂L/∂x‖ median | ‖∂L/∂x‖ mean | "
             "‖∂L/∂q‖ median | zero ∂L/∂x |", "|" + "---|" * 10]
    std = logit_std(summary)
    for m, name in enumerate(summary["remedy_names"]):
        for p, d in enumerate(summary["head_dims"]):
            lines.append(
                f"| {name} | {d} | {std[m, p]:.3g} | {summary['entropy']['mean'][m, p]:.3f} | "
                f"{summary['entropy']['median'][m, p]:.3g} | {summary['max_weight']['median'][m, p]:.3f} | "
                f"{summary['logit_grad_norm']['median'][m, p]:.3g} | {summary['logit_grad_norm']['mean'][m, p]:.3g} | "
                f"{summary['q_grad_norm']['median'][m, p]:.3g} | {summary['zero_fraction']['logit_grad'][m, p]:.4f} |")
    return "\n".join(lines)


def render_bounds(checks: list[dict]) -> str:
    lines = ["| remedy | d_k | max weight: bound / largest row | entropy: floor / smallest row | rows within both |",
             "|---|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c['remedy']} | {c['d_k']} | {c['max_weight_bound']:.4f} / {c['max_weight_max']:.4f} | "
                     f"{c['entropy_floor']:.4f} / {c['entropy_min']:.4f} | {c['rows_within_bounds']} / {c['rows']} |")
    return "\n".join(lines)


def render_laws(laws: dict) -> str:
    lines = []
    for name, law in laws.items():
        if not law["applies"]:
            lines.append(f"{name}: laws not fitted: {law['reason']}")
            continue
        dims = ", ".join(str(int(d)) for d in law["head_dims"])
        parts = [f"{name}: τ_eff = {law['temperature']:.3f} (fitted on d_k = {dims})"]
        for key in ("median_jacobian", "median_logit_grad"):
            f = law[key]
            parts.append(f"{key} b = {f['b']:.4f} (predicted m_S/τ_eff = {f['b_predicted']:.4f}), c = {f['c']:.3g}"
                         if isinstance(f, dict) else f"{key} {f}")
        for key in ("mean_jacobian", "mean_entropy"):
            f = law[key]
            parts.append(f"{key} a = {f['a']:.3f} (predicted -0.5), C at a = -1/2: {f['C']:.3f} (predicted {f['C_predicted']:.3f})"
                         if isinstance(f, dict) else f"{key} {f}")
        lines.append("; ".join(parts))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Figures (matplotlib through the lab's Agg figures; saved atomically by lab.save_figure).
# ----------------------------------------------------------------------------------------------------

STYLE = {  # named remedies -> (colour, line style)
    "none": ("k", "-"), "sqrt_dk": ("C0", "-"), "qk_norm": ("C1", "-"), "qk_norm_sqrt_dk": ("C1", "--"),
    "sigma_reparam": ("C3", "-"), "sigma_reparam_sqrt_dk": ("C3", "--"),
}


def styles(remedies) -> list[dict]:
    """Line styles: the named remedies fixed, caps in shades of green (dotted), the rest in shades of purple
    (dash-dotted), darker for a larger cap or temperature."""
    import matplotlib

    caps = sorted(r.logit_cap for r in remedies if r.name not in STYLE and r.logit_cap is not None)
    temps = sorted(r.temperature for r in remedies if r.name not in STYLE and r.logit_cap is None)
    shade = lambda values, v: 0.45 + 0.5 * (values.index(v) / max(len(values) - 1, 1))
    out = []
    for r in remedies:
        if r.name in STYLE:
            colour, line = STYLE[r.name]
        elif r.logit_cap is not None:
            colour, line = matplotlib.colormaps["Greens"](shade(caps, r.logit_cap)), ":"
        else:
            colour, line = matplotlib.colormaps["Purples"](shade(temps, r.temperature)), "-."
        out.append({"color": colour, "linestyle": line, "marker": "o", "markersize": 3, "label": r.name})
    return out


def _figure(width: float, height: float, rows: int, cols: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=80)  # no pyplot: the global backend is left alone
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, squeeze=False)


def plot_remedies(summary: dict, *, title: str):
    d = np.asarray(summary["head_dims"], np.float64)
    fig, axes = _figure(12, 8.5, 2, 2)
    panels = [
        (axes[0, 0], summary["entropy"]["mean"], "mean row entropy (nats)", "semilogx"),
        (axes[0, 1], summary["max_weight"]["median"], "median max weight", "semilogx"),
        (axes[1, 0], summary["logit_grad_norm"]["median"], "median ‖∂L/∂logits‖ (pre-cap)", "loglog"),
        (axes[1, 1], logit_std(summary), "logit std before the cap: scale·√Var(q'·k')", "loglog"),
    ]
    st = styles(summary["remedies"])
    for ax, values, label, kind in panels:
        for m in range(len(summary["remedies"])):
            y = np.asarray(values[m], np.float64)
            if kind == "loglog":
                y = np.where(y > 0, y, np.nan)  # an exact 0 has no place on a log axis
            getattr(ax, kind)(d, y, **st[m])
        ax.set_title(label)
        ax.set_xlabel("d_k")
    axes[0, 0].axhline(np.log(summary["num_keys"]), color="0.6", lw=0.8)
    axes[0, 0].text(d[0], np.log(summary["num_keys"]) * 0.97, f"uniform, log {summary['num_keys']}", fontsize=7,
                    va="top", color="0.4")
    axes[0, 1].legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_bounds(result: dict, *, title: str):
    d = np.asarray(result["head_dims"], np.float64)
    fig, axes = _figure(12, 4.2, 1, 2)
    for m, (remedy, st) in enumerate(zip(result["remedies"], styles(result["remedies"]))):
        if remedy.logit_cap is None:
            continue
        axes[0, 0].semilogx(d, result["max_weight"][m].reshape(len(d), -1).max(-1), **st)
        axes[0, 0].semilogx(d, np.full_like(d, result["max_weight_bound"][m]), color=st["color"], lw=0.8, linestyle="-")
        axes[0, 1].semilogx(d, result["entropy"][m].reshape(len(d), -1).min(-1), **st)
        axes[0, 1].semilogx(d, np.full_like(d, result["entropy_floor"][m]), color=st["color"], lw=0.8, linestyle="-")
    axes[0, 0].set_title("largest max weight over rows (dots) and the bound e^{2c}/(e^{2c}+S-1) (line)")
    axes[0, 1].set_title("smallest row entropy (dots) and the floor (line)")
    for ax in axes[0]:
        ax.set_xlabel("d_k")
        ax.title.set_fontsize(9)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        out = prepare_output_folder(args.out, OUTPUTS)
    except OutputFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cache = use_compilation_cache(enabled=args.cache)
    remedies = probes.DEFAULT_REMEDIES
    config = dict(head_dims=tuple(args.head_dims), num_trials=args.trials, num_queries=args.queries, num_keys=args.keys,
                  value_dim=16, trials_per_batch=args.trials_per_batch)
    print(f"remedies: seed {args.seed}, output folder {out}; d_k = {' '.join(map(str, args.head_dims))}; "
          f"{args.trials} trials × {args.queries} query rows × {args.keys} keys per d_k, float32")
    print(f"compiled programs: {'kept in ' + str(cache) if cache else 'not kept'}")
    t0 = time.perf_counter()
    with step(f"sweep: {len(remedies)} remedies in one program"):
        result = probes.saturation_sweep(args.seed, remedies=remedies, **config)
    seconds = time.perf_counter() - t0
    summary = probes.summarize_sweep(result)
    laws = probes.fit_remedy_laws(summary)
    checks = bound_checks(result)
    print(f"\nsweep: {seconds:.1f} s (compile and run)\n")
    print(render_table(summary))
    print("\nThe bounds a cap c guarantees over S keys (logit_cap_bounds), against every row:")
    print(render_bounds(checks))
    print("\nThe unscaled laws, where they apply (fit_remedy_laws; median ~ c·exp(-b√d_k), mean ~ d_k^a and C/√d_k):")
    print(render_laws(laws))
    sigma = {name: {"d_k": summary["head_dims"], "spectral_norm_q": summary["spectral_norm_q"][m],
                    "spectral_norm_k": summary["spectral_norm_k"][m]}
             for m, name in enumerate(summary["remedy_names"]) if summary["remedies"][m].sigma_reparam}
    for name, s in sigma.items():
        print(f"{name}: mean σ(W_q) / (2√d_k) = " + ", ".join(
            f"{v / (2 * np.sqrt(d)):.3f} (d_k {d})" for d, v in zip(s["d_k"], s["spectral_norm_q"])))
    title = f"remedies, float32, S = {args.keys} keys, {args.trials} trials × {args.queries} rows per d_k, seed {args.seed}"
    with step("drawing remedies.png and remedies_bounds.png"):
        pngs = [lab.save_figure(plot_remedies(summary, title=title), os.path.join(out, "remedies.png")),
                lab.save_figure(plot_bounds(result, title=title), os.path.join(out, "remedies_bounds.png"))]
    details = {
        "seed": args.seed, "config": config, "quick": args.quick, "seconds": seconds,
        "remedies": [r._asdict() for r in summary["remedies"]],
        "logit_std": dict(zip(summary["remedy_names"], logit_std(summary))),
        "zero_fraction_logit_grad": dict(zip(summary["remedy_names"], summary["zero_fraction"]["logit_grad"])),
        "bounds": checks, "laws": laws, "sigma_reparam": sigma,
    }
    paths = [write_json(os.path.join(out, "remedies.json"), records(summary)),
             write_json(os.path.join(out, "remedies_details.json"), details)] + pngs
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
