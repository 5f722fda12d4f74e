"""The checks of a model's inputs, one definition each, for every entry point that takes them.

The bundled models' ``forward``, ``log_prob``, ``generate``, ``resume`` and ``attention_input`` (through
:mod:`jaxattn.decoder` for the causal families, :mod:`jaxattn.bert` for the encoder) and
:func:`jaxattn.interventions.bind` check token ids, masks, head masks, spans, sampling arguments, layers
and residual streams here. Each check reads static shapes and dtypes in Python, and values only when
they are concrete (a traced value cannot be inspected and is passed through, or refused where it must
be concrete); it raises a ``ValueError`` or ``TypeError`` that names the argument, what was expected and
what was received.

Axis alphabet: B sequences of a batch, T tokens, D width, L layers, N heads.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._checks import _as_numpy, as_key
from jaxattn._nn import positions

Array = jax.Array


# ----------------------------------------------------------------------------------------------------
# One sequence: token ids, its attention mask, the head mask.
# ----------------------------------------------------------------------------------------------------


def check_id_values(x: Any, name: str, low: int, high: int, high_name: str = "vocab_size") -> None:
    """``ValueError`` unless every value of concrete ids ``x`` (any shape) lies in ``[low, high)``; traced
    ids cannot be read and pass."""
    if isinstance(x, jax.core.Tracer) or np.size(x) == 0:
        return
    values = np.asarray(x)
    lo, hi = int(values.min()), int(values.max())  # Python ints: no wrap of a large uint64
    if lo < low or hi >= high:
        raise ValueError(f"{name} must lie in [{low}, {high_name}={high}), received values in [{lo}, {hi}]")


def check_mask_values(mask: Any, name: str = "attention_mask", *, need_real: bool = False) -> None:
    """``ValueError`` unless a concrete mask (``[T]`` or ``[B, T]``) holds only 0 and 1 and, with
    ``need_real``, marks a real token in every sequence; a traced one cannot be read and passes."""
    if mask is None or isinstance(mask, jax.core.Tracer):
        return
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        values = np.unique(m)
        if not np.all(np.isin(values, (0, 1))):
            raise ValueError(f"{name} must hold only 0 and 1, received values {values.tolist()}")
    empty = ~np.any(m != 0, axis=-1)
    if need_real and np.any(empty):
        where = f"all {m.shape[-1]} entries are 0" if m.ndim == 1 else f"sequence(s) {np.flatnonzero(empty).tolist()}"
        raise ValueError(f"{name} marks no real token ({where}): there is nothing to run the model on")


def _sequence(x: Any, name: str) -> np.ndarray:
    """``x``, a Python sequence (no dtype), as NumPy; an empty one as int32, so that its shape is what gets
    checked (``np.asarray([])`` is float64, which the dtype checks would refuse first)."""
    a = _as_numpy(x, name)
    return a.astype(np.int32) if a.size == 0 and a.dtype == np.float64 else a


def token_ids(x: Any, name: str, *, low: int, high: int, length: int | None = None, max_length: int | None = None,
              high_name: str = "vocab_size", max_name: str = "n_positions") -> Array:
    """``x`` as int32 ``[T]``; values checked against ``[low, high)`` when concrete (traced ids cannot be).

    ``high_name`` and ``max_name`` name the config fields behind ``high`` and ``max_length`` in messages.
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        x = _sequence(x, name)
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
    check_id_values(x, name, low, high, high_name)
    if not isinstance(x, (jax.Array, jax.core.Tracer)):  # converted on the host: no program per new shape
        return jax.device_put(np.asarray(x).astype(np.int32))
    return jnp.asarray(x).astype(jnp.int32)


def family_ids(family: Any, config: Any, x: Any, name: str = "input_ids") -> Array:
    """:func:`token_ids` of a decoder family's model: ``[0, vocab)`` and ``1 <= T <= max_length`` from
    ``family.sizes(config)``, the longest input named by ``family.max_name``."""
    s = family.sizes(config)
    return token_ids(x, name, low=0, high=s.vocab, max_length=s.max_length, max_name=family.max_name)


