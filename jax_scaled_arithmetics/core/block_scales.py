"""Block scales: one scale per block of a ScaledArray's data.

A scale is either a scalar (one per tensor) or an array of the data's rank whose every
dimension divides the data's: `scale.shape[i]` blocks along axis `i`, each of
`data.shape[i] // scale.shape[i]` elements. Per-channel `(1, N)`, per-row `(M, 1)`, MX
`(M, K // 32)`, tiles `(M // 128, K // 128)`, stacked layers `(L, 1, 1)`.

These helpers work on plain arrays (inside or outside `autoscale`): expanding a block
scale over its blocks, bringing two layouts to a common one, the largest magnitude of
each block as a power of two, and the per-tensor form of a block-scaled array.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _compat
from .define import (
    batch_along_operand_0,
    define_primitive,
    identity_on_operand_0,
    tangent_of_operand_0,
)
from .dtypes import compute_dtype
from .scale_arithmetic import SCALE_MAX as SCALE_MAX  # the range of block scales too
from .scale_arithmetic import SCALE_MIN as SCALE_MIN
from .scale_arithmetic import (
    largest_magnitude,
    materialize_impl,
    max_in_one_kernel,
    scale_divide_p,
    split_long_axes,
)
from .types import Array

__all__ = [
    "block_layout",
    "is_block_scale",
    "expand_scale",
    "common_layout",
    "refine_scale",
    "block_max",
    "block_sum",
    "largest_scale",
    "block_pow2_scale",
    "to_per_tensor",
]

_F32 = np.dtype(np.float32)


def block_layout(data_shape: Sequence[int], scale_shape: Sequence[int]) -> tuple[int, ...]:
    """The scale's shape at the data's rank (a lower-rank scale gets leading 1s).

    Raises:
        ValueError: a scale dimension does not divide the data's, naming both shapes.

    Examples:
        >>> block_layout((4, 64), (4, 2))
        (4, 2)
        >>> block_layout((4, 64), (64,))
        (1, 64)
    """
    data_shape, scale_shape = tuple(data_shape), tuple(scale_shape)
    if len(scale_shape) > len(data_shape):
        raise ValueError(
            f"ScaledArray scale of shape {scale_shape} does not broadcast to data of shape "
            f"{data_shape}: a block scale has at most the data's rank."
        )
    full = (1,) * (len(data_shape) - len(scale_shape)) + scale_shape
    for n, s in zip(data_shape, full):
        if s < 1 or n % s:
            raise ValueError(
                f"ScaledArray scale of shape {scale_shape} does not broadcast to data of "
                f"shape {data_shape}: each scale dimension must divide the data's (the "
                f"number of blocks along that axis)."
            )
    return full


def is_block_scale(scale: Any) -> bool:
    """Whether `scale` is a block scale (any array of rank >= 1) rather than a scalar."""
    return np.ndim(scale) > 0


# `scale` unchanged, computed once per element by XLA rather than once per data element of
# the consumers it is broadcast into (`scale_arithmetic.materialize_impl`; with `scalars`, a
# scalar too, computed once rather than copied into every kernel that reads it). One equation.
materialize_p = define_primitive(
    "materialize",
    materialize_impl,
    lambda scale, **_: scale,
    batching=batch_along_operand_0,
    jvp=tangent_of_operand_0,
)


# A tensor unchanged, which XLA:CPU computes once, in the kernel that produces it, rather
# than again inside every kernel that reads it (the exact division of `materialize_impl`,
# which XLA does not duplicate into several consumers); other backends lower it to nothing.
materialize_on_cpu_p = define_primitive(
    "materialize_on_cpu",
    identity_on_operand_0,
    lambda x, **_: x,
    batching=batch_along_operand_0,
    jvp=tangent_of_operand_0,
    cpu_impl=materialize_impl,
)


def materialize_on_cpu(x: Array) -> Array:
    """`x` unchanged; on XLA:CPU written once by the kernel that computes it and read from
    memory by every kernel that uses it (see `interpreter._computed_once`)."""
    return materialize_on_cpu_p.bind(x)


def materialize_scalar_on_cpu(x: Array) -> Array:
    """A scalar `x` unchanged; on XLA:CPU computed once, in a kernel of its own, and read
    from memory by every kernel that uses it (rather than computed again in each)."""
    return materialize_on_cpu_p.bind(x, scalars=True)


def materialize_scalar(x: Array) -> Array:
    """`x` unchanged, computed once by XLA rather than copied into every kernel that reads
    it (`materialize` leaves scalars alone)."""
    return materialize_p.bind(x, scalars=True)


def materialize(scale: Array) -> Array:
    """`scale` unchanged, computed once per block by XLA rather than once per data element
    of the consumers it is broadcast into (for block scales computed by `lax` operations;
    `block_dynamic_scale_p` and `scale_divide_p` materialise theirs already)."""
    return materialize_p.bind(scale, scalars=False)


def expand_scale(scale: Array, shape: Sequence[int]) -> Array:
    """`scale` repeated over its blocks: an array broadcastable to `shape`.

    Axes with one block, or one element per block, need no repeat (plain broadcasting).

    Examples:
        >>> expand_scale(jnp.array([[1.0, 2.0]]), (2, 4)).tolist()
        [[1.0, 1.0, 2.0, 2.0]]
    """
    shape = tuple(shape)
    scale = jnp.asarray(scale)
    if scale.ndim == 0:
        return scale
    layout = block_layout(shape, scale.shape)
    scale = scale.reshape(layout)
    if all(s in (1, n) for s, n in zip(layout, shape)):
        return scale
    # (s0, s1, ...) -> (s0, b0, s1, b1, ...) -> (s0 * b0, s1 * b1, ...)
    interleaved = []
    dims = []
    for i, (s, n) in enumerate(zip(layout, shape)):
        b = n // s if s not in (1, n) else 1
        interleaved += [s, b]
        dims.append(2 * i)
    out = lax.broadcast_in_dim(scale, tuple(interleaved), tuple(dims))
    return out.reshape(tuple(s * b for s, b in zip(interleaved[::2], interleaved[1::2])))


def common_layout(shape: Sequence[int], *layouts: Sequence[int]) -> tuple[int, ...]:
    """The coarsest layout that refines every one of `layouts` (block scales of arrays of
    `shape`): along each axis, blocks of the greatest common divisor of their sizes.

    Examples:
        >>> common_layout((8, 64), (8, 1), (1, 2))
        (8, 2)
    """
    out = []
    for axis, n in enumerate(shape):
        block = n
        for layout in layouts:
            block = math.gcd(block, n // layout[axis]) if n else 1
        out.append(n // block if n else 1)
    return tuple(out)


def refine_scale(scale: Array, shape: Sequence[int], layout: Sequence[int]) -> Array:
    """`scale` (a block scale of an array of `shape`, or a scalar) on the finer `layout`."""
    scale = jnp.asarray(scale, _F32) if not hasattr(scale, "dtype") else scale
    if np.ndim(scale) == 0:
        return jnp.broadcast_to(scale, tuple(layout))
    if tuple(np.shape(scale)) == tuple(layout):
        return scale
    own = block_layout(shape, np.shape(scale))
    scale = scale.reshape(own)
    if own == tuple(layout):
        return scale
    # Each of our blocks holds whole blocks of the finer layout.
    return jnp.broadcast_to(expand_scale(scale, layout), tuple(layout))


def _blocked(x: Array, layout: Sequence[int]) -> tuple[Array, tuple[int, ...]]:
    """`x` reshaped to (s0, b0, s1, b1, ...) and the block axes (1, 3, ...)."""
    dims = []
    for s, n in zip(layout, x.shape):
        dims += [s, n // s if s else 0]
    return x.reshape(tuple(dims)), tuple(range(1, 2 * x.ndim, 2))


def block_sum(x: Array, layout: Sequence[int]) -> Array:
    """The sum of each block of `layout` (an array of the layout's shape)."""
    layout = block_layout(x.shape, tuple(layout))
    blocked, axes = _blocked(x, layout)
    return lax.reduce_sum(blocked, axes)


def block_max(x: Array, layout: Sequence[int], *, one_kernel_on_cpu: bool = False) -> Array:
    """The largest finite `|x|` of each block of `layout` (0 where there is none), float32.

    `one_kernel_on_cpu` (XLA:CPU lowerings): a small tensor's blocks reduced in the form
    XLA:CPU fuses into one loop with their producers (see `largest_magnitude`): one block
    flattened and padded, or each block axis longer than 32 split into axes of 32. Same
    values."""
    magnitude = lax.abs(x.astype(compute_dtype(x.dtype)))
    if x.size == 0:
        return jnp.zeros(tuple(layout), magnitude.dtype)
    layout = tuple(layout)
    if one_kernel_on_cpu and all(s == 1 for s in layout):
        largest = largest_magnitude(magnitude, finite_only=True, one_kernel_on_cpu=True)
        return largest.reshape(layout)
    if not one_kernel_on_cpu:
        magnitude = lax.select(lax.is_finite(magnitude), magnitude, lax.full_like(magnitude, 0))
    blocked, axes = _blocked(magnitude, layout)
    if one_kernel_on_cpu:  # the filter after the reshape, where XLA:CPU keeps the reshape
        blocked, axes = split_long_axes(blocked, axes)
        blocked = lax.select(lax.is_finite(blocked), blocked, lax.full_like(blocked, 0))
    return lax.reduce_max(blocked, axes)


def _block_pow2_scale_impl(
    x: Array, layout: Sequence[int], factor: Array = 1.0, *, one_kernel_on_cpu: bool = False
) -> Array:
    amax = block_max(x, layout, one_kernel_on_cpu=one_kernel_on_cpu).astype(_F32)
    factor = jnp.asarray(factor, _F32)
    if factor.ndim or not isinstance(factor, np.ndarray) or float(factor) != 1.0:
        amax = amax * factor
    bits = lax.bitcast_convert_type(amax, np.int32) & np.int32(0x7F800000)
    bits = lax.clamp(np.int32((127 - 124) << 23), bits, np.int32((127 + 126) << 23))
    bits = lax.select(amax > 0, bits, lax.full_like(bits, 127 << 23))
    return lax.bitcast_convert_type(bits, _F32)


def _block_dynamic_scale_impl(
    x: Array, factor: Array, *, layout: tuple[int, ...], one_kernel_on_cpu: bool = False
) -> list[Array]:
    scale = _block_pow2_scale_impl(x, layout, factor, one_kernel_on_cpu=one_kernel_on_cpu)
    inverse = lax.bitcast_convert_type(
        np.int32(254 << 23) - lax.bitcast_convert_type(scale, np.int32), _F32
    )  # 1 / scale, exactly
    return [materialize_impl(scale), materialize_impl(factor.astype(_F32) * inverse)]


def _block_dynamic_scale_jvp(
    primitive: Any, primals: Any, tangents: Any, *, layout: tuple[int, ...]
) -> Any:
    scale, ratio_ = primitive.bind(*primals, layout=layout)
    dfactor = _compat.instantiate_zeros(tangents[1])
    inverse = ratio(jnp.ones_like(scale), scale)
    return [scale, ratio_], [jnp.zeros_like(scale), dfactor * inverse]


def _block_dynamic_scale_batch(
    primitive: Any, args: Any, dims: Any, *, layout: tuple[int, ...]
) -> Any:
    # One scale per example and block: the batch axis becomes a leading axis of blocks.
    x, factor = args
    x_dim, f_dim = dims
    size = x.shape[x_dim] if x_dim is not None else factor.shape[f_dim]
    x = jnp.moveaxis(x, x_dim, 0) if x_dim is not None else jnp.broadcast_to(x, (size,) + x.shape)
    factor = jnp.asarray(factor, _F32)
    if f_dim is None:
        factor = jnp.broadcast_to(factor, (size,) + tuple(layout))
    else:
        factor = jnp.broadcast_to(jnp.moveaxis(factor, f_dim, 0), (size,) + tuple(layout))
    outs = primitive.bind(x, factor, layout=(size,) + tuple(layout))
    return outs, [0, 0]


# One equation for a block-wise dynamic scale (as `dynamic_scale_p` is for a tensor's):
# (scale, factor / scale), scale the power of two of each block's largest `|x| * factor`.
block_dynamic_scale_p = define_primitive(
    "block_dynamic_scale",
    _block_dynamic_scale_impl,
    lambda x, factor, *, layout: [jax.core.ShapedArray(tuple(layout), _F32)] * 2,
    multiple_results=True,
    batching=_block_dynamic_scale_batch,
    jvp=_block_dynamic_scale_jvp,
    # On XLA:CPU a small tensor's block maxima in one kernel (`block_max`).
    cpu_impl=functools.partial(_block_dynamic_scale_impl, one_kernel_on_cpu=True),
)


def block_pow2_scale(x: Array, layout: Sequence[int], factor: Array = 1.0) -> Array:
    """Per block of `layout`: the power of two at or below the largest finite `|x| * factor`,
    within `[SCALE_MIN, SCALE_MAX]` (1 for a block of zeros), float32. `factor` is a scalar
    or an array of the layout's shape. Excluded from autodiff (a choice of representation).

    Examples:
        >>> block_pow2_scale(jnp.array([[0.3, 5.0], [0.0, 0.0]]), (2, 1)).tolist()
        [[4.0], [1.0]]
    """
    layout = block_layout(np.shape(x), tuple(layout))
    factor = jnp.broadcast_to(jnp.asarray(factor, _F32), layout)
    # The primitive's derivative ignores `x` (a choice of representation).
    return block_dynamic_scale_p.bind(x, factor, layout=layout)[0]


def block_dynamic_scale(x: Array, factor: Array, layout: Sequence[int]) -> tuple[Array, Array]:
    """`(scale, factor / scale)` per block of `layout` (see :func:`block_pow2_scale`), in one
    equation; `factor` an array of the layout's shape."""
    layout = block_layout(np.shape(x), tuple(layout))
    factor = jnp.broadcast_to(jnp.asarray(factor, _F32), layout)
    scale, inverse = block_dynamic_scale_p.bind(x, factor, layout=layout)
    return scale, inverse


def ratio(scale: Array, to: Array) -> Array:
    """`scale / to` for scales (0 where `to` is 0: a zero scale represents zeros), without a
    division: exact when `to` is a power of two, Newton's reciprocal otherwise."""
    scale = jnp.asarray(scale, _F32)
    to = jnp.asarray(to, _F32)
    if scale.shape != to.shape:
        shape = np.broadcast_shapes(scale.shape, to.shape)
        scale, to = jnp.broadcast_to(scale, shape), jnp.broadcast_to(to, shape)
    return scale_divide_p.bind(scale, to, zero_gives_inf=False, pow2=False)


def largest_scale(scale: Array, axes: Sequence[int] | None = None, keepdims: bool = False) -> Array:
    """The largest of the block scales `scale` along `axes` (all by default), as `jnp.max`,
    in one kernel on XLA:CPU for a small scale array (`max_in_one_kernel`): a per-channel
    scale's largest, a contraction's kept scale.

    Examples:
        >>> largest_scale(jnp.array([[1.0, 4.0], [2.0, 0.5]]), (1,), keepdims=True).tolist()
        [[4.0], [2.0]]
    """
    scale = jnp.asarray(scale)
    axes = tuple(range(scale.ndim)) if axes is None else tuple(a % scale.ndim for a in axes)
    largest = max_in_one_kernel(scale, axes)
    if keepdims:
        largest = largest.reshape(tuple(1 if i in axes else n for i, n in enumerate(scale.shape)))
    return largest


def to_per_tensor(data: Array, scale: Array) -> tuple[Array, Array]:
    """The same values with one scale: `(data', S)`, `S` the largest block scale.

    Each block's data is multiplied by its scale's ratio to `S` (at most 1: nothing
    overflows; blocks far below the largest lose the precision that `data`'s dtype has
    below its smallest normal number).
    """
    scale = jnp.asarray(scale)
    if scale.ndim == 0:
        return data, scale
    largest = lax.stop_gradient(largest_scale(scale)).astype(_F32)
    cdtype = compute_dtype(data.dtype)
    factors = expand_scale(ratio(scale, largest), data.shape).astype(cdtype)
    return (data.astype(cdtype) * factors).astype(data.dtype), largest
