"""The Llama family's maths for the shared decoder (:mod:`jaxattn.decoder`), in the spirit of penzai's
``llamalike_common``: one small function per idea, each reading the config's feature values
(:data:`jaxattn.llama.VARIANTS`) instead of branching on a model type. :mod:`jaxattn.llama` holds the
config, loading and saving, and declares the family from these.

Axis alphabet: T tokens, N query heads, K key/value heads, H head dim, D width, I MLP width, L layers.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import decoder
from jaxattn._attention import merge_heads, split_heads
from jaxattn._nn import embed_ids

Array = jax.Array

# The MLP's gate activations this family's checkpoints use (the tanh forms are one formula).
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
}


def rms_norm(x: Array, weight: Array, config: Any, *, stream: Array | None = None) -> Array:
    """:func:`jaxattn.decoder.rms_norm` with the config's epsilon; Gemma scales by ``1 + w``."""
    return decoder.rms_norm(x, weight, eps=config.rms_norm_eps, plus_one=config.norm_plus_one, stream=stream)


def linear(x: Array, p: dict) -> Array:
    y = x @ p["kernel"]  # [T, out]; the kernel is stored (in, out)
    return y + p["bias"][None, :] if "bias" in p else y


def rope_kinds(config: Any) -> list[np.ndarray]:
    """The inverse frequencies of each kind of layer's RoPE (float32, ``[H/2]``): ``rope_theta``'s (divided by
    a linear ``rope_scaling_factor``) for full layers, then, for Gemma 3, ``rope_local_base_freq``'s for
    sliding ones (Hugging Face's ``Gemma3TextModel.rotary_emb_local``, no scaling)."""
    H = config.head_dim
    full = decoder.rope_frequencies(H, config.rope_theta, factor=config.rope_scaling_factor or 1.0)
    if config.rope_local_base_freq is None:
        return [full]
    return [full, decoder.rope_frequencies(H, config.rope_local_base_freq)]


def rotation(config: Any, pos: Array, size: int) -> tuple[Array, Array]:
    """``cos, sin [R, n, 1, H/2]`` of the angles ``pos · inv_freq`` at positions ``pos [n]`` in ``[0, size)``,
    for each of the ``R`` kinds of layer's RoPE (:func:`_rope_kinds`; one, but for Gemma 3).

    Each is :func:`jaxattn.decoder.rope_table`'s (NumPy tables gathered by position, NaN outside).
    """
    tables = [decoder.rope_table(pos, size, f) for f in rope_kinds(config)]  # R x (cos, sin)
    return tuple(jnp.stack(t) for t in zip(*tables))  # 2 x [R, n, 1, H/2]


def layer_data(config: Any) -> dict[str, np.ndarray]:
    """Gemma 2 and 3's data indexed by the layer: each layer's window (a full layer's spans every position),
    its logit cap, and which RoPE of :func:`_rope_kinds` it uses (Gemma 3: sliding layers the local one)."""
    if config.layer_types is None:
        return {}
    sliding = np.array([t == "sliding_attention" for t in config.layer_types])
    data = {"window": np.where(sliding, config.sliding_window, config.max_position_embeddings).astype(np.int32),
            "rope": (sliding & (config.rope_local_base_freq is not None)).astype(np.int32)}
    if config.attn_logit_softcapping is not None:
        data["logit_cap"] = np.full(config.num_hidden_layers, config.attn_logit_softcapping, np.float32)
    return data


def embed(params: dict, config: Any, ids: Array, pos: Array) -> Array:
    x = embed_ids(params["model"]["embed_tokens"]["embedding"], ids)  # [T, D]; NaN rows for ids outside [0, V)
    if config.embed_scale:  # Gemma: sqrt(D), rounded to the params' dtype as Hugging Face does
        x = x * jnp.asarray(config.hidden_size ** 0.5, x.dtype)
    return x


def qkv(p: dict, config: Any, x: Array, rot: tuple[Array, Array], d: Any) -> tuple[Array, Array, Array]:
    """Queries ``[T, N, H]``, keys and values ``[T, K, H]`` of one block (q, k rotated by ``rot``)."""
    h = rms_norm(x, p["input_layernorm"]["weight"], config)  # [T, D]
    a = p["self_attn"]
    q = split_heads(linear(h, a["q_proj"]), config.num_attention_heads)  # [T, N, H]
    k = split_heads(linear(h, a["k_proj"]), config.num_key_value_heads)  # [T, K, H]
    v = split_heads(linear(h, a["v_proj"]), config.num_key_value_heads)  # [T, K, H]
    if config.qk_norm:  # Qwen3, Gemma 3: RMSNorm over each head's features, before the rotation
        q, k = rms_norm(q, a["q_norm"]["weight"], config), rms_norm(k, a["k_norm"]["weight"], config)
    kind = d.get("rope", 0)  # this layer's kind of RoPE (Gemma 3: sliding layers' own base)
    rot = tuple(r[kind] for r in rot)  # 2 x [T, 1, H/2]
    return decoder.rope(q, rot), decoder.rope(k, rot), v


def attn_out(p: dict, config: Any, z: Array, d: Any) -> Array:
    """The output projection ``[T, N, H] -> [T, D]``; Gemma 2 and 3 normalise it (``post_attention_layernorm``)."""
    a = linear(merge_heads(z), p["self_attn"]["o_proj"])
    return rms_norm(a, p["post_attention_layernorm"]["weight"], config) if config.variant.sandwich else a


def mlp(p: dict, config: Any, x: Array, d: Any) -> Array:
    """The gated MLP on ``rms(x)``: ``down(act(gate(h)) · up(h))`` (SwiGLU; GeGLU for Gemma), ``[T, D] -> [T, D]``;
    Gemma 2 and 3 normalise before (``pre_feedforward_layernorm``) and after (``post_feedforward_layernorm``)."""
    sandwich = config.variant.sandwich
    h = rms_norm(x, p["pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"]["weight"], config)
    m = p["mlp"]
    y = decoder.gated_mlp(h, m["gate_proj"]["kernel"], m["up_proj"]["kernel"], m["down_proj"]["kernel"],
                          ACTIVATIONS[config.hidden_act])
    return rms_norm(y, p["post_feedforward_layernorm"]["weight"], config) if sandwich else y
