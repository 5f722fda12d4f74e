"""Layers the bundled models share (private: each model's forward names what it uses)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def layer_norm(x: Array, scale: Array, bias: Array, eps: float) -> Array:
    """LayerNorm over the last axis of ``x [..., D]``; ``scale``, ``bias`` are ``[D]``."""
    lead = (1,) * (x.ndim - 1)
    mean = jnp.mean(x, axis=-1, keepdims=True)  # [..., 1]
    var = jnp.var(x, axis=-1, keepdims=True)  # [..., 1]
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale.reshape(lead + scale.shape) + bias.reshape(lead + bias.shape)
