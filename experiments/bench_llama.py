"""Benchmark: loading the bundled SmolLM2-135M-Instruct (a Q4_1 GGUF, dequantized to float32), and
jaxattn's Llama forward pass with every attention map vs Hugging Face's FlaxLlamaForCausalLM
(output_attentions=True) on the same weights, both jit-compiled, timed alternately in one run.

    python experiments/bench_llama.py                  # T=512
    python experiments/bench_llama.py --T 256 --repeats 3

It also times FIRST calls (compile + run), each in a fresh Python process with no persistent compilation
cache, --first-repeats times each, alternating: jaxattn's forward and FlaxLlamaForCausalLM's at T, and
jaxattn's generate (a 5-token prompt, 15 new tokens) against jaxattn's forward on the same prompt. Targets:
forward's first call <= Flax's, generate's first call <= 2x the forward's.

    python experiments/bench_llama.py --phases         # where each first call goes (and nothing else)
    python experiments/bench_llama.py --gradient --baseline DIR   # the gradient's first call and steady time
    python experiments/bench_llama.py --generate --baseline DIR   # generate's steady time

--generate times ``generate``'s steady calls (15 new tokens after prompts of --generate-T tokens), the
median of --repeats calls after a first, in fresh processes alternating with the same in --baseline DIR
(another checkout, as for --gradient) when given. It writes nothing.

--gradient times ``jax.jit(jax.grad(log_prob))`` over all params at T=128 (--grad-T): its first call against
the forward's first call at the same T (target <= 2x), each in fresh processes, alternating; and its
steady time (the median of --repeats calls after the first) against the same gradient of the jaxattn in
--baseline DIR (another checkout, e.g. `git worktree add DIR <commit>`), also in fresh processes,
alternating (target: no slower by more than 10%). It writes nothing.

--first-generate times only the first calls of ``generate`` (a 5-token prompt, 15 new tokens) and of the
forward on the same prompt, in fresh processes, alternating (target <= 2x), without Flax.

With --baseline DIR, --gradient and --first-generate also time the same first calls of DIR's jaxattn (fresh
processes, in the same rounds) and print ours / the baseline's for each, and the baseline's own ratio: a
ratio target can move because its denominator, our forward's first call, did.

--random-init replaces the bundled checkpoint by random weights of its shapes (``llama.init_params``; the
same config), for a machine where the checkpoint's wheel is not installed: the times do not depend on the
values. Every child process (and the --baseline's) then builds the same random params.

--phases splits one first call of each forward at T, in a fresh process each, into trace, lower, XLA
compile and the first run (then a second run), and prints them; it writes nothing.

The Flax Llama of transformers 4.57 builds its RoPE table with base 10000 whatever the config says, so
both run at base 10000 here (SmolLM2's is 100000; the base changes no cost) and their outputs can be
compared. Its head is never tied: it gets the embedding's transpose. Needs transformers 4.x with its Flax
classes (the dev extra). Prints the load time, the median forward times and the ratio jaxattn / Hugging
Face (target <= 1.0), and writes them to bench_llama.json in the output folder it names. Beside each
steady median it prints the CPU time split into user and system time and the minor page faults per call
(Unix): the system time is mostly the kernel providing fresh pages for the memory a call writes, which
depends on the allocator (see docs/models.md, "Speed").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

try:
    import resource  # Unix: user/system time and page faults per call
except ImportError:  # Windows
    resource = None

# this checkout's jaxattn, whatever is installed (or a baseline checkout's, for --gradient's baseline children)
sys.path.insert(0, os.environ.get("JAXATTN_BENCH_ROOT") or str(Path(__file__).resolve().parent.parent))

import jax
import numpy as np

from jaxattn import llama
from jaxattn import checkpoint
from jaxattn.checkpoint import flatten, unflatten
from jaxattn.io import OutputFolderError, int_at_least, prepare_output_folder, write_json

if os.environ.get("JAXATTN_BENCH_ROOT") and (Path(llama.__file__).resolve().parents[1]
                                             != Path(os.environ["JAXATTN_BENCH_ROOT"]).resolve()):
    # an installed jaxattn found instead of the baseline's: its times would be ours, compared with ours
    raise SystemExit(f"JAXATTN_BENCH_ROOT={os.environ['JAXATTN_BENCH_ROOT']} holds no jaxattn of its own: "
                     f"imported {llama.__file__}")


def _timed(fn) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


def _usage() -> tuple[float, float, int]:
    """``(user s, system s, minor page faults)`` of this process so far (every thread); zeros where the
    platform has no ``resource`` module."""
    if resource is None:
        return 0.0, 0.0, 0
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def _timed_split(fn) -> dict[str, float]:
    """One call's wall seconds; its CPU seconds (every thread of this process, so they move less than the
    wall time when other jobs share the machine), split into user and system time (the kernel's share:
    mostly the page faults of memory the call touches for the first time); and its minor page faults."""
    u, s, f = _usage()
    t, c = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    u2, s2, f2 = _usage()
    return {"wall": wall, "cpu": cpu, "user": u2 - u, "sys": s2 - s, "faults": f2 - f}


# SmolLM2-135M-Instruct's shapes, as its bundled GGUF gives them (llama.load()'s config), for --random-init
_SMOLLM2_SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                       rms_norm_eps=1e-05, tie_word_embeddings=True)


def _model(random_init: bool, seed: int):
    """``(params, config)``: the bundled SmolLM2-135M, or random weights of its shapes, at RoPE base 10000."""
    if random_init:
        config = llama.LlamaConfig(**_SMOLLM2_SHAPES)
        return jax.device_put(llama.init_params(seed, config)), config
    params, config, _ = llama.load()
    return params, config._replace(rope_theta=10000.0)  # Flax Llama's fixed base; see the module docstring


def _flax_model(config, T):
    import transformers

    return transformers.FlaxLlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, max_position_embeddings=T,
        rms_norm_eps=config.rms_norm_eps), _do_init=False)


def _phases(fn, *args) -> dict[str, float]:
    """Seconds of each phase of ``jax.jit(fn)``'s first call on ``args``, then of a second run."""
    jitted, times = jax.jit(fn), {}
    t = time.perf_counter()
    traced = jitted.trace(*args)
    times["trace"], t = time.perf_counter() - t, time.perf_counter()
    lowered = traced.lower()
    times["lower"], t = time.perf_counter() - t, time.perf_counter()
    compiled = lowered.compile()
    times["compile"], t = time.perf_counter() - t, time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times["first run"], t = time.perf_counter() - t, time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times["second run"] = time.perf_counter() - t
    return times


