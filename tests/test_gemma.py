"""Gemma 2 and Gemma 3 through jaxattn.llama against the float64 NumPy reference (tests/gemma_reference.py),
on tiny random checkpoints written as transformers writes them: logits, every map and every hidden state with
T larger than the window, greedy continuations across the window's edge, the GGUF and Hugging Face paths
giving the same params, and the tables."""

import json

import jax
import numpy as np
import pytest

import gemma_reference as ref
from gpt2_checkpoints import train_tokenizer
from jaxattn import interventions, llama
from jaxattn.checkpoint import CheckpointError, flatten, unstack_layers
from llama_checkpoints import tokenizer_metadata, write_gguf

TOL = 2e-5
W = 4  # the sliding window: every T below is larger
TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=W, query_pre_attn_scalar=8, max_position_embeddings=64)
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]
CASES = {
    "gemma2-caps": ("gemma2", dict(layer_types=MIXED, attn_logit_softcapping=3.0, final_logit_softcapping=5.0)),
    "gemma3-local-base-scaling": ("gemma3_text", dict(layer_types=MIXED, rope_local_base_freq=100.0,
                                                      rope_scaling={"rope_type": "linear", "factor": 4.0})),
}


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(300)


# make test runs Gemma 3's case; make test-slow Gemma 2's as well (the same decoder paths, with caps)
@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.slow) if n.startswith("gemma2") else n
                                        for n in sorted(CASES)])
def case(request, tok, tmp_path_factory):
    model_type, fields = CASES[request.param]
    cfg = ref.config_dict(model_type, **TINY, **fields)
    weights = ref.random_weights(cfg, seed=len(request.param))
    directory = ref.save_hf(tmp_path_factory.mktemp(request.param), cfg, weights, tok.to_str())
    params, config, _ = llama.load(directory)
    return cfg, weights, params, config, directory


def test_config_is_read_as_transformers_wrote_it(case):
    cfg, _, _, config, _ = case
    assert config.model_type == cfg["model_type"] and config.layer_types == tuple(MIXED)
    assert config.sliding_window == W and config.query_pre_attn_scalar == 8.0
    if config.model_type == "gemma2":
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (3.0, 5.0)
    else:
        assert (config.rope_local_base_freq, config.rope_scaling_factor) == (100.0, 4.0)


@pytest.mark.parametrize("T", [5, 12])
def test_forward_matches_the_float64_reference(case, T):
    """Logits, every layer's map and the hidden states (the stream entering each block, then the final
    norm's output) within float32 error; sliding layers are exactly 0 beyond their window."""
    cfg, weights, params, config, _ = case
    ids = np.random.default_rng(T).integers(0, config.vocab_size, T)
    out = llama.forward(params, config, ids, return_hidden_states=True)
    want = ref.forward(weights, cfg, ids)
    np.testing.assert_allclose(out.logits, want["logits"], atol=TOL, rtol=0)
    np.testing.assert_allclose(out.attentions, want["maps"], atol=TOL, rtol=0)
    np.testing.assert_allclose(out.hidden_states, want["hidden"], atol=TOL * 10, rtol=1e-5)
    far = np.tril(np.ones((T, T), bool), -W)  # keys at distance >= W
    assert np.all(np.asarray(out.attentions)[[0, 2]][:, :, far] == 0)
    assert T <= W or np.all(np.asarray(out.attentions)[1][:, far] > 0)  # the full layer sees them


def test_greedy_generation_is_the_references_across_the_window_edge(case):
    cfg, weights, params, config, _ = case
    for prompt in (np.array([5, 17, 3]), np.arange(10) * 7 % config.vocab_size):  # read by the step, or in one pass
        got = np.asarray(llama.generate(params, config, prompt, max_new_tokens=8))
        np.testing.assert_array_equal(got, ref.greedy(weights, cfg, prompt, 8))


def test_generation_with_a_window_longer_than_the_sequence(case):
    """A ring as long as the whole generation (the window reaches further): greedy logits are the forward's."""
    _, _, params, config, _ = case
    wide = config._replace(sliding_window=40)
    prompt = np.array([5, 17, 3, 9, 22, 1])  # read by the generation step: causal among its own rows
    ids, logits = llama.generate(params, wide, prompt, max_new_tokens=6, return_logits=True)
    full = llama.forward(params, wide, np.asarray(ids)).logits[len(prompt) - 1:-1]
    np.testing.assert_allclose(logits, full, atol=1e-5, rtol=0)


