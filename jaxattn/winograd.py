"""Winograd schemas: the WSC273 data, and three scorers: language-model substitution, pronoun attention,
one selected head.

The bundled data (``jaxattn/data/wsc273.json``) is WSC273 as published: the first 273 problems of the
collection of Levesque, Davis & Morgenstern (2012; CC BY 4.0), in the collection's order, converted from
its ``WSCollection.xml`` by ``tools/convert_wsc273.py``. :func:`load_wsc273` returns them as
:class:`Problem` records (136 schemas: 135 of two sentences, one of three); :func:`to_schemas` makes each a
scorable :class:`Schema`; :func:`load_pairs` pairs the sentences of each schema whose answers differ
(136 pairs: the three-sentence schema gives one). The scorers:

- **substitution** (Trinh & Le 2018): replace the pronoun by each candidate and compare the language
  model's log-probability of the full sentence, or of the part after the candidate ("partial");
- **maximum attention** (Klein & Nabi 2019): every head votes for the candidate its pronoun row
  attends to more, with the weight of that attention; the candidate with more votes wins;
- **the single best head**: the head whose pronoun row picks the right candidate most often on one half
  of the pairs, evaluated on the other half.

Functions return data; models enter as functions (a scorer of continuations, a function from a text to
its attention maps), so the same code serves GPT-2, Llama and BERT: :func:`lm_scorer` and
:func:`model_maps` make them from a bundled model; :func:`evaluate` and :func:`evaluate_sentences` run
every scorer a model allows. :func:`accuracy` reports a score with Wilson's interval
(:func:`jaxattn.interventions.wilson_interval`).

Every name of ``__all__`` is also an attribute of :mod:`jaxattn.interventions`, the same object
(``interventions.load_wsc273`` is ``winograd.load_wsc273``). Needs the ``[models]`` extra.

Axis alphabet: S sentences, L layers, N heads, T tokens; C = 2 candidates.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Sequence

from jaxattn._extras import require

require("models", "jaxattn.winograd", "safetensors", "tokenizers", "huggingface_hub")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxattn.interventions._metrics import span_log_prob  # noqa: E402
from jaxattn.interventions._stats import wilson_interval  # noqa: E402
from jaxattn.interventions._text import char_span_to_tokens, encode_with_offsets, find_span  # noqa: E402
from jaxattn.models import spec  # noqa: E402

__all__ = [
    "Problem",
    "Schema",
    "accuracy",
    "best_head",
    "evaluate",
    "evaluate_sentences",
    "flatten_pairs",
    "head_predictions",
    "lm_scorer",
    "load_metadata",
    "load_pairs",
    "load_wsc273",
    "max_attention_predictions",
    "model_maps",
    "parse_pairs",
    "parse_wsc273",
    "pronoun_attention",
    "special_after_pronoun",
    "split_pairs",
    "substitution_scores",
    "to_schemas",
    "wsc273_pairs",
]

DATA_FILE = "wsc273.json"  # written by tools/convert_wsc273.py from the collection's WSCollection.xml


@dataclasses.dataclass(frozen=True)
class Schema:
    """One Winograd sentence.

    Attributes:
      pair: the index of its pair (the two sentences of a pair share it); from :func:`to_schemas`, the
        index of its schema (the sentences of a schema share it).
      text: the sentence.
      pronoun: ``(start, end)`` characters of the pronoun.
      candidates: two ``(start, end)`` character spans, each candidate's mention before the pronoun (or,
        from :func:`to_schemas`, after it where the sentence names the candidates there).
      substitutions: the sentence with the pronoun replaced by candidate 0, and by candidate 1.
      substitute_ends: where each substitute ends in its substitution (characters): "partial"
        scoring scores what follows.
      answer: 0 or 1, the candidate the pronoun refers to.
    """

    pair: int
    text: str
    pronoun: tuple[int, int]
    candidates: tuple[tuple[int, int], tuple[int, int]]
    substitutions: tuple[str, str]
    substitute_ends: tuple[int, int]
    answer: int

    def span_text(self, span: tuple[int, int]) -> str:
        return self.text[span[0]:span[1]]


def _phrase(value: Any, where: str, field: str) -> str:
    """A non-empty string field (a candidate's phrase, a substitute)."""
    if not isinstance(value, str):
        raise ValueError(f"{where}: {field} must be a string, received {type(value).__name__} {value!r}")
    if not value.strip():
        raise ValueError(f"{where}: {field} must be a non-empty phrase, received {value!r}")
    return value


def _mention(m: Any, where: str, field: str) -> tuple[str, int]:
    """``(phrase, k)`` from a candidate: a phrase, or ``[phrase, k]`` for its k-th whole-word occurrence."""
    if isinstance(m, str):
        return _phrase(m, where, field), 0
    if not isinstance(m, (list, tuple)) or len(m) != 2:
        raise ValueError(f"{where}: {field} must be a phrase or [phrase, occurrence], received {m!r}")
    phrase, k = _phrase(m[0], where, f"{field}[0]"), m[1]
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"{where}: {field}[1] (the occurrence) must be an int >= 0, received {k!r}")
    return phrase, k