def _first_call(what: str, T: int, seed: int, repeats: int = 5, random_init: bool = False) -> None:
    """In a fresh process: load (untimed), then time one first call of ``what``; print it as JSON."""
    params, config = _model(random_init, seed)
    jax.block_until_ready(params)
    ids = np.random.default_rng(seed).integers(0, config.vocab_size, T).astype(np.int32)
    if what == "steady-generate":  # first call untimed, then repeats
        gen = lambda: llama.generate(params, config, ids, max_new_tokens=15)  # noqa: E731
        jax.block_until_ready(gen())
        steady = [_timed_split(gen) for _ in range(repeats)]
        print(json.dumps({"what": what, "T": T, "steady_wall_s": [r["wall"] for r in steady],
                          "steady_cpu_s": [r["cpu"] for r in steady]}))
        return
    if what in ("grad", "steady-grad"):
        grad = jax.jit(jax.grad(lambda p, i: llama.log_prob(p, config, i)))
        first = _timed_split(lambda: grad(params, ids))
        record = {"what": what, "T": T, "wall_s": first["wall"], "cpu_s": first["cpu"]}
        if what == "steady-grad":
            steady = [_timed_split(lambda: grad(params, ids)) for _ in range(repeats)]
            record.update(steady_wall_s=[r["wall"] for r in steady], steady_cpu_s=[r["cpu"] for r in steady])
        print(json.dumps(record))
        return
    if what == "phases-forward":
        times = _phases(lambda p, i: (lambda o: (o.logits, o.attentions))(llama.forward(p, config, i)), params, ids)
        print(json.dumps({"what": what, "T": T, **times}))
        return
    if what in ("flax", "phases-flax"):
        hf = _flax_model(config, T)
        flat = checkpoint.unstack_layers(flatten(params), "model/layers")  # Flax Llama's per-layer layout
        hf_params = unflatten({**flat, "lm_head/kernel": flat["model/embed_tokens/embedding"].T})
        if what == "phases-flax":
            with jax.numpy_rank_promotion("allow"):
                times = _phases(lambda p, x: (lambda o: (o.logits, o.attentions))(hf(x, params=p, output_attentions=True)),
                                hf_params, ids[None])
            print(json.dumps({"what": what, "T": T, **times}))
            return
        run = jax.jit(lambda p, x: hf(x, params=p, output_attentions=True))

        def fn():
            with jax.numpy_rank_promotion("allow"):
                out = run(hf_params, ids[None])
            return out.logits, out.attentions
    elif what == "generate":
        def fn():
            return llama.generate(params, config, ids, max_new_tokens=15)
    else:
        def fn():
            out = llama.forward(params, config, ids)
            return out.logits, out.attentions
    run = _timed_split(fn)
    print(json.dumps({"what": what, "T": T, "wall_s": run["wall"], "cpu_s": run["cpu"]}))


