"""Does it train without √d_k, and what do the remedies do? Train the small Transformer of jaxattn.train on
associative recall (``--task recall``) or on character-level Tiny Shakespeare (``--task text``) over a grid
of d_k × remedies × learning rates × seeds, logging the probes at every step.

The remedies are jaxattn.probes.Remedy's names: none, sqrt_dk, qk_norm, qk_norm_sqrt_dk, sigma_reparam,
sigma_reparam_sqrt_dk, cap_<c>, temperature_<tau> (``--remedies all`` is the probes' default list). Without
``--remedies`` the grid is {sqrt_dk, none}: the scaled and unscaled model. For each d_k, the runs of one
model structure (seeds × learning rates × scales) are one jax.vmap'ed program. Writes a summary table
(Markdown, also printed; mean ± std over seeds), every logged series (JSON) and one PNG per panel (loss,
validation loss for text, entropy, max weight, logit gradient, max logit) into the output folder named on screen.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's jaxattn, whatever is installed

import numpy as np

from jaxattn import train
from jaxattn.io import (NO_CACHE_VARIABLE, OutputFolderError, atomic_write, int_at_least, positive_float,
                        prepare_output_folder, use_compilation_cache, write_json)
from jaxattn.probes import DEFAULT_REMEDIES, Remedy
from jaxattn.progress import ProgressBar

DEFAULT_GRID = ("sqrt_dk", "none")  # without --remedies: the scaled and the unscaled model
THRESHOLD = {"recall": 0.1, "text": 2.5}  # default --threshold (nats) per task


def remedy_arg(text: str) -> list:
    """One --remedies word as Remedy specs: a name, cap_<c>, temperature_<tau>, or 'all'."""
    if text == "all":
        return list(DEFAULT_REMEDIES)
    m = re.fullmatch(r"(cap|temperature)_(.+)", text)
    if m:
        try:
            spec = (m.group(1), float(m.group(2)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {m.group(1)}_<number> expected") from None
    else:
        spec = text
    try:
        Remedy.parse(spec)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a remedy: {e}; also accepted: cap_<c>, temperature_<tau>, "
                                         "all") from None
    return [spec]


def outputs(task: str) -> tuple[str, ...]:
    return ("summary.md", "history.json", *(f"{name}.png" for name, *_ in panels(task)))


def panels(task: str) -> list[tuple]:
    """(file name, y label, series of a history [C, x], x of the series, y scale)."""
    steps = lambda h: np.arange(h["loss"].shape[1])  # noqa: E731
    out = [("loss", "training loss (nats)", lambda h: h["loss"], steps, "linear")]
    if task == "text":
        out.append(("val_loss", "validation loss (nats)", lambda h: h["val_loss"], lambda h: h["val_step"], "linear"))
    return out + [
        ("entropy", "mean attention entropy, layer 1 (nats)", lambda h: h["entropy"][:, :, 0].mean(-1), steps, "linear"),
        ("max_weight", "mean largest weight per row, layer 1", lambda h: h["max_weight"][:, :, 0].mean(-1), steps, "linear"),
        ("logit_grad", "‖∂loss/∂logits‖ per row, layer 1", lambda h: h["logit_grad"][:, :, 0].mean(-1), steps, "log"),
        ("max_logit", "largest attention logit", lambda h: h["max_logit"].max(axis=(-1, -2)), steps, "log"),
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=("recall", "text"), default="recall", help="associative recall (default) or "
                   "character-level Tiny Shakespeare")
    p.add_argument("--remedies", type=remedy_arg, nargs="+", default=None,
                   help="remedy names (jaxattn.probes.Remedy): none sqrt_dk qk_norm qk_norm_sqrt_dk sigma_reparam "
                        "sigma_reparam_sqrt_dk cap_<c> temperature_<tau>, or all (default: sqrt_dk none)")
    p.add_argument("--head-dims", type=int_at_least(1), nargs="+", default=None, help="d_k values (default: 16 64 256; text: 64)")
    p.add_argument("--learning-rates", type=positive_float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    p.add_argument("--seeds", type=int_at_least(0), nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int_at_least(1), default=300)
    p.add_argument("--warmup", type=int_at_least(0), default=30)
    p.add_argument("--batch-size", type=int_at_least(1), default=32)
    p.add_argument("--context", type=int_at_least(2), default=64, help="text: characters per sequence (default 64)")
    p.add_argument("--d-model", type=int_at_least(1), default=64)
    p.add_argument("--heads", type=int_at_least(1), default=2)
    p.add_argument("--layers", type=int_at_least(1), default=2)
    p.add_argument("--chunk", type=int_at_least(1), default=50, help="steps per compiled call; text: validation loss after each")
    p.add_argument("--qk-layernorm", action="store_true", help="normalise q and k per head (Wortsman et al.)")
    p.add_argument("--threshold", type=positive_float, default=None,
                   help="loss (nats) for 'steps to threshold' (default: recall 0.1, text 2.5)")
    p.add_argument("--out", default="train-scale-output", help="output folder (created)")
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny model, 2 remedies (or those given), "
                   "seed 0, lr 3e-3, 4 steps (in place of the sizes, seeds, learning rates and steps given)")
    p.add_argument("--no-cache", dest="cache", action="store_false",
                   help="do not keep compiled programs across runs (default: kept in $XDG_CACHE_HOME/jaxattn, "
                        f"else ~/.cache/jaxattn; {NO_CACHE_VARIABLE}=1 does the same)")
    args = p.parse_args(argv)
    args.remedies = [s for group in (args.remedies or [list(DEFAULT_GRID)]) for s in group]
    names = [Remedy.parse(s).name for s in args.remedies]
    if len(set(names)) != len(names):
        p.error(f"argument --remedies: each remedy once, received {names}")
    if args.head_dims is None:
        args.head_dims = [64] if args.task == "text" else [16, 64, 256]
    if args.threshold is None:
        args.threshold = THRESHOLD[args.task]
    if args.quick:
        args.head_dims, args.learning_rates, args.seeds, args.steps, args.warmup = [8], [3e-3], [0], 4, 1
        args.d_model, args.layers, args.batch_size, args.context, args.chunk = 16, 1, 4, 16, 2
    for flag in ("head_dims", "learning_rates", "seeds"):  # a repeated value would train the same runs twice
        values = getattr(args, flag)
        if len(set(values)) != len(values):
            p.error(f"argument --{flag.replace('_', '-')}: each value once, received {values}")
    if args.warmup >= args.steps:
        p.error(f"argument --warmup: must be less than --steps ({args.steps}), received {args.warmup}")
    if args.task == "text":
        try:
            train.TextTask(context=args.context)
        except ValueError as e:
            p.error(f"argument --context: {e}")
    return args


def _spread(values: list[float], fmt: str = ".3f") -> str:
    return f"{np.mean(values):{fmt}} ± {np.std(values):{fmt}}" if len(values) > 1 else f"{values[0]:{fmt}}"


def _layers(runs: list[dict], key: str, fmt: str) -> str:
    per_layer = np.asarray([r[key] for r in runs])  # [seeds, L]
    return " / ".join(_spread(list(per_layer[:, i]), fmt) for i in range(per_layer.shape[1]))


def table(rows: list[dict], task: str) -> str:
    """Markdown table: one line per (d_k, remedy, learning rate); mean ± std over seeds (std: population)."""
    val = task == "text"
    cols = ["d_k", "remedy", "peak lr", "final loss", *(["final val loss"] if val else []),
            *([] if val else ["final accuracy"]), "steps to threshold (per seed)", "diverged",
            "final entropy per layer (nats)", "final max weight per layer", "final ‖∂loss/∂logits‖ per layer",
            "min entropy", "max logit"]
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["d_k"], r["remedy"], r["learning_rate"]), []).append(r)
    lines = []
    for (d_k, remedy, lr), runs in groups.items():
        steps = ", ".join("—" if r["steps_to_threshold"] is None else str(r["steps_to_threshold"]) for r in runs)
        cells = [str(d_k), remedy, f"{lr:g}", _spread([r["final_loss"] for r in runs])]
        cells += [_spread([r["final_val_loss"] for r in runs])] if val else [_spread([r["final_accuracy"] for r in runs], ".2f")]
        cells += [steps, f"{sum(r['diverged'] for r in runs)}/{len(runs)}", _layers(runs, "final_entropy", ".2f"),
                  _layers(runs, "final_max_weight", ".2f"), _layers(runs, "final_logit_grad", ".2g"),
                  f"{min(r['min_entropy'] for r in runs):.3f}", f"{max(r['max_logit'] for r in runs):.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def plot(histories: dict, runs: dict, args, path_stem: str) -> list[str]:
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [Remedy.parse(s).name for s in args.remedies]
    colors = matplotlib.colormaps["tab20"].colors if len(names) > 10 else matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ("-", "--", ":", "-.")
    paths = []
    for name, ylabel, series, xs, yscale in panels(args.task):
        fig = Figure(figsize=(4.6 * len(args.head_dims) + 1.8, 3.6))  # no pyplot: the global backend is left alone
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, len(args.head_dims), sharey=True, squeeze=False)
        for ax, d_k in zip(axes[0], args.head_dims):
            h, spec = histories[d_k], runs[d_k]
            y, x = series(h), xs(h)  # [C, n], [n]
            k = 10 if name != "val_loss" and y.shape[1] >= 20 else 1  # trailing mean over 10 steps, for readability
            for j, remedy in enumerate(names):
                for i, lr in enumerate(args.learning_rates):
                    idx = [c for c, s in enumerate(spec) if s[0] == remedy and s[1] == lr]
                    mean = np.mean(y[idx], axis=0)
                    smooth = np.convolve(mean, np.ones(k) / k, mode="valid")
                    ax.plot(x[k - 1:], smooth, styles[i % len(styles)], color=colors[j % len(colors)], lw=1.2,
                            label=f"{remedy}" + (f", lr {lr:g}" if len(args.learning_rates) > 1 else ""))
            ax.set_title(f"{args.task}, d_k = {d_k}")
            ax.set_xlabel("step")
            ax.set_yscale(yscale)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(ylabel)
        axes[0][-1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.suptitle(f"{name}: mean over seeds {args.seeds}", fontsize=9)
        fig.tight_layout()
        out = f"{path_stem}{name}.png"
        atomic_write(out, lambda f, fig=fig: fig.savefig(f, format="png", dpi=80))
        paths.append(out)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        prepare_output_folder(args.out, outputs(args.task), create=False)  # before any training: nothing wasted
    except OutputFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    use_compilation_cache(enabled=args.cache)  # kept for a second run; an unusable folder: one warning
    task = train.TextTask(context=args.context) if args.task == "text" else train.RecallTask()
    opt = train.OptConfig(total_steps=args.steps, warmup_steps=args.warmup, batch_size=args.batch_size)
    names = [Remedy.parse(s).name for s in args.remedies]
    print(f"seeds {args.seeds}; task {task} (chance loss log {task.n_vocab if args.task == 'text' else task.n_values} "
          f"= {task.chance_loss:.3f} nats)")
    print(f"optimizer {opt}")
    print(f"grid: d_k {args.head_dims} x remedies {names} x lr {args.learning_rates} x seeds {args.seeds}; "
          f"output folder: {os.path.abspath(args.out)}")
    sys.stdout.flush()  # the progress bars go to stderr
    start = time.time()
    histories, runs, rows, configs = {}, {}, [], {}
    for i, d_k in enumerate(args.head_dims):
        config = train.ModelConfig.for_task(
            task, d_model=args.d_model, num_heads=args.heads, head_dim=d_k, num_layers=args.layers,
            qk_layernorm=args.qk_layernorm,
        )
        spec = [(name, lr, seed, r) for name, r in zip(names, args.remedies) for lr in args.learning_rates
                for seed in args.seeds]
        label = f"d_k={d_k:<4} ({i + 1}/{len(args.head_dims)}, {len(spec)} runs)"
        with ProgressBar(label, opt.total_steps, unit="steps") as bar:
            h = train.train(
                config, task, opt,
                seeds=[s[2] for s in spec], learning_rates=[s[1] for s in spec], remedies=[s[3] for s in spec],
                chunk=args.chunk, progress=bar,
            )
        for r in train.summarize(h, threshold=args.threshold):
            rows.append({"d_k": d_k, **r})
        histories[d_k], runs[d_k], configs[d_k] = h, spec, dataclasses.asdict(config)
    wall = time.time() - start

    md = table(rows, args.task)
    print()
    print(md)
    print(f"threshold {args.threshold} nats; 'diverged' = a non-finite loss, or a final loss above the first step's; "
          "final = mean over the last 20 steps (validation: the last evaluation); ± = std over seeds")
    print(f"wall time {wall:.0f} s")

    stem = os.path.join(args.out, "")
    header = (
        f"# Remedies in training: {args.task}\n\nseeds {args.seeds}, {args.steps} steps, threshold {args.threshold} "
        f"nats, chance {task.chance_loss:.3f} nats, wall time {wall:.0f} s\n\n"
    )
    atomic_write(stem + "summary.md", (header + md).encode())
    extra = ("val_loss", "val_step") if args.task == "text" else ()
    series = {
        str(d_k): {
            "runs": [{"remedy": s[0], "learning_rate": s[1], "seed": s[2]} for s in runs[d_k]],
            "model": configs[d_k],
            "metrics": {name: h[name].tolist() for name in (*train.METRICS, *extra)},
            "scale_value": h["scale"].tolist(),
            "logit_cap": [None if np.isnan(c) else float(c) for c in h["logit_cap"]],
        }
        for d_k, h in histories.items()
    }
    payload = {
        "task": {"name": args.task, **dataclasses.asdict(task)},
        "optimizer": dataclasses.asdict(opt),
        "seeds": args.seeds,
        "remedies": names,
        "threshold": args.threshold,
        "metric_shapes": train.METRICS,
        "summary": rows,
        "series": series,
        "wall_time_s": wall,
    }
    write_json(stem + "history.json", payload, indent=None)  # NaN and inf as strings: strict parsers read it
    pngs = plot(histories, runs, args, stem)
    print("wrote", ", ".join([stem + "summary.md", stem + "history.json", *pngs]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
