"""Benchmark: jaxattn's GPT-2 forward pass with every attention map vs Hugging Face's FlaxGPT2LMHeadModel
(output_attentions=True) on the same random weights, both jit-compiled, timed alternately in one run.

    python experiments/bench_gpt2.py                  # GPT-2-small shapes, T=1024
    python experiments/bench_gpt2.py --T 256 --repeats 3

Needs transformers 4.x with its Flax classes (the dev extra); jaxattn itself does not. Prints the
median times and the ratio jaxattn / Hugging Face (target <= 1.0), and writes them to bench_gpt2.json
in the output folder it names.
"""

from __future__ import annotations

import argparse
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


def _timed(fn) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(gpt2.SIZES), default="small")
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--T", type=int, default=1024)
    parser.add_argument("--repeats", type=int_at_least(1), default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="lab-output/bench_gpt2")
    args = parser.parse_args(argv)
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

    compile_ours, compile_theirs = _timed(ours), _timed(theirs)  # first calls: compile + run
    a, b = ours(), theirs()
    max_logit = float(np.abs(np.asarray(a[0]) - np.asarray(b[0][0])).max())
    max_att = max(float(np.abs(np.asarray(a[1][i]) - np.asarray(b[1][i][0])).max()) for i in range(config.n_layer))
    del a, b
    t_ours, t_theirs = [], []
    for _ in range(args.repeats):  # alternate, so load on the machine hits both alike
        t_ours.append(_timed(ours))
        t_theirs.append(_timed(theirs))
    m_ours, m_theirs = statistics.median(t_ours), statistics.median(t_theirs)
    ratio = m_ours / m_theirs
    print(f"outputs agree: max |logits diff| {max_logit:.2e}, max |attention diff| {max_att:.2e}")
    print(f"first call (compile + run): jaxattn {compile_ours:.2f} s, Hugging Face {compile_theirs:.2f} s")
    print(f"jaxattn.gpt2.forward   median {m_ours * 1e3:9.1f} ms  (runs: {', '.join(f'{t * 1e3:.0f}' for t in t_ours)})")
    print(f"FlaxGPT2LMHeadModel    median {m_theirs * 1e3:9.1f} ms  (runs: {', '.join(f'{t * 1e3:.0f}' for t in t_theirs)})")
    print(f"ratio jaxattn / Hugging Face = {ratio:.3f}  (target <= 1.0: {'met' if ratio <= 1.0 else 'NOT met'})")

    out = Path(args.out)
    record = {"command": "python experiments/bench_gpt2.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "seed": args.seed, "size": args.size, "T": args.T, "vocab": config.vocab_size,
              "platform": jax.devices()[0].platform, "jaxattn_s": t_ours, "huggingface_s": t_theirs,
              "median_jaxattn_s": m_ours, "median_huggingface_s": m_theirs, "ratio": ratio,
              "max_abs_logits_diff": max_logit, "max_abs_attention_diff": max_att}
    write_json(out / "bench_gpt2.json", record)
    print(f"wrote {out}/bench_gpt2.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
