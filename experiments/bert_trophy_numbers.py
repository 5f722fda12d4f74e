"""The trophy pair through the real all-MiniLM-L6-v2 (bidirectional): numbers for lab part 4.

Prints, per layer and head: the max absolute change of the " it" row between "...too big." and
"...too small." (an encoder's " it" sees the adjective, so it may change), the " it" row's
trophy-minus-suitcase preference and how much it flips, and the mean attention entropy with the
trained scale 1/sqrt(d_k) against scale=1.0. Writes no files. Deterministic: no random numbers.
"""

import argparse

import numpy as np

from jaxattn import bert

SENTENCES = (
    "The trophy didn't fit in the suitcase because it was too big.",
    "The trophy didn't fit in the suitcase because it was too small.",
)


def table(title: str, values: np.ndarray, fmt: str) -> None:
    L, N = values.shape
    print(title)
    print("layer " + " ".join(f"{f'h{n}':>6}" for n in range(N)))
    for layer in range(L):
        print(f"{layer:>5} " + " ".join(format(v, fmt).rjust(6) for v in values[layer]))


def entropy(weights: np.ndarray) -> np.ndarray:
    """Mean over query rows of ``-sum_s A log A`` (nats): ``[L, N, T, T] -> [L, N]``."""
    w = weights.astype(np.float64)
    logw = np.log(np.where(w > 0, w, 1.0))
    return -(w * logw).sum(axis=-1).mean(axis=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--path", default=None, help="checkpoint directory (default: bundled all-MiniLM-L6-v2)")
    args = parser.parse_args()
    params, config, tokenizer = bert.load(args.path)
    print("seed: none (deterministic forward passes, no random numbers)")
    print(f"model: {args.path or bert.bundled_model_dir()}  L={config.num_hidden_layers} N={config.num_attention_heads} "
          f"d_k={config.head_dim}")

    ids = [bert.tokenize(tokenizer, s)["input_ids"][0] for s in SENTENCES]
    if ids[0].shape != ids[1].shape or int((ids[0] != ids[1]).sum()) != 1:
        raise SystemExit("the two sentences must tokenize to the same length and differ in one token")
    tokens = [tokenizer.id_to_token(int(i)) for i in ids[0]]
    print("tokens:", " ".join(f"{t}({i})" for i, t in enumerate(tokens)))
    it, trophy, suitcase = (tokens.index(w) for w in ("it", "trophy", "suitcase"))
    adj = int(np.flatnonzero(ids[0] != ids[1])[0])

    runs = {(s, scale): np.asarray(bert.forward(params, config, x, scale=scale).attentions)
            for s, x in enumerate(ids) for scale in (None, 1.0)}  # [L, N, T, T] each
    big, small = runs[(0, None)], runs[(1, None)]

    change = np.abs(big[:, :, it, :] - small[:, :, it, :]).max(axis=-1)  # [L, N]
    table(f'\nmax |A_big - A_small| over the " it" row (query {it}), per layer/head:', change, ".4f")
    l_max, h_max = (int(i) for i in np.unravel_index(change.argmax(), change.shape))
    print(f"overall max {change.max():.4f} at layer {l_max} head {h_max}; "
          f'" it" -> adjective weight, mean over heads: big {big[:, :, it, adj].mean():.4f}, '
          f"small {small[:, :, it, adj].mean():.4f}")

    pref_big = big[:, :, it, trophy] - big[:, :, it, suitcase]  # [L, N]
    pref_small = small[:, :, it, trophy] - small[:, :, it, suitcase]  # [L, N]
    flip = pref_big - pref_small  # > 0: " it" leans more to trophy with "big" (the right resolution)
    table('\n" it" row: (A[trophy] - A[suitcase]) with big minus with small, per layer/head:', flip, "+.3f")
    order = np.argsort(-np.abs(flip), axis=None)[:5]
    print("heads with the largest flip:", ", ".join(
        f"L{l}H{h} {flip[l, h]:+.3f} (big {pref_big[l, h]:+.3f}, small {pref_small[l, h]:+.3f})"
        for l, h in (np.unravel_index(o, flip.shape) for o in order)))
    print(f"heads whose flip has the right sign (more trophy with big): {(flip > 0).sum()} of {flip.size}")

    T = len(tokens)
    for s, name in enumerate(("big", "small")):
        default, unscaled = entropy(runs[(s, None)]), entropy(runs[(s, 1.0)])
        print(f"\n{name}: mean attention entropy (nats; uniform over T={T} is {np.log(T):.3f}): "
              f"scale=1/sqrt({config.head_dim}) {default.mean():.3f}, scale=1.0 {unscaled.mean():.3f}")
        print("per layer (mean over heads), default -> scale=1.0: " + ", ".join(
            f"L{l} {default[l].mean():.3f}->{unscaled[l].mean():.3f}" for l in range(config.num_hidden_layers)))
        if s == 0:
            table("per head, scale=1/sqrt(d_k):", default, ".3f")
            table("per head, scale=1.0:", unscaled, ".3f")
            print(f"heads whose entropy fell: {(unscaled < default).sum()} of {default.size}; "
                  f"mean max weight per row: {runs[(s, None)].max(-1).mean():.3f} -> {runs[(s, 1.0)].max(-1).mean():.3f}")


if __name__ == "__main__":
    main()
