"""Benchmark: the forward's length buckets. A concrete prompt runs at its bucket's length
(jaxattn.models.bucket_length), so prompts of 20, 21 and 22 tokens share one compiled forward; under the
caller's own jax.jit (traced ids) it runs at its exact length, one program per length.

Two measurements, in one run (three with --table):
- compilations: a forward for each of --lengths, exact (jax.jit over the ids, per length) against bucketed
  (the plain call), counted with jax.monitoring's backend-compile events, with the seconds they took, and
  the largest difference between the two logits;
- cost of the padding: the steady forward (logits and every map) at each of --cost-lengths, exact against
  bucketed, the median of --repeats interleaved runs with min-max, wall and CPU seconds;
- with --table, the first call of interventions.ablation_effects for each of --lengths, on a logit
  difference at the last token written as an interventions.RowMetric (run in the bucket) against the same
  metric as a plain function of the output (each length its own program): compilations, wall and CPU
  seconds, and the largest difference between the two tables.

    python experiments/bench_buckets.py                                  # GPT-2-small shapes, random weights
    python experiments/bench_buckets.py --model smollm2 --cost-lengths 100 1000
    python experiments/bench_buckets.py --model smollm2 --lengths 11 13 15 --cost-lengths --table
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's jaxattn, whatever is installed

import jax
import numpy as np

from jaxattn import gpt2, llama, models
from jaxattn.io import int_at_least

COMPILE = "/jax/core/compile/backend_compile_duration"


def load(args):
    if args.model == "smollm2":
        params, config, _ = llama.load()
        return llama, params, config, "SmolLM2-135M (bundled GGUF, float32)"
    config = gpt2.GPT2Config.make(vocab_size=50257, **gpt2.SIZES[args.model])
    return gpt2, gpt2.init_params(args.seed, config), config, f"GPT-2-{args.model} shapes, random weights"


def _timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0, time.process_time() - c0


def _spread(xs):
    return f"{np.median(xs):.3f} s ({min(xs):.3f}-{max(xs):.3f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", *sorted(gpt2.SIZES)], default="small")
    parser.add_argument("--lengths", type=int_at_least(1), nargs="+", default=[20, 21, 22])
    parser.add_argument("--cost-lengths", type=int_at_least(1), nargs="*", default=[100])
    parser.add_argument("--repeats", type=int_at_least(3), default=5, help="steady runs per way (>= 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--table", action="store_true", help="also time ablation_effects per length: RowMetric "
                        "against a plain metric")
    args = parser.parse_args(argv)

    compiles: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, seconds, **kw: compiles.append(seconds) if name == COMPILE else None)
    module, params, config, name = load(args)
    vocab = module.SPEC.sizes(config).vocab
    rng = np.random.default_rng(args.seed)
    print(f"{name}; jax {jax.__version__} on {jax.devices()[0].platform}")
    exact_forward = jax.jit(lambda p, ids: module.forward(p, config, ids))  # traced ids: their own length

    def ways(ids):
        return {"exact": lambda: exact_forward(params, ids), "bucketed": lambda: module.forward(params, config, ids)}

    sentences = [rng.integers(0, vocab, n).astype(np.int32) for n in args.lengths]
    outs = {}
    print(f"lengths {args.lengths}, buckets {[models.bucket_length(t) for t in args.lengths]}; per length: XLA "
          f"compilations (the largest's seconds) and the call's wall seconds")
    for way in ("exact", "bucketed"):
        outs[way], cells = [], []
        for ids in sentences:
            start, t0 = len(compiles), time.perf_counter()
            outs[way].append(np.asarray(ways(ids)[way]().logits))
            new = compiles[start:]
            cells.append(f"T={len(ids)}: {len(new)} ({max(new, default=0.0):.2f} s), {time.perf_counter() - t0:.2f} s")
        print(f"  {way:8s} " + "; ".join(cells))
    diff = max(float(np.abs(a - b).max()) for a, b in zip(outs["exact"], outs["bucketed"]))
    print(f"bucketed logits vs exact: max |diff| {diff:.2e}")

    for T in args.cost_lengths:
        ids = rng.integers(0, vocab, T).astype(np.int32)
        run = ways(ids)
        for fn in run.values():
            _timed(fn)  # compile
        times = {way: [] for way in run}
        for _ in range(args.repeats):
            for way, fn in run.items():
                times[way].append(_timed(fn))
        wall = {w: [t[0] for t in ts] for w, ts in times.items()}
        cpu = {w: [t[1] for t in ts] for w, ts in times.items()}
        paired = [b / e for b, e in zip(wall["bucketed"], wall["exact"])]
        print(f"T = {T} (bucket {models.bucket_length(T, module.SPEC.sizes(config).max_length)}), {args.repeats} "
              f"interleaved steady runs: exact {_spread(wall['exact'])} wall, {np.median(cpu['exact']):.3f} s CPU; "
              f"bucketed {_spread(wall['bucketed'])} wall, {np.median(cpu['bucketed']):.3f} s CPU; bucketed / exact "
              f"{np.median(wall['bucketed']) / np.median(wall['exact']):.3f} wall (paired {np.median(paired):.3f}, "
              f"{min(paired):.3f}-{max(paired):.3f}), {np.median(cpu['bucketed']) / np.median(cpu['exact']):.3f} CPU")
    if args.table:
        _tables(module, params, config, sentences, compiles)
    return 0


def _logit_difference(logits, next_ids):  # a RowMetric's fn: [R, V], [R]
    return logits[0, 0] - logits[0, 1]


def _tables(module, params, config, sentences, compiles):
    from jaxattn import interventions as I

    metrics = {"RowMetric": I.RowMetric(_logit_difference, (-1,)),
               "plain": lambda out: out.logits[-1, 0] - out.logits[-1, 1]}
    tables = {}
    print("ablation_effects of the last token's logit difference, first call per length: XLA compilations, "
          "wall and CPU seconds")
    for way, metric in metrics.items():
        tables[way], cells = [], []
        for ids in sentences:
            start, t0, c0 = len(compiles), time.perf_counter(), time.process_time()
            tables[way].append(jax.block_until_ready(I.ablation_effects(I.bind(module, params, config, ids), metric)))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            cells.append(f"T={len(ids)}: {len(compiles) - start}, {wall:.2f} s ({cpu:.2f} s CPU)")
        print(f"  {way:9s} " + "; ".join(cells))
    diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(tables["RowMetric"], tables["plain"]))
    print(f"RowMetric tables vs plain: max |diff| {diff:.2e}")


if __name__ == "__main__":
    raise SystemExit(main())
