"""Multi-device attention on 4 host CPU devices equals the single-device result.

The main pytest process has one CPU device and jax is already initialised there, so the checks run in
a subprocess started with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (set before jax is
imported). Running this file as a script performs the checks and prints one JSON line per check; the
tests below run that script once (a module-scoped fixture) and assert on each check's result. On the
main process's one device, ``ring_attention_shard`` runs as a ring of one and its argument checks.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

CHECKS = [
    "ring_shard_in_user_shard_map_matches_dense",
    "ring_shard_on_batch_by_seq_mesh_matches_dense",
    "ring_shard_check_vma_true_refused",
    "ring_matches_dense",
    "ring_causal_matches_dense",
    "ring_padding_gqa_matches_dense",
    "ring_window_matches_dense_values_and_gradients",
    "ring_gradients_match_single_device",
    "ring_backward_saves_only_own_chunks",
    "ring_check_grads_float64",
    "sharded_batch_heads_matches_dense",
    "named_sharding_jit_matches_single_device",
    "bad_mesh_axis_raises",
]


@pytest.fixture(scope="module")
def four_device_results():
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, cwd=root)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[record["check"]] = record
    results["_proc"] = proc
    return results


@pytest.mark.slow  # one 4-device subprocess of about 45 s on 2 cores: `make test-slow`
@pytest.mark.parametrize("check", CHECKS)
def test_four_device_check(four_device_results, check):
    proc = four_device_results["_proc"]
    assert check in four_device_results, f"check {check} did not report; subprocess stderr:\n{proc.stderr[-4000:]}"
    record = four_device_results[check]
    assert record["devices"] == 4
    assert record["ok"], record


# ----------------------------------------------------------------------------------------------------
# ring_attention_shard on the main process's one device: a ring of one, and its argument checks.
# ----------------------------------------------------------------------------------------------------


def _one_device_shard_map(fn):
    import jax
    from jax.sharding import PartitionSpec

    mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))  # shard_map places inputs
    spec = PartitionSpec("seq")
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, PartitionSpec(None, "seq")),
                         check_vma=False)


def test_ring_attention_shard_in_a_one_device_shard_map_equals_dense():
    import jaxattn

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((6, 2, n)).astype(np.float32) for n in (4, 4, 3))
    run = _one_device_shard_map(lambda q, k, v: jaxattn.ring_attention_shard(q, k, v, axis_name="seq", is_causal=True))
    out, lse = run(q, k, v)
    ref_out, _ = jaxattn.multi_head_attention(q, k, v, is_causal=True)
    _, ref_lse = jaxattn.multi_head_blockwise_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(out, ref_out, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(axis_name=1), TypeError, "axis_name must be the name (a str) of a mesh axis, received 1"),
        (dict(axis_name="nope"), ValueError, "axis_name='nope' is not bound here"),
    ],
    ids=["axis_name_not_str", "axis_name_unbound"],
)
def test_ring_attention_shard_refuses_an_axis_it_cannot_use(kwargs, error, message):
    import jaxattn

    q = np.zeros((4, 2, 4), np.float32)
    with pytest.raises(error) as info:  # outside any shard_map, and inside one without that axis
        jaxattn.ring_attention_shard(q, q, q, **kwargs)
    assert message in str(info.value)
    with pytest.raises(error) as info:
        _one_device_shard_map(lambda q, k, v: jaxattn.ring_attention_shard(q, k, v, **kwargs))(q, q, q)
    assert message in str(info.value)


@pytest.mark.parametrize("axis_name", [None, 1])
def test_ring_attention_refuses_an_axis_name_that_is_not_a_str(axis_name):
    """None means "not split" for sharded_attention's axes; ring_attention needs the axis it splits over."""
    import jax

    import jaxattn

    q = np.zeros((4, 2, 4), np.float32)
    mesh = jax.make_mesh((1,), ("seq",), devices=jax.devices()[:1])
    with pytest.raises(TypeError, match=r"^axis_name must be the name \(a str\) of the mesh axis the sequence is "
                                        rf"split over, received {axis_name!r}$"):
        jaxattn.ring_attention(q, q, q, mesh=mesh, axis_name=axis_name)


