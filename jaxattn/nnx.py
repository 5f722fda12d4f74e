"""A thin Flax NNX module over :func:`jaxattn.attention_layer`, for people who live in Flax.

It holds the parameters and nothing else: the computation is the same pure function, so maps and outputs
match the functional API exactly.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxattn._attention import attention_layer, init_attention_params
from jaxattn._extras import require

require("nnx", "jaxattn.nnx", "flax")

from flax import nnx  # noqa: E402  (after the check, so a missing flax names the extra)

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nnx.Module):
    """Multi-head (grouped-query when ``num_kv_heads < num_heads``) attention as an NNX module.

    ``__call__(h [T, D], ...)`` returns ``(out [T, D], weights [N, T, S])``; batch with ``nnx.vmap`` or
    ``jax.vmap`` over :meth:`params` and :func:`jaxattn.attention_layer`.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        use_bias: bool = False,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        params = init_attention_params(
            rngs.params(), d_model, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            use_bias=use_bias, dtype=dtype,
        )
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.names = tuple(sorted(params))
        for name, value in params.items():
            setattr(self, name, nnx.Param(value))

    def params(self) -> dict:
        """The parameters as the plain dict :func:`jaxattn.attention_layer` takes."""
        return {name: getattr(self, name)[...] for name in self.names}

    def __call__(self, h, *, context=None, mask=None, bias=None, scale=None, is_causal: bool = False):
        return attention_layer(
            self.params(), h, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, context=context,
            mask=mask, bias=bias, scale=scale, is_causal=is_causal,
        )
