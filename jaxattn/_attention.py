"""Scaled dot-product attention as pure JAX functions.

Axis alphabet, used in every shape annotation, docstring and einsum string of the package:

  T  query length (number of queries)        S  key/value length (number of keys)
  N  query heads                             K  key/value heads (grouped-query: N = K * G)
  G  query heads per key/value head          H  head dimension of queries and keys (the paper's d_k)
  V  head dimension of values (d_v)          D  model width (d_model)

The core, :func:`attention`, works on ONE example and ONE head: q ``[T, H]``, k ``[S, H]``, v ``[S, V]``.
Heads and batches are ``jax.vmap`` of it (:func:`multi_head_attention`, and ``jax.vmap`` over a batch),
so the weights a probe inspects and the output a model uses come from one computation.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxattn._checks import (
    as_bool_array,
    as_float_array,
    as_key,
    check_broadcastable,
    check_int,
    check_rank,
    check_scale,
    softmax_dtype,
)
from jaxattn._masks import causal_mask

Array = jax.Array


# ----------------------------------------------------------------------------------------------------
# The per-example, per-head core (no validation: callers validate first).
# ----------------------------------------------------------------------------------------------------


def _logits(q: Array, k: Array, bias: Array | None, scale: Any) -> Array:
    """``scale * q kᵀ + bias`` in at least float32: ``[T, S]``."""
    acc = softmax_dtype(jnp.result_type(q, k))
    logits = jnp.einsum("TH,SH->TS", q, k, preferred_element_type=acc)  # [T, S]
    logits = logits * jnp.asarray(scale, acc)  # [T, S], the 1/sqrt(d_k) step
    if bias is not None:
        logits = logits + bias.astype(acc)  # [T, S]
    return logits


def _keep(mask: Array | None, is_causal: bool, T: int, S: int) -> Array | None:
    """The effective keep-mask ``[T, S]`` (or ``None``: keep everything)."""
    if is_causal:
        causal = causal_mask(T, S)  # [T, S]
        return causal if mask is None else jnp.logical_and(mask, causal)
    return mask


@jax.custom_jvp
def _masked_softmax(logits: Array, keep: Array | None) -> Array:
    """Numerically stable softmax over the last axis, restricted to ``keep``; ``[T, S]``.

    Masked logits are replaced by the dtype's most negative finite value (not -inf, which would give
    ``-inf - -inf = NaN`` in a fully masked row), so they never win the row maximum; their exponentials
    are then zeroed explicitly. A row with no kept key therefore has zero weights (its sum is 0, and the
    division is guarded), and both the value and its gradient stay finite.

    The derivative is the closed form ``dp = p ⊙ (dl − Σ p ⊙ dl)`` (see :func:`_masked_softmax_jvp`), so
    the backward pass costs what ``jax.nn.softmax``'s does instead of differentiating every step above.
    """
    fill = jnp.finfo(logits.dtype).min
    if keep is not None:
        logits = jnp.where(keep, logits, fill)  # [T, S]
    row_max = jnp.max(logits, axis=-1, keepdims=True, initial=fill)  # [T, 1]
    row_max = jax.lax.stop_gradient(row_max)  # softmax is shift-invariant
    e = jnp.exp(logits - row_max)  # [T, S], every entry in [0, 1]
    if keep is not None:
        e = jnp.where(keep, e, 0.0)  # [T, S]
    total = jnp.sum(e, axis=-1, keepdims=True)  # [T, 1], >= 1 unless the row is fully masked
    return e / jnp.where(total == 0.0, 1.0, total)  # [T, S]


@_masked_softmax.defjvp
def _masked_softmax_jvp(primals, tangents):
    """``dp = p ⊙ (dl − Σ_s p_s dl_s)``: zero at masked keys (p = 0 there) and in fully masked rows."""
    logits, keep = primals
    d_logits = tangents[0]
    p = _masked_softmax(logits, keep)  # [T, S]
    if keep is not None:
        d_logits = jnp.where(keep, d_logits, 0.0)  # a NaN tangent at a masked key must not leak (0·NaN)
    mean = jnp.sum(p * d_logits, axis=-1, keepdims=True)  # [T, 1]
    return p, p * (d_logits - mean)  # [T, S]


def _attend(
    q: Array, k: Array, v: Array, mask: Array | None, bias: Array | None, scale: Any, is_causal: bool
) -> tuple[Array, Array]:
    """One head, one example: ``(out [T, V], weights [T, S])`` from one softmax."""
    T, S = q.shape[0], k.shape[0]
    weights = _masked_softmax(_logits(q, k, bias, scale), _keep(mask, is_causal, T, S))  # [T, S], f32+
    out = jnp.einsum("TS,SV->TV", weights, v.astype(weights.dtype))  # [T, V]
    out_dtype = jnp.result_type(q, k, v)
    return out.astype(out_dtype), weights.astype(jnp.result_type(q, k))


# ----------------------------------------------------------------------------------------------------
# Validation for the single-head API.
# ----------------------------------------------------------------------------------------------------


def _validate_single(q, k, v, mask, bias, scale, *, broadcast_mask=True):
    """Checked arrays for the single-head API; ``broadcast_mask=False`` keeps the mask's compact shape."""
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
        bias = jnp.broadcast_to(bias, (T, S))
    scale = check_scale(scale, q.shape[1])
    return q, k, v, mask, bias, scale


