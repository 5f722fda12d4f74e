"""The NNX module is the functional attention_layer over its own parameters."""

import jax
import numpy as np
from flax import nnx

import jaxattn
from jaxattn.nnx import MultiHeadAttention


def test_nnx_module_matches_attention_layer_and_differentiates():
    module = MultiHeadAttention(16, 4, num_kv_heads=2, use_bias=True, rngs=nnx.Rngs(0))
    h = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    out, w = module(h, is_causal=True)
    ref_out, ref_w = jaxattn.attention_layer(module.params(), h, num_heads=4, num_kv_heads=2, is_causal=True)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(w, ref_w)
    assert out.shape == (5, 16) and w.shape == (4, 5, 5)
    grads = nnx.grad(lambda m: (m(h)[0] ** 2).sum())(module)
    g = grads["W_Q"][...]
    assert g.shape == (16, 16) and np.all(np.isfinite(g)) and np.any(g != 0)
    assert set(module.params()) == {"W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O"}
    batched = jax.vmap(lambda x: module(x)[0])(np.stack([h, h]))
    np.testing.assert_allclose(batched[1], module(h)[0], rtol=1e-6, atol=1e-6)
