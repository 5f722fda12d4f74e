"""Which heads does the answer depend on? Ablation, patching and gradients as arguments of a pure forward.

Attention maps show where heads look, not what the output depends on. The bundled models' forwards
take interventions as arguments (``head_mask [L, N]`` and ``patch``, see ``docs/models.md``), so the
effect of every head is one compiled program over a batch of masks or patches: no hooks, no state.

- a model on fixed inputs (``_model``): :class:`Bound`, :func:`bind`, and :func:`per_sequence` (one
  table per sequence of a batched bound, as one program);
- effect tables ``[L, N]`` for a metric of the output (``_effects``): :func:`ablation_effects`,
  :func:`patching_effects` (activation patching; mean-ablation with :func:`reference_mean`),
  :func:`gate_gradients`, :func:`attribution_patching`, :func:`attention_gradient`,
  :func:`layer_gradients`, :func:`metric_value`, :func:`joint_patching_effect` (heads patched at once),
  and the masks they run, :func:`head_masks`, :func:`head_where`; residual-stream and block-output
  sites (:data:`POSITION_SITES`) patched by layer and position, ``[L, T]``; with ``mesh=`` the
  interventions are split over a ``jax.sharding`` mesh's data axis and the model runs as ``shard``
  placed it (``_mesh``, ``docs/scaling.md``);
- the direct effect on the logits (``_lens``): :func:`logit_lens` (every layer's stream read through
  the final norm and the unembedding), :func:`logit_attribution` (each head's, MLP's and the
  embedding's share of a logit difference through the frozen final norm);
- head types from attention maps (``_scores``): :func:`head_scores` (previous-token, duplicate-token,
  induction and sink scores, :data:`HEAD_KINDS`);
- metrics (``_metrics``): :func:`span_log_prob`, :func:`choice_metric` (a causal LM's log-probability
  difference between two continuations), :func:`similarity_metric` (an encoder's, no LM head),
  :class:`RowMetric` (a function of the logits at chosen real tokens, whose tables run at the prompt's
  bucket length: a new length inside a bucket compiles nothing new);
- tokens of a text (``_text``): :func:`encode_with_offsets`, :func:`char_span_to_tokens`,
  :func:`find_span`, :func:`encode_choices`;
- statistics (``_stats``): :func:`spearman`, :func:`wilson_interval`;
- Winograd schemas: in their own module, :mod:`jaxattn.winograd` (WSC273 as published and the three
  scorers). Its names are also attributes of this package, the same objects (``interventions.load_wsc273``
  is ``winograd.load_wsc273``), so code written against them here keeps working; they are documented
  there and not listed in this package's ``__all__``;
- the entropy bound on real heads (``_heads``): :func:`qk_weights` (a :class:`jaxattn.models.QKWeights`),
  :func:`attention_inputs`, :func:`entropy_bounds`;
- reports (``_report``): :func:`head_tables` (every method's table), :func:`correlations`,
  :func:`top_heads`, :func:`heatmaps_png`, :func:`bound_summary`, and their ``render_*`` functions.

Timing the tables (resumed, as whole forwards, against a Python loop of forwards) is an experiment's job:
``experiments/heads.py --parts bench``.

Needs the ``[models]`` extra (the tokenizers; the bundled models).
"""

from jaxattn._extras import require

require("models", "jaxattn.interventions", "safetensors", "tokenizers", "huggingface_hub")

from jaxattn.interventions._effects import (  # noqa: E402
    HEAD_SITES,
    POSITION_SITES,
    ablation_effects,
    attention_gradient,
    attribution_patching,
    gate_gradients,
    head_masks,
    head_where,
    joint_patching_effect,
    layer_gradients,
    metric_value,
    patching_effects,
    reference_mean,
)
from jaxattn.interventions._heads import attention_inputs, entropy_bounds, qk_weights  # noqa: E402
from jaxattn.interventions._lens import logit_attribution, logit_lens  # noqa: E402
from jaxattn.interventions._metrics import LogitMetric, RowMetric, choice_metric, similarity_metric, span_log_prob  # noqa: E402
from jaxattn.interventions._model import Bound, bind, per_sequence  # noqa: E402
from jaxattn.interventions._report import (  # noqa: E402
    METHODS,
    attention_row_reduce,
    bound_summary,
    choice_pair,
    correlations,
    head_tables,
    heatmaps_png,
    render_bound,
    render_correlations,
    render_top,
    top_heads,
)
from jaxattn.interventions._scores import HEAD_KINDS, head_scores  # noqa: E402
from jaxattn.interventions._stats import spearman, wilson_interval  # noqa: E402
from jaxattn.interventions._text import char_span_to_tokens, encode_choices, encode_with_offsets, find_span  # noqa: E402

__all__ = [
    "HEAD_KINDS",
    "HEAD_SITES",
    "METHODS",
    "POSITION_SITES",
    "Bound",
    "ablation_effects",
    "attention_gradient",
    "attention_inputs",
    "attention_row_reduce",
    "attribution_patching",
    "bind",
    "bound_summary",
    "char_span_to_tokens",
    "LogitMetric",
    "RowMetric",
    "choice_metric",
    "choice_pair",
    "correlations",
    "encode_choices",
    "encode_with_offsets",
    "entropy_bounds",
    "find_span",
    "gate_gradients",
    "head_masks",
    "head_scores",
    "head_tables",
    "head_where",
    "joint_patching_effect",
    "heatmaps_png",
    "layer_gradients",
    "logit_attribution",
    "logit_lens",
    "metric_value",
    "patching_effects",
    "per_sequence",
    "qk_weights",
    "reference_mean",
    "render_bound",
    "render_correlations",
    "render_top",
    "similarity_metric",
    "span_log_prob",
    "spearman",
    "top_heads",
    "wilson_interval",
]

# The Winograd names, defined in jaxattn.winograd (its __all__): attributes of this package too (the same
# objects), looked up on first use, so that jaxattn.winograd, which reads this package's tokens and
# statistics, imports first or second alike.


def __getattr__(name: str):
    """``jaxattn.winograd``'s names as attributes of this package (``interventions.load_wsc273``)."""
    if not name.startswith("__"):
        from jaxattn import winograd

        if name in winograd.__all__:
            return getattr(winograd, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    from jaxattn import winograd

    return sorted(set(globals()) | set(winograd.__all__))
