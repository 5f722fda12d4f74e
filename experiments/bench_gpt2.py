"""Benchmark: jaxattn's GPT-2 forward pass with every attention map vs Hugging Face's FlaxGPT2LMHeadModel
(output_attentions=True) on the same random weights, both jit-compiled, timed alternately in one run.

    python experiments/bench_gpt2.py                  # GPT-2-small shapes, T=1024
    python experiments/bench_gpt2.py --T 256 --repeats 3

Needs transformers 4.x with its Flax classes (the dev extra); jaxattn itself does not. Prints the
median times (of at least 3 runs, with their spread) and the ratio jaxattn / Hugging Face (target <= 1.0),
with the process CPU time and its ratio beside the wall time, and writes them to bench_gpt2.json in the
output folder it names.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's jaxattn, whatever is installed

import jax
import numpy as np

from jaxattn import gpt2
from jaxattn.checkpoint import unstack_layers
from jaxattn.io import OutputFolderError, int_at_least, prepare_output_folder, write_json


def _timed(fn) -> tuple[float, float]:
    """Wall and process CPU seconds of one call."""
    t, c = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    return time.perf_counter() - t, time.process_time() - c


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(gpt2.SIZES), default="small")
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--T", type=int_at_least(1), default=1024, help="tokens, at most the size's n_positions")
    parser.add_argument("--repeats", type=int_at_least(3), default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="lab-output/bench_gpt2")
    args = parser.parse_args(argv)
    if args.T > gpt2.SIZES[args.size]["n_positions"]:  # before any work: the model has no position past it
        parser.error(f"--T {args.T} must be at most GPT-2-{args.size}'s n_positions "
                     f"({gpt2.SIZES[args.size]['n_positions']})")
    try:  # before any work: nothing wasted, nothing half-written
        prepare_output_folder(args.out, ("bench_gpt2.json",), create=False)
    except OutputFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    config = gpt2.GPT2Config.make(vocab_size=args.vocab, **gpt2.SIZES[args.size])
    print(f"seed {args.seed}; GPT-2-{args.size} shapes ({config.n_layer} layers x {config.n_head} heads, "
          f"d_model={config.n_embd}, V={config.vocab_size}), random weights, T={args.T}; "
          f"jax {jax.__version__} on {jax.devices()[0].platform} ({platform.processor() or platform.machine()})")
    params = gpt2.init_params(args.seed, config)
    ids = np.random.default_rng(args.seed).integers(0, config.vocab_size, args.T).astype(np.int32)

    hf = FlaxGPT2LMHeadModel(
        GPT2Config(vocab_size=config.vocab_size, n_positions=config.n_positions, n_embd=config.n_embd,
                   n_layer=config.n_layer, n_head=config.n_head), _do_init=False)
    hf_run = jax.jit(lambda p, x: hf(x, params=p, output_attentions=True))
    hf_params = unstack_layers(params, "transformer/h")  # Flax GPT-2's per-layer layout

    def ours():
        out = gpt2.forward(params, config, ids)
        return out.logits, out.attentions  # [T, V], [L, N, T, T]

    def theirs():
        out = hf_run(hf_params, ids[None])
        return out.logits, out.attentions  # [1, T, V], L x [1, N, T, T]

    (compile_ours, _), (compile_theirs, _) = _timed(ours), _timed(theirs)  # first calls: compile + run
    a, b = ours(), theirs()
    max_logit = float(np.abs(np.asarray(a[0]) - np.asarray(b[0][0])).max())
    max_att = max(float(np.abs(np.asarray(a[1][i]) - np.asarray(b[1][i][0])).max()) for i in range(config.n_layer))
    del a, b
    runs_ours, runs_theirs = [], []
    for _ in range(args.repeats):  # alternate, so load on the machine hits both alike
        runs_ours.append(_timed(ours))
        runs_theirs.append(_timed(theirs))
    t_ours, c_ours = [r[0] for r in runs_ours], [r[1] for r in runs_ours]
    t_theirs, c_theirs = [r[0] for r in runs_theirs], [r[1] for r in runs_theirs]
    m_ours, m_theirs = statistics.median(t_ours), statistics.median(t_theirs)
    mc_ours, mc_theirs = statistics.median(c_ours), statistics.median(c_theirs)
    ratio, cpu_ratio = m_ours / m_theirs, mc_ours / mc_theirs
    print(f"outputs agree: max |logits diff| {max_logit:.2e}, max |attention diff| {max_att:.2e}")
    print(f"first call (compile + run): jaxattn {compile_ours:.2f} s, Hugging Face {compile_theirs:.2f} s")
    print(f"jaxattn.gpt2.forward   median {m_ours * 1e3:9.1f} ms ({min(t_ours) * 1e3:.1f}-{max(t_ours) * 1e3:.1f}), "
          f"CPU {mc_ours * 1e3:9.1f} ms  (runs: {', '.join(f'{t * 1e3:.0f}' for t in t_ours)})")
    print(f"FlaxGPT2LMHeadModel    median {m_theirs * 1e3:9.1f} ms ({min(t_theirs) * 1e3:.1f}-{max(t_theirs) * 1e3:.1f}), "
          f"CPU {mc_theirs * 1e3:9.1f} ms  (runs: {', '.join(f'{t * 1e3:.0f}' for t in t_theirs)})")
    print(f"ratio jaxattn / Hugging Face = {ratio:.3f}, CPU {cpu_ratio:.3f}  "
          f"(median of {args.repeats}; target <= 1.0: {'met' if ratio <= 1.0 else 'NOT met'})")

    out = Path(args.out)
    record = {"command": "python experiments/bench_gpt2.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "seed": args.seed, "size": args.size, "T": args.T, "vocab": config.vocab_size,
              "platform": jax.devices()[0].platform, "jax": jax.__version__,
              "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "jaxattn_s": t_ours, "huggingface_s": t_theirs, "jaxattn_cpu_s": c_ours, "huggingface_cpu_s": c_theirs,
              "median_jaxattn_s": m_ours, "median_huggingface_s": m_theirs, "ratio": ratio,
              "median_jaxattn_cpu_s": mc_ours, "median_huggingface_cpu_s": mc_theirs, "cpu_ratio": cpu_ratio,
              "max_abs_logits_diff": max_logit, "max_abs_attention_diff": max_att}
    write_json(out / "bench_gpt2.json", record)
    print(f"wrote {out}/bench_gpt2.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
