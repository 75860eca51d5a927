"""Scaled rules for `custom_jvp` and `custom_vjp` (other higher-order primitives:
`control_flow.py`).

The scaled function is a new `jax.custom_jvp` / `jax.custom_vjp` over the flattened leaves
(a ScaledArray becomes its `data` and its `scale`), whose rules run the user's rules with
the scaled interpreter, leaf tangents and cotangents converted to and from value tangents,
so `grad` still uses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..core import _compat, block_scales, registry
from ..core.datatype import ScaledArray, is_floating
from ..core.registry import operand_constants
from ..core.subjaxpr import (
    coerce_scaledness,
    flatten_scaled,
    leaf_avals,
    unflatten_scaled,
)
from .base import register_higher_order, safe_div
from .control_flow import per_tensor
from .elementwise import scaled_hypot_with_unit_vector

# --- custom derivatives -------------------------------------------------------------------
#
# The scaled function is a new custom_jvp / custom_vjp over the flattened leaves. Its
# derivative rule runs the user's rule with the scaled interpreter, converting between
# derivatives of leaves (data, scale) and derivatives of the represented values:
#   value = data * scale  =>  d value = d data * scale + data * d scale,
#   dL/d data = dL/d value * scale,  dL/d scale = sum(dL/d value * data).


def _value_tangent(primal: Any, tangent_leaves: Sequence[Any]) -> Any:
    """Tangent of a represented value, from the tangents of its leaves (linear in them)."""
    if not isinstance(primal, ScaledArray):
        return tangent_leaves[0]
    t_data, t_scale = tangent_leaves
    scale = jnp.asarray(primal.scale)
    ratio = block_scales.expand_scale(safe_div(t_scale, scale), primal.shape).astype(primal.dtype)
    data = t_data + primal.data * ratio
    return ScaledArray(data, jax.lax.stop_gradient(scale))


def _leaf_tangents(primal_out: Any, value_tangent: Any) -> list[Any]:
    """Tangents of an output's leaves that give `value_tangent` (the scale's is zero)."""
    if not isinstance(primal_out, ScaledArray):
        if isinstance(value_tangent, ScaledArray):
            value_tangent = value_tangent.to_array()
        return [value_tangent]
    scale = jnp.asarray(primal_out.scale)
    if isinstance(value_tangent, ScaledArray):
        t_scale = jnp.asarray(value_tangent.scale)
        if t_scale.ndim and t_scale.shape != scale.shape:  # another block layout
            value_tangent = per_tensor(value_tangent)
            t_scale = jnp.asarray(value_tangent.scale)
        ratio = block_scales.expand_scale(safe_div(t_scale, scale), primal_out.shape)
        t_data = (value_tangent.data.astype(jnp.float32) * ratio).astype(primal_out.dtype)
    else:
        full = block_scales.expand_scale(scale, primal_out.shape)
        t_data = safe_div(value_tangent.astype(jnp.float32), full).astype(primal_out.dtype)
    return [t_data, jnp.zeros_like(scale)]


def _zeros_like_value(value: Any) -> Any:
    if isinstance(value, ScaledArray):
        return ScaledArray(jnp.zeros_like(value.data), jnp.zeros_like(jnp.asarray(value.scale)))
    return jnp.zeros_like(value)


def _group_leaves(leaves: Sequence[Any], specs: Sequence[bool]) -> list[list[Any]]:
    groups = []
    it = iter(leaves)
    for scaled in specs:
        groups.append([next(it), next(it)] if scaled else [next(it)])
    return groups


class _ScaledPrimal:
    """The scaled interpretation of a custom-derivative function's primal jaxpr.

    Its output structure (which outputs are scaled) is fixed once, from an abstract
    evaluation; the derivative rules coerce their primal outputs to it.
    """

    def __init__(self, call_jaxpr: Any, args: Sequence[Any]) -> None:
        # Only abstract information is kept: the derivative rules close over this object,
        # and must not hold on to the operands (tracers of the current trace).
        self.call_jaxpr = call_jaxpr
        self.known = list(operand_constants()) or [None] * len(args)
        leaves, self.in_specs = flatten_scaled(args)
        self._out_specs: tuple[bool, ...] | None = None
        jax.eval_shape(lambda *flat: flatten_scaled(self.values(*flat))[0], *leaf_avals(leaves))

    @property
    def out_specs(self) -> tuple[bool, ...]:
        assert self._out_specs is not None
        return self._out_specs

    def coerce(self, outs: Sequence[Any]) -> list[Any]:
        if self._out_specs is None:
            self._out_specs = tuple(isinstance(o, ScaledArray) for o in outs)
            return list(outs)
        return [coerce_scaledness(o, s) for o, s in zip(outs, self._out_specs, strict=True)]

    def values(self, *flat: Any) -> list[Any]:
        values = unflatten_scaled(flat, self.in_specs)
        return self.coerce(registry.interpret_closed_jaxpr(self.call_jaxpr, values, self.known))

    def leaves(self, *flat: Any) -> list[Any]:
        """The primal function on leaves: what the custom-derivative wrapper is built on."""
        return flatten_scaled(self.values(*flat))[0]

    def call(self, scaled_fun: Any, args: Sequence[Any]) -> list[Any]:
        """`scaled_fun` (built on :meth:`leaves`) applied to `args`, outputs rebuilt."""
        return unflatten_scaled(scaled_fun(*flatten_scaled(args)[0]), self.out_specs)


@register_higher_order(
    _compat.custom_jvp_call_p,
    remark="the user's JVP rule is kept, and run scaled; jnp.hypot's (JAX >= 0.12) at a "
    "common scale",
)
def scaled_custom_jvp_call(
    *args: Any,
    call_jaxpr: Any,
    jvp_jaxpr_fun: Any,
    symbolic_zeros: bool,
    num_consts: int = 0,  # absent from JAX 0.11 when 0
) -> list[Any]:
    del symbolic_zeros
    hypot_outputs = _compat.jax_hypot_outputs(call_jaxpr)
    if hypot_outputs is not None and num_consts == 0:
        outs = scaled_hypot_with_unit_vector(*args)
        if outs is not None:
            return [outs[i] for i in hypot_outputs]
    primal = _ScaledPrimal(call_jaxpr, args)
    known, in_specs, primal_values = primal.known, primal.in_specs, primal.values
    scaled_fun = jax.custom_jvp(primal.leaves)

    @scaled_fun.defjvp
    def scaled_fun_jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[Any, Any]:
        values = unflatten_scaled(primals, in_specs)
        primal_outs = primal_values(*primals)
        tangent_groups = _group_leaves(tangents, in_specs)
        value_tangents = [_value_tangent(v, t) for v, t in zip(values, tangent_groups, strict=True)]
        n_in = len(values) - num_consts
        jvp_jaxpr, jvp_consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*([False] * n_in))
        jvp_closed = _compat.ClosedJaxpr(jvp_jaxpr, jvp_consts)
        jvp_outs = registry.interpret_closed_jaxpr(
            jvp_closed,
            [*values[num_consts:], *value_tangents[num_consts:]],
            [*known[num_consts:], *([None] * n_in)],
        )
        nz_tangents = iter(jvp_outs[len(out_zeros) :])
        out_tangent_leaves: list[Any] = []
        for primal_out, is_zero in zip(primal_outs, out_zeros, strict=True):
            if is_zero:
                tangent = _zeros_like_value(primal_out)
                out_tangent_leaves.extend(flatten_scaled([tangent])[0])
            else:
                out_tangent_leaves.extend(_leaf_tangents(primal_out, next(nz_tangents)))
        return flatten_scaled(primal_outs)[0], out_tangent_leaves

    return primal.call(scaled_fun, args)


def _instantiate(ct: Any, like: Any) -> Any:
    if _compat.is_symbolic_zero(ct):
        return _zeros_like_value(like)
    return ct


def _value_cotangent(primal_out: Any, ct_leaves: Sequence[Any]) -> Any:
    """Cotangent of a represented value, from its leaves' cotangents: dL/dvalue = ct_data / s."""
    if not isinstance(primal_out, ScaledArray):
        return ct_leaves[0]
    scale = jnp.asarray(primal_out.scale, jnp.float32)
    return ScaledArray(ct_leaves[0], safe_div(1.0, scale))


