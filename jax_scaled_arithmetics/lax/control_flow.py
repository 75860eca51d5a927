"""Scaled rules for `jit`, `remat`, calls, and loops and conditionals. The other
higher-order rules: `custom_derivatives.py` (`custom_jvp`/`custom_vjp`), `linear_solve.py`,
`callbacks.py` (callbacks, barriers, names, placement), `collectives.py`.

Every rule re-interprets the inner jaxpr(s) with the scaled interpreter over
flattened leaves (a ScaledArray becomes its `data` and its `scale`), then emits
the original construct over those leaves:

- `jit` and `remat` are bound again with their per-argument params expanded
  (shardings, layouts, donation, `prevent_cse`); `closed_call` is inlined, and so are a
  `composite`'s decomposition and a hijax primitive's (`call_hi_primitive`) expansion into
  ordinary primitives.
- `custom_jvp` / `custom_vjp` become new `jax.custom_jvp` / `jax.custom_vjp`
  over leaves whose rules run the user's rules scaled (leaf tangents and
  cotangents converted to and from value tangents), so `grad` still uses them.
- `scan`, `while` and `cond` are re-emitted with the public `jax.lax.scan`,
  `while_loop` and `switch` rather than by binding the primitives: their params
  (`linear`, `_split_transpose`, jaxpr layouts, const counts...) change between
  JAX releases, while the public signatures do not. Only `length`, `reverse`
  and `unroll` (and `_split_transpose` where present) are forwarded.
- A loop carry keeps one structure: a carry scaled on input stays scaled; one
  the body returns scaled is promoted on input and the body traced again, until
  a fixed point. The scale is a carried leaf, so it can change per iteration.
  A scaled stacked output of `scan` keeps one scale per iteration, as a block
  scale `(L, 1, ...)` (or its loop-invariant scale), and a scanned input with such
  a scale gives each iteration its own: stacked layers keep their own scales.
- Block scales (`lax/block_rules/reblocking.py`): a carry of `scan` or `while` keeps its
  initial value's layout, per tensor or blocks: the body's output is brought back to it
  (exactly where the layout is finer than the body's, else each block at the largest
  scale it holds).
- A `cond` output scaled in one branch is scaled (promoted) in all; the index
  stays plain. Its branches meet at one layout per output: the finest of theirs when
  their layouts are nested (exact), else the finest layout coarser than all of them.
- `custom_linear_solve` runs the public `jax.lax.custom_linear_solve` on the data
  of the right-hand side with fixed scales, so its implicit derivatives apply.
- Callbacks (`jax.debug.print`/`callback`, `pure_callback`, `io_callback`) see
  represented values; barriers, `checkpoint_name`, `device_put` and sharding
  constraints act on data and scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core import _compat, block_scales, delayed, registry
from ..core.config import get_autoscale_config
from ..core.datatype import ScaledArray
from ..core.promotion import promote_to_scaled
from ..core.registry import operand_constants
from ..core.subjaxpr import (
    abstract_value,
    coerce_scaledness,
    flatten_compact,
    flatten_scaled,
    leaves_per_value,
    outputs_depending_on,
    trace_scaled_jaxpr,
    trace_scaled_leaves,
    unflatten_compact,
    unflatten_scaled,
    with_body_sites,
)
from .base import register_higher_order
from .block_rules import meet_scale_shapes, to_scale_shape


def _expand_per_value(values: Sequence[Any], specs: Sequence[Any], name: str) -> tuple[Any, ...]:
    """A per-value jit parameter expanded to the compact leaves (a scale leaf gets the default)."""
    out: list[Any] = []
    for value, count in zip(values, leaves_per_value(specs), strict=True):
        out.append(value)
        if count == 2:
            out.append(_compat.default_per_arg_value(name))
    return tuple(out)


@register_higher_order(
    _compat.jit_p,
    remark="kept as a sub-call with its shardings, layouts and donation; static scales kept",
)
def scaled_jit(*args: Any, jaxpr: Any, **params: Any) -> list[Any]:
    known = operand_constants()
    if delayed.recording() and _compat.jit_places_nothing(params):
        # Inlined, so that its sums and contractions are sites of the delayed_scaling
        # step being traced (in a jit of its own they would be traced apart from it).
        return registry.interpret_closed_jaxpr(jaxpr, args, known)
    new_jaxpr, consts, in_specs, out_specs = trace_scaled_jaxpr(jaxpr, args, known)
    leaves, _ = flatten_compact(args)
    new_params = dict(params)
    for name in _compat.JIT_PER_INPUT_PARAMS:
        if name in params:
            per_const = (_compat.default_per_arg_value(name),) * len(consts)
            new_params[name] = per_const + _expand_per_value(params[name], in_specs, name)
    for name in _compat.JIT_PER_OUTPUT_PARAMS:
        if name in params:
            new_params[name] = _expand_per_value(params[name], out_specs, name)
    outs = _compat.jit_p.bind(*consts, *leaves, jaxpr=new_jaxpr, **new_params)
    return unflatten_compact(outs, out_specs, scales_of=args)


@register_higher_order(
    _compat.closed_call_p,
    remark="inlined (a closed_call has no behaviour of its own)",
)
def scaled_closed_call(*args: Any, call_jaxpr: Any, **params: Any) -> list[Any]:
    del params
    return registry.interpret_closed_jaxpr(call_jaxpr, args, operand_constants())


@register_higher_order(
    _compat.composite_p,
    remark="its decomposition inlined (a compiler's kernel for the named op would read the "
    "data as values)",
)
def scaled_composite(*args: Any, **params: Any) -> list[Any]:
    """`jax.lax.composite`: the decomposition, which defines the op's values, interpreted
    with the scaled rules. The composite itself is not kept: a compiler that recognises
    its name would compute the named op of the data, not of the represented values."""
    decomposition = _compat.composite_decomposition(params)
    return registry.interpret_closed_jaxpr(decomposition, args, operand_constants())


@registry.register_scaled_op(
    _compat.call_hi_primitive_p,
    promote=False,
    family="expanded",
    remark="a hijax HiPrim (jnp.frexp, jnp.ldexp): its expansion into ordinary primitives "
    "interpreted",
)
def scaled_call_hi_primitive(*args: Any, **params: Any) -> list[Any]:
    """The operation of a `HiPrim` (JAX's "hijax" primitives) in ordinary primitives, as JAX
    lowers it (its `expand`), run with the scaled interpreter: each of those primitives'
    rules chooses its scales. Derivatives of `grad(autoscale(f))` are those of the expansion
    (the HiPrim's own `jvp`/`vjp` rules see no ScaledArrays)."""
    closed = _compat.hi_primitive_expansion(params)
    return registry.interpret_closed_jaxpr(closed, args, operand_constants())


@register_higher_order(
    _compat.remat_p,
    remark="checkpoint kept, with its policy",
)
def scaled_remat(*args: Any, jaxpr: Any, prevent_cse: Any, **params: Any) -> list[Any]:
    closed = _compat.ClosedJaxpr(jaxpr, ())
    # Under `jsa.delayed_scaling`, the checkpointed body's sums and contractions take held
    # scales too (autodiff puts a checkpointed layer's backward pass, its forward
    # recomputed, in such a body): rows of the history, passed in and measured out.
    recorder = delayed.site_recorder()
    sites = recorder.group("checkpoint", 1) if recorder is not None else None
    new_jaxpr, consts, in_specs, out_specs = trace_scaled_jaxpr(
        closed, args, operand_constants(), body_sites=sites
    )
    if sites is not None:
        sites.check()
    leaves, _ = flatten_compact(args)
    held = [sites.held[0]] if sites is not None and sites.takes_held else []
    if not isinstance(prevent_cse, bool):
        expanded: list[Any] = [True] * len(consts)
        for value, count in zip(prevent_cse, leaves_per_value(in_specs), strict=True):
            expanded.extend([value] * count)
        prevent_cse = (*expanded, *([True] * len(held)))
    outs = _compat.remat_p.bind(
        *consts, *leaves, *held, jaxpr=new_jaxpr.jaxpr, prevent_cse=prevent_cse, **params
    )
    if sites is not None and sites.measures:
        sites.finish(outs[-1][None])
        outs = outs[:-1]
    return unflatten_compact(outs, out_specs, scales_of=args)


# --- loops and conditionals ---------------------------------------------------------------
#
# Re-emitted with the public `jax.lax.scan` / `while_loop` / `switch` over flattened leaves
# (not by binding the primitives with adjusted params, whose names and invariants change
# between JAX releases). The scaled body is traced once per fixed-point round to a jaxpr
# over leaves, and that jaxpr is what the public API's body evaluates.


def split_groups(values: Sequence[Any], sizes: Sequence[int]) -> list[list[Any]]:
    """`values` cut into consecutive groups of the given sizes, and the rest."""
    groups, start = [], 0
    for n in sizes:
        groups.append(list(values[start : start + n]))
        start += n
    return [*groups, list(values[start:])]


def operand_known(n: int) -> list[Any]:
    known = list(operand_constants())
    return known if len(known) == n else [None] * n


def _scale_aval(value: Any) -> jax.ShapeDtypeStruct:
    """The (strongly typed) aval a carried scale leaf keeps across iterations: a scalar, or
    the initial value's block scale (the body's outputs are brought back to its layout)."""
    if isinstance(value, ScaledArray):
        return jax.ShapeDtypeStruct(np.shape(value.scale), jnp.result_type(value.scale))
    return jax.ShapeDtypeStruct((), get_autoscale_config().scale_dtype)


def _trace_leaves(
    closed_jaxpr: Any,
    abstract_args: Sequence[Any],
    known: Sequence[Any],
    out_scaled: Sequence[bool | None],
    scale_shapes: Sequence[Any],
    body_sites: Any = None,
) -> tuple[Any, tuple[bool, ...]]:
    """`trace_scaled_leaves`, each scaled output also brought to the scale shape given
    (`()` per tensor, a block layout, or None: as it comes) with `to_scale_shape`.

    `body_sites`: a scan's `delayed_scaling` rows (a recorder's `group`): the body then
    takes their held scales as one more input leaf (when the history has them) and
    returns their measured scales as one more output leaf (when it has sites)."""
    in_leaves, in_specs = flatten_scaled(abstract_args)
    out_specs_box: list[tuple[bool, ...]] = []

    def flat_fun(*flat: Any) -> list[Any]:
        values = unflatten_scaled(flat, in_specs)
        outs = []
        for out, scaled, shape in zip(
            registry.interpret_closed_jaxpr(closed_jaxpr, values, known),
            out_scaled,
            scale_shapes,
            strict=True,
        ):
            if scaled is not None:
                out = coerce_scaledness(out, scaled)
            if shape is not None and isinstance(out, ScaledArray):
                out = to_scale_shape(out, shape)
            outs.append(out)
        out_leaves, out_specs = flatten_scaled(outs)
        out_specs_box.append(out_specs)
        return out_leaves

    extra: list[Any] = []
    if body_sites is not None:
        flat_fun, extra = with_body_sites(flat_fun, body_sites, len(in_leaves))
    traced = jax.make_jaxpr(flat_fun)(*in_leaves, *extra)
    return traced, out_specs_box[-1]


def _carry_abstract(aval: Any, scaled: bool, scale_aval: Any) -> Any:
    data = jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))
    return ScaledArray(data, scale_aval) if scaled else data