def _schema(pair: int, raw: str, mentions: Sequence[tuple[str, int]], subs: Sequence[str], answer: int,
            where: str, field: str, *, anywhere: bool = False, mention_field: str = "'candidates'") -> Schema:
    """A :class:`Schema` from a marked text; ``anywhere``: mention k is the k-th whole-word occurrence counted
    from the start of the text (before or after the pronoun), else the k-th before the pronoun."""
    if raw.count("[") != 1 or raw.count("]") != 1 or raw.index("[") > raw.index("]"):
        raise ValueError(f"{where}: the text must mark the pronoun with one [bracket] pair, received {field} = {raw!r}")
    start = raw.index("[")
    end = raw.index("]") - 1
    text = raw.replace("[", "", 1).replace("]", "", 1)
    if not text[start:end].strip():
        raise ValueError(f"{where}: the text must have a pronoun inside its [brackets], received {field} = {raw!r}")
    spans = []
    for j, (phrase, k) in enumerate(mentions):
        try:
            spans.append(find_span(text, phrase, occurrence=k, before=None if anywhere else start))
        except ValueError:
            place = "in" if anywhere else "before the pronoun of"
            raise ValueError(f"{where}: {mention_field}[{j}] {phrase!r} (occurrence {k}) must occur as a whole word "
                             f"{place} {field}, received the text {text!r}") from None
        if anywhere and spans[-1][0] < end and start < spans[-1][1]:
            raise ValueError(f"{where}: {mention_field}[{j}] {phrase!r} (occurrence {k}) is the pronoun of {field}, "
                             f"received the text {text!r}")
    if spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]:
        raise ValueError(f"{where}: the candidates' mentions overlap in {field}: {[m for m, _ in mentions]!r}")
    substitutions, ends = [], []
    for s in subs:
        if text[start].isupper():
            s = s[:1].upper() + s[1:]
        substitutions.append(text[:start] + s + text[end:])
        ends.append(start + len(s))
    return Schema(pair, text, (start, end), (spans[0], spans[1]), (substitutions[0], substitutions[1]),
                  (ends[0], ends[1]), answer)


def parse_pairs(data: Any) -> list[tuple[Schema, Schema]]:
    """The pairs of a data dict (the bundled file's layout: ``{"pairs": [{texts, candidates, substitutes, answers}]}``).

    Each pair is a dict of four lists of two entries: ``texts`` (strings, the pronoun marked once with
    non-empty ``[brackets]``), ``candidates`` (non-empty phrases, or ``[phrase, k]`` with an int ``k >= 0``
    for the k-th whole-word occurrence, each found before the pronoun in both texts), ``substitutes``
    (non-empty strings) and ``answers`` (the ints 0 and 1, one each).

    Raises:
      ValueError: naming the pair (its index) and the field that is malformed, e.g.
        ``pair 3: 'candidates'[1] ...``.
    """
    if not isinstance(data, dict) or not isinstance(data.get("pairs"), list):
        raise ValueError("data must be a dict with a list under 'pairs'")
    out = []
    for i, p in enumerate(data["pairs"]):
        where = f"pair {i}"
        if not isinstance(p, dict):
            raise ValueError(f"{where} must be a dict with 'texts', 'candidates', 'substitutes' and 'answers', "
                             f"received {type(p).__name__}")
        for key in ("texts", "candidates", "substitutes", "answers"):
            if not isinstance(p.get(key), list) or len(p[key]) != 2:
                raise ValueError(f"{where}: '{key}' must be a list of two entries, received {p.get(key)!r}")
        for j, t in enumerate(p["texts"]):
            if not isinstance(t, str):
                raise ValueError(f"{where}: 'texts'[{j}] must be a string, received {type(t).__name__} {t!r}")
        mentions = [_mention(m, where, f"'candidates'[{j}]") for j, m in enumerate(p["candidates"])]
        subs = [_phrase(x, where, f"'substitutes'[{j}]") for j, x in enumerate(p["substitutes"])]
        answers = p["answers"]
        if any(isinstance(a, bool) or not isinstance(a, int) for a in answers):
            raise ValueError(f"{where}: 'answers' must be ints (0 or 1), received {answers!r}")
        if sorted(answers) != [0, 1]:
            raise ValueError(f"{where}: the two sentences must have different answers (0 and 1), received {answers}")
        out.append(tuple(_schema(i, t, mentions, subs, a, where, f"'texts'[{j}]")
                         for j, (t, a) in enumerate(zip(p["texts"], answers))))
    return out


