"""Dynamic rescaling: move a power-of-two factor from data to scale, value unchanged.

One primitive, `dynamic_rescale_p`, does it inside and outside `autoscale`: the identity
on plain arrays, and on a ScaledArray a new scale per block chosen from its data (per
tensor for a scalar scale). `scale_shape` asks for another block layout (per row, per
channel, MX blocks, tiles): each new block's data is first brought to the largest of the
old scales it covers (exact powers of two, nothing overflows), then rescaled by its norm.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import _compat, block_scales, registry
from ..core.datatype import ScaledArray, is_array, is_floating, is_scaled_leaf
from ..core.define import define_identity_primitive, define_primitive, zero_tangents
from ..core.dtypes import compute_dtype
from ..core.interpreter import autoscale
from ..core.scale_arithmetic import (
    largest_magnitude,
    largest_of_each,
    largest_of_several,
    mark_pow2,
    partial_maxima,
)
from ..core.types import Array
from ..lax.scaling_primitives import block_rebalance_by, rebalance_by, register_scaling_op

__all__ = [
    "dynamic_rescale_max",
    "dynamic_rescale_l1",
    "dynamic_rescale_l2",
    "dynamic_rescale_max_grad",
    "dynamic_rescale_l1_grad",
    "dynamic_rescale_l2_grad",
    "DEFAULT_EPSILON",
    "rescale_tree",
    "match_layout",
    "rescale_factor_p",
    "rescale_factors_p",
    "rescale_to_bounds",
    "rescale_to_bounds_p",
]

ScaleShape = Sequence[int] | Callable[[tuple[int, ...]], Sequence[int]] | None
DEFAULT_EPSILON = 2.0**-60
_F32 = np.dtype(np.float32)


def _block_norms(data: Array, layout: tuple[int, ...], norm: str) -> Array:
    """The `norm` of each block of `layout` (an array of the layout's shape), float32."""
    data = data.astype(jnp.float32)
    if norm == "max":
        return block_scales.block_max(data, layout)  # the largest finite magnitude
    count = np.float32(data.size // max(int(np.prod(layout)), 1))
    if norm == "l1":
        return block_scales.block_sum(lax.abs(data), layout) / count
    return lax.sqrt(block_scales.block_sum(data * data, layout) / count)


def _pow2_bits(magnitude: Array, epsilon: float, lowest: int = 0) -> Array:
    """The exponent bits of the power of two at or below each finite `magnitude` (floored
    at `epsilon`; 1 where it is not finite), at most 2^126 and at least 2^(lowest - 127)."""
    finite = lax.is_finite(magnitude)
    magnitude = lax.select(
        finite,
        lax.max(magnitude, lax.full_like(magnitude, epsilon)),
        lax.full_like(magnitude, 1.0),
    )
    bits = lax.bitcast_convert_type(magnitude, np.int32) & np.int32(0x7F800000)
    if lowest:
        return lax.clamp(np.int32(lowest << 23), bits, np.int32(253 << 23))
    return lax.min(bits, lax.full_like(bits, 253 << 23))


# Both come from integer bits, which carry no derivative: no stop_gradient needed.
def _pow2(bits: Array) -> Array:
    return lax.bitcast_convert_type(bits, _F32)


def _inverse_pow2(bits: Array) -> Array:
    """`1 / 2^e` for the exponent bits of `2^e`, exactly."""
    return lax.bitcast_convert_type(np.int32(254 << 23) - bits, _F32)


def _layout_of(x: ScaledArray) -> tuple[int, ...]:
    if np.ndim(x.scale) == 0:
        return (1,) * x.ndim
    return block_scales.block_layout(x.shape, np.shape(x.scale))


def _reblock(x: ScaledArray, target: tuple[int, ...]) -> tuple[Array, Array]:
    """`x` on the block layout `target`: `(data, scale)`, the scale of each target block the
    largest old scale within it, the data (float32 or float64) multiplied by each old
    scale's ratio to it (a power of two at most 1: nothing overflows)."""
    cdtype = compute_dtype(x.dtype)
    data = jnp.asarray(x.data).astype(cdtype)
    scale = jnp.asarray(x.scale, _F32)
    if scale.ndim == 0:
        return data, jnp.broadcast_to(scale, target)
    own = block_scales.block_layout(x.shape, scale.shape)
    scale = scale.reshape(own)
    if own == target:
        return data, scale
    common = block_scales.common_layout(x.shape, own, target)
    fine = block_scales.refine_scale(scale, x.shape, common)
    new = block_scales.block_max(fine, target)
    ratio = block_scales.ratio(fine, block_scales.refine_scale(new, x.shape, common))
    return data * block_scales.expand_scale(ratio, x.shape).astype(cdtype), new


def _scaled(data: Array, scale: Array, dtype: Any) -> ScaledArray:
    """A ScaledArray from float32 block arithmetic; one block gives a scalar scale."""
    scale = jnp.asarray(scale, _F32)
    if scale.size == 1:
        scale = scale.reshape(())
    return ScaledArray(data.astype(dtype), scale)


# --- the primitive -------------------------------------------------------------------------
#
# `dynamic_rescale_p(x, norm, epsilon, layout)`: the identity on values. Inside `autoscale`
# a ScaledArray `x` gets one new power-of-two scale per block of `layout` (None: its own
# layout), so that each block's `norm` of the data is in [1, 2).


def _dynamic_rescale_batch(
    primitive: Any, args: Any, dims: Any, *, layout: Any, **params: Any
) -> Any:
    (x,), (dim,) = args, dims
    if layout is not None and dim is not None:  # one block per example along the batch axis
        layout = tuple(layout[:dim]) + (x.shape[dim],) + tuple(layout[dim:])
    return primitive.bind(x, layout=layout, **params), dim


dynamic_rescale_p = define_identity_primitive("dynamic_rescale", _dynamic_rescale_batch)


# `rescale_factor_p(data; norm, epsilon, shift, axes)`: the power of two `2^(shift - e)` and
# its inverse, `2^e` the power of two at or below the `norm` of `data` over `axes` (floored
# at `epsilon`; 1 where the norm is not finite). Two outputs of one equation for what would
# be a dozen (the norm, then the exponent-bit arithmetic) and a scale division: the
# per-tensor dynamic rescale of every optimizer state leaf and parameter is this and one
# multiply.

_F32_MAX_EXPONENT_BITS = np.int32(254 << 23)  # 2^127
_F32_TWO_M127_BITS = np.int32(1 << 22)  # 2^-127, a subnormal


def _rescale_factor_impl(
    data: Array,
    *,
    norm: str,
    epsilon: float,
    shift: int,
    axes: tuple[int, ...],
    one_kernel_on_cpu: bool = False,
) -> list[Array]:
    data = data.astype(jnp.float32)  # float64 data too: the scale is float32
    if norm == "max" and len(axes) == data.ndim:  # per tensor
        magnitude = largest_magnitude(
            lax.abs(data), finite_only=False, one_kernel_on_cpu=one_kernel_on_cpu
        )
    elif norm == "max":
        magnitude = jnp.max(jnp.abs(data), axis=axes)
    elif norm == "l1":
        magnitude = jnp.mean(jnp.abs(data), axis=axes)
    else:
        magnitude = jnp.sqrt(jnp.mean(jnp.square(data), axis=axes))
    return _factors_of_norm(magnitude, epsilon, shift)


def _factors_of_norm(magnitude: Array, epsilon: float, shift: int) -> list[Array]:
    """Elementwise: `rescale_factor_p`'s two outputs for a norm `magnitude` (float32)."""
    bits = _pow2_bits(magnitude, epsilon)
    # 2^(shift - e), kept a normal float32 (2^-126 .. 2^127) for extreme shifts and epsilons.
    out = np.int32(254 << 23) - bits + np.int32(shift << 23)
    out = lax.clamp(np.int32(1 << 23), out, _F32_MAX_EXPONENT_BITS)
    # Its inverse exactly: 2^(e - shift), 2^-127 (subnormal) for a factor of 2^127.
    inverse = lax.select(
        out == _F32_MAX_EXPONENT_BITS,
        lax.full_like(out, _F32_TWO_M127_BITS),
        _F32_MAX_EXPONENT_BITS - out,
    )
    return [lax.bitcast_convert_type(out, _F32), lax.bitcast_convert_type(inverse, _F32)]


def _rescale_factor_batch(
    primitive: Any, args: Any, dims: Any, *, axes: tuple[int, ...], **params: Any
) -> Any:
    (data,), (dim,) = args, dims
    data = jnp.moveaxis(data, dim, 0)
    axes = tuple(a + 1 if a >= 0 else a for a in axes)  # the batch axis is kept
    return primitive.bind(data, axes=axes, **params), [0, 0]


def _rescale_factor_abstract(data: Any, *, axes: tuple[int, ...], **_: Any) -> list[Any]:
    kept = [i for i in range(len(data.shape)) if i not in axes]
    return [_compat.aval_like(data, [data.shape[i] for i in kept], _F32, kept)] * 2


rescale_factor_p = define_primitive(
    "rescale_factor",
    _rescale_factor_impl,
    _rescale_factor_abstract,
    multiple_results=True,
    batching=_rescale_factor_batch,
    jvp=zero_tangents,  # a choice of representation: no derivative
    cpu_impl=functools.partial(_rescale_factor_impl, one_kernel_on_cpu=True),
)


# `rescale_factors_p(*data; epsilon, shift)`: `rescale_factor_p` with the "max" norm over
# every axis, for each operand (none empty), as `[factor_1, inverse_1, factor_2, ...]`:
# the per-tensor rescales of a tree (an optimizer's state) together. On XLA:GPU every
# operand's largest magnitude is finished in one kernel (`largest_of_each`: each large
# tensor's rows reduced where it is written; each took one or two kernels of its own, and
# XLA:GPU merged some across tensors of transposed shapes, with transposes in and out); on
# XLA:CPU the small operands in one kernel and the large ones of each size in one
# (`largest_of_several`: XLA:CPU fuses no two reductions, but runs a variadic one as one
# loop); in a program partitioned over devices (where gathering the operands' partials
# into one vector would gather sharded tensors whole), each operand as `rescale_factor_p`
# computes it: a partial reduction on each device and one scalar all-reduce.


def _rescale_factors_impl(*data: Array, epsilon: float, shift: int) -> list[Array]:
    partials = [partial_maxima(lax.abs(d.astype(jnp.float32))) for d in data]
    factors, inverses = _factors_of_norm(largest_of_each(partials), epsilon, shift)
    return [out[k] for k in range(len(data)) for out in (factors, inverses)]


def _rescale_factors_per_tensor(
    *data: Array, epsilon: float, shift: int, one_kernel_on_cpu: bool = False
) -> list[Array]:
    """Each operand's factors from a reduction of its own (`one_kernel_on_cpu`: a small
    operand's in XLA:CPU's one-kernel form, XLA:CPU's form before `largest_of_several`)."""
    return [
        out
        for d in data
        for out in _rescale_factor_impl(
            d,
            norm="max",
            epsilon=epsilon,
            shift=shift,
            axes=tuple(range(d.ndim)),
            one_kernel_on_cpu=one_kernel_on_cpu,
        )
    ]


def _rescale_factors_abstract(*data: Any, **_: Any) -> list[Any]:
    return [_compat.scalar_aval_like(d, _F32) for d in data for _ in range(2)]


def _rescale_factors_batch(
    primitive: Any, args: Any, dims: Any, *, epsilon: float, shift: int
) -> Any:
    # Each operand as `rescale_factor_p` batches it: per example along a batched axis.
    outs, out_dims = [], []
    for data, dim in zip(args, dims):
        if dim is not None:
            data = jnp.moveaxis(data, dim, 0)
        axes = tuple(range(0 if dim is None else 1, data.ndim))
        outs += rescale_factor_p.bind(data, norm="max", epsilon=epsilon, shift=shift, axes=axes)
        out_dims += [None if dim is None else 0] * 2
    return outs, out_dims


def _rescale_factors_cpu(*data: Array, epsilon: float, shift: int) -> list[Array]:
    """XLA:CPU's form: the operands reduced a few at a time, each few in one kernel
    (`largest_of_several`), each operand's factors from its own largest magnitude."""
    magnitudes = [lax.abs(d.astype(jnp.float32)) for d in data]
    return [
        out
        for amax in largest_of_several(magnitudes, finite_only=False)
        for out in _factors_of_norm(amax, epsilon, shift)
    ]


rescale_factors_p = define_primitive(
    "rescale_factors",
    _rescale_factors_impl,
    _rescale_factors_abstract,
    multiple_results=True,
    batching=_rescale_factors_batch,
    jvp=zero_tangents,  # a choice of representation: no derivative
    cpu_impl=_rescale_factors_cpu,
    partitioned_impl=_rescale_factors_per_tensor,
)


def _rescale_per_tensor(x: ScaledArray, norm: str, epsilon: float, shift: int) -> ScaledArray:
    factor, inverse = rescale_factor_p.bind(
        jnp.asarray(x.data), norm=norm, epsilon=epsilon, shift=shift, axes=tuple(range(x.ndim))
    )
    return rebalance_by(x, factor, mark_pow2(inverse))


@register_scaling_op(
    dynamic_rescale_p,
    "a new power-of-two scale per tensor or block, from the data's norm",
    always_scaled=False,
)
def scaled_dynamic_rescale(
    x: Any, *, norm: str, epsilon: float, layout: tuple[int, ...] | None, shift: int = 0
) -> Any:
    if not isinstance(x, ScaledArray) or x.size == 0:
        return x
    own = _layout_of(x)
    target = own if layout is None else tuple(layout)
    if np.ndim(x.scale) == 0 and all(s == 1 for s in target):
        return _rescale_per_tensor(x, norm, epsilon, shift)
    data, scale = _reblock(x, target)
    # Block scales stay in [2^-126, 2^127]: a block of zeros is no reason for a zero scale.
    bits = _pow2_bits(_block_norms(data, target, norm), epsilon, lowest=1)
    inverse = block_scales.materialize(_inverse_pow2(bits))  # once per block (see materialize)
    data = data * block_scales.expand_scale(inverse, x.shape).astype(data.dtype)
    out = _scaled(data, scale * _pow2(bits), x.dtype)
    if not shift:
        return out
    rebalance = rebalance_by if np.ndim(out.scale) == 0 else block_rebalance_by
    return rebalance(out, jnp.float32(2.0**shift))


registry.register_block_rule(dynamic_rescale_p, scaled_dynamic_rescale)


# `dynamic_rescale_many_p(*xs; norm, epsilon, shift)`: `dynamic_rescale_p` (on each
# operand's own layout) of every operand, in one equation, so that the per-tensor max
# rescales of a tree take their factors from one `rescale_factors_p`.


def _many_batch(primitive: Any, args: Any, dims: Any, **params: Any) -> Any:
    return primitive.bind(*args, **params), list(dims)  # own layouts: per operand


def _many_jvp(primitive: Any, primals: Any, tangents: Any, **params: Any) -> Any:
    return primitive.bind(*primals, **params), [_compat.instantiate_zeros(t) for t in tangents]


dynamic_rescale_many_p = define_primitive(
    "dynamic_rescale_many",
    lambda *xs, **_: list(xs),
    lambda *xs, **_: list(xs),
    multiple_results=True,
    batching=_many_batch,
    jvp=_many_jvp,
)


@register_scaling_op(
    dynamic_rescale_many_p,
    "dynamic_rescale of each operand, the per-tensor max factors computed together",
    always_scaled=False,
)
def scaled_dynamic_rescale_many(*xs: Any, norm: str, epsilon: float, shift: int = 0) -> list[Any]:
    together = [
        i
        for i, x in enumerate(xs)
        if norm == "max" and isinstance(x, ScaledArray) and x.size and np.ndim(x.scale) == 0
    ]
    out = [
        x
        if i in together
        else scaled_dynamic_rescale(x, norm=norm, epsilon=epsilon, layout=None, shift=shift)
        for i, x in enumerate(xs)
    ]
    if together:
        data = [jnp.asarray(xs[i].data) for i in together]
        factors = rescale_factors_p.bind(*data, epsilon=epsilon, shift=shift)
        for k, i in enumerate(together):
            out[i] = rebalance_by(xs[i], factors[2 * k], mark_pow2(factors[2 * k + 1]))
    return out


registry.register_block_rule(dynamic_rescale_many_p, scaled_dynamic_rescale_many)


# `rescale_to_bounds_p(*xs, bounds; epsilon, shift)`: the identity on each `x`. Inside
# `autoscale`, each per-tensor scaled `x` takes the scale that `dynamic_rescale_p`'s "max"
# norm would give a tensor whose largest magnitude is `bounds[i]` (a float32 vector of upper
# bounds on the `xs`' largest magnitudes, `core/magnitude_bounds.py`): its data's largest
# magnitude below `2^(shift + 1)`, with no reduction over `x`, so that the kernel computing
# `x` also writes its data. A block-scaled `x` is rescaled from its data, as
# `dynamic_rescale_p` does.


def _bounds_batch(primitive: Any, args: Any, dims: Any, **params: Any) -> Any:
    *xs, bounds = args
    if dims[-1] is not None:  # one bound for the whole batch (one scale per tensor)
        bounds = jnp.max(bounds, axis=dims[-1])
    return primitive.bind(*xs, bounds, **params), list(dims[:-1])


def _bounds_jvp(primitive: Any, primals: Any, tangents: Any, **params: Any) -> Any:
    return primitive.bind(*primals, **params), [_compat.instantiate_zeros(t) for t in tangents[:-1]]


rescale_to_bounds_p = define_primitive(
    "rescale_to_bounds",
    lambda *operands, **_: list(operands[:-1]),
    lambda *operands, **_: list(operands[:-1]),
    multiple_results=True,
    batching=_bounds_batch,
    jvp=_bounds_jvp,
)

_F32_MAX = np.float32(np.finfo(np.float32).max)


# `factors_of_magnitudes_p(magnitudes; epsilon, shift)`: `rescale_factor_p`'s two outputs
# for each element of a float32 vector of largest magnitudes, as `[factor_1, inverse_1,
# factor_2, ...]` scalars. One equation; lowered element by element (a slice and the
# exponent-bit arithmetic each), which XLA copies into the kernels that read each factor.
# A magnitude that is not finite or overflowed float32 (a bound's NaN from 0 * inf) counts
# as the largest float32, so that nothing rescaled with it overflows.


def _factors_of_magnitudes_impl(
    magnitudes: Array, *, epsilon: float, shift: int, written_first: bool = False
) -> list[Array]:
    if written_first:
        # XLA:CPU's form: the vector written by a kernel of its own, each factor's readers
        # loading their element. Copied into each of them, its computation (the largest
        # magnitudes stacked, the bounds' arithmetic) made every store kernel larger: the
        # zoo Equinox step compiled 41% slower than with measured scales.
        magnitudes = lax.optimization_barrier(magnitudes)
    out = []
    for k in range(magnitudes.shape[0]):
        magnitude = lax.squeeze(lax.slice(magnitudes, (k,), (k + 1,)), (0,))
        magnitude = lax.select(magnitude <= _F32_MAX, magnitude, _F32_MAX)
        out += _factors_of_norm(magnitude, epsilon, shift)
    return out


def _factors_of_magnitudes_abstract(magnitudes: Any, **_: Any) -> list[Any]:
    return [_compat.scalar_aval_like(magnitudes, _F32)] * (2 * magnitudes.shape[0])


def _factors_of_magnitudes_batch(
    primitive: Any, args: Any, dims: Any, *, epsilon: float, shift: int
) -> Any:
    (magnitudes,), (dim,) = args, dims
    if dim is not None:  # one factor for the whole batch
        magnitudes = jnp.max(magnitudes, axis=dim)
    outs = primitive.bind(magnitudes, epsilon=epsilon, shift=shift)
    return outs, [None] * len(outs)


factors_of_magnitudes_p = define_primitive(
    "factors_of_magnitudes",
    _factors_of_magnitudes_impl,
    _factors_of_magnitudes_abstract,
    multiple_results=True,
    batching=_factors_of_magnitudes_batch,
    jvp=zero_tangents,  # a choice of representation: no derivative
    cpu_impl=functools.partial(_factors_of_magnitudes_impl, written_first=True),
)


@register_scaling_op(
    rescale_to_bounds_p,
    "per-tensor scales from upper bounds on the largest magnitudes, no reduction",
    always_scaled=False,
)
def scaled_rescale_to_bounds(*operands: Any, epsilon: float, shift: int = 0) -> list[Any]:
    *xs, bounds = operands
    if isinstance(bounds, ScaledArray):
        bounds = bounds.to_array(jnp.float32)
    bounded = [
        i
        for i, x in enumerate(xs)
        if isinstance(x, ScaledArray) and x.size and np.ndim(x.scale) == 0
    ]
    out = [
        x
        if i in bounded
        else scaled_dynamic_rescale(x, norm="max", epsilon=epsilon, layout=None, shift=shift)
        for i, x in enumerate(xs)
    ]
    if not bounded:
        return out
    magnitudes = jnp.asarray(bounds, jnp.float32)
    if len(bounded) < len(xs):
        magnitudes = magnitudes[np.asarray(bounded)]
    scales = [xs[i].scale for i in bounded]
    if any(_compat.is_tracer(s) or float(s) != 1.0 for s in scales):  # the data's bounds
        magnitudes = magnitudes / jnp.stack([jnp.asarray(s, jnp.float32) for s in scales])
    factors = factors_of_magnitudes_p.bind(magnitudes, epsilon=epsilon, shift=shift)
    for k, i in enumerate(bounded):
        out[i] = rebalance_by(xs[i], factors[2 * k], mark_pow2(factors[2 * k + 1]))
    return out


registry.register_block_rule(rescale_to_bounds_p, scaled_rescale_to_bounds)


def rescale_to_bounds(xs: Sequence[Any], bounds: Any, epsilon: float, shift: int = 0) -> list[Any]:
    """Each of `xs` rescaled so that its data's largest magnitude is below `2^(shift + 1)`,
    from `bounds` (a float32 vector: an upper bound on each one's largest magnitude, from
    `core.magnitude_bounds`) rather than from a reduction over it; inside `autoscale`."""
    bind = functools.partial(
        rescale_to_bounds_p.bind, epsilon=_check_epsilon(epsilon), shift=int(shift)
    )
    if any(isinstance(x, ScaledArray) for x in xs):
        return autoscale(bind)(*xs, bounds)
    return bind(*xs, bounds)


# `match_layout_p(x, like)`: the identity on `x`'s value; inside `autoscale`, `x` as a
# ScaledArray (a plain `x` gets scale 1) on the block layout of `like`'s scale (per tensor
# when `like` has a scalar scale or none), each block at the largest of `x`'s scales within
# it. Optimizer states use it to keep their layout from step to step.
def _match_layout_batch(primitive: Any, args: Any, dims: Any) -> Any:
    x, like = args
    x_dim, like_dim = dims
    if x_dim is None:
        x = jnp.broadcast_to(x, (like.shape[like_dim],) + x.shape)
    else:
        x = jnp.moveaxis(x, x_dim, 0)
    like = like if like_dim is None else jnp.moveaxis(like, like_dim, 0)
    return primitive.bind(x, like), 0


match_layout_p = define_identity_primitive("match_layout", _match_layout_batch)


@register_scaling_op(match_layout_p, "re-block to another array's scale layout")
def scaled_match_layout(x: Any, like: Any) -> Any:
    if not isinstance(x, ScaledArray):
        if not is_floating(x):
            return x
        x = ScaledArray(x, np.float32(1.0))  # a plain value: scale 1
    if isinstance(like, ScaledArray) and np.ndim(like.scale) and np.shape(like) == x.shape:
        target = _layout_of(like)
    else:
        target = (1,) * x.ndim
    if _layout_of(x) == target:
        return x
    if all(s == 1 for s in target):
        return ScaledArray(*block_scales.to_per_tensor(x.data, x.scale))
    data, scale = _reblock(x, target)
    return _scaled(data, scale, x.dtype)


registry.register_block_rule(match_layout_p, scaled_match_layout)


def match_layout(x: Array, like: Array) -> Any:
    """`x` with the block layout of `like`'s scale (same value): inside `autoscale`, each
    block of `like`'s layout at the largest of `x`'s scales within it; per tensor when
    `like` has one scale. Outside `autoscale` on plain arrays: the identity."""
    if isinstance(x, ScaledArray) or isinstance(like, ScaledArray):
        return autoscale(match_layout_p.bind)(x, like)
    return match_layout_p.bind(x, like)


# --- public functions ----------------------------------------------------------------------


def _target_layout(shape: tuple[int, ...], scale_shape: ScaleShape) -> tuple[int, ...] | None:
    if scale_shape is None:
        return None
    wanted = scale_shape(shape) if callable(scale_shape) else scale_shape
    return block_scales.block_layout(shape, tuple(int(s) for s in wanted))


def _is_floating_array(x: Any) -> bool:
    return (isinstance(x, ScaledArray) or is_array(x)) and is_floating(x)


def _check_epsilon(epsilon: Any) -> float:
    try:
        value = float(epsilon)
    except (TypeError, ValueError):
        raise TypeError(
            f"dynamic_rescale: epsilon must be a Python number, got {type(epsilon).__name__}."
        ) from None
    if not (np.isfinite(value) and value > 0):
        raise ValueError(
            f"dynamic_rescale: epsilon must be finite and positive (it floors the norm, so "
            f"that all-zero data keeps a usable scale), got {value!r}."
        )
    return value


def rescale_tree(
    tree: Any, norm: str, epsilon: float, scale_shape: ScaleShape, shift: int = 0
) -> Any:
    """Every floating leaf of `tree` rescaled so that each block's `norm` of the data is in
    `[2^shift, 2^(shift + 1))`."""
    epsilon = _check_epsilon(epsilon)
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_scaled_leaf)
    rescaled = [i for i, x in enumerate(leaves) if _is_floating_array(x)]
    if norm == "max" and scale_shape is None and len(rescaled) > 1:
        # One equation for all: their per-tensor factors computed together.
        params = dict(norm=norm, epsilon=float(epsilon), shift=int(shift))
        many = functools.partial(dynamic_rescale_many_p.bind, **params)
        xs = [leaves[i] for i in rescaled]
        outs = autoscale(many)(*xs) if any(isinstance(x, ScaledArray) for x in xs) else many(*xs)
        for i, x in zip(rescaled, outs):
            leaves[i] = x
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def rescale(x: Any) -> Any:
        if not _is_floating_array(x):  # None (a frozen part's gradient), Python scalars...
            return x
        params = dict(
            norm=norm,
            epsilon=float(epsilon),
            layout=_target_layout(tuple(np.shape(x)), scale_shape),
            shift=int(shift),
        )
        if isinstance(x, ScaledArray):  # outside autoscale: interpret the primitive
            return autoscale(functools.partial(dynamic_rescale_p.bind, **params))(x)
        return dynamic_rescale_p.bind(x, **params)

    return jax.tree_util.tree_map(rescale, tree, is_leaf=is_scaled_leaf)


def dynamic_rescale_max(
    tree: Any, epsilon: float = DEFAULT_EPSILON, *, scale_shape: ScaleShape = None
) -> Any:
    """Rescale every scaled leaf so that its data's largest magnitude is in [1, 2).

    A power of two is moved from the data to the scale, so the value is unchanged
    (exactly, unless a block's data falls below its dtype's smallest normal). Works inside
    `autoscale` (on the ScaledArrays the step computes) and outside it (on ScaledArray
    leaves); plain arrays are returned as they are. `epsilon` floors the norm (all-zero
    data keeps a finite scale). A block-scaled leaf is rescaled block by block (the largest
    finite magnitude of each block); `scale_shape` (a tuple, or a function of the leaf's
    shape) asks for another block layout: per row `(M, 1)`, per channel `(1, N)`, MX
    blocks `(M, K // 32)`, tiles, or `()` for one scale per tensor.

    Examples:
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jsa.scaled_array([0.001, -0.002], 1.0)
        >>> y = jsa.ops.dynamic_rescale_max(x)
        >>> float(y.scale), y.to_array().tolist() == x.to_array().tolist()
        (0.001953125, True)
        >>> rows = jsa.scaled_array([[0.001, 0.002], [8.0, 3.0]], [[1.0], [1.0]])
        >>> jsa.ops.dynamic_rescale_max(rows).scale.tolist()
        [[0.001953125], [8.0]]
        >>> jsa.ops.dynamic_rescale_max(x, scale_shape=(2,)).scale.tolist()  # per element
        [0.0009765625, 0.001953125]
    """
    return rescale_tree(tree, "max", epsilon, scale_shape)


def dynamic_rescale_l1(
    tree: Any, epsilon: float = DEFAULT_EPSILON, *, scale_shape: ScaleShape = None
) -> Any:
    """Like :func:`dynamic_rescale_max`, with the mean absolute value of the data.

    Examples:
        >>> import jax_scaled_arithmetics as jsa
        >>> float(jsa.ops.dynamic_rescale_l1(jsa.scaled_array([4.0, 4.0], 1.0)).scale)
        4.0
    """
    return rescale_tree(tree, "l1", epsilon, scale_shape)


def dynamic_rescale_l2(
    tree: Any, epsilon: float = DEFAULT_EPSILON, *, scale_shape: ScaleShape = None
) -> Any:
    """Like :func:`dynamic_rescale_max`, with the root mean square of the data: the scale
    is the largest power of two at most sqrt(mean(|data * scale|^2)).

    Examples:
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jsa.scaled_array([3.0, 4.0], 1.0)  # root mean square 3.54
        >>> jsa.ops.dynamic_rescale_l2(x).scale
        Array(2., dtype=float32)
    """
    return rescale_tree(tree, "l2", epsilon, scale_shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _rescale_gradient(x: Any, norm: str, epsilon: float, scale_shape: ScaleShape) -> Any:
    """`x`, whose gradient is rescaled by `norm`'s :func:`dynamic_rescale_max` family."""
    return x


def _rescale_gradient_fwd(x: Any, norm: str, epsilon: float, scale_shape: ScaleShape) -> Any:
    return x, None


def _rescale_gradient_bwd(
    norm: str, epsilon: float, scale_shape: ScaleShape, _: None, ct: Any
) -> tuple[Any]:
    return (rescale_tree(ct, norm, epsilon, scale_shape),)


_rescale_gradient.defvjp(_rescale_gradient_fwd, _rescale_gradient_bwd)


def _gradients_rescaled(tree: Any, norm: str, epsilon: float, scale_shape: ScaleShape) -> Any:
    if isinstance(scale_shape, list):
        scale_shape = tuple(scale_shape)  # hashable (a static argument)
    epsilon = _check_epsilon(epsilon)
    return jax.tree_util.tree_map(
        lambda x: _rescale_gradient(x, norm, epsilon, scale_shape) if _is_floating_array(x) else x,
        tree,
        is_leaf=is_scaled_leaf,
    )


def dynamic_rescale_max_grad(
    tree: Any, epsilon: float = DEFAULT_EPSILON, *, scale_shape: ScaleShape = None
) -> Any:
    """Identity on the forward pass; :func:`dynamic_rescale_max` of the gradient on the
    backward pass (same `epsilon` and `scale_shape`).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> w = jsa.as_scaled_array(jnp.array([1.0, 2.0], jnp.float16))
        >>> x = jsa.as_scaled_array(jnp.array([0.25, 0.5], jnp.float16))
        >>> def loss(w, x):  # d loss / d w is x: data [0.25, 0.5], scale 1, rescaled
        ...     return jnp.sum(jsa.ops.dynamic_rescale_max_grad(w) * x)
        >>> jsa.autoscale(jax.grad(loss))(w, x)
        ScaledArray(data=Array([0.5, 1. ], dtype=float16), scale=Array(0.5, dtype=float32))
    """
    return _gradients_rescaled(tree, "max", epsilon, scale_shape)


def dynamic_rescale_l1_grad(
    tree: Any, epsilon: float = DEFAULT_EPSILON, *, scale_shape: ScaleShape = None
) -> Any:
    """Like :func:`dynamic_rescale_max_grad`, with :func:`dynamic_rescale_l1`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> w, x = (jsa.as_scaled_array(jnp.array(v, jnp.float16)) for v in ([1, 2], [0.25, 0.5]))
        >>> grad = jax.grad(lambda w, x: (jsa.ops.dynamic_rescale_l1_grad(w) * x).sum())
        >>> jsa.autoscale(grad)(w, x).scale  # the gradient is x: mean |x| 3/8, scale 1/4
        Array(0.25, dtype=float32)
    """
    return _gradients_rescaled(tree, "l1", epsilon, scale_shape)


def dynamic_rescale_l2_grad(
    tree: Any, epsilon: float = DEFAULT_EPSILON, *, scale_shape: ScaleShape = None
) -> Any:
    """Like :func:`dynamic_rescale_max_grad`, with :func:`dynamic_rescale_l2`: in a pytree,
    each leaf's gradient is rescaled by its own root mean square.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> params = {"w": jsa.as_scaled_array(jnp.array([3.0, 4.0], jnp.float16))}
        >>> squares = lambda p: (jsa.ops.dynamic_rescale_l2_grad(p)["w"] ** 2).sum()
        >>> jsa.autoscale(jax.grad(squares))(params)["w"].scale  # grad [6, 8], rms 7.07: scale 4
        Array(4., dtype=float32)
    """
    return _gradients_rescaled(tree, "l2", epsilon, scale_shape)