def _coerce_carry(value: Any, scaled: bool, known: Any, scale_aval: Any) -> Any:
    """Promote an initial carry to scaled where the loop needs it; scales strongly typed."""
    if scaled and not isinstance(value, ScaledArray):
        value = promote_to_scaled(value, known)
    if isinstance(value, ScaledArray):
        scale = jax.lax.convert_element_type(jnp.asarray(value.scale), scale_aval.dtype)
        value = ScaledArray(value.data, scale)
    return value


def _init_leaves(
    init: Sequence[Any], specs: Sequence[bool], known: Sequence[Any], scale_avals: Sequence[Any]
) -> list[Any]:
    """The leaves of the initial carry, each value coerced to the loop's (see `_coerce_carry`)."""
    coerced = [
        _coerce_carry(c, s, k, sa)
        for c, s, k, sa in zip(init, specs, known, scale_avals, strict=True)
    ]
    return flatten_scaled(coerced)[0]


def _cast_like(leaf: Any, aval: Any) -> Any:
    """Cast an output leaf to the dtype of the input leaf it is carried to (drops weak types)."""
    leaf_aval = _compat.typeof(leaf)
    if leaf_aval.dtype != aval.dtype or (
        getattr(leaf_aval, "weak_type", False) and not getattr(aval, "weak_type", False)
    ):
        return jax.lax.convert_element_type(leaf, aval.dtype)
    return leaf


