"""GPT-2 as plain functions over a params pytree, on jaxattn's own multi-head causal attention.

Axis alphabet: T tokens (queries; keys are the same tokens, so S = T), N heads, H head dim (d_k),
D model width (n_embd), I MLP width (n_inner), V vocabulary, L layers, P positions (n_positions).

Params are a nested dict with the key names and orientation of Hugging Face's Flax GPT-2
(``FlaxGPT2LMHeadModel.params``), every block's weights stacked over the layers (``[L, ...]``, what the
decoder scans; :func:`jaxattn.checkpoint.stack_layers` converts Flax's per-layer ``transformer/h/{i}/...``
and ``unstack_layers`` converts back)::

    transformer/wte/embedding              [V, D]
    transformer/wpe/embedding              [P, D]
    transformer/h/ln_1/{scale,bias}        [L, D]
    transformer/h/attn/c_attn/kernel       [L, 3D, D]   (out, in): applied as x @ kernel.T
    transformer/h/attn/c_attn/bias         [L, 3D]
    transformer/h/attn/c_proj/kernel       [L, D, D]
    transformer/h/attn/c_proj/bias         [L, D]
    transformer/h/ln_2/{scale,bias}        [L, D]
    transformer/h/mlp/c_fc/{kernel,bias}   [L, I, D], [L, I]
    transformer/h/mlp/c_proj/{kernel,bias} [L, D, I], [L, D]
    transformer/ln_f/{scale,bias}          [D]

The language-model head is tied to ``wte`` (``logits = h wteᵀ``), as in every released GPT-2.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import _sharding, decoder
from jaxattn._attention import merge_heads, split_heads
from jaxattn._checks import as_float_dtype, check_int, check_positive_float32
from jaxattn._inputs import check_last_axis, check_layer
from jaxattn.decoder import Family
from jaxattn._extras import require
from jaxattn._nn import embed_ids, init_from_shapes, layer_norm
from jaxattn._typing import Array, ArrayLike, Bool, Float, Int, Real
from jaxattn.checkpoint import (CheckpointError, ConfigSchema, TextTokenizer, check_finite, check_finite_params,
    check_layer_names, check_saveable_tokenizer, check_shapes, fitting, flatten, read_config, read_msgpack,
    read_safetensors, resolve, stack_layers, unflatten, unstack_layers)
from jaxattn.io import atomic_write
from jaxattn import models
from jaxattn.models import ModelOutput, QKWeights, Sizes

__all__ = [
    "CAUSAL", "SPEC", "GPT2Config", "GPT2_SCHEMA", "SIZES", "attention_input", "check_params", "final_norm",
    "final_norm_linear", "forward",
    "generate", "head_projections", "init_params", "load", "load_tokenizer", "log_prob", "param_shapes",
    "param_shardings", "params_from_msgpack", "params_from_safetensors", "qk_weights", "random_model",
    "read_gpt2_config", "resume", "save", "shard", "sizes",
    "unembed",
]

require("models", "jaxattn.gpt2", "safetensors", "tokenizers", "huggingface_hub", "flax")


# ----------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------

# Activations GPT-2 checkpoints use; the three tanh forms are the same formula.
_ACTIVATIONS = {
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_fast": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "tanh": jnp.tanh,
}

GPT2_SCHEMA = ConfigSchema(
    required={"vocab_size": int, "n_positions": int, "n_embd": int, "n_layer": int, "n_head": int},
    optional={
        "n_inner": ((int, type(None)), None),
        "layer_norm_epsilon": (float, 1e-5),
    },
    fixed={
        "model_type": ("gpt2",),
        "activation_function": tuple(_ACTIVATIONS),
        "scale_attn_weights": (True,),
        "scale_attn_by_inverse_layer_idx": (False,),
        "add_cross_attention": (False,),
        "tie_word_embeddings": (True,),
        "is_encoder_decoder": (False,),
        "n_special": (0,),
        # PyTorch's "reorder and upcast" computes q·k in float32; jaxattn's softmax always runs in at
        # least float32 and the weights are loaded as float32, so both values give the same model.
        "reorder_and_upcast_attn": (False, True),
    },
    ignored=frozenset(
        {
            # training-only: dropout, initialisation, gradient checkpointing
            "attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_first_dropout", "initializer_range",
            "gradient_checkpointing",
            # heads of other GPT-2 classes (sequence summary, classification), not the LM
            "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
            "_num_labels", "num_labels", "id2label", "label2id", "problem_type",
            # generation and bookkeeping
            "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "output_past",
            "task_specific_params", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
            "predict_special_tokens", "n_ctx",
        }
    ),
)


class GPT2Config(NamedTuple):
    """The shape of a GPT-2 model (hashable: a static argument of the jitted forward pass)."""

    vocab_size: int  # V
    n_positions: int  # P, the longest sequence
    n_embd: int  # D
    n_layer: int  # L
    n_head: int  # N
    n_inner: int  # I, the MLP width (4 D by default)
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5

    @property
    def head_dim(self) -> int:
        """H = D / N, the paper's d_k."""
        return self.n_embd // self.n_head

    @classmethod
    def make(cls, *, vocab_size: int, n_positions: int, n_embd: int, n_layer: int, n_head: int,
             n_inner: int | None = None, activation_function: str = "gelu_new",
             layer_norm_epsilon: float = 1e-5) -> "GPT2Config":
        """A checked config; ``n_inner=None`` means ``4 * n_embd``."""
        for name, value in (("vocab_size", vocab_size), ("n_positions", n_positions), ("n_embd", n_embd),
                            ("n_layer", n_layer), ("n_head", n_head)):
            check_int(value, name)
        if n_embd % n_head != 0:
            raise ValueError(f"n_head={n_head} must divide n_embd={n_embd} (H = D / N)")
        if activation_function not in _ACTIVATIONS:
            raise ValueError(
                f"activation_function must be one of {sorted(_ACTIVATIONS)}, received {activation_function!r}"
            )
        n_inner = 4 * n_embd if n_inner is None else n_inner
        check_int(n_inner, "n_inner")
        eps = check_positive_float32(layer_norm_epsilon, "layer_norm_epsilon")  # 1e300 is inf in float32
        return cls(int(vocab_size), int(n_positions), int(n_embd), int(n_layer), int(n_head), int(n_inner),
                   activation_function, eps)


