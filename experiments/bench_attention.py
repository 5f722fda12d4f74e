"""Benchmark: dense attention, blockwise attention, jax.nn.dot_product_attention and the chapter's naive version.

Configurations: GPT-2 shapes (T=S=1024, N=12, H=64) and long sequences (N=1 by default, ``--long-N``; H=64,
T=S=4k..64k), forward and forward+backward (``--modes``), causal and not. For each configuration every implementation is compiled,
then timed in interleaved rounds in ONE process (so that the ratios compare like with like), next to
the same process's large-matmul throughput (the machine's ceiling). Peak memory is measured for each
(configuration, implementation) in its own subprocess. On a GPU (``--gpu``, or detected) everything
runs in bfloat16 and ``jax.nn.dot_product_attention(..., implementation='cudnn')`` joins, with the
Pallas GPU kernel through ``multi_head_blockwise_attention(..., implementation="pallas")``; a second table
then gives every implementation's time against cuDNN's and, with ``--peak-tflops``, its share of the peak.

FLOP count: 4·T·S·H per head for the forward (two matmuls), halved for causal; forward+backward counts
3.5× that (the backward's five matmuls, FlashAttention-2's convention).

Results: ``<out>/bench_attention.json`` (every measurement, written after each configuration, so an
interrupted run resumes with ``--resume``) and ``<out>/bench_attention.md`` (the tables).

``--windows`` measures the sliding window instead (``<out>/bench_windows.json`` and ``.md``): causal
blockwise with a window of W keys (``local_window_size=(W - 1, 0)``, blocks of ``--window-block``) against
full causal blockwise (blocks of ``--block-q``/``--block-k``) at ``--window-T``, forward and forward+backward;
causal against non-causal blockwise at ``--causal-T``; each the median of ``--rounds`` interleaved
rounds with the spread and the CPU time, the ratios from the medians and as the median of each round's
own ratio; beside them each compiled program's temporary buffer and the minor page faults per timed
call (on XLA's CPU backend a temporary above glibc's 32 MiB mmap threshold is fresh memory, faulted in
anew, on every call); and the windowed forward+backward's peak resident memory at ``--window-memory-T``
in a process of its own.

``--baseline DIR`` compares this checkout with another (DIR: e.g. ``git worktree add DIR <commit>``) at the
GPT-2 configurations: ``--rounds`` fresh processes of each, alternating (which side starts alternates too),
each timing ``xla``, ``dense`` and ``blockwise`` in interleaved rounds; per process the ratios dense/xla
and blockwise/xla (wall and CPU), then their median over the processes with the spread, each side's, and
ours over the baseline's (``<out>/bench_baseline.json`` and ``.md``). The ratio to ``jax.nn`` in the same
process is what is compared, so a machine slower in one process than in the next cancels out.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

# this checkout's jaxattn, whatever is installed (or another checkout's, in --baseline's children)
sys.path.insert(0, os.environ.get("JAXATTN_BENCH_ROOT") or str(Path(__file__).resolve().parent.parent))

import numpy as np

GIB = 1024**3
IMPLS_CPU = ("xla", "dense", "naive", "blockwise")
IMPLS_GPU = ("cudnn", "pallas", "xla", "dense", "naive", "blockwise")


# ----------------------------------------------------------------------------------------------------
# The implementations, all with one signature: q [T, N, H], k [S, N, H], v [S, N, V] -> out [T, N, V].
# ----------------------------------------------------------------------------------------------------


def _implementations(causal: bool, block_q: int, block_k: int):
    import jax
    import jax.numpy as jnp

    import jaxattn

    # a --baseline checkout from before the implementation switch has one kernel, its own
    named = {"implementation": "blockwise"} if "implementation" in inspect.signature(
        jaxattn.multi_head_blockwise_attention).parameters else {}

    def naive(q, k, v):
        """The chapter's four lines (§6), per head, in JAX: scores, scale, softmax, weighted sum."""

        def one_head(Q, K, V):
            d_k = Q.shape[-1]
            scores = Q @ K.T  # [T, S], every query against every key
            scores = scores / math.sqrt(d_k)  # keep the softmax out of saturation
            if causal:
                scores = jnp.where(jaxattn.causal_mask(*scores.shape), scores, -jnp.inf)  # [T, S]
            A = jax.nn.softmax(scores, axis=-1)  # [T, S], rows sum to 1
            return A @ V  # [T, V]

        return jax.vmap(one_head, in_axes=1, out_axes=1)(q, k, v)

    return {
        "xla": lambda q, k, v: jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=causal)[0],
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            q[None], k[None], v[None], is_causal=causal, implementation="cudnn"
        )[0],
        "dense": lambda q, k, v: jaxattn.multi_head_attention(q, k, v, is_causal=causal)[0],
        "naive": naive,
        # jaxattn's own tiled kernel, named (None would pick cuDNN for bf16 on an NVIDIA GPU)
        "blockwise": lambda q, k, v: jaxattn.multi_head_blockwise_attention(
            q, k, v, is_causal=causal, block_q=block_q, block_k=block_k, **named
        )[0],
        # the Pallas GPU kernel (jax.experimental.pallas.ops.gpu.attention.mha) through jaxattn's switch
        "pallas": lambda q, k, v: jaxattn.multi_head_blockwise_attention(q, k, v, is_causal=causal, implementation="pallas")[0],
    }


