"""GGUF files (llama.cpp's format) read for :mod:`jaxattn.llama`: metadata, weights, tokenizer.

Read with the ``gguf`` package (llama.cpp's own Python reader, ``gguf.GGUFReader``) and dequantized with
``gguf.quants.dequantize`` (vectorised NumPy). Only the ``llama`` architecture is read, and everything
it does not understand is refused by name: another architecture, a metadata key of the architecture it
does not implement (RoPE scaling, experts, ...), a tensor type outside :data:`TENSOR_TYPES`, a missing,
unexpected or misshapen tensor, a tokenizer other than GPT-2's byte-level BPE.

Layout. GGUF lists a tensor's dims as ``ne`` (``ne0`` the fastest-varying, the INPUT features of a
weight matrix), the reverse of NumPy's order; read row-major, a weight is ``[out, in]``, PyTorch's
``nn.Linear`` orientation. Messages quote shapes in GGUF order, as ``gguf-dump`` prints them.

llama.cpp's RoPE rotates ADJACENT pairs ``(x[2j], x[2j+1])``, Hugging Face's rotates HALVES
``(x[j], x[j + H/2])``. ``convert_hf_to_gguf.py`` therefore permutes the rows of every head of
``q_proj`` and ``k_proj`` (``LlamaModel.permute``); :func:`unpermute` undoes it, so one forward
(halves) serves both sources.
"""

from __future__ import annotations

import functools
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from jaxattn.checkpoint import CheckpointError, LazyArray, TextTokenizer

# Tensor types read (names of ``gguf.GGMLQuantizationType``): floats and llama.cpp's block quantizations,
# each dequantized by ``gguf.quants.dequantize``. Others (integer tensors, the IQ/TQ/FP4 families) are refused.
TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# ``llama.*`` metadata keys: the ones read, and the ones that must hold a value that changes nothing.
_LLAMA_KEYS = {
    "llama.context_length", "llama.embedding_length", "llama.block_count", "llama.feed_forward_length",
    "llama.attention.head_count", "llama.attention.head_count_kv", "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.freq_base", "llama.rope.dimension_count", "llama.attention.key_length",
    "llama.attention.value_length", "llama.vocab_size",
}
_NEUTRAL = {"llama.rope.scaling.type": ("none",), "llama.expert_count": (0,), "llama.expert_used_count": (0,)}

# The architectures read (``general.architecture``), each a Llama-family ``model_type``.
ARCHITECTURES = {"llama": "llama", "gemma3": "gemma3_text"}
_GEMMA3_KEYS = {
    "gemma3.context_length", "gemma3.embedding_length", "gemma3.block_count", "gemma3.feed_forward_length",
    "gemma3.attention.head_count", "gemma3.attention.head_count_kv", "gemma3.attention.layer_norm_rms_epsilon",
    "gemma3.rope.freq_base", "gemma3.rope.dimension_count", "gemma3.attention.key_length",
    "gemma3.attention.value_length", "gemma3.attention.sliding_window", "gemma3.vocab_size",
    "gemma3.rope.scaling.type", "gemma3.rope.scaling.factor",
}
# What a Gemma 3 GGUF does not say and llama.cpp hard-codes (src/llama-model.cpp, LLM_ARCH_GEMMA3 in
# llama_model::load_hparams): every sixth layer is full, the others sliding (``hparams.set_swa_pattern(6)``:
# layer il slides iff il % 6 < 5, Hugging Face's default layer_types too); sliding layers rotate with base
# 10000 (``rope_freq_base_train_swa``); the logit scale is 1/sqrt(key_length), but for the 27B model's 62
# layers 1/sqrt(embedding_length / head_count) (``f_attention_scale``).
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0

# Pre-tokenizers (``tokenizer.ggml.pre``) as ``tokenizers`` pre-tokenizer sequences. llama.cpp's "smollm"
# splits every numeric character off (``\p{N}``), then applies GPT-2's regex; "gpt-2" only the regex.
PRE_TOKENIZERS = ("smollm", "gpt-2")
_TOKENIZER_KEYS = {
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template",
}
_SPECIAL_ID = re.compile(r"^tokenizer\.ggml\.\w+_token_id$")  # bos/eos/unknown/padding/...: ids, not behaviour