def read_gpt2_config(path: str | Path) -> GPT2Config:
    """A :class:`GPT2Config` from a ``config.json``; unsupported fields raise :class:`CheckpointError`."""
    raw = read_config(path, GPT2_SCHEMA)
    try:
        return GPT2Config.make(
            vocab_size=raw["vocab_size"], n_positions=raw["n_positions"], n_embd=raw["n_embd"],
            n_layer=raw["n_layer"], n_head=raw["n_head"], n_inner=raw["n_inner"],
            activation_function=raw.get("activation_function", "gelu_new"),
            layer_norm_epsilon=raw["layer_norm_epsilon"],
        )
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


_LAYERS = "transformer/h"  # where the blocks sit


def param_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """``{"transformer/h/attn/c_attn/kernel": (L, 3D, D), ...}``: every weight, blocks stacked (module docstring)."""
    L, head = config.n_layer, _LAYERS + "/0/"
    return {(_LAYERS + "/" + k[len(head):] if k.startswith(head) else k): ((L, *v) if k.startswith(head) else v)
            for k, v in _flax_shapes(config).items() if k.startswith(head) or not k.startswith(_LAYERS + "/")}


def _flax_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """``{"transformer/h/0/attn/c_attn/kernel": (3D, D), ...}``: every weight in Flax's per-layer layout."""
    V, P, D, I = config.vocab_size, config.n_positions, config.n_embd, config.n_inner
    shapes = {"transformer/wte/embedding": (V, D), "transformer/wpe/embedding": (P, D)}
    for i in range(config.n_layer):
        h = f"transformer/h/{i}"
        shapes.update({
            f"{h}/ln_1/scale": (D,), f"{h}/ln_1/bias": (D,),
            f"{h}/attn/c_attn/kernel": (3 * D, D), f"{h}/attn/c_attn/bias": (3 * D,),
            f"{h}/attn/c_proj/kernel": (D, D), f"{h}/attn/c_proj/bias": (D,),
            f"{h}/ln_2/scale": (D,), f"{h}/ln_2/bias": (D,),
            f"{h}/mlp/c_fc/kernel": (I, D), f"{h}/mlp/c_fc/bias": (I,),
            f"{h}/mlp/c_proj/kernel": (D, I), f"{h}/mlp/c_proj/bias": (D,),
        })
    shapes.update({"transformer/ln_f/scale": (D,), "transformer/ln_f/bias": (D,)})
    return shapes


