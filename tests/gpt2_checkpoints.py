"""Tiny GPT-2 checkpoints built locally for the tests (no download): Hugging Face Flax models saved with
``save_pretrained``, the same weights written as PyTorch-layout safetensors with NumPy, and a small
byte-level BPE tokenizer trained here with the ``tokenizers`` package."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from jaxattn.checkpoint import unflatten
from layouts import per_layer_shapes

TROPHY_CORPUS = [
    "The trophy didn't fit in the suitcase because it was too big.",
    "The trophy didn't fit in the suitcase because it was too small.",
    "The trophy was too big for the suitcase, and the suitcase was too small for the trophy.",
    "It was the trophy. It was the suitcase. The cat sat on the mat because it was tired.",
]


def train_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer (GPT-2's scheme, no prefix space) trained on a few sentences."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(TROPHY_CORPUS * 4, vocab_size=vocab_size, min_frequency=1,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    return tok


def random_params(seed: int, **config) -> dict:
    """Random GPT-2 params in Hugging Face's per-layer Flax layout (``FlaxGPT2LMHeadModel``'s) with EVERY leaf random (biases and LayerNorms too, unlike
    GPT-2's own initialisation), so that parity tests exercise each weight."""
    from jaxattn import gpt2

    cfg = gpt2.GPT2Config.make(**{k: v for k, v in config.items() if k in gpt2.GPT2Config._fields})
    rng = np.random.default_rng(seed)
    flat = {}
    for name, shape in per_layer_shapes(gpt2.param_shapes(cfg), "transformer/h").items():
        base = 1.0 if name.endswith("scale") else 0.0
        flat[name] = (base + 0.2 * rng.standard_normal(shape)).astype(np.float32)
    return unflatten(flat)


def hf_model(seed: int = 0, **config):
    """A ``FlaxGPT2LMHeadModel`` (transformers 4.x) with the given GPT2Config fields and :func:`random_params`.

    Built with ``_do_init=False`` (no compile); the params live in ``model.params_`` and every call
    passes them. Hugging Face's code relies on NumPy rank promotion, which the suite's strict
    configuration forbids for jaxattn: it is allowed only around calls into transformers.
    """
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    with jax.numpy_rank_promotion("allow"):
        model = FlaxGPT2LMHeadModel(GPT2Config(**config), _do_init=False)
    model.params_ = random_params(seed, **config)
    model.run_ = jax.jit(lambda p, ids: model(ids, params=p, output_attentions=True, output_hidden_states=True))
    return model


def hf_run(model, ids):
    """``(logits [T, V], attentions [L, N, T, T], hidden_states [L + 1, T, D])`` from Hugging Face."""
    with jax.numpy_rank_promotion("allow"):
        out = model.run_(model.params_, np.asarray(ids)[None])
    return (np.asarray(out.logits[0]), np.stack([np.asarray(a[0]) for a in out.attentions]),
            np.stack([np.asarray(h[0]) for h in out.hidden_states]))


def torch_layout(params: dict, *, prefix: str = "transformer.") -> dict[str, np.ndarray]:
    """Flax GPT-2 params as PyTorch ``GPT2LMHeadModel`` tensors, written out by hand: Conv1D kernels
    ``(in, out)`` (the Flax ``(out, in)`` transposed), LayerNorm ``weight``, embeddings ``weight``, and
    the causal-mask buffers ``attn.bias`` old checkpoints carry."""
    tr = params["transformer"]
    out = {
        f"{prefix}wte.weight": np.asarray(tr["wte"]["embedding"]),
        f"{prefix}wpe.weight": np.asarray(tr["wpe"]["embedding"]),
        f"{prefix}ln_f.weight": np.asarray(tr["ln_f"]["scale"]),
        f"{prefix}ln_f.bias": np.asarray(tr["ln_f"]["bias"]),
    }
    P = out[f"{prefix}wpe.weight"].shape[0]
    for i, block in tr["h"].items():
        h = f"{prefix}h.{i}"
        for ln in ("ln_1", "ln_2"):
            out[f"{h}.{ln}.weight"] = np.asarray(block[ln]["scale"])
            out[f"{h}.{ln}.bias"] = np.asarray(block[ln]["bias"])
        for mod, sub in (("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj")):
            out[f"{h}.{mod}.{sub}.weight"] = np.ascontiguousarray(np.asarray(block[mod][sub]["kernel"]).T)
            out[f"{h}.{mod}.{sub}.bias"] = np.asarray(block[mod][sub]["bias"])
        out[f"{h}.attn.bias"] = np.tril(np.ones((P, P), np.float32))[None, None]
    return out


def save_checkpoint(directory: Path, model, *, weights: str = "msgpack", tokenizer=None) -> Path:
    """``config.json`` + ``flax_model.msgpack`` (``save_pretrained``) or ``model.safetensors`` (NumPy),
    plus ``tokenizer.json`` when a tokenizer is given."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if weights == "msgpack":
        model.save_pretrained(directory, params=model.params_)
    else:
        (directory / "config.json").write_text(model.config.to_json_string())
        save_file(torch_layout(model.params_), str(directory / "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def edit_config(directory: Path, **changes) -> None:
    path = Path(directory) / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))
