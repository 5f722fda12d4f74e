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
    "ring_gradients_match_dense",
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

    def ring_gradients_match_dense():
        q, k, v = qkv(16, 2, 4)
        d_out = rng.standard_normal((16, 2, 3)).astype(np.float32)
        for is_causal in (False, True):
            loss = lambda q, k, v: jnp.sum(ring(q, k, v, is_causal=is_causal)[0] * d_out)
            loss_ref = lambda q, k, v: jnp.sum(jaxattn.multi_head_attention(q, k, v, is_causal=is_causal)[0] * d_out)
            grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
            grads_ref = jax.grad(loss_ref, argnums=(0, 1, 2))(q, k, v)
            for g, g_ref in zip(grads, grads_ref):
                np.testing.assert_allclose(g, g_ref, **tol)

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
        "ring_gradients_match_dense": ring_gradients_match_dense,
        "sharded_batch_heads_matches_dense": sharded_batch_heads_matches_dense,
        "named_sharding_jit_matches_single_device": named_sharding_jit_matches_single_device,
        "bad_mesh_axis_raises": bad_mesh_axis_raises,
    }
    for name, fn in checks.items():
        try:
            fn()
            record = dict(check=name, ok=True, devices=devices)
        except Exception:  # report every failure, keep checking the rest
            record = dict(check=name, ok=False, devices=devices, error=traceback.format_exc()[-3000:])
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    _main()
