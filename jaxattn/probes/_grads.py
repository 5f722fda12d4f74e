"""Gradients through the core attention by ``jax.grad``, for any ``scale`` and logit soft cap."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxattn._attention import attention
from jaxattn._checks import as_float_array, check_attention_inputs, check_flag, check_logit_cap, softmax_dtype
from jaxattn._typing import ArrayLike, Bool, Float, Real

Array = jax.Array




def attention_grads(
    q: Float[ArrayLike, "T H"],
    k: Float[ArrayLike, "S H"],
    v: Float[ArrayLike, "S V"],
    cotangent: Float[ArrayLike, "T V"],
    *,
    mask: Bool[ArrayLike, "#T #S"] | Bool[ArrayLike, "#S"] | None = None,
    scale: Real[ArrayLike, ""] | None = None,
    is_causal: bool = False,
    logit_cap: Real[ArrayLike, ""] | None = None,
) -> dict[str, Float[Array, "..."]]:
    """Gradients of the linear read-out ``L = Σ cotangent ⊙ attention(q, k, v)`` by ``jax.grad``.

    Any loss's gradient is the read-out of its cotangent at the attention output, so a random
    ``cotangent`` probes what a generic loss sees. ``∂L/∂logits`` is taken exactly as the gradient with
    respect to a zero additive ``bias`` (the core computes ``logits = scale · q kᵀ + bias``): the same
    trick gives it inside a whole model (pass ``bias=zeros`` and differentiate with respect to it).

    With ``logit_cap=c`` the attention is the core's capped one, ``softmax(c · tanh(x / c)) v``, and
    ``∂L/∂logits`` is the gradient with respect to the pre-cap logits ``x = scale · q kᵀ + bias`` (the
    bias is added before the cap, and ``x`` is what the ``1/sqrt(d_k)`` scale acts on): it includes the
    cap's derivative, ``∂L/∂x_s = sech²(x_s / c) · ∂L/∂(capped logit)_s``. ``∂L/∂q``, ``∂L/∂k``
    and ``∂L/∂v`` are those of the capped attention; ``weights`` is its (capped) map.

    Args:
      q: ``[T, H]``; k: ``[S, H]``; v: ``[S, V]``.
      cotangent: ``[T, V]``, the read-out (``∂L/∂out``).
      mask, scale, is_causal: as in :func:`jaxattn.attention`; ``scale=1.0`` is the unscaled variant.
      logit_cap: ``None`` (no cap) or the soft cap ``c > 0`` (:func:`jaxattn.attention`'s ``logit_cap``);
        a traced scalar is accepted under ``jit``/``vmap``.

    Returns:
      dict: ``logits [T, S]``, ``q [T, H]``, ``k [S, H]``, ``v [S, V]`` (gradients, in the input
      dtypes), ``weights [T, S]`` and ``loss`` (scalar, float32 or wider).
    """
    # q, k, v, mask and scale get the core's own checks (ranks, matching H and S, mask shape, scale)
    # first, so that a wrong q is blamed on q; only then is the cotangent checked against them.
    q, k, v, _, _, _ = check_attention_inputs(q, k, v, mask, None, scale)
    is_causal = check_flag(is_causal, "is_causal")
    cap = check_logit_cap(logit_cap)
    cotangent = as_float_array(cotangent, "cotangent")
    T, S, V = q.shape[0], k.shape[0], v.shape[1]
    if cotangent.shape != (T, V):
        raise ValueError(
            f"cotangent must have shape [T, V] = ({T}, {V}) for q {tuple(q.shape)} [T, H] and v "
            f"{tuple(v.shape)} [S, V], received {tuple(cotangent.shape)}"
        )
    bias = jnp.zeros((T, S), jnp.result_type(q, k))
    return _attention_grads(q, k, v, cotangent, bias, mask, scale, is_causal, cap)


@functools.partial(jax.jit, static_argnames=("is_causal",))
def _attention_grads(q, k, v, cotangent, bias, mask, scale, is_causal, cap=None):
    acc = softmax_dtype(jnp.result_type(q, k, v))

    def loss(q, k, v, bias):
        out, weights = attention(q, k, v, mask=mask, bias=bias, scale=scale, is_causal=is_causal, logit_cap=cap)
        return jnp.sum(out.astype(acc) * cotangent.astype(acc)), weights

    (value, weights), (dq, dk, dv, dz) = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        q, k, v, bias
    )
    return {"logits": dz, "q": dq, "k": dk, "v": dv, "weights": weights, "loss": value}


def _row_norm(g: Array) -> Array:
    """The Euclidean norm over the last axis, in float32 or wider, each row divided by its largest
    magnitude first: float32 squares of entries below about 1e-19 are 0, so a plain norm of a saturated
    row's gradient came out 0 where the row is not. 0 for an all-zero row; inf or NaN as the row holds."""
    g = g.astype(softmax_dtype(g.dtype))
    m = jnp.max(jnp.abs(g), axis=-1)  # [...]
    safe = jnp.where((m > 0) & jnp.isfinite(m), m, 1.0)
    scaled = safe * jnp.sqrt(jnp.sum(jnp.square(g / safe[..., None]), axis=-1))
    return jnp.where(m == 0, 0.0, jnp.where(jnp.isfinite(m), scaled, m))


def grad_norms(grads: dict[str, Float[ArrayLike, "..."]]) -> dict[str, Float[Array, "..."] | Bool[Array, "..."]]:
    """Per-row Euclidean norms of :func:`attention_grads`' gradients, and which rows are exactly zero.

    Returns:
      dict: ``logits [T]``, ``q [T]``, ``k [S]``, ``v [S]`` (norms, float32 or wider, each row scaled by its
      largest entry first, so that a row of tiny entries (a saturated softmax's) has its norm, not 0), and
      ``logits_zero [T]``, ``q_zero [T]`` (bool: every entry of the row is exactly 0 in its dtype).
    """
    out = {}
    for name in ("logits", "q", "k", "v"):
        out[name] = _row_norm(jnp.asarray(grads[name]))
    out["logits_zero"] = jnp.all(grads["logits"] == 0, axis=-1)
    out["q_zero"] = jnp.all(grads["q"] == 0, axis=-1)
    return out
