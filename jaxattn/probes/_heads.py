"""Saturation of a model's attention heads, per layer and head, from its captured pre-softmax logits.

A model's forward captures ``attn_logits [L, N, T, S]`` (the softmax's own input, after any logit cap, before
the masks); :func:`layer_keep_masks` makes the keep-mask each layer's softmax ran under (padding, causality,
each layer's sliding window), and :func:`head_saturation` reduces every counted row of every head to one
record per ``(layer, head)``: the spread of its logits, its entropy, its softmax Jacobian norm and the
fraction of its rows that are saturated.

Axis alphabet: B sentences, L layers, N heads, T queries, S keys (S = T for self-attention), Q quantiles.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._attention import _masked_softmax
from jaxattn._checks import as_bool_array, as_float_array, softmax_dtype
from jaxattn._typing import ArrayLike, Bool, Float
from jaxattn.probes._jacobian import _jacobian_norms
from jaxattn.probes._rows import _entropy, _max_kept

Array = jax.Array

DEFAULT_THRESHOLD = 0.99  # a row is saturated when its largest weight is at least this
DEFAULT_QUANTILES = (0.1, 0.5, 0.9)


# ----------------------------------------------------------------------------------------------------
# The keep-mask of each layer.
# ----------------------------------------------------------------------------------------------------


def layer_keep_masks(
    attention_mask: Bool[ArrayLike, "*B T"] | Any,
    *,
    causal: bool,
    windows: Sequence[int | None] | None = None,
) -> Bool[Array, "*B L 1 T T"]:
    """The keep-mask every layer's self-attention ran under, shaped to broadcast against captured logits.

    ``keep[..., l, 0, t, s]`` is True when query ``t`` and key ``s`` are both real tokens
    (``attention_mask``), ``s <= t`` if ``causal``, and, for a layer with a sliding window ``w``,
    ``pos[t] - pos[s] < w``, with ``pos`` each real token's index among the real tokens (the positions
    the bundled decoders count windows in, so padding anywhere gives the window of the sequence alone).
    A padded query row keeps no key: it is no row of the sentence.

    Args:
      attention_mask: ``[T]`` or ``[B, T]``, 1 (or True) for a real token, 0 for padding.
      causal: whether query ``t`` sees only keys ``s <= t`` (a decoder; ``False`` for an encoder).
      windows: each layer's sliding window (an int ``>= 1``, or None for a full layer), e.g. a model's
        ``Sizes.layer_windows``; ``None``: every layer full, one mask for all (an ``L`` axis of 1).

    Returns:
      boolean ``[..., L, 1, T, T]`` (``[..., 1, 1, T, T]`` without ``windows``): broadcastable to
      ``attn_logits [..., L, N, T, T]``.

    Raises:
      TypeError, ValueError: naming ``attention_mask``, ``causal`` or ``windows``.
    """
    real = _attention_mask(attention_mask)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, received {type(causal).__name__}")
    sizes = _windows(windows)
    T = real.shape[-1]
    pos = jnp.cumsum(real, axis=-1) - 1  # [..., T], each real token's index among the real ones
    keep = real[..., :, None] & real[..., None, :]  # [..., T, S]
    if causal:
        lower = jnp.tril(jnp.ones((T, T), bool)).reshape((1,) * (keep.ndim - 2) + (T, T))
        keep = keep & lower  # query t sees keys s <= t
    if sizes is None:
        return keep[..., None, None, :, :]  # [..., 1, 1, T, S]
    distance = pos[..., :, None] - pos[..., None, :]  # [..., T, S]
    layers = [keep if w is None else keep & (distance < w) for w in sizes]
    return jnp.stack(layers, axis=-3)[..., None, :, :]  # [..., L, 1, T, S]


def _attention_mask(attention_mask: Any) -> Array:
    a = np.asarray(attention_mask)
    if a.dtype != np.bool_ and not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"attention_mask must be integer or boolean (1 = token, 0 = padding), received dtype {a.dtype}")
    if a.ndim not in (1, 2) or a.shape[-1] == 0:
        raise ValueError(f"attention_mask must be [T] or [B, T] with T >= 1, received shape {a.shape}")
    if not np.isin(a, (0, 1)).all():
        raise ValueError("attention_mask must hold only 0 and 1 (True and False)")
    return jnp.asarray(a.astype(bool))


def _windows(windows: Any) -> tuple[int | None, ...] | None:
    if windows is None:
        return None
    if isinstance(windows, (str, bytes)) or not hasattr(windows, "__iter__"):
        raise TypeError(f"windows must be a sequence of ints or None (one per layer), received {type(windows).__name__}")
    out = tuple(windows)
    for w in out:
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1):
            raise ValueError(f"windows must hold ints >= 1 or None (one per layer), received {w!r}")
    if not out:
        raise ValueError("windows must name at least one layer, received an empty sequence")
    return tuple(None if w is None else int(w) for w in out)


# ----------------------------------------------------------------------------------------------------
# Per-row measures, reduced per (layer, head).
# ----------------------------------------------------------------------------------------------------

def head_saturation(
    logits: Float[ArrayLike, "*B L N T S"],
    mask: Bool[ArrayLike, "*#B #L #N #T #S"],
    *,
    threshold: float = DEFAULT_THRESHOLD,
    quantiles: Sequence[float] = DEFAULT_QUANTILES,
) -> dict[str, Array]:
    """How saturated each head of a model is, over its real rows: one value per ``(layer, head)``.

    Every row is one query of one sentence: ``p = softmax(logits)`` over the keys ``mask`` keeps (the core's
    masked softmax, in float32). A row counts when it keeps at least two keys: a padded query row (no kept
    key) never counts, and a row with a single kept key (the first token under a causal mask, or the first
    tokens of a sentence under a window of 1) is excluded too, because its weight is 1 whatever its logits:
    it is saturated by the mask, not by the logits, and has no spread. Per row:

    - **spread** ``g = x_(1) - x_(2)``, the gap between the two largest kept logits: the quantity the
      unscaled laws of ``docs/saturation.md`` are written in (a row is one-hot up to ``p_2 ≈ e^{-g}``);
    - **entropy** ``H(p) = -Σ p log p`` in nats (:func:`entropy`'s definition, exact on saturated rows);
    - **Jacobian norm** ``‖diag(p) - p pᵀ‖_F`` (the ``frobenius`` of :func:`softmax_jacobian_norms`, stable
      when saturated), the size of the gradient the softmax passes to its logits;
    - **max weight** ``max_s p_s``; the row is **saturated** when ``max_s p_s >= threshold`` (0.99 by
      default: at most 1% of the weight off the top key). A saturated row has a spread ``g >= log 99 ≈ 4.6``
      (a row of two kept keys is saturated exactly then), and every row of ``n`` kept keys with
      ``g >= log(99 (n - 1))`` is saturated.

    Pass the captured logits the softmax consumed (``attn_logits``, after a logit cap when the model has
    one) and the mask the softmax ran under (:func:`layer_keep_masks`: padding, causality, each layer's
    window): the measures are those of the model's own weights.

    Args:
      logits: ``[L, N, T, S]`` (one sentence) or ``[B, L, N, T, S]`` (B sentences, rows pooled over them),
        a float array.
      mask: boolean keep-mask (True = attend) broadcastable to ``logits``, e.g. ``[B, L, 1, T, S]``.
      threshold: the max weight at or above which a row is saturated, in ``(0, 1]``.
      quantiles: the levels of ``spread_quantiles``, each in ``[0, 1]`` (linear interpolation, as
        ``numpy.quantile``'s default).

    Returns:
      a dict of float32 arrays ``[L, N]`` (``spread_quantiles``: ``[Q, L, N]``): ``rows`` (counted rows),
      ``single_key_rows`` (excluded rows with one kept key), ``spread_median``, ``spread_quantiles``,
      ``entropy_mean``, ``jacobian_median``, ``max_weight_median``, ``saturated_fraction`` (of the counted
      rows) and ``zero_jacobian_fraction`` (counted rows whose Jacobian norm is exactly 0 in float32). A head
      with no counted row has NaN statistics and 0 rows; a head with a counted row whose kept logits hold a
      NaN (or +inf) has NaN statistics, its rows still counted (NaN in, NaN out: never the other rows' values).

    Raises:
      TypeError, ValueError: naming ``logits``, ``mask``, ``threshold`` or ``quantiles``, before anything is
        traced.
    """
    x = as_float_array(logits, "logits")
    if x.ndim not in (4, 5):
        raise ValueError(f"logits must be [L, N, T, S] or [B, L, N, T, S], received shape {tuple(x.shape)}")
    if mask is None:
        raise TypeError("mask must be a boolean keep-mask broadcastable to logits (the mask the softmax ran under), "
                        "received None")
    keep = as_bool_array(mask, "mask")
    if keep.ndim > x.ndim or not _broadcasts(tuple(keep.shape), tuple(x.shape)):
        raise ValueError(f"mask must be broadcastable to logits {tuple(x.shape)}, received shape {tuple(keep.shape)}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.floating, np.integer)) or not (
            0.0 < float(threshold) <= 1.0):
        raise ValueError(f"threshold must be a number in (0, 1], received {threshold!r}")
    levels = _quantiles(quantiles)
    if x.ndim == 4:
        x = x[None]  # one sentence: B = 1
    keep = jnp.broadcast_to(keep.reshape((1,) * (5 - keep.ndim) + keep.shape), x.shape)
    return _head_saturation(x.astype(softmax_dtype(x.dtype)), keep, float(threshold), levels)


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return np.broadcast_shapes(shape, target) == target
    except ValueError:
        return False


def _quantiles(quantiles: Any) -> tuple[float, ...]:
    if isinstance(quantiles, (str, bytes)) or not hasattr(quantiles, "__iter__"):
        raise TypeError(f"quantiles must be a sequence of numbers in [0, 1], received {type(quantiles).__name__}")
    out = tuple(quantiles)
    if not out or not all(isinstance(q, (int, float, np.floating, np.integer)) and not isinstance(q, bool)
                          and 0.0 <= float(q) <= 1.0 for q in out):
        raise ValueError(f"quantiles must be a non-empty sequence of numbers in [0, 1], received {quantiles!r}")
    return tuple(float(q) for q in out)


@functools.partial(jax.jit, static_argnames=("threshold", "levels"))
def _head_saturation(x: Array, keep: Array, threshold: float, levels: tuple[float, ...]) -> dict[str, Array]:
    """:func:`head_saturation` of checked ``x, keep [B, L, N, T, S]``, one compiled program."""
    n_keys = jnp.sum(keep, axis=-1)  # [B, L, N, T]
    counted = n_keys >= 2  # [B, L, N, T]
    p = _masked_softmax(x, keep)  # [B, L, N, T, S], float32
    h = _entropy(p, keep)  # [B, L, N, T]
    jac = _jacobian_norms(p)["frobenius"]  # [B, L, N, T]
    top = _max_kept(p, keep)  # [B, L, N, T]
    low = jnp.finfo(x.dtype).min
    masked = jnp.where(keep, x, low)  # [B, L, N, T, S]
    two = jax.lax.top_k(masked, 2)[0] if x.shape[-1] >= 2 else jnp.concatenate([masked, masked], axis=-1)
    spread = two[..., 0] - two[..., 1]  # [B, L, N, T], meaningful where counted

    def rows_last(a: Array) -> Array:  # [B, L, N, T] -> [L, N, B * T], excluded rows NaN
        a = jnp.where(counted, a, jnp.nan)
        return jnp.moveaxis(a, 0, 2).reshape(a.shape[1], a.shape[2], -1)

    c = jnp.moveaxis(counted, 0, 2).reshape(counted.shape[1], counted.shape[2], -1)  # [L, N, B * T]
    rows = jnp.sum(c, axis=-1).astype(jnp.float32)  # [L, N]

    def mean(a: Array) -> Array:
        return jnp.nansum(rows_last(a), axis=-1) / jnp.where(rows > 0, rows, jnp.nan)

    def frac(flag: Array) -> Array:
        return mean(flag.astype(jnp.float32))

    spreads = rows_last(spread)
    single = jnp.moveaxis(n_keys == 1, 0, 2).reshape(c.shape)
    # a counted row whose softmax is NaN (a kept NaN or +inf logit) makes its head's statistics NaN; the
    # nan-reductions below skip NaN, which marks the excluded rows
    bad = jnp.any(jnp.moveaxis(counted & jnp.isnan(h), 0, 2).reshape(c.shape), axis=-1)  # [L, N]
    stats = {
        "spread_median": jnp.nanquantile(spreads, 0.5, axis=-1),
        "spread_quantiles": jnp.nanquantile(spreads, jnp.asarray(levels, jnp.float32), axis=-1),
        "entropy_mean": mean(h),
        "jacobian_median": jnp.nanquantile(rows_last(jac), 0.5, axis=-1),
        "max_weight_median": jnp.nanquantile(rows_last(top), 0.5, axis=-1),
        "saturated_fraction": frac(top >= threshold),
        "zero_jacobian_fraction": frac(jac == 0),
    }
    return {"rows": rows, "single_key_rows": jnp.sum(single, axis=-1).astype(jnp.float32),
            **{name: jnp.where(bad, jnp.nan, a) for name, a in stats.items()}}
