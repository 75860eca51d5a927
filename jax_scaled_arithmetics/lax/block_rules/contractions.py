"""Block rules of reductions and contractions (dot_general, convolutions): blocks along
reduced or contracted axes are applied before the operation, the output gets one dynamic
scale per block.

- reductions: blocks along a reduced axis are first brought to their largest scale;
- dot_general: blocks along contracting axes are applied to the data in float32 before
  the product (as MX hardware applies them per block); blocks of the lhs's batch and free
  axes stay the output's; blocks of the rhs's free axes are applied to the float32
  accumulator (an output scale per (row, column) pair would be as large as the data).
- conv_general_dilated: scales on axes that are not contracted factor out of a
  convolution: the lhs's batch blocks (per example) and the rhs's output-feature blocks
  (per output channel) are the output's, along its batch and feature axes (their outer
  product). Blocks along contracted axes (input features, spatial window; the lhs batch
  when `batch_group_count > 1`) are applied to the data in float32 before the conv, as for
  dot_general: exact, and it keeps small blocks that a per-tensor fallback would flush (at
  the cost of a float32 copy of that operand). `feature_group_count > 1` needs nothing
  more: each output feature still uses one rhs output feature.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ...core import block_scales, registry
from ...core.datatype import ScaledArray
from ...core.types import Array
from ..base import compute_dtype, contraction_dtype
from ._common import F32, dynamic_blocks, layout_of, scaled

# --- reductions -------------------------------------------------------------------------


def _reduce_prep(x: ScaledArray, axes: Sequence[int]) -> tuple[Array, Array]:
    """Data with the blocks along `axes` at their largest scale (compute dtype), and the
    scale over the remaining axes (the reduced ones dropped)."""
    layout = layout_of(x)
    scale = jnp.asarray(x.scale, F32).reshape(layout) if np.ndim(x.scale) else x.scale
    if np.ndim(scale) == 0:
        return x.data, scale
    out_layout = tuple(s for i, s in enumerate(layout) if i not in set(axes))
    if all(layout[a] == 1 for a in axes):  # one block along every reduced axis
        return x.data, scale.reshape(out_layout)
    kept = lax.stop_gradient(block_scales.largest_scale(scale, axes, keepdims=True))
    data = x.data
    if any(layout[a] > 1 for a in axes):
        cdtype = compute_dtype(x.dtype)
        factor = block_scales.expand_scale(block_scales.ratio(scale, kept), x.shape).astype(cdtype)
        data = x.data.astype(cdtype) * factor
    return data, kept.reshape(out_layout)


@registry.register_block_rule(lax.reduce_sum_p)
def _reduce_sum(x: ScaledArray, **params: Any) -> Any:
    data, scale = _reduce_prep(x, params["axes"])
    acc = lax.reduce_sum_p.bind(data, **params)
    layout = np.shape(scale) if np.ndim(scale) else (1,) * acc.ndim
    return dynamic_blocks(acc, scale, layout, x.dtype)


def _reduce_keep(primitive: Any) -> None:
    def rule(x: ScaledArray, **params: Any) -> Any:
        data, scale = _reduce_prep(x, params["axes"])
        return scaled(primitive.bind(data, **params).astype(x.dtype), scale)

    registry.register_block_rule(primitive, rule)


for _prim in (lax.reduce_max_p, lax.reduce_min_p):
    _reduce_keep(_prim)


# --- dot_general ------------------------------------------------------------------------


def _apply_contracting_blocks(
    x: ScaledArray, contracting: Sequence[int]
) -> tuple[Array, Array, tuple[int, ...]]:
    """Data with the blocks along `contracting` applied (float32 where there are several),
    and the scale left on the other axes (1 along `contracting`), with its layout."""
    layout = layout_of(x)
    if np.ndim(x.scale) == 0:
        return x.data, jnp.asarray(x.scale, F32).reshape(layout), layout
    scale = jnp.asarray(x.scale, F32).reshape(layout)
    if not any(layout[a] > 1 for a in contracting):
        return x.data, scale, layout
    kept = lax.stop_gradient(block_scales.largest_scale(scale, contracting, keepdims=True))
    cdtype = compute_dtype(x.dtype)
    factor = block_scales.expand_scale(block_scales.ratio(scale, kept), x.shape).astype(cdtype)
    return x.data.astype(cdtype) * factor, kept, tuple(kept.shape)


# An operand of a contraction: its data, the scale left on it, and that scale's layout.
_Operand = tuple[Array, Array, tuple[int, ...]]


def _contracted_operands(
    primitive: Any,
    lhs: ScaledArray,
    rhs: ScaledArray,
    lcontract: Sequence[int],
    rcontract: Sequence[int],
    params: dict,
) -> tuple[_Operand, _Operand, Any, dict]:
    """(data, scale, layout) of each operand with its blocks along the contracted axes
    applied (data of one dtype), the output dtype, and `params` with the accumulator's."""
    out_dtype = contraction_dtype(primitive, params, lhs, rhs)
    ldata, lscale, llayout = _apply_contracting_blocks(lhs, lcontract)
    rdata, rscale, rlayout = _apply_contracting_blocks(rhs, rcontract)
    if ldata.dtype != rdata.dtype:
        ldata, rdata = ldata.astype(F32), rdata.astype(F32)
    acc_params = dict(params, preferred_element_type=compute_dtype(out_dtype))
    return (ldata, lscale, llayout), (rdata, rscale, rlayout), out_dtype, acc_params


