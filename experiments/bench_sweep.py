"""Benchmark: the saturation sweep as one jit(vmap) program against a Python loop over the same trials.

The loop calls the SAME jitted single-trial function the sweep vmaps (probes.sweep_trial_fn), once per
(d_k, trial, scale mode), and waits for each result, as a script that collects results one by one does.
Both are compiled before timing. Two configurations are measured in one run:
  * "many small trials": d_k = 8 … 64, where each trial is cheap and the loop pays dispatch per call;
  * "the lab's sweep": d_k = 8 … 4096, where every trial computes on vectors padded to 4096 and compute
    dominates, so batching has less to win.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import probes
from jaxattn._probes import _sweep_program


def bench(name, head_dims, trials, T, S, V, repeats):
    dims = jnp.asarray(head_dims, jnp.int32)
    keys = jax.random.split(jax.random.key(0), (len(head_dims), trials))
    static = dict(T=T, S=S, V=V, max_dim=max(head_dims), dtype=jnp.dtype("float32"))
    one = probes.sweep_trial_fn(num_queries=T, num_keys=S, value_dim=V, max_dim=max(head_dims))
    jax.block_until_ready(_sweep_program(keys, dims, **static))  # compile
    jax.block_until_ready(one(keys[0, 0], dims[0], jnp.bool_(True)))  # compile

    def vmapped():
        return jax.block_until_ready(_sweep_program(keys, dims, **static))

    def loop():
        out = []
        for p in range(len(head_dims)):
            for r in range(trials):
                for scaled in (True, False):
                    out.append(jax.block_until_ready(one(keys[p, r], dims[p], jnp.bool_(scaled))))
        return out

    t_vmap = min(_time(vmapped) for _ in range(repeats))
    t_loop = min(_time(loop) for _ in range(repeats))
    # The two give the same numbers (spot check one trial).
    v = vmapped()["entropy"][0, 0, 0]
    l = one(keys[0, 0], dims[0], jnp.bool_(True))["entropy"]
    np.testing.assert_allclose(v, l, rtol=1e-4)
    calls = len(head_dims) * trials * 2
    print(f"{name}: d_k = {head_dims[0]} … {head_dims[-1]}, {trials} trials, T = {T}, S = {S}: {calls} trials")
    print(f"  Python loop of the jitted single-trial function: {t_loop:8.3f} s ({1e3 * t_loop / calls:.3f} ms per trial)")
    print(f"  one jit(vmap) program:                           {t_vmap:8.3f} s ({1e3 * t_vmap / calls:.3f} ms per trial)")
    print(f"  speed-up: {t_loop / t_vmap:.1f}x")
    return t_loop / t_vmap


def _time(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many timings (default 3)")
    parser.add_argument("--trials", type=int, default=256, help="trials per d_k, small configuration (default 256)")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; seed 0")
    bench("many small trials", (8, 16, 32, 64), args.trials, 16, 16, 16, args.repeats)
    bench("the lab's sweep", probes.DEFAULT_HEAD_DIMS, 32, 16, 16, 16, args.repeats)


if __name__ == "__main__":
    main()
