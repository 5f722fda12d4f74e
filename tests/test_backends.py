"""The implementation switch: every implementation this machine runs returns the oracle's (out, lse) and
gradients; one that cannot honour a call says why; None follows its documented rule.

On CPU: "blockwise" and "xla" run as they are, "pallas" runs its GPU kernel in Pallas's interpret mode
(through the private entry points, which the public functions call with interpret=False), "cudnn" only
refuses. The conformance harness (end of this file) runs the whole grid.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import _conformance, check_conformance, conformance_table
from jaxattn._backends import choose_implementation
from jaxattn._blockwise import _multi_head_blockwise
from jaxattn._conformance import Case, _check, oracle
from tests._oracle import reference_forward, reference_vjp

TOL = dict(atol=2e-5, rtol=2e-5)


def _qkv(seed, T, S, N, K, H, V, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((T, N, H)).astype(dtype), rng.standard_normal((S, K, H)).astype(dtype),
            rng.standard_normal((S, K, V)).astype(dtype))


# (implementation, T, S, N, K, H, V, mask): odd lengths, grouped-query heads, V != H. Each runs out, lse
# and the gradients of Σ out·w_out + Σ lse·w_lse (lse's cotangent included) against the float64 oracle.
# The xla case with a general mask runs in `make test` as the conformance slice (end of this file).
CASES = [
    ("pallas", 13, 29, 4, 2, 16, 8, "none"),  # padded keys masked through the extra head column
    pytest.param("xla", 13, 29, 4, 2, 16, 8, "general", marks=pytest.mark.slow),  # an empty row: 0, -inf
    pytest.param("blockwise", 13, 29, 4, 2, 16, 8, "padding", marks=pytest.mark.slow),
    pytest.param("xla", 32, 32, 2, 2, 16, 16, "causal", marks=pytest.mark.slow),
    pytest.param("pallas", 21, 16, 2, 1, 8, 8, "causal", marks=pytest.mark.slow),  # causal, T > S: the column
    pytest.param("pallas", 8, 37, 2, 2, 4, 6, "causal", marks=pytest.mark.slow),  # causal, T <= S: no column
    pytest.param("pallas", 300, 140, 4, 2, 8, 8, "causal", marks=pytest.mark.slow),  # several blocks of 128
]


@pytest.mark.parametrize("impl,T,S,N,K,H,V,mask", CASES)
def test_implementation_matches_the_float64_oracle(impl, T, S, N, K, H, V, mask):
    case = Case(T, S, N, K, H, V, mask, "float32")
    (record,) = _check([case], [impl])
    assert record["status"] == "pass", record


def test_lse_of_a_library_kernel_recovers_the_weights():
    q, k, v = _qkv(2, 9, 11, 2, 1, 8, 8)

    @jax.jit
    def multi_and_single(q, k, v):  # the single-head function runs the same kernel
        kw = dict(is_causal=True, implementation="xla")
        return (jaxattn.multi_head_blockwise_attention(q, k, v, **kw),
                jaxattn.blockwise_attention(q[:, 1], k[:, 0], v[:, 0], **kw))

    (out, lse), (out1, lse1) = multi_and_single(q, k, v)
    rows = jaxattn.weights_from_lse(q[:, 1], k[:, 0], lse[1], rows=[0, 4, 8], is_causal=True)
    weights = jaxattn.attention_weights(q[:, 1], k[:, 0], is_causal=True)  # [T, S]
    np.testing.assert_allclose(rows, np.asarray(weights)[[0, 4, 8]], **TOL)
    np.testing.assert_allclose(out1, out[:, 1], **TOL)
    np.testing.assert_allclose(lse1, lse[1], **TOL)


def test_the_lse_pass_runs_only_when_something_depends_on_lse():
    """The library kernels' lse gets its gradient from an extra blockwise pass, skipped for a loss on out alone."""
    q, k, v = _qkv(4, 8, 8, 2, 2, 4, 4)
    f = lambda q, k, v: _multi_head_blockwise(q, k, v, mask=None, is_causal=False, scale=None, block_q=4,
                                              block_k=4, implementation="xla", interpret=False)
    loops = lambda loss: str(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v)).count("scan[")
    assert loops(lambda *a: jnp.sum(f(*a)[0])) == 0
    assert loops(lambda *a: jnp.sum(f(*a)[1])) > 0  # the check can fail: a loss on lse runs the pass


