"""Input validation shared by every public function.

Each check runs on static shapes and dtypes in Python, before anything is traced into XLA, and raises
a ``ValueError`` or ``TypeError`` that names the argument, what was expected and what was received.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def as_float_array(x: Any, name: str) -> jax.Array:
    """``x`` as a JAX array of a floating dtype; ``TypeError`` for integer, boolean or complex input."""
    if x is None:
        raise TypeError(f"{name} must be an array of a floating dtype, received None")
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        x = np.asarray(x)
        dtype = x.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{name} must have a floating dtype (float16, bfloat16, float32 or float64), "
            f"received dtype {np.dtype(dtype).name}"
        )
    return jnp.asarray(x)


def as_bool_array(x: Any, name: str) -> jax.Array:
    """``x`` as a boolean JAX array (a keep-mask: True = attend); ``TypeError`` for any other dtype."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        x = np.asarray(x)
        dtype = x.dtype
    if dtype != np.bool_:
        raise TypeError(
            f"{name} must be a boolean keep-mask (True = attend), received dtype {np.dtype(dtype).name}; "
            f"convert it with {name}.astype(bool) if 1 means attend"
        )
    return jnp.asarray(x)


def check_rank(x: jax.Array, rank: int, name: str, axes: str) -> None:
    """Raise ``ValueError`` unless ``x`` has ``rank`` dimensions, named by ``axes`` (e.g. "[T, H]")."""
    if x.ndim != rank:
        raise ValueError(
            f"{name} must have {rank} dimensions {axes}, received shape {tuple(x.shape)} ({x.ndim} dimensions)"
        )


def check_broadcastable(x: jax.Array | None, target: tuple[int, ...], name: str, axes: str) -> None:
    """Raise ``ValueError`` unless ``x`` broadcasts to ``target`` without growing it."""
    if x is None:
        return
    ok = x.ndim <= len(target)
    if ok:
        try:
            ok = np.broadcast_shapes(tuple(x.shape), target) == tuple(target)
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(
            f"{name} must be broadcastable to {axes} = {tuple(target)}, received shape {tuple(x.shape)}"
        )


def check_scale(scale: Any, head_dim: int) -> Any:
    """The logit scale: ``1/sqrt(head_dim)`` when ``None``; a concrete value must be finite and > 0.

    A traced scale (under ``jit``/``vmap``/``grad`` with respect to it) cannot be inspected and is
    passed through unchecked, so that sweeps over the scale can be one compiled program.
    """
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, jax.core.Tracer):
        if jnp.ndim(scale) != 0:
            raise ValueError(f"scale must be a scalar, received shape {tuple(jnp.shape(scale))}")
        return scale
    if isinstance(scale, bool) or not (np.ndim(scale) == 0 and np.issubdtype(np.asarray(scale).dtype, np.number)):
        raise TypeError(f"scale must be a positive finite scalar or None, received {scale!r}")
    value = float(scale)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"scale must be finite and > 0 (None means 1/sqrt(H)), received {value!r}")
    return scale


def softmax_dtype(dtype: Any) -> Any:
    """The dtype softmax runs in: the input's, but at least float32."""
    return jnp.promote_types(dtype, jnp.float32)
