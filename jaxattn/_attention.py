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

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._backends import check_implementation
from jaxattn._blockwise import multi_head_blockwise_attention
from jaxattn._checks import (
    as_float_array,
    as_key,
    check_attention_inputs,
    check_flag,
    check_int,
    check_logit_cap,
    check_multi_head_inputs,
    check_rank,
)
from jaxattn._logits import compact_mask, finite_logits, group_query_heads, kept_nonfinite, per_head, scaled_logits
from jaxattn._masks import causal_mask, check_window, clamp_offset, window_keep
from jaxattn._typing import ArrayLike, Bool, Float, Key, Real, Shaped, UInt32

Array = jax.Array


# ----------------------------------------------------------------------------------------------------
# The per-example, per-head core (no validation: callers validate first).
# ----------------------------------------------------------------------------------------------------


def _diagonal(is_causal: Any, causal_offset: Any, local_window_size: Any = None) -> tuple[int | None, tuple | None]:
    """``(causal, window)``: the causal diagonal's offset (``causal_mask``'s ``offset``, ``None`` without
    ``is_causal``) and the window ``(left, right, offset)`` around the same diagonal (``None`` without one)."""
    is_causal = check_flag(is_causal, "is_causal")
    window = check_window(local_window_size)
    if isinstance(causal_offset, bool) or not isinstance(causal_offset, (int, np.integer)):
        raise TypeError(
            f"causal_offset must be a Python int (it chooses the compiled program), received {causal_offset!r} "
            f"of type {type(causal_offset).__name__}"
        )
    if causal_offset and not is_causal and window is None:
        raise ValueError(
            f"causal_offset={causal_offset} moves the causal diagonal and needs is_causal=True (or "
            f"local_window_size, whose diagonal it moves too)"
        )
    return (int(causal_offset) if is_causal else None), (None if window is None else (*window, int(causal_offset)))


def _keep(mask: Array | None, causal: int | None, T: int, S: int, window: tuple | None = None) -> Array | None:
    """The effective keep-mask ``[T, S]`` (or ``None``: keep everything); ``causal``, ``window``: see :func:`_diagonal`."""
    if window is not None:
        left, right, offset = window
        keep = window_keep((left, right), offset, T, S)  # [T, S]
        mask = keep if mask is None else jnp.logical_and(mask, keep)
    if causal is not None:
        causal = causal_mask(T, S, offset=causal)  # [T, S]
        return causal if mask is None else jnp.logical_and(mask, causal)
    return mask


