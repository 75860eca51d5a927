"""Power-of-two helpers: rounding of scales, and splitting a value into a power of two."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .config import Pow2RoundMode, get_autoscale_config
from .types import Array

__all__ = [
    "pow2_floor",
    "pow2_round",
    "pow2_round_down",
    "pow2_round_up",
    "pow2_decompose",
    "static_pow2",
]


def _as_float_array(x: Array) -> Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    return x


_EXPONENT_MASK = np.uint32(0x7F800000)
_MANTISSA_MASK = np.uint32(0x007FFFFF)
_EXPONENT_ONE = np.uint32(0x00800000)


def pow2_floor(x: Array) -> Array:
    """The power of two at or below a positive normal float32 `x` (three operations).

    The exponent bits of `x` alone: 0 for 0 and subnormals, inf for inf and NaN. For
    scales, which are positive normal numbers; :func:`pow2_round_down` handles the rest.
    """
    bits = lax.bitcast_convert_type(x, jnp.uint32) & _EXPONENT_MASK
    return lax.bitcast_convert_type(bits, jnp.float32)


def _pow2_bits(x: Array, round_up: bool) -> Array:
    """Power-of-two rounding of `|x|` by float32 bit manipulation (exact, cheap)."""
    x = _as_float_array(x)
    dtype = x.dtype
    magnitude = lax.abs(x)
    if magnitude.dtype != jnp.float32:
        magnitude = lax.convert_element_type(magnitude, jnp.float32)
    bits = lax.bitcast_convert_type(magnitude, jnp.uint32)
    exponent = bits & _EXPONENT_MASK
    if round_up:
        has_mantissa = (bits & _MANTISSA_MASK) != 0
        up = has_mantissa & (exponent != 0)
        exponent = lax.select(up, exponent + _EXPONENT_ONE, exponent)
    out = lax.bitcast_convert_type(exponent, jnp.float32)
    # NaN stays NaN (its exponent bits alone would read as inf); a subnormal float32 stays
    # itself (not a power of two, but never rounded to zero).
    keep = (magnitude != magnitude) | (exponent == 0)
    out = lax.select(keep, magnitude, out)
    return out.astype(dtype)


def pow2_round_down(x: Array) -> Array:
    """The largest power of two not above `|x|`; 0, inf and NaN map to themselves.

    Scales are float32: a value below the smallest normal float32 (2^-126) is kept as is.

    Examples:
        >>> from jax_scaled_arithmetics.core.pow2 import pow2_round_down
        >>> pow2_round_down(3.0)
        Array(2., dtype=float32)
    """
    return _pow2_bits(x, round_up=False)


def pow2_round_up(x: Array) -> Array:
    """The smallest power of two not below `|x|`; 0, inf and NaN map to themselves.

    Examples:
        >>> from jax_scaled_arithmetics.core.pow2 import pow2_round_up
        >>> pow2_round_up(3.0)
        Array(4., dtype=float32)
    """
    return _pow2_bits(x, round_up=True)


def pow2_round(x: Array, mode: Pow2RoundMode | None = None) -> Array:
    """Round `|x|` to a power of two with `mode` (default: the `AutoScaleConfig`'s).

    Examples:
        >>> from jax_scaled_arithmetics.core.pow2 import pow2_round
        >>> import jax_scaled_arithmetics as jsa
        >>> pow2_round(5.0, jsa.Pow2RoundMode.UP)
        Array(8., dtype=float32)
    """
    mode = get_autoscale_config().rounding_mode if mode is None else mode
    if mode == Pow2RoundMode.DOWN:
        return pow2_round_down(x)
    if mode == Pow2RoundMode.UP:
        return pow2_round_up(x)
    return jnp.abs(_as_float_array(x))


def pow2_decompose(x: Array, mode: Pow2RoundMode = Pow2RoundMode.DOWN) -> tuple[Array, Array]:
    """Split `x` into `(pow2, remainder)` with `x == pow2 * remainder` exactly.

    `pow2` is `|x|` rounded to a power of two (1 where `x` is 0, inf or NaN).

    Examples:
        >>> from jax_scaled_arithmetics.core.pow2 import pow2_decompose
        >>> pow2_decompose(-6.0)
        (Array(4., dtype=float32), Array(-1.5, dtype=float32))
    """
    x = _as_float_array(x)
    p = pow2_round(x, mode)
    p = jnp.where(jnp.isfinite(p) & (p != 0), p, jnp.ones_like(p))
    return p, x / p


def static_pow2(value: float, mode: Pow2RoundMode | None = None) -> float:
    """Power-of-two rounding of a Python/NumPy scalar, computed at trace time."""
    mode = get_autoscale_config().rounding_mode if mode is None else mode
    value = abs(float(value))
    if value == 0 or not np.isfinite(value) or mode == Pow2RoundMode.NONE:
        return value
    mantissa, exponent = np.frexp(value)
    if mode == Pow2RoundMode.UP and mantissa != 0.5:
        return float(np.ldexp(1.0, int(exponent)))
    return float(np.ldexp(1.0, int(exponent) - 1))
