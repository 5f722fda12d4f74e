"""A float64 NumPy forward of Gemma 2 and Gemma 3 (text), written from transformers 4.57's PyTorch source,
for parity tests; plus tiny random checkpoints saved the way Hugging Face lays them out.

Every piece names the transformers function it mirrors (``models/gemma2/modeling_gemma2.py``,
``models/gemma3/modeling_gemma3.py``, ``masking_utils.py``, ``modeling_rope_utils.py``, ``activations.py``,
``utils/generic.py``). It does not import jaxattn: it is the independent side of a comparison.

What it follows, in short:

* the embedding is multiplied by sqrt(D) (``Gemma2Model.forward``'s ``normalizer``,
  ``Gemma3TextScaledWordEmbedding``); transformers rounds that factor to the weights' dtype, here it stays
  float64;
* RMSNorm multiplies by ``1 + w`` (``Gemma2RMSNorm`` / ``Gemma3RMSNorm``); each block is "sandwiched":
  input_layernorm, attention, post_attention_layernorm, residual; pre_feedforward_layernorm, MLP,
  post_feedforward_layernorm, residual (``Gemma2DecoderLayer.forward`` / ``Gemma3DecoderLayer.forward``);
* Gemma 3 applies q_norm / k_norm to each head before RoPE (``Gemma3Attention.forward``);
* RoPE: Gemma 2 uses ``rope_theta`` (with ``rope_scaling`` if the config has one) on every layer. Gemma 3
  uses ``rope_theta`` with ``rope_scaling`` on full_attention layers and ``rope_local_base_freq`` WITHOUT
  scaling on sliding_attention layers (``Gemma3TextModel.__init__`` builds ``rotary_emb_local`` from a
  config copy with ``rope_theta = rope_local_base_freq`` and ``rope_scaling = {"rope_type": "default"}``;
  ``Gemma3DecoderLayer.forward`` picks it when ``self_attn.is_sliding``);
* scores are scaled by ``query_pre_attn_scalar ** -0.5``; ``attn_logit_softcapping`` is applied in Gemma 2
  only (``Gemma2Attention`` passes ``softcap=`` to ``eager_attention_forward``; ``Gemma3Attention`` does not,
  although Gemma3TextConfig has the field). Only the eager and flash/flex attention functions take
  ``softcap``: ``sdpa_attention_forward`` drops it, so this follows the eager path (the one that returns
  attention maps). ``final_logit_softcapping`` is applied by both
  ``Gemma2ForCausalLM`` and ``Gemma3ForCausalLM`` when set (Gemma 2's default 30.0, Gemma 3's None);
* masks: causal (``causal_mask_function``: kv <= q), and on sliding_attention layers also
  ``sliding_window_overlay`` (kv > q - sliding_window); an optional padding mask hides keys
  (``padding_mask_function``); positions stay 0..T-1 as in a forward without ``position_ids``;
* the head is tied: logits = final_norm(h) @ embed_tokens.weight^T (``_tied_weights_keys``).

``hidden`` follows ``output_hidden_states``: ``check_model_inputs`` (utils/generic.py) records the input of
the first decoder layer, then each layer's output, and replaces the last entry with ``last_hidden_state``
(the final norm's output); ``Gemma2Model.forward`` / ``Gemma3TextModel.forward`` build the same tuple. So
``hidden[0]`` is the scaled embedding, ``hidden[i]`` (0 < i < L) the stream leaving block i - 1, and
``hidden[L]`` the final norm of the stream leaving the last block; ``resid_post[L - 1]`` is that stream
before the final norm.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

MODEL_TYPES = ("gemma2", "gemma3_text")

# The config classes' own defaults (Gemma2Config.__init__, Gemma3TextConfig.__init__), used only for fields
# a config.json leaves out.
DEFAULTS = {
    "gemma2": dict(head_dim=256, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                   query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0, hidden_activation="gelu_pytorch_tanh", attention_bias=False),
    "gemma3_text": dict(head_dim=256, rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_scaling=None,
                        rope_local_base_freq=10_000.0, query_pre_attn_scalar=256, sliding_window=4096,
                        final_logit_softcapping=None, attn_logit_softcapping=None,
                        hidden_activation="gelu_pytorch_tanh", attention_bias=False,
                        use_bidirectional_attention=False),
}


# ----------------------------------------------------------------------------------------------------
# Configs, weights, checkpoint directories
# ----------------------------------------------------------------------------------------------------


def config_dict(model_type: str, **fields) -> dict:
    """config.json as transformers writes it: ``Gemma2Config(**fields)`` or ``Gemma3TextConfig(**fields)``
    serialised by ``to_json_string`` (only the fields that differ from PretrainedConfig's defaults, plus
    ``model_type`` and ``transformers_version``). ``save_pretrained`` of a model would also add
    ``architectures`` and ``dtype``; pass ``architectures=[...]`` in ``fields`` to have it."""
    import transformers

    classes = {"gemma2": transformers.Gemma2Config, "gemma3_text": transformers.Gemma3TextConfig}
    if model_type not in classes:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, received {model_type!r}")
    return json.loads(classes[model_type](**fields).to_json_string())


def settings(cfg: dict) -> dict:
    """``cfg`` with the config class's defaults filled in, and ``layer_types`` as the config class derives
    it when absent: Gemma 2 alternates sliding / full starting with sliding (``Gemma2Config.__init__``:
    sliding iff (i + 1) % 2); Gemma 3 puts a full layer every ``sliding_window_pattern`` layers, 6 by default
    (``Gemma3TextConfig.__init__``: sliding iff (i + 1) % pattern)."""
    model_type = cfg["model_type"]
    if model_type not in DEFAULTS:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, received {model_type!r}")
    s = {**DEFAULTS[model_type], **cfg}
    if s.get("layer_types") is None:
        pattern = 2 if model_type == "gemma2" else cfg.get("sliding_window_pattern", 6)
        s["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                            for i in range(s["num_hidden_layers"])]
    if s["hidden_activation"] != "gelu_pytorch_tanh":
        raise NotImplementedError(f"hidden_activation {s['hidden_activation']!r}")
    if s["attention_bias"]:
        raise NotImplementedError("attention_bias=True")
    if s.get("use_bidirectional_attention"):
        raise NotImplementedError("use_bidirectional_attention=True")
    return s


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` checkpoint, in the modules' order,
    named as ``state_dict`` names them (``nn.Linear`` weights are ``[out, in]``). The head is tied to
    ``model.embed_tokens.weight``, so there is no ``lm_head.weight``."""
    s = settings(cfg)
    V, D, F = s["vocab_size"], s["hidden_size"], s["intermediate_size"]
    N, K, H = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    shapes = {"model.embed_tokens.weight": (V, D)}
    for i in range(s["num_hidden_layers"]):
        b = f"model.layers.{i}"
        shapes[f"{b}.self_attn.q_proj.weight"] = (N * H, D)
        shapes[f"{b}.self_attn.k_proj.weight"] = (K * H, D)
        shapes[f"{b}.self_attn.v_proj.weight"] = (K * H, D)
        shapes[f"{b}.self_attn.o_proj.weight"] = (D, N * H)
        if s["model_type"] == "gemma3_text":
            shapes[f"{b}.self_attn.q_norm.weight"] = (H,)
            shapes[f"{b}.self_attn.k_norm.weight"] = (H,)
        shapes[f"{b}.mlp.gate_proj.weight"] = (F, D)
        shapes[f"{b}.mlp.up_proj.weight"] = (F, D)
        shapes[f"{b}.mlp.down_proj.weight"] = (D, F)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            shapes[f"{b}.{norm}.weight"] = (D,)
    shapes["model.norm.weight"] = (D,)
    return shapes


