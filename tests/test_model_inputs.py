"""Model inputs refused by name before XLA sees them, and patches that touch only what they patch.

Resumed positions outside the model (negative, past ``max_position_embeddings``) are refused, and
positions past the rows get their own rotation; a float16 load of a weight float16 cannot hold, a config
deeper than its params, a layer outside the model, a stream of the wrong width or dtype and an unknown
``dtype`` are each refused naming the argument, what was expected and what was received. An
``attn_weights`` patch of one layer leaves every other layer exactly as it was, and a padded key whose
value is NaN contributes nothing to the rows the patch remakes (as in attention itself).

Every model is a tiny random one built here; nothing touches the network.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import bert, gpt2, llama
from jaxattn.checkpoint import CheckpointError, TextTokenizer
from gpt2_checkpoints import train_tokenizer
from llama_checkpoints import random_params

T = 8  # tokens of every run
P = 16  # max_position_embeddings

LLAMA = llama.LlamaConfig.make(vocab_size=304, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=P)
GPT2 = gpt2.GPT2Config.make(vocab_size=23, n_positions=P, n_embd=8, n_layer=2, n_head=2)
BERT = bert.BertConfig(vocab_size=23, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=12,
                       max_position_embeddings=P, type_vocab_size=2, layer_norm_eps=1e-12)

IDS = np.array([3, 17, 5, 9, 22, 1, 4, 8], np.int32)
CAUSAL = np.tril(np.ones((T, T), bool))  # a [T, T] mask: one sequence, as resume's packed form


@pytest.fixture(scope="module")
def tiny():
    """The 2-layer Llama, its params (every leaf random) and a clean run capturing resid_pre."""
    params = jax.tree.map(jnp.asarray, random_params(0, LLAMA))
    out = llama.forward(params, LLAMA, IDS, capture=("resid_pre",))
    return params, out


@pytest.fixture(scope="module")
def models():
    """Each family's tiny model: ``{name: (module, config, params)}``."""
    return {"llama": (llama, LLAMA, llama.init_params(0, LLAMA)),
            "gpt2": (gpt2, GPT2, gpt2.init_params(0, GPT2)),
            "bert": (bert, BERT, bert.init_params(0, BERT))}


# ----------------------------------------------------------------------------------------------------
# resume's positions
# ----------------------------------------------------------------------------------------------------


def _resume(params, out, positions):
    return llama.resume(params, LLAMA, out.captured["resid_pre"][1], 1, attention_mask=CAUSAL, positions=positions)


def test_resume_refuses_negative_positions(tiny):
    params, out = tiny
    with pytest.raises(ValueError, match=r"positions must lie in \[0, max_position_embeddings\) = \[0, 16\), "
                                         r"received -1 at row 0"):
        _resume(params, out, np.arange(T) - 1)


def test_resume_refuses_positions_past_the_model(tiny):
    params, out = tiny
    with pytest.raises(ValueError, match=r"positions must lie in \[0, max_position_embeddings\) = \[0, 16\), "
                                         r"received 16 at row 7"):
        _resume(params, out, np.arange(T) + 9)


def test_resume_positions_past_the_rows_get_their_own_rotation(tiny):
    """RoPE is relative: one sequence at positions 8..15 gives the logits it gives at 0..7. Positions past
    the T rows once read the last row of a T-row table (every row past it the same rotation)."""
    params, out = tiny
    at_zero = _resume(params, out, np.arange(T))
    np.testing.assert_allclose(at_zero.logits, out.logits, atol=1e-5, rtol=0)
    shifted = _resume(params, out, np.arange(T) + T)
    np.testing.assert_allclose(shifted.logits, at_zero.logits, atol=1e-4, rtol=0)


def test_resume_traced_positions_outside_the_rows_give_nan_rows(tiny):
    """Traced positions cannot be checked: one outside [0, T) rotates by NaN, never by another position."""
    params, out = tiny
    run = jax.jit(lambda pos: _resume(params, out, pos).logits)
    np.testing.assert_allclose(run(jnp.arange(T)), out.logits, atol=1e-5, rtol=0)
    last_outside = run(jnp.arange(T).at[T - 1].set(-1))
    assert np.all(np.isfinite(last_outside[:T - 1])) and np.all(np.isnan(last_outside[T - 1]))
    assert np.all(np.isnan(run(jnp.arange(T) + T)))


