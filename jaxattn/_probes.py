"""Probes of softmax saturation: what an attention map looks like, and what gradient flows through it.

Everything here is a pure function of arrays, composes with ``jax.jit``/``jax.vmap``, and takes an
optional boolean keep-mask (True = attend) broadcastable to the map. The attention maps, logits and
gradients the probes measure come from the core (:func:`jaxattn.attention`, :func:`jaxattn.attention_logits`
and its masked softmax): there is no second attention path here.

Axis alphabet as in :mod:`jaxattn._attention` (T queries, S keys, H = d_k, V = d_v); ``...`` is any
leading batch of rows (e.g. ``[L, N, T]`` for every layer and head of a model). Sweep results add
``P`` (one entry per head dimension swept) and ``R`` (random trials); their first axis of size 2 is
the scale mode, ``0`` = scaled by ``1/sqrt(d_k)``, ``1`` = unscaled.

Probes, in order:
  * row statistics of a map: :func:`entropy`, :func:`normalized_entropy`, :func:`max_weight`,
    :func:`effective_support`, :func:`row_stats`, :func:`head_entropy`;
  * the softmax Jacobian ``diag(p) - p pᵀ`` in closed form, :func:`softmax_jacobian`, and its norms,
    :func:`softmax_jacobian_norms` (computed without forming the ``[S, S]`` matrix, stable when saturated);
  * gradients through the core attention by ``jax.grad``: :func:`attention_grads`, :func:`grad_norms`;
  * the variance of ``q·k``: :func:`dot_product_variance`;
  * the saturation sweep as one ``jit(vmap(...))`` program: :func:`saturation_sweep`, summarised by
    :func:`summarize_sweep`;
  * the laws the sweep obeys (float64 NumPy, extreme-value statistics of the top-two logit gap):
    :func:`gap_survival`, :func:`gap_density_at_zero`, :func:`gap_median`, :func:`underflow_gap`,
    :func:`predicted_laws`, and :func:`fit_power_law`, :func:`fit_stretched_exp` to fit measurements.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._attention import _masked_softmax, _validate_single, attention, attention_logits
from jaxattn._checks import as_bool_array, as_float_array, check_broadcastable, softmax_dtype

Array = jax.Array

DEFAULT_HEAD_DIMS = tuple(2**i for i in range(3, 13))  # 8, 16, ..., 4096

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
    dtype the weights came in, plus ``4·S`` ulps of ``p``'s) whose
    largest weight exceeds 1/2, that term is computed as ``p_max · log1p(-ε)`` with ε summed from the
    other weights (no cancellation); any other row is summed as it is. The derivative is always that of
    the plain sum, ``-(log p_s + 1)`` (the correction enters through ``stop_gradient``).
    """
    if keep is not None:
        p = jnp.where(keep, p, 0.0)
    terms = _xlogx(p)  # [..., S]
    S = p.shape[-1]
    if S < 2:
        return -jnp.sum(terms, axis=-1)
    complement, is_max = _complement(p)  # [..., S]: 1 - p_s, with 1 - p_max summed from the others
    others = jnp.sum(jnp.where(is_max, complement, 0.0), axis=-1, keepdims=True)  # [..., 1], ε
    p_max = jnp.max(p, axis=-1, keepdims=True)  # [..., 1]
    # Rounding a distribution to its dtype moves its sum by at most ulp/2; computing it (softmax, sums) in
    # p's dtype by a few ulps per key.
    tolerance = (0.0 if ulp is None else ulp) + 4 * S * float(jnp.finfo(p.dtype).eps)
    use = (jnp.abs(p_max + others - 1.0) <= tolerance) & (others < 0.5)  # [..., 1]
    safe = jnp.where(use, others, 0.0)  # log1p(-ε) finite, with a finite gradient, wherever it is not used
    plain = -jnp.sum(terms, axis=-1)
    exact = -jnp.sum(jnp.where(is_max & use, p_max * jnp.log1p(-safe), terms), axis=-1)
    return plain + jax.lax.stop_gradient(exact - plain)


def _num_keys(p: Array, keep: Array | None) -> Array:
    if keep is None:
        return jnp.full(p.shape[:-1], p.shape[-1], p.dtype)
    return jnp.sum(keep, axis=-1).astype(p.dtype)


def entropy(weights: Any, mask: Any = None) -> Array:
    """Row entropy of an attention map, in nats: ``H(p) = -Σ_s p_s log p_s`` with ``0 log 0 = 0``.

    Exactly 0 (never NaN) for a one-hot row whose other weights underflowed to 0, which is the row a
    saturated softmax produces; a naive ``p * log(clip(p, tiny))`` is not. The gradient is finite too.

    Args:
      weights: ``[..., S]``, each row a distribution over S keys (e.g. ``[T, S]`` or ``[L, N, T, S]``).
      mask: optional boolean keep-mask broadcastable to ``weights``; masked entries are ignored.

    Returns:
      ``[...]`` in at least float32. A fully masked (all-zero) row has entropy 0.
    """
    p, ulp = _weights(weights)
    return _entropy(p, _keep(mask, p.shape), ulp)


def normalized_entropy(weights: Any, mask: Any = None) -> Array:
    """Row entropy divided by its maximum, ``log(number of unmasked keys)``: 1 uniform, 0 one-hot.

    Rows with fewer than 2 unmasked keys (where the maximum is 0) return 0.

    Args:
      weights: ``[..., S]``.
      mask: optional boolean keep-mask broadcastable to ``weights``.

    Returns:
      ``[...]`` in ``[0, 1]`` (up to rounding), at least float32.
    """
    p, ulp = _weights(weights)
    keep = _keep(mask, p.shape)
    n = _num_keys(p, keep)
    log_n = jnp.log(jnp.where(n > 1, n, 2.0))
    return jnp.where(n > 1, _entropy(p, keep, ulp) / log_n, 0.0)


def max_weight(weights: Any, mask: Any = None) -> Array:
    """The largest weight of each row, ``max_s p_s`` (1 for one-hot, ``1/S`` for uniform).

    Args:
      weights: ``[..., S]``.
      mask: optional boolean keep-mask broadcastable to ``weights``.

    Returns:
      ``[...]``; 0 for a fully masked row.
    """
    p = _rows(weights, "weights", "[..., S]")
    keep = _keep(mask, p.shape)
    if keep is not None:
        p = jnp.where(keep, p, 0.0)
    return jnp.max(p, axis=-1, initial=0.0)


def effective_support(weights: Any, mask: Any = None) -> Array:
    """``exp(entropy)``: the number of keys a row effectively attends to (1 one-hot, S uniform).

    Args:
      weights: ``[..., S]``.
      mask: optional boolean keep-mask broadcastable to ``weights``.

    Returns:
      ``[...]``; 0 for a row with no unmasked key.
    """
    p, ulp = _weights(weights)
    keep = _keep(mask, p.shape)
    return jnp.where(_num_keys(p, keep) > 0, jnp.exp(_entropy(p, keep, ulp)), 0.0)


def row_stats(weights: Any, mask: Any = None) -> dict[str, Array]:
    """All row statistics of a map at once.

    Args:
      weights: ``[..., S]``.
      mask: optional boolean keep-mask broadcastable to ``weights``.

    Returns:
      dict of ``[...]`` arrays: ``entropy`` (nats), ``normalized_entropy``, ``max_weight``,
      ``effective_support`` and ``num_keys`` (unmasked keys per row).
    """
    p, ulp = _weights(weights)
    keep = _keep(mask, p.shape)
    n = _num_keys(p, keep)
    h = _entropy(p, keep, ulp)
    masked = p if keep is None else jnp.where(keep, p, 0.0)
    return {
        "entropy": h,
        "normalized_entropy": jnp.where(n > 1, h / jnp.log(jnp.where(n > 1, n, 2.0)), 0.0),
        "max_weight": jnp.max(masked, axis=-1, initial=0.0),
        "effective_support": jnp.where(n > 0, jnp.exp(h), 0.0),
        "num_keys": n,
    }


