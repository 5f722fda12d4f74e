"""Attention maps as PNG figures: every head in one picture, and one head of a pair with its difference.

Built on a ``matplotlib.figure.Figure`` with its own Agg canvas: matplotlib's global backend and state
are never touched, and nothing is shown. Token labels on both axes, a colorbar on every picture;
weights on a fixed 0-1 scale (viridis), differences on a blue-white-red scale symmetric about 0.
Tokens, titles and names are drawn literally: no mathtext, no TeX (a ``$`` is a dollar sign).
Functions return PNG bytes; the caller writes the file.

Axis alphabet: L layers, N heads, T queries, S keys.
"""

from __future__ import annotations

import io
from typing import Any, Sequence

import numpy as np

from jaxattn._extras import require
from jaxattn.viz._html import WEIGHT_SLACK, _split_tokens, text_label

MASKED = "#d9d9d9"  # cells of weight exactly 0 (hidden by the mask), as in the HTML page
# At most this many tokens on an axis are labelled by name; longer axes get an index every few tokens.
MAX_NAMED_TOKENS = 48
# Text properties of every label drawn from the caller's strings: literal text, never mathtext or TeX.
LITERAL = {"parse_math": False, "usetex": False}


def _figure(width: float, height: float):
    require("lab", "jaxattn.viz's PNG figures", "matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _png(fig, dpi: int) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def _colours(name: str):
    """A colormap whose NaN is white (gaps) and whose values below the scale are grey (masked keys)."""
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(bad="white", under=MASKED)


def _check(maps: Any, name: str, ndim: int, *, difference: bool) -> np.ndarray:
    arr = np.asarray(maps)
    axes = "[L, N, T, S]" if ndim == 4 else "[T, S]"
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16"):
        raise TypeError(f"{name}: expected a floating-point array {axes}, received dtype {arr.dtype}")
    if arr.ndim != ndim or 0 in arr.shape:
        raise ValueError(f"{name}: expected shape {axes} with no empty axis, received shape {arr.shape}")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: expected finite values, received {int(np.sum(~np.isfinite(arr)))} that are not")
    lo, hi = (-1.0, 1.0) if difference else (0.0, 1.0)
    if arr.min() < lo - WEIGHT_SLACK or arr.max() > hi + WEIGHT_SLACK:
        what = "differences of weights in [-1, 1]" if difference else "attention weights in [0, 1]"
        raise ValueError(f"{name}: expected {what}, received values from {arr.min():.6g} to {arr.max():.6g}")
    return arr


def _title(title: Any) -> str:
    if not isinstance(title, str):
        raise TypeError(f"title: expected a str, received {type(title).__name__}")
    return text_label(title)


LABEL_CHARS = 20  # a token label longer than this ends in "…", as on the page (a long token must not size the figure)


def _short(label: str) -> str:
    return label if len(label) <= LABEL_CHARS else label[: LABEL_CHARS - 1] + "\u2026"


def _ticks(labels: Sequence[str]) -> tuple[list[int], list[str]]:
    """Tick positions and texts: every token by name (cut to :data:`LABEL_CHARS` characters), or an index
    every few tokens on a long axis."""
    n = len(labels)
    if n <= MAX_NAMED_TOKENS:
        return list(range(n)), [f"{i} {_short(x)!r}" if x.strip() != x or not x else f"{i} {_short(x)}"
                                for i, x in enumerate(labels)]
    every = -(-n // 16)
    return list(range(0, n, every)), [str(i) for i in range(0, n, every)]


def _font(n: int, inches: float) -> float:
    """A tick font size (points) that fits ``n`` labels along ``inches``."""
    return float(np.clip(72 * inches / max(n, 1) * 0.8, 3.0, 8.0))


def merged_labels(a: Sequence[str], b: Sequence[str]) -> list[str]:
    """One label per position for a difference ``A - B``: ``"x"`` where both agree, ``"x/y"`` where not."""
    if len(a) != len(b):
        raise ValueError(f"b: expected as many labels as a ({len(a)}), received {len(b)}")
    return [x if x == y else f"{x}/{y}" for x, y in zip(a, b)]


def grid_png(maps: Any, tokens: Any, *, title: str = "", difference: bool = False, dpi: int = 110) -> bytes:
    """:func:`grid_figure` as PNG bytes at ``dpi``."""
    return _png(grid_figure(maps, tokens, title=title, difference=difference), dpi)


def pair_png(a: Any, b: Any, tokens_a: Any, tokens_b: Any, *, names: Sequence[str] = ("A", "B"), title: str = "",
             dpi: int = 110) -> bytes:
    """:func:`pair_figure` as PNG bytes at ``dpi``."""
    return _png(pair_figure(a, b, tokens_a, tokens_b, names=names, title=title), dpi)


def grid_figure(maps: Any, tokens: Any, *, title: str = "", difference: bool = False):
    """Every layer x head map of ``maps [L, N, T, S]`` in one ``Figure``: one block per head, one colorbar.

    Blocks are laid out with layers down and heads across (``L0``, ``h0`` on the right and top edges).
    Each block row carries the query tokens on the left, each block column the key tokens below
    (named up to :data:`MAX_NAMED_TOKENS` tokens, indexed beyond). ``difference=True`` takes values in
    [-1, 1] (e.g. one sentence's maps minus another's) and draws them blue-white-red, symmetric about 0.

    Args:
      maps: ``[L, N, T, S]``, weights in [0, 1] (or differences in [-1, 1] with ``difference=True``).
      tokens: the S key labels (queries the same when T == S), or ``(query_labels, key_labels)``; drawn
        literally (``$`` included), a lone surrogate as U+FFFD, one longer than :data:`LABEL_CHARS`
        characters cut, ending in ``…``.
      title: shown above, literally.

    Returns:
      A matplotlib ``Figure`` on its own Agg canvas (nothing shown, no global state touched).
    """
    m = _check(maps, "maps", 4, difference=difference)
    title = _title(title)
    L, N, T, S = m.shape
    queries, keys = _split_tokens(tokens, T, S, "tokens")
    gap = max(1, round(0.08 * max(T, S)))
    # Gaps between blocks are NaN (white); a weight of exactly 0, a key the mask hides, is below the scale (grey).
    shown = m if difference else np.where(m == 0.0, -1.0, m)
    mosaic = np.full((L * (T + gap) - gap, N * (S + gap) - gap), np.nan)
    for layer in range(L):
        for head in range(N):
            mosaic[layer * (T + gap):layer * (T + gap) + T, head * (S + gap):head * (S + gap) + S] = shown[layer, head]
    block = 1.1  # inches per block
    fig = _figure(block * N + 3.0, block * L * T / S + 2.0)  # a block is 1.1 in wide, T/S as tall
    ax = fig.add_subplot()
    if difference:
        scale = max(float(np.abs(m).max()), 1e-12)
        cmap, vmin, vmax, what = "RdBu_r", -scale, scale, "difference of attention weights"
    else:
        cmap, vmin, vmax, what = "viridis", 0.0, 1.0, "attention weight"
    im = ax.imshow(mosaic, cmap=_colours(cmap), vmin=vmin, vmax=vmax, interpolation="nearest", aspect="equal")
    qt, ql = _ticks(queries)
    kt, kl = _ticks(keys)
    ax.set_yticks([layer * (T + gap) + t for layer in range(L) for t in qt], ql * L,
                  fontsize=_font(T, block * T / max(T, S)), **LITERAL)
    ax.set_xticks([head * (S + gap) + s for head in range(N) for s in kt], kl * N,
                  fontsize=_font(S, block), rotation=90, **LITERAL)
    ax.tick_params(length=1.5, pad=1)
    top = ax.secondary_xaxis("top")
    top.set_xticks([head * (S + gap) + (S - 1) / 2 for head in range(N)], [f"h{n}" for n in range(N)], fontsize=8)
    right = ax.secondary_yaxis("right")
    right.set_yticks([layer * (T + gap) + (T - 1) / 2 for layer in range(L)], [f"L{layer}" for layer in range(L)], fontsize=8)
    for side in (top, right):
        side.tick_params(length=0)
    fig.colorbar(im, ax=ax, shrink=min(0.6, 6.0 / (block * L + 2.0)) if L > 4 else 0.8, pad=0.04, label=what)
    head_line = f"{title}\n" if title else ""
    # the axes' own title (not the figure's) sits right above the head labels, whatever the grid's aspect
    ax.set_title(f"{head_line}rows: queries, columns: keys ({T} x {S} tokens); layers down, heads across", fontsize=9,
                 **LITERAL)
    return fig


def pair_figure(a: Any, b: Any, tokens_a: Any, tokens_b: Any, *, names: Sequence[str] = ("A", "B"), title: str = ""):
    """One head's map ``[T, S]`` for two inputs and their difference ``a - b``, side by side, in one ``Figure``.

    Each panel has the tokens on both axes and its own colorbar: ``a`` and ``b`` on the 0-1 scale,
    ``a - b`` blue-white-red, symmetric about 0, its labels ``"x/y"`` where the two inputs' tokens differ.

    Args:
      a, b: ``[T, S]`` attention weights in [0, 1], the same shape.
      tokens_a, tokens_b: their labels (S keys, or ``(query_labels, key_labels)``), drawn literally (one
        longer than :data:`LABEL_CHARS` characters cut, ending in ``…``).
      names: the two inputs' names.
      title: shown above, literally.

    Returns:
      A matplotlib ``Figure`` on its own Agg canvas.
    """
    wa = _check(a, "a", 2, difference=False)
    wb = _check(b, "b", 2, difference=False)
    if wa.shape != wb.shape:
        raise ValueError(f"b: expected the shape of a, {wa.shape}, received {wb.shape}")
    names = tuple(names) if isinstance(names, (list, tuple)) else names  # a str is not two names
    if not (isinstance(names, tuple) and len(names) == 2 and all(isinstance(n, str) and n for n in names)):
        raise ValueError(f"names: expected two non-empty strings, received {names!r}")
    names, title = tuple(text_label(n) for n in names), _title(title)
    T, S = wa.shape
    qa, ka = _split_tokens(tokens_a, T, S, "tokens_a")
    qb, kb = _split_tokens(tokens_b, T, S, "tokens_b")
    d = wa - wb
    scale = max(float(np.abs(d).max()), 1e-12)
    side = float(np.clip(0.28 * max(T, S), 3.0, 9.0))
    fig = _figure(3 * side + 4.5, side + 1.5)
    axes = fig.subplots(1, 3)
    masked = lambda w: np.where(w == 0.0, -1.0, w)  # exactly 0: below the scale, drawn grey
    panels = ((masked(wa), qa, ka, names[0], "viridis", 0.0, 1.0, "attention weight"),
              (masked(wb), qb, kb, names[1], "viridis", 0.0, 1.0, "attention weight"),
              (d, merged_labels(qa, qb), merged_labels(ka, kb), f"{names[0]} - {names[1]}", "RdBu_r", -scale, scale,
               "difference"))
    for ax, (w, ql, kl, name, cmap, vmin, vmax, what) in zip(axes, panels):
        im = ax.imshow(w, cmap=_colours(cmap), vmin=vmin, vmax=vmax, interpolation="nearest")
        yt, yl = _ticks(ql)
        xt, xl = _ticks(kl)
        ax.set_yticks(yt, yl, fontsize=_font(T, side), **LITERAL)
        ax.set_xticks(xt, xl, fontsize=_font(S, side), rotation=90, **LITERAL)
        ax.set_title(name, fontsize=10, **LITERAL)
        ax.set_ylabel("query")
        ax.set_xlabel("key")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label=what)
    if title:
        fig.suptitle(title, fontsize=10, **LITERAL)
    fig.tight_layout()
    return fig
