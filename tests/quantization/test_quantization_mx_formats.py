"""OCP MX format names (`MX_FORMATS`, `mx_element_format`) and `block_quantize` with them."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_scaled_arithmetics.quantization import (
    FORMATS,
    MX_FORMATS,
    block,
    block_dequantize,
    block_fake_quantize,
    block_quantize,
    mx_element_format,
)

EXPECTED = {
    "mxfp8_e4m3": "float8_e4m3fn",
    "mxfp8_e5m2": "float8_e5m2",
    "mxfp6_e2m3": "float6_e2m3fn",
    "mxfp6_e3m2": "float6_e3m2fn",
    "mxfp4_e2m1": "float4_e2m1fn",
}


def test_mx_formats_are_the_ocp_concrete_formats():
    assert dict(MX_FORMATS) == EXPECTED
    with pytest.raises(TypeError):
        MX_FORMATS["mxint8"] = "int8"  # type: ignore[index]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_mx_names_resolve_to_their_element_formats(name):
    assert mx_element_format(name) is FORMATS[EXPECTED[name]]
    assert mx_element_format(EXPECTED[name]) is FORMATS[EXPECTED[name]]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_block_quantize_accepts_mx_names(name):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32))
    by_name = block_quantize(x, name)
    by_element = block_quantize(x, EXPECTED[name])
    assert by_name.format is by_element.format and by_name.block_size == 32
    np.testing.assert_array_equal(block_dequantize(by_name), block_dequantize(by_element))


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("axis", [0, 1])
def test_block_fake_quantize_is_dequantize_of_quantize(name, axis):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((40, 48)) * np.exp2(rng.uniform(-20, 20, (40, 1)))
    x = jnp.asarray(x.astype(np.float32)).at[0].set(0.0)
    fake = block_fake_quantize(x, name, 16, axis=axis, pad=True)
    expected = block_dequantize(block_quantize(x, name, 16, axis=axis, pad=True))
    assert fake.dtype == jnp.float32 and fake.shape == x.shape
    np.testing.assert_array_equal(fake, expected)
    with pytest.raises(ValueError, match="does not divide"):
        block_fake_quantize(x, name, 32, axis=axis)


CONSTANT = np.random.default_rng(1).standard_normal((8, 2)).astype(np.float32)


def test_block_fake_quantize_of_a_constant_under_jit():
    expected = block_dequantize(block_quantize(CONSTANT, "float8_e4m3fn", 8, axis=0))
    out = jax.jit(lambda: block_fake_quantize(CONSTANT, "float8_e4m3fn", 8, axis=0))()
    np.testing.assert_array_equal(out, expected)


def test_block_dequantize_of_a_float8_constant_under_jit():
    """Once misplaced elements on JAX 0.10.2's CPU backend (float8 constants folded under
    jit); the encoder shared with `mx_from_scaled_array` no longer triggers it."""
    expected = block_dequantize(block_quantize(CONSTANT, "float8_e4m3fn", 8, axis=0))
    out = jax.jit(lambda: block_dequantize(block_quantize(CONSTANT, "float8_e4m3fn", 8, axis=0)))()
    np.testing.assert_array_equal(out, expected)


def test_unknown_or_unsuitable_formats_raise():
    with pytest.raises(ValueError, match="Unknown MX format 'mxfp7'.*mxfp8_e4m3"):
        mx_element_format("mxfp7")
    with pytest.raises(ValueError, match="Unknown MX format 'mxfp7'"):
        block_quantize(jnp.ones(32), "mxfp7")
    with pytest.raises(ValueError, match="signed"):
        mx_element_format("float8_e8m0fnu")
    with pytest.raises(ValueError, match="float format"):
        mx_element_format("posit8_es0")


def test_doctests():
    assert doctest.testmod(block, optionflags=doctest.ELLIPSIS).failed == 0