def _read_data(path: str | Path | None) -> Any:
    """The JSON of a data file (``None``: the bundled one); ``ValueError`` naming the file when it is not
    UTF-8 JSON (or nests too deeply for Python to read)."""
    source = resources.files("jaxattn").joinpath("data", DATA_FILE) if path is None else Path(path)
    try:
        return json.loads(source.read_text(encoding="utf-8"))
    except RecursionError:
        raise ValueError(f"{source}: not a Winograd data file: its JSON nests too deeply to read") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        hint = "" if path is not None else ": reinstall jaxattn, or rewrite it with tools/convert_wsc273.py"
        raise ValueError(f"{source}: not a Winograd data file: not UTF-8 JSON ({e}){hint}") from None


@dataclasses.dataclass(frozen=True)
class Problem:
    """One WSC273 problem, as the collection gives it, with what scoring it needs.

    Attributes:
      index: its position in the collection (0-272).
      schema: the index of its schema (0-135), shared by the schema's sentences: 135 schemas of two
        sentences and one of three (problems 252-254). In two schemas (problems 172-173, a minnow or a shark
        below a duck; 265-266, a butterfly wing or a heavy book on a table) a candidate changes between
        the sentences.
      text: the sentence with the pronoun marked once with ``[brackets]``, e.g.
        ``"The trophy doesn't fit into the brown suitcase because [it] is too large."``.
      pronoun: the pronoun as written (``"it"``, ``"He"``, ``"his"``).
      candidates: the collection's two answers, as it words them (``"the suitcase"`` for "the brown
        suitcase", ``"The son"`` for "his son").
      answer: 0 or 1, the index of the correct candidate.
      source: the collection's credit for the problem (its author, or where it is adapted from).
      mentions: each candidate's words in the sentence, ``(phrase, k)``: the k-th whole-word occurrence
        of ``phrase`` in the text without brackets (before the pronoun, except in problems 232-233, which
        name the candidates after it).
      substitutes: what replaces the pronoun for each candidate in the substitution form (Trinh & Le
        2018): lowercase, capitalised by :func:`to_schemas` where the pronoun starts a sentence.
    """

    index: int
    schema: int
    text: str
    pronoun: str
    candidates: tuple[str, str]
    answer: int
    source: str
    mentions: tuple[tuple[str, int], tuple[str, int]]
    substitutes: tuple[str, str]

    def to_schema(self) -> Schema:
        """The problem as a scorable :class:`Schema` (``pair``: the index of its schema)."""
        return _schema(self.schema, self.text, self.mentions, self.substitutes, self.answer,
                       f"problem {self.index}", "'text'", anywhere=True, mention_field="'mentions'")