def _program(impl: str, cfg: dict):
    """The jitted function to time: forward, or forward+backward (gradients of sum(out) w.r.t. q, k, v)."""
    import jax
    import jax.numpy as jnp

    f = _implementations(cfg["causal"], cfg["block_q"], cfg["block_k"])[impl]
    if cfg["mode"] == "fwd":
        return jax.jit(f)
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))


def _inputs(cfg: dict, seed: int):
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    shape = (cfg["T"], cfg["N"], cfg["H"])
    return [jnp.asarray(rng.standard_normal(shape, dtype=np.float32), cfg["dtype"]) for _ in range(3)]


def _flops(cfg: dict) -> float:
    fwd = 4.0 * cfg["T"] * cfg["T"] * cfg["H"] * cfg["N"] / (2 if cfg["causal"] else 1)
    return fwd * (1.0 if cfg["mode"] == "fwd" else 3.5)


def _quadratic_bytes(cfg: dict, impl: str) -> float:
    """Rough memory the [T, S] buffers of the materialising implementations need (0 for blockwise/cudnn)."""
    if impl in ("blockwise", "cudnn", "pallas"):
        return 0.0
    buffers = 4 if cfg["mode"] == "fwd" else 8  # logits, weights, temporaries; the backward keeps more
    return buffers * 4.0 * cfg["T"] * cfg["T"] * cfg["N"]


def _key(cfg: dict) -> str:
    c = "causal" if cfg["causal"] else "full"
    return f"{cfg['group']}-T{cfg['T']}-N{cfg['N']}-H{cfg['H']}-{c}-{cfg['mode']}"


# ----------------------------------------------------------------------------------------------------
# Measurements.
# ----------------------------------------------------------------------------------------------------


def _call(fn, args) -> tuple[float, float]:
    import jax

    w, c = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - w, time.process_time() - c


def _matmul_gflops(dtype, n: int, rounds: int = 3) -> float:
    """The same process's large-matmul throughput (n×n @ n×n), the median of ``rounds``."""
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32), dtype)
    mm = jax.jit(lambda a: a @ a)
    jax.block_until_ready(mm(a))
    median = float(np.median([_call(mm, (a,))[0] for _ in range(rounds)]))
    return 2.0 * n**3 / median / 1e9


def _proc_bytes(path: str, field: str) -> int | None:
    """A ``field: N kB`` line of a /proc file, in bytes (None where there is no such file or line)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _available_bytes() -> float:
    available = _proc_bytes("/proc/meminfo", "MemAvailable")
    return float("inf") if available is None else float(available)


def _time_config(cfg: dict, impls: list[str], args, seed: int) -> dict:
    """Compile every implementation, then time them in interleaved rounds; wall and CPU seconds."""
    import jax

    q, k, v = _inputs(cfg, seed)
    programs, first, results = {}, {}, {}
    for impl in impls:
        try:
            programs[impl] = _program(impl, cfg).lower(q, k, v).compile()
            first[impl] = _call(programs[impl], (q, k, v))[0]  # warm-up: first touch of every buffer
        except Exception as e:  # e.g. out of memory, or cuDNN refusing a shape: recorded, not fatal
            results[impl] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            programs.pop(impl, None)
    slowest = max(first.values(), default=0.0)
    per_round = max(slowest * len(first), 1e-9)
    rounds = max(args.min_rounds, min(args.max_rounds, int(args.seconds_per_config / per_round)))  # >= 3
    wall = {impl: [] for impl in programs}
    cpu = {impl: [] for impl in programs}
    ceiling = [_matmul_gflops(cfg["dtype"], args.matmul_n)]
    for _ in range(rounds):
        for impl, fn in programs.items():
            w, c = _call(fn, (q, k, v))
            wall[impl].append(w)
            cpu[impl].append(c)
    ceiling.append(_matmul_gflops(cfg["dtype"], args.matmul_n))
    flops = _flops(cfg)
    for impl in programs:  # the median of the rounds, with their spread and the median CPU time
        median = float(np.median(wall[impl]))
        results[impl] = dict(
            seconds=median,
            seconds_min=min(wall[impl]),
            seconds_max=max(wall[impl]),
            cpu_seconds=float(np.median(cpu[impl])),
            gflops=flops / median / 1e9,
            rounds=rounds,
        )
    del programs, q, k, v
    jax.clear_caches()
    return dict(results=results, matmul_gflops=max(ceiling), rounds=rounds)


# ----------------------------------------------------------------------------------------------------
# Sliding windows (--windows).
# ----------------------------------------------------------------------------------------------------


def _window_program(kind: str, cfg: dict):
    """``causal``, ``full`` (blockwise, blocks of block_q/block_k) or ``window`` (causal with W keys, blocks
    of window_block): the jitted forward or forward+backward of multi_head_blockwise_attention."""
    import jax
    import jax.numpy as jnp

    import jaxattn

    if kind == "window":
        kw = dict(is_causal=True, local_window_size=(cfg["W"] - 1, 0), block_q=cfg["window_block"], block_k=cfg["window_block"])
    else:
        kw = dict(is_causal=kind == "causal", block_q=cfg["block_q"], block_k=cfg["block_k"])
    f = lambda q, k, v: jaxattn.multi_head_blockwise_attention(q, k, v, **kw)[0]
    if cfg["mode"] == "fwd":
        return jax.jit(f)
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), argnums=(0, 1, 2)))


def _window_child(cfg: dict, seed: int) -> dict:
    """In a fresh process: the windowed program once; the process's peak resident memory."""
    import jax

    base = _peak_rss()
    q, k, v = _inputs(cfg, seed)
    jax.block_until_ready(_window_program("window", cfg)(q, k, v))
    return dict(peak_rss_bytes=_peak_rss(), import_rss_bytes=base)