def init_params(seed: int, config: GPT2Config) -> dict:
    """Random float32 params as GPT-2 initialises them: weights ``N(0, 0.02²)``, zero biases, unit LN scales.

    Drawn with NumPy (``numpy.random.default_rng(seed)``), so that building even a GPT-2-small-sized
    model compiles nothing.
    """
    return unflatten(stack_layers(flatten(init_from_shapes(seed, _flax_shapes(config), ones=("scale",))), _LAYERS))


# The released GPT-2 shapes (vocabulary aside): layers, heads, width, positions.
SIZES = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, n_positions=128),
    "small": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024),  # gpt2
    "medium": dict(n_layer=24, n_head=16, n_embd=1024, n_positions=1024),  # gpt2-medium
    "large": dict(n_layer=36, n_head=20, n_embd=1280, n_positions=1024),  # gpt2-large
    "xl": dict(n_layer=48, n_head=25, n_embd=1600, n_positions=1024),  # gpt2-xl
}


# What :func:`random_model` trains its tokenizer on when given no texts (byte-level: any text encodes).
_DEFAULT_TEXTS = (
    "The trophy didn't fit in the suitcase because it was too big.",
    "The trophy didn't fit in the suitcase because it was too small.",
    'In that sentence, "it" refers to the trophy or the suitcase.',
    "The quick brown fox jumps over the lazy dog.",
)


