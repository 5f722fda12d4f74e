"""The lab's parts 3 and 4 on any model: the trophy sentence's attention, and the two sentences compared.

Model-agnostic: a model enters through a :class:`LabModel` (a name, whether its attention is causal,
text -> token ids and labels, ids -> every attention map, optionally a scorer of continuations), so
GPT-2 (causal) and a BERT encoder (bidirectional) run through the same analysis. Functions return data;
``render_*`` functions return strings (or PNG bytes); nothing here prints or writes files.

Axis alphabet: L layers, N heads, T tokens (queries), S tokens (keys; S = T here).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from jaxattn import viz
from jaxattn.probes import head_entropy
from jaxattn.models import pad_to_bucket, spec

SENTENCES = {
    "big": "The trophy didn't fit in the suitcase because it was too big.",
    "small": "The trophy didn't fit in the suitcase because it was too small.",
}
# How the model's own prediction is read: the log-probability of each resolution after the sentence.
RESOLUTION_PROMPT = ' In that sentence, "it" refers to the'
RESOLUTIONS = {"trophy": " trophy", "suitcase": " suitcase"}


def substitutions(sentence: str) -> tuple[str, dict[str, str]]:
    """The sentence split for substitution scoring (Trinh & Le 2018): ``(prefix, {candidate: rest})``.

    Each candidate replaces the pronoun: ``prefix + rest`` is the sentence with "the trophy" (or "the
    suitcase") in place of "it". The prefix is the same for both, so comparing ``log p(rest | prefix)``
    compares the two whole sentences' log-probabilities.
    """
    at = sentence.find(" it ", sentence.find("because"))
    if at < 0:
        raise ValueError(f"the sentence must contain ' it ' after 'because', received {sentence!r}")
    prefix, rest = sentence[:at], sentence[at + len(" it"):]
    return prefix, {name: f" the{word}{rest}" for name, word in RESOLUTIONS.items()}

# Shading characters for ASCII maps, from weight 0 (blank) to weight 1.
SHADES = " .:-=+*#%@"


@dataclasses.dataclass(frozen=True)
class LabModel:
    """What the lab needs from a model.

    Attributes:
      name: shown in reports.
      causal: True if query ``t`` can only see keys ``s <= t`` (GPT-2), False if bidirectional (BERT).
      tokenize: ``text -> (ids [T] int, labels: T strings)``, the labels readable (``" it"``).
      attentions: ``(ids [T], scale) -> [L, N, T, T]`` every layer's attention weights; ``scale=None``
        is the model's own ``1/sqrt(d_k)``, ``scale=1.0`` the unscaled variant.
      score: optional ``(prefix, continuation) -> log p(continuation | prefix)`` in nats (a causal LM).
    """

    name: str
    causal: bool
    tokenize: Callable[[str], tuple[np.ndarray, list[str]]]
    attentions: Callable[[np.ndarray, Any], np.ndarray]
    score: Callable[[str, str], float] | None = None


# ----------------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------------


def _norm_label(label: str) -> str:
    return label.replace("Ġ", " ").replace("##", "").strip().lower()


def word_span(labels: Sequence[str], word: str, *, after: int = 0) -> tuple[int, int]:
    """``(start, stop)``: the first run of tokens at or after ``after`` whose labels spell ``word``.

    Labels are compared without spaces, BERT's ``##`` and case, so a word split into several tokens
    (``" suit" + "case"``) is found as a span.

    Raises:
      ValueError: naming the word and the labels when it is not there.
    """
    target = word.strip().lower()
    norm = [_norm_label(x) for x in labels]
    for start in range(after, len(norm)):
        text = ""
        for stop in range(start, len(norm)):
            if not norm[stop] and stop == start:
                break
            text += norm[stop]
            if text == target:
                return start, stop + 1
            if not target.startswith(text):
                break
    raise ValueError(f"word {word!r} not found among the tokens {list(labels)}")


# ----------------------------------------------------------------------------------------------------
# Part 3: the attention map of one sentence
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SentenceMaps:
    """One sentence through one model: ``ids [T]``, ``labels`` (T strings), ``attentions [L, N, T, T]``."""

    model: str
    text: str
    ids: np.ndarray
    labels: list[str]
    attentions: np.ndarray
    scale: float | None = None


def sentence_maps(model: LabModel, text: str, *, scale: Any = None, run_length: int | None = None) -> SentenceMaps:
    """Run ``text`` through ``model`` and keep every attention map (float64 copies).

    Args:
      model: a :class:`LabModel`.
      text: the sentence.
      scale: the attention scale (``None``: the model's own).
      run_length: causal models only: run the model on the ids padded at the end (repeating the last
        token) to this many tokens, and keep the first T rows and columns. Under a causal mask no
        position sees the padding, so the maps are the same; two sentences run at one length go
        through one compiled program, so a shared prefix gives bit-identical numbers (two lengths
        would be two programs, free to round differently).
    """
    ids, labels = model.tokenize(text)
    ids = np.asarray(ids)
    T = len(labels)
    run = ids
    if run_length is not None and run_length > T:
        if not model.causal:
            raise ValueError(f"{model.name} is not causal: padding would change its attention maps")
        run = np.concatenate([ids, np.full(run_length - T, ids[-1], ids.dtype)])
    att = np.asarray(model.attentions(run, scale), np.float64)  # [L, N, len(run), len(run)]
    if att.ndim != 4 or att.shape[2:] != (len(run), len(run)):
        raise ValueError(f"{model.name}: attentions must have shape [L, N, T, T] with T={len(run)} (the ids it "
                         f"was given), received {att.shape}")
    return SentenceMaps(model.name, text, ids, list(labels), att[:, :, :T, :T], scale)  # the real rows and columns


def focus_head(maps: SentenceMaps, row_word: str, col_words: Sequence[str]) -> tuple[int, int]:
    """``(layer, head)`` whose ``row_word`` row puts the most weight on the ``col_words`` tokens."""
    r = word_span(maps.labels, row_word)[1] - 1
    cols = np.zeros(len(maps.labels), bool)
    for w in col_words:
        a, b = word_span(maps.labels, w)
        cols[a:b] = True
    mass = maps.attentions[:, :, r, :][..., cols].sum(-1)  # [L, N]
    layer, head = np.unravel_index(int(np.argmax(mass)), mass.shape)
    return int(layer), int(head)


def render_ascii(weights: np.ndarray, labels: Sequence[str], *, title: str = "") -> str:
    """An attention map ``[T, S]`` as text: one row per query token, one 2-character cell per key.

    The cell's character encodes the weight on an absolute scale, ``SHADES[floor(w · 10)]`` from
    ``" "`` (below 0.1) to ``"@"`` (0.9 and above). A weight of exactly 0 is drawn ``" ·"``: in a
    causal map, the keys a query cannot see; so blank means "small", a dot means "cannot see".
    Columns are numbered with the row indices, written downwards past 9 (a line of tens above the
    line of units: column 12 reads ``1`` over ``2``), so every number stays in its own cell.
    """
    w = np.asarray(weights, np.float64)
    if w.ndim != 2:
        raise ValueError(f"weights must have shape [T, S], received shape {w.shape}")
    T, S = w.shape
    if len(labels) != T:
        raise ValueError(f"labels must have one entry per query row (T={T}), received {len(labels)}")
    if not np.all(np.isfinite(w)):
        i, j = np.argwhere(~np.isfinite(w))[0]
        raise ValueError(f"weights must be finite (a weight in [0, 1] per cell), received {w[i, j]} at row {i}, "
                         f"column {j}")
    width = max(len(repr(x)) for x in labels) if labels else 0
    index = max(2, len(str(max(T - 1, 0))))  # the row numbers' width: row 100 as wide as row 0
    lines = [title] if title else []
    digits = len(str(max(S - 1, 0)))
    for place in range(digits - 1, -1, -1):  # the highest place first; a number's leading zeros blank
        cells = "".join(f" {j // 10**place % 10}" if j >= 10**place or place == 0 else "  " for j in range(S))
        lines.append(" " * (width + index + 3) + cells)
    for i in range(T):
        cells = []
        for j in range(S):
            if w[i, j] == 0.0:
                cells.append(" ·")
            else:
                c = SHADES[min(int(w[i, j] * len(SHADES)), len(SHADES) - 1)]
                cells.append(c * 2)
        lines.append(f"{i:>{index}d} {labels[i]!r:>{width}}  " + "".join(cells))
    lines.append("scale: ' ' < 0.1 <= '.' < 0.2 ... '@' >= 0.9; ' ·' = weight exactly 0 (masked)")
    return "\n".join(lines)


def render_part3(maps: SentenceMaps, layer: int, head: int) -> str:
    """Part 3 as text: the chosen head's map and the head-average of its layer."""
    L, N = maps.attentions.shape[:2]
    if not (0 <= layer < L and 0 <= head < N):
        raise ValueError(f"layer/head must lie in [0, {L}) x [0, {N}), received ({layer}, {head})")
    a = render_ascii(maps.attentions[layer, head], maps.labels,
                     title=f"{maps.model}: layer {layer}, head {head}  ({maps.text!r})")
    b = render_ascii(maps.attentions[layer].mean(0), maps.labels,
                     title=f"{maps.model}: layer {layer}, averaged over its {N} heads")
    return a + "\n\n" + b


def png_grid(maps: SentenceMaps, *, dpi: int = 110) -> bytes:
    """Every layer x head map of one sentence as one PNG (bytes; the caller writes the file).

    Token labels on both axes, a 0-1 colorbar, keys hidden by the mask in grey (:func:`jaxattn.viz.grid_png`).
    """
    return viz.grid_png(maps.attentions, maps.labels, title=f"{maps.model}: {maps.text}", dpi=dpi)


# ----------------------------------------------------------------------------------------------------
# Part 4: the two sentences compared
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Part 4's numbers. Arrays are ``[L, N]`` (per layer and head) unless noted.

    Attributes:
      model, causal: which model; whether its attention is causal.
      maps: the two sentences' :class:`SentenceMaps` (keys ``"big"``, ``"small"``).
      first_difference: the first token position where the two sentences' ids differ.
      it_index: the row of " it" (the same position in both sentences).
      it_row_max_abs_diff: ``max_s |A_big[l, n, it, s] - A_small[l, n, it, s]|`` over the keys both
        sentences have at the same position. A causal model runs both sentences at one length (the
        shorter padded at its end, where no earlier position can see it), so this is exactly 0.
      preference: ``{row: {sentence: [L, N]}}``, the weight the row puts on " trophy" minus on
        " suitcase", for rows ``"it"``, ``"adjective"`` and ``"period"`` (the final ".").
      flip: ``{row: [L, N]}``, ``preference[big] - preference[small]``: positive when the head looks
        more at the trophy in "too big" and more at the suitcase in "too small" (the right way).
      log_probs: ``{sentence: {"trophy": lp, "suitcase": lp}}``, or ``None`` without a scorer.
      substitution: ``{sentence: {"trophy": lp, "suitcase": lp}}``, the log-probability of the sentence
        with "it" replaced by each candidate (:func:`substitutions`), or ``None`` without a scorer.
      entropy: ``{"scaled": [L, N], "unscaled": [L, N]}``, the mean row entropy (nats) of the "big"
        sentence with the model's own scale and with ``scale=1.0``.
      max_weight: the same for the mean of each row's largest weight.
    """

    model: str
    causal: bool
    maps: dict[str, SentenceMaps]
    first_difference: int
    it_index: int
    it_row_max_abs_diff: np.ndarray
    preference: dict[str, dict[str, np.ndarray]]
    flip: dict[str, np.ndarray]
    log_probs: dict[str, dict[str, float]] | None
    entropy: dict[str, np.ndarray]
    max_weight: dict[str, np.ndarray]
    substitution: dict[str, dict[str, float]] | None = None

    def ranking(self, row: str, top: int | None = None) -> list[dict[str, Any]]:
        """Heads sorted by ``flip[row]``, largest first: ``[{layer, head, big, small, flip}, ...]``; the first
        ``top`` (a positive int; None: all)."""
        if top is not None and (isinstance(top, bool) or not isinstance(top, (int, np.integer)) or top < 1):
            raise ValueError(f"top must be a positive int or None, received {top!r}")
        f = self.flip[row]
        order = np.argsort(-f, axis=None, kind="stable")
        out = []
        for idx in order[:top]:
            layer, head = np.unravel_index(int(idx), f.shape)
            out.append({
                "layer": int(layer), "head": int(head),
                "big": float(self.preference[row]["big"][layer, head]),
                "small": float(self.preference[row]["small"][layer, head]),
                "flip": float(f[layer, head]),
            })
        return out

    def to_json(self) -> dict[str, Any]:
        """Plain lists and floats, ready for ``json.dumps``."""
        return {
            "model": self.model,
            "causal": self.causal,
            "sentences": {k: {"text": m.text, "ids": m.ids.tolist(), "labels": m.labels} for k, m in self.maps.items()},
            "first_difference": self.first_difference,
            "it_index": self.it_index,
            "it_row_max_abs_diff": self.it_row_max_abs_diff.tolist(),
            "it_row_identical": bool(np.all(self.it_row_max_abs_diff == 0.0)),
            "preference": {r: {s: v.tolist() for s, v in d.items()} for r, d in self.preference.items()},
            "flip": {r: v.tolist() for r, v in self.flip.items()},
            "ranking": {r: self.ranking(r) for r in self.flip},
            "log_probs": self.log_probs,
            "substitution": self.substitution,
            "entropy": {k: v.tolist() for k, v in self.entropy.items()},
            "max_weight": {k: v.tolist() for k, v in self.max_weight.items()},
        }


def _preference(maps: SentenceMaps, row: int) -> np.ndarray:
    t0, t1 = word_span(maps.labels, "trophy")
    s0, s1 = word_span(maps.labels, "suitcase")
    a = maps.attentions[:, :, row, :]  # [L, N, S]
    return a[..., t0:t1].sum(-1) - a[..., s0:s1].sum(-1)  # [L, N]


def compare(
    model: LabModel,
    sentences: dict[str, str] | None = None,
    *,
    progress: Callable[[int, int, str], None] | None = None,
) -> Comparison:
    """Part 4: the "big" and "small" sentences through ``model``, compared per layer and head.

    Args:
      model: a :class:`LabModel`.
      sentences: ``{"big": ..., "small": ...}``; default :data:`SENTENCES`. Each must contain the words
        trophy, suitcase, it, and end with its adjective followed by ".".
      progress: optional ``progress(done, total, what)``, called before each model run (``what`` says
        which) and once at the end; e.g. a :class:`jaxattn.progress.ProgressBar`.

    Returns:
      A :class:`Comparison`.
    """
    sentences = dict(SENTENCES if sentences is None else sentences)
    if set(sentences) != {"big", "small"}:
        raise ValueError(f"sentences must have the keys 'big' and 'small', received {sorted(sentences)}")
    say = _Steps(progress, 3 + (8 if model.score is not None else 0))  # maps of big, small, big unscaled; 8 scores
    run_length = None
    if model.causal:  # one length for both sentences: one compiled program (see sentence_maps)
        run_length = max(len(model.tokenize(sentences[k])[0]) for k in ("big", "small"))
    maps = {}
    for k in ("big", "small"):
        say(f"maps of 'too {k}'")
        maps[k] = sentence_maps(model, sentences[k], run_length=run_length)
    big, small = maps["big"], maps["small"]
    n = min(len(big.ids), len(small.ids))
    diff = np.nonzero(big.ids[:n] != small.ids[:n])[0]
    if not diff.size and len(big.ids) == len(small.ids):
        raise ValueError("the 'big' and 'small' sentences tokenize to the same ids: there is nothing to compare")
    first_difference = int(diff[0]) if diff.size else n
    it = _it_index(big)
    if it != _it_index(small):
        raise ValueError("the token ' it' sits at different positions in the two sentences")
    # Keys present at the same position in both: the whole row when the lengths agree, else the
    # shared prefix (all a causal model's " it" can see either way).
    S = len(big.ids) if len(big.ids) == len(small.ids) else first_difference
    it_diff = np.abs(big.attentions[:, :, it, :S] - small.attentions[:, :, it, :S]).max(-1)  # [L, N]
    rows = {
        "it": lambda m: it,
        "adjective": lambda m: _period_index(m) - 1,  # the adjective's last token
        "period": _period_index,
    }
    preference = {r: {k: _preference(m, f(m)) for k, m in maps.items()} for r, f in rows.items()}
    flip = {r: p["big"] - p["small"] for r, p in preference.items()}
    log_probs = substitution = None
    if model.score is not None:
        log_probs, substitution = _resolution_scores(model.score, sentences, say)
    say("maps of 'too big' with scale=1.0")
    unscaled = sentence_maps(model, sentences["big"], scale=1.0)
    say.finish()
    entropy = {  # [L, N]: each head's mean row entropy (nats)
        "scaled": np.asarray(head_entropy(big.attentions), np.float64),
        "unscaled": np.asarray(head_entropy(unscaled.attentions), np.float64),
    }
    max_weight = {"scaled": big.attentions.max(-1).mean(-1), "unscaled": unscaled.attentions.max(-1).mean(-1)}
    return Comparison(model.name, model.causal, maps, first_difference, it, it_diff, preference, flip,
                      log_probs, entropy, max_weight, substitution)


class _Steps:
    """``progress(done, total, what)`` before each step (``steps(what)``) and once at the end (``finish()``);
    nothing when ``progress`` is None."""

    def __init__(self, progress: Callable[[int, int, str], None] | None, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def __call__(self, what: str) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total, what)
        self.done += 1

    def finish(self) -> None:
        if self.progress is not None:
            self.progress(self.total, self.total, "done")


def _it_index(maps: SentenceMaps) -> int:
    """The row of " it" (the last token of the word "it" after "because")."""
    return word_span(maps.labels, "it", after=word_span(maps.labels, "because")[1])[1] - 1


def _period_index(maps: SentenceMaps) -> int:
    """The row of the last "." (an encoder may add [SEP] after it)."""
    dots = [i for i, x in enumerate(maps.labels) if _norm_label(x) == "."]
    if not dots:
        raise ValueError(f"the sentence must end with '.' as its own token, received labels {maps.labels}")
    return dots[-1]


def _resolution_scores(score: Callable[[str, str], float], sentences: dict[str, str],
                       say: Callable[[str], None]) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """``(log_probs, substitution)`` of :class:`Comparison`: each sentence's log p of each resolution after
    :data:`RESOLUTION_PROMPT`, and of the sentence with "it" replaced by each candidate."""
    log_probs: dict[str, dict[str, float]] = {}
    for k in ("big", "small"):
        log_probs[k] = {}
        for res, cont in RESOLUTIONS.items():
            say(f"log p({cont!r} | 'too {k}')")
            log_probs[k][res] = float(score(sentences[k] + RESOLUTION_PROMPT, cont))
    substitution: dict[str, dict[str, float]] = {}
    for k in ("big", "small"):
        prefix, rests = substitutions(sentences[k])
        substitution[k] = {}
        for res, rest in rests.items():
            say(f"log p('{prefix.split()[-1]}{rest}' | ...) ('too {k}', it -> the {res})")
            substitution[k][res] = float(score(prefix, rest))
    return log_probs, substitution


def _why_it_row(c: Comparison) -> str:
    if c.causal:
        return (
            f"Why: under the causal mask query {c.it_index} (' it') sees only keys 0..{c.it_index}, "
            f"and the sentences first differ at token {c.first_difference}, after ' it'. Every layer "
            f"computes the same numbers for the shared prefix, so the row is identical in every head: "
            f"when {c.model} reads ' it', it cannot know yet whether the thing was too big or too small. "
            f"This is the uncomfortable result. Any resolution must happen later, at the adjective or "
            f"the final '.', looking back."
        )
    return (
        f"{c.model} is bidirectional: ' it' (token {c.it_index}) also sees the adjective at token "
        f"{c.first_difference}, so its row may change between the sentences."
    )


def _verdict_lines(scores: dict[str, dict[str, float]], label: Callable[[str, str], str]) -> list[str]:
    """One verdict of :func:`render_part4`: per sentence, each candidate's log p (``label(sentence, candidate)``
    names it) and the one preferred; then whether both sentences are resolved the right way."""
    lines = []
    for k in ("big", "small"):
        lp = scores[k]
        pick = max(lp, key=lp.get)
        lines.append(f"  too {k:<5}: {label(k, 'trophy')} {lp['trophy']:8.3f}  {label(k, 'suitcase')} "
                     f"{lp['suitcase']:8.3f}  -> prefers 'the {pick}' (by {abs(lp['trophy'] - lp['suitcase']):.3f})")
    right = scores["big"]["trophy"] > scores["big"]["suitcase"] and scores["small"]["suitcase"] > scores["small"]["trophy"]
    lines.append(f"  both resolutions right: {'yes' if right else 'no'}")
    return lines


def render_part4(c: Comparison, *, top: int = 5) -> str:
    """Part 4 as text: the " it" row, the heads ranked by flip, the model's prediction, the entropy."""
    L, N = c.it_row_max_abs_diff.shape
    lines = [f"== Part 4: 'too big' vs 'too small' on {c.model} ({L} layers x {N} heads) =="]
    big = c.maps["big"]
    lines.append(f"tokens: {big.labels}")
    lines.append(f"first differing token: {c.first_difference} ({big.labels[c.first_difference]!r} vs "
                 f"{c.maps['small'].labels[c.first_difference]!r}); ' it' is token {c.it_index}")
    d = c.it_row_max_abs_diff
    lines.append("\n' it' row, max |A_big - A_small| per layer (max over heads):")
    cells = [f"L{layer}:{d[layer].max():.3g}" for layer in range(L)]
    lines.extend("  " + "  ".join(cells[i:i + 12]) for i in range(0, L, 12))
    identical = bool(np.all(d == 0.0))
    where = np.unravel_index(int(np.argmax(d)), d.shape)
    lines.append(f"  over all {L * N} heads: max = {d.max():.3g}"
                 + ("  -> bit-identical (exactly 0)" if identical else f" (layer {where[0]}, head {where[1]})"))
    lines.append("  " + _why_it_row(c))
    if not identical:  # the row changes: show every head, and how much ' it' looks at the adjective itself
        lines.append("  per head (rows: layers, columns: heads):")
        lines.append("  " + " " * 5 + "".join(f"{f'h{n}':>7}" for n in range(N)))
        lines.extend(f"  L{layer:<3} " + "".join(f"{v:7.4f}" for v in d[layer]) for layer in range(L))
        adj = c.first_difference
        if adj < min(len(big.ids), len(c.maps["small"].ids)):
            w = {k: m.attentions[:, :, c.it_index, adj] for k, m in c.maps.items()}  # [L, N] each
            lines.append(f"  weight of ' it' on the adjective (token {adj}), mean over heads: "
                         f"{big.labels[adj]!r} {w['big'].mean():.4f}, {c.maps['small'].labels[adj]!r} "
                         f"{w['small'].mean():.4f}; the largest single head: {max(w['big'].max(), w['small'].max()):.4f}")
    for row in (() if c.causal else ("it",)) + ("adjective", "period"):
        lines.append(f"\nrow of the {row} token: weight on ' trophy' minus on ' suitcase'; heads ranked by "
                     f"flip = pref(big) - pref(small) (positive = the right way round):")
        lines.append(f"  {'layer':>5} {'head':>4} {'big':>8} {'small':>8} {'flip':>8}")
        for r in c.ranking(row, top):
            lines.append(f"  {r['layer']:>5} {r['head']:>4} {r['big']:>8.4f} {r['small']:>8.4f} {r['flip']:>8.4f}")
        f = c.flip[row]
        sign = int(np.sum((c.preference[row]['big'] > 0) & (c.preference[row]['small'] < 0)))
        lines.append(f"  heads whose preference changes sign the right way: {sign} of {L * N}; "
                     f"mean flip {f.mean():+.4f}")
    if c.log_probs is not None:
        lines.append(f"\nwhere it looks (attention, above) beside what it concludes (prediction): {c.model}'s "
                     f"log p(continuation | sentence + {RESOLUTION_PROMPT!r}), nats")
        lines += _verdict_lines(c.log_probs, lambda k, res: res)
    if c.substitution is not None:
        lines.append("\nits verdict by substitution (Trinh & Le 2018): log p of the sentence with 'it' replaced by "
                     "each candidate, nats")
        lines += _verdict_lines(c.substitution, lambda k, res: f"'the {res} was too {k}'")
    else:
        lines.append(f"\nwhat it concludes (prediction): not reported. {c.model} has no scorer (no language-model "
                     f"head), so it gives no probability to 'the trophy' vs 'the suitcase'; only where it looks "
                     f"(attention, above) is measured.")
    e, m = c.entropy, c.max_weight
    T = len(big.labels)
    uniform = "" if c.causal else f" (uniform over all T={T} tokens: {np.log(T):.3f})"  # causal rows see fewer
    lines.append(f"\nentropy of the attention rows ('too big' sentence), mean per layer, nats: "
                 f"scale=1/sqrt(d_k) vs scale=1.0{uniform}")
    for layer in range(L):
        lines.append(f"  L{layer:<2} {e['scaled'][layer].mean():6.3f} -> {e['unscaled'][layer].mean():6.3f}   "
                     f"max weight {m['scaled'][layer].mean():.3f} -> {m['unscaled'][layer].mean():.3f}")
    lines.append(f"  all heads: {e['scaled'].mean():.3f} -> {e['unscaled'].mean():.3f} nats; heads whose entropy "
                 f"fell: {int(np.sum(e['unscaled'] < e['scaled']))} of {L * N}")
    return "\n".join(lines)


def render_contrast(causal: Comparison, encoder: Comparison) -> str:
    """The " it" row of a causal model beside a bidirectional one's: the same rows, side by side.

    Per layer: the largest change of the row between "too big" and "too small" (over heads and keys),
    and the mean over heads of the row's preference for " trophy" over " suitcase" in each sentence.
    """
    if not causal.causal or encoder.causal:
        raise ValueError("render_contrast takes a causal model's Comparison first and a bidirectional one's second")
    rows = []
    for c in (causal, encoder):
        d, p = c.it_row_max_abs_diff, c.preference.get("it") or {
            k: _preference(m, c.it_index) for k, m in c.maps.items()}
        rows.append([(float(d[layer].max()), float(p["big"][layer].mean()), float(p["small"][layer].mean()))
                     for layer in range(d.shape[0])])
    name_c, name_e = causal.model, encoder.model
    lines = [f"== The ' it' row, causal beside bidirectional: {name_c} | {name_e} ==",
             "  per layer: max |A_big - A_small| over heads and keys; mean over heads of the row's weight on "
             "' trophy' minus ' suitcase' in 'too big' / 'too small'",
             f"  {'layer':>5}  {'max|diff|':>10} {'pref big':>9} {'pref small':>10}  |  {'max|diff|':>10} "
             f"{'pref big':>9} {'pref small':>10}"]
    for layer in range(max(len(rows[0]), len(rows[1]))):
        cells = []
        for r in rows:
            cells.append(f"{r[layer][0]:>10.3g} {r[layer][1]:>9.4f} {r[layer][2]:>10.4f}" if layer < len(r) else " " * 31)
        lines.append(f"  {layer:>5}  {cells[0]}  |  {cells[1]}")
    dc, de = causal.it_row_max_abs_diff.max(), encoder.it_row_max_abs_diff.max()
    lines.append(f"  over all heads: {name_c} {dc:.3g}" + (" (bit-identical)" if dc == 0.0 else "")
                 + f"; {name_e} {de:.3g}: the causal ' it' cannot see the adjective, the bidirectional one can.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# The pair as pictures: the difference of every head, one head side by side, the interactive page.
# ----------------------------------------------------------------------------------------------------

PAIR_NAMES = ("too big", "too small")


def _same_shape(c: Comparison) -> tuple[SentenceMaps, SentenceMaps]:
    big, small = c.maps["big"], c.maps["small"]
    if big.attentions.shape != small.attentions.shape:
        raise ValueError(f"the two sentences' maps differ in shape, {list(big.attentions.shape)} and "
                         f"{list(small.attentions.shape)} (layers, heads, tokens, tokens): no difference map")
    return big, small


def png_difference(c: Comparison, *, dpi: int = 110) -> bytes:
    """Every layer x head of ``A_big - A_small`` as one PNG, blue-white-red about 0, with a colorbar.

    Labels read ``big/small`` where the sentences' tokens differ. Raises ``ValueError`` when the two
    sentences have different token counts (no cell-by-cell difference).
    """
    big, small = _same_shape(c)
    return viz.grid_png(big.attentions - small.attentions, viz.merged_labels(big.labels, small.labels),
                        title=f"{c.model}: 'too big' minus 'too small'", difference=True, dpi=dpi)


def png_pair(c: Comparison, layer: int, head: int, *, dpi: int = 110) -> bytes:
    """One head's map for both sentences and their difference, side by side, tokens on both axes."""
    big, small = _same_shape(c)
    L, N = big.attentions.shape[:2]
    if not (0 <= layer < L and 0 <= head < N):
        raise ValueError(f"layer/head must lie in [0, {L}) x [0, {N}), received ({layer}, {head})")
    return viz.pair_png(big.attentions[layer, head], small.attentions[layer, head], big.labels, small.labels,
                        names=PAIR_NAMES, title=f"{c.model}: layer {layer}, head {head}", dpi=dpi)


def html_page(c: Comparison) -> str:
    """The interactive page (:func:`jaxattn.viz.html`) for both sentences, with their difference view
    when they have the same number of tokens."""
    big, small = c.maps["big"], c.maps["small"]
    kind = "causal" if c.causal else "bidirectional"
    return viz.html(big.attentions, big.labels, other=small.attentions, other_tokens=small.labels, names=PAIR_NAMES,
                    title=f"{c.model} ({kind}): the trophy sentence, 'too big' vs 'too small'")


# ----------------------------------------------------------------------------------------------------
# A bundled model as a LabModel.
# ----------------------------------------------------------------------------------------------------


def lab_model(module: Any, params: Any, config: Any, tokenizer: Any, *, name: str) -> LabModel:
    """A model of jaxattn's model API (``jaxattn.gpt2``, ``jaxattn.bert``) as a :class:`LabModel`.

    The protocol's ``forward(params, config, ids, scale=...)`` gives the maps. A model with ``log_prob``
    (a causal language model) is causal and scores continuations; one without it (an encoder) is
    bidirectional and has no scorer: it assigns no probability to a continuation, and the lab reports
    none rather than a number from a head the model was never trained with. A causal model (the
    protocol's ``causal``) runs every sentence right-padded to a bucket length under its attention mask
    (:func:`jaxattn.models.pad_to_bucket`: the same numbers at the real positions, a handful of compiled
    programs for many sentence lengths). A continuation is scored after its prefix without the ids the
    tokenizer puts before any text (Gemma's ``<bos>``, which the prefix already starts with).

    Args:
      module: the model's module.
      params, config, tokenizer: from ``module.load()`` (or ``module.random_model()``).
      name: shown in reports.
    """
    declared = spec(module)  # the model protocol (jaxattn.models.ModelSpec)
    log_prob, forward = declared.log_prob, declared.forward
    pad = pad_to_bucket if declared.causal else None
    start = np.asarray(tokenizer.encode(""), np.int32) if declared.causal else None  # ids put before any text

    def tokenize(text: str) -> tuple[np.ndarray, list[str]]:
        ids = tokenizer.encode(text)
        return ids, tokenizer.labels(ids)

    def attentions(ids: np.ndarray, scale: Any) -> np.ndarray:
        T = len(ids)
        if pad is None:
            return np.asarray(forward(params, config, ids, scale=scale).attentions)  # [L, N, T, T]
        padded, mask = pad(ids)
        maps = forward(params, config, padded, attention_mask=mask, scale=scale).attentions
        return np.asarray(maps)[:, :, :T, :T]  # [L, N, T, T]

    def score(prefix: str, continuation: str) -> float:
        p, c = tokenizer.encode(prefix), tokenizer.encode(continuation)
        if len(start) and np.array_equal(c[: len(start)], start):  # the continuation's own <bos> (Gemma) goes
            c = c[len(start):]  # the prefix has one already; a second, mid-sequence, would be scored too
        ids = np.concatenate([p, c])
        if pad is None:
            return float(log_prob(params, config, ids, start=len(p)))
        padded, mask = pad(ids)
        return float(log_prob(params, config, padded, attention_mask=mask, start=len(p), end=len(ids)))

    causal = log_prob is not None
    return LabModel(name=name, causal=causal, tokenize=tokenize, attentions=attentions, score=score if causal else None)
