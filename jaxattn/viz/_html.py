"""Attention maps as one self-contained HTML page: script, style and data inline, nothing fetched.

The page (``page.js``, ``page.css`` beside this file) shows one layer and head at a time as a heatmap,
as BertViz-style lines from each query token to the keys, or both; hovering a cell or a token shows
the token pair and its weight. With a second set of maps of the same shape it also shows their
difference, and an overview of every head's mean row entropy (click a head to select it); with tables
of per-head values ``[L, N]`` (ablation effects, head scores...), a panel that shows one of them.

Weights are stored as 16-bit codes (0 = exactly 0, a key the mask hides; else ``1 + round(w · 65534)``,
so a weight is kept within 7.7e-6), base64-encoded: about 2.7 bytes per weight.

Axis alphabet: L layers, N heads, T queries, S keys.
"""

from __future__ import annotations

import base64
import html as html_escape
import json
import re
from importlib import resources
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

# Weights are stored as uint16 codes: 0 is a weight of exactly 0, 1 + round(w * LEVELS) otherwise.
LEVELS = 65534
# A weight may exceed [0, 1] by float rounding this much; it is clipped, anything further is an error.
WEIGHT_SLACK = 1e-5
# A surrogate code point (U+D800-U+DFFF) in a str is not a character and cannot be encoded as UTF-8; a
# byte-level tokenizer's decoder emits them for a token that ends inside a multi-byte character.
_SURROGATE = re.compile("[\ud800-\udfff]")


def text_label(text: str) -> str:
    """``text`` with every surrogate code point replaced by U+FFFD (the replacement character), so it
    encodes as UTF-8; other text is unchanged."""
    return _SURROGATE.sub("\ufffd", text)


def _labels(tokens: Any, n: int, what: str, name: str) -> list[str]:
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise TypeError(f"{name}: expected a sequence of {n} strings ({what}), received {type(tokens).__name__}")
    bad = [type(t).__name__ for t in tokens if not isinstance(t, str)]
    if bad:
        raise TypeError(f"{name}: expected strings ({what}), received an item of type {bad[0]}")
    if len(tokens) != n:
        raise ValueError(f"{name}: expected {n} labels ({what}), received {len(tokens)}")
    return [text_label(t) for t in tokens]


def _split_tokens(tokens: Any, T: int, S: int, name: str) -> tuple[list[str], list[str]]:
    """``(queries [T], keys [S])`` from a sequence of S labels (queries = keys when T == S) or a pair."""
    if isinstance(tokens, tuple) and len(tokens) == 2 and all(
        isinstance(t, Sequence) and not isinstance(t, str) for t in tokens
    ):
        return (_labels(tokens[0], T, "one per query row, T", f"{name}[0]"),
                _labels(tokens[1], S, "one per key column, S", f"{name}[1]"))
    keys = _labels(tokens, S, "one per key column, S", name)
    if T != S:
        raise ValueError(f"{name}: the maps have T={T} query rows and S={S} key columns; pass "
                         f"(query_labels, key_labels) to label both")
    return keys, keys


def check_maps(maps: Any, name: str = "maps") -> np.ndarray:
    """``maps`` as float64 ``[L, N, T, S]`` with every weight in [0, 1] (rounding up to 1e-5 is clipped).

    Raises:
      TypeError: not a real floating-point array.
      ValueError: not 4-D, an empty axis, a weight that is not finite or lies outside [0, 1].
    """
    arr = np.asarray(maps)
    if not _is_float(arr):
        raise TypeError(f"{name}: expected a floating-point array [L, N, T, S], received dtype {arr.dtype}")
    if arr.ndim != 4 or 0 in arr.shape:
        raise ValueError(f"{name}: expected shape [L, N, T, S] with no empty axis, received shape {arr.shape}")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: expected finite weights, received {int(np.sum(~np.isfinite(arr)))} that are not")
    lo, hi = float(arr.min()), float(arr.max())
    if lo < -WEIGHT_SLACK or hi > 1 + WEIGHT_SLACK:
        raise ValueError(f"{name}: expected attention weights in [0, 1], received values from {lo:.6g} to {hi:.6g}")
    return np.clip(arr, 0.0, 1.0)


