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
from typing import Any, cast

import jax
import jax.numpy as jnp
import ml_dtypes

from . import _bits
from ._bits import Rounding
from .float_quantize import float_quantize

__all__ = ["NVFP4Array", "nvfp4_dequantize", "nvfp4_fake_quantize", "nvfp4_quantize"]

ELEMENT_MAX = 6.0
SCALE_MAX = 448.0
BLOCK_SIZE = 16
_E4M3 = jnp.dtype(ml_dtypes.float8_e4m3fn)
_E2M1 = jnp.dtype(ml_dtypes.float4_e2m1fn)


@dataclasses.dataclass(frozen=True)
class NVFP4Array:
    """An NVFP4-quantised array: ``value = data * (block_scales * tensor_scale)`` per block.

    A JAX pytree (`data`, `block_scales` and `tensor_scale` are leaves).

    Attributes:
        data: ``float4_e2m1fn`` elements, the input's shape.
        block_scales: ``float8_e4m3fn`` scales, the input's shape with `axis` of length
            ``length // block_size``; NaN marks a block that held NaN or infinity.
        tensor_scale: float32 scalar.
        block_size: Elements per block (16 in NVFP4).
        axis: The blocked axis, as a negative index.

    Examples:
        >>> import jax.numpy as jnp
        >>> q = nvfp4_quantize(jnp.linspace(-1.0, 1.0, 16))
        >>> q.data.dtype, q.block_scales.dtype, q.block_scales.shape
        (dtype(float4_e2m1fn), dtype(float8_e4m3fn), (1,))
    """

    data: jax.Array
    block_scales: jax.Array
    tensor_scale: jax.Array
    block_size: int
    axis: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def dequantize(self) -> jax.Array:
        """Same as :func:`nvfp4_dequantize`."""
        return nvfp4_dequantize(self)


jax.tree_util.register_dataclass(
    NVFP4Array,
    data_fields=["data", "block_scales", "tensor_scale"],
    meta_fields=["block_size", "axis"],
)


def _check(x: Any, axis: int, block_size: int, rounding: Any, key: Any) -> tuple[Any, int, str]:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype).itemsize > 4:
        raise TypeError(f"nvfp4_quantize takes float inputs up to 32 bits, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("nvfp4_quantize needs an array with at least one axis")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of rank {x.ndim}")
    axis = axis % x.ndim
    if x.shape[axis] % block_size:
        raise ValueError(
            f"axis {axis} has {x.shape[axis]} entries, not a multiple of the block size "
            f"{block_size}"
        )
    mode = _bits.check_rounding(rounding, key)
    if mode not in ("nearest", "stochastic"):
        raise ValueError(f"NVFP4 elements round 'nearest' or 'stochastic', got {rounding!r}")
    return x, axis, mode


def nvfp4_quantize(
    x: Any,
    axis: int = -1,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    block_size: int = BLOCK_SIZE,
) -> NVFP4Array:
    """NVFP4 quantisation of `x` along `axis` (see the module docstring for the arithmetic).

    Args:
        x: Float array (up to 32 bits) whose `axis` length `block_size` divides.
        axis: Axis along which blocks are formed (the contraction axis of a matmul).
        rounding: Element rounding, ``"nearest"`` (even) or ``"stochastic"``; block scales
            always round to nearest.
        key: PRNG key, required for ``rounding="stochastic"``.
        block_size: Elements per block scale (16 in NVFP4).

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
    x, axis, mode = _check(x, axis, block_size, rounding, key)
    key = key if mode == "stochastic" else None
    data, scales, tensor_scale = _quantize(x, key, axis, block_size, mode)
    return NVFP4Array(data, scales, tensor_scale, block_size, axis - x.ndim)


def _blocked(v: jax.Array, axis: int, block_size: int) -> jax.Array:
    v = jnp.moveaxis(v, axis, -1)
    return v.reshape(*v.shape[:-1], v.shape[-1] // block_size, block_size)


def _unblocked(v: jax.Array, axis: int) -> jax.Array:
    return jnp.moveaxis(v.reshape(*v.shape[:-2], -1), -1, axis)


def _blocks_and_scales(
    x: jax.Array, key: jax.Array | None, block_size: int, mode: str
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Along the last axis: (float32 elements (blocked), E4M3 block scales, the float32
    denominators `s * t` (NaN for special blocks), the tensor scale)."""
    f32 = jnp.float32
    blocks = _blocked(x.astype(f32), -1, block_size)
    finite = jnp.isfinite(blocks)
    magnitude = jnp.where(finite, jnp.abs(blocks), f32(0))
    amax = jnp.max(magnitude)
    # A product with the rounded reciprocal: XLA may rewrite a division by a constant so.
    tensor_scale = jnp.where(
        amax == 0, f32(1), jnp.maximum(amax * f32(1 / (ELEMENT_MAX * SCALE_MAX)), f32(2.0**-126))
    )
    special = ~jnp.all(finite, axis=-1, keepdims=True)
    block_amax = jnp.max(magnitude, axis=-1, keepdims=True)
    ratio = jnp.minimum(block_amax / (tensor_scale * f32(ELEMENT_MAX)), f32(SCALE_MAX))
    scales = ratio.astype(_E4M3)
    denominator = scales.astype(f32) * tensor_scale
    safe = jnp.where(denominator == 0, f32(1), denominator)
    scaled = jnp.where(special | (denominator == 0), f32(0), blocks / safe)
    elements = float_quantize(scaled, "float4_e2m1fn", cast(Rounding, mode), saturate=True, key=key)
    scales = jnp.where(special, jnp.asarray(jnp.nan, _E4M3), scales)
    denominator = jnp.where(special, f32(jnp.nan), denominator)
    return elements, scales, denominator, tensor_scale


