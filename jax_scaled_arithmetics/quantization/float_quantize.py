"""Simulated quantisation to a floating point format ("fake quantisation")."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..core import prng
from . import _bits
from ._bits import Rounding
from .formats import FloatFormat, PositFormat, get_format
from .posit import posit_quantize


def quantize_abs_bits(
    abs_bits: jax.Array,
    exp_offset: Any,
    fmt: FloatFormat,
    rounding: str,
    rbits: jax.Array | None,
) -> jax.Array:
    """Rounds finite ``|x| * 2**exp_offset`` onto the grid of `fmt` (no range handling)."""
    m, e = _bits.decompose(abs_bits)
    min_quantum_exp = fmt.min_exponent - (fmt.mantissa_bits if fmt.has_zero else 0)
    q, qexp = _bits.round_significand(
        m, e + exp_offset, fmt.mantissa_bits, min_quantum_exp, rounding, rbits
    )
    return _bits.compose(q, qexp)


def _is_e2m1(fmt: FloatFormat) -> bool:
    """Whether `fmt` has E2M1's values: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    return (
        fmt.exponent_bits == 2
        and fmt.mantissa_bits == 1
        and fmt.exponent_bias == 1
        and fmt.nan_encoding == "none"
        and fmt.has_zero
        and not fmt.unsigned
    )


def _e2m1_nearest(x: jax.Array) -> jax.Array:
    """float32 `x` rounded to nearest E2M1 (ties to even), saturated to +-6, NaN kept.

    The same values as the bit-level path, with a quarter of its instructions: on [0, 2)
    the grid step is 0.5, on [2, 4) 1, on [4, 6] 2, and scaling by a power of two is exact,
    so ``round(a / step) * step`` (`round`: half to even, as the grid's even codes are the
    multiples of twice the step) is the nearest-even grid value. E2M1 has no infinity:
    overflow saturates whatever `saturate`."""
    a = jnp.minimum(jnp.abs(x), jnp.float32(6.0))
    q = jnp.where(
        a < 2,
        jnp.round(a * 2) * jnp.float32(0.5),
        jnp.where(a < 4, jnp.round(a), jnp.round(a * jnp.float32(0.5)) * 2),
    )
    return jnp.where(jnp.isnan(x), x, jnp.copysign(q, x))


def quantize_float32(
    x: jax.Array, fmt: FloatFormat, rounding: str, saturate: bool, rbits: jax.Array | None
) -> jax.Array:
    if rounding == "nearest" and _is_e2m1(fmt):
        return _e2m1_nearest(x.astype(jnp.float32))
    bits = _bits.to_bits(x)
    sign = bits & _bits.u32(_bits.SIGN_MASK)
    a = bits & _bits.u32(_bits.ABS_MASK)
    is_nan = a > _bits.u32(_bits.INF_BITS)
    is_inf = a == _bits.u32(_bits.INF_BITS)
    r = quantize_abs_bits(a, 0, fmt, rounding, rbits)

    max_bits = _bits.u32(_bits.float_bits(fmt.max))
    if saturate or fmt.nan_encoding == "none":
        overflow_bits = max_bits
    elif fmt.has_inf:
        overflow_bits = _bits.u32(_bits.INF_BITS)
    else:
        overflow_bits = _bits.u32(_bits.QNAN_BITS)
    # IEEE 754: rounding toward zero never overflows a finite value past the largest one.
    finite_overflow_bits = max_bits if rounding == "toward_zero" else overflow_bits
    r = jnp.where(r > max_bits, finite_overflow_bits, r)
    r = jnp.where(is_inf, overflow_bits, r)
    if not fmt.has_zero:  # No zero: positive underflow goes to the smallest value.
        min_bits = _bits.u32(_bits.float_bits(fmt.min_normal))
        r = jnp.maximum(r, min_bits)

    if fmt.unsigned:
        # No sign bit: a negative value is NaN (one that rounds to zero too); -0 is +0 in
        # a format with zero, and +-0 are NaN in one without (float8_e8m0fnu).
        invalid = (sign != 0) & (a != 0) if fmt.has_zero else (sign != 0) | (a == 0)
        out = jnp.where(invalid, _bits.u32(_bits.QNAN_BITS), r)
    elif fmt.nan_encoding == "fnuz":  # No negative zero.
        out = jnp.where(r == 0, r, r | sign)
    else:
        out = r | sign
    out = jnp.where(is_nan, bits, out)
    return _bits.from_bits(out)


# Called as _float_quantize_ste((fmt, rounding, saturate), x, key).
@_bits.straight_through("fmt", "rounding", "saturate")
def _float_quantize_ste(
    x: jax.Array, key: Any, fmt: FloatFormat, rounding: str, saturate: bool
) -> jax.Array:
    rbits = prng.random_bits(key, x.shape) if rounding == "stochastic" else None
    return quantize_float32(x, fmt, rounding, saturate, rbits).astype(x.dtype)


def float_quantize(
    x: Any,
    format: str | FloatFormat | PositFormat | Any,
    rounding: Rounding = "nearest",
    saturate: bool = False,
    key: jax.Array | None = None,
) -> jax.Array:
    """Rounds `x` to the values of a float format, keeping the dtype of `x`.

    Posit formats (``"posit{nbits}_es{es}"`` or a :class:`PositFormat`) are accepted too
    and forwarded to :func:`posit_quantize` (`saturate` is then ignored: posits never
    overflow).

    The rounding is done exactly with integer operations on the float32 bits of `x`
    (float16 / bfloat16 / float8 inputs are converted to float32 exactly and the result is
    cast back to their dtype; integer inputs give float32). Subnormals of the format are
    simulated. Works under ``jax.jit`` and ``jax.vmap``.

    For every preset with an ml_dtypes dtype, ``rounding="nearest"`` and
    ``saturate=False`` give bit-exactly the numpy / ml_dtypes cast
    ``x.astype(float32).astype(format.dtype).astype(x.dtype)``, except that NaN stays NaN
    for formats without NaN (ml_dtypes turns NaN into a zero there).

    Special values and range:

    * NaN inputs always give NaN.
    * ``saturate=False`` (ml_dtypes' casting behaviour): values that round above
      ``format.max`` and infinities become ±inf in formats with infinities, NaN in
      formats with NaN but no infinities (e.g. float8_e4m3fn), and ±max in formats
      with neither (float6 / float4).
    * ``saturate=True``: values that round above ``format.max`` *and* infinities are
      clamped to ±max, so every non-NaN output is finite.
    * ``rounding="toward_zero"`` never rounds a finite value past ±max (as in IEEE 754),
      whatever `saturate`; ``"stochastic"`` overflows like ``"nearest"`` when it rounds up
      past ±max.
    * "fnuz" formats have no negative zero: negative values rounding to zero give +0.
    * float8_e8m0fnu (unsigned, no zero): negative inputs and ±0 give NaN, positive
      values below its smallest value ``2**-127`` give ``2**-127``; with nearest rounding,
      ties round up (there is no mantissa to make even), as in ml_dtypes 0.7. (XLA's
      conversion, and ml_dtypes before 0.7, round all of ``(2**-127, 2**-126)`` up to
      ``2**-126``.)
    * float8_e5m3fnu (unsigned, with zero): negative inputs give NaN (those that round to
      zero too, as in ml_dtypes), ``-0`` gives ``+0``; overflow gives NaN (the format has
      no infinity), or the largest value, 114688, with ``saturate=True``.

    Gradient: straight-through (identity), implemented with ``jax.custom_jvp``; the
    tangent of `x` passes through unchanged, whatever the rounding and saturation.

    Args:
        x: Input array.
        format: A preset name, dtype, :class:`FloatFormat` or posit format (see
            :func:`get_format`).
        rounding: ``"nearest"`` (round to nearest, ties to even), ``"toward_zero"``
            (truncation) or ``"stochastic"`` (rounds up in magnitude with probability
            ``(|x| - lower) / (upper - lower)`` between the two neighbours: unbiased).
        saturate: Whether to clamp overflow to ±max (see above).
        key: PRNG key, required for (and only used by) ``rounding="stochastic"``.

    Returns:
        The quantised array, with the dtype and shape of `x`.

    Raises:
        ValueError: unknown format or rounding mode, or a stochastic rounding without key.
        TypeError: for non-real inputs or float64 inputs.

    Examples:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([0.3, 1.0625, 1.1875, 500.0, -1e-4])
        >>> float_quantize(x, "float8_e4m3fn")
        Array([ 0.3125,  1.    ,  1.25  ,     nan, -0.    ], dtype=float32)
        >>> float_quantize(x, "float8_e4m3fn", saturate=True)[3]
        Array(448., dtype=float32)
        >>> float_quantize(x, "float8_e4m3fn", rounding="toward_zero")[:3]
        Array([0.28125, 1.     , 1.125  ], dtype=float32)
        >>> float_quantize(x, "posit8_es0").tolist()  # posits saturate at maxpos and minpos
        [0.296875, 1.0625, 1.1875, 64.0, -0.015625]
    """
    fmt = get_format(format)
    if isinstance(fmt, PositFormat):
        return posit_quantize(x, fmt.nbits, fmt.es, rounding, key)
    x, mode, key = _bits.prepare(x, "float_quantize", rounding, key)
    return _float_quantize_ste((fmt, mode, bool(saturate)), x, key)
