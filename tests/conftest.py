"""Strict test configuration: rank promotion raises, float64 only where a test asks for it."""

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def x64():
    """Run the test with float64 enabled (and only that test)."""
    with jax.enable_x64(True):
        yield