@functools.partial(jax.jit, static_argnames=("axis", "block_size", "mode"))
def _quantize(
    x: jax.Array, key: jax.Array | None, axis: int, block_size: int, mode: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    moved = jnp.moveaxis(x, axis, -1)
    elements, scales, _, tensor_scale = _blocks_and_scales(moved, key, block_size, mode)
    data = jnp.moveaxis(elements.reshape(moved.shape), -1, axis).astype(_E2M1)
    return data, jnp.moveaxis(scales[..., 0], -1, axis), tensor_scale


@functools.partial(jax.jit, static_argnames=("axis", "block_size", "mode"))
def _fake_quantize(
    x: jax.Array, key: jax.Array | None, axis: int, block_size: int, mode: str
) -> jax.Array:
    moved = jnp.moveaxis(x, axis, -1)
    elements, _, denominator, _ = _blocks_and_scales(moved, key, block_size, mode)
    return jnp.moveaxis((elements * denominator).reshape(moved.shape), -1, axis)


def nvfp4_dequantize(q: NVFP4Array) -> jax.Array:
    """The float32 values of an :class:`NVFP4Array`: ``data * (block_scale * tensor_scale)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> nvfp4_dequantize(nvfp4_quantize(jnp.array([1.0, 7.0, 0.25, 0.0]), block_size=4))
        Array([1.1666667, 7.0000005, 0.       , 0.       ], dtype=float32)
    """
    axis = q.axis % q.data.ndim
    return _dequantize(q.data, q.block_scales, q.tensor_scale, axis, q.block_size)


@functools.partial(jax.jit, static_argnames=("axis", "block_size"))
def _dequantize(
    data: jax.Array, scales: jax.Array, tensor_scale: jax.Array, axis: int, block_size: int
) -> jax.Array:
    blocks = _blocked(data.astype(jnp.float32), axis, block_size)
    scale = jnp.moveaxis(scales, axis, -1)[..., None].astype(jnp.float32) * tensor_scale
    return _unblocked(blocks * scale, axis)


def nvfp4_fake_quantize(
    x: Any,
    axis: int = -1,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    block_size: int = BLOCK_SIZE,
) -> jax.Array:
    """``nvfp4_dequantize(nvfp4_quantize(x, ...))``: the float32 values NVFP4 keeps of `x`.

    Not differentiable (use a straight-through estimator around it to train).

    Examples:
        >>> import jax.numpy as jnp
        >>> nvfp4_fake_quantize(jnp.array([1.0, 2.0, 3.0, 100.0]), block_size=4)
        Array([  0.,   0.,   0., 100.], dtype=float32)
    """
    x, axis, mode = _check(x, axis, block_size, rounding, key)
    # Bit-identical to the round trip, without forming the float4 array (slow to convert).
    return _fake_quantize(x, key if mode == "stochastic" else None, axis, block_size, mode)
