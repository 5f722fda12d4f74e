"""Tiny Llama-architecture checkpoints built locally for the tests (no download).

* Hugging Face directories: ``config.json`` from transformers' own config classes (Llama, Mistral, Qwen2, Qwen3, Gemma),
  ``model.safetensors`` in PyTorch names and orientation written here with NumPy, a ``tokenizer.json``;
* GGUF files written with ``gguf.GGUFWriter`` the way llama.cpp's ``convert_hf_to_gguf.py`` writes a
  llama model: its names, its ``ne`` order, q and k rows permuted for llama.cpp's RoPE (``permute`` below,
  copied from the converter), the tokenizer as ``tokenizer.ggml.*`` metadata;
* the Flax reference, ``FlaxLlamaForCausalLM`` (transformers 4.x) on the same weights.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from unittest import mock

import jax
import numpy as np

from jaxattn import llama
from jaxattn.checkpoint import flatten, stack_layers, unflatten, unstack_layers
from layouts import per_layer_shapes


def random_params(seed: int, config: llama.LlamaConfig) -> dict:
    """Params (jaxattn's layout: blocks stacked) with EVERY leaf random (norm weights ``1 + 0.2 N(0, 1)``,
    biases too), so that parity tests exercise each weight; drawn block by block in Hugging Face's order."""
    rng = np.random.default_rng(seed)
    flat = {}
    for name, shape in per_layer_shapes(llama.param_shapes(config), "model/layers").items():
        base = 1.0 if name.endswith("norm/weight") else 0.0  # every RMSNorm: the blocks', the final, q/k (Qwen3)
        flat[name] = (base + 0.2 * rng.standard_normal(shape)).astype(np.float32)
    return unflatten(stack_layers(flat, "model/layers"))


# ----------------------------------------------------------------------------------------------------
# Hugging Face layout
# ----------------------------------------------------------------------------------------------------


def torch_layout(params: dict) -> dict[str, np.ndarray]:
    """Flax Llama params as PyTorch ``LlamaForCausalLM`` tensors, written out by hand: ``nn.Linear``
    weights ``[out, in]`` (the Flax kernel transposed), RMSNorm ``weight``, ``embed_tokens.weight``."""
    out = {}
    for key, value in unstack_layers(flatten(params), "model/layers").items():
        *parts, leaf = key.split("/")
        value = np.asarray(value)
        if leaf == "kernel":
            out[".".join(parts) + ".weight"] = np.ascontiguousarray(value.T)
        elif leaf == "embedding":
            out[".".join(parts) + ".weight"] = value
        else:
            out[".".join(parts) + "." + leaf] = value
    return out


def hf_config(config: llama.LlamaConfig):
    """transformers' config object of ``config.model_type`` with the same fields."""
    import transformers

    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
    )
    if config.model_type == "llama":
        return transformers.LlamaConfig(attention_bias=config.qkv_bias, head_dim=config.head_dim, **common)
    if config.model_type == "mistral":
        return transformers.MistralConfig(sliding_window=config.sliding_window, head_dim=config.head_dim, **common)
    if config.model_type == "qwen3":
        return transformers.Qwen3Config(head_dim=config.head_dim, attention_bias=False, **common)
    if config.model_type == "gemma":
        return transformers.GemmaConfig(head_dim=config.head_dim, hidden_act=config.hidden_act,
                                        hidden_activation=config.hidden_act, **common)
    return transformers.Qwen2Config(**common)


def save_hf(directory: Path, params: dict, config: llama.LlamaConfig, tokenizer=None) -> Path:
    """``config.json`` (transformers' ``to_json_string``), ``model.safetensors`` (:func:`torch_layout`) and,
    with a ``tokenizers`` tokenizer, ``tokenizer.json``."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(hf_config(config).to_json_string())
    save_file(torch_layout(params), str(directory / "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def edit_config(directory: Path, **changes) -> None:
    path = Path(directory) / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _sinusoidal(theta: float):
    """transformers' ``create_sinusoidal_positions`` with base ``theta`` in place of its fixed 10000."""

    def table(num_pos, dim):
        inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2) / dim))
        freqs = np.einsum("i , j -> i j", np.arange(num_pos), inv_freq).astype("float32")
        emb = np.concatenate((freqs, freqs), axis=-1)
        out = np.concatenate((np.sin(emb)[:, None, :], np.cos(emb)[:, None, :]), axis=-1)
        return jax.numpy.array(out[:, :, :num_pos])

    return table


def hf_model(params: dict, config: llama.LlamaConfig):
    """``FlaxLlamaForCausalLM`` on ``params`` (copied, the blocks unstacked into Flax's per-layer layout).

    The Flax Llama of transformers 4.57 has no tied head (its ``lm_head`` gets the embedding's transpose),
    has one ``attention_bias`` for q, k, v AND o (a model without an o bias gets zeros), and builds its
    RoPE table with base 10000 whatever ``rope_theta`` says: :func:`hf_run` rebuilds the table with the
    same formula at the config's theta (``_sinusoidal``). Hugging Face's code relies on NumPy rank
    promotion, which the suite forbids for jaxattn: it is allowed only around calls into transformers.
    """
    import transformers

    hf = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, attention_bias=config.qkv_bias or config.o_bias,
    )
    with jax.numpy_rank_promotion("allow"):
        model = transformers.FlaxLlamaForCausalLM(hf, _do_init=False)
    flat = {k: np.asarray(v) for k, v in unstack_layers(flatten(params), "model/layers").items()}
    if config.tie_word_embeddings:
        flat["lm_head/kernel"] = flat["model/embed_tokens/embedding"].T
    if config.qkv_bias != config.o_bias:
        for i in range(config.num_hidden_layers):
            flat[f"model/layers/{i}/self_attn/o_proj/bias"] = np.zeros((config.hidden_size,), np.float32)
    model.params_ = unflatten(flat)
    model.theta_ = config.rope_theta
    # Eager: on models this small, op by op is quicker than compiling the whole program.
    model.run_ = lambda p, ids, mask: model(ids, attention_mask=mask, params=p, output_attentions=True,
                                            output_hidden_states=True)
    return model


