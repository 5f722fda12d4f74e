"""The chapter's four-part lab as library code: compute the numbers, return data, render to text or PNG.

Nothing here prints; ``experiments/lab.py`` and ``experiments/trophy.py`` parse, call and write.

- parts 1-2 (``_saturation``): a small attention map and its row sums (:func:`part1`); the same attention
  with and without ``1/sqrt(d_k)`` (:func:`side_by_side`); the saturation sweep over ``d_k``
  (:func:`sweep`), its table, the laws it follows, the exactly-zero gradients per dtype, and a figure;
- parts 3-4 (``_trophy``): any model's maps of the trophy sentence (:class:`LabModel`,
  :func:`lab_model`, :func:`sentence_maps`), and "too big" vs "too small" compared (:func:`compare`),
  drawn as PNGs (:func:`png_grid`, :func:`png_difference`, :func:`png_pair`) and as one interactive
  HTML page (:func:`html_page`, built by :func:`jaxattn.viz.html`).

Long computations (:func:`sweep`, :func:`compare`) take an optional ``progress`` callback and are
otherwise silent.
"""

from jaxattn._extras import require

require("lab", "jaxattn.lab", "matplotlib")

from jaxattn.lab._saturation import (  # noqa: E402
    FIT_MIN_HEAD_DIM,
    LOW_PRECISION_DTYPES,
    QK_COLUMNS,
    ROW_SUM_TOLERANCE,
    TABLE_COLUMNS,
    fit_laws,
    key_gap_median,
    part1,
    plot_sweep,
    readout_norm_mean,
    render_laws,
    render_part1,
    render_side_by_side,
    render_table,
    render_zero_fractions,
    save_figure,
    scaled_band,
    side_by_side,
    sweep,
    sweep_table,
    zero_fractions,
)
from jaxattn.lab._trophy import (  # noqa: E402
    PAIR_NAMES,
    RESOLUTION_PROMPT,
    RESOLUTIONS,
    SENTENCES,
    SHADES,
    Comparison,
    LabModel,
    SentenceMaps,
    compare,
    focus_head,
    html_page,
    lab_model,
    png_difference,
    png_grid,
    png_pair,
    render_ascii,
    render_contrast,
    render_part3,
    render_part4,
    sentence_maps,
    substitutions,
    word_span,
)

__all__ = [
    "FIT_MIN_HEAD_DIM",
    "LOW_PRECISION_DTYPES",
    "PAIR_NAMES",
    "QK_COLUMNS",
    "RESOLUTIONS",
    "RESOLUTION_PROMPT",
    "ROW_SUM_TOLERANCE",
    "SENTENCES",
    "SHADES",
    "TABLE_COLUMNS",
    "Comparison",
    "LabModel",
    "SentenceMaps",
    "compare",
    "fit_laws",
    "focus_head",
    "html_page",
    "key_gap_median",
    "lab_model",
    "part1",
    "plot_sweep",
    "png_difference",
    "png_grid",
    "png_pair",
    "readout_norm_mean",
    "render_ascii",
    "render_contrast",
    "render_laws",
    "render_part1",
    "render_part3",
    "render_part4",
    "render_side_by_side",
    "render_table",
    "render_zero_fractions",
    "save_figure",
    "scaled_band",
    "sentence_maps",
    "side_by_side",
    "substitutions",
    "sweep",
    "sweep_table",
    "word_span",
    "zero_fractions",
]
