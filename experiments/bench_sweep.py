"""Benchmark: the saturation sweep as one jit(vmap) program against a Python loop over the same trials.

The loop calls the SAME jitted single-trial function the sweep vmaps (probes.sweep_trial_fn(d_k)) once
per (d_k, trial, scale mode), in two ways: waiting for each result, as a script that reads its results
one by one does, and leaving JAX's asynchronous dispatch alone (it waits once, at the end), the
stricter baseline. The program is probes.saturation_sweep itself, NumPy results included. Everything is
compiled before timing (compile times are printed apart); times are the median of --repeats, interleaved,
with the spread (min-max) and the process CPU time beside the wall time.

    python experiments/bench_sweep.py                 # the lab's sweep and many small trials
    python experiments/bench_sweep.py --repeats 3
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's jaxattn, whatever is installed

import jax
import jax.numpy as jnp

from jaxattn import probes
from jaxattn.io import int_at_least

CONFIGS = {
    "the lab's sweep": dict(head_dims=probes.DEFAULT_HEAD_DIMS, trials=32),
    "many small trials": dict(head_dims=(8, 16, 32, 64), trials=256),
}


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _median_interleaved(fns, repeats: int) -> list[dict]:
    """Median, min and max wall seconds and the median process CPU seconds of each function over ``repeats``
    runs, run in turn so that all see the same load."""
    wall, cpu = [[] for _ in fns], [[] for _ in fns]
    for _ in range(repeats):
        for w, c, fn in zip(wall, cpu, fns):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            w.append(time.perf_counter() - t0)
            c.append(time.process_time() - c0)
    return [dict(median=statistics.median(w), min=min(w), max=max(w), cpu=statistics.median(c))
            for w, c in zip(wall, cpu)]


def _cell(t: dict) -> str:
    return f"{t['median']:8.4f} s ({t['min']:.4f}-{t['max']:.4f}), CPU {t['cpu']:8.4f} s"


def bench(name: str, head_dims, trials: int, T: int, S: int, V: int, repeats: int, seed: int) -> dict:
    key = jax.random.key(seed)
    shape = dict(num_queries=T, num_keys=S, value_dim=V, dtype=jnp.float32)
    program = lambda: probes.saturation_sweep(key, head_dims=head_dims, num_trials=trials, **shape)
    fns = {d: probes.sweep_trial_fn(d, **shape) for d in head_dims}
    keys = jax.random.split(key, (len(head_dims), trials))  # [P, R]: the sweep's trial keys (its docstring)
    calls = [(fns[d], keys[p, r], scaled) for p, d in enumerate(head_dims) for r in range(trials) for scaled in (True, False)]

    def loop_waiting():
        for fn, k, scaled in calls:
            jax.block_until_ready(fn(k, scaled))

    def loop_async():
        jax.block_until_ready([fn(k, scaled) for fn, k, scaled in calls])

    compile_program = _time(program)
    compile_loop = _time(lambda: [jax.block_until_ready(fns[d](keys[0, 0], True)) for d in head_dims])
    t_wait, t_async, t_program = _median_interleaved([loop_waiting, loop_async, program], repeats)
    print(f"{name}: d_k = {head_dims[0]} … {head_dims[-1]}, {trials} trials, T = {T}, S = {S}, V = {V} "
          f"({len(calls)} calls of the single-trial function)")
    print(f"  compile: one program {compile_program:.1f} s; {len(head_dims)} single-trial functions {compile_loop:.1f} s")
    print(f"  Python loop, waiting for each result:          {_cell(t_wait)}")
    print(f"  Python loop, asynchronous, waiting at the end: {_cell(t_async)}")
    print(f"  one jit(vmap) program (saturation_sweep):      {_cell(t_program)}")
    print(f"  speed-up (medians): {t_wait['median'] / t_program['median']:.1f}x over the waiting loop, "
          f"{t_async['median'] / t_program['median']:.1f}x over the asynchronous one "
          f"(CPU {t_wait['cpu'] / t_program['cpu']:.1f}x, {t_async['cpu'] / t_program['cpu']:.1f}x)")
    return {"waiting": t_wait, "async": t_async, "program": t_program}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int_at_least(3), default=10, help="timed runs of each (the median is kept, with the spread)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind}); seed {args.seed}; "
          f"median of {args.repeats}, interleaved (min-max); process CPU time beside wall time")
    for name, cfg in CONFIGS.items():
        bench(name, cfg["head_dims"], cfg["trials"], 16, 16, 16, args.repeats, args.seed)


if __name__ == "__main__":
    main()
