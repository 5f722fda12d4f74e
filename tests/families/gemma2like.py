"""A small Gemma-2-like causal decoder declared on jaxattn's public decoder API (nothing in jaxattn changed).

``x = embed[ids] · sqrt(D)``; each block (sandwich norms, RMSNorm scaling by ``1 + w``):
``x += post_attn(o_proj(attn(RoPE(q), RoPE(k), v)))`` on ``input_layernorm(x)``, then
``x += post_ff(down(gelu(gate(h)) · up(h)))`` with ``h = pre_ff(x)`` (GeGLU, ``decoder.gated_mlp``). The
attention logits are soft-capped ``c · tanh(x / c)`` and even layers see a sliding window of
``sliding_window`` keys, odd layers every key: both as layer data (``"logit_cap"``, ``"window"``), which the
decoder's attention reads. K key/value heads serve N query heads; the logit scale is
``query_pre_attn_scalar^-1/2``; the head is tied and its logits soft-capped too. RoPE rotates halves.

Params (kernels ``(in, out)``, blocks stacked ``[L, ...]``)::

    model/embed_tokens/embedding                                [V, D]
    model/layers/{input,post_attention,pre_feedforward,post_feedforward}_layernorm/weight   [L, D]
    model/layers/self_attn/q_proj/kernel                        [L, D, N·H]
    model/layers/self_attn/{k,v}_proj/kernel                    [L, D, K·H]
    model/layers/self_attn/o_proj/kernel                        [L, N·H, D]
    model/layers/mlp/{gate,up}_proj/kernel, down_proj/kernel    [L, D, I], [L, I, D]
    model/norm/weight                                           [D]
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import decoder, merge_heads, split_heads
from jaxattn.checkpoint import unflatten
from jaxattn.models import ModelSpec, QKWeights, Sizes

LAYOUT = "Gemma-2-like names, kernels (in, out), blocks stacked"
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
CAUSAL = True


class Gemma2LikeConfig(NamedTuple):
    """A Gemma-2-like model's shape (hashable: a static argument of the compiled programs)."""

    vocab_size: int  # V
    max_position_embeddings: int  # the longest input
    hidden_size: int  # D
    intermediate_size: int  # I
    num_hidden_layers: int  # L
    num_attention_heads: int  # N
    num_key_value_heads: int  # K
    head_dim: int  # H (N·H need not be D)
    sliding_window: int  # even layers: query t sees keys s with t - s < sliding_window
    attn_logit_softcapping: float
    final_logit_softcapping: float
    query_pre_attn_scalar: float  # the logit scale is its -1/2 power
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6


def _windows(config):  # each layer's window (None: every key)
    return tuple(config.sliding_window if l % 2 == 0 else None for l in range(config.num_hidden_layers))


def sizes(config: Gemma2LikeConfig) -> Sizes:
    return Sizes(layers=config.num_hidden_layers, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                 head_dim=config.head_dim, width=config.hidden_size, vocab=config.vocab_size,
                 max_length=config.max_position_embeddings, scale_dim=config.query_pre_attn_scalar,
                 layer_windows=_windows(config))


def param_shapes(config: Gemma2LikeConfig) -> dict[str, tuple[int, ...]]:
    V, D, I, L = config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers
    NH, KH = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    a = "model/layers/"
    return {"model/embed_tokens/embedding": (V, D), **{f"{a}{n}/weight": (L, D) for n in NORMS},
            a + "self_attn/q_proj/kernel": (L, D, NH), a + "self_attn/k_proj/kernel": (L, D, KH),
            a + "self_attn/v_proj/kernel": (L, D, KH), a + "self_attn/o_proj/kernel": (L, NH, D),
            a + "mlp/gate_proj/kernel": (L, D, I), a + "mlp/up_proj/kernel": (L, D, I),
            a + "mlp/down_proj/kernel": (L, I, D), "model/norm/weight": (D,)}


def init_params(seed: int, config: Gemma2LikeConfig, std: float = 0.3) -> dict:
    """Random float32 params (NumPy): kernels and embedding ``N(0, std²)``, norm weights ``N(0, 0.1²)``."""
    rng = np.random.default_rng(seed)
    return unflatten({k: jnp.asarray((0.1 if k.endswith("weight") else std) * rng.standard_normal(s), jnp.float32)
                      for k, s in param_shapes(config).items()})


def check_params(params, config: Gemma2LikeConfig) -> None:
    decoder.check_stacked(params, "model/layers", config.num_hidden_layers, field="num_hidden_layers", layout=LAYOUT)
    decoder.check_tree(params, param_shapes(config), root="model", layout=LAYOUT, kernel_layout="(in, out)")


def _layer_data(config):
    L, full = config.num_hidden_layers, config.max_position_embeddings  # a full layer's window spans every position
    return {"window": np.array([full if w is None else w for w in _windows(config)], np.int32),
            "logit_cap": np.full(L, config.attn_logit_softcapping, np.float32)}


def _rms(x, w, config):
    return decoder.rms_norm(x, w, eps=config.rms_norm_eps, plus_one=True)