def _spread(xs: list[float]) -> dict:
    return dict(median=float(np.median(xs)), min=float(min(xs)), max=float(max(xs)), runs=[float(x) for x in xs])


def _time_pair(cfg: dict, kinds: tuple[str, str], rounds: int, seed: int) -> dict:
    """Both programs compiled, then timed in ``rounds`` interleaved rounds: wall and CPU seconds of each,
    and the ratio ``kinds[0] / kinds[1]`` from the medians and per round."""
    q, k, v = _inputs(cfg, seed)
    programs, compile_s, temp = {}, {}, {}
    for kind in kinds:
        t = time.perf_counter()
        programs[kind] = _window_program(kind, cfg).lower(q, k, v).compile()
        compile_s[kind] = time.perf_counter() - t
        stats = programs[kind].memory_analysis()
        temp[kind] = None if stats is None else int(stats.temp_size_in_bytes)
        _call(programs[kind], (q, k, v))  # warm-up
    wall = {kind: [] for kind in kinds}
    cpu = {kind: [] for kind in kinds}
    faults = {kind: 0 for kind in kinds}  # minor page faults during the timed calls (the process's count)
    for _ in range(rounds):
        for kind in kinds:
            f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            w, c = _call(programs[kind], (q, k, v))
            faults[kind] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f
            wall[kind].append(w)
            cpu[kind].append(c)
    a, b = kinds
    paired = [x / y for x, y in zip(wall[a], wall[b])]
    return dict(
        cfg=cfg, kinds=list(kinds), compile_seconds=compile_s,
        wall={kind: _spread(wall[kind]) for kind in kinds}, cpu={kind: _spread(cpu[kind]) for kind in kinds},
        ratio_of_medians=float(np.median(wall[a]) / np.median(wall[b])),
        cpu_ratio_of_medians=float(np.median(cpu[a]) / np.median(cpu[b])),
        paired_ratio=_spread(paired),
        temp_bytes=temp, page_faults_per_call={kind: faults[kind] / rounds for kind in kinds},
    )


def _render_windows(report: dict) -> str:
    meta = report["meta"]
    lines = [
        "# Sliding-window and causal blockwise attention",
        "",
        f"`{meta['command']}` on {meta['machine']}, jax {meta['jax']} ({meta['backend']}, {meta['dtype']}); "
        f"N = 1, H = 64; each time the median of {meta['rounds']} interleaved rounds (min-max), CPU seconds "
        f"beside wall seconds; `paired` = the median of each round's own ratio (min-max); `temp, faults`: each "
        f"compiled program's temporary buffer (XLA's memory analysis) and the process's minor page faults "
        f"per timed call.",
        "",
        "| comparison | mode | T | numerator: wall (min-max), CPU | denominator: wall (min-max), CPU | ratio of medians (CPU) | paired | temp, faults | target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rec in report["pairs"]:
        a, b = rec["kinds"]
        cfg = rec["cfg"]
        cell = lambda kind: (f"{kind}: {rec['wall'][kind]['median'] * 1e3:.1f} ms ({rec['wall'][kind]['min'] * 1e3:.1f}-"
                             f"{rec['wall'][kind]['max'] * 1e3:.1f}), CPU {rec['cpu'][kind]['median'] * 1e3:.0f} ms")
        target = "<= 0.1" if a == "window" else "<= 0.6"
        name = f"window W={cfg['W']} (blocks {cfg['window_block']}) / causal" if a == "window" else "causal / non-causal"
        p = rec["paired_ratio"]
        mib = lambda x: "?" if x is None else f"{x / 2**20:.1f} MiB"
        mem = "; ".join(f"{mib(rec['temp_bytes'][kind])}, {rec['page_faults_per_call'][kind]:.0f}" for kind in (a, b))
        lines.append(f"| {name} | {cfg['mode']} | {cfg['T']} | {cell(a)} | {cell(b)} | {rec['ratio_of_medians']:.3f} "
                     f"({rec['cpu_ratio_of_medians']:.3f}) | {p['median']:.3f} ({p['min']:.3f}-{p['max']:.3f}) | {mem} | {target} |")
    mem = report.get("memory")
    if mem:
        got = mem.get("peak_rss_bytes")
        text = f"{got / GIB:.2f} GiB (after import {mem['import_rss_bytes'] / GIB:.2f} GiB)" if got else mem.get("error", "?")
        lines += ["", f"Windowed (W = {mem['cfg']['W']}) forward+backward at T = {mem['cfg']['T']}: the process's peak "
                  f"resident memory {text} (target < 1 GiB)."]
    return "\n".join(lines) + "\n"


def _run_windows(args) -> None:
    from jaxattn.io import OutputFolderError, atomic_write, prepare_output_folder

    try:
        prepare_output_folder(args.out, ("bench_windows.json", "bench_windows.md"), create=False)
    except OutputFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    import jax

    dtype = "float32"
    base = dict(H=64, N=1, dtype=dtype, block_q=args.block_q, block_k=args.block_k, W=args.window,
                window_block=args.window_block, group="window", causal=True)
    out_dir = Path(args.out)
    json_path, md_path = out_dir / "bench_windows.json", out_dir / "bench_windows.md"
    report = dict(meta=dict(
        machine=f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        backend=jax.default_backend(), dtype=dtype, jax=jax.__version__, rounds=args.rounds,
        command=" ".join([os.path.basename(sys.executable), *sys.argv]), seed=args.seed,
    ), pairs=[])
    plan = [("window", "causal", T, mode) for T in args.window_T for mode in args.modes]
    plan += [("causal", "full", T, mode) for T in args.causal_T for mode in args.modes]
    for a, b, T, mode in plan:
        cfg = dict(base, T=T, mode=mode)
        print(f"{a} / {b} at T={T} {mode}: {args.rounds} rounds", flush=True)
        rec = _time_pair(cfg, (a, b), args.rounds, args.seed)
        report["pairs"].append(rec)
        print(f"  ratio of medians {rec['ratio_of_medians']:.3f} (CPU {rec['cpu_ratio_of_medians']:.3f}), "
              f"paired {rec['paired_ratio']['median']:.3f} ({rec['paired_ratio']['min']:.3f}-{rec['paired_ratio']['max']:.3f})", flush=True)
        atomic_write(json_path, json.dumps(report, indent=1))
        atomic_write(md_path, _render_windows(report))
    if args.window_memory_T:
        cfg = dict(base, T=args.window_memory_T, mode="fwd+bwd")
        cmd = [sys.executable, os.path.abspath(__file__), "--window-child", json.dumps(dict(cfg=cfg, seed=args.seed))]
        print(f"peak memory of the windowed fwd+bwd at T={cfg['T']} (own process)", flush=True)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.memory_timeout)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            mem = json.loads(lines[-1]) if lines else dict(error=f"exit code {proc.returncode}")
        except subprocess.TimeoutExpired:
            mem = dict(error=f"exceeded {args.memory_timeout:.0f} s")
        report["memory"] = dict(mem, cfg=cfg)
    atomic_write(json_path, json.dumps(report, indent=1))
    atomic_write(md_path, _render_windows(report))
    print(_render_windows(report))
    print(f"wrote {json_path} and {md_path}")


