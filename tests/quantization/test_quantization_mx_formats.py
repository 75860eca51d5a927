"""OCP MX format names (`MX_FORMATS`, `mx_element_format`) and `block_quantize` with them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_scaled_arithmetics.quantization import (
    FORMATS,
    MX_FORMAT_ALIASES,
    MX_FORMATS,
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


@pytest.mark.parametrize(
    "alias, name", [("mxfp8", "mxfp8_e4m3"), ("mxfp6", "mxfp6_e2m3"), ("mxfp4", "mxfp4_e2m1")]
)
def test_family_names_are_their_documented_variant(alias, name):
    assert dict(MX_FORMAT_ALIASES)[alias] == name
    assert mx_element_format(alias) is FORMATS[EXPECTED[name]]
    assert mx_element_format(alias.upper()) is FORMATS[EXPECTED[name]]
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32))
    np.testing.assert_array_equal(
        block_dequantize(block_quantize(x, alias)), block_dequantize(block_quantize(x, name))
    )


def test_unknown_mx_name_lists_the_names():
    with pytest.raises(ValueError, match=r"Unknown MX format 'mxfp5'.*mxfp8_e4m3.*mxfp4"):
        mx_element_format("mxfp5")


# Each format with one axis in the default run (both axes among them); the other five in
# the slow step. Both axes of three formats: test_block_fake_quantize_bit_exact_over_*.
@pytest.mark.parametrize(
    "name, axis",
    [
        pytest.param(name, axis, marks=() if i % 2 == axis else pytest.mark.slow)
        for i, name in enumerate(sorted(EXPECTED))
        for axis in (0, 1)
    ],
)
@pytest.mark.one_case
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


def _wide_range_blocks(extreme: str) -> np.ndarray:
    """Blocks over float32's range, mixed magnitudes inside blocks, zero, signed-zero,
    NaN and inf blocks; `extreme` adds a block of float32 subnormals or near float32's max
    (the fake quantiser's float path hands those to the integer path)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((512, 64)) * np.exp2(rng.uniform(-60, 60, (512, 1)))
    x[::5] *= np.exp2(rng.uniform(-40, 0, x[::5].shape))
    x = x.astype(np.float32)
    x[0], x[1], x[2, 7], x[3, 33] = 0.0, -0.0, np.nan, -np.inf
    x[4] = np.linspace(-6.0, 6.0, 64) * 2.0**20  # ties of the small formats
    if extreme == "subnormal":
        x[5] = np.float32(1e-40)
        x[6] = np.float32(1e-40) * np.arange(64)
    elif extreme == "huge":
        x[5] = np.float32(3e38) * np.sign(np.arange(64) - 31.5)
    return x


EXTREMES = ("none", "subnormal", "huge")


@pytest.mark.parametrize(
    "name, extreme",
    # Each extreme that takes the integer path in the default run (2 cases, two formats);
    # the float32 path of every format is in the default run's
    # test_block_fake_quantize_is_dequantize_of_quantize, over 2^+-60 for MXFP4 in
    # tests/quantization/test_quantization_block.py::test_mxfp4_bit_exact_on_a_hundred_*;
    # all 15 in the slow step.
    [
        pytest.param(
            name,
            extreme,
            marks=() if i == EXTREMES.index(extreme) > 0 else pytest.mark.slow,
        )
        for i, name in enumerate(sorted(EXPECTED))
        for extreme in EXTREMES
    ],
)
@pytest.mark.slow
def test_block_fake_quantize_bit_exact_over_float32_range(name, extreme):
    """Nearest rounding takes a float32 path (scale, round, unscale) where it is exact and
    the integer path elsewhere: bit for bit the round trip, both scale roundings, both axes."""
    x = jnp.asarray(_wide_range_blocks(extreme))
    for axis in (0, 1):
        for scale_rounding in ("floor", "up"):
            fake = block_fake_quantize(x, name, 32, axis=axis, scale_rounding=scale_rounding)
            mx = block_quantize(x, name, 32, axis=axis, scale_rounding=scale_rounding)
            np.testing.assert_array_equal(
                np.asarray(fake).view(np.uint32),
                np.asarray(block_dequantize(mx)).view(np.uint32),
                err_msg=f"{name} axis {axis} {scale_rounding}",
            )


def _tiled(x: np.ndarray, r: int, c: int) -> np.ndarray:
    m, n = x.shape
    return x.reshape(m // r, r, n // c, c).swapaxes(1, 2).reshape(m // r, n // c, r * c)


# The tiles are blocks of 1,024 whatever the scale rounding (both roundings of 1-D blocks:
# test_block_fake_quantize_bit_exact_over_float32_range): "up" in the slow step.
@pytest.mark.parametrize("scale_rounding", ["floor", pytest.param("up", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_2d_blocks_are_one_scale_per_tile_and_commute_with_transposition(scale_rounding):
    """`block_size=(32, 32)`: each 32 x 32 tile is one block (the 1-D quantisation of the
    tile's 1,024 values), so a weight and its transpose quantise identically."""
    w = jnp.asarray(_wide_range_blocks("none")[:128])  # 4 x 2 tiles
    mx = block_quantize(w, "mxfp4_e2m1", (32, 32), scale_rounding=scale_rounding)
    assert mx.block_size == (32, 32) and mx.scale.shape == (4, 2) and mx.shape == w.shape
    flat = block_quantize(
        jnp.asarray(_tiled(np.asarray(w), 32, 32)), "mxfp4_e2m1", 1024,
        scale_rounding=scale_rounding,
    )  # fmt: skip
    np.testing.assert_array_equal(
        np.asarray(mx.scale.astype(jnp.float32)).ravel(),
        np.asarray(flat.scale.astype(jnp.float32)).ravel(),
    )
    values = np.asarray(block_dequantize(mx))
    np.testing.assert_array_equal(
        _tiled(values, 32, 32).view(np.uint32), np.asarray(block_dequantize(flat)).view(np.uint32)
    )
    fake = block_fake_quantize(w, "mxfp4_e2m1", (32, 32), scale_rounding=scale_rounding)
    np.testing.assert_array_equal(np.asarray(fake).view(np.uint32), values.view(np.uint32))
    transposed = block_fake_quantize(w.T, "mxfp4_e2m1", (32, 32), scale_rounding=scale_rounding)
    np.testing.assert_array_equal(np.asarray(transposed).view(np.uint32), values.T.view(np.uint32))
    # The ScaledArray view: one power of two per tile.
    view = mx.to_scaled_array()
    assert view.scale.shape == (4, 2)
    np.testing.assert_array_equal(np.asarray(view.to_array(jnp.float32)), values)


@pytest.mark.parametrize(
    "shape, kwargs, match",
    [
        ((64,), {}, "need an array of rank 2 or more and axis=-1"),
        ((64, 64), {"axis": 0}, "and axis=-1, got rank 2 and axis 0"),
        ((48, 64), {}, "axis 0 has 48 entries, not a multiple of the block size 32"),
        ((64, 64), {"pad": True}, "2D blocks do not pad"),
    ],
)
def test_bad_2d_blocks_are_refused(shape, kwargs, match):
    with pytest.raises(ValueError, match=match):
        block_quantize(jnp.ones(shape), "mxfp4_e2m1", (32, 32), **kwargs)
    with pytest.raises(ValueError, match="a positive integer or a pair of them"):
        block_fake_quantize(jnp.ones((64, 64)), "mxfp4_e2m1", (32, 0))
