"""The shared decoder and the model protocol: padded and unpadded inputs agree on every score and every
continuation, bad generation arguments are refused by name, bfloat16 generates, every model's logits are
``unembed(final_norm(resid_post[-1]))``, and a model module written outside jaxattn runs through
interventions with no model-specific code."""

import types

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import decoder, bert, gpt2, interventions, llama, models
from jaxattn.checkpoint import CheckpointError

GPT2 = gpt2.GPT2Config.make(vocab_size=23, n_positions=24, n_embd=8, n_layer=2, n_head=2)
LLAMA = llama.LlamaConfig.make(vocab_size=23, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=24)
IDS = np.array([3, 17, 5, 9, 22, 1, 4, 8], np.int32)


def _spread(params, scale):
    """Random params with their matrices scaled up, so that logits spread and greedy tokens vary."""
    matrix = lambda path: jax.tree_util.keystr(path).endswith(("['kernel']", "['embedding']"))  # noqa: E731
    return jax.tree_util.tree_map_with_path(lambda path, x: x * scale if matrix(path) else x, params)


MODELS = {
    "gpt2": (gpt2, GPT2, _spread(gpt2.init_params(0, GPT2), 20.0)),
    "llama": (llama, LLAMA, _spread(llama.init_params(0, LLAMA), 8.0)),
}


# The decoder is one skeleton: make test runs its behaviours on the Llama family, make test-slow on GPT-2
# as well; the protocol and the refusals run on both in make test.
@pytest.fixture(params=[pytest.param("gpt2", marks=pytest.mark.slow), "llama"])
def model(request):
    return MODELS[request.param]


@pytest.fixture(params=sorted(MODELS))
def each_model(request):
    return MODELS[request.param]


def _left(ids, pad):
    return np.concatenate([np.zeros(pad, np.int32), ids]), np.array([0] * pad + [1] * len(ids))


def _right(ids, pad):
    return np.concatenate([ids, np.zeros(pad, np.int32)]), np.array([1] * len(ids) + [0] * pad)


# --- silent wrong answers: padding, masks, temperatures ---


