"""One span score: ``interventions.span_log_prob``, with and without an attention mask, against a float64
NumPy loop, and the causal models' ``log_prob`` as that same function of their logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import gpt2, interventions, llama

T, V = 11, 7


def _log_softmax64(row):
    row = np.asarray(row, np.float64)
    top = row.max()
    return row - top - np.log(np.sum(np.exp(row - top)))


def _loop(logits, ids, start, end, keep=None):
    """``Σ log p(ids[t] | ...)`` over ``start <= t < end``, token ``t`` scored from the row of the last real
    token before it (``t - 1`` without ``keep``), one position at a time in float64."""
    keep = np.ones(len(ids), bool) if keep is None else np.asarray(keep, bool)
    total = 0.0
    for t in range(start, min(end, len(ids))):
        before = [s for s in range(t) if keep[s]]
        if keep[t] and before:
            total += _log_softmax64(logits[before[-1]])[ids[t]]
    return total


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    logits = (3.0 * rng.standard_normal((T, V))).astype(np.float32)
    ids = rng.integers(0, V, T).astype(np.int32)
    return logits, ids


SPANS = [(0, T), (1, T), (3, 8), (5, 5), (0, 1), (T - 1, T)]
MASKS = {
    "left": [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1],
    "right": [1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
    "inside": [1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1],
    "one real token": [0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0],
}


@pytest.mark.parametrize("start, end", SPANS)
def test_without_a_mask_each_token_is_scored_from_the_row_before_it(data, start, end):
    logits, ids = data
    got = interventions.span_log_prob(logits, ids, start, end)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), _loop(logits, ids, start, end), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("where", sorted(MASKS))
@pytest.mark.parametrize("start, end", SPANS)
def test_with_a_mask_each_real_token_is_scored_from_the_last_real_token_before_it(data, where, start, end):
    logits, ids = data
    mask = np.array(MASKS[where])
    expected = _loop(logits, ids, start, end, mask)
    for m in (mask, mask.astype(bool), jnp.asarray(mask)):  # int or bool, NumPy or JAX, as the models take it
        got = interventions.span_log_prob(logits, ids, start, end, attention_mask=m)
        np.testing.assert_allclose(float(got), expected, rtol=1e-5, atol=1e-5)


def test_a_padded_sequence_scores_as_the_sequence_alone(data):
    logits, ids = data
    keep = np.array(MASKS["inside"], bool)
    alone = interventions.span_log_prob(logits[keep], ids[keep], 0, int(keep.sum()))
    garbage = np.where(keep[:, None], logits, 1e4).astype(np.float32)  # padded rows must never be read
    padded = interventions.span_log_prob(garbage, np.where(keep, ids, V - 1), 0, T, attention_mask=keep)
    np.testing.assert_allclose(float(padded), float(alone), rtol=1e-6)


def test_a_mask_of_ones_is_no_mask(data):
    logits, ids = data
    for start, end in SPANS:
        np.testing.assert_allclose(float(interventions.span_log_prob(logits, ids, start, end,
                                                                     attention_mask=np.ones(T, np.int32))),
                                   float(interventions.span_log_prob(logits, ids, start, end)), rtol=1e-6, atol=1e-6)


def test_traced_spans_and_masks_give_the_loops_values(data):
    logits, ids = data
    masks = np.array([MASKS[k] for k in sorted(MASKS)], bool)  # [4, T]
    run = jax.jit(jax.vmap(lambda m, s, e: interventions.span_log_prob(logits, ids, s, e, attention_mask=m)))
    got = run(masks, jnp.array([0, 2, 3, 4]), jnp.array([T, 9, 7, T]))
    expected = [_loop(logits, ids, s, e, m) for m, s, e in zip(masks, [0, 2, 3, 4], [T, 9, 7, T])]
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def test_float64_logits_are_scored_in_float64(data):
    logits, ids = data
    with jax.enable_x64(True):
        got = interventions.span_log_prob(jnp.asarray(logits, jnp.float64), ids, 0, T,
                                          attention_mask=np.array(MASKS["inside"]))
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(float(got), _loop(logits, ids, 0, T, MASKS["inside"]), rtol=1e-12)


def test_bad_arguments_are_refused_by_name(data):
    logits, ids = data
    with pytest.raises(ValueError, match=r"logits must be \[T, V\] and ids \[T\] with one T"):
        interventions.span_log_prob(logits, ids[:-1], 0, T)
    with pytest.raises(ValueError, match=r"attention_mask must have shape \[T\] = \(11,\), like input_ids"):
        interventions.span_log_prob(logits, ids, 0, T, attention_mask=np.ones(T - 1, np.int32))
    with pytest.raises(ValueError, match=r"attention_mask must hold only 0 and 1, received values \[0, 2\]"):
        interventions.span_log_prob(logits, ids, 0, T, attention_mask=np.array([2] * 5 + [0] * 6))
    with pytest.raises(TypeError, match="attention_mask must have an integer or boolean dtype"):
        interventions.span_log_prob(logits, ids, 0, T, attention_mask=np.ones(T, np.float32))


GPT2 = gpt2.GPT2Config.make(vocab_size=23, n_positions=24, n_embd=8, n_layer=2, n_head=2)
LLAMA = llama.LlamaConfig.make(vocab_size=23, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=24)


@pytest.mark.parametrize("module, config", [(gpt2, GPT2), (llama, LLAMA)], ids=["gpt2", "llama"])
def test_log_prob_is_span_log_prob_of_the_forwards_logits(module, config):
    params = module.init_params(0, config)
    ids = np.array([0, 0, 3, 17, 5, 9, 22, 0, 1, 4, 8, 0], np.int32)
    mask = np.array([0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 0])
    logits = module.forward(params, config, ids, attention_mask=mask).logits
    for start, end in [(0, None), (4, 10), (8, 9)]:
        want = interventions.span_log_prob(logits, ids, start, len(ids) if end is None else end, attention_mask=mask)
        got = module.log_prob(params, config, ids, attention_mask=mask, start=start, end=end)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5, atol=1e-5)