def test_resume_refuses_a_stream_of_another_dtype(tiny):
    params, out = tiny
    with pytest.raises(TypeError, match=r"resid_pre must have the dtype of the residual stream the forward carries, "
                                        r"float32 \(the params' dtype\), received dtype bfloat16"):
        llama.resume(params, LLAMA, out.captured["resid_pre"][1].astype(jnp.bfloat16), 1)


def test_resume_checks_the_stream_dtype_of_traced_params(tiny):
    params, out = tiny
    resid = out.captured["resid_pre"][1]
    logits = jax.jit(lambda p: llama.resume(p, LLAMA, resid, 1).logits)(params)
    np.testing.assert_allclose(logits, out.logits, atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match=r"resid_pre must have the dtype .* received dtype float16"):
        jax.jit(lambda p: llama.resume(p, LLAMA, resid.astype(jnp.float16), 1))(params)


# ----------------------------------------------------------------------------------------------------
# Loading: a dtype that cannot hold a weight, a dtype that is not one
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def too_big_for_float16(tmp_path_factory):
    """A checkpoint directory whose layer-0 q_proj holds 1e5 (float16's largest finite number is 65504)."""
    params = random_params(1, LLAMA)
    params["model"]["layers"]["self_attn"]["q_proj"]["kernel"][0, 3, 5] = 1e5  # layer 0's
    directory = tmp_path_factory.mktemp("big-q")
    return llama.save(directory, params, LLAMA, TextTokenizer(train_tokenizer()))


def test_load_float16_refuses_a_weight_beyond_its_range(too_big_for_float16):
    with pytest.raises(CheckpointError, match=r"model\.safetensors: weight 'model/layers/0/self_attn/q_proj/kernel' "
                                              r"holds values up to \|100000\|, beyond the largest finite float16 "
                                              r"number 65504 \(dtype=float16 would turn them into inf\)"):
        llama.load(too_big_for_float16, dtype=jnp.float16)


def test_load_bfloat16_keeps_a_weight_float16_cannot_hold(too_big_for_float16):
    params, _, _ = llama.load(too_big_for_float16, dtype=jnp.bfloat16)
    q = params["model"]["layers"]["self_attn"]["q_proj"]["kernel"][0]
    assert q.dtype == jnp.bfloat16 and float(q[3, 5]) == pytest.approx(1e5, rel=1e-2)
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(params))


@pytest.mark.parametrize("module", [llama, gpt2, bert], ids=lambda m: m.__name__)
def test_load_refuses_an_unknown_dtype(module, tmp_path):
    with pytest.raises(TypeError, match=r"dtype must be a floating dtype \(jnp\.float32, jnp\.bfloat16, "
                                        r"jnp\.float16.*received 'bogus'"):
        module.load(tmp_path, dtype="bogus")
    with pytest.raises(TypeError, match=r"dtype must be a floating dtype, received int32"):
        module.load(tmp_path, dtype=jnp.int32)


# ----------------------------------------------------------------------------------------------------
# A config deeper than its params; layers and widths outside the model
# ----------------------------------------------------------------------------------------------------

DEPTH = {"llama": ("num_hidden_layers", "model/layers"), "gpt2": ("n_layer", "transformer/h"),
         "bert": ("num_hidden_layers", "encoder/layer")}


def _with(config, **fields):
    """``config`` with ``fields`` changed, unchecked (a NamedTuple or BERT's dataclass)."""
    return config._replace(**fields) if hasattr(config, "_replace") else dataclasses.replace(config, **fields)


@pytest.mark.parametrize("name", sorted(DEPTH))
def test_forward_refuses_a_config_deeper_than_its_params(models, name):
    """Checked before any table of the config's layers is made: 10**9 layers cost nothing to refuse."""
    module, config, params = models[name]
    field, path = DEPTH[name]
    deep = _with(config, **{field: 10**9})
    with pytest.raises(ValueError, match=rf"config\.{field}=1000000000 but params hold 2 blocks under '{path}'"):
        module.forward(params, deep, IDS[:4])
    with pytest.raises(ValueError, match=rf"config\.{field}=1 but params hold 2 blocks under '{path}'"):
        module.check_params(params, _with(config, **{field: 1}))


