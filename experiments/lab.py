"""The chapter's lab (§7): part 1, the attention map in numbers; part 2, the collapse without √d_k;
parts 3-4, real attention on the trophy sentence and "too big" vs "too small" (experiments/trophy.py).

Every run prints its seed and the output folder, and writes its numbers (JSON) and pictures (PNG) there.
Parts 3-4 run on GPT-2 from the hub; when the hub cannot be reached and nothing is cached they run on the
bundled all-MiniLM-L6-v2 encoder and say so in one line (--model picks explicitly).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from jaxattn import gpt2, lab, probes
from jaxattn.io import write_json


def run_part1(args) -> dict:
    data = lab.part1(args.seed)
    print(lab.render_part1(data))
    path = write_json(os.path.join(args.out, "part1.json"), data)
    print(f"wrote {path}")
    if not data["rows_ok"]:
        raise SystemExit("part 1: a row of A does not sum to 1 within 1e-6")
    return data


def run_part2(args) -> dict:
    pairs = lab.side_by_side(args.seed)
    print(lab.render_side_by_side(pairs))
    print()
    t0 = time.perf_counter()
    dims = probes.DEFAULT_HEAD_DIMS
    sweep = lab.sweep(args.seed, head_dims=dims, num_trials=args.trials, num_keys=args.keys, num_queries=args.queries, dtypes=args.dtypes,
                      trials_per_batch=args.trials_per_batch)
    seconds = time.perf_counter() - t0
    cfg = sweep["config"]
    summary = sweep["summaries"][args.dtypes[0]]
    rows = lab.sweep_table(summary)
    print(
        f"Part 2b: saturation sweep in {args.dtypes[0]}: d_k = {dims[0]} … {dims[-1]}, {cfg['num_trials']} trials × "
        f"{cfg['num_queries']} query rows × {cfg['num_keys']} keys per d_k, scaled and unscaled on the same draws "
        f"(one jit(vmap) program per dtype; {len(args.dtypes)} dtypes in {seconds:.1f} s)."
    )
    print("H = row entropy (mean; 'med' = median), maxw = max weight, |g| = ‖∂L/∂logits‖ per row "
          "(L = random linear read-out), ratio = scaled / unscaled, |J| = ‖softmax Jacobian‖_F")
    print(lab.render_table(rows))
    print("gradients with respect to the queries (|∂q| = ‖∂L/∂q‖ per query row) and the keys (|∂k| = ‖∂L/∂k‖ per key):")
    print(lab.render_table(rows, columns=lab.QK_COLUMNS))
    band = lab.scaled_band(summary)
    print("scaled band over d_k (max/min of the mean): " + ", ".join(
        f"{k.removesuffix('_mean')} {v['min']:.3f}–{v['max']:.3f} (×{v['ratio']:.3f})" for k, v in band.items() if k.endswith("_mean")))
    zeros = lab.zero_fractions(sweep)
    print(lab.render_zero_fractions(zeros, dims))
    fit_dtype = "float64" if "float64" in sweep["summaries"] else args.dtypes[0]
    laws = lab.fit_laws(sweep["summaries"][fit_dtype], dtype=fit_dtype)
    print(lab.render_laws(laws))
    fig = lab.plot_sweep(summary, zeros, title=f"saturation sweep, {args.dtypes[0]}, S = {cfg['num_keys']} keys, seed {args.seed}")
    png = lab.save_figure(fig, os.path.join(args.out, "part2_sweep.png"))
    data = {"seed": args.seed, "side_by_side": pairs, "config": cfg, "table": rows, "scaled_band": band,
            "zero_fractions": zeros, "laws": laws, "summaries": sweep["summaries"], "seconds": seconds}
    path = write_json(os.path.join(args.out, "part2.json"), data)
    print(f"wrote {path}\nwrote {png}")
    return data


def run_parts34(args) -> int:
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trophy.py")  # beside this script
    spec = importlib.util.spec_from_file_location("trophy_experiment", path)
    trophy_experiment = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trophy_experiment)

    argv = ["--out", os.path.join(args.out, "trophy")]
    if args.model is not None:
        argv += ["--model", args.model]
    if args.random_gpt2 is not None:
        argv += ["--random-gpt2", args.random_gpt2, "--seed", str(args.seed)]
    code = trophy_experiment.main(argv)
    if code:
        raise SystemExit(code)
    return code


PARTS = {1: run_part1, 2: run_part2, 3: run_parts34, 4: run_parts34}  # parts 3 and 4 run together


def parse_parts(text: str) -> list[int]:
    try:
        parts = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--parts takes a comma-separated list like 1,2, received {text!r}") from None
    missing = [p for p in parts if p not in PARTS]
    if missing or not parts:
        raise argparse.ArgumentTypeError(f"parts {missing or text!r} are not available; available: {sorted(PARTS)}")
    return parts


DTYPES = ("float32", "bfloat16", "float16", "float64")


def parse_dtypes(text: str) -> list[str]:
    names = [d.strip() for d in text.split(",") if d.strip()]
    unknown = [d for d in names if d not in DTYPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--dtypes takes a comma-separated list of {','.join(DTYPES)}, received {text!r}")
    return names


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", type=parse_parts, default=sorted(PARTS), help=f"comma-separated, default all available: {','.join(map(str, sorted(PARTS)))}")
    parser.add_argument("--out", default="lab-output", help="output folder (default lab-output/)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=32, help="random trials per d_k in the sweep (default 32)")
    parser.add_argument("--trials-per-batch", type=int, default=None,
                        help="vmap this many trials of each d_k at a time inside the one program (bounds memory; default all)")
    parser.add_argument("--queries", type=int, default=16, help="query rows per trial (default 16)")
    parser.add_argument("--keys", type=int, default=16, help="keys per row, S (default 16)")
    parser.add_argument("--model", default=None,
                        help="parts 3-4: 'minilm' (bundled encoder), a GPT-2 hub id or local directory; "
                             "default gpt2, or minilm (said on screen) when the hub cannot be reached")
    parser.add_argument("--random-gpt2", default=None, choices=sorted(gpt2.SIZES),
                        help="parts 3-4 on a RANDOM GPT-2 of this size (offline; not a trained model)")
    parser.add_argument("--dtypes", type=parse_dtypes, default=list(DTYPES),
                        help="sweep dtypes; the first is the table's (default float32,bfloat16,float16,float64)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    print(f"jaxattn lab, parts {','.join(map(str, args.parts))}; seed {args.seed} (rerun with --seed {args.seed}); "
          f"output folder {os.path.abspath(args.out)}")
    done = set()
    for part in args.parts:
        if PARTS[part] in done:
            continue
        done.add(PARTS[part])
        print()
        PARTS[part](args)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
