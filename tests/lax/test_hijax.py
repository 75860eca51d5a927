"""Hijax primitives (`call_hi_primitive`: JAX's `HiPrim`s, e.g. `jnp.frexp` and `jnp.ldexp`
from JAX 0.12) through `jsa.autoscale`: their expansion into ordinary primitives is
interpreted, and `grad(autoscale(f))` uses JAX's own derivative of the HiPrim.

Both functions act on the bits of the value in the data dtype (the `bitcast_convert_type`
rule), so their outputs are plain arrays, compared with the plain function on the value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from tests.helpers import FLOAT_DTYPES, check_autoscale_matches, make_scaled
from tests.lax.test_elementwise import primitives_of

X = np.array([1.5, -3.0, 0.25, 6.0, -0.75, 2.0], np.float32)
N = np.array([2, -1, 3, 0, 1, -2], np.int32)

pytestmark = pytest.mark.skipif(
    "call_hi_primitive" not in primitives_of(jnp.frexp, [X]),
    reason="jnp.frexp is a HiPrim from JAX 0.12 (a custom_jvp of ordinary primitives before)",
)


def _frexp(x):
    mantissa, exponent = jnp.frexp(x)
    return mantissa, exponent


def _ldexp(x):
    return jnp.ldexp(x, N)


def _scales(dtype, use_jit):
    # float16 holds the values (for the bits in the data dtype) only near scale 1.
    if np.dtype(dtype) == np.float16:
        return (2.0**-4,) if use_jit else (2.0**4,)
    return (2.0**-60, 2.0**60) if use_jit else (2.0**-20, 1.0)


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_frexp_and_ldexp_match_plain(dtype, use_jit):
    for scale in _scales(dtype, use_jit):
        for fn in (_frexp, _ldexp):
            check_autoscale_matches(
                fn, [X], dtype, scale, use_jit, rtol=0.0, expect_scaled_output=False
            )


@pytest.mark.parametrize("use_jit", [False, True])
def test_grad_uses_the_hi_primitive_derivative(use_jit):
    # The expansions go through bit casts (no derivative): the gradient is JAX's own.
    w = np.linspace(0.5, 1.5, X.size).astype(np.float32)
    scale = np.float32(2.0**-40 if use_jit else 2.0**40)
    for fn in (_ldexp, lambda v: _frexp(v)[0]):
        grad = jax.grad(lambda d, f=fn: jnp.sum(jsa.autoscale(f)(jsa.ScaledArray(d, scale)) * w))
        grad = jax.jit(grad) if use_jit else grad
        expected = jax.grad(lambda v, f=fn: jnp.sum(f(v) * w))(X * scale) * scale
        np.testing.assert_allclose(grad(X), expected, rtol=1e-6)


def test_grad_inside_autoscale():
    x = make_scaled(X, jnp.bfloat16, 2.0**-30)
    fn = jax.jit(jsa.autoscale(jax.grad(lambda v: jnp.sum(_ldexp(v)))))
    np.testing.assert_array_equal(np.asarray(fn(x), np.float32), 2.0**N)
