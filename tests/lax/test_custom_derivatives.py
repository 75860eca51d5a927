"""`custom_jvp` and `custom_vjp` under autoscale (lax/custom_derivatives.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.lax import custom_derivatives
from tests.helpers import (
    FLOAT_DTYPES,
    RTOL,
    assert_close,
    make_scaled,
)
from tests.lax.test_control_flow import (
    V,
    _ids,
    _sin_fake_jvp,
    _square_fake_vjp,
    check_grad_over_scales,
    check_matches_over_scales,
)

# --- custom derivatives ---------------------------------------------------------------------


def _custom_cases():
    x = np.array([0.5, -1.0, 2.0], np.float32)
    y = np.array([1.5, 0.25, -0.5], np.float32)
    return [
        ("jvp", lambda a, b: jnp.sum(_sin_fake_jvp(a) * b), x, y),
        ("vjp", lambda a, b: jnp.sum(_square_fake_vjp(a, b)), x, y),
    ]


@pytest.mark.parametrize("scale", (2.0**-30, 2.0**30), ids=_ids)
@pytest.mark.parametrize("case", _custom_cases(), ids=lambda c: c[0])
def test_custom_derivative_rules_kept(case, scale):
    _, loss, x, y = case
    expected = jax.grad(loss, argnums=(0, 1))(x, y)
    true_rule = (jnp.cos(x) * y, jnp.sin(x)) if case[0] == "jvp" else (y, x)
    assert not np.allclose(expected[0], true_rule[0])  # the custom rule differs

    sx = jsa.as_scaled_array(x, scale=np.float32(scale))
    sy = jsa.as_scaled_array(y, scale=np.float32(1 / scale))

    # grad(autoscale(f)), with respect to the represented values
    def scaled_loss(a, b):
        out = jsa.autoscale(loss)(jsa.as_scaled_array(a, scale=np.float32(scale)), b)
        return out.to_array(jnp.float32)

    g = jax.jit(jax.grad(scaled_loss, argnums=(0, 1)))(jnp.asarray(x), jnp.asarray(y))
    for got, ref in zip(g, expected, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5)
    # autoscale(grad(f)), on scaled inputs
    ga, gb = jax.jit(jsa.autoscale(jax.grad(loss, argnums=(0, 1))))(sx, sy)
    assert isinstance(ga, jsa.ScaledArray)
    assert_close(ga, expected[0], 1e-5)
    assert_close(gb, expected[1], 1e-5)


ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "softplus": jax.nn.softplus,
    "silu": jax.nn.silu,
}


ACTIVATION_X = np.linspace(-3, 3, 12).astype(np.float32)


@pytest.mark.parametrize(
    "name, dtype",
    [  # Each activation with one dtype in the default run, in turn; the slow step: the rest.
        pytest.param(
            name,
            dtype,
            marks=() if (i + j) % len(FLOAT_DTYPES) == 0 else pytest.mark.slow,
            id=f"{name}-{dtype.name}",
        )
        for i, name in enumerate(sorted(ACTIVATIONS))
        for j, dtype in enumerate(FLOAT_DTYPES)
    ],
)
def test_activations_with_custom_jvp(name, dtype):
    fn = ACTIVATIONS[name]
    check_matches_over_scales(fn, [ACTIVATION_X], dtype, [1.0, 2.0**-2], rtol=4 * RTOL[dtype])


@pytest.mark.parametrize(
    "name",
    [  # relu and softplus (custom_jvp rules: relu, logaddexp) in the default run
        pytest.param(name, marks=() if name in ("relu", "softplus") else pytest.mark.slow)
        for name in sorted(ACTIVATIONS)
    ],
)
def test_activation_gradients_with_custom_jvp(name):
    dtype = np.dtype(jnp.bfloat16)
    fn = ACTIVATIONS[name]
    check_grad_over_scales(fn, [ACTIVATION_X], dtype, [2.0**-4, 2.0**4], rtol=4 * RTOL[dtype])


def test_custom_lin_has_a_clear_error():
    with pytest.raises(NotImplementedError, match="linearize"):
        custom_derivatives.scaled_custom_lin(make_scaled(V, np.float32, 1.0))