def _leaf_cotangents(primal_in: Any, value_ct: Any) -> list[Any]:
    """Cotangents of an input's leaves from the cotangent of its represented value."""
    if not isinstance(primal_in, ScaledArray):
        if isinstance(value_ct, ScaledArray):
            value_ct = value_ct.to_array()
        if not is_floating(primal_in):
            return [None]
        return [value_ct.astype(primal_in.dtype)]
    scale = jnp.asarray(primal_in.scale)
    if isinstance(value_ct, ScaledArray):
        ct_scale_in = block_scales.expand_scale(
            jnp.asarray(value_ct.scale, jnp.float32), value_ct.shape
        )
        ct_value = value_ct.data.astype(jnp.float32) * ct_scale_in
    else:
        ct_value = value_ct.astype(jnp.float32)
    full = block_scales.expand_scale(scale.astype(jnp.float32), primal_in.shape)
    ct_data = (ct_value * full).astype(primal_in.dtype)
    products = ct_value * primal_in.data.astype(jnp.float32)
    if scale.ndim:  # dL/dscale of each block: the sum over its block
        ct_scale = block_scales.block_sum(products, scale.shape).astype(scale.dtype)
    else:
        ct_scale = jnp.sum(products).astype(scale.dtype)
    return [ct_data, ct_scale]


