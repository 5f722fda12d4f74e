"""Layers the bundled models share and the span score of the causal ones (private: each model's forward
names what it uses; the checks of their inputs are in :mod:`jaxattn._inputs`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._checks import check_int
from jaxattn.checkpoint import unflatten

Array = jax.Array


def layer_norm(x: Array, scale: Array, bias: Array, eps: float) -> Array:
    """LayerNorm over the last axis of ``x [..., D]``; ``scale``, ``bias`` are ``[D]``."""
    lead = (1,) * (x.ndim - 1)
    mean = jnp.mean(x, axis=-1, keepdims=True)  # [..., 1]
    var = jnp.var(x, axis=-1, keepdims=True)  # [..., 1]
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale.reshape(lead + scale.shape) + bias.reshape(lead + bias.shape)


def init_from_shapes(seed: int, shapes: dict[str, tuple[int, ...]], *, ones: tuple[str, ...]) -> dict:
    """Random float32 params from ``{"a/b/kernel": shape}``: ``kernel``/``embedding`` leaves ``N(0, 0.02²)``,
    leaves ending in one of ``ones`` (norm scales) 1, the rest (biases) 0; drawn with NumPy, compiling nothing.
    ``seed``: an int >= 0 (``ValueError`` naming it otherwise)."""
    rng = np.random.default_rng(check_int(seed, "seed", 0))
    flat = {}
    for name, shape in shapes.items():
        if name.endswith(("kernel", "embedding")):
            flat[name] = (0.02 * rng.standard_normal(shape, np.float32)).astype(np.float32)
        else:
            flat[name] = np.full(shape, 1.0 if name.endswith(ones) else 0.0, np.float32)
    return unflatten({k: jnp.asarray(v) for k, v in flat.items()})


def embed_ids(table: Array, ids: Array) -> Array:
    """``table[ids]`` (``[V, D]``, ``[T]`` -> ``[T, D]``), with a row of NaN for an id outside ``[0, V)``.

    Eager callers refuse such ids before tracing. Under ``jit``/``vmap`` the ids cannot be inspected, and
    plain indexing would clamp (or, for negative ids, wrap) to another token's row: NaN makes the position,
    and everything that attends to it, visibly wrong instead.
    """
    valid = (ids >= 0) & (ids < table.shape[0])  # [T]
    rows = table[jnp.clip(ids, 0, table.shape[0] - 1)]  # [T, D]
    return jnp.where(valid[:, None], rows, jnp.nan)


# ----------------------------------------------------------------------------------------------------
# What the models compute from their checked inputs (the checks: jaxattn._inputs).
# ----------------------------------------------------------------------------------------------------


def positions(keep: Array) -> Array:
    """Position ids from an attention mask ``[T]``: each real token's index among the real tokens (as
    Hugging Face's ``generate`` does for left padding); padded positions get 0."""
    return jnp.where(keep, jnp.cumsum(keep) - 1, 0).astype(jnp.int32)  # [T]


def span_log_prob(logits: Array, ids: Array, start: Any, end: Any, keep: Array | None = None) -> Array:
    """``Σ_{start <= t < end} log p(ids[t] | the real tokens before t)`` from a causal model's ``logits [T, V]``.

    Token ``t`` is predicted by the logits of the last REAL position before it: without ``keep``, row
    ``t - 1``; with a keep-mask ``keep [T]`` (bool, True = real token), the last ``s < t`` with ``keep[s]``,
    so padding anywhere (left, right, inside) gives the score of the sequence alone and padded positions
    never count. A token with no real token before it (position 0, the first real one) has no prediction
    and never counts. ``start``, ``end`` index the (padded) array and may be traced. Computed in the
    logits' dtype promoted to at least float32 (float64 logits stay float64).

    The one implementation of the span score: the causal models' ``log_prob`` (with the keep-mask of their
    ``attention_mask``) and :func:`jaxattn.interventions.span_log_prob`, its public face, both call it.
    """
    T = ids.shape[0]
    dtype = jnp.promote_types(logits.dtype, jnp.float32)  # at least float32 (float64 stays float64)
    if keep is None:  # every token real: row t - 1 predicts token t
        logp = jax.nn.log_softmax(logits[:-1].astype(dtype), axis=-1)  # [T - 1, V]: predicts ids[1:]
        picked = jnp.take_along_axis(logp, ids[1:, None], axis=-1)[:, 0]  # [T - 1]
        t = jnp.arange(1, T)  # [T - 1], the position each entry scores
        return jnp.sum(jnp.where((t >= start) & (t < end), picked, 0.0))
    t = jnp.arange(T)  # [T]
    last = jax.lax.cummax(jnp.where(keep, t, -1))  # [T], the last real position <= t (-1: none)
    prev = jnp.concatenate([jnp.full((1,), -1, last.dtype), last[:-1]])  # [T], the last real position < t
    logp = jax.nn.log_softmax(logits[jnp.maximum(prev, 0)].astype(dtype), axis=-1)  # [T, V]
    picked = jnp.take_along_axis(logp, ids[:, None], axis=-1)[:, 0]  # [T]
    counted = (t >= start) & (t < end) & keep & (prev >= 0)  # [T]
    return jnp.sum(jnp.where(counted, picked, 0.0))
