"""A window run as bands (each query block's keys in one slice, one softmax) equals the tiles and the oracle.

``blockwise_attention`` runs a window narrower than the keys (without a mask or a bias) as bands; these
tests call the module's kernel with the choice forced both ways, on purpose.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxattn
from jaxattn import _blockwise
from tests._oracle import assert_close, reference_forward, reference_vjp, window_keep

# (T, S, window, causal, cap, block_q): a causal window over several scan steps with padded rows, capped;
# a two-sided window with more keys than queries; more queries than keys (rows past the keys see none);
# a window of zero keys back.
CASES = [
    (37, 37, (9, 0), True, None, 4),
    (37, 37, (9, 0), True, 1.5, 4),
    (20, 29, (3, 6), False, None, 4),
    (26, 9, (0, 2), False, 0.8, 4),
    (19, 19, (0, 0), True, None, 8),
]


def _run(q, k, v, window, causal, cap, bq, band):
    scale = jnp.asarray(1.0 / np.sqrt(q.shape[1]), jnp.float32)
    return _blockwise._blockwise_jit(q, k, v, None, scale, causal, bq, 3, window, cap, band=band)


@pytest.mark.parametrize("T,S,window,causal,cap,bq", CASES)
def test_bands_equal_the_oracle_and_the_tiles_with_their_gradients(T, S, window, causal, cap, bq):
    rng = np.random.default_rng(T * S)
    q, k = (rng.normal(size=(n, 4)).astype(np.float32) * 1.5 for n in (T, S))
    v = rng.normal(size=(S, 3)).astype(np.float32)
    d_out, d_lse = rng.normal(size=(T, 3)).astype(np.float32), rng.normal(size=(T,)).astype(np.float32)
    plan = _blockwise._plan(T, S, bq, 3, causal, False, window, cap, band=None)
    assert plan.band is not None  # the automatic choice takes bands here
    keep = window_keep(T, S, *window)
    if causal:
        keep &= np.tril(np.ones((T, S), bool))
    want_out, _ = reference_forward(q, k, v, keep, None, None, cap)

    def both(band):
        (out, lse), vjp = jax.vjp(lambda q, k, v: _run(q, k, v, window, causal, cap, bq, band), q, k, v)
        return out, lse, vjp((d_out, d_lse))

    out, lse, grads = both(True)
    out_t, lse_t, grads_t = both(False)
    assert_close(out, want_out, err_msg="out")
    empty = ~keep.any(axis=1)
    assert np.all(np.asarray(out)[empty] == 0) and np.all(np.isneginf(np.asarray(lse)[empty]))
    np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(lse_t)[~empty], rtol=2e-6, atol=2e-6)
    for got, want, name in zip(grads, grads_t, "qkv"):  # with the lse's cotangent too
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5, err_msg=f"d{name}")
    _, vjp = jax.vjp(lambda q, k, v: _run(q, k, v, window, causal, cap, bq, True)[0], q, k, v)
    wants = reference_vjp(q, k, v, d_out, keep, None, None, cap)
    magnitude = max(float(np.max(np.abs(w), initial=0.0)) for w in wants)  # normwise over (dq, dk, dv)
    for got, want, name in zip(vjp(d_out), wants, "qkv"):
        assert_close(got, want, err_msg=f"oracle d{name}", magnitude=magnitude)


def test_bands_in_bfloat16_equal_the_tiles():
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=(40, 8)), jnp.bfloat16) for _ in range(3))
    got, want = (_run(q, k, v, (11, 0), True, 2.0, 8, band)[0] for band in (True, False))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def test_bands_have_second_derivatives_and_a_scale_gradient(x64):
    rng = np.random.default_rng(9)
    q, k, v = (rng.normal(size=(13, 3)) for _ in range(3))

    def f(q, k, v, scale):
        return jaxattn.blockwise_attention(q, k, v, is_causal=True, local_window_size=(3, 0), logit_cap=1.7,
                                           scale=scale, block_q=2, block_k=2)[0]

    check_grads(f, (q, k, v, 0.6), order=2, modes=["rev"], atol=1e-5, rtol=1e-5)


def test_the_automatic_choice_keeps_tiles_for_a_mask_or_a_window_as_wide_as_the_keys():
    assert _blockwise._plan(64, 64, 8, 8, True, False, (15, 0), None, band=None).band == (16, 0)
    assert _blockwise._plan(64, 64, 8, 8, True, True, (15, 0), None, band=None).band is None  # a mask
    assert _blockwise._plan(16, 16, 8, 8, True, False, (15, 0), None, band=None).band is None  # as wide
    assert _blockwise._plan(64, 64, 8, 8, True, False, None, None, band=None).band is None  # no window


def test_which_outputs_a_non_finite_value_reaches_under_a_window_equals_a_dense_count():
    """The kernels' count of kept non-finite values (prefix sums over the keys, read at shifted rows) against
    the keep-mask written out, over offsets, both sides, causal diagonals and rows seeing no key."""
    from jaxattn._logits import kept_nonfinite

    rng = np.random.default_rng(0)
    for T, S, left, right, offset, causal in [(1, 1, 2, 12, -5, 0), (7, 9, 2, 3, 0, None), (7, 4, 0, 0, 4, None),
                                              (3, 9, 11, 12, -5, 2), (7, 9, 11, 0, 0, 0), (9, 7, 2, 3, 4, 0)]:
        bad = rng.random((S, 3)) < 0.3
        bad[0, 0] = True
        i, j = np.arange(T)[:, None], np.arange(S)[None, :]
        keep = (j >= i + offset - left) & (j <= i + offset + right)
        if causal is not None:
            keep &= j <= i + causal
        want = (keep.astype(int) @ bad.astype(int)) > 0
        got = np.asarray(kept_nonfinite(None, causal, T, S, jnp.asarray(bad), (left, right, offset)))
        np.testing.assert_array_equal(got, want, err_msg=str((T, S, left, right, offset, causal)))
        assert not np.any(np.asarray(kept_nonfinite(None, causal, T, S, jnp.zeros((S, 3), bool), (left, right, offset))))


def test_bands_at_the_edges_equal_the_tiles_values_of_zero_width_and_rows_whose_logits_are_all_minus_inf():
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.normal(size=(20, 4)), jnp.float32) for _ in range(2))
    v0 = jnp.zeros((20, 0), jnp.float32)
    grads = [jax.grad(lambda q, k: _run(q, k, v0, (2, 1), False, None, 4, band)[1].sum(), argnums=(0, 1))(q, k)
             for band in (True, False)]
    for got, want in zip(*grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # one query whose logits all overflow to -inf: no weight, as a row that sees no key
    q1, k1 = jnp.full((1, 2), 1e20, jnp.float32), jnp.full((8, 2), -1e20, jnp.float32)
    for band in (True, False):
        out, lse = _run(q1, k1, jnp.ones((8, 3), jnp.float32), (0, 2), False, None, 1, band)
        np.testing.assert_array_equal(np.asarray(out), np.zeros((1, 3), np.float32))
        assert np.isneginf(np.asarray(lse)).all()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a property of XLA's CPU backend and glibc's allocator")
def test_the_bands_keep_their_temporary_memory_under_the_size_glibc_maps_afresh_on_every_call():
    """XLA's CPU backend allocates a program's temporary buffer on every call; above glibc's mmap threshold
    (32 MiB at most) that is fresh memory, page-faulted in each time. The bands make no padded or cleaned
    copy of k and v and stack nothing per step but dk and dv, so their forward+backward at T = 16,384
    stays under it, and their forward needs less than the causal kernel's (docs/blockwise.md)."""
    T = 16384
    x = jax.ShapeDtypeStruct((T, 1, 64), jnp.float32)

    def temp(grad, **kw):
        def f(q, k, v):
            return jaxattn.multi_head_blockwise_attention(q, k, v, **kw)[0]

        program = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), argnums=(0, 1, 2)) if grad else f
        stats = jax.jit(program).lower(x, x, x).compile().memory_analysis()
        if stats is None:
            pytest.skip("this backend gives no memory analysis")
        return stats.temp_size_in_bytes

    window = dict(is_causal=True, local_window_size=(511, 0), block_q=128, block_k=128)
    assert temp(True, **window) < 32 * 2**20
    assert temp(False, **window) < temp(False, is_causal=True, block_q=512, block_k=512)
