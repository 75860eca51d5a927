"""Block scaled ("microscaling", OCP MX v1.0) quantisation."""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _bits
from ._bits import Rounding
from .float_quantize import quantize_abs_bits
from .formats import FloatFormat, get_format

E8M0_NAN = 0xFF
E8M0_BIAS = 127

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
"""


def mx_element_format(format: str | FloatFormat | Any) -> FloatFormat:
    """The element format of an MX format name, or an element format itself.

    Args:
        format: An OCP MX name from :data:`MX_FORMATS` (``"mxfp8_e4m3"``, ...), or an
            element format: a preset name, dtype or :class:`FloatFormat` (signed, with a
            zero).

    Returns:
        The element :class:`FloatFormat`.

    Raises:
        ValueError: for an unknown name (the message lists the MX names and the float
            formats) or a format that cannot hold block elements.

    Examples:
        >>> mx_element_format("mxfp4_e2m1").name
        'float4_e2m1fn'
        >>> mx_element_format("float8_e5m2").max
        57344.0
    """
    if isinstance(format, str) and format in MX_FORMATS:
        return _check_element_format(get_format(MX_FORMATS[format]))
    try:
        fmt = get_format(format)
    except ValueError as e:
        raise ValueError(
            f"Unknown MX format {format!r}: expected one of {', '.join(MX_FORMATS)} "
            f"or an element format ({e})"
        ) from None
    return _check_element_format(fmt)


def _e8m0_from_codes(codes: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(codes.astype(jnp.uint8), jnp.float8_e8m0fnu)


def _e8m0_codes(scale: jax.Array) -> jax.Array:
    """Raw uint8 codes of a float8_e8m0fnu or uint8 array."""
    dtype = np.dtype(scale.dtype)
    if dtype == np.dtype(jnp.float8_e8m0fnu):
        return lax.bitcast_convert_type(scale, jnp.uint8)
    if dtype == np.uint8:
        return scale
    raise TypeError(f"expected a float8_e8m0fnu or uint8 array of scales, got {dtype.name}")


def _floor_log2(abs_bits: jax.Array) -> jax.Array:
    """floor(log2(|x|)) of finite float32 bits as int32 (-150 for zero)."""
    m, e = _bits.decompose(abs_bits)
    return e + 31 - lax.clz(m).astype(jnp.int32)


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
    exp = _floor_log2(a)
    if rounding == "up":
        m, _ = _bits.decompose(a)
        exact = (m & (m - _bits.u32(1))) == 0  # the significand is a power of two
        exp = exp + jnp.where(exact, 0, 1)
    codes = jnp.clip(exp, -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    codes = jnp.where(a == 0, 0, codes)
    invalid = (a >= _bits.u32(_bits.INF_BITS)) | ((bits != a) & (a != 0))
    codes = jnp.where(invalid, E8M0_NAN, codes)
    return _e8m0_from_codes(codes)


def _e8m0_exponents(codes: jax.Array) -> jax.Array:
    return codes.astype(jnp.int32) - E8M0_BIAS


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
    return _from_e8m0_impl(_e8m0_codes(jnp.asarray(scale)))


@jax.jit
def _from_e8m0_impl(codes: jax.Array) -> jax.Array:
    bits = jnp.where(
        codes == 0,
        _bits.u32(0x00400000),
        lax.shift_left(codes.astype(jnp.uint32), _bits.u32(23)),
    )
    bits = jnp.where(codes == E8M0_NAN, _bits.u32(_bits.QNAN_BITS), bits)
    return _bits.from_bits(bits)


@dataclasses.dataclass(frozen=True)
class MXArray:
    """A block scaled array: ``value = data * scale`` per block along one axis.

    A JAX pytree (``data`` and ``scales`` are leaves, the rest is static metadata), so it
    can cross ``jax.jit`` boundaries and be mapped over with ``jax.tree_util``.

    Attributes:
        data: Elements, shape of the (zero-padded) input. Its dtype is the element
            format's dtype when JAX supports it (float8, float4), else float32 holding
            values of the element format exactly (float6 and custom formats).
        scales: ``float8_e8m0fnu`` block scales, shape of the input with ``axis``
            of length ``ceil(length / block_size)``. NaN marks a block that held NaN/inf.
        format: Element format.
        block_size: Number of elements sharing a scale.
        axis: The blocked axis, as a negative index (it stays valid when batch
            dimensions are prepended, e.g. by ``jax.vmap``).
        length: Length of ``axis`` before padding.

    Examples:
        >>> import jax.numpy as jnp
        >>> mx = block_quantize(jnp.arange(8.0), "float4_e2m1fn", block_size=4)
        >>> mx.data.dtype, mx.scales.dtype, mx.shape
        (dtype(float4_e2m1fn), dtype(float8_e8m0fnu), (8,))
        >>> mx.dequantize()  # 7 / 1 saturates to the float4_e2m1fn max, 6
        Array([0., 1., 2., 3., 4., 4., 6., 6.], dtype=float32)
    """

    data: jax.Array
    scales: jax.Array
    format: FloatFormat
    block_size: int
    axis: int
    length: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the dequantized array."""
        shape = list(self.data.shape)
        shape[self.axis] = self.length
        return tuple(shape)

    def dequantize(self) -> jax.Array:
        """Same as :func:`block_dequantize`."""
        return block_dequantize(self)


