"""Simulated quantisation to signed fixed point."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .. import _deprecation
from ..core import prng
from . import _bits
from ._bits import Rounding

MAX_WORD_BITS = 25
"""Widest word: every value ``n * 2**-frac_bits`` with ``|n| <= 2**24`` is exact in float32."""
MAX_FRAC_BITS = 149
"""Finest step: ``2**-149`` is the smallest float32."""


def _check_width(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _fixed_point_f32(
    x: jax.Array,
    word_bits: int,
    frac_bits: int,
    rounding: str,
    clamp: bool,
    rbits: jax.Array | None,
) -> jax.Array:
    bits = _bits.to_bits(x)
    sign = bits & _bits.u32(_bits.SIGN_MASK)
    a = bits & _bits.u32(_bits.ABS_MASK)
    is_nan = a > _bits.u32(_bits.INF_BITS)
    is_inf = a == _bits.u32(_bits.INF_BITS)
    m, e = _bits.decompose(a)
    q, qexp = _bits.round_significand(m, e, 23, -frac_bits, rounding, rbits)
    r = jnp.where(is_inf, a, _bits.compose(q, qexp))
    if clamp:
        pos_max = (2 ** (word_bits - 1) - 1) * 2.0**-frac_bits
        neg_max = 2.0 ** (word_bits - 1 - frac_bits)
        limit = jnp.where(
            sign != 0,
            _bits.u32(_bits.float_bits(neg_max)),
            _bits.u32(_bits.float_bits(pos_max)),
        )
        r = jnp.minimum(r, limit)
    out = jnp.where(r == 0, r, r | sign)  # Fixed point has no negative zero.
    out = jnp.where(is_nan, bits, out)
    return _bits.from_bits(out)


# Called as _fixed_point_ste((word_bits, frac_bits, rounding, clamp), x, key).
@_bits.straight_through("word_bits", "frac_bits", "rounding", "clamp")
def _fixed_point_ste(
    x: jax.Array, key: Any, word_bits: int, frac_bits: int, rounding: str, clamp: bool
) -> jax.Array:
    rbits = prng.random_bits(key, x.shape) if rounding == "stochastic" else None
    return _fixed_point_f32(x, word_bits, frac_bits, rounding, clamp, rbits).astype(x.dtype)


def fixed_point_quantize(
    x: Any,
    word_bits: int,
    frac_bits: int,
    rounding: Rounding = "nearest",
    saturate: bool = True,
    key: jax.Array | None = None,
    *,
    clamp: bool | None = None,
) -> jax.Array:
    """Rounds `x` to signed (two's complement) fixed point, keeping the dtype of `x`.

    The grid is ``n * 2**-frac_bits`` for integers ``n`` in
    ``[-2**(word_bits - 1), 2**(word_bits - 1) - 1]``. Rounding is exact (integer
    operations on the float32 bits); float16 / bfloat16 inputs are computed in float32
    and cast back, so their result is the fixed point value rounded to their dtype.

    * ``saturate=True`` clamps to ``[-2**(word_bits - 1 - frac_bits),
      (2**(word_bits - 1) - 1) * 2**-frac_bits]`` (infinities included).
    * ``saturate=False`` only rounds to the step ``2**-frac_bits``: out-of-range values
      are left out of range (no wrap-around) and infinities stay infinite.
    * NaN stays NaN, and results are never negative zero.

    Gradient: straight-through (identity) via ``jax.custom_jvp``, also where clamped.

    Args:
        x: Input array.
        word_bits: Total bits including the sign, 1 to 25.
        frac_bits: Fractional bits, 0 to 149.
        rounding: ``"nearest"`` (ties to even), ``"toward_zero"`` or ``"stochastic"``.
        saturate: Whether to clamp to the representable range (the keyword every
            quantiser uses; ``float_quantize``'s default is False).
        key: PRNG key, required for (and only used by) ``rounding="stochastic"``.
        clamp: Deprecated name of `saturate`.

    Returns:
        The quantised array, with the dtype and shape of `x`.

    Raises:
        ValueError: for invalid widths, an unknown rounding mode or a missing key.
        TypeError: for non-real inputs or float64 inputs.

    Examples:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([0.3, -0.3, 0.375, 9.0, -9.0])
        >>> fixed_point_quantize(x, word_bits=8, frac_bits=4)
        Array([ 0.3125, -0.3125,  0.375 ,  7.9375, -8.    ], dtype=float32)
        >>> fixed_point_quantize(x, 8, 2, rounding="toward_zero", saturate=False)
        Array([ 0.25, -0.25,  0.25,  9.  , -9.  ], dtype=float32)
    """
    if clamp is not None:
        _deprecation.warn_renamed(
            "fixed_point_quantize(clamp=...)", "fixed_point_quantize(saturate=...)"
        )
        saturate = clamp
    word_bits = _check_width("word_bits", word_bits, 1, MAX_WORD_BITS)
    frac_bits = _check_width("frac_bits", frac_bits, 0, MAX_FRAC_BITS)
    x, mode, key = _bits.prepare(x, "fixed_point_quantize", rounding, key)
    return _fixed_point_ste((word_bits, frac_bits, mode, bool(saturate)), x, key)