def _shapes(T=8, S=8, N=2, K=2, H=8, V=8, dtype=jnp.float32):
    return (jax.ShapeDtypeStruct((T, N, H), dtype), jax.ShapeDtypeStruct((S, K, H), dtype),
            jax.ShapeDtypeStruct((S, K, V), dtype))


@pytest.mark.parametrize("dtype,H,V,mask,scale,expected", [
    (jnp.bfloat16, 64, 64, None, 0.125, "cudnn"),
    (jnp.float16, 128, 128, None, 0.1, "cudnn"),
    (jnp.bfloat16, 64, 32, None, 0.125, "pallas"),  # H != V: not cuDNN's shapes
    (jnp.bfloat16, 12, 12, None, 0.125, "pallas"),  # H not a multiple of 8
    (jnp.bfloat16, 64, 64, "mask", 0.125, "blockwise"),  # a mask: neither library kernel
    (jnp.float32, 64, 64, None, 0.125, "blockwise"),  # float32: cuDNN refuses it, Triton would use TF32
    (jnp.bfloat16, 64, 64, None, "traced", "blockwise"),  # a traced scale: the kernels take Python floats
])
def test_none_picks_by_the_documented_rule_on_a_gpu(dtype, H, V, mask, scale, expected):
    q, k, v = _shapes(H=H, V=V, dtype=dtype)
    m = None if mask is None else jnp.ones((8,), bool)

    def pick(scale):
        return choose_implementation(None, q, k, v, m, scale, False, platform="gpu")

    if scale == "traced":
        picked = []
        jax.make_jaxpr(lambda s: picked.append(pick(s)) or s)(1.0)
        assert picked == [expected]
    else:
        assert pick(scale) == expected
    assert choose_implementation(None, q, k, v, m, 0.125, False, platform="cpu") == "blockwise"
    assert choose_implementation(None, q, k, v, m, 0.125, False, platform="tpu") == "blockwise"


ON_GPU = jax.default_backend() == "gpu"
BAD = [
    (dict(implementation="flash"), r"implementation must be None or one of \['xla', 'cudnn', 'pallas', 'blockwise'\]"),
    (dict(implementation="cudnn"), r"implementation='cudnn' cannot run this call: " + (
        "cuDNN flash attention takes bfloat16 or float16 inputs, received float32" if ON_GPU
        else "cuDNN attention needs an NVIDIA GPU")),
    pytest.param(dict(implementation="pallas"),
                 r"implementation='pallas' cannot run this call: the Pallas kernel .* needs an NVIDIA GPU",
                 marks=pytest.mark.skipif(ON_GPU, reason="on an NVIDIA GPU the Pallas kernel runs this call")),
]


@pytest.mark.parametrize("override,message", BAD)
def test_an_implementation_that_cannot_run_says_why(override, message):
    q, k, v = _qkv(5, 4, 6, 2, 2, 8, 8)
    with pytest.raises(ValueError, match=message):
        jaxattn.multi_head_blockwise_attention(q, k, v, **override)
    with pytest.raises(ValueError, match=message):
        jaxattn.blockwise_attention(q[:, 0], k[:, 0], v[:, 0], **override)


