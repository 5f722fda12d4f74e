"""JAX's own dot_product_attention tests, run against ``jaxattn.dot_product_attention``.

Origin: the five ``dot_product_attention`` tests of JAX's tests/nn_test.py at tag jax-v0.10.2
(``testDotProductAttention``, ``testDotProductAttentionMask``, ``testDotProductAttentionFloat64MaskDebugInfs``,
``testDotProductAttentionBiasGradient``, ``testDotProductAttention_localWindowSizeWithoutMask``; Apache-2.0,
Copyright 2019 The JAX Authors). Each is written here again as a pytest function with the same
parameter grid, the same inputs (the same PRNG keys, shapes and dtypes), the same reference
(``jax.nn.dot_product_attention`` with ``implementation=None``) and the same assertions and tolerances.
What changed, and only this:

- CHANGED: the function under test (``sdpa_ans``) is ``jaxattn.dot_product_attention``, not ``jax.nn``'s;
  the reference stays ``jax.nn.dot_product_attention``.
- CHANGED: besides JAX's own ``impl`` values (``"cudnn"``, ``"xla"``), jaxattn's kernels (``"blockwise"``,
  ``"dense"``) run each case too.
- CHANGED: ``_check_cudnn_backend`` and the GPU guards: cuDNN cases skip off an NVIDIA GPU, as the tests'
  own guards (compute capability 8.0) do; the cuDNN-in-HLO checks run only where cuDNN runs.
- CHANGED: ``assertAllClose`` is ``numpy.testing.assert_allclose`` on float32 copies (absltest's compares
  in float32 for bf16/f16 too), and tuples of outputs are compared element by element.
- CHANGED: the cases beyond one per test function are marked ``slow`` (``make test-slow``).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

import jaxattn

ON_NVIDIA = jax.default_backend() == "gpu"


def _close(a, b, atol=1e-6, rtol=1e-6):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=atol, rtol=rtol)


def _impls(*jax_impls):
    """JAX's own impl values, then jaxattn's kernels (CHANGED: they run too)."""
    return list(jax_impls) + ["blockwise", "dense"]


def _skip_off_gpu(impl):
    if impl == "cudnn" and not ON_NVIDIA:
        pytest.skip("Needs compute capability 8.0 or higher.")  # the test's own guard, off an NVIDIA GPU


def _slow_after_first(cases):
    return [c if i == 0 else pytest.param(*c if isinstance(c, tuple) else (c,), marks=pytest.mark.slow)
            for i, c in enumerate(cases)]


_DPA_CASES = [(dtype, g, vm, impl) for dtype in (jnp.bfloat16, jnp.float16) for g in (1, 2, 4)
              for vm in (False, True) for impl in _impls("cudnn", "xla")]
_DPA_CASES.sort(key=lambda c: c[3] != "blockwise")  # one blockwise case in make test


@pytest.mark.parametrize("dtype,group_num,use_vmap,impl", _slow_after_first(_DPA_CASES))
def test_dot_product_attention(dtype, group_num, use_vmap, impl):
    _skip_off_gpu(impl)
    if impl == "xla" and dtype == jnp.float16 and jax.default_backend() == "cpu" and use_vmap:
        pass  # jax.nn's float16 xla path runs eagerly on a CPU; so does jaxattn's (it is jax.nn's)
    B, S, T, N, H, G = 2, 128, 128, 4, 32, group_num
    keys = random.split(random.PRNGKey(0), 5)
    Q = random.normal(keys[0], (B, T, N, H), dtype)
    K = random.normal(keys[1], (B, S, N // G, H), dtype)
    V = random.normal(keys[2], (B, S, N // G, H), dtype)
    grad = random.normal(keys[3], (B, T, N, H), dtype)
    lse_grad = random.normal(keys[4], (B, T, N), dtype)
    bias, mask = None, None

    sdpa_ref = partial(jax.nn.dot_product_attention, implementation=None)
    sdpa_ans = partial(jaxattn.dot_product_attention, implementation=impl)  # CHANGED: jaxattn's
    sdpa_ref_lse = partial(jax.nn.dot_product_attention, implementation=None, return_residual=True)
    sdpa_ans_lse = partial(jaxattn.dot_product_attention, implementation=impl, return_residual=True)  # CHANGED
    if use_vmap:
        sdpa_ans = jax.vmap(sdpa_ans, in_axes=(0, 0, 0, None, None), out_axes=0)

    K_ref = jnp.repeat(K, G, axis=2)
    V_ref = jnp.repeat(V, G, axis=2)
    out_ref, sdpa_vjp_ref = jax.vjp(sdpa_ref, Q, K_ref, V_ref, bias, mask)
    out_ans, sdpa_vjp_ans = jax.vjp(sdpa_ans, Q, K, V, bias, mask)
    out_ref_lse, sdpa_vjp_ref_lse = jax.vjp(sdpa_ref_lse, Q, K_ref, V_ref, bias, mask)
    out_ans_lse, sdpa_vjp_ans_lse = jax.vjp(sdpa_ans_lse, Q, K, V, bias, mask)

    dQ_ref, dK_ref, dV_ref = sdpa_vjp_ref(grad)[:3]
    dQ_ans, dK_ans, dV_ans = sdpa_vjp_ans(grad)[:3]
    dK_ref = dK_ref.reshape(B, S, N // G, G, H).sum(axis=3)
    dV_ref = dV_ref.reshape(B, S, N // G, G, H).sum(axis=3)
    dQ_ref_lse, dK_ref_lse, dV_ref_lse = sdpa_vjp_ref_lse((grad, lse_grad))[:3]
    dQ_ans_lse, dK_ans_lse, dV_ans_lse = sdpa_vjp_ans_lse((grad, lse_grad))[:3]
    dK_ref_lse = dK_ref_lse.reshape(B, S, N // G, G, H).sum(axis=3)
    dV_ref_lse = dV_ref_lse.reshape(B, S, N // G, G, H).sum(axis=3)

    assert out_ans.dtype == out_ref.dtype and out_ans_lse[1].dtype == out_ref_lse[1].dtype
    _close(out_ref, out_ans, atol=.01, rtol=.01)
    _close(dQ_ref, dQ_ans, rtol=.01, atol=.01)
    _close(dK_ref, dK_ans, rtol=.01, atol=.01)
    _close(dV_ref, dV_ans, rtol=.01, atol=.01)
    _close(out_ref_lse[0], out_ans_lse[0], atol=.01, rtol=.01)
    _close(out_ref_lse[1], out_ans_lse[1], atol=.01, rtol=.01)
    _close(dQ_ref_lse, dQ_ans_lse, rtol=.01, atol=.01)
    _close(dK_ref_lse, dK_ans_lse, rtol=.01, atol=.01)
    _close(dV_ref_lse, dV_ans_lse, rtol=.01, atol=.01)


_MASK_MODES = ["bias", "causal", "padding", "custom", ("causal", "padding"), ("custom", "padding"),
               ("bias", "causal"), ("causal", "sliding_window")]
# JAX's own impl there: cuDNN on an NVIDIA GPU, else xla. CHANGED: jaxattn's kernels run each mode too.
_MASK_CASES = [(m, impl) for m in _MASK_MODES for impl in ["cudnn" if ON_NVIDIA else "xla", "blockwise", "dense"]]
_MASK_CASES.sort(key=lambda c: not (c[0] == ("causal", "sliding_window") and c[1] == "blockwise"))


@pytest.mark.parametrize("mask_mode,impl", _slow_after_first(_MASK_CASES))
def test_dot_product_attention_mask(mask_mode, impl):
    if isinstance(mask_mode, str):
        mask_mode = (mask_mode,)
    dtype = jnp.bfloat16
    B, S, T, N, H = 2, 128, 128, 4, 32
    keys = random.split(random.PRNGKey(0), 4)
    Q = random.normal(keys[0], (B, T, N, H), dtype)
    K = random.normal(keys[1], (B, S, N, H), dtype)
    V = random.normal(keys[2], (B, S, N, H), dtype)
    grad = random.normal(keys[3], (B, T, N, H), dtype)
    bias, mask = None, None
    q_seqlen, kv_seqlen = None, None
    window_size = None

    is_causal = "causal" in mask_mode
    if "padding" in mask_mode:
        q_seqlen = jnp.array([T // 2, T // 4], dtype=jnp.int32)
        kv_seqlen = jnp.array([S // 4, S // 2], dtype=jnp.int32)
    if "custom" in mask_mode:
        custom_mask = jnp.tril(jnp.ones((T, S), dtype=jnp.bool_))
        mask = custom_mask[None, None, :, :]
    if "bias" in mask_mode:
        bias = random.normal(keys[4], (1, N, T, S), dtype)  # as in JAX: index 4 of 4 keys clamps to the last
    if "sliding_window" in mask_mode:
        window_size = (3, 2) if is_causal else (3, 0)

    sdpa_ref = partial(jax.nn.dot_product_attention, is_causal=is_causal, implementation=None)
    sdpa_ans = partial(jaxattn.dot_product_attention, is_causal=is_causal, implementation=impl)  # CHANGED
    args = (Q, K, V, bias, mask)
    fn_ref = lambda q, k, v, b, m, qs, kvs: sdpa_ref(
        q, k, v, b, m, query_seq_lengths=qs, key_value_seq_lengths=kvs, local_window_size=window_size)
    fn_ans = lambda q, k, v, b, m, qs, kvs: sdpa_ans(
        q, k, v, b, m, query_seq_lengths=qs, key_value_seq_lengths=kvs, local_window_size=window_size)
    out_ref, sdpa_vjp_ref = jax.vjp(fn_ref, *args, q_seqlen, kv_seqlen)
    out_ans, sdpa_vjp_ans = jax.vjp(fn_ans, *args, q_seqlen, kv_seqlen)
    dQ_ref, dK_ref, dV_ref, dbias_ref = sdpa_vjp_ref(grad)[:4]
    dQ_ans, dK_ans, dV_ans, dbias_ans = sdpa_vjp_ans(grad)[:4]

    _close(out_ref, out_ans, atol=.01, rtol=.01)
    _close(dQ_ref, dQ_ans, rtol=.02, atol=.02)
    _close(dK_ref, dK_ans, rtol=.02, atol=.02)
    _close(dV_ref, dV_ans, rtol=.01, atol=.01)
    if dbias_ref is None:
        assert dbias_ans is None
    else:
        _close(dbias_ref, dbias_ans, rtol=.02, atol=.02)


@pytest.mark.parametrize("impl", [None, "xla", pytest.param("blockwise", marks=pytest.mark.slow),
                                  pytest.param("dense", marks=pytest.mark.slow)])
def test_dot_product_attention_float64_mask_debug_infs(impl):
    # CHANGED: jaxattn's function, at each implementation; JAX asserts no warning and no error.
    with jax.enable_x64(True):
        T, S, K, N, H = 5, 7, 3, 6, 11
        mask = jnp.arange(S) <= S // 2
        with jax.debug_infs(True):
            out = jaxattn.dot_product_attention(
                jnp.zeros((T, N, H), dtype=jnp.float64),
                jnp.zeros((S, K, H), dtype=jnp.float64),
                jnp.zeros((S, K, H), dtype=jnp.float64),
                mask=mask, implementation=impl,
            )
            out.block_until_ready()
        assert out.shape == (T, N, H) and out.dtype == jnp.float64


_BIAS_CASES = [(b, vm, impl) for b in (1, 16) for vm in (False, True)
               for impl in ["cudnn" if ON_NVIDIA else "xla", "blockwise", "dense"]]
_BIAS_CASES.sort(key=lambda c: not (c[0] == 1 and c[2] == "blockwise"))


@pytest.mark.parametrize("batch_size,use_vmap,impl", _slow_after_first(_BIAS_CASES))
def test_dot_product_attention_bias_gradient(batch_size, use_vmap, impl):
    dtype = jnp.bfloat16
    B, S, N, H = batch_size, 128, 4, 32
    keys = random.split(random.PRNGKey(0), 2)
    x = random.normal(keys[0], (B, S, N, H), dtype)
    bias = random.normal(keys[1], (B, N, S, S), dtype=dtype)
    mask = jnp.ones((1, 1, S), dtype=jnp.bool_)

    def attention(x, bias, mask, fn, impl):
        return fn(query=x, key=x, value=x, bias=bias, mask=mask, is_causal=False, implementation=impl)

    attn_ref = partial(attention, fn=jax.nn.dot_product_attention, impl=None)
    attn_ans = partial(attention, fn=jaxattn.dot_product_attention, impl=impl)  # CHANGED
    if use_vmap:
        attn_batched_ref = jax.vmap(attn_ref, in_axes=(0, 0, None))
        attn_batched_ans = jax.vmap(attn_ans, in_axes=(0, 0, None))
    else:
        attn_batched_ref, attn_batched_ans = attn_ref, attn_ans
    y_ref = jax.jit(attn_batched_ref)(x, bias, mask)
    y_ans = jax.jit(attn_batched_ans)(x, bias, mask)
    _close(y_ref, y_ans, atol=1e-2, rtol=1e-2)  # absltest's default bf16 tolerance

    @jax.jit
    def bwd_ref(x, bias, mask):
        _, f_vjp = jax.vjp(attn_ref, x, bias, mask)
        return f_vjp(x)

    @jax.jit
    def bwd_ans(x, bias, mask):
        _, f_vjp = jax.vjp(attn_ans, x, bias, mask)
        return f_vjp(x)

    _, dbias_ref, _ = bwd_ref(x, bias, mask)
    _, dbias_ans, _ = bwd_ans(x, bias, mask)
    _close(dbias_ans, dbias_ref, rtol=0.1, atol=0.1)


@pytest.mark.parametrize("impl", [None, "xla", "blockwise", pytest.param("dense", marks=pytest.mark.slow)])
def test_dot_product_attention_local_window_size_without_mask(impl):
    dtype = jnp.float32
    B, S, T, N, H = 2, 128, 128, 4, 32
    keys = random.split(random.PRNGKey(0), 3)
    Q = random.normal(keys[0], (B, T, N, H), dtype)
    K = random.normal(keys[1], (B, S, N, H), dtype)
    V = random.normal(keys[2], (B, S, N, H), dtype)
    sdpa = partial(jaxattn.dot_product_attention, implementation=impl)  # CHANGED: jaxattn's
    output_large_window = sdpa(Q, K, V, mask=None, local_window_size=(32, 32))
    output_small_window = sdpa(Q, K, V, mask=None, local_window_size=(1, 1))
    assert not jnp.allclose(output_large_window, output_small_window), (
        "Attention output should differ with different local_window_size, even without a mask.")
    # ADDED: and each equals jax.nn's, both with float32 products in float32 (a GPU's default may be TF32)
    with jax.default_matmul_precision("highest"):
        small = sdpa(Q, K, V, mask=None, local_window_size=(1, 1))
        want = jax.nn.dot_product_attention(Q, K, V, local_window_size=(1, 1))
    _close(small, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # make test-slow: it compiles every implementation in every dtype
def test_the_lse_is_in_the_input_dtype_without_a_gradient_as_in_jax_nn():
    """With return_residual, lse carries no gradient (a cotangent on it changes nothing), in bf16."""
    keys = random.split(random.PRNGKey(1), 4)
    q, k, v = (random.normal(kk, (1, 16, 2, 8), jnp.bfloat16) for kk in keys[:3])
    for impl in ("blockwise", "dense", "xla"):
        f = lambda q: jaxattn.dot_product_attention(q, k, v, implementation=impl, return_residual=True)
        (out, lse), vjp = jax.vjp(f, q)
        assert lse.dtype == jnp.bfloat16 and lse.shape == (1, 16, 2)
        (dq_lse,) = vjp((jnp.zeros_like(out), jnp.ones_like(lse)))
        assert not np.any(np.asarray(dq_lse, np.float32)), impl