def random_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Every weight random, float32: matrices and the embedding 0.2 N(0, 1); RMSNorm weights (Gemma's
    ``w`` of ``1 + w``) 0.3 N(0, 1). With D of a few dozen this gives logits of order 1-10 and, with
    ``query_pre_attn_scalar`` near ``head_dim``, attention maps far from uniform."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        scale = 0.3 if name.endswith("norm.weight") else 0.2
        out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return out


def save_hf(directory, cfg: dict, weights: dict, tokenizer_json: str | None = None) -> Path:
    """A Hugging Face checkpoint directory: config.json, model.safetensors and, if given, tokenizer.json."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(directory / "model.safetensors"))
    if tokenizer_json is not None:
        (directory / "tokenizer.json").write_text(tokenizer_json)
    return directory


# ----------------------------------------------------------------------------------------------------
# Pieces
# ----------------------------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """``Gemma2RMSNorm.forward`` / ``Gemma3RMSNorm.forward``: x * rsqrt(mean(x^2) + eps) * (1 + w), over
    the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``nn.Linear(bias=False)``: x @ W^T with W stored ``[out, in]``."""
    return x @ w.T


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """``ACT2FN["gelu_pytorch_tanh"]`` (activations.py ``GELUTanh``): the tanh approximation of GELU."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def mlp(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """``Gemma2MLP.forward`` / ``Gemma3MLP.forward``: down(act(gate(x)) * up(x))."""
    return linear(gelu_tanh(linear(x, gate)) * linear(x, up), down)


def softcap(x: np.ndarray, cap: float | None) -> np.ndarray:
    """cap * tanh(x / cap), or x when cap is None (``eager_attention_forward``'s ``softcap``,
    ``Gemma2ForCausalLM.forward``'s ``final_logit_softcapping``)."""
    return x if cap is None else cap * np.tanh(x / cap)


def rope_parameters(s: dict, layer: int) -> tuple[float, float]:
    """(base, linear factor) of the rotary embedding layer ``layer`` uses.

    Gemma 2: one ``Gemma2RotaryEmbedding(config)`` for all layers: ``rope_theta`` and ``rope_scaling``.
    Gemma 3: ``Gemma3TextModel.rotary_emb`` (``rope_theta``, ``rope_scaling``) for full_attention layers;
    ``rotary_emb_local`` (``rope_local_base_freq``, rope_scaling forced to default) for sliding_attention."""
    scaling = s.get("rope_scaling")
    if s["model_type"] == "gemma3_text" and s["layer_types"][layer] == "sliding_attention":
        return float(s["rope_local_base_freq"]), 1.0
    if scaling is None:
        return float(s["rope_theta"]), 1.0
    # Gemma2RotaryEmbedding / Gemma3RotaryEmbedding.__init__: rope_type, or the older key "type"
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "default":
        return float(s["rope_theta"]), 1.0
    if rope_type == "linear":
        return float(s["rope_theta"]), float(scaling["factor"])
    raise NotImplementedError(f"rope_scaling type {rope_type!r}")


def inverse_frequencies(base: float, head_dim: int, factor: float = 1.0) -> np.ndarray:
    """``_compute_default_rope_parameters``: 1 / base^(2j / H) for j < H / 2; then
    ``_compute_linear_scaling_rope_parameters`` divides them by ``factor`` (the same as dividing the
    positions by it). The attention scaling of both is 1."""
    return 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / factor


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``Gemma2RotaryEmbedding.forward``: angles = positions x inv_freq, repeated twice along the last axis
    (``torch.cat((freqs, freqs))``); returns cos, sin of shape [T, H]."""
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles), np.sin(angles)


def rotate_half(x: np.ndarray) -> np.ndarray:
    """``rotate_half``: (x1, x2) -> (-x2, x1) over the two halves of the last axis."""
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``apply_rotary_pos_emb`` on x of shape [T, heads, H]: x cos + rotate_half(x) sin."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def visible(s: dict, layer: int, T: int, mask: np.ndarray | None = None) -> np.ndarray:
    """Which keys each query sees, bool [T (q), T (kv)]: ``causal_mask_function`` (kv <= q); on
    sliding_attention layers also ``sliding_window_overlay`` (kv > q - sliding_window); with ``mask``
    ([T], 1 real, 0 padding) also ``padding_mask_function`` (key kv is real)."""
    q = np.arange(T)[:, None]
    kv = np.arange(T)[None, :]
    seen = kv <= q
    if s["layer_types"][layer] == "sliding_attention":
        seen = seen & (kv > q - s["sliding_window"])
    if mask is not None:
        seen = seen & (np.asarray(mask)[None, :] != 0)
    return seen


def masked_softmax(scores: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """Softmax over keys of the visible entries (``eager_attention_forward`` adds the dtype's minimum to the
    hidden ones, which gives them weight exactly 0 as soon as one key is visible). A row with no visible key
    (a padding query under left padding) is returned as zeros here: transformers' value there depends on
    the attention implementation, so compare real tokens only."""
    z = np.where(seen, scores, -np.inf)
    top = np.max(z, axis=-1, keepdims=True)
    e = np.where(seen, np.exp(z - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = np.sum(e, axis=-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


# ----------------------------------------------------------------------------------------------------
# Attention, block, model
# ----------------------------------------------------------------------------------------------------


def attention(w: dict, s: dict, layer: int, x: np.ndarray, mask: np.ndarray | None = None) -> dict:
    """``Gemma2Attention.forward`` / ``Gemma3Attention.forward`` + ``eager_attention_forward`` on the
    normed stream x [T, D]. Returns ``out`` [T, D] (after o_proj), ``maps`` [N, T, T] and ``scores``
    [N, T, T] (scaled and, in Gemma 2, softcapped; before the mask)."""
    b = f"model.layers.{layer}.self_attn"
    T = x.shape[0]
    N, K, H, eps = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"], s["rms_norm_eps"]
    q = linear(x, w[f"{b}.q_proj.weight"]).reshape(T, N, H)
    k = linear(x, w[f"{b}.k_proj.weight"]).reshape(T, K, H)
    v = linear(x, w[f"{b}.v_proj.weight"]).reshape(T, K, H)
    if s["model_type"] == "gemma3_text":  # Gemma3Attention: q_norm / k_norm over head_dim, before RoPE
        q = rms_norm(q, w[f"{b}.q_norm.weight"], eps)
        k = rms_norm(k, w[f"{b}.k_norm.weight"], eps)
    base, factor = rope_parameters(s, layer)
    cos, sin = rope_tables(np.arange(T), inverse_frequencies(base, H, factor))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # repeat_kv: query head n reads key/value head n // (N / K)
    group = N // K
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("qnh,knh->nqk", q, k) * float(s["query_pre_attn_scalar"]) ** -0.5
    if s["model_type"] == "gemma2":  # only Gemma2Attention passes softcap= to the attention function
        scores = softcap(scores, s["attn_logit_softcapping"])
    maps = masked_softmax(scores, visible(s, layer, T, mask)[None])
    z = np.einsum("nqk,knh->qnh", maps, v).reshape(T, N * H)
    return {"out": linear(z, w[f"{b}.o_proj.weight"]), "maps": maps, "scores": scores}


def block(w: dict, s: dict, layer: int, x: np.ndarray, mask: np.ndarray | None = None) -> dict:
    """``Gemma2DecoderLayer.forward`` / ``Gemma3DecoderLayer.forward``: the sandwich-normed attention and
    MLP sublayers, each added to the residual stream. Returns ``out`` (the stream leaving the block) and the
    attention's ``maps`` and ``scores``."""
    b = f"model.layers.{layer}"
    eps = s["rms_norm_eps"]
    a = attention(w, s, layer, rms_norm(x, w[f"{b}.input_layernorm.weight"], eps), mask)
    x = x + rms_norm(a["out"], w[f"{b}.post_attention_layernorm.weight"], eps)
    m = mlp(rms_norm(x, w[f"{b}.pre_feedforward_layernorm.weight"], eps),
            w[f"{b}.mlp.gate_proj.weight"], w[f"{b}.mlp.up_proj.weight"], w[f"{b}.mlp.down_proj.weight"])
    x = x + rms_norm(m, w[f"{b}.post_feedforward_layernorm.weight"], eps)
    return {"out": x, "maps": a["maps"], "scores": a["scores"]}


def forward(weights: dict, cfg: dict, ids: np.ndarray, mask: np.ndarray | None = None,
            scores: bool = False) -> dict:
    """``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` on one sequence ``ids`` [T], in float64.

    Returns ``logits`` [T, V], ``maps`` [L, N, T, T] (softmax weights), ``hidden`` [L + 1, T, D]
    (``output_hidden_states``: the stream entering each block, then the final norm's output),
    ``resid_post`` [L, T, D] (the stream leaving each block, before the final norm) and, with
    ``scores=True``, ``scores`` [L, N, T, T] (the pre-softmax scores, scaled and softcapped, before the
    mask). ``mask`` ([T], 1 real, 0 padding) hides padding keys; positions stay 0..T-1."""
    s = settings(cfg)
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    ids = np.asarray(ids)
    embed = w["model.embed_tokens.weight"]
    # Gemma2Model.forward's normalizer / Gemma3TextScaledWordEmbedding's embed_scale: sqrt(D)
    x = embed[ids] * math.sqrt(s["hidden_size"])
    hidden, resid_post, maps, all_scores = [x], [], [], []
    for layer in range(s["num_hidden_layers"]):
        out = block(w, s, layer, x, mask)
        x = out["out"]
        resid_post.append(x)
        hidden.append(x)
        maps.append(out["maps"])
        all_scores.append(out["scores"])
    final = rms_norm(x, w["model.norm.weight"], s["rms_norm_eps"])  # Gemma2Model.forward: self.norm
    hidden[-1] = final  # check_model_inputs: the last entry is last_hidden_state
    logits = softcap(final @ embed.T, s["final_logit_softcapping"])  # tied lm_head, then the softcap
    result = {"logits": logits, "maps": np.stack(maps), "hidden": np.stack(hidden),
              "resid_post": np.stack(resid_post)}
    if scores:
        result["scores"] = np.stack(all_scores)
    return result


def greedy(weights: dict, cfg: dict, ids: np.ndarray, new: int) -> np.ndarray:
    """Greedy continuation: ``new`` times, a full forward of the sequence so far and the argmax of its last
    row appended. Returns the prompt followed by the ``new`` tokens."""
    out = [int(t) for t in np.asarray(ids)]
    for _ in range(new):
        out.append(int(np.argmax(forward(weights, cfg, np.array(out))["logits"][-1])))
    return np.array(out, dtype=np.asarray(ids).dtype)