@pytest.mark.parametrize("name", sorted(DEPTH))
@pytest.mark.parametrize("layer", [2, -1])
def test_attention_input_refuses_a_layer_outside_the_model(models, name, layer):
    module, config, params = models[name]
    D = module.sizes(config).width
    with pytest.raises(ValueError, match=rf"layer must lie in \[0, L\) = \[0, 2\) \(the model has 2 layers\), "
                                         rf"received {layer}"):
        module.attention_input(params, config, layer, jnp.zeros((3, D)))
    with pytest.raises(TypeError, match=r"layer must be an int in \[0, L\) = \[0, 2\), received True"):
        module.attention_input(params, config, True, jnp.zeros((3, D)))


@pytest.mark.parametrize("name", sorted(DEPTH))
def test_attention_input_refuses_the_wrong_width(models, name):
    module, config, params = models[name]
    D = module.sizes(config).width
    with pytest.raises(ValueError, match=rf"x must have shape \[\.\.\., D\] = \[\.\.\., {D}\] \(D = {D}, the model "
                                         rf"width\), received shape \(3, {D - 1}\)"):
        module.attention_input(params, config, 1, jnp.zeros((3, D - 1)))
    assert module.attention_input(params, config, 1, jnp.ones((3, D))).shape == (3, D)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_unembed_refuses_the_wrong_width(models, name):
    module, config, params = models[name]
    s = module.sizes(config)
    D = s.width
    with pytest.raises(ValueError, match=rf"x must have shape \[\.\.\., D\] = \[\.\.\., {D}\] \(D = {D}, the model "
                                         rf"width\), received shape \(3, {D - 1}\)"):
        module.unembed(params, config, jnp.zeros((3, D - 1)))
    with pytest.raises(TypeError, match=r"x must be a float array \[\.\.\., D\], received dtype int32"):
        module.unembed(params, config, jnp.zeros((3, D), jnp.int32))
    assert module.unembed(params, config, jnp.zeros((D,))).shape == (s.vocab,)


# ----------------------------------------------------------------------------------------------------
# An attn_weights patch touches only what it patches
# ----------------------------------------------------------------------------------------------------

REAL = 5  # right padding: tokens 0..4 real, 5..7 padded with token 0, whose embedding row is NaN
MASK = np.array([1] * REAL + [0] * (T - REAL), np.int32)
PADDED = np.concatenate([IDS[:REAL], np.zeros(T - REAL, np.int32)])


@pytest.fixture(scope="module")
def nan_pad():
    """The tiny Llama whose pad token's embedding row is NaN, and its clean right-padded run."""
    params = jax.tree.map(jnp.asarray, random_params(2, LLAMA))
    params["model"]["embed_tokens"]["embedding"] = params["model"]["embed_tokens"]["embedding"].at[0].set(jnp.nan)
    clean = llama.forward(params, LLAMA, PADDED, attention_mask=MASK, capture=("attn_weights", "z"))
    assert np.all(np.isfinite(clean.logits[:REAL]))
    return params, clean


def _at(layer):
    """A patch's where: True at every entry of ``layer``, False at the other layers."""
    where = np.zeros((LLAMA.num_hidden_layers, 1, 1, 1), bool)
    where[layer] = True
    return where


def test_attn_weights_patch_of_one_layer_keeps_a_padded_nan_out(nan_pad):
    """Patching layer 0's weights with its own keeps every real row finite (a NaN pad value at weight 0
    contributes nothing), and the logits the clean run's."""
    params, clean = nan_pad
    patched = llama.forward(params, LLAMA, PADDED, attention_mask=MASK, capture=("z",),
                            patch={"attn_weights": (clean.captured["attn_weights"], _at(0))})
    assert np.all(np.isfinite(patched.logits[:REAL]))
    np.testing.assert_allclose(patched.logits[:REAL], clean.logits[:REAL], atol=1e-5, rtol=0)
    np.testing.assert_allclose(patched.captured["z"][0, :REAL], clean.captured["z"][0, :REAL], atol=1e-6, rtol=0)


