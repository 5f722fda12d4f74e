"""Input validation shared by every public function, and the checked inputs of attention itself.

Each check runs on static shapes and dtypes in Python, before anything is traced into XLA, and raises
a ``ValueError`` or ``TypeError`` that names the argument, what was expected and what was received.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _as_numpy(x: Any, name: str) -> np.ndarray:
    """``np.asarray(x)``, with the argument's name in the error for input NumPy cannot make an array of."""
    try:
        return np.asarray(x)
    except (ValueError, TypeError) as e:
        raise TypeError(f"{name} must be an array (rectangular: every row the same length), received {type(x).__name__}: {e}") from None


def as_float_array(x: Any, name: str) -> jax.Array:
    """``x`` as a JAX array of a floating dtype; ``TypeError`` for integer, boolean or complex input."""
    if x is None:
        raise TypeError(f"{name} must be an array of a floating dtype, received None")
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        x = _as_numpy(x, name)
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
        x = _as_numpy(x, name)
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


def check_scale(scale: Any, head_dim: int, dtype: Any = jnp.float32) -> Any:
    """The logit scale: ``1/sqrt(head_dim)`` when ``None``; a concrete value must be real, finite and > 0
    in the dtype the logits are computed in, ``softmax_dtype(dtype)`` (so ``1e300`` is refused for float32
    inputs, where it would be ``inf``, and ``1e-300``, where it would be 0).

    A traced scale (under ``jit``/``vmap``/``grad`` with respect to it) cannot be inspected and is
    passed through unchecked, so that sweeps over the scale can be one compiled program.
    """
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, jax.core.Tracer):
        if jnp.ndim(scale) != 0:
            raise ValueError(f"scale must be a scalar, received shape {tuple(jnp.shape(scale))}")
        return scale
    kind = np.asarray(scale).dtype if np.ndim(scale) == 0 else None
    if isinstance(scale, bool) or kind is None or not (np.issubdtype(kind, np.floating) or np.issubdtype(kind, np.integer)):
        raise TypeError(f"scale must be a real, positive, finite scalar or None, received {scale!r}")
    acc = softmax_dtype(dtype)
    with np.errstate(over="ignore", under="ignore"):
        used = float(np.asarray(scale, np.float64).astype(acc))  # the value the logits are scaled by
    if not math.isfinite(used) or used <= 0.0:
        raise ValueError(
            f"scale must be finite and > 0 in {np.dtype(acc).name}, the dtype the logits are computed in "
            f"(None means 1/sqrt(H)), received {scale!r}, which is {used!r} there"
        )
    return scale


def softmax_dtype(dtype: Any) -> Any:
    """The dtype softmax runs in: the input's, but at least float32."""
    return jnp.promote_types(dtype, jnp.float32)


def check_int(value: Any, name: str, minimum: int = 1, *, what: str = "") -> int:
    """``value`` as a Python int ``>= minimum``; ``ValueError`` naming ``name`` otherwise (bools refused).

    ``what`` says what the number counts (e.g. "rows per tile") and is added to the message.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        bound = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        detail = f" ({what})" if what else ""
        raise ValueError(f"{name} must be {bound}{detail}, received {value!r}")
    return int(value)


def check_positive_float32(value: Any, name: str) -> float:
    """``value`` as a Python float that is finite and > 0 in float32, the dtype config constants such as a
    norm's epsilon or RoPE's base are computed in (``1e300`` would be inf there, ``1e-50`` zero); Python
    and NumPy numbers are accepted, bools are not (``ValueError`` naming ``name``)."""
    f32 = np.finfo(np.float32)
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.floating, np.integer))
            or not np.isfinite(value) or not float(f32.smallest_subnormal) <= value <= float(f32.max)):
        raise ValueError(f"{name} must be a finite number > 0 in float32, received {value!r}")
    return float(value)


def as_key(key: Any, name: str = "key") -> jax.Array:
    """A ``jax.random`` key from a key (new-style or raw ``uint32[2]``) or an int seed."""
    if isinstance(key, bool):
        raise TypeError(f"{name} must be a jax.random key or an int seed, received {key!r}")
    if isinstance(key, (int, np.integer)):
        if not -2**63 <= int(key) < 2**63:
            raise ValueError(f"{name} as an int seed must fit in 64 bits, received {key!r}")
        return jax.random.key(int(key))
    try:
        key = jnp.asarray(key)
    except TypeError:
        raise TypeError(f"{name} must be a jax.random key or an int seed, received {key!r}") from None
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if not ((typed and key.shape == ()) or (key.dtype == jnp.uint32 and key.shape == (2,))):
        raise TypeError(
            f"{name} must be ONE jax.random key (a key array of shape () or a raw uint32[2]) or an int seed, "
            f"received an array of dtype {key.dtype} and shape {tuple(key.shape)}"
        )
    return key


def check_float_dtype(dtype: Any, name: str = "dtype") -> Any:
    """``dtype`` as a floating ``numpy.dtype``; float64 needs 64-bit JAX."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating dtype, received {dtype.name}")
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError(f"{name} float64 needs 64-bit JAX: run inside `with jax.enable_x64(True):`")
    return dtype