def random_model(size: str = "small", *, seed: int = 0, texts: Any = None) -> tuple[dict, GPT2Config, TextTokenizer]:
    """A RANDOM GPT-2 of a released size with a byte-level BPE trained on ``texts`` (default: a few
    English sentences): ``(params, config, tokenizer)`` like :func:`load`, for running code offline.

    Its attention maps come from random weights (``N(0, 0.02²)``), not from a trained model.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, received {size!r}")
    if texts is None:
        texts = _DEFAULT_TEXTS
    tokenizer = TextTokenizer.train_byte_level_bpe(texts, vocab_size=512)
    config = GPT2Config.make(vocab_size=tokenizer.vocab_size, **SIZES[size])
    return init_params(seed, config), config, tokenizer


# ----------------------------------------------------------------------------------------------------
# Loading weights
# ----------------------------------------------------------------------------------------------------

# PyTorch GPT-2 (Conv1D) names -> Flax names; buffers that are not parameters.
_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")  # the old causal-mask buffers


def _torch_name(flax_key: str) -> tuple[str, bool]:
    """The safetensors key of a Flax key, and whether the array is transposed between the two."""
    parts = flax_key.split("/")[1:]  # drop "transformer"
    leaf = parts[-1]
    if leaf == "embedding":
        return ".".join(parts[:-1] + ["weight"]), False
    if leaf == "scale":
        return ".".join(parts[:-1] + ["weight"]), False
    if leaf == "kernel":
        return ".".join(parts[:-1] + ["weight"]), True  # Conv1D stores (in, out), Flax (out, in)
    return ".".join(parts), False


def params_from_safetensors(path: str | Path, config: GPT2Config) -> dict:
    """Params (Flax layout) from a PyTorch GPT-2 ``model.safetensors`` (Conv1D kernels ``(in, out)``).

    Keys may carry a ``transformer.`` prefix (saved from ``GPT2LMHeadModel``) or not (``GPT2Model``);
    the causal-mask buffers ``h.{i}.attn.bias``/``masked_bias`` are skipped; an ``lm_head.weight`` must
    equal ``wte`` (GPT-2's head is tied). Float32.
    """
    return _from_safetensors(path, config, _sharding.placer(jnp.float32))


def _from_safetensors(path: str | Path, config: GPT2Config, place: Any) -> dict:
    """:func:`params_from_safetensors`, read one tensor at a time, each handed to ``place(key, float32 array)``."""
    raw = read_safetensors(path, lazy=True)
    arrays: dict[str, np.ndarray] = {}
    lm_head = None
    for key, value in raw.items():
        name = key[len("transformer."):] if key.startswith("transformer.") else key
        if _BUFFER.match(name):
            continue
        if name == "lm_head.weight":
            lm_head = value
            continue
        if name in arrays:
            raise CheckpointError(f"{path}: weight '{name}' appears twice (with and without 'transformer.')")
        arrays[name] = value
    check_layer_names(arrays, config.n_layer, path, field="n_layer", pattern=r"h\.(\d+)\.")  # before the tables
    table = {flax_key: _torch_name(flax_key) for flax_key in _flax_shapes(config)}
    expected = {t: (shape[::-1] if transposed else shape)
                for (flax_key, shape), (t, transposed) in zip(_flax_shapes(config).items(), table.values())}
    check_shapes(arrays, expected, path, kernel_layout="(in, out) (PyTorch Conv1D)")
    if lm_head is not None and not np.array_equal(lm_head, arrays["wte.weight"]):
        raise CheckpointError(
            f"{path}: weight 'lm_head.weight' differs from 'wte.weight'; untied GPT-2 heads are not supported"
        )
    def convert(flax_key: str) -> np.ndarray:
        t, transposed = table[flax_key]
        a = np.asarray(arrays[t], np.float32)
        a = np.ascontiguousarray(a.T) if transposed else a
        check_finite({t: a}, path)  # the file's name for it
        return a

    return unflatten(decoder.place_stacked(list(table), convert, place, _LAYERS, workers=1))


def params_from_msgpack(path: str | Path, config: GPT2Config) -> dict:
    """Params from a Hugging Face Flax ``flax_model.msgpack`` (kernels ``(out, in)``), every shape checked.

    A file saved from ``FlaxGPT2Model`` (no ``transformer`` level) is accepted too. Float32.
    """
    return _from_msgpack(path, config, _sharding.placer(jnp.float32))


def _from_msgpack(path: str | Path, config: GPT2Config, place: Any) -> dict:
    tree = read_msgpack(path)
    if "transformer" not in tree and "wte" in tree:
        tree = {"transformer": tree}
    flat = flatten(tree)
    check_layer_names(flat, config.n_layer, path, field="n_layer", pattern=r"transformer/h/(\d+)/")  # before the table
    check_shapes(flat, _flax_shapes(config), path, kernel_layout="(out, in) (Hugging Face Flax)")

    def convert(key: str) -> np.ndarray:  # the file is read whole; converted and placed a stacked weight at a time
        a = np.asarray(flat[key], np.float32)
        check_finite({key: a}, path)
        return a

    return unflatten(decoder.place_stacked(list(flat), convert, place, _LAYERS, workers=1))


def load_tokenizer(files: dict[str, Path], config: GPT2Config) -> TextTokenizer:
    """GPT-2's byte-level BPE tokenizer from ``tokenizer.json`` or ``vocab.json`` + ``merges.txt``."""
    if "tokenizer.json" in files:
        tok = TextTokenizer.from_file(files["tokenizer.json"])
        source = files["tokenizer.json"]
    else:
        tok = TextTokenizer.from_bpe_files(files["vocab.json"], files["merges.txt"])
        source = files["vocab.json"]
    if tok.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{source}: the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
            f"{config.vocab_size}; they do not belong together"
        )
    return tok