def _loop_fixed_point(
    body: Any,
    before: Sequence[Any],
    carry_avals: Sequence[Any],
    carry_specs: Sequence[bool],
    after: Sequence[Any],
    scale_avals: Sequence[Any],
    known: Sequence[Any],
    num_extra_outs: int,
    body_sites: Any = None,
) -> tuple[Any, tuple[bool, ...], list[Any], tuple[bool, ...]]:
    """Trace a loop body until the carries' scaledness is stable.

    A carry that is scaled on input stays scaled on output (promoted with scale
    1 if the body returns it unscaled); one that the body returns scaled is
    promoted on input, and the body traced again. A scaled carry's output is brought
    to its input's scale shape (`scale_avals`: per tensor or a block layout), so the
    layout is a fixed point. Returns the body jaxpr over leaves, the carry specs, the
    carries' abstract values and the output specs.
    """
    specs = tuple(carry_specs)
    scale_shapes = [tuple(sa.shape) for sa in scale_avals] + [None] * num_extra_outs
    while True:
        carries = [
            _carry_abstract(a, s, sa)
            for a, s, sa in zip(carry_avals, specs, scale_avals, strict=True)
        ]
        forced = [True if s else None for s in specs] + [None] * num_extra_outs
        traced, out_specs = _trace_leaves(
            body, [*before, *carries, *after], known, forced, scale_shapes, body_sites
        )
        new_specs = tuple(a or b for a, b in zip(specs, out_specs[: len(specs)], strict=True))
        if new_specs == specs:
            return traced, specs, carries, out_specs
        specs = new_specs


