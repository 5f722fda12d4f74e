"""Which heads does "it -> trophy vs suitcase" depend on? Every head ablated, patched and differentiated.

    python experiments/heads.py                         # SmolLM2-135M (bundled): effects, benchmark, entropy bound
    python experiments/heads.py --model minilm          # the bundled all-MiniLM-L6-v2 (no LM head: a similarity metric)
    python experiments/heads.py --model gpt2            # GPT-2 from the hub or a local directory (fails offline)
    python experiments/heads.py --random-gpt2 small     # a RANDOM GPT-2 (offline; the machinery, not a trained model)
    python experiments/heads.py --parts bound           # only the entropy bound (also: effects, bench)

The metric, for a causal LM: log p(" trophy") - log p(" suitcase") after the "too big" sentence and
' In that sentence, "it" refers to the'. For the encoder: cos(h_it, h_trophy) - cos(h_it, h_suitcase) of
the last hidden states. Patching takes each head's z (or attention weights) from the "too small" run.
Writes heads.json, heads.md, heads.png, bench.json and bound.json into --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's jaxattn, whatever is installed

import numpy as np

from jaxattn import bert, gpt2, interventions, lab, llama
from jaxattn.checkpoint import CheckpointError
from jaxattn.io import OutputFolderError, atomic_write, prepare_output_folder, write_json

BIG, SMALL = lab.SENTENCES["big"], lab.SENTENCES["small"]
CHOICES = [lab.RESOLUTIONS["trophy"], lab.RESOLUTIONS["suitcase"]]
# What each part writes into --out (checked before the model loads).
OUTPUTS = {"effects": ("heads.json", "heads.md", "heads.png"), "bench": ("bench.json",), "bound": ("bound.json",)}


def load(args):
    """``(module, params, config, tokenizer, name)`` for the chosen model."""
    if args.random_gpt2:
        texts = [t + lab.RESOLUTION_PROMPT + c for t in (BIG, SMALL) for c in CHOICES]
        texts += [s.text for s in interventions.flatten_pairs(interventions.load_pairs())]
        params, config, tok = gpt2.random_model(args.random_gpt2, seed=0, texts=texts)
        return gpt2, params, config, tok, f"random-gpt2-{args.random_gpt2} (RANDOM weights)"
    if args.model == "smollm2":
        params, config, tok = llama.load()
        return llama, params, config, tok, "SmolLM2-135M-Instruct (bundled GGUF, Q4_1 weights as float32)"
    if args.model == "minilm":
        params, config, tok = bert.load()
        return bert, params, config, tok, bert.BUNDLED_NAME
    params, config, tok = gpt2.load(args.model)
    return gpt2, params, config, tok, str(args.model)


def token_of(tok, text, phrase):
    """The token span of a phrase's first whole-word occurrence in the text."""
    _, offsets = interventions.encode_with_offsets(tok, text)
    return interventions.char_span_to_tokens(offsets, *interventions.find_span(text, phrase))