def load(name_or_path: str | Path, *, dtype: Any = jnp.float32, mesh: Any = None, model_axis: str | None = "model",
         split_vocab: bool = False) -> tuple[dict, GPT2Config, TextTokenizer]:
    """Load a GPT-2 checkpoint: ``(params, config, tokenizer)``.

    Args:
      name_or_path: a local directory, or a Hugging Face hub id (``gpt2``, ``gpt2-medium``,
        ``openai-community/gpt2-large``) fetched through ``huggingface_hub`` (progress bar, cache). The
        directory needs ``config.json``, ``model.safetensors`` (preferred) or ``flax_model.msgpack``,
        and ``tokenizer.json`` or ``vocab.json`` + ``merges.txt``. No PyTorch, no transformers.
      dtype: the params' dtype, float32 by default whatever the file holds (each weight is checked in
        float32, then cast, as :func:`jaxattn.checkpoint.cast_params` casts); a weight holding a value the
        dtype cannot (1e5 in float16) is refused by name, never loaded as inf.
      mesh: a ``jax.sharding.Mesh``: each weight goes straight to its shards of :func:`shard` as it is read
        (safetensors one tensor at a time; a msgpack file is read whole first). ``None``: the default device.
      model_axis, split_vocab: as in :func:`shard`, with ``mesh``.

    Returns:
      ``(params, config, tokenizer)``: params in the Flax layout (``dtype``), a :class:`GPT2Config`, and
      a :class:`~jaxattn.checkpoint.TextTokenizer`.

    Raises:
      CheckpointError (a ``ValueError``): naming the file and the key at fault; offline with nothing
        cached, one message saying how to point at a local directory.
    """
    _sharding.placer(as_float_dtype(dtype))  # a dtype it cannot cast to is refused before any file is read
    files = resolve(
        name_or_path,
        required=["config.json"],
        any_of=[["model.safetensors", "flax_model.msgpack"], ["tokenizer.json", ("vocab.json", "merges.txt")]],
    ).files
    config = read_gpt2_config(files["config.json"])
    place = _sharding.placer(dtype, None if mesh is None else _layout(
        config, mesh, model_axis=model_axis, split_vocab=split_vocab, where="jaxattn.gpt2.load"))
    source = files["model.safetensors" if "model.safetensors" in files else "flax_model.msgpack"]
    place = fitting(place, dtype, source)  # refuses a weight dtype cannot hold (1e5 in float16)
    if "model.safetensors" in files:
        params = _from_safetensors(source, config, place)
    else:
        params = _from_msgpack(source, config, place)
    tokenizer = load_tokenizer(files, config)
    return params, config, tokenizer


# ----------------------------------------------------------------------------------------------------
# The forward pass: GPT-2's pieces of the shared decoder (picoGPT style: one small function per idea)
# ----------------------------------------------------------------------------------------------------


def _linear(x: Array, p: dict) -> Array:
    return x @ p["kernel"].T + p["bias"][None]  # [T, out]; the kernel is stored (out, in)


def _embed(params: dict, config: GPT2Config, ids: Array, pos: Array) -> Array:
    tr = params["transformer"]
    return embed_ids(tr["wte"]["embedding"], ids) + tr["wpe"]["embedding"][pos]  # [T, D]; NaN rows for bad ids


def _qkv(p: dict, config: GPT2Config, x: Array, rot: None, d: Any) -> tuple[Array, Array, Array]:
    h = layer_norm(x, **p["ln_1"], eps=config.layer_norm_epsilon)  # [T, D]
    q, k, v = jnp.split(_linear(h, p["attn"]["c_attn"]), 3, axis=-1)  # 3 x [T, D]
    return tuple(split_heads(a, config.n_head) for a in (q, k, v))  # 3 x [T, N, H]


def _attn_out(p: dict, config: GPT2Config, z: Array, d: Any) -> Array:
    return _linear(merge_heads(z), p["attn"]["c_proj"])  # [T, N, H] -> [T, D]


def _mlp(p: dict, config: GPT2Config, x: Array, d: Any) -> Array:
    h = layer_norm(x, **p["ln_2"], eps=config.layer_norm_epsilon)  # [T, D]
    act = _ACTIVATIONS[config.activation_function]
    return _linear(act(_linear(h, p["mlp"]["c_fc"])), p["mlp"]["c_proj"])  # [T, I] -> [T, D]


def final_norm(params: dict, config: GPT2Config, x: Array) -> Array:
    """``ln_f(x)``, ``x [..., D]``: the final LayerNorm, between the last block and :func:`unembed`."""
    return layer_norm(x, **params["transformer"]["ln_f"], eps=config.layer_norm_epsilon)


def final_norm_linear(params: dict, config: GPT2Config, x: Array, v: Array) -> Array:
    """``ln_f`` linearised at the stream ``x [..., D]`` and applied to a part ``v [..., D]`` of it, without
    its bias: ``(v - mean(v)) / sqrt(var(x) + eps) · scale``, the standard deviation frozen at ``x``'s.

    Linear in ``v``; the parts of ``x`` add up to ``final_norm(x) - bias`` (direct logit attribution)."""
    ln = params["transformer"]["ln_f"]
    lead = (1,) * (x.ndim - 1)
    inv = jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + config.layer_norm_epsilon)  # [..., 1], frozen
    return (v - jnp.mean(v, axis=-1, keepdims=True)) * inv * ln["scale"].reshape(lead + ln["scale"].shape)


