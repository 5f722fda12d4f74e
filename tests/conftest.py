"""Strict test configuration: rank promotion raises, float64 only where a test asks for it."""

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


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
