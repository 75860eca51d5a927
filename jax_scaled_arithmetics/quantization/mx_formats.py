"""OCP MX v1.0 formats: their names and element formats, E8M0 scales and the roundings
of block scales."""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from . import _bits
from ._mx_common import E8M0_BIAS, E8M0_NAN, e8m0_codes, e8m0_from_codes, floor_log2
from .formats import FloatFormat, get_format

MX_FORMATS: Mapping[str, str] = types.MappingProxyType(
    {
        "mxfp8_e4m3": "float8_e4m3fn",
        "mxfp8_e5m2": "float8_e5m2",
        "mxfp6_e2m3": "float6_e2m3fn",
        "mxfp6_e3m2": "float6_e3m2fn",
        "mxfp4_e2m1": "float4_e2m1fn",
    }
)
"""The concrete formats of OCP MX v1.0, by name: their element format (read-only).

Every one has E8M0 scales shared by blocks of 32 elements. The names are accepted
wherever an MX element format is (:func:`block_quantize`, :func:`mx_element_format`).

Examples:
    >>> import jax_scaled_arithmetics as jsa
    >>> jsa.quantization.MX_FORMATS["mxfp4_e2m1"]
    'float4_e2m1fn'
"""

MX_FORMAT_ALIASES: Mapping[str, str] = types.MappingProxyType(
    {"mxfp8": "mxfp8_e4m3", "mxfp6": "mxfp6_e2m3", "mxfp4": "mxfp4_e2m1"}
)
"""The family names of the specifications and vendors' documents, as the concrete format
each means here (read-only): MXFP4 has one element format; for MXFP8 and MXFP6, the
variant with more mantissa bits (E4M3, E2M3), the one used for weights and activations.
The other variants are named in full (``"mxfp8_e5m2"``, ``"mxfp6_e3m2"``).

Examples:
    >>> import jax_scaled_arithmetics as jsa
    >>> jsa.quantization.MX_FORMAT_ALIASES["mxfp8"]
    'mxfp8_e4m3'
"""


def mx_element_format(format: str | FloatFormat | Any) -> FloatFormat:
    """The element format of an MX format name, or an element format itself.

    Args:
        format: An OCP MX name from :data:`MX_FORMATS` (``"mxfp8_e4m3"``, ...) or
            :data:`MX_FORMAT_ALIASES` (``"mxfp4"``, ...), or an element format: a preset
            name, dtype or :class:`FloatFormat` (signed, with a zero).

    Returns:
        The element :class:`FloatFormat`.

    Raises:
        ValueError: for an unknown name (the message lists the MX names and the float
            formats) or a format that cannot hold block elements.

    Examples:
        >>> mx_element_format("mxfp4_e2m1").name
        'float4_e2m1fn'
        >>> mx_element_format("mxfp8").name
        'float8_e4m3fn'
        >>> mx_element_format("float8_e5m2").max
        57344.0
    """
    if isinstance(format, str):
        format = MX_FORMAT_ALIASES.get(format.lower(), format)
        if format.lower() in MX_FORMATS:
            return _check_element_format(get_format(MX_FORMATS[format.lower()]))
    try:
        fmt = get_format(format)
    except ValueError as e:
        names = ", ".join([*MX_FORMATS, *MX_FORMAT_ALIASES])
        raise ValueError(
            f"Unknown MX format {format!r}: expected one of {names} or an element format ({e})"
        ) from None
    return _check_element_format(fmt)


def _check_element_format(fmt: Any) -> FloatFormat:
    if not isinstance(fmt, FloatFormat):
        raise ValueError(f"block element format must be a float format, got {fmt.name!r}")
    if fmt.unsigned or not fmt.has_zero:
        raise ValueError(f"block element format must be signed and have a zero, got {fmt.name!r}")
    return fmt


