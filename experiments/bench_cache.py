"""Benchmark: the key/value cache of generation with sliding-window layers, ring against every key.

A sliding-window layer of jaxattn's generation keeps a ring of its last W keys and values; a full layer
keeps every slot. This script compiles ``jaxattn.llama.generate`` for Gemma 3 270M's shapes (18 layers,
15 of them sliding with W = 512; random weights: the cache's size depends on the shapes only) to reach
``--total`` tokens, and, in the same run, the same model with every layer full (a cache of every key),
and prints for each: the cache's bytes (its buffers' shapes, counted from the compiled program's jaxpr)
and the compiled program's temporary memory (XLA's ``memory_analysis``), with their ratios. Compiling is
deterministic; each is compiled ``--repeats`` times and the median with its spread printed beside the
compile's wall and CPU time.

    python experiments/bench_cache.py                     # T = 4096: an 8-token prompt and 4088 new tokens
    python experiments/bench_cache.py --total 2048
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

# Gemma 3 270M's shapes (the GGUF's metadata; jaxattn.llama.load("gemma-3-270m") reads the same config).
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                   rope_theta=1e6, tie_word_embeddings=True, model_type="gemma3_text", sliding_window=512,
                   query_pre_attn_scalar=256.0)


def _cache_bytes(jaxpr, K: int, H: int) -> int:
    """Bytes of the [layers, length, K, H] buffers the program makes (the cache's): each distinct shape twice,
    its keys' buffer and its values'."""
    seen = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                aval = v.aval
                if len(getattr(aval, "shape", ())) == 4 and aval.shape[2:] == (K, H):
                    seen.add((aval.shape, aval.dtype.itemsize))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr)
    return sum(2 * int(np.prod(shape)) * size for shape, size in seen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total", type=int_at_least(16), default=4096, help="prompt plus new tokens")
    parser.add_argument("--prompt", type=int_at_least(1), default=8, help="prompt tokens")
    parser.add_argument("--repeats", type=int_at_least(3), default=3)
    args = parser.parse_args(argv)
    if args.prompt >= args.total:  # generate needs one new token or more
        parser.error(f"--prompt {args.prompt} must be less than --total {args.total} (the rest are the new tokens)")
    windowed = llama.LlamaConfig.make(**GEMMA3_270M)
    full = windowed._replace(layer_types=("full_attention",) * windowed.num_hidden_layers)
    params = jax.eval_shape(lambda: llama.init_params(0, windowed))  # shapes only: nothing is run
    prompt = np.zeros(args.prompt, np.int32)
    new = args.total - args.prompt
    print(f"Gemma 3 270M shapes, T = {args.total} ({args.prompt}-token prompt, {new} new); jax {jax.__version__} on "
          f"{jax.devices()[0].platform}")
    K, H = windowed.num_key_value_heads, windowed.head_dim
    rows = {}
    for label, config in (("sliding rings", windowed), ("every key", full)):
        fn = jax.jit(lambda p, c=config: llama.generate(p, c, prompt, max_new_tokens=new))
        cache = _cache_bytes(jax.make_jaxpr(fn)(params).jaxpr, K, H)
        temps, walls, cpus = [], [], []
        for _ in range(args.repeats):
            jax.clear_caches()
            t, c = time.perf_counter(), time.process_time()
            compiled = fn.lower(params).compile()
            walls.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
            temps.append(compiled.memory_analysis().temp_size_in_bytes)
        rows[label] = (cache, statistics.median(temps))
        print(f"{label:14s} cache {cache / 2**20:8.1f} MiB; compiled temporaries median {statistics.median(temps) / 2**20:8.1f} "
              f"MiB (spread {(max(temps) - min(temps)) / 2**20:.1f}); compile median {statistics.median(walls):.1f} s wall "
              f"({min(walls):.1f}-{max(walls):.1f}), {statistics.median(cpus):.1f} s CPU ({min(cpus):.1f}-{max(cpus):.1f})")
    (c1, t1), (c2, t2) = rows["sliding rings"], rows["every key"]
    print(f"ratio, rings / every key: cache {c1 / c2:.3f}, compiled temporaries {t1 / t2:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
