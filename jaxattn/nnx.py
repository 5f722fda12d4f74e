"""Flax NNX modules over jaxattn's pure functions (imports Flax; ``import jaxattn`` alone does not)."""

from jaxattn._nnx import MultiHeadAttention

__all__ = ["MultiHeadAttention"]
