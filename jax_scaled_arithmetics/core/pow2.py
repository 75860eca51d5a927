"""Power-of-two helpers: rounding of scales, and splitting a value into a power of two."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from .config import Pow2RoundMode, get_autoscale_config

Array = Any

__all__ = ["pow2_round", "pow2_round_down", "pow2_round_up", "pow2_decompose", "static_pow2"]


def _as_float_array(x: Array) -> Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    return x


def pow2_round_down(x: Array) -> Array:
    """The largest power of two not above `|x|`; 0, inf and NaN map to themselves.

    Examples:
        >>> from jax_scaled_arithmetics.core.pow2 import pow2_round_down
        >>> pow2_round_down(3.0)
        Array(2., dtype=float32)
    """
    x = _as_float_array(x)
    abs_x = jnp.abs(x)
    mantissa, exponent = jnp.frexp(abs_x)
    del mantissa
    out = jnp.ldexp(jnp.ones_like(abs_x), exponent - 1)
    return jnp.where(jnp.isfinite(abs_x) & (abs_x != 0), out, abs_x)


def pow2_round_up(x: Array) -> Array:
    """The smallest power of two not below `|x|`; 0, inf and NaN map to themselves.

    Examples:
        >>> from jax_scaled_arithmetics.core.pow2 import pow2_round_up
        >>> pow2_round_up(3.0)
        Array(4., dtype=float32)
    """
    x = _as_float_array(x)
    abs_x = jnp.abs(x)
    mantissa, exponent = jnp.frexp(abs_x)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    out = jnp.ldexp(jnp.ones_like(abs_x), exponent)
    return jnp.where(jnp.isfinite(abs_x) & (abs_x != 0), out, abs_x)


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
