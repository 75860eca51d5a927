"""Rules that keep block scales (one scale per row, channel, MX block, tile or layer).

A primitive listed here keeps its operands' block layouts; any other primitive gets its
block-scaled operands in per-tensor form (the largest block scale, every block's data
multiplied by its ratio to it: `core.block_scales.to_per_tensor`) and its ordinary rule.
Layouts meet at their common refinement (along each axis, blocks of the greatest common
divisor of the operands' block sizes), so operands with different layouts combine
exactly. Outputs of sums and contractions get one dynamic power-of-two scale per block
(the largest finite magnitude of each block), whatever the policy.

- data-only ops (neg, abs, copy, reduce_precision, float casts): scale kept;
- transpose, broadcast_in_dim, squeeze: the scale moves with its axes; reshape keeps the
  blocks when only axes with one block are merged or split (else per tensor); slice when
  it cuts along block boundaries with stride 1 (else per tensor);
- mul / div: data multiplied / divided, scales multiplied / divided per block;
- exp, log, tanh, logistic, sqrt, rsqrt, sin, cos, erf, integer powers...: computed on
  the value in float32, one dynamic scale per block of the output;
- add, sub, max, min, select_n: each block at the larger of its operands' scales;
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
  more: each output feature still uses one rhs output feature;
- rev: the blocks are reversed with the data;
- concatenate: the other axes at the common refinement; along the axis, blocks of the gcd
  of the operands' block sizes when that is the smallest of them (equal block sizes, or
  one block per operand of sizes that are multiples of the smallest...), so the output's
  blocks are all of one size and no operand is cut finer than the finest; else one block
  along the axis (each operand's data brought to the largest scale). Operands that all
  have one block take the ordinary rule (per-tensor programs are unchanged);
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
  per tensor would flush small updates. scatter-mul / min / max go per tensor;
- control flow (`lax/control_flow.py`): `to_scale_shape` brings a value to a given layout
  (a loop carry's initial one), `meet_scale_shapes` picks one for a cond's branches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import _compat, block_scales, registry
from ..core.datatype import ScaledArray, is_floating
from ..core.types import Array
from .base import compute_dtype, select_whole_cases
from .indexing import scatter_update_params
from .scale_algebra import static_value

_F32 = np.dtype(np.float32)


def layout_of(x: ScaledArray) -> tuple[int, ...]:
    """The block layout of `x` (all 1s for a per-tensor scale)."""
    if np.ndim(x.scale) == 0:
        return (1,) * x.ndim
    return block_scales.block_layout(x.shape, np.shape(x.scale))


def scale_on(x: ScaledArray, layout: Sequence[int]) -> Array:
    """`x`'s scale on the (finer or equal) `layout`, float32."""
    return block_scales.refine_scale(jnp.asarray(x.scale, _F32), x.shape, layout)


def _ordinary(primitive: Any, *operands: Any, **params: Any) -> Any:
    """The primitive's ordinary rule on per-tensor operands (a rule that cannot keep blocks)."""
    per_tensor = [
        ScaledArray(*block_scales.to_per_tensor(o.data, o.scale))
        if isinstance(o, ScaledArray)
        else o
        for o in operands
    ]
    return registry.get_scaled_rule(primitive).rule(*per_tensor, **params)


def _scaled(data: Array, scale: Array) -> ScaledArray:
    """A ScaledArray whose block scale collapses to a scalar when it has a single block."""
    scale = jnp.asarray(scale, _F32)
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
    return _scaled(data.astype(dtype), block_scale)


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
        return _ordinary(lax.convert_element_type_p, x, **params)
    return ScaledArray(lax.convert_element_type_p.bind(x.data, **params), x.scale)


# --- shape ----------------------------------------------------------------------------


