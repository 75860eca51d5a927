"""Scaled rules for higher-order primitives: jit, remat, closed_call, custom_jvp/vjp.

Each re-interprets its inner jaxpr(s) with the scaled interpreter over flattened
leaves (a ScaledArray becomes its `data` and `scale`) and binds the original
primitive on the result, so that `jit` keeps its shardings and donation, and
custom derivative rules stay what `grad` uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..core import _compat, registry
from ..core.datatype import ScaledArray, is_floating
from ..core.interpreter import operand_constants
from ..core.subjaxpr import (
    coerce_scaledness,
    flatten_scaled,
    leaf_avals,
    trace_scaled_jaxpr,
    unflatten_scaled,
)
from .base import safe_div


def _expand_per_value(values: Sequence[Any], specs: Sequence[bool], name: str) -> tuple[Any, ...]:
    out: list[Any] = []
    for value, scaled in zip(values, specs):
        out.append(value)
        if scaled:
            out.append(_compat.default_per_arg_value(name))
    return tuple(out)


@registry.register_scaled_op(
    _compat.jit_p, always_scaled=True, promote=False, family="higher-order",
    remark="kept as a sub-call with its shardings, layouts and donation",
)
def scaled_jit(*args: Any, jaxpr: Any, **params: Any) -> list[Any]:
    known = operand_constants()
    new_jaxpr, consts, out_specs = trace_scaled_jaxpr(jaxpr, args, known)
    leaves, in_specs = flatten_scaled(args)
    new_params = dict(params)
    for name in _compat.JIT_PER_INPUT_PARAMS:
        if name in params:
            per_const = (_compat.default_per_arg_value(name),) * len(consts)
            new_params[name] = per_const + _expand_per_value(params[name], in_specs, name)
    for name in _compat.JIT_PER_OUTPUT_PARAMS:
        if name in params:
            new_params[name] = _expand_per_value(params[name], out_specs, name)
    outs = _compat.jit_p.bind(*consts, *leaves, jaxpr=new_jaxpr, **new_params)
    return unflatten_scaled(outs, out_specs)


@registry.register_scaled_op(
    _compat.closed_call_p, always_scaled=True, promote=False, family="higher-order",
    remark="inlined (a closed_call has no behaviour of its own)",
)
def scaled_closed_call(*args: Any, call_jaxpr: Any, **params: Any) -> list[Any]:
    del params
    return registry.interpret_closed_jaxpr(call_jaxpr, args, operand_constants())


@registry.register_scaled_op(
    _compat.remat_p, always_scaled=True, promote=False, family="higher-order",
    remark="checkpoint kept, with its policy",
)
def scaled_remat(*args: Any, jaxpr: Any, prevent_cse: Any, **params: Any) -> list[Any]:
    closed = _compat.ClosedJaxpr(jaxpr, ())
    new_jaxpr, consts, out_specs = trace_scaled_jaxpr(closed, args, operand_constants())
    leaves, in_specs = flatten_scaled(args)
    if not isinstance(prevent_cse, bool):
        expanded: list[Any] = [True] * len(consts)
        for value, scaled in zip(prevent_cse, in_specs):
            expanded.extend([value, value] if scaled else [value])
        prevent_cse = tuple(expanded)
    outs = _compat.remat_p.bind(
        *consts, *leaves, jaxpr=new_jaxpr.jaxpr, prevent_cse=prevent_cse, **params
    )
    return unflatten_scaled(outs, out_specs)


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
    ratio = safe_div(t_scale, scale).astype(primal.dtype)
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
        ratio = safe_div(jnp.asarray(value_tangent.scale), scale)
        t_data = (value_tangent.data.astype(jnp.float32) * ratio).astype(primal_out.dtype)
    else:
        t_data = safe_div(value_tangent.astype(jnp.float32), scale).astype(primal_out.dtype)
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


@registry.register_scaled_op(
    _compat.custom_jvp_call_p, always_scaled=True, promote=False, family="higher-order",
    remark="the user's JVP rule is kept, and run scaled",
)
def scaled_custom_jvp_call(
    *args: Any, call_jaxpr: Any, jvp_jaxpr_fun: Any, num_consts: int, symbolic_zeros: bool
) -> list[Any]:
    del symbolic_zeros
    known = list(operand_constants()) or [None] * len(args)
    leaves, in_specs = flatten_scaled(args)
    out_specs_box: list[tuple[bool, ...]] = []

    def primal_values(*flat: Any) -> list[Any]:
        values = unflatten_scaled(flat, in_specs)
        outs = registry.interpret_closed_jaxpr(call_jaxpr, values, known)
        if out_specs_box:
            outs = [coerce_scaledness(o, s) for o, s in zip(outs, out_specs_box[0])]
        else:
            out_specs_box.append(tuple(isinstance(o, ScaledArray) for o in outs))
        return outs

    # Fix the output structure once, from the primal interpretation.
    jax.eval_shape(lambda *flat: flatten_scaled(primal_values(*flat))[0], *leaf_avals(leaves))
    out_specs = out_specs_box[0]

    @jax.custom_jvp
    def scaled_fun(*flat: Any) -> list[Any]:
        return flatten_scaled(primal_values(*flat))[0]

    @scaled_fun.defjvp
    def scaled_fun_jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[Any, Any]:
        values = unflatten_scaled(primals, in_specs)
        primal_outs = primal_values(*primals)
        tangent_groups = _group_leaves(tangents, in_specs)
        value_tangents = [_value_tangent(v, t) for v, t in zip(values, tangent_groups)]
        n_in = len(values) - num_consts
        jvp_jaxpr, jvp_consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*([False] * n_in))
        jvp_closed = _compat.ClosedJaxpr(jvp_jaxpr, jvp_consts)
        jvp_outs = registry.interpret_closed_jaxpr(
            jvp_closed, [*values[num_consts:], *value_tangents[num_consts:]],
            [*known[num_consts:], *([None] * n_in)],
        )
        nz_tangents = iter(jvp_outs[len(out_zeros):])
        out_tangent_leaves: list[Any] = []
        for primal_out, is_zero in zip(primal_outs, out_zeros):
            if is_zero:
                tangent = _zeros_like_value(primal_out)
                out_tangent_leaves.extend(flatten_scaled([tangent])[0])
            else:
                out_tangent_leaves.extend(_leaf_tangents(primal_out, next(nz_tangents)))
        return flatten_scaled(primal_outs)[0], out_tangent_leaves

    outs = scaled_fun(*leaves)
    return unflatten_scaled(outs, out_specs)


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
        ct_value = value_ct.data.astype(jnp.float32) * jnp.asarray(value_ct.scale, jnp.float32)
    else:
        ct_value = value_ct.astype(jnp.float32)
    ct_data = (ct_value * scale.astype(jnp.float32)).astype(primal_in.dtype)
    ct_scale = jnp.sum(ct_value * primal_in.data.astype(jnp.float32)).astype(scale.dtype)
    return [ct_data, ct_scale]


@registry.register_scaled_op(
    _compat.custom_vjp_call_p, always_scaled=True, promote=False, family="higher-order",
    remark="the user's fwd/bwd rules are kept, and run scaled",
)
def scaled_custom_vjp_call(
    *args: Any,
    call_jaxpr: Any,
    fwd_jaxpr_thunk: Any,
    bwd: Any,
    out_trees: Any,
    num_consts: int,
    symbolic_zeros: bool,
) -> list[Any]:
    del symbolic_zeros
    known = list(operand_constants()) or [None] * len(args)
    leaves, in_specs = flatten_scaled(args)
    out_specs_box: list[tuple[bool, ...]] = []

    def primal_values(*flat: Any) -> list[Any]:
        values = unflatten_scaled(flat, in_specs)
        outs = registry.interpret_closed_jaxpr(call_jaxpr, values, known)
        return _coerce_outs(outs)

    def _coerce_outs(outs: list[Any]) -> list[Any]:
        if out_specs_box:
            return [coerce_scaledness(o, s) for o, s in zip(outs, out_specs_box[0])]
        out_specs_box.append(tuple(isinstance(o, ScaledArray) for o in outs))
        return outs

    jax.eval_shape(lambda *flat: flatten_scaled(primal_values(*flat))[0], *leaf_avals(leaves))
    out_specs = out_specs_box[0]

    @jax.custom_vjp
    def scaled_fun(*flat: Any) -> list[Any]:
        return flatten_scaled(primal_values(*flat))[0]

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
        primal_outs = _coerce_outs(list(primal_outs))
        return flatten_scaled(primal_outs)[0], (residuals, primal_outs, values)

    def scaled_bwd(saved: Any, ct_leaves: Sequence[Any]) -> tuple[Any, ...]:
        residuals, primal_outs, values = saved
        ct_groups = _group_leaves(ct_leaves, out_specs)
        value_cts = [_value_cotangent(o, c) for o, c in zip(primal_outs, ct_groups)]
        plain_res = [r.to_array() if isinstance(r, ScaledArray) else r for r in residuals]
        plain_cts = [c.to_array() if isinstance(c, ScaledArray) else c for c in value_cts]
        inputs = values[num_consts:]

        def bwd_plain(*res_and_cts: Any) -> list[Any]:
            cts_in = bwd.call_wrapped(*res_and_cts)
            return [
                jnp.zeros(jnp.shape(x), x.dtype) if _compat.is_symbolic_zero(c) else c
                for c, x in zip(cts_in, [_plain_like(v) for v in inputs])
            ]

        bwd_closed = jax.make_jaxpr(bwd_plain)(*plain_res, *plain_cts)
        cts_in = registry.interpret_closed_jaxpr(bwd_closed, [*residuals, *value_cts])
        out: list[Any] = []
        for value in values[:num_consts]:
            out.extend(flatten_scaled([_zeros_like_value(value)])[0])
        for value, ct in zip(inputs, cts_in):
            out.extend(_leaf_cotangents(value, ct))
        return tuple(out)

    scaled_fun.defvjp(scaled_fwd, scaled_bwd)
    outs = scaled_fun(*leaves)
    return unflatten_scaled(outs, out_specs)


def _plain_like(value: Any) -> Any:
    if isinstance(value, ScaledArray):
        return jax.ShapeDtypeStruct(value.shape, value.dtype)
    return jax.ShapeDtypeStruct(jnp.shape(value), jnp.result_type(value))
