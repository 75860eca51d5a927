"""Slow, obviously-correct numpy references for the quantization tests."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jax_scaled_arithmetics.quantization import FloatFormat

UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def bits_of(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x.view(UINT_OF_SIZE[x.dtype.itemsize])


def assert_same_bits(got, ref, inputs=None, msg: str = "") -> None:
    """Bitwise equality, any NaN matching any NaN."""
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.dtype == ref.dtype, (msg, got.dtype, ref.dtype)
    assert got.shape == ref.shape, msg
    gotf, reff = got.astype(np.float32), ref.astype(np.float32)
    same = (bits_of(got) == bits_of(ref)) | (np.isnan(gotf) & np.isnan(reff))
    if not same.all():
        idx = np.flatnonzero(~same)[:10]
        where = "" if inputs is None else f"\ninputs {np.asarray(inputs).ravel()[idx]!r}"
        raise AssertionError(
            f"{msg}: {(~same).sum()} mismatches{where}"
            f"\ngot {got.ravel()[idx]!r}\nref {ref.ravel()[idx]!r}"
        )


def grid(fmt: FloatFormat) -> np.ndarray:
    """Sorted non-negative finite values of a small format with a zero (float64).

    Ordered like the codes, so the index parity is the mantissa LSB.
    """
    assert fmt.has_zero and fmt.bits <= 16
    e_all, m_all = 2**fmt.exponent_bits - 1, 2**fmt.mantissa_bits - 1
    vals = []
    for e in range(e_all + 1):
        for m in range(m_all + 1):
            if e == e_all and fmt.nan_encoding == "ieee":
                continue
            if e == e_all and m == m_all and fmt.nan_encoding == "fn":
                continue
            frac = m / 2.0**fmt.mantissa_bits
            if e == 0:
                vals.append(frac * 2.0 ** (1 - fmt.exponent_bias))
            else:
                vals.append((1 + frac) * 2.0 ** (e - fmt.exponent_bias))
    g = np.array(vals)
    assert (np.diff(g) > 0).all()
    return g


def ref_quantize(
    x: np.ndarray, fmt: FloatFormat, rounding: str = "nearest", saturate: bool = False
) -> np.ndarray:
    """Grid-search reference of float_quantize on float32 inputs (not for mantissa_bits=0)."""
    with np.errstate(all="ignore"):  # signalling NaN inputs, overflow
        return _ref_quantize(x, fmt, rounding, saturate)


def _ref_quantize(x: np.ndarray, fmt: FloatFormat, rounding: str, saturate: bool) -> np.ndarray:
    assert fmt.mantissa_bits > 0
    x = np.asarray(x, np.float32)
    g = grid(fmt)
    nxt = g[-1] + 2.0 ** (fmt.max_exponent - fmt.mantissa_bits)  # first value past max
    ext = np.append(g, nxt)
    ax = np.abs(x.astype(np.float64))
    finite = np.isfinite(ax)
    axf = np.where(finite, ax, 0.0)
    i = np.clip(np.searchsorted(ext, axf, side="right") - 1, 0, len(ext) - 1)
    lo = ext[i]
    hi = ext[np.minimum(i + 1, len(ext) - 1)]
    if rounding == "nearest":
        d_lo, d_hi = axf - lo, hi - axf
        up = (d_hi < d_lo) | ((d_hi == d_lo) & (i % 2 == 1))
        r = np.where((i < len(ext) - 1) & up, hi, lo)
        overflow = (r > g[-1]) | (i == len(ext) - 1)
    elif rounding == "toward_zero":
        r = np.minimum(lo, g[-1])
        overflow = np.zeros(x.shape, bool)
    else:
        raise ValueError(rounding)

    if saturate or fmt.nan_encoding == "none":
        big = g[-1]
    elif fmt.has_inf:
        big = np.inf
    else:
        big = np.nan
    r = np.where(overflow, big, r)
    r = np.where(np.isinf(ax), big, r)
    if fmt.unsigned:  # no sign: negative values (even those rounding to 0) are NaN, -0 is 0
        r = np.where(np.signbit(x) & (ax != 0), np.nan, r)
    else:
        r = np.where(np.signbit(x), -r, r)
    if fmt.nan_encoding == "fnuz":
        r = np.where(r == 0, 0.0, r)
    r = np.where(np.isnan(x), np.nan, r)
    return r.astype(np.float32)


def neighbours(x: np.ndarray, fmt: FloatFormat) -> tuple[np.ndarray, np.ndarray]:
    """Grid values below and above |x| (finite, in range), as float64 magnitudes."""
    g = grid(fmt)
    with np.errstate(invalid="ignore"):
        ax = np.abs(np.asarray(x, np.float64))
    i = np.searchsorted(g, ax, side="right") - 1
    lo = g[i]
    hi = np.where(lo == ax, lo, g[np.minimum(i + 1, len(g) - 1)])
    return lo, hi


def probe_values(fmt: FloatFormat, values: np.ndarray | None = None) -> np.ndarray:
    """Float32 probes: all values, midpoints (ties), just around them, out of range, specials."""
    if values is None:
        if fmt.dtype is not None and fmt.dtype.itemsize <= 2:
            codes = np.arange(2**fmt.bits, dtype=UINT_OF_SIZE[fmt.dtype.itemsize])
            values = codes.view(fmt.dtype).astype(np.float32)
        else:
            g = grid(fmt)
            values = np.concatenate([g, -g])
    v = np.unique(values[np.isfinite(values)].astype(np.float64))
    mids = (v[1:] + v[:-1]) / 2
    f32 = np.float32
    top = np.float64(fmt.max) + 2.0 ** (fmt.max_exponent - fmt.mantissa_bits)
    extra = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, fmt.max * 2, top, (fmt.max + top) / 2],
        np.float64,
    )
    with np.errstate(over="ignore"):
        probes = np.concatenate([v, mids, extra, -extra]).astype(f32)
    around = np.concatenate(
        [np.nextafter(probes, f32(np.inf)), np.nextafter(probes, f32(-np.inf))]
    ).astype(f32)
    with np.errstate(over="ignore"):
        scaled = [probes * f32(2), probes * f32(0.5)]
    return np.concatenate([probes, around, *scaled]).astype(f32)


def random_values(n: int, seed: int = 0) -> np.ndarray:
    """Float32 values spread over the whole exponent range, plus random bit patterns."""
    rng = np.random.default_rng(seed)
    scaled = rng.standard_normal(n // 2) * np.exp2(rng.uniform(-155, 129, n // 2))
    with np.errstate(over="ignore"):
        scaled = scaled.astype(np.float32)
    patterns = rng.integers(0, 2**32, n - n // 2, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([scaled, patterns.view(np.float32)])


E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
# ml_dtypes before 0.7.0 rounded every float32 subnormal in (2**-127, 2**-126) up to
# 2**-126 when casting to float8_e8m0fnu; 0.7.0 rounds them to the nearest (ties up).
_E8M0_SUBNORMALS_ROUND_UP = tuple(int(p) for p in ml_dtypes.__version__.split(".")[:2]) < (0, 7)


def ml_dtypes_roundtrip(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``x.astype(dtype).astype(float32)`` without numpy cast warnings.

    Rounds to the nearest whatever the installed ml_dtypes (see above)."""
    x = np.asarray(x, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        out = x.astype(dtype).astype(np.float32)
    if _E8M0_SUBNORMALS_ROUND_UP and np.dtype(dtype) == E8M0:
        smallest = np.float32(2.0**-127)
        out = np.where((x > smallest) & (x < np.float32(1.5) * smallest), smallest, out)
    return out


def all_values(dtype) -> np.ndarray:
    """Every bit pattern of a 16-bit or smaller dtype."""
    dtype = np.dtype(dtype)
    return np.arange(2 ** (8 * dtype.itemsize), dtype=UINT_OF_SIZE[dtype.itemsize]).view(dtype)


BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