def test_log_prob_resume_and_an_ablation_table(case):
    cfg, weights, params, config, _ = case
    ids = np.random.default_rng(0).integers(0, config.vocab_size, 9)
    logp = jax.nn.log_softmax(np.asarray(ref.forward(weights, cfg, ids)["logits"], np.float64), axis=-1)
    np.testing.assert_allclose(float(llama.log_prob(params, config, ids, start=1)),
                               sum(logp[t - 1, ids[t]] for t in range(1, 9)), rtol=1e-5)
    out = llama.forward(params, config, ids, capture=("resid_pre",))
    again = llama.resume(params, config, out.captured["resid_pre"][1], 1, attentions=out.attentions)
    np.testing.assert_allclose(again.logits, out.logits, atol=1e-5, rtol=0)
    bound = interventions.bind(llama, params, config, ids)
    metric = lambda o: o.logits[-1, 3] - o.logits[-1, 4]  # noqa: E731
    table = np.asarray(interventions.ablation_effects(bound, metric))
    mask = np.ones((3, 4), np.float32)
    mask[2, 1] = 0.0
    cut = llama.forward(params, config, ids, head_mask=mask)
    assert table[2, 1] == pytest.approx(float(metric(cut) - metric(out)), abs=1e-5)
    assert np.abs(table).max() > 1e-4


def _gguf_of(weights, cfg, tok):
    """A gemma3 GGUF of the weights as llama.cpp's converter writes one: gguf-py's tensor names, norm weights
    stored as 1 + w, no q/k permutation, and the sizes under gemma3.* (sliding pattern: llama.cpp's own)."""
    import gguf
    from gguf.tensor_mapping import TensorNameMap

    names = TensorNameMap(gguf.MODEL_ARCH.GEMMA3, cfg["num_hidden_layers"])
    tensors = {}
    for name, w in weights.items():
        base, leaf = name.rsplit(".", 1)
        key = f"{names.get_name(base)}.{leaf}"
        tensors[key] = (w + 1.0 if base.endswith("norm") else w).astype(np.float32)
    meta = {
        "general.architecture": "gemma3", "gemma3.context_length": cfg["max_position_embeddings"],
        "gemma3.embedding_length": cfg["hidden_size"], "gemma3.block_count": cfg["num_hidden_layers"],
        "gemma3.feed_forward_length": cfg["intermediate_size"],
        "gemma3.attention.head_count": cfg["num_attention_heads"],
        "gemma3.attention.head_count_kv": cfg["num_key_value_heads"],
        "gemma3.attention.key_length": cfg["head_dim"], "gemma3.attention.value_length": cfg["head_dim"],
        "gemma3.attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"], "gemma3.rope.freq_base": cfg["rope_theta"],
        "gemma3.attention.sliding_window": cfg["sliding_window"],
        **tokenizer_metadata(tok),
    }
    return meta, tensors


def test_gguf_and_hugging_face_paths_give_the_same_params(tok, tmp_path):
    """A Gemma 3 of six layers (llama.cpp's pattern: five sliding, one full) written both ways."""
    cfg = ref.config_dict("gemma3_text", **{**TINY, "num_hidden_layers": 6, "query_pre_attn_scalar": 8})
    weights = ref.random_weights(cfg, seed=3)
    hf_params, hf_config, _ = llama.load(ref.save_hf(tmp_path / "hf", cfg, weights, tok.to_str()))
    meta, tensors = _gguf_of(weights, cfg, tok)
    path = write_gguf(tmp_path / "g.gguf", meta, tensors)
    params, config, _ = llama.load(path)
    assert config == hf_config
    ours, theirs = flatten(params), flatten(hf_params)
    assert set(ours) == set(theirs)
    for key in ours:  # norms went through 1 + w and back in float32
        np.testing.assert_allclose(ours[key], theirs[key], atol=1e-6 if "norm" in key else 0, rtol=0, err_msg=key)
    ids = np.arange(9) * 11 % cfg["vocab_size"]
    np.testing.assert_allclose(llama.forward(params, config, ids).logits, ref.forward(weights, cfg, ids)["logits"],
                               atol=TOL, rtol=0)


