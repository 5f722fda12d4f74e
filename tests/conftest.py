"""Strict test configuration: rank promotion raises, float64 only where a test asks for it; XLA's backend
optimisations off.

The tests run hundreds of tiny programs, so compiling them costs far more than running them: with
``jax_disable_most_optimizations`` XLA skips its expensive LLVM passes (backend optimisation level 0),
which cuts the suite's compile time by about a quarter. XLA's HLO passes (fusion, algebraic rewrites)
still run, so the programs tested are the ones users run; only their machine code is less optimised,
which can move a float result in its last bits where an order of summation changes (the suite passes
either way: ``JAX_DISABLE_MOST_OPTIMIZATIONS=0 make test``). Subprocesses the tests start inherit the
setting through the environment.
"""

import os

os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_disable_most_optimizations", os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] not in ("0", ""))


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