def _peak_rss() -> int:
    """This process's peak resident memory in bytes: VmHWM (ru_maxrss would include the parent's, as
    Linux carries it across fork and exec)."""
    peak = _proc_bytes("/proc/self/status", "VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if peak is None else peak


def _peak_memory_child(cfg: dict, impl: str, seed: int) -> dict:
    """Run in a fresh process: build inputs, compile, run once; report the process's peak memory."""
    import jax

    base_rss = _peak_rss()
    q, k, v = _inputs(cfg, seed)
    jax.block_until_ready(_program(impl, cfg)(q, k, v))
    out = dict(peak_rss_bytes=_peak_rss(), import_rss_bytes=base_rss)
    dev = jax.devices()[0]
    if dev.platform != "cpu":
        stats = dev.memory_stats() or {}
        out["device_peak_bytes"] = stats.get("peak_bytes_in_use")
    return out


def _peak_memory(cfg: dict, impl: str, seed: int, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(dict(cfg=cfg, impl=impl, seed=seed))]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(error=f"memory subprocess exceeded {timeout:.0f} s")
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            return json.loads(line)
    if proc.returncode < 0:
        return dict(error=f"killed by signal {-proc.returncode} (likely out of memory)")
    return dict(error=f"exit code {proc.returncode}: {proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else ''}")


# ----------------------------------------------------------------------------------------------------
# Against another checkout (--baseline).
# ----------------------------------------------------------------------------------------------------

BASELINE_IMPLS = ("xla", "dense", "blockwise")


def _baseline_child(spec: dict) -> dict:
    """One process of --baseline: each configuration timed as the main run times it, on whichever
    checkout's jaxattn comes first on the path."""
    import jax

    import jaxattn

    knobs = SimpleNamespace(**spec["knobs"])
    configs = {_key(cfg): _time_config(cfg, list(BASELINE_IMPLS), knobs, spec["seed"]) for cfg in spec["cfgs"]}
    return dict(configs=configs, jaxattn=str(Path(jaxattn.__file__).resolve().parent), jax=jax.__version__)


def _baseline_summary(runs: dict) -> dict:
    """Per configuration and implementation: each side's per-process ratio to xla (wall and CPU) over its
    processes, its own time, and ours over the baseline's (the medians' ratio)."""
    summary = {}
    for key in runs["ours"][0]["configs"]:
        summary[key] = {}
        for impl in BASELINE_IMPLS[1:]:
            entry = {}
            for side, processes in runs.items():
                wall, cpu, ms, errors = [], [], [], []
                for proc in processes:
                    res = proc["configs"][key]["results"]
                    if "seconds" not in res.get(impl, {}) or "seconds" not in res.get("xla", {}):
                        errors.append(res.get(impl, {}).get("error") or res.get("xla", {}).get("error") or "missing")
                        continue
                    wall.append(res[impl]["seconds"] / res["xla"]["seconds"])
                    cpu.append(res[impl]["cpu_seconds"] / res["xla"]["cpu_seconds"])
                    ms.append(res[impl]["seconds"] * 1e3)
                entry[side] = dict(errors=errors, **({} if not wall else dict(
                    wall=_spread(wall), cpu=_spread(cpu), ms=_spread(ms))))
            if "wall" in entry["ours"] and "wall" in entry["baseline"]:
                entry["ours_over_baseline"] = entry["ours"]["wall"]["median"] / entry["baseline"]["wall"]["median"]
                entry["cpu_ours_over_baseline"] = entry["ours"]["cpu"]["median"] / entry["baseline"]["cpu"]["median"]
            summary[key][impl] = entry
    return summary


def _render_baseline(report: dict) -> str:
    meta = report["meta"]
    lines = [
        "# Ratios to jax.nn.dot_product_attention against another checkout",
        "",
        f"`{meta['command']}` on {meta['machine']}, jax {meta['jax']} ({meta['backend']}, {meta['dtype']}); "
        f"ours: {meta['ours']}; baseline: {meta['baseline']}. {meta['processes']} fresh processes of each side, "
        f"alternating; in each, xla, dense and blockwise timed in interleaved rounds (the median of the rounds), "
        f"and the ratio to xla taken in that process. Each cell: the median over the processes (min-max), "
        f"the CPU-time ratio beside it, and the implementation's own median time.",
        "",
        "| configuration | ratio | ours (min-max), CPU, time | baseline's (min-max), CPU, time | ours / baseline's (CPU) |",
        "|---|---|---|---|---|",
    ]

    def cell(side: dict) -> str:
        if "wall" not in side:
            return "failed: " + "; ".join(side["errors"])[:200]
        w, c, ms = side["wall"], side["cpu"], side["ms"]
        return f"{w['median']:.3f} ({w['min']:.3f}-{w['max']:.3f}), CPU {c['median']:.3f}, {ms['median']:.1f} ms"

    for key, per_impl in report["summary"].items():
        for impl, entry in per_impl.items():
            r = entry.get("ours_over_baseline")
            ratio = "–" if r is None else f"**{r:.3f}** ({entry['cpu_ours_over_baseline']:.3f})"
            lines.append(f"| {key} | {impl}/xla | {cell(entry['ours'])} | {cell(entry['baseline'])} | {ratio} |")
    return "\n".join(lines) + "\n"


def _run_baseline(args) -> None:
    from jaxattn.io import OutputFolderError, atomic_write, prepare_output_folder

    root = Path(args.baseline).resolve()
    if not (root / "jaxattn" / "__init__.py").is_file():
        raise SystemExit(f"--baseline {args.baseline!r}: expected a checkout with jaxattn/__init__.py in it")
    try:
        prepare_output_folder(args.out, ("bench_baseline.json", "bench_baseline.md"), create=False)
    except OutputFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    import jax

    if jax.default_backend() != "cpu":
        raise SystemExit("--baseline compares float32 runs on CPU; jax's default backend is "
                         f"{jax.default_backend()!r} (JAX_PLATFORMS=cpu runs it on the host)")
    cfgs = [c for c in _configs(SimpleNamespace(**{**vars(args), "skip_gpt2": False, "long_T": []}), "float32")
            if args.only in _key(c)]
    if not cfgs:
        raise SystemExit(f"--baseline: no GPT-2 configuration's key contains --only {args.only!r}")
    spec = dict(cfgs=cfgs, seed=args.seed, knobs=dict(min_rounds=args.min_rounds, max_rounds=args.max_rounds,
                                                    seconds_per_config=args.seconds_per_config, matmul_n=args.matmul_n))
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "JAXATTN_BENCH_ROOT")}
    ours_root = str(Path(__file__).resolve().parent.parent)
    runs = {"ours": [], "baseline": []}
    for r in range(args.rounds):
        for side in (("ours", "baseline") if r % 2 == 0 else ("baseline", "ours")):  # who starts alternates
            child_env = dict(env, JAXATTN_BENCH_ROOT=str(root) if side == "baseline" else ours_root)
            proc = subprocess.run([sys.executable, __file__, "--baseline-child", json.dumps(spec)],
                                  capture_output=True, text=True, env=child_env)
            if proc.returncode != 0:
                raise SystemExit(f"--baseline: a process on {side}'s jaxattn failed:\n{proc.stderr[-3000:]}")
            runs[side].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"process {r + 1} of {args.rounds}, {side}: done", flush=True)
    out_dir = Path(args.out)
    report = dict(
        meta=dict(command=" ".join([os.path.basename(sys.executable), *sys.argv]), jax=jax.__version__,
                  machine=f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                  backend="cpu", dtype="float32", ours=runs["ours"][0]["jaxattn"], baseline=runs["baseline"][0]["jaxattn"],
                  processes=args.rounds, seed=args.seed),
        summary=_baseline_summary(runs), runs=runs,
    )
    atomic_write(out_dir / "bench_baseline.json", json.dumps(report, indent=1))
    text = _render_baseline(report)
    atomic_write(out_dir / "bench_baseline.md", text)
    print(text)
    print(f"wrote {out_dir / 'bench_baseline.json'} and {out_dir / 'bench_baseline.md'}")


