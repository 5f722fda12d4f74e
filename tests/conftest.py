"""Strict test configuration: rank promotion raises, float64 only where a test asks for it; and one of two
XLA configurations, named by ``JAXATTN_TEST_XLA``.

- ``fast`` (the default; ``make test``): XLA's backend optimisations off and its older CPU emitters on.
  The tests run hundreds of tiny programs, so compiling them costs far more than running them: with
  ``jax_disable_most_optimizations`` XLA skips its expensive LLVM passes (backend optimisation level 0),
  which cuts the suite's compile time by about a quarter, and ``--xla_cpu_use_fusion_emitters=false``
  (added to ``XLA_FLAGS`` unless it names the flag, on jaxlib before 0.11, which removed it) compiles
  the same fused HLO with the older emitters, faster (a Qwen3 test that compiles 54 programs: 9.1-10.0 s
  against 13.2-16.9 s). XLA's HLO passes (fusion, algebraic rewrites) still run, but the machine code
  is NOT what users run: it can move a float result in its last bits, and the two code generators
  differ in how ``max``, ``exp`` and clamps treat NaN (a softmax that left NaN to travel through its row
  maximum lost a NaN row under the defaults and kept it here). So this configuration alone proves
  nothing about the defaults' numerics.
- ``defaults`` (``make test-defaults``, a step of its own in CI): XLA exactly as users run it: no flag
  added, ``JAX_DISABLE_MOST_OPTIMIZATIONS=0``, the MLIR fusion emitters on. The whole suite runs so;
  tests/test_compiler_defaults.py also checks the NaN rows in a fresh process under the defaults
  whichever configuration runs it.

Subprocesses the tests start inherit the configuration through the environment.

On a GPU, float32 products run in float32 (``jax_default_matmul_precision="highest"``): a GPU's default
may round them to TF32 (about 3 decimal digits), and the tests compare float32 results with a float64
oracle at 1e-5.

The two test processes (``pytest -n 2``) share one compilation cache for the run, in a fresh temporary
folder removed at the end: a program that tests in both compile (the same sweep, the same tiny model) is
compiled once. Nothing is kept between runs, so every run compiles what it tests.
"""

import os
import shutil
import tempfile


def _older_emitters_exist() -> bool:
    """Whether this jaxlib's XLA still has ``--xla_cpu_use_fusion_emitters`` (it went in jaxlib 0.11)."""
    from importlib.metadata import version

    major, minor = (int(part) for part in version("jaxlib").split(".")[:2])
    return (major, minor) < (0, 11)


_XLA = os.environ.setdefault("JAXATTN_TEST_XLA", "fast")
if _XLA not in ("fast", "defaults"):
    raise ValueError(f"JAXATTN_TEST_XLA must be 'fast' or 'defaults', received {_XLA!r}")
if _XLA == "defaults":
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0"
    if "xla_cpu_use_fusion_emitters" in os.environ.get("XLA_FLAGS", ""):
        raise ValueError(f"JAXATTN_TEST_XLA=defaults, but XLA_FLAGS sets the CPU emitters: {os.environ['XLA_FLAGS']!r}")
else:
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    # jaxlib 0.11 removed the flag, and XLA aborts the process on a flag it does not know.
    if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "") and _older_emitters_exist():
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false").strip()
if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller (or a run without xdist): the workers inherit it
    os.environ["JAXATTN_TEST_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="jaxattn-tests-cache-")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
if jax.default_backend() == "gpu":
    jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_disable_most_optimizations", os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] not in ("0", ""))
if os.environ.get("JAXATTN_TEST_COMPILATION_CACHE"):
    jax.config.update("jax_compilation_cache_dir", os.environ["JAXATTN_TEST_COMPILATION_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)  # only programs worth sharing
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if "PYTEST_XDIST_WORKER" not in os.environ and os.environ.get("JAXATTN_TEST_COMPILATION_CACHE"):
        shutil.rmtree(os.environ["JAXATTN_TEST_COMPILATION_CACHE"], ignore_errors=True)


@pytest.fixture
def x64():
    """Run the test with float64 enabled (and only that test)."""
    with jax.enable_x64(True):
        yield


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """The Hugging Face hub switched off, with an empty cache (returned): nothing may touch the network."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache
