"""NVFP4: 4-bit E2M1 elements, an E4M3 scale per block of 16, one float32 scale per tensor.

The two-level scaling of NVIDIA's NVFP4 format (arXiv 2509.25149). Along `axis`, with
float32 arithmetic throughout:

1. tensor scale ``t = amax * float32(1 / (6 * 448))``, `amax` the largest finite magnitude
   of the tensor (6 is E2M1's max, 448 E4M3's), so that block scales use E4M3's range;
   ``t = 1`` for an all-zero tensor and at least ``2**-126`` (float32's smallest normal)
   otherwise;
2. block scale ``s = e4m3(amax_block / (6 * t))`` (round to nearest even, at most 448; it
   is 0 when the block's values are below E4M3's range at this tensor scale);
3. elements ``q = e2m1(x / (s * t))``, rounded (nearest even or stochastically) and
   saturated to +-6; 0 in a block whose scale is 0;
4. value ``q * (s * t)``.

A block holding NaN or +-inf gets a NaN scale and dequantizes to NaN (E4M3 has no infinity);
the tensor scale ignores such values. XLA on CPU flushes float32 subnormals to zero, so
there a block whose `s * t` is below ``2**-126`` (tensors whose values are all below about
``2**-100``) dequantizes to zeros.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import ml_dtypes

from .. import _deprecation
from . import _bits
from ._bits import Rounding
from ._tiles import tiles, untiles
from .float_quantize import float_quantize

if TYPE_CHECKING:
    from ..core.datatype import ScaledArray

__all__ = ["NVFP4Array", "nvfp4_dequantize", "nvfp4_fake_quantize", "nvfp4_quantize"]

ELEMENT_MAX = 6.0
SCALE_MAX = 448.0
BLOCK_SIZE = 16
_E4M3 = jnp.dtype(ml_dtypes.float8_e4m3fn)
_E2M1 = jnp.dtype(ml_dtypes.float4_e2m1fn)


# eq=False: equal only to itself. Arrays have no single truth value, so a field-wise `==`
# raises (Python 3.13's dataclass `__eq__` compares field by field; earlier ones compared
# tuples, which passed only for the very same arrays).
@dataclasses.dataclass(frozen=True, eq=False)
class NVFP4Array:
    """An NVFP4-quantised array: ``value = data * (scale * tensor_scale)`` per block.

    A JAX pytree (`data`, `scale` and `tensor_scale` are leaves).

    Attributes:
        data: ``float4_e2m1fn`` elements, the input's shape.
        scale: ``float8_e4m3fn`` block scales, the input's shape with `axis` of length
            ``length // block_size`` (2D blocks: the last two axes divided by the block
            shape); NaN marks a block that held NaN or infinity.
        tensor_scale: float32 scalar.
        block_shape: ``(1, 16)`` for blocks of 16 along `axis`, ``(16, 16)`` for 2D
            blocks over the last two axes.
        axis: The blocked axis, as a negative index.

    Examples:
        >>> import jax.numpy as jnp
        >>> q = nvfp4_quantize(jnp.linspace(-1.0, 1.0, 16))
        >>> q.data.dtype, q.scale.dtype, q.scale.shape
        (dtype(float4_e2m1fn), dtype(float8_e4m3fn), (1,))
    """

    data: jax.Array
    scale: jax.Array
    tensor_scale: jax.Array
    block_shape: tuple[int, int]
    axis: int

    # Deprecated: `scale`, the name every scaled array type uses.
    block_scales = _deprecation.RenamedAttribute("jsa.quantization.NVFP4Array", "scale")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def block_size(self) -> int:
        """Elements per block scale."""
        return self.block_shape[0] * self.block_shape[1]

    def dequantize(self) -> jax.Array:
        """Same as :func:`nvfp4_dequantize`."""
        return nvfp4_dequantize(self)

    def to_scaled_array(self) -> ScaledArray:
        """The same values as a block-scaled :class:`~jax_scaled_arithmetics.ScaledArray`.

        A view, nothing is re-quantised: the data are the E2M1 elements, the scale is
        ``scale * tensor_scale`` in float32 (the two levels folded into one block
        scale, not a power of two), of the data's rank: ``(M, K // 16)`` for blocks of 16
        along the last axis of ``(M, K)``, ``(M // 16, K // 16)`` for 16x16 blocks. So
        ``jsa.autoscale`` computes on it with its block rules. A block that held NaN/inf
        keeps its NaN scale.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jax_scaled_arithmetics as jsa
            >>> q = nvfp4_quantize(jnp.array([[1.0, 2.0, 3.0, 12.0]]), block_size=2)
            >>> sa = q.to_scaled_array()
            >>> sa.scale.shape, sa.data.dtype
            ((1, 2), dtype(float4_e2m1fn))
            >>> doubled = jsa.autoscale(lambda a: a.astype(jnp.float32) * 2.0)(sa)
            >>> bool(jnp.array_equal(doubled.to_array(), 2 * q.dequantize()))
            True
        """
        from ..core.datatype import ScaledArray

        return ScaledArray(self.data, self.scale.astype(jnp.float32) * self.tensor_scale)


jax.tree_util.register_dataclass(
    NVFP4Array,
    data_fields=["data", "scale", "tensor_scale"],
    meta_fields=["block_shape", "axis"],
)


def _check(
    x: Any, axis: int, block_size: Any, rounding: Any, key: Any
) -> tuple[Any, int, tuple[int, int], str]:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype).itemsize > 4:
        raise TypeError(f"nvfp4_quantize takes float inputs up to 32 bits, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("nvfp4_quantize needs an array with at least one axis")
    sizes = block_size if isinstance(block_size, tuple) else (block_size,)
    if len(sizes) not in (1, 2) or any(
        isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes
    ):
        raise ValueError(
            f"block_size must be a positive integer or a pair of them, got {block_size!r}"
        )
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of rank {x.ndim}")
    axis = axis % x.ndim
    if len(sizes) == 2 and (x.ndim < 2 or axis != x.ndim - 1):
        raise ValueError(
            f"2D blocks {block_size} tile the last two axes: they need an array of rank 2 or "
            f"more and axis=-1, got rank {x.ndim} and axis {axis}"
        )
    shape = (1, sizes[0]) if len(sizes) == 1 else (sizes[0], sizes[1])
    axes = (axis,) if len(sizes) == 1 else (axis - 1, axis)
    for ax, size in zip(axes, sizes, strict=True):
        if x.shape[ax] % size:
            raise ValueError(
                f"axis {ax} has {x.shape[ax]} entries, not a multiple of the block size {size}"
            )
    mode = _bits.check_rounding(rounding, key)
    if mode not in ("nearest", "stochastic"):
        raise ValueError(f"NVFP4 elements round 'nearest' or 'stochastic', got {rounding!r}")
    return x, axis, shape, mode


def nvfp4_quantize(
    x: Any,
    axis: int = -1,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    block_size: int | tuple[int, int] = BLOCK_SIZE,
) -> NVFP4Array:
    """NVFP4 quantisation of `x` along `axis` (see the module docstring for the arithmetic).

    Args:
        x: Float array (up to 32 bits) whose `axis` length `block_size` divides.
        axis: Axis along which blocks are formed (the contraction axis of a matmul).
        rounding: Element rounding, ``"nearest"`` (even) or ``"stochastic"``; block scales
            always round to nearest.
        key: PRNG key, required for ``rounding="stochastic"``.
        block_size: Elements per block scale along `axis` (16 in NVFP4), or a pair
            ``(rows, columns)`` for 2D blocks over the last two axes (`axis` -1), which
            NVFP4 uses for weights: a matrix and its transpose then quantise identically.

    Raises:
        TypeError: non-float or 64-bit input.
        ValueError: bad axis, block size, rounding, or a missing key.

    Examples:
        >>> import jax.numpy as jnp
        >>> q = nvfp4_quantize(jnp.array([[0.5, -1.0, 3.0, 12.0]]), block_size=4)
        >>> q.tensor_scale  # 12 / (6 * 448)
        Array(0.00446429, dtype=float32)
        >>> q.dequantize()  # the block's scale is 12 / 6 = 2: 0.5 / 2 ties to E2M1's 0
        Array([[ 0., -1.,  3., 12.]], dtype=float32)
    """
    x, axis, shape, mode = _check(x, axis, block_size, rounding, key)
    key = key if mode == "stochastic" else None
    data, scales, tensor_scale = _quantize(x, key, axis, shape, mode)
    return NVFP4Array(data, scales, tensor_scale, shape, axis - x.ndim)


def _blocks_and_scales(
    blocks: jax.Array, key: jax.Array | None, mode: str
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """For blocks along the last axis: (float32 elements, E4M3 block scales, the float32
    denominators `s * t` (NaN for special blocks), the tensor scale)."""
    f32 = jnp.float32
    blocks = blocks.astype(f32)
    # One reduction over the elements: a block's largest magnitude, NaN or inf when the
    # block holds one (the maximum propagates NaN), and the tensor's from the blocks'.
    block_amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    special = ~jnp.isfinite(block_amax)
    block_amax = jnp.where(special, f32(0), block_amax)

    def finite_amax(_: Any) -> jax.Array:  # the finite values of special blocks count too
        return jnp.max(jnp.where(jnp.isfinite(blocks), jnp.abs(blocks), f32(0)))

    amax = jax.lax.cond(jnp.any(special), finite_amax, lambda _: jnp.max(block_amax), None)
    # A product with the rounded reciprocal: XLA may rewrite a division by a constant so.
    tensor_scale = jnp.where(
        amax == 0, f32(1), jnp.maximum(amax * f32(1 / (ELEMENT_MAX * SCALE_MAX)), f32(2.0**-126))
    )
    ratio = jnp.minimum(block_amax / (tensor_scale * f32(ELEMENT_MAX)), f32(SCALE_MAX))
    scales_f32 = _e4m3_nearest(ratio)
    scales = scales_f32.astype(_E4M3)
    denominator = scales_f32 * tensor_scale
    # The per-block values apart from the elementwise pass where a backend keeps the barrier
    # (XLA:CPU removes it before fusion and recomputes them for every element, so they are
    # kept cheap: docs/benchmarks.md, "Posit and lookup-table quantisation").
    denominator, special = jax.lax.optimization_barrier((denominator, special))
    safe = jnp.where(denominator == 0, f32(1), denominator)
    scaled = jnp.where(special | (denominator == 0), f32(0), blocks / safe)
    elements = float_quantize(scaled, "float4_e2m1fn", cast(Rounding, mode), saturate=True, key=key)
    scales = jnp.where(special, jnp.asarray(jnp.nan, _E4M3), scales)
    denominator = jnp.where(special, f32(jnp.nan), denominator)
    return elements, scales, denominator, tensor_scale


def _e4m3_nearest(r: jax.Array) -> jax.Array:
    """``r.astype(float8_e4m3fn)`` in float32 for ``0 <= r <= 448``, in a few instructions:
    XLA:CPU fuses the block scales into the elementwise pass and recomputes them for every
    element, so their rounding must be cheap. Normal range: the float32 significand rounded
    to 3 bits, ties to even (a carry moves to the exponent); below ``2**-6`` the subnormal
    step ``2**-9``."""
    bits = _bits.to_bits(r)
    lsb = (bits >> 20) & _bits.u32(1)
    normal = _bits.from_bits((bits + _bits.u32(0x7FFFF) + lsb) & _bits.u32(0xFFF00000))
    subnormal = jnp.round(r * jnp.float32(512)) * jnp.float32(1 / 512)
    return jnp.where(r < jnp.float32(2.0**-6), subnormal, normal)


def _to_blocks(x: jax.Array, axis: int, shape: tuple[int, int]) -> jax.Array:
    moved = jnp.moveaxis(x, axis, -1)
    return tiles(moved[None] if moved.ndim == 1 else moved, shape)


def _from_blocks(t: jax.Array, axis: int, shape: tuple[int, int], ndim: int) -> jax.Array:
    v = untiles(t, shape)
    return jnp.moveaxis(v[0] if ndim == 1 else v, -1, axis)


@functools.partial(jax.jit, static_argnames=("axis", "shape", "mode"))
def _quantize(
    x: jax.Array, key: jax.Array | None, axis: int, shape: tuple[int, int], mode: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    elements, scales, _, tensor_scale = _blocks_and_scales(_to_blocks(x, axis, shape), key, mode)
    data = _from_blocks(elements, axis, shape, x.ndim).astype(_E2M1)
    scales = scales[..., 0]
    scales = jnp.moveaxis(scales[0] if x.ndim == 1 else scales, -1, axis)
    return data, scales, tensor_scale


@functools.partial(jax.jit, static_argnames=("axis", "shape", "mode"))
def _fake_quantize(
    x: jax.Array, key: jax.Array | None, axis: int, shape: tuple[int, int], mode: str
) -> jax.Array:
    elements, _, denominator, _ = _blocks_and_scales(_to_blocks(x, axis, shape), key, mode)
    return _from_blocks(elements * denominator, axis, shape, x.ndim)


def nvfp4_dequantize(q: NVFP4Array) -> jax.Array:
    """The float32 values of an :class:`NVFP4Array`: ``data * (block_scale * tensor_scale)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> nvfp4_dequantize(nvfp4_quantize(jnp.array([1.0, 7.0, 0.25, 0.0]), block_size=4))
        Array([1.1666667, 7.0000005, 0.       , 0.       ], dtype=float32)
    """
    axis = q.axis % q.data.ndim
    return _dequantize(q.data, q.scale, q.tensor_scale, axis, q.block_shape)


@functools.partial(jax.jit, static_argnames=("axis", "shape"))
def _dequantize(
    data: jax.Array, scales: jax.Array, tensor_scale: jax.Array, axis: int, shape: tuple[int, int]
) -> jax.Array:
    blocks = _to_blocks(data.astype(jnp.float32), axis, shape)
    scales = jnp.moveaxis(scales, axis, -1)
    scales = scales[None] if data.ndim == 1 else scales
    scale = scales[..., None].astype(jnp.float32) * tensor_scale
    return _from_blocks(blocks * scale, axis, shape, data.ndim)


def nvfp4_fake_quantize(
    x: Any,
    axis: int = -1,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    block_size: int | tuple[int, int] = BLOCK_SIZE,
) -> jax.Array:
    """``nvfp4_dequantize(nvfp4_quantize(x, ...))``: the float32 values NVFP4 keeps of `x`.

    Not differentiable (use a straight-through estimator around it to train).

    Examples:
        >>> import jax.numpy as jnp
        >>> nvfp4_fake_quantize(jnp.array([1.0, 2.0, 3.0, 100.0]), block_size=4)
        Array([  0.,   0.,   0., 100.], dtype=float32)
    """
    x, axis, shape, mode = _check(x, axis, block_size, rounding, key)
    # Bit-identical to the round trip, without forming the float4 array (slow to convert).
    return _fake_quantize(x, key if mode == "stochastic" else None, axis, shape, mode)