# ----------------------------------------------------------------------------------------------------
# Configurations, files and rendering.
# ----------------------------------------------------------------------------------------------------


def _configs(args, dtype: str) -> list[dict]:
    base = dict(H=64, dtype=dtype, block_q=args.block_q, block_k=args.block_k)
    shapes = ([] if args.skip_gpt2 else [("gpt2", args.gpt2_T, 12)]) + [("long", T, args.long_N) for T in args.long_T]
    configs = []
    for group, T, N in shapes:
        for mode in args.modes:
            for causal in (False, True):
                configs.append(dict(base, group=group, T=T, N=N, mode=mode, causal=causal))
    return configs


def _fmt_time(entry: dict | None) -> str:
    if not entry:
        return "–"
    if "skipped" in entry:
        return "skipped"
    if "error" in entry:
        return "failed"
    def t(s):
        return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"

    spread = f" ({t(entry['seconds_min'])}-{t(entry['seconds_max'])})" if "seconds_min" in entry else ""
    cpu = f", CPU {t(entry['cpu_seconds'])}" if "cpu_seconds" in entry else ""
    return t(entry["seconds"]) + spread + cpu


def _ratios(record: dict, impls: list[str]) -> dict:
    """Time ratios against ``xla`` and, where it ran, against ``cudnn`` (the GPU's reference kernel)."""
    res = record["results"]
    out = {}
    for base in ("xla", "cudnn"):
        ref = res.get(base, {}).get("seconds")
        for impl in impls:
            s = res.get(impl, {}).get("seconds")
            if s and ref and impl != base:
                out[f"{impl}/{base}"] = s / ref
    return out