def unembed(params: dict, config: GPT2Config, x: Array) -> Array:
    """``x wteᵀ``, ``[..., D] -> [..., V]``: the language-model head, tied to the token embedding (``x``'s
    width checked)."""
    x = check_last_axis(x, config.n_embd)
    return x @ params["transformer"]["wte"]["embedding"].T


def sizes(config: GPT2Config) -> Sizes:
    """The protocol's :class:`~jaxattn.models.Sizes` of a GPT-2 config (K = N: no grouping)."""
    return Sizes(layers=config.n_layer, heads=config.n_head, kv_heads=config.n_head, head_dim=config.head_dim,
                 width=config.n_embd, vocab=config.vocab_size, max_length=config.n_positions, mlp=config.n_inner)


CAUSAL = True  # query t sees keys s <= t

_FAMILY = Family(
    name="jaxattn.gpt2", config_type=GPT2Config, sizes=sizes, check_params=lambda p, c: check_params(p, c),
    blocks=lambda params: params["transformer"]["h"], embed=_embed, rotation=lambda c, pos, n: None,
    qkv=_qkv, attn_out=_attn_out, mlp=_mlp, final_norm=final_norm, unembed=unembed,
    max_name="n_positions",
)

def forward(
    params: Any,
    config: GPT2Config,
    input_ids: Int[ArrayLike, "T"],
    *,
    attention_mask: Int[ArrayLike, "T"] | Bool[ArrayLike, "T"] | None = None,
    head_mask: Real[ArrayLike, "L N"] | None = None,
    scale: Real[ArrayLike, ""] | None = None,
    return_attention_logits: bool = False,
    return_qkv: bool = False,
    return_hidden_states: bool = False,
    capture: Sequence[str] = (),
    patch: Mapping[str, tuple[ArrayLike, ArrayLike]] | None = None,
) -> ModelOutput:
    return decoder.forward(_FAMILY, params, config, input_ids, attention_mask=attention_mask, head_mask=head_mask,
                           scale=scale, return_attention_logits=return_attention_logits, return_qkv=return_qkv,
                           return_hidden_states=return_hidden_states, capture=capture, patch=patch)


def log_prob(
    params: Any,
    config: GPT2Config,
    input_ids: Int[ArrayLike, "T"],
    *,
    attention_mask: Int[ArrayLike, "T"] | Bool[ArrayLike, "T"] | None = None,
    start: Int[ArrayLike, ""] = 0,
    end: Int[ArrayLike, ""] | None = None,
    scale: Real[ArrayLike, ""] | None = None,
) -> Float[Array, ""]:
    return decoder.log_prob(_FAMILY, params, config, input_ids, attention_mask=attention_mask, start=start, end=end,
                            scale=scale)


def generate(
    params: Any,
    config: GPT2Config,
    prompt_ids: Int[ArrayLike, "T"],
    *,
    max_new_tokens: int,
    attention_mask: Int[ArrayLike, "T"] | Bool[ArrayLike, "T"] | None = None,
    head_mask: Real[ArrayLike, "L N"] | None = None,
    temperature: Any = 0.0,
    key: Any = None,
    scale: Real[ArrayLike, ""] | None = None,
    return_logits: bool = False,
) -> Int[Array, "T_new"] | tuple[Int[Array, "T_new"], Float[Array, "new V"]]:
    return decoder.generate(_FAMILY, params, config, prompt_ids, max_new_tokens=max_new_tokens,
                            attention_mask=attention_mask, head_mask=head_mask, temperature=temperature, key=key,
                            scale=scale, return_logits=return_logits)


def resume(
    params: Any,
    config: GPT2Config,
    resid_pre: Float[ArrayLike, "T D"],
    layer: Int[ArrayLike, ""],
    *,
    attention_mask: Int[ArrayLike, "T"] | Bool[ArrayLike, "T"] | Bool[ArrayLike, "T T"] | None = None,
    positions: Int[ArrayLike, "T"] | None = None,
    head_mask: Real[ArrayLike, "L N"] | None = None,
    scale: Real[ArrayLike, ""] | None = None,
    patch: Mapping[str, tuple[ArrayLike, ArrayLike]] | None = None,
    attentions: Float[ArrayLike, "L N T T"] | None = None,
) -> ModelOutput:
    return decoder.resume(_FAMILY, params, config, resid_pre, layer, attention_mask=attention_mask,
                          positions=positions, head_mask=head_mask, scale=scale, patch=patch, attentions=attentions)


