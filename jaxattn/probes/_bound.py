"""A lower bound on a head's attention entropy from the spectral norm of its query-key matrix.

Zhai et al. (2023), "Stabilizing Transformer Training by Preventing Attention Entropy Collapse" (ICML),
bound the entropy of an attention row from below by a function that decreases in ``σ = ‖W_Q W_Kᵀ‖₂``:
a head whose query-key matrix has a small spectral norm cannot put all its weight on one key. The bound
rests on two facts, implemented here for one head on its actual inputs:

1. **The logits of row i cannot spread more than** ``β_i``. With ``q_i = W_Qᵀ x_i + b_q`` and
   ``k_j = W_Kᵀ x_j + b_k``, ``a_ij = s · q_i·k_j = s · x̃_iᵀ W̃ x_j + const_i`` where ``x̃_i = [x_i, 1]``,
   ``W̃ = [W_Q; b_qᵀ] W_Kᵀ`` (``[D + 1, D]``) and ``const_i`` (from ``b_k``) is the same for every key,
   so it leaves the softmax unchanged. Hence
   ``max_j a_ij - min_j a_ij ≤ β_i = s · σ · ‖x̃_i‖ · max_{j,k} ‖x_j - x_k‖`` with ``σ = ‖W̃‖₂``, the
   maximum over the keys row i sees. Under rotary embeddings (``rotary=True``) q and k are rotated by
   angles that depend on their positions, so ``W̃`` is not one matrix and the key bias no longer cancels;
   then ``|a_ij - a_ik| ≤ s ‖q_i‖ (‖k_j‖ + ‖k_k‖)`` (rotations keep norms), so
   ``β_i = s · σ · ‖x̃_i‖ · 2 max_j ‖x̃_j‖`` with ``σ = ‖[W_Q; b_qᵀ]‖₂ ‖[W_K; b_kᵀ]‖₂``.
2. **Among rows whose logits spread at most β over n keys, the entropy is smallest at a two-level row**:
   k logits at the top and n - k at the bottom (along any one logit, the entropy rises then falls, so
   its minimum over an interval is at an end), whose entropy is
   ``H_k(β) = log(k e^β + n - k) - k β e^β / (k e^β + n - k)``. The floor is ``min_{1 ≤ k < n} H_k(β)``.

Zhai et al. state the bound with one logit at the top (``k = 1``):
``log(1 + (n-1) e^{-β}) + β (n-1) e^{-β} / (1 + (n-1) e^{-β})``. For large β that is the minimum, but
for n ≥ 3 and small β a row with more logits at the top has less entropy (n = 4, β = 0.5:
``H_1 = 1.3593 > H_2 = 1.3560``), so :func:`entropy_floor` takes the minimum over k, which is a bound for
every β. The exact text of their theorem (the form of β) was not available where this was written; the
derivation above is complete on its own and is what the tests check.

The same two facts bound a soft-capped head with no spectral norm at all: ``c · tanh(x / c)`` keeps every
logit in ``(-c, c)``, a spread below ``2c``, so :func:`logit_cap_bounds` gives the entropy floor and the
largest weight (:func:`max_weight_ceiling`) of any row of it.

Axis alphabet: T queries, S keys, D model width, H head dim.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._checks import as_bool_array, as_float_array, check_flag, check_int, check_logit_cap, check_rank, check_scale
from jaxattn._typing import ArrayLike, Bool, Float, Real

Array = jax.Array


def _concrete(x: Any) -> np.ndarray | None:
    """``x`` as float64 NumPy when concrete; None when traced (under ``jit``/``vmap``: it cannot be checked)."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x, np.float64)


def _check_spread_keys(spread: Any, n_keys: Any, k: Any = None, max_keys: int | None = None) -> None:
    """``ValueError`` for a concrete ``spread < 0``, ``n_keys`` not a whole number >= 1 (or above
    ``max_keys``), ``k`` outside ``1 <= k <= n_keys``; NaN passes (NaN in, NaN out)."""
    b, n, kk = _concrete(spread), _concrete(n_keys), None if k is None else _concrete(k)
    if b is not None and np.any(b < 0):
        raise ValueError(f"spread must be >= 0 (the largest logit minus the smallest), received {np.min(b)!r}")
    if n is not None and np.any((n < 1) | (n != np.round(n))):
        raise ValueError(f"n_keys must be whole numbers >= 1, received {n_keys!r}")
    if n is not None and max_keys is not None and np.any(n > max_keys):
        raise ValueError(f"n_keys must be <= max_keys={max_keys} (the k searched are 1 .. max_keys - 1), "
                         f"received {n_keys!r}")
    if kk is not None and n is not None:
        kb, nb = np.broadcast_arrays(kk, n)
        if np.any((kb < 1) | (kb > nb) | (kb != np.round(kb))):
            raise ValueError(f"k must be a whole number with 1 <= k <= n_keys, received k={k!r}, n_keys={n_keys!r}")


