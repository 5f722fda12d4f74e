"""Probes of softmax saturation (public face of :mod:`jaxattn._probes`; see there for the details).

Row statistics of attention maps (mask-aware, ``[..., S] -> [...]``)::

    entropy, normalized_entropy, max_weight, effective_support, row_stats, head_entropy

The softmax Jacobian ``diag(p) - p pᵀ`` and its norms::

    softmax_jacobian, softmax_jacobian_norms

Gradients through the core attention by ``jax.grad``, for any ``scale``::

    attention_grads, grad_norms

Monte Carlo: Var(q·k) and the saturation sweep (one ``jit(vmap(...))`` program)::

    dot_product_variance, saturation_sweep, summarize_sweep, sweep_trial_fn, DEFAULT_HEAD_DIMS, SAMPLINGS

The laws the unscaled sweep follows (float64 NumPy), and fits::

    gap_survival, gap_density_at_zero, gap_median, underflow_gap, predicted_laws,
    fit_power_law, fit_stretched_exp
"""

from jaxattn._probes import (
    DEFAULT_HEAD_DIMS,
    SAMPLINGS,
    attention_grads,
    dot_product_variance,
    effective_support,
    entropy,
    fit_power_law,
    fit_stretched_exp,
    gap_density_at_zero,
    gap_median,
    gap_survival,
    grad_norms,
    head_entropy,
    max_weight,
    normalized_entropy,
    predicted_laws,
    row_stats,
    saturation_sweep,
    softmax_jacobian,
    softmax_jacobian_norms,
    summarize_sweep,
    sweep_trial_fn,
    underflow_gap,
)

__all__ = [
    "DEFAULT_HEAD_DIMS",
    "SAMPLINGS",
    "attention_grads",
    "dot_product_variance",
    "effective_support",
    "entropy",
    "fit_power_law",
    "fit_stretched_exp",
    "gap_density_at_zero",
    "gap_median",
    "gap_survival",
    "grad_norms",
    "head_entropy",
    "max_weight",
    "normalized_entropy",
    "predicted_laws",
    "row_stats",
    "saturation_sweep",
    "softmax_jacobian",
    "softmax_jacobian_norms",
    "summarize_sweep",
    "sweep_trial_fn",
    "underflow_gap",
]
