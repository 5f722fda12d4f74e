"""Boolean keep-masks: causal, padding, combined."""

import jax
import numpy as np
import pytest

import jaxattn


@pytest.mark.parametrize("T,S,offset", [(4, 4, 0), (3, 5, 0), (3, 5, 2), (5, 3, -1), (0, 3, 0)])
def test_causal_mask_matches_numpy_tril(T, S, offset):
    np.testing.assert_array_equal(jaxattn.causal_mask(T, S, offset), np.tril(np.ones((T, S), bool), offset))


def test_causal_mask_default_is_square():
    assert jaxattn.causal_mask(3).shape == (3, 3)


def test_padding_mask_keeps_the_first_length_keys():
    m = jaxattn.padding_mask(np.array([0, 2, 4]), 4)
    np.testing.assert_array_equal(m, np.array([[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]], bool))
    assert jaxattn.padding_mask(3, 5).shape == (5,)


def test_combine_masks_is_logical_and_with_broadcasting_and_none():
    causal = jaxattn.causal_mask(3, 4)
    pad = jaxattn.padding_mask(2, 4)
    both = jaxattn.combine_masks(causal, None, pad)
    np.testing.assert_array_equal(both, np.asarray(causal) & np.asarray(pad)[None, :])
    assert jaxattn.combine_masks(None, None) is None


@pytest.mark.slow
def test_padded_batch_gives_each_example_its_own_result():
    rng = np.random.default_rng(0)
    B, T, N, H = 3, 6, 2, 4
    q, k, v = (rng.standard_normal((B, T, N, H)).astype(np.float32) for _ in range(3))
    lengths = np.array([6, 4, 1])
    masks = jaxattn.padding_mask(lengths, T)  # [B, S]
    out, w = jax.vmap(lambda a, b, c, m: jaxattn.multi_head_attention(a, b, c, mask=m, is_causal=True))(q, k, v, masks)
    for b, n in enumerate(lengths):
        alone, w_alone = jaxattn.multi_head_attention(q[b, :n], k[b, :n], v[b, :n], is_causal=True)
        np.testing.assert_allclose(out[b, :n], alone, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(w[b, :, :n, :n], w_alone, rtol=1e-5, atol=1e-6)
        assert np.all(np.asarray(w)[b, :, :, n:] == 0.0)


@pytest.mark.parametrize(
    "call, exc, message",
    [
        (lambda: jaxattn.causal_mask(-1), ValueError, "T must be >= 0, received -1"),
        (lambda: jaxattn.causal_mask(2.5), TypeError, "T must be a non-negative Python int, received 2.5"),
        (lambda: jaxattn.causal_mask(2, 2, offset=0.5), TypeError, "offset must be a Python int"),
        (lambda: jaxattn.padding_mask(np.array([1.5]), 3), TypeError, "lengths must be an integer array, received dtype float"),
        (lambda: jaxattn.combine_masks(np.ones((2, 3), bool), np.ones((4,), bool)), ValueError, r"masks must broadcast against each other, received shapes \(2, 3\), \(4,\)"),
        (lambda: jaxattn.combine_masks(np.ones((2, 3), np.int32)), TypeError, "masks\\[0\\] must be a boolean keep-mask"),
    ],
)
def test_mask_errors(call, exc, message):
    with pytest.raises(exc, match=message):
        call()