def two_level_entropy(spread: Real[ArrayLike, "..."], n_keys: Any, k: Any) -> Float[Array, "..."]:
    """``H_k(β)``: the entropy of a softmax over ``n_keys`` logits, ``k`` of them ``β`` above the rest.

    ``log(k e^β + n - k) - k β e^β / (k e^β + n - k)``, computed as ``log k + log1p(r / k) + β r / z`` with
    ``r = (n-k) e^{-β}``, ``z = k + r``: no overflow for large β and no cancellation (every term ≥ 0), so
    the small entropies of large β keep their float32 digits. ``k = 1`` is the form Zhai et al. state.
    Concrete values must satisfy ``β >= 0`` and ``1 <= k <= n`` (``ValueError``; traced ones cannot be checked).
    """
    _check_spread_keys(spread, n_keys, k)
    beta = jnp.asarray(spread, jnp.float32)
    n = jnp.asarray(n_keys, jnp.float32)
    k = jnp.asarray(k, jnp.float32)
    r = (n - k) * jnp.exp(-beta)  # the weight of the low logits relative to one high one
    z = k + r
    return jnp.log(k) + jnp.log1p(r / k) + jnp.where(r > 0, beta * r / z, 0.0)


def entropy_floor(spread: Real[ArrayLike, "..."], n_keys: Any, *, max_keys: int) -> Float[Array, "..."]:
    """The least entropy of a softmax over ``n_keys`` logits whose largest minus smallest is ≤ ``spread``.

    ``min_{1 ≤ k < n} H_k(spread)`` (:func:`two_level_entropy`): ``log n`` at spread 0, falling towards 0
    as the spread grows; 0 for a row with one key.

    Args:
      spread: ``[...]``, β ≥ 0.
      n_keys: ``[...]`` (broadcastable), the number of keys of each row, ``1 <= n <= max_keys``.
      max_keys: the largest ``n_keys`` (static: the k searched are ``1 .. max_keys - 1``).
    """
    max_keys = check_int(max_keys, "max_keys")
    _check_spread_keys(spread, n_keys, max_keys=max_keys)
    return _floor(jnp.asarray(spread, jnp.float32), jnp.asarray(n_keys, jnp.float32), max_keys)


@functools.partial(jax.jit, static_argnames="max_keys")
def _floor(beta: Array, n: Array, max_keys: int) -> Array:
    beta, n = jnp.broadcast_arrays(beta, n)  # [...]
    if max_keys < 2:
        return jnp.zeros(jnp.broadcast_shapes(beta.shape, n.shape), jnp.float32)
    ks = jnp.arange(1, max_keys, dtype=jnp.float32).reshape((-1,) + (1,) * beta.ndim)  # [K, 1...]
    h = two_level_entropy(beta[None], n[None], ks)  # [K, ...]
    h = jnp.where(ks < n[None], h, jnp.inf)  # only 1 <= k < n
    return jnp.where(n > 1, jnp.min(h, axis=0), 0.0)


def max_weight_ceiling(spread: Real[ArrayLike, "..."], n_keys: Any) -> Float[Array, "..."]:
    """The largest weight a softmax over ``n_keys`` logits whose largest minus smallest is ≤ ``spread`` can
    give: one logit β above the other n - 1, ``e^β / (e^β + n - 1)``, computed as ``1 / (1 + (n - 1) e^{-β})``
    (float32; 1 for a row with one key). The weight of the top logit rises with the gap to each other logit,
    so it is largest when every other logit is β below it. Concrete values must satisfy ``β >= 0`` and
    ``n >= 1`` (``ValueError``)."""
    _check_spread_keys(spread, n_keys)
    beta = jnp.asarray(spread, jnp.float32)
    n = jnp.asarray(n_keys, jnp.float32)
    return 1.0 / (1.0 + (n - 1.0) * jnp.exp(-beta))


