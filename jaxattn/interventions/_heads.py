"""Every head's query-key weights and inputs, read from a bundled model, for the entropy bound.

:func:`qk_weights` reads ``W_Q``, ``b_q``, ``W_K`` per layer and head out of a model's params (GPT-2,
BERT, Llama layouts); :func:`entropy_bounds` runs the model once, rebuilds each layer's attention input
(the block's normalisation of ``resid_pre``) and compares :func:`jaxattn.probes.entropy_lower_bound` with
the entropy of the rows the model produced.

Axis alphabet: L layers, N query heads, K key/value heads, T tokens, D model width, H head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._nn import layer_norm
from jaxattn.probes import entropy, entropy_floor, logit_spread_bound, qk_spectral_norm

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class QKWeights:
    """One model's query-key weights: ``w_q [L, N, D, H]``, ``b_q [L, N, H]`` or None, ``w_k [L, K, D, H]``.

    ``rotary``: q and k are rotated by position (Llama); ``scale``: the logit scale ``1/sqrt(H)``.
    """

    w_q: Array
    b_q: Array | None
    w_k: Array
    rotary: bool
    scale: float
    b_k: Array | None = None  # [L, K, H]; matters only under rotary embeddings


def _kind(module: Any) -> str:
    name = getattr(module, "__name__", "")
    for kind in ("gpt2", "bert", "llama"):
        if name == f"jaxattn.{kind}":
            return kind
    raise ValueError(f"module must be jaxattn.gpt2, jaxattn.bert or jaxattn.llama, received {name or module!r}")


def _heads(w: Array, n: int) -> Array:
    """``[L, D, n·H] -> [L, n, D, H]``."""
    L, D, NH = w.shape
    return jnp.transpose(w.reshape(L, D, n, NH // n), (0, 2, 1, 3))


def qk_weights(module: Any, params: Any, config: Any) -> QKWeights:
    """``W_Q``, ``b_q`` and ``W_K`` of every head of a bundled model, as ``q = x W_Q + b_q`` on its input."""
    kind = _kind(module)
    if kind == "gpt2":
        L, N, D = config.n_layer, config.n_head, config.n_embd
        h = params["transformer"]["h"]
        kernel = jnp.stack([h[str(i)]["attn"]["c_attn"]["kernel"] for i in range(L)])  # [L, 3D, D] (out, in)
        bias = jnp.stack([h[str(i)]["attn"]["c_attn"]["bias"] for i in range(L)])  # [L, 3D]
        w = jnp.transpose(kernel, (0, 2, 1))  # [L, D, 3D]
        return QKWeights(_heads(w[..., :D], N), bias[:, :D].reshape(L, N, -1), _heads(w[..., D:2 * D], N),
                         False, float(config.head_dim) ** -0.5)
    if kind == "bert":
        L, N = config.num_hidden_layers, config.num_attention_heads
        layers = [params["encoder"]["layer"][str(i)]["attention"]["self"] for i in range(L)]
        wq = jnp.stack([p["query"]["kernel"] for p in layers])  # [L, D, D] (in, out)
        bq = jnp.stack([p["query"]["bias"] for p in layers])  # [L, D]
        wk = jnp.stack([p["key"]["kernel"] for p in layers])
        return QKWeights(_heads(wq, N), bq.reshape(L, N, -1), _heads(wk, N), False, float(config.head_dim) ** -0.5)
    return _llama_qk(params, config)


def _llama_qk(params: Any, config: Any) -> QKWeights:
    L, N, K = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    layers = [params["model"]["layers"][str(i)]["self_attn"] for i in range(L)]
    wq = jnp.stack([p["q_proj"]["kernel"] for p in layers])  # [L, D, N·H] (in, out)
    wk = jnp.stack([p["k_proj"]["kernel"] for p in layers])  # [L, D, K·H]
    b_q = b_k = None
    if config.qkv_bias:
        b_q = jnp.stack([p["q_proj"]["bias"] for p in layers]).reshape(L, N, -1)  # [L, N, H]
        b_k = jnp.stack([p["k_proj"]["bias"] for p in layers]).reshape(L, K, -1)  # [L, K, H]
    return QKWeights(_heads(wq, N), b_q, _heads(wk, K), True, float(config.head_dim) ** -0.5, b_k)


def attention_inputs(module: Any, params: Any, config: Any, resid_pre: Any) -> Array:
    """``[L, T, D]``: each layer's attention input from its ``resid_pre [L, T, D]`` (the block's norm)."""
    kind = _kind(module)
    resid_pre = jnp.asarray(resid_pre, jnp.float32)
    if kind == "gpt2":
        h = params["transformer"]["h"]
        return jnp.stack([layer_norm(resid_pre[i], **h[str(i)]["ln_1"], eps=config.layer_norm_epsilon)
                          for i in range(config.n_layer)])
    if kind == "bert":
        return resid_pre  # post-LayerNorm: the block's input is already normalised
    layers = params["model"]["layers"]
    out = []
    for i in range(config.num_hidden_layers):  # RMSNorm, as the block applies it (statistic in float32)
        x = resid_pre[i]
        rms = jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + config.rms_norm_eps)  # [T, 1]
        out.append(layers[str(i)]["input_layernorm"]["weight"].astype(jnp.float32)[None, :] * (x / rms))
    return jnp.stack(out)


def entropy_bounds(module: Any, params: Any, config: Any, input_ids: Any, *, causal: bool | None = None) -> dict[str, Array]:
    """The entropy floor and the measured entropy of every row of every head on one input.

    Args:
      module, params, config: a bundled model (``jaxattn.gpt2``, ``jaxattn.bert``, ``jaxattn.llama``).
      input_ids: ``[T]`` token ids.
      causal: whether row i sees only keys ``j <= i``; ``None``: GPT-2 and Llama are, BERT is not.

    Returns:
      ``{"bound", "entropy", "spread_bound", "spread"}`` each ``[L, N, T]``, and ``"sigma" [L, N]``: the
      floor of :func:`jaxattn.probes.entropy_lower_bound`, the entropy of the model's own rows (nats), the
      bound β on each row's logit spread that the floor comes from and the spread the model's logits
      actually have (largest minus smallest over the keys the row sees), and the spectral norm ``σ``
      behind β (:func:`jaxattn.probes.qk_spectral_norm`).
    """
    kind = _kind(module)
    ids = np.asarray(input_ids)
    out = module.forward(params, config, ids, capture=("resid_pre", "attn_logits"))
    x = attention_inputs(module, params, config, out.captured["resid_pre"])  # [L, T, D]
    qk = qk_weights(module, params, config)
    N = qk.w_q.shape[1]
    K = qk.w_k.shape[1]
    T = ids.shape[0]
    causal = kind != "bert" if causal is None else causal
    keep = jnp.tril(jnp.ones((T, T), bool)) if causal else jnp.ones((T, T), bool)

    if kind == "llama" and config.sliding_window is not None:
        t = jnp.arange(T)
        keep = keep & (t[:, None] - t[None, :] < config.sliding_window)

    def one(x, w_q, b_q, w_k, b_k):
        return logit_spread_bound(x, w_q, w_k, b_q=b_q, b_k=b_k, scale=qk.scale, mask=keep, rotary=qk.rotary)

    def sigma(w_q, b_q, w_k, b_k):
        return qk_spectral_norm(w_q, w_k, b_q, b_k=b_k, rotary=qk.rotary)

    w_k = jnp.repeat(qk.w_k, N // K, axis=1)  # [L, N, D, H]: query head n reads key head n // (N/K)
    b_k = None if qk.b_k is None else jnp.repeat(qk.b_k, N // K, axis=1)  # [L, N, H]
    per_head = jax.vmap(jax.vmap(one, in_axes=(None, 0, 0, 0, 0)))  # a None bias has no leaves to map
    beta = jax.jit(per_head)(x, qk.w_q, qk.b_q, w_k, b_k)  # [L, N, T]
    sig = jax.vmap(jax.vmap(sigma))(qk.w_q, qk.b_q, w_k, b_k)  # [L, N]
    a = out.captured["attn_logits"].astype(jnp.float32)  # [L, N, T, T]
    spread = jnp.max(jnp.where(keep, a, -jnp.inf), -1) - jnp.min(jnp.where(keep, a, jnp.inf), -1)  # [L, N, T]
    return {"bound": entropy_floor(beta, jnp.sum(keep, axis=1), max_keys=T), "entropy": entropy(out.attentions, keep),
            "sigma": sig, "spread_bound": beta, "spread": spread}