@jax.custom_jvp
def _softmax_rows(logits: Array, keep: Array | None) -> tuple[Array, Array]:
    """``(p0 [T, S], nan_row [T, 1])``: the softmax over the last axis restricted to ``keep``, all finite (a
    NaN row's weights are zeros here), and which rows are NaN rows. :func:`_masked_softmax` is
    ``where(nan_row, NaN, p0)``; attention takes its product with ``p0`` directly (see :func:`_attend`).

    Masked logits are replaced by the dtype's most negative finite value (not -inf, which would give
    ``-inf - -inf = NaN`` in a fully masked row), so they never win the row maximum; their exponentials
    are then zeroed explicitly. A row with no kept key therefore has zero weights (its sum is 0, and the
    division is guarded), and both the value and its gradient stay finite.

    A kept NaN or +inf logit makes its row a NaN row through a flag, not through the maximum or the
    exponential: how a backend's max, exp or clamp treats NaN (XLA's default CPU emitters drop it in
    places; fused with a NaN, an exponential has given finite values of either sign) cannot change the
    answer. Without a mask the flag is an ``any`` over the row of ``isnan(x) | (x == +inf)``, a reduction
    of booleans (no float reduction carries it), and the row's weights are zeroed in the division's
    ``where``; with one, the maximum reads a NaN as +inf (a flag from a comparison, not from how the max
    treats NaN) and the row's exponentials are zeroed with the masked ones. The two arrangements compute
    the same; each is the one XLA's CPU backend fuses into fewer passes over ``[T, S]`` (docs/core.md).

    The derivative is the closed form ``dp = p ⊙ (dl − Σ p ⊙ dl)`` (see :func:`_softmax_rows_jvp`), so
    the backward pass costs what ``jax.nn.softmax``'s does instead of differentiating every step above.
    """
    fill = jnp.finfo(logits.dtype).min
    if keep is None:
        nan_row = jnp.any(jnp.isnan(logits) | (logits == jnp.inf), axis=-1, keepdims=True)  # [T, 1]
        row_max = jnp.max(logits, axis=-1, keepdims=True, initial=fill)  # [T, 1]; anything in a NaN row
        e = jnp.exp(logits - jax.lax.stop_gradient(row_max))  # [T, S], in [0, 1] outside NaN rows
        total = jnp.sum(e, axis=-1, keepdims=True)  # [T, 1], >= 1 unless every logit is -inf (anything in a NaN row)
        return jnp.where(nan_row, 0.0, e / jnp.where(total == 0.0, 1.0, total)), nan_row  # [T, S], [T, 1]
    # with a mask, the NaN test rides on the maximum's own pass: it reads a NaN as +inf (a different
    # arrangement from the unmasked one above because XLA's CPU backend fuses each into fewer passes)
    x = jnp.where(keep, logits, fill)  # [T, S]
    row_max = jnp.max(jnp.where(jnp.isnan(x), jnp.inf, x), axis=-1, keepdims=True, initial=fill)  # [T, 1]
    nan_row = row_max == jnp.inf  # [T, 1]: a kept NaN or +inf
    e = jnp.where(jnp.logical_and(keep, ~nan_row), jnp.exp(x - jax.lax.stop_gradient(row_max)), 0.0)  # [T, S]
    total = jnp.sum(e, axis=-1, keepdims=True)  # [T, 1], >= 1 unless the row is fully masked or NaN
    return e / jnp.where(total == 0.0, 1.0, total), nan_row  # [T, S], [T, 1]


@_softmax_rows.defjvp
def _softmax_rows_jvp(primals, tangents):
    """``dp = p0 ⊙ (dl − Σ_s p0_s dl_s)``: zero at masked keys (p0 = 0 there), in fully masked rows, and in NaN
    rows, where it is set to zero by a ``where`` (their p0 is 0, but their logits' tangent may be NaN, and
    ``0 · NaN`` is NaN). In reverse mode that ``where`` also keeps XLA's CPU backend from fusing the
    product that brings the weights' cotangent (``dout vᵀ``) into this backward: fused, the two ran slower
    than apart."""
    logits, keep = primals
    d_logits = tangents[0]
    p0, nan_row = _softmax_rows(logits, keep)  # [T, S] finite, [T, 1]
    if keep is not None:
        d_logits = jnp.where(keep, d_logits, 0.0)  # a NaN tangent at a masked key must not leak (0·NaN)
    mean = jnp.sum(p0 * d_logits, axis=-1, keepdims=True)  # [T, 1]
    dp = jnp.where(nan_row, 0.0, p0 * (d_logits - mean))  # [T, S]
    return (p0, nan_row), (dp, np.zeros(nan_row.shape, jax.dtypes.float0))


@jax.custom_jvp
def _nan_at(logits: Array, bad_rows: Array, bad_cols: Array) -> Array:
    """``where(bad_rows | bad_cols, NaN, logits)``, ``[T, S]``: the NaN rows and columns of
    :func:`~jaxattn._logits.scaled_logits`, put into the dense core's logits (:func:`finite_logits`).

    Its tangent passes through unchanged: the softmax after it (:func:`_softmax_rows`) gives a NaN logit's
    entry no derivative (a kept one makes its row a NaN row, whose derivative is zero; a masked one is
    zeroed with the mask), so the ``where``'s own derivative would zero what is zero already, in a pass over
    ``[T, S]`` of the backward. Only for that consumer: elsewhere the plain ``where`` is the derivative."""
    return jnp.where(jnp.logical_or(bad_rows, bad_cols), jnp.nan, logits)


@_nan_at.defjvp
def _nan_at_jvp(primals, tangents):
    return _nan_at(*primals), tangents[0]