def _first_calls(T: int, repeats: int, seed: int, runs: list[tuple[str, int]] | None = None,
                 extra: tuple[str, ...] = ()) -> dict[str, dict[str, list[float]]]:
    """``{label: {"wall": [...], "cpu": [...]}}`` over ``repeats`` fresh processes per label, alternating."""
    runs = runs or [("forward", T), ("flax", T), ("forward", 5), ("generate", 5)]
    times: dict[str, dict[str, list[float]]] = {f"{w}@{t}": {"wall": [], "cpu": []} for w, t in runs}
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    for _ in range(repeats):
        for what, t in runs:
            proc = subprocess.run([sys.executable, __file__, "--child", what, "--T", str(t), "--seed", str(seed), *extra],
                                  capture_output=True, text=True, env=env, check=True)
            record = json.loads(proc.stdout.strip().splitlines()[-1])
            times[f"{what}@{t}"]["wall"].append(record["wall_s"])
            times[f"{what}@{t}"]["cpu"].append(record["cpu_s"])
    return times


def _child(what: str, T: int, seed: int, *, root: str | None = None, repeats: int = 5, extra: tuple[str, ...] = ()) -> dict:
    """One fresh process running ``--child what`` (with ``root``'s jaxattn first on the path when given)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    if root is not None:  # this script's child code, on the baseline checkout's jaxattn
        env["JAXATTN_BENCH_ROOT"] = str(Path(root).resolve())
    proc = subprocess.run([sys.executable, __file__, "--child", what, "--T", str(T), "--seed", str(seed),
                           "--repeats", str(repeats), *extra], capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gradient(T: int, rounds: int, repeats: int, seed: int, baseline: str | None, extra: tuple[str, ...] = ()) -> None:
    """The gradient's first call against the forward's, and its steady time against ``baseline``'s."""
    first = {"grad": [], "forward": [], "baseline forward": []}
    steady = {"ours": [], "baseline": []}
    for _ in range(rounds):  # alternating, each a fresh process
        for what in ("grad", "forward"):
            first[what].append(_child(what, T, seed, extra=extra))
        steady["ours"].append(_child("steady-grad", T, seed, repeats=repeats, extra=extra))
        if baseline is not None:
            steady["baseline"].append(_child("steady-grad", T, seed, root=baseline, repeats=repeats, extra=extra))
            first["baseline forward"].append(_child("forward", T, seed, root=baseline, extra=extra))
    fg, ff = ([r["wall_s"] for r in first[w]] for w in ("grad", "forward"))
    cg, cf = ([r["cpu_s"] for r in first[w]] for w in ("grad", "forward"))
    print(f"first calls at T={T}, {rounds} fresh processes each: jax.jit(jax.grad(log_prob)) wall {_spread(fg)}, "
          f"CPU {_spread(cg)}; forward wall {_spread(ff)}, CPU {_spread(cf)}")
    r = statistics.median(fg) / statistics.median(ff)
    print(f"gradient's first call / forward's: {r:.2f} (CPU {statistics.median(cg) / statistics.median(cf):.2f}; "
          f"target <= 2.0: {'met' if r <= 2.0 else 'NOT met'})")
    if baseline is not None:  # the same first calls of the baseline (its steady-grad process's first call)
        _report_first_against_baseline({"grad": fg, "forward": ff},
                                       {"grad": [x["wall_s"] for x in steady["baseline"]],
                                        "forward": [x["wall_s"] for x in first["baseline forward"]]}, baseline)
    _report_steady("steady gradient", steady, repeats, rounds, baseline, target=1.10)


