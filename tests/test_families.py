"""Gemma and Qwen3 on the shared decoder: parity with transformers' FlaxGemmaForCausalLM and with a float64
NumPy Qwen3 written here, on tiny random checkpoints saved as Hugging Face directories; the same API
(forward, generate, log_prob, capture, patch, head_mask) as every family."""

from pathlib import Path

import jax
import numpy as np
import pytest

from gpt2_checkpoints import train_tokenizer
from jaxattn import llama
from jaxattn.checkpoint import flatten, unflatten, unstack_layers
from llama_checkpoints import random_params, save_hf

TOL = 1e-5
P = 32  # max_position_embeddings: Flax Gemma's RoPE table needs P >= 2 H

# Tiny random configs: head_dim independent of D / N (Gemma's 2B has H = 256 with D / N = 256, 7B H = 256
# with D / N = 192); multi-query and grouped-query.
CONFIGS = {
    "gemma-mqa4x1-h16": dict(model_type="gemma", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                             head_dim=16, hidden_size=24, intermediate_size=40, tie_word_embeddings=True),
    "gemma-gqa4x2-h8": dict(model_type="gemma", num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, hidden_size=32, intermediate_size=64, tie_word_embeddings=True,
                            rms_norm_eps=1e-5),
    "qwen3-gqa4x2-untied": dict(model_type="qwen3", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16, hidden_size=32, intermediate_size=48, rope_theta=1e6),
    "qwen3-mha2-tied": dict(model_type="qwen3", num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                            head_dim=8, hidden_size=24, intermediate_size=32, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


def ids_of(config, T=12, seed=0):
    return np.random.default_rng(seed).integers(0, config.vocab_size, T).astype(np.int32)


# make test runs one Gemma (GQA) and one Qwen3 (GQA, untied, 2 layers); the others run in make test-slow.
SLOW = {"gemma-mqa4x1-h16", "qwen3-mha2-tied"}


@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                        for n in sorted(CONFIGS)])
def case(request, tok, tmp_path_factory):
    """A tiny random checkpoint written by transformers' config class + safetensors, loaded back."""
    config = llama.LlamaConfig.make(vocab_size=tok.get_vocab_size() + 4, max_position_embeddings=P,
                                    **CONFIGS[request.param])
    weights = random_params(len(request.param), config)
    directory = save_hf(tmp_path_factory.mktemp(request.param), weights, config, tok)
    params, loaded, tokenizer = llama.load(directory)
    assert loaded == config
    return config, params, tokenizer


def _flax_gemma(params, config, ids):
    import transformers

    hf = transformers.GemmaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
    )
    with jax.numpy_rank_promotion("allow"):
        model = transformers.FlaxGemmaForCausalLM(hf, _do_init=False)
        out = model(np.asarray(ids)[None], params=unflatten(unstack_layers({k: np.asarray(v) for k, v in flatten(params).items()}, "model/layers")),
                    output_attentions=True, output_hidden_states=True)
    return (np.asarray(out.logits[0]), np.stack([np.asarray(a[0]) for a in out.attentions]),
            np.stack([np.asarray(h[0]) for h in out.hidden_states]))


def _numpy_qwen3(params, config, ids):
    """Qwen3 in float64 NumPy, from Hugging Face's modeling_qwen3: RMSNorm of each head's q and k before
    RoPE (rotate halves), no q/k/v bias, SwiGLU, causal GQA."""
    p = {k: np.asarray(v, np.float64) for k, v in unstack_layers(flatten(params), "model/layers").items()}
    N, K, H, eps = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.rms_norm_eps
    T = len(ids)

    def rms(x, w):
        return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)

    inv = 1.0 / config.rope_theta ** (np.arange(0, H, 2) / H)
    ang = np.arange(T)[:, None] * inv[None, :]  # [T, H/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):  # [T, heads, H]
        x1, x2 = x[..., :H // 2], x[..., H // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    x = p["model/embed_tokens/embedding"][ids]
    hidden, maps = [x], []
    for i in range(config.num_hidden_layers):
        b = f"model/layers/{i}"
        h = rms(x, p[f"{b}/input_layernorm/weight"])
        q = (h @ p[f"{b}/self_attn/q_proj/kernel"]).reshape(T, N, H)
        k = (h @ p[f"{b}/self_attn/k_proj/kernel"]).reshape(T, K, H)
        v = (h @ p[f"{b}/self_attn/v_proj/kernel"]).reshape(T, K, H)
        q, k = rope(rms(q, p[f"{b}/self_attn/q_norm/weight"])), rope(rms(k, p[f"{b}/self_attn/k_norm/weight"]))
        k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)
        logits = np.einsum("tnh,snh->nts", q, k) / np.sqrt(H)
        logits = np.where(np.tril(np.ones((T, T), bool))[None], logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        maps.append(w)
        x = x + np.einsum("nts,snh->tnh", w, v).reshape(T, N * H) @ p[f"{b}/self_attn/o_proj/kernel"]
        h = rms(x, p[f"{b}/post_attention_layernorm/weight"])
        gate = h @ p[f"{b}/mlp/gate_proj/kernel"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ p[f"{b}/mlp/up_proj/kernel"])) @ p[f"{b}/mlp/down_proj/kernel"]
        hidden.append(x)
    x = rms(x, p["model/norm/weight"])
    hidden[-1] = x
    head = p["model/embed_tokens/embedding"].T if config.tie_word_embeddings else p["lm_head/kernel"]
    return x @ head, np.stack(maps), np.stack(hidden)


