"""Posit activation shortcuts: the bit trick itself, and their stated maximum errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.quantization import posit_from_bits, posit_to_bits, posit_values

# Maximum absolute errors stated in the docstrings: (at posit inputs, over all inputs).
STATED = {
    ("sigmoid", 8): (0.0607, 0.0627),
    ("sigmoid", 16): (0.0491, 0.0491),
    ("tanh", 8): (0.1214, 0.1233),
    ("tanh", 16): (0.0981, 0.0981),
}
FUNCTIONS = {
    "sigmoid": (jsa.ops.posit_sigmoid, lambda v: 0.5 * (1 + np.tanh(v / 2))),
    "tanh": (jsa.ops.posit_tanh, np.tanh),
}


def worst_inputs(nbits):
    """Every posit<nbits, 0> value, and the float32 values next to every rounding boundary
    (the odd codes of posit<nbits + 1, 0>): the error over all real inputs peaks there."""
    ties = np.asarray(
        posit_from_bits(np.arange(1, 2 ** (nbits + 1), 2, dtype=np.uint32), nbits + 1, 0)
    )
    ties = ties[np.isfinite(ties)]
    around = [ties, np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))]
    big = np.float32([1e30, -1e30, np.inf, -np.inf])
    return np.concatenate([*around, big]).astype(np.float32)


@pytest.mark.parametrize("name, nbits", sorted(STATED))
def test_stated_maximum_errors(name, nbits):
    fn, exact = FUNCTIONS[name]
    at_posits, overall = STATED[(name, nbits)]
    x = posit_values(nbits, 0)
    error = np.abs(np.asarray(fn(x, nbits), np.float64) - exact(x.astype(np.float64))).max()
    assert at_posits - 1e-4 <= error <= at_posits, error
    y = worst_inputs(nbits)
    with np.errstate(over="ignore"):
        error = np.abs(np.asarray(fn(y, nbits), np.float64) - exact(y.astype(np.float64))).max()
    assert overall - 1e-4 <= error <= overall, error


@pytest.mark.parametrize("nbits", [4, 8, 12, 16])
def test_sigmoid_is_the_bit_trick(nbits):
    x = posit_values(nbits, 0)
    codes = np.asarray(posit_to_bits(x, nbits, 0)).astype(np.uint32)
    trick = ((codes ^ (1 << (nbits - 1))) >> 2).astype(np.uint32)
    expected = np.asarray(posit_from_bits(trick, nbits, 0))
    np.testing.assert_array_equal(np.asarray(jsa.ops.posit_sigmoid(x, nbits)), expected)
    if nbits == 8:  # the classic posit8 table
        assert float(jsa.ops.posit_sigmoid(np.float32(0.0))) == 0.5
        assert float(jsa.ops.posit_sigmoid(np.float32(64.0))) == 1 - 2**-6


@pytest.mark.parametrize("nbits", [8, 16])
def test_tanh_is_odd_bounded_and_a_posit(nbits):
    x = posit_values(nbits, 0)
    t = np.asarray(jsa.ops.posit_tanh(x, nbits))
    np.testing.assert_array_equal(t, -t[::-1])
    assert (np.abs(t) < 1).all() and (np.diff(t) >= 0).all()
    assert np.isin(t, posit_values(nbits, 0)).all()
    s = np.asarray(jsa.ops.posit_sigmoid(x, nbits))
    assert ((s >= 0) & (s < 1)).all() and (np.diff(s) >= 0).all()
    assert np.isin(s, posit_values(nbits, 0)).all()


def test_specials_dtypes_and_gradients():
    x = np.float32([np.nan, np.inf, -np.inf, 0.0, -0.0])
    s = np.asarray(jsa.ops.posit_sigmoid(x))
    np.testing.assert_array_equal(s, [np.nan, 1 - 2**-6, 0.0, 0.5, 0.5])
    t = np.asarray(jsa.ops.posit_tanh(x))
    np.testing.assert_array_equal(t, [np.nan, 1 - 2**-5, -(1 - 2**-5), 0.0, 0.0])
    v = x.astype(np.float16)
    np.testing.assert_array_equal(np.asarray(jsa.ops.posit_sigmoid(v)), s.astype(np.float16))
    v = jnp.linspace(-3, 3, 7)
    g = jax.grad(lambda a: jnp.sum(jsa.ops.posit_sigmoid(a)))(v)
    np.testing.assert_allclose(
        np.asarray(g), np.asarray(jax.grad(lambda a: jnp.sum(jax.nn.sigmoid(a)))(v)), rtol=1e-6
    )
    g = jax.jit(jax.grad(lambda a: jnp.sum(jsa.ops.posit_tanh(a, 16))))(v)
    np.testing.assert_allclose(np.asarray(g), 1 - np.tanh(np.asarray(v)) ** 2, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_inputs(dtype):
    """FP8 activations (jnp.signbit takes no 8-bit dtype: posit_tanh raised on them): the
    float32 inputs' outputs, rounded to the format, jit and eager; NaN stays NaN."""
    import ml_dtypes

    dtype = np.dtype(getattr(ml_dtypes, dtype))
    x = np.concatenate([np.linspace(-4, 4, 33), [0.0, -0.0, np.nan]]).astype(dtype)
    for fn in (jsa.ops.posit_sigmoid, jsa.ops.posit_tanh):
        want = np.asarray(fn(x.astype(np.float32))).astype(dtype)
        for run in (fn, jax.jit(fn)):
            got = run(x)
            assert got.dtype == dtype
            np.testing.assert_array_equal(np.asarray(got, np.float32), want.astype(np.float32))


def test_errors():
    x = jnp.ones(3)
    for bad in (3, 27, 8.0, True):
        with pytest.raises(ValueError, match=r"nbits must be an integer in \[4, 26\]"):
            jsa.ops.posit_sigmoid(x, bad)
    with pytest.raises(ValueError, match=r"nbits must be an integer in \[4, 26\], got 2"):
        jsa.ops.posit_tanh(x, 2)
    with pytest.raises(TypeError, match="posit_sigmoid expects a float array of at most 32 bits"):
        jsa.ops.posit_sigmoid(jnp.arange(3))
    with pytest.raises(TypeError, match="posit_tanh expects a float array of at most 32 bits"):
        jsa.ops.posit_tanh(jnp.ones(3, jnp.complex64))