def _embed(params, config, ids, pos):
    x = decoder.embed_ids(params["model"]["embed_tokens"]["embedding"], ids)  # NaN rows for ids outside [0, V)
    return x * jnp.asarray(config.hidden_size ** 0.5, x.dtype)


def _rotation(config, pos, size):
    return decoder.rope_table(pos, size, decoder.rope_frequencies(config.head_dim, config.rope_theta))


def _qkv(p, config, x, rot, d):
    h, a = _rms(x, p["input_layernorm"]["weight"], config), p["self_attn"]  # [T, D]
    q = split_heads(h @ a["q_proj"]["kernel"], config.num_attention_heads)  # [T, N, H]
    k, v = (split_heads(h @ a[f"{n}_proj"]["kernel"], config.num_key_value_heads) for n in "kv")  # [T, K, H]
    return decoder.rope(q, rot), decoder.rope(k, rot), v


def _attn_out(p, config, z, d):
    return _rms(merge_heads(z) @ p["self_attn"]["o_proj"]["kernel"], p["post_attention_layernorm"]["weight"], config)


def _mlp(p, config, x, d):
    h, m = _rms(x, p["pre_feedforward_layernorm"]["weight"], config), p["mlp"]
    y = decoder.gated_mlp(h, m["gate_proj"]["kernel"], m["up_proj"]["kernel"], m["down_proj"]["kernel"],
                          lambda a: jax.nn.gelu(a, approximate=True))  # GeGLU
    return _rms(y, p["post_feedforward_layernorm"]["weight"], config)


def final_norm(params, config, x):
    return _rms(x, params["model"]["norm"]["weight"], config)


def final_norm_linear(params, config, x, v):
    """The final norm linearised at the stream ``x [..., D]`` on a part ``v`` of it (the parts add up)."""
    return decoder.rms_norm(v, params["model"]["norm"]["weight"], eps=config.rms_norm_eps, plus_one=True, stream=x)


def unembed(params, config, x):
    logits = x @ params["model"]["embed_tokens"]["embedding"].T  # tied head, soft-capped
    return decoder.soft_cap(logits, config.final_logit_softcapping)


FAMILY = decoder.Family(
    name="families.gemma2like", config_type=Gemma2LikeConfig, sizes=sizes, check_params=check_params,
    blocks=lambda params: params["model"]["layers"], embed=_embed, rotation=_rotation, qkv=_qkv, attn_out=_attn_out,
    mlp=_mlp, final_norm=final_norm, unembed=unembed, max_name="max_position_embeddings", layer_data=_layer_data)


def forward(params, config, input_ids, **kwargs):
    return decoder.forward(FAMILY, params, config, input_ids, **kwargs)


def log_prob(params, config, input_ids, **kwargs):
    return decoder.log_prob(FAMILY, params, config, input_ids, **kwargs)


def generate(params, config, prompt_ids, **kwargs):
    return decoder.generate(FAMILY, params, config, prompt_ids, **kwargs)


def resume(params, config, resid_pre, layer, **kwargs):
    return decoder.resume(FAMILY, params, config, resid_pre, layer, **kwargs)


_DOC = dict(title="The Gemma-2-like", config="Gemma2LikeConfig",
            formula="Sandwich-normed blocks, GeGLU, soft caps, alternating sliding windows (module docstring).")
for _fn, _doc in ((forward, decoder.FORWARD_DOC), (log_prob, decoder.LOG_PROB_DOC),
                  (generate, decoder.GENERATE_DOC), (resume, decoder.RESUME_DOC)):
    decoder.document(_fn, _doc, FAMILY, **_DOC)


def attention_input(params, config, layer, x):
    """Block ``layer``'s ``input_layernorm`` of the stream ``x [T, D]``: what its q, k, v come from."""
    return _rms(x, params["model"]["layers"]["input_layernorm"]["weight"][layer], config)


def head_projections(params, config):
    """``[L, N, H, D]``: each query head's rows of ``o_proj`` (``attn_out = post_attn(Σ_n z[:, n] @ W[n])``)."""
    L, N, H, D = config.num_hidden_layers, config.num_attention_heads, config.head_dim, config.hidden_size
    return params["model"]["layers"]["self_attn"]["o_proj"]["kernel"].reshape(L, N, H, D)


def qk_weights(params, config):
    """``W_Q [L, N, D, H]``, ``W_K [L, K, D, H]`` on :func:`attention_input`, before the rotation; no biases."""
    L, D, H = config.num_hidden_layers, config.hidden_size, config.head_dim
    heads = lambda w, n: jnp.transpose(w.reshape(L, D, n, H), (0, 2, 1, 3))  # noqa: E731
    a = params["model"]["layers"]["self_attn"]
    return QKWeights(heads(a["q_proj"]["kernel"], config.num_attention_heads), None,
                     heads(a["k_proj"]["kernel"], config.num_key_value_heads), True,
                     float(config.query_pre_attn_scalar) ** -0.5)


SPEC = ModelSpec(name=FAMILY.name, causal=CAUSAL, forward=forward, sizes=sizes, final_norm=final_norm, unembed=unembed,
                 final_norm_linear=final_norm_linear, attention_input=attention_input,
                 head_projections=head_projections, qk_weights=qk_weights, resume=resume, log_prob=log_prob)