def _masked_softmax(logits: Array, keep: Array | None) -> Array:
    """Numerically stable softmax over the last axis, restricted to ``keep``; ``[T, S]``.

    Masked logits never matter, whatever their value (NaN and Inf included). A kept logit of -inf is a
    weight of 0; a kept NaN or +inf makes the whole row NaN. A row with no kept key has zero weights.
    The derivative is the softmax's closed form, zero in NaN rows (:func:`_softmax_rows`).
    """
    p0, nan_row = _softmax_rows(logits, keep)
    return jnp.where(nan_row, jnp.nan, p0)  # [T, S]


@jax.custom_jvp
def _finite_values(v: Array) -> Array:
    """``where(isfinite(v), v, 0)``, ``[S, V]``, whose tangent passes through unchanged.

    Only for :func:`_weighted_sum`: a non-finite ``v[s, c]`` is zeroed before the product, and every output
    it could reach (a row that keeps key s, in column c) is put back to NaN with its cotangent dropped, so
    the entry's gradient is zero either way, and a finite tangent there reaches only rows whose weight on
    key s is 0 (a tangent that is itself non-finite there would reach them as ``0 · NaN``). The ``where``'s
    own transpose, a select over ``dv``, made XLA's CPU backend compute ``dv = pᵀ dout`` as a plain
    transposed product instead of through its matrix library (about 8% of the dense forward+backward at
    GPT-2 shapes)."""
    return jnp.where(jnp.isfinite(v), v, 0.0)


@_finite_values.defjvp
def _finite_values_jvp(primals, tangents):
    return _finite_values(*primals), tangents[0]


def _weighted_sum(p0: Array, nan_row: Array, v: Array, hit: Array) -> Array:
    """``weights @ v``, ``[T, V]``, in which a masked key contributes nothing, whatever its value.

    A plain product gives ``0 · NaN = NaN`` at a masked key whose v is NaN or Inf. Here the product runs
    on the finite weights ``p0`` (:func:`_softmax_rows`) and v with its non-finite entries zeroed, then NaN
    is put back where it belongs: entry ``(t, c)`` is NaN iff row t is a NaN row or ``hit[t, c]`` (row t
    keeps a key whose ``v[:, c]`` is non-finite, :func:`kept_nonfinite`). The cotangent of those NaN
    entries is dropped, so a row that never kept a non-finite v gets finite gradients.

    The product runs in the wider of the two dtypes (float64 values with float32 weights: float64), so no
    finite value overflows on the way in: ``hit``, read from v's own dtype, then names every entry zeroed.
    """
    dtype = jnp.promote_types(p0.dtype, v.dtype)
    out = jnp.einsum("TS,SV->TV", p0.astype(dtype), _finite_values(v.astype(dtype)))  # [T, V]
    return jnp.where(jnp.logical_or(hit, nan_row), jnp.nan, out)  # [T, V]


def _attend(
    q: Array, k: Array, v: Array, mask: Array | None, bias: Array | None, scale: Any, causal: int | None,
    window: tuple | None = None, cap: Any = None,
) -> tuple[Array, Array]:
    """One head, one example: ``(out [T, V], weights [T, S])`` from one softmax.

    ``mask``: None or broadcastable to ``[T, S]``, best in its compact shape (a key-padding mask ``[S]``
    or ``[1, S]``), which makes the non-finite bookkeeping of :func:`kept_nonfinite` O(S·V). A window
    (see :func:`_diagonal`) is folded into a ``[T, S]`` mask with the causal one; ``cap``: the logit soft cap.
    """
    T, S = q.shape[0], k.shape[0]
    if T == 0 or S == 0:  # no logit at all: zero weights and outputs (each row keeps no key), no softmax to trace
        return (jnp.zeros((T, v.shape[1]), jnp.result_type(q, k, v)), jnp.zeros((T, S), jnp.result_type(q, k)))
    if causal is not None:
        causal = clamp_offset(causal, T, S)  # the same mask, and i + causal stays inside int32
    mask = compact_mask(mask)  # [t, s] or None
    if window is not None:  # no rank-one structure left: one [T, S] mask
        mask, causal = _keep(mask, causal, T, S, window), None  # [T, S]
    keep = _keep(mask, causal, T, S)  # broadcastable to [T, S], or None
    logits, bad_rows, bad_cols = finite_logits(q, k, bias, scale, cap)  # [T, S] f32+, [T, 1], [1, S]
    p0, nan_row = _softmax_rows(_nan_at(logits, bad_rows, bad_cols), keep)  # [T, S], [T, 1]
    hit = kept_nonfinite(mask, causal, T, S, ~jnp.isfinite(v))  # [T or 1, V]
    out = _weighted_sum(p0, nan_row, v, hit)  # [T, V]
    weights = jnp.where(nan_row, jnp.nan, p0)  # [T, S]: _masked_softmax's
    return out.astype(jnp.result_type(q, k, v)), weights.astype(jnp.result_type(q, k))


