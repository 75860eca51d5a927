"""Block rules of indexing primitives: gather, dynamic slices, pad and scatters.

- gather: the scale array gathered with the same indices (one entry per element along
  indexed axes with several blocks; a per-row table gives per-token lookups, a per-column
  one keeps its columns); fills other than 0 / NaN get scale 1; `one_hot` mode and slices
  ending inside a block of a non-indexed axis go per tensor;
- dynamic_slice: axes with one block or sliced whole keep their blocks, others go to one
  scale per element, sliced at the same start; dynamic_update_slice: nothing rescaled,
  the region of the scale array replaced by the update's (one scale per element along the
  partially updated axes); pad: the scale array padded with the padding value's scale
  (whole blocks added, or one scale per element along axes cut inside a block);
- scatter, scatter-add, scatter-sub: values in float32 relative to the largest scale, one
  dynamic scale per block of the operand's layout (one per element along indexed axes when
  the updates have blocks along their scatter axes: per-row embedding gradients).
  Bringing updates to the operand's block scales could overflow a small block, one scale
  per tensor would flush small updates. scatter-mul / min / max go per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ...core import block_scales, registry
from ...core.datatype import ScaledArray
from ...core.types import Array
from ..base import compute_dtype
from ..indexing import scatter_update_params
from ..scale_algebra import static_value
from ._common import F32, dynamic_blocks, layout_of, ordinary, scaled

# --- indexing: gather, dynamic slices, pad ----------------------------------------------


def _scale_array(x: ScaledArray, layout: Sequence[int]) -> Array:
    """`x`'s scale as a float32 array of `layout` (a refinement of its own layout)."""
    return block_scales.refine_scale(jnp.asarray(x.scale, F32), x.shape, tuple(layout))


def _fill_needs_mask(mode: Any, fill: Any) -> bool:
    """Whether out-of-bounds fills need scale 1: a fill of 0 or NaN is the same value at any
    (finite) scale; another fill value `c` is `c` only at scale 1."""
    if mode != lax.GatherScatterMode.FILL_OR_DROP or fill is None:
        return False
    return not (np.isnan(fill) or fill == 0)


def _gather_in_bounds(indices: Array, shape: Sequence[int], params: dict) -> Array:
    """Per index vector: whether its slice lies inside the operand (FILL_OR_DROP's test)."""
    dnums, sizes = params["dimension_numbers"], params["slice_sizes"]
    upper = np.array([shape[i] - sizes[i] for i in dnums.start_index_map], indices.dtype)
    lead = (1,) * (indices.ndim - 1)
    inside = (indices >= 0) & (indices <= upper.reshape(lead + upper.shape))
    return jnp.all(inside, axis=-1)