def _type_name(raw: Any) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(int(raw)).name
    except ValueError:
        return f"unknown type id {int(raw)}"


# The header's value types (``gguf.GGUFValueType``): the byte size of each scalar; 8 is a string
# (uint64 length + bytes), 9 an array (uint32 item type, uint64 count, the items).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_READ_VERSIONS = (2, 3)  # the versions gguf.GGUFReader reads


class _Header:
    """A cursor over a GGUF file's header that refuses any size the rest of the file cannot hold."""

    def __init__(self, data: bytes | Any, path: Path, order: str):
        self.data, self.path, self.order, self.at = data, path, order, 0

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: cannot read GGUF file, truncated or corrupt? ({what})")

    def left(self) -> int:
        return len(self.data) - self.at

    def need(self, n: int, what: str) -> None:
        if n > self.left():
            raise self.fail(f"{what} needs {n} bytes at offset {self.at}, but the file ends {self.left()} bytes later")

    def uint(self, size: int, what: str) -> int:
        self.need(size, what)
        (value,) = struct.unpack_from(self.order + {4: "I", 8: "Q"}[size], self.data, self.at)
        self.at += size
        return int(value)

    def string(self, what: str, *, keep: bool = True) -> bytes:
        n = self.uint(8, f"the length of {what}")
        self.need(n, f"{what} ({n} bytes claimed)")
        text = bytes(self.data[self.at:self.at + n]) if keep else b""
        self.at += n
        return text

    def value(self, kind: int, key: str, depth: int = 0) -> bool:
        """Skip one value of type ``kind``; False when the type is unknown (the reader then refuses it)."""
        if kind in _SCALAR_BYTES:
            self.need(_SCALAR_BYTES[kind], f"metadata key '{key}'")
            self.at += _SCALAR_BYTES[kind]
        elif kind == _STRING:
            self.string(f"metadata key '{key}'", keep=False)
        elif kind == _ARRAY:
            item = self.uint(4, f"the item type of metadata key '{key}'")
            count = self.uint(8, f"the length of metadata key '{key}'")
            # the fewest bytes one item takes: a scalar's size, a string's length field, an array's type and count
            least = _SCALAR_BYTES.get(item, 8 if item == _STRING else 12)
            if count * least > self.left():
                raise self.fail(
                    f"metadata key '{key}' claims an array of {count} items, at least {count * least} bytes, "
                    f"but the file ends {self.left()} bytes later"
                )
            if item in _SCALAR_BYTES:
                self.at += count * least
            elif item == _STRING:  # a vocabulary's worth of strings: the loop of self.string, inlined
                at, end, length = self.at, len(self.data), struct.Struct(self.order + "Q").unpack_from
                for i in range(count):
                    if at + 8 > end or at + 8 + length(self.data, at)[0] > end:
                        self.at = at
                        raise self.fail(f"item {i} of metadata key '{key}' runs past the file's end (offset {at})")
                    at += 8 + length(self.data, at)[0]
                self.at = at
            elif item == _ARRAY and depth < 8:
                for _ in range(count):
                    if not self.value(item, key, depth + 1):
                        return False
            else:
                return False
        else:
            return False
        return True


def read_architecture(path: str | os.PathLike) -> str | None:
    """``general.architecture`` read from the header alone, before any other key's value is read (llama.cpp's
    converters write it first, so this reads a few hundred bytes, whatever the vocabulary's size); None when
    the file is not GGUF of a version this reads, or holds no such string key.

    Raises:
      CheckpointError: a count or length the file's bytes cannot hold on the way to it (naming the file).
    """
    import mmap

    path = Path(path)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF":
                return None
            version = struct.unpack_from("<I", data, 4)[0]
            order = "<"
            if version & 0xFFFF == 0:
                order, version = ">", struct.unpack_from(">I", data, 4)[0]
            if version not in _READ_VERSIONS:
                return None
            h = _Header(data, path, order)
            h.at = 8
            h.uint(8, "the tensor count")
            for i in range(h.uint(8, "the key/value count")):
                key = h.string(f"the name of metadata key number {i}").decode("utf-8", "replace")
                kind = h.uint(4, f"the type of metadata key '{key}'")
                if key == "general.architecture" and kind == _STRING:
                    return h.string(f"metadata key '{key}'").decode("utf-8", "replace")
                if not h.value(kind, key):
                    return None
    return None


