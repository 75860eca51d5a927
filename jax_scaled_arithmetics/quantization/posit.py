"""Posits: exact simulation of ``posit<nbits, es>`` rounding and codes in float32."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import prng
from . import _bits
from ._bits import Rounding, shl, shr, u32
from .formats import PositFormat


def _format(nbits: Any, es: Any) -> PositFormat:
    return PositFormat(nbits, es)  # validates: ValueError naming the allowed range


def _encode_f32(
    x: jax.Array, nbits: int, es: int, rounding: str, rbits: jax.Array | None
) -> jax.Array:
    """Float32 `x` -> posit codes (uint32, low `nbits` bits, two's complement)."""
    n, body = nbits, nbits - 1  # body: the bits after the sign
    bits = _bits.to_bits(x)
    a = bits & u32(_bits.ABS_MASK)
    negative = bits != a
    m, e = _bits.decompose(a)
    msb = 31 - lax.clz(m).astype(jnp.int32)
    scale = e + msb  # floor(log2|x|)
    k = lax.shift_right_arithmetic(scale, jnp.int32(es))  # regime: |x| in [useed**k, useed**(k+1))
    exponent = (scale & (2**es - 1)).astype(jnp.uint32)
    frac = shl(m, 23 - msb) & u32(0x7FFFFF)  # fraction bits below the leading one
    tail_bits = es + 23
    tail = shl(exponent, jnp.full_like(scale, 23)) | frac  # exponent field, then fraction

    big = k >= n - 2  # |x| >= maxpos
    small = k < -(n - 2)  # |x| < minpos
    k = jnp.clip(k, -(n - 2), n - 3)
    regime_bits = jnp.where(k >= 0, k + 2, 1 - k)  # run and terminating bit: <= body
    regime = jnp.where(k >= 0, shl(shl(u32(1), k + 1) - 1, jnp.ones_like(k)), u32(1))
    room = body - regime_bits  # bits left for the exponent and fraction fields
    dropped = tail_bits - room  # tail bits that do not fit (none if <= 0)
    kept = jnp.where(dropped > 0, shr(tail, dropped), shl(tail, -dropped))
    code = shl(regime, room) | kept  # the truncated pattern (the neighbour towards zero)

    if rounding == "nearest":  # ties to even, on the bit string
        guard = jnp.where(dropped > 0, shr(tail, dropped - 1) & 1, u32(0))
        sticky = (tail & (shl(u32(1), dropped - 1) - 1)) != 0
        up = (guard == 1) & (sticky | ((code & 1) == 1)) & (dropped > 0)
        small_code = u32(1)
    elif rounding == "toward_zero":
        up = jnp.zeros_like(negative)
        small_code = u32(0)
    else:  # stochastic: up with probability (|x| - lower) / (upper - lower)
        assert rbits is not None
        # The cut falls in the fraction field: the two neighbours are one quantum apart
        # and the dropped bits are the distance to the lower one, in 2**dropped quanta.
        low = tail & (shl(u32(1), dropped) - 1)
        up_fraction = shr(low + shr(rbits, 32 - dropped), dropped) == 1
        # The cut falls in the exponent field: lower = 2**p, upper = 2**(p + j) with
        # j = 2**(es - room), and |x| = 2**(p + d) * 1.f: up iff
        # u * (2**j - 1) < 2**d * 1.f - 1, with u of 24 random bits.
        cut = es - room
        d = exponent & (shl(u32(1), cut) - 1)
        excess = shl(frac | u32(0x800000), d.astype(jnp.int32)) - u32(0x800000)
        span = shl(u32(1), lax.shift_left(jnp.ones_like(cut), jnp.maximum(cut, 0))) - 1
        up_exponent = shr(rbits, jnp.full_like(cut, 8)) * span < 2 * excess
        up = jnp.where(cut > 0, up_exponent, up_fraction & (dropped > 0))
        # Below minpos the neighbours are 0 and minpos: up with probability |x| / minpos.
        shift = e + 2**es * (n - 2) + 32
        threshold = jnp.where(shift >= 0, shl(m, shift), shr(m, -shift))
        small_code = (rbits < threshold).astype(jnp.uint32)

    magnitude = code + up.astype(jnp.uint32)
    magnitude = jnp.where(big, u32(2 ** (n - 1) - 1), magnitude)
    magnitude = jnp.where(small, small_code, magnitude)
    magnitude = jnp.where(a == 0, u32(0), magnitude)
    mask = u32(2**n - 1)
    out = jnp.where(negative, (mask + 1 - magnitude) & mask, magnitude)
    return jnp.where(a >= u32(_bits.INF_BITS), u32(2 ** (n - 1)), out)  # NaN, inf: NaR


def _decode_f32(codes: jax.Array, nbits: int, es: int) -> jax.Array:
    """Posit codes (uint32, only the low `nbits` bits are read) -> float32 values."""
    n = nbits
    mask = u32(2**n - 1)
    c = codes & mask
    nar = c == u32(2 ** (n - 1))
    negative = shr(c, jnp.full(c.shape, n - 1, jnp.int32)) == 1
    magnitude = jnp.where(negative, (mask + 1 - c) & mask, c)
    w = shl(magnitude, jnp.full(c.shape, 33 - n, jnp.int32))  # body, left-aligned
    first = shr(w, jnp.full(c.shape, 31, jnp.int32))
    run = jnp.where(first == 1, lax.clz(~w), lax.clz(w)).astype(jnp.int32)
    run = jnp.minimum(run, n - 1)
    k = jnp.where(first == 1, run - 1, -run)
    rest = jnp.where(run + 1 >= 32, u32(0), shl(w, run + 1))  # after the regime
    if es:
        exponent = shr(rest, jnp.full(c.shape, 32 - es, jnp.int32)).astype(jnp.int32)
        rest = shl(rest, jnp.full(c.shape, es, jnp.int32))
    else:
        exponent = jnp.zeros(c.shape, jnp.int32)
    frac = shr(rest, jnp.full(c.shape, 9, jnp.int32))
    biased = (k * 2**es + exponent + 127).astype(jnp.uint32)
    out = shl(biased, jnp.full(c.shape, 23, jnp.int32)) | frac
    out = jnp.where(magnitude == 0, u32(0), out)
    out = jnp.where(negative, out | u32(_bits.SIGN_MASK), out)
    return _bits.from_bits(jnp.where(nar, u32(_bits.QNAN_BITS), out))


@functools.partial(jax.jit, static_argnames=("nbits", "es", "rounding"))
def _encode_jit(x: jax.Array, key: Any, nbits: int, es: int, rounding: str) -> jax.Array:
    rbits = prng.random_bits(key, x.shape) if rounding == "stochastic" else None
    return _encode_f32(x.astype(jnp.float32), nbits, es, rounding, rbits)


# Called as _posit_quantize_ste((nbits, es, rounding), x, key).
@_bits.straight_through("nbits", "es", "rounding")
def _posit_quantize_ste(x: jax.Array, key: Any, nbits: int, es: int, rounding: str) -> jax.Array:
    codes = _encode_jit(x, key, nbits, es, rounding)
    return _decode_f32(codes, nbits, es).astype(x.dtype)


def posit_quantize(
    x: Any,
    nbits: int,
    es: int,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
) -> jax.Array:
    """Rounds `x` to the values of ``posit<nbits, es>``, keeping the dtype of `x`.

    Rounding follows the posit standard (2022), done exactly with integer operations on
    the float32 bits of `x`, and is bit-exact against SoftPosit, the reference
    implementation, for float32 inputs:

    * ``"nearest"`` rounds the bit string (regime, exponent, fraction) to nearest, ties to
      even. Where the cut falls in the fraction field this is the arithmetic midpoint;
      where it falls in the exponent field (next to ``maxpos`` and ``minpos``, where
      neighbours are more than a factor 2 apart) the tie is the geometric mean of the
      neighbours, e.g. ``2**22`` between ``2**20`` and ``2**24`` in posit8_es2.
      Non-zero values never round to 0 or overflow: below ``minpos`` they give ``±minpos``,
      above ``maxpos`` ``±maxpos``.
    * ``"toward_zero"`` truncates the magnitude: values below ``minpos`` give 0, values
      above ``maxpos`` give ``±maxpos`` (as :func:`float_quantize`, it never overflows).
    * ``"stochastic"`` rounds the magnitude up with probability ``(|x| - lower) / (upper -
      lower)`` between its two neighbouring posits (unbiased; 0 and ``minpos`` are the
      neighbours below ``minpos``, and values above ``maxpos`` give ``±maxpos``). Where
      the neighbours are more than a factor 2 apart the probability is resolved to
      ``2**-24``.
    * 0 gives 0 (posits have no negative zero); ±inf and NaN give NaR, returned as NaN.

    float16 / bfloat16 inputs are rounded in float32 and the posit value is then cast to
    their dtype (posit16_es1 values beyond float16's range become inf there); integer
    inputs give float32. Works under ``jax.jit`` and ``jax.vmap``. Every
    ``posit<nbits, es>`` whose values float32 holds exactly is supported: ``es`` from 0
    to 3 and ``nbits`` from 2 to 26, 27, 28 and 17 for ``es`` = 0, 1, 2, 3
    (:data:`~jax_scaled_arithmetics.quantization.formats.POSIT_MAX_NBITS`). Format names
    ``"posit{nbits}_es{es}"`` work wherever a format is accepted (``float_quantize``,
    ``jsa.ops.reduce_precision_on_forward``, ...).

    Gradient: straight-through (identity), as :func:`float_quantize`.

    Args:
        x: Input array.
        nbits: Posit width in bits.
        es: Exponent field width.
        rounding: ``"nearest"``, ``"toward_zero"`` or ``"stochastic"``.
        key: PRNG key, required for (and only used by) ``rounding="stochastic"``.

    Returns:
        The quantised array, with the dtype and shape of `x`.

    Raises:
        ValueError: unsupported `nbits` / `es` (the message gives the range), unknown
            rounding mode, or stochastic rounding without a key.
        TypeError: for non-real inputs or float64 inputs.

    Examples:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([0.3, 1.03, -3.0, 100.0, 1e-9, 0.0, jnp.inf])
        >>> posit_quantize(x, 8, 0).tolist()  # maxpos 64, minpos 1/64
        [0.296875, 1.03125, -3.0, 64.0, 0.015625, 0.0, nan]
        >>> y = posit_quantize(jnp.array([2.0**22, 2.0**22 * 1.01]), 8, 2)  # geometric tie
        >>> jnp.log2(y).tolist()  # 2**20 and 2**24 are neighbours
        [20.0, 24.0]
    """
    fmt = _format(nbits, es)
    x, mode, key = _bits.prepare(x, "posit_quantize", rounding, key)
    return _posit_quantize_ste((fmt.nbits, fmt.es, mode), x, key)


def posit_to_bits(
    x: Any,
    nbits: int,
    es: int,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
) -> jax.Array:
    """The ``posit<nbits, es>`` bit patterns of `x`, rounded as :func:`posit_quantize`.

    Codes are the standard two's complement patterns: 0 is ``0``, NaR (from NaN and
    ±inf) is ``1 << (nbits - 1)``, ``-p`` is ``-code(p) mod 2**nbits``, and the codes of
    the positive values increase with the value.

    Args:
        x: Input array (float up to 32 bits, or integer).
        nbits: Posit width in bits.
        es: Exponent field width.
        rounding: ``"nearest"``, ``"toward_zero"`` or ``"stochastic"``.
        key: PRNG key, required for (and only used by) ``rounding="stochastic"``.

    Returns:
        An array of the shape of `x`: uint8 for ``nbits <= 8``, uint16 for ``nbits <= 16``,
        uint32 beyond.

    Raises:
        ValueError: as :func:`posit_quantize`.
        TypeError: for non-real inputs or float64 inputs.

    Examples:
        >>> import jax.numpy as jnp
        >>> posit_to_bits(jnp.array([1.0, -1.0, 0.0, jnp.nan, 64.0, 1e-9]), 8, 0)
        Array([ 64, 192,   0, 128, 127,   1], dtype=uint8)
    """
    fmt = _format(nbits, es)
    x, mode, key = _bits.prepare(x, "posit_to_bits", rounding, key)
    return _encode_jit(x, key, fmt.nbits, fmt.es, mode).astype(fmt.code_dtype)


@functools.partial(jax.jit, static_argnames=("nbits", "es"))
def _decode_jit(codes: jax.Array, nbits: int, es: int) -> jax.Array:
    return _decode_f32(codes.astype(jnp.uint32), nbits, es)


def posit_from_bits(codes: Any, nbits: int, es: int) -> jax.Array:
    """Float32 values of ``posit<nbits, es>`` bit patterns (NaR gives NaN).

    Only the low `nbits` bits of each code are read, so signed integer codes (e.g.
    int8 for posit8) work too.

    Args:
        codes: Integer array of bit patterns.
        nbits: Posit width in bits.
        es: Exponent field width.

    Returns:
        A float32 array of the shape of `codes` (exact: every posit value is a float32).

    Raises:
        ValueError: unsupported `nbits` / `es`.
        TypeError: for non-integer codes.

    Examples:
        >>> import jax.numpy as jnp
        >>> posit_from_bits(jnp.array([64, 192, 0, 128, 127, 1], jnp.uint8), 8, 0).tolist()
        [1.0, -1.0, 0.0, nan, 64.0, 0.015625]
    """
    fmt = _format(nbits, es)
    codes = jnp.asarray(codes)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise TypeError(f"posit_from_bits expects integer codes, got {codes.dtype.name}")
    return _decode_jit(codes, fmt.nbits, fmt.es)


POSIT_VALUES_MAX_NBITS = 16


@functools.cache
def _posit_values(nbits: int, es: int) -> np.ndarray:
    codes = np.arange(2**nbits, dtype=np.uint32)
    codes = codes[codes != 2 ** (nbits - 1)]  # NaR
    values = np.sort(np.asarray(posit_from_bits(codes, nbits, es)))
    values.flags.writeable = False
    return values


def posit_values(nbits: int, es: int) -> np.ndarray:
    """The ``2**nbits - 1`` finite values of ``posit<nbits, es>``, sorted (0 included).

    Usable as a table for :func:`~jax_scaled_arithmetics.quantization.table_quantize`.

    Args:
        nbits: Posit width in bits, at most 16 here.
        es: Exponent field width.

    Returns:
        A new float32 numpy array.

    Raises:
        ValueError: unsupported `nbits` / `es`, or ``nbits > 16``.

    Examples:
        >>> posit_values(4, 0).tolist()
        [-4.0, -2.0, -1.5, -1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0]
    """
    fmt = _format(nbits, es)
    if fmt.nbits > POSIT_VALUES_MAX_NBITS:
        raise ValueError(
            f"posit_values lists posits of at most {POSIT_VALUES_MAX_NBITS} bits "
            f"(2**16 - 1 values), got nbits={nbits}"
        )
    return _posit_values(fmt.nbits, fmt.es).copy()