def parse_wsc273(data: Any) -> list[Problem]:
    """The problems of a data dict in the WSC273 layout (``{"problems": [...]}``, what
    ``tools/convert_wsc273.py`` writes; see :class:`Problem` for the fields).

    Raises:
      ValueError: naming the problem (its index) and the field that is malformed.
    """
    if not isinstance(data, dict) or not isinstance(data.get("problems"), list):
        raise ValueError("data must be a dict with a list under 'problems'")
    out: list[Problem] = []
    for i, p in enumerate(data["problems"]):
        where = f"problem {i}"
        if not isinstance(p, dict):
            raise ValueError(f"{where} must be a dict, received {type(p).__name__}")
        for key in ("index", "schema", "answer"):
            v = p.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{where}: '{key}' must be an int >= 0, received {v!r}")
        if p["index"] != i:
            raise ValueError(f"{where}: 'index' must be its position in the list, {i}, received {p['index']}")
        if p["answer"] not in (0, 1):
            raise ValueError(f"{where}: 'answer' must be 0 or 1, received {p['answer']!r}")
        previous = out[-1].schema if out else -1
        if p["schema"] not in (previous, previous + 1):
            raise ValueError(f"{where}: 'schema' must be the previous problem's ({previous}) or the next one, "
                             f"received {p['schema']}")
        for key in ("text", "pronoun", "source"):
            if not isinstance(p.get(key), str):
                raise ValueError(f"{where}: '{key}' must be a string, received {p.get(key)!r}")
        for key in ("candidates", "mentions", "substitutes"):
            if not isinstance(p.get(key), list) or len(p[key]) != 2:
                raise ValueError(f"{where}: '{key}' must be a list of two entries, received {p.get(key)!r}")
        candidates = tuple(_phrase(c, where, f"'candidates'[{j}]") for j, c in enumerate(p["candidates"]))
        mentions = tuple(_mention(m, where, f"'mentions'[{j}]") for j, m in enumerate(p["mentions"]))
        subs = tuple(_phrase(x, where, f"'substitutes'[{j}]") for j, x in enumerate(p["substitutes"]))
        problem = Problem(i, p["schema"], p["text"], p["pronoun"], candidates, p["answer"], p["source"],
                          mentions, subs)  # type: ignore[arg-type]
        schema = problem.to_schema()  # checks the marking and the mentions
        if schema.span_text(schema.pronoun) != problem.pronoun:
            raise ValueError(f"{where}: 'pronoun' must be the marked word {schema.span_text(schema.pronoun)!r}, "
                             f"received {problem.pronoun!r}")
        out.append(problem)
    return out


def load_wsc273(path: str | Path | None = None) -> list[Problem]:
    """All 273 WSC273 problems in the collection's order (``None``: the bundled ``jaxattn/data/wsc273.json``;
    else a JSON file in its layout, e.g. one ``tools/convert_wsc273.py`` wrote). The bundled file must hold
    all 273 problems in 136 schemas, each schema with both answers (``ValueError`` naming it otherwise)."""
    problems = parse_wsc273(_read_data(path))
    if path is None:
        answers: dict[int, set[int]] = {}
        for p in problems:
            answers.setdefault(p.schema, set()).add(p.answer)
        if len(problems) != 273 or len(answers) != 136 or any(a != {0, 1} for a in answers.values()):
            raise ValueError(f"the bundled {DATA_FILE} holds {len(problems)} problems in {len(answers)} schemas, not "
                             "WSC273's 273 in 136 (each with both answers): reinstall jaxattn, or rewrite it with "
                             "tools/convert_wsc273.py")
    return problems


def to_schemas(problems: Sequence[Problem]) -> list[Schema]:
    """Each problem as a scorable :class:`Schema`, ``pair`` being its schema's index (for
    :func:`evaluate_sentences`)."""
    return [p.to_schema() for p in problems]


def wsc273_pairs(problems: Sequence[Problem]) -> list[tuple[Schema, Schema]]:
    """Pairs of sentences of one schema with different answers, in the collection's order.

    Each sentence is in at most one pair: a schema's first sentence is paired with its next sentence of the
    other answer. WSC273 gives 136 pairs (272 sentences): every two-sentence schema one, and the
    three-sentence schema (answers 0, 1, 0) one, of its first two sentences; its third is left out. The
    ``pair`` of each :class:`Schema` is the index of its pair.
    """
    groups: dict[int, list[Problem]] = {}
    for p in problems:
        groups.setdefault(p.schema, []).append(p)
    out: list[tuple[Schema, Schema]] = []
    for members in groups.values():
        left = list(members)
        while left:
            first = left.pop(0)
            other = next((q for q in left if q.answer != first.answer), None)
            if other is None:
                continue
            left.remove(other)
            a, b = (dataclasses.replace(q.to_schema(), pair=len(out)) for q in (first, other))
            out.append((a, b))
    return out


def load_pairs(path: str | Path | None = None) -> list[tuple[Schema, Schema]]:
    """Winograd pairs: ``None``, the pairs of the bundled WSC273 (:func:`wsc273_pairs`, 136 pairs); else a
    JSON file in the WSC273 layout (paired the same way) or in :func:`parse_pairs`'s layout."""
    data = _read_data(path)
    if isinstance(data, dict) and "problems" in data:
        return wsc273_pairs(parse_wsc273(data))
    return parse_pairs(data)


