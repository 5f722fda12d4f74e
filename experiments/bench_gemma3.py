"""Benchmark: loading the bundled Gemma 3 270M (a Q4_K_M GGUF, dequantized to float32) and its forward pass
with every attention map.

    python experiments/bench_gemma3.py                 # T = 512, 3 loads, 5 steady forwards
    python experiments/bench_gemma3.py --T 600 --repeats 3

Prints the load (``llama.load``) and the forward's steady time at T with every map, each as the median
of at least 3 runs with its spread and CPU time beside wall time, and the forward's first call (compile
and run), one run in this process, wall and CPU. Needs the Gemma 3 wheels
(`make install`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's jaxattn, whatever is installed

import jax
import numpy as np

from jaxattn import llama
from jaxattn.io import int_at_least


def _timed(fn) -> tuple[float, float]:
    t, c = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    return time.perf_counter() - t, time.process_time() - c


def _line(label: str, runs: list[tuple[float, float]]) -> str:
    wall, cpu = [r[0] for r in runs], [r[1] for r in runs]
    return (f"{label}: wall median {statistics.median(wall):.2f} s (min {min(wall):.2f}, max {max(wall):.2f}); "
            f"CPU median {statistics.median(cpu):.2f} s ({len(runs)} runs)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int_at_least(1), default=512, help="tokens of the forward's input")
    parser.add_argument("--loads", type=int_at_least(3), default=3, help="loads timed")
    parser.add_argument("--repeats", type=int_at_least(3), default=5, help="steady forwards timed")
    args = parser.parse_args(argv)
    loads = []
    for _ in range(args.loads):
        result = {}
        loads.append(_timed(lambda: result.setdefault("model", llama.load(llama.GEMMA3_NAME))[0]))
    params, config, _ = result["model"]
    print(f"{llama.GEMMA3_NAME}: {config.num_hidden_layers} layers, T = {args.T}; jax {jax.__version__} on "
          f"{jax.devices()[0].platform}")
    print(_line("load", loads))
    ids = np.random.default_rng(0).integers(0, config.vocab_size, args.T).astype(np.int32)

    def forward():
        out = llama.forward(params, config, ids)
        return out.logits, out.attentions

    wall, cpu = _timed(forward)  # one first call per process: not a median
    print(f"forward with every map, first call (compile and run): {wall:.2f} s wall, {cpu:.2f} s CPU "
          f"(one run in this process)")
    print(_line("forward with every map, steady", [_timed(forward) for _ in range(args.repeats)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