# ----------------------------------------------------------------------------------------------------
# Public single-head API.
# ----------------------------------------------------------------------------------------------------


def attention_logits(q: Any, k: Any, *, bias: Any = None, scale: Any = None) -> Array:
    """The pre-softmax logits ``scale · q kᵀ + bias`` of one head, before any mask.

    These are exactly the logits :func:`attention` and :func:`attention_weights` feed to their softmax
    (the same private function computes them), for probes that study the softmax's input.

    Args:
      q: queries ``[T, H]``.
      k: keys ``[S, H]``.
      bias: optional additive bias broadcastable to ``[T, S]``.
      scale: logit scale; ``None`` means ``1/sqrt(H)`` (see :func:`attention` for why).

    Returns:
      ``[T, S]`` in at least float32.
    """
    q, k, _, _, bias, scale = _validate_single(q, k, None, None, bias, scale)
    return _logits(q, k, bias, scale)


def attention_weights(
    q: Any, k: Any, *, mask: Any = None, bias: Any = None, scale: Any = None, is_causal: bool = False
) -> Array:
    """The attention map ``A = softmax(scale · q kᵀ + bias)`` of one head, restricted to ``mask``.

    Args:
      q: queries ``[T, H]``.
      k: keys ``[S, H]``.
      mask: optional boolean keep-mask (True = attend) broadcastable to ``[T, S]``.
      bias: optional additive bias broadcastable to ``[T, S]``, added after scaling.
      scale: logit scale; ``None`` means ``1/sqrt(H)`` (see :func:`attention` for why).
      is_causal: also apply :func:`causal_mask` ``(T, S)`` (key ``j`` visible to query ``i`` iff ``j <= i``).

    Returns:
      ``[T, S]`` in the dtype of ``q``/``k``; each row sums to 1, or is all zeros if fully masked.
    """
    q, k, _, mask, bias, scale = _validate_single(q, k, None, mask, bias, scale)
    weights = _masked_softmax(_logits(q, k, bias, scale), _keep(mask, is_causal, q.shape[0], k.shape[0]))
    return weights.astype(jnp.result_type(q, k))


