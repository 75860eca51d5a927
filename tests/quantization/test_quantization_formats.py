import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from quantization_reference import all_values, grid

from jax_scaled_arithmetics.quantization import FORMATS, FloatFormat, get_format

PRESETS = list(FORMATS)
# The presets whose dtype the installed ml_dtypes has (float8_e5m3fnu came with 0.7).
ML_DTYPES_PRESETS = [name for name, fmt in FORMATS.items() if fmt.dtype is not None]
EXPECTED_PRESETS = {
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "float8_e4m3",
    "float8_e3m4",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "float4_e2m1fn",
    "float8_e8m0fnu",
    "float8_e5m3fnu",
    "bfloat16",
    "float16",
    "float32",
}


def test_presets_are_complete():
    assert set(FORMATS) == EXPECTED_PRESETS
    for name, fmt in FORMATS.items():
        assert fmt.name == name
        numpy_dtype = {"float16": np.float16, "float32": np.float32}.get(name)
        dtype = getattr(ml_dtypes, name, numpy_dtype)  # float8_e5m3fnu: ml_dtypes >= 0.7
        assert fmt.dtype == (None if dtype is None else np.dtype(dtype))


@pytest.mark.parametrize("name", ML_DTYPES_PRESETS)
def test_preset_matches_ml_dtypes_finfo(name):
    fmt = FORMATS[name]
    info = ml_dtypes.finfo(fmt.dtype)
    assert fmt.bits == info.bits
    assert fmt.exponent_bits == info.nexp
    assert fmt.mantissa_bits == info.nmant
    assert fmt.max == float(info.max)
    assert fmt.min_normal == float(info.smallest_normal)
    assert fmt.epsilon == float(info.eps)
    assert fmt.min_exponent == info.minexp
    assert fmt.max_exponent == info.maxexp - 1
    if fmt.min_subnormal is None:
        # No subnormals (float8_e8m0fnu): ml_dtypes reports the smallest normal here.
        assert float(info.smallest_subnormal) == fmt.min_normal
        assert fmt.mantissa_bits == 0
    else:
        assert fmt.min_subnormal == float(info.smallest_subnormal)


@pytest.mark.parametrize("name", [n for n in ML_DTYPES_PRESETS if n != "float32"])
def test_preset_matches_enumerated_values(name):
    """Every bit pattern of the dtype: largest/smallest values, infinities, NaN."""
    fmt = FORMATS[name]
    values = all_values(fmt.dtype)[: 2**fmt.bits].astype(np.float32)
    finite = values[np.isfinite(values)]
    positive = finite[finite > 0]
    assert fmt.max == finite.max() == -finite.min() or fmt.unsigned
    assert fmt.max == positive.max()
    assert fmt.has_inf == bool(np.isinf(values).any())
    assert fmt.has_nan == bool(np.isnan(values).any())
    assert (0.0 in finite) == fmt.has_zero
    assert (fmt.min_subnormal or fmt.min_normal) == positive.min()
    normals = positive[positive >= fmt.min_normal]
    assert fmt.min_normal in normals
    negative_zero = np.signbit(values) & (values == 0)
    assert negative_zero.any() == (fmt.has_zero and fmt.nan_encoding != "fnuz" and not fmt.unsigned)
    if fmt.has_zero and fmt.bits <= 16:
        np.testing.assert_array_equal(np.unique(np.abs(finite)), grid(fmt))


@pytest.mark.parametrize("name", PRESETS)
def test_get_format_by_name_and_dtype(name):
    fmt = FORMATS[name]
    assert get_format(name) is fmt
    assert get_format(fmt) is fmt
    if fmt.dtype is not None:
        assert get_format(fmt.dtype) is fmt
        assert get_format(fmt.dtype.type) is fmt
    if hasattr(jnp, name):
        assert get_format(getattr(jnp, name)) is fmt


def test_get_format_custom_passthrough():
    fmt = FloatFormat.custom(3, 3)
    assert get_format(fmt) is fmt


def test_get_format_unknown_name():
    with pytest.raises(
        ValueError, match=r"Unknown float format 'float7'; known formats: .*float8_e4m3fn"
    ):
        get_format("float7")


def test_get_format_unknown_dtype():
    with pytest.raises(ValueError, match=r"Unknown float format for dtype 'int8'; known formats"):
        get_format(np.int8)
    with pytest.raises(ValueError, match=r"'float64'"):
        get_format(np.float64)


@pytest.mark.parametrize("bad", [None, object(), 3.5])
def test_get_format_bad_type(bad):
    with pytest.raises(
        TypeError, match="get_format expects a format name, a dtype or a FloatFormat"
    ):
        get_format(bad)