def _stacked_scale(y: ScaledArray, invariant: bool) -> ScaledArray:
    """A stacked output of a scan, whose scale was stacked too: one scale per iteration, as
    a block scale with one block per iteration along the stacked axis (`(L, 1, ...)`), or
    the one scale when it is the same at every iteration."""
    scales = jnp.asarray(y.scale)
    if scales.shape[0] == 0:
        return ScaledArray(y.data, jnp.ones((), scales.dtype))
    if invariant:  # the same scale at every iteration
        return ScaledArray(y.data, scales[0])
    per_iteration = scales.shape[1:] or (1,) * (y.data.ndim - 1)
    return ScaledArray(y.data, scales.reshape(scales.shape[:1] + tuple(per_iteration)))


def per_tensor(value: Any) -> Any:
    """A block-scaled ScaledArray at one scale per tensor; other values as they are."""
    if isinstance(value, ScaledArray) and np.ndim(value.scale):
        return ScaledArray(*block_scales.to_per_tensor(value.data, value.scale))
    return value


def _scan_x(x: Any, length: int) -> tuple[Any, bool]:
    """A scanned operand with its scale as each iteration sees it: `(x, sliced)`. A block
    scale with one block per iteration along the scanned axis is sliced with the data
    (stacked layers keep one scale each); one with one block along it is passed whole,
    without that axis; any other layout goes per tensor."""
    if not isinstance(x, ScaledArray) or np.ndim(x.scale) == 0:
        return x, False
    layout = block_scales.block_layout(x.shape, np.shape(x.scale))
    scale = jnp.asarray(x.scale).reshape(layout)
    if layout[0] == length and length > 1:
        rest = layout[1:]
        return ScaledArray(
            x.data, scale.reshape((length,) if all(r == 1 for r in rest) else layout)
        ), True
    if layout[0] == 1:
        rest = layout[1:]
        return ScaledArray(x.data, scale.reshape(() if all(r == 1 for r in rest) else rest)), False
    return per_tensor(x), False


