"""The public face of `jsa.optax`: its names and its lazy import (its examples run in
tests/docs/test_doctests.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


def _wrappers():
    import optax

    return {
        "scale_optimizer": lambda tx: jsa.optax.scale_optimizer(tx),
        "scaled_state": lambda tx: jsa.optax.scaled_state(tx),
        "quantize": lambda tx: jsa.optax.quantize(tx, state="bfloat16"),
        "kahan_summation": lambda tx: jsa.optax.kahan_summation(tx),
        "multi_steps": lambda tx: jsa.optax.multi_steps(tx, 2),
        "bf16_stochastic.optimizer": lambda tx: jsa.optax.bf16_stochastic(tx).optimizer,
        "plain": lambda tx: tx,
    }, optax


@pytest.mark.parametrize("name", sorted(_wrappers()[0]))
def test_transforms_are_optax_gradient_transformations_that_chain(name):
    """What the docs promise of `jsa.optax`: each wrapper returns an
    `optax.GradientTransformation` (init/update), usable inside `optax.chain` and under
    `jax.jit` like any optax optimizer."""
    import jax
    import jax.numpy as jnp

    wrappers, optax = _wrappers()
    tx = wrappers[name](optax.adam(1e-2))
    assert isinstance(tx, optax.GradientTransformation)
    chained = optax.chain(optax.clip_by_global_norm(1.0), tx)
    params = {"w": jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)}
    state = chained.init(params)
    grads = {"w": jnp.full(8, 0.5, jnp.float32)}
    update = jax.jit(chained.update)
    moved = params
    for _ in range(2):  # multi_steps(k=2) applies the accumulated update on the second
        updates, state = update(grads, state, moved)
        leaves = jax.tree_util.tree_structure(updates, is_leaf=jsa.is_scaled_leaf)
        assert leaves == jax.tree_util.tree_structure(params)  # a ScaledArray is one leaf
        moved = optax.apply_updates(moved, jsa.asarray(updates, jnp.float32))
    assert bool(jnp.all(jnp.isfinite(moved["w"]))) and not bool(jnp.all(moved["w"] == params["w"]))