def _render_against_cudnn(report: dict, impls: list[str], peak_tflops: float | None) -> list[str]:
    """A table per configuration against cuDNN: time, time / cuDNN's, TFLOP/s and the share of the peak."""
    if "cudnn" not in impls:
        return []
    others = [i for i in impls if i != "cudnn"]
    peak = f" and % of the {peak_tflops:g} TFLOP/s peak" if peak_tflops else ""
    lines = ["", f"Against `jax.nn.dot_product_attention(implementation='cudnn')`: time, ratio to cuDNN's time, "
             f"TFLOP/s{peak} (same FLOP count for every implementation).", "",
             "| config | " + " | ".join(impls) + " | " + " | ".join(f"{i}/cudnn" for i in others) + " | "
             + " | ".join(f"{i} TFLOP/s" for i in impls) + " |",
             "|" + "---|" * (1 + 2 * len(impls) + len(others))]
    for key, rec in report["configs"].items():
        res, ratios = rec["results"], rec.get("ratios", {})

        def tflops(impl):
            g = res.get(impl, {}).get("gflops")
            if g is None:
                return "–"
            return f"{g / 1e3:.1f}" + (f" ({100 * g / 1e3 / peak_tflops:.0f}%)" if peak_tflops else "")

        lines.append(f"| {key} | " + " | ".join(_fmt_time(res.get(i)) for i in impls) + " | "
                     + " | ".join(f"{ratios[f'{i}/cudnn']:.2f}" if f"{i}/cudnn" in ratios else "–" for i in others)
                     + " | " + " | ".join(tflops(i) for i in impls) + " |")
    return lines


def _render(report: dict, impls: list[str]) -> str:
    meta = report["meta"]
    lines = [
        "# Attention benchmark",
        "",
        f"Machine: {meta['machine']}; backend {meta['backend']} ({meta['device']}), dtype {meta['dtype']}; "
        f"jax {meta['jax']}; GLIBC_TUNABLES={meta['glibc_tunables'] or '(unset)'}.",
        f"Command: `{meta['command']}`",
        "",
        "Time = the median of at least 3 interleaved rounds (min-max), wall clock, with the median CPU time "
        "(every thread) beside it. GFLOP/s counts 4·T·S·H per head forward "
        "(halved for causal), ×3.5 for forward+backward, at the median time. `ceiling` = the same process's "
        f"{meta['matmul_n']}² matmul GFLOP/s (median of 3). Ratios are median time / median time of `xla` "
        "(jax.nn.dot_product_attention), measured in the same rounds. Peak = the whole process's peak resident "
        "memory (its own process).",
        "",
        "| config | " + " | ".join(impls) + " | ceiling GFLOP/s | blockwise GFLOP/s (% of ceiling) | "
        + " | ".join(f"{i}/xla" for i in impls if i != "xla") + " | peak MiB " + " / ".join(impls) + " |",
        "|" + "---|" * (len(impls) * 2 + 3) ,
    ]
    for key, rec in report["configs"].items():
        res = rec["results"]
        ratios = rec.get("ratios", {})
        bw = res.get("blockwise", {})
        bw_g = f"{bw['gflops']:.1f} ({100 * bw['gflops'] / rec['matmul_gflops']:.0f}%)" if "gflops" in bw else "–"
        peaks = []
        for impl in impls:
            mem = rec.get("memory", {}).get(impl, {})
            peaks.append(f"{mem['peak_rss_bytes'] / 2**20:.0f}" if "peak_rss_bytes" in mem else ("oom" if "error" in mem else "–"))
        lines.append(
            f"| {key} | "
            + " | ".join(_fmt_time(res.get(i)) for i in impls)
            + f" | {rec.get('matmul_gflops', float('nan')):.0f} | {bw_g} | "
            + " | ".join(f"{ratios[f'{i}/xla']:.2f}" if f"{i}/xla" in ratios else "–" for i in impls if i != "xla")
            + " | " + " / ".join(peaks) + " |"
        )
    notes = [f"- {key} {impl}: {entry['skipped']}" for key, rec in report["configs"].items()
             for impl, entry in rec["results"].items() if "skipped" in entry]
    notes += [f"- {key} {impl}: {entry['error']}" for key, rec in report["configs"].items()
              for impl, entry in rec["results"].items() if "error" in entry]
    if notes:
        lines += ["", "Notes:"] + notes
    lines += _render_against_cudnn(report, impls, report["meta"].get("peak_tflops"))
    lines += ["", "Derived (each against its design target):"] + [f"- {line}" for line in report.get("derived", [])]
    return "\n".join(lines) + "\n"