def as_float_dtype(dtype: Any, name: str = "dtype") -> Any:
    """``dtype`` as a floating ``numpy.dtype`` (:func:`check_float_dtype`), with a ``TypeError`` naming
    ``name`` and what is accepted for anything NumPy does not know as a dtype (``"bogus"``, ``3``)."""
    try:
        jnp.dtype(dtype)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a floating dtype (jnp.float32, jnp.bfloat16, jnp.float16, or jnp.float64 "
                        f"under jax.enable_x64; their names as strings too), received {dtype!r}") from None
    return check_float_dtype(dtype, name)


def check_depth(params: Any, path: tuple[str, ...], layers: int, *, field: str, layout: str) -> None:
    """``params`` holds exactly ``layers`` blocks under ``path`` (a dict of blocks ``{"0": ..., "1": ...}``),
    the config's ``field``; ``ValueError`` naming both counts otherwise. Run before any table of the
    config's layers is made, so a config claiming 10**9 layers is refused without building one."""
    node = params
    for depth, key in enumerate(path):
        if not isinstance(node, Mapping) or key not in node:
            raise ValueError(f"params must hold the blocks under '{'/'.join(path)}' ({layout}); "
                             f"'{'/'.join(path[:depth + 1])}' is missing")
        node = node[key]
    if not isinstance(node, Mapping):
        raise ValueError(f"params '{'/'.join(path)}' must be a dict of blocks {{'0': ..., '1': ...}} ({layout}), "
                         f"received {type(node).__name__}")
    if len(node) != layers:
        raise ValueError(f"config.{field}={layers} but params hold {len(node)} blocks under '{'/'.join(path)}': "
                         f"the config does not describe these params")