@register_higher_order(
    _compat.custom_vjp_call_p,
    remark="the user's fwd/bwd rules are kept, and run scaled",
)
def scaled_custom_vjp_call(
    *args: Any,
    call_jaxpr: Any,
    fwd_jaxpr_thunk: Any,
    bwd: Any,
    out_trees: Any,
    symbolic_zeros: bool,
    num_consts: int = 0,  # absent from JAX 0.11 when 0
) -> list[Any]:
    del symbolic_zeros
    primal = _ScaledPrimal(call_jaxpr, args)
    known, in_specs, out_specs = primal.known, primal.in_specs, primal.out_specs
    scaled_fun = jax.custom_vjp(primal.leaves)

    def scaled_fwd(*flat: Any) -> tuple[list[Any], Any]:
        values = unflatten_scaled(flat, in_specs)
        n_in = len(values) - num_consts
        fwd_jaxpr, fwd_consts = fwd_jaxpr_thunk.call_wrapped(*([True] * n_in))
        fwd_closed = _compat.ClosedJaxpr(fwd_jaxpr, fwd_consts)
        outs = registry.interpret_closed_jaxpr(fwd_closed, values[num_consts:], known[num_consts:])
        _, res_tree, input_fwds = out_trees()
        num_res_out = res_tree.num_leaves - sum(f is not None for f in input_fwds)
        res_out, primal_outs = outs[:num_res_out], outs[num_res_out:]
        res_iter = iter(res_out)
        residuals = [next(res_iter) if f is None else values[f] for f in input_fwds]
        primal_outs = primal.coerce(list(primal_outs))
        return flatten_scaled(primal_outs)[0], (residuals, primal_outs, values)

    def scaled_bwd(saved: Any, ct_leaves: Sequence[Any]) -> tuple[Any, ...]:
        residuals, primal_outs, values = saved
        ct_groups = _group_leaves(ct_leaves, out_specs)
        value_cts = [_value_cotangent(o, c) for o, c in zip(primal_outs, ct_groups, strict=True)]
        plain_res = [r.to_array() if isinstance(r, ScaledArray) else r for r in residuals]
        plain_cts = [c.to_array() if isinstance(c, ScaledArray) else c for c in value_cts]
        inputs = values[num_consts:]

        def bwd_plain(*res_and_cts: Any) -> list[Any]:
            cts_in = _compat.call_custom_vjp_bwd(bwd, *res_and_cts)
            return [
                jnp.zeros(jnp.shape(x), x.dtype) if _compat.is_symbolic_zero(c) else c
                for c, x in zip(cts_in, [_plain_like(v) for v in inputs], strict=True)
            ]

        bwd_closed = jax.make_jaxpr(bwd_plain)(*plain_res, *plain_cts)
        cts_in = registry.interpret_closed_jaxpr(bwd_closed, [*residuals, *value_cts])
        out: list[Any] = []
        for value in values[:num_consts]:
            out.extend(flatten_scaled([_zeros_like_value(value)])[0])
        for value, ct in zip(inputs, cts_in, strict=True):
            out.extend(_leaf_cotangents(value, ct))
        return tuple(out)

    scaled_fun.defvjp(scaled_fwd, scaled_bwd)
    return primal.call(scaled_fun, args)


def _plain_like(value: Any) -> Any:
    if isinstance(value, ScaledArray):
        return jax.ShapeDtypeStruct(value.shape, value.dtype)
    return jax.ShapeDtypeStruct(jnp.shape(value), jnp.result_type(value))


@registry.register_scaled_op(
    _compat.primitives.custom_lin_p,
    always_scaled=False,
    promote=False,
    family="higher-order",
    remark="not supported: internal to jax.linearize",
)
def scaled_custom_lin(*args: Any, **params: Any) -> Any:
    raise NotImplementedError(
        "autoscale cannot interpret 'custom_lin', an internal primitive of jax.linearize's "
        "linear function. Apply autoscale before linearizing (jax.linearize(autoscale(f)) or "
        "autoscale(jax.grad(f))), not to the linearized function."
    )


for _call_prim, _call_rule in (
    (_compat.custom_jvp_call_p, scaled_custom_jvp_call),
    (_compat.custom_vjp_call_p, scaled_custom_vjp_call),
):
    registry.register_block_rule(_call_prim, _call_rule)