def _derived(report: dict) -> list[str]:
    """The design-target quantities, computed from the measured records."""
    out = []
    cfgs = report["configs"]

    def sec(key, impl, field="seconds"):
        return cfgs.get(key, {}).get("results", {}).get(impl, {}).get(field)

    def cpu_note(key_a, key_b):  # across configurations (timed apart), CPU seconds are steadier on a busy machine
        a, b = sec(key_a, "blockwise", "cpu_seconds"), sec(key_b, "blockwise", "cpu_seconds")
        return f" [CPU-time ratio {a / b:.2f}; timed apart, one configuration after the other]" if a and b else ""

    for key, rec in cfgs.items():
        r = rec.get("ratios", {})
        if key.startswith("gpt2") and "dense/xla" in r:
            out.append(f"dense/xla at {key}: {r['dense/xla']:.2f} (target <= 1.05)")
        if "blockwise/xla" in r:
            out.append(f"blockwise/xla at {key}: {r['blockwise/xla']:.2f} (target <= 0.5)")
        bw = rec["results"].get("blockwise", {})
        if key.startswith("long") and key.endswith("-fwd") and "gflops" in bw:
            out.append(f"blockwise forward at {key}: {bw['gflops']:.1f} GFLOP/s = "
                       f"{100 * bw['gflops'] / rec['matmul_gflops']:.0f}% of the {rec['matmul_gflops']:.0f} GFLOP/s matmul (target >= 80% at T >= 4k)")
    for key in cfgs:
        if "-causal-" in key:
            full = key.replace("-causal-", "-full-")
            a, b = sec(key, "blockwise"), sec(full, "blockwise")
            if a and b:
                out.append(f"blockwise causal/non-causal time at {full.replace('-full', '')}: {a / b:.2f}"
                           f"{cpu_note(key, full)} (target <= 0.6 at T >= 8k)")
        if key.endswith("-fwd+bwd"):
            a, b = sec(key, "blockwise"), sec(key[: -len("+bwd")], "blockwise")
            if a and b:
                out.append(f"blockwise (fwd+bwd)/fwd time at {key[: -len('-fwd+bwd')]}: {a / b:.2f}"
                           f"{cpu_note(key, key[: -len('+bwd')])} (target <= 3)")
            mem = cfgs[key].get("memory", {}).get("blockwise", {})
            if "peak_rss_bytes" in mem and "-T65536-" in key:
                out.append(f"blockwise fwd+bwd peak resident memory at {key}: {mem['peak_rss_bytes'] / GIB:.2f} GiB (target <= 1 GiB)")
    return out


