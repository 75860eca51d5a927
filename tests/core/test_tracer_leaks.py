"""The interpreter and the higher-order rules leak no tracer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from tests.helpers import make_scaled


def model(params, x):
    w, b = params
    h = jax.nn.relu(x @ w + b[None, :])
    h = jax.jit(lambda a: jnp.tanh(a) * 0.5)(h)
    return jnp.mean(jax.nn.softplus(h) ** 2)


@pytest.mark.parametrize(
    "use_jit", [pytest.param(False, marks=pytest.mark.slow), True], ids=["eager", "jit"]
)
def test_no_tracer_leak_forward_and_grads(use_jit):
    rng = np.random.default_rng(0)
    params = (
        make_scaled(rng.normal(size=(4, 3)), np.float16, 0.5),
        make_scaled(rng.normal(size=(3,)), np.float16, 0.25),
    )
    x = make_scaled(rng.normal(size=(2, 4)), np.float16, 2.0**-10)
    with jax.check_tracer_leaks():
        fwd = jsa.autoscale(model)
        grad_fn = jsa.autoscale(jax.grad(model))
        if use_jit:
            fwd, grad_fn = jax.jit(fwd), jax.jit(grad_fn)
        assert isinstance(fwd(params, x), jsa.ScaledArray)
        grads = grad_fn(params, x)
        assert all(isinstance(g, jsa.ScaledArray) for g in grads)

        def data_loss(w_data):
            p = (jsa.ScaledArray(w_data, params[0].scale), params[1])
            return jsa.autoscale(model)(p, x).to_array(jnp.float32)

        data_grad = jax.grad(data_loss)
        # Jitted with the rest (leak checking turns JAX's caches off: eagerly, every
        # operation is traced and compiled anew); eagerly in the slow step's eager variant.
        data_grad = jax.jit(data_grad) if use_jit else data_grad
        assert data_grad(params[0].data).shape == (4, 3)
