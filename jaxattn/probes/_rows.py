"""Row statistics of attention maps: entropy, normalised entropy, max weight, effective support.

Every function takes weights ``[..., S]`` (each row a distribution over S keys; ``...`` any leading axes,
e.g. ``[L, N, T]`` for every layer and head of a model) and an optional boolean keep-mask (True = attend)
broadcastable to them, and returns ``[...]`` in at least float32. All are pure and jit/vmap-able.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxattn._checks import as_bool_array, as_float_array, check_broadcastable, check_flag, softmax_dtype
from jaxattn._typing import ArrayLike, Bool, Float

Array = jax.Array

# ----------------------------------------------------------------------------------------------------
# Validation.
# ----------------------------------------------------------------------------------------------------


def _rows(x: Any, name: str, axes: str) -> Array:
    return _weights(x, name, axes)[0]


def _weights(x: Any, name: str = "weights", axes: str = "[..., S]") -> tuple[Array, float]:
    """``x`` in at least float32, and the machine epsilon of its own dtype (the rounding it was given with)."""
    x = as_float_array(x, name)
    if x.ndim < 1:
        raise ValueError(f"{name} must have at least 1 dimension {axes}, received shape {tuple(x.shape)}")
    return x.astype(softmax_dtype(x.dtype)), float(jnp.finfo(x.dtype).eps)


def _keep(mask: Any, shape: tuple[int, ...], name: str = "mask") -> Array | None:
    if mask is None:
        return None
    mask = as_bool_array(mask, name)
    check_broadcastable(mask, shape, name, "the weights/logits shape [..., S]")
    return jnp.broadcast_to(mask, shape)


# ----------------------------------------------------------------------------------------------------
# Row statistics of an attention map.
# ----------------------------------------------------------------------------------------------------


def _xlogx(p: Array) -> Array:
    """``p log p`` with ``0 log 0 = 0``, finite value and gradient everywhere (double ``where``)."""
    positive = p > 0
    safe = jnp.where(positive, p, 1.0)
    return jnp.where(positive, safe * jnp.log(safe), 0.0)


def _entropy(p: Array, keep: Array | None, ulp: float | None = None) -> Array:
    """``-Σ p log p`` per row, keeping the largest weight's term on saturated rows of a distribution.

    When a row is nearly one-hot, its largest weight rounds to 1 (``1 - p_max`` below half an ulp) and
    ``p_max log p_max`` to 0, while the other weights still carry entropy: their sum ε is exactly the
    lost ``1 - p_max``, and the lost term ``-p_max log p_max ≈ ε`` is a fraction ``1/(1 + gap)`` of the
    entropy (5% at a logit gap of 20 in float32). For a row that sums to 1 (within one ``ulp`` of the
    dtype the weights came in, plus ``4·(1 + S·ε)`` ulps of ``p``'s) whose
    largest weight exceeds 1/2, that term is computed as ``p_max · log1p(-ε)`` with ε summed from the
    other weights (no cancellation); any other row is summed as it is. The derivative is always that of
    the plain sum, ``-(log p_s + 1)`` (the correction enters through ``stop_gradient``).
    A row with a NaN weight at a kept key has entropy NaN (``0 log 0 = 0`` must not hide it).
    """
    if keep is not None:
        p = jnp.where(keep, p, 0.0)
    nan_row = jnp.any(jnp.isnan(p), axis=-1)  # [...]
    return jnp.where(nan_row, jnp.nan, _entropy_of_numbers(p, ulp))


def _entropy_of_numbers(p: Array, ulp: float | None) -> Array:
    terms = _xlogx(p)  # [..., S]
    S = p.shape[-1]
    if S < 2:
        return -jnp.sum(terms, axis=-1)
    complement, is_max = _complement(p)  # [..., S]: 1 - p_s, with 1 - p_max summed from the others
    others = jnp.sum(jnp.where(is_max, complement, 0.0), axis=-1, keepdims=True)  # [..., 1], ε
    p_max = jnp.max(p, axis=-1, keepdims=True)  # [..., 1]
    # Rounding a distribution to its dtype moves its sum by at most ulp/2; computing it (softmax) in p's
    # dtype by a few ulps of the sum, and summing the S - 1 others a few ulps of ε per key: S enters
    # through ε alone, so a long row that does not sum to 1 is not taken for one.
    eps = float(jnp.finfo(p.dtype).eps)
    tolerance = (0.0 if ulp is None else ulp) + 4 * eps * (1.0 + S * others)  # [..., 1]
    use = (jnp.abs(p_max + others - 1.0) <= tolerance) & (others < 0.5)  # [..., 1]
    safe = jnp.where(use, others, 0.0)  # log1p(-ε) finite, with a finite gradient, wherever it is not used
    plain = -jnp.sum(terms, axis=-1)
    exact = -jnp.sum(jnp.where(is_max & use, p_max * jnp.log1p(-safe), terms), axis=-1)
    return plain + jax.lax.stop_gradient(exact - plain)


def _normalized(h: Array, n: Array) -> Array:
    """Entropy ``h`` over its maximum ``log n`` (``n`` kept keys); 0 for rows with fewer than 2 keys."""
    return jnp.where(n > 1, h / jnp.log(jnp.where(n > 1, n, 2.0)), 0.0)


def _max_kept(p: Array, keep: Array | None) -> Array:
    """Each row's largest weight at a kept key; 0 for a row with none, NaN for a row with a kept NaN.

    The NaN is put in from the row's flag, not left to the maximum (a backend's max may drop NaN)."""
    if keep is not None:
        p = jnp.where(keep, p, 0.0)
    nan_row = jnp.any(jnp.isnan(p), axis=-1)  # [...]
    return jnp.where(nan_row, jnp.nan, jnp.max(jnp.where(jnp.isnan(p), 0.0, p), axis=-1, initial=0.0))


def _num_keys(p: Array, keep: Array | None) -> Array:
    if keep is None:
        return jnp.full(p.shape[:-1], p.shape[-1], p.dtype)
    return jnp.sum(keep, axis=-1).astype(p.dtype)


STATS = ("entropy", "normalized_entropy", "max_weight", "effective_support", "num_keys")


@functools.partial(jax.jit, static_argnames=("ulp", "names"))
def _stats(p: Array, keep: Array | None, ulp: float, names: tuple[str, ...]) -> dict[str, Array]:
    """The row statistics ``names`` (of :data:`STATS`) of checked weights ``p [..., S]``, as one compiled
    program (XLA drops the ones not asked for): called eagerly on a new shape, one compile instead of one
    per primitive."""
    n = _num_keys(p, keep)
    h = _entropy(p, keep, ulp)
    stats = {
        "entropy": h,
        "normalized_entropy": _normalized(h, n),
        "max_weight": _max_kept(p, keep),
        "effective_support": jnp.where(n > 0, jnp.exp(h), 0.0),
        "num_keys": n,
    }
    return {name: stats[name] for name in names}


def entropy(
    weights: Float[ArrayLike, "*rows S"], mask: Bool[ArrayLike, "*#rows #S"] | None = None
) -> Float[Array, "*rows"]:
    """Row entropy of an attention map, in nats: ``H(p) = -Σ_s p_s log p_s`` with ``0 log 0 = 0``.

    Exactly 0 (never NaN) for a one-hot row whose other weights underflowed to 0, which is the row a
    saturated softmax produces; a naive ``p * log(clip(p, tiny))`` is not. The gradient is finite too.
    NaN in, NaN out: a row with a NaN weight at an unmasked key has entropy NaN.

    Args:
      weights: ``[..., S]``, each row a distribution over S keys (e.g. ``[T, S]`` or ``[L, N, T, S]``).
      mask: optional boolean keep-mask broadcastable to ``weights``; masked entries are ignored.

    Returns:
      ``[...]`` in at least float32. A fully masked (all-zero) row has entropy 0.
    """
    p, ulp = _weights(weights)
    return _stats(p, _keep(mask, p.shape), ulp, ("entropy",))["entropy"]


def normalized_entropy(
    weights: Float[ArrayLike, "*rows S"], mask: Bool[ArrayLike, "*#rows #S"] | None = None
) -> Float[Array, "*rows"]:
    """Row entropy divided by its maximum, ``log(number of unmasked keys)``: 1 uniform, 0 one-hot.

    Rows with fewer than 2 unmasked keys (where the maximum is 0) return 0.

    Args:
      weights: ``[..., S]``.
      mask: optional boolean keep-mask broadcastable to ``weights``.

    Returns:
      ``[...]`` in ``[0, 1]`` (up to rounding), at least float32.
    """
    p, ulp = _weights(weights)
    return _stats(p, _keep(mask, p.shape), ulp, ("normalized_entropy",))["normalized_entropy"]


def max_weight(
    weights: Float[ArrayLike, "*rows S"], mask: Bool[ArrayLike, "*#rows #S"] | None = None
) -> Float[Array, "*rows"]:
    """The largest weight of each row, ``max_s p_s`` (1 for one-hot, ``1/S`` for uniform), over the keys
    ``mask`` keeps (weights ``[..., S]`` and mask as in the module docstring); ``[...]``, 0 for a fully
    masked row."""
    p, ulp = _weights(weights)
    return _stats(p, _keep(mask, p.shape), ulp, ("max_weight",))["max_weight"]


def effective_support(
    weights: Float[ArrayLike, "*rows S"], mask: Bool[ArrayLike, "*#rows #S"] | None = None
) -> Float[Array, "*rows"]:
    """``exp(entropy)``: the number of keys a row effectively attends to (1 one-hot, S uniform), with
    weights ``[..., S]`` and mask as in the module docstring; ``[...]``, 0 for a row with no unmasked key."""
    p, ulp = _weights(weights)
    return _stats(p, _keep(mask, p.shape), ulp, ("effective_support",))["effective_support"]


def row_stats(
    weights: Float[ArrayLike, "*rows S"], mask: Bool[ArrayLike, "*#rows #S"] | None = None
) -> dict[str, Float[Array, "*rows"]]:
    """All row statistics of a map at once.

    Args:
      weights: ``[..., S]``.
      mask: optional boolean keep-mask broadcastable to ``weights``.

    Returns:
      dict of ``[...]`` arrays: ``entropy`` (nats), ``normalized_entropy``, ``max_weight``,
      ``effective_support`` and ``num_keys`` (unmasked keys per row).
    """
    p, ulp = _weights(weights)
    return _stats(p, _keep(mask, p.shape), ulp, STATS)


def head_entropy(
    weights: Float[ArrayLike, "*heads T S"],
    mask: Bool[ArrayLike, "*#heads #T #S"] | Bool[ArrayLike, "#S"] | None = None,
    *,
    normalized: bool = False,
) -> Float[Array, "*heads"]:
    """Mean row entropy of each head: the average over queries of :func:`entropy`.

    Rows with no unmasked key are left out of the average. For a model's maps ``[L, N, T, S]`` and a
    causal mask ``[T, S]`` this gives the per-layer, per-head entropy ``[L, N]`` tracked in training.

    Args:
      weights: ``[..., T, S]``.
      mask: optional boolean keep-mask broadcastable to ``weights``.
      normalized: average :func:`normalized_entropy` instead (rows with one key count as 0).

    Returns:
      ``[...]``.
    """
    p, ulp = _weights(weights, axes="[..., T, S]")
    if p.ndim < 2:
        raise ValueError(f"weights must have at least 2 dimensions [..., T, S], received shape {tuple(p.shape)}")
    normalized = check_flag(normalized, "normalized")
    stats = _stats(p, _keep(mask, p.shape), ulp, ("normalized_entropy" if normalized else "entropy", "num_keys"))
    h, n = stats.values()
    rows = (n > 0).astype(h.dtype)
    return jnp.sum(h * rows, axis=-1) / jnp.maximum(jnp.sum(rows, axis=-1), 1.0)



def _complement(p: Array) -> tuple[Array, Array]:
    """``(1 - p_s, is_argmax)``, with ``1 - p_max`` summed from the other weights (no cancellation).

    Only the row's largest weight can exceed 1/2, so for every other entry ``1 - p_s`` is accurate as is;
    for the largest, ``1 - p_max`` rounds to 0 long before the other weights do, so it is their sum.
    """
    S = p.shape[-1]
    is_max = jax.nn.one_hot(jnp.argmax(p, axis=-1), S, dtype=jnp.bool_)  # [..., S]
    others = jnp.sum(jnp.where(is_max, 0.0, p), axis=-1, keepdims=True)  # [..., 1]
    return jnp.where(is_max, others, 1.0 - p), is_max
