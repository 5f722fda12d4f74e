"""Benchmark: the saturation sweep as one jit(vmap) program against a Python loop over the same trials.

The loop calls the SAME jitted single-trial function the sweep vmaps (probes.sweep_trial_fn(d_k)), once
per (d_k, trial, scale mode), in two ways: waiting for each result, as a script that reads its results
one by one does, and leaving JAX's asynchronous dispatch alone (the calls queue up while earlier ones
run; it waits once, at the end), which is faster and is the stricter baseline. Both are compiled before
timing (compile times are printed apart). Measured in one run, for each
way the sweep can draw q and k (probes.saturation_sweep's `sampling`):
  * "gram" (the default, what the lab runs): q and k drawn in coordinates of their span (Bartlett's
    factor of their Gram matrix): exactly the law of every probe, at a cost that does not grow with d_k;
  * "vectors": the d_k-dimensional vectors themselves, each d_k at its own width;
and for two configurations:
  * "the lab's sweep": d_k = 8 … 4096, the lab's default 32 trials × 16 queries × 16 keys;
  * "many small trials": d_k = 8 … 64, 256 trials.
--breakdown adds, for "gram", what the lab's program spends its time on, and the speed-up of the trial
without its row probes.
--chunks 32,1024 adds, for "gram", the program at those trial counts as one vmap and in chunks of
(d_k, trial) pairs, the automatic chunk marked.
--per-dk adds, for "vectors", the comparison one d_k at a time next to a program that only draws the
trials' random inputs (in the same chunks) and sums them: work no batching can remove, which grows with d_k.
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import probes
from jaxattn._probes import _chunks, _draw, _draw_gram, _gram_chunk, _gram_program, _gram_trial_widths, _sweep_program

F32 = np.dtype("float32")


def _time(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _best_interleaved(fns, repeats):
    """Best of ``repeats`` wall times of each function, run in turn so all see the same load."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for t, fn in zip(times, fns):
            t.append(_time(fn))
    return [min(t) for t in times]


def _programs(head_dims, trials, T, S, V, seed, sampling):
    """The sweep's keys, the single-trial functions, the keys sliced per (d_k, trial), the one program, the loop."""
    keys = jax.random.split(jax.random.key(seed), (len(head_dims), trials))  # [P, R], as saturation_sweep
    if sampling == "gram":  # as saturation_sweep
        dims = np.asarray(head_dims, np.int32)
        batch = _gram_chunk(keys.size, T, S, V)  # the chunks saturation_sweep picks (on a CPU, 256 pairs past 425)
        program = lambda: _gram_program(keys, dims, T=T, S=S, V=V, dtype=F32, batch=batch)
    else:
        chunks = _chunks(head_dims, trials, T, S, V)
        program = lambda: _sweep_program(keys, head_dims=tuple(head_dims), T=T, S=S, V=V, dtype=F32, chunks=chunks)
    fns = {d: probes.sweep_trial_fn(d, num_queries=T, num_keys=S, value_dim=V, sampling=sampling) for d in head_dims}
    trial_keys = [[keys[p, r] for r in range(trials)] for p in range(len(head_dims))]  # sliced before timing

    def vmapped():
        return jax.block_until_ready(program())

    loop = functools.partial(_loop, lambda p, key, scaled: fns[head_dims[p]](key, scaled), trial_keys)
    return keys, fns, trial_keys, vmapped, loop


def _loop(call, trial_keys, wait_each=True):
    """``call(p, key, scaled)`` for every (d_k, trial, scale mode), waiting for each result or once at the end."""
    wait = jax.block_until_ready if wait_each else (lambda x: x)
    out = [wait(call(p, key, scaled)) for p, keys in enumerate(trial_keys) for key in keys for scaled in (True, False)]
    return out if wait_each else jax.block_until_ready(out)