# The public functions check their inputs in Python, then run their core as one compiled program: called
# eagerly on a new shape, one compile instead of one per primitive (several times faster); inside the
# caller's jit, vmap or grad the inner jit is inlined.
_attend_jit = jax.jit(_attend, static_argnames=("causal", "window"))
_logits_jit = jax.jit(scaled_logits)


@functools.partial(jax.jit, static_argnames=("causal", "window"))
def _weights_core(q: Array, k: Array, mask: Array | None, bias: Array | None, scale: Any, causal: int | None,
                  window: tuple | None = None, cap: Any = None) -> Array:
    keep = _keep(mask, causal, q.shape[0], k.shape[0], window)
    weights = _masked_softmax(scaled_logits(q, k, bias, scale, cap), keep)
    return weights.astype(jnp.result_type(q, k))


# ----------------------------------------------------------------------------------------------------
# Public single-head API.
# ----------------------------------------------------------------------------------------------------


def attention_logits(
    q: Float[ArrayLike, "T H"],
    k: Float[ArrayLike, "S H"],
    *,
    bias: Float[ArrayLike, "#T #S"] | Float[ArrayLike, "#S"] | None = None,
    scale: Real[ArrayLike, ""] | None = None,
    logit_cap: Real[ArrayLike, ""] | None = None,
) -> Float[Array, "T S"]:
    """The pre-softmax logits ``scale · q kᵀ + bias`` of one head (soft-capped with ``logit_cap``), before any mask.

    These are exactly the logits :func:`attention` and :func:`attention_weights` feed to their softmax
    (the same private function computes them), for probes that study the softmax's input. A row of q
    (of k) holding a NaN or Inf gives NaN on its whole logit row (column).

    Args:
      q: queries ``[T, H]``.
      k: keys ``[S, H]``.
      bias: optional additive bias broadcastable to ``[T, S]``.
      scale: logit scale; ``None`` means ``1/sqrt(H)`` (see :func:`attention` for why).
      logit_cap: ``None``, or ``c`` for ``c · tanh(logits / c)`` (see :func:`attention`).

    Returns:
      ``[T, S]`` in at least float32.
    """
    q, k, _, _, bias, scale = check_attention_inputs(q, k, None, None, bias, scale)
    return _logits_jit(q, k, bias, scale, check_logit_cap(logit_cap))


def attention_weights(
    q: Float[ArrayLike, "T H"],
    k: Float[ArrayLike, "S H"],
    *,
    mask: Bool[ArrayLike, "#T #S"] | Bool[ArrayLike, "#S"] | None = None,
    bias: Float[ArrayLike, "#T #S"] | Float[ArrayLike, "#S"] | None = None,
    scale: Real[ArrayLike, ""] | None = None,
    is_causal: bool = False,
    causal_offset: int = 0,
    local_window_size: int | tuple[int, int] | None = None,
    logit_cap: Real[ArrayLike, ""] | None = None,
) -> Float[Array, "T S"]:
    """The attention map ``A = softmax(scale · q kᵀ + bias)`` of one head, restricted to ``mask``.

    Args:
      q: queries ``[T, H]``.
      k: keys ``[S, H]``.
      mask: optional boolean keep-mask (True = attend) broadcastable to ``[T, S]``.
      bias: optional additive bias broadcastable to ``[T, S]``, added after scaling.
      scale: logit scale; ``None`` means ``1/sqrt(H)`` (see :func:`attention` for why).
      is_causal: also apply :func:`causal_mask` ``(T, S, causal_offset)`` (key ``j`` visible to query ``i``
        iff ``j <= i + causal_offset``).
      causal_offset: with ``is_causal``, how many keys past the diagonal each query still sees: 0 for
        self-attention, ``S - T`` for queries that continue ``S - T`` earlier keys (a cache, a row block).
      local_window_size, logit_cap: see :func:`attention`.

    Returns:
      ``[T, S]`` in the dtype of ``q``/``k``; each row sums to 1, or is all zeros if fully masked.
    """
    q, k, _, mask, bias, scale = check_attention_inputs(q, k, None, mask, bias, scale)
    causal, window = _diagonal(is_causal, causal_offset, local_window_size)
    return _weights_core(q, k, mask, bias, scale, causal, window, check_logit_cap(logit_cap))


