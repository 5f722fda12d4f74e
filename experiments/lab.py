"""The chapter's lab, part 1 (a small demo for now): the attention map in numbers, rows summing to 1."""

import argparse

import numpy as np

import jaxattn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    T, H = 4, 8
    q, k, v = (rng.standard_normal((T, H)).astype(np.float32) for _ in range(3))
    out, weights = jaxattn.attention(q, k, v)
    weights = np.asarray(weights)
    np.set_printoptions(precision=3, suppress=True)
    print(f"seed {args.seed}; T={T} tokens, d_k={H}")
    print("attention map A = softmax(Q Kᵀ / √d_k):")
    print(weights)
    sums = weights.sum(axis=-1)
    print("row sums:", " ".join(f"{s:.3f}" for s in sums))
    ok = np.allclose(sums, 1.0, atol=1e-6)
    print("every row sums to 1 within 1e-6:", "yes" if ok else "NO")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