def check_flag(value: Any, name: str) -> bool:
    """``value`` as a Python bool; ``TypeError`` otherwise (a string such as ``"no"`` or a traced value).

    Flags such as ``is_causal`` choose which program is built, so they must be concrete: a traced
    value (e.g. an argument of a jitted function) cannot, and is refused with its name.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a Python bool; received a traced value (it chooses the compiled program: "
            f"pass it as a static argument, e.g. jax.jit(f, static_argnames='{name}'))"
        )
    raise TypeError(f"{name} must be a Python bool (True or False), received {value!r} of type {type(value).__name__}")


def check_logit_cap(cap: Any, name: str = "logit_cap") -> Any:
    """``None`` (no cap), or the soft cap ``c`` of ``c · tanh(logits / c)``: a concrete value must be real,
    finite and > 0, and a normal float32 (about 1.2e-38 to 3.4e38: the logits are at least float32, and
    ``logits / c`` with a ``c`` beyond that range is inf or NaN), returned as a float; a traced scalar is
    passed through unchecked (sweeps under jit)."""
    if cap is None:
        return None
    if isinstance(cap, jax.core.Tracer):
        if jnp.ndim(cap) != 0:
            raise ValueError(f"{name} must be a scalar, received shape {tuple(jnp.shape(cap))}")
        return cap
    if isinstance(cap, (bool, np.bool_)) or np.ndim(cap) != 0 or not np.issubdtype(np.asarray(cap).dtype, np.number):
        raise TypeError(f"{name} must be None or a positive real number, received {cap!r}")
    value = float(np.asarray(cap))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0 (the c of c·tanh(logits/c)), received {value!r}")
    check_float32_normal(value, name)
    return value


def check_float32_normal(value: float, name: str) -> None:
    """``ValueError`` naming ``name`` unless ``value > 0`` is a normal float32 (what a divisor of float32
    logits must be: outside it the quotient overflows or the value itself rounds to inf or 0)."""
    info = np.finfo(np.float32)
    if not float(info.tiny) <= value <= float(info.max):
        raise ValueError(f"{name} must lie in float32's normal range [{float(info.tiny):.3g}, {float(info.max):.3g}] "
                         f"(it divides float32 logits), received {value!r}")


# ----------------------------------------------------------------------------------------------------
# The inputs of attention itself (axis alphabet as in jaxattn._attention).
# ----------------------------------------------------------------------------------------------------


def check_attention_inputs(q, k, v, mask, bias, scale, *, broadcast_mask=True, broadcast_bias=True):
    """Checked ``(q, k, v, mask, bias, scale)`` of one head: q ``[T, H]``, k ``[S, H]``, v ``[S, V]`` or None,
    mask and bias broadcastable to ``[T, S]`` (or None), the scale as :func:`check_scale` gives it.

    The bias is broadcast to ``[T, S]`` and so is the mask, unless ``broadcast_bias=False`` or
    ``broadcast_mask=False``, which keep their compact shapes (a key-padding mask ``[S]`` stays ``[S]``).
    """
    q = as_float_array(q, "q")
    k = as_float_array(k, "k")
    check_rank(q, 2, "q", "[T, H]")
    check_rank(k, 2, "k", "[S, H]")
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"q and k must have the same head dimension H: q has shape {tuple(q.shape)} [T, H], "
            f"k has shape {tuple(k.shape)} [S, H]"
        )
    if v is not None:
        v = as_float_array(v, "v")
        check_rank(v, 2, "v", "[S, V]")
        if v.shape[0] != k.shape[0]:
            raise ValueError(
                f"k and v must have the same length S: k has shape {tuple(k.shape)} [S, H], "
                f"v has shape {tuple(v.shape)} [S, V]"
            )
    T, S = q.shape[0], k.shape[0]
    if mask is not None:
        mask = as_bool_array(mask, "mask")
        check_broadcastable(mask, (T, S), "mask", "[T, S]")
        if broadcast_mask:
            mask = jnp.broadcast_to(mask, (T, S))
    if bias is not None:
        bias = as_float_array(bias, "bias")
        check_broadcastable(bias, (T, S), "bias", "[T, S]")
        if broadcast_bias:
            bias = jnp.broadcast_to(bias, (T, S))
    scale = check_scale(scale, q.shape[-1], jnp.result_type(q, k))
    return q, k, v, mask, bias, scale


def check_multi_head_inputs(q, k, v, mask, bias, scale):
    """Checked ``(q, k, v, mask, bias, scale)`` of multi-head (grouped-query) attention: q ``[T, N, H]``,
    k ``[S, K, H]``, v ``[S, K, V]`` with ``N % K == 0``, mask and bias broadcastable to ``[N, T, S]`` (kept
    in their own shapes) or None, the scale as :func:`check_scale` gives it."""
    q = as_float_array(q, "q")
    k = as_float_array(k, "k")
    v = as_float_array(v, "v")
    check_rank(q, 3, "q", "[T, N, H]")
    check_rank(k, 3, "k", "[S, K, H]")
    check_rank(v, 3, "v", "[S, K, V]")
    T, N, H = q.shape
    S, K, Hk = k.shape
    if H != Hk:
        raise ValueError(
            f"q and k must have the same head dimension H: q has shape {tuple(q.shape)} [T, N, H], "
            f"k has shape {tuple(k.shape)} [S, K, H]"
        )
    if v.shape[0] != S or v.shape[1] != K:
        raise ValueError(
            f"v must have shape [S, K, V] = [{S}, {K}, V] to match k {tuple(k.shape)}, "
            f"received {tuple(v.shape)}"
        )
    if K == 0 or N % K != 0:
        raise ValueError(
            f"the number of query heads N must be a multiple of the number of key/value heads K "
            f"(grouped-query attention): q has N={N} heads (shape {tuple(q.shape)}), "
            f"k and v have K={K} (shape {tuple(k.shape)})"
        )
    if mask is not None:
        mask = as_bool_array(mask, "mask")
        check_broadcastable(mask, (N, T, S), "mask", "[N, T, S]")
    if bias is not None:
        bias = as_float_array(bias, "bias")
        check_broadcastable(bias, (N, T, S), "bias", "[N, T, S]")
    scale = check_scale(scale, H, jnp.result_type(q, k))
    return q, k, v, mask, bias, scale