def _report_first_against_baseline(ours: dict[str, list[float]], theirs: dict[str, list[float]], baseline: str) -> None:
    """Print the baseline's first calls (fresh processes), ours / the baseline's for each, and the baseline's own
    ratio of the first named to the second: whether a ratio target moved because its denominator did."""
    a, b = list(ours)
    for what in (a, b):
        print(f"first call {what} (baseline {baseline}): wall {_spread(theirs[what])}; ours / baseline's: "
              f"{statistics.median(ours[what]) / statistics.median(theirs[what]):.3f}")
    print(f"the baseline's first call {a} / its {b}: "
          f"{statistics.median(theirs[a]) / statistics.median(theirs[b]):.3f}")


def _steady_generate(T: int, rounds: int, repeats: int, seed: int, baseline: str | None, extra: tuple[str, ...] = ()) -> None:
    """``generate``'s steady time (15 new tokens after a ``T``-token prompt), against ``baseline``'s."""
    runs = {"ours": [], "baseline": []}
    for _ in range(rounds):  # alternating, each a fresh process
        runs["ours"].append(_child("steady-generate", T, seed, repeats=repeats, extra=extra))
        if baseline is not None:
            runs["baseline"].append(_child("steady-generate", T, seed, root=baseline, repeats=repeats, extra=extra))
    _report_steady(f"steady generate, {T}-token prompt, 15 new tokens", runs, repeats, rounds, baseline)


def _report_steady(label: str, runs: dict, repeats: int, rounds: int, baseline: str | None,
                   target: float | None = None) -> None:
    """Print each side's steady time (the median of each process's calls, spread over processes) and, with
    a baseline, the ratio of the medians (against ``target`` when there is one)."""
    per = {k: [statistics.median(x["steady_wall_s"]) for x in v] for k, v in runs.items() if v}
    cpu = {k: [statistics.median(x["steady_cpu_s"]) for x in v] for k, v in runs.items() if v}
    for k in per:
        print(f"{label} ({k}): median of each process's {repeats} calls, over {rounds} processes: wall "
              f"{_spread(per[k])}; CPU {_spread(cpu[k])}")
    if "baseline" in per:
        r = statistics.median(per["ours"]) / statistics.median(per["baseline"])
        verdict = "" if target is None else f"; target <= {target:.2f}: {'met' if r <= target else 'NOT met'}"
        print(f"{label} / baseline's ({baseline}): {r:.3f} (CPU "
              f"{statistics.median(cpu['ours']) / statistics.median(cpu['baseline']):.3f}{verdict})")


def _generate_ratio(med: dict[str, dict[str, float]]) -> str:
    """The line of generate's first call against the forward's, from the medians of ``_first_calls``."""
    r = med["generate@5"]["wall"] / med["forward@5"]["wall"]
    return (f"generate's first call / forward's (5-token prompt, 15 new tokens): {r:.3f} (CPU "
            f"{med['generate@5']['cpu'] / med['forward@5']['cpu']:.3f}; target <= 2.0: {'met' if r <= 2.0 else 'NOT met'})")


