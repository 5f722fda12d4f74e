"""GPT-2 in pure JAX: parity with Hugging Face's FlaxGPT2LMHeadModel on tiny random models built here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt2_checkpoints import hf_model, hf_run, save_checkpoint, torch_layout, train_tokenizer
from jaxattn import gpt2
from jaxattn.checkpoint import stack_layers, unstack_layers

TOL = 1e-5

# (layers, heads, width, vocab, positions, n_inner, activation): several shapes, one per config.
CONFIGS = {
    "1L1H": dict(n_layer=1, n_head=1, n_embd=8, vocab_size=40, n_positions=16),
    "2L2H-inner24-gelu": dict(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=32, n_inner=24,
                              activation_function="gelu"),
    "3L4H": dict(n_layer=3, n_head=4, n_embd=32, vocab_size=64, n_positions=24, layer_norm_epsilon=1e-6),
}


@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.slow) if n == "1L1H" else n
                                        for n in sorted(CONFIGS)])  # make test: two configs; make test-slow: all
def case(request, tmp_path_factory):
    model = hf_model(seed=len(request.param), **CONFIGS[request.param])
    directory = save_checkpoint(tmp_path_factory.mktemp(request.param), model)
    config = gpt2.read_gpt2_config(directory / "config.json")
    params = gpt2.params_from_msgpack(directory / "flax_model.msgpack", config)
    return model, directory, config, params


def run(params, config, ids, scale=None):
    """The forward pass with every captured tensor: one compiled program per config and length."""
    return gpt2.forward(params, config, ids, scale=scale, return_attention_logits=True, return_qkv=True,
                        return_hidden_states=True)


def ids5(config):
    return (np.arange(5, dtype=np.int32) * 7 + 3) % config.vocab_size


def test_parity_with_flax_gpt2(case):
    model, _, config, params = case
    rng = np.random.default_rng(0)
    for T in (5, config.n_positions):
        ids = rng.integers(0, config.vocab_size, T).astype(np.int32)
        out = run(params, config, ids)
        logits, attentions, hidden = hf_run(model, ids)
        assert out.logits.shape == (T, config.vocab_size)
        assert out.attentions.shape == (config.n_layer, config.n_head, T, T)
        np.testing.assert_allclose(out.logits, logits, atol=TOL, rtol=0)
        for layer in range(config.n_layer):  # every attention map, layer by layer
            np.testing.assert_allclose(out.attentions[layer], attentions[layer], atol=TOL, rtol=0)
        np.testing.assert_allclose(out.hidden_states, hidden, atol=TOL, rtol=0)


def test_a_long_sequence_matches_flax_gpt2(tmp_path):
    """At 256 tokens: Flax's logits and every map (exact zeros above the diagonal)."""
    T = 256
    model = hf_model(seed=7, n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=T)
    directory = save_checkpoint(tmp_path, model)
    config = gpt2.read_gpt2_config(directory / "config.json")
    params = gpt2.params_from_msgpack(directory / "flax_model.msgpack", config)
    ids = np.random.default_rng(8).integers(0, config.vocab_size, T).astype(np.int32)
    out = gpt2.forward(params, config, ids)
    logits, attentions, _ = hf_run(model, ids)
    np.testing.assert_allclose(out.logits, logits, atol=TOL, rtol=0)
    np.testing.assert_allclose(out.attentions, np.stack(attentions), atol=TOL, rtol=0)
    assert np.all(np.asarray(out.attentions)[:, :, np.triu(np.ones((T, T), bool), 1)] == 0)


def test_params_are_interchangeable_with_hugging_face(case):
    """Loaded params are Hugging Face's with the blocks stacked; stack_layers and unstack_layers convert."""
    model, _, config, params = case
    theirs = stack_layers(model.params_, "transformer/h")
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(theirs)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(theirs)):
        np.testing.assert_array_equal(a, b)
    back = unstack_layers(params, "transformer/h", config.n_layer)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(model.params_)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(model.params_)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("prefix", ["transformer.", ""])
def test_safetensors_in_pytorch_layout_load_to_the_same_params(case, tmp_path, prefix):
    from safetensors.numpy import save_file

    model, _, config, params = case
    tensors = torch_layout(model.params_, prefix=prefix)
    tensors["lm_head.weight"] = tensors[f"{prefix}wte.weight"].copy()  # tied head, saved explicitly
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = gpt2.params_from_safetensors(tmp_path / "model.safetensors", config)
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(a, b)


def test_load_directory_both_formats(tmp_path):
    tok = train_tokenizer()
    model = hf_model(seed=3, n_layer=2, n_head=2, n_embd=16, vocab_size=tok.get_vocab_size(), n_positions=32)
    a = save_checkpoint(tmp_path / "msgpack", model, weights="msgpack", tokenizer=tok)
    b = save_checkpoint(tmp_path / "safetensors", model, weights="safetensors", tokenizer=tok)
    text = "The trophy didn't fit in the suitcase because it was too big."
    results = []
    for directory in (a, b):
        params, config, tokenizer = gpt2.load(directory)
        ids = tokenizer.encode(text)
        assert ids.tolist() == tok.encode(text).ids
        assert "".join(tokenizer.labels(ids)) == text
        results.append(gpt2.forward(params, config, ids).logits)
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_allclose(results[0], hf_run(model, ids)[0], atol=TOL, rtol=0)


def test_tokenizer_from_vocab_and_merges(tmp_path):
    tok = train_tokenizer()
    model = hf_model(seed=4, n_layer=1, n_head=1, n_embd=8, vocab_size=tok.get_vocab_size(), n_positions=32)
    directory = save_checkpoint(tmp_path, model)
    tok.save_model(str(directory))  # vocab.json + merges.txt, GPT-2's original tokenizer files
    _, _, tokenizer = gpt2.load(directory)
    text = "The trophy didn't fit in the suitcase because it was too small."
    assert tokenizer.encode(text).tolist() == tok.encode(text).ids


