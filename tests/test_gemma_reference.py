"""Checks of the float64 NumPy Gemma 2 / Gemma 3 reference (tests/gemma_reference.py) without torch:

* against a second, separate implementation written here with plain Python loops over positions, heads and
  dimensions (whole model: every block, the final norm, the logits);
* against transformers' own Flax Gemma modules (``FlaxGemmaRMSNorm``, ``FlaxGemmaAttention``,
  ``FlaxGemmaMLP``) assembled into Gemma 2's sandwich block, where Gemma 2 reduces to them (no softcapping,
  ``query_pre_attn_scalar = head_dim``, rope_theta 10000, no sliding window in reach);
* invariants: the sliding window, softcapping, which RoPE base and scaling each layer uses, the
  ``output_hidden_states`` convention, the padding mask, greedy decoding;
* the checkpoint pieces: config.json through transformers' config classes, weight names against the
  modeling source, safetensors round trip.
"""

import importlib.util
import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

import gemma_reference as ref

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=4, query_pre_attn_scalar=8)
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]
FULL = ["full_attention"] * 3
SLIDING = ["sliding_attention"] * 3


def tiny(model_type, **fields):
    return ref.config_dict(model_type, **{**TINY, **fields})


def ids_of(T, seed=1):
    return np.random.default_rng(seed).integers(0, TINY["vocab_size"], T)


# ----------------------------------------------------------------------------------------------------
# A second implementation: plain Python loops
# ----------------------------------------------------------------------------------------------------


def _matvec(W, x):
    return [sum(W[o][i] * x[i] for i in range(len(x))) for o in range(len(W))]