def head_entropy(weights: Any, mask: Any = None, *, normalized: bool = False) -> Array:
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
    keep = _keep(mask, p.shape)
    n = _num_keys(p, keep)
    h = _entropy(p, keep, ulp)
    if normalized:
        h = jnp.where(n > 1, h / jnp.log(jnp.where(n > 1, n, 2.0)), 0.0)
    rows = (n > 0).astype(h.dtype)
    return jnp.sum(h * rows, axis=-1) / jnp.maximum(jnp.sum(rows, axis=-1), 1.0)


# ----------------------------------------------------------------------------------------------------
# The softmax Jacobian.
# ----------------------------------------------------------------------------------------------------


def _complement(p: Array) -> tuple[Array, Array]:
    """``(1 - p_s, is_argmax)``, with ``1 - p_max`` summed from the other weights (no cancellation).

    Only the row's largest weight can exceed 1/2, so for every other entry ``1 - p_s`` is accurate as is;
    for the largest, ``1 - p_max`` rounds to 0 long before the other weights do, so it is their sum.
    """
    S = p.shape[-1]
    is_max = jax.nn.one_hot(jnp.argmax(p, axis=-1), S, dtype=jnp.bool_)  # [..., S]
    others = jnp.sum(jnp.where(is_max, 0.0, p), axis=-1, keepdims=True)  # [..., 1]
    return jnp.where(is_max, others, 1.0 - p), is_max


def softmax_jacobian(logits: Any, mask: Any = None) -> Array:
    """The Jacobian of the (masked) softmax, per row, in closed form: ``J = diag(p) - p pᵀ``.

    ``J[s, s'] = ∂p_s / ∂z_s'`` for ``p = softmax(z)`` computed by the core's masked softmax. The diagonal
    ``p_s (1 - p_s)`` takes ``1 - p_max`` as the sum of the other weights, so it does not round to 0 while
    the off-diagonal entries are still nonzero. Masked keys get zero rows and columns.

    Args:
      logits: ``[..., S]`` (e.g. the output of :func:`jaxattn.attention_logits`, ``[T, S]``).
      mask: optional boolean keep-mask broadcastable to ``logits``.

    Returns:
      ``[..., S, S]`` in at least float32; symmetric positive semi-definite, rows summing to 0.
    """
    z = _rows(logits, "logits", "[..., S]")
    p = _masked_softmax(z, _keep(mask, z.shape))  # [..., S]
    c, _ = _complement(p)  # [..., S]
    outer = -p[..., :, None] * p[..., None, :]  # [..., S, S]
    eye = jnp.broadcast_to(jnp.eye(p.shape[-1], dtype=jnp.bool_), outer.shape)  # [..., S, S]
    return jnp.where(eye, jnp.broadcast_to((p * c)[..., None, :], outer.shape), outer)


def softmax_jacobian_norms(logits: Any, mask: Any = None) -> dict[str, Array]:
    """Norms of the softmax Jacobian ``J = diag(p) - p pᵀ`` per row, without forming ``J`` (O(S) per row).

    Frobenius: ``‖J‖_F² = Σ_s p_s² ((1 - p_s)² + Σ_{s'≠s} p_s'²)``, evaluated relative to the second
    largest weight ``a`` so that neither the squares nor ``1 - p_max`` underflow or cancel: ``‖J‖_F`` is
    accurate whenever ``a`` is representable. For a saturated row it is ``≈ 2a``.
    Nuclear (= trace, since J is positive semi-definite): ``Σ_s p_s (1 - p_s) = 1 - Σ_s p_s²``.

    Args:
      logits: ``[..., S]``.
      mask: optional boolean keep-mask broadcastable to ``logits``.

    Returns:
      dict of ``[...]`` arrays: ``frobenius`` and ``nuclear``.
    """
    z = _rows(logits, "logits", "[..., S]")
    p = _masked_softmax(z, _keep(mask, z.shape))  # [..., S]
    return _jacobian_norms(p)


def _jacobian_norms(p: Array) -> dict[str, Array]:
    c, is_max = _complement(p)  # [..., S]
    rest = jnp.where(is_max, 0.0, p)  # [..., S], the weights other than the largest
    a = jnp.max(rest, axis=-1, keepdims=True)  # [..., 1], the second largest weight
    a_safe = jnp.where(a > 0, a, 1.0)
    u = rest / a_safe  # [..., S], in [0, 1]
    p_max = jnp.sum(jnp.where(is_max, p, 0.0), axis=-1)  # [...]
    c_max = jnp.sum(jnp.where(is_max, c, 0.0), axis=-1)  # [...], 1 - p_max without cancellation
    sum_u2 = jnp.sum(u * u, axis=-1)  # [...]
    # Σ_{s'≠s} p_s'² for s ≠ argmax: p_max² + a² (Σu² - u_s²); the a²-part is kept only where it matters.
    others_sq = p_max[..., None] ** 2 + (a * a) * (sum_u2[..., None] - u * u)  # [..., S]
    frob_sq_scaled = (p_max**2) * ((c_max / a_safe[..., 0]) ** 2 + sum_u2) + jnp.sum(
        u * u * (c * c + others_sq), axis=-1
    )
    frob = jnp.where(a[..., 0] > 0, a[..., 0] * jnp.sqrt(frob_sq_scaled), 0.0)
    return {"frobenius": frob, "nuclear": jnp.sum(p * c, axis=-1)}


# ----------------------------------------------------------------------------------------------------
# Gradients through the core attention.
# ----------------------------------------------------------------------------------------------------


def attention_grads(
    q: Any,
    k: Any,
    v: Any,
    cotangent: Any,
    *,
    mask: Any = None,
    scale: Any = None,
    is_causal: bool = False,
) -> dict[str, Array]:
    """Gradients of the linear read-out ``L = Σ cotangent ⊙ attention(q, k, v)`` by ``jax.grad``.

    Any loss's gradient is the read-out of its cotangent at the attention output, so a random
    ``cotangent`` probes what a generic loss sees. ``∂L/∂logits`` is taken exactly as the gradient with
    respect to a zero additive ``bias`` (the core computes ``logits = scale · q kᵀ + bias``): the same
    trick gives it inside a whole model (pass ``bias=zeros`` and differentiate with respect to it).

    Args:
      q: ``[T, H]``; k: ``[S, H]``; v: ``[S, V]``.
      cotangent: ``[T, V]``, the read-out (``∂L/∂out``).
      mask, scale, is_causal: as in :func:`jaxattn.attention`; ``scale=1.0`` is the unscaled variant.

    Returns:
      dict: ``logits [T, S]``, ``q [T, H]``, ``k [S, H]``, ``v [S, V]`` (gradients, in the input
      dtypes), ``weights [T, S]`` and ``loss`` (scalar, float32 or wider).
    """
    # q, k, v, mask and scale get the core's own checks (ranks, matching H and S, mask shape, scale)
    # first, so that a wrong q is blamed on q; only then is the cotangent checked against them.
    q, k, v, _, _, _ = _validate_single(q, k, v, mask, None, scale)
    cotangent = as_float_array(cotangent, "cotangent")
    T, S, V = q.shape[0], k.shape[0], v.shape[1]
    if cotangent.shape != (T, V):
        raise ValueError(
            f"cotangent must have shape [T, V] = ({T}, {V}) for q {tuple(q.shape)} [T, H] and v "
            f"{tuple(v.shape)} [S, V], received {tuple(cotangent.shape)}"
        )
    bias = jnp.zeros((T, S), jnp.result_type(q, k))
    return _attention_grads(q, k, v, cotangent, bias, mask, scale, is_causal)