def attention(
    q: Float[ArrayLike, "T H"],
    k: Float[ArrayLike, "S H"],
    v: Float[ArrayLike, "S V"],
    *,
    mask: Bool[ArrayLike, "#T #S"] | Bool[ArrayLike, "#S"] | None = None,
    bias: Float[ArrayLike, "#T #S"] | Float[ArrayLike, "#S"] | None = None,
    scale: Real[ArrayLike, ""] | None = None,
    is_causal: bool = False,
    causal_offset: int = 0,
    local_window_size: int | tuple[int, int] | None = None,
    logit_cap: Real[ArrayLike, ""] | None = None,
) -> tuple[Float[Array, "T V"], Float[Array, "T S"]]:
    """Scaled dot-product attention of one head: ``softmax(scale · q kᵀ + bias) v``.

    With the paper's names: ``H = d_k``, ``V = d_v``, ``T = S = n`` for self-attention.

    Why the scale exists: if the H components of a query and a key are independent with mean 0 and
    variance 1, their dot product has variance H. Unscaled, the logits grow like ``sqrt(H)``, the softmax
    saturates to a near one-hot row and its gradient vanishes. Multiplying by ``1/sqrt(H)`` restores unit
    variance. ``scale=None`` means ``1/sqrt(H)``; ``scale=1.0`` is the unscaled variant (the same code).

    The softmax runs in at least float32 (bf16/fp16 inputs are promoted, results cast back): ``q kᵀ`` is
    accumulated in float32 and then multiplied by the scale in float32, so the scale is never rounded to
    the input dtype. The output is computed from the same float32 weights that are returned (cast to the
    input dtype), so the map you inspect is the one that produced the output.

    Sliding windows: ``local_window_size=(left, right)`` (``jax.nn.dot_product_attention``'s meaning; an
    int ``w`` is ``(w, w)``) keeps key ``j`` for query ``i`` iff ``i + o - left <= j <= i + o + right``, ``o``
    the ``causal_offset``. A causal window of ``W`` keys (query ``t`` sees key ``s`` iff ``0 <= t - s < W``,
    as Mistral's and Gemma's ``sliding_window = W``) is ``is_causal=True, local_window_size=(W - 1, 0)``.

    Soft-capping: ``logit_cap=c`` replaces the logits ``x = scale · q kᵀ + bias`` by ``c · tanh(x / c)``
    before the mask (Gemma 2's attention-logit soft cap), which bounds them to ``(-c, c)`` and so keeps
    the softmax away from a one-hot row: over S kept keys no weight exceeds ``e^{2c} / (e^{2c} + S - 1)``.
    Its derivative is ``1 - tanh²(x / c)``; a traced ``c`` is accepted (sweeps), and differentiable.

    Masking: ``mask`` is a boolean keep-mask (True = attend). A query row whose keys are all masked
    returns zero weights and a zero output, with finite gradients. ``S = 0`` is the same case (zero
    output ``[T, V]``, weights ``[T, 0]``); ``T = 0`` gives empty outputs.

    Non-finite inputs: a masked position never influences any output or gradient, whatever its value
    (NaN, +Inf, -Inf). At kept positions they propagate; nothing is silently replaced:

    - a non-finite ``v[s, c]`` at a key ``s`` that row ``t`` keeps makes ``out[t, c]`` NaN (the other
      columns of the row stay finite);
    - a non-finite entry of ``k[s]`` kept by row ``t``, or of ``q[t]`` (if row ``t`` keeps any key), makes
      row ``t``'s weights and output NaN; so does a NaN or +Inf ``bias[t, s]`` at a kept position, while a
      kept ``-inf`` bias is a weight of 0. Only ``mask`` masks: a non-finite ``v[s]`` still reaches a row
      that gives key ``s`` a ``-inf`` bias (the first rule). With ``logit_cap`` the cap comes first, so an
      infinite bias becomes a logit of ``±c``: a weight, not a 0 or a NaN row.

    Gradients do not flow through those NaN outputs (their cotangent is dropped), so the gradients of a
    loss over the outputs that are finite are finite, and equal those with the masked entries set to 0.
    The bookkeeping costs O((T + S)·(H + V)) for no mask, causal, a key-padding mask ``[S]`` or a
    combination; a general ``[T, S]`` mask adds a ``[T, 32] @ [32, V]`` product per 32 keys holding a
    non-finite v (none when all are finite).

    Args:
      q: queries ``[T, H]``, floating dtype (NumPy or JAX).
      k: keys ``[S, H]``.
      v: values ``[S, V]``.
      mask: optional boolean keep-mask broadcastable to ``[T, S]``.
      bias: optional additive logit bias broadcastable to ``[T, S]``.
      scale: positive finite logit scale, or ``None`` for ``1/sqrt(H)``. A traced scale is accepted
        (for sweeps under ``jit``/``vmap``) and is not checked.
      is_causal: also apply :func:`causal_mask` ``(T, S, causal_offset)``.
      causal_offset: with ``is_causal``, key ``j`` is visible to query ``i`` iff ``j <= i + causal_offset``
        (0: self-attention; ``S - T``: queries that continue ``S - T`` earlier keys). Any Python int:
        ``causal_offset >= S`` keeps every key, ``<= -T`` none (clamped to ``[-T, S]``, the same mask).
        It moves the window's diagonal too.
      local_window_size: ``None``, an int ``w`` or ``(left, right)`` Python ints >= 0 (see above).
      logit_cap: ``None`` (no cap) or the soft cap ``c > 0`` (see above).

    Returns:
      ``(out, weights)``: ``out [T, V]`` in the promoted dtype of q, k, v; ``weights [T, S]`` in that
      of q, k.
    """
    q, k, v, mask, bias, scale = check_attention_inputs(q, k, v, mask, bias, scale, broadcast_mask=False)
    causal, window = _diagonal(is_causal, causal_offset, local_window_size)
    return _attend_jit(q, k, v, mask, bias, scale, causal, window, check_logit_cap(logit_cap))