@pytest.mark.parametrize("kwargs,message", [
    (dict(mask=np.ones(6, bool)), r"the Pallas kernel takes no mask \(is_causal only\)"),
    (dict(scale="traced"), r"the Pallas kernel takes the scale as a Python number, received a traced scale"),
])
def test_pallas_refuses_what_its_kernel_cannot_do(kwargs, message):
    q, k, v = _qkv(6, 4, 6, 2, 2, 8, 8)

    def call(scale):
        args = dict(mask=None, is_causal=False, scale=scale, block_q=4, block_k=4, implementation="pallas", interpret=True)
        args.update({n: x for n, x in kwargs.items() if n != "scale"})
        return _multi_head_blockwise(q, k, v, **args)[0]

    with pytest.raises(ValueError, match=r"implementation='pallas' cannot run this call: " + message):
        if kwargs.get("scale") == "traced":
            jax.jit(call)(0.5)
        else:
            call(None)


@jax.default_matmul_precision("highest")  # float32 products in float32 on a GPU too (its default may be TF32)
def test_attention_layer_without_weights_runs_each_implementation():
    params = jaxattn.init_attention_params(0, 16, 4, num_kv_heads=2)
    h = np.random.default_rng(7).standard_normal((9, 16)).astype(np.float32)

    @jax.jit
    def layers(params, h):
        layer = lambda **kw: jaxattn.attention_layer(params, h, num_heads=4, num_kv_heads=2, is_causal=True, **kw)
        return layer(), layer(return_weights=False, implementation="xla")

    (out, weights), (out2, lse) = layers(params, h)
    assert lse.shape == (4, 9) and weights.shape == (4, 9, 9)
    np.testing.assert_allclose(out2, out, **TOL)
    with pytest.raises(ValueError, match=r"implementation='xla' needs return_weights=False"):
        jaxattn.attention_layer(params, h, num_heads=4, num_kv_heads=2, implementation="xla")
    bias = np.random.default_rng(3).normal(size=(4, 9, 9)).astype(np.float32)  # per head
    with_map, _ = jaxattn.attention_layer(params, h, num_heads=4, num_kv_heads=2, bias=bias)
    without, _ = jaxattn.attention_layer(params, h, num_heads=4, num_kv_heads=2, bias=bias, return_weights=False)
    np.testing.assert_allclose(without, with_map, **TOL)  # the blockwise kernel adds the bias in its tiles
    with pytest.raises(ValueError, match=r"implementation='xla' cannot run this call: a bias runs in the 'blockwise'"):
        jaxattn.attention_layer(params, h, num_heads=4, num_kv_heads=2, bias=bias, return_weights=False,
                                implementation="xla")
    with pytest.raises(ValueError, match=r"implementation must be None or one of"):
        jaxattn.attention_layer(params, h, num_heads=4, num_kv_heads=2, return_weights=False, implementation="XLA")


# ---------------------------------------------------------------------------------------------- conformance
# The harness (jaxattn.check_conformance): its float64 oracle against the tests' independent one, a slice of
# the grid in `make test`, the whole grid (every implementation this machine runs) in `make test-slow`.