jax.tree_util.register_dataclass(
    MXArray, data_fields=["data", "scales"], meta_fields=["format", "block_size", "axis", "length"]
)


def _check_element_format(fmt: Any) -> FloatFormat:
    if not isinstance(fmt, FloatFormat):
        raise ValueError(f"block element format must be a float format, got {fmt.name!r}")
    if fmt.unsigned or not fmt.has_zero:
        raise ValueError(f"block element format must be signed and have a zero, got {fmt.name!r}")
    return fmt


def block_quantize(
    x: Any,
    format: str | FloatFormat | Any,
    block_size: int = 32,
    axis: int = -1,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    pad: bool = False,
) -> MXArray:
    """Block scaled (MX) quantisation along one axis, with E8M0 power-of-two scales.

    Each block of `block_size` consecutive elements along `axis` shares the scale
    ``X = 2**(floor(log2(max|block|)) - emax)`` (OCP MX v1.0), ``emax`` being the element
    format's :attr:`~FloatFormat.max_exponent`, clamped to E8M0's ``[2**-127, 2**127]``.
    Elements are ``x / X`` rounded to the element format and saturated to ±max. Scaling
    and rounding are exact (integer operations on float32 bits).

    * An all-zero block gets the smallest scale ``2**-127`` and zero elements (signs kept).
    * A block holding NaN or ±inf gets a NaN scale and zero elements: it dequantizes
      to all-NaN (the MX rule that a NaN scale makes the whole block NaN).
    * If `block_size` does not divide the axis length, a ValueError is raised unless
      ``pad=True``: the axis is then zero-padded to a multiple of `block_size` (``data``
      holds the padding) and :func:`block_dequantize` trims it off.

    Not differentiable: use :func:`float_quantize` for straight-through fake quantisation.

    Args:
        x: Array with at least one dimension (float up to 32 bits, or integer).
        format: Element format: a signed preset name, dtype or :class:`FloatFormat`
            (typically float8_e4m3fn, float8_e5m2, float6_e2m3fn, float6_e3m2fn,
            float4_e2m1fn), or an OCP MX name from :data:`MX_FORMATS` (``"mxfp8_e4m3"``,
            ``"mxfp4_e2m1"``, ...), which stands for its element format.
        block_size: Elements per block (32 in the MX specification).
        axis: Axis along which blocks are formed.
        rounding: Element rounding: ``"nearest"``, ``"toward_zero"`` or ``"stochastic"``.
        key: PRNG key, required for (and only used by) ``rounding="stochastic"``.
        pad: Whether to zero-pad an axis that `block_size` does not divide.

    Returns:
        An :class:`MXArray`.

    Raises:
        ValueError: invalid format, block size, axis or rounding, or a block size that
            does not divide the axis length without ``pad=True``.
        TypeError: for non-real inputs or float64 inputs.

    Examples:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([1.0, -2.0, 3.0, 100.0])
        >>> mx = block_quantize(x, "float8_e4m3fn", block_size=2)
        >>> from_e8m0(mx.scales)  # 2**(floor(log2(amax)) - 8)
        Array([0.0078125, 0.25     ], dtype=float32)
        >>> block_dequantize(mx)  # 100 / 0.25 = 400 rounds to 384 in float8_e4m3fn
        Array([ 1., -2.,  3., 96.], dtype=float32)
    """
    return _block_quantize(x, format, block_size, axis, rounding, key, pad, float32_data=False)


def _block_quantize(
    x: Any,
    format: str | FloatFormat | Any,
    block_size: int,
    axis: int,
    rounding: Rounding,
    key: jax.Array | None,
    pad: bool,
    float32_data: bool,
) -> MXArray:
    fmt = mx_element_format(format)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    mode = _bits.check_rounding(rounding, key)
    x = jnp.asarray(x)
    _bits.compute_dtype(x, "block_quantize")
    if x.ndim == 0:
        raise ValueError("block_quantize needs an array with at least one dimension")
    if isinstance(axis, bool) or not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis!r} is out of range for an array of rank {x.ndim}")
    axis = axis % x.ndim
    length = x.shape[axis]
    if length % block_size and not pad:
        raise ValueError(
            f"block_size {block_size} does not divide the length {length} of axis {axis}; "
            "pass pad=True to zero-pad the last block"
        )
    data_dtype = np.dtype(np.float32) if float32_data else fmt.jax_dtype or np.dtype(np.float32)
    key = key if mode == "stochastic" else None
    data, scales = _block_quantize_impl(x, key, fmt, block_size, axis, mode, data_dtype)
    return MXArray(data, scales, fmt, block_size, axis - x.ndim, length)