def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    scale: Any = None,
    is_causal: bool = False,
) -> tuple[Array, Array]:
    """Scaled dot-product attention of one head: ``softmax(scale · q kᵀ + bias) v``.

    With the paper's names: ``H = d_k``, ``V = d_v``, ``T = S = n`` for self-attention.

    Why the scale exists: if the H components of a query and a key are independent with mean 0 and
    variance 1, their dot product has variance H. Unscaled, the logits grow like ``sqrt(H)``, the softmax
    saturates to a near one-hot row and its gradient vanishes. Multiplying by ``1/sqrt(H)`` restores unit
    variance. ``scale=None`` means ``1/sqrt(H)``; ``scale=1.0`` is the unscaled variant (the same code).

    The softmax runs in at least float32 (bf16/fp16 inputs are promoted, results cast back). The output
    is computed from the same float32 weights that are returned (cast to the input dtype), so the map you
    inspect is the one that produced the output.

    Masking: ``mask`` is a boolean keep-mask (True = attend). A query row whose keys are all masked
    returns zero weights and a zero output, with finite gradients. ``S = 0`` is the same case (zero
    output ``[T, V]``, weights ``[T, 0]``); ``T = 0`` gives empty outputs. NaN or Inf in q, k, v or bias at
    kept positions propagate to the result; nothing is silently replaced.

    Args:
      q: queries ``[T, H]``, floating dtype (NumPy or JAX).
      k: keys ``[S, H]``.
      v: values ``[S, V]``.
      mask: optional boolean keep-mask broadcastable to ``[T, S]``.
      bias: optional additive logit bias broadcastable to ``[T, S]``.
      scale: positive finite logit scale, or ``None`` for ``1/sqrt(H)``. A traced scale is accepted
        (for sweeps under ``jit``/``vmap``) and is not checked.
      is_causal: also apply :func:`causal_mask` ``(T, S)``.

    Returns:
      ``(out, weights)``: ``out [T, V]`` in the promoted dtype of q, k, v; ``weights [T, S]`` in that
      of q, k.
    """
    q, k, v, mask, bias, scale = _validate_single(q, k, v, mask, bias, scale)
    return _attend(q, k, v, mask, bias, scale, is_causal)


# ----------------------------------------------------------------------------------------------------
# Multi-head and grouped-query attention: vmaps of the single-head core.
# ----------------------------------------------------------------------------------------------------