def attention_mask(mask: Any, T: int) -> Array:
    """The tokenizer's mask ``[T]`` (1/True = real token, 0/False = padding) as bool; ``None``: all real."""
    if mask is None:
        return jax.device_put(np.ones((T,), bool))  # made on the host: no program per new T
    dtype = getattr(mask, "dtype", None)
    if dtype is None:
        mask = _sequence(mask, "attention_mask")
        dtype = mask.dtype
    if not (jnp.issubdtype(dtype, jnp.integer) or dtype == np.bool_):
        raise TypeError(f"attention_mask must have an integer or boolean dtype (1 = token, 0 = padding), received dtype {np.dtype(dtype).name}")
    if tuple(jnp.shape(mask)) != (T,):
        raise ValueError(f"attention_mask must have shape [T] = ({T},), like input_ids, received shape {tuple(jnp.shape(mask))}")
    check_mask_values(mask)
    if not isinstance(mask, (jax.Array, jax.core.Tracer)):
        return jax.device_put(np.asarray(mask) != 0)
    if dtype == np.bool_:  # already the keep-mask: no program to compare it
        return mask
    return jnp.asarray(mask) != 0


def keep_mask(mask: Any, T: int, *, name: str = "attention_mask") -> Array:
    """:func:`attention_mask` as the keep-mask ``[T]`` of a causal model; a concrete mask must mark at least
    one real token (there is nothing to run the model on otherwise)."""
    keep = attention_mask(mask, T)
    check_mask_values(mask if mask is None else keep, name, need_real=True)
    return keep


def head_mask(mask: Any, L: int, N: int) -> Array:
    """``head_mask [L, N]`` as float32 (any float: 0 ablates a head, 1 keeps it); ``None``: all ones."""
    if mask is None:
        return jax.device_put(np.ones((L, N), np.float32))
    dtype = getattr(mask, "dtype", None)
    if dtype is None:
        mask = _as_numpy(mask, "head_mask")
        dtype = mask.dtype
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer) or dtype == np.bool_):
        raise TypeError(f"head_mask must be a real array [L, N], received dtype {np.dtype(dtype).name}")
    if tuple(jnp.shape(mask)) != (L, N):
        raise ValueError(f"head_mask must have shape [L, N] = ({L}, {N}) (layers, heads), received shape {tuple(jnp.shape(mask))}")
    return jnp.asarray(mask, jnp.float32) if not jnp.issubdtype(dtype, jnp.floating) else jnp.asarray(mask)


# ----------------------------------------------------------------------------------------------------
# A batch of sequences, as interventions.bind and the head scores take them: [T] or [B, T].
# ----------------------------------------------------------------------------------------------------


def float32(x: Any) -> Any:
    """A scalar ``x`` as float32 for a compiled program's argument: a NumPy scalar when it is a Python or
    NumPy number (nothing compiled), cast with ``jnp`` when it is a JAX array or a tracer."""
    if isinstance(x, (jax.Array, jax.core.Tracer)):
        return jnp.asarray(x, jnp.float32)
    return np.float32(x)


def _as_array(x: Any, name: str) -> Any:
    """``x`` as it is when it is a JAX array (concrete or traced: ``bind`` under ``jax.vmap``/``jax.jit``
    over prompts), else as a NumPy array; only its dtype and shape are read here."""
    return x if isinstance(x, (jax.Array, jax.core.Tracer)) else _sequence(x, name)


def batch_ids(x: Any, name: str) -> Any:
    """Token ids ``[T]`` or ``[B, T]`` with ``T >= 1``, as int32 (a NumPy array stays one, a JAX array, traced
    or not, stays one); dtype and shape checked, values left to the model's forward."""
    a = _as_array(x, name)
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be integer token ids [T] or [B, T], received dtype {np.dtype(a.dtype).name}")
    if a.ndim not in (1, 2) or a.shape[-1] == 0:
        raise ValueError(f"{name} must have shape [T] or [B, T] with T >= 1, received shape {tuple(a.shape)}")
    return a.astype(np.int32) if isinstance(a, np.ndarray) else a.astype(jnp.int32)