@pytest.mark.parametrize(
    "kwargs, k_len, message",
    [
        (dict(kv_mask=np.ones(3, bool)), 4, "kv_mask must have shape [S] = (4,), received (3,)"),
        (dict(kv_mask=np.ones(4, np.float32)), 4, "kv_mask must be a boolean keep-mask"),
        (dict(is_causal=True), 2, "needs chunks of equal length, received q (4, 2, 4) [Tc, N, H] and k (2, 2, 4)"),
    ],
    ids=["kv_mask_shape", "kv_mask_dtype", "causal_unequal_chunks"],
)
def test_ring_attention_shard_checks_its_chunks(kwargs, k_len, message):
    import jax

    import jaxattn

    q, k = np.zeros((4, 2, 4), np.float32), np.zeros((k_len, 2, 4), np.float32)
    mask = kwargs.get("kv_mask")
    rest = {key: value for key, value in kwargs.items() if key != "kv_mask"}
    f = lambda q, k, v: jaxattn.ring_attention_shard(q, k, v, axis_name="seq", kv_mask=mask, **rest)
    with pytest.raises((ValueError, TypeError)) as info:
        jax.eval_shape(_one_device_shard_map(f), q, k, k)
    assert message in str(info.value)


# ----------------------------------------------------------------------------------------------------
# The checks themselves, run in the 4-device subprocess.
# ----------------------------------------------------------------------------------------------------


def _main():  # pragma: no cover - runs in the subprocess
    import time
    import traceback

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    import jaxattn

    jax.config.update("jax_numpy_rank_promotion", "raise")
    devices = len(jax.devices())
    rng = np.random.default_rng(0)
    tol = dict(atol=1e-5, rtol=1e-5)
    seq_mesh = jax.make_mesh((4,), ("seq",))
    grid_mesh = jax.make_mesh((2, 2), ("batch", "heads"))

    def qkv(*shape_q, K=None, V=3):
        T, N, H = shape_q
        K = N if K is None else K
        return (
            rng.standard_normal((T, N, H)).astype(np.float32),
            rng.standard_normal((T, K, H)).astype(np.float32),
            rng.standard_normal((T, K, V)).astype(np.float32),
        )

    def on(mesh, spec, *xs):
        return [jax.device_put(x, NamedSharding(mesh, spec)) for x in xs]

    def ring(q, k, v, **kw):
        q, k, v = on(seq_mesh, PartitionSpec("seq"), q, k, v)
        f = jax.jit(lambda q, k, v: jaxattn.ring_attention(q, k, v, mesh=seq_mesh, axis_name="seq", block_q=3, block_k=2, **kw))
        return f(q, k, v)

    def check_ring(is_causal):
        q, k, v = qkv(16, 2, 4)
        out, lse = ring(q, k, v, is_causal=is_causal)
        np.testing.assert_allclose(out, jaxattn.multi_head_attention(q, k, v, is_causal=is_causal)[0], **tol)
        np.testing.assert_allclose(lse, jaxattn.multi_head_blockwise_attention(q, k, v, is_causal=is_causal)[1], **tol)
        assert len(out.sharding.device_set) == 4

    def ring_padding_gqa_matches_dense():
        q, k, v = qkv(12, 4, 4, K=2)
        kv_mask = np.arange(12) < 9  # the last chunk and part of the one before are padding
        f = jax.jit(lambda q, k, v, m: jaxattn.ring_attention(q, k, v, mesh=seq_mesh, axis_name="seq", kv_mask=m, is_causal=True))
        out, _ = f(*on(seq_mesh, PartitionSpec("seq"), q, k, v, kv_mask))
        np.testing.assert_allclose(out, jaxattn.multi_head_attention(q, k, v, mask=kv_mask, is_causal=True)[0], **tol)

    # Gradient configurations: (name, T, N, K, is_causal, kv_mask). Keys 9.. (the last chunk) are padding,
    # and with is_causal rows 0 and 1 see only the masked keys 0, 1: fully masked rows (zero output).
    pad = (np.arange(12) >= 2) & (np.arange(12) < 9)
    grad_cases = [
        ("plain", 16, 2, 2, False, None),
        ("causal", 16, 2, 2, True, None),
        ("causal_padding_gqa", 12, 4, 2, True, pad),
    ]

    def ring_fn(is_causal, has_mask, **kw):
        def f(q, k, v, m):
            q, k, v = (jax.reshard(x, NamedSharding(seq_mesh, PartitionSpec("seq"))) for x in (q, k, v))
            return jaxattn.ring_attention(
                q, k, v, mesh=seq_mesh, axis_name="seq", kv_mask=m if has_mask else None, is_causal=is_causal,
                block_q=3, block_k=2, **kw)
        return f

    def ring_vjp(is_causal, has_mask):
        """One compiled function: the ring's forward, then its vjp for any cotangent (d_out, d_lse)."""
        f = ring_fn(is_causal, has_mask)

        @jax.jit
        def run(q, k, v, m, d_out, d_lse):
            out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, m), q, k, v)
            return out, vjp((d_out, d_lse))
        return run

    def single_vjp(f, primals, cotangent):
        out, vjp = jax.vjp(f, *primals)
        return out, vjp(cotangent)

    def ring_gradients_match_single_device():
        """dq, dk, dv of ring attention equal one device's: dense for d_out, blockwise with d_lse too."""
        for name, T, N, K, is_causal, kv_mask in grad_cases:
            q, k, v = qkv(T, N, 4, K=K)
            m = np.ones(T, bool) if kv_mask is None else kv_mask
            d_out = rng.standard_normal((T, N, 3)).astype(np.float32)
            d_lse = rng.standard_normal((N, T)).astype(np.float32)
            run = ring_vjp(is_causal, kv_mask is not None)
            placed = on(seq_mesh, PartitionSpec("seq"), q, k, v, m)
            dense = lambda q, k, v: jaxattn.multi_head_attention(q, k, v, mask=kv_mask, is_causal=is_causal)[0]
            blockwise = lambda q, k, v: jaxattn.multi_head_blockwise_attention(
                q, k, v, mask=kv_mask, is_causal=is_causal)
            (out, lse), grads = run(*placed, d_out, np.zeros_like(d_lse))
            out_ref, grads_ref = jax.jit(lambda q, k, v: single_vjp(dense, (q, k, v), d_out))(q, k, v)
            np.testing.assert_allclose(out, out_ref, **tol, err_msg=name)
            for g, g_ref, what in zip(grads, grads_ref, "qkv"):
                np.testing.assert_allclose(g, g_ref, **tol, err_msg=f"{name}: d{what} vs dense")
            _, grads = run(*placed, d_out, d_lse)
            _, grads_ref = jax.jit(lambda q, k, v: single_vjp(blockwise, (q, k, v), (d_out, d_lse)))(q, k, v)
            for g, g_ref, what in zip(grads, grads_ref, "qkv"):
                assert np.all(np.isfinite(g)), (name, what)
                np.testing.assert_allclose(g, g_ref, **tol, err_msg=f"{name}: d{what} vs blockwise, with d_lse")
            if kv_mask is not None and is_causal:  # rows 0, 1 fully masked: zero output, no gradient to dq
                assert np.all(np.asarray(out)[:2] == 0.0) and np.all(np.asarray(lse)[:, :2] == -np.inf)
                assert np.all(np.asarray(grads[0])[:2] == 0.0)

    def ring_backward_saves_only_own_chunks():
        """The vjp keeps per device only its own q, k, v, mask, out, lse chunks (O((T + S) / P)).

        Autodiff through the ring would also keep every visiting key/value chunk (and each step's
        partial out/lse): P times more for k and v, so this fails for it.
        """
        T, N, K = 12, 4, 2
        q, k, v = qkv(T, N, 4, K=K)
        f = jax.jit(ring_fn(True, True))
        _, vjp = jax.vjp(lambda q, k, v: f(q, k, v, on(seq_mesh, PartitionSpec("seq"), pad)[0]),
                         *on(seq_mesh, PartitionSpec("seq"), q, k, v))
        residuals = [x for x in jax.tree_util.tree_leaves(vjp) if isinstance(x, jax.Array)]
        per_device = sum(int(np.prod(x.sharding.shard_shape(x.shape))) for x in residuals)
        chunk = T // 4
        own = chunk * (N * 4 + K * 4 + K * 3 + 1 + N * 3 + N) + 1  # q, k, v, mask, out [T,N,V], lse [N,T]; scale
        assert residuals and per_device <= own, (per_device, own, [(x.shape, x.dtype) for x in residuals])
        # and the backward really is a ring: each hop sends k, v, mask and the gradients dk, dv; one more
        # hop brings dk, dv home (the transpose of the forward's ring would send only dk, dv)
        jaxpr = str(jax.make_jaxpr(vjp)((jnp.zeros((T, N, 3)), jnp.zeros((N, T)))))
        assert jaxpr.count("ppermute[") >= 7, jaxpr

    def ring_check_grads_float64():
        """check_grads (first order, reverse mode) of the ring in float64 on a tiny causal padded GQA case."""
        from jax.test_util import check_grads

        with jax.enable_x64(True):
            T, N, K = 8, 2, 1
            q, k, v = (rng.standard_normal((T, n, 2)) for n in (N, K, K))
            m = on(seq_mesh, PartitionSpec("seq"), np.arange(T) != 2)[0]
            # scale is an argument too: its gradient is each device's share, summed round the ring (psum)
            f = jax.jit(lambda q, k, v, s: ring_fn(True, True, scale=s)(q, k, v, m))  # one compile for all
            check_grads(f, (q, k, v, np.float64(0.7)), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)

    def batched(B, T, N, K, H=4):
        return (
            rng.standard_normal((B, T, N, H)).astype(np.float32),
            rng.standard_normal((B, T, K, H)).astype(np.float32),
            rng.standard_normal((B, T, K, 3)).astype(np.float32),
        )

    dense_batched = jax.vmap(lambda q, k, v: jaxattn.multi_head_attention(q, k, v, is_causal=True)[0])

    def sharded_batch_heads_matches_dense():
        q, k, v = batched(4, 10, 4, 2)
        f = jax.jit(lambda q, k, v: jaxattn.sharded_attention(
            q, k, v, mesh=grid_mesh, batch_axis="batch", head_axis="heads", is_causal=True, block_q=4, block_k=3))
        out, lse = f(*on(grid_mesh, PartitionSpec("batch", None, "heads", None), q, k, v))
        np.testing.assert_allclose(out, dense_batched(q, k, v), **tol)
        assert lse.shape == (4, 4, 10)
        assert out.sharding.spec == PartitionSpec("batch", None, "heads", None)

    def named_sharding_jit_matches_single_device():
        q, k, v = batched(4, 10, 4, 2)
        expected = dense_batched(q, k, v)
        blockwise_batched = jax.vmap(lambda q, k, v: jaxattn.multi_head_blockwise_attention(
            q, k, v, is_causal=True, block_q=4, block_k=3)[0])
        spec = PartitionSpec("batch", None, "heads", None)
        # an Auto mesh (XLA's partitioner decides) and an Explicit one (the sharding is part of the types)
        auto_mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("batch", "heads"))
        for mesh in (auto_mesh, grid_mesh):
            placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
            with jax.set_mesh(mesh):
                outs = [jax.jit(dense_batched)(*placed), jax.jit(blockwise_batched)(*placed)]
            for out in outs:
                np.testing.assert_allclose(out, expected, **tol)
                assert len(out.sharding.device_set) == 4
        assert outs[1].sharding.spec == spec  # explicit: every device computed its own examples and heads

    def bad_mesh_axis_raises():
        q, k, v = qkv(16, 2, 4)
        for kwargs, message in (
            (dict(axis_name="nope"), "is not an axis of the mesh"),
            (dict(axis_name="seq", is_causal=True), None),
        ):
            try:
                jaxattn.ring_attention(q[:15], k[:15], v[:15], mesh=seq_mesh, **kwargs)
            except ValueError as e:
                assert message is None or message in str(e), str(e)
                assert message is not None or "must divide both sequence lengths" in str(e), str(e)
            else:
                raise AssertionError(f"no ValueError for {kwargs}")

    def max_abs(**pairs):  # reported in the check's record, never asserted
        diff = lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        return {f"max_abs_{name}": diff(a, b) for name, (a, b) in pairs.items()}

    def shard_vjp(fn, mesh, spec, lse_spec, has_mask):
        """One compiled function: ``fn(q, k, v, m, scale)`` in the caller's own shard_map, forward and vjp."""
        in_specs = (spec, spec, spec, spec if has_mask else None, PartitionSpec())
        body = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=(spec, lse_spec), check_vma=False)

        @jax.jit
        def run(q, k, v, m, scale, d_out, d_lse):
            out, vjp = jax.vjp(lambda q, k, v, s: body(q, k, v, m, s), q, k, v, scale)
            return out, vjp((d_out, d_lse))
        return run

    def ring_shard_in_user_shard_map_matches_dense():
        """ring_attention_shard in the caller's shard_map (4-device ring): out, lse, dq, dk, dv, dscale.

        Causal, grouped-query, keys 9.. padded; scale is an input replicated over the ring (P()), so its
        gradient is the devices' shares summed by shard_map's transpose.
        """
        T, N, K = 12, 4, 2
        q, k, v = qkv(T, N, 4, K=K)
        kv_mask = np.arange(T) < 9
        d_out = rng.standard_normal((T, N, 3)).astype(np.float32)
        d_lse = rng.standard_normal((N, T)).astype(np.float32)

        def block(q, k, v, m, s):  # this device's chunks [3, N, H], [3, K, H], [3, K, V], [3]
            return jaxattn.ring_attention_shard(q, k, v, axis_name="seq", kv_mask=m, is_causal=True, scale=s,
                                                block_q=2, block_k=2)

        run = shard_vjp(block, seq_mesh, PartitionSpec("seq"), PartitionSpec(None, "seq"), True)
        placed = on(seq_mesh, PartitionSpec("seq"), q, k, v, kv_mask)
        (out, lse), grads = run(*placed, np.float32(0.6), d_out, d_lse)
        ref = lambda q, k, v, s: jaxattn.multi_head_blockwise_attention(q, k, v, mask=kv_mask, is_causal=True, scale=s)
        (out_ref, lse_ref), grads_ref = jax.jit(lambda *a: single_vjp(ref, a, (d_out, d_lse)))(q, k, v, np.float32(0.6))
        dense = jaxattn.multi_head_attention(q, k, v, mask=kv_mask, is_causal=True, scale=0.6)[0]
        np.testing.assert_allclose(out, dense, **tol)
        np.testing.assert_allclose(out, out_ref, **tol)
        np.testing.assert_allclose(lse, lse_ref, **tol)
        for g, g_ref, what in zip(grads, grads_ref, ("q", "k", "v", "scale")):
            np.testing.assert_allclose(g, g_ref, atol=1e-4, rtol=1e-5, err_msg=f"d{what}")
        assert len(out.sharding.device_set) == 4
        grad_pairs = dict(zip(("dq", "dk", "dv", "dscale"), zip(grads, grads_ref)))
        return max_abs(out=(out, dense), lse=(lse, lse_ref), **grad_pairs)

    def ring_shard_on_batch_by_seq_mesh_matches_dense():
        """A 2 x 2 (batch, seq) mesh: the caller vmaps ring_attention_shard over its examples; not causal."""
        mesh = jax.make_mesh((2, 2), ("batch", "seq"))
        q, k, v = batched(4, 8, 4, 2)
        d_out = rng.standard_normal((4, 8, 4, 3)).astype(np.float32)
        d_lse = rng.standard_normal((4, 4, 8)).astype(np.float32)

        def block(q, k, v, m, s):  # [2, 4, N, H] ...: this device's 2 examples, 4 positions of each
            f = lambda q, k, v: jaxattn.ring_attention_shard(q, k, v, axis_name="seq", scale=s, block_q=2, block_k=3)
            return jax.vmap(f)(q, k, v)

        spec = PartitionSpec("batch", "seq")
        run = shard_vjp(block, mesh, spec, PartitionSpec("batch", None, "seq"), False)
        (out, lse), grads = run(*on(mesh, spec, q, k, v), None, np.float32(0.5), d_out, d_lse)
        ref = jax.vmap(lambda q, k, v, s: jaxattn.multi_head_blockwise_attention(q, k, v, scale=s), (0, 0, 0, None))
        (out_ref, lse_ref), grads_ref = jax.jit(lambda *a: single_vjp(ref, a, (d_out, d_lse)))(q, k, v, np.float32(0.5))
        dense = jax.vmap(lambda q, k, v: jaxattn.multi_head_attention(q, k, v, scale=0.5)[0])(q, k, v)
        np.testing.assert_allclose(out, dense, **tol)
        np.testing.assert_allclose(lse, lse_ref, **tol)
        for g, g_ref, what in zip(grads, grads_ref, ("q", "k", "v", "scale")):
            np.testing.assert_allclose(g, g_ref, atol=1e-4, rtol=1e-5, err_msg=f"d{what}")
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), out.ndim), out.sharding
        grad_pairs = dict(zip(("dq", "dk", "dv", "dscale"), zip(grads, grads_ref)))
        return max_abs(out=(out, dense), lse=(lse, lse_ref), **grad_pairs)

    def ring_shard_check_vma_true_refused():
        q, k, v = on(seq_mesh, PartitionSpec("seq"), *qkv(8, 2, 4))
        spec = PartitionSpec("seq")
        body = jax.shard_map(lambda q, k, v: jaxattn.ring_attention_shard(q, k, v, axis_name="seq"), mesh=seq_mesh,
                             in_specs=(spec, spec, spec), out_specs=(spec, PartitionSpec(None, "seq")))
        try:
            jax.eval_shape(body, q, k, v)
        except NotImplementedError as e:
            assert "check_vma=False" in str(e), str(e)
        else:
            raise AssertionError("no NotImplementedError under check_vma=True")

    def ring_window_matches_dense_values_and_gradients():
        """Windows over the whole sequence, inside a chunk, across chunks and wrapping past the ring's last
        device: out, lse and dq, dk, dv (with a cotangent on lse) equal one device's."""
        T = 16  # chunks of 4 on 4 devices
        for is_causal, window in [(True, (2, 0)), (True, (5, 0)), (False, (3, 2)), (False, (0, 9)), (True, (20, 0))]:
            q, k, v = qkv(T, 2, 4)
            d_out = rng.standard_normal((T, 2, 3)).astype(np.float32)
            d_lse = rng.standard_normal((2, T)).astype(np.float32)
            f = lambda q, k, v: jaxattn.ring_attention(q, k, v, mesh=seq_mesh, axis_name="seq", is_causal=is_causal,
                                                       local_window_size=window, block_q=3, block_k=2)
            g = lambda q, k, v: jaxattn.multi_head_blockwise_attention(q, k, v, is_causal=is_causal,
                                                                       local_window_size=window)
            (out, lse), grads = jax.jit(lambda q, k, v: single_vjp(f, (q, k, v), (d_out, d_lse)))(
                *on(seq_mesh, PartitionSpec("seq"), q, k, v))
            (out_ref, lse_ref), grads_ref = single_vjp(g, (q, k, v), (d_out, d_lse))
            dense = jaxattn.multi_head_attention(q, k, v, is_causal=is_causal, local_window_size=window)[0]
            np.testing.assert_allclose(out, dense, **tol, err_msg=str(window))
            np.testing.assert_allclose(lse, lse_ref, **tol, err_msg=str(window))
            for a, b, name in zip(grads, grads_ref, "qkv"):
                np.testing.assert_allclose(a, b, **tol, err_msg=f"{window}: d{name}")
        from jaxattn._ring import _Ring

        ring = _Ring("seq", 8, True, 512, 512, (511, 0), 1024)  # W = 512 keys in chunks of 1024
        kinds = [ring.kind(m)[0] for m in range(-7, 8)]
        assert kinds.count("skip") == 13 and kinds.count("window") == 2, kinds  # two chunks run, six skipped

    checks = {
        "ring_window_matches_dense_values_and_gradients": ring_window_matches_dense_values_and_gradients,
        "ring_shard_in_user_shard_map_matches_dense": ring_shard_in_user_shard_map_matches_dense,
        "ring_shard_on_batch_by_seq_mesh_matches_dense": ring_shard_on_batch_by_seq_mesh_matches_dense,
        "ring_shard_check_vma_true_refused": ring_shard_check_vma_true_refused,
        "ring_matches_dense": lambda: check_ring(False),
        "ring_causal_matches_dense": lambda: check_ring(True),
        "ring_padding_gqa_matches_dense": ring_padding_gqa_matches_dense,
        "ring_gradients_match_single_device": ring_gradients_match_single_device,
        "ring_backward_saves_only_own_chunks": ring_backward_saves_only_own_chunks,
        "ring_check_grads_float64": ring_check_grads_float64,
        "sharded_batch_heads_matches_dense": sharded_batch_heads_matches_dense,
        "named_sharding_jit_matches_single_device": named_sharding_jit_matches_single_device,
        "bad_mesh_axis_raises": bad_mesh_axis_raises,
    }
    for name, fn in checks.items():
        start = time.perf_counter()
        try:
            record = dict(check=name, ok=True, devices=devices, **(fn() or {}))
        except Exception:  # report every failure, keep checking the rest
            record = dict(check=name, ok=False, devices=devices, error=traceback.format_exc()[-3000:])
        record["seconds"] = round(time.perf_counter() - start, 2)  # reported, never asserted
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    _main()
