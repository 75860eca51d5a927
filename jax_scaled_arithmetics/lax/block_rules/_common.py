"""What the block rules share: an operand's layout and scale on a layout, the fallback to
the ordinary (per-tensor) rule, and outputs with one dynamic scale per block."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ...core import block_scales, registry
from ...core.datatype import ScaledArray
from ...core.types import Array
from ..base import compute_dtype

F32 = np.dtype(np.float32)


def layout_of(x: ScaledArray) -> tuple[int, ...]:
    """The block layout of `x` (all 1s for a per-tensor scale)."""
    if np.ndim(x.scale) == 0:
        return (1,) * x.ndim
    return block_scales.block_layout(x.shape, np.shape(x.scale))


def scale_on(x: ScaledArray, layout: Sequence[int]) -> Array:
    """`x`'s scale on the (finer or equal) `layout`, float32."""
    return block_scales.refine_scale(jnp.asarray(x.scale, F32), x.shape, layout)


def ordinary(primitive: Any, *operands: Any, **params: Any) -> Any:
    """The primitive's ordinary rule on per-tensor operands (a rule that cannot keep blocks)."""
    per_tensor = [
        ScaledArray(*block_scales.to_per_tensor(o.data, o.scale))
        if isinstance(o, ScaledArray)
        else o
        for o in operands
    ]
    return registry.get_scaled_rule(primitive).rule(*per_tensor, **params)


def scaled(data: Array, scale: Array) -> ScaledArray:
    """A ScaledArray whose block scale collapses to a scalar when it has a single block."""
    scale = jnp.asarray(scale, F32)
    if scale.size == 1:
        scale = scale.reshape(())
    return ScaledArray(data, scale)


def dynamic_blocks(acc: Array, factor: Array, layout: Sequence[int], dtype: Any) -> ScaledArray:
    """`acc * expand(factor)` with one power-of-two scale per block of `layout`: the data of
    each block has its largest finite magnitude in [1, 2)."""
    cdtype = compute_dtype(acc.dtype)
    acc = acc.astype(cdtype)
    block_scale, ratio = block_scales.block_dynamic_scale(acc, factor, layout)
    data = acc * block_scales.expand_scale(ratio, acc.shape).astype(cdtype)
    return scaled(data.astype(dtype), block_scale)
