"""SentencePiece BPE tokenization as llama.cpp runs it, for GGUF files whose ``tokenizer.ggml.model`` is
``"llama"`` (llama.cpp's "SPM" vocabulary: Llama 1 and 2, Mistral, Gemma 1 to 3, Phi-3, ...).

The GGUF holds no merge list for these models: ``tokenizer.ggml.scores`` gives every piece a score, and a
merge is ranked by the score of the piece it makes. A Unigram model over the same scores (what a
tokenizer built for Unigram makes of them) segments differently: it splits Gemma 3's "The capital of
France is" into ``The ▁c ap it al ▁of ▁Fr an ce ▁is``, where llama.cpp gives
``The ▁capital ▁of ▁France ▁is``.

What :meth:`SpmTokenizer.encode` does, step by step as llama.cpp's ``src/llama-vocab.cpp`` (commit
00ad355) does it in ``llama_vocab::impl::tokenize`` (case ``LLAMA_VOCAB_TYPE_SPM``):

1. ``tokenizer_st_partition``: the special pieces, longest (in UTF-8 bytes) first, cut the text into
   fragments, each occurrence (leftmost first, not overlapping) becoming its own token. The special
   pieces are those of type USER_DEFINED, CONTROL or UNKNOWN; CONTROL and UNKNOWN ones only with
   ``parse_special`` (llama-cli and llama-server pass it for prompts; the library default is off). A
   piece whose text looks like an end-of-generation or fill-in-the-middle token is treated as CONTROL
   whatever its type (``llama_vocab::impl::load``): Gemma 3's ``</s>`` (USER_DEFINED in the file) is
   therefore text unless ``parse_special``, where SentencePiece and Hugging Face match it as one token.
2. Each remaining text fragment: a space prepended when ``add_space_prefix`` is set and the fragment is
   first or follows a special token; every ``" "`` replaced by ``"▁"`` (U+2581, ``llama_escape_whitespace``).
3. ``llm_tokenizer_spm`` (its per-call ``tokenize``): the fragment split into characters (Unicode code
   points, the UTF-8 sequences llama.cpp walks); every adjacent pair whose concatenation is a vocabulary
   piece (of any type) goes into a priority queue, best score first and, among equal scores, the leftmost
   first; the best pair is merged and the pairs it forms with its neighbours are queued, until no queued
   pair is left. A queued pair one of whose symbols has since changed is dropped when it comes up.
4. ``resegment``: each final symbol is its piece's id, or, when the symbol is a character the vocabulary
   lacks, the byte tokens ``<0xAB>`` of its UTF-8 bytes (``llama_vocab::byte_to_token``).
5. ``<bos>`` before it all when ``tokenizer.ggml.add_bos_token`` says so (llama.cpp's default for this
   vocabulary type: yes), ``<eos>`` after it when ``add_eos_token`` does (default: no). An empty text
   gives ``[bos]`` (or nothing).

Nothing else is normalised: no Unicode normalisation, no collapsing of whitespace (llama.cpp reads
``tokenizer.ggml.remove_extra_whitespaces`` but its SPM path never uses it). Gemma 3's file says
``add_space_prefix = false``; llama.cpp's default for this vocabulary type, when the key is absent, is true.

:meth:`SpmTokenizer.decode` is ``llama_vocab::impl::detokenize`` with ``token_to_piece``: a NORMAL
piece with ``▁`` back to spaces, a USER_DEFINED piece as written, a BYTE piece as its byte (the bytes
joined, then read as UTF-8), a CONTROL or UNKNOWN piece as written only when ``special``; with
``add_space_prefix`` one leading space of the first piece is dropped (not when ``remove_special`` drops a
leading ``<bos>``, nor the space prefixed to a fragment after a special piece: llama.cpp keeps both).
"""

from __future__ import annotations

import heapq
import mmap
import os
import re
import struct
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from jaxattn.checkpoint import CheckpointError

__all__ = ["SpmTokenizer", "from_gguf", "from_metadata", "read_tokenizer_metadata"]

# Token types in ``tokenizer.ggml.token_type`` (llama.h's ``llama_token_type``, gguf's ``TokenType``).
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(7)

