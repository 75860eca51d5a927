"""Scaled rules for indexing: dynamic slices, gather, scatter, sort and top-k.

Indices are never scaled. Selecting elements keeps the scale; writing values
into an array brings the array and the written values to a common scale first.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import registry
from ..core.datatype import ScaledArray
from ..core.pow2 import pow2_round, static_pow2
from ..core.types import Array
from .base import (
    compute_dtype,
    register_common_scale,
    register_each,
    register_linear,
    rescale,
    safe_div,
    to_common_scale,
    unscaled_value,
)


def masked_data(x: ScaledArray) -> Array:
    """The data of `x`, or `data * 0` where the scale is 0: the (signed) zeros it represents.

    Rules whose result depends on the order of the data (sort, top_k, pooling
    selection) use it, so that a zero scale orders as the zeros it represents.
    """
    return jnp.where(jnp.asarray(x.scale) == 0, x.data * jnp.zeros((), x.dtype), x.data)


def renormalised(y: Array, scale: Array, dtype: Any) -> ScaledArray:
    """`y * scale` as a ScaledArray with `dtype` data, `y` renormalised to its range.

    `y` (high precision) is divided by the power of two nearest its largest finite
    magnitude, which joins the scale (1 when `y` has no nonzero finite value).
    """
    finite = jnp.isfinite(y)
    amax = jnp.max(jnp.where(finite, jnp.abs(y), 0), initial=0).astype(jnp.float32)
    norm = lax.stop_gradient(jnp.where(amax > 0, pow2_round(amax), 1))
    data = (y / norm.astype(y.dtype)).astype(dtype)
    return ScaledArray(data, jnp.asarray(scale, jnp.float32) * norm)


register_linear(lax.dynamic_slice_p, remark="indices plain")
register_common_scale(
    lax.dynamic_update_slice_p,
    scaled_operands=(0, 1),
    remark="operand and update at a common scale",
)


@registry.register_scaled_op(
    lax.gather_p, family="linear", remark="indices plain; a finite fill value joins the scale"
)
def scaled_gather(operand: ScaledArray, indices: Array, **params: Any) -> ScaledArray:
    """Gather on the data. Out-of-bounds fill values 0, NaN and inf are scale-free.

    Another fill value `c` (with `mode="fill"`) is a scaled constant: the output
    takes the common scale of the operand and `c`, and in-bounds positions come
    from a second gather of ones.
    """
    fill = params.get("fill_value")
    mode = params.get("mode")
    if (
        fill is None
        or mode != lax.GatherScatterMode.FILL_OR_DROP
        or not np.isfinite(fill)
        or fill == 0
    ):
        return ScaledArray(lax.gather_p.bind(operand.data, indices, **params), operand.scale)
    scale_in = jnp.asarray(operand.scale, jnp.float32)
    scale = jnp.maximum(scale_in, np.float32(static_pow2(fill)))
    data = rescale(operand.data, safe_div(scale_in, scale))
    bind_params = dict(params, fill_value=0)
    out = lax.gather_p.bind(data, indices, **bind_params)
    inside = lax.gather_p.bind(jnp.ones_like(data), indices, **bind_params)
    fill_data = (np.float32(fill) / scale).astype(data.dtype)
    return ScaledArray(jnp.where(inside != 0, out, fill_data), lax.stop_gradient(scale))


register_common_scale(
    lax.scatter_p, scaled_operands=(0, 2), remark="operand and updates at a common scale"
)
for _prim in (lax.scatter_min_p, lax.scatter_max_p):
    register_common_scale(
        _prim, scaled_operands=(0, 2), remark="operand and updates at a common scale"
    )


@functools.cache
def _update_jaxpr(combine: Any, dtype: Any) -> Any:
    scalar = jax.ShapeDtypeStruct((), dtype)
    return jax.make_jaxpr(combine)(scalar, scalar)


def scatter_update_params(params: dict[str, Any], combine: Any, dtype: Any) -> dict[str, Any]:
    """`params` with the scatter's update computation rebuilt for `dtype` scalars."""
    closed = _update_jaxpr(combine, jnp.dtype(dtype))
    return dict(params, update_jaxpr=closed.jaxpr, update_consts=tuple(closed.consts))


@register_each(
    (lax.scatter_add_p, lax.add),
    (lax.scatter_sub_p, lax.sub),
    family="common scale",
    remark="operand and updates at a common scale, accumulated in float32",
)
def _scaled_scatter_add_like(primitive: Any, combine: Any) -> Any:
    def rule(operand: ScaledArray, indices: Array, updates: ScaledArray, **params: Any) -> Any:
        (data, upd), scale = to_common_scale(operand, updates)
        cdtype = compute_dtype(operand.dtype)
        out = primitive.bind(
            data.astype(cdtype),
            indices,
            upd.astype(cdtype),
            **scatter_update_params(params, combine, cdtype),
        )
        return ScaledArray(out.astype(operand.dtype), scale)

    return rule


@registry.register_scaled_op(
    lax.scatter_mul_p,
    family="scatter-mul",
    remark="updates unscaled (factors); float32 product, scale * pow2(max |data|)",
)
def scaled_scatter_mul(
    operand: ScaledArray, indices: Array, updates: ScaledArray, **params: Any
) -> ScaledArray:
    """Multiply some elements of `operand` by `updates`.

    Untouched elements keep the operand's value and touched ones are multiplied,
    so no scalar output scale fits both from the scales alone: the updates are
    used as plain factors (their value, in float32), the operand's data is
    multiplied in float32, and the result is renormalised by the power of two
    nearest its largest magnitude (the operand's scale times that power).
    """
    cdtype = compute_dtype(operand.dtype)
    factors = unscaled_value(updates, cdtype)
    out = lax.scatter_mul_p.bind(
        operand.data.astype(cdtype),
        indices,
        factors,
        **scatter_update_params(params, lax.mul, cdtype),
    )
    return renormalised(out, operand.scale, operand.dtype)


@registry.register_scaled_op(
    lax.sort_p, family="sort", remark="keys sorted on their data; every operand keeps its scale"
)
def scaled_sort(*operands: Any, num_keys: int, **params: Any) -> list[Any]:
    """Sort on the data: a positive scale does not change the order of a key.

    Keys are compared separately, so each keeps its own scale; a zero-scale key
    sorts as zeros (stable order), as its values do.
    """
    datas = [
        (masked_data(o) if i < num_keys else o.data) if isinstance(o, ScaledArray) else o
        for i, o in enumerate(operands)
    ]
    outs = lax.sort_p.bind(*datas, num_keys=num_keys, **params)
    return [
        ScaledArray(out, o.scale) if isinstance(o, ScaledArray) else out
        for out, o in zip(outs, operands, strict=True)
    ]


@register_each(lax.top_k_p, lax.approx_top_k_p, family="sort", remark="values keep the scale")
def _scaled_top_k_like(primitive: Any) -> Any:
    def rule(operand: ScaledArray, **params: Any) -> list[Any]:
        values, idx = primitive.bind(masked_data(operand), **params)
        return [ScaledArray(values, operand.scale), idx]

    return rule
