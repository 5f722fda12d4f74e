"""From characters to tokens: which tokens spell a span of a text, and two-choice inputs for a metric.

The bundled tokenizers (``jaxattn.checkpoint.TextTokenizer``) wrap a ``tokenizers.Tokenizer``, whose
encodings carry each token's character offsets; a span of characters is the tokens that overlap it.
A tokenizer without offsets (only ``encode``/``decode``) gets them from decoding growing prefixes of its
ids, which is exact for byte-level BPE.

Axis alphabet: C choices, T tokens.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np

from jaxattn._spm import SpmTokenizer


def _backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` (or ``tokenizer`` itself when it is one), else None;
    a SentencePiece BPE tokenizer (:class:`jaxattn._spm.SpmTokenizer`, Gemma's) has none."""
    if isinstance(tokenizer, SpmTokenizer):
        return None
    backend = getattr(tokenizer, "backend", tokenizer)
    return backend if hasattr(backend, "encode") and hasattr(backend, "token_to_id") else None


def encode_with_offsets(tokenizer: Any, text: str) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [T] int32, offsets [T, 2])``: each token's ``[start, end)`` in ``text``.

    Special tokens added by the tokenizer (``[CLS]``, ``[SEP]``, a BOS) have an empty span.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, received {type(text).__name__}")
    backend = _backend(tokenizer)
    if backend is not None:
        special = getattr(tokenizer, "add_special_tokens", True)
        enc = backend.encode(text, add_special_tokens=special)
        offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
        mask = np.asarray(enc.special_tokens_mask, bool) if len(enc.ids) else np.zeros(0, bool)
        offsets[mask] = offsets[mask, :1]  # an empty span where the tokenizer added the token
        return np.asarray(enc.ids, np.int32), offsets
    if not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
        raise TypeError(f"tokenizer must have encode and decode (or a tokenizers backend), received {type(tokenizer).__name__}")
    ids = np.asarray(tokenizer.encode(text), np.int32)
    decode = tokenizer.decode
    if isinstance(tokenizer, SpmTokenizer):  # its <bos> spells no character of the text
        decode = functools.partial(decode, special=False)
    ends = [len(decode(ids[: i + 1])) for i in range(len(ids))]  # decoded prefix lengths
    starts = [0] + ends[:-1]
    return ids, np.stack([starts, ends], axis=1).astype(np.int64) if len(ids) else np.zeros((0, 2), np.int64)


def char_span_to_tokens(offsets: Any, start: int, end: int) -> tuple[int, int]:
    """``(first, stop)``: the tokens whose character span overlaps ``[start, end)`` (empty spans never do).

    Raises:
      ValueError: naming the span when no token overlaps it.
    """
    off = np.asarray(offsets)
    if off.ndim != 2 or off.shape[1] != 2:
        raise ValueError(f"offsets must have shape [T, 2], received {off.shape}")
    if not 0 <= start < end:
        raise ValueError(f"the span must satisfy 0 <= start < end, received start={start}, end={end}")
    hit = (off[:, 0] < end) & (off[:, 1] > start) & (off[:, 1] > off[:, 0])
    idx = np.flatnonzero(hit)
    if idx.size == 0:
        raise ValueError(f"no token overlaps the characters [{start}, {end})")
    return int(idx[0]), int(idx[-1]) + 1


def find_span(text: str, phrase: str, *, occurrence: int = 0, before: int | None = None) -> tuple[int, int]:
    """``(start, end)`` of the ``occurrence``-th whole-word match of ``phrase`` in ``text`` (case-sensitive).

    ``before``: only matches that end at or before this character count (e.g. a candidate's mention
    before the pronoun).
    """
    found, at = -1, 0
    while True:
        i = text.find(phrase, at)
        if i < 0 or (before is not None and i + len(phrase) > before):
            raise ValueError(f"{phrase!r} (occurrence {occurrence}) not found in {text!r}"
                             + (f" before character {before}" if before is not None else ""))
        left_ok = i == 0 or not text[i - 1].isalnum()
        right_ok = i + len(phrase) == len(text) or not text[i + len(phrase)].isalnum()
        if left_ok and right_ok:
            found += 1
            if found == occurrence:
                return i, i + len(phrase)
        at = i + 1


def encode_choices(tokenizer: Any, prefix: str, choices: Sequence[str], *, length: int | None = None,
                   pad_id: int = 0) -> dict[str, np.ndarray]:
    """The inputs of a C-way choice: ``prefix + choice`` for each choice, right-padded to one length.

    Returns:
      ``{"input_ids" [C, T], "attention_mask" [C, T] bool, "start" [C], "end" [C]}``: the choice's tokens
      are ``[start, end)`` of its row (the first token whose span starts at or after ``len(prefix)``).
      ``length`` pads to at least that many tokens (to line up two inputs for patching).

    Raises:
      ValueError: when a token straddles the boundary between the prefix and a choice.
    """
    if isinstance(choices, str) or len(choices) < 1:
        raise TypeError(f"choices must be a sequence of strings, received {choices!r}")
    rows, starts, ends = [], [], []
    for choice in choices:
        ids, off = encode_with_offsets(tokenizer, prefix + choice)
        real = off[:, 1] > off[:, 0]
        inside = np.flatnonzero(real & (off[:, 1] > len(prefix)))
        if inside.size == 0:
            raise ValueError(f"choice {choice!r} adds no token after the prefix")
        first = int(inside[0])
        if off[first, 0] < len(prefix):
            raise ValueError(f"a token straddles the end of the prefix and the start of {choice!r}; "
                             f"start the choice with a space or end the prefix with one")
        rows.append(ids)
        starts.append(first)
        ends.append(int(inside[-1]) + 1)
    T = max(max(len(r) for r in rows), length or 0)
    out_ids = np.full((len(rows), T), pad_id, np.int32)
    mask = np.zeros((len(rows), T), bool)
    for i, r in enumerate(rows):
        out_ids[i, : len(r)] = r
        mask[i, : len(r)] = True
    return {"input_ids": out_ids, "attention_mask": mask, "start": np.asarray(starts), "end": np.asarray(ends)}
