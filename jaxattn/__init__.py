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
from jaxattn._blockwise import blockwise_attention, multi_head_blockwise_attention, weights_from_lse
from jaxattn._conformance import check_conformance, conformance_table
from jaxattn._dpa import dot_product_attention
from jaxattn._masks import causal_mask, combine_masks, padding_mask, window_mask
from jaxattn import probes  # jaxattn.probes.entropy, ... (saturation and gradient probes)
from jaxattn._ring import ring_attention, ring_attention_shard, sharded_attention

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_layer",
    "attention_logits",
    "attention_weights",
    "blockwise_attention",
    "causal_mask",
    "check_conformance",
    "combine_masks",
    "conformance_table",
    "dot_product_attention",
    "init_attention_params",
    "merge_heads",
    "multi_head_attention",
    "multi_head_blockwise_attention",
    "padding_mask",
    "probes",
    "ring_attention",
    "ring_attention_shard",
    "sharded_attention",
    "split_heads",
    "weights_from_lse",
    "window_mask",
]