def batch_mask(mask: Any, shape: tuple[int, ...], *, like: str = "input_ids") -> Any:
    """The attention mask of token ids ``like`` of ``shape`` (``[T]`` or ``[B, T]``; 1/True = token) as bool,
    NumPy or JAX as given; ``None``: all real (NumPy). Dtype and shape checked, values left to the forward."""
    if mask is None:
        return np.ones(shape, bool)
    mask = _as_array(mask, "attention_mask")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask must have the shape of {like} {tuple(shape)}, received {tuple(mask.shape)}")
    if not (mask.dtype == np.bool_ or np.issubdtype(mask.dtype, np.integer)):
        raise TypeError(f"attention_mask must be integer or boolean (1 = token), received dtype "
                        f"{np.dtype(mask.dtype).name}")
    return mask != 0


# ----------------------------------------------------------------------------------------------------
# What a causal model's log_prob and generate take besides the ids: a span, the sampling arguments.
# ----------------------------------------------------------------------------------------------------


def check_span(start: Any, end: Any, T: int) -> Any:
    """``end`` (``None``: ``T``) once ``start``/``end`` are ints (or traced) with ``0 <= start <= end <= T``."""
    end = T if end is None else end
    for name, value in (("start", start), ("end", end)):
        dtype = value.dtype if isinstance(value, jax.core.Tracer) else np.asarray(value).dtype
        if isinstance(value, bool) or not np.issubdtype(dtype, np.integer):
            raise TypeError(f"{name} must be an int, received {value!r}")
        if np.ndim(value) != 0:
            raise ValueError(f"{name} must be a scalar (vmap over spans for several), received shape {np.shape(value)}")
    if not isinstance(start, jax.core.Tracer) and not isinstance(end, jax.core.Tracer) and not 0 <= int(start) <= int(end) <= T:
        raise ValueError(f"the span must satisfy 0 <= start <= end <= T={T}, received start={start!r}, end={end!r}")
    return end


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


# ----------------------------------------------------------------------------------------------------
# Layers and residual streams: attention_input, unembed and resume.
# ----------------------------------------------------------------------------------------------------


def check_layer(layer: Any, layers: int, name: str = "layer") -> int:
    """``layer`` as a Python int in ``[0, layers)``: ``TypeError`` for anything but an int (bools and traced
    values included: it picks a block's params), ``ValueError`` naming ``name`` and the range otherwise."""
    if isinstance(layer, jax.core.Tracer):
        raise TypeError(f"{name} must be a Python int (it picks a block's params), received a traced value")
    if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"{name} must be an int in [0, L) = [0, {layers}), received {layer!r}")
    if not 0 <= int(layer) < layers:
        raise ValueError(f"{name} must lie in [0, L) = [0, {layers}) (the model has {layers} layers), "
                         f"received {int(layer)}")
    return int(layer)


def layer_index(layer: Any, L: int) -> Array:
    """``layer`` as an int32 scalar, the block :func:`jaxattn.decoder.resume` starts at: a traced int scalar is
    accepted (the loop's start; it clamps it), a concrete one must lie in ``[0, L)``. Unlike
    :func:`check_layer` (a layer that picks params, which must be concrete)."""
    if isinstance(layer, jax.core.Tracer):
        if jnp.ndim(layer) != 0 or not jnp.issubdtype(layer.dtype, jnp.integer):
            raise TypeError(f"layer must be an int scalar, received a traced {layer.dtype} of shape {layer.shape}")
        return layer.astype(jnp.int32)
    a = np.asarray(layer)
    if isinstance(layer, bool) or a.ndim != 0 or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"layer must be an int (the block the stream enters), received {layer!r}")
    if not 0 <= int(a) < L:
        raise ValueError(f"layer must lie in [0, L) = [0, {L}), received {int(a)}")
    return jnp.asarray(int(a), jnp.int32)


