"""The public face of `jsa.optax`: its names and its lazy import (its examples run in
tests/docs/test_doctests.py)."""

from __future__ import annotations

import subprocess
import sys

import jax_scaled_arithmetics as jsa


def test_public_names():
    import jax_scaled_arithmetics.optax as jsa_optax

    assert set(jsa_optax.__all__) == {
        "KahanState",
        "QuantizeSpec",
        "QuantizeState",
        "Recipe",
        "accumulate_gradients",
        "apply_updates",
        "bf16_kahan",
        "bf16_stochastic",
        "default_data_exponent",
        "ibm8_like",
        "kahan_summation",
        "multi_steps",
        "quantize",
        "scale_optimizer",
        "scaled_state",
        "split_microbatches",
        "state_nbytes",
    }
    assert all(hasattr(jsa_optax, name) for name in jsa_optax.__all__)
    assert jsa.optax is jsa_optax


def test_lazy_import():
    """`import jax_scaled_arithmetics` does not import optax; `jsa.optax` does, on first use."""
    code = (
        "import sys, jax_scaled_arithmetics as jsa; "
        "assert 'optax' not in sys.modules and 'jax_scaled_arithmetics.optax' not in sys.modules; "
        "jsa.optax.quantize; assert 'jax_scaled_arithmetics.optax.recipes' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
