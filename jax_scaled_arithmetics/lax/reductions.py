"""Scaled rules for reductions, cumulative and windowed reductions.

Sums (reduce_sum, cumsum, reduce_window_sum) accumulate the data in float32; the
output scale is the input's times a factor `t` and the data is the sum divided by
`t`: with `ScalePolicy.DYNAMIC` (default) the power of two of the sum's largest
magnitude (so sums of non-negative terms, which grow like N, and sums that cancel
both land in range), with `ScalePolicy.STATIC` the unit-scaling `pow2(sqrt(N))`.
A sum of one term per output (N = 1) is its term: the operand's scale, nothing measured.
Max/min keep the scale. Products and generic reductions are computed in float32
and renormalised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import _compat, registry
from ..core.datatype import ScaledArray, is_floating
from .base import (
    compute_dtype,
    register_each,
    register_linear,
    register_unscaled_output,
    unscaled_value,
)
from .indexing import masked_data, renormalised
from .linalg import represent_accumulation


def _sum_rule(primitive: Any, count_of: Any) -> Any:
    """A sum of `count_of(x, params)` values, accumulated in float32, scale times `t`."""

    def rule(x: ScaledArray, **params: Any) -> ScaledArray:
        if count_of(x, params) == 1:
            # One term per output (axes of size 1: autodiff's transpose of a broadcast of
            # a kept dimension): exact in the data's own dtype, at the operand's scale.
            return ScaledArray(primitive.bind(x.data, **params), x.scale)
        acc = primitive.bind(x.data.astype(compute_dtype(x.dtype)), **params)
        return represent_accumulation(acc, [(x.scale, 1)], x.dtype, count_of(x, params))

    rule.__name__ = f"scaled_{primitive.name}"
    return rule


def _prod(sizes: Sequence[int]) -> int:
    return int(np.prod(sizes, dtype=np.int64))


registry.register_scaled_op(
    lax.reduce_sum_p,
    _sum_rule(lax.reduce_sum_p, lambda x, p: _prod([x.shape[a] for a in p["axes"]])),
    family="reduce",
    remark="scale * t: dynamic (or sqrt(N)); N = 1: the term, scale kept",
)
# The last element of a cumsum is the full sum: same rule as reduce_sum, so that
# jnp.cumsum(x)[-1] and jnp.sum(x) agree (and long f16 sums do not overflow).
registry.register_scaled_op(
    lax.cumsum_p,
    _sum_rule(lax.cumsum_p, lambda x, p: x.shape[p["axis"]]),
    family="reduce",
    remark="scale * t: dynamic (or sqrt(N), N the length of the axis); N = 1: scale kept",
)
registry.register_scaled_op(
    lax.reduce_window_sum_p,
    _sum_rule(lax.reduce_window_sum_p, lambda x, p: _prod(p["window_dimensions"])),
    family="reduce",
    remark="scale * t: dynamic (or sqrt(window size)); a window of 1: scale kept",
)


@register_each(lax.reduce_max_p, lax.reduce_min_p, family="linear", remark="scale kept")
def _extremum_rule(primitive: Any) -> Any:
    """max/min keep the scale; an empty reduction gives the identity (-inf/inf), scale 1."""

    def rule(x: ScaledArray, *, axes: Any, **params: Any) -> ScaledArray:
        out = primitive.bind(x.data, axes=axes, **params)
        if _prod([x.shape[a] for a in axes]) == 0:
            return ScaledArray(out, jnp.ones((), jnp.float32))
        return ScaledArray(out, x.scale)

    return rule


for _prim in (
    lax.cummax_p,
    lax.cummin_p,
    lax.reduce_window_max_p,
    lax.reduce_window_min_p,
):
    register_linear(_prim, remark="scale kept")
register_unscaled_output(lax.argmax_p)
register_unscaled_output(lax.argmin_p)


@register_each(
    lax.cumprod_p, lax.cumlogsumexp_p, family="reduce", remark="float32 value, dynamic scale"
)
def _value_rule(primitive: Any) -> Any:
    """Computed on the float32 value; the result renormalised to a power-of-two scale."""

    def rule(x: ScaledArray, **params: Any) -> ScaledArray:
        out = primitive.bind(unscaled_value(x), **params)
        return renormalised(out, 1.0, x.dtype)

    return rule


@registry.register_scaled_op(
    lax.reduce_prod_p, family="reduce", remark="scale ** N * pow2(max |prod(data)|)"
)
def scaled_reduce_prod(x: ScaledArray, *, axes: Any, **params: Any) -> ScaledArray:
    """Product of N values: the data's product (float32) times `scale ** N`.

    The data product is renormalised by its largest power of two. A `scale ** N`
    out of the float32 range gives inf or 0, as the plain float32 product does.
    """
    count = _prod([x.shape[a] for a in axes])
    out = lax.reduce_prod_p.bind(x.data.astype(compute_dtype(x.dtype)), axes=axes, **params)
    return renormalised(out, jnp.asarray(x.scale, jnp.float32) ** count, x.dtype)


def _select_and_add_rule(primitive: Any) -> Any:
    """The rule of a max/min pooling derivative: `values` (the gradient, scattered, or the
    tangents, gathered) placed where `operand` is selected, at the scale of `values`."""

    def rule(values: ScaledArray, operand: ScaledArray, **params: Any) -> ScaledArray:
        out = primitive.bind(values.data, masked_data(operand), **params)
        return ScaledArray(out, values.scale)

    return rule


for _prim, _remark in (
    (lax.select_and_scatter_add_p, "source's scale; selection on data"),  # pooling gradient
    (lax.select_and_gather_add_p, "tangents' scale; selection on data"),  # its forward mode
):
    registry.register_scaled_op(_prim, _select_and_add_rule(_prim), family="linear", remark=_remark)


# --- generic reductions: a body jaxpr, evaluated on float32 values ----------------------


def _upcast(x: Any) -> Any:
    x = jnp.asarray(x)
    if is_floating(x) and x.dtype != compute_dtype(x.dtype):
        return x.astype(compute_dtype(x.dtype))
    return x


def _eval_upcast(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluate `jaxpr` with every floating value widened to float32 (float64 kept)."""
    env: dict[Any, Any] = {}

    def read(atom: Any) -> Any:
        return _upcast(atom.val if isinstance(atom, _compat.Literal) else env[atom])

    for var, value in zip(jaxpr.constvars, consts, strict=True):
        env[var] = value
    for var, value in zip(jaxpr.invars, args, strict=True):
        env[var] = value
    for eqn in jaxpr.eqns:
        invals = [read(a) for a in eqn.invars]
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if isinstance(inner, _compat.ClosedJaxpr):  # jit, closed_call, custom_jvp: inlined
            outs = _eval_upcast(inner.jaxpr, inner.consts, invals)
        else:
            params = dict(eqn.params)
            new_dtype = params.get("new_dtype")
            if eqn.primitive is lax.convert_element_type_p and is_floating(new_dtype):
                params["new_dtype"] = compute_dtype(new_dtype)
            outs = eqn.primitive.bind(*invals, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        for var, out in zip(eqn.outvars, outs, strict=True):
            env[var] = out
    return [read(v) for v in jaxpr.outvars]


def _widened_body(body: Any, dtypes: Sequence[Any]) -> Any:
    """`body` (a closed jaxpr of scalars) re-traced for scalars of `dtypes`."""
    avals = [jax.ShapeDtypeStruct((), d) for d in dtypes]
    return jax.make_jaxpr(lambda *a: _eval_upcast(body.jaxpr, body.consts, a))(*avals)


def _generic_reduction(
    primitive: Any, operands: Sequence[Any], body: Any, body_params: Any, params: dict
) -> list[Any]:
    """Run a reduction with a body jaxpr on float32 values; floating outputs renormalised."""
    values = [unscaled_value(o) if isinstance(o, ScaledArray) else o for o in operands]
    num = len(operands) // 2
    dtypes = [jnp.asarray(v).dtype for v in values[:num]]
    if any(jnp.dtype(v.dtype) != jnp.dtype(o.dtype) for v, o in zip(values, operands, strict=True)):
        body = _widened_body(body, dtypes * 2)
    outs = primitive.bind(*values, **dict(params, **body_params(body)))
    return [
        renormalised(out, 1.0, o.dtype) if isinstance(o, ScaledArray) else out
        for out, o in zip(outs, operands[:num], strict=True)
    ]


@registry.register_scaled_op(
    lax.reduce_p, family="reduce", remark="any body: float32 values, dynamic scale"
)
def scaled_reduce(*operands: Any, jaxpr: Any, **params: Any) -> list[Any]:
    return _generic_reduction(lax.reduce_p, operands, jaxpr, lambda b: {"jaxpr": b}, params)


@registry.register_scaled_op(
    lax.reduce_window_p, family="reduce", remark="any body: float32 values, dynamic scale"
)
def scaled_reduce_window(*operands: Any, jaxpr: Any, consts: Any, **params: Any) -> list[Any]:
    body = _compat.ClosedJaxpr(jaxpr, consts)
    return _generic_reduction(
        lax.reduce_window_p,
        operands,
        body,
        lambda b: {"jaxpr": b.jaxpr, "consts": tuple(b.consts)},
        params,
    )
