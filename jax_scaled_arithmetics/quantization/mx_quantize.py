"""Block scaled ("microscaling", OCP MX v1.0) quantisation: `block_quantize`,
`block_fake_quantize` and `mx_from_scaled_array` (the values of a ScaledArray)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import prng
from . import _bits, nvfp4
from ._bits import Rounding
from ._mx_common import E8M0_BIAS, E8M0_NAN, block_dequantize_impl, e8m0_from_codes, floor_log2
from ._tiles import tiles, untiles
from .float_quantize import quantize_abs_bits, quantize_float32
from .formats import FloatFormat
from .mx_array import MXArray, block_dequantize
from .mx_formats import SCALE_ROUNDINGS, ScaleRounding, mx_element_format
from .nvfp4 import NVFP4Array, nvfp4_quantize

if TYPE_CHECKING:
    from ..core.datatype import ScaledArray


def block_quantize(
    x: Any,
    format: str | FloatFormat | Any,
    block_size: int | tuple[int, int] | None = None,
    axis: int = -1,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    pad: bool = False,
    scale_rounding: ScaleRounding = "floor",
) -> MXArray | NVFP4Array:
    """Block scaled (MX) quantisation along one axis, with E8M0 power-of-two scales.

    ``format="nvfp4"`` gives NVIDIA's two-level NVFP4 instead (an
    :class:`~jax_scaled_arithmetics.quantization.NVFP4Array`: E2M1 elements, an E4M3 scale
    per block of 16, one float32 scale per tensor; `block_size` 16 or a pair such as
    ``(16, 16)`` for 2D blocks over the last two axes): the same as
    :func:`~jax_scaled_arithmetics.quantization.nvfp4_quantize`, which documents it.
    `pad` and ``scale_rounding="up"`` do not apply to it.

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
        block_size: Elements per block (default: 32, as in the MX specification; 16 for
            ``"nvfp4"``), or a pair ``(r, c)`` for 2D blocks of r x c over the last two
            axes (then `axis` must be -1 and there is no padding): a weight and its
            transpose then quantise identically, one scale per tile.
        axis: Axis along which blocks are formed.
        rounding: Element rounding: ``"nearest"``, ``"toward_zero"`` or ``"stochastic"``.
        key: PRNG key, required for (and only used by) ``rounding="stochastic"``.
        pad: Whether to zero-pad an axis that `block_size` does not divide.
        scale_rounding: ``"floor"`` (the OCP rule above) or ``"up"``: a block whose
            largest magnitude exceeds the element max at the OCP scale gets twice that
            scale, so that no element saturates (:data:`SCALE_ROUNDINGS`).

    Returns:
        An :class:`MXArray`.

    Raises:
        ValueError: invalid format, block size, axis or rounding, or a block size that
            does not divide the axis length without ``pad=True``.
        TypeError: for non-real inputs or float64 inputs.

    Examples:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([1.0, -2.0, 3.0, 100.0])
        >>> from jax_scaled_arithmetics.quantization import from_e8m0
        >>> mx = block_quantize(x, "float8_e4m3fn", block_size=2)
        >>> from_e8m0(mx.scale)  # 2**(floor(log2(amax)) - 8)
        Array([0.0078125, 0.25     ], dtype=float32)
        >>> block_dequantize(mx)  # 100 / 0.25 = 400 rounds to 384 in float8_e4m3fn
        Array([ 1., -2.,  3., 96.], dtype=float32)
        >>> block_fake_quantize(jnp.array([7.0, 1.0]), "mxfp4_e2m1", 2)  # 7 saturates to 6
        Array([6., 1.], dtype=float32)
        >>> block_fake_quantize(jnp.array([7.0, 1.0]), "mxfp4_e2m1", 2, scale_rounding="up")
        Array([8., 1.], dtype=float32)
    """
    if _is_nvfp4(format):
        _check_nvfp4_args(pad, scale_rounding)
        return nvfp4_quantize(
            x, axis, rounding, key, nvfp4.BLOCK_SIZE if block_size is None else block_size
        )
    if isinstance(block_size, tuple):
        x = jnp.asarray(x)
        r, c = _check_2d_blocks(x, block_size, axis, pad)
        mx = _block_quantize(
            tiles(x, (r, c)), format, r * c, -1, rounding, key, False, scale_rounding,
            float32_data=False,
        )  # fmt: skip
        data = untiles(mx.data, (r, c))
        return MXArray(data, mx.scale[..., 0], mx.format, (r, c), -1, x.shape[-1])
    return _block_quantize(
        x, format, _mx_block_size(block_size), axis, rounding, key, pad, scale_rounding,
        float32_data=False,
    )  # fmt: skip


def _check_2d_blocks(x: jax.Array, block_size: Any, axis: Any, pad: bool) -> tuple[int, int]:
    """(rows, columns) of valid 2D blocks over the last two axes of `x`."""
    if len(block_size) != 2 or any(
        isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block_size
    ):
        raise ValueError(
            f"block_size must be a positive integer or a pair of them, got {block_size!r}"
        )
    if x.ndim < 2 or axis not in (-1, x.ndim - 1):
        raise ValueError(
            f"2D blocks {block_size} tile the last two axes: they need an array of rank 2 or "
            f"more and axis=-1, got rank {x.ndim} and axis {axis}"
        )
    if pad:
        raise ValueError("2D blocks do not pad: the block shape must divide the last two axes")
    for ax, size in zip((x.ndim - 2, x.ndim - 1), block_size, strict=True):
        if x.shape[ax] % size:
            raise ValueError(
                f"axis {ax} has {x.shape[ax]} entries, not a multiple of the block size {size}"
            )
    return block_size[0], block_size[1]


def _is_nvfp4(format: Any) -> bool:
    return isinstance(format, str) and format == "nvfp4"


def _check_nvfp4_args(pad: bool, scale_rounding: Any) -> None:
    if pad:
        raise ValueError("nvfp4 does not pad: its block size must divide the axis")
    if scale_rounding != "floor":
        raise ValueError(
            f"nvfp4 block scales round to the nearest E4M3, not {scale_rounding!r}: "
            "scale_rounding is for the MX formats' E8M0 scales"
        )


def _mx_block_size(block_size: Any) -> Any:
    """The MX block size along one axis: 32 by default."""
    return 32 if block_size is None else block_size


def _check_block_args(
    ndim: int,
    shape: tuple[int, ...],
    format: Any,
    block_size: Any,
    axis: Any,
    rounding: Any,
    key: Any,
    pad: bool,
    fn: str,
) -> tuple[FloatFormat, str, int]:
    """Validates the arguments of a block quantiser: (element format, rounding, axis >= 0)."""
    fmt = mx_element_format(format)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    mode = _bits.check_rounding(rounding, key)
    if ndim == 0:
        raise ValueError(f"{fn} needs an array with at least one dimension")
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis!r} is out of range for an array of rank {ndim}")
    axis = axis % ndim
    if shape[axis] % block_size and not pad:
        raise ValueError(
            f"block_size {block_size} does not divide the length {shape[axis]} of axis {axis}; "
            "pass pad=True to zero-pad the last block"
        )
    return fmt, mode, axis


def _block_quantize(
    x: Any,
    format: str | FloatFormat | Any,
    block_size: int,
    axis: int,
    rounding: Rounding,
    key: jax.Array | None,
    pad: bool,
    scale_rounding: ScaleRounding,
    float32_data: bool,
) -> MXArray:
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"scale_rounding must be one of {SCALE_ROUNDINGS}, got {scale_rounding!r}")
    x = jnp.asarray(x)
    _bits.quantized_dtype(x, "block_quantize")
    fmt, mode, axis = _check_block_args(
        x.ndim, x.shape, format, block_size, axis, rounding, key, pad, "block_quantize"
    )
    data_dtype = np.dtype(np.float32) if float32_data else fmt.jax_dtype or np.dtype(np.float32)
    key = key if mode == "stochastic" else None
    data, scales = _block_quantize_impl(
        x, key, fmt, block_size, axis, mode, data_dtype, scale_rounding == "up"
    )
    return MXArray(data, scales, fmt, block_size, axis - x.ndim, x.shape[axis])


def _pad_axis(x: jax.Array, block_size: int, axis: int) -> jax.Array:
    """`x` zero-padded along `axis` to a multiple of `block_size`."""
    if x.shape[axis] % block_size == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, -x.shape[axis] % block_size)
    return jnp.pad(x, widths)


@functools.partial(
    jax.jit, static_argnames=("fmt", "block_size", "axis", "mode", "data_dtype", "round_up")
)
def _block_quantize_impl(
    x: jax.Array,
    key: jax.Array | None,
    fmt: FloatFormat,
    block_size: int,
    axis: int,
    mode: str,
    data_dtype: np.dtype,
    round_up: bool = False,
) -> tuple[jax.Array, jax.Array]:
    bits = _bits.to_bits(_pad_axis(x.astype(jnp.float32), block_size, axis))
    special = (bits & _bits.u32(_bits.ABS_MASK)) >= _bits.u32(_bits.INF_BITS)
    return _encode_blocks(bits, 0, special, key, fmt, block_size, axis, mode, data_dtype, round_up)


# Exponent of a zero element: below any block's, so that it never sets a scale.
_NO_EXPONENT = -(2**24)


def _encode_blocks(
    bits: jax.Array,
    exp_offset: Any,
    special: jax.Array,
    key: jax.Array | None,
    fmt: FloatFormat,
    block_size: int,
    axis: int,
    mode: str,
    data_dtype: np.dtype,
    round_up: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """MX elements and E8M0 scales of the values ``bits * 2**exp_offset``.

    `bits` are float32 bit patterns (signs included) of an array whose `axis` is a multiple
    of `block_size`; `exp_offset` is 0 or an int32 array of the same shape; `special` marks
    elements whose value is NaN or infinite (their block becomes a NaN block). Integer
    operations only, so the result is exact whatever the offsets. `round_up`: a block
    whose largest magnitude would exceed the element format's max at the OCP scale gets the
    next power of two instead (no element saturates).
    """

    def blocked(v: jax.Array) -> jax.Array:
        vt = jnp.moveaxis(v, axis, -1)
        return vt.reshape(*vt.shape[:-1], vt.shape[-1] // block_size, block_size)

    blocks = blocked(bits)
    offset = blocked(exp_offset) if np.ndim(exp_offset) else exp_offset
    sign = blocks & _bits.u32(_bits.SIGN_MASK)
    a = blocks & _bits.u32(_bits.ABS_MASK)
    special = jnp.any(blocked(special), axis=-1, keepdims=True)
    a = jnp.where(special, _bits.u32(0), a)
    # floor(log2 |value|) per element; its largest over a block is that of the block's amax.
    exponent = jnp.where(a == 0, _NO_EXPONENT, floor_log2(a) + offset)
    top = jnp.max(exponent, axis=-1, keepdims=True)
    shared = jnp.clip(top - fmt.max_exponent, -E8M0_BIAS, E8M0_BIAS)
    if round_up:
        # Exact: a power-of-two rescale of the block's largest values, which land in
        # [2^emax, 2^(emax + 1)) (smaller ones may flush to 0 here, which is harmless).
        scaled = jnp.ldexp(_bits.from_bits(a), (offset - shared).astype(jnp.int32))
        over = jnp.any(scaled > fmt.max, axis=-1, keepdims=True)
        shared = jnp.minimum(shared + over.astype(shared.dtype), E8M0_BIAS)
    shared = jnp.where(special, 0, shared)

    rbits = prng.random_bits(key, blocks.shape) if mode == "stochastic" else None
    r = quantize_abs_bits(a, offset - shared, fmt, mode, rbits)
    r = jnp.minimum(r, _bits.u32(_bits.float_bits(fmt.max)))  # saturate
    if fmt.nan_encoding == "fnuz":  # no negative zero
        sign = jnp.where(r == 0, _bits.u32(0), sign)
    elements = _bits.from_bits(jnp.where(special, _bits.u32(0), r | sign))
    codes = jnp.where(special, E8M0_NAN, shared + E8M0_BIAS)

    shape = jnp.moveaxis(bits, axis, -1).shape
    data = jnp.moveaxis(elements.reshape(shape), -1, axis)
    data = data.astype(data_dtype)
    scales = jnp.moveaxis(e8m0_from_codes(codes[..., 0]), -1, axis)
    return data, scales


def mx_from_scaled_array(
    x: ScaledArray,
    format: str | FloatFormat | Any,
    block_size: int = 32,
    axis: int = -1,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    pad: bool = False,
    scale_rounding: ScaleRounding = "floor",
) -> MXArray:
    """The MX quantisation of the values a ScaledArray represents (``data * scale``).

    The inverse of :meth:`MXArray.to_scaled_array`: any scale layout is accepted (one
    scale per tensor, per row, per channel, MX blocks, tiles...), and the values are
    quantised as :func:`block_quantize` quantises them, without forming them in float32:
    each element's exponent is its data's plus its scale's (integer arithmetic), so values
    beyond float32's range (large scales) are quantised exactly as well. When `x` came
    from an MXArray with the same format, block size and axis, the result is that MXArray,
    bit for bit. A scale that is not a power of two is folded into the data in float32
    before rounding (one extra rounding); a negative scale flips signs; a NaN or infinite
    value (data or scale) makes its block a NaN block.

    Args:
        x: A :class:`~jax_scaled_arithmetics.ScaledArray` of rank at least 1 (data float
            up to 32 bits).
        format: Element format, as for :func:`block_quantize` (an OCP MX name such as
            ``"mxfp8_e4m3"``, or an element format).
        block_size: Elements per block (32 in the MX specification).
        axis: Axis along which blocks are formed.
        rounding: Element rounding: ``"nearest"``, ``"toward_zero"`` or ``"stochastic"``.
        key: PRNG key, required for (and only used by) ``rounding="stochastic"``.
        pad: Whether to zero-pad an axis that `block_size` does not divide.
        scale_rounding: ``"floor"`` (the OCP rule, as in :func:`block_quantize`) or
            ``"up"``: a block whose largest magnitude exceeds the element max at the OCP
            scale gets twice that scale, so that no element saturates
            (:data:`SCALE_ROUNDINGS`).

    Returns:
        An :class:`MXArray`.

    Raises:
        ValueError: invalid format, block size, axis or rounding, a block size that does
            not divide the axis length without ``pad=True``, or a scale whose shape is not
            a block layout of the data's.
        TypeError: `x` is not a ScaledArray, or its data is float64 or not real.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jsa.scaled_array(jnp.array([[1.0, 1.5, 1.0, -1.25]]), 2.0**100)
        >>> mx = mx_from_scaled_array(x, "mxfp8_e4m3", block_size=2)
        >>> mx.scale.view(jnp.uint8)  # E8M0 codes: 2**(100 - 8) per block
        Array([[219, 219]], dtype=uint8)
        >>> mx.data
        Array([[256, 384, 256, -320]], dtype=float8_e4m3fn)
        >>> y = jsa.as_scaled_array(jnp.arange(8.0).reshape(2, 4), scale_shape=(2, 1))
        >>> mx_from_scaled_array(y, "mxfp4_e2m1", block_size=4).dequantize()
        Array([[0., 1., 2., 3.],
               [4., 4., 6., 6.]], dtype=float32)
    """
    from ..core import block_scales
    from ..core.datatype import ScaledArray

    if not isinstance(x, ScaledArray):
        raise TypeError(f"mx_from_scaled_array expects a ScaledArray, got {type(x).__name__}")
    data = jnp.asarray(x.data)
    _bits.quantized_dtype(data, "mx_from_scaled_array")
    fmt, mode, axis = _check_block_args(
        data.ndim, data.shape, format, block_size, axis, rounding, key, pad, "mx_from_scaled_array"
    )
    scale = jnp.asarray(x.scale)
    if scale.ndim:
        scale = scale.reshape(block_scales.block_layout(data.shape, scale.shape))
        scale = block_scales.expand_scale(scale.astype(jnp.float32), data.shape)
    data_dtype = fmt.jax_dtype or np.dtype(np.float32)
    key = key if mode == "stochastic" else None
    elements, scales = _mx_from_scaled_impl(
        data, scale, key, fmt, block_size, axis, mode, data_dtype
    )
    return MXArray(elements, scales, fmt, block_size, axis - data.ndim, data.shape[axis])


@functools.partial(jax.jit, static_argnames=("fmt", "block_size", "axis", "mode", "data_dtype"))
def _mx_from_scaled_impl(
    data: jax.Array,
    scale: jax.Array,
    key: jax.Array | None,
    fmt: FloatFormat,
    block_size: int,
    axis: int,
    mode: str,
    data_dtype: np.dtype,
) -> tuple[jax.Array, jax.Array]:
    d = data.astype(jnp.float32)
    sbits = _bits.to_bits(jnp.broadcast_to(scale.astype(jnp.float32), d.shape))
    sa = sbits & _bits.u32(_bits.ABS_MASK)
    # |scale| = m * 2**k with m in [1, 2), from its bits (float32 subnormals included).
    sm, se = _bits.decompose(sa)
    msb = 31 - lax.clz(sm).astype(jnp.int32)
    k = se + msb
    pow2 = (sm & (sm - _bits.u32(1))) == 0
    # m / 2 in [0.5, 1), folded into the data in float32 (the product cannot overflow).
    half_m = _bits.from_bits(_bits.u32(126 << 23) | (_bits.shl(sm, 23 - msb) & _bits.u32(0x7FFFFF)))
    v = jnp.where(pow2, d, d * half_m)
    k = jnp.where(pow2, k, k + 1)
    bits = _bits.to_bits(v) ^ (sbits & _bits.u32(_bits.SIGN_MASK))
    # A zero scale represents zeros (signed as the data).
    bits = jnp.where(sa == 0, bits & _bits.u32(_bits.SIGN_MASK), bits)
    special = ~jnp.isfinite(d) | (sa >= _bits.u32(_bits.INF_BITS))
    bits, k, special = (_pad_axis(t, block_size, axis) for t in (bits, k, special))
    return _encode_blocks(bits, k, special, key, fmt, block_size, axis, mode, data_dtype)


def block_fake_quantize(
    x: Any,
    format: str | FloatFormat | Any,
    block_size: int | tuple[int, int] | None = None,
    axis: int = -1,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    pad: bool = False,
    scale_rounding: ScaleRounding = "floor",
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
    if _is_nvfp4(format):
        _check_nvfp4_args(pad, scale_rounding)
        size = nvfp4.BLOCK_SIZE if block_size is None else block_size
        return nvfp4.nvfp4_fake_quantize(x, axis, rounding, key, size)
    if isinstance(block_size, tuple):
        x = jnp.asarray(x)
        r, c = _check_2d_blocks(x, block_size, axis, pad)
        quantized = block_fake_quantize(
            tiles(x, (r, c)), format, r * c, -1, rounding, key, False, scale_rounding
        )
        return untiles(quantized, (r, c))
    size = _mx_block_size(block_size)
    if rounding == "nearest" and scale_rounding in SCALE_ROUNDINGS:
        x = jnp.asarray(x)
        _bits.quantized_dtype(x, "block_quantize")
        fmt, _, ax = _check_block_args(
            x.ndim, x.shape, format, size, axis, rounding, key, pad, "block_quantize"
        )
        if x.shape[ax] % size == 0 and x.size:
            return _fake_quantize_nearest(x, fmt, size, ax, scale_rounding == "up")
    mx = _block_quantize(
        x, format, size, axis, rounding, key, pad, scale_rounding, float32_data=True
    )
    return block_dequantize(mx)


# Shared exponents for which the float32 path below is exact: 2**-shared and 2**shared are
# normal floats, and so is every nonzero element value (at least 2**(shared - 24)).
_FAST_EXPONENTS = (-100, 126)


@functools.partial(jax.jit, static_argnames=("fmt", "block_size", "axis", "round_up"))
def _fake_quantize_nearest(
    x: jax.Array, fmt: FloatFormat, block_size: int, axis: int, round_up: bool
) -> jax.Array:
    """`block_fake_quantize` with nearest rounding in float32 arithmetic: each block divided
    by its power-of-two scale, rounded, multiplied back, all exact while the shared
    exponents stay in `_FAST_EXPONENTS` (zero blocks aside); otherwise (blocks of float32
    subnormals, or of values near float32's limits) the integer path, bit for bit."""
    x32 = x.astype(jnp.float32)
    moved = jnp.moveaxis(x32, axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], moved.shape[-1] // block_size, block_size)
    magnitude = jnp.abs(blocks)
    # The block maxima from the bits, one reduction: XLA on CPU may treat float32
    # subnormals as zeros in float comparisons, the integers keep them; NaN and inf bits
    # are the largest, so a block holding one has a maximum at least INF_BITS.
    amax_bits = jnp.max(_bits.to_bits(magnitude), axis=-1, keepdims=True)
    special = amax_bits >= _bits.u32(_bits.INF_BITS)
    amax_bits = jnp.where(special, _bits.u32(0), amax_bits)
    zero = amax_bits == 0
    # floor(log2 amax) from the exponent field: right for normal maxima, the only ones the
    # float path takes (a subnormal maximum gives a shared exponent below its range).
    shared = (amax_bits >> 23).astype(jnp.int32) - 127 - fmt.max_exponent
    low, high = _FAST_EXPONENTS

    def power_of_two(exponent: jax.Array) -> jax.Array:
        """2**exponent from its bits, for exponents clipped to float32's normal range."""
        biased = jnp.clip(exponent + 127, 1, 254).astype(jnp.uint32)
        return _bits.from_bits(lax.shift_left(biased, _bits.u32(23)))

    if round_up:  # the next power of two where the block's maximum would saturate
        over = _bits.from_bits(amax_bits) * power_of_two(-shared) > fmt.max
        shared = shared + over.astype(shared.dtype)
    shared = jnp.where(zero | special, 0, shared)

    def fast(_: Any) -> jax.Array:
        # Cheap per-block factors: XLA:CPU fuses them into the elementwise pass and
        # recomputes them for every element.
        down, up = power_of_two(-shared), power_of_two(shared)
        q = quantize_float32(magnitude * down, fmt, "nearest", True, None)
        values = jnp.copysign(q * up, blocks)
        values = jnp.where(special, _bits.from_bits(_bits.u32(_bits.QNAN_BITS)), values)
        return jnp.moveaxis(values.reshape(moved.shape), -1, axis)

    def exact(_: Any) -> jax.Array:
        bits = _bits.to_bits(x32)
        special_elements = (bits & _bits.u32(_bits.ABS_MASK)) >= _bits.u32(_bits.INF_BITS)
        data, scales = _encode_blocks(
            bits, 0, special_elements, None, fmt, block_size, axis, "nearest",
            np.dtype(np.float32), round_up,
        )  # fmt: skip
        return block_dequantize_impl(data, scales, block_size, axis - x.ndim, x.shape[axis])

    in_range = jnp.all(zero | special | ((shared >= low) & (shared <= high)))
    return lax.cond(in_range, fast, exact, None)