@register_higher_order(
    _compat.scan_p,
    remark="lax.scan over leaves; carries promoted to a fixed point; stacked outputs and "
    "inputs one scale per iteration",
)
def scaled_scan(*args: Any, length: int, reverse: bool, unroll: Any, **params: Any) -> list[Any]:
    jaxpr, num_consts, num_carry = _compat.scan_layout(params)
    sizes = (num_consts, num_carry)
    consts, init, xs = split_groups(args, sizes)
    xs, sliced = map(list, zip(*[_scan_x(x, length) for x in xs])) if xs else ([], [])
    k_consts, k_init, k_xs = split_groups(operand_known(len(args)), sizes)
    _, carry_avals, x_avals = split_groups(jaxpr.in_avals, sizes)
    const_abs = [abstract_value(c) for c in consts]
    x_abs = [
        ScaledArray(
            _carry_abstract(a, False, None),
            jax.ShapeDtypeStruct(np.shape(x.scale)[1:], jnp.result_type(x.scale))
            if cut
            else abstract_value(x.scale),
        )
        if isinstance(x, ScaledArray)
        else _carry_abstract(a, False, None)
        for x, a, cut in zip(xs, x_avals, sliced, strict=True)
    ]
    scale_avals = [_scale_aval(c) for c in init]
    num_ys = len(jaxpr.out_avals) - num_carry
    # Under `jsa.delayed_scaling`, the body's sums and contractions take held scales too:
    # a row of the history per site and iteration, scanned in and measured out.
    recorder = delayed.site_recorder()
    sites = recorder.group("scan", length) if recorder is not None else None
    body, carry_specs, carry_abs, out_specs = _loop_fixed_point(
        jaxpr,
        const_abs,
        carry_avals,
        [isinstance(c, ScaledArray) for c in init],
        x_abs,
        scale_avals,
        [*k_consts, *([None] * num_carry), *k_xs],
        num_ys,
        sites,
    )
    if sites is not None:
        sites.check()  # the final body against the history
    measures = sites is not None and sites.measures
    init_leaves = _init_leaves(init, carry_specs, k_init, scale_avals)
    const_leaves, _ = flatten_scaled(consts)
    carry_leaf_avals, _ = flatten_scaled(carry_abs)
    n_carry = len(init_leaves)
    xs_data: list[Any] = []
    for x, cut in zip(xs, sliced, strict=True):
        xs_data.append(x.data if isinstance(x, ScaledArray) else x)
        if cut:
            xs_data.append(x.scale)
    if sites is not None and sites.takes_held:
        xs_data.append(sites.held)

    def body_fun(carry_leaves: list[Any], x_slices: list[Any]) -> tuple[list[Any], list[Any]]:
        x_leaves: list[Any] = []
        slices = iter(x_slices)
        for x, cut in zip(xs, sliced, strict=True):
            data = next(slices)
            if isinstance(x, ScaledArray):
                x_leaves.extend([data, next(slices) if cut else x.scale])
            else:
                x_leaves.append(data)
        x_leaves.extend(slices)  # the held scales of the body's sites, if any
        outs = _compat.jaxpr_as_fun(body)(*const_leaves, *carry_leaves, *x_leaves)
        carry_out = [
            _cast_like(o, a) for o, a in zip(outs[:n_carry], carry_leaf_avals, strict=True)
        ]
        return carry_out, list(outs[n_carry:])

    public = {k: v for k, v in params.items() if k in _SCAN_PUBLIC_PARAMS}
    carry_leaves, ys_leaves = jax.lax.scan(
        body_fun, init_leaves, xs_data, length=length, reverse=reverse, unroll=unroll, **public
    )
    if measures:
        assert sites is not None
        sites.finish(ys_leaves[-1])
        ys_leaves = ys_leaves[:-1]
    # A scaled `y` whose scale does not depend on the carries or xs has one scale for all.
    n_const_leaves = len(const_leaves)
    mask = [i >= n_const_leaves for i in range(len(body.jaxpr.invars))]
    varying = outputs_depending_on(body.jaxpr, mask)[n_carry:]
    if measures:
        varying = varying[:-1]
    y_specs = out_specs[num_carry:]
    ys = unflatten_scaled(ys_leaves, y_specs)
    ys_varying = unflatten_scaled(varying, y_specs)
    ys = [
        _stacked_scale(y, not v.scale) if isinstance(y, ScaledArray) else y
        for y, v in zip(ys, ys_varying, strict=True)
    ]
    return [*unflatten_scaled(carry_leaves, carry_specs), *ys]


