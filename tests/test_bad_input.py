"""Bad and edge inputs, by kind: each kind is refused with a message naming the argument, or made visible
(NaN), never silently turned into a plausible result."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import probes

RNG = np.random.default_rng(0)
Q = RNG.standard_normal((4, 8)).astype(np.float32)
V = RNG.standard_normal((4, 3)).astype(np.float32)


# --- weights_from_lse: a row index outside [0, T) ---


@pytest.mark.parametrize("rows", [[10], [4], [-1], [0, 2, 7]])
def test_weights_from_lse_refuses_rows_outside_the_queries(rows):
    _, lse = jaxattn.blockwise_attention(Q, Q, V)
    with pytest.raises(ValueError, match=r"rows must be query indices in \[0, T=4\)"):
        jaxattn.weights_from_lse(Q, Q, lse, rows=np.array(rows))


def test_weights_from_lse_traced_rows_outside_the_queries_are_nan_rows():
    _, lse = jaxattn.blockwise_attention(Q, Q, V)
    w = jax.jit(lambda r: jaxattn.weights_from_lse(Q, Q, lse, rows=r))(jnp.array([1, 10, -1, 3]))
    assert np.all(np.isnan(w[1])) and np.all(np.isnan(w[2]))
    np.testing.assert_allclose(np.asarray(w)[[0, 3]], np.asarray(jaxattn.attention(Q, Q, V)[1])[[1, 3]], rtol=1e-5, atol=1e-7)


# --- out-of-vocabulary ids under jit/vmap: never another token's embedding ---


@pytest.fixture(scope="module")
def tiny_gpt2():
    from jaxattn import gpt2

    return gpt2, *gpt2.random_model("tiny", seed=0)


@pytest.mark.parametrize("bad", ["vocab_size", "vocab_size + 5", "-1"])
def test_gpt2_out_of_vocabulary_id_is_refused_eagerly_and_nan_under_vmap(tiny_gpt2, bad):
    gpt2, params, config, _ = tiny_gpt2
    bad_id = eval(bad, {"vocab_size": config.vocab_size})
    ids = np.array([1, 2, bad_id, 3], np.int32)
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size="):
        gpt2.forward(params, config, ids)
    good = np.array([1, 2, config.vocab_size - 1, 3], np.int32)
    out = jax.vmap(lambda i: gpt2.forward(params, config, i).logits)(np.stack([ids, good]))  # [2, T, V]
    bad_rows = np.isnan(out[0]).any(-1)
    assert bad_rows.tolist() == [False, False, True, True]  # the position and every later one (causal)
    assert not np.isnan(out[1]).any()


def test_bert_out_of_vocabulary_id_is_nan_under_jit():
    from jaxattn import bert

    params, config, tokenizer = bert.load()
    ids = np.asarray(tokenizer.encode("a short sentence"), np.int32)
    bad = ids.copy()
    bad[2] = config.vocab_size + 3
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size="):
        bert.forward(params, config, bad)
    out = jax.jit(lambda p, i: bert.forward(p, config, i).last_hidden_state)(params, bad)  # params as an argument
    assert np.isnan(out).any(-1).all()  # bidirectional: every position attends to it


# --- probes: NaN in, NaN out ---


@pytest.mark.parametrize("probe", ["entropy", "normalized_entropy", "effective_support", "max_weight"])
@pytest.mark.parametrize("row", [[np.nan, 0.5, 0.5], [np.nan, np.nan, np.nan], [0.0, np.nan, 1.0]])
def test_row_probes_turn_nan_weights_into_nan(probe, row):
    w = np.array([row, [0.25, 0.25, 0.5]], np.float32)
    got = np.asarray(getattr(probes, probe)(w))
    assert np.isnan(got[0]) and np.isfinite(got[1])
    stats = probes.row_stats(w)
    assert all(np.isnan(stats[k][0]) for k in ("entropy", "normalized_entropy", "effective_support", "max_weight"))
    assert np.isnan(probes.head_entropy(w[None])[0])  # the mean over rows of a head with a NaN row


def test_nan_at_a_masked_key_does_not_reach_the_entropy():
    w = np.array([[np.nan, 0.5, 0.5]], np.float32)
    assert float(probes.entropy(w, mask=np.array([False, True, True]))[0]) == pytest.approx(math.log(2))


# --- empty inputs ---


def test_softmax_jacobian_of_zero_keys_is_empty():
    z = np.zeros((3, 0), np.float32)
    assert probes.softmax_jacobian(z).shape == (3, 0, 0)
    norms = probes.softmax_jacobian_norms(z)
    assert norms["frobenius"].shape == norms["nuclear"].shape == (3,)
    assert np.all(np.asarray(norms["frobenius"]) == 0) and np.all(np.asarray(norms["nuclear"]) == 0)


# --- is_causal: a Python bool, concrete ---

CAUSAL_CALLS = {
    "attention": lambda c: jaxattn.attention(Q, Q, V, is_causal=c),
    "attention_weights": lambda c: jaxattn.attention_weights(Q, Q, is_causal=c),
    "multi_head_attention": lambda c: jaxattn.multi_head_attention(Q[:, None], Q[:, None], V[:, None], is_causal=c),
    "blockwise_attention": lambda c: jaxattn.blockwise_attention(Q, Q, V, is_causal=c),
    "multi_head_blockwise_attention": lambda c: jaxattn.multi_head_blockwise_attention(Q[:, None], Q[:, None], V[:, None], is_causal=c),
    "attention_grads": lambda c: probes.attention_grads(Q, Q, V, V, is_causal=c),
    "weights_from_lse": lambda c: jaxattn.weights_from_lse(Q, Q, np.zeros(4, np.float32), is_causal=c),
}


@pytest.mark.parametrize("name", sorted(CAUSAL_CALLS))
@pytest.mark.parametrize("value", ["no", "False", 1, None, np.array([True, False])])
def test_is_causal_must_be_a_bool(name, value):
    with pytest.raises(TypeError, match=r"is_causal must be a Python bool \(True or False\)"):
        CAUSAL_CALLS[name](value)


@pytest.mark.parametrize("name", ["attention", "blockwise_attention", "attention_grads"])
def test_traced_is_causal_is_refused_by_name(name):
    with pytest.raises(TypeError, match="is_causal must be a Python bool; received a traced value"):
        jax.jit(CAUSAL_CALLS[name])(True)


def test_numpy_bool_is_a_bool():
    out_np, _ = jaxattn.attention(Q, Q, V, is_causal=np.bool_(True))
    out, _ = jaxattn.attention(Q, Q, V, is_causal=True)
    np.testing.assert_array_equal(out_np, out)


# --- arrays NumPy cannot build: the message names the argument ---


@pytest.mark.parametrize("arg", ["q", "k", "v", "mask"])
def test_ragged_list_names_its_argument(arg):
    args = dict(q=Q, k=Q, v=V, mask=None)
    args[arg] = [[1.0, 2.0], [3.0]] if arg != "mask" else [[True, False], [True]]
    with pytest.raises(TypeError, match=rf"^{arg} must be an array \(rectangular"):
        jaxattn.attention(args["q"], args["k"], args["v"], mask=args["mask"])


# --- the scale: checked as the value the logits are multiplied by ---


@pytest.mark.parametrize("scale, used", [(1e300, "inf"), (1e-300, "0.0"), (-1e-300, "-0.0"), (3.5e38, "inf")])
def test_scale_is_checked_in_the_dtype_it_is_used_in(scale, used):
    for call in (lambda: jaxattn.attention(Q, Q, V, scale=scale), lambda: jaxattn.blockwise_attention(Q, Q, V, scale=scale),
                 lambda: jaxattn.multi_head_attention(Q[:, None], Q[:, None], V[:, None], scale=scale)):
        with pytest.raises(ValueError, match=rf"scale must be finite and > 0 in float32.*which is {used} there"):
            call()


def test_scale_large_for_float32_is_fine_in_float64(x64):
    q = Q.astype(np.float64)
    out, w = jaxattn.attention(q, q, V.astype(np.float64), scale=1e300)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(w))


@pytest.mark.parametrize("scale", [np.complex64(1 + 1j), 1j, np.array([0.5]), "0.5", True])
def test_scale_must_be_a_real_scalar(scale):
    with pytest.raises((TypeError, ValueError), match="scale must be"):
        jaxattn.attention(Q, Q, V, scale=scale)


# --- loaders: one dtype policy ---


def test_loaders_give_float32_by_default_and_the_dtype_asked_for(tmp_path):
    from jaxattn import bert, gpt2

    params, _, _ = bert.load()
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    params16, _, _ = bert.load(dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(params16)} == {jnp.dtype(jnp.bfloat16)}
    p, c, t = gpt2.random_model("tiny", seed=0)
    half = jax.tree.map(lambda x: np.asarray(x, np.float16), p)  # a float16 checkpoint
    directory = tmp_path / "gpt2"
    gpt2.save(directory, half, c, t)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        loaded, _, _ = gpt2.load(directory, dtype=dtype)
        assert {x.dtype for x in jax.tree.leaves(loaded)} == {jnp.dtype(dtype)}
    with pytest.raises(TypeError, match="dtype must be a floating dtype"):
        gpt2.load(directory, dtype=jnp.int32)
    with pytest.raises(ValueError, match="float64 needs 64-bit JAX"):
        bert.load(dtype=jnp.float64)


@pytest.mark.parametrize("module, expected", [("gpt2", "GPT2Config"), ("bert", "BertConfig"), ("llama", "LlamaConfig")])
def test_check_params_names_a_config_of_another_model(module, expected):
    import importlib

    from jaxattn import llama

    other = (llama.LlamaConfig.make(vocab_size=11, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8)
             if module != "llama" else importlib.import_module("jaxattn.gpt2").GPT2Config(
                 vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2, n_inner=8))
    with pytest.raises(TypeError, match=rf"config must be a {expected}, received {type(other).__name__}"):
        importlib.import_module(f"jaxattn.{module}").check_params({}, other)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: probes.softmax_jacobian(np.zeros((1, 3), np.float32), logit_cap=1e39), ValueError,
         r"logit_cap must lie in float32's normal range"),
        (lambda: probes.softmax_jacobian_norms(np.zeros((1, 3), np.float32), logit_cap=1e-46), ValueError,
         r"logit_cap must lie in float32's normal range"),
        (lambda: probes.saturation_sweep(0, head_dims=(8,), num_trials=1, num_queries=2, num_keys=3, value_dim=2,
                                         remedies=[("temperature", 1e-40)]), ValueError, r"tau must lie in float32's normal range"),
        (lambda: probes.logit_spread_bound(np.ones((3, 4), np.float32), np.ones((4, 2), np.float32),
                                           np.ones((4, 2), np.float32), scale=-1.0), ValueError, r"scale must be finite and > 0"),
        (lambda: probes.two_level_entropy(1.0, 2, 3), ValueError, r"k must be a whole number with 1 <= k <= n_keys"),
        (lambda: probes.entropy_floor(0.5, 16, max_keys=2), ValueError, r"n_keys must be <= max_keys=2"),
        (lambda: probes.max_weight_ceiling(-1.0, 4), ValueError, r"spread must be >= 0"),
        (lambda: probes.head_entropy(np.full((2, 3), 1 / 3, np.float32), normalized="False"), TypeError,
         r"normalized must be a Python bool"),
        (lambda: probes.dot_product_variance(0, 8), TypeError, r"head_dims must be a sequence of positive ints"),
        (lambda: probes.underflow_gap("foo"), TypeError, r"dtype must be a floating dtype .* received 'foo'"),
    ],
)
def test_probe_arguments_are_refused_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call()