@pytest.mark.parametrize("start, end", [(0, None), (1, None), (3, 6), (5, 5)])
def test_log_prob_of_a_padded_sequence_is_the_sequence_alones(model, start, end):
    module, config, params = model
    alone = float(module.log_prob(params, config, IDS, start=start, end=end))
    ids, mask = _left(IDS, 3)
    stop = None if end is None else end + 3
    np.testing.assert_allclose(float(module.log_prob(params, config, ids, attention_mask=mask, start=start + 3,
                                                     end=stop)), alone, rtol=1e-5, atol=1e-4)
    if start == 0:  # the whole padded array: the first real token is not scored from a pad
        np.testing.assert_allclose(float(module.log_prob(params, config, ids, attention_mask=mask)), alone,
                                   rtol=1e-5, atol=1e-4)
    ids, mask = _right(IDS, 3)
    np.testing.assert_allclose(float(module.log_prob(params, config, ids, attention_mask=mask, start=start, end=end)),
                               alone, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("side", ["left", "right"])
def test_generate_from_a_padded_prompt_continues_the_prompt_alone(model, side):
    module, config, params = model
    prompt = IDS[:5]
    alone, alone_logits = module.generate(params, config, prompt, max_new_tokens=4, return_logits=True)
    ids, mask = (_left if side == "left" else _right)(prompt, 3)
    out, logits = module.generate(params, config, ids, attention_mask=mask, max_new_tokens=4, return_logits=True)
    assert len(set(np.asarray(alone[5:]).tolist())) > 1  # the check can fail: the continuation varies
    np.testing.assert_array_equal(np.asarray(out[8:]), np.asarray(alone[5:]))
    np.testing.assert_array_equal(np.asarray(out[:8]), ids)
    np.testing.assert_allclose(logits, alone_logits, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("left, right", [(0, 0), (3, 0), (0, 6)])
def test_generate_from_a_prompt_longer_than_prompt_rows(model, left, right):
    """A prompt longer than PROMPT_ROWS tokens is read in one pass of the forward's loop (a shorter one by
    the generation step itself, the other tests): every new token's logits are the full forward's at the
    token before it, padded or not."""
    module, config, params = model
    prompt = np.array([3, 17, 5, 9, 22, 1, 4, 8, 2, 13, 7], np.int32)  # 11 tokens
    assert len(prompt) > decoder.PROMPT_ROWS
    ids = np.concatenate([np.zeros(left, np.int32), prompt, np.zeros(right, np.int32)])
    mask = np.array([0] * left + [1] * len(prompt) + [0] * right)
    out, logits = module.generate(params, config, ids, attention_mask=mask, max_new_tokens=4, return_logits=True)
    new = np.asarray(out[len(ids):])
    full = module.forward(params, config, np.concatenate([prompt, new])).logits[len(prompt) - 1:-1]  # [4, V]
    np.testing.assert_allclose(logits, full, atol=1e-4, rtol=1e-5)
    np.testing.assert_array_equal(new, np.argmax(np.asarray(full), axis=-1))
    assert len(set(new.tolist())) > 1  # the check can fail: the continuation varies


@pytest.mark.parametrize("T", [6, 11])  # the prompt read by the generation step, or in one pass
def test_generate_keeps_a_sliding_window(T):
    config = LLAMA._replace(model_type="mistral", sliding_window=3)
    params = MODELS["llama"][2]
    prompt = np.array([3, 17, 5, 9, 22, 1, 4, 8, 2, 13, 7], np.int32)[:T]
    out, logits = llama.generate(params, config, prompt, max_new_tokens=4, return_logits=True)
    full = llama.forward(params, config, np.asarray(out)).logits[T - 1:-1]
    np.testing.assert_allclose(logits, full, atol=1e-4, rtol=1e-5)
    assert not np.allclose(full, llama.forward(params, LLAMA, np.asarray(out)).logits[T - 1:-1], atol=1e-3)


def _eqns(jaxpr):
    """Every equation of a jaxpr, its sub-jaxprs' included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _eqns(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _eqns(sub)


def _primitives(jaxpr) -> set[str]:
    """Every primitive of a jaxpr, its sub-jaxprs' included."""
    return {eqn.primitive.name for eqn in _eqns(jaxpr)}


def _shapes(jaxpr) -> set[tuple[int, ...]]:
    """The shape of every value a jaxpr makes, its sub-jaxprs' included."""
    return {tuple(v.aval.shape) for eqn in _eqns(jaxpr) for v in eqn.outvars if hasattr(v.aval, "shape")}


def test_log_prob_keeps_no_attention_map(each_model):
    """log_prob reads the logits only: its program makes no [L, N, T, T] buffer of maps (the forward's
    does), and its score is the forward's logits' own."""
    module, config, params = each_model
    s = module.sizes(config)
    maps = (s.layers, s.heads, len(IDS), len(IDS))
    assert maps in _shapes(jax.make_jaxpr(lambda p: module.forward(p, config, IDS).logits)(params).jaxpr)
    assert maps not in _shapes(jax.make_jaxpr(lambda p: module.log_prob(p, config, IDS, start=2))(params).jaxpr)
    logp = jax.nn.log_softmax(np.asarray(module.forward(params, config, IDS).logits, np.float64), axis=-1)
    expected = sum(logp[t - 1, IDS[t]] for t in range(2, len(IDS)))
    np.testing.assert_allclose(float(module.log_prob(params, config, IDS, start=2)), expected, rtol=1e-5)


def test_the_forward_scans_one_block_and_each_layer_gets_its_own_cotangent(model):
    """The forward runs one block in a scan over the stacked blocks, with no switch over the layers; its
    gradient is the scan's own. Each layer's params get their own cotangent:
    for a tangent in one layer's weights only, the gradient's inner product with it equals the forward-mode
    derivative (a reverse pass that mixed the layers' cotangents would fail this for one of them)."""
    module, config, params = model
    loss = lambda p: module.forward(p, config, IDS).logits[-1, 3]  # noqa: E731
    plain = _primitives(jax.make_jaxpr(loss)(params).jaxpr)
    assert "scan" in plain and "cond" not in plain  # (custom_jvp_call: the core's softmax and activations)
    grad = jax.grad(loss)(params)
    assert "scan" in _primitives(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
    rng = np.random.default_rng(0)
    for layer in range(module.sizes(config).layers):
        def only(path, x):  # a random tangent in this layer's matrices, zero elsewhere
            if x.ndim < 3:
                return jnp.zeros_like(x)
            return jnp.zeros_like(x).at[layer].set(rng.standard_normal(x.shape[1:]).astype(x.dtype))

        tangent = jax.tree_util.tree_map_with_path(only, params)
        _, forward_mode = jax.jvp(loss, (params,), (tangent,))
        reverse_mode = sum(jnp.vdot(g, t) for g, t in zip(jax.tree.leaves(grad), jax.tree.leaves(tangent)))
        assert abs(float(forward_mode)) > 1e-3  # the layer matters
        np.testing.assert_allclose(float(reverse_mode), float(forward_mode), rtol=1e-4)
    tangent = jax.tree.map(jnp.ones_like, params)
    out, _ = jax.jvp(lambda p: module.forward(p, config, IDS, capture=("z",)), (params,), (tangent,))
    plain = module.forward(params, config, IDS, capture=("z",))
    for a, b in ((out.logits, plain.logits), (out.attentions, plain.attentions), (out.captured["z"], plain.captured["z"])):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)


def test_an_attention_mask_with_no_real_token_is_refused(each_model):
    model = each_model
    module, config, params = model
    zeros = np.zeros(len(IDS), np.int32)
    for call in (lambda: module.generate(params, config, IDS, attention_mask=zeros, max_new_tokens=2),
                 lambda: module.log_prob(params, config, IDS, attention_mask=zeros),
                 lambda: module.forward(params, config, IDS, attention_mask=zeros)):
        with pytest.raises(ValueError, match=r"attention_mask marks no real token"):
            call()


@pytest.mark.parametrize("temperature", [1e-38, pytest.param(1e-30, marks=pytest.mark.slow),
                                         pytest.param(np.float32(1e-20), marks=pytest.mark.slow)])
def test_a_tiny_temperature_picks_the_argmax(model, temperature):
    module, config, params = model
    greedy = module.generate(params, config, IDS[:4], max_new_tokens=4)
    sampled = module.generate(params, config, IDS[:4], max_new_tokens=4, temperature=temperature, key=0)
    np.testing.assert_array_equal(sampled, greedy)


def test_numpy_numbers_are_temperatures_and_bad_ones_are_refused(model):
    module, config, params = model
    greedy = module.generate(params, config, IDS[:4], max_new_tokens=4)
    np.testing.assert_array_equal(module.generate(params, config, IDS[:4], max_new_tokens=4,
                                                  temperature=np.float32(0)), greedy)
    a = module.generate(params, config, IDS[:4], max_new_tokens=4, temperature=np.float64(0.7), key=1)
    np.testing.assert_array_equal(module.generate(params, config, IDS[:4], max_new_tokens=4, temperature=0.7, key=1), a)
    for bad in (-1.0, float("inf"), float("nan"), "hot", np.ones(2), True):
        with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or a finite number > 0"):
            module.generate(params, config, IDS[:4], max_new_tokens=4, temperature=bad, key=0)


def test_a_key_seed_too_large_names_key(each_model):
    model = each_model
    module, config, params = model
    with pytest.raises(ValueError, match=r"key as an int seed must fit in 64 bits, received 1180591620717411303424"):
        module.generate(params, config, IDS[:4], max_new_tokens=2, temperature=1.0, key=2**70)


def test_capture_of_a_non_name_names_capture(each_model):
    model = each_model
    module, config, params = model
    with pytest.raises(TypeError, match=r"capture must be a sequence of names \(str\), received an entry \['z'\]"):
        module.forward(params, config, IDS, capture=[["z"]])


def test_bfloat16_generation_matches_float32(model):
    module, config, params = model
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    out = module.generate(half, config, IDS[:4], max_new_tokens=4)
    assert out.dtype == jnp.int32 and out.shape == (8,)
    # bfloat16 rounds the weights: compare with float32 on the same rounded weights
    rounded = jax.tree.map(lambda x: x.astype(jnp.float32), half)
    np.testing.assert_array_equal(out, module.generate(rounded, config, IDS[:4], max_new_tokens=4))


def test_a_config_value_infinite_in_float32_is_refused(tmp_path):
    from llama_checkpoints import edit_config, save_hf
    from gpt2_checkpoints import train_tokenizer

    tok = train_tokenizer()
    config = llama.LlamaConfig.make(vocab_size=tok.get_vocab_size() + 4, hidden_size=16, intermediate_size=24,
                                    num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=8)
    directory = save_hf(tmp_path / "c", llama.init_params(0, config), config, tok)
    edit_config(directory, rms_norm_eps=1e300)
    with pytest.raises(CheckpointError, match=r"rms_norm_eps must be a finite number > 0 in float32, received 1e\+300"):
        llama.load(directory)


# Each family's config, one float field at a time: a value that is inf or 0 in float32 (where it is used).
_CONFIGS = {
    "gpt2": (gpt2.read_gpt2_config, dict(model_type="gpt2", vocab_size=23, n_positions=24, n_embd=8, n_layer=2,
                                         n_head=2, layer_norm_epsilon=1e-5)),
    "llama": (llama.read_llama_config, dict(llama.config_dict(LLAMA))),
    "bert": (bert.read_bert_config, dict(model_type="bert", vocab_size=23, hidden_size=8, num_hidden_layers=1,
                                         num_attention_heads=2, intermediate_size=16, max_position_embeddings=8,
                                         type_vocab_size=2, layer_norm_eps=1e-12)),
}
_NOT_FLOAT32 = [
    ("gpt2", "layer_norm_epsilon", 1e300, r"layer_norm_epsilon must be a finite number > 0 in float32, received 1e\+300"),
    ("gpt2", "layer_norm_epsilon", 1e-50, r"layer_norm_epsilon must be a finite number > 0 in float32, received 1e-50"),
    ("llama", "rms_norm_eps", 1e300, r"rms_norm_eps must be a finite number > 0 in float32, received 1e\+300"),
    ("llama", "rope_theta", 1e39, r"rope_theta must be a finite number > 0 in float32, received 1e\+39"),
    ("bert", "layer_norm_eps", 1e300, r"field 'layer_norm_eps' must be a positive finite number in float32, found 1e\+300"),
    ("bert", "layer_norm_eps", 1e-50, r"field 'layer_norm_eps' must be a positive finite number in float32, found 1e-50"),
]


@pytest.mark.parametrize("family, field, value, says", _NOT_FLOAT32, ids=[f"{f}-{k}-{v}" for f, k, v, _ in _NOT_FLOAT32])
def test_a_config_float_not_finite_and_positive_in_float32_is_refused_by_field(tmp_path, family, field, value, says):
    import json

    read, fields = _CONFIGS[family]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    read(path)  # the config as given reads
    path.write_text(json.dumps({**fields, field: value}))
    with pytest.raises(CheckpointError, match=rf"config\.json: {says}"):
        read(path)


def test_numpy_numbers_make_a_gpt2_config_of_python_numbers(tmp_path):
    i = np.int64
    config = gpt2.GPT2Config.make(vocab_size=i(23), n_positions=i(24), n_embd=i(8), n_layer=i(2), n_head=i(2),
                                  layer_norm_epsilon=np.float64(1e-5))
    assert config == GPT2 and all(type(getattr(config, f)) is int for f in ("vocab_size", "n_layer", "n_inner"))
    gpt2.save(tmp_path / "c", gpt2.init_params(0, config), config)  # config.json holds plain numbers
    assert gpt2.read_gpt2_config(tmp_path / "c" / "config.json") == GPT2
    with pytest.raises(ValueError, match=r"layer_norm_epsilon must be a finite number > 0 in float32, received True"):
        gpt2.GPT2Config.make(vocab_size=23, n_positions=24, n_embd=8, n_layer=2, n_head=2, layer_norm_epsilon=True)


def test_a_config_nested_too_deeply_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=r"config\.json: not a config: its JSON nests too deeply"):
        llama.read_llama_config(path)
    with pytest.raises(CheckpointError, match=r"config\.json: not a config: its JSON nests too deeply"):
        gpt2.read_gpt2_config(path)


_NESTED = "[" * 100_000 + "]" * 100_000
_DEEP_FILES = [  # (module, the files of the folder, what the error says); "" is an empty placeholder
    ("llama", {"config.json": _NESTED, "model.safetensors": "", "tokenizer.json": ""},
     r"config\.json: not a config: its JSON nests too deeply to read"),
    ("llama", {"config.json": '{"a": ' * 100_000 + "1" + "}" * 100_000, "model.safetensors": "", "tokenizer.json": ""},
     r"config\.json: not a config: its JSON nests too deeply to read"),
    ("llama", {"config.json": None, "model.safetensors.index.json": _NESTED, "tokenizer.json": ""},
     r"model\.safetensors\.index\.json: cannot read the shard index \(RecursionError"),
    ("gpt2", {"config.json": _NESTED, "model.safetensors": "", "tokenizer.json": ""},
     r"config\.json: not a config: its JSON nests too deeply to read"),
    ("bert", {"config.json": _NESTED, "model.safetensors": "", "tokenizer.json": ""},
     r"config\.json: not a config: its JSON nests too deeply to read"),
]


@pytest.mark.parametrize("module, files, says", _DEEP_FILES, ids=["llama", "llama-object", "llama-index", "gpt2", "bert"])
def test_load_of_a_folder_with_a_file_nested_too_deeply_is_a_checkpoint_error_naming_it(tmp_path, module, files, says):
    import json

    for name, text in files.items():  # None: a readable config of the family
        (tmp_path / name).write_text(json.dumps(llama.config_dict(LLAMA)) if text is None else text)
    with pytest.raises(CheckpointError, match=says):
        {"llama": llama, "gpt2": gpt2, "bert": bert}[module].load(tmp_path)


# --- the model protocol ---


def test_logits_are_unembed_of_final_norm_of_the_last_residual(each_model):
    model = each_model
    module, config, params = model
    out = module.forward(params, config, IDS, capture=("resid_post",), return_hidden_states=True)
    h = module.final_norm(params, config, out.captured["resid_post"][-1])
    np.testing.assert_allclose(h, out.last_hidden_state, atol=1e-6, rtol=0)
    np.testing.assert_allclose(module.unembed(params, config, h), out.logits, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(out.hidden_states[-1], out.last_hidden_state)
    assert set(out.captured) == {"resid_post"}  # the sugar's own captures are not returned


def test_head_projections_rebuild_attn_out(each_model):
    model = each_model
    module, config, params = model
    out = module.forward(params, config, IDS, capture=("z", "attn_out"))
    w = module.head_projections(params, config)  # [L, N, H, D]
    s = module.sizes(config)
    assert w.shape == (s.layers, s.heads, s.head_dim, s.width)
    by_head = jnp.einsum("ltnh,lnhd->ltd", out.captured["z"], w)
    bias = out.captured["attn_out"] - by_head  # what is left is the output projection's bias, the same at every t
    np.testing.assert_allclose(bias, jnp.broadcast_to(bias[:, :1], bias.shape), atol=1e-4)


def test_bert_has_the_same_output_type_and_protocol():
    params, config, tok = bert.load()  # the bundled all-MiniLM-L6-v2
    ids = tok.encode("The trophy didn't fit.")
    out = bert.forward(params, config, ids, capture=("resid_post", "z", "attn_out"))
    assert isinstance(out, models.ModelOutput) and out.logits is None
    np.testing.assert_array_equal(bert.final_norm(params, config, out.captured["resid_post"][-1]),
                                  out.last_hidden_state)
    with pytest.raises(ValueError, match="no language-model head"):
        bert.unembed(params, config, out.last_hidden_state)
    by_head = jnp.einsum("ltnh,lnhd->ltd", out.captured["z"], bert.head_projections(params, config))
    bias = out.captured["attn_out"] - by_head
    np.testing.assert_allclose(bias, jnp.broadcast_to(bias[:, :1], bias.shape), atol=1e-4)
    assert bert.CAUSAL is False and gpt2.CAUSAL and llama.CAUSAL


# --- a model module written outside jaxattn: one layer, two heads ---


def _toy_module():
    """The protocol and the shared forward arguments, nothing else: what a user's own model supplies."""
    from jaxattn import multi_head_attention

    L, N, H, D, V = 1, 2, 4, 8, 11
    sizes = models.Sizes(layers=L, heads=N, kv_heads=N, head_dim=H, width=D, vocab=V, max_length=16)

    def forward(params, config, ids, *, attention_mask=None, head_mask=None, patch=None, capture=()):
        x = params["embed"][ids]  # [T, D]
        keep = jnp.ones(ids.shape, bool) if attention_mask is None else jnp.asarray(attention_mask, bool)
        q = jnp.einsum("td,ndh->tnh", x, params["wq"])
        k = jnp.einsum("td,ndh->tnh", x, params["wk"])
        v = jnp.einsum("td,ndh->tnh", x, params["wv"])
        z, w = multi_head_attention(q, k, v, mask=keep, is_causal=True)  # [T, N, H], [N, T, T]
        z = z * (jnp.ones((L, N)) if head_mask is None else head_mask)[0][None, :, None]
        if patch and "z" in patch:
            value, where = patch["z"]
            z = jnp.where(where[0], value[0], z)
        h = x + jnp.einsum("tnh,nhd->td", z, params["wo"])
        logits = h @ params["embed"].T
        logit_qk = jnp.einsum("tnh,snh->nts", q, k) * H ** -0.5
        captured = {"resid_pre": x[None], "attn_logits": logit_qk[None], "z": z[None]}
        return models.ModelOutput(logits=logits, last_hidden_state=h, attentions=w[None],
                                  captured={c: captured[c] for c in capture})

    def qk_weights(params, config):
        return models.QKWeights(params["wq"][None], None, params["wk"][None], False, H ** -0.5)

    module = models.ModelSpec(  # the declared protocol, all a model of one's own needs
        name="my_lab.toy", causal=True, forward=forward, sizes=lambda c: sizes, qk_weights=qk_weights,
        attention_input=lambda params, config, layer, x: x, final_norm=lambda p, c, x: x,
        unembed=lambda p, c, x: x @ p["embed"].T)
    rng = np.random.default_rng(0)
    params = {name: jnp.asarray(rng.standard_normal(shape), jnp.float32)
              for name, shape in [("embed", (V, D)), ("wq", (N, D, H)), ("wk", (N, D, H)), ("wv", (N, D, H)),
                                  ("wo", (N, H, D))]}
    return module, params


def test_a_model_module_of_ones_own_runs_through_interventions():
    module, params = _toy_module()
    ids = np.array([1, 5, 2, 7, 3], np.int32)
    bound = interventions.bind(module, params, "toy-config", ids)
    assert (bound.n_layers, bound.n_heads) == (1, 2)
    metric = lambda out: out.logits[-1, 4] - out.logits[-1, 6]
    table = interventions.ablation_effects(bound, metric)
    clean = metric(module.forward(params, None, ids))
    for n in range(2):  # against a hand-written loop of forwards
        mask = np.ones((1, 2), np.float32)
        mask[0, n] = 0
        np.testing.assert_allclose(table[0, n], metric(module.forward(params, None, ids, head_mask=mask)) - clean,
                                   atol=1e-5)
    bounds = interventions.entropy_bounds(module, params, "toy-config", ids)
    assert bounds["bound"].shape == (1, 2, 5)
    assert bool(jnp.all(bounds["entropy"] >= bounds["bound"] - 1e-5))


def test_a_model_that_declares_no_protocol_is_refused_by_name():
    """bind and the tables read the declared protocol (a ModelSpec, or a module's SPEC), never loose names."""
    loose = types.SimpleNamespace(__name__="my_lab.loose", forward=lambda *a, **k: None, sizes=lambda c: None)
    with pytest.raises(TypeError, match=r"my_lab\.loose declares no model protocol: pass a jaxattn\.models\.ModelSpec"):
        interventions.bind(loose, {}, None, np.array([1, 2], np.int32))
    for module in (gpt2, llama, bert):
        assert models.spec(module) is module.SPEC and module.SPEC.causal == module.CAUSAL
    assert llama.SPEC.resume is llama.resume and bert.SPEC.resume is None


def test_rms_norm_rounds_as_hugging_face_in_bfloat16():
    """Llama casts the normalised x to the input dtype and then scales by w; Gemma scales by 1 + w in
    float32 and then casts (``GemmaRMSNorm``): in bfloat16 the two orders round differently."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((6, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(64) * 0.3, jnp.bfloat16)
    x32 = np.asarray(x, np.float32)
    normed = x32 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    gemma = jnp.asarray(normed * (1 + np.asarray(w, np.float32)), jnp.bfloat16)
    llama_ = np.asarray(w, np.float32) * np.asarray(jnp.asarray(normed, jnp.bfloat16), np.float32)
    got_gemma = decoder.rms_norm(x, w, eps=1e-6, plus_one=True)
    got_llama = decoder.rms_norm(x, w, eps=1e-6)
    assert got_gemma.dtype == jnp.bfloat16 and got_llama.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got_gemma, np.float32), np.asarray(gemma, np.float32))
    np.testing.assert_array_equal(np.asarray(got_llama, np.float32), np.asarray(jnp.asarray(llama_, jnp.bfloat16), np.float32))
    cast_first = np.asarray(jnp.asarray((1 + np.asarray(w, np.float32)) * np.asarray(jnp.asarray(normed, jnp.bfloat16), np.float32), jnp.bfloat16), np.float32)
    assert np.any(cast_first != np.asarray(gemma, np.float32))  # the orders differ here, so the test tells them apart


def test_place_stacked_fills_each_weight_in_the_places_dtype_as_stacking_then_casting_would():
    """The loaders' stacking (decoder.place_stacked, internals on purpose): a Fitting place gets each block
    weight as one [L, ...] array already in its dtype, equal to np.stack of the layers cast at once; the
    other keys as they are; each layer checked under its own key."""
    from jaxattn.checkpoint import fitting

    rng = np.random.default_rng(0)
    layers = {f"m/layers/{i}/w": rng.standard_normal((3, 5)).astype(np.float32) * 1e3 for i in range(4)}
    arrays = {**layers, "m/embed": rng.standard_normal((6, 3)).astype(np.float32)}
    got = {}
    place = fitting(lambda key, a: got.setdefault(key, a), jnp.float16, "test")
    out = decoder.place_stacked(list(arrays), lambda key: arrays[key], place, "m/layers")
    assert set(out) == {"m/layers/w", "m/embed"}
    want = np.stack([layers[f"m/layers/{i}/w"] for i in range(4)]).astype(np.float16)
    assert got["m/layers/w"].dtype == np.float16 and got["m/layers/w"].shape == (4, 3, 5)
    np.testing.assert_array_equal(np.asarray(got["m/layers/w"], np.float32), np.asarray(want, np.float32))
    arrays["m/layers/2/w"] = arrays["m/layers/2/w"] * 100  # past float16's 65504: refused under its own key
    with pytest.raises(CheckpointError, match=r"m/layers/2/w"):
        decoder.place_stacked(list(arrays), lambda key: arrays[key], place, "m/layers")