def test_save_writes_what_transformers_and_load_read(case, tok, tmp_path):
    cfg, weights, params, config, _ = case
    directory = llama.save(tmp_path / "saved", params, config)
    written = json.loads((directory / "config.json").read_text())
    assert written["model_type"] == cfg["model_type"] and written["layer_types"] == MIXED
    (directory / "tokenizer.json").write_text(tok.to_str())
    again, loaded, _ = llama.load(directory)
    assert loaded == config
    for key, value in flatten(params).items():
        np.testing.assert_array_equal(flatten(again)[key], value)
    per_layer = unstack_layers(flatten(params), "model/layers")
    assert "model/layers/2/post_feedforward_layernorm/weight" in per_layer


def test_gemma_configs_refuse_what_they_cannot_mean():
    fields = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                  max_position_embeddings=16, tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"a gemma3_text config needs sliding_window"):
        llama.LlamaConfig.make(model_type="gemma3_text", **fields)
    with pytest.raises(ValueError, match=r"layer_types must name one of full_attention, sliding_attention for each of "
                                         r"the 2 layers"):
        llama.LlamaConfig.make(model_type="gemma2", sliding_window=4, layer_types=["full_attention"], **fields)
    with pytest.raises(ValueError, match=r"attn_logit_softcapping is not applied by Gemma 3"):
        llama.LlamaConfig.make(model_type="gemma3_text", sliding_window=4, attn_logit_softcapping=50.0, **fields)
    with pytest.raises(ValueError, match=r"a llama config has no layer_types"):
        llama.LlamaConfig.make(model_type="llama", layer_types=["full_attention"] * 2, **fields)
    default = llama.LlamaConfig.make(model_type="gemma2", sliding_window=4, **fields)
    assert default.layer_types == ("sliding_attention", "full_attention")  # Hugging Face's default


def test_a_gemma3_rope_scaling_it_does_not_implement_is_refused(tok, tmp_path):
    cfg = ref.config_dict("gemma3_text", **TINY, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    directory = ref.save_hf(tmp_path / "y", cfg, ref.random_weights(cfg, 0), tok.to_str())
    with pytest.raises(CheckpointError, match=r"field 'rope_scaling' = .*'yarn'.* is not supported"):
        llama.load(directory)
    with pytest.raises(ValueError, match=r"a gemma2 config has one RoPE base"):
        llama.LlamaConfig.make(vocab_size=4, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                               num_attention_heads=2, max_position_embeddings=8, tie_word_embeddings=True,
                               model_type="gemma2", sliding_window=2, rope_local_base_freq=5.0)


@pytest.mark.parametrize("side", [pytest.param("left", marks=pytest.mark.slow), "right"])  # left: make test-slow
def test_a_padded_prompt_generates_as_the_prompt_alone_across_the_window(case, side):
    """The rings of the windowed layers are indexed by position, so padding takes no room in them."""
    _, _, params, config, _ = case
    prompt = np.array([5, 17, 3, 9, 22, 1, 4, 8, 2, 13])  # read in one pass: longer than the step's rows
    for p in (prompt, prompt[:5]):
        alone = np.asarray(llama.generate(params, config, p, max_new_tokens=6))[len(p):]
        pad = np.zeros(3, np.int64)
        ids = np.concatenate([pad, p] if side == "left" else [p, pad])
        mask = np.concatenate([np.zeros(3), np.ones(len(p))] if side == "left" else [np.ones(len(p)), np.zeros(3)])
        got = np.asarray(llama.generate(params, config, ids, attention_mask=mask.astype(np.int32), max_new_tokens=6))
        np.testing.assert_array_equal(got[len(ids):], alone)


def test_windowed_layers_keep_a_ring_of_their_last_keys(case):
    """Generation's program holds a full cache for the full layer only, [1, slots, K, H], and a ring of W
    entries for the two sliding layers, [2, W, K, H]: no [L, slots, K, H] buffer."""
    _, _, params, config, _ = case
    prompt, new = np.arange(6), 30
    jaxpr = jax.make_jaxpr(lambda p: llama.generate(p, config, prompt, max_new_tokens=new))(params).jaxpr

    def shapes(jaxpr):
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                yield tuple(getattr(v.aval, "shape", ()))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from shapes(inner)

    made = set(shapes(jaxpr))
    slots = len(prompt) + new + len(prompt) - 2  # a prompt of at most 8 tokens runs at its own length
    K, H = config.num_key_value_heads, config.head_dim
    assert (1, slots, K, H) in made and (2, W, K, H) in made
    assert (3, slots, K, H) not in made


def test_a_multimodal_gemma3_checkpoint_loads_its_text_part(tok, tmp_path):
    """config.json of model_type "gemma3" (Gemma3ForConditionalGeneration: a text_config, a vision_config) with
    the text weights under language_model.model.* and vision weights beside them: the text model, as the
    gemma3_text folder of the same weights loads it; a text_config listing only what differs from
    Gemma3TextConfig's defaults reads the same."""
    import transformers
    from safetensors.numpy import save_file

    cfg = ref.config_dict("gemma3_text", **TINY, layer_types=MIXED)
    weights = ref.random_weights(cfg, seed=5)
    want, want_config, _ = llama.load(ref.save_hf(tmp_path / "text", cfg, weights, tok.to_str()))
    text = {k: v for k, v in cfg.items() if k not in ("transformers_version", "architectures")}
    whole = json.loads(transformers.Gemma3Config(text_config=text).to_json_string())
    for prefix in ("language_model.model.", "model.language_model."):  # transformers' two spellings
        d = tmp_path / prefix.replace(".", "_")
        d.mkdir()
        (d / "config.json").write_text(json.dumps(whole))
        tensors = {prefix + k[len("model."):]: v for k, v in weights.items()}
        tensors["vision_tower.vision_model.post_layernorm.weight"] = np.ones(4, np.float32)
        tensors["multi_modal_projector.mm_input_projection_weight"] = np.ones((4, 32), np.float32)
        save_file(tensors, str(d / "model.safetensors"))
        (d / "tokenizer.json").write_text(tok.to_str())
        params, config, _ = llama.load(d)
        assert config == want_config
        for key, value in flatten(want).items():
            np.testing.assert_array_equal(flatten(params)[key], value)
    defaults = ref.config_dict("gemma3_text")  # Gemma3TextConfig() as transformers writes it
    short = {k: v for k, v in text.items() if defaults.get(k) != v or k == "model_type"}
    (d / "config.json").write_text(json.dumps({**whole, "text_config": short}))
    assert llama.read_llama_config(d / "config.json") == want_config
    (d / "config.json").write_text(json.dumps({**whole, "text_config": {**short, "num_hidden_layers": 10**9}}))
    with pytest.raises(CheckpointError, match=r"field 'num_hidden_layers' = 1000000000, but .* holds the tensors of 3"):
        llama.load(d)
    # one weight under both of transformers' spellings: which would win depends on the file's order
    (d / "config.json").write_text(json.dumps(whole))
    tensors = {**{"language_model.model." + k[len("model."):]: v for k, v in weights.items()},
               "model.language_model.embed_tokens.weight": weights["model.embed_tokens.weight"] + 1}
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"weight 'model\.embed_tokens\.weight' appears twice, as "
                                              r"'language_model\.model\.embed_tokens\.weight' and "
                                              r"'model\.language_model\.embed_tokens\.weight'"):
        llama.load(d)


