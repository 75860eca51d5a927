"""Re-blocking for control flow (`lax/control_flow.py`): `to_scale_shape` brings a value to
a given layout (a loop carry's initial one), `meet_scale_shapes` picks one for a cond's
branches."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from jax import lax

from ...core import block_scales
from ...core.datatype import ScaledArray
from ..base import compute_dtype
from ._common import layout_of, scale_on


def to_scale_shape(x: ScaledArray, scale_shape: Sequence[int]) -> ScaledArray:
    """The same values with a scale of `scale_shape` (`()`: one per tensor, else a block
    layout of `x`). Exact where the layout refines `x`'s (scales repeated); otherwise each
    block of the layout is at the largest scale it holds (data multiplied by ratios of at
    most 1, as :func:`core.block_scales.to_per_tensor` does)."""
    scale_shape = tuple(scale_shape)
    if tuple(np.shape(x.scale)) == scale_shape:
        return x
    if scale_shape == ():
        return ScaledArray(*block_scales.to_per_tensor(x.data, x.scale))
    fine = block_scales.common_layout(x.shape, layout_of(x), scale_shape)
    scale = scale_on(x, fine)
    if fine == scale_shape:  # a refinement: the data is unchanged
        return ScaledArray(x.data, scale)
    target = lax.stop_gradient(block_scales.block_max(scale, scale_shape))
    cdtype = compute_dtype(x.dtype)
    ratio = block_scales.ratio(scale, block_scales.refine_scale(target, x.shape, fine))
    factor = block_scales.expand_scale(ratio, x.shape).astype(cdtype)
    return ScaledArray((x.data.astype(cdtype) * factor).astype(x.dtype), target)


def meet_scale_shapes(
    shape: Sequence[int], scale_shapes: Sequence[Sequence[int]]
) -> tuple[int, ...]:
    """One scale shape for values of `shape` that come with `scale_shapes` (the branches of
    a `cond`): the common refinement when it is one of them (nested layouts: exact), else
    the finest layout coarser than all (along each axis, blocks of the lcm of the sizes);
    `()` when that has one block."""
    shape = tuple(shape)
    shapes = [tuple(s) for s in scale_shapes]
    if all(s == shapes[0] for s in shapes):
        return shapes[0]
    full = [block_scales.block_layout(shape, s) for s in shapes]
    out = block_scales.common_layout(shape, *full)
    if out not in full:
        coarse = []
        for axis, n in enumerate(shape):
            size = math.lcm(*[n // lay[axis] for lay in full]) if n else 0
            coarse.append(n // size if size else 1)
        out = tuple(coarse)
    return () if all(s == 1 for s in out) else out
