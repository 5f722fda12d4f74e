"""jaxattn: scaled dot-product attention as pure JAX functions, with probes that measure it.

Axis alphabet (every docstring and einsum): T queries, S keys, N query heads, K key/value heads,
G = N // K, H query/key head dim (d_k), V value head dim (d_v), D model width.
"""

from jaxattn._attention import (
    attention,
    attention_layer,
    attention_logits,
    attention_weights,
    init_attention_params,
    merge_heads,
    multi_head_attention,
    split_heads,
)
from jaxattn._masks import causal_mask, combine_masks, padding_mask
from jaxattn import probes  # jaxattn.probes.entropy, ... (saturation and gradient probes)

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_layer",
    "attention_logits",
    "attention_weights",
    "causal_mask",
    "combine_masks",
    "init_attention_params",
    "merge_heads",
    "multi_head_attention",
    "padding_mask",
    "probes",
    "split_heads",
]