# Block-scaled operands reach these rules as they are: scan slices stacked per-layer scales,
# and the call-like primitives interpret their bodies with the blocks.
registry.register_block_rule(_compat.scan_p, scaled_scan)
for _call_prim, _call_rule in (
    (_compat.jit_p, scaled_jit),
    (_compat.closed_call_p, scaled_closed_call),
    (_compat.composite_p, scaled_composite),
    (_compat.remat_p, scaled_remat),
):
    registry.register_block_rule(_call_prim, _call_rule)

# Scan params with a keyword of `jax.lax.scan` other than length / reverse / unroll.
_SCAN_PUBLIC_PARAMS = ("_split_transpose",)


def _unbatch_predicate(
    cond_jaxpr: Any, body_jaxpr: Any, cond_nconsts: int, body_nconsts: int
) -> tuple[Any, Any]:
    """The plain jaxprs of a while loop whose predicate is a vector (`vmap` of a loop).

    Such a loop runs while any predicate holds, each carry keeping its value
    where its own predicate is false. Returned: a scalar-predicate cond (over the
    cond consts and carries) and a body selecting per element (over the cond
    consts, body consts and carries), which the scaled rule then handles as usual.
    """
    cond_fun, body_fun = _compat.jaxpr_as_fun(cond_jaxpr), _compat.jaxpr_as_fun(body_jaxpr)
    cconst_avals = cond_jaxpr.in_avals[:cond_nconsts]
    bconst_avals, carry_avals = split_groups(body_jaxpr.in_avals, (body_nconsts,))

    def any_cond(*args: Any) -> Any:
        return jnp.any(cond_fun(*args)[0])

    def select_body(*args: Any) -> list[Any]:
        cconsts, bconsts, carry = split_groups(args, (cond_nconsts, body_nconsts))
        pred = cond_fun(*cconsts, *carry)[0]
        new = body_fun(*bconsts, *carry)
        outs = []
        for n, old in zip(new, carry, strict=True):
            dims = tuple(range(pred.ndim))
            mask = jax.lax.broadcast_in_dim(pred, jnp.shape(old), dims)
            outs.append(jax.lax.select(mask, n, old))
        return outs

    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (*cconst_avals, *carry_avals)]
    body_avals = [
        jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (*cconst_avals, *bconst_avals, *carry_avals)
    ]
    return jax.make_jaxpr(any_cond)(*avals), jax.make_jaxpr(select_body)(*body_avals)


@register_higher_order(
    _compat.while_p,
    remark="lax.while_loop over leaves; carries promoted to a fixed point",
)
def scaled_while(
    *args: Any,
    cond_jaxpr: Any,
    body_jaxpr: Any,
    cond_nconsts: int,
    body_nconsts: int,
    **params: Any,
) -> list[Any]:
    del params
    sizes = (cond_nconsts, body_nconsts)
    cconsts, bconsts, init = split_groups(args, sizes)
    k_cconsts, k_bconsts, k_init = split_groups(operand_known(len(args)), sizes)
    if cond_jaxpr.out_avals[0].shape:  # a batched predicate (from vmap)
        cond_jaxpr, body_jaxpr = _unbatch_predicate(
            cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts
        )
        bconsts, k_bconsts = [*cconsts, *bconsts], [*k_cconsts, *k_bconsts]
        body_nconsts = cond_nconsts + body_nconsts
    carry_avals = body_jaxpr.in_avals[body_nconsts:]
    scale_avals = [_scale_aval(c) for c in init]
    body, carry_specs, carry_abs, _ = _loop_fixed_point(
        body_jaxpr,
        [abstract_value(c) for c in bconsts],
        carry_avals,
        [isinstance(c, ScaledArray) for c in init],
        [],
        scale_avals,
        [*k_bconsts, *([None] * len(init))],
        0,
    )
    cond, _ = trace_scaled_leaves(
        cond_jaxpr,
        [*[abstract_value(c) for c in cconsts], *carry_abs],
        [*k_cconsts, *([None] * len(init))],
        [False],
    )
    init_leaves = _init_leaves(init, carry_specs, k_init, scale_avals)
    cconst_leaves, _ = flatten_scaled(cconsts)
    bconst_leaves, _ = flatten_scaled(bconsts)
    carry_leaf_avals, _ = flatten_scaled(carry_abs)

    def cond_fun(carry_leaves: list[Any]) -> Any:
        return _compat.jaxpr_as_fun(cond)(*cconst_leaves, *carry_leaves)[0]

    def body_fun(carry_leaves: list[Any]) -> list[Any]:
        outs = _compat.jaxpr_as_fun(body)(*bconst_leaves, *carry_leaves)
        return [_cast_like(o, a) for o, a in zip(outs, carry_leaf_avals, strict=True)]

    out_leaves = jax.lax.while_loop(cond_fun, body_fun, init_leaves)
    return unflatten_scaled(out_leaves, carry_specs)