def load_metadata(path: str | Path | None = None) -> dict[str, str]:
    """The data file's ``name``, ``source``, ``license`` and ``note`` (its citation)."""
    data = _read_data(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a Winograd data file: expected a JSON object, found {type(data).__name__}")
    return {k: data.get(k, "") for k in ("name", "source", "license", "note")}


def flatten_pairs(pairs: Sequence[tuple[Schema, Schema]]) -> list[Schema]:
    """The sentences of the pairs, in order (two per pair)."""
    return [s for pair in pairs for s in pair]


# ----------------------------------------------------------------------------------------------------
# Scorer 1: substitution (Trinh & Le 2018).
# ----------------------------------------------------------------------------------------------------

Scorer = Callable[[str, str], float]  # (context, continuation) -> log p(continuation | context), nats


def substitution_scores(schemas: Sequence[Schema], score: Scorer) -> dict[str, np.ndarray]:
    """Each candidate's substitution score: ``{"full": [S, 2], "partial": [S, 2]}`` (nats).

    ``full`` is ``score("", substitution)``: the log-probability of the whole sentence with the candidate
    in place of the pronoun (a model without a start token cannot score the first token, which the two
    candidates share). ``partial`` is ``score(up to and with the candidate, the rest)``: the
    log-probability of the words after the candidate, given it (Trinh & Le's partial scoring).

    Raises:
      TypeError: ``score`` returned something that is not one real number.
      ValueError: ``score`` returned NaN; both name the sentence (its index and pair) and the candidate.
        Infinities are kept (``-inf``: probability 0); the larger score wins, ties go to candidate 0.
    """
    full = np.zeros((len(schemas), 2))
    partial = np.zeros((len(schemas), 2))
    for i, s in enumerate(schemas):
        for c in range(2):
            text, cut = s.substitutions[c], s.substitute_ends[c]
            where = f"sentence {i} (pair {s.pair}), candidate {c}"
            full[i, c] = _score_value(score("", text), f"{where}, full substitution {text!r}")
            partial[i, c] = _score_value(score(text[:cut], text[cut:]), f"{where}, partial substitution {text!r}")
    return {"full": full, "partial": partial}


def _score_value(value: Any, where: str) -> float:
    """A scorer's result as a float: one real number, not NaN."""
    arr = None if isinstance(value, (str, bytes)) else np.asarray(value)
    if arr is None or arr.shape != () or arr.dtype == np.bool_ or not (
        jnp.issubdtype(arr.dtype, jnp.floating) or jnp.issubdtype(arr.dtype, jnp.integer)
    ):
        raise TypeError(f"score must return one real number (log p in nats), received {type(value).__name__} "
                        f"{value!r} for {where}")
    x = float(arr)
    if np.isnan(x):
        raise ValueError(f"score must return a number, received NaN for {where}")
    return x


# ----------------------------------------------------------------------------------------------------
# Scorers 2 and 3: the pronoun's attention to the candidates.
# ----------------------------------------------------------------------------------------------------

MapsFn = Callable[[str], tuple[Any, Any]]  # text -> (attentions [L, N, T, T], offsets [T, 2])


def pronoun_attention(schemas: Sequence[Schema], maps: MapsFn) -> np.ndarray:
    """``[S, L, N, 2]``: the weight the pronoun's (first) token puts on each candidate's tokens (summed).

    Args:
      schemas: the sentences.
      maps: ``text -> (attentions [L, N, T, T], offsets [T, 2])``, e.g. :func:`model_maps`.

    Raises:
      ValueError: a candidate's weight is not finite (NaN from the model): naming the sentence, its pair,
        the layer, the head and the candidate (a NaN would otherwise lose every comparison, a vote for
        candidate 0).
    """
    out = []
    for i, s in enumerate(schemas):
        att, offsets = maps(s.text)
        att = np.asarray(att, np.float64)
        p = char_span_to_tokens(offsets, *s.pronoun)[0]
        row = att[:, :, p, :]  # [L, N, T]
        cols = []
        for span in s.candidates:
            a, b = char_span_to_tokens(offsets, *span)
            cols.append(row[:, :, a:b].sum(-1))  # [L, N]
        out.append(np.stack(cols, -1))  # [L, N, 2]
        bad = np.argwhere(~np.isfinite(out[-1]))  # a NaN weight must not vote (it would tie: candidate 0)
        if bad.size:
            l, n, c = bad[0]
            raise ValueError(f"maps must return finite attention weights, received {out[-1][l, n, c]} for sentence "
                             f"{i} (pair {s.pair}), layer {l}, head {n}, candidate {c}")
    return np.stack(out)


def max_attention_predictions(attention: Any) -> np.ndarray:
    """``[S]``: Klein & Nabi's maximum attention score (MAS) choice from ``attention [S, L, N, 2]``.

    Each head keeps the attention of the candidate it attends to more and gives the other 0; the
    candidate with the larger sum over heads wins (ties: candidate 0).
    """
    a = np.asarray(attention, np.float64)
    if a.ndim != 4 or a.shape[-1] != 2:
        raise ValueError(f"attention must have shape [S, L, N, 2], received {a.shape}")
    winner = a == a.max(-1, keepdims=True)  # [S, L, N, 2]
    mas = np.where(winner, a, 0.0).sum((1, 2))  # [S, 2]
    return np.argmax(mas, axis=-1)


def head_predictions(attention: Any) -> np.ndarray:
    """``[S, L, N]``: the candidate each head's pronoun row attends to more (ties: candidate 0)."""
    a = np.asarray(attention, np.float64)
    return (a[..., 1] > a[..., 0]).astype(np.int64)


def split_pairs(n_pairs: int, *, seed: int = 0) -> np.ndarray:
    """``[n_pairs]`` bool: a seeded random half of the pairs (True), the rest False."""
    order = np.random.default_rng(seed).permutation(n_pairs)
    half = np.zeros(n_pairs, bool)
    half[order[: n_pairs // 2]] = True
    return half


def best_head(attention: Any, answers: Any, pair_ids: Any, *, seed: int = 0) -> list[dict[str, Any]]:
    """The single best head, selected on one half of the pairs and scored on the other, both ways round.

    Pairs, not sentences, are split (a seeded permutation of the pairs present, in the order of their
    ids), so a pair's two sentences are on one side; any subset of pairs splits into halves of
    ``n // 2`` and ``n - n // 2`` pairs.

    Returns:
      two dicts (select on half A, evaluate on half B; then the reverse): ``head (l, n)``,
      ``select_accuracy``, ``correct`` and ``total`` on the evaluation half.
    """
    pred = head_predictions(attention)  # [S, L, N]
    answers = np.asarray(answers)
    pair_ids = np.asarray(pair_ids)
    if pred.shape[0] != answers.shape[0] or answers.shape != pair_ids.shape:
        raise ValueError(f"attention [S, ...], answers [S] and pair_ids [S] must agree, received "
                         f"{pred.shape[0]}, {answers.shape}, {pair_ids.shape}")
    if pair_ids.size == 0 or not np.issubdtype(pair_ids.dtype, np.integer) or pair_ids.min() < 0:
        raise ValueError(f"pair_ids must be ints >= 0, one per sentence, received {pair_ids!r}")
    present = np.unique(pair_ids)  # the pairs there are, sorted
    half = split_pairs(present.size, seed=seed)[np.searchsorted(present, pair_ids)]  # [S]
    if half.all() or not half.any():
        raise ValueError(f"pair_ids must name at least 2 pairs with sentences on both halves of the split (one "
                         f"to select the head on, one to score it), received pairs {sorted(set(pair_ids.tolist()))}")
    right = pred == answers[:, None, None]  # [S, L, N]
    folds = []
    for select in (half, ~half):
        acc = right[select].mean(0)  # [L, N]
        l, n = np.unravel_index(int(np.argmax(acc)), acc.shape)
        evaluate = ~select
        folds.append({"head": (int(l), int(n)), "select_accuracy": float(acc[l, n]),
                      "correct": int(right[evaluate, l, n].sum()), "total": int(evaluate.sum())})
    return folds


def accuracy(correct: Any) -> dict[str, float]:
    """``{"accuracy", "correct", "total", "low", "high"}`` with Wilson's 95% interval."""
    c = np.asarray(correct, bool).ravel()
    k, n = int(c.sum()), int(c.size)
    low, high = wilson_interval(k, n)
    return {"accuracy": k / n, "correct": k, "total": n, "low": low, "high": high}


# ----------------------------------------------------------------------------------------------------
# A model's maps and scores, for the functions above.
# ----------------------------------------------------------------------------------------------------


def _bucket(n: int) -> int:
    return max(16, -(-n // 16) * 16)


@functools.lru_cache(maxsize=None)
def _compiled(module: Any, config: Any) -> Callable[..., Any]:
    """One jitted forward per model: ``(params, ids, mask) -> output`` (the scorer and the maps share it)."""
    forward = spec(module).forward
    return jax.jit(lambda params, ids, mask: forward(params, config, ids, attention_mask=mask))


def _padded(ids: np.ndarray, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    T = _bucket(len(ids))
    out = np.full(T, pad_id, np.int32)
    out[: len(ids)] = ids
    return out, np.arange(T) < len(ids)


def model_maps(module: Any, params: Any, config: Any, tokenizer: Any) -> MapsFn:
    """``text -> (attentions [L, N, T, T], offsets [T, 2])`` for a bundled model (right-padded to a
    multiple of 16 tokens under the mask, so a few lengths compile; the real rows and keys are returned)."""
    run = _compiled(module, config)

    def maps(text: str) -> tuple[np.ndarray, np.ndarray]:
        ids, offsets = encode_with_offsets(tokenizer, text)
        padded, mask = _padded(ids)
        att = np.asarray(run(params, jnp.asarray(padded), jnp.asarray(mask)).attentions)
        T = len(ids)
        return att[:, :, :T, :T], offsets

    return maps


def lm_scorer(module: Any, params: Any, config: Any, tokenizer: Any) -> Scorer:
    """``(context, continuation) -> log p(continuation | context)`` in nats, for a causal bundled model.

    The two are encoded as one text; the continuation is the tokens that start at or after
    ``len(context)`` (a token straddling the boundary raises). With an empty context every token but the
    first is scored (the first has no prediction unless the tokenizer adds a start token).
    """
    run = _compiled(module, config)

    def score(context: str, continuation: str) -> float:
        ids, offsets = encode_with_offsets(tokenizer, context + continuation)
        real = offsets[:, 1] > offsets[:, 0]
        after = np.flatnonzero(real & (offsets[:, 1] > len(context)))
        if after.size == 0:
            raise ValueError(f"the continuation {continuation!r} has no token")
        first = int(after[0])
        if offsets[first, 0] < len(context):
            raise ValueError(f"a token straddles the end of the context {context!r} and the continuation {continuation!r}")
        padded, mask = _padded(ids)
        logits = run(params, jnp.asarray(padded), jnp.asarray(mask)).logits
        return float(span_log_prob(logits, padded, max(first, 1), int(after[-1]) + 1))

    return score


def special_after_pronoun(pair: tuple[Schema, Schema]) -> bool:
    """Whether the two sentences of a pair first differ after the pronoun: then a causal model's pronoun
    row sees the same tokens in both, so pronoun-row attention cannot tell them apart."""
    a, b = pair[0].text, pair[1].text
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return first >= pair[0].pronoun[1]


def _check_sequence(x: Any, name: str, of: str, least: str) -> None:
    """``x`` a non-empty sequence (not a str, bytes or dict): ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(x, (str, bytes, dict)) or not isinstance(x, Sequence):
        raise TypeError(f"{name} must be a sequence of {of}, received {type(x).__name__}")
    if len(x) == 0:
        raise ValueError(f"{name} must hold at least {least}, received none")


def evaluate(pairs: Sequence[tuple[Schema, Schema]], *, score: Scorer | None = None, maps: MapsFn | None = None,
             seed: int = 0) -> dict[str, Any]:
    """Every scorer the model allows on the pairs: ``{method: accuracy dict}`` plus the details.

    Args:
      pairs: from :func:`load_pairs`.
      score: a continuation scorer (:func:`lm_scorer`), for substitution; ``None`` (an encoder) skips it.
      maps: ``text -> (attentions, offsets)`` (:func:`model_maps`), for the attention scorers.
      seed: the split of the pairs for the single best head.

    Returns:
      ``{"substitution_full", "substitution_partial", "max_attention", "best_head"}`` (those computed),
      each an :func:`accuracy` dict (``best_head`` pools its two folds, each scored on pairs it was not
      selected on, and keeps the folds under ``"folds"``); ``"sentences"`` and ``"pairs"``; and
      ``"special_after_pronoun"``, the pairs whose sentences first differ after the pronoun.

    Raises:
      ValueError: ``pairs`` is empty (or holds a single pair when ``maps`` is given: the best head needs
        one pair to select it on and another to score it), or ``score`` returns NaN (naming the sentence,
        its pair and the candidate; see :func:`substitution_scores`), or ``maps`` gives a pronoun row
        whose weight on a candidate is not finite (:func:`pronoun_attention`).
      TypeError: an entry of ``pairs`` is not two :class:`Schema`, or ``score`` returns something that is
        not a real number.
    """
    _check_sequence(pairs, "pairs", "(Schema, Schema) from load_pairs", "one pair (from load_pairs or parse_pairs)")
    for i, p in enumerate(pairs):
        if not isinstance(p, (tuple, list)) or len(p) != 2 or not all(isinstance(x, Schema) for x in p):
            raise TypeError(f"pairs[{i}] must be two Schema (a pair from load_pairs), received {p!r}")
    if maps is not None and len(pairs) < 2:
        raise ValueError(f"pairs must hold at least 2 pairs when maps is given (the best head is selected on "
                         f"one half of the pairs and scored on the other), received {len(pairs)}")
    result = evaluate_sentences(flatten_pairs(pairs), score=score, maps=maps, seed=seed)  # groups: the pairs
    return {"pairs": result.pop("groups"), **result}


def evaluate_sentences(schemas: Sequence[Schema], *, score: Scorer | None = None, maps: MapsFn | None = None,
                       seed: int = 0) -> dict[str, Any]:
    """Every scorer the model allows on sentences grouped by ``Schema.pair``, e.g. all of WSC273:
    ``evaluate_sentences(to_schemas(load_wsc273()), ...)`` (groups: the schemas).

    As :func:`evaluate`, with the best head's halves made of groups (a schema's sentences are on one
    side); ``"groups"`` counts them, and ``"special_after_pronoun"`` counts the groups of two or more
    sentences that are the same up to and with the pronoun (a causal model's pronoun row is then the same
    in all of them, so its attention picks the same candidate for each).

    Raises:
      TypeError: ``schemas`` is not a sequence of :class:`Schema`, or ``score`` returns something that is
        not a real number.
      ValueError: ``schemas`` is empty (or all in one group when ``maps`` is given), ``score`` returns NaN,
        or ``maps`` gives a non-finite weight on a candidate.
    """
    _check_sequence(schemas, "schemas", "Schema (e.g. to_schemas(load_wsc273()))", "one sentence")
    for i, x in enumerate(schemas):
        if not isinstance(x, Schema):
            raise TypeError(f"schemas[{i}] must be a Schema (e.g. from to_schemas), received {x!r}")
    groups: dict[int, list[Schema]] = {}
    for x in schemas:
        groups.setdefault(x.pair, []).append(x)
    if maps is not None and len(groups) < 2:
        raise ValueError(f"schemas must hold at least 2 groups (Schema.pair) when maps is given (the best head is "
                         f"selected on one half of the groups and scored on the other), received {len(groups)}")
    same = sum(len(g) > 1 and all(special_after_pronoun((g[0], x)) for x in g[1:]) for g in groups.values())
    out: dict[str, Any] = {"sentences": len(schemas), "groups": len(groups), "special_after_pronoun": int(same)}
    return {**out, **_scored(schemas, score, maps, seed)}


def _scored(schemas: Sequence[Schema], score: Scorer | None, maps: MapsFn | None, seed: int) -> dict[str, Any]:
    """The scorers' accuracies on the sentences (the best head split by ``Schema.pair``)."""
    answers = np.array([s.answer for s in schemas])
    out: dict[str, Any] = {}
    if score is not None:
        scores = substitution_scores(schemas, score)
        for mode in ("full", "partial"):
            out[f"substitution_{mode}"] = accuracy(scores[mode].argmax(1) == answers)
        out["scores"] = {k: v.tolist() for k, v in scores.items()}
    if maps is not None:
        attention = pronoun_attention(schemas, maps)
        out["max_attention"] = accuracy(max_attention_predictions(attention) == answers)
        folds = best_head(attention, answers, [s.pair for s in schemas], seed=seed)
        correct = sum(f["correct"] for f in folds)
        total = sum(f["total"] for f in folds)
        out["best_head"] = {**accuracy(np.arange(total) < correct), "folds": folds}
        per_head = (head_predictions(attention) == answers[:, None, None]).mean(0)  # [L, N]
        out["head_accuracy"] = per_head.tolist()
    return out
