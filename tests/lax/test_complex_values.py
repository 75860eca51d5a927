import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from tests.helpers import make_scaled, represented


@pytest.mark.parametrize("scale", [2.0**-40, 1.0, 2.0**40])
@pytest.mark.parametrize("use_jit", [False, True])
def test_rfft_and_complex_of_scaled_values(scale, use_jit):
    x = make_scaled(np.array([1.0, -2.0, 3.0, 0.5]), np.float32, scale)
    value = jnp.asarray(represented(x), jnp.float32)

    def fn(a):
        return jnp.fft.rfft(a), jax.lax.complex(a, a * 2.0), jnp.fft.irfft(jnp.fft.rfft(a))

    scaled_fn = jax.jit(jsa.autoscale(fn)) if use_jit else jsa.autoscale(fn)
    spectrum, pairs, round_trip = scaled_fn(x)
    expected = fn(value)
    assert not isinstance(spectrum, jsa.ScaledArray) and spectrum.dtype == jnp.complex64
    np.testing.assert_allclose(spectrum, expected[0], rtol=1e-5, atol=1e-6 * 4 * scale)
    np.testing.assert_allclose(pairs, expected[1], rtol=1e-6)
    np.testing.assert_allclose(round_trip, value, rtol=1e-5, atol=1e-6 * scale)