def test_parity_with_the_reference(case):
    """Gemma against FlaxGemmaForCausalLM, Qwen3 against the float64 NumPy forward: logits, every map and
    every hidden state within 1e-5."""
    config, params, _ = case
    ids = ids_of(config)
    out = llama.forward(params, config, ids, return_hidden_states=True)
    reference = _flax_gemma if config.model_type == "gemma" else _numpy_qwen3
    logits, maps, hidden = reference(params, config, ids)
    np.testing.assert_allclose(out.logits, logits, atol=TOL, rtol=0)
    np.testing.assert_allclose(out.attentions, maps, atol=TOL, rtol=0)
    np.testing.assert_allclose(out.hidden_states, hidden, atol=TOL, rtol=0)


def test_each_family_differs_where_it_should(case):
    """The family's own pieces matter: the same weights read as plain Llama give other logits."""
    config, params, _ = case
    ids = ids_of(config)
    as_llama = config._replace(model_type="llama", hidden_act="silu")
    flat = {k: v for k, v in flatten(params).items() if "q_norm" not in k and "k_norm" not in k}
    other = llama.forward(unflatten(flat), as_llama, ids).logits
    assert np.abs(np.asarray(other) - np.asarray(llama.forward(params, config, ids).logits)).max() > 1e-2


def test_the_same_api_generate_log_prob_capture_patch_head_mask(case):
    config, params, _ = case
    ids = ids_of(config, T=6)
    out = llama.forward(params, config, ids, capture=("z", "resid_post"))
    # generate: greedy continuation = the argmax of full forwards, step by step (row t of one causal forward
    # of the whole output is the full forward of the prefix gen[:t + 1])
    gen = np.asarray(llama.generate(params, config, ids, max_new_tokens=3))
    np.testing.assert_array_equal(gen[:6], ids)
    full = np.asarray(llama.forward(params, config, gen).logits)  # [9, V]
    np.testing.assert_array_equal(gen[6:], np.argmax(full[5:8], axis=-1))
    # log_prob: the sum of the picked log-softmax rows
    logp = jax.nn.log_softmax(np.asarray(out.logits, np.float64), axis=-1)
    np.testing.assert_allclose(float(llama.log_prob(params, config, ids, start=2)),
                               sum(float(logp[t - 1, ids[t]]) for t in range(2, 6)), atol=1e-4)
    # unembed(final_norm(resid_post[-1])) is the logits
    lens = llama.unembed(params, config, llama.final_norm(params, config, out.captured["resid_post"][-1]))
    np.testing.assert_allclose(lens, out.logits, atol=1e-5, rtol=0)
    # head_mask 0 on head (0, 1) = patching its z with zeros
    mask = np.ones((config.num_hidden_layers, config.num_attention_heads), np.float32)
    mask[0, 1] = 0
    where = np.zeros(out.captured["z"].shape, bool)
    where[0, :, 1] = True
    patched = llama.forward(params, config, ids, patch={"z": (np.zeros(where.shape, np.float32), where)})
    np.testing.assert_allclose(llama.forward(params, config, ids, head_mask=mask).logits, patched.logits, atol=1e-6)


def test_save_load_round_trip(case, tmp_path):
    config, params, tokenizer = case
    params2, config2, _ = llama.load(llama.save(tmp_path / "again", params, config, tokenizer))
    assert config2 == config
    for key, value in flatten(params).items():
        np.testing.assert_array_equal(np.asarray(flatten(params2)[key]), np.asarray(value))


# --- what transformers' Flax class writes ---


@pytest.mark.parametrize("how", ["msgpack", "safetensors", "sharded msgpack"])
def test_directories_written_by_flax_llama_save_pretrained_load(tok, tmp_path, how):
    import transformers

    config = llama.LlamaConfig.make(vocab_size=tok.get_vocab_size() + 4, max_position_embeddings=16, hidden_size=16,
                                    intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2)
    weights = random_params(3, config)
    hf = transformers.LlamaConfig(vocab_size=config.vocab_size, hidden_size=16, intermediate_size=24,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=16, rms_norm_eps=config.rms_norm_eps)
    with jax.numpy_rank_promotion("allow"):
        model = transformers.FlaxLlamaForCausalLM(hf, _do_init=False)
        kwargs = {"safe_serialization": how != "msgpack"}
        if how == "sharded msgpack":
            kwargs["max_shard_size"] = "20KB"
        model.save_pretrained(tmp_path, params=unstack_layers(weights, "model/layers"), **kwargs)
    tok.save(str(tmp_path / "tokenizer.json"))
    names = {p.name for p in tmp_path.iterdir()}
    expected = {"msgpack": "flax_model.msgpack", "safetensors": "model.safetensors",
                "sharded msgpack": "flax_model.msgpack.index.json"}[how]
    assert expected in names, names
    params, loaded, _ = llama.load(tmp_path)
    assert loaded == config
    for key, value in flatten(weights).items():
        np.testing.assert_array_equal(np.asarray(flatten(params)[key]), value)


def test_an_unknown_weight_layout_lists_the_known_ones(tok, tmp_path):
    from safetensors.numpy import save_file

    config = llama.LlamaConfig.make(vocab_size=tok.get_vocab_size() + 4, max_position_embeddings=16, hidden_size=16,
                                    intermediate_size=24, num_hidden_layers=1, num_attention_heads=2)
    directory = save_hf(tmp_path / "c", random_params(0, config), config, tok)
    save_file({"transformer.wte.weight": np.zeros((4, 4), np.float32),
               "model.layers.0.attn.c_attn.weight": np.zeros((4, 4), np.float32)}, str(directory / "model.safetensors"))
    with pytest.raises(Exception, match=r"not a weight layout this loader knows \(it knows PyTorch names.*Flax names"):
        llama.load(directory)