def logit_cap_bounds(logit_cap: Any, num_keys: int) -> dict[str, float]:
    """What a logit soft cap ``c · tanh(x / c)`` guarantees every row over ``num_keys`` keys, whatever the
    logits ``x``.

    The capped logits lie in ``(-c, c)``, so they spread less than ``2c``, hence
    (:func:`max_weight_ceiling` and :func:`entropy_floor` at spread ``2c``):

    - ``max_weight``: max weight ≤ ``e^{2c} / (e^{2c} + S - 1)``, one key at ``+c`` and the other S - 1 at ``-c``;
    - ``entropy``: entropy ≥ ``min_{1 ≤ m < S} H_m(2c)``, the least entropy of ``m`` logits at ``+c`` and
      ``S - m`` at ``-c`` (:func:`two_level_entropy`). For a large enough cap (S = 8: c ≳ 1.12; S = 16:
      c ≳ 1.68) the minimum is at ``m = 1``, the row with one weight at the max-weight bound and the rest
      shared equally; below, more keys at ``+c`` give less entropy.

    Args:
      logit_cap: the cap ``c > 0``, a concrete number.
      num_keys: S ≥ 1, the keys of the row (kept keys, under a mask).

    Returns:
      dict of floats (computed in float32): ``max_weight``, ``entropy`` (nats).
    """
    c = check_logit_cap(logit_cap)
    if c is None or not isinstance(c, float):
        raise TypeError(f"logit_cap must be a concrete number > 0, received {logit_cap!r}")
    S = check_int(num_keys, "num_keys")
    return {"max_weight": float(max_weight_ceiling(2.0 * c, S)), "entropy": float(entropy_floor(2.0 * c, S, max_keys=S))}


def qk_spectral_norm(w_q: Float[ArrayLike, "D H"], w_k: Float[ArrayLike, "D H"],
                     b_q: Float[ArrayLike, "H"] | None = None, *, b_k: Float[ArrayLike, "H"] | None = None,
                     rotary: bool = False) -> Float[Array, ""]:
    """The σ of :func:`entropy_lower_bound`: ``‖[W_Q; b_qᵀ] W_Kᵀ‖₂``, the largest singular value of the
    head's bilinear form (``[D+1, D]``); under ``rotary``, ``‖[W_Q; b_qᵀ]‖₂ ‖[W_K; b_kᵀ]‖₂``."""
    rotary = check_flag(rotary, "rotary")
    w_q, w_k = _projections(w_q, w_k, b_q)
    if rotary:
        return jnp.linalg.norm(w_q, ord=2) * jnp.linalg.norm(_augment(w_k, b_k, "b_k"), ord=2)
    return jnp.linalg.norm(w_q @ w_k.T, ord=2)


def _bias(b: Any, name: str, H: int) -> Array | None:
    """``b`` as float32 ``[H]`` (or None), checked."""
    if b is None:
        return None
    b = as_float_array(b, name)
    if b.shape != (H,):
        raise ValueError(f"{name} must have shape [H] = ({H},), received {tuple(b.shape)}")
    return b.astype(jnp.float32)


def _augment(w: Array, b: Any, name: str) -> Array:
    """``[W; bᵀ]`` (``[D + 1, H]``), or ``W`` when ``b`` is None."""
    b = _bias(b, name, w.shape[1])
    return w if b is None else jnp.concatenate([w, b[None]], axis=0)


def _projections(w_q: Any, w_k: Any, b_q: Any) -> tuple[Array, Array]:
    """The checked query and key projections in float32: ``[W_Q; b_qᵀ]`` (``[D(+1), H]``) and ``W_K`` ``[D, H]``."""
    w_q = as_float_array(w_q, "w_q")
    w_k = as_float_array(w_k, "w_k")
    check_rank(w_q, 2, "w_q", "[D, H]")
    check_rank(w_k, 2, "w_k", "[D, H]")
    if w_q.shape != w_k.shape:
        raise ValueError(f"w_q and w_k must have one shape [D, H], received {tuple(w_q.shape)} and {tuple(w_k.shape)}")
    return _augment(w_q.astype(jnp.float32), b_q, "b_q"), w_k.astype(jnp.float32)  # [D(+1), H], [D, H]


