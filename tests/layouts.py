"""The per-layer layout of Hugging Face's Flax models, from jaxattn's stacked one, for the tests' references."""

from __future__ import annotations


def per_layer_shapes(shapes: dict[str, tuple[int, ...]], prefix: str) -> dict[str, tuple[int, ...]]:
    """``{f"{prefix}/{i}/{name}": shape}`` from stacked ``{f"{prefix}/{name}": (L, *shape)}``, in Hugging Face's
    order: the weights before the blocks, then block 0's weights, block 1's..., then the rest."""
    head = prefix + "/"
    keys = list(shapes)
    first = next(i for i, k in enumerate(keys) if k.startswith(head))
    stacked = [k for k in keys if k.startswith(head)]
    L = shapes[stacked[0]][0]
    out = {k: shapes[k] for k in keys[:first]}
    for i in range(L):
        out.update({f"{head}{i}/{k[len(head):]}": shapes[k][1:] for k in stacked})
    out.update({k: shapes[k] for k in keys[first:] if not k.startswith(head)})
    return out