# Token attributes (llama.h's ``llama_token_attr``): the bits llama.cpp derives from the types and by name.
_A_UNKNOWN, _A_UNUSED, _A_NORMAL, _A_CONTROL, _A_USER, _A_BYTE = 1, 2, 4, 8, 16, 32
_A_LSTRIP, _A_RSTRIP = 128, 256
_ATTR_OF_TYPE = {NORMAL: _A_NORMAL, UNKNOWN: _A_UNKNOWN, CONTROL: _A_CONTROL, USER_DEFINED: _A_USER,
                 UNUSED: _A_UNUSED, BYTE: _A_BYTE}  # UNDEFINED and any other value: no bit

_SPACE = "\u2581"  # "▁", SentencePiece's escaped space
_C_SPACE = " \t\n\v\f\r"  # C's isspace() in the "C" locale: what LSTRIP/RSTRIP strip

# Texts llama.cpp's ``load`` marks CONTROL whatever their type (its "control-looking token" warning): the
# end-of-generation list, matched unconditionally, and the fill-in-the-middle lists, matched only for a
# kind whose id the metadata does not give (``tokenizer.ggml.fim_pre_token_id``, ...).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})
_FIM_TEXTS = {
    ("fim_pre", "prefix"): ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                            "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    ("fim_suf", "suffix"): ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                            "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    ("fim_mid", "middle"): ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                            "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    ("fim_pad",): ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    ("fim_rep",): ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    ("fim_sep",): ("<|file_sep|>",),
}
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # llama.cpp's gpt-oss rule

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPECIAL_ID_KEY = re.compile(r"^tokenizer\.ggml\.(\w+)_token_id$")


