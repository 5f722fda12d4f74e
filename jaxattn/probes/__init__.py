"""Probes of softmax saturation: what an attention map looks like, and what gradient flows through it.

Every probe is a pure function of arrays that composes with ``jax.jit``/``jax.vmap`` and takes an
optional boolean keep-mask (True = attend) broadcastable to the map. The maps, logits and gradients it
measures come from the core (:func:`jaxattn.attention`, :func:`jaxattn.attention_logits` and its masked
softmax): there is no second attention path.

The Jacobian, gradient and sweep probes take ``logit_cap=c`` (the core's logit soft cap ``c · tanh(x / c)``)
and then measure the capped attention; their Jacobians and ``∂L/∂logits`` are with respect to the pre-cap
logits ``x = scale · q kᵀ + bias`` (what the ``1/sqrt(d_k)`` scale acts on), so they include the cap's
derivative ``sech²(x / c) = 1 - tanh²(x / c)``.

- row statistics of a map ``[..., S] -> [...]`` (``_rows``): :func:`entropy`,
  :func:`normalized_entropy`, :func:`max_weight`, :func:`effective_support`, :func:`row_stats`,
  :func:`head_entropy`;
- the softmax Jacobian ``diag(p) - p pᵀ`` (``_jacobian``): :func:`softmax_jacobian`,
  :func:`softmax_jacobian_norms`;
- gradients through the core attention by ``jax.grad`` (``_grads``): :func:`attention_grads`,
  :func:`grad_norms`;
- Monte Carlo (``_sweep``): :func:`dot_product_variance`, the saturation sweep as one ``jit(vmap)``
  program, :func:`saturation_sweep`, :func:`summarize_sweep`, :func:`sweep_trial_fn`;
- the laws the unscaled sweep follows, float64 NumPy (``_laws``): :func:`gap_survival`,
  :func:`gap_density_at_zero`, :func:`gap_median`, :func:`underflow_gap`, :func:`predicted_laws`,
  :func:`fit_power_law`, :func:`fit_stretched_exp`;
- a lower bound on a head's row entropy from the spectral norm of its query-key matrix, after Zhai et
  al. 2023 (``_bound``): :func:`entropy_lower_bound`, :func:`logit_spread_bound`, :func:`entropy_floor`,
  :func:`two_level_entropy`, :func:`qk_spectral_norm`; and what a logit cap guarantees every row,
  :func:`logit_cap_bounds`, :func:`max_weight_ceiling`;
- remedies the sweep applies instead of or with ``1/sqrt(d_k)`` (``_remedies``): :class:`Remedy` (none,
  √d_k, q/k RMS norm, a logit cap, a temperature, σReparam), :data:`DEFAULT_REMEDIES`, the sweep's
  ``remedies=`` argument, and the laws of the remedies whose logits still grow with ``d_k``,
  :func:`fit_remedy_laws`;
- a trained model's heads, per layer and head, from its captured ``attn_logits`` (``_heads``):
  :func:`head_saturation` (logit spread, entropy, Jacobian norm, saturated fraction over the real rows)
  and :func:`layer_keep_masks` (the mask each layer's softmax ran under: padding, causality, windows).
"""

from jaxattn.probes._bound import (
    entropy_floor,
    entropy_lower_bound,
    logit_cap_bounds,
    logit_spread_bound,
    max_weight_ceiling,
    qk_spectral_norm,
    two_level_entropy,
)
from jaxattn.probes._grads import attention_grads, grad_norms
from jaxattn.probes._heads import head_saturation, layer_keep_masks
from jaxattn.probes._jacobian import softmax_jacobian, softmax_jacobian_norms
from jaxattn.probes._laws import (
    fit_power_law,
    fit_remedy_laws,
    fit_stretched_exp,
    gap_density_at_zero,
    gap_median,
    gap_survival,
    predicted_laws,
    underflow_gap,
)
from jaxattn.probes._remedies import DEFAULT_REMEDIES, Remedy
from jaxattn.probes._rows import effective_support, entropy, head_entropy, max_weight, normalized_entropy, row_stats
from jaxattn.probes._sweep import (
    DEFAULT_HEAD_DIMS,
    dot_product_variance,
    saturation_sweep,
    summarize_sweep,
    sweep_trial_fn,
)

__all__ = [
    "DEFAULT_HEAD_DIMS",
    "DEFAULT_REMEDIES",
    "Remedy",
    "attention_grads",
    "dot_product_variance",
    "effective_support",
    "entropy",
    "entropy_floor",
    "entropy_lower_bound",
    "fit_power_law",
    "fit_remedy_laws",
    "fit_stretched_exp",
    "gap_density_at_zero",
    "gap_median",
    "gap_survival",
    "grad_norms",
    "head_entropy",
    "head_saturation",
    "layer_keep_masks",
    "logit_cap_bounds",
    "logit_spread_bound",
    "max_weight",
    "max_weight_ceiling",
    "normalized_entropy",
    "predicted_laws",
    "qk_spectral_norm",
    "row_stats",
    "saturation_sweep",
    "softmax_jacobian",
    "softmax_jacobian_norms",
    "summarize_sweep",
    "sweep_trial_fn",
    "two_level_entropy",
    "underflow_gap",
]
