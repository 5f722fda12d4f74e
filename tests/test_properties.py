"""Invariants of attention, checked by hypothesis over shapes, values, masks and scales."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxattn

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw, causal=False):
    T = draw(st.integers(1, 6))
    S = T if causal else draw(st.integers(1, 6))
    H = draw(st.sampled_from([1, 2, 4, 8]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    spread = draw(st.sampled_from([0.1, 1.0, 5.0]))
    k = (spread * rng.standard_normal((S, H))).astype(np.float32)
    q = (spread * rng.standard_normal((T, H))).astype(np.float32)
    v = rng.standard_normal((S, 3)).astype(np.float32)
    scale = draw(st.sampled_from([None, 1.0, 0.25]))
    return q, k, v, scale, rng


@SETTINGS
@given(problems())
def test_rows_sum_to_one(p):
    q, k, v, scale, _ = p
    w = np.asarray(jaxattn.attention_weights(q, k, scale=scale), np.float64)
    np.testing.assert_allclose(w.sum(axis=-1), 1.0, atol=1e-6)
    assert np.all(w >= 0.0)


@pytest.mark.slow
@SETTINGS
@given(problems(), st.floats(-50.0, 50.0))
def test_adding_a_constant_to_a_row_of_logits_changes_nothing(p, c):
    q, k, v, scale, rng = p
    row = int(rng.integers(0, q.shape[0]))
    shift = np.zeros((q.shape[0], 1), np.float32)
    shift[row] = c
    out, w = jaxattn.attention(q, k, v, scale=scale)
    out2, w2 = jaxattn.attention(q, k, v, scale=scale, bias=np.broadcast_to(shift, (q.shape[0], k.shape[0])))
    np.testing.assert_allclose(w2, w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out2, out, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@SETTINGS
@given(problems())
def test_permuting_keys_and_values_together_leaves_the_output_unchanged(p):
    q, k, v, scale, rng = p
    perm = rng.permutation(k.shape[0])
    out, w = jaxattn.attention(q, k, v, scale=scale)
    out2, w2 = jaxattn.attention(q, k[perm], v[perm], scale=scale)
    np.testing.assert_allclose(out2, out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w2, np.asarray(w)[:, perm], rtol=1e-5, atol=1e-6)


@SETTINGS
@given(problems())
def test_permuting_queries_permutes_the_output(p):
    q, k, v, scale, rng = p
    perm = rng.permutation(q.shape[0])
    out, w = jaxattn.attention(q, k, v, scale=scale)
    out2, w2 = jaxattn.attention(q[perm], k, v, scale=scale)
    np.testing.assert_array_equal(out2, np.asarray(out)[perm])
    np.testing.assert_array_equal(w2, np.asarray(w)[perm])


@SETTINGS
@given(problems(causal=True))
def test_causal_rows_up_to_i_ignore_tokens_after_i_bit_for_bit(p):
    q, k, v, scale, rng = p
    T = q.shape[0]
    i = int(rng.integers(0, T))
    q2, k2, v2 = q.copy(), k.copy(), v.copy()
    for x in (q2, k2, v2):
        x[i + 1 :] = rng.standard_normal(x[i + 1 :].shape).astype(np.float32) * 3.0
    out, w = jaxattn.attention(q, k, v, scale=scale, is_causal=True)
    out2, w2 = jaxattn.attention(q2, k2, v2, scale=scale, is_causal=True)
    np.testing.assert_array_equal(np.asarray(out2)[: i + 1], np.asarray(out)[: i + 1])
    np.testing.assert_array_equal(np.asarray(w2)[: i + 1], np.asarray(w)[: i + 1])