def _fraction(text: str) -> float:
    """An argparse ``type=``: a number in (0, 1] (else a usage error, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], received {text!r}")
    return value


def main() -> None:
    from jaxattn.io import OutputFolderError, atomic_write, int_at_least, positive_float, prepare_output_folder

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-output", help="output folder (default: bench-output)")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes, few rounds (a smoke run of a minute or two): sets --gpt2-T 256, "
                             "--long-T 2048, --min-rounds 3, --max-rounds 3, --seconds-per-config 3, whatever is given")
    parser.add_argument("--gpu", action="store_true", help="require a GPU (bf16, adds cuDNN); detected automatically otherwise")
    parser.add_argument("--resume", action="store_true", help="keep configurations already in the JSON file")
    parser.add_argument("--only", default="", help="run only configurations whose key contains this text")
    parser.add_argument("--impls", nargs="*", default=None,
                        help="time only these implementations (default: all the backend's); ratios need xla")
    parser.add_argument("--gpt2-T", type=int_at_least(1), default=1024)
    parser.add_argument("--skip-gpt2", action="store_true", help="only the long configurations")
    parser.add_argument("--long-T", type=int_at_least(1), nargs="*", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--long-N", type=int_at_least(1), default=1, help="heads of the long configurations (default 1)")
    parser.add_argument("--modes", nargs="*", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--peak-tflops", type=positive_float, default=None,
                        help="the device's peak TFLOP/s in the benchmark's dtype (H200 bf16 dense: 989), for the share of peak")
    parser.add_argument("--block-q", type=int_at_least(1), default=512)
    parser.add_argument("--block-k", type=int_at_least(1), default=512)
    parser.add_argument("--matmul-n", type=int_at_least(1), default=2048, help="side of the ceiling matmul")
    parser.add_argument("--min-rounds", type=int_at_least(3), default=3, help="timed rounds per configuration, at least")
    parser.add_argument("--max-rounds", type=int_at_least(3), default=7)
    parser.add_argument("--seconds-per-config", type=positive_float, default=12.0, help="time budget for the timed rounds")
    parser.add_argument("--memory-fraction", type=_fraction, default=0.5,
                        help="skip a materialising implementation whose [T, S] buffers need more than this "
                             "fraction of the available memory")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-configuration peak-memory subprocesses")
    parser.add_argument("--memory-timeout", type=positive_float, default=600.0)
    parser.add_argument("--seed", type=int_at_least(0), default=0)
    parser.add_argument("--windows", action="store_true",
                        help="measure the sliding window and causal skipping instead (bench_windows.json/.md)")
    parser.add_argument("--window", type=int_at_least(1), default=512, help="--windows: W, keys in each causal window")
    parser.add_argument("--window-block", type=int_at_least(1), default=128, help="--windows: the windowed kernel's block_q = block_k")
    parser.add_argument("--window-T", type=int_at_least(1), nargs="*", default=[16384])
    parser.add_argument("--causal-T", type=int_at_least(1), nargs="*", default=[8192, 16384])
    parser.add_argument("--window-memory-T", type=int_at_least(0), default=65536, help="--windows: T of the memory run (0: none)")
    parser.add_argument("--rounds", type=int_at_least(3), default=5,
                        help="--windows: interleaved timed rounds; --baseline: processes of each side (>= 3)")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="another checkout: the GPT-2 configurations' dense/xla and blockwise/xla against its")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--window-child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.window_child:
        spec = json.loads(args.window_child)
        print(json.dumps(_window_child(spec["cfg"], spec["seed"])), flush=True)
        return
    if args.baseline is not None:
        if args.rounds < 3:
            parser.error(f"--rounds must be >= 3, received {args.rounds}")
        _run_baseline(args)
        return
    if args.windows:
        for name in ("window", "window_block", "rounds"):
            if getattr(args, name) < (3 if name == "rounds" else 1):
                parser.error(f"--{name.replace('_', '-')} must be >= {3 if name == 'rounds' else 1}, received {getattr(args, name)}")
        if args.window_memory_T < 0 or any(T < 1 for T in args.window_T + args.causal_T):
            parser.error("--window-T, --causal-T must be >= 1 and --window-memory-T >= 0")
        _run_windows(args)
        return
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(_peak_memory_child(spec["cfg"], spec["impl"], spec["seed"])), flush=True)
        return
    try:  # before any work: nothing wasted, nothing half-written
        prepare_output_folder(args.out, ("bench_attention.json", "bench_attention.md"), create=False)
    except OutputFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)

    import jax

    backend = jax.default_backend()
    on_gpu = backend == "gpu"
    if args.gpu and not on_gpu:
        raise SystemExit(f"--gpu given but jax's default backend is {backend!r}")
    impls = list(IMPLS_GPU if on_gpu else IMPLS_CPU)
    if args.impls:
        unknown = sorted(set(args.impls) - set(impls))
        if unknown:
            raise SystemExit(f"--impls: {unknown} not among this backend's implementations {impls}")
        impls = [i for i in impls if i in args.impls]
    dtype = "bfloat16" if on_gpu else "float32"
    if args.quick:
        args.gpt2_T, args.long_T = 256, [2048]
        args.min_rounds, args.max_rounds, args.seconds_per_config = 3, 3, 3.0

    out_dir = Path(args.out)
    json_path, md_path = out_dir / "bench_attention.json", out_dir / "bench_attention.md"
    print(f"seed {args.seed}; writing {json_path} and {md_path}", flush=True)
    print(f"backend {backend}, dtype {dtype}, GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(unset)')}", flush=True)

    report = dict(configs={})
    earlier = {}
    if args.resume and json_path.exists():
        report = json.loads(json_path.read_text())
        earlier = report.get("meta", {})
    report["meta"] = dict(
        machine=f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.0f} GiB",
        backend=backend,
        device=str(jax.devices()[0].device_kind),
        dtype=dtype,
        jax=jax.__version__,
        glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""),
        matmul_n=args.matmul_n,
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        seed=args.seed,
        peak_tflops=args.peak_tflops,
    )
    # --resume keeps a configuration only if it was measured as this run would measure it
    changed = [f"{k} {earlier[k]!r} then, {report['meta'][k]!r} now"
               for k in ("machine", "backend", "device", "dtype", "seed", "jax")
               if k in earlier and earlier[k] != report["meta"][k]]
    if changed:
        print(f"--resume: nothing kept: the earlier run differs ({'; '.join(changed)})", flush=True)
        report["configs"] = {}

    for cfg in _configs(args, dtype):
        key = _key(cfg)
        if args.only and args.only not in key:
            continue
        kept = report["configs"].get(key)
        if kept is not None and kept.get("cfg") == cfg and sorted(kept.get("results", {})) == sorted(impls):
            print(f"{key}: kept from the earlier run", flush=True)
            continue
        avail = _available_bytes()
        run, skipped = [], {}
        for impl in impls:
            need = _quadratic_bytes(cfg, impl)
            if need > args.memory_fraction * avail:
                skipped[impl] = dict(skipped=f"its [T, S] buffers need ~{need / GIB:.0f} GiB, "
                                     f"more than {args.memory_fraction:.0%} of the {avail / GIB:.0f} GiB available")
            else:
                run.append(impl)
        print(f"{key}: timing {', '.join(run)}" + (f" (skipped: {', '.join(skipped)})" if skipped else ""), flush=True)
        record = _time_config(cfg, run, args, args.seed)
        record["results"].update(skipped)
        record.update(cfg=cfg, ratios={})
        record["ratios"] = _ratios(record, impls)
        if not args.no_memory:
            record["memory"] = {impl: _peak_memory(cfg, impl, args.seed, args.memory_timeout) for impl in run}
        report["configs"][key] = record
        times = ", ".join(f"{i} {_fmt_time(record['results'].get(i))}" for i in impls)
        ratios = ", ".join(f"{name} {value:.2f}" for name, value in record["ratios"].items())
        print(f"  {times}; matmul {record['matmul_gflops']:.0f} GFLOP/s; ratios: {ratios}", flush=True)
        if args.peak_tflops:
            shares = ", ".join(f"{i} {r['gflops'] / 1e3:.1f} TFLOP/s = {100 * r['gflops'] / 1e3 / args.peak_tflops:.0f}% of peak"
                               for i, r in record["results"].items() if "gflops" in r)
            print(f"  {shares}", flush=True)
        report["derived"] = _derived(report)
        atomic_write(json_path, json.dumps(report, indent=1))
        atomic_write(md_path, _render(report, impls))

    report["derived"] = _derived(report)
    atomic_write(json_path, json.dumps(report, indent=1))
    atomic_write(md_path, _render(report, impls))
    print("\n".join(report["derived"]))
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--baseline-child"]:  # before main(): a baseline's jaxattn may lack what main() imports
        print(json.dumps(_baseline_child(json.loads(sys.argv[2]))), flush=True)
    else:
        main()