def test_layers_an_attn_weights_patch_leaves_alone_compute_as_without_it(nan_pad):
    """A patch of layer 1 leaves layer 0's z bit for bit, and the rows its where leaves alone too."""
    params, clean = nan_pad
    z = clean.captured["z"]
    patched = llama.forward(params, LLAMA, PADDED, attention_mask=MASK, capture=("z",),
                            patch={"attn_weights": (clean.captured["attn_weights"], _at(1))})
    np.testing.assert_array_equal(patched.captured["z"][0], z[0])
    row = np.zeros((LLAMA.num_hidden_layers, LLAMA.num_attention_heads, T, 1), bool)
    row[0, 1, 2] = True  # layer 0, head 1, query 2 only
    one_row = llama.forward(params, LLAMA, PADDED, attention_mask=MASK, capture=("z",),
                            patch={"attn_weights": (clean.captured["attn_weights"], row)})
    others = np.ones((T, LLAMA.num_attention_heads), bool)
    others[2, 1] = False
    np.testing.assert_array_equal(np.asarray(one_row.captured["z"][0])[others], np.asarray(z[0])[others])
    np.testing.assert_allclose(one_row.captured["z"][0, 2, 1], z[0, 2, 1], atol=1e-6, rtol=0)


def test_attn_weights_patch_on_a_nan_key_makes_the_row_nan(nan_pad):
    """Weight the patch itself puts on a padded key whose value is NaN is no 0 · NaN: that row is NaN."""
    params, clean = nan_pad
    w = np.array(clean.captured["attn_weights"])
    w[0, :, REAL - 1, :] = 0.0
    w[0, :, REAL - 1, REAL] = 1.0  # query 4 of every head reads padded key 5 only
    patched = llama.forward(params, LLAMA, PADDED, attention_mask=MASK, capture=("z",),
                            patch={"attn_weights": (w, _at(0))})
    z0 = np.asarray(patched.captured["z"][0])
    assert np.all(np.isnan(z0[REAL - 1])) and np.all(np.isfinite(z0[:REAL - 1]))


def test_bert_attn_weights_patch_of_one_layer_keeps_a_padded_nan_out(models):
    _, config, params = models["bert"]
    params = jax.tree.map(lambda a: a, params)
    embedding = params["embeddings"]["word_embeddings"]["embedding"]
    params["embeddings"]["word_embeddings"]["embedding"] = jnp.asarray(embedding).at[0].set(jnp.nan)
    clean = bert.forward(params, config, PADDED, attention_mask=MASK, capture=("attn_weights",))
    assert np.all(np.isfinite(clean.last_hidden_state[:REAL]))
    patched = bert.forward(params, config, PADDED, attention_mask=MASK,
                           patch={"attn_weights": (clean.captured["attn_weights"], _at(0))})
    np.testing.assert_allclose(patched.last_hidden_state[:REAL], clean.last_hidden_state[:REAL], atol=1e-5, rtol=0)


def test_forward_warns_once_when_a_jit_closes_over_the_params(tiny, monkeypatch):
    """The weights as constants of the caller's jit: one warning saying to pass params as an argument;
    none with params as an argument, none under vmap alone, none a second time."""
    import warnings

    from jaxattn import decoder

    params = tiny[0]
    monkeypatch.setattr(decoder, "_WARNED_CLOSED_OVER", [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(lambda p, ids: llama.forward(p, LLAMA, ids).logits).lower(params, IDS)  # params as an argument
        jax.vmap(lambda ids: llama.forward(params, LLAMA, ids).logits)(IDS[None])  # vmap compiles no closure
    with pytest.warns(UserWarning, match=r"jaxattn\.llama\.forward is being traced by jax\.jit with the ids traced but "
                                         r"the params as concrete arrays.*jax\.jit\(lambda p, ids: jaxattn\.llama\.forward"):
        jax.jit(lambda ids: llama.forward(params, LLAMA, ids).logits).lower(IDS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(lambda ids: llama.log_prob(params, LLAMA, ids)).lower(IDS)  # once per process
