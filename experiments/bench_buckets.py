"""Benchmark: compiled programs for many sentence lengths, exact lengths against length buckets.

Each distinct input length compiles its own GPT-2 forward. jaxattn.models.pad_to_bucket pads a sentence
under the attention mask to the next bucket length, so sentences of 20, 21 and 22 tokens share one
program. This script runs GPT-2-small-shaped random weights on sentences of the given lengths, first
at their exact lengths, then bucketed, in one run, and prints the number of XLA compilations (counted
with jax.monitoring) and the seconds they took, and checks that the bucketed logits at the real
positions equal the exact ones.

    python experiments/bench_buckets.py                      # lengths 20, 21, 22; GPT-2-small shapes
    python experiments/bench_buckets.py --lengths 5 9 17 33 --size tiny
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's jaxattn, whatever is installed

import jax
import numpy as np

from jaxattn import gpt2, models

COMPILE = "/jax/core/compile/backend_compile_duration"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(gpt2.SIZES), default="small")
    parser.add_argument("--lengths", type=int, nargs="+", default=[20, 21, 22])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    compiles: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, seconds, **kw: compiles.append(seconds) if name == COMPILE else None)
    config = gpt2.GPT2Config.make(vocab_size=50257, **gpt2.SIZES[args.size])
    params = gpt2.init_params(args.seed, config)
    rng = np.random.default_rng(args.seed)
    sentences = [rng.integers(0, config.vocab_size, n).astype(np.int32) for n in args.lengths]
    print(f"GPT-2-{args.size} shapes, random weights; sentence lengths {args.lengths}; buckets {models.BUCKETS}; "
          f"jax {jax.__version__} on {jax.devices()[0].platform}")

    def run(label, call):
        start, t0 = len(compiles), time.perf_counter()
        outs = [np.asarray(call(ids)) for ids in sentences]
        wall = time.perf_counter() - t0
        n, secs = len(compiles) - start, sum(compiles[start:])
        print(f"{label:16s} {n:3d} compilations, {secs:6.2f} s compiling; {wall:6.2f} s wall for {len(sentences)} sentences")
        return outs, n, wall

    exact, n_exact, wall_exact = run("exact lengths", lambda ids: np.asarray(gpt2.forward(params, config, ids).logits))

    def bucketed_logits(ids):
        padded, mask = models.pad_to_bucket(ids)
        return np.asarray(gpt2.forward(params, config, padded, attention_mask=mask).logits)[: len(ids)]

    bucketed, n_bucket, wall_bucket = run("bucketed", bucketed_logits)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(exact, bucketed))
    print(f"bucketed logits at the real positions vs exact: max |diff| {diff:.2e}")
    print(f"programs: {n_exact} -> {n_bucket}; wall: {wall_exact:.2f} s -> {wall_bucket:.2f} s "
          f"(ratio {wall_bucket / wall_exact:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