# ----------------------------------------------------------------------------------------------------
# Multi-head and grouped-query attention: vmaps of the single-head core.
# ----------------------------------------------------------------------------------------------------


def multi_head_attention(
    q: Float[ArrayLike, "T N H"],
    k: Float[ArrayLike, "S K H"],
    v: Float[ArrayLike, "S K V"],
    *,
    mask: Bool[ArrayLike, "#N #T #S"] | Bool[ArrayLike, "#T #S"] | Bool[ArrayLike, "#S"] | None = None,
    bias: Float[ArrayLike, "#N #T #S"] | Float[ArrayLike, "#T #S"] | Float[ArrayLike, "#S"] | None = None,
    scale: Real[ArrayLike, ""] | None = None,
    is_causal: bool = False,
    causal_offset: int = 0,
    local_window_size: int | tuple[int, int] | None = None,
    logit_cap: Real[ArrayLike, ""] | None = None,
) -> tuple[Float[Array, "T N V"], Float[Array, "N T S"]]:
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
      is_causal: also apply :func:`causal_mask` ``(T, S, causal_offset)``.
      causal_offset: with ``is_causal``, key ``j`` is visible to query ``i`` iff ``j <= i + causal_offset``.
      local_window_size, logit_cap: as in :func:`attention`, for every head of this call (a model passes
        its own per layer).

    Returns:
      ``(out [T, N, V], weights [N, T, S])``.
    """
    q, k, v, mask, bias, scale = check_multi_head_inputs(q, k, v, mask, bias, scale)
    causal, window = _diagonal(is_causal, causal_offset, local_window_size)
    return _multi_head(q, k, v, mask, bias, scale, causal, window, check_logit_cap(logit_cap))


@functools.partial(jax.jit, static_argnames=("causal", "window"))
def _multi_head(q: Array, k: Array, v: Array, mask: Array | None, bias: Array | None, scale: Any,
                causal: int | None, window: tuple | None = None, cap: Any = None) -> tuple[Array, Array]:
    """:func:`multi_head_attention` of checked inputs: the single-head core vmapped over the heads."""
    T, N, H = q.shape
    S, K, V = v.shape
    qh = group_query_heads(q, K)  # [K, G, T, H]
    kh = k.transpose(1, 0, 2)  # [K, S, H]
    vh = v.transpose(1, 0, 2)  # [K, S, V]
    m, m_axis = per_head(mask, N, K)
    b, b_axis = per_head(bias, N, K)

    def one_head(q1, k1, v1, m1, b1):  # m1 [t, s] in its compact shape (see _attend)
        if b1 is not None:
            b1 = jnp.broadcast_to(b1, (T, S))
        return _attend(q1, k1, v1, m1, b1, scale, causal, window, cap)

    over_group = jax.vmap(one_head, in_axes=(0, None, None, 0 if m_axis == 0 else None, 0 if b_axis == 0 else None))
    over_kv = jax.vmap(over_group, in_axes=(0, 0, 0, m_axis, b_axis))
    out, weights = over_kv(qh, kh, vh, m, b)  # [K, G, T, V], [K, G, T, S]
    out = out.transpose(2, 0, 1, 3).reshape(T, N, V)  # [T, N, V]
    weights = weights.reshape(N, T, S)  # [N, T, S]
    return out, weights


# ----------------------------------------------------------------------------------------------------
# Projections from the model width: a params pytree in, arrays out.
# ----------------------------------------------------------------------------------------------------


def split_heads(x: Shaped[ArrayLike, "T NH"], num_heads: int) -> Shaped[Array, "T num_heads NH//num_heads"]:
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


def merge_heads(x: Shaped[ArrayLike, "T N H"]) -> Shaped[Array, "T N*H"]:
    """``[T, N, H] -> [T, N·H]`` (the inverse of :func:`split_heads`)."""
    x = jnp.asarray(x)
    check_rank(x, 3, "x", "[T, N, H]")
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2])  # [T, N*H]


def init_attention_params(
    key: Key[Array, ""] | UInt32[ArrayLike, "2"] | int,
    d_model: int,
    num_heads: int,
    *,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    use_bias: bool = False,
    dtype: Any = jnp.float32,
) -> dict[str, Float[Array, "_ _"] | Float[Array, "_"]]:
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


def _layer_mode(return_weights: Any, implementation: Any) -> tuple[bool, str | None]:
    """:func:`attention_layer`'s ``(return_weights, implementation)``: an implementation needs
    ``return_weights=False``."""
    return_weights = check_flag(return_weights, "return_weights")
    implementation = check_implementation(implementation)
    if return_weights and implementation is not None:
        raise ValueError(
            f"implementation={implementation!r} needs return_weights=False: the weights [N, T, S] come from "
            f"the dense core, the implementations return (out, lse) (rows of the map: jaxattn.weights_from_lse)"
        )
    return return_weights, implementation


def _layer_inputs(
    params: dict, h: Any, context: Any, num_heads: Any, num_kv_heads: Any
) -> tuple[Array, Array, int, int]:
    """:func:`attention_layer`'s ``(h [T, D], c [S, Dc], N, K)``, checked against ``params``: ``c`` is the
    context (``h`` for self-attention), and ``W_Q``, ``W_K``, ``W_V`` project ``h``, ``c``, ``c`` to N, K, K
    heads."""
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
    for name, w in (("b_Q", "W_Q"), ("b_K", "W_K"), ("b_V", "W_V"), ("b_O", "W_O")):
        b = params.get(name)
        cols = tuple(jnp.shape(params[w])[-1:])
        if b is not None and tuple(jnp.shape(b)) != cols:
            raise ValueError(f"params['{name}'] must have shape {list(cols)} (the columns of params['{w}']), "
                             f"received {tuple(jnp.shape(b))}")
    return h, c, N, K


def _check_output_projection(params: dict, width: int) -> None:
    """``W_O`` must be ``[N·V, D]``, ``width = N·V`` the merged heads' width."""
    w_o = params["W_O"]
    if jnp.ndim(w_o) != 2 or w_o.shape[0] != width:
        raise ValueError(f"params['W_O'] must have shape [N*V, D] = [{width}, D], received {tuple(jnp.shape(w_o))}")


