"""Strict test configuration: rank promotion raises, float64 only where a test asks for it; XLA's backend
optimisations off.

The tests run hundreds of tiny programs, so compiling them costs far more than running them: with
``jax_disable_most_optimizations`` XLA skips its expensive LLVM passes (backend optimisation level 0),
which cuts the suite's compile time by about a quarter. XLA's HLO passes (fusion, algebraic rewrites)
still run, so the programs tested are the ones users run; only their machine code is less optimised,
which can move a float result in its last bits where an order of summation changes (the suite passes
either way: ``JAX_DISABLE_MOST_OPTIMIZATIONS=0 make test``). Subprocesses the tests start inherit the
setting through the environment.

XLA's CPU fusion emitters (the MLIR ones, the default) are switched off for the tests too
(``--xla_cpu_use_fusion_emitters=false`` added to ``XLA_FLAGS`` unless it names the flag): the older
emitters compile the same fused HLO into machine code faster (a Qwen3 test that compiles 54 programs:
9.1-10.0 s against 13.2-16.9 s), and make test is mostly compiling.

The two test processes (``pytest -n 2``) share one compilation cache for the run, in a fresh temporary
folder removed at the end: a program that tests in both compile (the same sweep, the same tiny model) is
compiled once. Nothing is kept between runs, so every run compiles what it tests.
"""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false").strip()
if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller (or a run without xdist): the workers inherit it
    os.environ["JAXATTN_TEST_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="jaxattn-tests-cache-")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
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
