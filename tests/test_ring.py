"""Multi-device attention on 4 host CPU devices equals the single-device result.

The main pytest process has one CPU device and jax is already initialised there, so the checks run in
a subprocess started with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (set before jax is
imported). Running this file as a script performs the checks and prints one JSON line per check; the
tests below run that script once (a module-scoped fixture) and assert on each check's result.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKS = [
    "ring_matches_dense",
    "ring_causal_matches_dense",
    "ring_padding_gqa_matches_dense",
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


@pytest.mark.slow  # one 4-device subprocess of about 35 s: `make test-slow`
@pytest.mark.parametrize("check", CHECKS)
def test_four_device_check(four_device_results, check):
    proc = four_device_results["_proc"]
    assert check in four_device_results, f"check {check} did not report; subprocess stderr:\n{proc.stderr[-4000:]}"
    record = four_device_results[check]
    assert record["devices"] == 4
    assert record["ok"], record


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

    checks = {
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
            fn()
            record = dict(check=name, ok=True, devices=devices)
        except Exception:  # report every failure, keep checking the rest
            record = dict(check=name, ok=False, devices=devices, error=traceback.format_exc()[-3000:])
        record["seconds"] = round(time.perf_counter() - start, 2)  # reported, never asserted
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    _main()
