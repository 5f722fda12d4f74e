"""Layers and input checks the bundled models share (private: each model's forward names what it uses)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._checks import as_key
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
    leaves ending in one of ``ones`` (norm scales) 1, the rest (biases) 0; drawn with NumPy, compiling nothing."""
    rng = np.random.default_rng(seed)
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
# Inputs of a model forward, checked before tracing (concrete values) or passed through (traced ones).
# ----------------------------------------------------------------------------------------------------


def token_ids(x: Any, name: str, *, low: int, high: int, length: int | None = None, max_length: int | None = None,
              high_name: str = "vocab_size", max_name: str = "n_positions") -> Array:
    """``x`` as int32 ``[T]``; values checked against ``[low, high)`` when concrete (traced ids cannot be).

    ``high_name`` and ``max_name`` name the config fields behind ``high`` and ``max_length`` in messages.
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        x = np.asarray(x)
        dtype = x.dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must be integer token ids [T], received dtype {np.dtype(dtype).name}")
    shape = tuple(jnp.shape(x))
    if len(shape) != 1:
        raise ValueError(f"{name} must have 1 dimension [T] (batch with jax.vmap), received shape {shape}")
    if length is not None and shape[0] != length:
        raise ValueError(f"{name} must have shape [T] = ({length},), like input_ids, received shape {shape}")
    if max_length is not None and not 1 <= shape[0] <= max_length:
        raise ValueError(f"{name} must hold 1 to {max_name}={max_length} tokens, received T={shape[0]}")
    if not isinstance(x, jax.core.Tracer) and shape[0] > 0:
        values = np.asarray(x).astype(np.int64)
        if values.min() < low or values.max() >= high:
            raise ValueError(
                f"{name} must lie in [{low}, {high_name}={high}), received values in [{values.min()}, {values.max()}]"
            )
    return jnp.asarray(x).astype(jnp.int32)


def attention_mask(mask: Any, T: int) -> Array:
    """The tokenizer's mask ``[T]`` (1/True = real token, 0/False = padding) as bool; ``None``: all real."""
    if mask is None:
        return jnp.ones((T,), bool)
    dtype = getattr(mask, "dtype", None)
    if dtype is None:
        mask = np.asarray(mask)
        dtype = mask.dtype
    if not (jnp.issubdtype(dtype, jnp.integer) or dtype == np.bool_):
        raise TypeError(f"attention_mask must have an integer or boolean dtype (1 = token, 0 = padding), received dtype {np.dtype(dtype).name}")
    if tuple(jnp.shape(mask)) != (T,):
        raise ValueError(f"attention_mask must have shape [T] = ({T},), like input_ids, received shape {tuple(jnp.shape(mask))}")
    if not isinstance(mask, jax.core.Tracer) and dtype != np.bool_:
        values = np.unique(np.asarray(mask))
        if not np.all(np.isin(values, (0, 1))):
            raise ValueError(f"attention_mask must hold only 0 and 1, received values {values.tolist()}")
    return jnp.asarray(mask) != 0


def head_mask(mask: Any, L: int, N: int) -> Array:
    """``head_mask [L, N]`` as float32 (any float: 0 ablates a head, 1 keeps it); ``None``: all ones."""
    if mask is None:
        return jnp.ones((L, N), jnp.float32)
    dtype = getattr(mask, "dtype", None)
    if dtype is None:
        mask = np.asarray(mask)
        dtype = mask.dtype
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer) or dtype == np.bool_):
        raise TypeError(f"head_mask must be a real array [L, N], received dtype {np.dtype(dtype).name}")
    if tuple(jnp.shape(mask)) != (L, N):
        raise ValueError(f"head_mask must have shape [L, N] = ({L}, {N}) (layers, heads), received shape {tuple(jnp.shape(mask))}")
    return jnp.asarray(mask, jnp.float32) if not jnp.issubdtype(dtype, jnp.floating) else jnp.asarray(mask)


