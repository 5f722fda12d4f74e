"""Benchmark: what reading each layer's weights out of params stacked ``[L, ...]`` costs on this backend.

The decoder (jaxattn.decoder) keeps a model's blocks stacked ``[L, ...]`` and runs them as one
``lax.scan``, so a first call compiles one block whatever the depth. On XLA's CPU backend a product
cannot read a slice of a larger buffer in place: the scan copies each layer's weights into a buffer of
their own before its matmuls read them. This script measures that cost on SmolLM2-135M's MLP shapes
(L = 30 blocks of x + (silu(x Wg) * (x Wu)) Wd, D = 576, F = 1536, float32, 318 MB of weights), for
``--rows`` rows of x (1 and 5: a generation step; 128: a forward or gradient at T = 128), against

- ``separate``: the same blocks written out over 30 separate arrays (no copy; compiles 30 blocks);
- ``fused-gemv`` (one row only): the weights stored ``[L, F, D]`` and multiplied as ``x @ W[l].T`` in a
  ``fori_loop``, the one form in which XLA's CPU backend fuses the slice into the product (a
  matrix-vector product emitted as a loop): no copy, but its own product instead of the library's.

Each time is the median of --repeats interleaved calls (min-max), with CPU time beside wall time; the
ratios are to ``separate`` in the same run. Compile times are printed apart.

    python experiments/bench_stacked.py
    python experiments/bench_stacked.py --rows 1 128 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

L, D, F = 30, 576, 1536  # SmolLM2-135M: blocks, width, MLP width


def _block(x, g, u, d):
    return x + (jax.nn.silu(x @ g) * (x @ u)) @ d


def _programs(rows: int, seed: int) -> dict[str, tuple]:
    """``{name: (compiled, args, compile seconds)}``."""
    rng = np.random.default_rng(seed)
    w = [jnp.asarray(rng.standard_normal(shape) * 0.02, jnp.float32) for shape in ((L, D, F), (L, D, F), (L, F, D))]
    x = jnp.asarray(rng.standard_normal((rows, D)), jnp.float32)
    separate = [tuple(a[layer].copy() for a in w) for layer in range(L)]

    def scanned(x, g, u, d):
        return jax.lax.scan(lambda h, ws: (_block(h, *ws), None), x, (g, u, d))[0]

    def written_out(x, layers):
        for ws in layers:
            x = _block(x, *ws)
        return x

    plans = {"scan over stacked": (scanned, (x, *w)), "separate": (written_out, (x, separate))}
    if rows == 1:
        w_t = [jnp.swapaxes(a, 1, 2).copy() for a in w]  # [L, out, in]

        def fused(x, g, u, d):
            def body(layer, h):
                mv = lambda v, a: v @ jax.lax.dynamic_index_in_dim(a, layer, keepdims=False).T  # noqa: E731
                return h + mv(jax.nn.silu(mv(h, g)) * mv(h, u), d)

            return jax.lax.fori_loop(0, L, body, x[0])[None]

        plans["fused-gemv"] = (fused, (x, *w_t))
    out = {}
    for name, (fn, args) in plans.items():
        t = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        out[name] = (compiled, args, time.perf_counter() - t)
    reference = out["separate"][0](*out["separate"][1])
    for name, (compiled, args, _) in out.items():  # the same numbers, whatever the program
        np.testing.assert_allclose(compiled(*args), reference, rtol=1e-3, atol=1e-3)
    return out


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} ms ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 5, 128])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.repeats < 3 or any(r < 1 for r in args.rows):
        parser.error(f"--repeats must be >= 3 and --rows >= 1, received {args.repeats} and {args.rows}")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; L={L}, D={D}, F={F}, float32")
    for rows in args.rows:
        programs = _programs(rows, args.seed)
        wall = {name: [] for name in programs}
        cpu = {name: [] for name in programs}
        for compiled, a, _ in programs.values():
            jax.block_until_ready(compiled(*a))  # warm-up
        for _ in range(args.repeats):
            for name, (compiled, a, _) in programs.items():
                t, c = time.perf_counter(), time.process_time()
                jax.block_until_ready(compiled(*a))
                wall[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
        base_wall, base_cpu = statistics.median(wall["separate"]), statistics.median(cpu["separate"])
        print(f"rows={rows}, median of {args.repeats} interleaved calls (min-max):")
        for name, (_, _, compile_s) in programs.items():
            print(f"  {name:18s} wall {_spread(wall[name])}, CPU {_spread(cpu[name])}; "
                  f"/ separate: {statistics.median(wall[name]) / base_wall:.2f} (CPU "
                  f"{statistics.median(cpu[name]) / base_cpu:.2f}); compile {compile_s:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
