"""MXArray as a view of a block-scaled ScaledArray: `MXArray.to_scaled_array` and
`mx_from_scaled_array`, bit-exact round trips, autoscale on the view, and errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.quantization import (
    MX_FORMATS,
    block_dequantize,
    block_quantize,
    mx_from_scaled_array,
    mx_quantize,
)
from tests.helpers import eager_and_jit, pairwise_params

FORMATS = list(MX_FORMATS)  # the five OCP MX element formats


def bits(a) -> np.ndarray:
    """Raw bits of an array of any float dtype (float32 elements or 8-bit dtypes)."""
    a = np.asarray(a)
    return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint32)


def assert_same_mx(a, b):
    assert (a.format, a.block_size, a.axis, a.length) == (b.format, b.block_size, b.axis, b.length)
    assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
    np.testing.assert_array_equal(bits(a.scale), bits(b.scale))
    np.testing.assert_array_equal(bits(a.data), bits(b.data))


def wide_blocks(seed, shape, low=-150, high=125):
    """Normal values whose blocks of 32 along the last axis differ widely in magnitude,
    with zero, negative-zero, NaN and infinite blocks."""
    rng = np.random.default_rng(seed)
    mag = np.exp2(rng.uniform(low, high, shape[:-1] + (shape[-1] // 32, 1)))
    x = rng.standard_normal(shape[:-1] + (shape[-1] // 32, 32)) * mag
    x = x.reshape(shape).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :32] = -0.0
    x[2, 3] = np.nan
    x[3, 40] = -np.inf
    return x


# Each format with one axis in the default run (both axes among them: the axis is moved
# to the end before the elements are encoded, whatever the format); all ten in the slow step.
@pytest.mark.parametrize(
    "name, axis",
    [
        pytest.param(name, axis, marks=() if i % 2 == (axis == 0) else pytest.mark.slow)
        for i, name in enumerate(FORMATS)
        for axis in (-1, 0)
    ],
)
def test_mx_to_scaled_array_and_back_is_exact(name, axis):
    x = wide_blocks(len(name), (64, 96))
    mx = block_quantize(x if axis == -1 else x.T, name, block_size=32, axis=axis)
    sa = mx.to_scaled_array()
    assert isinstance(sa, jsa.ScaledArray)
    assert sa.data is mx.data and sa.scale.dtype == np.float32
    assert sa.scale.shape == ((64, 3) if axis == -1 else (3, 64))
    assert_same_mx(mx_from_scaled_array(sa, name, block_size=32, axis=axis), mx)


@pytest.mark.parametrize("name", FORMATS)
def test_view_represents_the_dequantized_values(name):
    # Scales within float32's normal range: XLA on CPU flushes subnormal products.
    x = wide_blocks(1, (16, 64), low=-60, high=60)
    x[2, 3] = x[3, 40] = 1.0
    mx = block_quantize(x, name)
    np.testing.assert_array_equal(mx.to_scaled_array().to_array(jnp.float32), mx.dequantize())


# Each format with one rounding in the default run (both roundings among them); all ten in
# the slow step.
@pytest.mark.parametrize(
    "name, rounding",
    [
        pytest.param(name, r, marks=() if i % 2 == (r == "toward_zero") else pytest.mark.slow)
        for i, name in enumerate(FORMATS)
        for r in ("nearest", "toward_zero")
    ],
)
def test_per_tensor_scale_one_is_block_quantize(name, rounding):
    x = wide_blocks(2, (8, 64))
    sa = jsa.scaled_array(x, 1.0)
    out = mx_from_scaled_array(sa, name, block_size=32, rounding=rounding)
    assert_same_mx(out, block_quantize(x, name, block_size=32, rounding=rounding))


LAYOUTS = {"tensor": (), "row": (8, 1), "column": (1, 64), "mx16": (8, 4), "tile": (2, 2)}


# Every pair of (layout, dtype, format) values in the default run, the full product in the
# slow step.
@pytest.mark.parametrize(
    "layout, dtype, name",
    pairwise_params(
        [
            (layout, dtype, name)
            for layout in LAYOUTS
            for dtype in (np.float32, np.float16, ml_dtypes.bfloat16)
            for name in ("mxfp8_e4m3", "mxfp4_e2m1")
        ]
    ),
)
def test_any_layout_is_quantized_as_its_values(layout, dtype, name):
    x = wide_blocks(3, (8, 64), low=-40, high=40)
    x[2, 3] = x[3, 40] = 1.0
    if LAYOUTS[layout]:
        sa = jsa.as_scaled_array(x, scale_shape=LAYOUTS[layout], dtype=dtype)
    else:
        sa = jsa.as_scaled_array(x, scale=2.0**-5, dtype=dtype)
    values = np.asarray(sa.to_array(jnp.float32))
    assert_same_mx(mx_from_scaled_array(sa, name), block_quantize(values, name))


def test_values_beyond_float32_range():
    x = wide_blocks(4, (4, 64), low=-3, high=3)
    x[2, 3] = x[3, 40] = 1.0
    sa = jsa.scaled_array(x, 2.0**120)  # values up to about 2**126 * 8
    mx = mx_from_scaled_array(sa, "mxfp8_e5m2")
    ref = block_quantize(x, "mxfp8_e5m2")
    np.testing.assert_array_equal(bits(mx.data), bits(ref.data))
    shifted = bits(ref.scale).astype(int) + 120
    shifted[:2, 0] = 0  # zero blocks keep the smallest scale, 2**-127
    np.testing.assert_array_equal(bits(mx.scale).astype(int), shifted)


def test_non_power_of_two_negative_and_zero_scales():
    x = np.float32([[1.0, -2.0, 3.0, 0.5], [1.0, 2.0, 3.0, 4.0]])
    sa = jsa.ScaledArray(jnp.asarray(x), jnp.float32([[3.0], [0.0]]))
    mx = mx_from_scaled_array(sa, "mxfp8_e4m3", block_size=4)
    np.testing.assert_array_equal(mx.dequantize(), [[3.0, -6.0, 9.0, 1.5], [0, 0, 0, 0]])
    neg = mx_from_scaled_array(jsa.ScaledArray(jnp.asarray(x), -2.0), "mxfp8_e4m3", 4)
    np.testing.assert_array_equal(neg.dequantize(), -2 * x)


def test_nan_and_inf_make_nan_blocks():
    x = np.ones((2, 8), np.float32)
    x[0, 1] = np.inf
    sa = jsa.ScaledArray(jnp.asarray(x), jnp.float32([[1.0, 1.0], [1.0, np.nan]]))
    out = np.asarray(mx_from_scaled_array(sa, "mxfp6_e2m3", block_size=4).dequantize())
    assert np.isnan(out[0, :4]).all() and np.isnan(out[1, 4:]).all()
    np.testing.assert_array_equal(out[0, 4:], 1.0)
    np.testing.assert_array_equal(out[1, :4], 1.0)


def test_pad_and_jit():
    x = wide_blocks(5, (4, 64), low=-10, high=10)[:, :50]
    x[2, 3] = x[3, 40] = 1.0
    sa = jsa.as_scaled_array(x, scale_shape=(4, 1))
    values = np.asarray(sa.to_array(jnp.float32))
    ref = block_quantize(values, "mxfp8_e4m3", pad=True)
    assert_same_mx(mx_from_scaled_array(sa, "mxfp8_e4m3", pad=True), ref)
    convert = jax.jit(lambda s: mx_from_scaled_array(s, "mxfp8_e4m3", pad=True))
    assert_same_mx(convert(sa), ref)
    with pytest.raises(ValueError, match="padded from length 50 to 64"):
        ref.to_scaled_array()


# Outside jit every operation of the scaled matmul compiles its own program: the default run
# holds it for an 8-bit and the 4-bit format, and under jit an 8-, a 6- and the 4-bit format
# (the element dtypes of each width); the slow step every format both ways.
@pytest.mark.parametrize(
    "name, use_jit",
    eager_and_jit(
        FORMATS,
        lambda name: name in ("mxfp8_e4m3", "mxfp4_e2m1"),
        lambda name: name in ("mxfp8_e4m3", "mxfp6_e2m3", "mxfp4_e2m1"),
    ),
)
@pytest.mark.one_case
def test_view_inside_autoscale_matmul(name, use_jit):
    rng = np.random.default_rng(6)
    a = rng.standard_normal((8, 64)) * np.exp2(rng.integers(-20, 20, (8, 2)).repeat(32, 1))
    b = rng.standard_normal((64, 16)) * np.exp2(rng.integers(-20, 20, (2, 16)).repeat(32, 0))
    mx_a = block_quantize(a.astype(np.float32), name, axis=-1)
    mx_b = block_quantize(b.astype(np.float32), name, axis=0)  # blocks along contraction
    ref = np.asarray(block_dequantize(mx_a), np.float64) @ np.asarray(
        block_dequantize(mx_b), np.float64
    )
    # Elements cast to float32 (exactly), then `a @ b` under autoscale.
    sa, sb = (m.to_scaled_array().astype(jnp.float32) for m in (mx_a, mx_b))
    matmul = jsa.autoscale(lambda a, b: a @ b)
    out = (jax.jit(matmul) if use_jit else matmul)(sa, sb)
    assert isinstance(out, jsa.ScaledArray)
    np.testing.assert_allclose(out.to_array(), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    # Elements in their own dtype, accumulated in float32.
    native = jsa.autoscale(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    native = jax.jit(native) if use_jit else native
    out = native(mx_a.to_scaled_array(), mx_b.to_scaled_array()).to_array()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_errors_name_the_problem():
    sa = jsa.as_scaled_array(np.ones((4, 64), np.float32), scale_shape=(4, 2))
    with pytest.raises(ValueError, match="block_size 48 does not divide the length 64"):
        mx_from_scaled_array(sa, "mxfp8_e4m3", block_size=48)
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        mx_from_scaled_array(sa, "mxfp8_e4m3", axis=2)
    with pytest.raises(ValueError, match="Unknown MX format 'mxfp9'"):
        mx_from_scaled_array(sa, "mxfp9")
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        mx_from_scaled_array(sa, "mxfp8_e4m3", block_size=0)
    with pytest.raises(ValueError, match="rounding='stochastic' needs a PRNG key"):
        mx_from_scaled_array(sa, "mxfp8_e4m3", rounding="stochastic")
    bad = jsa.ScaledArray(jnp.ones((4, 64)), jnp.ones((3, 1)))  # unvalidated constructor
    with pytest.raises(ValueError, match=r"scale of shape \(3, 1\) does not broadcast"):
        mx_from_scaled_array(bad, "mxfp8_e4m3")
    with pytest.raises(ValueError, match="at least one dimension"):
        mx_from_scaled_array(jsa.scaled_array(1.0, 1.0), "mxfp8_e4m3")
    with pytest.raises(TypeError, match="expects a ScaledArray, got ndarray"):
        mx_from_scaled_array(np.ones((4, 64), np.float32), "mxfp8_e4m3")


def test_view_under_jit_and_no_recompilation():
    x = wide_blocks(7, (4, 64), low=-10, high=10)
    x[2, 3] = x[3, 40] = 1.0
    mx = block_quantize(x, "mxfp6_e3m2")
    round_trip = jax.jit(lambda m: mx_from_scaled_array(m.to_scaled_array(), "mxfp6_e3m2"))
    assert_same_mx(round_trip(mx), mx)
    sa = mx.to_scaled_array()
    mx_from_scaled_array(sa, "mxfp6_e3m2")
    before = mx_quantize._mx_from_scaled_impl._cache_size()
    mx_from_scaled_array(jsa.ScaledArray(sa.data + 1, sa.scale), "mxfp6_e3m2")
    assert mx_quantize._mx_from_scaled_impl._cache_size() == before