def logit_spread_bound(
    x: Float[ArrayLike, "T D"],
    w_q: Float[ArrayLike, "D H"],
    w_k: Float[ArrayLike, "D H"],
    *,
    b_q: Float[ArrayLike, "H"] | None = None,
    b_k: Float[ArrayLike, "H"] | None = None,
    scale: Real[ArrayLike, ""] | None = None,
    mask: Bool[ArrayLike, "T T"] | None = None,
    rotary: bool = False,
) -> Float[Array, "T"]:
    """``β [T]``: how far apart each row's logits can be, from the head's spectral norm (module docstring).

    Args:
      x: ``[T, D]`` the head's input, the tokens the queries and keys are projected from (after the
        block's LayerNorm or RMSNorm in a pre-norm model; the block input in a post-norm one).
      w_q, w_k: ``[D, H]`` the head's query and key projections (``q = x W_Q + b_q``, ``k = x W_K + b_k``).
      b_q: ``[H]`` the query bias, or ``None``.
      b_k: ``[H]`` the key bias, or ``None``: used only under ``rotary`` (otherwise it cancels).
      scale: the logit scale s; ``None`` is ``1/sqrt(H)``.
      mask: ``[T, T]`` boolean keep-mask (True = row i sees key j), e.g. causal; ``None``: all.
      rotary: the head applies rotary position embeddings to q and k (``β`` then uses ``‖W̃_Q‖‖W̃_K‖``).

    Returns:
      ``[T]``: ``β_i ≥ max_j a_ij - min_j a_ij`` over the keys row i sees.
    """
    x = as_float_array(x, "x").astype(jnp.float32)
    check_rank(x, 2, "x", "[T, D]")
    wq, wk = _projections(w_q, w_k, b_q)
    if x.shape[1] != wk.shape[0]:
        raise ValueError(f"x must be [T, D] with D = {wk.shape[0]} (the rows of w_k), received {tuple(x.shape)}")
    rotary = check_flag(rotary, "rotary")
    T, H = x.shape[0], wk.shape[1]
    s = jnp.asarray(check_scale(scale, H), jnp.float32)
    keep = _keep_mask(mask, T)
    return _spread(x, wq, wk, _bias(b_k, "b_k", H), s, keep, rotary, b_q is not None)


def _keep_mask(mask: Any, T: int) -> Array:
    """The checked keep-mask ``[T, T]`` (row i sees key j); all True for None."""
    if mask is None:
        return jnp.ones((T, T), bool)
    keep = as_bool_array(mask, "mask")
    if keep.shape != (T, T):
        raise ValueError(f"mask must have shape [T, T] = ({T}, {T}), received {tuple(keep.shape)}")
    return keep


@functools.partial(jax.jit, static_argnames=("rotary", "has_b_q"))
def _spread(x: Array, wq: Array, wk: Array, b_k: Array | None, s: Array, keep: Array, rotary: bool,
            has_b_q: bool) -> Array:
    T = x.shape[0]
    ones = jnp.ones((T, 1), jnp.float32)
    x_aug = jnp.concatenate([x, ones], axis=1) if has_b_q else x  # [T, D(+1)]
    q_norm = jnp.linalg.norm(x_aug, axis=1)  # [T], ‖x̃_i‖
    if rotary:
        wk_aug = wk if b_k is None else jnp.concatenate([wk, b_k[None]], axis=0)  # [D(+1), H]
        sigma = jnp.linalg.norm(wq, ord=2) * jnp.linalg.norm(wk_aug, ord=2)
        norms = jnp.linalg.norm(jnp.concatenate([x, ones], axis=1) if b_k is not None else x, axis=1)  # [S]
        width = 2 * jnp.max(jnp.where(keep, norms[None, :], 0.0), axis=1)  # [T]
    else:
        sigma = jnp.linalg.norm(wq @ wk.T, ord=2)
        dist = jnp.linalg.norm(x[:, None, :] - x[None, :, :], axis=-1)  # [S, S]
        both = keep[:, :, None] & keep[:, None, :]  # [T, S, S]
        width = jnp.max(jnp.where(both, dist[None], 0.0), axis=(1, 2))  # [T], the widest pair row i sees
    return s * sigma * q_norm * width  # [T]


def entropy_lower_bound(x: Float[ArrayLike, "T D"], w_q: Float[ArrayLike, "D H"], w_k: Float[ArrayLike, "D H"],
                        **options: Any) -> Float[Array, "T"]:
    """Each row's entropy floor for one head on its inputs: :func:`entropy_floor` of
    :func:`logit_spread_bound` over the keys the row sees.

    Args:
      x, w_q, w_k: as in :func:`logit_spread_bound`.
      **options: :func:`logit_spread_bound`'s keywords, checked there: ``b_q``, ``b_k``, ``scale``,
        ``mask``, ``rotary``.

    Returns:
      ``[T]`` nats: a lower bound on the entropy of each row of this head's attention; 0 for rows with
      at most one key.
    """
    beta = logit_spread_bound(x, w_q, w_k, **options)  # [T]
    T = beta.shape[0]
    n = jnp.sum(_keep_mask(options.get("mask"), T), axis=1)  # [T]; 0 for a row that keeps no key (padding)
    return entropy_floor(beta, jnp.maximum(n, 1), max_keys=T)  # a floor of 0 at one key or none
