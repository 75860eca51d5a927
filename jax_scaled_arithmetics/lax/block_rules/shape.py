"""Block rules of data-only and shape primitives, rev and concatenate.

- data-only ops (neg, abs, copy, reduce_precision, float casts): scale kept;
- transpose, broadcast_in_dim, squeeze: the scale moves with its axes; reshape keeps the
  blocks when only axes with one block are merged or split (else per tensor); slice when
  it cuts along block boundaries with stride 1 (else per tensor);
- rev: the blocks are reversed with the data;
- concatenate: the other axes at the common refinement; along the axis, blocks of the gcd
  of the operands' block sizes when that is the smallest of them (equal block sizes, or
  one block per operand of sizes that are multiples of the smallest...), so the output's
  blocks are all of one size and no operand is cut finer than the finest; else one block
  along the axis (each operand's data brought to the largest scale). Operands that all
  have one block take the ordinary rule (per-tensor programs are unchanged).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ...core import block_scales, registry
from ...core.datatype import ScaledArray, is_floating
from ...core.types import Array
from ..base import compute_dtype
from ._common import layout_of, ordinary, scale_on, scaled

# --- data-only ------------------------------------------------------------------------


def _keep_scale(primitive: Any) -> None:
    def rule(x: ScaledArray, **params: Any) -> Any:
        return ScaledArray(primitive.bind(x.data, **params), x.scale)

    registry.register_block_rule(primitive, rule)


for _prim in (lax.neg_p, lax.abs_p, lax.copy_p, lax.reduce_precision_p):
    _keep_scale(_prim)


@registry.register_block_rule(lax.convert_element_type_p)
def _convert(x: ScaledArray, **params: Any) -> Any:
    if not is_floating(np.dtype(params["new_dtype"])):
        return ordinary(lax.convert_element_type_p, x, **params)
    return ScaledArray(lax.convert_element_type_p.bind(x.data, **params), x.scale)


# --- shape ----------------------------------------------------------------------------


def _move_blocks(primitive: Any, move: Callable[[Array, dict], Array]) -> None:
    """A primitive that moves elements, and `move(scale, params)` the blocks with them."""

    def rule(x: ScaledArray, **params: Any) -> Any:
        data = primitive.bind(x.data, **params)
        if np.ndim(x.scale) == 0:
            return ScaledArray(data, x.scale)
        scale = jnp.asarray(x.scale).reshape(layout_of(x))
        return ScaledArray(data, move(scale, params))

    registry.register_block_rule(primitive, rule)


_move_blocks(lax.transpose_p, lambda scale, params: jnp.transpose(scale, params["permutation"]))
_move_blocks(lax.rev_p, lambda scale, params: lax.rev(scale, params["dimensions"]))


@registry.register_block_rule(lax.broadcast_in_dim_p)
def _broadcast_in_dim(x: ScaledArray, *dyn: Any, **params: Any) -> Any:
    data = lax.broadcast_in_dim_p.bind(x.data, *dyn, **params)
    if np.ndim(x.scale) == 0:
        return ScaledArray(data, x.scale)
    layout = [1] * data.ndim
    for i, d in enumerate(params["broadcast_dimensions"]):
        layout[d] = layout_of(x)[i]
    scale = jnp.asarray(x.scale).reshape(layout_of(x))
    return ScaledArray(
        data, lax.broadcast_in_dim(scale, tuple(layout), params["broadcast_dimensions"])
    )


@registry.register_block_rule(lax.squeeze_p)
def _squeeze(x: ScaledArray, **params: Any) -> Any:
    data = lax.squeeze_p.bind(x.data, **params)
    if np.ndim(x.scale) == 0:
        return ScaledArray(data, x.scale)
    dims = {d % x.ndim for d in params["dimensions"]}
    layout = tuple(s for i, s in enumerate(layout_of(x)) if i not in dims)
    return scaled(data, jnp.asarray(x.scale).reshape(layout) if layout else x.scale)


@registry.register_block_rule(lax.reshape_p)
def _reshape(x: ScaledArray, *dyn: Any, **params: Any) -> Any:
    layout = layout_of(x)
    new_shape = tuple(params["new_sizes"])
    # Blocks stay when every axis with several blocks is in a leading run of axes the
    # reshape leaves as they are (stacked layers, batches of rows...).
    keep = 0
    while keep < min(x.ndim, len(new_shape)) and x.shape[keep] == new_shape[keep]:
        keep += 1
    if params.get("dimensions") is None and all(s == 1 for s in layout[keep:]):
        data = lax.reshape_p.bind(x.data, *dyn, **params)
        new_layout = layout[:keep] + (1,) * (len(new_shape) - keep)
        return scaled(data, jnp.asarray(x.scale).reshape(new_layout))
    return ordinary(lax.reshape_p, x, *dyn, **params)


@registry.register_block_rule(lax.slice_p)
def _slice(x: ScaledArray, **params: Any) -> Any:
    layout = layout_of(x)
    starts, limits = params["start_indices"], params["limit_indices"]
    strides = params.get("strides") or (1,) * x.ndim
    aligned = True
    for n, s, a, b, st in zip(x.shape, layout, starts, limits, strides):
        block = n // s
        if s > 1 and (st != 1 or a % block or b % block):
            aligned = False
    if not aligned:
        return ordinary(lax.slice_p, x, **params)
    data = lax.slice_p.bind(x.data, **params)
    scale = jnp.asarray(x.scale).reshape(layout)
    index = tuple(
        slice(a // (n // s), b // (n // s)) if s > 1 else slice(None)
        for n, s, a, b in zip(x.shape, layout, starts, limits)
    )
    return scaled(data, scale[index])


# --- concatenate ------------------------------------------------------------------------


@registry.register_block_rule(lax.concatenate_p)
def _concatenate(*xs: Any, **params: Any) -> Any:
    axis = params["dimension"]
    layouts = [layout_of(x) if isinstance(x, ScaledArray) else () for x in xs]
    if (
        not all(isinstance(x, ScaledArray) and x.size for x in xs)
        or max(np.prod(lay, dtype=np.int64) for lay in layouts) == 1
    ):  # one block each (per tensor): the ordinary rule, one scale out
        return ordinary(lax.concatenate_p, *xs, **params)
    # The other axes: the common refinement (sizes agree there).
    flat_shape = xs[0].shape[:axis] + (1,) + xs[0].shape[axis + 1 :]
    other = block_scales.common_layout(
        flat_shape, *[lay[:axis] + (1,) + lay[axis + 1 :] for lay in layouts]
    )

    def on_axis(blocks_along: int) -> tuple[int, ...]:
        return other[:axis] + (blocks_along,) + other[axis + 1 :]

    # Along the axis: blocks of the gcd of the operands' block sizes, when that is the
    # smallest of them (no operand is cut finer than the finest operand's blocks).
    sizes = [x.shape[axis] // lay[axis] for x, lay in zip(xs, layouts)]
    block = math.gcd(*sizes)
    if block == min(sizes):
        scales = [scale_on(x, on_axis(x.shape[axis] // block)) for x in xs]
        data = lax.concatenate_p.bind(*[x.data for x in xs], **params)
        return scaled(data, lax.concatenate(scales, axis))
    # Else one block along the axis: each operand's blocks along it brought to the largest
    # scale of all operands (per block of the other axes).
    scales = [scale_on(x, on_axis(lay[axis])) for x, lay in zip(xs, layouts)]
    common = block_scales.largest_scale(scales[0], (axis,))
    for scale in scales[1:]:
        common = lax.max(common, block_scales.largest_scale(scale, (axis,)))
    common = lax.stop_gradient(common).reshape(on_axis(1))
    datas = []
    for x, scale in zip(xs, scales):
        cdtype = compute_dtype(x.dtype)
        factor = block_scales.expand_scale(block_scales.ratio(scale, common), x.shape).astype(
            cdtype
        )
        datas.append((x.data.astype(cdtype) * factor).astype(x.dtype))
    return scaled(lax.concatenate_p.bind(*datas, **params), common)