@functools.partial(jax.jit, static_argnames=("fmt", "block_size", "axis", "mode", "data_dtype"))
def _block_quantize_impl(
    x: jax.Array,
    key: jax.Array | None,
    fmt: FloatFormat,
    block_size: int,
    axis: int,
    mode: str,
    data_dtype: np.dtype,
) -> tuple[jax.Array, jax.Array]:
    if x.shape[axis] % block_size:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, -x.shape[axis] % block_size)
        x = jnp.pad(x, widths)
    xt = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    blocks = xt.reshape(*xt.shape[:-1], xt.shape[-1] // block_size, block_size)
    bits = _bits.to_bits(blocks)
    sign = bits & _bits.u32(_bits.SIGN_MASK)
    a = bits & _bits.u32(_bits.ABS_MASK)
    # Integer max of |bits| is the max of |x|, and NaN/inf patterns are the largest.
    amax = jnp.max(a, axis=-1, keepdims=True)
    special = amax >= _bits.u32(_bits.INF_BITS)
    shared = jnp.clip(_floor_log2(amax) - fmt.max_exponent, -E8M0_BIAS, E8M0_BIAS)
    shared = jnp.where(special, 0, shared)

    rbits = _bits.random_bits(key, blocks.shape) if mode == "stochastic" else None
    r = quantize_abs_bits(jnp.where(special, _bits.u32(0), a), -shared, fmt, mode, rbits)
    r = jnp.minimum(r, _bits.u32(_bits.float_bits(fmt.max)))  # saturate
    if fmt.nan_encoding == "fnuz":  # no negative zero
        sign = jnp.where(r == 0, _bits.u32(0), sign)
    elements = _bits.from_bits(jnp.where(special, _bits.u32(0), r | sign))
    codes = jnp.where(special, E8M0_NAN, shared + E8M0_BIAS)

    data = jnp.moveaxis(elements.reshape(xt.shape), -1, axis)
    data = data.astype(data_dtype)
    scales = jnp.moveaxis(_e8m0_from_codes(codes[..., 0]), -1, axis)
    return data, scales


def block_fake_quantize(
    x: Any,
    format: str | FloatFormat | Any,
    block_size: int = 32,
    axis: int = -1,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    pad: bool = False,
) -> jax.Array:
    """The float32 values of the block quantisation of `x` (simulated MX, "fake quantisation").

    Bit-identical to ``block_dequantize(block_quantize(x, ...))``, with the same arguments
    and errors, but the elements are held in float32 throughout: no array of the element
    dtype (float8, float4) is formed. The shape is that of `x` (padding trimmed). Not
    differentiable.

    Examples:
        >>> import jax.numpy as jnp
        >>> block_fake_quantize(jnp.array([1.0, -2.0, 3.0, 100.0]), "mxfp8_e4m3", block_size=2)
        Array([ 1., -2.,  3., 96.], dtype=float32)
    """
    mx = _block_quantize(x, format, block_size, axis, rounding, key, pad, float32_data=True)
    return block_dequantize(mx)


def block_dequantize(mx: MXArray) -> jax.Array:
    """Converts an :class:`MXArray` back to float32 (exactly: ``data * scale``).

    Args:
        mx: The block scaled array.

    Returns:
        A float32 array of shape ``mx.shape`` (padding trimmed).

    Examples:
        >>> import jax.numpy as jnp
        >>> mx = block_quantize(jnp.array([1.0, 2.0, 3.0]), "float8_e5m2", 2, pad=True)
        >>> block_dequantize(mx)
        Array([1., 2., 3.], dtype=float32)
    """
    if not isinstance(mx, MXArray):
        raise TypeError(f"block_dequantize expects an MXArray, got {type(mx).__name__}")
    return _block_dequantize_impl(mx.data, mx.scales, mx.block_size, mx.axis, mx.length)


@functools.partial(jax.jit, static_argnames=("block_size", "axis", "length"))
def _block_dequantize_impl(
    data_in: jax.Array, scales: jax.Array, block_size: int, axis: int, length: int
) -> jax.Array:
    data = jnp.moveaxis(data_in.astype(jnp.float32), axis, -1)
    blocks = data.reshape(*data.shape[:-1], data.shape[-1] // block_size, block_size)
    codes = jnp.moveaxis(_e8m0_codes(scales), axis, -1)[..., None]
    bits = _bits.to_bits(blocks)
    sign = bits & _bits.u32(_bits.SIGN_MASK)
    a = bits & _bits.u32(_bits.ABS_MASK)
    r = _bits.scale_abs_bits(a, _e8m0_exponents(codes))
    out = jnp.where(codes == E8M0_NAN, _bits.u32(_bits.QNAN_BITS), r | sign)
    out = jnp.where(a == _bits.u32(_bits.INF_BITS), bits, out)
    out = jnp.where(a > _bits.u32(_bits.INF_BITS), bits, out)
    values = _bits.from_bits(out).reshape(data.shape)
    values = jnp.moveaxis(values, -1, axis)
    return lax.slice_in_dim(values, 0, length, axis=axis % values.ndim)
