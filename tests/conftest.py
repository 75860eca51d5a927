"""Test-session settings: strict rank promotion, four CPU devices (for collectives and
`shard_map` over a real mesh), and the rule output check always on.

Leaked-tracer checking (`jax.check_tracer_leaks`) makes every trace several times
slower, so it runs in dedicated tests (tests/core/test_tracer_leaks.py) rather
than around every test.
"""

import jax
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.core.config import default_config

# Before any computation initialises the CPU backend (importing the package does not).
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _strict_autoscale():
    """Every test runs with the rule output check on."""
    with default_config(jsa.AutoScaleConfig(check=True)):
        yield
