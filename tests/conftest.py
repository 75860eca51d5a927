"""Test-session settings: strict JAX promotion, rule output checks on, no leaked tracers."""

import jax
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.core.config import default_config

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _strict_autoscale():
    """Every test runs with the rule output check on and leaked-tracer checks."""
    with default_config(jsa.AutoScaleConfig(check=True)), jax.check_tracer_leaks():
        yield
