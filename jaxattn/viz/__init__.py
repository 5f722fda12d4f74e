"""Attention maps made visible: an interactive HTML page, and PNG figures.

- :func:`html`: one self-contained page (script, style and data inline; nothing fetched) for maps
  ``[L, N, T, S]``: layer and head selectors, heatmap and BertViz-style lines, the token pair and its
  weight on hover, the difference of two maps, each head's entropy at a glance, tables of per-head
  values ``[L, N]`` (click a head to show it); it fits the window. Needs only NumPy.
- :func:`grid_png`, :func:`pair_png` (and the ``Figure`` behind each, :func:`grid_figure`,
  :func:`pair_figure`): every head in one picture, and one head of a pair with its difference; token
  labels on both axes, colorbars (extra ``[lab]``: matplotlib, imported on use; never pyplot).
- :class:`Table`: a table's values ``[L, N]`` with the tokens they were computed on (checked by :func:`html`).
- :func:`page_data`: the data a page holds, decoded (what a test compares the browser against).

Axis alphabet: L layers, N heads, T queries, S keys.
"""

from jaxattn.viz._html import LEVELS, Table, check_maps, html, page_data
from jaxattn.viz._png import MAX_NAMED_TOKENS, grid_figure, grid_png, merged_labels, pair_figure, pair_png

__all__ = [
    "LEVELS",
    "MAX_NAMED_TOKENS",
    "Table",
    "check_maps",
    "grid_figure",
    "grid_png",
    "html",
    "merged_labels",
    "page_data",
    "pair_figure",
    "pair_png",
]