def _is_float(arr: np.ndarray) -> bool:
    return arr.dtype != object and (np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16")


class Table(NamedTuple):
    """A table of per-head values and the tokens it was computed on, for ``html(..., tables={name: Table(...)})``.

    ``values``: ``[L, N]`` real floats, NaN where a head has no value. ``tokens``: the labels of the input the
    values were computed on, given as :func:`html`'s ``tokens`` (S labels or a ``(query_labels, key_labels)``
    pair); ``None``: not checked. ``{"values": ..., "tokens": ...}`` is read the same way.
    """

    values: Any
    tokens: Any = None


def _token_pair(tokens: Any, where: str) -> tuple[list[str], list[str]] | None:
    """A table's tokens as ``(queries, keys)`` (a single sequence is both), lone surrogates as U+FFFD."""
    if tokens is None:
        return None
    if isinstance(tokens, tuple) and len(tokens) == 2 and all(
        isinstance(t, Sequence) and not isinstance(t, str) for t in tokens
    ):
        q, k = tokens
    else:
        q = k = tokens
    for part in (q, k):
        if isinstance(part, (str, bytes)) or not isinstance(part, Sequence) or not all(isinstance(t, str) for t in part):
            raise TypeError(f"{where}.tokens: expected a sequence of strings or a (query_labels, key_labels) pair, "
                            f"received {type(tokens).__name__}")
    return [text_label(t) for t in q], [text_label(t) for t in k]


def _first_difference(got: list[str], want: list[str]) -> str:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"token {i} is {a!r}, the page's is {b!r}"
    return f"{len(got)} tokens, the page has {len(want)}"


def check_tables(
    tables: Any, L: int, N: int, name: str = "tables", tokens: tuple[list[str], list[str]] | None = None
) -> dict[str, np.ndarray]:
    """``tables`` as ``{table name: float64 [L, N]}``, in the caller's order; NaN (no value) is kept.

    A table is an ``[L, N]`` array, a :class:`Table` or a mapping ``{"values": [L, N], "tokens": labels}``;
    with ``tokens`` (the page's ``(query_labels, key_labels)``), a table that names its tokens must have
    been computed on these.

    Raises:
      TypeError: not a mapping, a name that is not a str, a table that is not a real floating-point array.
      ValueError: an empty name, two names that are the same once lone surrogates are replaced, a
        table whose shape is not ``[L, N]``, an infinite value, a table whose tokens are not the page's.
    """
    if not isinstance(tables, Mapping):
        raise TypeError(f"{name}: expected a mapping from table names (str) to [L, N] arrays, received "
                        f"{type(tables).__name__}")
    out: dict[str, np.ndarray] = {}
    for key, table in tables.items():
        if not isinstance(key, str):
            raise TypeError(f"{name}: expected table names that are str, received a key of type {type(key).__name__}")
        if not key:
            raise ValueError(f"{name}: expected non-empty table names, received ''")
        label = text_label(key)
        if label in out:
            raise ValueError(f"{name}: two table names read {label!r} once lone surrogates become U+FFFD")
        where = f"{name}[{key!r}]"
        if isinstance(table, Mapping):
            extra = sorted(str(k) for k in table if k not in ("values", "tokens"))
            if "values" not in table or extra:
                raise ValueError(f"{where}: expected a mapping with the keys 'values' and 'tokens', received the keys "
                                 f"{sorted(str(k) for k in table)}")
            table = Table(table["values"], table.get("tokens"))
        if isinstance(table, Table):
            given = _token_pair(table.tokens, where)
            if given is not None and tokens is not None and given != tuple(tokens):
                query = given[0] != tokens[0]
                got, want = (given[0], tokens[0]) if query else (given[1], tokens[1])
                side = "" if given[0] == given[1] and tokens[0] == tokens[1] else ("query labels: " if query else "key labels: ")
                raise ValueError(f"{where}: computed on other tokens than the page's ({side}"
                                 f"{_first_difference(got, want)})")
            table = table.values
        arr = np.asarray(table)
        if not _is_float(arr):
            raise TypeError(f"{where}: expected a real floating-point array [L, N] = ({L}, {N}), received dtype {arr.dtype}")
        if arr.shape != (L, N):
            raise ValueError(f"{where}: expected shape [L, N] = ({L}, {N}) (the layers and heads of maps), "
                             f"received shape {arr.shape}")
        arr = arr.astype(np.float64)
        infinite = int(np.sum(np.isinf(arr)))
        if infinite:
            raise ValueError(f"{where}: expected finite values or NaN (no value), received {infinite} infinite")
        out[label] = arr
    return out


def encode_weights(maps: np.ndarray) -> str:
    """``[L, N, T, S]`` weights in [0, 1] as base64 of little-endian uint16 codes (0 = exactly 0)."""
    codes = np.where(maps == 0.0, 0, 1 + np.rint(maps * LEVELS)).astype("<u2")
    return base64.b64encode(codes.tobytes()).decode("ascii")


def decode_weights(text: str, shape: tuple[int, int, int, int]) -> np.ndarray:
    """The inverse of :func:`encode_weights`: float64 ``[L, N, T, S]`` (a weight within 7.7e-6)."""
    codes = np.frombuffer(base64.b64decode(text), "<u2").reshape(shape)
    return np.where(codes == 0, 0.0, (codes.astype(np.float64) - 1) / LEVELS)


def _mean_row_entropy(maps: np.ndarray) -> np.ndarray:
    """Mean row entropy (nats) of each head, ``[L, N]``, in float64; rows whose weights are all 0 are left out.

    The page's overview, computed with NumPy alone (:func:`jaxattn.probes.head_entropy` is the probe).
    """
    p = np.asarray(maps, np.float64)
    h = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)  # [L, N, T]
    live = p.sum(-1) > 0  # [L, N, T]
    return np.where(live, h, 0.0).sum(-1) / np.maximum(live.sum(-1), 1)


