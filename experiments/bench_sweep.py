"""Benchmark: the saturation sweep as one jit(vmap) program against a Python loop over the same trials.

The loop calls the SAME jitted single-trial function the sweep vmaps (probes.sweep_trial_fn(d_k)), once
per (d_k, trial, scale mode), and waits for each result, as a script that collects results one by one
does. Both are compiled before timing (compile times are printed apart). Each d_k runs at its own width
in both. Two configurations are measured in one run:
  * "the lab's sweep": d_k = 8 … 4096, the lab's default 32 trials × 16 queries × 16 keys;
  * "many small trials": d_k = 8 … 64, 256 trials, where each trial is cheap.
"""

import argparse
import time

import jax
import numpy as np

from jaxattn import probes
from jaxattn._probes import _sweep_program


def bench(name, head_dims, trials, T, S, V, repeats, seed):
    keys = jax.random.split(jax.random.key(seed), (len(head_dims), trials))  # [P, R], as saturation_sweep
    static = dict(head_dims=tuple(head_dims), T=T, S=S, V=V, dtype=np.dtype("float32"))
    fns = {d: probes.sweep_trial_fn(d, num_queries=T, num_keys=S, value_dim=V) for d in head_dims}
    t0 = time.perf_counter()
    jax.block_until_ready(_sweep_program(keys, **static))
    compile_vmap = time.perf_counter() - t0
    t0 = time.perf_counter()
    for d in head_dims:
        jax.block_until_ready(fns[d](keys[0, 0], True))
    compile_loop = time.perf_counter() - t0

    def vmapped():
        return jax.block_until_ready(_sweep_program(keys, **static))

    trial_keys = [[keys[p, r] for r in range(trials)] for p in range(len(head_dims))]  # sliced before timing

    def loop():
        out = []
        for p, d in enumerate(head_dims):
            one = fns[d]
            for key in trial_keys[p]:
                for scaled in (True, False):
                    out.append(jax.block_until_ready(one(key, scaled)))
        return out

    t_vmap, t_loop = [], []
    for _ in range(repeats):  # interleaved, so both see the same load on a shared machine
        t_vmap.append(_time(vmapped))
        t_loop.append(_time(loop))
    t_vmap, t_loop = min(t_vmap), min(t_loop)
    # The two give the same numbers (spot check: the last d_k, last trial, unscaled).
    v = vmapped()["logit_grad_norm"][1, -1, -1]
    l = fns[head_dims[-1]](keys[-1, -1], False)["logit_grad_norm"]
    np.testing.assert_allclose(v, l, rtol=5e-2, atol=1e-30)
    calls = len(head_dims) * trials * 2
    print(f"{name}: d_k = {head_dims[0]} … {head_dims[-1]}, {trials} trials, T = {T}, S = {S}, V = {V}: {calls} trials")
    print(f"  compile: one program {compile_vmap:.1f} s; {len(head_dims)} single-trial functions {compile_loop:.1f} s")
    print(f"  Python loop of the jitted single-trial function: {t_loop:8.3f} s ({1e3 * t_loop / calls:.3f} ms per trial)")
    print(f"  one jit(vmap) program:                           {t_vmap:8.3f} s ({1e3 * t_vmap / calls:.3f} ms per trial)")
    print(f"  speed-up: {t_loop / t_vmap:.1f}x (best of {repeats} each)", flush=True)
    return t_loop / t_vmap


def _time(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many timings (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=32, help="trials per d_k of the lab's sweep (default 32, the lab's)")
    parser.add_argument("--small-trials", type=int, default=256, help="trials per d_k, small configuration (default 256)")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; seed {args.seed}; PRNG {jax.config.jax_default_prng_impl}")
    bench("the lab's sweep", probes.DEFAULT_HEAD_DIMS, args.trials, 16, 16, 16, args.repeats, args.seed)
    if args.small_trials:
        bench("many small trials", (8, 16, 32, 64), args.small_trials, 16, 16, 16, args.repeats, args.seed)


if __name__ == "__main__":
    main()