def _attention_grads(q, k, v, cotangent, bias, mask, scale, is_causal):
    acc = softmax_dtype(jnp.result_type(q, k, v))

    def loss(q, k, v, bias):
        out, weights = attention(q, k, v, mask=mask, bias=bias, scale=scale, is_causal=is_causal)
        return jnp.sum(out.astype(acc) * cotangent.astype(acc)), weights

    (value, weights), (dq, dk, dv, dz) = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        q, k, v, bias
    )
    return {"logits": dz, "q": dq, "k": dk, "v": dv, "weights": weights, "loss": value}


def grad_norms(grads: dict[str, Array]) -> dict[str, Array]:
    """Per-row Euclidean norms of :func:`attention_grads`' gradients, and which rows are exactly zero.

    Returns:
      dict: ``logits [T]``, ``q [T]``, ``k [S]``, ``v [S]`` (norms, float32 or wider), and
      ``logits_zero [T]``, ``q_zero [T]`` (bool: every entry of the row is exactly 0 in its dtype).
    """
    out = {}
    for name in ("logits", "q", "k", "v"):
        g = grads[name]
        out[name] = jnp.linalg.norm(g.astype(softmax_dtype(g.dtype)), axis=-1)
    out["logits_zero"] = jnp.all(grads["logits"] == 0, axis=-1)
    out["q_zero"] = jnp.all(grads["q"] == 0, axis=-1)
    return out


# ----------------------------------------------------------------------------------------------------
# Monte Carlo: the variance of q·k, and the saturation sweep.
# ----------------------------------------------------------------------------------------------------


def _check_head_dims(head_dims: Sequence[int]) -> tuple[int, ...]:
    dims = tuple(head_dims)
    if not dims or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in dims):
        raise ValueError(f"head_dims must be a non-empty sequence of positive ints, received {head_dims!r}")
    return tuple(int(d) for d in dims)


def _check_count(n: Any, name: str, minimum: int = 1) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, received {n!r}")
    return int(n)


def _as_key(key: Any) -> Array:
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return jax.random.key(int(key))
    return key


def _check_dtype(dtype: Any) -> Any:
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, received {dtype.name}")
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError("dtype float64 needs 64-bit JAX: run inside `with jax.enable_x64(True):`")
    return dtype


def dot_product_variance(key: Any, head_dims: Sequence[int] = DEFAULT_HEAD_DIMS, *, num_samples: int = 4096) -> dict:
    """Monte Carlo ``Var(q·k)`` for ``q, k ~ N(0, I_{d_k})``: the chapter's claim is ``Var = d_k``.

    One compiled program. Each sample is a row of ``Σ d_k`` independent N(0, 1) pairs, cut into disjoint
    blocks of ``d_k`` columns, one block per ``d_k`` (so every ``d_k`` has its own vectors). The rows
    are drawn a block of rows at a time inside a ``lax.map``, so memory does not grow with
    ``num_samples``: XLA's temporary buffers hold ``2 · max(2^18, Σ d_k)`` normals and their RNG state
    (13 MiB at the defaults, ``num_samples = 4096`` and d_k = 8 … 4096; one draw of every pair at
    once took 1.15 GiB), plus the ``[P, num_samples]`` products.

    Args:
      key: a ``jax.random`` key or an int seed.
      head_dims: the ``d_k`` values, ``[P]``.
      num_samples: independent pairs per ``d_k``.

    Returns:
      dict of NumPy arrays ``[P]``: ``head_dims``, ``variance`` (unbiased sample variance, float64),
      ``ratio`` (``variance / d_k``) and ``std_error`` (standard error of ``ratio``).
    """
    dims = _check_head_dims(head_dims)
    n = _check_count(num_samples, "num_samples", 2)
    dots = _dots(_as_key(key), dims, n)  # [P, n]
    dots = np.asarray(dots, np.float64)
    var = dots.var(axis=1, ddof=1)
    d = np.asarray(dims, np.float64)
    # Var of the sample variance: (m4 - var²)/n, with m4 the fourth central moment.
    # Both moments biased (m4 >= m2² always), so the estimate is never the sqrt of a negative number.
    centred = dots - dots.mean(axis=1, keepdims=True)
    m2, m4 = (centred**2).mean(axis=1), (centred**4).mean(axis=1)
    return {"head_dims": np.asarray(dims), "variance": var, "ratio": var / d, "std_error": np.sqrt((m4 - m2**2) / n) / d}


_DOT_BLOCK = 2**18  # normals per operand (q or k) drawn per step of :func:`_dots`' loop, when Σ d_k fits