def _rms(x, w, eps):
    r = math.sqrt(sum(v * v for v in x) / len(x) + eps)
    return [x[i] / r * (1.0 + w[i]) for i in range(len(x))]


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def _rotate(vec, position, base, factor):
    """RoPE on one head as pairs (j, j + H/2) rotated by the angle (position / factor) * base^(-2j/H)."""
    H = len(vec)
    out = list(vec)
    for j in range(H // 2):
        angle = (position / factor) * base ** (-(2.0 * j) / H)
        c, s = math.cos(angle), math.sin(angle)
        out[j] = vec[j] * c - vec[j + H // 2] * s
        out[j + H // 2] = vec[j + H // 2] * c + vec[j] * s
    return out


def loop_model(weights, cfg, ids):
    """Gemma 2 / Gemma 3 (text) with explicit loops, read from the same transformers source as the
    reference but written without NumPy arrays: returns logits, maps, hidden as nested lists."""
    gemma3 = cfg["model_type"] == "gemma3_text"
    D, N, K, H = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, W = cfg["rms_norm_eps"], cfg["sliding_window"]
    scaling = cfg.get("rope_scaling") or {}
    factor = scaling["factor"] if scaling.get("rope_type") == "linear" else 1.0
    w = {k: np.asarray(v, np.float64).tolist() for k, v in weights.items()}
    T = len(ids)
    E = w["model.embed_tokens.weight"]
    xs = [[e * math.sqrt(D) for e in E[int(i)]] for i in ids]
    hidden, maps = [[list(x) for x in xs]], []
    for layer in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{layer}"
        sliding = cfg["layer_types"][layer] == "sliding_attention"
        if gemma3 and sliding:
            base, f = cfg["rope_local_base_freq"], 1.0
        else:
            base, f = cfg["rope_theta"], factor
        normed = [_rms(x, w[f"{b}.input_layernorm.weight"], eps) for x in xs]
        q, k, v = [], [], []
        for t in range(T):
            qf = _matvec(w[f"{b}.self_attn.q_proj.weight"], normed[t])
            kf = _matvec(w[f"{b}.self_attn.k_proj.weight"], normed[t])
            vf = _matvec(w[f"{b}.self_attn.v_proj.weight"], normed[t])
            qh = [qf[n * H:(n + 1) * H] for n in range(N)]
            kh = [kf[n * H:(n + 1) * H] for n in range(K)]
            if gemma3:
                qh = [_rms(h, w[f"{b}.self_attn.q_norm.weight"], eps) for h in qh]
                kh = [_rms(h, w[f"{b}.self_attn.k_norm.weight"], eps) for h in kh]
            q.append([_rotate(h, t, base, f) for h in qh])
            k.append([_rotate(h, t, base, f) for h in kh])
            v.append([vf[n * H:(n + 1) * H] for n in range(K)])
        layer_maps = [[[0.0] * T for _ in range(T)] for _ in range(N)]
        z = [[0.0] * (N * H) for _ in range(T)]
        for n in range(N):
            g = n // (N // K)
            for t in range(T):
                allowed = [s for s in range(T) if s <= t and (not sliding or s > t - W)]
                scores = {}
                for s in allowed:
                    score = sum(q[t][n][d] * k[s][g][d] for d in range(H)) / math.sqrt(cfg["query_pre_attn_scalar"])
                    if not gemma3 and cfg["attn_logit_softcapping"] is not None:
                        c = cfg["attn_logit_softcapping"]
                        score = c * math.tanh(score / c)
                    scores[s] = score
                top = max(scores.values())
                total = sum(math.exp(scores[s] - top) for s in allowed)
                for s in allowed:
                    p = math.exp(scores[s] - top) / total
                    layer_maps[n][t][s] = p
                    for d in range(H):
                        z[t][n * H + d] += p * v[s][g][d]
        maps.append(layer_maps)
        for t in range(T):
            o = _matvec(w[f"{b}.self_attn.o_proj.weight"], z[t])
            o = _rms(o, w[f"{b}.post_attention_layernorm.weight"], eps)
            xs[t] = [xs[t][i] + o[i] for i in range(D)]
            m_in = _rms(xs[t], w[f"{b}.pre_feedforward_layernorm.weight"], eps)
            gate = _matvec(w[f"{b}.mlp.gate_proj.weight"], m_in)
            up = _matvec(w[f"{b}.mlp.up_proj.weight"], m_in)
            down = _matvec(w[f"{b}.mlp.down_proj.weight"], [_gelu_tanh(gate[j]) * up[j] for j in range(len(up))])
            down = _rms(down, w[f"{b}.post_feedforward_layernorm.weight"], eps)
            xs[t] = [xs[t][i] + down[i] for i in range(D)]
        hidden.append([list(x) for x in xs])
    final = [_rms(x, w["model.norm.weight"], eps) for x in xs]
    hidden[-1] = final
    logits = [[sum(final[t][d] * E[u][d] for d in range(D)) for u in range(len(E))] for t in range(T)]
    if cfg["final_logit_softcapping"] is not None:
        c = cfg["final_logit_softcapping"]
        logits = [[c * math.tanh(x / c) for x in row] for row in logits]
    return logits, maps, hidden


LOOP_CASES = {
    # Gemma 2: attention and final softcapping small enough to bite, linear RoPE scaling on every layer
    "gemma2": dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                   rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # Gemma 3: q/k norms, local base on sliding layers, linear scaling on the full layer only;
    # attn_logit_softcapping is in the config but the attention does not apply it
    "gemma3_text": dict(layer_types=MIXED, rope_theta=10000.0, rope_local_base_freq=100.0,
                        rope_scaling={"rope_type": "linear", "factor": 4.0},
                        attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
}


@pytest.mark.parametrize("model_type", sorted(LOOP_CASES))
def test_matches_a_loop_implementation(model_type):
    cfg = tiny(model_type, **LOOP_CASES[model_type])
    weights = ref.random_weights(cfg, seed=3)
    ids = ids_of(7)  # T = 7 > sliding_window = 4: the window hides keys on rows 4, 5, 6
    out = ref.forward(weights, cfg, ids)
    logits, maps, hidden = loop_model(weights, cfg, ids)
    np.testing.assert_allclose(out["maps"], np.array(maps), atol=1e-12, rtol=0)
    np.testing.assert_allclose(out["hidden"], np.array(hidden), atol=1e-11, rtol=0)
    np.testing.assert_allclose(out["logits"], np.array(logits), atol=1e-11, rtol=0)


def test_the_loop_implementation_sees_each_feature():
    """The loop comparison is not vacuous: the features it covers move the outputs."""
    cfg = tiny("gemma3_text", **LOOP_CASES["gemma3_text"])
    weights = ref.random_weights(cfg, seed=3)
    ids = ids_of(7)
    base = ref.forward(weights, cfg, ids)["logits"]
    for change in (dict(rope_local_base_freq=1000.0), dict(rope_scaling=None), dict(sliding_window=6),
                   dict(final_logit_softcapping=None), dict(layer_types=FULL)):
        other = ref.forward(weights, {**cfg, **change}, ids)["logits"]
        assert np.abs(other - base).max() > 1e-3, change
    q_norm = dict(weights, **{"model.layers.0.self_attn.q_norm.weight": np.zeros(8, np.float32)})
    assert np.abs(ref.forward(q_norm, cfg, ids)["logits"] - base).max() > 1e-3


# ----------------------------------------------------------------------------------------------------
# transformers' Flax Gemma modules, assembled into a Gemma 2 block
# ----------------------------------------------------------------------------------------------------


def flax_gemma2(weights, cfg, ids):
    """Gemma 2 built from transformers' FlaxGemmaRMSNorm / FlaxGemmaAttention / FlaxGemmaMLP (float32):
    valid where Gemma 2 reduces to Gemma 1's attention (scale head_dim^-0.5, base 10000, no softcapping,
    no key out of the sliding window)."""
    import transformers
    from transformers.models.gemma import modeling_flax_gemma as fg

    D, H = cfg["hidden_size"], cfg["head_dim"]
    assert cfg["query_pre_attn_scalar"] == H and cfg["rope_theta"] == 10000.0
    assert cfg["attn_logit_softcapping"] is None and cfg["final_logit_softcapping"] is None
    assert "sliding_attention" not in cfg["layer_types"] or len(ids) <= cfg["sliding_window"]
    fc = transformers.GemmaConfig(
        vocab_size=cfg["vocab_size"], hidden_size=D, intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=1, num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], head_dim=H, max_position_embeddings=32,
        rms_norm_eps=cfg["rms_norm_eps"], hidden_activation="gelu_pytorch_tanh")
    w = {k: np.asarray(v, np.float32) for k, v in weights.items()}
    T = len(ids)

    def norm(name, x):
        return fg.FlaxGemmaRMSNorm(fc).apply({"params": {"weight": w[name]}}, x)

    def dense(name):
        return {"kernel": w[name].T}

    with jax.numpy_rank_promotion("allow"):
        x = w["model.embed_tokens.weight"][np.asarray(ids)][None] * np.float32(D ** 0.5)  # [1, T, D]
        hidden, maps = [np.asarray(x[0])], []
        for layer in range(cfg["num_hidden_layers"]):
            b = f"model.layers.{layer}"
            attn = {p: dense(f"{b}.self_attn.{p}.weight") for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
            out, weights_ = fg.FlaxGemmaAttention(fc).apply(
                {"params": attn}, norm(f"{b}.input_layernorm.weight", x), attention_mask=np.ones((1, T), "i4"),
                position_ids=np.arange(T)[None], output_attentions=True)
            x = x + norm(f"{b}.post_attention_layernorm.weight", out)
            mlp = {p: dense(f"{b}.mlp.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")}
            m = fg.FlaxGemmaMLP(fc).apply({"params": mlp}, norm(f"{b}.pre_feedforward_layernorm.weight", x))
            x = x + norm(f"{b}.post_feedforward_layernorm.weight", m)
            hidden.append(np.asarray(x[0]))
            maps.append(np.asarray(weights_[0]))
        final = norm("model.norm.weight", x)[0]
        hidden[-1] = np.asarray(final)
        logits = np.asarray(final @ w["model.embed_tokens.weight"].T)
    return logits, np.stack(maps), np.stack(hidden)


@pytest.mark.parametrize("layer_types, T", [(FULL, 12), (None, 4)], ids=["full-T12", "default-types-T4"])
def test_gemma2_matches_transformers_flax_gemma_modules(layer_types, T):
    fields = dict(attn_logit_softcapping=None, final_logit_softcapping=None, rope_theta=10000.0)
    if layer_types is not None:
        fields["layer_types"] = layer_types
    cfg = tiny("gemma2", **fields)
    assert layer_types is not None or cfg["layer_types"] == MIXED  # Gemma2Config's default: sliding first
    weights = ref.random_weights(cfg, seed=5)
    ids = ids_of(T, seed=2)
    out = ref.forward(weights, cfg, ids)
    logits, maps, hidden = flax_gemma2(weights, cfg, ids)
    np.testing.assert_allclose(out["maps"], maps, atol=2e-6, rtol=0)
    np.testing.assert_allclose(out["hidden"], hidden, atol=2e-5, rtol=0)
    np.testing.assert_allclose(out["logits"], logits, atol=2e-5, rtol=0)


# ----------------------------------------------------------------------------------------------------
# Invariants
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_sliding_window(model_type):
    cfg = tiny(model_type, layer_types=MIXED)
    weights = ref.random_weights(cfg, seed=0)
    T, W = 12, cfg["sliding_window"]
    maps = ref.forward(weights, cfg, ids_of(T))["maps"]
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    np.testing.assert_allclose(maps.sum(-1), 1.0, atol=1e-12, rtol=0)
    assert np.all(maps[:, :, s > t] == 0)  # causal, every layer
    for layer, kind in enumerate(cfg["layer_types"]):
        in_window = (s <= t) & (s > t - W)
        if kind == "sliding_attention":
            assert np.all(maps[layer][:, (s <= t - W) & (s <= t)] == 0)
            assert np.all(maps[layer][:, in_window] > 0)
        else:
            assert np.all(maps[layer][:, s <= t] > 0)  # a full layer sees beyond the window
    # off by one: the first layer's rows t < W are those of an all-full model (same input, and in Gemma 3
    # the same RoPE base), row W is not
    full_cfg = {**cfg, "layer_types": FULL, "rope_theta": cfg.get("rope_local_base_freq", cfg["rope_theta"])}
    full = ref.forward(weights, full_cfg, ids_of(T))["maps"]
    np.testing.assert_array_equal(maps[0][:, :W], full[0][:, :W])
    assert np.abs(maps[0][:, W] - full[0][:, W]).max() > 1e-3


def test_attention_softcapping_gemma2():
    c = 1.5
    capped_cfg = tiny("gemma2", attn_logit_softcapping=c, final_logit_softcapping=None)
    plain_cfg = {**capped_cfg, "attn_logit_softcapping": None}
    weights = ref.random_weights(capped_cfg, seed=0)
    ids = ids_of(12)
    capped = ref.forward(weights, capped_cfg, ids, scores=True)
    plain = ref.forward(weights, plain_cfg, ids, scores=True)
    assert np.abs(plain["scores"]).max() > c  # the cap has something to do
    assert np.all(np.abs(capped["scores"]) < c)
    # layer 0 sees the same input in both: its scores are c tanh(plain / c)
    np.testing.assert_allclose(capped["scores"][0], c * np.tanh(plain["scores"][0] / c), atol=1e-12, rtol=0)
    assert np.abs(capped["maps"] - plain["maps"]).max() > 1e-2


def test_gemma3_ignores_attn_logit_softcapping():
    """Gemma3TextConfig carries attn_logit_softcapping, but Gemma3Attention does not pass it on."""
    cfg = tiny("gemma3_text", layer_types=MIXED, attn_logit_softcapping=0.5)
    weights = ref.random_weights(cfg, seed=0)
    ids = ids_of(12)
    capped = ref.forward(weights, cfg, ids, scores=True)
    plain = ref.forward(weights, {**cfg, "attn_logit_softcapping": None}, ids, scores=True)
    assert np.abs(capped["scores"]).max() > 0.5
    np.testing.assert_array_equal(capped["logits"], plain["logits"])


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_final_logit_softcapping(model_type):
    f = 2.0
    cfg = tiny(model_type, final_logit_softcapping=f, layer_types=MIXED)
    weights = ref.random_weights(cfg, seed=0)
    ids = ids_of(12)
    capped = ref.forward(weights, cfg, ids)["logits"]
    plain = ref.forward(weights, {**cfg, "final_logit_softcapping": None}, ids)["logits"]
    assert np.abs(plain).max() > f
    assert np.all(np.abs(capped) < f)
    np.testing.assert_allclose(capped, f * np.tanh(plain / f), atol=1e-12, rtol=0)


def _logits(cfg, **change):
    weights = ref.random_weights(cfg, seed=4)
    return ref.forward(weights, {**cfg, **change}, ids_of(12))["logits"]


def test_gemma3_rope_base_and_scaling_per_layer():
    """Full layers: rope_theta and rope_scaling; sliding layers: rope_local_base_freq, never scaled."""
    linear = {"rope_type": "linear", "factor": 4.0}
    full = tiny("gemma3_text", layer_types=FULL)
    sliding = tiny("gemma3_text", layer_types=SLIDING)
    mixed = tiny("gemma3_text", layer_types=MIXED)
    # the local base reaches sliding layers only
    np.testing.assert_array_equal(_logits(full), _logits(full, rope_local_base_freq=50.0))
    assert np.abs(_logits(mixed) - _logits(mixed, rope_local_base_freq=50.0)).max() > 1e-3
    # rope_theta and rope_scaling reach full layers only
    np.testing.assert_array_equal(_logits(sliding), _logits(sliding, rope_theta=50.0))
    np.testing.assert_array_equal(_logits(sliding), _logits(sliding, rope_scaling=linear))
    assert np.abs(_logits(mixed) - _logits(mixed, rope_theta=50.0)).max() > 1e-3
    assert np.abs(_logits(mixed) - _logits(mixed, rope_scaling=linear)).max() > 1e-3


def test_gemma2_rope_theta_and_scaling_on_every_layer():
    """Gemma 2 has no local base: rope_theta and rope_scaling reach sliding layers as well."""
    sliding = tiny("gemma2", layer_types=SLIDING)
    linear = {"rope_type": "linear", "factor": 4.0}
    assert np.abs(_logits(sliding) - _logits(sliding, rope_theta=50.0)).max() > 1e-3
    assert np.abs(_logits(sliding) - _logits(sliding, rope_scaling=linear)).max() > 1e-3
    # "type" is the older spelling of "rope_type" (Gemma2RotaryEmbedding.__init__ reads both)
    np.testing.assert_array_equal(_logits(sliding, rope_scaling=linear),
                                  _logits(sliding, rope_scaling={"type": "linear", "factor": 4.0}))


def test_linear_scaling_divides_the_positions():
    cos, sin = ref.rope_tables(np.arange(6), ref.inverse_frequencies(10000.0, 8, factor=4.0))
    cos1, sin1 = ref.rope_tables(np.arange(6) / 4.0, ref.inverse_frequencies(10000.0, 8))
    np.testing.assert_allclose(cos, cos1, atol=1e-15, rtol=0)
    np.testing.assert_allclose(sin, sin1, atol=1e-15, rtol=0)
    assert ref.rope_parameters(ref.settings(tiny("gemma3_text", layer_types=MIXED,
                                                 rope_scaling={"rope_type": "linear", "factor": 8.0})), 1) == (1e6, 8.0)


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_hidden_states_convention(model_type):
    """hidden[0]: sqrt(D) x embedding; hidden[i]: the stream leaving block i - 1; hidden[L]: the final norm
    of resid_post[L - 1]; logits: hidden[L] @ embed^T (tied head)."""
    cfg = tiny(model_type, layer_types=MIXED, final_logit_softcapping=None)
    weights = ref.random_weights(cfg, seed=0)
    ids = ids_of(12)
    out = ref.forward(weights, cfg, ids)
    L, D = cfg["num_hidden_layers"], cfg["hidden_size"]
    embed = weights["model.embed_tokens.weight"].astype(np.float64)
    assert out["hidden"].shape == (L + 1, 12, D) and out["resid_post"].shape == (L, 12, D)
    assert out["maps"].shape == (L, 4, 12, 12) and out["logits"].shape == (12, 64)
    np.testing.assert_allclose(out["hidden"][0], embed[ids] * math.sqrt(D), atol=1e-14, rtol=0)
    np.testing.assert_array_equal(out["hidden"][1:L], out["resid_post"][:L - 1])
    final = ref.rms_norm(out["resid_post"][-1], weights["model.norm.weight"].astype(np.float64), 1e-6)
    np.testing.assert_allclose(out["hidden"][L], final, atol=1e-14, rtol=0)
    assert np.abs(out["hidden"][L] - out["resid_post"][-1]).max() > 1e-2
    np.testing.assert_allclose(out["logits"], final @ embed.T, atol=1e-12, rtol=0)


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_scales_give_order_one_logits_and_peaked_maps(model_type):
    cfg = tiny(model_type, layer_types=MIXED, final_logit_softcapping=None)
    out = ref.forward(ref.random_weights(cfg, seed=0), cfg, ids_of(12))
    assert 0.3 < out["logits"].std() < 10
    # uniform rows would put 1 / (number of visible keys) on each; the largest weights are well above that
    maps = out["maps"]
    uniform = 1.0 / (maps > 0).sum(-1)
    assert maps.max(-1).mean() > 1.5 * uniform.mean()


def test_padding_mask_hides_keys():
    cfg = tiny("gemma3_text", layer_types=MIXED)
    weights = ref.random_weights(cfg, seed=0)
    ids = ids_of(8)
    np.testing.assert_array_equal(ref.forward(weights, cfg, ids, mask=np.ones(8))["logits"],
                                  ref.forward(weights, cfg, ids)["logits"])
    mask = np.array([0, 0, 1, 1, 0, 1, 1, 1])  # left padding and one padding key inside
    maps = ref.forward(weights, cfg, ids, mask=mask)["maps"]
    assert np.all(maps[..., [0, 1, 4]] == 0)
    np.testing.assert_allclose(maps[:, :, 2:].sum(-1), 1.0, atol=1e-12, rtol=0)
    assert np.all(maps[:, :, 3, 2:4] > 0)
    # the left-padding queries see no key at all: returned as zeros
    assert np.all(maps[:, :, :2] == 0)


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_greedy(model_type):
    cfg = tiny(model_type, layer_types=MIXED)
    weights = ref.random_weights(cfg, seed=7)
    ids = ids_of(5)
    gen = ref.greedy(weights, cfg, ids, new=4)
    assert gen.shape == (9,)
    np.testing.assert_array_equal(gen[:5], ids)
    # row t of one causal forward of the whole output is the forward of the prefix gen[:t + 1]
    full = ref.forward(weights, cfg, gen)["logits"]
    np.testing.assert_array_equal(gen[5:], np.argmax(full[4:8], axis=-1))


# ----------------------------------------------------------------------------------------------------
# Configs, names, files
# ----------------------------------------------------------------------------------------------------


def test_config_dict_is_the_config_class_json():
    g2 = ref.config_dict("gemma2", num_hidden_layers=4)
    assert g2["model_type"] == "gemma2" and g2["transformers_version"]
    assert g2["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert g2["attn_logit_softcapping"] == 50.0 and g2["final_logit_softcapping"] == 30.0
    g3 = ref.config_dict("gemma3_text", num_hidden_layers=7)
    assert g3["model_type"] == "gemma3_text"
    assert g3["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert g3["attn_logit_softcapping"] is None and g3["final_logit_softcapping"] is None
    assert g3["rope_theta"] == 1e6 and g3["rope_local_base_freq"] == 1e4
    # a config.json without layer_types gets the config class's default
    for cfg in (g2, g3):
        bare = {k: v for k, v in cfg.items() if k != "layer_types"}
        assert ref.settings(bare)["layer_types"] == cfg["layer_types"]
    with pytest.raises(ValueError):
        ref.config_dict("gemma", num_hidden_layers=2)


@pytest.mark.parametrize("model_type, module", [("gemma2", "gemma2"), ("gemma3_text", "gemma3")])
def test_weight_names_follow_the_modeling_source(model_type, module):
    """Each part of each name is a submodule the modeling code assigns (``self.<part> = ``); Gemma 3 has
    q_norm / k_norm and Gemma 2 has not; no lm_head (tied); the config's tensor-parallel plan (written
    against the same module names) matches the projections."""
    cfg = tiny(model_type)
    weights = ref.random_weights(cfg, seed=0)
    source = Path(importlib.util.find_spec(f"transformers.models.{module}.modeling_{module}").origin).read_text()
    parts = {p for name in weights for p in name.split(".")[:-1] if not p.isdigit()}
    for part in parts:
        assert f"self.{part} = " in source, part
    assert ("self.q_norm = " in source) == (model_type == "gemma3_text")
    assert any("q_norm" in n for n in weights) == (model_type == "gemma3_text")
    assert not any(n.startswith("lm_head") for n in weights)
    import transformers

    cls = transformers.Gemma2Config if model_type == "gemma2" else transformers.Gemma3TextConfig
    for pattern in cls.base_model_tp_plan:
        for i in range(3):
            assert "model." + pattern.replace("*", str(i)) + ".weight" in weights
    for name, value in weights.items():
        assert value.dtype == np.float32 and np.unique(value).size > 0.95 * value.size, name  # every leaf random
    assert len(weights) == 1 + 1 + 3 * (13 if model_type == "gemma3_text" else 11)


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_save_hf_round_trip(model_type, tmp_path):
    import transformers
    from safetensors.numpy import load_file

    cfg = tiny(model_type, layer_types=MIXED)
    weights = ref.random_weights(cfg, seed=0)
    directory = ref.save_hf(tmp_path / "ckpt", cfg, weights, tokenizer_json='{"version": "1.0"}')
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert json.loads((directory / "config.json").read_text()) == cfg
    loaded = transformers.AutoConfig.from_pretrained(directory)
    assert loaded.model_type == model_type and loaded.layer_types == MIXED
    assert json.loads(loaded.to_json_string()) == cfg
    back = load_file(str(directory / "model.safetensors"))
    assert back.keys() == weights.keys()
    for name in weights:
        np.testing.assert_array_equal(back[name], weights[name])
    assert not (ref.save_hf(tmp_path / "bare", cfg, weights) / "tokenizer.json").exists()
