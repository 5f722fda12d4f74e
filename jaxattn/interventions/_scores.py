"""What kind of head is it? Scores of attention maps against the patterns of known head types.

:func:`head_scores` reads maps ``[L, N, T, S]`` (a model's ``attentions``) and the token ids, and gives every
head the mean weight it puts on the positions a previous-token, duplicate-token, induction or sink head
would attend to. Padding is left out: padded rows and padded keys never count, and positions count real
tokens, so a padded sequence scores as the sequence alone.

Axis alphabet: B sequences, L layers, N heads, T queries, S keys (S = T).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxattn._inputs import batch_mask

Array = jax.Array

HEAD_KINDS = ("previous_token", "duplicate_token", "induction", "sink")


def _patterns(ids: Array, keep: Array, kind: str) -> tuple[Array, Array]:
    """``(targets [T, S], rows [T])`` of one sequence: which keys each query row is scored on, and which
    rows have at least one target (the rows averaged over)."""
    T = ids.shape[0]
    pos = jnp.where(keep, jnp.cumsum(keep) - 1, -1)  # [T]: each real token's position, -1 for padding
    real = keep[:, None] & keep[None, :]  # [T, S]
    earlier = jnp.arange(T)[None, :] < jnp.arange(T)[:, None]  # [T, S]: s < t
    same = ids[:, None] == ids[None, :]  # [T, S]
    if kind == "previous_token":
        targets = real & (pos[None, :] == pos[:, None] - 1)
    elif kind == "duplicate_token":
        targets = real & earlier & same
    elif kind == "induction":
        dup = (real & earlier & same).astype(jnp.float32)  # [T, J]: earlier occurrences j of ids[t]
        after = (real & (pos[None, :] == pos[:, None] + 1)).astype(jnp.float32)  # [J, S]: s is the token after j
        targets = real & (dup @ after > 0) & ~earlier.T  # s = the token after j, s <= t
    else:  # sink
        targets = real & (pos[None, :] == 0) & (pos[:, None] >= 1)
    return targets, jnp.any(targets, axis=1)


def _one(maps: Array, ids: Array, keep: Array, kind: str) -> Array:
    targets, rows = _patterns(ids, keep, kind)
    dtype = jnp.promote_types(maps.dtype, jnp.float32)
    maps = maps.astype(dtype)
    on = jnp.where(targets, maps, 0.0)  # [L, N, T, S]: a NaN on a padded row never counts
    score = jnp.sum(on, axis=(-2, -1)) / jnp.sum(rows).astype(dtype)  # [L, N]; 0 / 0 = NaN with no rows
    # A NaN anywhere among the real rows and keys (a target or not) makes the head's score NaN: a broken map
    # must not read as a score. Put in explicitly: reductions compiled for CPU may drop a NaN.
    real = (keep[:, None] & keep[None, :])[None, None]  # [1, 1, T, S]
    broken = jnp.any(jnp.isnan(maps) & real, axis=(-2, -1))  # [L, N]
    return jnp.where(broken, jnp.asarray(jnp.nan, dtype), score)


@functools.partial(jax.jit, static_argnames=("kind", "batched"))
def _scores(maps: Array, ids: Array, keep: Array, *, kind: str, batched: bool) -> Array:
    score = lambda m, i, k: _one(m, i, k, kind)  # noqa: E731
    return jax.vmap(score)(maps, ids, keep) if batched else score(maps, ids, keep)


def head_scores(maps: Any, ids: Any, kind: str, *, attention_mask: Any = None) -> Array:
    """``[L, N]``: each head's mean attention on the keys a head of type ``kind`` attends to.

    For every query row ``t`` that has a target, the row's score is its total weight on the target keys;
    a head's score is the mean of those row scores (rows without a target are left out). Positions count
    real tokens only (``attention_mask``): the previous token of the first real token after left padding
    is none, and a padded row or key never counts.

    - ``"previous_token"``: rows ``t >= 1``; the target is ``t - 1``.
    - ``"duplicate_token"``: rows whose token occurred before; the targets are those earlier occurrences
      ``j < t`` with ``ids[j] == ids[t]``.
    - ``"induction"``: the same rows; the targets are the tokens right after each earlier occurrence,
      ``j + 1`` for ``j < t`` with ``ids[j] == ids[t]`` (``j + 1 <= t``: when ``ids[t - 1] == ids[t]``
      the target ``j + 1 = t`` is the row's own token).
    - ``"sink"``: rows ``t >= 1``; the target is position 0, the first real token (under left padding,
      the first column that ``attention_mask`` marks real).

    A NaN in the maps at a real row and key (a target or not) makes that head's score NaN, so a broken map
    never reads as a score; NaN at padded rows or keys is ignored.

    A kind with no row that has a target (no repeated token for the duplicate and induction kinds; one
    real token for the others) gives NaN for every head: there is nothing to average, and 0 would read as
    "never attends there".

    Compared with TransformerLens' ``detect_head`` (``"previous_token_head"``, ``"duplicate_token_head"``,
    ``"induction_head"``, with the default ``error_measure="mul"``): its detection patterns are the same
    targets (lower triangular; the duplicate pattern drops the diagonal; the induction pattern is the
    duplicate pattern shifted one key to the right), but its score divides the weight on the targets,
    summed over ALL rows, by the total weight of all rows (T, each row summing to 1). So a row without a
    target counts as 0 there: TransformerLens' score is this one times (rows with a target) / T. It also
    scores the tokens ``model.to_tokens`` makes (a BOS token prepended by default), runs one sequence,
    averages a list of sequences into one table and has no sink kind; its ``exclude_bos`` and
    ``exclude_current_token`` options zero keys in both sums, which this function does not do.

    Args:
      maps: attention weights ``[L, N, T, S]`` with ``S = T`` (e.g. ``forward(...).attentions``), or a
        batch ``[B, L, N, T, S]``.
      ids: the token ids ``[T]`` (``[B, T]`` for a batch) the maps were computed on.
      kind: one of ``"previous_token"``, ``"duplicate_token"``, ``"induction"``, ``"sink"``.
      attention_mask: ``[T]`` (``[B, T]``), 1 (or True) for a real token, 0 for padding; ``None``: all real.

    Returns:
      float ``[L, N]`` (``[B, L, N]`` for a batch), at least float32: one compiled program per kind and
      shape; works under ``jax.jit`` too (the checks read shapes and dtypes only). Maps on a mesh (from a
      sharded forward, ``docs/scaling.md``) are scored there, the ids following their batch split.

    Raises:
      ValueError, TypeError: naming ``kind``, ``maps``, ``ids`` or ``attention_mask``, with the expected
        and the received shape or dtype.
    """
    if not isinstance(kind, str) or kind not in HEAD_KINDS:
        raise ValueError(f"kind must be one of {', '.join(HEAD_KINDS)}, received {kind!r}")
    maps = jnp.asarray(maps)
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(maps.dtype, jnp.floating):
        raise TypeError(f"maps must be float attention weights [L, N, T, S], received dtype {maps.dtype.name}")
    if maps.ndim not in (4, 5):
        raise ValueError(f"maps must have shape [L, N, T, S] or [B, L, N, T, S], received shape {tuple(maps.shape)}")
    batched = maps.ndim == 5
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"ids must be integer token ids, received dtype {ids.dtype.name}")
    T = maps.shape[-2]
    want = (maps.shape[0], T) if batched else (T,)
    if maps.shape[-1] != T or tuple(ids.shape) != want:
        lead = "[B, T]" if batched else "[T]"
        raise ValueError(f"maps must be square in its last two axes (S = T) and ids must be {lead} = {want} for "
                         f"maps of shape {tuple(maps.shape)}, received ids of shape {tuple(ids.shape)}")
    keep = jnp.asarray(batch_mask(None if attention_mask is None else jnp.asarray(attention_mask), want, like="ids"))
    sharding = getattr(maps, "sharding", None)
    if isinstance(sharding, NamedSharding) and not isinstance(maps, jax.core.Tracer):
        # maps on a mesh (a sharded forward's): the ids and mask follow the maps' batch split
        spec = PartitionSpec(tuple(sharding.spec)[0] if batched and len(sharding.spec) else None)
        ids, keep = jax.device_put((ids, keep), NamedSharding(sharding.mesh, spec))
    return _scores(maps, ids, keep, kind=kind, batched=batched)
