"""A batch whose sequences share a prefix, packed into one sequence that holds the prefix once.

Under a causal model, the rows of a shared prefix are the same in every sequence of a batch, as long as
every sequence gets the same intervention there: the tables' head masks are shared by the batch, and a
patch value qualifies when its rows agree across the sequences over the prefix (checked). The two
continuations of a two-choice metric are such a batch (the prompt, then " trophy" or " suit"+"case").
Packed, the batch is one sequence: sequence 0 whole, then each further sequence's rows after the
prefix; each row sees its own sequence's rows and the prefix, through a ``[T', T']`` keep-mask and each
row's own position (the protocol's ``resume`` with ``positions``). The effect tables run it and unpack
the output to the batch's shapes, so the metric sees what the batch gives (to float rounding).

Axis alphabet: B sequences, L layers, N heads, T columns of a sequence, P the shared prefix, T' packed
rows (``T + (B - 1)(T - P)``), D width, V vocabulary.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._sites import CAPTURE_NAMES

Array = jax.Array


class Packing(NamedTuple):
    """Where each packed row comes from, and what it sees.

    Attributes:
      seq, col: ``[T']`` the sequence and the column each packed row holds (prefix rows: sequence 0).
      slots: ``[B, T]`` the packed row of each sequence's column.
      keep: ``[T', T']`` the keys each packed row sees (its sequence's real keys and the prefix's);
        causality comes from the order of the rows, which keeps each sequence's order.
      visible: ``[T', T']`` the same without the padding: where a map's weight lives.
      positions: ``[T']`` each row's position among its own sequence's real tokens.
      shared: P, the prefix's length (a 0-d array: a Packing is a pytree of arrays, passed to jit).
    """

    seq: np.ndarray
    col: np.ndarray
    slots: np.ndarray
    keep: np.ndarray
    visible: np.ndarray
    positions: np.ndarray
    shared: np.ndarray


def plan(ids: Any, mask: Any) -> Packing | None:
    """The packing of a batch ``ids, mask [B, T]``, or ``None`` when its sequences share no prefix."""
    ids, mask = np.asarray(ids), np.asarray(mask, bool)
    if ids.ndim != 2 or ids.shape[0] < 2:
        return None
    B, T = ids.shape
    same = np.all(ids == ids[:1], axis=0) & np.all(mask == mask[:1], axis=0)  # [T]
    P = T if same.all() else int(np.argmin(same))
    if P == 0:
        return None
    seq = np.concatenate([np.zeros(T, np.int32)] + [np.full(T - P, b, np.int32) for b in range(1, B)])  # [T']
    col = np.concatenate([np.arange(T, dtype=np.int32)] + [np.arange(P, T, dtype=np.int32)] * (B - 1))  # [T']
    slots = np.tile(np.arange(T, dtype=np.int32), (B, 1))  # [B, T]
    for b in range(1, B):
        slots[b, P:] = T + (b - 1) * (T - P) + np.arange(T - P)
    visible = (seq[:, None] == seq[None, :]) | ((seq[None, :] == 0) & (col[None, :] < P))  # [T', T']
    keep = visible & mask[seq, col][None, :]
    position = np.where(mask, np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)  # [B, T], as the forward counts
    return Packing(seq, col, slots, keep, visible, position[seq, col], np.asarray(P, np.int32))


def _t_axes(name: str) -> tuple[int, int | None]:
    """The T axis of ``name``'s ``[L, ...]`` layout, and its S axis (``None`` but for the maps)."""
    axes = CAPTURE_NAMES[name][0].split()
    return 1 + axes.index("T"), (1 + axes.index("S") if "S" in axes else None)


def value_packs(name: str, value: Any, batched: bool, P: int) -> bool:
    """Whether a patch value of ``name`` can be packed: concrete, and (with a batch axis) the same in every
    sequence over the prefix's rows. Maps need their query and key axes whole."""
    if isinstance(value, jax.core.Tracer):
        return False
    v = np.asarray(value)
    t_axis, s_axis = _t_axes(name)
    if s_axis is not None and (v.shape[-2] == 1 or v.shape[-1] == 1):
        return False  # a map broadcast over queries or keys would spread over the packed rows
    if not batched:
        return True
    lead = 1 + t_axis
    rows = [slice(None)] * v.ndim
    if v.shape[lead] > 1:
        rows[lead] = slice(0, P)
    return bool(np.all(v[tuple(rows)] == v[:1][tuple(rows)]))


def pack_value(name: str, value: Array, batched: bool, pk: Packing) -> Array:
    """A patch value ``[(B,) L, ...]`` as the packed sequence's ``[L, ...]``."""
    t_axis, s_axis = _t_axes(name)
    seq, col = jnp.asarray(pk.seq), jnp.asarray(pk.col)
    if s_axis is not None:  # [(B,) L, N, T, S] -> [L, N, T', T'], zero where a row does not see a key
        v, which = (value, seq) if batched else (value[None], jnp.zeros_like(seq))
        w = v[which[:, None], :, :, col[:, None], col[None, :]]  # [T', T', L, N]
        return jnp.where(jnp.asarray(pk.visible)[None, None], jnp.transpose(w, (2, 3, 0, 1)), 0)
    if batched:
        full = jnp.broadcast_to(value, value.shape[:1 + t_axis] + (len(pk.slots[0]),) + value.shape[2 + t_axis:])
        return jnp.moveaxis(jnp.moveaxis(full, 1 + t_axis, 1)[seq, col], 0, t_axis)  # [L, ..., T', ...]
    if value.shape[t_axis] == 1:
        return value
    return jnp.take(value, col, axis=t_axis)


def pack_where(name: str, where: Array, pk: Packing) -> Array:
    """A patch's ``where [L, ...]`` (shared by the batch) along the packed rows (and keys, for the maps)."""
    t_axis, s_axis = _t_axes(name)
    col = jnp.asarray(pk.col)
    for axis in (t_axis, s_axis):
        if axis is not None and where.shape[axis] > 1:
            where = jnp.take(where, col, axis=axis)
    return where


def pack_stream(x: Array, pk: Packing) -> Array:
    """``[B, L, T, ...]`` (a batch's captured stream) -> ``[L, T', ...]``."""
    return jnp.moveaxis(x[jnp.asarray(pk.seq), :, jnp.asarray(pk.col)], 0, 1)


def pack_maps(maps: Array, pk: Packing) -> Array:
    """``[B, L, N, T, T]`` -> ``[L, N, T', T']``: each row's weights on the keys it sees, 0 elsewhere."""
    return pack_value("attn_weights", maps, True, pk)


def unpack(out: Any, pk: Packing) -> Any:
    """The packed sequence's output as the batch's: ``logits [B, T, V]``, ``last_hidden_state [B, T, D]``,
    ``attentions [B, L, N, T, T]``."""
    slots = jnp.asarray(pk.slots)  # [B, T]
    maps = out.attentions[:, :, slots[:, :, None], slots[:, None, :]]  # [L, N, B, T, T]
    logits = None if out.logits is None else out.logits[slots]
    return out._replace(logits=logits, last_hidden_state=out.last_hidden_state[slots],
                        attentions=jnp.moveaxis(maps, 2, 0))
