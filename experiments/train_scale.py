"""Does it train without √d_k? Train the small Transformer of jaxattn.train on associative recall over a
grid of d_k × {1/√d_k, 1} × learning rates × seeds, logging the probes at every step.

For each d_k, every (scale, learning rate, seed) run is one jax.vmap'ed program. Writes loss, entropy and
max-logit curves (PNG), a summary table (Markdown, also printed) and every logged series (JSON) into the
output folder named on screen.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's jaxattn, whatever is installed

import numpy as np

from jaxattn import train
from jaxattn.io import NO_CACHE_VARIABLE, OutputFolderError, atomic_write, prepare_output_folder, use_compilation_cache
from jaxattn.progress import ProgressBar

SCALES = {"scaled": None, "unscaled": 1.0}  # name -> the core's scale (None = 1/√d_k)
SCALE_LABEL = {"scaled": "1/√d_k", "unscaled": "1"}
PANELS = ("loss", "entropy", "max_logit")  # one PNG each
OUTPUTS = ("summary.md", "history.json", *(f"{name}.png" for name in PANELS))  # what a run writes into --out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=int, nargs="+", default=[16, 64, 256], help="d_k values (default: 16 64 256)")
    p.add_argument("--learning-rates", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--qk-layernorm", action="store_true", help="normalise q and k per head (Wortsman et al.)")
    p.add_argument("--threshold", type=float, default=0.1, help="loss (nats) for 'steps to threshold'")
    p.add_argument("--out", default="train-scale-output", help="output folder (created)")
    p.add_argument("--quick", action="store_true", help="smoke run: d_k 16 64, lr 3e-3, seed 0, 100 steps")
    p.add_argument("--no-cache", dest="cache", action="store_false",
                   help="do not keep compiled programs across runs (default: kept in $XDG_CACHE_HOME/jaxattn, "
                        f"else ~/.cache/jaxattn; {NO_CACHE_VARIABLE}=1 does the same)")
    args = p.parse_args(argv)
    if args.quick:
        args.head_dims, args.learning_rates, args.seeds, args.steps, args.warmup = [16, 64], [3e-3], [0], 100, 10
    return args


def table(rows: list[dict]) -> str:
    """Markdown table: one line per (d_k, scale, learning rate), seeds aggregated."""
    head = (
        "| d_k | scale | peak lr | final loss (mean over seeds) | final accuracy | steps to threshold (per seed) "
        "| diverged | min entropy (nats) | max logit |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["d_k"], r["scale_name"], r["learning_rate"]), []).append(r)
    lines = []
    for (d_k, scale, lr), runs in groups.items():
        steps = ", ".join("—" if r["steps_to_threshold"] is None else str(r["steps_to_threshold"]) for r in runs)
        lines.append(
            f"| {d_k} | {SCALE_LABEL[scale]} | {lr:g} | {np.mean([r['final_loss'] for r in runs]):.3f} "
            f"| {np.mean([r['final_accuracy'] for r in runs]):.2f} | {steps} "
            f"| {sum(r['diverged'] for r in runs)}/{len(runs)} | {min(r['min_entropy'] for r in runs):.3f} "
            f"| {max(r['max_logit'] for r in runs):.0f} |"
        )
    return head + "\n".join(lines) + "\n"


def plot(histories: dict, runs: dict, args, path_stem: str) -> list[str]:
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = [
        ("loss", "loss (nats, answer positions)", lambda h: h["loss"], "linear"),
        ("entropy", "lowest per-head attention entropy (nats)", lambda h: h["entropy"].min(axis=(-1, -2)), "linear"),
        ("max_logit", "largest attention logit", lambda h: h["max_logit"].max(axis=(-1, -2)), "log"),
    ]
    paths = []
    for name, ylabel, series, yscale in panels:
        fig = Figure(figsize=(4.2 * len(args.head_dims), 3.4))  # no pyplot: the global backend is left alone
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, len(args.head_dims), sharey=True, squeeze=False)
        for ax, d_k in zip(axes[0], args.head_dims):
            h, spec = histories[d_k], runs[d_k]
            y = series(h)  # [C, steps]
            for i, lr in enumerate(args.learning_rates):
                for scale, style in zip(SCALES, ("-", "--")):
                    idx = [c for c, s in enumerate(spec) if s[0] == scale and s[1] == lr]
                    mean = np.mean(y[idx], axis=0)
                    k = 10  # trailing mean over 10 steps, for readability
                    smooth = np.convolve(mean, np.ones(k) / k, mode="valid")
                    ax.plot(np.arange(k - 1, len(mean)), smooth, style, color=colors[i % len(colors)],
                            label=f"lr {lr:g}, scale {SCALE_LABEL[scale]}", lw=1.3)
            ax.set_title(f"d_k = {d_k}")
            ax.set_xlabel("step")
            ax.set_yscale(yscale)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(ylabel)
        axes[0][-1].legend(fontsize=7)
        fig.suptitle(f"{name}: mean over seeds {args.seeds}, solid = 1/√d_k, dashed = unscaled", fontsize=9)
        fig.tight_layout()
        out = f"{path_stem}{name}.png"
        atomic_write(out, lambda f, fig=fig: fig.savefig(f, format="png", dpi=80))
        paths.append(out)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        prepare_output_folder(args.out, OUTPUTS, create=False)  # before any training: nothing wasted, nothing half-written
    except OutputFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    use_compilation_cache(enabled=args.cache)  # kept for a second run; an unusable folder: one warning
    task = train.RecallTask()
    opt = train.OptConfig(total_steps=args.steps, warmup_steps=args.warmup, batch_size=args.batch_size)
    print(f"seeds {args.seeds}; task {task} (chance loss log {task.n_values} = {task.chance_loss:.3f} nats)")
    print(f"optimizer {opt}")
    print(f"grid: d_k {args.head_dims} x scale {[SCALE_LABEL[s] for s in SCALES]} x lr {args.learning_rates} "
          f"x seeds {args.seeds}; output folder: {os.path.abspath(args.out)}")
    sys.stdout.flush()  # the progress bars go to stderr
    start = time.time()
    histories, runs, rows, configs = {}, {}, [], {}
    for i, d_k in enumerate(args.head_dims):
        config = train.ModelConfig.for_task(
            task, d_model=args.d_model, num_heads=args.heads, head_dim=d_k, num_layers=args.layers,
            qk_layernorm=args.qk_layernorm,
        )
        spec = [(s, lr, seed) for s in SCALES for lr in args.learning_rates for seed in args.seeds]
        label = f"d_k={d_k:<4} ({i + 1}/{len(args.head_dims)}, {len(spec)} runs vmapped)"
        with ProgressBar(label, opt.total_steps, unit="steps") as bar:
            h = train.train(
                config, task, opt,
                seeds=[s[2] for s in spec], learning_rates=[s[1] for s in spec], scales=[SCALES[s[0]] for s in spec],
                progress=bar,
            )
        for r, s in zip(train.summarize(h, threshold=args.threshold), spec):
            rows.append({"d_k": d_k, "scale_name": s[0], **r})
        histories[d_k], runs[d_k], configs[d_k] = h, spec, dataclasses.asdict(config)
    wall = time.time() - start

    md = table(rows)
    print()
    print(md)
    print(f"threshold {args.threshold} nats; 'diverged' = a non-finite loss, or a final loss above the first step's")
    print(f"wall time {wall:.0f} s")

    stem = os.path.join(args.out, "")
    header = (
        f"# Does it train without √d_k?\n\nseeds {args.seeds}, {args.steps} steps, threshold {args.threshold} "
        f"nats, chance {task.chance_loss:.3f} nats, wall time {wall:.0f} s\n\n"
    )
    atomic_write(stem + "summary.md", (header + md).encode())
    series = {
        str(d_k): {
            "runs": [{"scale": s[0], "learning_rate": s[1], "seed": s[2]} for s in runs[d_k]],
            "model": configs[d_k],
            "metrics": {name: h[name].tolist() for name in train.METRICS},
            "scale_value": h["scale"].tolist(),
        }
        for d_k, h in histories.items()
    }
    payload = {
        "task": dataclasses.asdict(task),
        "optimizer": dataclasses.asdict(opt),
        "seeds": args.seeds,
        "threshold": args.threshold,
        "metric_shapes": train.METRICS,
        "summary": rows,
        "series": series,
        "wall_time_s": wall,
    }
    atomic_write(stem + "history.json", json.dumps(payload, allow_nan=True).encode())
    pngs = plot(histories, runs, args, stem)
    print("wrote", ", ".join([stem + "summary.md", stem + "history.json", *pngs]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