_DOC = dict(title="GPT-2's", config='GPT2Config', formula='``h₀ = wte[ids] + wpe[positions]``; each block ``h += attn(ln_1(h))``, ``h += mlp(ln_2(h))`` with causal multi-head attention ``softmax(scale · q kᵀ) v`` from :func:`jaxattn.multi_head_attention`; ``logits = ln_f(h) wteᵀ``.')
decoder.document(forward, decoder.FORWARD_DOC, _FAMILY, **_DOC)
decoder.document(log_prob, decoder.LOG_PROB_DOC, _FAMILY, **_DOC)
decoder.document(generate, decoder.GENERATE_DOC, _FAMILY, **_DOC)
decoder.document(resume, decoder.RESUME_DOC, _FAMILY, **_DOC)


def attention_input(params: dict, config: GPT2Config, layer: int, x: Array) -> Array:
    """``ln_1`` of block ``layer`` on the residual stream ``x [T, D]``: what its q, k, v are projected from.

    ``layer``, an int in ``[0, L)``, and ``x``'s width are checked (``ValueError`` naming them)."""
    layer = check_layer(layer, config.n_layer)
    x = check_last_axis(x, config.n_embd)
    ln_1 = params["transformer"]["h"]["ln_1"]
    return layer_norm(x, ln_1["scale"][layer], ln_1["bias"][layer], eps=config.layer_norm_epsilon)


def head_projections(params: dict, config: GPT2Config) -> Array:
    """``[L, N, H, D]``: each head's rows of ``c_proj`` (``attn_out = Σ_n z[:, n] @ W[n] + c_proj.bias``)."""
    L, N, H, D = config.n_layer, config.n_head, config.head_dim, config.n_embd
    w = params["transformer"]["h"]["attn"]["c_proj"]["kernel"]  # [L, D, N·H] (out, in)
    return jnp.transpose(w, (0, 2, 1)).reshape(L, N, H, D)


def qk_weights(params: dict, config: GPT2Config) -> QKWeights:
    """Every head's ``W_Q [L, N, D, H]``, ``b_q``, ``W_K``, ``b_k`` on its input (:func:`attention_input`)."""
    L, N, H, D = config.n_layer, config.n_head, config.head_dim, config.n_embd
    c_attn = params["transformer"]["h"]["attn"]["c_attn"]
    w = jnp.transpose(c_attn["kernel"], (0, 2, 1)).reshape(L, D, 3, N, H)  # [L, D, 3, N, H] (in, out)
    b = c_attn["bias"].reshape(L, 3, N, H)
    w_q, w_k = (jnp.transpose(w[:, :, j], (0, 2, 1, 3)) for j in (0, 1))  # 2 x [L, N, D, H]
    return QKWeights(w_q, b[:, 0], w_k, False, float(config.head_dim) ** -0.5, b[:, 1])


SPEC = models.ModelSpec(
    name="jaxattn.gpt2", causal=CAUSAL, forward=forward, sizes=sizes, final_norm=final_norm, unembed=unembed,
    final_norm_linear=final_norm_linear, attention_input=attention_input, head_projections=head_projections,
    qk_weights=qk_weights, resume=resume, log_prob=log_prob,
)  # the model protocol, declared (jaxattn.models.ModelSpec)


# Megatron-style: each weight's dim split over the mesh's model axis (the rest replicated); :func:`shard`.
# Kernels are (out, in). c_attn's rows are q, k, v one after the other, so a device's block of rows is
# not whole heads of all three; the forward regroups them into heads (jnp.split of the fused output).
_SPLITS = {
    "attn/c_attn/kernel": (_sharding.HEADS, None), "attn/c_attn/bias": (_sharding.HEADS,),
    "attn/c_proj/kernel": (None, _sharding.HEADS),
    "mlp/c_fc/kernel": (_sharding.MLP, None), "mlp/c_fc/bias": (_sharding.MLP,),
    "mlp/c_proj/kernel": (None, _sharding.MLP),
    "wte/embedding": (_sharding.VOCAB, None),
}


