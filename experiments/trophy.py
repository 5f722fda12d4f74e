"""The chapter's lab, parts 3-4: GPT-2's real attention on the trophy sentence, and "too big" vs "too small".

    python experiments/trophy.py                       # the hub's gpt2 (downloaded once, then cached)
    python experiments/trophy.py --model DIR           # any local GPT-2 checkpoint directory
    python experiments/trophy.py --random-gpt2 small   # offline: a RANDOM GPT-2-small, tokenizer trained here

Prints part 3 (ASCII maps) and part 4 (the comparison); writes trophy.json, part3.txt, part4.txt and one
PNG grid (all layers x heads) per sentence into the output folder it names.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jaxattn import gpt2, trophy
from jaxattn._checkpoint import atomic_write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", help="hub id or local checkpoint directory (default: gpt2)")
    parser.add_argument("--random-gpt2", choices=sorted(gpt2.SIZES), default=None,
                        help="run on a RANDOM GPT-2 of this size instead (offline; not a trained model)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random GPT-2 (with --random-gpt2)")
    parser.add_argument("--layer", type=int, default=None, help="part 3's layer (default: the focus head's)")
    parser.add_argument("--head", type=int, default=None, help="part 3's head (default: the focus head)")
    parser.add_argument("--top", type=int, default=5, help="heads shown per ranking")
    parser.add_argument("--out", default="lab-output/trophy", help="output folder")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    if args.random_gpt2:
        params, config, tokenizer = gpt2.random_model(args.random_gpt2, seed=args.seed)
        name = f"random-gpt2-{args.random_gpt2}"
        print(f"NOTE: {name} is a RANDOM, untrained GPT-2-{args.random_gpt2} (seed {args.seed}) with a byte-level "
              f"BPE trained on the lab's sentences: its maps show the machinery, not what GPT-2 learned.")
    else:
        try:
            params, config, tokenizer = gpt2.load(args.model)
        except gpt2.CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            print("(or run offline on a random model: --random-gpt2 small)", file=sys.stderr)
            return 2
        name = str(args.model)
    print(f"model: {name}: {config.n_layer} layers x {config.n_head} heads, d_model={config.n_embd}, "
          f"d_k={config.head_dim} (loaded in {time.perf_counter() - t0:.1f} s)")
    model = gpt2.lab_model(params, config, tokenizer, name=name)

    maps = trophy.sentence_maps(model, trophy.SENTENCES["big"])
    focus = trophy.focus_head(maps, "it", ["trophy", "suitcase"])
    layer = focus[0] if args.layer is None else args.layer
    head = focus[1] if args.head is None else args.head
    part3 = trophy.render_part3(maps, layer, head)
    print(f"\n== Part 3: the trophy sentence's attention (layer {layer}, head {head}; the focus head, whose "
          f"' it' row weighs ' trophy' + ' suitcase' most, is L{focus[0]} H{focus[1]}) ==")
    print(part3)

    comparison = trophy.compare(model)
    part4 = trophy.render_part4(comparison, top=args.top)
    print()
    print(part4)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"model": name, "seed": args.seed if args.random_gpt2 else None,
              "part3": {"layer": layer, "head": head, "focus_head": list(focus)},
              "part4": comparison.to_json()}
    atomic_write(out / "trophy.json", json.dumps(result, indent=1) + "\n")
    atomic_write(out / "part3.txt", part3 + "\n")
    atomic_write(out / "part4.txt", part4 + "\n")
    for key, m in comparison.maps.items():
        atomic_write(out / f"trophy_{key}.png", trophy.png_grid(m))
    print(f"\nwrote trophy.json, part3.txt, part4.txt, trophy_big.png, trophy_small.png to {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