def check_last_axis(x: Any, size: int, name: str = "x", axes: str = "[..., D]") -> Any:
    """``x`` (an array of a floating dtype, or something NumPy makes one of) whose last axis has ``size``
    entries, the ``D`` of ``axes``: ``TypeError`` for another dtype, ``ValueError`` naming ``name`` and the
    expected and received shapes otherwise. Reads the shape and dtype only, so traced ``x`` passes."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        x = _as_numpy(x, name)
        dtype = x.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a float array {axes}, received dtype {np.dtype(dtype).name}")
    shape = tuple(jnp.shape(x))
    if not shape or shape[-1] != size:
        want = axes.replace("D]", f"{size}]")
        raise ValueError(f"{name} must have shape {axes} = {want} (D = {size}, the model width), "
                         f"received shape {shape}")
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


def stream(x: Any, D: int) -> Array:
    """``resid_pre``, the residual stream ``[T, D]`` entering a block (:func:`jaxattn.decoder.resume`): a float
    array with ``T >= 1`` rows of the model's width."""
    dtype = getattr(x, "dtype", None) or np.asarray(x).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"resid_pre must be a float array [T, D] (the stream entering a block), received dtype "
                        f"{np.dtype(dtype).name}")
    shape = tuple(jnp.shape(x))
    if len(shape) != 2 or shape[1] != D or shape[0] < 1:
        raise ValueError(f"resid_pre must have shape [T, D] with D = {D} and T >= 1 (batch with jax.vmap), "
                         f"received shape {shape}")
    return jnp.asarray(x)


def stream_dtype(family: Any, config: Any, params: Any, x: Array) -> None:
    """``resid_pre``'s dtype must be the residual stream's in the forward, the embedding's (the params'):
    the loop over the layers carries the stream in one dtype. Shapes and dtypes only (traced params pass)."""
    one = jnp.zeros((1,), jnp.int32)
    want = jax.eval_shape(lambda p: family.embed(p, config, one, one), params).dtype
    if x.dtype != want:
        raise TypeError(f"resid_pre must have the dtype of the residual stream the forward carries, {want.name} "
                        f"(the params' dtype), received dtype {x.dtype.name}; cast it with "
                        f"resid_pre.astype(jnp.{want.name}) or the params to {x.dtype.name}")


def packed_keep(mask: Any, pos: Any, T: int, max_length: int, max_name: str) -> tuple[Array, Array]:
    """``(keep [T] or [T, T], positions [T])`` of :func:`jaxattn.decoder.resume`: a ``[T]`` mask gives the
    positions of the forward; a ``[T, T]`` one (packed sequences) needs them given."""
    if mask is not None and jnp.ndim(mask) == 2:
        if tuple(jnp.shape(mask)) != (T, T):
            raise ValueError(f"attention_mask must have shape [T] = ({T},) or [T, T] = ({T}, {T}) (each query's keys), "
                             f"received shape {tuple(jnp.shape(mask))}")
        dtype = getattr(mask, "dtype", None) or np.asarray(mask).dtype
        if dtype != np.bool_:
            raise TypeError(f"attention_mask [T, T] must be boolean (True = the query sees the key), received dtype "
                            f"{np.dtype(dtype).name}")
        if pos is None:
            raise ValueError("positions must be given with a [T, T] attention_mask (packed sequences: each token's "
                             "position in its own sequence)")
        pos_dtype = getattr(pos, "dtype", None) or np.asarray(pos).dtype
        if tuple(jnp.shape(pos)) != (T,) or not jnp.issubdtype(pos_dtype, jnp.integer):
            raise ValueError(f"positions must be integer [T] = ({T},), received dtype {np.dtype(pos_dtype).name} "
                             f"shape {tuple(jnp.shape(pos))}")
        if not isinstance(pos, jax.core.Tracer):
            a = np.asarray(pos)
            outside = np.flatnonzero((a < 0) | (a >= max_length))
            if outside.size:
                row = int(outside[0])
                raise ValueError(f"positions must lie in [0, {max_name}) = [0, {max_length}), received {int(a[row])} "
                                 f"at row {row}")
        return jnp.asarray(mask), jnp.asarray(pos).astype(jnp.int32)
    if T > max_length:
        raise ValueError(f"resid_pre must hold 1 to {max_name}={max_length} tokens, received T={T}")
    if pos is not None:
        raise ValueError("positions are given only with a [T, T] attention_mask (packed sequences); a [T] mask "
                         "makes them from the real tokens")
    keep = keep_mask(mask, T)
    return keep, positions(keep)