def _run(maps: np.ndarray, queries: list[str], keys: list[str], name: str) -> dict[str, Any]:
    L, N, T, S = maps.shape
    causal = T == S and T > 1 and bool(np.all(np.triu(np.ones((T, S), bool), 1) <= (maps == 0.0)))
    return {
        "name": name, "L": L, "N": N, "T": T, "S": S, "queries": queries, "keys": keys, "causal": causal,
        "weights": encode_weights(maps),
        "entropy": np.round(_mean_row_entropy(maps), 5).tolist(),
    }


def _script_json(data: Any) -> str:
    """JSON that is safe inside ``<script>``: no ``<``, ``>`` or ``&`` that could end or open a tag."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _asset(name: str) -> str:
    return resources.files("jaxattn.viz").joinpath(name).read_text(encoding="utf-8")


PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{title}</title>
<style>
{css}
</style>
</head>
<body>
<noscript>This page draws the attention maps with JavaScript; please enable it.</noscript>
<script id="jaxattn-data" type="application/json">{data}</script>
<script>
{js}
</script>
</body>
</html>
"""


def html(
    maps: Any,
    tokens: Any,
    *,
    other: Any = None,
    other_tokens: Any = None,
    names: Sequence[str] = ("A", "B"),
    title: str = "attention maps",
    tables: Mapping[str, Any] | None = None,
    top: int = 10,
) -> str:
    """One self-contained HTML page (a ``str``) for every layer and head of ``maps``; the caller writes it.

    The page loads nothing from the network (its Content-Security-Policy forbids it): script, style
    and data are inline. It has layer and head selectors; a heatmap (rows = queries, columns = keys,
    a fixed 0-1 colour scale, keys hidden by the mask in grey), BertViz-style lines, or both; the token
    pair and its weight on hover; an overview of each head's mean row entropy (click to select). With
    ``other`` of the same shape, a third view shows ``maps - other`` on a blue-white-red scale
    symmetric about 0. With ``tables``, a panel shows the table picked in its selector as an ``[L, N]``
    grid with a colour bar and the value on hover, every layer and head labelled, its full name, and a
    list of its ``top`` heads of largest ``|value|`` (``L3 H1: -0.4213``); clicking a cell or an entry of
    the list shows that layer and head's map.
    Causal and bidirectional maps are drawn the same way: a weight of exactly 0 is the mask's.

    Args:
      maps: ``[L, N, T, S]`` attention weights in [0, 1] (NumPy or JAX, any float dtype).
      tokens: the S key labels (the queries get the same labels when T == S), or a pair
        ``(query_labels [T], key_labels [S])``.
      other: optional second maps ``[L', N', T', S']`` (e.g. the other sentence of a pair); the
        difference view needs the same shape as ``maps``.
      other_tokens: labels of ``other``, as ``tokens``; default ``tokens``.
      names: the two maps' names, shown in the selectors and the tooltip.
      title: the page's title.
      tables: optional ``{name: [L, N] values}``, any per-head numbers of ``maps``' heads (ablation or
        patching effects, direct logit attribution, head scores), real floats, NaN where a head has
        no value (drawn grey). A table with both signs is drawn blue-white-red, symmetric about 0;
        any other on a sequential scale from its smallest value to its largest. A table may carry the
        tokens it was computed on: ``Table(values, tokens)`` or ``{"values": values, "tokens": tokens}``
        (tokens given as ``tokens`` is); a table whose tokens differ from ``tokens`` raises ValueError
        naming it. A plain array is not checked.
      top: how many heads the list beside each table shows (largest ``|value|`` first, heads without a
        value left out); 0: no list.

    Labels, names, table names and title are shown as given, except that a surrogate code point (a lone surrogate,
    as a byte-level tokenizer's decoder emits for a token that ends inside a multi-byte character)
    becomes U+FFFD, so the page always encodes as UTF-8.

    Returns:
      The page: about 2.7 bytes per weight and 20 per table value, plus its script and style
      (docs/viz.md has sizes).

    Raises:
      TypeError, ValueError: naming the argument, with the expected and the received shape or type.
    """
    if not isinstance(title, str):
        raise TypeError(f"title: expected a str, received {type(title).__name__}")
    names = tuple(names) if isinstance(names, (list, tuple)) else names
    if not (isinstance(names, tuple) and len(names) == 2 and all(isinstance(n, str) and n for n in names)):
        raise ValueError(f"names: expected two non-empty strings, received {names!r}")
    title, names = text_label(title), tuple(text_label(n) for n in names)
    a = check_maps(maps, "maps")
    qa, ka = _split_tokens(tokens, a.shape[2], a.shape[3], "tokens")
    checked = {} if tables is None else check_tables(tables, a.shape[0], a.shape[1], "tables", (qa, ka))
    if isinstance(top, bool) or not isinstance(top, (int, np.integer)) or top < 0:
        raise ValueError(f"top: expected an int >= 0 (how many heads each table lists), received {top!r}")
    runs = [_run(a, qa, ka, names[0])]
    note = ""
    if other is not None:
        b = check_maps(other, "other")
        qb, kb = _split_tokens(tokens if other_tokens is None else other_tokens, b.shape[2], b.shape[3],
                               "other_tokens" if other_tokens is not None else
                               "other_tokens (not given: tokens, other's default)")
        runs.append(_run(b, qb, kb, names[1]))
        if a.shape != b.shape:
            note = (f"no difference view: {names[0]} has shape {list(a.shape)} and {names[1]} "
                    f"{list(b.shape)} (layers, heads, queries, keys)")
    elif other_tokens is not None:
        raise ValueError("other_tokens: given without other (the second maps)")
    data = {
        "title": title,
        "levels": LEVELS,
        "runs": runs,
        "difference": len(runs) == 2 and not note,
        "difference_note": note,
        # JSON has no NaN: a head without a value is null
        "top": int(top),
        "tables": [{"name": k, "values": [[None if np.isnan(x) else float(x) for x in row] for row in v]}
                   for k, v in checked.items()],
    }
    return PAGE.format(title=html_escape.escape(title), css=_asset("page.css").strip(),
                       data=_script_json(data), js=_asset("page.js").strip())


def page_data(page: str) -> dict[str, Any]:
    """The data an :func:`html` page holds: each run's ``weights`` decoded to ``[L, N, T, S]`` float64, and
    ``masked [L, N, T, S]``, True where the weight was exactly 0 (a weight below 7.7e-6 decodes as 0.0
    too, but is not masked); ``tables``, ``{name: float64 [L, N]}`` in the page's order, NaN where a
    head has no value (the values as given, exactly)."""
    start = page.index('<script id="jaxattn-data" type="application/json">')
    start = page.index(">", start) + 1
    data = json.loads(page[start:page.index("</script>", start)])
    for run in data["runs"]:
        shape = (run["L"], run["N"], run["T"], run["S"])
        codes = np.frombuffer(base64.b64decode(run["weights"]), "<u2").reshape(shape)
        run["weights"] = decode_weights(run["weights"], shape)
        run["masked"] = codes == 0
    data["tables"] = {t["name"]: np.array([[np.nan if x is None else x for x in row] for row in t["values"]],
                                          np.float64) for t in data["tables"]}
    return data