@functools.partial(jax.jit, static_argnums=(1, 2))
def _dots(key, dims, n):
    # Rows of Σ d_k pairs, ``rows`` at a time (one RNG op to compile, memory bounded by the block), each
    # row cut into disjoint column blocks of width d_k.
    total = sum(dims)
    rows = max(1, min(n, _DOT_BLOCK // total))
    chunks = -(-n // rows)
    offsets = np.cumsum((0,) + dims)

    def block(chunk_key):
        z = jax.random.normal(chunk_key, (2, rows, total))  # q, k: [2, rows, ΣH]
        prod = z[0] * z[1]  # [rows, ΣH]
        return jnp.stack([jnp.sum(prod[:, a:b], axis=-1) for a, b in zip(offsets[:-1], offsets[1:])])  # [P, rows]

    dots = jax.lax.map(block, jax.random.split(key, chunks))  # [chunks, P, rows]
    return jnp.moveaxis(dots, 0, 1).reshape(len(dims), chunks * rows)[:, :n]  # [P, n]


_ROW_FIELDS = (
    "entropy",
    "normalized_entropy",
    "max_weight",
    "jacobian_norm",
    "logit_grad_norm",
    "q_grad_norm",
    "logit_grad_zero",
    "q_grad_zero",
    "jacobian_zero",
)


def _draw(key, *, head_dim, T, S, V, dtype):
    """One trial's ``q [T, H]``, ``k [S, H]``, ``v [S, V]`` with N(0, 1) entries and read-out ``r [T, V]`` (N(0, 1/V))."""
    # One draw for everything (each separate draw costs XLA compile time, once per d_k in the sweep).
    z = jax.random.normal(key, ((T + S) * (head_dim + V),))  # [(T+S)·(H+V)]
    qk, vr = jnp.split(z.reshape(T + S, head_dim + V), [head_dim], axis=1)  # [T+S, H], [T+S, V]
    q = qk[:T].astype(dtype)  # [T, H]
    k = qk[T:].astype(dtype)  # [S, H]
    v = vr[T:].astype(dtype)  # [S, V]
    r = (vr[:T] / math.sqrt(V)).astype(dtype)  # [T, V], unit-variance read-out
    return q, k, v, r


def _probe_rows(q, k, v, r, scale):
    """Every per-row probe of one head for the read-out ``L = Σ r ⊙ attention(q, k, v; scale)``."""
    return _row_probes(**_width_probes(q, k, v, r, scale))


def _width_probes(q, k, v, r, scale):
    """The part of :func:`_probe_rows` that sees ``d_k``: the core attention's gradients, reduced to rows.

    Returns ``[T, S]`` arrays (``logits``, ``weights``, ``logit_grad``), whose shapes do not depend on
    ``d_k``, and the ``‖∂L/∂q‖``, ``‖∂L/∂k‖`` and ``q·k`` moments, already reduced.
    """
    T, S = q.shape[0], k.shape[0]
    acc = softmax_dtype(jnp.result_type(q, k, v))
    grads = _attention_grads(q, k, v, r, jnp.zeros((T, S), q.dtype), None, scale, False)
    logits = attention_logits(q, k, scale=scale)  # [T, S], the softmax's input (f32 or wider)
    dots = logits / scale  # [T, S], q·k
    return {
        "logits": logits,
        "weights": grads["weights"].astype(acc),  # [T, S], the map the output was computed from
        "logit_grad": grads["logits"],  # [T, S], ∂L/∂logits in the input dtype
        "q_grad_norm": jnp.linalg.norm(grads["q"].astype(acc), axis=-1),  # [T]
        "k_grad_norm": jnp.linalg.norm(grads["k"].astype(acc), axis=-1),  # [S]
        "q_grad_zero": jnp.all(grads["q"] == 0, axis=-1),  # [T]
        "dot_sq": jnp.mean(dots * dots),  # E[(q·k)²] over this trial's T·S pairs (the mean is 0)
        "dot_mean": jnp.mean(dots),
    }


def _row_probes(logits, weights, logit_grad, **reduced):
    """The rest of :func:`_probe_rows`, on ``[..., T, S]`` rows: any leading axes (the sweep stacks all d_k)."""
    stats = row_stats(weights)
    # The Jacobian of the softmax the core computed (in float32 or wider). When q, k, v are in that dtype
    # (logit_grad's dtype is theirs), the map is that softmax itself; otherwise it was rounded to their dtype.
    p = weights if logit_grad.dtype == logits.dtype else _masked_softmax(logits, None)
    jac = _jacobian_norms(p)["frobenius"]  # [..., T]
    return {
        "entropy": stats["entropy"],
        "normalized_entropy": stats["normalized_entropy"],
        "max_weight": stats["max_weight"],
        "jacobian_norm": jac,
        "logit_grad_norm": jnp.linalg.norm(logit_grad.astype(softmax_dtype(logit_grad.dtype)), axis=-1),
        "logit_grad_zero": jnp.all(logit_grad == 0, axis=-1),
        "jacobian_zero": jac == 0,
        **reduced,
    }


def _trial_widths(key, scaled, *, head_dim, T, S, V, dtype):
    """One random trial at one static ``d_k`` and one scale mode, up to the ``d_k``-independent row probes."""
    q, k, v, r = _draw(key, head_dim=head_dim, T=T, S=S, V=V, dtype=dtype)
    acc = softmax_dtype(dtype)
    scale = jnp.where(scaled, jnp.asarray(1.0 / math.sqrt(head_dim), acc), jnp.ones((), acc))  # traced scale
    return _width_probes(q, k, v, r, scale)


def _trial(key, scaled, *, head_dim, T, S, V, dtype):
    """One random trial at one static ``d_k`` and one scale mode: per-row probes of ``T`` queries on ``S`` keys."""
    return _row_probes(**_trial_widths(key, scaled, head_dim=head_dim, T=T, S=S, V=V, dtype=dtype))


# --- Gram sampling: every statistic of a trial depends on q and k only through their Gram matrix. ---
#
# A trial's logits are q·k, ‖∂L/∂q_t‖ = c‖Σ_s Z_ts k_s‖ (Z = ∂L/∂logits) needs the k_s·k_s', ‖∂L/∂k_s‖
# the q_t·q_t', and v, r do not see d_k: every probe is a function of the Gram matrix X Xᵀ of X = [q; k]
# ([T+S, d_k]), i.e. invariant under any rotation of R^{d_k}. Write X = L Uᵀ (LQ decomposition: U has
# orthonormal columns; L is [T+S, min(T+S, d_k)], lower-triangular, lower-trapezoidal when d_k < T+S,
# with a positive diagonal in its first min(T+S, d_k) rows): the rows of L are q and k in coordinates of
# an orthonormal basis of their span, with the same Gram matrix, so every probe computed on them equals
# the probe computed on X (to rounding). For Gaussian X, Bartlett's decomposition gives L's law:
# independent entries, L_ij ~ N(0, 1) below the diagonal (j < i, j < d_k), L_ii ~ χ_{d_k - i} (0-based
# i < d_k), zero elsewhere (rows i >= d_k: d_k normals, no diagonal entry). Drawing L costs (T+S)²
# numbers whatever d_k, and every d_k has the same shape, so d_k can be a traced argument: one function
# for every d_k.


_CHI_CANDIDATES = 3  # candidates drawn up front per χ sample (P(all rejected) ≤ 0.05³ per sample)


def _chi(key, df):
    """χ samples (square roots of χ²_df), ``df >= 1`` a float array; exact, by Marsaglia & Tsang (2000).

    χ²_df = 2·Gamma(df/2). Gamma(a ≥ 1) by Marsaglia–Tsang's rejection: with d = a - 1/3, c = 1/√(9d),
    x ~ N(0, 1), w = c·x > -1 and u ~ U(0, 1), accept d·(1 + w)³ when
    ``log u < x²/2 + d·(3 log1p(w) - w(3 + w(3 + w)))``, which is Marsaglia–Tsang's
    ``x²/2 + d - d·v + d·log v`` (v = (1 + w)³) without its cancellation of terms of size d: in float32 at
    d ≈ 2²⁵ that form's rounding is larger than the log-ratio it tests (variance of χ² off by 22%).
    Every entry takes the first accepted candidate of a sequence. The first :data:`_CHI_CANDIDATES`
    candidates of every entry are drawn at once; entries with none accepted (the acceptance rate is
    ≥ 95%, ≥ 99.8% for a ≥ 16: rare) continue one candidate per round in a ``lax.while_loop``, which
    usually runs no round at all.
    a < 1 uses Gamma(a) = Gamma(a + 1)·U^{1/a}. Written out because ``jax.random.chisquare`` samples each
    entry in its own loop with its own key splits, several times slower under ``vmap`` on a CPU.
    """
    dt = jnp.result_type(float)
    a = jnp.asarray(df, dt) / 2
    boost = a < 1
    d = jnp.where(boost, a + 1, a) - 1 / 3
    c = jax.lax.rsqrt(9 * d)
    boost_key, first_key, loop_key = jax.random.split(key, 3)

    def candidates(key, shape):  # -> accepted [shape], value [shape]; shape is [..., *df.shape]
        x_key, u_key = jax.random.split(key)
        x = jax.random.normal(x_key, shape, dt)
        u = jax.random.uniform(u_key, shape, dt)
        ds = jnp.broadcast_to(d, shape)
        w = jnp.broadcast_to(c, shape) * x
        positive = w > -1  # v = (1 + w)³ > 0; v <= 0 is rejected
        w = jnp.where(positive, w, 0.0)  # log1p finite wherever it is not used
        log_ratio = 0.5 * x * x + ds * (3 * jnp.log1p(w) - w * (3 + w * (3 + w)))
        return positive & (jnp.log(u) < log_ratio), ds * (1 + w) ** 3

    ok, value = candidates(first_key, (_CHI_CANDIDATES, *a.shape))  # [K, ...]
    first = jnp.argmax(ok, axis=0)  # the first accepted candidate (0 if none)
    start = (jnp.zeros((), jnp.int32), jnp.any(ok, axis=0), jnp.take_along_axis(value, first[None], axis=0)[0])

    def round_(state):
        i, done, gamma = state
        ok, value = candidates(jax.random.fold_in(loop_key, i), a.shape)
        return i + 1, done | ok, jnp.where(done, gamma, value)

    _, _, gamma = jax.lax.while_loop(lambda s: ~jnp.all(s[1]), round_, start)
    u = jax.random.uniform(boost_key, a.shape, dt)
    gamma = gamma * jnp.where(boost, u ** (1 / a), 1)
    return jnp.sqrt(2 * gamma)


@functools.lru_cache(maxsize=None)
def _lower_gather(n):
    """Index map for :func:`_gram_factor`: ``[n, n]`` positions in ``z`` of the strictly lower entries, else ``m``."""
    rows, cols = np.tril_indices(n, -1)
    index = np.full((n, n), len(rows), np.int32)
    index[rows, cols] = np.arange(len(rows))
    return index


def _gram_factor(z, chi_key, head_dim, n):
    """``L [n, n]``: Bartlett's factor of ``X Xᵀ`` for ``X [n, head_dim]`` with N(0, 1) entries (``head_dim`` traced).

    ``z``: ``n(n-1)/2`` N(0, 1) numbers for the strictly lower entries; ``chi_key`` draws the diagonal.
    Columns ``j >= head_dim`` are zero (for ``head_dim < n`` the Gram matrix has rank ``head_dim``).
    """
    lower = jnp.concatenate([z, jnp.zeros((1,), z.dtype)])[_lower_gather(n)]  # [n, n], a gather (a scatter is slower)
    i = jnp.arange(n)
    df = head_dim - i  # row i's diagonal entry is χ_{d_k - i} while i < d_k
    diag = jnp.where(df > 0, _chi(chi_key, jnp.maximum(df, 1)), 0)  # [n]
    return jnp.where(i[:, None] == i[None, :], diag[:, None], jnp.where(i[None, :] < head_dim, lower, 0))


def _draw_gram(key, head_dim, *, T, S, V, dtype):
    """One trial as :func:`_draw`, with q and k in coordinates of their span: ``q [T, T+S]``, ``k [S, T+S]``."""
    n = T + S
    m = n * (n - 1) // 2
    z_key, chi_key = jax.random.split(key)
    z = jax.random.normal(z_key, (m + n * V,))  # one draw: L's lower entries, then v and r (fewer RNG ops)
    L = _gram_factor(z[:m], chi_key, head_dim, n)  # [n, n]
    vr = z[m:].reshape(n, V)
    return L[:T].astype(dtype), L[T:].astype(dtype), vr[T:].astype(dtype), (vr[:T] / math.sqrt(V)).astype(dtype)


def _gram_trial_widths(key, scaled, head_dim, *, T, S, V, dtype):
    """:func:`_trial_widths` from :func:`_draw_gram`: ``head_dim`` is a traced int."""
    q, k, v, r = _draw_gram(key, head_dim, T=T, S=S, V=V, dtype=dtype)
    acc = softmax_dtype(dtype)
    scale = jnp.where(scaled, 1 / jnp.sqrt(jnp.asarray(head_dim, acc)), jnp.ones((), acc))
    return _width_probes(q, k, v, r, scale)


def _gram_trial(key, scaled, head_dim, *, T, S, V, dtype):
    return _row_probes(**_gram_trial_widths(key, scaled, head_dim, T=T, S=S, V=V, dtype=dtype))


@functools.partial(jax.jit, static_argnames=("T", "S", "V", "dtype", "batch"))
def _gram_program(keys, head_dims, *, T, S, V, dtype, batch):
    """``[P, R]`` keys, ``[P]`` int head dims -> every probe ``[2, P, R, ...]``: one vmap over all P·R trials.

    Each trial runs both scale modes on its draw; ``batch`` (``None`` or a count) chunks the trials with
    ``lax.map`` (the same numbers up to rounding, memory bounded by the chunk).
    """
    P, R = keys.shape
    modes = jnp.array([True, False])
    trial = functools.partial(_gram_trial_widths, T=T, S=S, V=V, dtype=dtype)
    both = lambda args: jax.vmap(trial, in_axes=(None, 0, None))(args[0], modes, args[1])  # [2, ...]
    flat = (keys.reshape(P * R), jnp.repeat(jnp.asarray(head_dims, jnp.int32), R))
    out = jax.vmap(both)(flat) if batch is None else jax.lax.map(both, flat, batch_size=batch)  # [P·R, 2, ...]
    out = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0).reshape(2, P, R, *x.shape[2:]), out)  # [2, P, R, ...]
    return _row_probes(**out)


_CHUNK_ELEMENTS = 2**20  # automatic chunks: at most this many drawn numbers per d_k at a time (4 MiB f32)


def _chunks(head_dims, R, T, S, V, trials_per_batch=None):
    """Trials vmapped at a time, per ``d_k`` (``None``: all R). Automatic unless ``trials_per_batch`` is given.

    Automatic: all R trials at once while their draws, ``R·(T+S)·(d_k+V)`` numbers, fit in
    :data:`_CHUNK_ELEMENTS`; otherwise chunks of the largest power of two of trials that do. At large d_k the sweep is bound by drawing and
    then consuming its random inputs, and a working set that stays in cache makes it about 1.7× faster
    on a 2-core CPU (measured, d_k = 8 … 4096, 32 trials: 0.149 s → 0.089 s); small d_k keep one vmap (chunking
    them only adds loop steps).
    """
    if trials_per_batch is not None:
        return tuple(None if trials_per_batch >= R else trials_per_batch for _ in head_dims)
    return tuple(_fit_chunk(R, (T + S) * (d + V)) for d in head_dims)


def _fit_chunk(count, drawn_each):
    """``None`` if ``count`` items of ``drawn_each`` drawn numbers fit in :data:`_CHUNK_ELEMENTS`, else
    the largest power of two of items that fits (at least 1)."""
    fit = max(1, _CHUNK_ELEMENTS // drawn_each)
    return None if fit >= count else 2 ** (fit.bit_length() - 1)


@functools.partial(jax.jit, static_argnames=("head_dims", "T", "S", "V", "dtype", "chunks"))
def _sweep_program(keys, *, head_dims, T, S, V, dtype, chunks):
    """``[P, R]`` keys -> every probe ``[2, P, R, ...]`` in one compiled program.

    The tuple of ``head_dims`` is static: the trace unrolls over it, and each ``d_k`` runs at its own
    width, vmapped over its R trials and over the two scale modes (which share each trial's draw), as
    far as the ``[T, S]`` logits, weights and ``∂L/∂logits``; those are stacked over ``d_k`` and the row
    probes that do not see ``d_k`` run once on the stack (one copy to compile instead of P). This is
    :func:`_trial` for every key and mode. ``chunks[p]`` (see :func:`_chunks`) is ``None`` to vmap over
    all R trials of ``head_dims[p]`` at once, or a count: ``lax.map`` then runs the vmapped trial over
    chunks of that many trials (the same numbers up to rounding, memory bounded by the chunk).
    """
    modes = jnp.array([True, False])
    per_dim = []
    for p, (head_dim, batch) in enumerate(zip(head_dims, chunks)):
        trial = functools.partial(_trial_widths, head_dim=head_dim, T=T, S=S, V=V, dtype=dtype)
        both = lambda key, trial=trial: jax.vmap(trial, in_axes=(None, 0))(key, modes)  # key -> [2, ...]
        if batch is None:
            per_dim.append(jax.vmap(both)(keys[p]))  # [R, 2, ...]
        else:
            per_dim.append(jax.lax.map(both, keys[p], batch_size=batch))  # [R, 2, ...]
    stacked = jax.tree.map(lambda *xs: jnp.moveaxis(jnp.stack(xs), 2, 0), *per_dim)  # [2, P, R, ...]
    return _row_probes(**stacked)


def _gram_chunk(pairs, T, S, V):
    """Automatic chunk of ``(d_k, trial)`` pairs for ``sampling="gram"`` (``None``: all at once).

    On a CPU, all pairs at once while their draws (``(T+S)(T+S-1)/2 + (T+S)·V`` normals, and
    ``2·_CHI_CANDIDATES + 1`` numbers for each of the ``T+S`` χ) fit in :data:`_CHUNK_ELEMENTS`, as for
    ``"vectors"``; otherwise chunks of the largest power of two of pairs that fit, so the working set
    stays in cache. At T = S = V = 16 that is up to 851 pairs at once, then chunks of 512 (measured by
    ``python experiments/bench_sweep.py --chunks 32,64,1024`` on a 2-core CPU: 1024 trials × 10 d_k,
    468 ms as one vmap, 288 ms in chunks of 512; at 32 and 64 trials chunks gained nothing). On a GPU or
    TPU a chunk only takes parallelism away: there the pairs are never chunked automatically.
    """
    if jax.default_backend() != "cpu":
        return None
    n = T + S
    return _fit_chunk(pairs, n * (n - 1) // 2 + n * V + (2 * _CHI_CANDIDATES + 1) * n)


@functools.lru_cache(maxsize=None)
def _trial_fn(head_dim, T, S, V, dtype):
    return jax.jit(functools.partial(_trial, head_dim=head_dim, T=T, S=S, V=V, dtype=dtype))


@functools.lru_cache(maxsize=None)
def _gram_trial_fn(T, S, V, dtype):
    return jax.jit(functools.partial(_gram_trial, T=T, S=S, V=V, dtype=dtype))


@functools.lru_cache(maxsize=None)
def _gram_trial_at(head_dim, T, S, V, dtype):
    return functools.partial(_gram_trial_fn(T, S, V, dtype), head_dim=np.int32(head_dim))


SAMPLINGS = ("gram", "vectors")


def _check_sampling(sampling: Any, dtype: Any) -> str:
    """``None`` picks ``"gram"`` for float32 and wider, ``"vectors"`` for narrower dtypes (see :func:`saturation_sweep`)."""
    if sampling is None:
        return "gram" if jnp.finfo(dtype).bits >= 32 else "vectors"
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be None or one of {SAMPLINGS}, received {sampling!r}")
    return sampling


def sweep_trial_fn(
    head_dim: int,
    *,
    num_queries: int = 16,
    num_keys: int = 16,
    value_dim: int = 16,
    dtype: Any = jnp.float32,
    sampling: str | None = None,
):
    """The jitted single-trial function the sweep vmaps: ``f(key, scaled) -> dict`` at ``d_k = head_dim``.

    ``f(key, scaled)`` draws one trial from ``key`` exactly as :func:`saturation_sweep` with the same
    ``sampling`` does and returns its per-row probes (the sweep's fields without the leading
    ``[2, P, R]`` axes); ``scaled`` is a (traced) bool. The sweep's trial ``r`` at ``head_dims[p]`` used
    the key ``jax.random.split(key, (P, R))[p, r]``. The same arguments return the same object.
    ``sampling`` as in :func:`saturation_sweep` (``None``: by ``dtype``). ``"gram"``: one compiled
    function for every ``d_k`` (``d_k`` is one of its traced arguments, bound here); ``"vectors"``: one
    per ``d_k``. For benchmarks (a Python loop over it
    against :func:`saturation_sweep`) and for debugging one trial.
    """
    (head_dim,) = _check_head_dims((head_dim,))
    T = _check_count(num_queries, "num_queries")
    S = _check_count(num_keys, "num_keys", 2)
    V = _check_count(value_dim, "value_dim")
    dtype = _check_dtype(dtype)
    if _check_sampling(sampling, dtype) == "gram":
        return _gram_trial_at(head_dim, T, S, V, dtype)
    return _trial_fn(head_dim, T, S, V, dtype)


def saturation_sweep(
    key: Any,
    *,
    head_dims: Sequence[int] = DEFAULT_HEAD_DIMS,
    num_trials: int = 64,
    num_queries: int = 16,
    num_keys: int = 16,
    value_dim: int = 16,
    dtype: Any = jnp.float32,
    sampling: str | None = None,
    trials_per_batch: int | None = None,
) -> dict[str, Any]:
    """Saturation sweep: ``d_k`` × {scaled, unscaled} × random trials, as ONE ``jit(vmap(...))`` program.

    Each trial draws ``q [T, d_k]``, ``k [S, d_k]``, ``v [S, V]`` with N(0, 1) entries (q and k in the
    law of such vectors, see ``sampling``) and a read-out ``r [T, V]`` with N(0, 1/V) entries, runs the
    core :func:`jaxattn.attention` with ``scale=1/sqrt(d_k)`` and ``scale=1`` on the same draws, and
    records per query row: entropy, normalised entropy, max weight, the Frobenius norm of the softmax
    Jacobian, ``‖∂L/∂logits‖`` and ``‖∂L/∂q‖`` for ``L = Σ r ⊙ out`` (by ``jax.grad``), and whether those
    are exactly zero in ``dtype``; per key ``‖∂L/∂k‖``; per trial the moments of ``q·k``.

    How q and k are drawn (``sampling``; ``None``, the default, picks ``"gram"`` for float32 and wider
    and ``"vectors"`` for narrower dtypes):
      * ``"gram"``: q and k in coordinates of an orthonormal basis of their span, ``[T, T+S]``
        and ``[S, T+S]``, drawn from Bartlett's decomposition of their Gram matrix. Every probe here is
        a function of the Gram matrix of ``[q; k]`` (the logits, and the norms of ``∂L/∂q``, ``∂L/∂k``
        are invariant under rotations of R^{d_k}), so each probe has exactly the law it has for
        ``d_k``-dimensional Gaussian vectors, up to rounding. A trial costs the same at every ``d_k``,
        and every ``d_k`` has one shape: the program is one ``vmap`` over all ``(d_k, trial)`` pairs.
        Rounding is not rotation-invariant: in float16 the entries of ``∂L/∂q`` underflow one coordinate
        at a time, and coordinates of size ``√d_k`` underflow less often than N(0, 1) ones, so the
        fraction of exactly-zero ``∂L/∂q`` rows differs (measured at d_k = 1024, 4096 rows: 0.27–0.29
        against 0.33). Hence the default only for float32 and wider, where the two agree. For ``d_k``
        far below ``T + S``, ``"vectors"`` is cheaper.
      * ``"vectors"``: the ``d_k``-dimensional vectors themselves. The trace unrolls over the static
        ``head_dims``, each at its own width, vmapped over its trials (and chunked, see
        ``trials_per_batch``); the cost grows with ``d_k``, drawing the vectors dominates it.

    Args:
      key: a ``jax.random`` key or an int seed.
      head_dims: the ``d_k`` values, ``[P]`` (default powers of two 8 … 4096).
      num_trials: R, random trials per ``d_k``.
      num_queries, num_keys, value_dim: T, S, V of each trial.
      dtype: dtype of q, k, v (the softmax still runs in at least float32, as in the core; gradients
        come back in ``dtype``). float64 needs ``jax.enable_x64``.
      sampling: ``None``, ``"gram"`` or ``"vectors"``, above. The two draw different numbers from one key.
      trials_per_batch: ``None`` (default) picks chunks: ``"vectors"`` per d_k, all trials at once while
        their draws fit in 2²⁰ numbers, power-of-two chunks of trials that fit otherwise; ``"gram"``, on
        a CPU, chunks all ``(d_k, trial)`` pairs in the same way (at T = S = V = 16: up to 851 pairs
        at once, chunks of 512 beyond), and never on a GPU or TPU. A
        chunk is a ``lax.map`` step over the vmapped trial inside the one compiled program: memory
        bounded, and on a CPU faster, because the working set stays in cache. An int runs chunks of that
        many trials (``"vectors"``: of each d_k's trials; ``"gram"``: of all ``(d_k, trial)`` pairs).
        Results are the same whatever the chunks, up to rounding (each chunk size compiles its own
        kernels; float32: relative differences of order 1e-7).

    Returns:
      dict: ``head_dims [P]``, ``scaled [2]`` (True, False), config entries (``sampling`` included), and
      NumPy arrays ``[2, P, R, T]`` (``entropy``, ``normalized_entropy``, ``max_weight``,
      ``jacobian_norm``, ``logit_grad_norm``, ``q_grad_norm``, ``logit_grad_zero``, ``q_grad_zero``,
      ``jacobian_zero``), ``k_grad_norm [2, P, R, S]`` and ``dot_sq``, ``dot_mean [2, P, R]``.
    """
    dims = _check_head_dims(head_dims)
    R = _check_count(num_trials, "num_trials")
    T = _check_count(num_queries, "num_queries")
    S = _check_count(num_keys, "num_keys", 2)
    V = _check_count(value_dim, "value_dim")
    dtype = _check_dtype(dtype)
    sampling = _check_sampling(sampling, dtype)
    batch = None if trials_per_batch is None else _check_count(trials_per_batch, "trials_per_batch")
    keys = jax.random.split(_as_key(key), (len(dims), R))  # [P, R]
    if sampling == "gram":
        if max(dims) >= 2**31:
            raise ValueError(f"head_dims must be below 2**31 (an int32 in the program), received {max(dims)}")
        pairs = len(dims) * R
        batch = _gram_chunk(pairs, T, S, V) if batch is None else batch
        batch = None if batch is None or batch >= pairs else batch
        out = _gram_program(keys, np.asarray(dims, np.int32), T=T, S=S, V=V, dtype=dtype, batch=batch)
    else:
        chunks = _chunks(dims, R, T, S, V, batch)
        out = _sweep_program(keys, head_dims=dims, T=T, S=S, V=V, dtype=dtype, chunks=chunks)
    result = {name: np.asarray(x) for name, x in out.items()}
    result.update(
        head_dims=np.asarray(dims),
        scaled=np.array([True, False]),
        num_trials=R,
        num_queries=T,
        num_keys=S,
        value_dim=V,
        dtype=dtype.name,
        sampling=sampling,
    )
    return result


_SUMMARY_FIELDS = ("entropy", "normalized_entropy", "max_weight", "jacobian_norm", "logit_grad_norm", "q_grad_norm", "k_grad_norm")


def summarize_sweep(result: dict[str, Any], quantiles: Sequence[float] = (0.1, 0.5, 0.9)) -> dict[str, Any]:
    """Distributions of a :func:`saturation_sweep`, per scale mode and ``d_k`` (float64 NumPy).

    Returns:
      dict: ``head_dims [P]``, ``quantiles [Q]``, ``var_qk [P]`` (Monte Carlo Var(q·k) over every pair),
      ``var_ratio [P]`` (``/ d_k``), and for each probe ``name`` in entropy, normalized_entropy,
      max_weight, jacobian_norm, logit_grad_norm, q_grad_norm, k_grad_norm: ``name`` → dict with
      ``mean [2, P]``, ``std [2, P]``, ``quantiles [2, P, Q]`` (``median`` = the 0.5 one if requested);
      ``zero_fraction`` → dict with ``logit_grad``, ``q_grad``, ``jacobian``: ``[2, P]`` fractions of rows
      that are exactly zero. Axis 0 is (scaled, unscaled).
    """
    qs = np.asarray(quantiles, np.float64)
    summary: dict[str, Any] = {"head_dims": np.asarray(result["head_dims"]), "quantiles": qs}
    summary.update({k: result[k] for k in ("num_trials", "num_queries", "num_keys", "value_dim", "dtype", "sampling") if k in result})
    dot_sq = np.asarray(result["dot_sq"], np.float64)[1]  # [P, R], unscaled mode: logits are q·k
    dot_mean = np.asarray(result["dot_mean"], np.float64)[1]
    var = dot_sq.mean(axis=1) - dot_mean.mean(axis=1) ** 2
    summary["var_qk"] = var
    summary["var_ratio"] = var / summary["head_dims"]
    for name in _SUMMARY_FIELDS:
        x = np.asarray(result[name], np.float64)
        x = x.reshape(x.shape[0], x.shape[1], -1)  # [2, P, rows]
        stats = {"mean": x.mean(axis=-1), "std": x.std(axis=-1), "quantiles": np.quantile(x, qs, axis=-1).transpose(1, 2, 0)}
        if 0.5 in qs:
            stats["median"] = stats["quantiles"][..., list(qs).index(0.5)]
        summary[name] = stats
    summary["zero_fraction"] = {
        field: np.asarray(result[f"{field}_zero"], np.float64).reshape(2, len(summary["head_dims"]), -1).mean(axis=-1)
        for field in ("logit_grad", "q_grad", "jacobian")
    }
    return summary


# ----------------------------------------------------------------------------------------------------
# The laws (float64 NumPy): extreme-value statistics of the gap between the two largest logits.
# ----------------------------------------------------------------------------------------------------
#
# Unscaled, the logits of one query are z_s = q·k_s; given q they are S i.i.d. N(0, σ²) with σ = |q| ≈
# √d_k. Write z_(1) > z_(2) for the two largest and D = (z_(1) - z_(2)) / σ, the gap of S standard
# normals, whose law does not depend on d_k. Once σD is large the row is one-hot up to p_2 ≈ e^{-σD}, and
#   ‖J‖_F ≈ 2 e^{-σD},  entropy ≈ (1 + σD) e^{-σD},  1 - max weight ≈ e^{-σD}.
# Typical row (median): σD ≈ √d_k · median(D), so the median falls like exp(-median(D) · √d_k).
# Mean: dominated by near ties, D ≲ 1/σ, where the density of D is f_D(0); over the two-key profile
#   ∫₀^∞ 2p₁p₂ dy = 1, ∫₀^∞ H_b dy = π²/6, ∫₀^∞ p₂ dy = ln 2, and E‖∂L/∂z‖ picks up E|g₁ - g₂|/√2 = √(2/π)·…,
# so every mean falls like f_D(0) · c / √d_k: a power law with exponent -1/2.
# Exact zeros: a row's gradient is exactly 0 once every weight but the largest is flushed to 0, i.e.
#   σD > g_dtype ≈ -ln(smallest normal number the gradient is held in); so zero_fraction = P(σD > g).


def _normal_pdf(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _normal_cdf(x: np.ndarray) -> np.ndarray:
    from scipy.special import ndtr

    return ndtr(x)


_GRID = np.linspace(-12.0, 12.0, 24001)  # quadrature grid for the top-two gap integrals (step 1e-3)


def _check_gaps(x: Any, name: str) -> np.ndarray:
    """``x`` as float64, each entry finite and >= 0 (a gap between two logits, in any unit)."""
    arr = np.asarray(x)
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise TypeError(f"{name} must be a real number or array of gaps >= 0, received dtype {arr.dtype.name}")
    arr = arr.astype(np.float64)
    bad = ~(np.isfinite(arr) & (arr >= 0))
    if np.any(bad):
        raise ValueError(
            f"{name} must be finite and >= 0 (a gap between the two largest logits), received "
            f"{arr[bad].ravel()[:4].tolist()} among shape {arr.shape}"
        )
    return arr


def gap_survival(x: Any, num_keys: int) -> np.ndarray:
    """``P(D > x)`` for ``D`` the gap between the two largest of ``num_keys`` i.i.d. N(0, 1) values.

    ``P(D > x) = S ∫ φ(t) Φ(t - x)^{S-1} dt`` (the largest is at ``t``, all others below ``t - x``),
    by the trapezoid rule in float64.

    Args:
      x: gaps ``[...]``, finite and >= 0 (``ValueError`` otherwise: ``P(D > x)`` is 1 for x < 0).
      num_keys: S >= 2.

    Returns:
      ``[...]`` float64.
    """
    S = _check_count(num_keys, "num_keys", 2)
    x = _check_gaps(x, "x")
    t = _GRID
    integrand = _normal_pdf(t) * _normal_cdf(t - x[..., None]) ** (S - 1)
    return S * np.trapezoid(integrand, t, axis=-1)


def gap_density_at_zero(num_keys: int) -> float:
    """``f_D(0) = S(S-1) ∫ φ(t)² Φ(t)^{S-2} dt``: how likely the two largest logits nearly tie."""
    S = _check_count(num_keys, "num_keys", 2)
    t = _GRID
    return float(S * (S - 1) * np.trapezoid(_normal_pdf(t) ** 2 * _normal_cdf(t) ** (S - 2), t))


def gap_median(num_keys: int) -> float:
    """The median of ``D`` (solves ``P(D > x) = 1/2`` by bisection)."""
    lo, hi = 0.0, 10.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if gap_survival(mid, num_keys) > 0.5 else (lo, mid)
    return 0.5 * (lo + hi)


def underflow_gap(dtype: Any) -> float:
    """The logit gap past which a row's ``∂L/∂logits`` is exactly 0 in ``dtype`` (as the core computes it).

    The gradient of the other weights is ``≈ e^{-gap}`` times an O(1) factor. The core computes it in
    float32 (float64 for float64 input), where XLA on CPU flushes subnormal results to zero, so for
    float32 and bfloat16 (which shares float32's exponent range) the threshold is
    ``-ln(smallest normal float32) = 126 ln 2 = 87.3``; float64: ``1022 ln 2 = 708.4``. float16 input
    gets the float32 gradient rounded to float16, which keeps subnormals and rounds below half the
    smallest one to 0: ``25 ln 2 = 17.3``.

    Args:
      dtype: a floating dtype (``TypeError`` for integer or boolean dtypes, which have no underflow).

    Returns:
      the gap in nats, a float.
    """
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype (float16, bfloat16, float32 or float64), received {dtype.name}")
    if dtype == jnp.float16:
        return 25.0 * math.log(2.0)
    return float(-math.log(float(jnp.finfo(softmax_dtype(dtype)).tiny)))


def predicted_laws(head_dims: Sequence[int], num_keys: int, *, gap_threshold: float | None = None) -> dict[str, Any]:
    """The predicted unscaled statistics for rows of ``num_keys`` logits with σ = √d_k (float64).

    Args:
      head_dims: ``d_k`` values ``[P]``.
      num_keys: S.
      gap_threshold: if given (a finite scalar >= 0), the logit gap past which a row's gradient is exactly zero (see
        :func:`underflow_gap`); adds ``zero_fraction [P] = P(√d_k · D > gap_threshold)``.

    Returns:
      dict with constants ``gap_median`` (m_S), ``gap_density_at_zero`` (f_D(0)) and ``[P]`` arrays:
      ``median_jacobian = 2 exp(-m_S √d_k)``, ``median_entropy = (1 + m_S √d_k) exp(-m_S √d_k)``,
      ``mean_jacobian = f_D(0) / √d_k``, ``mean_entropy = (π²/6) f_D(0) / √d_k``,
      ``mean_one_minus_max = ln 2 · f_D(0) / √d_k``, ``mean_logit_grad = √(2/π) f_D(0) / √d_k``
      (for a read-out of norm exactly 1 against unit-variance values; the sweep's ``r ~ N(0, I/V)`` has
      ``E‖r‖ = √(2/V) Γ((V+1)/2) / Γ(V/2)``, 0.985 at V = 16, which multiplies it: see the lab's ``fit_laws``).
    """
    dims = np.asarray(_check_head_dims(head_dims), np.float64)
    m = gap_median(num_keys)
    f0 = gap_density_at_zero(num_keys)
    y = m * np.sqrt(dims)
    laws = {
        "head_dims": dims,
        "gap_median": m,
        "gap_density_at_zero": f0,
        "median_jacobian": 2.0 * np.exp(-y),
        "median_entropy": (1.0 + y) * np.exp(-y),
        "mean_jacobian": f0 / np.sqrt(dims),
        "mean_entropy": (math.pi**2 / 6.0) * f0 / np.sqrt(dims),
        "mean_one_minus_max": math.log(2.0) * f0 / np.sqrt(dims),
        "mean_logit_grad": math.sqrt(2.0 / math.pi) * f0 / np.sqrt(dims),
    }
    if gap_threshold is not None:
        threshold = _check_gaps(gap_threshold, "gap_threshold")
        if threshold.ndim != 0:
            raise ValueError(f"gap_threshold must be a scalar, received shape {threshold.shape}")
        laws["zero_fraction"] = gap_survival(threshold / np.sqrt(dims), num_keys)
    return laws


def _fit_data(x: Any, y: Any, *, x_min: str) -> tuple[np.ndarray, np.ndarray]:
    """``x [P]``, ``y [P]`` as float64 for a fit in log space: y finite and > 0, x finite and ``x_min``."""
    x, y = np.asarray(x), np.asarray(y)
    for name, arr in (("x", x), ("y", y)):
        if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
            raise TypeError(f"{name} must be a real array [P], received dtype {arr.dtype.name}")
    x, y = x.astype(np.float64), y.astype(np.float64)
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"x and y must both have shape [P], received x {x.shape} and y {y.shape}")
    if not np.all(np.isfinite(y) & (y > 0)):
        raise ValueError(f"y must be finite and > 0 to fit in log space (an underflowed statistic?), received {y}")
    x_ok = x > 0 if x_min == "> 0" else x >= 0
    if not np.all(np.isfinite(x) & x_ok):
        raise ValueError(f"x must be finite and {x_min} for this fit, received {x}")
    if np.unique(x).size < 2:
        raise ValueError(f"x must hold at least 2 distinct values to fit a line, received {x}")
    return x, y


def fit_power_law(x: Any, y: Any) -> tuple[float, float]:
    """Least-squares ``y ≈ c · x^a`` in log-log (float64); returns ``(a, c)``.

    Args:
      x: ``[P]``, finite and > 0 (e.g. the ``d_k`` values), at least 2 distinct.
      y: ``[P]``, finite and > 0 (an underflowed 0 cannot be fitted in log space).

    Returns:
      ``(a, c)`` as floats. ``ValueError``/``TypeError`` for input outside those ranges.
    """
    x, y = _fit_data(x, y, x_min="> 0")
    a, b = np.polyfit(np.log(x), np.log(y), 1)
    return float(a), float(np.exp(b))


def fit_stretched_exp(x: Any, y: Any) -> tuple[float, float]:
    """Least-squares ``y ≈ c · exp(-b √x)`` (``ln y`` linear in ``√x``, float64); returns ``(b, c)``.

    Args:
      x: ``[P]``, finite and >= 0, at least 2 distinct.
      y: ``[P]``, finite and > 0.

    Returns:
      ``(b, c)`` as floats. ``ValueError``/``TypeError`` for input outside those ranges.
    """
    x, y = _fit_data(x, y, x_min=">= 0")
    slope, intercept = np.polyfit(np.sqrt(x), np.log(y), 1)
    return float(-slope), float(np.exp(intercept))