def check_architecture(path: str | os.PathLike, supported: tuple[str, ...]) -> None:
    """Refuse a GGUF file whose ``general.architecture`` is not one of ``supported``, before its vocabulary
    or tensors are parsed (:func:`read_architecture`); a file without one is left to the full reader.

    Raises:
      CheckpointError: naming the file, its architecture and the supported ones.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    arch = read_architecture(path)
    if arch is not None and arch not in supported:
        names = ", ".join(repr(a) for a in supported)
        raise CheckpointError(
            f"{path}: general.architecture is {arch!r}; this loader reads {names} "
            f"(nothing else of the file was read)"
        )


def check_header(path: str | os.PathLike) -> None:
    """Walk a GGUF file's header (magic, version, tensor count, key/value count, every key and value, every
    tensor's name and dims) and refuse any count or length whose bytes the file cannot hold, before
    ``gguf.GGUFReader`` is handed them (it would loop over a claimed array length past the file's end).

    A file that is not GGUF, or of a version or value type the reader does not know, passes: the reader
    refuses it by name.

    Raises:
      CheckpointError: naming the file, the count or metadata key, the bytes it claims and those left.
    """
    import mmap

    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            return  # too short for a header: the reader reports it
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF":
                return
            version = struct.unpack_from("<I", data, 4)[0]
            order = "<"
            if version & 0xFFFF == 0:  # written on a machine of the other byte order, as the reader detects
                order, version = ">", struct.unpack_from(">I", data, 4)[0]
            if version not in _READ_VERSIONS:
                return
            h = _Header(data, path, order)
            h.at = 8
            n_tensors = h.uint(8, "the tensor count")
            n_keys = h.uint(8, "the key/value count")
            if n_tensors * 24 + n_keys * 13 > h.left():  # the smallest tensor info and key/value entry
                raise h.fail(f"the header claims {n_tensors} tensors and {n_keys} metadata keys, at least "
                             f"{n_tensors * 24 + n_keys * 13} bytes, but the file ends {h.left()} bytes later")
            for i in range(n_keys):
                key = h.string(f"the name of metadata key number {i}").decode("utf-8", "replace")
                if not h.value(h.uint(4, f"the type of metadata key '{key}'"), key):
                    return  # an unknown value type: the reader refuses it
            for i in range(n_tensors):
                name = h.string(f"the name of tensor number {i}").decode("utf-8", "replace")
                n_dims = h.uint(4, f"the dimension count of tensor '{name}'")
                h.need(n_dims * 8 + 12, f"the {n_dims} dims, type and offset of tensor '{name}'")
                h.at += n_dims * 8 + 12


def open_gguf(path: str | os.PathLike) -> Any:
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped; nothing is dequantized yet).

    Raises:
      CheckpointError: the file is missing, truncated, not a GGUF file, claims a count or length its bytes
        cannot hold (:func:`check_header`) or holds a tensor type the reader does not know; the message
        names the file.
    """
    import gguf

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    try:
        check_header(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read GGUF file ({e.strerror or e})") from None
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, KeyError, IndexError, struct errors...
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        unknown = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", detail)
        if unknown:
            raise CheckpointError(
                f"{path}: a tensor has type id {unknown.group(1)}, an unknown tensor type "
                f"(this loader reads {', '.join(TENSOR_TYPES)})"
            ) from None
        raise CheckpointError(f"{path}: cannot read GGUF file, truncated or corrupt? ({detail})") from None
    end = len(reader.data)
    for t in reader.tensors:  # memory-mapped views end at the file's end: a short tensor means truncation
        if t.data_offset + int(t.n_bytes) > end or t.data.nbytes != int(t.n_bytes):
            raise CheckpointError(
                f"{path}: tensor '{t.name}' needs {int(t.n_bytes)} bytes at offset {t.data_offset}, "
                f"but the file ends at {end}: the file is truncated"
            )
    return reader


def metadata(reader: Any) -> dict[str, Any]:
    """``{key: value}`` for every metadata field (strings decoded, arrays as lists)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the header: version, counts
            continue
        out[key] = field.contents()
    return out


def _int(meta: dict, key: str, path: Path, default: Any = None) -> Any:
    if key not in meta:
        if default is None:
            raise CheckpointError(f"{path}: metadata key '{key}' is missing")
        return default
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise CheckpointError(f"{path}: metadata key '{key}' must be an integer, found {value!r}")
    return int(value)


def _float(meta: dict, key: str, path: Path, default: Any = None) -> float:
    if key not in meta:
        if default is None:
            raise CheckpointError(f"{path}: metadata key '{key}' is missing")
        return float(default)
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise CheckpointError(f"{path}: metadata key '{key}' must be a number, found {value!r}")
    if isinstance(value, float) and float(np.float32(value)) == value:
        # a float32 field holds the converter's decimal (1e-05) rounded; its shortest float32 repr gives it back
        return float(str(np.float32(value)))
    return float(value)


def llama_fields(reader: Any, path: str | os.PathLike) -> dict[str, Any]:
    """The model's sizes from a llama or gemma3 GGUF's metadata, as :class:`jaxattn.llama.LlamaConfig` fields
    (a Gemma 3's layer pattern, local RoPE base and logit scale as llama.cpp hard-codes them:
    :data:`GEMMA3_SWA_PATTERN`).

    Raises:
      CheckpointError: another architecture; a ``llama.*`` key this model does not implement (or one with
        a value other than the neutral one, e.g. ``llama.rope.scaling.type`` other than ``none``); a
        missing or mistyped key; a head count below 1 or one that does not divide the embedding width
        (without ``key_length``); a ``block_count`` other than the number of ``blk.N`` tensor groups the
        file holds; a RoPE dimension count other than the head dim (partial RoPE).
    """
    path = Path(path)
    meta = metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: general.architecture is {arch!r}; this loader reads "
                              f"{', '.join(repr(a) for a in ARCHITECTURES)}")
    if arch == "gemma3":  # the same keys under the architecture's own prefix
        for key in sorted(k for k in meta if k.startswith("gemma3.")):
            if key not in _GEMMA3_KEYS:
                raise CheckpointError(f"{path}: unsupported metadata key '{key}'; this model does not implement it, "
                                      "so its weights could be misread")
        meta = {("llama." + k[len("gemma3."):] if k.startswith("gemma3.") else k): v for k, v in meta.items()}
        meta.pop("llama.attention.sliding_window", None), meta.pop("llama.rope.scaling.factor", None)
        scaling = meta.pop("llama.rope.scaling.type", "linear")  # llama.cpp's default when the key is absent
    for key in sorted(k for k in meta if k.startswith("llama.")):
        if key in _NEUTRAL:
            if meta[key] not in _NEUTRAL[key]:
                raise CheckpointError(f"{path}: metadata key '{key}' = {meta[key]!r} is not supported "
                                      f"(supported: {', '.join(repr(v) for v in _NEUTRAL[key])})")
        elif key not in _LLAMA_KEYS:
            raise CheckpointError(f"{path}: unsupported metadata key '{key}'; this model does not implement it, "
                                  "so its weights could be misread")
    D = _int(meta, "llama.embedding_length", path)
    if D < 1:
        raise CheckpointError(f"{path}: metadata key 'llama.embedding_length' must be >= 1, found {D}")
    N = _int(meta, "llama.attention.head_count", path)
    if N < 1:
        raise CheckpointError(f"{path}: metadata key 'llama.attention.head_count' must be >= 1, found {N}")
    K = _int(meta, "llama.attention.head_count_kv", path, default=N)
    if K < 1 or N % K != 0:
        raise CheckpointError(
            f"{path}: metadata key 'llama.attention.head_count_kv' must be >= 1 and divide "
            f"'llama.attention.head_count' = {N} (grouped-query attention), found {K}"
        )
    if "llama.attention.key_length" not in meta and D % N != 0:
        raise CheckpointError(
            f"{path}: metadata key 'llama.attention.head_count' = {N} does not divide 'llama.embedding_length' = {D}; "
            "without 'llama.attention.key_length' the head dim is embedding_length / head_count"
        )
    H = _int(meta, "llama.attention.key_length", path, default=D // N)
    if _int(meta, "llama.attention.value_length", path, default=H) != H:
        raise CheckpointError(f"{path}: llama.attention.value_length differs from key_length; not supported")
    if _int(meta, "llama.rope.dimension_count", path, default=H) != H:
        given = ("'llama.attention.key_length'" if "llama.attention.key_length" in meta else
                 f"'llama.embedding_length' = {D} / 'llama.attention.head_count' = {N}")
        raise CheckpointError(
            f"{path}: llama.rope.dimension_count = {meta['llama.rope.dimension_count']} but the head dim is {H} "
            f"({given}); partial rotary embeddings are not supported, so one of them is wrong"
        )
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{path}: missing tensor 'token_embd.weight'")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    L = _int(meta, "llama.block_count", path)
    _check_blocks(L, reader, path, "metadata key 'llama.block_count'")
    V = _int(meta, "llama.vocab_size", path, default=int(embd.shape[1]) if len(embd.shape) == 2 else 0)
    extra = {}
    if arch == "gemma3":
        raw = metadata(reader)
        if scaling not in ("none", "linear"):
            raise CheckpointError(f"{path}: metadata key 'gemma3.rope.scaling.type' = {scaling!r} is not supported "
                                  "(supported: 'none', 'linear')")
        extra = dict(
            model_type="gemma3_text", hidden_act="gelu_pytorch_tanh",
            sliding_window=_int(raw, "gemma3.attention.sliding_window", path),
            layer_types=["sliding_attention" if i % GEMMA3_SWA_PATTERN < GEMMA3_SWA_PATTERN - 1 else "full_attention"
                         for i in range(L)],
            rope_local_base_freq=GEMMA3_LOCAL_ROPE_BASE,
            query_pre_attn_scalar=float(D // N if L == 62 else H),
            # a factor applies when the type is linear or absent (llama.cpp's reading); none given: no scaling
            rope_scaling_factor=(_float(raw, "gemma3.rope.scaling.factor", path)
                                 if scaling == "linear" and "gemma3.rope.scaling.factor" in raw else None),
        )
    return dict(**extra,
        vocab_size=V,
        hidden_size=D,
        intermediate_size=_int(meta, "llama.feed_forward_length", path),
        num_hidden_layers=L,
        num_attention_heads=N,
        num_key_value_heads=K,
        head_dim=H,
        max_position_embeddings=_int(meta, "llama.context_length", path),
        rope_theta=_float(meta, "llama.rope.freq_base", path, default=10000.0),
        rms_norm_eps=_float(meta, "llama.attention.layer_norm_rms_epsilon", path),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
    )


def _check_blocks(L: int, reader: Any, path: Path, what: str) -> None:
    """Refuse a layer count ``L`` other than the number of ``blk.N.`` tensor groups in the file (before a
    table of ``L`` entries is built)."""
    blocks = {int(m.group(1)) for m in (re.match(r"blk\.(\d+)\.", t.name) for t in reader.tensors) if m}
    if L != len(blocks):
        held = f"{len(blocks)} blocks (blk.{min(blocks)} to blk.{max(blocks)})" if blocks else "no block"
        raise CheckpointError(f"{path}: {what} = {L}, but the file holds the tensors of {held}")


def tensor_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """``{gguf name: shape in GGUF order (ne0 first)}`` of every tensor a llama GGUF of ``config`` holds."""
    V, D, I = config.vocab_size, config.hidden_size, config.intermediate_size
    N, K, H = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    shapes = {"token_embd.weight": (D, V), "output_norm.weight": (D,)}
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (D, V)
    for i in range(config.num_hidden_layers):
        b = f"blk.{i}"
        if config.model_type == "gemma3_text":
            shapes.update({f"{b}.post_attention_norm.weight": (D,), f"{b}.post_ffw_norm.weight": (D,),
                           f"{b}.attn_q_norm.weight": (H,), f"{b}.attn_k_norm.weight": (H,)})
        shapes.update({
            f"{b}.attn_norm.weight": (D,),
            f"{b}.attn_q.weight": (D, N * H), f"{b}.attn_k.weight": (D, K * H), f"{b}.attn_v.weight": (D, K * H),
            f"{b}.attn_output.weight": (N * H, D),
            f"{b}.ffn_norm.weight": (D,),
            f"{b}.ffn_gate.weight": (D, I), f"{b}.ffn_up.weight": (D, I), f"{b}.ffn_down.weight": (I, D),
        })
        if config.qkv_bias:
            shapes.update({f"{b}.attn_q.bias": (N * H,), f"{b}.attn_k.bias": (K * H,), f"{b}.attn_v.bias": (K * H,)})
        if config.o_bias:
            shapes[f"{b}.attn_output.bias"] = (D,)
    return shapes


def torch_name(gguf_name: str, model_type: str = "llama") -> str:
    """The Hugging Face (PyTorch) name of a llama or gemma3 GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``; gguf-py's ``TensorNameMap`` maps them so)."""
    gemma3 = model_type == "gemma3_text"
    table = {
        "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
        "attn_norm": "input_layernorm",
        "ffn_norm": "pre_feedforward_layernorm" if gemma3 else "post_attention_layernorm",
        "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    }
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{table[parts[2]]}.{parts[3]}"
    return f"{table[parts[0]]}.{parts[1]}"


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo ``convert_hf_to_gguf.py``'s ``LlamaModel.permute`` on ``q_proj``/``k_proj`` rows (``[heads·H, ...]``).

    The converter maps row ``c·H/2 + j`` of a head (``c`` in {0, 1}, the half) to row ``2j + c``, so that
    llama.cpp's adjacent-pair RoPE rotates the pairs Hugging Face's half-split RoPE rotates; this is its
    inverse, for a weight ``[out, in]`` or a bias ``[out]``.
    """
    out = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(heads, out // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def read_llama_tensors(reader: Any, path: str | os.PathLike, config: Any, *, lazy: bool = False) -> dict[str, Any]:
    """Every weight of a llama or gemma3 GGUF as float32 ``{Hugging Face name: array}`` in PyTorch orientation
    (``[out, in]``): a llama's q and k un-permuted (:func:`unpermute`); a Gemma 3's RMSNorm weights less 1
    (llama.cpp's converter stores Gemma's ``1 + w``, ``Gemma2Model.modify_tensors`` in
    ``convert_hf_to_gguf.py``, as transformers' ``Gemma2TensorProcessor`` reads it back; its q and k keep
    Hugging Face's order: Gemma uses llama.cpp's NEOX rotation, the halves). With ``lazy``, every name and
    shape is checked and each value is a :class:`~jaxattn.checkpoint.LazyArray` dequantized when it is read.

    Raises:
      CheckpointError: a layer count other than the file's number of ``blk.N`` groups, a tensor type
        outside :data:`TENSOR_TYPES`, a missing or unexpected tensor, or a shape other than ``config``'s,
        each named.
    """
    from gguf.quants import dequantize

    path = Path(path)
    _check_blocks(config.num_hidden_layers, reader, path, "the config's num_hidden_layers")
    expected = tensor_shapes(config)
    tensors = {t.name: t for t in reader.tensors}
    for name in expected:
        if name not in tensors:
            raise CheckpointError(f"{path}: missing tensor '{name}'")
    for name, t in tensors.items():
        if name not in expected:
            raise CheckpointError(f"{path}: unexpected tensor '{name}', which this model does not use")
        kind = _type_name(t.tensor_type)
        if kind not in TENSOR_TYPES:
            raise CheckpointError(
                f"{path}: tensor '{name}' has type {kind}, which this loader does not read "
                f"(supported: {', '.join(TENSOR_TYPES)})"
            )
        shape = tuple(int(d) for d in t.shape)
        if shape != expected[name]:
            raise CheckpointError(
                f"{path}: tensor '{name}' has shape {list(shape)}, expected {list(expected[name])} "
                "(GGUF order, ne0 first)"
            )
    N, K = config.num_attention_heads, config.num_key_value_heads
    gemma3 = config.model_type == "gemma3_text"

    def read(name: str) -> np.ndarray:
        t = tensors[name]
        w = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(expected[name][::-1])  # [out, in]
        if gemma3 and name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # the file's 1 + w
        elif not gemma3 and name.split(".")[-2] in ("attn_q", "attn_k"):
            w = unpermute(w, N if ".attn_q." in name else K)
        return w

    def one(name: str) -> tuple[str, np.ndarray]:
        return torch_name(name, config.model_type), read(name)

    if lazy:
        return {torch_name(name, config.model_type): LazyArray(expected[name][::-1], np.float32,
                                                               functools.partial(read, name))
                for name in tensors}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # NumPy releases the GIL on large arrays
        return dict(pool.map(one, sorted(tensors, key=lambda n: -int(tensors[n].n_bytes))))


# ----------------------------------------------------------------------------------------------------
# The tokenizer
# ----------------------------------------------------------------------------------------------------


def _pre_tokenizer(name: str) -> Any:
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex, then bytes
    if name == "gpt-2":
        return byte_level
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])  # "smollm"


def read_tokenizer(reader: Any, path: str | os.PathLike) -> Any:
    """GPT-2-style byte-level BPE from a GGUF's ``tokenizer.ggml.*`` metadata, with the ``tokenizers`` package;
    a ``"llama"`` model (SentencePiece BPE: Gemma) is :func:`jaxattn._spm.from_gguf`'s tokenizer.

    The vocabulary (``tokens``) and ``merges`` make a ``tokenizers`` BPE model; ``pre`` chooses the
    pre-tokenizer (:data:`PRE_TOKENIZERS`); control tokens (token type 3) become special tokens, so
    ``"<|im_start|>"`` in text is one id; ``add_bos_token``/``add_eos_token`` add them around the text.

    Raises:
      CheckpointError: no tokenizer, a model other than ``gpt2`` (byte-level BPE), an unknown
        pre-tokenizer or ``tokenizer.ggml.*`` key, a malformed merge, each named.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    path = Path(path)
    meta = metadata(reader)
    if meta.get("tokenizer.ggml.model") == "llama":  # SentencePiece BPE (Gemma), tokenized as llama.cpp does
        from jaxattn import _spm

        return _spm.from_gguf(path)
    for key in sorted(k for k in meta if k.startswith("tokenizer.")):
        if key not in _TOKENIZER_KEYS and not _SPECIAL_ID.match(key) and not key.startswith("tokenizer.chat_template."):
            raise CheckpointError(f"{path}: unsupported tokenizer metadata key '{key}'")
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise CheckpointError(f"{path}: the file holds no tokenizer (metadata key 'tokenizer.ggml.model' is missing)")
    if model != "gpt2":
        raise CheckpointError(
            f"{path}: tokenizer.ggml.model is {model!r}; supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
        )
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"{path}: tokenizer.ggml.pre is {pre!r}, a pre-tokenizer this loader does not implement "
            f"(supported: {', '.join(PRE_TOKENIZERS)})"
        )
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        raise CheckpointError(f"{path}: tokenizer.ggml.add_space_prefix = true is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        missing = "tokenizer.ggml.tokens" if not tokens else "tokenizer.ggml.merges"
        raise CheckpointError(f"{path}: metadata key '{missing}' is missing")
    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"{path}: tokenizer.ggml.merges holds {m!r}, not two tokens separated by a space")
        pairs.append((parts[0], parts[1]))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens holds a token twice")
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    except Exception as e:  # tokenizers raises a bare Exception for a merge of unknown tokens
        raise CheckpointError(f"{path}: the BPE vocabulary and merges do not fit together ({e})") from None
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == 3]
    tok.add_special_tokens(special)
    around = [(key, meta.get(f"tokenizer.ggml.{key}_token_id")) for key in ("bos", "eos")
              if meta.get(f"tokenizer.ggml.add_{key}_token", False)]
    if around:
        for key, i in around:
            if i is None or not 0 <= int(i) < len(tokens):
                raise CheckpointError(f"{path}: tokenizer.ggml.add_{key}_token is set but {key}_token_id is {i!r}")
        bos = [tokens[int(i)] for key, i in around if key == "bos"]
        eos = [tokens[int(i)] for key, i in around if key == "eos"]
        single = " ".join(bos + ["$A"] + eos)
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=single + " " + " ".join(bos + ["$B"] + eos),
            special_tokens=[(tokens[int(i)], int(i)) for _, i in around],
        )
    return TextTokenizer(tok)