def as_e8m0(scale: Any, rounding: Literal["up", "down"] = "up") -> jax.Array:
    """Converts float32 scales (ideally powers of two) to float8_e8m0fnu.

    E8M0 holds ``2**k`` for ``k`` in ``[-127, 127]`` and NaN, nothing else. A power of two
    in that range converts exactly; other positive values have their exponent rounded
    ``"up"`` (``ceil(log2(scale))``, the default, so the E8M0 scale is never smaller than
    `scale`) or ``"down"`` (``floor``), then clamped to
    ``[-127, 127]``. ``±0`` gives the smallest scale ``2**-127`` (there is no zero);
    negative values, ``+inf`` and NaN give NaN.

    Args:
        scale: Array of scales (converted to float32).
        rounding: ``"up"`` or ``"down"``.

    Returns:
        A ``float8_e8m0fnu`` array of the same shape.

    Raises:
        ValueError: for an unknown rounding.

    Examples:
        >>> import jax.numpy as jnp
        >>> s = as_e8m0(jnp.array([0.25, 3.0, -1.0]))
        >>> s.dtype
        dtype(float8_e8m0fnu)
        >>> from_e8m0(s)
        Array([0.25, 4.  ,  nan], dtype=float32)
        >>> from_e8m0(as_e8m0(jnp.array([0.0, 1e-40])))  # 2**-127, the smallest scale
        Array([5.877472e-39, 5.877472e-39], dtype=float32)
        >>> from_e8m0(as_e8m0(jnp.array([3.0]), rounding="down"))
        Array([2.], dtype=float32)
    """
    if rounding not in ("up", "down"):
        raise ValueError(f"Unknown rounding {rounding!r} for as_e8m0; expected 'up' or 'down'")
    return _as_e8m0_impl(jnp.asarray(scale, dtype=jnp.float32), rounding)


@functools.partial(jax.jit, static_argnames=("rounding",))
def _as_e8m0_impl(scale: jax.Array, rounding: str) -> jax.Array:
    bits = _bits.to_bits(scale)
    a = bits & _bits.u32(_bits.ABS_MASK)
    exp = floor_log2(a)
    if rounding == "up":
        m, _ = _bits.decompose(a)
        exact = (m & (m - _bits.u32(1))) == 0  # the significand is a power of two
        exp = exp + jnp.where(exact, 0, 1)
    codes = jnp.clip(exp, -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    codes = jnp.where(a == 0, 0, codes)
    invalid = (a >= _bits.u32(_bits.INF_BITS)) | ((bits != a) & (a != 0))
    codes = jnp.where(invalid, E8M0_NAN, codes)
    return e8m0_from_codes(codes)


def from_e8m0(scale: Any) -> jax.Array:
    """Converts float8_e8m0fnu scales (or their raw uint8 codes) to float32.

    Code ``c`` is ``2**(c - 127)``, code 255 is NaN. The result is exact, including
    ``2**-127`` (a float32 subnormal).

    Args:
        scale: A ``float8_e8m0fnu`` array, or a ``uint8`` array of codes.

    Returns:
        A float32 array of the same shape.

    Raises:
        TypeError: for other dtypes.

    Examples:
        >>> import jax.numpy as jnp
        >>> from_e8m0(jnp.array([127, 130, 255], dtype=jnp.uint8))
        Array([ 1.,  8., nan], dtype=float32)
    """
    return _from_e8m0_impl(e8m0_codes(jnp.asarray(scale)))


@jax.jit
def _from_e8m0_impl(codes: jax.Array) -> jax.Array:
    bits = jnp.where(
        codes == 0,
        _bits.u32(0x00400000),
        lax.shift_left(codes.astype(jnp.uint32), _bits.u32(23)),
    )
    bits = jnp.where(codes == E8M0_NAN, _bits.u32(_bits.QNAN_BITS), bits)
    return _bits.from_bits(bits)


ScaleRounding = Literal["floor", "up"]
SCALE_ROUNDINGS: tuple[str, ...] = ("floor", "up")
"""Block-scale rounding: ``"floor"`` is OCP MX v1.0's ``2**(floor(log2 amax) - emax)`` (a
block's largest elements may saturate to the element max); ``"up"`` the smallest power of
two at which the block's largest magnitude fits the element format (Mishra et al. 2025
found the floor rule can make MXFP4 and MXFP8 training diverge, and rounding up fixes it)."""