def _per_head(x: Array | None, N: int, K: int) -> tuple[Array | None, int | None]:
    """A mask/bias broadcastable to ``[N, T, S]`` as ``[K, G, t, s]`` (vmapped) or ``[t, s]`` (shared)."""
    if x is None:
        return None, None
    x = x.reshape((1,) * (3 - x.ndim) + tuple(x.shape))  # [n, t, s], n in {1, N}
    if x.shape[0] == 1:
        return x[0], None
    return x.reshape((K, N // K) + tuple(x.shape[1:])), 0


def _validate_multi(q, k, v, mask, bias, scale):
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
    scale = check_scale(scale, H)
    return q, k, v, mask, bias, scale


def multi_head_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    scale: Any = None,
    is_causal: bool = False,
) -> tuple[Array, Array]:
    """Multi-head (and grouped-query) attention of one example: :func:`attention` vmapped over heads.

    Query head ``n`` reads key/value head ``n // G`` where ``G = N // K`` (the convention of
    ``jax.nn.dot_product_attention``); ``K = N`` is ordinary multi-head attention, ``K = 1``
    multi-query attention. For a batch, ``jax.vmap`` this function over a leading axis.

    Args:
      q: queries ``[T, N, H]``.
      k: keys ``[S, K, H]`` with ``N % K == 0``.
      v: values ``[S, K, V]``.
      mask: optional boolean keep-mask broadcastable to ``[N, T, S]`` (e.g. ``[T, S]`` or ``[S]``).
      bias: optional additive logit bias broadcastable to ``[N, T, S]``.
      scale: logit scale, ``None`` for ``1/sqrt(H)``; see :func:`attention` for why it exists.
      is_causal: also apply :func:`causal_mask` ``(T, S)``.

    Returns:
      ``(out [T, N, V], weights [N, T, S])``.
    """
    q, k, v, mask, bias, scale = _validate_multi(q, k, v, mask, bias, scale)
    T, N, H = q.shape
    S, K, V = v.shape
    G = N // K
    qh = q.reshape(T, K, G, H).transpose(1, 2, 0, 3)  # [K, G, T, H]
    kh = k.transpose(1, 0, 2)  # [K, S, H]
    vh = v.transpose(1, 0, 2)  # [K, S, V]
    m, m_axis = _per_head(mask, N, K)
    b, b_axis = _per_head(bias, N, K)

    def one_head(q1, k1, v1, m1, b1):
        if m1 is not None:
            m1 = jnp.broadcast_to(m1, (T, S))
        if b1 is not None:
            b1 = jnp.broadcast_to(b1, (T, S))
        return _attend(q1, k1, v1, m1, b1, scale, is_causal)

    over_group = jax.vmap(one_head, in_axes=(0, None, None, 0 if m_axis == 0 else None, 0 if b_axis == 0 else None))
    over_kv = jax.vmap(over_group, in_axes=(0, 0, 0, m_axis, b_axis))
    out, weights = over_kv(qh, kh, vh, m, b)  # [K, G, T, V], [K, G, T, S]
    out = out.transpose(2, 0, 1, 3).reshape(T, N, V)  # [T, N, V]
    weights = weights.reshape(N, T, S)  # [N, T, S]
    return out, weights


# ----------------------------------------------------------------------------------------------------
# Projections from the model width: a params pytree in, arrays out.
# ----------------------------------------------------------------------------------------------------


def split_heads(x: Any, num_heads: int) -> Array:
    """``[T, N·H] -> [T, N, H]``."""
    x = jnp.asarray(x)
    check_rank(x, 2, "x", "[T, N*H]")
    check_int(num_heads, "num_heads")
    if x.shape[1] % num_heads != 0:
        raise ValueError(
            f"the last axis of x ({x.shape[1]}, shape {tuple(x.shape)}) must be divisible by "
            f"num_heads={num_heads}"
        )
    return x.reshape(x.shape[0], num_heads, x.shape[1] // num_heads)  # [T, N, H]


def merge_heads(x: Any) -> Array:
    """``[T, N, H] -> [T, N·H]`` (the inverse of :func:`split_heads`)."""
    x = jnp.asarray(x)
    check_rank(x, 3, "x", "[T, N, H]")
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2])  # [T, N*H]


def init_attention_params(
    key: Any,
    d_model: int,
    num_heads: int,
    *,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    use_bias: bool = False,
    dtype: Any = jnp.float32,
) -> dict[str, Array]:
    """Random parameters for :func:`attention_layer`.

    ``W_Q [D, N·H]``, ``W_K [D, K·H]``, ``W_V [D, K·H]`` and ``W_O [N·H, D]`` drawn from
    ``N(0, 1/fan_in)``, so projections of unit-variance inputs have unit variance (the regime the
    ``1/sqrt(H)`` scale is designed for); with ``use_bias``, zero ``b_Q, b_K, b_V, b_O``.
    ``head_dim=None`` means ``H = D / N``, which requires ``N`` to divide ``D``.
    """
    check_int(d_model, "d_model")
    check_int(num_heads, "num_heads")
    K = num_heads if num_kv_heads is None else check_int(num_kv_heads, "num_kv_heads")
    if num_heads % K != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({K}) for grouped-query attention"
        )
    if head_dim is None:
        if d_model % num_heads != 0:
            raise ValueError(
                f"num_heads N={num_heads} must divide d_model D={d_model} (H = D / N), or pass head_dim"
            )
        head_dim = d_model // num_heads
    H = check_int(head_dim, "head_dim")
    kq, kk, kv, ko = jax.random.split(as_key(key), 4)
    normal = lambda k, shape, fan_in: (jax.random.normal(k, shape, dtype) / math.sqrt(fan_in)).astype(dtype)
    params = {
        "W_Q": normal(kq, (d_model, num_heads * H), d_model),
        "W_K": normal(kk, (d_model, K * H), d_model),
        "W_V": normal(kv, (d_model, K * H), d_model),
        "W_O": normal(ko, (num_heads * H, d_model), num_heads * H),
    }
    if use_bias:
        params.update(
            b_Q=jnp.zeros((num_heads * H,), dtype),
            b_K=jnp.zeros((K * H,), dtype),
            b_V=jnp.zeros((K * H,), dtype),
            b_O=jnp.zeros((d_model,), dtype),
        )
    return params