@pytest.mark.parametrize(
    "exponent_bits, mantissa_bits, preset",
    [
        (5, 10, "float16"),
        (8, 7, "bfloat16"),
        (8, 23, "float32"),
        (5, 2, "float8_e5m2"),
        (4, 3, "float8_e4m3"),
        (3, 4, "float8_e3m4"),
    ],
)
def test_custom_matches_ieee_presets(exponent_bits, mantissa_bits, preset):
    fmt = FloatFormat.custom(exponent_bits, mantissa_bits)
    ref = FORMATS[preset]
    for prop in (
        "bits",
        "max",
        "min_normal",
        "min_subnormal",
        "epsilon",
        "has_inf",
        "has_nan",
        "max_exponent",
        "min_exponent",
    ):
        assert getattr(fmt, prop) == getattr(ref, prop), prop
    assert fmt.name == f"e{exponent_bits}m{mantissa_bits}"
    assert fmt.dtype is None and fmt.jax_dtype is None


@pytest.mark.parametrize("exponent_bits", range(1, 9))
@pytest.mark.parametrize("mantissa_bits", [0, 1, 2, 5, 10, 23])
def test_custom_all_widths(exponent_bits, mantissa_bits):
    fmt = FloatFormat.custom(exponent_bits, mantissa_bits)
    assert fmt.bits == 1 + exponent_bits + mantissa_bits
    assert fmt.nan_encoding == ("ieee" if exponent_bits >= 2 else "none")
    assert fmt.has_nan == (exponent_bits >= 2 and mantissa_bits > 0)
    assert 0 < fmt.min_normal <= fmt.max <= float(np.finfo(np.float32).max)
    assert fmt.epsilon == 2.0**-mantissa_bits
    assert (fmt.min_subnormal is None) == (mantissa_bits == 0)
    # All properties are exact float32 values.
    for v in (fmt.max, fmt.min_normal, fmt.min_subnormal or 1.0):
        assert float(np.float32(v)) == v
    if fmt.bits <= 12:
        g = grid(fmt)
        assert g[-1] == fmt.max
        assert g[1] == (fmt.min_subnormal or fmt.min_normal)


def test_custom_small_formats():
    e1 = FloatFormat.custom(1, 2)  # bias 0, no room for inf/NaN: 0, 0.5, 1, 1.5, 2, ..., 3.5
    assert (e1.max, e1.min_normal, e1.min_subnormal, e1.has_inf, e1.has_nan) == (
        3.5,
        2.0,
        0.5,
        False,
        False,
    )
    np.testing.assert_array_equal(grid(e1), np.arange(8) * 0.5)
    fn = FloatFormat.custom(4, 3, nan_encoding="fn", name="my_e4m3fn")
    assert (fn.max, fn.min_subnormal, fn.has_nan) == (448.0, 2.0**-9, True)
    biased = FloatFormat.custom(4, 3, exponent_bias=11, nan_encoding="fnuz")
    assert biased.max == FORMATS["float8_e4m3b11fnuz"].max


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 3), r"exponent_bits must be an integer in \[1, 8\], got 0"),
        ((-1, 3), r"exponent_bits must be an integer in \[1, 8\], got -1"),
        ((9, 3), r"exponent_bits must be an integer in \[1, 8\], got 9"),
        ((4, -1), r"mantissa_bits must be an integer in \[0, 23\], got -1"),
        ((4, 24), r"mantissa_bits must be an integer in \[0, 23\], got 24"),
        ((4.0, 3), r"exponent_bits must be an integer in \[1, 8\], got 4.0"),
        ((True, 3), r"exponent_bits must be an integer in \[1, 8\], got True"),
        ((4, "3"), r"mantissa_bits must be an integer in \[0, 23\], got '3'"),
    ],
)
def test_custom_bad_widths(args, match):
    with pytest.raises(ValueError, match=match):
        FloatFormat.custom(*args)


def test_custom_bad_options():
    with pytest.raises(ValueError, match="largest exponent 154 > 127"):
        FloatFormat.custom(8, 3, exponent_bias=100)
    with pytest.raises(ValueError, match=r"values down to 2\*\*-152 < 2\*\*-149"):
        FloatFormat.custom(8, 23, exponent_bias=130)
    with pytest.raises(ValueError, match="nan_encoding must be one of"):
        FloatFormat.custom(4, 3, nan_encoding="ocp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs exponent_bits >= 2"):
        FloatFormat.custom(1, 3, nan_encoding="ieee")
    with pytest.raises(ValueError, match="exponent_bias must be an integer"):
        FloatFormat.custom(4, 3, exponent_bias=7.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        FloatFormat.custom(4, 3, name="")


def test_format_is_frozen_and_hashable():
    fmt = FORMATS["float8_e4m3fn"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        fmt.max_exponent = 3  # type: ignore[misc]
    assert len({fmt, FORMATS["float8_e4m3fn"], FloatFormat.custom(4, 3)}) == 2
    assert FloatFormat.custom(4, 3) == FloatFormat.custom(4, 3)


def test_jax_dtype():
    assert FORMATS["float8_e4m3fn"].jax_dtype == jnp.float8_e4m3fn
    assert FORMATS["float4_e2m1fn"].jax_dtype == jnp.float4_e2m1fn
    assert FORMATS["float32"].jax_dtype == jnp.float32
