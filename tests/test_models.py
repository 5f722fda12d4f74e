"""The models are pure functions of their parameters: grad, jit and vmap over params and batches, padding,
head_mask, the KV cache and generation, spans of log-probability, saving."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import decoder, bert, gpt2, models

TINY = gpt2.GPT2Config.make(vocab_size=23, n_positions=16, n_embd=8, n_layer=2, n_head=2)
IDS = np.array([3, 17, 5, 9, 22, 1, 4], np.int32)


def tiny_params(seed=0, scale=1.0):
    """A tiny random GPT-2; ``scale`` > 1 makes its logits spread, so greedy tokens vary."""
    matrix = lambda path: jax.tree_util.keystr(path).endswith(("['kernel']", "['embedding']"))  # noqa: E731
    return jax.tree_util.tree_map_with_path(lambda path, x: x * scale if matrix(path) else x, gpt2.init_params(seed, TINY))


@pytest.fixture(scope="module")
def params():
    return tiny_params(scale=20.0)


# --- pure in the params ---


@pytest.mark.slow  # make test-slow: float64 finite differences through a whole model
def test_gradient_with_respect_to_the_params_matches_float64_finite_differences(x64):
    p = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), tiny_params(seed=1, scale=5.0))
    loss = lambda p: jnp.sum(jnp.sin(gpt2.forward(p, TINY, IDS).logits))  # a loss that weighs every logit
    grad = jax.grad(loss)(p)
    rng = np.random.default_rng(0)
    for _ in range(3):  # directional derivatives along random directions in parameter space
        d = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape)), p)
        eps = 1e-6
        plus = loss(jax.tree.map(lambda x, y: x + eps * y, p, d))
        minus = loss(jax.tree.map(lambda x, y: x - eps * y, p, d))
        fd = (plus - minus) / (2 * eps)
        exact = sum(jnp.vdot(g, y) for g, y in zip(jax.tree.leaves(grad), jax.tree.leaves(d)))
        assert abs(float(fd - exact)) <= 1e-6 * max(1.0, abs(float(exact))), (float(fd), float(exact))


@pytest.mark.slow  # make test-slow
def test_jit_vmap_and_eager_agree_over_params_and_batches(params):
    eager = gpt2.forward(params, TINY, IDS)
    jitted = jax.jit(lambda p, ids: gpt2.forward(p, TINY, ids))(params, IDS)  # params traced
    np.testing.assert_allclose(jitted.logits, eager.logits, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jitted.attentions, eager.attentions, rtol=1e-6, atol=1e-7)
    other = tiny_params(seed=3, scale=20.0)
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), params, other)  # an ensemble of two models
    both = jax.vmap(lambda p: gpt2.forward(p, TINY, IDS).logits)(stacked)
    np.testing.assert_allclose(both[1], gpt2.forward(other, TINY, IDS).logits, rtol=1e-5, atol=1e-5)
    batch = np.stack([IDS, IDS[::-1]])
    logits = jax.vmap(lambda ids: gpt2.forward(params, TINY, ids).logits)(batch)
    np.testing.assert_allclose(logits[1], gpt2.forward(params, TINY, IDS[::-1]).logits, rtol=1e-5, atol=1e-5)
    grads = jax.vmap(jax.grad(lambda p: gpt2.forward(p, TINY, IDS).logits.sum()))(stacked)  # per-model grads
    assert jax.tree.structure(grads) == jax.tree.structure(stacked)


def test_wrong_params_are_refused_before_tracing(params):
    bad = jax.tree.map(lambda x: x, params)
    bad["transformer"]["h"]["attn"]["c_attn"]["kernel"] = jnp.zeros((2, 8, 24))
    with pytest.raises(ValueError, match=r"c_attn/kernel' has shape \(2, 8, 24\), expected \(2, 24, 8\) \(it looks transposed"):
        jax.jit(lambda p: gpt2.forward(p, TINY, IDS).logits)(bad)
    with pytest.raises(ValueError, match="transformer"):
        gpt2.check_params({"h": {}}, TINY)


# --- padding ---


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_sequence_equals_the_sequence_alone(params, side):
    alone = gpt2.forward(params, TINY, IDS)
    pad = np.zeros(4, np.int32) + 7
    ids = np.concatenate([pad, IDS] if side == "left" else [IDS, pad])
    mask = np.concatenate([np.zeros(4), np.ones(len(IDS))] if side == "left" else [np.ones(len(IDS)), np.zeros(4)]).astype(np.int32)
    out = gpt2.forward(params, TINY, ids, attention_mask=mask)
    real = slice(4, None) if side == "left" else slice(0, len(IDS))
    np.testing.assert_allclose(out.logits[real], alone.logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out.attentions[:, :, real, real], alone.attentions, atol=1e-5)
    assert np.all(np.asarray(out.attentions)[:, :, :, ~mask.astype(bool)] == 0)  # padded keys get no weight


def test_buckets_pad_under_the_mask_and_compile_once_per_bucket(params):
    ids, mask = models.pad_to_bucket(IDS, buckets=(4, 16))
    assert ids.shape == (16,) and mask.tolist() == [True] * 7 + [False] * 9
    out = gpt2.forward(params, TINY, ids, attention_mask=mask)
    np.testing.assert_allclose(out.logits[:7], gpt2.forward(params, TINY, IDS).logits, atol=1e-5)
    assert models.pad_to_bucket(np.arange(20), buckets=(4, 16))[0].shape == (20,)  # past the largest: as is


# --- head_mask ---


def test_head_mask_of_ones_is_no_mask_and_a_zero_removes_that_head_by_hand(params):
    plain = gpt2.forward(params, TINY, IDS)
    ones = gpt2.forward(params, TINY, IDS, head_mask=np.ones((2, 2), np.float32))
    np.testing.assert_array_equal(ones.logits, plain.logits)
    mask = np.ones((2, 2), np.float32)
    mask[1, 0] = 0.0
    ablated = gpt2.forward(params, TINY, IDS, head_mask=mask)
    by_hand = jax.tree.map(lambda x: x, params)
    kernel = by_hand["transformer"]["h"]["attn"]["c_proj"]["kernel"]  # [L, D, N·H], (out, in)
    by_hand["transformer"]["h"]["attn"]["c_proj"]["kernel"] = kernel.at[1, :, 0:4].set(0.0)  # layer 1, head 0's inputs
    np.testing.assert_allclose(ablated.logits, gpt2.forward(by_hand, TINY, IDS).logits, atol=1e-5)
    assert not np.allclose(ablated.logits, plain.logits, atol=1e-3)
    half = gpt2.forward(params, TINY, IDS, head_mask=np.where(mask == 0, 0.5, 1.0)).logits
    assert np.all(np.isfinite(half))
    gate = jax.grad(lambda m: gpt2.forward(params, TINY, IDS, head_mask=m).logits[-1].max())(jnp.ones((2, 2)))
    assert gate.shape == (2, 2) and np.all(np.isfinite(gate))
    with pytest.raises(ValueError, match=r"head_mask must have shape \[L, N\] = \(2, 2\)"):
        gpt2.forward(params, TINY, IDS, head_mask=np.ones(2))


def test_bert_head_mask_of_ones_is_no_mask_and_a_zero_changes_the_output():
    p, c, t = bert.load()
    ids = t.encode("The trophy didn't fit.")
    plain = bert.forward(p, c, ids)
    shape = (c.num_hidden_layers, c.num_attention_heads)
    np.testing.assert_array_equal(bert.forward(p, c, ids, head_mask=np.ones(shape)).last_hidden_state, plain.last_hidden_state)
    mask = np.ones(shape, np.float32)
    mask[2, 5] = 0
    by_hand = jax.tree.map(lambda x: x, p)
    dense = by_hand["encoder"]["layer"]["2"]["attention"]["output"]["dense"]
    H = c.head_dim
    dense["kernel"] = dense["kernel"].at[5 * H:6 * H].set(0.0)  # [in, out]: head 5's inputs
    np.testing.assert_allclose(bert.forward(p, c, ids, head_mask=mask).last_hidden_state,
                               bert.forward(by_hand, c, ids).last_hidden_state, atol=1e-5)


# --- the KV cache and generation ---


def test_greedy_generation_equals_an_argmax_loop_over_full_forwards(params):
    out, logits = gpt2.generate(params, TINY, IDS[:4], max_new_tokens=6, return_logits=True)
    assert out[:4].tolist() == IDS[:4].tolist()
    # one causal forward of the whole output: row t is the full forward of the prefix out[:t + 1]
    full = gpt2.forward(params, TINY, np.asarray(out)).logits  # [10, V]
    for i in range(6):
        np.testing.assert_allclose(logits[i], full[3 + i], atol=1e-5, rtol=1e-5)  # cached logits = full forward
        assert int(out[4 + i]) == int(np.argmax(full[3 + i]))
    assert len(set(out[4:].tolist())) > 1  # the test model does not just repeat one token


def test_one_compiled_step_serves_every_new_token(params):
    gpt2.generate(params, TINY, IDS[:3], max_new_tokens=5)
    before = decoder._generate._cache_size()
    gpt2.generate(params, TINY, IDS[2:5], max_new_tokens=5)  # same shapes, other tokens: no new program
    assert decoder._generate._cache_size() == before


@pytest.mark.slow  # make test-slow: make test checks padded prompts in tests/testdecoder.py
def test_batched_prompts_of_different_lengths_through_left_padding(params):
    prompts = [IDS[:3], IDS[1:6]]
    width = max(map(len, prompts))
    ids = np.stack([np.concatenate([np.zeros(width - len(p), np.int32), p]) for p in prompts])
    mask = np.stack([np.arange(width) >= width - len(p) for p in prompts])
    out = jax.vmap(lambda i, m: gpt2.generate(params, TINY, i, max_new_tokens=4, attention_mask=m))(ids, mask)
    for row, p in zip(np.asarray(out), prompts):
        assert row[width:].tolist() == np.asarray(gpt2.generate(params, TINY, p, max_new_tokens=4))[len(p):].tolist()


def test_sampling_needs_a_key_and_is_reproducible(params):
    with pytest.raises(ValueError, match="needs a key"):
        gpt2.generate(params, TINY, IDS[:3], max_new_tokens=2, temperature=1.0)
    a = gpt2.generate(params, TINY, IDS[:3], max_new_tokens=5, temperature=1.0, key=7)
    b = gpt2.generate(params, TINY, IDS[:3], max_new_tokens=5, temperature=1.0, key=7)
    assert a.tolist() == b.tolist()
    with pytest.raises(ValueError, match="exceeds n_positions=16"):
        gpt2.generate(params, TINY, IDS, max_new_tokens=10)


# --- log-probability of a span ---


def test_log_prob_of_a_span_with_padding_under_jit_and_vmap(params):
    logp = jax.nn.log_softmax(gpt2.forward(params, TINY, IDS).logits, axis=-1)
    by_hand = sum(float(logp[t - 1, IDS[t]]) for t in range(2, 5))
    assert float(gpt2.log_prob(params, TINY, IDS, start=2, end=5)) == pytest.approx(by_hand, rel=1e-5)
    spans = jnp.array([[2, 5], [1, 7]])
    got = jax.jit(jax.vmap(lambda s: gpt2.log_prob(params, TINY, IDS, start=s[0], end=s[1])))(spans)
    assert float(got[0]) == pytest.approx(by_hand, rel=1e-5)
    left = np.concatenate([np.zeros(3, np.int32), IDS])
    mask = np.arange(len(left)) >= 3
    padded = gpt2.log_prob(params, TINY, left, attention_mask=mask, start=5, end=8)  # the same tokens, shifted by 3
    assert float(padded) == pytest.approx(by_hand, rel=1e-4)
    with pytest.raises(ValueError, match="0 <= start <= end <= T=7"):
        gpt2.log_prob(params, TINY, IDS, start=5, end=3)


# --- saving ---


@pytest.mark.parametrize("fmt", ["safetensors", "msgpack"])
def test_save_load_round_trip_in_hugging_faces_layout(params, tmp_path, fmt):
    directory = gpt2.save(tmp_path / fmt, params, TINY, format=fmt)
    assert (directory / ("model.safetensors" if fmt == "safetensors" else "flax_model.msgpack")).is_file()
    files = {"config.json": directory / "config.json", "model.safetensors": directory / "model.safetensors",
             "flax_model.msgpack": directory / "flax_model.msgpack"}
    reader = gpt2.params_from_safetensors if fmt == "safetensors" else gpt2.params_from_msgpack
    loaded = reader(files["model.safetensors" if fmt == "safetensors" else "flax_model.msgpack"], TINY)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    assert gpt2.read_gpt2_config(files["config.json"]) == TINY
    p, c, t = gpt2.random_model("tiny", seed=2)  # with a tokenizer: the whole checkpoint through load
    back, c2, t2 = gpt2.load(gpt2.save(tmp_path / f"{fmt}-full", p, c, t, format=fmt))
    assert c2 == c and t2.encode("a trophy").tolist() == t.encode("a trophy").tolist()
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(p)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="format must be"):
        gpt2.save(tmp_path / "x", params, TINY, format="pickle")


# --- captured tensors and patches (the model API's names) ---

NAMES = ("resid_pre", "q", "k", "v", "attn_logits", "attn_weights", "z", "attn_out", "resid_mid", "mlp_out",
         "resid_post")


def test_captured_tensors_have_the_documented_shapes_and_agree_with_the_outputs(params):
    out = gpt2.forward(params, TINY, IDS, capture=NAMES, return_qkv=True, return_attention_logits=True)
    L, N, H, D, T = TINY.n_layer, TINY.n_head, TINY.head_dim, TINY.n_embd, len(IDS)
    shapes = {"resid_pre": (L, T, D), "q": (L, T, N, H), "k": (L, T, N, H), "v": (L, T, N, H),
              "attn_logits": (L, N, T, T), "attn_weights": (L, N, T, T), "z": (L, T, N, H),
              "attn_out": (L, T, D), "resid_mid": (L, T, D), "mlp_out": (L, T, D), "resid_post": (L, T, D)}
    assert {k: v.shape for k, v in out.captured.items()} == shapes
    c = out.captured
    np.testing.assert_array_equal(c["attn_weights"], out.attentions)
    np.testing.assert_array_equal(c["q"], out.q)
    np.testing.assert_array_equal(c["attn_logits"], out.attention_logits)
    np.testing.assert_allclose(c["resid_mid"], c["resid_pre"] + c["attn_out"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(c["resid_post"], c["resid_mid"] + c["mlp_out"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(c["resid_pre"][1:], c["resid_post"][:-1])
    assert gpt2.forward(params, TINY, IDS).captured == {}


def test_patching_the_residual_stream_everywhere_from_b_gives_bs_output(params):
    other = IDS[::-1].copy()
    b = gpt2.forward(params, TINY, other, capture=("resid_pre", "attn_weights"))
    everywhere = np.ones((TINY.n_layer, 1, 1), bool)
    a = gpt2.forward(params, TINY, IDS, patch={"resid_pre": (b.captured["resid_pre"], everywhere)})
    np.testing.assert_array_equal(a.logits, b.logits)
    nowhere = np.zeros((TINY.n_layer, 1, 1), bool)
    np.testing.assert_array_equal(gpt2.forward(params, TINY, IDS, patch={"resid_pre": (b.captured["resid_pre"], nowhere)}).logits,
                                  gpt2.forward(params, TINY, IDS).logits)


def test_a_zero_patch_of_one_heads_z_is_that_heads_ablation_in_both_models(params):
    hm = np.ones((TINY.n_layer, TINY.n_head), np.float32)
    hm[1, 0] = 0.0
    where = np.zeros((TINY.n_layer, 1, TINY.n_head, 1), bool)
    where[1, 0, 0, 0] = True
    zero = np.zeros((TINY.n_layer, 1, TINY.n_head, 1), np.float32)
    np.testing.assert_array_equal(gpt2.forward(params, TINY, IDS, head_mask=hm).logits,
                                  gpt2.forward(params, TINY, IDS, patch={"z": (zero, where)}).logits)


@pytest.mark.parametrize(
    "capture, patch, error, match",
    [
        (("zz",), None, ValueError, "capture: unknown name 'zz'"),
        (3, None, TypeError, "capture must be a sequence of names"),
        ((), {"attn_logits": (np.zeros((2, 2, 7, 7), np.float32), np.ones((2, 1, 1, 1), bool))}, ValueError,
         "patch attn_weights instead"),
        ((), {"z": np.zeros((2, 7, 2, 4), np.float32)}, TypeError, r"patch\['z'\] must be a pair"),
        ((), {"z": (np.zeros((2, 7, 2, 5), np.float32), np.ones((2, 1, 1, 1), bool))}, ValueError,
         r"patch\['z'\] value must have shape \(2, 7, 2, 4\)"),
        ((), {"z": (np.zeros((2, 7, 2, 4), np.float32), np.ones((2, 1, 1, 1), np.int32))}, TypeError,
         r"where must be boolean"),
        ((), {"z": (np.zeros((2, 7, 2, 4), np.float32), np.ones((1, 1, 1), bool))}, ValueError,
         r"where must have shape \(2, 7, 2, 4\)"),
        ((), {"z": (np.zeros((2, 7, 2, 4), np.int32), np.ones((2, 1, 1, 1), bool))}, TypeError,
         r"value must be a float array"),
    ],
)
def test_bad_capture_and_patch_arguments_are_refused_by_name(params, capture, patch, error, match):
    with pytest.raises(error, match=match):
        gpt2.forward(params, TINY, IDS, capture=capture, patch=patch)


# --- left_pad ---


def test_left_pad_puts_each_sequence_at_the_right_end_with_its_mask():
    ids, mask = models.left_pad([[5, 6, 7], [8], np.array([1, 2], np.int64)], pad_id=9)
    np.testing.assert_array_equal(ids, [[5, 6, 7], [9, 9, 8], [9, 1, 2]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [0, 0, 1], [0, 1, 1]])
    assert ids.dtype == jnp.int32 and mask.dtype == jnp.bool_
    ids, mask = models.left_pad([[5, 6]], length=4)
    np.testing.assert_array_equal(ids, [[0, 0, 5, 6]])
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1]])


def test_left_padded_log_prob_indexes_the_padded_columns(params):
    # Sequence b's position t is column t + T - len(b): the span [1 + 2, None) of the padded row is the
    # span [1, None) of the sequence alone.
    ids, mask = models.left_pad([IDS, IDS[2:]])
    alone = gpt2.log_prob(params, TINY, IDS[2:], start=1)
    padded = gpt2.log_prob(params, TINY, ids[1], attention_mask=mask[1], start=1 + 2)
    np.testing.assert_allclose(padded, alone, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("sequences,length,message", [
    ([], None, "sequences must hold at least one sequence"),
    ([[1, 2], []], None, r"sequences\[1\] must be a non-empty list of integer token ids"),
    ([[1.5, 2.0]], None, r"sequences\[0\] must be a non-empty list of integer token ids, received dtype float64"),
    ([[[1, 2]]], None, r"sequences\[0\] .* shape \(1, 2\)"),
    ([[1, 2, 3]], 2, r"length must be an int >= the longest sequence \(3\), received 2"),
    ([[1, 2, 3]], True, r"length must be an int >= the longest sequence \(3\), received True"),
])
def test_left_pad_refuses_bad_sequences_by_name(sequences, length, message):
    with pytest.raises(ValueError, match=message):
        models.left_pad(sequences, length=length)


def test_head_mesh_shape_picks_a_model_axis_the_heads_divide():
    from jaxattn.models import head_mesh_shape

    assert head_mesh_shape(8, 9, 3) == (2, 3)  # SmolLM2 on 8 devices: 6 used
    assert head_mesh_shape(8, 12, 12) == (1, 6)
    assert head_mesh_shape(8, 12, 4) == (2, 4)
    assert head_mesh_shape(1, 9, 3) == (1, 1)
    assert head_mesh_shape(6, 15, 5) == (1, 5)
    for n, h, k in [(8, 9, 3), (8, 12, 4), (16, 32, 8), (3, 7, 7)]:
        data, model = head_mesh_shape(n, h, k)
        assert h % model == 0 and k % model == 0 and data * model <= n
        assert not any(h % m == 0 and k % m == 0 for m in range(model + 1, min(n, k) + 1))
    with pytest.raises(ValueError, match=r"kv_heads must be an int >= 1 dividing heads=9, received 2"):
        head_mesh_shape(8, 9, 2)
    with pytest.raises(ValueError, match=r"n_devices must be an int >= 1, received 0"):
        head_mesh_shape(0, 9, 3)
    # the MLP's hidden units are split over "model" too: 4 heads but an MLP of 18 allow a model axis of 2
    assert head_mesh_shape(8, 4, 4, 18) == (4, 2) and head_mesh_shape(8, 9, 3, 1536) == (2, 3)
    with pytest.raises(ValueError, match=r"mlp must be an int >= 1, received 0"):
        head_mesh_shape(8, 4, 4, 0)
    from jaxattn import bert, gpt2, llama

    assert llama.sizes(llama.LlamaConfig.make(vocab_size=8, hidden_size=8, intermediate_size=18, num_hidden_layers=1,
                                              num_attention_heads=2, max_position_embeddings=8)).mlp == 18
    assert gpt2.sizes(gpt2.GPT2Config.make(n_embd=8, n_head=2, n_layer=1, vocab_size=8, n_positions=8)).mlp == 32
    assert bert.sizes(bert.BertConfig(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=12, max_position_embeddings=8, type_vocab_size=2,
                                      layer_norm_eps=1e-12)).mlp == 12


def test_head_mesh_on_this_process_devices():
    import jax

    from jaxattn.models import Sizes, head_mesh

    mesh = head_mesh(Sizes(layers=2, heads=9, kv_heads=3, head_dim=8, width=72, vocab=10, max_length=16))
    assert mesh.axis_names == ("data", "model")
    assert mesh.devices.size <= len(jax.devices()) and 9 % mesh.shape["model"] == 0
    with pytest.raises(TypeError, match=r"sizes must be a model's Sizes"):
        head_mesh((2, 9, 3))


def test_per_layer_params_are_refused_with_the_call_that_stacks_them(params):
    """Hugging Face's per-layer layout converts both ways with stack_layers / unstack_layers; the forward
    names the conversion when handed the per-layer one."""
    from jaxattn.checkpoint import stack_layers, unstack_layers

    per_layer = unstack_layers(params, "transformer/h", TINY.n_layer)
    assert set(per_layer["transformer"]["h"]) == {"0", "1"}
    np.testing.assert_array_equal(per_layer["transformer"]["h"]["1"]["attn"]["c_proj"]["kernel"],
                                  params["transformer"]["h"]["attn"]["c_proj"]["kernel"][1])
    with pytest.raises(ValueError, match=r"params hold one dict per block under 'transformer/h' .* convert once with "
                                         r"jaxattn\.checkpoint\.stack_layers\(params, 'transformer/h'\)"):
        gpt2.forward(per_layer, TINY, IDS)
    back = stack_layers(per_layer, "transformer/h")
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    broken = jax.tree.map(lambda x: x, per_layer)
    broken["transformer"]["h"]["1"]["ln_1"]["bias"] = jnp.zeros(3)
    with pytest.raises(ValueError, match=r"weight 'transformer/h/i/ln_1/bias' has shapes \[\(3,\), \(8,\)\] across the blocks"):
        stack_layers(broken, "transformer/h")
    gap = {"transformer": {"h": {"0": per_layer["transformer"]["h"]["0"], "2": per_layer["transformer"]["h"]["1"]}}}
    with pytest.raises(ValueError, match=r"the blocks under 'transformer/h' must be numbered 0\.\.1, found \[0, 2\]"):
        stack_layers(gap, "transformer/h")
    with pytest.raises(ValueError, match=r"must be stacked \[L, \.\.\.\] with L = 3"):
        unstack_layers(params, "transformer/h", 3)