def _split_counts(config: GPT2Config) -> dict[str, tuple[str, int]]:
    return {_sharding.HEADS: ("n_head", config.n_head), _sharding.MLP: ("n_inner", config.n_inner),
            _sharding.VOCAB: ("vocab_size", config.vocab_size)}


shard, param_shardings, _layout = _sharding.public_api(
    "jaxattn.gpt2", param_shapes=lambda c: param_shapes(c), check_params=lambda p, c: check_params(p, c),
    rules=_SPLITS, counts=_split_counts,
    what="``c_attn`` (q, k, v) and ``c_fc`` are split over ``model_axis`` by output rows (column-parallel), the "
         "attention's and the MLP's ``c_proj`` by input columns (row-parallel), so ``model_axis``'s size must "
         "divide ``n_head`` and ``n_inner``. ``c_attn`` stores q, k and v one after the other: a device's block "
         "of its rows is not whole heads of all three, and the forward regroups them into heads.",
)


def check_params(params: Any, config: GPT2Config) -> None:
    """Raise ``ValueError`` naming the key whose shape (Flax GPT-2 names, kernels ``(out, in)``, blocks stacked
    ``[L, ...]``) does not match ``config``, or that is missing; shapes and dtypes only, so traced params (``jit``, ``grad``) pass."""
    decoder.check_config(_FAMILY, config)
    decoder.check_stacked(params, _LAYERS, config.n_layer, field="n_layer",
                           layout="Flax GPT-2 names, blocks stacked")  # before the table of every weight
    decoder.check_tree(params, param_shapes(config), root="transformer", kernel_layout="(out, in)",
                        layout="Flax GPT-2 names, blocks stacked")


# ----------------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------------


def save(directory: str | Path, params: dict, config: GPT2Config, tokenizer: TextTokenizer | None = None, *,
         format: str = "safetensors") -> Path:
    """Write a checkpoint in Hugging Face's layout that :func:`load` (and ``transformers``) reads.

    ``config.json``; the weights as ``model.safetensors`` (PyTorch ``GPT2LMHeadModel`` names, Conv1D
    kernels ``(in, out)``) or ``flax_model.msgpack`` (``FlaxGPT2LMHeadModel``, kernels ``(out, in)``),
    in the params' dtype; and, if given, ``tokenizer.json``. Each file is written atomically, and
    ``load(save(...))`` returns the same params when a tokenizer was saved (:func:`load` needs one). A
    folder that already holds ``model.safetensors`` is refused for ``format="msgpack"`` (``ValueError``,
    before anything is written): :func:`load` reads that file first, so the new weights would not be the
    ones loaded. Params holding NaN or Inf are refused by name (``ValueError``, before anything is
    written): :func:`load` refuses such a file.
    """
    if format not in ("safetensors", "msgpack"):
        raise ValueError(f"format must be 'safetensors' or 'msgpack', received {format!r}")
    decoder.check_config(_FAMILY, config)
    check_params(params, config)
    check_finite_params(params)
    check_saveable_tokenizer(tokenizer)
    directory = Path(directory)
    if format == "msgpack" and (directory / "model.safetensors").exists():
        raise ValueError(f"directory {str(directory)!r} already holds model.safetensors, which load reads before "
                         f"flax_model.msgpack: remove it, or save with format='safetensors'")
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], **config._asdict()}
    flat = {k: np.asarray(v) for k, v in unstack_layers(flatten(params), _LAYERS).items()}
    if format == "safetensors":
        from safetensors.numpy import save as save_safetensors

        tensors = {}
        for flax_key, value in flat.items():
            name, transposed = _torch_name(flax_key)
            tensors["transformer." + name] = np.ascontiguousarray(value.T if transposed else value)
        atomic_write(directory / "model.safetensors", save_safetensors(tensors, metadata={"format": "pt"}))
    else:
        from flax import serialization

        atomic_write(directory / "flax_model.msgpack", serialization.msgpack_serialize(unflatten(flat)))
    atomic_write(directory / "config.json", json.dumps(cfg, indent=2) + "\n")
    if tokenizer is not None:
        atomic_write(directory / "tokenizer.json", tokenizer.backend.to_str())
    return directory