def _spread(xs: list[float]) -> str:
    if max(xs) < 1.0:  # a GPU's steady calls: milliseconds
        return f"median {statistics.median(xs) * 1e3:.2f} ms (min {min(xs) * 1e3:.2f}, max {max(xs) * 1e3:.2f})"
    return f"median {statistics.median(xs):.2f} s (min {min(xs):.2f}, max {max(xs):.2f})"


def _none_or_at_least_3(text: str) -> int:
    """An argparse ``type=``: 0 (skip) or an int >= 3 (a median of at least 3)."""
    value = int_at_least(0)(text)
    if 0 < value < 3:
        raise argparse.ArgumentTypeError(f"must be 0 (skip) or an int >= 3, received {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--first-repeats", type=_none_or_at_least_3, default=3,
                        help="fresh processes per first-call timing, at least 3 (0: skip)")
    parser.add_argument("--child", choices=("forward", "flax", "generate", "phases-forward", "phases-flax", "grad",
                                            "steady-grad", "steady-generate"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--phases", action="store_true", help="only split each forward's first call into its phases")
    parser.add_argument("--gradient", action="store_true", help="only the gradient's first call and steady time")
    parser.add_argument("--grad-T", type=int_at_least(1), default=128, help="tokens of the gradient's input")
    parser.add_argument("--generate", action="store_true",
                        help="only generate's steady time against --baseline's (prompts of --generate-T tokens)")
    parser.add_argument("--generate-T", type=int_at_least(1), nargs="+", default=[5, 40], help="prompt lengths for --generate")
    parser.add_argument("--first-generate", action="store_true",
                        help="only generate's first call against the forward's (5-token prompt), without Flax")
    parser.add_argument("--random-init", action="store_true",
                        help="random weights of the bundled checkpoint's shapes instead of the checkpoint")
    parser.add_argument("--baseline", default=None, help="a checkout whose jaxattn is the baseline (--gradient, --generate, --first-generate)")
    parser.add_argument("--T", type=int_at_least(1), default=512)
    parser.add_argument("--repeats", type=int_at_least(3), default=5, help="steady calls timed (a median of at least 3)")
    parser.add_argument("--load-repeats", type=int_at_least(1), default=3,
                        help="loads timed (reported, not a target: 1 is printed as one load)")
    parser.add_argument("--seed", type=int_at_least(0), default=0)
    parser.add_argument("--out", default="lab-output/bench_llama")
    args = parser.parse_args(argv)
    if args.baseline is not None and not (Path(args.baseline) / "jaxattn" / "__init__.py").is_file():
        parser.error(f"--baseline {args.baseline}: expected a checkout with jaxattn/__init__.py in it")
    extra = ("--random-init",) if args.random_init else ()  # what every child process is told
    if args.child:
        _first_call(args.child, args.T, args.seed, args.repeats, args.random_init)
        return 0
    if args.gradient:
        _gradient(args.grad_T, max(args.first_repeats, 3), args.repeats, args.seed, args.baseline, extra)
        return 0
    if args.generate:
        for T in args.generate_T:
            _steady_generate(T, max(args.first_repeats, 3), args.repeats, args.seed, args.baseline, extra)
        return 0
    if args.first_generate:
        rounds = max(args.first_repeats, 3)
        first = {"forward@5": {"wall": [], "cpu": []}, "generate@5": {"wall": [], "cpu": []}}
        theirs: dict[str, list[float]] = {"generate": [], "forward": []}
        for _ in range(rounds):  # alternating, each a fresh process; the baseline's after ours in each round
            for what in ("forward", "generate"):
                record = _child(what, 5, args.seed, extra=extra)
                first[f"{what}@5"]["wall"].append(record["wall_s"])
                first[f"{what}@5"]["cpu"].append(record["cpu_s"])
            if args.baseline is not None:
                for what in ("forward", "generate"):
                    theirs[what].append(_child(what, 5, args.seed, root=args.baseline, extra=extra)["wall_s"])
        for label in ("forward@5", "generate@5"):
            print(f"first call {label:11s} ({rounds} fresh processes): wall {_spread(first[label]['wall'])}; "
                  f"CPU {_spread(first[label]['cpu'])}")
        med = {k: {m: statistics.median(v[m]) for m in ("wall", "cpu")} for k, v in first.items()}
        print(f"{_generate_ratio(med)}; jax {jax.__version__} on {jax.devices()[0].platform}")
        if args.baseline is not None:
            _report_first_against_baseline({"generate": first["generate@5"]["wall"],
                                            "forward": first["forward@5"]["wall"]}, theirs, args.baseline)
        return 0
    if args.phases:
        env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
        print(f"first call of each forward at T={args.T}, a fresh process each (seconds):")
        for what, label in (("phases-forward", "jaxattn.llama.forward"), ("phases-flax", "FlaxLlamaForCausalLM")):
            proc = subprocess.run([sys.executable, __file__, "--child", what, "--T", str(args.T), "--seed", str(args.seed),
                                   *extra], capture_output=True, text=True, env=env, check=True)
            record = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"  {label:22s} " + ", ".join(f"{k} {record[k]:.2f}" for k in ("trace", "lower", "compile", "first run",
                                                                                    "second run")))
        return 0
    try:  # before any work: nothing wasted, nothing half-written
        prepare_output_folder(args.out, ("bench_llama.json",), create=False)
    except OutputFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    t_load = []
    for _ in range(args.load_repeats):
        t = time.perf_counter()
        params, config = _model(args.random_init, args.seed)
        jax.block_until_ready(params)
        t_load.append(time.perf_counter() - t)
    n_params = sum(int(np.prod(v.shape)) for v in flatten(params).values())
    name = f"random weights of {llama.BUNDLED_NAME}'s shapes" if args.random_init else llama.BUNDLED_NAME
    loads = (f"median {statistics.median(t_load):.2f} s (runs: {', '.join(f'{t:.2f}' for t in t_load)})"
             if len(t_load) > 1 else f"{t_load[0]:.2f} s (one load)")
    print(f"load {name}: {n_params / 1e6:.1f}M parameters to float32, {loads}")

    print(f"seed {args.seed}; {config.num_hidden_layers} layers x {config.num_attention_heads} query heads "
          f"({config.num_key_value_heads} key/value heads), d_model={config.hidden_size}, V={config.vocab_size}, "
          f"T={args.T}; jax {jax.__version__} on {jax.devices()[0].platform} "
          f"({platform.processor() or platform.machine()})")
    ids = np.random.default_rng(args.seed).integers(0, config.vocab_size, args.T).astype(np.int32)
    hf = _flax_model(config, args.T)
    flat = checkpoint.unstack_layers(flatten(params), "model/layers")  # Flax Llama's per-layer layout
    hf_params = unflatten({**flat, "lm_head/kernel": flat["model/embed_tokens/embedding"].T})
    hf_run = jax.jit(lambda p, x: hf(x, params=p, output_attentions=True))

    def ours():
        out = llama.forward(params, config, ids)
        return out.logits, out.attentions  # [T, V], [L, N, T, T]

    def theirs():
        with jax.numpy_rank_promotion("allow"):
            out = hf_run(hf_params, ids[None])
        return out.logits, out.attentions  # [1, T, V], L x [1, N, T, T]

    compile_ours, compile_theirs = _timed(ours), _timed(theirs)  # first calls: compile + run
    a, b = ours(), theirs()
    max_logit = float(np.abs(np.asarray(a[0]) - np.asarray(b[0][0])).max())
    logit_scale = float(np.abs(np.asarray(b[0][0])).max())
    max_att = max(float(np.abs(np.asarray(a[1][i]) - np.asarray(b[1][i][0])).max())
                  for i in range(config.num_hidden_layers))
    del a, b
    runs: dict[str, list[dict[str, float]]] = {"ours": [], "theirs": []}
    for _ in range(args.repeats):  # alternate, so load on the machine hits both alike
        for label, fn in (("ours", ours), ("theirs", theirs)):
            runs[label].append(_timed_split(fn))
    t_ours, t_theirs = ([r["wall"] for r in runs[k]] for k in ("ours", "theirs"))
    c_ours, c_theirs = ([r["cpu"] for r in runs[k]] for k in ("ours", "theirs"))
    split = {k: {m: statistics.median(r[m] for r in runs[k]) for m in ("user", "sys", "faults")} for k in runs}
    m_ours, m_theirs = statistics.median(t_ours), statistics.median(t_theirs)
    ratio = m_ours / m_theirs
    pair_ratio = statistics.median(a / b for a, b in zip(t_ours, t_theirs))  # each run against its neighbour
    cpu_ratio = statistics.median(c_ours) / statistics.median(c_theirs)
    print(f"outputs agree: max |logits diff| {max_logit:.2e} (max |logit| {logit_scale:.1f}), "
          f"max |attention diff| {max_att:.2e}")
    print(f"first call (compile + run): jaxattn {compile_ours:.2f} s, Hugging Face {compile_theirs:.2f} s")
    print(f"jaxattn.llama.forward  median {m_ours * 1e3:9.1f} ms  (runs: {', '.join(f'{t * 1e3:.0f}' for t in t_ours)})")
    print(f"FlaxLlamaForCausalLM   median {m_theirs * 1e3:9.1f} ms  (runs: {', '.join(f'{t * 1e3:.0f}' for t in t_theirs)})")
    print(f"ratio jaxattn / Hugging Face = {ratio:.3f}  (target <= 1.0: {'met' if ratio <= 1.0 else 'NOT met'}); "
          f"median of paired ratios {pair_ratio:.3f}; CPU time {statistics.median(c_ours):.2f} s vs "
          f"{statistics.median(c_theirs):.2f} s, ratio {cpu_ratio:.3f}")
    if resource is not None:
        o, h = split["ours"], split["theirs"]
        print(f"CPU time split (medians per call): user {o['user']:.2f} s vs {h['user']:.2f} s, ratio "
              f"{o['user'] / h['user']:.3f}; system {o['sys']:.2f} s vs {h['sys']:.2f} s; minor page faults "
              f"{o['faults']:.0f} vs {h['faults']:.0f} (system time is mostly the kernel handing out fresh "
              f"pages for memory a call writes)")

    first = {}
    if args.first_repeats > 0:
        first = _first_calls(args.T, args.first_repeats, args.seed, extra=extra)
        med = {k: {m: statistics.median(v[m]) for m in ("wall", "cpu")} for k, v in first.items()}
        fw, fl, f5, g5 = (f"forward@{args.T}", f"flax@{args.T}", "forward@5", "generate@5")
        print(f"first calls, {args.first_repeats} fresh processes each (compile + run, no persistent cache):")
        for label in (fw, fl, f5, g5):
            print(f"  {label:14s} wall {_spread(first[label]['wall'])}; CPU {_spread(first[label]['cpu'])}")
        r1 = med[fw]["wall"] / med[fl]["wall"]
        print(f"forward's first call / Flax's at T={args.T}: {r1:.3f} (CPU {med[fw]['cpu'] / med[fl]['cpu']:.3f}; "
              f"target <= 1.0: {'met' if r1 <= 1.0 else 'NOT met'})")
        print(_generate_ratio(med))

    out = Path(args.out)
    record = {"first_calls": first,"command": "python experiments/bench_llama.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "seed": args.seed, "T": args.T, "platform": jax.devices()[0].platform, "jax": jax.__version__,
              "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "load_s": t_load,
              "median_load_s": statistics.median(t_load), "parameters": n_params,
              "jaxattn_s": t_ours, "huggingface_s": t_theirs, "median_jaxattn_s": m_ours,
              "median_huggingface_s": m_theirs, "ratio": ratio, "paired_ratio": pair_ratio,
              "jaxattn_cpu_s": c_ours, "huggingface_cpu_s": c_theirs, "cpu_ratio": cpu_ratio,
              "jaxattn_runs": runs["ours"], "huggingface_runs": runs["theirs"],
              "max_abs_logits_diff": max_logit, "max_abs_logit": logit_scale, "max_abs_attention_diff": max_att}
    write_json(out / "bench_llama.json", record)
    print(f"wrote {out}/bench_llama.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