@registry.register_block_rule(lax.transpose_p)
def _transpose(x: ScaledArray, **params: Any) -> Any:
    data = lax.transpose_p.bind(x.data, **params)
    if np.ndim(x.scale) == 0:
        return ScaledArray(data, x.scale)
    scale = jnp.asarray(x.scale).reshape(layout_of(x))
    return ScaledArray(data, jnp.transpose(scale, params["permutation"]))


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
    return _scaled(data, jnp.asarray(x.scale).reshape(layout) if layout else x.scale)


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
        return _scaled(data, jnp.asarray(x.scale).reshape(new_layout))
    return _ordinary(lax.reshape_p, x, *dyn, **params)


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
        return _ordinary(lax.slice_p, x, **params)
    data = lax.slice_p.bind(x.data, **params)
    scale = jnp.asarray(x.scale).reshape(layout)
    index = tuple(
        slice(a // (n // s), b // (n // s)) if s > 1 else slice(None)
        for n, s, a, b in zip(x.shape, layout, starts, limits)
    )
    return _scaled(data, scale[index])


# --- elementwise ------------------------------------------------------------------------


def _full(xs: Sequence[ScaledArray]) -> list[ScaledArray]:
    """Operands broadcast to one shape (JAX binds scalar literals, and size-1 axes, beside
    full arrays); a broadcast axis has one block."""
    shape = tuple(np.broadcast_shapes(*[x.shape for x in xs]))
    out = []
    for x in xs:
        if x.shape != shape:
            scale = x.scale
            if np.ndim(scale):
                lead = (1,) * (len(shape) - x.ndim)
                scale = jnp.asarray(scale).reshape(lead + layout_of(x))
            x = ScaledArray(jnp.broadcast_to(x.data, shape), scale)
        out.append(x)
    return out


def _common(xs: Sequence[ScaledArray]) -> tuple[tuple[int, ...], list[Array]]:
    xs = _full(xs)
    shape = xs[0].shape
    layout = block_scales.common_layout(shape, *[layout_of(x) for x in xs])
    return layout, [scale_on(x, layout) for x in xs]


@registry.register_block_rule(lax.mul_p)
def _mul(a: ScaledArray, b: ScaledArray, **params: Any) -> Any:
    a, b = _full([a, b])
    layout, (sa, sb) = _common([a, b])
    cdtype = compute_dtype(a.dtype)
    data = (a.data.astype(cdtype) * b.data.astype(cdtype)).astype(a.dtype)
    return _scaled(data, sa * sb)


@registry.register_block_rule(lax.div_p)
def _div(a: ScaledArray, b: ScaledArray, **params: Any) -> Any:
    a, b = _full([a, b])
    layout, (sa, sb) = _common([a, b])
    cdtype = compute_dtype(a.dtype)
    data = lax.div(a.data.astype(cdtype), b.data.astype(cdtype)).astype(a.dtype)
    return _scaled(data, sa / sb)


def _at_common_scale(xs: Sequence[ScaledArray]) -> tuple[list[Array], Array]:
    """The operands' data at one scale per block (the largest of theirs), compute dtype."""
    xs = _full(xs)
    layout, scales = _common(xs)
    distinct: list[Array] = []
    for scale in scales:
        if not any(scale is d for d in distinct):
            distinct.append(scale)
    common = distinct[0]
    for scale in distinct[1:]:
        common = lax.max(common, scale)
    # No stop_gradient: each operand's value `data * ratio(s, common) * common` does not
    # depend on `common`, and autodiff of the ratio (scale_divide_p) says so exactly.
    out = []
    for x, scale in zip(xs, scales):
        cdtype = compute_dtype(x.dtype)
        if scale is common:  # already at the common scale
            out.append(x.data.astype(cdtype))
            continue
        factor = block_scales.expand_scale(block_scales.ratio(scale, common), x.shape).astype(
            cdtype
        )
        out.append(x.data.astype(cdtype) * factor)
    return out, common


def _common_scale_rule(primitive: Any) -> None:
    def rule(*operands: Any, **params: Any) -> Any:
        xs = [o for o in operands if isinstance(o, ScaledArray)]
        datas, common = _at_common_scale(xs)
        it = iter(datas)
        args = [next(it).astype(o.dtype) if isinstance(o, ScaledArray) else o for o in operands]
        return _scaled(primitive.bind(*args, **params), common)

    registry.register_block_rule(primitive, rule)


for _prim in (
    lax.add_p,
    lax.sub_p,
    _compat.primitives.add_jaxvals_p,
    lax.max_p,
    lax.min_p,
):
    _common_scale_rule(_prim)


@registry.register_block_rule(lax.select_n_p)
def _select_n_blocks(which: Any, *cases: Any, **params: Any) -> Any:
    """A scalar predicate selects a whole case, blocks and all; otherwise each block of the
    cases at the largest of their scales."""
    whole = select_whole_cases(which, cases, **params)
    if whole is not None:
        return whole
    datas, common = _at_common_scale(list(cases))
    return _scaled(
        lax.select_n_p.bind(which, *[d.astype(c.dtype) for d, c in zip(datas, cases)], **params),
        common,
    )


# Non-linear functions of one operand: computed on the value in float32, each block of
# the output at the power of two of its largest magnitude (one block reduction).


def _unary_value_rule(primitive: Any) -> None:
    def rule(x: ScaledArray, **params: Any) -> Any:
        layout = layout_of(x)
        cdtype = compute_dtype(x.dtype)
        scale = block_scales.expand_scale(jnp.asarray(x.scale, _F32), x.shape).astype(cdtype)
        value = primitive.bind(x.data.astype(cdtype) * scale, **params)
        return dynamic_blocks(value, np.float32(1.0), layout, x.dtype)

    registry.register_block_rule(primitive, rule)


for _name in (
    "exp_p exp2_p log_p log1p_p expm1_p tanh_p logistic_p sqrt_p rsqrt_p cbrt_p sin_p cos_p "
    "erf_p integer_pow_p square_p"
).split():
    if hasattr(lax, _name):
        _unary_value_rule(getattr(lax, _name))


# --- reductions -------------------------------------------------------------------------


def _reduce_prep(x: ScaledArray, axes: Sequence[int]) -> tuple[Array, Array]:
    """Data with the blocks along `axes` at their largest scale (compute dtype), and the
    scale over the remaining axes (the reduced ones dropped)."""
    layout = layout_of(x)
    scale = jnp.asarray(x.scale, _F32).reshape(layout) if np.ndim(x.scale) else x.scale
    if np.ndim(scale) == 0:
        return x.data, scale
    out_layout = tuple(s for i, s in enumerate(layout) if i not in set(axes))
    if all(layout[a] == 1 for a in axes):  # one block along every reduced axis
        return x.data, scale.reshape(out_layout)
    kept = lax.stop_gradient(jnp.max(scale, axis=tuple(axes), keepdims=True))
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
        return _scaled(primitive.bind(data, **params).astype(x.dtype), scale)

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
        return x.data, jnp.asarray(x.scale, _F32).reshape(layout), layout
    scale = jnp.asarray(x.scale, _F32).reshape(layout)
    if not any(layout[a] > 1 for a in contracting):
        return x.data, scale, layout
    kept = lax.stop_gradient(jnp.max(scale, axis=tuple(contracting), keepdims=True))
    cdtype = compute_dtype(x.dtype)
    factor = block_scales.expand_scale(block_scales.ratio(scale, kept), x.shape).astype(cdtype)
    return x.data.astype(cdtype) * factor, kept, tuple(kept.shape)


@registry.register_block_rule(lax.dot_general_p)
def _dot_general(lhs: ScaledArray, rhs: ScaledArray, **params: Any) -> Any:
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    preferred = params.get("preferred_element_type")
    out_dtype = jnp.result_type(lhs.dtype, rhs.dtype) if preferred is None else preferred
    ldata, lscale, llayout = _apply_contracting_blocks(lhs, lc)
    rdata, rscale, rlayout = _apply_contracting_blocks(rhs, rc)
    if ldata.dtype != rdata.dtype:
        ldata, rdata = ldata.astype(_F32), rdata.astype(_F32)
    acc_dtype = compute_dtype(out_dtype)
    acc = lax.dot_general_p.bind(ldata, rdata, **dict(params, preferred_element_type=acc_dtype))
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
        r_kept = lax.stop_gradient(jnp.max(r_perm, axis=r_free_axes, keepdims=True))
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
    preferred = params.get("preferred_element_type")
    out_dtype = jnp.result_type(lhs.dtype, rhs.dtype) if preferred is None else preferred
    ldata, lscale, llayout = _apply_contracting_blocks(lhs, lcontract)
    rdata, rscale, rlayout = _apply_contracting_blocks(rhs, rcontract)
    if ldata.dtype != rdata.dtype:
        ldata, rdata = ldata.astype(_F32), rdata.astype(_F32)
    acc_dtype = compute_dtype(out_dtype)
    acc = lax.conv_general_dilated_p.bind(
        ldata, rdata, **dict(params, preferred_element_type=acc_dtype)
    )
    # Output scale: lhs batch blocks along the output's batch axis, rhs output-feature
    # blocks along its feature axis (their outer product).
    l_shape, r_shape = [1] * acc.ndim, [1] * acc.ndim
    l_shape[ospec[0]] = llayout[lspec[0]]
    r_shape[ospec[1]] = rlayout[rspec[0]]
    factor = lscale.reshape(tuple(l_shape)) * rscale.reshape(tuple(r_shape))
    return dynamic_blocks(acc, factor, factor.shape, out_dtype)


@registry.register_block_rule(lax.rev_p)
def _rev(x: ScaledArray, **params: Any) -> Any:
    data = lax.rev_p.bind(x.data, **params)
    if np.ndim(x.scale) == 0:
        return ScaledArray(data, x.scale)
    scale = jnp.asarray(x.scale).reshape(layout_of(x))
    return ScaledArray(data, lax.rev(scale, params["dimensions"]))


# --- concatenate ------------------------------------------------------------------------


@registry.register_block_rule(lax.concatenate_p)
def _concatenate(*xs: Any, **params: Any) -> Any:
    axis = params["dimension"]
    layouts = [layout_of(x) if isinstance(x, ScaledArray) else () for x in xs]
    if (
        not all(isinstance(x, ScaledArray) and x.size for x in xs)
        or max(np.prod(lay, dtype=np.int64) for lay in layouts) == 1
    ):  # one block each (per tensor): the ordinary rule, one scale out
        return _ordinary(lax.concatenate_p, *xs, **params)
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
        return _scaled(data, lax.concatenate(scales, axis))
    # Else one block along the axis: each operand's blocks along it brought to the largest
    # scale of all operands (per block of the other axes).
    scales = [scale_on(x, on_axis(lay[axis])) for x, lay in zip(xs, layouts)]
    common = lax.reduce_max(scales[0], (axis,))
    for scale in scales[1:]:
        common = lax.max(common, lax.reduce_max(scale, (axis,)))
    common = lax.stop_gradient(common).reshape(on_axis(1))
    datas = []
    for x, scale in zip(xs, scales):
        cdtype = compute_dtype(x.dtype)
        factor = block_scales.expand_scale(block_scales.ratio(scale, common), x.shape).astype(
            cdtype
        )
        datas.append((x.data.astype(cdtype) * factor).astype(x.dtype))
    return _scaled(lax.concatenate_p.bind(*datas, **params), common)


# --- re-blocking (control flow: carries and branch outputs of one layout) ---------------


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


# --- indexing: gather, dynamic slices, pad ----------------------------------------------


def _scale_array(x: ScaledArray, layout: Sequence[int]) -> Array:
    """`x`'s scale as a float32 array of `layout` (a refinement of its own layout)."""
    return block_scales.refine_scale(jnp.asarray(x.scale, _F32), x.shape, tuple(layout))


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
        return _ordinary(lax.gather_p, operand, indices, **params)
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
    return _scaled(data, scale)


def _dynamic_slice_scale(
    scale: Array, shape: Sequence[int], starts: Sequence[Any], sizes: Sequence[int]
) -> Array:
    """A dynamic slice of the block scale `scale` of an array of `shape` that matches the
    data's: axes with one block, or sliced whole, keep their blocks; others go to one scale
    per element and are sliced at the same (clamped) start."""
    layout = block_scales.block_layout(shape, np.shape(scale))
    target = tuple(s if s == 1 or z == n else n for n, s, z in zip(shape, layout, sizes))
    fine = block_scales.refine_scale(jnp.asarray(scale, _F32), shape, target)
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
        return _ordinary(lax.dynamic_slice_p, x, *rest, **params)
    data = lax.dynamic_slice_p.bind(x.data, *rest, **params)
    scale = jnp.asarray(x.scale, _F32).reshape(layout_of(x))
    return _scaled(data, _dynamic_slice_scale(scale, x.shape, rest, sizes))


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
        return _ordinary(lax.dynamic_update_slice_p, operand, update, *starts, **params)
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
    return _scaled(data, scale)


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
        return _ordinary(lax.pad_p, x, value, **params)
    data = lax.pad_p.bind(x.data, value.data, **params)
    if not data.size:
        return _ordinary(lax.pad_p, x, value, **params)
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
    scale = lax.pad(_scale_array(x, target), jnp.asarray(value.scale, _F32), scale_config)
    return _scaled(data, scale)


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
            return _ordinary(primitive, operand, indices, updates, **params)
        layout = _scatter_layout(operand, updates, params)
        so, su = jnp.asarray(operand.scale, _F32), jnp.asarray(updates.scale, _F32)
        top = lax.stop_gradient(lax.max(jnp.max(so), jnp.max(su)))
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