@register_higher_order(
    _compat.cond_p,
    remark="lax.switch over leaves; an output scaled in one branch is scaled in all",
)
def scaled_cond(index: Any, *operands: Any, branches: Sequence[Any], **params: Any) -> list[Any]:
    del params
    if isinstance(index, ScaledArray):  # not floating in practice; kept plain
        index = index.to_array()
    known = operand_known(len(operands) + 1)[1:]
    abstract = [abstract_value(o) for o in operands]
    probes = [trace_scaled_leaves(b, abstract, known) for b in branches]
    out_specs = tuple(any(specs) for specs in zip(*(p[1] for p in probes), strict=True))
    # One scale shape per scaled output, met by all branches (block-scaled operands give
    # branches block-scaled outputs, possibly of different layouts).
    branch_shapes = [_out_scale_shapes(jaxpr.out_avals, specs) for jaxpr, specs in probes]
    scale_shapes = [
        meet_scale_shapes(aval.shape, [shapes[i] or () for shapes in branch_shapes])
        if scaled
        else None
        for i, (aval, scaled) in enumerate(zip(branches[0].out_avals, out_specs, strict=True))
    ]
    # Branches whose outputs are not all scaled as the union is, or not at the shapes met,
    # are traced again, promoted and re-blocked.
    traced = [
        jaxpr
        if specs == out_specs and shapes == scale_shapes
        else _trace_leaves(b, abstract, known, out_specs, scale_shapes)[0]
        for b, (jaxpr, specs), shapes in zip(branches, probes, branch_shapes, strict=True)
    ]
    leaves, _ = flatten_scaled(operands)
    # Every branch returns leaves of one type: the original dtypes, strong scales.
    scale_dtype = get_autoscale_config().scale_dtype
    target: list[Any] = []
    for aval, shape in zip(branches[0].out_avals, scale_shapes, strict=True):
        target.append(jax.ShapeDtypeStruct(aval.shape, aval.dtype))
        if shape is not None:
            target.append(jax.ShapeDtypeStruct(shape, scale_dtype))

    def make_branch(jaxpr: Any) -> Any:
        def branch_fun(*flat: Any) -> list[Any]:
            outs = _compat.jaxpr_as_fun(jaxpr)(*flat)
            return [_cast_like(o, a) for o, a in zip(outs, target, strict=True)]

        return branch_fun

    out_leaves = jax.lax.switch(index, [make_branch(j) for j in traced], *leaves)
    return unflatten_scaled(out_leaves, out_specs)


def _out_scale_shapes(out_avals: Sequence[Any], specs: Sequence[bool]) -> list[Any]:
    """Per output of a jaxpr over leaves: its scale's shape (None where unscaled)."""
    shapes: list[Any] = []
    avals = iter(out_avals)
    for scaled in specs:
        next(avals)
        shapes.append(tuple(next(avals).shape) if scaled else None)
    return shapes


# Block-scaled operands and carries keep their layouts through `while` and `cond`: a
# carry's body output is brought back to its initial layout, and the branches' outputs
# to one layout per output.
registry.register_block_rule(_compat.while_p, scaled_while)
registry.register_block_rule(_compat.cond_p, scaled_cond)