def reference(module, params, config, tok, n):
    """The mean z over n Winograd sentences (mean-ablation's value), each padded to a multiple of 16."""
    bounds = []
    for s in interventions.flatten_pairs(interventions.load_pairs())[:n]:
        ids, _ = interventions.encode_with_offsets(tok, s.text)
        T = -(-len(ids) // 16) * 16
        padded = np.zeros(T, np.int32)
        padded[: len(ids)] = ids
        bounds.append(interventions.bind(module, params, config, padded, attention_mask=np.arange(T) < len(ids)))
    return interventions.reference_mean(bounds)


def setup(module, params, config, tok):
    """The clean and source bounds, the metric, the query rows and the candidate spans."""
    spans = {w: token_of(tok, BIG, w) for w in ("it", "trophy", "suitcase")}
    if module is bert:  # an encoder: the sentences alone, a similarity metric
        ids = [interventions.encode_with_offsets(tok, t)[0] for t in (BIG, SMALL)]
        bound = interventions.bind(module, params, config, ids[0])
        source = interventions.bind(module, params, config, ids[1]) if len(ids[0]) == len(ids[1]) else None
        metric = interventions.similarity_metric(spans["it"][0], spans["trophy"], spans["suitcase"])
        rows = {"it": spans["it"][0]}
        return bound, source, metric, rows, spans, "cos(h_it, h_trophy) - cos(h_it, h_suitcase)"
    pair = interventions.choice_pair(tok, BIG + lab.RESOLUTION_PROMPT, SMALL + lab.RESOLUTION_PROMPT, CHOICES)
    clean, src = pair["clean"], pair["source"]
    bound = interventions.bind(module, params, config, clean["input_ids"], attention_mask=clean["attention_mask"])
    source = None  # patching needs the two inputs token for token aligned
    if pair["aligned"]:
        source = interventions.bind(module, params, config, src["input_ids"], attention_mask=src["attention_mask"])
    rows = {"it": spans["it"][0], "last": (clean["start"] - 1).tolist()}  # the row that predicts the answer
    return bound, source, interventions.choice_metric(clean), rows, spans, "log p(' trophy') - log p(' suitcase')"


def attention_columns(bound, source, rows, spans):
    """``[L, N]`` tables of where the query rows look: the weight on 'trophy' and on 'suitcase'."""
    cols = {}
    for run, which in ((bound, "big"), (source, "small")):
        if run is None:
            continue
        att = np.asarray(run().attentions)
        for row_name, row in rows.items():
            for cand in ("trophy", "suitcase"):
                cols[f"A[{row_name}->{cand}]{'' if which == 'big' else '(small)'}"] = (
                    interventions.attention_row_reduce(att, row, spans[cand]) / (1 if att.ndim == 4 else att.shape[0]))
    for row_name in rows:  # the preference and its flip between the sentences
        cols[f"pref[{row_name}]"] = cols[f"A[{row_name}->trophy]"] - cols[f"A[{row_name}->suitcase]"]
        if source is None:
            continue
        cols[f"flip[{row_name}]"] = cols[f"pref[{row_name}]"] - (cols[f"A[{row_name}->trophy](small)"]
                                                                - cols[f"A[{row_name}->suitcase](small)"])
    return cols


def effects_part(module, params, config, tok, name, args, out):
    bound, source, metric, rows, spans, metric_text = setup(module, params, config, tok)
    line = f"metric: {metric_text}; clean ('too big'): {float(interventions.metric_value(bound, metric)):+.4f}"
    if source is None:
        print(line + "; 'too small' tokenizes to another length: no patching")
    else:
        print(line + f", source ('too small'): {float(interventions.metric_value(source, metric)):+.4f}")
    t0 = time.perf_counter()
    ref = reference(module, params, config, tok, args.reference) if args.reference else None
    tables = interventions.head_tables(bound, metric, source=source, reference=ref, rows=rows, chunk=args.chunk)
    print(f"effect tables: {', '.join(tables)} ({time.perf_counter() - t0:.0f} s)")
    attention = attention_columns(bound, source, rows, spans)
    causal = {k: v for k, v in tables.items() if k != "attn_grad[all]"}
    rho = interventions.correlations(causal)
    looks = {k: attention[k] for k in attention if k.startswith("pref")}
    effects = {k: tables[k] for k in ("ablation", "patch_z") if k in tables}
    rho_attention = interventions.correlations({**looks, **effects})
    rho_abs = interventions.correlations({**{k: attention[k] for k in attention if k.startswith("A[") and "small" not in k},
                                          **effects}, absolute=True)
    effect_cols = [c for c in ("ablation", "mean_ablation", "patch_z", "patch_attn", "gate_estimate", "attribution") if c in tables]
    look_cols = [k for k in attention if k.startswith("A[") and "small" not in k]
    merged = {**tables, **attention}
    by_effect = interventions.top_heads(merged, "ablation", k=args.top, columns=effect_cols + look_cols)
    by_patch = interventions.top_heads(merged, "patch_z", k=args.top, columns=effect_cols + look_cols) if "patch_z" in tables else []
    by_look = interventions.top_heads(merged, "A[it->trophy]", k=args.top, columns=look_cols + effect_cols)
    L, N = tables["ablation"].shape
    report = [
        f"# Heads behind 'it -> trophy vs suitcase': {name} ({L} layers x {N} heads)",
        "",
        f"metric: {metric_text}; effects are metric(intervened) - metric(clean) on 'too big'.",
        "",
        interventions.render_top(by_effect, effect_cols + look_cols, title=f"## Top {args.top} heads by |ablation effect|"),
        "",
    ]
    if by_patch:
        report += [interventions.render_top(by_patch, effect_cols + look_cols,
                                            title=f"## Top {args.top} heads by |patching effect| (z from 'too small')"), ""]
    report += [
        interventions.render_top(by_look, look_cols + effect_cols, title=f"## Top {args.top} heads by attention from 'it' to 'trophy'"),
        "",
        "## Spearman rank correlation between the methods (signed, over all heads)",
        "```",
        interventions.render_correlations(rho),
        "```",
        "## Does where the heads look agree with what the metric depends on? (signed)",
        "```",
        interventions.render_correlations(rho_attention),
        "```",
        "## ... and in magnitude (|attention| vs |effect|)",
        "```",
        interventions.render_correlations(rho_abs),
        "```",
    ]
    if "flip[it]" in attention:
        report.append(f"max |flip| of the 'it' row's preference between 'too big' and 'too small': "
                      f"{float(np.max(np.abs(attention['flip[it]']))):.3g}")
    text = "\n".join(report)
    print(text)
    atomic_write(out / "heads.md", text + "\n")
    atomic_write(out / "heads.png", interventions.heatmaps_png({**tables, "pref[it]": attention["pref[it]"]},
                                                                title=f"{name}: {metric_text}"))
    write_json(out / "heads.json", {
        "model": name, "metric": metric_text, "methods": interventions.METHODS, "tables": tables,
        "attention": attention, "spans": spans, "rows": rows, "correlations": rho,
        "correlations_attention": rho_attention, "correlations_magnitude": rho_abs,
        "top_by_ablation": by_effect, "top_by_patch_z": by_patch, "top_by_attention": by_look,
    })


def bench_part(bound, metric, args, out, name):
    r = interventions.benchmark_ablations(bound, metric, chunk=args.chunk, repeats=args.repeats)
    print(f"benchmark, {r['heads']} single-head ablations of {name}: one program (chunk {r['chunk']}) "
          f"{r['program_s']:.2f} s (first call, with compilation, {r['program_first_s']:.2f} s); loop of one jitted "
          f"forward {r['loop_s']:.2f} s (first {r['loop_first_s']:.2f} s); ratio {r['ratio']:.2f}x "
          f"(with compilation {r['ratio_first']:.2f}x); max |difference| {r['max_difference']:.2g}")
    write_json(out / "bench.json", {"model": name, **r})


def bound_part(module, params, config, tok, name, out):
    ids, _ = interventions.encode_with_offsets(tok, BIG)
    summary = interventions.bound_summary(interventions.entropy_bounds(module, params, config, ids))
    text = interventions.render_bound(summary, name=name)
    print(text)
    write_json(out / "bound.json", {"model": name, "sentence": BIG, **summary})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), minilm, gpt2 or a GPT-2 directory")
    parser.add_argument("--random-gpt2", choices=sorted(gpt2.SIZES), default=None, help="a RANDOM GPT-2 of this size")
    parser.add_argument("--parts", default="effects,bench,bound", help="comma-separated: effects, bench, bound")
    parser.add_argument("--chunk", type=int, default=16, help="interventions run at once in each compiled program")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per way in the benchmark (after one to compile)")
    parser.add_argument("--reference", type=int, default=16, help="Winograd sentences for mean-ablation (0: none)")
    parser.add_argument("--top", type=int, default=10, help="heads per table")
    parser.add_argument("--out", default=None, help="output folder (default lab-output/heads/<model>)")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= {"effects", "bench", "bound"}:
        parser.error(f"--parts: unknown {sorted(parts - {'effects', 'bench', 'bound'})}")
    out = Path(args.out or f"lab-output/heads/{args.random_gpt2 and 'random-gpt2-' + args.random_gpt2 or Path(args.model).name}")
    try:  # before the model loads: nothing wasted, nothing half-written
        prepare_output_folder(out, [name for part in sorted(parts) for name in OUTPUTS[part]], create=False)
    except OutputFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        module, params, config, tok, name = load(args)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        print("(offline: --model smollm2 or --model minilm run on bundled weights)", file=sys.stderr)
        return 2
    print(f"model: {name} (loaded in {time.perf_counter() - t0:.1f} s)")
    if "bench" in parts:  # first: both ways then compile from nothing
        bound, _, metric, *_ = setup(module, params, config, tok)
        bench_part(bound, metric, args, out, name)
    if "effects" in parts:
        effects_part(module, params, config, tok, name, args, out)
    if "bound" in parts:
        bound_part(module, params, config, tok, name, out)
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} to {out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