def test_oracle_agrees_with_the_independent_reference_per_head():
    rng = np.random.default_rng(0)
    T, S, N, K, H, V = 5, 7, 4, 2, 3, 2
    q, k, v = rng.standard_normal((T, N, H)), rng.standard_normal((S, K, H)), rng.standard_normal((S, K, V))
    mask = rng.random((N, T, S)) < 0.7
    mask[2, 1] = False
    w_out, w_lse = rng.standard_normal((T, N, V)), np.zeros((N, T))
    out, lse, dq, dk, dv = oracle(q, k, v, mask, True, 0.4, w_out, w_lse)
    causal = np.arange(S)[None, :] <= np.arange(T)[:, None]
    dk_ref, dv_ref = np.zeros_like(k), np.zeros_like(v)
    for n in range(N):
        keep = mask[n] & causal
        ref_out, p = reference_forward(q[:, n], k[:, n // 2], v[:, n // 2], mask=keep, scale=0.4)
        gq, gk, gv = reference_vjp(q[:, n], k[:, n // 2], v[:, n // 2], w_out[:, n], mask=keep, scale=0.4)
        np.testing.assert_allclose(out[:, n], ref_out, atol=1e-12)
        np.testing.assert_allclose(dq[:, n], gq, atol=1e-12)
        dk_ref[:, n // 2] += gk
        dv_ref[:, n // 2] += gv
        logits = 0.4 * q[:, n] @ k[:, n // 2].T
        with np.errstate(divide="ignore"):
            np.testing.assert_allclose(lse[n], np.log(np.where(keep, np.exp(logits), 0).sum(axis=1)), atol=1e-12)
    np.testing.assert_allclose(dk, dk_ref, atol=1e-12)
    np.testing.assert_allclose(dv, dv_ref, atol=1e-12)
    assert np.isneginf(lse[2, 1]) and not out[1, 2].any()


def test_a_slice_of_the_grid_passes_and_renders_one_table():
    """xla with a general mask holding an empty row (jaxattn's 0 and -inf there), odd lengths, GQA, V != H."""
    cases = [Case(13, 29, 4, 2, 16, 8, "general", "float32")]
    records = _check(cases, ["xla", "cudnn"])
    by_name = {r["implementation"]: r for r in records}
    assert by_name["xla"]["status"] == "pass", by_name["xla"]
    assert by_name["cudnn"]["status"] == "unsupported"
    assert ("takes bfloat16 or float16" if ON_GPU else "needs an NVIDIA GPU") in by_name["cudnn"]["reason"]
    text = conformance_table(records)
    assert "| case | xla | cudnn |\n" in text and "\n| float32 · general · GQA 4/2 · T=13 S=29 | ✓ " in text
    assert "Totals: 1 pass, 0 fail, 1 unsupported." in text and "- `cudnn`: cuDNN " in text


def test_a_wrong_result_fails_the_check(monkeypatch):
    """The harness can fail: an implementation whose dq is off by 0.1% is reported as failing."""

    def off(implementation, case, q, k, v, mask, is_causal, w_out, w_lse, *rest):
        out, lse, dq, dk, dv = oracle(q, k, v, mask, is_causal, 1 / np.sqrt(case.H), w_out, w_lse)
        return out, lse, dq * 1.001, dk, dv

    monkeypatch.setattr(_conformance, "_run_one", off)
    (record,) = _check([Case(8, 8, 2, 2, 4, 4, "none", "float32")], ["blockwise"])
    assert record["status"] == "fail" and record["errors"]["dq"] > 1e-4 and "✗" in conformance_table([record])
    assert max(e for name, e in record["errors"].items() if name != "dq") == 0.0


def test_what_jaxs_cudnn_wrapper_refuses_as_it_traces_is_reported_unsupported(monkeypatch):
    """cuDNN's checks run as jax traces the call (its backward takes a mask only with even lengths): such a
    case is unsupported, with jax's reason; the same exception from any other implementation propagates."""

    def refuse(implementation, *rest):
        raise NotImplementedError("Unsupported sequence length Q 13, KV 29.")

    monkeypatch.setattr(_conformance, "_run_one", refuse)
    monkeypatch.setattr(_conformance, "unsupported", lambda *args, **kwargs: None)  # as on a GPU
    case = Case(13, 29, 2, 2, 8, 8, "general", "bfloat16")
    (record,) = _check([case], ["cudnn"])
    assert record["status"] == "unsupported"
    assert record["reason"] == "jax's cuDNN wrapper: Unsupported sequence length Q 13, KV 29."
    with pytest.raises(NotImplementedError, match="Unsupported sequence length"):
        _check([case], ["xla"])


@pytest.mark.slow  # the whole grid: 96 cases through every implementation, about 10 minutes on 2 CPU cores
def test_the_whole_grid_conforms():
    records = check_conformance()
    failed = [(r["label"], r["implementation"], r["errors"]) for r in records if r["status"] == "fail"]
    assert not failed, failed
    ran = {r["implementation"] for r in records if r["status"] == "pass"}
    assert {"xla", "blockwise", "pallas"} <= ran
    assert len({r["label"] for r in records}) == 96
