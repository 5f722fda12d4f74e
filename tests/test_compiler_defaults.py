"""A kept NaN makes its row NaN under every XLA configuration, the users' default one included.

XLA's default CPU code generator (the MLIR fusion emitters) does not carry NaN through every ``max``,
``exp`` or clamp the way the older emitters do, so a softmax that leaves NaN to travel through its row
maximum can lose it: a NaN query row once came out as finite numbers that were not even a distribution.
The core now flags such rows and writes NaN in with a ``where``. These tests check it in the process's
own configuration (``make test`` runs the fast one, ``make test-defaults`` XLA's defaults; see
tests/conftest.py) and, whatever that is, in a fresh process under XLA's defaults.
"""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import jaxattn
from jaxattn import probes

_CASE = textwrap.dedent(
    """
    import numpy as np, jaxattn
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(n, 3)).astype("float32") for n in (5, 7, 7))
    q[3, 0] = np.nan
    """
)


def _nan_query_case():
    scope = {}
    exec(_CASE, scope)
    return scope["q"], scope["k"], scope["v"]


def _assert_only_row_3_is_nan(x, name):
    x = np.asarray(x)
    assert np.all(np.isnan(x[3])), f"{name}: row 3 keeps a NaN query and must be NaN, got {x[3]}"
    assert np.all(np.isfinite(np.delete(x, 3, axis=0))), f"{name}: the other rows must stay finite"


def test_a_nan_query_row_is_nan_in_weights_output_and_row_statistics():
    q, k, v = _nan_query_case()
    weights = jaxattn.attention_weights(q, k)
    _assert_only_row_3_is_nan(weights, "attention_weights")
    out, w = jaxattn.attention(q, k, v)
    _assert_only_row_3_is_nan(out, "attention's output")
    _assert_only_row_3_is_nan(w, "attention's weights")
    finite = np.delete(np.asarray(w), 3, axis=0)
    np.testing.assert_allclose(finite.sum(axis=1), 1.0, rtol=1e-6)  # the others stay distributions
    out3, w3 = jaxattn.multi_head_attention(q[:, None], k[:, None], v[:, None])
    _assert_only_row_3_is_nan(out3[:, 0], "multi_head_attention's output")
    _assert_only_row_3_is_nan(w3[0], "multi_head_attention's weights")
    out_b, lse_b = jaxattn.blockwise_attention(q, k, v, block_q=2, block_k=3)
    _assert_only_row_3_is_nan(out_b, "blockwise_attention's output")
    _assert_only_row_3_is_nan(lse_b, "blockwise_attention's lse")
    out_w, lse_w = jaxattn.blockwise_attention(q, k, v, block_q=2, local_window_size=(1, 1))  # a window as bands
    _assert_only_row_3_is_nan(out_w, "blockwise_attention's output with a window")
    _assert_only_row_3_is_nan(lse_w, "blockwise_attention's lse with a window")
    stats = probes.row_stats(weights)
    for name in ("entropy", "max_weight"):
        _assert_only_row_3_is_nan(stats[name], f"row_stats' {name}")


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_kept_nan_or_plus_inf_logit_from_a_bias_makes_only_its_row_nan(value):
    rng = np.random.default_rng(1)
    q, k = rng.normal(size=(5, 4)).astype("float32"), rng.normal(size=(6, 4)).astype("float32")
    bias = np.zeros((5, 6), np.float32)
    bias[3, 2] = value
    _assert_only_row_3_is_nan(jaxattn.attention_weights(q, k, bias=bias), "attention_weights with a bias")
    mask = np.ones((5, 6), bool)
    mask[3, 2] = False  # masked: the bad bias must not matter
    w = np.asarray(jaxattn.attention_weights(q, k, bias=bias, mask=mask))
    assert np.all(np.isfinite(w)) and np.allclose(w.sum(axis=1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("S", [256, 1100])
@pytest.mark.parametrize("value", ["q", np.nan, np.inf])
def test_a_bad_entry_makes_only_its_row_nan_in_rows_long_enough_for_vectorised_reductions(S, value):
    """Rows of hundreds of keys, where XLA's CPU maximum drops a NaN: the row is flagged all the same, in
    every head and column position, and the other rows and heads stay finite."""
    rng = np.random.default_rng(2)
    T, r, c = 6, 4, (3 * S) // 5
    q, k, v = (rng.normal(size=(n, 2, 8)).astype("float32") for n in (T, S, S))
    bias = np.zeros((2, T, S), np.float32)
    if value == "q":
        q[r, 1, 5] = np.nan
    else:
        bias[1, r, c] = value
    out, w = (np.asarray(x) for x in jaxattn.multi_head_attention(q, k, v, bias=bias))
    assert np.all(np.isnan(w[1, r])) and np.all(np.isnan(out[r, 1])), "the bad row vanished"
    assert np.all(np.isfinite(np.delete(w[1], r, axis=0))) and np.all(np.isfinite(w[0]))
    assert np.all(np.isfinite(np.delete(out[:, 1], r, axis=0))) and np.all(np.isfinite(out[:, 0]))


def test_a_nan_query_row_is_nan_under_xla_default_compiler_flags():
    """The reported snippet in a fresh process with XLA's default CPU configuration (no test flags)."""
    env = dict(os.environ)
    env.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_cpu_use_fusion_emitters" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    env.pop("JAXATTN_TEST_COMPILATION_CACHE", None)
    script = _CASE + textwrap.dedent(
        """
        import jax
        assert not jax.config.read("jax_disable_most_optimizations")
        w = np.asarray(jaxattn.attention_weights(q, k))
        out = np.asarray(jaxattn.attention(q, k, v)[0])
        print("weights", w[3].tolist())
        print("output", out[3].tolist())
        assert np.all(np.isnan(w[3])) and np.all(np.isnan(out[3])), "the NaN query row vanished"
        assert np.all(np.isfinite(np.delete(w, 3, axis=0))) and np.all(np.isfinite(np.delete(out, 3, axis=0)))
        band = np.asarray(jaxattn.blockwise_attention(q, k, v, block_q=2, local_window_size=(1, 1))[0])  # bands
        print("blockwise with a window", band[3].tolist())
        assert np.all(np.isnan(band[3])), "the NaN query row vanished from the windowed blockwise kernel"
        assert np.all(np.isfinite(np.delete(band, 3, axis=0)))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_suite_runs_the_compiler_configuration_its_conftest_names():
    """``JAXATTN_TEST_XLA=defaults`` (``make test-defaults``) leaves XLA as users run it; otherwise the fast one."""
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("JAXATTN_TEST_XLA") == "defaults":
        assert "xla_cpu_use_fusion_emitters" not in flags
        assert not jax.config.read("jax_disable_most_optimizations")
    else:  # the older emitters where this jaxlib still has them (0.11 removed the flag)
        from importlib.metadata import version

        older = tuple(int(part) for part in version("jaxlib").split(".")[:2]) < (0, 11)
        assert ("xla_cpu_use_fusion_emitters" in flags) == older
        assert jax.config.read("jax_disable_most_optimizations") == (os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] not in ("0", ""))