@contextlib.contextmanager
def _hf_context(theta: float):
    from transformers.models.llama import modeling_flax_llama

    with jax.numpy_rank_promotion("allow"), mock.patch.object(modeling_flax_llama, "create_sinusoidal_positions",
                                                              _sinusoidal(theta)):
        yield


def hf_run(model, ids, mask=None):
    """``(logits [T, V], attentions [L, N, T, T], hidden_states [L + 1, T, D])`` from Hugging Face."""
    ids = np.asarray(ids)[None]
    mask = np.ones_like(ids) if mask is None else np.asarray(mask)[None].astype(np.int32)
    with _hf_context(model.theta_):
        out = model.run_(model.params_, ids, mask)
    return (np.asarray(out.logits[0]), np.stack([np.asarray(a[0]) for a in out.attentions]),
            np.stack([np.asarray(h[0]) for h in out.hidden_states]))


# ----------------------------------------------------------------------------------------------------
# GGUF, as llama.cpp's converter writes a llama model
# ----------------------------------------------------------------------------------------------------

_GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """``LlamaModel.permute`` of llama.cpp's ``convert_hf_to_gguf.py``, on NumPy arrays."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def gguf_tensors(params: dict, config: llama.LlamaConfig, *, permuted: bool = True) -> dict[str, np.ndarray]:
    """``{gguf name: float32 [out, in]}``; q and k (weights and biases) permuted as the converter does."""
    N, K = config.num_attention_heads, config.num_key_value_heads
    out = {}
    for name, value in torch_layout(params).items():
        if name.startswith("model.layers."):
            _, _, i, *mid, leaf = name.split(".")
            key = f"blk.{i}.{_GGUF_NAMES['.'.join(mid)]}.{leaf}"
        else:
            *mid, leaf = name.split(".")
            key = f"{_GGUF_NAMES['.'.join(mid)]}.{leaf}"
        if permuted and ".self_attn.q_proj." in name:
            value = permute(value, N, N)
        elif permuted and ".self_attn.k_proj." in name:
            value = permute(value, N, K)
        out[key] = np.ascontiguousarray(value, np.float32)
    return out


def tokenizer_metadata(tokenizer, *, pre: str = "gpt-2") -> dict:
    """``tokenizer.ggml.*`` metadata of a ``tokenizers`` byte-level BPE: tokens by id, merges, types."""
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if i in special else 1 for i in range(len(tokens))],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
    }


def llama_metadata(config: llama.LlamaConfig) -> dict:
    """``general.architecture`` and the ``llama.*`` keys of ``config``, as the converter writes them."""
    return {
        "general.architecture": "llama",
        "llama.block_count": config.num_hidden_layers,
        "llama.context_length": config.max_position_embeddings,
        "llama.embedding_length": config.hidden_size,
        "llama.feed_forward_length": config.intermediate_size,
        "llama.attention.head_count": config.num_attention_heads,
        "llama.attention.head_count_kv": config.num_key_value_heads,
        "llama.rope.freq_base": config.rope_theta,
        "llama.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        "llama.vocab_size": config.vocab_size,
        "llama.rope.dimension_count": config.head_dim,
    }


def write_gguf(path: Path, metadata: dict, tensors: dict, *, types: dict | None = None) -> Path:
    """Write a GGUF file: ``metadata`` ``{key: value}`` (ints as uint32, floats as float32), ``tensors``
    ``{name: float32 [out, in]}`` stored as ``types[name]`` (a ``GGMLQuantizationType`` name, F32 when
    absent; a uint8 array holds that type's raw blocks; another integer array is stored as it is)."""
    import gguf

    types = types or {}
    metadata = dict(metadata)
    w = gguf.GGUFWriter(str(path), metadata.pop("general.architecture"))
    for key, value in metadata.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, value in tensors.items():
        kind = types.get(name, "F32")
        if value.dtype == np.uint8:
            w.add_tensor(name, value, raw_dtype=gguf.GGMLQuantizationType[kind])
        elif not np.issubdtype(value.dtype, np.floating) or kind == "F32":
            w.add_tensor(name, value)
        elif kind == "F16":
            w.add_tensor(name, value.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def save_gguf(path: Path, params: dict, config: llama.LlamaConfig, tokenizer, *, pre: str = "gpt-2",
              types: dict | None = None, permuted: bool = True) -> Path:
    """A llama GGUF of ``params`` with ``tokenizer``'s vocabulary (see :func:`write_gguf`)."""
    meta = {**llama_metadata(config), **tokenizer_metadata(tokenizer, pre=pre)}
    return write_gguf(path, meta, gguf_tensors(params, config, permuted=permuted), types=types)
