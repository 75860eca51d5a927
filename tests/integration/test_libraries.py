"""Flax (linen and NNX), Equinox and Optax programs, unchanged under autoscale.

Parameters are pytrees of ScaledArrays; the modules and optimizers are the
libraries' own code, run by `autoscale` on the represented values.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_scaled_arithmetics as jsa
from tests.integration.checks import (
    assert_all_scaled,
    assert_tree_close,
    check_forward_backward,
    scale_tree,
)

RNG = np.random.default_rng(1)


class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = nn.Conv(4, (3, 3), padding="VALID")(x)
        x = nn.max_pool(x, (2, 2), strides=(1, 1))
        x = nn.LayerNorm()(x.reshape(x.shape[0], -1))
        return nn.Dense(3)(x)


class TinyTransformer(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(11, 8)(tokens)
        h = h + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(h)
        h = nn.LayerNorm()(h)
        h = nn.Dense(16)(h)
        return nn.Dense(11)(nn.gelu(h))


def _linen_case(module, inputs):
    variables = jax.jit(module.init)(jax.random.PRNGKey(0), inputs)  # eager: a compile per op
    return (lambda p: module.apply(p, inputs)), variables


@pytest.mark.slow
def test_flax_linen_conv_pool_layernorm_dense():
    x = RNG.normal(size=(2, 8, 8, 3)).astype(np.float32)
    fn, params = _linen_case(ConvNet(), x)
    check_forward_backward(fn, params, rtol=1e-4)


@pytest.mark.slow  # the zoo's linen LM (tests/integration/test_zoo.py) covers it by default
def test_flax_linen_embed_attention():
    tokens = jnp.asarray(RNG.integers(0, 11, (2, 5)))
    fn, params = _linen_case(TinyTransformer(), tokens)
    # The key bias does not change the softmax: its gradient is rounding noise around 0.
    check_forward_backward(fn, params, rtol=1e-4, atol=1e-6)


class NNXStack(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(6, 6, rngs=rngs) for _ in range(3)])
        self.out = nnx.Linear(6, 2, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.tanh(layer(x))
        return self.out(x)


def test_flax_nnx_linear_stack():  # the default run's library model (the others: slow)
    model = NNXStack(nnx.Rngs(0))
    graphdef, state = nnx.split(model)  # `state` is a pytree: its arrays become ScaledArrays
    x = RNG.normal(size=(4, 6)).astype(np.float32)
    check_forward_backward(lambda st: nnx.merge(graphdef, st)(x), state, rtol=1e-4)


@pytest.mark.slow
def test_equinox_mlp():
    mlp = eqx.nn.MLP(5, 3, width_size=8, depth=2, activation=jax.nn.gelu, key=jax.random.PRNGKey(2))
    params, static = eqx.partition(mlp, eqx.is_inexact_array)
    x = RNG.normal(size=(5,)).astype(np.float32)
    check_forward_backward(lambda p: eqx.combine(p, static)(x), params, rtol=1e-4)


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
}


@pytest.mark.parametrize(
    "name",
    # clip_adam (Adam in a chain) by default; SGD, Adam alone and AdamW (Adam and decayed
    # weights: tests/optax/test_plain_optax.py's clip-decay-adam-schedule) in the slow step.
    [
        n if n == "clip_adam" else pytest.param(n, marks=pytest.mark.slow)
        for n in sorted(OPTIMIZERS)
    ],
)
@pytest.mark.slow
def test_optax_training_step(name):
    """One step (loss, grads, update) in one autoscaled function; params and grads scaled."""
    model = nn.Dense(3)
    x = RNG.normal(size=(8, 4)).astype(np.float32)
    y = RNG.normal(size=(8, 3)).astype(np.float32)
    params = model.init(jax.random.PRNGKey(3), x)
    optimizer = OPTIMIZERS[name]()

    def step(params, opt_state):
        def loss_fn(p):
            return jnp.mean((model.apply(p, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    # Two steps: the second one starts from a non-trivial optimizer state.
    plain = (params, optimizer.init(params))
    scaled = (scale_tree(params), jsa.autoscale(optimizer.init)(scale_tree(params)))
    scaled_step, plain_step = jax.jit(jsa.autoscale(step)), jax.jit(step)
    for _ in range(2):
        expected = plain_step(*plain)
        out = scaled_step(*scaled)
        assert_all_scaled((out[0], out[2], out[3]), "step")
        assert_tree_close(out, expected, rtol=1e-4, what="step")
        plain, scaled = expected[:2], out[:2]


class ScannedBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(16)(nn.LayerNorm()(x))
        return x + nn.Dense(8)(nn.gelu(h)), None


class ScannedStack(nn.Module):
    remat: bool

    @nn.compact
    def __call__(self, x):
        block = nn.remat(ScannedBlock) if self.remat else ScannedBlock
        stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return nn.Dense(1)(stack()(x, None)[0])


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan-remat"])
@pytest.mark.slow
def test_flax_linen_scan_and_remat_under_delayed_scaling(remat):
    """`nn.scan` over `nn.remat` blocks, as deep linen models are written: under
    `jsa.delayed_scaling` each layer's sums and contractions (forward, and the backward
    pass in the checkpoint) hold a scale of their own, and the gradients are float32's."""
    model = ScannedStack(remat=remat)
    x = jnp.asarray(RNG.normal(size=(4, 8)), jnp.float32)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), x)
    step = jax.value_and_grad(lambda p, x: jnp.mean(model.apply(p, x) ** 2))
    scaled = jsa.as_scaled_array(params, dtype=jnp.float16)
    delayed = jsa.delayed_scaling(step)
    _, history = jax.jit(delayed.init)(scaled, x)
    assert sum(s.startswith("scan 1 (3 iterations), iteration 2: ") for s in history.sites) >= 4
    if remat:
        assert any(": checkpoint 0: " in s for s in history.sites)
    (loss, grads), _ = jax.jit(delayed)(history, scaled, x)
    want_loss, want = jax.jit(step)(jsa.asarray(scaled, jnp.float32), x)
    np.testing.assert_allclose(float(loss.to_array(jnp.float32)), float(want_loss), rtol=2e-3)
    assert_tree_close(grads, want, rtol=2e-2)