def test_save_refuses_a_tokenizer_it_cannot_write_before_writing(case, tmp_path):
    from jaxattn._spm import SpmTokenizer  # the tokenizer a Gemma 3 GGUF loads with (testing the refusal)

    _, _, params, config, _ = case
    spm = SpmTokenizer(["<pad>", "<eos>", "<bos>", "<unk>", "a", "b", "\u2581a", "\u2581b"])
    with pytest.raises(TypeError, match=r"tokenizer must be a jaxattn\.checkpoint\.TextTokenizer .* received "
                                        r"SpmTokenizer: .* pass tokenizer=None"):
        llama.save(tmp_path / "out", params, config, spm)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_logit_attribution_adds_up_through_the_sandwich_norms(case):
    """Each head's output reaches the stream through the post-attention norm (frozen at the layer's raw
    output): the shares add up to the clean logit difference (Gemma 3) or to the difference before the final
    soft cap (Gemma 2, whose capped logits are not linear in the stream)."""
    _, _, params, config, _ = case
    ids = np.arange(3, 3 + 9, dtype=np.int32)
    a, b = 5, 17
    parts = interventions.logit_attribution(interventions.bind(llama, params, config, ids), (a, b))
    logits = np.asarray(llama.forward(params, config, ids).logits[-1], np.float64)
    cap = config.final_logit_softcapping
    want = logits[a] - logits[b] if cap is None else cap * (np.arctanh(logits[a] / cap) - np.arctanh(logits[b] / cap))
    shares = sum(float(np.sum(v)) for k, v in parts.items() if k != "total")
    assert abs(want) > 0.05  # a difference worth attributing
    assert float(parts["total"]) == pytest.approx(want, abs=2e-4)
    assert shares == pytest.approx(float(parts["total"]), abs=2e-4)
    # each layer's heads add up to its attention's contribution to the stream, which the norm changed
    assert float(np.abs(np.asarray(parts["heads"])).min()) > 0