def bench(name, head_dims, trials, T, S, V, repeats, seed, sampling):
    keys, fns, trial_keys, vmapped, loop = _programs(head_dims, trials, T, S, V, seed, sampling)
    compile_vmap = _time(vmapped)
    compile_loop = _time(lambda: [jax.block_until_ready(fns[d](keys[0, 0], True)) for d in head_dims])
    # Like for like: the program draws each trial once for both modes; this loop does too (one call per
    # trial of the same single-trial function vmapped over the two modes).
    modes = np.array([True, False])
    pairs = {d: jax.jit(jax.vmap(lambda key, scaled, f=fns[d]: f(key, scaled), in_axes=(None, 0))) for d in head_dims}

    def loop_pairs():
        return [jax.block_until_ready(pairs[d](key, modes)) for p, d in enumerate(head_dims) for key in trial_keys[p]]

    loop_pairs()  # compile
    loop_async = functools.partial(loop, wait_each=False)
    t_vmap, t_loop, t_async, t_pairs = _best_interleaved([vmapped, loop, loop_async, loop_pairs], repeats)
    # The two give the same numbers (spot check: the last d_k, last trial, both modes). The two programs
    # round differently; the float32 VJP's cancellation floor is ~1e-7·|g|, times |k| ≈ √d_k for ∂L/∂q.
    out = vmapped()
    for mode, scaled in enumerate((True, False)):
        one = fns[head_dims[-1]](keys[-1, -1], scaled)
        for field, atol in (("entropy", 1e-7), ("logit_grad_norm", 1e-6), ("q_grad_norm", 1e-6 * np.sqrt(head_dims[-1]))):
            np.testing.assert_allclose(out[field][mode, -1, -1], one[field], rtol=5e-2, atol=atol, err_msg=field)
    calls = len(head_dims) * trials * 2
    compiled = "one single-trial function" if sampling == "gram" else f"{len(head_dims)} single-trial functions"
    print(f"{name}, sampling={sampling!r}: d_k = {head_dims[0]} … {head_dims[-1]}, {trials} trials, T = {T}, S = {S}, V = {V}: "
          f"{calls} trials")
    print(f"  compile: one program {compile_vmap:.1f} s; {compiled} {compile_loop:.1f} s")
    print(f"  Python loop of the jitted single-trial function, waiting for each result: {t_loop:8.4f} s"
          f" ({1e3 * t_loop / calls:.3f} ms per trial)")
    print(f"  the same loop, dispatched asynchronously, waiting once at the end:        {t_async:8.4f} s"
          f" ({1e3 * t_async / calls:.3f} ms per trial)")
    print(f"  one jit(vmap) program:                                                    {t_vmap:8.4f} s"
          f" ({1e3 * t_vmap / calls:.4f} ms per trial)")
    print(f"  speed-up: {t_loop / t_vmap:.1f}x over the loop waiting for each result, {t_async / t_vmap:.1f}x over the"
          f" asynchronous loop (best of {repeats} each)")
    print(f"  like for like, a loop with one call per trial for both modes (one draw, as the program): {t_pairs:.4f} s, "
          f"speed-up {t_pairs / t_vmap:.1f}x", flush=True)
    return t_loop / t_vmap


def per_dk(head_dims, trials, T, S, V, repeats, seed):
    """sampling="vectors", one d_k at a time, with the batched draw of the inputs timed alone."""
    print(f"per d_k, sampling='vectors' ({trials} trials, T = {T}, S = {S}, V = {V}; times per trial and scale mode, "
          f"best of {repeats}):")
    print("  d_k | loop (ms/call) | program (ms) | drawing alone (ms) | speed-up | loop / drawing alone")
    for d in head_dims:
        keys, _, _, vmapped, loop = _programs((d,), trials, T, S, V, seed, "vectors")
        (chunk,) = _chunks((d,), trials, T, S, V)  # drawn in the same chunks as the program draws them
        one_draw = lambda key, d=d: sum(x.sum() for x in _draw(key, head_dim=d, T=T, S=S, V=V, dtype=F32))  # read once
        draw = jax.jit(lambda keys, f=one_draw, c=chunk: jax.lax.map(f, keys, batch_size=c) if c else jax.vmap(f)(keys))
        drawn = lambda: jax.block_until_ready(draw(keys[0]))
        vmapped(), loop(), drawn()  # compile
        t_vmap, t_loop, t_draw = _best_interleaved([vmapped, loop, drawn], repeats)
        n = 2 * trials  # the program draws once per trial for both modes; the loop once per call
        print(
            f"  {d:4d} | {1e3 * t_loop / n:14.3f} | {1e3 * t_vmap / n:12.4f} | {1e3 * t_draw / n:18.4f} |"
            f" {t_loop / t_vmap:7.1f}x | {t_loop / t_draw:7.1f}x",
            flush=True,
        )