@registry.register_block_rule(lax.gather_p)
def _gather(operand: ScaledArray, indices: Array, **params: Any) -> Any:
    """Each gathered element keeps its block's scale, the scale array being gathered with
    the same indices (clamped as the data's are).

    Along indexed axes (and batching axes) the scale goes to one entry per element when it
    has several blocks, so that an element's scale is found at its own index (a per-row
    table `(V, 1)` is already one per element: free); a scale with one block along every
    indexed axis does not depend on the indices (per-column tables `(1, d)` give `(1, ...,
    1, d)`). Other axes start at 0 and keep their blocks when the slice ends on a block
    boundary (a whole row of a tiled table), else the ordinary rule (per tensor).
    Out-of-bounds fills (`mode=FILL_OR_DROP`): 0 and NaN are the same at any scale; another
    fill value `c` gets scale 1. `ONE_HOT` mode: the ordinary rule.
    """
    mode = lax.GatherScatterMode.from_any(params.get("mode"))
    dnums, sizes = params["dimension_numbers"], tuple(params["slice_sizes"])
    layout = layout_of(operand)
    # An indexed axis sliced whole starts at 0 (clamped; out of bounds with FILL_OR_DROP).
    indexed = {i for i in dnums.start_index_map if sizes[i] < operand.shape[i]}
    indexed |= set(dnums.operand_batching_dims)
    misaligned = any(
        s > 1 and i not in indexed and z % (n // s)
        for i, (n, s, z) in enumerate(zip(operand.shape, layout, sizes))
    )
    if mode == lax.GatherScatterMode.ONE_HOT or misaligned or not operand.size:
        return ordinary(lax.gather_p, operand, indices, **params)
    data = lax.gather_p.bind(operand.data, indices, **params)
    if all(layout[i] == 1 for i in indexed):
        # The scale does not depend on the indices: one block along the output's batch axes.
        target = layout
        scale_indices = jnp.zeros((1,) * (indices.ndim - 1) + indices.shape[-1:], indices.dtype)
    else:
        target = tuple(
            n if i in indexed and s > 1 else s
            for i, (n, s) in enumerate(zip(operand.shape, layout))
        )
        # Batching axes pair operand and indices element by element.
        target = tuple(
            n if i in dnums.operand_batching_dims else t
            for i, (n, t) in enumerate(zip(operand.shape, target))
        )
        scale_indices = indices
    scale_sizes = tuple(
        z if t == n else (1 if t == 1 else z // (n // t))
        for n, t, z in zip(operand.shape, target, sizes)
    )
    scale = lax.gather_p.bind(
        _scale_array(operand, target),
        scale_indices,
        **dict(params, slice_sizes=scale_sizes, mode=lax.GatherScatterMode.CLIP, fill_value=None),
    )
    if _fill_needs_mask(mode, params.get("fill_value")):
        batch_dims = [d for d in range(data.ndim) if d not in set(dnums.offset_dims)]
        shape = tuple(
            data.shape[d] if d in batch_dims else scale.shape[d] for d in range(data.ndim)
        )
        inside = lax.broadcast_in_dim(
            _gather_in_bounds(indices, operand.shape, params), shape, tuple(batch_dims)
        )
        scale = jnp.where(inside, jnp.broadcast_to(scale, shape), np.float32(1.0))
    return scaled(data, scale)


def _dynamic_slice_scale(
    scale: Array, shape: Sequence[int], starts: Sequence[Any], sizes: Sequence[int]
) -> Array:
    """A dynamic slice of the block scale `scale` of an array of `shape` that matches the
    data's: axes with one block, or sliced whole, keep their blocks; others go to one scale
    per element and are sliced at the same (clamped) start."""
    layout = block_scales.block_layout(shape, np.shape(scale))
    target = tuple(s if s == 1 or z == n else n for n, s, z in zip(shape, layout, sizes))
    fine = block_scales.refine_scale(jnp.asarray(scale, F32), shape, target)
    moving = [t == n and z < n for n, t, z in zip(shape, target, sizes)]
    scale_starts = [st if m else 0 for st, m in zip(starts, moving)]
    scale_sizes = [z if m else t for z, t, m in zip(sizes, target, moving)]
    return lax.dynamic_slice(fine, scale_starts, scale_sizes)


@registry.register_block_rule(lax.dynamic_slice_p)
def _dynamic_slice(x: ScaledArray, *rest: Any, **params: Any) -> Any:
    """Axes with one block, or sliced to their full size, keep their blocks; an axis with
    several blocks sliced at a dynamic start gets one scale per element (the scale array
    expanded along it, then sliced at the same start: a per-token KV cache `(B, T, 1, 1)`
    is already one per element; tiles along the axis cost a scale per element of it)."""
    sizes = tuple(params["slice_sizes"])
    if len(rest) != x.ndim or not x.size or 0 in sizes:  # dynamic shapes, empty slices
        return ordinary(lax.dynamic_slice_p, x, *rest, **params)
    data = lax.dynamic_slice_p.bind(x.data, *rest, **params)
    scale = jnp.asarray(x.scale, F32).reshape(layout_of(x))
    return scaled(data, _dynamic_slice_scale(scale, x.shape, rest, sizes))


@registry.register_block_rule(lax.dynamic_update_slice_p)
def _dynamic_update_slice(operand: Any, update: Any, *starts: Any, **params: Any) -> Any:
    """Operand and update keep their own scales (the data is written as it is: no
    rescaling, nothing overflows): the output scale is the operand's with the updated region
    replaced by the update's. Along axes the update covers whole, the common refinement of
    both layouts; along the others one scale per element (so the region's edges fall on
    block boundaries), the scale arrays updated at the same (clamped) start. Writing a token
    into a per-token cache `(B, T, 1, 1)` is free; a partial update along an axis that had
    one block costs a scale per element of it."""
    if (
        not isinstance(operand, ScaledArray)
        or not isinstance(update, ScaledArray)
        or len(starts) != operand.ndim
        or not update.size
    ):
        return ordinary(lax.dynamic_update_slice_p, operand, update, *starts, **params)
    lo, lu = layout_of(operand), layout_of(update)
    out_layout, upd_layout = [], []
    for n, u, so, su in zip(operand.shape, update.shape, lo, lu):
        if u == n:
            out_layout.append(n // math.gcd(n // so, n // su))
            upd_layout.append(out_layout[-1])
        else:
            out_layout.append(n)
            upd_layout.append(u)
    scale_starts = [st if u < n else 0 for st, u, n in zip(starts, update.shape, operand.shape)]
    scale = lax.dynamic_update_slice(
        _scale_array(operand, out_layout), _scale_array(update, upd_layout), scale_starts
    )
    data = lax.dynamic_update_slice_p.bind(operand.data, update.data, *starts, **params)
    return scaled(data, scale)


@registry.register_block_rule(lax.pad_p)
def _pad(x: Any, value: Any, **params: Any) -> Any:
    """The padded region represents the padding value at its own scale (the data padded
    with its data, the scale array with its scale): exact, nothing rescaled. Per axis:
    unpadded axes keep their blocks; padding (or cropping) by whole blocks adds (removes)
    blocks; a zero padding value needs nothing along an axis with one block (zeros at any
    scale); other padded axes (interior padding, a cut inside a block, or a nonzero value
    along an axis with one block) get one scale per element."""
    config = params["padding_config"]
    if not isinstance(x, ScaledArray) or not isinstance(value, ScaledArray):
        return ordinary(lax.pad_p, x, value, **params)
    data = lax.pad_p.bind(x.data, value.data, **params)
    if not data.size:
        return ordinary(lax.pad_p, x, value, **params)
    zero = static_value(value.scale) == 0.0
    layout = layout_of(x)
    target, scale_config = [], []
    for n, s, (lo, hi, interior) in zip(x.shape, layout, config):
        block = n // s
        if (lo, hi, interior) == (0, 0, 0) or (s == 1 and zero):
            target.append(s)
            scale_config.append((0, 0, 0))
        elif not interior and lo % block == 0 and hi % block == 0:
            target.append(s)
            scale_config.append((lo // block, hi // block, 0))
        else:
            target.append(n)
            scale_config.append((lo, hi, interior))
    scale = lax.pad(_scale_array(x, target), jnp.asarray(value.scale, F32), scale_config)
    return scaled(data, scale)


# --- scatter ----------------------------------------------------------------------------


def _scatter_layout(operand: ScaledArray, updates: ScaledArray, params: dict) -> tuple[int, ...]:
    """The output layout of a scatter: the operand's, refined by where the updates' blocks
    land. With blocks along the updates' scatter (non-window) axes (one scale per token of
    an embedding's cotangent), one scale per element along the operand's indexed axes (one
    per row of the table); along a window axis, the updates' blocks when the window starts
    at 0 (one per element when it starts at an index)."""
    dnums = params["dimension_numbers"]
    shape, lu = operand.shape, layout_of(updates)
    inserted = set(dnums.inserted_window_dims) | set(dnums.operand_batching_dims)
    indexed = set(dnums.scatter_dims_to_operand_dims)
    window_axes = [i for i in range(operand.ndim) if i not in inserted]
    window_of = dict(zip(window_axes, dnums.update_window_dims))
    scatter_dims = [d for d in range(updates.ndim) if d not in set(dnums.update_window_dims)]
    scattered = any(lu[d] > 1 for d in scatter_dims)
    from_updates = []
    for i, n in enumerate(shape):
        if i in inserted:
            from_updates.append(n if scattered else 1)
            continue
        d = window_of[i]
        if i in indexed:
            from_updates.append(n if scattered or lu[d] > 1 else 1)
        else:
            from_updates.append(n // math.gcd(n, updates.shape[d] // lu[d]))
    return block_scales.common_layout(shape, layout_of(operand), tuple(from_updates))


def _scatter_rule(primitive: Any, combine: Any) -> None:
    def rule(operand: Any, indices: Any, updates: Any, **params: Any) -> Any:
        if (
            not isinstance(operand, ScaledArray)
            or not isinstance(updates, ScaledArray)
            or not operand.size
            or not updates.size
        ):
            return ordinary(primitive, operand, indices, updates, **params)
        layout = _scatter_layout(operand, updates, params)
        so, su = jnp.asarray(operand.scale, F32), jnp.asarray(updates.scale, F32)
        top = lax.stop_gradient(
            lax.max(block_scales.largest_scale(so), block_scales.largest_scale(su))
        )
        cdtype = compute_dtype(operand.dtype)

        def value(x: ScaledArray, scale: Array) -> Array:
            factor = block_scales.expand_scale(block_scales.ratio(scale, top), x.shape).astype(
                cdtype
            )
            return x.data.astype(cdtype) * factor

        if combine is not None:
            params = scatter_update_params(params, combine, cdtype)
        acc = primitive.bind(value(operand, so), indices, value(updates, su), **params)
        return dynamic_blocks(acc, top, layout, operand.dtype)

    registry.register_block_rule(primitive, rule)


for _prim, _combine in (
    (lax.scatter_add_p, lax.add),
    (lax.scatter_sub_p, lax.sub),
    (lax.scatter_p, None),
):
    _scatter_rule(_prim, _combine)