def positions(keep: Array) -> Array:
    """Position ids from an attention mask ``[T]``: each real token's index among the real tokens (as
    Hugging Face's ``generate`` does for left padding); padded positions get 0."""
    return jnp.where(keep, jnp.cumsum(keep) - 1, 0).astype(jnp.int32)  # [T]


# ----------------------------------------------------------------------------------------------------
# What the causal models share around their forward: span scores, sampling arguments, length buckets.
# ----------------------------------------------------------------------------------------------------


def check_span(start: Any, end: Any, T: int) -> Any:
    """``end`` (``None``: ``T``) once ``start``/``end`` are ints (or traced) with ``0 <= start <= end <= T``."""
    end = T if end is None else end
    for name, value in (("start", start), ("end", end)):
        if isinstance(value, bool) or not (isinstance(value, jax.core.Tracer) or np.issubdtype(np.asarray(value).dtype, np.integer)):
            raise TypeError(f"{name} must be an int, received {value!r}")
    if not isinstance(start, jax.core.Tracer) and not isinstance(end, jax.core.Tracer) and not 0 <= int(start) <= int(end) <= T:
        raise ValueError(f"the span must satisfy 0 <= start <= end <= T={T}, received start={start!r}, end={end!r}")
    return end


def span_log_prob(logits: Array, ids: Array, keep: Array, start: Any, end: Any) -> Array:
    """``Σ_{start <= t < end, keep[t]} log p(ids[t] | real tokens before t)`` from ``logits [T, V]`` (float32).

    Token ``t`` is predicted by the logits of the last REAL position before it, so padding anywhere
    (left, right, inside) gives the score of the sequence alone; a real token with no real token before
    it (the first one) has no prediction and never counts. ``start``, ``end`` index the padded array
    and come from :func:`check_span`.
    """
    T = ids.shape[0]
    t = jnp.arange(T)  # [T]
    last = jax.lax.cummax(jnp.where(keep, t, -1))  # [T], the last real position <= t (-1: none)
    prev = jnp.concatenate([jnp.full((1,), -1, last.dtype), last[:-1]])  # [T], the last real position < t
    logp = jax.nn.log_softmax(logits[jnp.maximum(prev, 0)].astype(jnp.float32), axis=-1)  # [T, V]
    picked = jnp.take_along_axis(logp, ids[:, None], axis=-1)[:, 0]  # [T]
    counted = (t >= start) & (t < end) & keep & (prev >= 0)  # [T]
    return jnp.sum(jnp.where(counted, picked, 0.0))


def _real_scalar(x: Any) -> bool:
    """A concrete real number: a Python int or float (not bool), a NumPy scalar or a 0-d array."""
    if isinstance(x, (bool, np.bool_)) or isinstance(x, jax.core.Tracer):
        return False
    dtype = getattr(x, "dtype", None)
    if dtype is not None:
        return np.ndim(x) == 0 and (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
    return isinstance(x, (int, float))


def sampling(temperature: Any, key: Any) -> tuple[bool, Array | None]:
    """``(greedy, key)`` for ``generate``: temperature 0 is greedy (the key, if any, only checked); a finite
    ``> 0`` samples and needs a key.

    Python and NumPy numbers (and 0-d arrays) are accepted alike; a traced temperature samples.
    """
    if not isinstance(temperature, jax.core.Tracer):
        if not _real_scalar(temperature) or not np.isfinite(float(temperature)) or float(temperature) < 0:
            raise ValueError(f"temperature must be 0 (greedy) or a finite number > 0, received {temperature!r}")
        if float(temperature) == 0:  # greedy: a key given is checked, none is made
            return True, None if key is None else as_key(key)
    elif jnp.ndim(temperature) != 0:
        raise ValueError(f"temperature must be a scalar, received shape {tuple(jnp.shape(temperature))}")
    if key is None:
        raise ValueError("sampling (temperature > 0) needs a key: pass key=jax.random.key(seed) or an int seed")
    return False, as_key(key)