class SpmTokenizer:
    """llama.cpp's SentencePiece BPE tokenizer over a vocabulary of pieces, scores and token types.

    Stands in for :class:`~jaxattn.checkpoint.TextTokenizer`: :meth:`encode` (int32 ids), :meth:`decode`,
    :meth:`labels`, :attr:`vocab_size`, :attr:`add_special_tokens`, and ``id_to_token``/``token_to_id``
    as on a ``tokenizers.Tokenizer``. It has no ``backend``: no ``tokenizers.Tokenizer`` reproduces this
    segmentation (nor can one be saved as ``tokenizer.json``).

    Args:
      tokens: the pieces (``tokenizer.ggml.tokens``), id order. An empty piece becomes ``[EMPTY_<id>]``,
        as llama.cpp names it.
      scores: one score per piece (``tokenizer.ggml.scores``; float32 or int32); None: all 0.
      token_types: one type per piece (``tokenizer.ggml.token_type``: 1 NORMAL, 2 UNKNOWN, 3 CONTROL,
        4 USER_DEFINED, 5 UNUSED, 6 BYTE); None: all NORMAL.
      special_ids: the ``tokenizer.ggml.<name>_token_id`` values by name (``{"bos": 2, "eos": 1, ...}``);
        ``bos`` defaults to 1 and ``eos`` to 2 (llama.cpp's defaults for this vocabulary type). An id outside
        the vocabulary is refused when ``add_bos``/``add_eos`` needs it (llama.cpp would warn and fall back
        to its default) and ignored otherwise.
      add_bos, add_eos: ``tokenizer.ggml.add_bos_token``/``add_eos_token`` (llama.cpp's defaults: True, False).
      add_space_prefix: ``tokenizer.ggml.add_space_prefix`` (llama.cpp's default: True).
      name: ``general.name``; a name holding ``phi-3``/``phi3`` strips the whitespace after each special
        piece, as llama.cpp does for those models.
      source: what the vocabulary came from, for messages.

    Raises:
      CheckpointError: no piece; a piece twice; ``scores``/``token_types`` shorter than ``tokens``; a
        BYTE piece not written ``<0xAB>``; ``add_bos``/``add_eos`` with no valid id; each named.
    """

    def __init__(self, tokens: Sequence[str], scores: Any = None, token_types: Any = None, *,
                 special_ids: Mapping[str, int] | None = None, add_bos: bool = True, add_eos: bool = False,
                 add_space_prefix: bool = True, name: str = "", source: str = "vocabulary"):
        n = len(tokens)
        self.source = source
        if n == 0:
            raise CheckpointError(f"{source}: the vocabulary holds no token (tokenizer.ggml.tokens is empty)")
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        ids = dict(zip(tokens, range(n)))
        if len(ids) != n:
            seen: dict[str, int] = {}
            for i, t in enumerate(tokens):
                if t in seen:
                    raise CheckpointError(
                        f"{source}: duplicate token in the vocabulary: {t!r} has ids {seen[t]} and {i}")
                seen[t] = i
        if scores is None:
            scores = np.zeros(n, np.float32)
        scores = np.asarray(scores)
        if scores.ndim != 1 or scores.shape[0] < n:
            raise CheckpointError(f"{source}: tokenizer.ggml.scores holds {scores.size} scores for {n} tokens")
        types = np.full(n, NORMAL, np.int32) if token_types is None else np.asarray(token_types)
        if types.ndim != 1 or types.shape[0] < n:
            raise CheckpointError(f"{source}: tokenizer.ggml.token_type holds {types.size} types for {n} tokens")
        # float32 scores, compared as llama.cpp compares them (a Python float holds a float32 exactly)
        self._scores: list[float] = scores[:n].astype(np.float32).astype(np.float64).tolist()
        self._tokens: list[str] = tokens
        self._ids: dict[str, int] = ids
        attrs = np.zeros(n, np.int64)
        for t, a in _ATTR_OF_TYPE.items():
            attrs[types[:n] == t] = a
        self._attrs = self._llama_cpp_attrs(attrs, dict(special_ids or {}), name)

        self._byte_ids: list[int | None] = [None] * 256  # llama_vocab::byte_to_token: <0xAB>, else the byte itself
        for b in range(256):
            i = ids.get(f"<0x{b:02X}>")
            if i is None and b < 0x80:
                i = ids.get(chr(b))
            self._byte_ids[b] = i
        self._byte_of: dict[int, int] = {}  # id of each BYTE piece -> its byte
        for i in np.flatnonzero(self._attrs & _A_BYTE).tolist():
            m = _BYTE_PIECE.match(tokens[i])
            if m is None:
                raise CheckpointError(f"{source}: token {i} {tokens[i]!r} has type BYTE but is not written <0xAB>")
            self._byte_of[i] = int(m.group(1), 16)

        # the special pieces, longest in UTF-8 bytes first (llama.cpp's cache_special_tokens; equal
        # lengths, which llama.cpp leaves in std::sort's order, by id here)
        special = np.flatnonzero(self._attrs & (_A_CONTROL | _A_USER | _A_UNKNOWN)).tolist()
        self._specials = sorted(((tokens[i], i) for i in special),
                                key=lambda p: (-len(p[0].encode("utf-8", "surrogateescape")), p[1]))

        ids_given = {k: int(v) for k, v in (special_ids or {}).items()}
        self.bos_id = self._valid_id(ids_given.get("bos", 1))
        self.eos_id = self._valid_id(ids_given.get("eos", 2))
        self.unk_id = self._valid_id(ids_given.get("unknown", 0))
        for what, flag, i in (("bos", add_bos, self.bos_id), ("eos", add_eos, self.eos_id)):
            if flag and i is None:
                raise CheckpointError(
                    f"{source}: tokenizer.ggml.add_{what}_token is set but tokenizer.ggml.{what}_token_id is "
                    f"{ids_given.get(what)!r}, not an id of the {n} tokens"
                )
        self.add_bos, self.add_eos, self.add_space_prefix = bool(add_bos), bool(add_eos), bool(add_space_prefix)
        self.add_special_tokens = True  # as TextTokenizer's: encode adds <bos>/<eos> as the vocabulary says

    # ------------------------------------------------------------------------------------------------
    # construction
    # ------------------------------------------------------------------------------------------------

    def _valid_id(self, i: Any) -> int | None:
        return int(i) if i is not None and 0 <= int(i) < len(self._tokens) else None

    def _llama_cpp_attrs(self, attrs: np.ndarray, special_ids: dict[str, int], name: str) -> np.ndarray:
        """The attributes llama.cpp's ``llama_vocab::impl::load`` adds by a token's text, after its type."""
        ids = self._ids
        for text in _EOG_TEXTS:
            i = ids.get(text)
            if i is not None:
                attrs[i] |= _A_CONTROL
        for kinds, texts in _FIM_TEXTS.items():
            if any(self._valid_id(special_ids.get(k)) is not None for k in kinds):
                continue  # the metadata names this kind's token: llama.cpp looks for none by text
            # llama.cpp marks the first it meets in hash order; a vocabulary holds one of them in practice
            for text in texts:
                if text in ids:
                    attrs[ids[text]] |= _A_CONTROL
                    break
        for text in _ALWAYS_USER_DEFINED:
            if text in ids:
                attrs[ids[text]] = _A_USER
        # o200k_harmony / solar-open: "<|end|>" is no end of generation there, and becomes USER_DEFINED
        if "<|end|>" in ids and ((("<|return|>" in ids) and (("<|call|>" in ids) or ("<|calls|>" in ids)))
                                 or ((("<|call|>" in ids) or ("<|calls|>" in ids)) and "<|flush|>" in ids)):
            attrs[ids["<|end|>"]] = _A_USER
        if "<|tool_response>" in ids and "</s>" in ids:  # gemma4 / paddleocr: "</s>" is a plain piece there
            attrs[ids["</s>"]] = _A_NORMAL
        lowered = name.lower()
        if "phi-3" in lowered or "phi3" in lowered:  # every special piece strips the whitespace after it
            attrs[(attrs & (_A_CONTROL | _A_USER | _A_UNKNOWN)) != 0] |= _A_RSTRIP
            if "</s>" in ids:
                attrs[ids["</s>"]] |= _A_RSTRIP
            for text in ("<unk>", "<s>", "<|endoftext|>"):
                if text in ids:
                    attrs[ids[text]] &= ~_A_RSTRIP
        return attrs

    # ------------------------------------------------------------------------------------------------
    # the vocabulary
    # ------------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def id_to_token(self, i: int) -> str | None:
        """The piece of id ``i`` as the vocabulary writes it (``▁`` for spaces), or None out of range."""
        i = int(i)
        return self._tokens[i] if 0 <= i < len(self._tokens) else None

    def token_to_id(self, piece: str) -> int | None:
        """The id of the vocabulary piece ``piece`` (written with ``▁``), or None."""
        return self._ids.get(piece)

    def score(self, i: int) -> float:
        """The score of piece ``i`` (a float32 value): merges making higher-scored pieces come first."""
        return self._scores[self._check_id(i)]

    def _check_id(self, i: Any) -> int:
        try:
            j = int(i)
        except (TypeError, ValueError):
            raise ValueError(f"token ids must be integers, received {i!r}") from None
        if not 0 <= j < len(self._tokens):
            raise ValueError(f"token id {j} is out of range for a vocabulary of {len(self._tokens)} tokens")
        return j

    # ------------------------------------------------------------------------------------------------
    # encoding
    # ------------------------------------------------------------------------------------------------

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """``tokenizer_st_partition``: ``text`` cut by the special pieces into text fragments (str) and ids."""
        frags: list[str | int] = [text]
        skip = 0 if parse_special else (_A_CONTROL | _A_UNKNOWN)
        attrs = self._attrs
        for piece, tid in self._specials:
            if piece not in text:  # the fragments are substrings of the text
                continue
            attr = int(attrs[tid])
            if attr & skip:
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or piece not in f:
                    out.append(f)
                    continue
                start = 0
                while (at := f.find(piece, start)) >= 0:
                    left = f[start:at]
                    if attr & _A_LSTRIP:
                        left = left.rstrip(_C_SPACE)
                    if left:
                        out.append(left)
                    out.append(tid)
                    start = at + len(piece)
                    if attr & _A_RSTRIP:
                        while start < len(f) and f[start] in _C_SPACE:
                            start += 1
                if start < len(f):
                    out.append(f[start:])
            frags = out
        return frags

    def _bpe(self, text: str, out: list[int]) -> None:
        """llama.cpp's ``llm_tokenizer_spm`` tokenize on one escaped fragment, its ids appended to ``out``."""
        sym = list(text)  # code points: the UTF-8 sequences llama.cpp splits the fragment into
        n = len(sym)
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        ids, scores = self._ids, self._scores
        # (-score, left, right, length): the best score first, then the leftmost, as llm_bigram_spm::comparator
        heap = []
        for i in range(n - 1):
            t = ids.get(sym[i] + sym[i + 1])
            if t is not None:
                heap.append((-scores[t], i, i + 1, 2))
        heapq.heapify(heap)
        push, pop = heapq.heappush, heapq.heappop
        while heap:
            _, left, right, size = pop(heap)
            a, b = sym[left], sym[right]
            if not a or not b or len(a) + len(b) != size:
                continue  # one of the two symbols was merged since this pair was queued
            merged = a + b
            sym[left], sym[right] = merged, ""
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prv[after] = left
                t = ids.get(merged + sym[after])
                if t is not None:
                    push(heap, (-scores[t], left, after, size + len(sym[after])))
            before = prv[left]
            if before >= 0:
                t = ids.get(sym[before] + merged)
                if t is not None:
                    push(heap, (-scores[t], before, left, len(sym[before]) + size))
        i = 0
        while i != -1:
            s = sym[i]
            t = ids.get(s)
            if t is not None:
                out.append(t)
            else:  # a character the vocabulary lacks: its UTF-8 bytes
                for byte in s.encode("utf-8"):
                    t = self._byte_ids[byte]
                    if t is None:
                        raise ValueError(
                            f"{self.source}: the character {s!r} is not in the vocabulary, and neither is the byte "
                            f"token <0x{byte:02X}> it falls back to"
                        )
                    out.append(t)
            i = nxt[i]

    def encode_list(self, text: str, *, add_special: bool | None = None, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` as a list (:meth:`encode` returns them as an array).

        Args:
          text: the text (a ``str``; lone surrogates cannot be encoded and are refused).
          add_special: add ``<bos>``/``<eos>`` as the vocabulary's ``add_bos``/``add_eos`` say; None:
            :attr:`add_special_tokens`.
          parse_special: also match CONTROL and UNKNOWN pieces (``<start_of_turn>``) written in the text;
            otherwise only USER_DEFINED pieces are matched and the others are plain text.

        Raises:
          ValueError: ``text`` is not a string or holds a lone surrogate; a character outside the
            vocabulary whose byte token is missing too.
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, received {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"text holds {text[e.start:e.end]!r} at index {e.start}, a lone surrogate, which "
                             "has no UTF-8 encoding to tokenize") from None
        add = self.add_special_tokens if add_special is None else bool(add_special)
        out: list[int] = []
        if add and self.add_bos:
            out.append(self.bos_id)
        prev_special = True  # llama.cpp: the first fragment counts as following a special token
        for frag in self._partition(text, parse_special) if text else []:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                frag = " " + frag
            self._bpe(frag.replace(" ", _SPACE), out)
            prev_special = False
        if add and self.add_eos:
            out.append(self.eos_id)
        return out

    def encode(self, text: str, *, add_special: bool | None = None, parse_special: bool = False) -> np.ndarray:
        """Token ids ``[T]`` (int32) of ``text``, as llama.cpp's ``llama_tokenize`` gives them (the
        arguments and errors are :meth:`encode_list`'s)."""
        return np.asarray(self.encode_list(text, add_special=add_special, parse_special=parse_special), np.int32)

    def tokenize(self, text: str, *, add_special: bool | None = None, parse_special: bool = False) -> list[str]:
        """The vocabulary pieces of :meth:`encode` (``["<bos>", "The", "▁capital", ...]``)."""
        return [self._tokens[i] for i in self.encode_list(text, add_special=add_special, parse_special=parse_special)]

    # ------------------------------------------------------------------------------------------------
    # decoding
    # ------------------------------------------------------------------------------------------------

    def _piece(self, i: int, special: bool) -> bytes:
        """``llama_vocab::impl::token_to_piece`` for an SPM vocabulary."""
        attr = int(self._attrs[i])
        text = self._tokens[i]
        if attr & (_A_UNKNOWN | _A_CONTROL):
            return text.encode("utf-8", "surrogateescape") if special else b""
        if attr & _A_USER:
            return text.encode("utf-8", "surrogateescape")
        if attr & _A_NORMAL:
            return text.replace(_SPACE, " ").encode("utf-8", "surrogateescape")
        if attr & _A_BYTE:
            return bytes((self._byte_of[i],))
        return b""  # UNUSED or UNDEFINED: llama.cpp writes nothing

    def decode(self, ids: Iterable[int], *, special: bool = True, remove_special: bool = False) -> str:
        """The text of ``ids``, as llama.cpp's ``llama_detokenize`` writes it.

        Args:
          ids: token ids.
          special: write CONTROL and UNKNOWN pieces (``<bos>``) as their text (True, as
            :class:`~jaxattn.checkpoint.TextTokenizer` does), or drop them (llama.cpp's ``unparse_special``).
          remove_special: drop a leading ``<bos>`` and a trailing ``<eos>`` when the vocabulary adds them.

        Raises:
          ValueError: an id that is no integer or lies outside the vocabulary.
        """
        ids = [self._check_id(i) for i in (ids.tolist() if isinstance(ids, np.ndarray) else ids)]
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            ids, remove_space = ids[1:], False
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        parts = []
        for k, i in enumerate(ids):
            piece = self._piece(i, special)
            if k == 0 and remove_space and piece.startswith(b" "):
                piece = piece[1:]
            parts.append(piece)
        return b"".join(parts).decode("utf-8", "replace")

    def labels(self, ids: Iterable[int]) -> list[str]:
        """One readable label per token: its own decoded text (``" capital"``), or its vocabulary piece
        when that text is empty."""
        out = []
        for i in (ids.tolist() if isinstance(ids, np.ndarray) else ids):
            j = self._check_id(i)
            text = self._piece(j, True).decode("utf-8", "replace")
            out.append(text if text else self._tokens[j])
        return out

    def __repr__(self) -> str:
        return (f"SpmTokenizer({self.source}: {self.vocab_size} tokens, bos={self.bos_id}, add_bos={self.add_bos}, "
                f"add_eos={self.add_eos}, add_space_prefix={self.add_space_prefix})")


# ----------------------------------------------------------------------------------------------------
# GGUF
# ----------------------------------------------------------------------------------------------------

# GGUF value types (gguf's ``GGUFValueType``): the scalars' struct formats; 8 is a string, 9 an array.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "u1", 10: "u8", 11: "i8", 12: "f8"}


def _wanted(key: str) -> bool:
    """The metadata keys the tokenizer reads (the rest of the header is walked over, not decoded)."""
    return key in ("general.architecture", "general.name") or (
        key.startswith("tokenizer.ggml.") and key != "tokenizer.ggml.merges")


def read_tokenizer_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The tokenizer's metadata of a GGUF file, read from its header alone: ``general.architecture``,
    ``general.name`` and every ``tokenizer.ggml.*`` key but the merges, with string arrays as lists of
    ``str`` and numeric arrays as NumPy arrays (``tokenizer.ggml.scores``: float32 or int32).

    ``gguf.GGUFReader`` parses every field and tensor of the file into NumPy views, which takes seconds
    for a 262,144-piece vocabulary (14 s for Gemma 3's file); this walks the header once and decodes only
    these keys (a fraction of a second).

    Raises:
      CheckpointError: the file is missing, not GGUF, of a version other than 2 or 3, or claims a length
        its bytes cannot hold; the message names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise CheckpointError(f"{path}: {size} bytes, too short for a GGUF header (24 bytes at least)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _walk_header(data, path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read GGUF file ({e.strerror or e})") from None


def _walk_header(data: Any, path: Path) -> dict[str, Any]:
    if data[:4] != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (it starts with {bytes(data[:4])!r}, not b'GGUF')")
    order = "<"
    version = struct.unpack_from("<I", data, 4)[0]
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        order, version = ">", struct.unpack_from(">I", data, 4)[0]
    if version not in (2, 3):
        raise CheckpointError(f"{path}: GGUF version {version}; versions 2 and 3 are read")
    end = len(data)
    at = 16  # magic, version, tensor count

    def fail(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: cannot read GGUF file, truncated or corrupt? ({what})")

    def uint(size: int, what: str) -> int:
        nonlocal at
        if at + size > end:
            raise fail(f"{what} needs {size} bytes at offset {at}, but the file ends at {end}")
        value = struct.unpack_from(order + ("I" if size == 4 else "Q"), data, at)[0]
        at += size
        return int(value)

    def string(what: str) -> bytes:
        nonlocal at
        n = uint(8, f"the length of {what}")
        if at + n > end:
            raise fail(f"{what} claims {n} bytes at offset {at}, but the file ends at {end}")
        s = bytes(data[at:at + n])
        at += n
        return s

    def value(kind: int, key: str, keep: bool, depth: int = 0) -> Any:
        nonlocal at
        if kind in _SCALAR:
            fmt = order + _SCALAR[kind]
            size = struct.calcsize(fmt)
            if at + size > end:
                raise fail(f"metadata key '{key}' needs {size} bytes at offset {at}, but the file ends at {end}")
            v = struct.unpack_from(fmt, data, at)[0]
            at += size
            return v
        if kind == _STRING:
            return string(f"metadata key '{key}'").decode("utf-8", "surrogateescape")
        if kind == _ARRAY and depth < 8:
            item = uint(4, f"the item type of metadata key '{key}'")
            count = uint(8, f"the length of metadata key '{key}'")
            if item in _SCALAR:
                nbytes = count * struct.calcsize(_SCALAR[item])
                if at + nbytes > end:
                    raise fail(f"metadata key '{key}' claims {count} items ({nbytes} bytes) at offset {at}, "
                               f"but the file ends at {end}")
                arr = np.frombuffer(data, order + _NUMPY[item], count, at).astype(_NUMPY[item]) if keep else None
                if keep and item == 7:
                    arr = arr.astype(bool)
                at += nbytes
                return (item, arr)
            if item == _STRING:
                if at + 8 * count > end:
                    raise fail(f"metadata key '{key}' claims {count} strings at offset {at}, "
                               f"but the file ends at {end}")
                length = struct.Struct(order + "Q").unpack_from
                out = [] if keep else None
                for i in range(count):  # a vocabulary's worth of strings: the loop of string(), inlined
                    if at + 8 > end or at + 8 + length(data, at)[0] > end:
                        raise fail(f"item {i} of metadata key '{key}' runs past the file's end (offset {at})")
                    n = length(data, at)[0]
                    if keep:
                        out.append(bytes(data[at + 8:at + 8 + n]).decode("utf-8", "surrogateescape"))
                    at += 8 + n
                return (item, out)
            if item == _ARRAY:
                return (item, [value(_ARRAY, key, keep, depth + 1) for _ in range(count)])
        raise CheckpointError(f"{path}: metadata key '{key}' has value type id {kind}, which GGUF does not define")

    n_keys = uint(8, "the key/value count")
    meta: dict[str, Any] = {}
    for i in range(n_keys):
        key = string(f"the name of metadata key number {i}").decode("utf-8", "replace")
        kind = uint(4, f"the type of metadata key '{key}'")
        keep = _wanted(key)
        v = value(kind, key, keep)
        if keep:
            meta[key] = v[1] if kind == _ARRAY else v
    return meta


def _from_reader(reader: Any) -> dict[str, Any]:
    """The same dictionary as :func:`read_tokenizer_metadata`, from an open ``gguf.GGUFReader``."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not _wanted(key):
            continue
        kinds = [int(t) for t in field.types]
        if kinds and kinds[0] == _ARRAY:
            item = kinds[1] if len(kinds) > 1 else None
            if item in _SCALAR:
                parts = [field.parts[j] for j in field.data]
                arr = np.concatenate(parts).astype(_NUMPY[item]) if parts else np.zeros(0, _NUMPY[item])
                meta[key] = arr.astype(bool) if item == 7 else arr
            elif item == _STRING:
                meta[key] = [bytes(field.parts[j]).decode("utf-8", "surrogateescape") for j in field.data]
            else:
                meta[key] = field.contents()
        else:
            meta[key] = field.contents()
    return meta


def from_metadata(meta: Mapping[str, Any], *, source: str = "GGUF metadata") -> SpmTokenizer:
    """An :class:`SpmTokenizer` from GGUF metadata (``{key: value}``, arrays as lists or arrays), with
    llama.cpp's defaults for the keys a file leaves out (``add_bos_token`` true, ``add_eos_token`` false,
    ``add_space_prefix`` true, ``bos_token_id`` 1, ``eos_token_id`` 2).

    Raises:
      CheckpointError: no ``tokenizer.ggml.model``, or one other than ``"llama"`` (naming it and where
        each other kind is read); no or mistyped ``tokens``, ``scores`` or ``token_type``; a flag that is
        no boolean; and :class:`SpmTokenizer`'s errors.
    """
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise CheckpointError(f"{source}: the file holds no tokenizer (metadata key 'tokenizer.ggml.model' is missing)")
    if model != "llama":
        hint = {"gpt2": "; a 'gpt2' (byte-level BPE) tokenizer is read by jaxattn._gguf.read_tokenizer"}.get(model, "")
        raise CheckpointError(
            f"{source}: tokenizer.ggml.model is {model!r}; this tokenizer implements 'llama' only (llama.cpp's "
            f"SentencePiece BPE, LLAMA_VOCAB_TYPE_SPM){hint}"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise CheckpointError(f"{source}: metadata key 'tokenizer.ggml.tokens' is missing (the vocabulary)")
    if isinstance(tokens, (str, bytes)) or not all(isinstance(t, str) for t in tokens):
        raise CheckpointError(f"{source}: metadata key 'tokenizer.ggml.tokens' must be an array of strings")
    tokens = list(tokens)
    scores, types = meta.get("tokenizer.ggml.scores"), meta.get("tokenizer.ggml.token_type")
    scores = None if scores is None else np.asarray(scores)
    types = None if types is None else np.asarray(types)
    if scores is not None and scores.dtype.kind not in "fiu":
        raise CheckpointError(f"{source}: metadata key 'tokenizer.ggml.scores' must hold numbers")
    if types is not None and types.dtype.kind not in "iu":
        raise CheckpointError(f"{source}: metadata key 'tokenizer.ggml.token_type' must hold integers")

    def flag(key: str, default: bool) -> bool:
        v = meta.get(f"tokenizer.ggml.{key}", default)
        if not isinstance(v, (bool, np.bool_)):
            raise CheckpointError(f"{source}: metadata key 'tokenizer.ggml.{key}' must be a boolean, found {v!r}")
        return bool(v)

    special_ids = {}
    for key, v in meta.items():
        m = _SPECIAL_ID_KEY.match(key) if isinstance(key, str) else None
        if m:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise CheckpointError(f"{source}: metadata key '{key}' must be an integer id, found {v!r}")
            special_ids[m.group(1)] = int(v)
    name = meta.get("general.name", "")
    return SpmTokenizer(tokens, scores, types, special_ids=special_ids,
                        add_bos=flag("add_bos_token", True), add_eos=flag("add_eos_token", False),
                        add_space_prefix=flag("add_space_prefix", True),
                        name=name if isinstance(name, str) else "", source=source)


def from_gguf(reader_or_path: Any) -> SpmTokenizer:
    """The tokenizer of a GGUF file whose ``tokenizer.ggml.model`` is ``"llama"`` (SentencePiece BPE).

    Args:
      reader_or_path: a path (its header is read by :func:`read_tokenizer_metadata`, in well under a
        second for a 262,144-piece vocabulary), or an open ``gguf.GGUFReader`` (e.g. from
        ``jaxattn._gguf.open_gguf``).

    Raises:
      CheckpointError: an unreadable file, a tokenizer other than ``"llama"``, or malformed tokenizer
        metadata, naming the file (:func:`from_metadata`).
    """
    if isinstance(reader_or_path, (str, os.PathLike)):
        return from_metadata(read_tokenizer_metadata(reader_or_path), source=str(reader_or_path))
    if not hasattr(reader_or_path, "fields"):
        raise TypeError(f"from_gguf takes a path or a gguf.GGUFReader, received {type(reader_or_path).__name__}")
    source = str(getattr(reader_or_path, "path", None) or "GGUF reader")
    return from_metadata(_from_reader(reader_or_path), source=source)
