"""``jaxattn.dot_product_attention``, the jax.nn switch: inputs jax.nn refuses or never meets."""

import jax
import numpy as np
import pytest

import jaxattn


def _qkv(B=2, T=3, S=5, N=2, H=4, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=shape).astype(np.float32) for shape in ((B, T, N, H), (B, S, N, H), (B, S, N, H)))


@pytest.mark.parametrize("lengths", [np.array([2**31, 2**32 + 2], np.int64), np.array([2**32 - 1, 7], np.uint32)])
@pytest.mark.parametrize("implementation", ["dense", "blockwise"])
def test_a_length_past_int32_keeps_every_key_instead_of_wrapping_round(lengths, implementation):
    """Lengths of any integer dtype are clipped before they become int32: longer than S keeps every key."""
    q, k, v = _qkv()
    got = jaxattn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation=implementation)
    want = jaxattn.dot_product_attention(q, k, v, implementation=implementation)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
    traced = jax.jit(lambda n: jaxattn.dot_product_attention(q, k, v, key_value_seq_lengths=n,
                                                             implementation=implementation))(np.array([9, 2**30], np.int32))
    np.testing.assert_allclose(np.asarray(traced), np.asarray(want), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["query", "key", "value"])
def test_a_ragged_input_is_refused_by_name(name):
    q, k, v = _qkv(B=1)
    args = dict(query=q, key=k, value=v)
    args[name] = [[[[1.0]]], [[[1.0, 2.0]]]]  # rows of different lengths
    with pytest.raises(TypeError, match=name):
        jaxattn.dot_product_attention(**args)
