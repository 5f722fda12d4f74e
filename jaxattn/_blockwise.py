"""Blockwise (flash-style) attention: the exact result of :func:`jaxattn.attention` without a ``[T, S]`` buffer.

The score matrix ``scale · q kᵀ`` is where attention's quadratic cost is born. Its time is quadratic by
nature; its memory need not be (Rabe & Staats 2021, "Self-attention does not need O(n²) memory";
Dao et al. 2022/2023, FlashAttention 1 and 2). The queries are cut into blocks of ``block_q`` rows and
the keys into blocks of ``block_k``; for each query block a loop over key blocks keeps, per row,

  m   = the running maximum of the logits seen so far,
  l   = the running sum of ``exp(logit - m)``,
  acc = the running sum of ``exp(logit - m) · v``,

and rescales ``l`` and ``acc`` by ``exp(m_old - m_new)`` whenever the maximum grows (the online softmax).
At the end ``out = acc / l`` and ``lse = m + log l`` (the row log-sum-exp). Only one ``[block_q, block_k]``
tile of scores exists at a time.

The gradient is a ``jax.custom_vjp`` (FlashAttention-2's backward): the forward saves only ``q, k, v,
out, lse``; the backward recomputes every tile's weights exactly as ``p = exp(logit - lse)``, so the
memory of the gradient is O(T + S) too, instead of autodiff storing every tile of the loop.

With ``is_causal`` the tiles wholly above the diagonal are never computed (each step of the tile loops
runs its tile under a ``lax.cond``), tiles wholly below it run without any mask, and only the tiles the
diagonal crosses pay for a mask. The loops have static trip counts, so that the forward and the
backward are themselves differentiable in reverse mode (``jax.grad`` of ``jax.grad``). A padding mask
is kept in its broadcast shape (``[S]`` stays ``[S]``), so it costs O(S) memory, not O(T·S).

Axis alphabet as in :mod:`jaxattn._attention`: T queries, S keys, N query heads, K key/value heads,
G = N // K, H query/key head dim, V value head dim.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._backends import attend, check_implementation, choose_implementation
from jaxattn._checks import (
    as_float_array,
    check_attention_inputs,
    check_flag,
    check_int,
    check_logit_cap,
    check_multi_head_inputs,
    softmax_dtype,
)
from jaxattn._masks import check_window
from jaxattn._logits import compact_mask, group_query_heads, kept_nonfinite, per_head, scaled_logits, sech2, soft_cap
from jaxattn._typing import ArrayLike, Bool, Float, Int, Real

Array = jax.Array

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


# ----------------------------------------------------------------------------------------------------
# Static geometry of the tiling.
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The tiling of one head: static Python ints and flags, hashable (a ``custom_vjp`` static arg)."""

    T: int  # real number of queries
    S: int  # real number of keys
    bq: int  # query rows per tile
    bk: int  # keys per tile
    nq: int  # number of query blocks (T padded up to nq * bq)
    nk: int  # number of key blocks (S padded up to nk * bk)
    causal: bool
    has_mask: bool
    window: tuple[int, int] | None = None  # (left, right): query r sees key c iff r - left <= c <= r + right
    cap: float | None = None  # the logit soft cap c of c·tanh(x / c)
    band: tuple[int, int] | None = None  # (before, after): a windowed block's keys in one slice (see _band_forward)

    @property
    def full_k(self) -> int:
        """Key blocks holding no padding (the last block is padded when ``bk`` does not divide S)."""
        return self.S // self.bk