@pytest.mark.parametrize("scaling_type, want", [(None, 4.0), ("linear", 4.0), ("none", None)])
def test_a_gguf_scaling_factor_without_its_type_is_linear_as_llama_cpp_reads_it(tok, tmp_path, scaling_type, want):
    """llama.cpp reads an absent gemma3.rope.scaling.type as 'linear', so a factor alone scales the full
    layers' positions (it was ignored here); an explicit 'none' keeps them unscaled."""
    cfg = ref.config_dict("gemma3_text", **{**TINY, "num_hidden_layers": 6, "query_pre_attn_scalar": 8},
                          rope_scaling={"rope_type": "linear", "factor": 4.0})
    weights = ref.random_weights(cfg, seed=3)
    meta, tensors = _gguf_of(weights, cfg, tok)
    meta["gemma3.rope.scaling.factor"] = 4.0
    if scaling_type is not None:
        meta["gemma3.rope.scaling.type"] = scaling_type
    params, config, _ = llama.load(write_gguf(tmp_path / "g.gguf", meta, tensors))
    assert config.rope_scaling_factor == want
    if want is not None:  # the positions as Hugging Face's linear scaling gives them
        ids = np.arange(9) * 11 % cfg["vocab_size"]
        np.testing.assert_allclose(llama.forward(params, config, ids).logits, ref.forward(weights, cfg, ids)["logits"],
                                   atol=TOL, rtol=0)


# each model type's config.json with only its required fields, read as transformers' configuration class reads it
FIELDS_WITH_DEFAULTS = ("num_key_value_heads", "head_dim", "rope_theta", "sliding_window", "query_pre_attn_scalar",
                        "attn_logit_softcapping", "final_logit_softcapping")


@pytest.mark.parametrize("model_type, reference", [
    ("llama", "LlamaConfig"), ("mistral", "MistralConfig"), ("qwen2", "Qwen2Config"), ("qwen3", "Qwen3Config"),
    ("gemma", "GemmaConfig"), ("gemma2", "Gemma2Config"), ("gemma3_text", "Gemma3TextConfig")])
def test_a_field_missing_from_config_json_takes_transformers_default(tmp_path, model_type, reference):
    transformers = pytest.importorskip("transformers")  # the dev extra: a test reference only
    required = dict(vocab_size=64, hidden_size=256, intermediate_size=64, num_hidden_layers=2, num_attention_heads=32,
                    max_position_embeddings=128)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **required}))
    ours = llama.read_llama_config(tmp_path / "config.json")
    theirs = getattr(transformers, reference)(**required)
    for field in FIELDS_WITH_DEFAULTS:
        if field == "sliding_window" and model_type in ("llama", "qwen2", "qwen3", "gemma"):
            continue  # no window (Qwen's acts only with use_sliding_window, which jaxattn refuses)
        want = getattr(theirs, field, None)
        want = required["hidden_size"] // required["num_attention_heads"] if field == "head_dim" and want is None else want
        assert getattr(ours, field) == want, (model_type, field, getattr(ours, field), want)
    if model_type.startswith("gemma"):
        assert ours.hidden_act == "gelu_pytorch_tanh"


@pytest.mark.parametrize("fields, act", [
    ({"hidden_act": "gelu"}, "gelu_pytorch_tanh"),  # Gemma 1's config.json: the tanh GELU the model was trained with
    ({"hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"}, "gelu_pytorch_tanh"),
    ({"hidden_activation": "gelu"}, "gelu"), ({"hidden_act": "gelu", "hidden_activation": None}, "gelu_pytorch_tanh"),
    ({"hidden_act": "silu"}, None)])
def test_a_gemma_activation_is_hidden_activation_else_the_tanh_gelu(tmp_path, fields, act):
    cfg = dict(model_type="gemma", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, head_dim=8, max_position_embeddings=16, **fields)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if act is None:
        with pytest.raises(CheckpointError, match=r"field 'hidden_act' = 'silu' without 'hidden_activation'"):
            llama.read_llama_config(tmp_path / "config.json")
    else:
        assert llama.read_llama_config(tmp_path / "config.json").hidden_act == act