def test_scale_is_the_query_scale(case):
    """``scale=c/sqrt(H)`` equals the default model with the query projection multiplied by c."""
    _, _, config, params = case
    c = 3.0
    D = config.n_embd
    scaled = jax.tree_util.tree_map(lambda x: x, params)
    blocks = scaled["transformer"]["h"]  # every block's, stacked [L, ...]
    kernel = blocks["attn"]["c_attn"]["kernel"]  # [L, 3D, D] (out, in): rows 0..D-1 make q
    bias = blocks["attn"]["c_attn"]["bias"]
    blocks["attn"]["c_attn"] = {"kernel": kernel.at[:, :D].multiply(c), "bias": bias.at[:, :D].multiply(c)}
    a = run(params, config, ids5(config), scale=c / np.sqrt(config.head_dim))
    b = run(scaled, config, ids5(config))
    np.testing.assert_allclose(a.attentions, b.attentions, atol=TOL, rtol=0)
    np.testing.assert_allclose(a.logits, b.logits, atol=1e-4, rtol=0)


def test_captured_tensors_are_the_ones_used(case):
    _, _, config, params = case
    for scale in (None, 1.0):
        out = run(params, config, ids5(config), scale=scale)
        s = 1 / np.sqrt(config.head_dim) if scale is None else scale
        expect = np.einsum("LTNH,LSNH->LNTS", out.q, out.k) * s
        np.testing.assert_allclose(out.attention_logits, expect, atol=1e-5, rtol=1e-5)
        causal = np.tril(np.ones((5, 5), bool))
        masked = np.where(causal, np.asarray(out.attention_logits, np.float64), -np.inf)
        soft = np.exp(masked - masked.max(-1, keepdims=True))
        np.testing.assert_allclose(out.attentions, soft / soft.sum(-1, keepdims=True), atol=1e-6)
        assert np.all(np.asarray(out.attentions)[..., ~causal] == 0.0)


def test_unscaled_attention_collapses(case):
    _, _, config, params = case
    ent = []
    for scale in (None, 1.0, 100.0):
        w = np.asarray(run(params, config, ids5(config), scale=scale).attentions, np.float64)
        ent.append(-(w * np.log(np.where(w > 0, w, 1))).sum(-1).mean())
    assert ent[0] > ent[2]  # a large scale sharpens every row
    assert ent[1] >= ent[2]


def test_vmap_is_the_batch():
    config = gpt2.GPT2Config.make(vocab_size=40, n_positions=16, n_embd=8, n_layer=2, n_head=2)
    params = gpt2.init_params(0, config)
    ids = np.random.default_rng(1).integers(0, config.vocab_size, (3, 6)).astype(np.int32)
    batched = jax.vmap(lambda x: gpt2.forward(params, config, x).logits)(jnp.asarray(ids))
    for b in range(3):
        np.testing.assert_allclose(batched[b], gpt2.forward(params, config, ids[b]).logits, atol=1e-6)


def test_log_prob_matches_logits():
    config = gpt2.GPT2Config.make(vocab_size=40, n_positions=16, n_embd=8, n_layer=2, n_head=2)
    params = gpt2.init_params(1, config)
    ids = np.array([1, 2, 3, 4, 5], np.int32)
    logits = np.asarray(gpt2.forward(params, config, ids).logits, np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expect = logp[2, ids[3]] + logp[3, ids[4]]
    np.testing.assert_allclose(gpt2.log_prob(params, config, ids, start=3), expect, atol=1e-5)


@pytest.mark.parametrize(
    "ids, error, match",
    [
        (np.array([0.0, 1.0]), TypeError, r"input_ids must be integer token ids \[T\], received dtype float64"),
        (np.zeros((2, 3), np.int32), ValueError, r"1 dimension \[T\].*received shape \(2, 3\)"),
        (np.zeros((0,), np.int32), ValueError, r"1 to n_positions=16 tokens, received T=0"),
        (np.zeros((17,), np.int32), ValueError, r"1 to n_positions=16 tokens, received T=17"),
        (np.array([0, 40], np.int32), ValueError, r"\[0, vocab_size=40\), received values in \[0, 40\]"),
        (np.array([-1, 3], np.int32), ValueError, r"\[0, vocab_size=40\), received values in \[-1, 3\]"),
    ],
)
def test_forward_rejects_bad_input_ids(ids, error, match):
    config = gpt2.GPT2Config.make(vocab_size=40, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    params = gpt2.init_params(0, config)
    with pytest.raises(error, match=match):
        gpt2.forward(params, config, ids)


def test_forward_rejects_params_of_another_config():
    config = gpt2.GPT2Config.make(vocab_size=40, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    other = gpt2.GPT2Config.make(vocab_size=40, n_positions=16, n_embd=8, n_layer=1, n_head=2, n_inner=16)
    with pytest.raises(ValueError, match=r"'transformer/h/mlp/c_fc/kernel' has shape \(1, 16, 8\), expected \(1, 32, 8\)"):
        gpt2.forward(gpt2.init_params(0, other), config, np.zeros(3, np.int32))
    with pytest.raises(ValueError, match=r"scale must be finite and > 0"):
        gpt2.forward(gpt2.init_params(0, config), config, np.zeros(3, np.int32), scale=0.0)
    with pytest.raises(ValueError, match=r"n_head=3 must divide n_embd=8"):
        gpt2.GPT2Config.make(vocab_size=40, n_positions=16, n_embd=8, n_layer=1, n_head=3)