def _plan(T: int, S: int, block_q: int, block_k: int, causal: bool, has_mask: bool,
          window: tuple[int, int] | None = None, cap: float | None = None, band: bool | None = False) -> _Plan:
    """The tiling; ``band``: True runs a window as bands (:func:`_band_forward`), None when they are
    narrower than the keys (and there is no mask: the caller also passes False for a bias), False never."""
    bq = max(1, min(block_q, T))
    bk = max(1, min(block_k, S))
    if window is not None:  # no wider than the keys: the same mask, and the index arithmetic stays small
        window = (min(window[0], T + S), min(window[1], T + S))
    sides = None
    if window is not None and band is not False and not has_mask:
        right = min(window[1], 0) if causal else window[1]
        # whole query blocks before and after a block's own keys, so that key gradients add up block-wise
        sides = (-(-max(window[0], 0) // bq) * bq, -(-max(right, 0) // bq) * bq)
        if band is None and sum(sides) + bq >= S:  # no narrower than the keys: the tiles skip as much
            sides = None
    return _Plan(T, S, bq, bk, -(-T // bq), -(-S // bk), causal, has_mask, window, cap, sides)


def _min(a: Any, b: Any) -> Any:
    """``min`` of Python ints (the static trip counts), ``jnp.minimum`` of traced ones."""
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def _max(a: Any, b: Any) -> Any:
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def _clamp(x: Any, lo: Any, hi: Any) -> Any:
    return _min(_max(x, lo), hi)


def _ceil_div(a: Any, b: int) -> Any:
    return -((-a) // b)


def _k_range(plan: _Plan, i: Any) -> tuple[Any, Any, Any, Any]:
    """For query block ``i``: ``(lo, f_lo, f_hi, hi)``: key blocks ``[f_lo, f_hi)`` need no mask,
    ``[lo, f_lo)`` and ``[f_hi, hi)`` need one, the rest are skipped.

    Causal: key ``c`` is visible to row ``r`` iff ``c <= r``; blocks ``j >= hi`` lie wholly above the
    diagonal. A key block is mask-free for every row of block ``i`` iff every key of it is visible to
    every row of the block and it holds no padding (its last key ``(j+1)·bk - 1`` at most the block's
    first row ``i·bq``, causal). With a window ``(left, right)`` (query ``r`` sees ``[r - left, r + right]``)
    only the key blocks that hold a key some row of the block sees are visited, the ones wholly inside
    every row's window without a mask: the cost grows as T·W, not T·S. A user's mask makes every visited
    tile masked. ``i`` is a Python int (the bounds are then Python ints) or a traced index.
    """
    bq, bk = plan.bq, plan.bk
    first_row, last_row = i * bq, (i + 1) * bq - 1
    right = plan.window[1] if plan.window is not None else plan.nk * bk  # no window: past every key
    if plan.causal:
        right = 0 if plan.window is None else min(right, 0)
    lo = 0 if plan.window is None else _clamp((first_row - plan.window[0]) // bk, 0, plan.nk)
    hi = _clamp((last_row + right) // bk + 1, lo, plan.nk)  # past the last key some row sees
    if plan.has_mask:
        return lo, hi, hi, hi
    # free: (j+1)·bk - 1 <= first_row + right, no padding, and j·bk >= last_row - left
    f_hi = _clamp(_min((first_row + right + 1) // bk, plan.full_k), lo, hi)
    f_lo = lo if plan.window is None else _clamp(_ceil_div(last_row - plan.window[0], bk), lo, f_hi)
    return lo, f_lo, f_hi, hi


def _q_range(plan: _Plan, j: Any) -> tuple[Any, Any, Any, Any]:
    """For key block ``j``: ``(lo, f_lo, f_hi, hi)``: query blocks ``[f_lo, f_hi)`` need no mask,
    ``[lo, f_lo)`` and ``[f_hi, hi)`` need one, the rest are skipped.

    The transpose of :func:`_k_range`, so that the backward visits exactly the tiles the forward did,
    each with the same mask decision. ``j`` is a Python int or a traced index.
    """
    bq, bk = plan.bq, plan.bk
    first_key, last_key = j * bk, (j + 1) * bk - 1
    right = plan.window[1] if plan.window is not None else plan.nk * bk  # no window: past every key
    if plan.causal:
        right = 0 if plan.window is None else min(right, 0)
    left = plan.window[0] if plan.window is not None else plan.nq * bq + plan.nk * bk  # and before every row
    # rows r that see some key of the block: first_key - right <= r <= last_key + left
    lo = _clamp((first_key - right) // bq, 0, plan.nq)
    hi = _clamp((last_key + left) // bq + 1, lo, plan.nq)
    if plan.has_mask:
        return lo, hi, hi, hi
    # free: every row of block i sees every key: i·bq >= last_key - right and (i+1)·bq - 1 <= first_key + left
    f_lo = _clamp(_ceil_div(last_key - right, bq), lo, hi)
    f_hi = _clamp((first_key + left + 1) // bq, f_lo, hi)
    complete = (j + 1) * bk <= plan.S  # the block holds no padded key
    if isinstance(j, int):
        f_lo, f_hi = (f_lo, f_hi) if complete else (hi, hi)
    else:
        f_lo, f_hi = jnp.where(complete, f_lo, hi), jnp.where(complete, f_hi, hi)
    return lo, f_lo, f_hi, hi


def _loop_counts(plan: _Plan) -> tuple[tuple[int, int], tuple[int, int]]:
    """Static trip counts: the most key blocks any query block visits without and with a mask (forward),
    and the most query blocks any key block visits with and without a mask (backward)."""
    fwd = [_k_range(plan, i) for i in range(plan.nq)]
    bwd = [_q_range(plan, j) for j in range(plan.nk)]
    free = lambda ranges: max(f_hi - f_lo for _, f_lo, f_hi, _ in ranges)
    masked = lambda ranges: max((f_lo - lo) + (hi - f_hi) for lo, f_lo, f_hi, hi in ranges)
    return (free(fwd), masked(fwd)), (masked(bwd), free(bwd))


def _tied(index: Any, data: Any) -> tuple[Any, Any]:
    """``(index, data)`` through an optimization barrier: to JAX's partial evaluation, the tile index is
    then as unknown as the tile's data.

    When ``jax.grad`` differentiates a scan around this function (the map over heads, a user's scan over
    layers), the scan's partial evaluation hoists out of the loop everything that depends only on values
    it knows, storing it per step: the tile index is such a value (it comes from ``arange`` and a loop
    counter), and with it the tile's keep-mask and the cond's predicate, which would be stored as
    ``[steps, bq, bk]`` arrays (O(T·S) memory in the gradient, and slower). Tied to the data, they are
    computed inside the tile. The barrier computes nothing at run time.
    """
    return jax.lax.optimization_barrier((index, data))


def _tile_loop(lo: Any, hi: Any, count: int, body, carry, local=None, gap=None):
    """``carry = body(j, carry)`` for ``j`` in ``[lo, hi)`` (less ``[gap_lo, gap_hi)`` with ``gap``), in a
    loop with a static trip count.

    Python-int bounds give ``fori_loop``s. Traced bounds (causal, padding, windows) give ``count`` steps,
    at least the number of ``j`` to visit, each running ``body`` under a ``lax.cond`` only if ``j < hi``:
    a skipped tile costs a predicate, never its matmuls. Static trip counts make the loops differentiable
    in reverse mode, so that the ``custom_vjp``'s forward and backward can themselves be differentiated
    (``jax.grad`` of ``jax.grad``); a traced trip count makes a ``while_loop``, which reverse mode refuses.

    ``local = (take, put)``: ``body`` sees only ``take(j, carry)`` and ``put(j, carry, result)`` writes it
    back, outside the cond, so that a large accumulator is never an operand of the cond.
    """
    take, put = local or ((lambda j, carry: carry), (lambda j, carry, part: part))
    gap_lo, gap_hi = gap if gap is not None else (hi, hi)
    if all(isinstance(x, int) for x in (lo, hi, gap_lo, gap_hi)):

        def plain(j, carry):
            j_data, part = _tied(j, take(j, carry))
            return put(j, carry, body(j_data, part))

        carry = jax.lax.fori_loop(lo, gap_lo, plain, carry)
        return jax.lax.fori_loop(gap_hi, hi, plain, carry)

    def step(t, carry):
        j = lo + t
        if gap is not None:
            j = jnp.where(j >= gap_lo, j + (gap_hi - gap_lo), j)
        j_data, part = _tied(j, take(j, carry))
        part = jax.lax.cond(j_data < hi, body, lambda j, part: part, j_data, part)
        return put(j, carry, part)

    return jax.lax.fori_loop(0, count, step, carry)


def _tile_keep(plan: _Plan, mask: Array | None, i: Any, j: Any) -> Array:
    """The keep-mask of tile ``(i, j)``: ``[bq, bk]`` bool (causal, key padding and the user's mask)."""
    rows = i * plan.bq + jnp.arange(plan.bq)  # [bq]
    cols = j * plan.bk + jnp.arange(plan.bk)  # [bk]
    # Causal, the window and key padding keep one interval of keys per row, [first, last]: two compares
    # per entry of the tile, the rest per row.
    last = jnp.full((plan.bq,), plan.S - 1)  # [bq], padded keys dropped
    if plan.causal:
        last = jnp.minimum(last, rows)  # [bq]
    if plan.window is not None:
        last = jnp.minimum(last, rows + plan.window[1])  # [bq]
        first = rows - plan.window[0]  # [bq]
        keep = jnp.logical_and(cols[None, :] >= first[:, None], cols[None, :] <= last[:, None])  # [bq, bk]
    else:
        keep = cols[None, :] <= last[:, None]  # [bq, bk]
    if mask is not None:
        tm, sm = mask.shape
        tile = mask
        if tm > 1:
            tile = jax.lax.dynamic_slice_in_dim(tile, i * plan.bq, plan.bq, axis=0)  # [bq, sm]
        if sm > 1:
            tile = jax.lax.dynamic_slice_in_dim(tile, j * plan.bk, plan.bk, axis=1)  # [., bk]
        keep = jnp.logical_and(keep, tile)  # [bq, bk]
    return keep


# ----------------------------------------------------------------------------------------------------
# Forward: online softmax over key blocks, one query block at a time.
# ----------------------------------------------------------------------------------------------------


def _bias_tile(bias: Array, plan: _Plan, i: Any, j: Any) -> Array:
    """Tile ``(i, j)`` of a bias ``[t, s]`` (``t in {1, Tp}``, ``s in {1, Sp}``): ``[bq or 1, bk or 1]``."""
    tile = bias
    if bias.shape[0] > 1:
        tile = jax.lax.dynamic_slice_in_dim(tile, i * plan.bq, plan.bq, axis=0)
    if bias.shape[1] > 1:
        tile = jax.lax.dynamic_slice_in_dim(tile, j * plan.bk, plan.bk, axis=1)
    return tile


def _forward(q: Array, k: Array, v: Array, mask: Array | None, bias: Array | None, scale: Array,
             plan: _Plan) -> tuple[Array, Array]:
    """Padded inputs (q ``[nq·bq, H]``, k ``[nk·bk, H]``, v ``[nk·bk, V]``, bias ``[t, s]`` or None) ->
    ``(out [nq·bq, V], lse [nq·bq])``."""
    # Non-finite inputs (see blockwise_attention): a non-finite entry of q or k becomes NaN, so that its
    # logits are NaN (a masked one is replaced by the fill, a kept one makes the row NaN, as in the dense
    # core); v is summed with its non-finite entries zeroed (a masked key's weight is 0, and 0 · NaN would
    # be NaN), and the outputs that keep one are set to NaN at the end (``hit``).
    k_in, v_in = k, v  # the bands clean theirs per slice (see _band_forward)
    q = jnp.where(jnp.isfinite(q), q, jnp.nan)  # [Tp, H]
    k = jnp.where(jnp.isfinite(k), k, jnp.nan)  # [Sp, H]
    v_bad = ~jnp.isfinite(v)  # [Sp, V]
    v = jnp.where(v_bad, 0, v)  # [Sp, V]
    # float32/64 inputs: q scaled once, so that no tile pays a [bq, bk] multiply. bf16/fp16 inputs: each
    # tile's float32 product is scaled in float32 (as the dense core does), never the scale rounded to
    # the input dtype (which overflows fp16 at scale·q > 65504 and loses the scale's precision).
    pre = q.dtype == scale.dtype
    if pre:
        q = _scaled(q, scale)  # [Tp, H]
    if plan.band is not None:
        out, lse = _band_forward(q, k_in, v_in, scale, plan, pre)  # [Tp, V], [Tp]
    else:
        out, lse = _tile_forward(q, k, v, mask, bias, scale, plan, pre)  # [Tp, V], [Tp]
    window = None if plan.window is None else (*plan.window, 0)
    hit = kept_nonfinite(mask, 0 if plan.causal else None, plan.nq * plan.bq, plan.nk * plan.bk, v_bad, window)  # [Tp or 1, V], no [T, S] buffer
    return jnp.where(hit, jnp.nan, out), lse


def _tile_forward(q, k, v, mask, bias, scale, plan: _Plan, pre: bool) -> tuple[Array, Array]:
    """The online softmax over the visited key blocks of each query block: ``(out [Tp, V], lse [Tp])``."""
    acc_dtype = scale.dtype
    fill = jnp.finfo(acc_dtype).min  # finite: a fully masked row keeps m = fill and never makes NaN
    bq, bk, V = plan.bq, plan.bk, v.shape[1]
    (n_free, n_masked), _ = _loop_counts(plan)

    def q_block(i, qb):  # qb [bq, H]
        i, qb = _tied(i, qb)  # see _tied

        def tile(j, carry, masked):
            m, l, acc = carry  # [bq], [bq], [bq, V]
            kb = jax.lax.dynamic_slice_in_dim(k, j * bk, bk)  # [bk, H]
            vb = jax.lax.dynamic_slice_in_dim(v, j * bk, bk).astype(acc_dtype)  # [bk, V]
            s = jnp.einsum("TH,SH->TS", qb, kb, preferred_element_type=acc_dtype)  # [bq, bk], scaled logits
            if not pre:
                s = s * scale  # [bq, bk]
            if bias is not None:
                s = s + _bias_tile(bias, plan, i, j).astype(acc_dtype)  # [bq, bk]
            s = soft_cap(s, plan.cap)  # [bq, bk]
            if masked:
                keep = _tile_keep(plan, mask, i, j)  # [bq, bk]
                s = jnp.where(keep, s, fill)  # [bq, bk]
            m_new = jnp.maximum(m, jnp.max(s, axis=1))  # [bq]
            p = jnp.exp(s - m_new[:, None])  # [bq, bk]
            if masked:
                p = jnp.where(keep, p, 0.0)  # [bq, bk]
            alpha = jnp.exp(m - m_new)  # [bq], rescales what was summed under the old maximum
            l = alpha * l + jnp.sum(p, axis=1)  # [bq]
            acc = alpha[:, None] * acc + jnp.einsum("TS,SV->TV", p, vb)  # [bq, V]
            return m_new, l, acc

        lo, f_lo, f_hi, hi = _k_range(plan, i)
        # initial values made from the data, so that they carry its sharding (heads split over devices)
        zero = jnp.zeros_like(qb[:, 0], acc_dtype)  # [bq]
        carry = (zero + fill, zero, jnp.broadcast_to(zero[:, None], (bq, V)))
        carry = _tile_loop(f_lo, f_hi, n_free, functools.partial(tile, masked=False), carry)
        carry = _tile_loop(lo, hi, n_masked, functools.partial(tile, masked=True), carry, gap=(f_lo, f_hi))
        m, l, acc = carry
        empty = l == 0.0  # [bq], a row with no kept key
        l1 = jnp.where(empty, 1.0, l)  # [bq]; the double where keeps log 0 out of the gradient (0 · inf)
        out = acc / l1[:, None]  # [bq, V]; a row with no kept key gives 0
        lse = jnp.where(empty, -jnp.inf, m + jnp.log(l1))  # [bq]; log 0 = -inf for a row with no kept key
        return out, lse

    def scan_body(_, xs):
        i, qb = xs
        return None, q_block(i, qb)

    qs = q.reshape(plan.nq, bq, q.shape[1])  # [nq, bq, H]
    _, (out, lse) = jax.lax.scan(scan_body, None, (jnp.arange(plan.nq), qs))  # [nq, bq, V], [nq, bq]
    return out.reshape(plan.nq * bq, V), lse.reshape(plan.nq * bq)


# ----------------------------------------------------------------------------------------------------
# Bands: a window's keys of a query block in one slice.
# ----------------------------------------------------------------------------------------------------
#
# Under a window narrower than the keys, query block i sees keys [i·bq - before, i·bq + bq + after) at
# most (``plan.band = (before, after)``, whole blocks): one slice of L = before + bq + after keys, so one
# [bq, L] product and one softmax per block instead of an online softmax over small tiles, and the few
# masked logits of the band's two corners are the only waste (a fifth of them for a causal window of 4
# blocks). GROUP blocks make each step of a scan, so the loop is short (the forward's written out on CPU,
# vmapped elsewhere: :func:`_each_block`; the backward's vmapped). The backward goes by key blocks, over
# the mirror image of these bands (each key block's queries in one slice, see _band_backward).

_GROUP = 8  # query blocks per step of the band's scan


def _band_geometry(plan: _Plan) -> tuple[int, int, int, int]:
    """``(L, G, ng, Tg)``: the band's keys per block, blocks per step, steps, and the rows they cover."""
    before, after = plan.band
    G = min(_GROUP, plan.nq)
    ng = -(-plan.nq // G)
    return before + plan.bq + after, G, ng, ng * G * plan.bq


def _band_keep(plan: _Plan, i: Any, start: Any = None) -> Array:
    """Query block ``i``'s keep-mask over its band: ``[bq, L]`` bool (the window, causal, real keys).

    Row ``r``, column ``c`` is key ``start + c``. Without ``start`` it is ``i·bq - before`` (a padded
    layout, :func:`_band_keys`): the window and causality depend on ``c - r`` alone (one static mask for
    every block), the keys before 0 and past S on the block (one [L] compare). With it (a slice clamped
    to the keys, :func:`_band_forward`), the comparisons run on the band's own offsets."""
    before, after = plan.band
    L = before + plan.bq + after
    right = min(plan.window[1], 0) if plan.causal else plan.window[1]
    if start is not None:
        key = start + jnp.arange(L)  # [L]
        offset = key[None, :] - (i * plan.bq + jnp.arange(plan.bq))[:, None]  # [bq, L]: key - query
        keep = (offset >= -plan.window[0]) & (offset <= right)  # [bq, L]
        return jnp.logical_and(keep, (key < plan.S)[None, :])  # [bq, L]
    offset = np.arange(L)[None, :] - np.arange(plan.bq)[:, None] - before  # [bq, L]: key - query
    static = (offset >= -plan.window[0]) & (offset <= right)  # [bq, L]
    key = i * plan.bq - before + jnp.arange(L)  # [L]
    return jnp.logical_and(static, ((key >= 0) & (key < plan.S))[None, :])  # [bq, L]


def _band_keys(x: Array, plan: _Plan) -> Array:
    """``x [Sp, F]``, the rows a band slices (the queries', for the backward's :func:`_band_mirror`), with
    zero rows before row 0 and past the last, as far as the bands reach."""
    L, G, ng, Tg = _band_geometry(plan)
    before, after = plan.band
    n = before + Tg + after  # the keys the bands reach, from key -before
    x = x[:n - before]
    return jnp.pad(x, ((before, n - before - x.shape[0]), (0, 0)))  # [n, F]


def _band_slices(x: Array, i: Array, plan: _Plan) -> Array:
    """Blocks ``i``'s bands of :func:`_band_keys`' ``x``: ``[G, L, F]`` (a slice each)."""
    L = sum(plan.band) + plan.bq
    return jax.vmap(lambda i: jax.lax.dynamic_slice_in_dim(x, i * plan.bq, L))(i)  # [G, L, F]


def _band_mirror(plan: _Plan, Sp: int) -> _Plan:
    """The bands of the transposed problem, for the backward's key-major order: key block ``j``'s queries
    ``[j·bq - after, j·bq + bq + before)`` in one slice (``Sp``: the padded key count). Its rows are the
    keys and its band's keys the queries, so :func:`_band_keep` gives ``[bq, L]`` over (key, query)."""
    right = min(plan.window[1], 0) if plan.causal else plan.window[1]
    before, after = plan.band
    return dataclasses.replace(plan, T=plan.S, S=plan.T, nq=-(-Sp // plan.bq), causal=False,
                               window=(right, plan.window[0]), band=(after, before))


def _band_rows(x: Array, plan: _Plan) -> Array:
    """Query-side ``x [Tp, ...]`` -> ``[ng, G, bq, ...]`` (zero rows past Tp)."""
    L, G, ng, Tg = _band_geometry(plan)
    return _pad_rows(x, Tg).reshape(ng, G, plan.bq, *x.shape[1:])


def _each_block(block, *xs: Array) -> Any:
    """``block`` over the leading axis of ``xs`` (a step's G blocks): one ``jax.vmap`` (batched products),
    except on CPU, where the blocks are written out: XLA's CPU backend runs G products of 2-D operands
    faster than one batched product (the windowed forward at T = 16,384: 19-21 ms against 24-26 ms, see
    docs/blockwise.md), at about twice the compilation time of the vmapped step."""
    def written_out(*xs):
        outs = [block(*(x[g] for x in xs)) for g in range(xs[0].shape[0])]
        return jax.tree.map(lambda *ys: jnp.stack(ys), *outs)

    return jax.lax.platform_dependent(*xs, cpu=written_out, default=jax.vmap(block))


def _band_forward(q, k, v, scale, plan: _Plan, pre: bool) -> tuple[Array, Array]:
    """``(out [Tp, V], lse [Tp])`` by bands: one softmax over each block's band (no online rescaling).

    ``k`` and ``v`` come as the caller has them: each band is a slice of the keys themselves, clamped to
    them at the ends (its keep-mask says which keys it holds), and zeroes or NaNs its own non-finite
    entries, so that no padded or cleaned copy of the keys exists (see :func:`_band_backward` on memory).
    """
    acc_dtype = scale.dtype
    fill = jnp.finfo(acc_dtype).min
    L, G, ng, Tg = _band_geometry(plan)
    k, v = _pad_rows(k, max(L, k.shape[0])), _pad_rows(v, max(L, v.shape[0]))  # a band no longer than the keys
    last = k.shape[0] - L  # the last start a slice of L keys has

    def block(i, qb, start):  # [bq, H], []
        kb, vb = (jax.lax.dynamic_slice_in_dim(x, start, L) for x in (k, v))  # [L, H], [L, V]
        kb = jnp.where(jnp.isfinite(kb), kb, jnp.nan)  # as _forward does
        vb = jnp.where(jnp.isfinite(vb), vb, 0)
        s = jnp.einsum("TH,SH->TS", qb, kb, preferred_element_type=acc_dtype)  # [bq, L]
        if not pre:
            s = s * scale
        s = jnp.where(_band_keep(plan, i, start), soft_cap(s, plan.cap), fill)  # [bq, L]
        m = jnp.maximum(jnp.max(s, axis=1), fill)  # [bq]: at least the fill, as the tiles' running maximum
        p = jnp.exp(s - m[:, None])  # [bq, L]: a masked entry's exp(fill - m) is 0 unless the row is empty
        # a row with no kept key, or whose kept logits are all -inf (its maximum is the fill), gives 0 and
        # lse -inf, as the tiles do
        empty = m == fill  # [bq]
        l1 = jnp.where(empty, 1.0, jnp.sum(p, axis=1))  # [bq]
        out = jnp.einsum("TS,SV->TV", p, vb.astype(acc_dtype)) / l1[:, None]  # [bq, V]
        return jnp.where(empty[:, None], 0.0, out), jnp.where(empty, -jnp.inf, m + jnp.log(l1))

    def step(_, xs):
        i, qg = _tied(*xs)  # see _tied
        start = jnp.clip(i * plan.bq - plan.band[0], 0, last)  # [G]
        return None, _each_block(block, i, qg, start)

    i = jnp.arange(ng * G).reshape(ng, G)
    _, (out, lse) = jax.lax.scan(step, None, (i, _band_rows(q, plan)))
    Tp = plan.nq * plan.bq
    return out.reshape(Tg, -1)[:Tp], lse.reshape(Tg)[:Tp]


def _band_backward(q_s, k, v, d_out, D, lse, scale, plan: _Plan, pre: bool) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` as :func:`_backward`'s tiles give them (dq unscaled), key block by key block.

    Each key block's queries are one slice (:func:`_band_mirror`), so that a key block's dk and dv are one
    product each over its L queries (the longest products of the backward, and nothing to add up), and
    the queries' dq, whose slices overlap, is added into a carried buffer by whole query blocks. ``k``
    and ``v`` come as the caller has them: each block zeroes its own non-finite entries. Nothing is
    stacked per step but dk and dv themselves, and no cleaned copy of k and v exists: the program's
    memory stays small (on XLA's CPU backend, a temporary buffer above glibc's 32 MiB mmap threshold is
    fresh memory, page-faulted anew, on every call).
    """
    acc_dtype = scale.dtype
    Sp, Tp, H = k.shape[0], q_s.shape[0], q_s.shape[1]
    mirror = _band_mirror(plan, Sp)
    L, G, ng, Tg = _band_geometry(mirror)
    C = L // plan.bq  # query blocks in a key block's slice

    def block(j, kb, vb, qb, dob, lse_b, D_b):  # [bq, H], [bq, V], [L, H], [L, V], [L], [L]
        kb, vb = (jnp.where(jnp.isfinite(x), x, 0) for x in (kb, vb))  # as _backward_operands does
        s = jnp.einsum("SH,TH->ST", kb, qb, preferred_element_type=acc_dtype)  # [bq, L]
        if not pre:
            s = s * scale
        if plan.cap is not None:
            u = s / plan.cap
            s, d_cap = plan.cap * jnp.tanh(u), sech2(u)
        # keys past S get no weight (their dq part would be 0 times an overflow), nor do the slice's rows
        # outside the queries
        real = j * plan.bq + jnp.arange(plan.bq) < plan.S  # [bq]
        keep = jnp.logical_and(_band_keep(mirror, j), real[:, None])  # [bq, L]
        p = jnp.where(keep, jnp.exp(s - lse_b[None, :]), 0.0)  # [bq, L], the forward's weights
        dv = jnp.einsum("ST,TV->SV", p, dob)  # [bq, V]
        dp = jnp.einsum("SV,TV->ST", vb.astype(acc_dtype), dob)  # [bq, L]
        ds = p * (dp - D_b[None, :])  # [bq, L]
        if plan.cap is not None:
            ds = ds * d_cap
        dk = jnp.einsum("ST,TH->SH", ds, qb, preferred_element_type=acc_dtype)  # [bq, H]
        ds_t = jax.lax.optimization_barrier(ds.T)  # [L, bq]: one copy (see _backward)
        dq = jnp.einsum("TS,SH->TH", ds_t, kb, preferred_element_type=acc_dtype)  # [L, H]
        return dq, dk, dv

    rows = tuple(_band_keys(x, mirror) for x in (q_s, d_out, jnp.stack([lse, D], axis=1)))  # from query -after

    def step(dq, xs):  # dq [ng·G + C - 1, bq, H]: query blocks from query -after
        j, (kg, vg) = _tied(xs[0], xs[1:])  # see _tied
        qb, dob, ld = (_band_slices(x, j, mirror) for x in rows)  # [G, L, ...]
        parts, dk, dv = jax.vmap(block)(j, kg, vg, qb, dob, ld[..., 0], ld[..., 1])  # [G, L, H], [G, bq, ..]
        parts = parts.reshape(G, C, plan.bq, H)
        total = jax.lax.dynamic_slice_in_dim(dq, j[0], G + C - 1)  # the step's query blocks
        for c in range(C):  # key block j's c-th query block is the step's block (j - j[0]) + c
            total = total.at[c:c + G].add(parts[:, c])
        return jax.lax.dynamic_update_slice_in_dim(dq, total, j[0], 0), (dk, dv)

    j = jnp.arange(ng * G).reshape(ng, G)
    dq = jnp.zeros((ng * G + C - 1, plan.bq, H), acc_dtype)
    dq, (dk, dv) = jax.lax.scan(step, dq, (j, _band_rows(k, mirror), _band_rows(v, mirror)))
    dq = dq.reshape(-1, H)[mirror.band[0]:][:Tp]  # from query 0
    return _pad_rows(dq, Tp), dk.reshape(Tg, -1)[:Sp], dv.reshape(Tg, -1)[:Sp]


# ----------------------------------------------------------------------------------------------------
# Backward: FlashAttention-2, recomputing each tile's weights from the saved lse.
# ----------------------------------------------------------------------------------------------------


def _backward(q, k, v, mask, scale, out, lse, d_out, d_lse, plan: _Plan, bias=None):
    """Cotangents ``(dq, dk, dv, dscale, dbias)`` of ``(out, lse)`` -> inputs, one key block at a time
    (``dbias`` None without a bias; else in the bias's compact shape ``[t, s]``).

    ``out`` and ``lse`` need not come from this tile set: given the ``out`` and ``lse`` of attention over
    a larger key set (ring attention's global ones), this is that attention's gradient restricted to
    these keys (dq summed over them). Returned in the accumulation dtype.

    With ``p = exp(s - lse)`` the tile's weights and ``D = rowsum(d_out · out) - d_lse``:
    ``dv += pᵀ d_out``, ``dp = d_out vᵀ``, ``ds = p · (dp - D)`` (the softmax's Jacobian, plus
    ``d lse / d s = p``), ``dq += scale · ds k``, ``dk += scale · dsᵀ q``, ``dscale = Σ q · (ds k)``.
    """
    acc_dtype = scale.dtype
    bq, bk = plan.bq, plan.bk
    H, V = q.shape[1], v.shape[1]
    k_in, v_in = k, v  # the bands zero their non-finite entries per block (see _band_backward)
    q, k, v, d_out, D, lse = _backward_operands(q, k, v, out, lse, d_out, d_lse, acc_dtype)
    pre = q.dtype == acc_dtype  # as in _forward: bf16/fp16 tiles scale their float32 product instead
    q_s = _scaled(q, scale) if pre else q  # [Tp, H]
    if plan.band is not None:
        dq, dk, dv = _band_backward(q_s, k_in, v_in, d_out, D, lse, scale, plan, pre)  # [Tp, H], [Sp, H], [Sp, V]
        return _backward_end(q, dq, dk, dv, scale, pre, None)
    _, (n_masked_b, n_free_b) = _loop_counts(plan)
    dq_rows = _dq_rows(bq, bias)
    per_key = bias is not None and bias.shape[1] > 1  # the bias has a key axis (not sb > 1: sb = bk may be 1)
    tb, sb = (1, 1) if bias is None else (bias.shape[0], bk if per_key else 1)  # dbias: [tb, sb] a key block

    def k_block(j, dq, kb, vb):  # kb [bk, H], vb [bk, V]
        j, (kb, vb) = _tied(j, (kb, vb))  # see _tied
        vb32 = vb.astype(acc_dtype)  # [bk, V]

        def tile(i, carry, masked):
            dq_b, dk, dv, db = carry  # [bq, H], [bk, H], [bk, V], [bq or 1, sb]
            qb = jax.lax.dynamic_slice_in_dim(q_s, i * bq, bq)  # [bq, H], scaled
            dob = jax.lax.dynamic_slice_in_dim(d_out, i * bq, bq)  # [bq, V]
            lse_b = jax.lax.dynamic_slice_in_dim(lse, i * bq, bq)  # [bq]
            D_b = jax.lax.dynamic_slice_in_dim(D, i * bq, bq)  # [bq]
            # The tile transposed, [bk, bq], so that the products are plain row-major matmuls; dq needs
            # dsᵀ, made by one explicit copy (the barrier stops XLA folding the transpose back into a
            # transposed-operand dot, which its CPU backend runs ~2x slower than copy + plain dot).
            s = jnp.einsum("SH,TH->ST", kb, qb, preferred_element_type=acc_dtype)  # [bk, bq], scaled logits
            if not pre:
                s = s * scale  # [bk, bq]
            if bias is not None:
                s = s + _bias_tile(bias, plan, i, j).astype(acc_dtype).T  # [bk, bq]
            if plan.cap is not None:  # c·tanh(s/c), and its derivative sech² for ds below
                u = s / plan.cap  # [bk, bq]
                s, d_cap = plan.cap * jnp.tanh(u), sech2(u)  # [bk, bq], [bk, bq]
            p = jnp.exp(s - lse_b[None, :])  # [bk, bq], the forward's weights (transposed), exactly
            if masked:
                p = jnp.where(_tile_keep(plan, mask, i, j).T, p, 0.0)  # [bk, bq]
            dv = dv + jnp.einsum("ST,TV->SV", p, dob)  # [bk, V]
            dp = jnp.einsum("SV,TV->ST", vb32, dob)  # [bk, bq]
            ds = p * (dp - D_b[None, :])  # [bk, bq]
            if plan.cap is not None:
                ds = ds * d_cap  # [bk, bq], through the cap
            ds_t = jax.lax.optimization_barrier(ds.T)  # [bq, bk]
            dq_b = dq_b + jnp.einsum("TS,SH->TH", ds_t, kb, preferred_element_type=acc_dtype)  # [bq, H]
            dk = dk + jnp.einsum("ST,TH->SH", ds, qb, preferred_element_type=acc_dtype)  # [bk, H], = scale·dsᵀq if pre
            if bias is not None:  # the bias's cotangent is ds, summed over the axes it broadcasts along
                db_tile = ds_t if tb > 1 else jnp.sum(ds_t, axis=0, keepdims=True)  # [bq or 1, bk]
                db = db + (db_tile if per_key else jnp.sum(db_tile, axis=1, keepdims=True))  # [bq or 1, sb]
            return dq_b, dk, dv, db

        lo, f_lo, f_hi, hi = _q_range(plan, j)
        db0 = jnp.zeros_like(kb, acc_dtype, shape=(tb, sb))  # this key block's column of dbias
        carry = (dq, jnp.zeros_like(kb, acc_dtype), jnp.zeros_like(vb, acc_dtype), db0)  # (made from the data: see _forward)
        carry = _tile_loop(lo, hi, n_masked_b, functools.partial(tile, masked=True), carry, dq_rows, gap=(f_lo, f_hi))
        carry = _tile_loop(f_lo, f_hi, n_free_b, functools.partial(tile, masked=False), carry, dq_rows)
        return carry

    def scan_body(dq, xs):
        j, kb, vb = xs
        dq, dk, dv, db = k_block(j, dq, kb, vb)
        return dq, (dk, dv, db)

    ks = k.reshape(plan.nk, bk, H)  # [nk, bk, H]
    vs = v.reshape(plan.nk, bk, V)  # [nk, bk, V]
    dq0 = jnp.zeros_like(q, acc_dtype)  # [Tp, H], unscaled
    dq, (dk, dv, db) = jax.lax.scan(scan_body, dq0, (jnp.arange(plan.nk), ks, vs))  # [Tp, H], [nk, bk, H], [nk, bk, V], [nk, tb, sb]
    if bias is None:
        d_bias = None
    elif per_key:
        d_bias = db.transpose(1, 0, 2).reshape(tb, plan.nk * bk)  # [tb, Sp]
    else:
        d_bias = jnp.sum(db, axis=0)  # [tb, 1]
    return _backward_end(q, dq, dk.reshape(plan.nk * bk, H), dv.reshape(plan.nk * bk, V), scale, pre, d_bias)


def _backward_end(q, dq, dk, dv, scale, pre, d_bias):
    """``(dq, dk, dv, dscale, dbias)`` from the sums over tiles (dq unscaled, dk unscaled unless ``pre``)."""
    d_scale = jnp.sum(dq * q.astype(scale.dtype))  # Σ_ij ds_ij (q_i · k_j)
    dq = dq * scale  # [Tp, H]
    if not pre:
        dk = dk * scale  # [Sp, H], = scale·dsᵀq
    return dq, dk, dv, d_scale, d_bias


def _backward_operands(q, k, v, out, lse, d_out, d_lse, acc_dtype):
    """What :func:`_backward` multiplies: ``(q, k, v, d_out, D, lse)``, with ``D = rowsum(d_out · out) - d_lse``.

    Non-finite inputs: the products run on q, k, v with their non-finite entries zeroed, so that a masked
    one (weight 0) never reaches a gradient as 0 · NaN. The outputs the forward set to NaN (a kept
    non-finite input) have their cotangent dropped, and a NaN row (NaN lse) gets p = exp(s - inf) = 0.
    """
    q = jnp.where(jnp.isfinite(q), q, 0)  # [Tp, H]
    k = jnp.where(jnp.isfinite(k), k, 0)  # [Sp, H]
    v = jnp.where(jnp.isfinite(v), v, 0)  # [Sp, V]
    marked = jnp.isnan(out)  # [Tp, V]
    d_out = jnp.where(marked, 0.0, d_out.astype(acc_dtype))  # [Tp, V]
    out = jnp.where(marked, 0.0, out.astype(acc_dtype))  # [Tp, V]
    d_lse = jnp.where(jnp.isnan(lse), 0.0, d_lse)  # [Tp]
    D = jnp.sum(d_out * out, axis=1) - d_lse  # [Tp]
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)  # rows with no kept key: every p is masked to 0 anyway
    lse = jnp.where(jnp.isnan(lse), jnp.inf, lse)  # [Tp]
    return q, k, v, d_out, D, lse


def _dq_rows(bq: int, bias: Array | None = None):
    """``(take, put)`` for :func:`_tile_loop`: query block ``i``'s rows of dq (and of the key block's column
    of dbias, when the bias has rows) go in and out of the (possibly skipped) tile alone, with the key
    block's ``dk``, ``dv``; the whole ``dq [Tp, H]`` never enters the cond."""
    rows = bias is not None and bias.shape[0] > 1

    def take(i, carry):
        dq, dk, dv, db = carry
        if rows:
            db = jax.lax.dynamic_slice_in_dim(db, i * bq, bq)  # [bq, sb]
        return jax.lax.dynamic_slice_in_dim(dq, i * bq, bq), dk, dv, db  # [bq, H], [bk, H], [bk, V], ...

    def put(i, carry, part):
        dq_b, dk, dv, db = part
        if rows:
            db = jax.lax.dynamic_update_slice_in_dim(carry[3], db, i * bq, axis=0)  # [Tp, sb]
        return jax.lax.dynamic_update_slice_in_dim(carry[0], dq_b, i * bq, axis=0), dk, dv, db  # [Tp, H], ...

    return take, put


# ----------------------------------------------------------------------------------------------------
# The custom_vjp that ties them together.
# ----------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, mask, bias, scale, plan):
    return _forward(q, k, v, mask, bias, scale, plan)


def _flash_fwd(q, k, v, mask, bias, scale, plan):
    out, lse = _forward(q, k, v, mask, bias, scale, plan)
    return (out, lse), (q, k, v, mask, bias, scale, out, lse)


def _flash_bwd(plan, residuals, cotangents):
    q, k, v, mask, bias, scale, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv, d_scale, d_bias = _backward(q, k, v, mask, scale, out, lse, d_out, d_lse, plan, bias)
    d_bias = None if bias is None else d_bias.astype(bias.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, d_bias, d_scale


_flash.defvjp(_flash_fwd, _flash_bwd)


def _scaled(q: Array, scale: Array) -> Array:
    """``scale · q`` in q's dtype: one ``[T, H]`` multiply instead of one per ``[bq, bk]`` tile.

    Only for q in the accumulation dtype (float32/64): in bf16/fp16 it would round the scale and scale·q.
    """
    return (q * scale.astype(q.dtype)).astype(q.dtype)


def _axis_is_sharded(x: Array, axis: int) -> bool:
    """Whether ``x``'s axis is split over devices in its (explicit-sharding) type."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return spec is not None and len(spec) > axis and spec[axis] is not None


def _heads_side_by_side(q: Array, k: Array) -> bool:
    """Whether to vmap the heads (side by side) rather than map them one after another.

    One after another (a scan) keeps each head's tiles in cache on a CPU, but a scan cannot run on an
    axis split over devices: XLA would gather the heads onto every device, and the output would lose the
    input's head sharding. So the heads are vmapped when their axis is split in the inputs' (explicit
    sharding) types, and whenever the process has more than one device, since under ``jit`` with
    automatic sharding the inputs' placement is not visible while tracing. On a GPU or TPU they are
    vmapped too: there each step of a loop costs a launch sequence whatever its size, and side by side
    the heads take one loop's steps instead of one loop per head. The two orders compute each head the
    same way.
    """
    return (_axis_is_sharded(q, 1) or _axis_is_sharded(k, 1) or jax.device_count() > 1
            or jax.default_backend() != "cpu")


def _pad_rows(x: Array, n: int) -> Array:
    """``x`` with its first axis padded by zeros (or False) up to ``n``."""
    extra = n - x.shape[0]
    if extra == 0:
        return x
    return jnp.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1))


def _pad_compact(x: Array | None, Tp: int, Sp: int) -> Array | None:
    """A ``[t, s]`` mask or bias padded with False or 0 along the axes it does not broadcast."""
    if x is not None:
        if x.shape[0] > 1:
            x = _pad_rows(x, Tp)  # [Tp, s]
        if x.shape[1] > 1:
            x = _pad_rows(x.T, Sp).T  # [t, Sp]
    return x


def _padded(q, k, v, mask, plan: _Plan):
    """q, k, v padded with zero rows to whole blocks; the mask padded with False (padded keys not kept)."""
    Tp, Sp = plan.nq * plan.bq, plan.nk * plan.bk
    qp, kp, vp = _pad_rows(q, Tp), _pad_rows(k, Sp), _pad_rows(v, Sp)  # [Tp, H], [Sp, H], [Sp, V]
    return qp, kp, vp, _pad_compact(mask, Tp, Sp)


def _blockwise(q, k, v, mask, scale, is_causal, block_q, block_k, window=None, cap=None, bias=None, band=None):
    """One head, validated inputs; mask and bias ``[t, s]`` or None; scale an array of the accumulation
    dtype; ``window`` ``(left, right)`` or None, ``cap`` a Python float or None (both static); ``band``
    as :func:`_plan` takes it (None: bands where they are narrower than the keys, without a bias)."""
    T, S = q.shape[0], k.shape[0]
    out_dtype = jnp.result_type(q, k, v)
    acc_dtype = scale.dtype
    if T == 0 or S == 0:  # no key: every row is fully masked (zero output, lse = log 0)
        out = jnp.zeros((T, v.shape[1]), out_dtype)  # [T, V]
        return out, jnp.full((T,), -jnp.inf, acc_dtype)
    plan = _plan(T, S, block_q, block_k, bool(is_causal), mask is not None, window, cap,
                 band=False if bias is not None else band)
    qp, kp, vp, mask = _padded(q, k, v, mask, plan)  # [Tp, H], [Sp, H], [Sp, V], [t, s] padded
    bias = _pad_compact(bias, plan.nq * plan.bq, plan.nk * plan.bk)  # [t, s] padded, or None
    out, lse = _flash(qp, kp, vp, mask, bias, scale, plan)  # [Tp, V], [Tp]
    return out[:T].astype(out_dtype), lse[:T]


# The public functions check their inputs in Python, then run as one compiled program (eagerly on a new
# shape: one compile instead of one per primitive; inside the caller's jit the inner jit is inlined).
_blockwise_jit = jax.jit(_blockwise, static_argnames=("is_causal", "block_q", "block_k", "window", "cap", "band"))  # noqa: E501


def _blockwise_grads(q, k, v, mask, scale, out, lse, d_out, d_lse, is_causal, block_q, block_k, window=None, cap=None):
    """One head's ``(dq [T, H], dk [S, H], dv [S, V], dscale)`` given ``out [T, V]``, ``lse [T]``.

    :func:`_backward` on the tiling :func:`_blockwise` uses, without a forward: ``out`` and ``lse`` are
    given, so they may be those of attention over a larger key set (ring attention passes its global
    ones, and gets that attention's gradient restricted to these keys). Inputs as in :func:`_blockwise`;
    the cotangents ``d_out [T, V]``, ``d_lse [T]``; results in the accumulation dtype (scale's).
    """
    T, S = q.shape[0], k.shape[0]
    acc_dtype = scale.dtype
    if T == 0 or S == 0:
        zeros = lambda x: jnp.zeros(x.shape, acc_dtype)
        return zeros(q), zeros(k), zeros(v), jnp.zeros((), acc_dtype)
    plan = _plan(T, S, block_q, block_k, bool(is_causal), mask is not None, window, cap)
    qp, kp, vp, mask = _padded(q, k, v, mask, plan)  # [Tp, H], [Sp, H], [Sp, V], [t, s] padded
    Tp = plan.nq * plan.bq
    # padded query rows: zero d_out and d_lse, so their ds = p · (0 - 0) = 0 and they add nothing
    out, d_out = _pad_rows(out, Tp), _pad_rows(d_out.astype(acc_dtype), Tp)  # [Tp, V], [Tp, V]
    lse, d_lse = _pad_rows(lse, Tp), _pad_rows(d_lse.astype(acc_dtype), Tp)  # [Tp], [Tp]
    dq, dk, dv, d_scale, _ = _backward(qp, kp, vp, mask, scale, out, lse, d_out, d_lse, plan)
    return dq[:T], dk[:S], dv[:S], d_scale


def _scale_array(scale: Any, dtype: Any) -> Array:
    return jnp.asarray(scale, dtype)


# ----------------------------------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------------------------------


def blockwise_attention(
    q: Float[ArrayLike, "T H"],
    k: Float[ArrayLike, "S H"],
    v: Float[ArrayLike, "S V"],
    *,
    mask: Bool[ArrayLike, "#T #S"] | Bool[ArrayLike, "#S"] | None = None,
    is_causal: bool = False,
    scale: Real[ArrayLike, ""] | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    implementation: str | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    logit_cap: float | None = None,
    bias: Float[ArrayLike, "#T #S"] | Float[ArrayLike, "#S"] | None = None,
) -> tuple[Float[Array, "T V"], Float[Array, "T"]]:
    """Attention of one head, ``softmax(scale · q kᵀ) v``, computed tile by tile in O(T + S) memory.

    The same function as :func:`jaxattn.attention` (equal within float32 rounding), computed with an
    online softmax over key blocks so that no ``[T, S]`` buffer exists, in the forward or in the
    gradient (a ``custom_vjp`` that recomputes each tile from the saved ``lse``; see the module
    docstring). Any T and S (blocks need not divide them); causal tiles above the diagonal are skipped.

    With the paper's names: ``H = d_k``, ``V = d_v``. ``scale=None`` means ``1/sqrt(H)`` (see
    :func:`jaxattn.attention` for why); the scale is differentiable and may be traced.

    The attention weights are not returned (that would be the ``[T, S]`` buffer); any row of them is
    recovered exactly by :func:`weights_from_lse` from ``lse`` (given the same mask, window, cap and bias):
    ``A[i, j] = exp(cap(scale·q_i·k_j + bias_ij) - lse_i)``.

    bf16/fp16 inputs: the tiles' matmuls take the input dtype with float32 accumulation, and each tile's
    float32 product is multiplied by the scale in float32 (as :func:`jaxattn.attention` does; the scale
    and ``scale · q`` are never rounded to the input dtype, forward or backward). The softmax and the
    accumulators are float32, the output is cast back to the input dtype.

    Masking: ``mask`` is a boolean keep-mask (True = attend) broadcastable to ``[T, S]``; it is kept in
    its own shape (a padding mask ``[S]`` costs O(S)). A row with no kept key returns a zero output and
    ``lse = -inf``, with finite gradients, as :func:`jaxattn.attention` does.

    Sliding windows (``local_window_size``, as in :func:`jaxattn.attention`; a causal window of W keys is
    ``is_causal=True, local_window_size=(W - 1, 0)``): the key blocks wholly outside every row's window
    are skipped in the forward and the backward, so the cost grows as ``T·(block_q + W)``, not ``T·S``.
    A window narrower than the keys, without a mask or a bias, runs as bands: each query block takes the
    keys it may see as one slice (one product and one softmax, no online rescaling), eight blocks
    batched per step; the same numbers, fewer and larger operations (docs/blockwise.md).
    Soft-capping (``logit_cap=c``: ``c · tanh(logit / c)`` before the mask) runs inside each tile, and the
    backward multiplies by its derivative ``1 - tanh²``; the cap is a Python number (it is part of the
    compiled program) and carries no gradient here (the dense :func:`jaxattn.attention` differentiates it).

    Non-finite inputs, as in :func:`jaxattn.attention`: a masked position never influences any output or
    gradient, whatever its value, including inside a partly masked tile. A non-finite ``v[s, c]`` at a key
    row ``t`` keeps makes ``out[t, c]`` NaN; a non-finite ``k[s]`` kept by row ``t``, or ``q[t]`` with a
    kept key, makes row ``t``'s output and ``lse[t]`` NaN. Gradients do not flow through those NaN outputs.

    Args:
      q: queries ``[T, H]``.
      k: keys ``[S, H]``.
      v: values ``[S, V]``.
      mask: optional boolean keep-mask broadcastable to ``[T, S]``.
      is_causal: also apply :func:`jaxattn.causal_mask` ``(T, S)``: key ``j`` visible to query ``i`` iff
        ``j <= i``; tiles wholly above the diagonal are skipped, not masked.
      scale: logit scale, ``None`` for ``1/sqrt(H)``.
      block_q: query rows per tile (clipped to T).
      block_k: keys per tile (clipped to S).
      implementation: ``None``, ``"blockwise"``, ``"xla"``, ``"cudnn"`` or ``"pallas"``, named as in
        ``jax.nn.dot_product_attention``: see :func:`multi_head_blockwise_attention`. ``"blockwise"`` is
        the function described here; ``None`` is ``"blockwise"`` on CPU and TPU.
      local_window_size: ``None``, an int ``w`` or ``(left, right)`` Python ints (see above).
      logit_cap: ``None`` or a positive Python number (see above).
      bias: optional additive logit bias broadcastable to ``[T, S]``, added after the scale and before the
        cap; kept in its own shape (a per-key bias ``[S]`` costs O(S)), differentiable (its gradient is
        summed along the axes it broadcasts). ``"blockwise"`` only: the library kernels refuse it
        (``jaxattn.dot_product_attention`` passes a bias to jax.nn's).

    Returns:
      ``(out, lse)``: ``out [T, V]`` in the promoted dtype of q, k, v; ``lse [T]`` the row log-sum-exp of
      the kept logits, in float32 (float64 for float64 inputs).
    """
    return _blockwise_attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale, block_q=block_q,
                                block_k=block_k, implementation=implementation, interpret=False,
                                local_window_size=local_window_size, logit_cap=logit_cap, bias=bias)


def _static_cap(logit_cap: Any) -> float | None:
    """The blockwise kernel's soft cap: None or a concrete positive float (it is compiled in)."""
    cap = check_logit_cap(logit_cap)
    if cap is not None and not isinstance(cap, float):
        raise TypeError("logit_cap must be a Python number for the blockwise kernel (it is compiled in), "
                        "received a traced value; the dense jaxattn.attention takes a traced cap")
    return cap


def _blockwise_attention(q, k, v, *, mask, is_causal, scale, block_q, block_k, implementation, interpret,
                         local_window_size=None, logit_cap=None, bias=None):
    """:func:`blockwise_attention`; ``interpret`` runs the Pallas kernel in interpret mode (any platform)."""
    q, k, v, mask, bias, scale = check_attention_inputs(q, k, v, mask, bias, scale, broadcast_mask=False,
                                                        broadcast_bias=False)
    is_causal = check_flag(is_causal, "is_causal")
    block_q = check_int(block_q, "block_q", what="rows per tile")
    block_k = check_int(block_k, "block_k", what="rows per tile")
    implementation = check_implementation(implementation)
    window, cap = check_window(local_window_size), _static_cap(logit_cap)
    name = choose_implementation(implementation, q[:, None], k[:, None], v[:, None], mask, scale, is_causal,
                                 interpret=interpret, window=window, cap=cap, bias=bias)
    if name != "blockwise":
        out, lse = _attend_library(name, q[:, None], k[:, None], v[:, None], mask, scale, is_causal,
                                   block_q=block_q, block_k=block_k, interpret=interpret, window=window)  # [T, 1, V], [1, T]
        return out[:, 0], lse[0]
    acc_dtype = softmax_dtype(jnp.result_type(q, k, v))
    return _blockwise_jit(q, k, v, compact_mask(mask), _scale_array(scale, acc_dtype), is_causal, block_q, block_k,
                          window, cap, compact_mask(bias))


def multi_head_blockwise_attention(
    q: Float[ArrayLike, "T N H"],
    k: Float[ArrayLike, "S K H"],
    v: Float[ArrayLike, "S K V"],
    *,
    mask: Bool[ArrayLike, "#N #T #S"] | Bool[ArrayLike, "#T #S"] | Bool[ArrayLike, "#S"] | None = None,
    is_causal: bool = False,
    scale: Real[ArrayLike, ""] | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    implementation: str | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    logit_cap: float | None = None,
    bias: Float[ArrayLike, "#N #T #S"] | Float[ArrayLike, "#T #S"] | Float[ArrayLike, "#S"] | None = None,
) -> tuple[Float[Array, "T N V"], Float[Array, "N T"]]:
    """Multi-head and grouped-query :func:`blockwise_attention`: the single-head function mapped over heads.

    The heads run one after another (``jax.lax.map``), which keeps each head's tiles in cache; the
    result is the same as ``jax.vmap`` of :func:`blockwise_attention`. In a process with more than one
    device, or with the head axis split in the inputs' sharding, the heads are vmapped instead, so that
    a head axis split over devices stays split (``jit(vmap(...))`` on inputs placed
    ``P('batch', None, 'heads', None)`` returns outputs placed so). The head convention of
    :func:`jaxattn.multi_head_attention`: query head ``n`` reads key/value head ``n // G`` with
    ``G = N // K``. For a batch, ``jax.vmap`` this function over a leading axis.

    Args:
      q: queries ``[T, N, H]``.
      k: keys ``[S, K, H]`` with ``N % K == 0``.
      v: values ``[S, K, V]``.
      mask: optional boolean keep-mask broadcastable to ``[N, T, S]`` (e.g. ``[S]``, ``[T, S]``).
      is_causal, scale, block_q, block_k, local_window_size, logit_cap: as in :func:`blockwise_attention`
        (``"xla"`` and ``"cudnn"`` take a window, none but ``"blockwise"`` a cap).
      bias: optional additive logit bias broadcastable to ``[N, T, S]``, as in :func:`blockwise_attention`
        (``"blockwise"`` only).
      implementation: which kernel computes it, named as in ``jax.nn.dot_product_attention``; every one
        returns the same ``(out, lse)`` (lse from the kernel, differentiable), so
        :func:`weights_from_lse` recovers rows of the map whichever ran:

        - ``"blockwise"``: the tiled online softmax described here; any platform, mask and dtype.
        - ``"xla"``: ``jax.nn.dot_product_attention(implementation="xla", return_residual=True)``;
          materialises ``[N, T, S]``; any mask. Its softmax runs in float32, also for float64 inputs.
        - ``"cudnn"``: the same with ``implementation="cudnn"``: NVIDIA GPU, bfloat16/float16, a concrete
          scale; ``lse`` is cuDNN's saved softmax statistic, which JAX returns rounded to the input dtype.
        - ``"pallas"``: ``jax.experimental.pallas.ops.gpu.attention.mha`` (NVIDIA GPU), no mask
          (``is_causal`` only), a concrete scale; ``lse`` is the kernel's saved statistic, float32.
        - ``None``: the fastest available: on a GPU, ``"cudnn"`` (bf16/fp16, no mask, ``H == V``,
          ``H % 8 == 0``, ``H <= 128``), else ``"pallas"`` (bf16/fp16, no mask), else ``"blockwise"``;
          ``"blockwise"`` on CPU and TPU.

        One that cannot honour the call raises ``ValueError`` naming ``implementation`` and the reason;
        nothing falls back. ``block_q``, ``block_k`` tile ``"blockwise"`` (and the backward pass that
        gives the library kernels' ``lse`` its gradient). The guarantees on non-finite inputs at masked
        positions are those of ``"blockwise"``; the library kernels give no such guarantee.

    Returns:
      ``(out [T, N, V], lse [N, T])``.
    """
    return _multi_head_blockwise(q, k, v, mask=mask, is_causal=is_causal, scale=scale, block_q=block_q,
                                 block_k=block_k, implementation=implementation, interpret=False,
                                 local_window_size=local_window_size, logit_cap=logit_cap, bias=bias)


def _multi_head_blockwise(q, k, v, *, mask, is_causal, scale, block_q, block_k, implementation, interpret,
                          local_window_size=None, logit_cap=None, window=None, bias=None):
    """:func:`multi_head_blockwise_attention`; ``interpret`` runs the Pallas kernel in interpret mode;
    ``window``: a checked ``(left, right)`` that may be negative on one side (a ring step's window moved to
    the step's own coordinates), used when ``local_window_size`` is None."""
    q, k, v, mask, bias, scale = check_multi_head_inputs(q, k, v, mask, bias, scale)
    is_causal = check_flag(is_causal, "is_causal")
    block_q = check_int(block_q, "block_q", what="rows per tile")
    block_k = check_int(block_k, "block_k", what="rows per tile")
    implementation = check_implementation(implementation)
    window, cap = (window if local_window_size is None else check_window(local_window_size)), _static_cap(logit_cap)
    name = choose_implementation(implementation, q, k, v, mask, scale, is_causal, interpret=interpret,
                                 window=window, cap=cap, bias=bias)
    if name != "blockwise":
        return _attend_library(name, q, k, v, mask, scale, is_causal, block_q=block_q, block_k=block_k,
                               interpret=interpret, window=window)
    acc_dtype = softmax_dtype(jnp.result_type(q, k, v))
    return _multi_head_flash(q, k, v, mask, _scale_array(scale, acc_dtype), is_causal, block_q, block_k,
                             _heads_side_by_side(q, k), window, cap, bias)


@functools.partial(jax.jit, static_argnames=("is_causal", "block_q", "block_k", "side_by_side", "window", "cap"))
def _multi_head_flash(q, k, v, mask, scale, is_causal, block_q, block_k, side_by_side, window=None, cap=None,
                      bias=None):
    """:func:`multi_head_blockwise_attention`'s blockwise path on checked inputs, one compiled program."""
    T, N, H = q.shape
    S, K, V = v.shape
    qh = group_query_heads(q, K)  # [K, G, T, H]
    kh, vh = k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # [K, S, H], [K, S, V]
    m, m_axis = per_head(mask, N, K)  # [K, G, t, s] (one per head) or [t, s] (shared) or None
    b, b_axis = per_head(bias, N, K)  # likewise
    per_q = (qh,) if b_axis is None else (qh, b)  # a bias of its own per head is mapped with the queries

    def one_head(qs, kvs, m1):
        (q1, *b1), (k1, v1) = qs, kvs
        b1 = b1[0] if b1 else b
        return _blockwise(q1, k1, v1, compact_mask(m1), scale, is_causal, block_q, block_k, window, cap,
                          compact_mask(b1))

    out, lse = _over_heads(one_head, per_q, (kh, vh), m, m_axis, side_by_side)
    out = out.transpose(2, 0, 1, 3).reshape(T, N, V)  # [T, N, V], from [K, G, T, V]
    return out, lse.reshape(N, T)


def _over_heads(one_head, per_q, per_kv, mask, m_axis, vmapped):
    """``one_head(per_q, per_kv, mask)`` of every query head, outputs stacked ``[K, G, ...]``.

    ``per_q``: a tuple of ``[K, G, ...]`` arrays, sliced per query head; ``per_kv``: a tuple of
    ``[K, ...]`` arrays, sliced per key/value head (query head ``(κ, g)`` reads ``κ``); ``mask``
    ``[K, G, t, s]`` (``m_axis = 0``), shared ``[t, s]`` or None, from :func:`jaxattn._logits.per_head`.

    Heads run one after another (lax.map), not side by side (vmap): a vmapped tile is N times bigger
    and falls out of cache on a CPU. ``vmapped`` (see :func:`_heads_side_by_side`): the heads are
    vmapped, so that a head axis split over devices stays split and each device computes its own heads.
    """
    if vmapped:
        over_group = jax.vmap(one_head, in_axes=(0, None, 0 if m_axis == 0 else None))
        over_kv = jax.vmap(over_group, in_axes=(0, 0, m_axis))
        return over_kv(per_q, per_kv, mask)

    def one_kv_head(xs):
        qs, kvs, mg = xs  # [G, ...] each, [...] each, [G, t, s] or None
        if mg is None:
            return jax.lax.map(lambda q1: one_head(q1, kvs, mask), qs)
        return jax.lax.map(lambda ys: one_head(ys[0], kvs, ys[1]), (qs, mg))

    return jax.lax.map(one_kv_head, (per_q, per_kv, mask if m_axis == 0 else None))


def _multi_head_grads(q, k, v, mask, scale, out, lse, d_out, d_lse, *, is_causal, block_q, block_k, window=None,
                      cap=None):
    """The gradient of :func:`multi_head_blockwise_attention` at given ``out`` and ``lse``, without a forward.

    :func:`_blockwise_grads` over the heads the way the forward maps them. Validated inputs (q ``[T, N, H]``,
    k ``[S, K, H]``, v ``[S, K, V]``, mask broadcastable to ``[N, T, S]`` or None, scale an array of the
    accumulation dtype), ``out [T, N, V]``, ``lse [N, T]`` and their cotangents ``d_out``, ``d_lse``.
    Returns ``(dq [T, N, H], dk [S, K, H], dv [S, K, V], dscale)`` in the accumulation dtype; a
    grouped-query key/value head's gradient is summed over its G query heads.
    """
    T, N, H = q.shape
    S, K, V = v.shape
    G = N // K
    per_q = (
        group_query_heads(q, K),  # [K, G, T, H]
        group_query_heads(out, K),  # [K, G, T, V]
        lse.reshape(K, G, T),  # [K, G, T]
        group_query_heads(d_out, K),  # [K, G, T, V]
        d_lse.reshape(K, G, T),  # [K, G, T]
    )
    per_kv = (k.transpose(1, 0, 2), v.transpose(1, 0, 2))  # [K, S, H], [K, S, V]
    m, m_axis = per_head(mask, N, K)  # [K, G, t, s] (one per head) or [t, s] (shared) or None

    def one_head(qs, kvs, m1):
        (q1, out1, lse1, d_out1, d_lse1), (k1, v1) = qs, kvs
        m1 = compact_mask(m1)
        return _blockwise_grads(q1, k1, v1, m1, scale, out1, lse1, d_out1, d_lse1, is_causal, block_q, block_k,
                                window, cap)

    dq, dk, dv, d_scale = _over_heads(one_head, per_q, per_kv, m, m_axis, _heads_side_by_side(q, k))  # [K, G, ...] each
    dq = dq.transpose(2, 0, 1, 3).reshape(T, N, H)  # [T, N, H]
    dk = jnp.sum(dk, axis=1).transpose(1, 0, 2)  # [S, K, H]
    dv = jnp.sum(dv, axis=1).transpose(1, 0, 2)  # [S, K, V]
    return dq, dk, dv, jnp.sum(d_scale)


# ----------------------------------------------------------------------------------------------------
# The library kernels (jaxattn._backends), their lse given a gradient by the blockwise backward.
# ----------------------------------------------------------------------------------------------------


def _attend_library(name, q, k, v, mask, scale, is_causal, *, block_q, block_k, interpret, window=None):
    """:func:`jaxattn._backends.attend` (``out [T, N, V]``, ``lse [N, T]``), with ``lse`` differentiable.

    The kernels stop ``lse``'s gradient; here its cotangent flows to ``q``, ``k`` and ``scale`` through
    :func:`_multi_head_grads` with zero-width values, on the tiles ``block_q``, ``block_k``.
    """
    out, lse = attend(name, q, k, v, mask, scale, is_causal, interpret=interpret, window=window)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return out, lse
    out_dtype = jnp.result_type(q, k, v)
    q, k = q.astype(out_dtype), k.astype(out_dtype)  # the operands the kernel ran on
    scale = jnp.asarray(scale, lse.dtype)
    return out, _differentiable_lse(lse, q, k, mask, scale, bool(is_causal), block_q, block_k, window)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _differentiable_lse(lse, q, k, mask, scale, is_causal, block_q, block_k, window):
    """``lse`` itself; its cotangent flows to ``q``, ``k`` and ``scale`` through the blockwise backward."""
    return lse


def _differentiable_lse_fwd(lse, q, k, mask, scale, is_causal, block_q, block_k, window):
    return lse.value, (lse.value, q.value, k.value, mask.value if mask is not None else None, scale.value)


def _differentiable_lse_bwd(is_causal, block_q, block_k, window, residuals, d_lse):
    lse, q, k, mask, scale = residuals
    if isinstance(d_lse, jax.custom_derivatives.SymbolicZero):
        return None, None, None, None, None
    T, N, _ = q.shape
    S, K, _ = k.shape
    acc = scale.dtype
    empty_v = jnp.zeros((S, K, 0), k.dtype)  # zero-width values: only the lse part of ds = p·(dp - D)
    empty_out = jnp.zeros((T, N, 0), acc)
    dq, dk, _, d_scale = _multi_head_grads(q, k, empty_v, mask, scale, empty_out, lse, empty_out, d_lse.astype(acc),
                                           is_causal=is_causal, block_q=block_q, block_k=block_k, window=window)
    return None, dq.astype(q.dtype), dk.astype(k.dtype), None, d_scale.astype(scale.dtype)


_differentiable_lse.defvjp(_differentiable_lse_fwd, _differentiable_lse_bwd, symbolic_zeros=True)


def weights_from_lse(
    q: Float[ArrayLike, "T H"],
    k: Float[ArrayLike, "S H"],
    lse: Float[ArrayLike, "T"],
    *,
    rows: Int[ArrayLike, "R"] | None = None,
    mask: Bool[ArrayLike, "#T #S"] | Bool[ArrayLike, "#S"] | None = None,
    is_causal: bool = False,
    scale: Real[ArrayLike, ""] | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    logit_cap: Real[ArrayLike, ""] | None = None,
    bias: Float[ArrayLike, "#T #S"] | None = None,
) -> Float[Array, "R S"]:
    """Rows of the attention map, recovered exactly from the log-sum-exp ``blockwise_attention`` returns.

    ``A[i, j] = exp(cap(scale · q_i · k_j + bias_ij) - lse_i)`` where key ``j`` is kept, else 0: the softmax without
    a second pass over the keys, from the same logits function :func:`jaxattn.attention` uses. Costs
    O(R·S) for R rows, so a probe can inspect a few rows of a map whose ``[T, S]`` buffer is too big.

    Args:
      q: queries ``[T, H]``.
      k: keys ``[S, H]``.
      lse: ``[T]``, the second output of :func:`blockwise_attention` for the same q, k, mask, scale.
      rows: optional integer array ``[R]`` of query indices in ``[0, T)``; ``None`` means all T rows.
        A concrete index outside ``[0, T)`` raises ``ValueError``; a traced one (under ``jit``) gives a
        row of NaN.
      mask, is_causal, scale, local_window_size, logit_cap, bias: as given to :func:`blockwise_attention`
        (the same values, or the rows come out of a different map: nothing can check that).

    Returns:
      ``[R, S]`` in the accumulation dtype (float32 or float64); each row sums to 1, or is all zeros if
      the row has no kept key.
    """
    q, k, _, mask, bias, scale = check_attention_inputs(q, k, None, mask, bias, scale, broadcast_mask=False,
                                                        broadcast_bias=False)
    window, cap = check_window(local_window_size), check_logit_cap(logit_cap)
    lse = as_float_array(lse, "lse")
    T, S = q.shape[0], k.shape[0]
    is_causal = check_flag(is_causal, "is_causal")
    if lse.shape != (T,):
        raise ValueError(f"lse must have shape [T] = ({T},) to match q {tuple(q.shape)}, received {tuple(lse.shape)}")
    if rows is None:
        rows = jnp.arange(T)
    else:
        rows = jnp.asarray(rows)
        if not jnp.issubdtype(rows.dtype, jnp.integer) or rows.ndim != 1:
            raise TypeError(f"rows must be a 1-D integer array [R], received dtype {rows.dtype.name} shape {rows.shape}")
        if not isinstance(rows, jax.core.Tracer):
            bad = np.asarray(rows)[(np.asarray(rows) < 0) | (np.asarray(rows) >= T)]
            if bad.size:
                raise ValueError(f"rows must be query indices in [0, T={T}), received {bad.tolist()}")
    if bias is not None:  # [t, s] with t, s each 1 or full: the rows' part, [R or 1, S or 1]
        bias = bias.reshape((1,) * (2 - bias.ndim) + bias.shape)
        bias = bias[rows] if bias.shape[0] > 1 else bias
    logits = scaled_logits(q[rows], k, bias, scale, cap)  # [R, S]
    keep = jnp.ones(logits.shape, bool)  # [R, S]
    if is_causal:
        keep = jnp.arange(S)[None, :] <= rows[:, None]  # [R, S]
    if window is not None:
        d = jnp.arange(S)[None, :] - rows[:, None]  # [R, S]
        keep = jnp.logical_and(keep, jnp.logical_and(d >= -window[0], d <= window[1]))  # [R, S]
    if mask is not None:
        m2 = compact_mask(mask)  # [t, s]
        m2 = m2[rows] if m2.shape[0] > 1 else m2  # [R or 1, s]
        keep = jnp.logical_and(keep, m2)  # [R, S]
    lse_r = lse[rows].astype(logits.dtype)  # [R]
    lse_r = jnp.where(lse_r == -jnp.inf, 0.0, lse_r)  # a row with no kept key: all weights masked below
    weights = jnp.where(keep, jnp.exp(logits - lse_r[:, None]), 0.0)  # [R, S]
    # A traced row out of [0, T) cannot be refused: it gets a NaN row (indexing would clamp it to another row).
    return jnp.where(((rows >= 0) & (rows < T))[:, None], weights, jnp.nan)  # [R, S]
