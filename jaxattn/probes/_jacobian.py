"""The softmax Jacobian ``diag(p) - p pᵀ`` in closed form, and its norms without forming it.

With a logit soft cap ``c`` (the core's ``logit_cap``: the softmax runs on ``c · tanh(x / c)``), every
Jacobian here is taken with respect to the pre-cap logits ``x = scale · q kᵀ + bias``, the numbers the
``1/sqrt(d_k)`` scale acts on: ``∂p/∂x = (diag(p) - p pᵀ) diag(σ)``, ``σ_s = 1 - tanh²(x_s / c)`` the
cap's derivative, with ``p`` the capped softmax.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxattn._attention import _masked_softmax
from jaxattn._checks import check_logit_cap
from jaxattn._logits import soft_cap
from jaxattn.probes._rows import _complement, _keep, _rows
from jaxattn._typing import ArrayLike, Bool, Float, Real

Array = jax.Array


def _cap_slope(logits: Array, cap: Any) -> Array | None:
    """The derivative of the soft cap ``c · tanh(x / c)`` at the pre-cap logits ``x``: ``sech²(x / c) = 1 - tanh²(x / c)``.

    Computed as ``sech²(x / c) = 4 e^{-2|u|} / (1 + e^{-2|u|})²`` (``u = x / c``), which keeps its relative
    precision where ``tanh`` rounds to ±1 and ``1 - tanh²`` to 0 (``|x / c|`` beyond about 8 with XLA's
    float32 tanh); 0 at ``±inf`` and at NaN (a kept NaN makes its row of ``p`` NaN anyway; a masked one
    must not reach a zero column through ``0 · NaN``). ``None`` when ``cap`` is None (no cap, slope 1).
    """
    if cap is None:
        return None
    u = logits / jnp.asarray(cap, logits.dtype)  # [..., S]
    t = jnp.exp(-2.0 * jnp.abs(u))  # [..., S], in [0, 1]
    return jnp.where(jnp.isnan(u), 0.0, 4.0 * t / jnp.square(1.0 + t))  # [..., S]


def _capped_softmax(z: Array, keep: Array | None, cap: Any) -> tuple[Array, Array | None]:
    """The core's masked softmax of the capped logits ``c · tanh(z / c)``, and the cap's slope at ``z``."""
    return _masked_softmax(soft_cap(z, cap), keep), _cap_slope(z, cap)


def softmax_jacobian(
    logits: Float[ArrayLike, "*rows S"],
    mask: Bool[ArrayLike, "*#rows #S"] | None = None,
    *,
    logit_cap: Real[ArrayLike, ""] | None = None,
) -> Float[Array, "*rows S S"]:
    """The Jacobian of the (masked, optionally soft-capped) softmax, per row, in closed form.

    Without a cap: ``J = diag(p) - p pᵀ``, ``J[s, s'] = ∂p_s / ∂z_s'`` for ``p = softmax(z)`` computed by
    the core's masked softmax. The diagonal ``p_s (1 - p_s)`` takes ``1 - p_max`` as the sum of the other
    weights, so it does not round to 0 while the off-diagonal entries are still nonzero. Masked keys get
    zero rows and columns.

    With ``logit_cap=c``: ``logits`` are the pre-cap logits ``x`` (what :func:`jaxattn.attention_logits`
    returns without ``logit_cap``), ``p = softmax(c · tanh(x / c))`` as the core computes it with
    ``logit_cap=c``, and the Jacobian is with respect to ``x``: ``J[s, s'] = ∂p_s / ∂x_s' = (diag(p) -
    p pᵀ)[s, s'] · (1 - tanh²(x_s' / c))``. It is no longer symmetric; its columns still sum to 0.

    Args:
      logits: ``[..., S]`` (e.g. the output of :func:`jaxattn.attention_logits`, ``[T, S]``).
      mask: optional boolean keep-mask broadcastable to ``logits``.
      logit_cap: ``None`` (no cap) or the soft cap ``c > 0`` of the core's ``logit_cap``; a traced
        scalar is accepted under ``jit``/``vmap``.

    Returns:
      ``[..., S, S]`` in at least float32; without a cap symmetric positive semi-definite, rows summing
      to 0 (``[..., 0, 0]`` when ``S = 0``).
    """
    z = _rows(logits, "logits", "[..., S]")
    return _jacobian(z, _keep(mask, z.shape), check_logit_cap(logit_cap))


@jax.jit
def _jacobian(z: Array, keep: Array | None, cap: Any = None) -> Array:
    """:func:`softmax_jacobian` of checked logits, one compiled program."""
    p, slope = _capped_softmax(z, keep, cap)  # [..., S], [..., S] or None
    if p.shape[-1] == 0:  # no keys: an empty Jacobian
        return jnp.zeros(p.shape + (0,), p.dtype)
    c, _ = _complement(p)  # [..., S]
    outer = -p[..., :, None] * p[..., None, :]  # [..., S, S]
    eye = jnp.broadcast_to(jnp.eye(p.shape[-1], dtype=jnp.bool_), outer.shape)  # [..., S, S]
    jac = jnp.where(eye, jnp.broadcast_to((p * c)[..., None, :], outer.shape), outer)  # [..., S, S]
    if slope is None:
        return jac
    return jac * slope[..., None, :]  # column s' times the cap's slope at x_s'


def softmax_jacobian_norms(
    logits: Float[ArrayLike, "*rows S"],
    mask: Bool[ArrayLike, "*#rows #S"] | None = None,
    *,
    logit_cap: Real[ArrayLike, ""] | None = None,
) -> dict[str, Float[Array, "*rows"]]:
    """Norms of the softmax Jacobian ``J = diag(p) - p pᵀ`` per row, without forming ``J`` (O(S) per row).

    Frobenius: ``‖J‖_F² = Σ_s p_s² ((1 - p_s)² + Σ_{s'≠s} p_s'²)``, evaluated relative to the second
    largest weight ``a`` so that neither the squares nor ``1 - p_max`` underflow or cancel: ``‖J‖_F`` is
    accurate whenever ``a`` is representable. For a saturated row it is ``≈ 2a``.
    Nuclear (= trace, since J is positive semi-definite): ``Σ_s p_s (1 - p_s) = 1 - Σ_s p_s²``.

    With ``logit_cap=c`` the norms are those of :func:`softmax_jacobian`'s ``J diag(σ)``, the Jacobian of
    the capped softmax with respect to the pre-cap logits ``x = logits`` (``σ_s = 1 - tanh²(x_s / c)``).
    Frobenius: the same sum with term ``s`` (the squared norm of column ``s``) times ``σ_s²``, still O(S).
    Nuclear: ``J diag(σ)`` is not symmetric, so its trace ``Σ_s p_s (1 - p_s) σ_s`` is only a lower bound;
    the nuclear norm is summed from its singular values, which forms the ``[..., S, S]`` matrix (O(S³)
    per row, with a cap only).

    Args:
      logits: ``[..., S]``.
      mask: optional boolean keep-mask broadcastable to ``logits``.
      logit_cap: ``None`` (no cap) or the soft cap ``c > 0`` (see :func:`softmax_jacobian`).

    Returns:
      dict of ``[...]`` arrays: ``frobenius`` and ``nuclear`` (0 when ``S = 0``).
    """
    z = _rows(logits, "logits", "[..., S]")
    return _norms(z, _keep(mask, z.shape), check_logit_cap(logit_cap))


@jax.jit
def _norms(z: Array, keep: Array | None, cap: Any = None) -> dict[str, Array]:
    """:func:`softmax_jacobian_norms` of checked logits, one compiled program."""
    p, slope = _capped_softmax(z, keep, cap)  # [..., S], [..., S] or None
    if p.shape[-1] == 0:  # no keys: an empty Jacobian, whose norms are 0
        return {"frobenius": jnp.zeros(p.shape[:-1], p.dtype), "nuclear": jnp.zeros(p.shape[:-1], p.dtype)}
    if slope is None:
        return _jacobian_norms(p)
    jac = _jacobian(z, keep, cap)  # [..., S, S], J diag(σ)
    nuclear = jnp.sum(jnp.linalg.svd(jac, compute_uv=False), axis=-1)  # [...]
    return {"frobenius": _jacobian_norms(p, slope)["frobenius"], "nuclear": nuclear}


def _jacobian_norms(p: Array, slope: Array | None = None) -> dict[str, Array]:
    """``frobenius`` and ``nuclear`` (= trace) of ``J = diag(p) - p pᵀ`` per row; with ``slope`` (the cap's
    ``σ [..., S]``) ``frobenius`` and ``trace`` of ``J diag(σ)`` (the trace only bounds its nuclear norm
    from below)."""
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
    if slope is None:
        frob_sq_scaled = (p_max**2) * ((c_max / a_safe[..., 0]) ** 2 + sum_u2) + jnp.sum(
            u * u * (c * c + others_sq), axis=-1
        )
        frob = jnp.where(a[..., 0] > 0, a[..., 0] * jnp.sqrt(frob_sq_scaled), a[..., 0] * 0.0)  # 0, or a NaN row's NaN
        return {"frobenius": frob, "nuclear": jnp.sum(p * c, axis=-1)}
    # Column s of J diag(σ) is σ_s times column s of J: each column's squared norm times σ_s². The slopes
    # are taken relative to the row's largest, σ_top, so that σ² does not underflow where σ itself does
    # not (σ ≈ 4e^{-2|x/c|} is below 1e-19, and σ² below float32's range, from |x/c| ≈ 22).
    top = jnp.max(slope, axis=-1, keepdims=True)  # [..., 1]
    rel = slope / jnp.where(top > 0, top, 1.0)  # [..., S], in [0, 1]
    s2 = rel * rel  # [..., S]
    s2_max = jnp.sum(jnp.where(is_max, s2, 0.0), axis=-1)  # [...], (σ / σ_top)² at the largest weight
    frob_sq_scaled = s2_max * (p_max**2) * ((c_max / a_safe[..., 0]) ** 2 + sum_u2) + jnp.sum(
        s2 * u * u * (c * c + others_sq), axis=-1
    )
    frob = jnp.where(a[..., 0] > 0, a[..., 0] * top[..., 0] * jnp.sqrt(frob_sq_scaled), a[..., 0] * 0.0)  # 0, or NaN
    return {"frobenius": frob, "trace": jnp.sum(p * c * slope, axis=-1)}
