"""The interpreter and the higher-order rules leak no tracer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from tests.helpers import make_scaled, tracer_leak_checks


def model(params, x):
    w, b = params
    h = jax.nn.relu(x @ w + b[None, :])
    h = jax.jit(lambda a: jnp.tanh(a) * 0.5)(h)
    return jnp.mean(jax.nn.softplus(h) ** 2)


@pytest.mark.parametrize(
    "use_jit", [pytest.param(False, marks=pytest.mark.slow), True], ids=["eager", "jit"]
)
def test_no_tracer_leak_forward_and_grads(use_jit):
    """Under jit, the programs are traced (`jax.eval_shape`), where a leak would happen, and
    not compiled: leak checking turns JAX's caches off, so each compile inside it is a
    compile of every jitted helper anew. Eagerly (the slow step), every operation runs."""
    rng = np.random.default_rng(0)
    params = (
        make_scaled(rng.normal(size=(4, 3)), np.float16, 0.5),
        make_scaled(rng.normal(size=(3,)), np.float16, 0.25),
    )
    x = make_scaled(rng.normal(size=(2, 4)), np.float16, 2.0**-10)

    def data_loss(w_data):
        p = (jsa.ScaledArray(w_data, params[0].scale), params[1])
        return jsa.autoscale(model)(p, x).to_array(jnp.float32)

    def run(fn, *args):
        return jax.eval_shape(fn, *args) if use_jit else fn(*args)

    with tracer_leak_checks():
        out = run(jsa.autoscale(model), params, x)
        grads = run(jsa.autoscale(jax.grad(model)), params, x)
        data_grad = run(jax.grad(data_loss), params[0].data)
    assert isinstance(out, jsa.ScaledArray) and out.shape == ()
    assert all(isinstance(g, jsa.ScaledArray) for g in grads)
    assert [g.shape for g in grads] == [(4, 3), (3,)]
    assert data_grad.shape == (4, 3)


_KEPT: list = []  # made before the check starts, so frozen by `tracer_leak_checks`


def test_the_checks_find_a_tracer_kept_by_an_older_object():
    """The helper freezes the session's objects out of the collector's view; a tracer kept
    in one of them (a module-level list here) is still reported."""

    def leaky(a):
        _KEPT.append(a)
        return a * 2

    x = make_scaled(np.ones(3), np.float16, 0.5)
    try:
        with pytest.raises(Exception, match="[Ll]eaked"), tracer_leak_checks():
            jax.eval_shape(jsa.autoscale(leaky), x)
    finally:
        _KEPT.clear()