@registry.register_block_rule(lax.dot_general_p)
def _dot_general(lhs: ScaledArray, rhs: ScaledArray, **params: Any) -> Any:
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    (ldata, lscale, llayout), (rdata, rscale, rlayout), out_dtype, acc_params = (
        _contracted_operands(lax.dot_general_p, lhs, rhs, lc, rc, params)
    )
    acc = lax.dot_general_p.bind(ldata, rdata, **acc_params)
    lfree = [i for i in range(lhs.ndim) if i not in lc and i not in lb]
    rfree = [i for i in range(rhs.ndim) if i not in rc and i not in rb]
    # Output axes: batch, lhs free, rhs free. Scales as arrays of the output's rank.
    nb, nl, nr = len(lb), len(lfree), len(rfree)
    l_out = jnp.transpose(lscale, [*lb, *lfree, *lc]).reshape(
        tuple(llayout[i] for i in [*lb, *lfree]) + (1,) * nr
    )
    # rhs free blocks are applied to the accumulator, relative to their largest.
    r_perm = jnp.transpose(rscale, [*rb, *rfree, *rc]).reshape(
        tuple(rlayout[i] for i in [*rb, *rfree])
    )
    r_free_axes = tuple(range(nb, nb + nr))
    r_kept = r_perm
    if any(rlayout[i] > 1 for i in rfree):
        r_kept = lax.stop_gradient(block_scales.largest_scale(r_perm, r_free_axes, keepdims=True))
        inner = block_scales.ratio(r_perm, r_kept).reshape(
            r_perm.shape[:nb] + (1,) * nl + r_perm.shape[nb:]
        )
        acc = acc * block_scales.expand_scale(inner, acc.shape).astype(acc.dtype)
    r_out = r_kept.reshape(r_perm.shape[:nb] + (1,) * (nl + nr))
    layout = block_scales.common_layout(acc.shape, l_out.shape, r_out.shape)
    factor = block_scales.refine_scale(l_out, acc.shape, layout) * block_scales.refine_scale(
        r_out, acc.shape, layout
    )
    return dynamic_blocks(acc, factor, layout, out_dtype)


# --- convolutions -----------------------------------------------------------------------


def _conv_specs(
    lhs: ScaledArray, params: dict
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(lhs, rhs, out) specs: batch / out-feature axis first, then feature, then spatial."""
    dnums = params.get("dimension_numbers")
    if dnums is None:
        spec = tuple(range(lhs.ndim))
        return spec, spec, spec
    return tuple(dnums.lhs_spec), tuple(dnums.rhs_spec), tuple(dnums.out_spec)


@registry.register_block_rule(lax.conv_general_dilated_p)
def _conv_general_dilated(lhs: ScaledArray, rhs: ScaledArray, **params: Any) -> Any:
    lspec, rspec, ospec = _conv_specs(lhs, params)
    # Each output element sums products of one lhs batch element (one group of them with
    # batch_group_count > 1) with one rhs output feature: those blocks factor out; every
    # other axis is contracted (input features, spatial window).
    lhs_kept = [lspec[0]] if params.get("batch_group_count", 1) == 1 else []
    lcontract = [a for a in range(lhs.ndim) if a not in lhs_kept]
    rcontract = [a for a in range(rhs.ndim) if a != rspec[0]]
    (ldata, lscale, llayout), (rdata, rscale, rlayout), out_dtype, acc_params = (
        _contracted_operands(lax.conv_general_dilated_p, lhs, rhs, lcontract, rcontract, params)
    )
    acc = lax.conv_general_dilated_p.bind(ldata, rdata, **acc_params)
    # Output scale: lhs batch blocks along the output's batch axis, rhs output-feature
    # blocks along its feature axis (their outer product).
    l_shape, r_shape = [1] * acc.ndim, [1] * acc.ndim
    l_shape[ospec[0]] = llayout[lspec[0]]
    r_shape[ospec[1]] = rlayout[rspec[0]]
    factor = lscale.reshape(tuple(l_shape)) * rscale.reshape(tuple(r_shape))
    return dynamic_blocks(acc, factor, factor.shape, out_dtype)