def attention_layer(
    params: dict[str, Float[ArrayLike, "_ _"] | Float[ArrayLike, "_"] | None],
    h: Float[ArrayLike, "T D"],
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    context: Float[ArrayLike, "S Dc"] | None = None,
    mask: Bool[ArrayLike, "#N #T #S"] | Bool[ArrayLike, "#T #S"] | Bool[ArrayLike, "#S"] | None = None,
    bias: Float[ArrayLike, "#N #T #S"] | Float[ArrayLike, "#T #S"] | Float[ArrayLike, "#S"] | None = None,
    scale: Real[ArrayLike, ""] | None = None,
    is_causal: bool = False,
    return_weights: bool = True,
    implementation: str | None = None,
) -> tuple[Float[Array, "T D"], Float[Array, "N T S"]] | tuple[Float[Array, "T D"], Float[Array, "N T"]]:
    """Multi-head attention from the model width: project, attend per head, merge, project out.

    ``Q = h W_Q``, ``K = c W_K``, ``V = c W_V`` (``c = context``, or ``h`` for self-attention), split into
    heads, :func:`multi_head_attention`, merged, then ``out = merged W_O`` (plus biases if present).

    With ``return_weights=False`` the heads are computed by :func:`jaxattn.multi_head_blockwise_attention`
    with ``implementation`` (``None``, ``"blockwise"``, ``"xla"``, ``"cudnn"``, ``"pallas"``; see there)
    and no ``[N, T, S]`` map exists: the layer returns ``(out, lse)``, and
    :func:`jaxattn.weights_from_lse` recovers any row of the map. A ``bias`` runs in the ``"blockwise"``
    kernel there (the library kernels refuse it).

    Args:
      params: dict with ``W_Q [D, N·H]``, ``W_K [Dc, K·H]``, ``W_V [Dc, K·V]``, ``W_O [N·V, D]`` and
        optional biases ``b_Q, b_K, b_V, b_O`` (see :func:`init_attention_params`).
      h: input ``[T, D]``.
      num_heads: N, the number of query heads.
      num_kv_heads: K, the number of key/value heads (``None`` means N).
      context: optional ``[S, Dc]`` for cross-attention.
      mask, bias, scale, is_causal: as in :func:`multi_head_attention`.
      return_weights: return the map ``weights [N, T, S]`` (the dense core), or, if False, ``lse [N, T]``.
      implementation: with ``return_weights=False``, which kernel attends (see
        :func:`jaxattn.multi_head_blockwise_attention`); with ``return_weights=True`` it must be None.

    Returns:
      ``(out [T, D], weights [N, T, S])``, or ``(out [T, D], lse [N, T])`` with ``return_weights=False``.
    """
    return_weights, implementation = _layer_mode(return_weights, implementation)
    h, c, N, K = _layer_inputs(params, h, context, num_heads, num_kv_heads)
    q = split_heads(_project(h, params, "W_Q", "b_Q"), N)  # [T, N, H]
    k = split_heads(_project(c, params, "W_K", "b_K"), K)  # [S, K, H]
    v = split_heads(_project(c, params, "W_V", "b_V"), K)  # [S, K, V]
    if return_weights:
        out, weights = multi_head_attention(q, k, v, mask=mask, bias=bias, scale=scale, is_causal=is_causal)
    else:
        out, weights = multi_head_blockwise_attention(  # weights: lse [N, T]
            q, k, v, mask=mask, bias=bias, scale=scale, is_causal=is_causal, implementation=implementation
        )
    _check_output_projection(params, N * v.shape[2])
    out = _project(merge_heads(out), params, "W_O", "b_O")  # [T, D]
    return out, weights
