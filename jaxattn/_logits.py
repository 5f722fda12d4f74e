"""The logits of one head, and the logit-shaped arrays the dense and the blockwise cores both use.

- :func:`scaled_logits`: ``scale · q kᵀ + bias``, the one logits function of the package;
- :func:`kept_nonfinite`: which outputs keep a key whose value is non-finite, without a ``[T, S]`` buffer;
- :func:`compact_mask`: a keep-mask broadcastable to ``[T, S]`` as ``[t, s]``, not broadcast;
- :func:`per_head`, :func:`group_query_heads`: masks, biases and queries laid out per key/value head.

Every function takes validated arrays (see :mod:`jaxattn._checks`). Axis alphabet as in
:mod:`jaxattn._attention`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxattn._checks import softmax_dtype

Array = jax.Array


def soft_cap(logits: Array, cap: Any) -> Array:
    """``cap · tanh(logits / cap)`` (Gemma 2's attention-logit soft-capping), NaN kept as NaN; ``cap=None``: unchanged.

    The logits stay inside ``(-cap, cap)`` (``±inf`` becomes ``±cap``); the derivative is
    ``sech²(logits / cap)``, computed as ``4 e / (1 + e)²`` with ``e = exp(-2 |logits / cap|)``: ``1 - tanh²``
    would be exactly 0 in float32 once ``tanh`` rounds to ±1 (from ``|logits / cap| ≈ 8``), the stable form
    stays tiny and right. A NaN is put back by a ``where``: a backend's ``tanh`` may clamp it away.
    """
    if cap is None:
        return logits
    return jnp.where(jnp.isnan(logits), logits, _capped(logits, jnp.asarray(cap, logits.dtype)))


def sech2(u: Array) -> Array:
    """``sech²(u) = 1 - tanh²(u)`` without cancellation: ``4 e / (1 + e)²``, ``e = exp(-2|u|)``; 0 at ±inf and
    at NaN: a NaN logit's entry gets no derivative (masked, it must not reach a gradient as ``0 · NaN``;
    kept, its row is a NaN row, whose derivative is zero)."""
    e = jnp.exp(-2.0 * jnp.abs(u))
    return jnp.where(jnp.isnan(u), 0.0, 4.0 * e / (1.0 + e) ** 2)


@jax.custom_jvp
def _capped(x: Array, cap: Array) -> Array:
    return cap * jnp.tanh(x / cap)


@_capped.defjvp
def _capped_jvp(primals, tangents):
    x, cap = primals
    dx, dcap = tangents
    u = x / cap
    t = jnp.tanh(u)
    s = sech2(u)
    # d/dcap of cap·tanh(x/cap) = tanh(u) - u·sech²(u): ±1 at u = ±inf (not inf · 0), 0 at NaN (see sech2)
    d_cap = jnp.where(jnp.isfinite(u), t - u * s, jnp.where(jnp.isnan(u), 0.0, t))
    return cap * t, dx * s + dcap * d_cap


def scaled_logits(q: Array, k: Array, bias: Array | None, scale: Any, cap: Any = None) -> Array:
    """``scale * q kᵀ + bias`` in at least float32, soft-capped by :func:`soft_cap` when ``cap`` is given: ``[T, S]``.

    The product is accumulated in float32 (or wider) and only then scaled, in that dtype, so the scale is
    never rounded to a bf16/fp16 input dtype. A query (key) row holding a non-finite entry gives NaN on
    its whole logit row (column): the product runs on that row zeroed and NaN is put back by a ``where``
    (a double ``where``), so a NaN/Inf at a masked position cannot reach ``dq = dl k`` or ``dk = dlᵀ q``
    through ``0 · NaN``, while a kept one makes its row NaN in the softmax.
    """
    logits, bad_rows, bad_cols = _product(q, k, scale)
    logits = jnp.where(jnp.logical_or(bad_rows, bad_cols), jnp.nan, logits)  # [T, S]
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)  # [T, S]
    return soft_cap(logits, cap)  # [T, S]


def _product(q: Array, k: Array, scale: Any) -> tuple[Array, Array, Array]:
    """``(scale · q0 k0ᵀ [T, S], bad_rows [T, 1], bad_cols [1, S])``: q and k with their non-finite rows zeroed,
    the product accumulated in at least float32 and scaled in that dtype, and which rows were non-finite."""
    acc = softmax_dtype(jnp.result_type(q, k))
    q_ok, k_ok = jnp.isfinite(q), jnp.isfinite(k)  # [T, H], [S, H]
    q0, k0 = jnp.where(q_ok, q, 0), jnp.where(k_ok, k, 0)  # [T, H], [S, H]
    logits = jnp.einsum("TH,SH->TS", q0, k0, preferred_element_type=acc)  # [T, S]
    logits = logits * jnp.asarray(scale, acc)  # [T, S], the 1/sqrt(d_k) step
    return logits, ~jnp.all(q_ok, axis=1)[:, None], ~jnp.all(k_ok, axis=1)[None, :]


def finite_logits(q: Array, k: Array, bias: Array | None, scale: Any, cap: Any = None) -> tuple[Array, Array, Array]:
    """:func:`scaled_logits` without its NaN rows and columns: ``(logits [T, S], bad_rows [T, 1], bad_cols
    [1, S])``, the logits of the non-finite query (key) rows computed from those rows zeroed, and which rows
    (columns) :func:`scaled_logits` makes NaN (the dense core puts them in with a ``where`` whose backward
    costs no ``[T, S]`` pass)."""
    logits, bad_rows, bad_cols = _product(q, k, scale)
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)  # [T, S]
    return soft_cap(logits, cap), bad_rows, bad_cols


def kept_nonfinite(mask: Array | None, causal: int | None, T: int, S: int, bad: Array,
                   window: tuple[int, int, int] | None = None) -> Array:
    """``hit[t, c] = any_s keep[t, s] & bad[s, c]``, broadcastable to ``[T, C]``: a kept bad entry reaches it.

    ``mask``: ``[t, s]`` (``t in {1, T}``, ``s in {1, S}``, see :func:`compact_mask`) or None, combined
    with the causal diagonal (``causal``: key ``j`` visible to query ``i`` iff ``j <= i + causal``; None:
    no causal mask); ``bad [S, C]`` bool. O(S·C) when the keep-mask has a rank-one structure (no mask,
    causal, a key-padding mask ``[S]``, a query mask ``[T, 1]``, each with or without causal). A general
    ``[T, S]`` mask adds a loop over the keys that hold a bad entry, 32 at a time (a ``[T, 32] @ [32, C]``
    product each): nothing when every value is finite, and no ``[T, S]`` buffer. ``window``: ``(left,
    right, offset)``, key ``j`` visible to query ``i`` iff ``i + offset - left <= j <= i + offset + right``
    (as well): an any over each query's range of keys from log2(range) doublings of an any over shifted
    rows (a sparse table), O((T + S)·C·log(range)) and only when some value is bad. Under a mesh with
    Explicit axes a general mask takes one ``[T, S] @ [S, C]`` product instead of the loop (see there).
    """
    t, s = (1, 1) if mask is None else mask.shape
    if t > 1 and s > 1 and jax.sharding.get_abstract_mesh().explicit_axes:
        # Under a mesh with Explicit axes, JAX (0.10) cannot vmap a loop of traced length over a batch split
        # on them ("Resource axis ... not found in mesh"): one product over every key instead, O(T·S·C).
        keep = jnp.broadcast_to(mask, (T, S))
        if causal is not None:
            keep = jnp.logical_and(keep, jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + causal)
        if window is not None:
            d = jnp.arange(S)[None, :] - jnp.arange(T)[:, None] - window[2]  # [T, S]
            keep = jnp.logical_and(keep, jnp.logical_and(d >= -window[0], d <= window[1]))
        return jnp.einsum("TS,SC->TC", keep.astype(jnp.float32), bad.astype(jnp.float32)) > 0.0
    if t > 1 and s > 1:  # a general mask
        B = min(32, S)
        key_bad = jnp.any(bad, axis=1)  # [S]
        n_bad = jnp.sum(key_bad, dtype=jnp.int32)  # []
        ids = jnp.argsort(~key_bad, stable=True)  # [S], the keys holding a bad entry first
        ids = jnp.pad(ids, (0, -S % B))  # [whole chunks of B]

        def chunk(i, hit):
            idx = jax.lax.dynamic_slice_in_dim(ids, i * B, B)  # [B]
            cols = jnp.logical_and(mask[:, idx], (i * B + jnp.arange(B) < n_bad)[None, :])  # [T, B]
            if causal is not None:
                cols = jnp.logical_and(cols, idx[None, :] <= jnp.arange(T)[:, None] + causal)  # [T, B]
            if window is not None:
                d = idx[None, :] - jnp.arange(T)[:, None] - window[2]  # [T, B]
                cols = jnp.logical_and(cols, jnp.logical_and(d >= -window[0], d <= window[1]))  # [T, B]
            count = jnp.einsum("TB,BC->TC", cols.astype(jnp.float32), bad[idx].astype(jnp.float32))  # [T, C]
            return jnp.logical_or(hit, count > 0.0)

        return jax.lax.fori_loop(0, (n_bad + B - 1) // B, chunk, jnp.zeros((T, bad.shape[1]), bool))
    if mask is not None and s > 1:  # [1, S]: the same keys for every query
        bad = jnp.logical_and(bad, mask.reshape(S, 1))  # [S, C]
    if window is not None:  # keys [i + lo, i + hi] visible to query i
        left, right, offset = window  # Python ints
        lo = offset - left
        hi = offset + right if causal is None else min(offset + right, causal)
        n = hi - lo + 1  # keys in each query's range (before clipping to the keys)
        none = jnp.zeros_like(bad, shape=(T, bad.shape[1]))  # [T, C] False

        def any_in_range():
            # padded by False so that every query's range lies inside: key s is row s + front
            front, back = max(0, -lo), max(0, T - 1 + hi - (S - 1))
            y = jnp.pad(bad, ((front, back), (0, 0)))  # [M, C]
            M, w = y.shape[0], 1 << (n.bit_length() - 1)  # w: the largest power of 2 <= n

            def double(d, y):  # any over [s, s + d) -> any over [s, s + 2d)
                return y | jax.lax.dynamic_slice_in_dim(jnp.pad(y, ((0, M), (0, 0))), d, M)

            # y[s] = any bad in rows [s, s + w) (a sparse table's level); a range of n >= w rows is the
            # union of its first w rows and its last w
            y = jax.lax.fori_loop(0, n.bit_length() - 1, lambda i, y: double(2 ** i, y), y)  # [M, C]
            first = jax.lax.slice_in_dim(y, front + lo, front + lo + T)  # [T, C]
            last = jax.lax.slice_in_dim(y, front + hi - w + 1, front + hi - w + 1 + T)  # [T, C]
            return first | last

        # computed only when some value is bad, inside the cond, so that it costs nothing otherwise (under
        # vmap the cond becomes a select and both run); a range of no key (n <= 0) is never hit
        hit = none if n <= 0 else jax.lax.cond(jnp.any(bad), any_in_range, lambda: none)  # [T, C]
    elif causal is not None:  # key j visible to query i iff j <= i + causal: compare with a column's first bad key
        none = T + S + abs(causal)  # past every query: a column without a bad key is never hit
        first = jnp.min(jnp.where(bad, jnp.arange(S)[:, None], none), axis=0, initial=none)  # [C]
        hit = first[None, :] <= jnp.arange(T)[:, None] + causal  # [T, C]
    else:
        hit = jnp.any(bad, axis=0, keepdims=True)  # [1, C]
    if mask is not None and s == 1:  # [t, 1]: whole query rows kept or masked
        hit = jnp.logical_and(hit, mask)  # [T or 1, C]
    return hit


def compact_mask(mask: Array | None) -> Array | None:
    """A keep-mask broadcastable to ``[T, S]`` as ``[t, s]`` with ``t in {1, T}``, ``s in {1, S}``.

    The broadcast is NOT materialised: a padding mask ``[S]`` becomes ``[1, S]``, O(S) memory.
    """
    if mask is None:
        return None
    return mask.reshape((1,) * (2 - mask.ndim) + tuple(mask.shape))  # [t, s]


def per_head(x: Array | None, N: int, K: int) -> tuple[Array | None, int | None]:
    """A mask/bias broadcastable to ``[N, T, S]`` as ``[K, G, t, s]`` (vmapped) or ``[t, s]`` (shared).

    Returns ``(x, axis)``: the axis to map over (0, or None for a shared or absent ``x``).
    """
    if x is None:
        return None, None
    x = x.reshape((1,) * (3 - x.ndim) + tuple(x.shape))  # [n, t, s], n in {1, N}
    if x.shape[0] == 1:
        return x[0], None
    return x.reshape((K, N // K) + tuple(x.shape[1:])), 0


def group_query_heads(x: Array, K: int) -> Array:
    """``[T, N, X]`` -> ``[K, G, T, X]``: query head ``n = κ·G + g`` reads key/value head ``κ``."""
    T, N, X = x.shape
    return x.reshape(T, K, N // K, X).transpose(1, 2, 0, 3)  # [K, G, T, X]
