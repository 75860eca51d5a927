"""The quantisers under `jsa.autoscale`: they see represented values (the exponent range
applies to the value), match the plain functions, and pass gradients straight through.

For quantising the stored data of a ScaledArray (the range its scale was chosen for) use
`jsa.ops.reduce_precision_on_forward` / `cast_on_forward`, tested in tests/ops.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from tests.helpers import make_scaled, represented

q = jsa.quantization

QUANTISERS = {
    "float": lambda v: q.float_quantize(v, "float8_e4m3fn"),
    "float_saturate": lambda v: q.float_quantize(v, "float8_e5m2", saturate=True),
    "fixed": lambda v: q.fixed_point_quantize(v, 8, 4),
    "mx": lambda v: q.block_dequantize(q.block_quantize(v, "float8_e4m3fn", block_size=4)),
}


@functools.cache
def _scaled(name, use_jit):
    """`autoscale` of a quantiser (jitted), built once: the scales share its program."""
    fn = jsa.autoscale(QUANTISERS[name])
    return jax.jit(fn) if use_jit else fn


@pytest.mark.parametrize("name", sorted(QUANTISERS))
@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("scale", [2.0**-3, 1.0, 2.0**3])
def test_quantisers_under_autoscale_match_plain(name, use_jit, scale):
    fn = QUANTISERS[name]
    x = make_scaled(np.array([1.1, -3.3, 0.3, 7.7, -0.05, 2.5, 0.0, 1.0]), np.float32, scale)
    out = _scaled(name, use_jit)(x)
    expected = fn(jnp.asarray(represented(x), jnp.float32))
    np.testing.assert_array_equal(represented(out), np.asarray(expected, np.float64))


@pytest.mark.parametrize("name", ["float", "float_saturate", "fixed"])
def test_quantiser_gradients_are_straight_through_under_autoscale(name):
    fn = QUANTISERS[name]
    x = make_scaled(np.array([1.1, -3.3, 0.3, 7.7]), np.float32, 2.0**-3)
    weights = np.array([1.0, 2.0, 3.0, 4.0], np.float32)

    def loss(data):
        v = jsa.ScaledArray(data, x.scale)
        return jsa.asarray(jsa.autoscale(lambda a: jnp.sum(fn(a) * weights))(v))

    grads = jax.grad(loss)(x.data)
    np.testing.assert_allclose(np.asarray(grads), weights * 2.0**-3, rtol=1e-6)
