"""The softmax Jacobian ``diag(p) - p pᵀ`` in closed form, and its norms without forming it."""

from __future__ import annotations


import jax
import jax.numpy as jnp

from jaxattn._attention import _masked_softmax
from jaxattn.probes._rows import _complement, _keep, _rows
from jaxattn._typing import ArrayLike, Bool, Float

Array = jax.Array


def softmax_jacobian(
    logits: Float[ArrayLike, "*rows S"], mask: Bool[ArrayLike, "*#rows #S"] | None = None
) -> Float[Array, "*rows S S"]:
    """The Jacobian of the (masked) softmax, per row, in closed form: ``J = diag(p) - p pᵀ``.

    ``J[s, s'] = ∂p_s / ∂z_s'`` for ``p = softmax(z)`` computed by the core's masked softmax. The diagonal
    ``p_s (1 - p_s)`` takes ``1 - p_max`` as the sum of the other weights, so it does not round to 0 while
    the off-diagonal entries are still nonzero. Masked keys get zero rows and columns.

    Args:
      logits: ``[..., S]`` (e.g. the output of :func:`jaxattn.attention_logits`, ``[T, S]``).
      mask: optional boolean keep-mask broadcastable to ``logits``.

    Returns:
      ``[..., S, S]`` in at least float32; symmetric positive semi-definite, rows summing to 0
      (``[..., 0, 0]`` when ``S = 0``).
    """
    z = _rows(logits, "logits", "[..., S]")
    return _jacobian(z, _keep(mask, z.shape))


@jax.jit
def _jacobian(z: Array, keep: Array | None) -> Array:
    """:func:`softmax_jacobian` of checked logits, one compiled program."""
    p = _masked_softmax(z, keep)  # [..., S]
    if p.shape[-1] == 0:  # no keys: an empty Jacobian
        return jnp.zeros(p.shape + (0,), p.dtype)
    c, _ = _complement(p)  # [..., S]
    outer = -p[..., :, None] * p[..., None, :]  # [..., S, S]
    eye = jnp.broadcast_to(jnp.eye(p.shape[-1], dtype=jnp.bool_), outer.shape)  # [..., S, S]
    return jnp.where(eye, jnp.broadcast_to((p * c)[..., None, :], outer.shape), outer)


def softmax_jacobian_norms(
    logits: Float[ArrayLike, "*rows S"], mask: Bool[ArrayLike, "*#rows #S"] | None = None
) -> dict[str, Float[Array, "*rows"]]:
    """Norms of the softmax Jacobian ``J = diag(p) - p pᵀ`` per row, without forming ``J`` (O(S) per row).

    Frobenius: ``‖J‖_F² = Σ_s p_s² ((1 - p_s)² + Σ_{s'≠s} p_s'²)``, evaluated relative to the second
    largest weight ``a`` so that neither the squares nor ``1 - p_max`` underflow or cancel: ``‖J‖_F`` is
    accurate whenever ``a`` is representable. For a saturated row it is ``≈ 2a``.
    Nuclear (= trace, since J is positive semi-definite): ``Σ_s p_s (1 - p_s) = 1 - Σ_s p_s²``.

    Args:
      logits: ``[..., S]``.
      mask: optional boolean keep-mask broadcastable to ``logits``.

    Returns:
      dict of ``[...]`` arrays: ``frobenius`` and ``nuclear`` (0 when ``S = 0``).
    """
    z = _rows(logits, "logits", "[..., S]")
    return _norms(z, _keep(mask, z.shape))


@jax.jit
def _norms(z: Array, keep: Array | None) -> dict[str, Array]:
    """:func:`softmax_jacobian_norms` of checked logits, one compiled program."""
    p = _masked_softmax(z, keep)  # [..., S]
    if p.shape[-1] == 0:  # no keys: an empty Jacobian, whose norms are 0
        return {"frobenius": jnp.zeros(p.shape[:-1], p.dtype), "nuclear": jnp.zeros(p.shape[:-1], p.dtype)}
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