def breakdown(trials, T, S, V, repeats, seed):
    """sampling="gram", the lab's sweep taken apart: what the program's time goes to, and the speed-up of
    the trial without its row probes (both sides lose them: work removed from the trial leaves the loop too)."""
    head_dims = probes.DEFAULT_HEAD_DIMS
    keys, fns, trial_keys, vmapped, loop = _programs(head_dims, trials, T, S, V, seed, "gram")
    flat = (keys.reshape(-1), jnp.repeat(jnp.asarray(head_dims, jnp.int32), trials))
    modes = jnp.array([True, False])
    widths = functools.partial(_gram_trial_widths, T=T, S=S, V=V, dtype=F32)
    both = jax.vmap(widths, in_axes=(None, 0, None))  # (key, modes, d_k): the program's trial, both modes
    no_rows = jax.jit(jax.vmap(both, in_axes=(0, None, 0)))
    draw_sum = lambda key, d: sum(x.sum() for x in _draw_gram(key, d, T=T, S=S, V=V, dtype=F32))  # read once
    draw = jax.jit(jax.vmap(draw_sum))
    one_no_rows = jax.jit(widths)
    dims = [np.int32(d) for d in head_dims]

    loop_no_rows = functools.partial(_loop, lambda p, key, scaled: one_no_rows(key, scaled, dims[p]), trial_keys)

    fns_ = [vmapped, lambda: jax.block_until_ready(no_rows(flat[0], modes, flat[1])),
            lambda: jax.block_until_ready(draw(*flat)), loop, loop_no_rows,
            functools.partial(loop, wait_each=False), functools.partial(loop_no_rows, wait_each=False)]
    for f in fns_:
        f()  # compile
    t_all, t_no_rows, t_draw, t_loop, t_loop_no_rows, t_async, t_async_no_rows = _best_interleaved(fns_, repeats)
    n = 2 * len(head_dims) * trials
    print(f"breakdown, sampling='gram', the lab's sweep ({trials} trials; best of {repeats}, interleaved; µs per trial and mode):")
    print(f"  one program: {t_all * 1e3:.2f} ms ({1e6 * t_all / n:.1f} µs) = drawing q, k, v, r {t_draw * 1e3:.2f} ms"
          f" + the core attention's forward and backward {(t_no_rows - t_draw) * 1e3:.2f} ms"
          f" + the row probes {(t_all - t_no_rows) * 1e3:.2f} ms (by difference)")
    for label, t_wait, t_asy, t_prog in (("the whole trial:       ", t_loop, t_async, t_all),
                                         ("without its row probes:", t_loop_no_rows, t_async_no_rows, t_no_rows)):
        print(f"  {label} loop waiting for each result {t_wait * 1e3:6.1f} ms ({1e6 * t_wait / n:5.1f} µs per call),"
              f" asynchronous {t_asy * 1e3:6.1f} ms; program {t_prog * 1e3:5.2f} ms:"
              f" {t_wait / t_prog:.1f}x and {t_asy / t_prog:.1f}x", flush=True)


def chunk_sizes(trials, T, S, V, repeats, seed):
    """sampling="gram": the lab's d_k at ``trials`` per d_k, the program as one vmap and in chunks of pairs."""
    head_dims = probes.DEFAULT_HEAD_DIMS
    keys = jax.random.split(jax.random.key(seed), (len(head_dims), trials))
    dims = np.asarray(head_dims, np.int32)
    pairs = keys.size
    auto = _gram_chunk(pairs, T, S, V)
    sizes = [None] + sorted({c for c in (128, 256, 512, pairs // 2, auto) if c and c < pairs})
    fns = [lambda b=b: jax.block_until_ready(_gram_program(keys, dims, T=T, S=S, V=V, dtype=F32, batch=b)) for b in sizes]
    for f in fns:
        f()  # compile
    times = _best_interleaved(fns, repeats)
    cells = [f"{'one vmap' if b is None else f'chunks of {b}'}{' (automatic)' if b == auto else ''}: {1e3 * t:.1f} ms"
             for b, t in zip(sizes, times)]
    print(f"gram program, {trials} trials × {len(head_dims)} d_k = {pairs} pairs (best of {repeats}): " + "; ".join(cells),
          flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10, help="best of this many timings (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=32, help="trials per d_k of the lab's sweep (default 32, the lab's)")
    parser.add_argument("--small-trials", type=int, default=256, help="trials per d_k, small configuration (default 256; 0 skips)")
    parser.add_argument("--sampling", default="gram,vectors", help="comma-separated: gram, vectors (default both)")
    parser.add_argument("--per-dk", action="store_true", help="add the per-d_k breakdown of sampling='vectors'")
    parser.add_argument("--breakdown", action="store_true", help="add what the lab's gram program's time goes to")
    parser.add_argument("--chunks", default="", help="comma-separated trial counts: time the gram program in chunks")
    args = parser.parse_args()
    samplings = [s for s in args.sampling.split(",") if s]
    bad = [s for s in samplings if s not in probes.SAMPLINGS]
    if bad or not samplings:
        parser.error(f"--sampling: expected a comma-separated subset of {probes.SAMPLINGS}, received {args.sampling!r}")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind}); seed {args.seed}; "
          f"PRNG {jax.config.jax_default_prng_impl}")
    for sampling in samplings:
        bench("the lab's sweep", probes.DEFAULT_HEAD_DIMS, args.trials, 16, 16, 16, args.repeats, args.seed, sampling)
        if args.small_trials:
            bench("many small trials", (8, 16, 32, 64), args.small_trials, 16, 16, 16, args.repeats, args.seed, sampling)
    for trials in [int(t) for t in args.chunks.split(",") if t]:
        chunk_sizes(trials, 16, 16, 16, args.repeats, args.seed)
    if args.breakdown:
        breakdown(args.trials, 16, 16, 16, args.repeats, args.seed)
    if args.per_dk:
        per_dk(probes.DEFAULT_HEAD_DIMS, args.trials, 16, 16, 16, args.repeats, args.seed)


if __name__ == "__main__":
    main()