_WEIGHT_KEYS = ("W_Q", "W_K", "W_V", "W_O")


def _project(x: Array, params: dict, w: str, b: str) -> Array:
    y = x @ params[w]
    if params.get(b) is not None:
        y = y + params[b][None, :]  # [T, width]
    return y


def attention_layer(
    params: dict,
    h: Any,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    context: Any = None,
    mask: Any = None,
    bias: Any = None,
    scale: Any = None,
    is_causal: bool = False,
) -> tuple[Array, Array]:
    """Multi-head attention from the model width: project, attend per head, merge, project out.

    ``Q = h W_Q``, ``K = c W_K``, ``V = c W_V`` (``c = context``, or ``h`` for self-attention), split into
    heads, :func:`multi_head_attention`, merged, then ``out = merged W_O`` (plus biases if present).

    Args:
      params: dict with ``W_Q [D, N·H]``, ``W_K [Dc, K·H]``, ``W_V [Dc, K·V]``, ``W_O [N·V, D]`` and
        optional biases ``b_Q, b_K, b_V, b_O`` (see :func:`init_attention_params`).
      h: input ``[T, D]``.
      num_heads: N, the number of query heads.
      num_kv_heads: K, the number of key/value heads (``None`` means N).
      context: optional ``[S, Dc]`` for cross-attention.
      mask, bias, scale, is_causal: as in :func:`multi_head_attention`.

    Returns:
      ``(out [T, D], weights [N, T, S])``.
    """
    missing = [name for name in _WEIGHT_KEYS if name not in params]
    if missing:
        raise ValueError(f"params is missing {missing}; expected keys {list(_WEIGHT_KEYS)} (+ optional biases)")
    h = as_float_array(h, "h")
    check_rank(h, 2, "h", "[T, D]")
    c = h if context is None else as_float_array(context, "context")
    check_rank(c, 2, "context", "[S, Dc]")
    N = check_int(num_heads, "num_heads")
    K = N if num_kv_heads is None else check_int(num_kv_heads, "num_kv_heads")
    for name, x, rows in (("W_Q", h, h.shape[1]), ("W_K", c, c.shape[1]), ("W_V", c, c.shape[1])):
        w = params[name]
        if jnp.ndim(w) != 2 or w.shape[0] != rows:
            raise ValueError(
                f"params['{name}'] must have shape [{rows}, heads*H] to project an input of shape "
                f"{tuple(x.shape)}, received {tuple(jnp.shape(w))}"
            )
    for name, heads in (("W_Q", N), ("W_K", K), ("W_V", K)):
        width = params[name].shape[1]
        if width % heads != 0:
            raise ValueError(
                f"params['{name}'] has {width} output columns, which {heads} heads do not divide "
                f"(expected a multiple of {heads}); check num_heads/num_kv_heads"
            )
    q = split_heads(_project(h, params, "W_Q", "b_Q"), N)  # [T, N, H]
    k = split_heads(_project(c, params, "W_K", "b_K"), K)  # [S, K, H]
    v = split_heads(_project(c, params, "W_V", "b_V"), K)  # [S, K, V]
    out, weights = multi_head_attention(q, k, v, mask=mask, bias=bias, scale=scale, is_causal=is_causal)
    w_o = params["W_O"]
    if jnp.ndim(w_o) != 2 or w_o.shape[0] != N * v.shape[2]:
        raise ValueError(
            f"params['W_O'] must have shape [N*V, D] = [{N * v.shape[2]}, D], received {tuple(jnp.shape(w_o))}"
        )
    out = _project(merge_heads(out), params, "W_O", "b_O")  # [T, D]
    return out, weights
