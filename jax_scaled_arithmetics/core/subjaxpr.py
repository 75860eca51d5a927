"""Re-interpreting inner jaxprs (of jit, scan, cond, custom derivatives...) with scaled values.

Higher-order rules flatten their (possibly scaled) operands into plain leaves
(`data`, `scale` for a ScaledArray), trace the scaled interpretation of the inner
jaxpr as a new jaxpr over those leaves, and bind the original primitive on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import _compat, registry
from .datatype import ScaledArray

__all__ = [
    "flatten_scaled",
    "unflatten_scaled",
    "leaf_avals",
    "trace_scaled_jaxpr",
    "coerce_scaledness",
    "CompactSpec",
    "flatten_compact",
    "unflatten_compact",
    "leaves_per_value",
    "find_primitive",
    "abstract_value",
    "outputs_depending_on",
    "trace_scaled_leaves",
    "with_body_sites",
]


def flatten_scaled(values: Sequence[Any]) -> tuple[list[Any], tuple[bool, ...]]:
    """Flatten values into leaves: a ScaledArray gives (data, scale), anything else itself."""
    leaves: list[Any] = []
    specs = []
    for v in values:
        if isinstance(v, ScaledArray):
            leaves.extend((v.data, v.scale))
            specs.append(True)
        else:
            leaves.append(v)
            specs.append(False)
    return leaves, tuple(specs)


def unflatten_scaled(leaves: Sequence[Any], specs: Sequence[bool]) -> list[Any]:
    """Inverse of :func:`flatten_scaled`."""
    out = []
    it = iter(leaves)
    for scaled in specs:
        if scaled:
            data = next(it)
            out.append(ScaledArray(data, next(it)))
        else:
            out.append(next(it))
    return out


def leaf_avals(leaves: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    """Abstract leaves (weak types and varying mesh axes kept) to trace a jaxpr over."""
    return [_compat.shape_dtype_struct(_compat.typeof(leaf)) for leaf in leaves]


def coerce_scaledness(value: Any, scaled: bool) -> Any:
    """Make `value` scaled (promoting with scale 1) or unscaled (materialising) as asked."""
    from .promotion import promote_to_scaled

    if scaled and not isinstance(value, ScaledArray):
        return promote_to_scaled(value)
    if not scaled and isinstance(value, ScaledArray):
        return value.to_array()
    return value


# --- compact flattening: static and shared scales are not leaves ------------------------
#
# A sub-jaxpr that takes every scale as an argument loses what the caller knew about it:
# a static scale becomes a traced one (all the scale arithmetic inside it, and after it,
# is then done at run time), and two values sharing one scale get two. Compact flattening
# passes a static scale as a constant and a shared scale once, and returns an output
# scale that is static, or one of the inputs' scales, without a leaf of its own.

# Per value: ("plain",) one leaf; ("leaf",) data and scale leaves; ("static", v) data only,
# scale v; ("as", j) data only, the scale of value j (an input of the sub-jaxpr for its
# outputs, an earlier value of the same list for its inputs).
CompactSpec = tuple


def _static_scale(scale: Any) -> float | None:
    if _compat.is_tracer(scale) or getattr(scale, "shape", ()) != ():
        return None
    try:
        import numpy as np

        return float(np.asarray(scale, np.float64))
    except Exception:
        return None


def flatten_compact(
    values: Sequence[Any], scales_of: Sequence[Any] | None = None
) -> tuple[list[Any], tuple[CompactSpec, ...]]:
    """Flatten values into leaves, leaving out static scales and repeated scales.

    A scale that is (the same object as) the scale of the ScaledArray `scales_of[j]`
    (default: of an earlier value of `values`) is no leaf but `("as", j)`.
    """
    leaves: list[Any] = []
    specs: list[CompactSpec] = []
    for i, v in enumerate(values):
        if not isinstance(v, ScaledArray):
            leaves.append(v)
            specs.append(("plain",))
            continue
        leaves.append(v.data)
        static = _static_scale(v.scale)
        sources = enumerate(values[:i] if scales_of is None else scales_of)
        source = next(
            (j for j, u in sources if isinstance(u, ScaledArray) and u.scale is v.scale), None
        )
        if static is not None:
            specs.append(("static", static))
        elif source is not None:
            specs.append(("as", source))
        else:
            leaves.append(v.scale)
            specs.append(("leaf",))
    return leaves, tuple(specs)


def unflatten_compact(
    leaves: Sequence[Any], specs: Sequence[CompactSpec], scales_of: Sequence[Any] | None = None
) -> list[Any]:
    """Inverse of :func:`flatten_compact`; `("as", j)` takes the scale of `scales_of[j]`
    (default: of the j-th value rebuilt here)."""
    import numpy as np

    out: list[Any] = []
    it = iter(leaves)
    for spec in specs:
        kind = spec[0]
        if kind == "plain":
            out.append(next(it))
        elif kind == "leaf":
            data = next(it)
            out.append(ScaledArray(data, next(it)))
        elif kind == "static":
            out.append(ScaledArray(next(it), np.float32(spec[1])))
        else:
            source = out if scales_of is None else scales_of
            out.append(ScaledArray(next(it), source[spec[1]].scale))
    return out


def leaves_per_value(specs: Sequence[CompactSpec]) -> list[int]:
    """How many leaves each value of a compact flattening has."""
    return [2 if spec[0] == "leaf" else 1 for spec in specs]


def trace_scaled_jaxpr(
    closed_jaxpr: _compat.ClosedJaxpr,
    args: Sequence[Any],
    known: Sequence[Any] | None = None,
    out_scaled: Sequence[bool] | None = None,
    body_sites: Any = None,
) -> tuple[_compat.ClosedJaxpr, list[Any], tuple[CompactSpec, ...], tuple[CompactSpec, ...]]:
    """Trace the scaled interpretation of `closed_jaxpr` on `args` into a new jaxpr.

    The jaxpr takes the consts it closes over, then the compact leaves of `args`
    (:func:`flatten_compact`), and returns the compact leaves of its outputs, where an
    output scale that is static or one of the inputs' scales is not a leaf. Returns the
    jaxpr, its consts, and the input and output specs (an output `("as", j)` refers to
    the j-th argument). `out_scaled`, when given, forces each output to be scaled or not.
    `body_sites`: the `delayed_scaling` rows of the body (a recorder's `group`), whose held
    scales the jaxpr takes as one more input leaf, after the others, when the history has
    them, and whose measured scales it returns as one more output leaf when it has sites.
    """
    leaves, in_specs = flatten_compact(args)
    flat_fun, out_specs_box = _interpreted_on_leaves(
        closed_jaxpr, in_specs, known, out_scaled, compact=True
    )
    extra: list[Any] = []
    if body_sites is not None:
        flat_fun, extra = with_body_sites(flat_fun, body_sites, len(leaves))
    traced = jax.make_jaxpr(flat_fun)(*leaf_avals(leaves), *extra)
    new_jaxpr, consts = _compat.hoist_consts(traced)
    return new_jaxpr, consts, in_specs, out_specs_box[-1]


# --- helpers for rules that re-emit control flow over leaves ------------------------------


def abstract_value(value: Any) -> Any:
    """The abstract counterpart of a (possibly scaled) value: `ShapeDtypeStruct` leaves.

    A ScaledArray gives a ScaledArray of two `ShapeDtypeStruct` (its data's, its
    scale's), so that :func:`flatten_scaled` yields leaf avals.
    """
    if isinstance(value, ScaledArray):
        data, scale = leaf_avals([value.data, value.scale])
        return ScaledArray(data, scale)
    if isinstance(value, jax.ShapeDtypeStruct):
        return value
    return leaf_avals([value])[0]


def trace_scaled_leaves(
    closed_jaxpr: _compat.ClosedJaxpr,
    abstract_args: Sequence[Any],
    known: Sequence[Any] | None = None,
    out_scaled: Sequence[bool | None] | None = None,
) -> tuple[_compat.ClosedJaxpr, tuple[bool, ...]]:
    """Trace the scaled interpretation of `closed_jaxpr` over abstract arguments.

    `abstract_args` are values from :func:`abstract_value` (or with those
    leaves); the result is a jaxpr over their flattened leaves, returning the
    flattened leaves of the outputs, and which outputs are scaled. `out_scaled`
    forces an output scaled (True) or unscaled (False), or leaves it (None).
    """
    in_leaves, in_specs = flatten_scaled(abstract_args)
    flat_fun, out_specs_box = _interpreted_on_leaves(
        closed_jaxpr, in_specs, known, out_scaled, compact=False
    )
    traced = jax.make_jaxpr(flat_fun)(*in_leaves)
    return traced, out_specs_box[-1]


def with_body_sites(
    flat_fun: Callable[..., list[Any]], body_sites: Any, num_leaves: int
) -> tuple[Callable[..., list[Any]], list[Any]]:
    """`flat_fun` traced with a body's `delayed_scaling` rows (`body_sites`, a recorder's
    `group`): one more input leaf, the rows' held scales (when the history has them: the
    second value, its abstract value), and one more output leaf, their measured scales
    (when the body has sites)."""
    takes_held = body_sites.takes_held
    extra = [jax.ShapeDtypeStruct((body_sites.count,), np.float32)] if takes_held else []

    def fun(*flat: Any) -> list[Any]:
        held = flat[num_leaves] if takes_held else None
        with body_sites.trace_body(held) as body:
            outs = flat_fun(*flat[:num_leaves])
            measured = body.measured_scales()
        return outs if measured is None else [*outs, measured]

    return fun, extra


def _interpreted_on_leaves(
    closed_jaxpr: _compat.ClosedJaxpr,
    in_specs: Sequence[Any],
    known: Sequence[Any] | None,
    out_scaled: Sequence[bool | None] | None,
    *,
    compact: bool,
) -> tuple[Callable[..., list[Any]], list[Any]]:
    """The scaled interpretation of `closed_jaxpr` as a function of leaves, and the list
    that each of its calls appends its output specs to.

    With `compact`, the specs are :func:`flatten_compact`'s (outputs may take the inputs'
    scales), else :func:`flatten_scaled`'s. `out_scaled[i]` forces output i
    scaled (True) or unscaled (False), or leaves it (None).
    """
    out_specs_box: list[Any] = []

    def flat_fun(*flat: Any) -> list[Any]:
        if compact:
            values = unflatten_compact(flat, in_specs)
        else:
            values = unflatten_scaled(flat, in_specs)
        outs = registry.interpret_closed_jaxpr(closed_jaxpr, values, known)
        if out_scaled is not None:
            outs = [
                o if s is None else coerce_scaledness(o, s)
                for o, s in zip(outs, out_scaled, strict=True)
            ]
        flat_outs = flatten_compact(outs, scales_of=values) if compact else flatten_scaled(outs)
        out_specs_box.append(flat_outs[1])
        return flat_outs[0]

    return flat_fun, out_specs_box


def outputs_depending_on(jaxpr: _compat.Jaxpr, inputs_mask: Sequence[bool]) -> list[bool]:
    """Which outputs of `jaxpr` may depend on the inputs flagged in `inputs_mask`.

    Conservative: an equation's outputs depend on all its inputs.
    """
    dependent = {v for v, m in zip(jaxpr.invars, inputs_mask, strict=True) if m}
    for eqn in jaxpr.eqns:
        if any(not isinstance(a, _compat.Literal) and a in dependent for a in eqn.invars):
            dependent.update(v for v in eqn.outvars if not _compat.is_drop_var(v))
    return [not isinstance(v, _compat.Literal) and v in dependent for v in jaxpr.outvars]


def find_primitive(
    fn: Any, *args: Any, name: str, axis_env: Sequence[tuple[str, int]] | None = None
) -> _compat.Primitive | None:
    """The primitive called `name` that tracing `fn(*args)` binds, or None.

    Finds primitives that `jax.extend` does not export (debug callbacks,
    optimization barriers...) with public APIs only: a JAX upgrade that renames
    one makes this return None rather than fail at import.
    """
    try:
        closed = jax.make_jaxpr(fn, axis_env=None if axis_env is None else list(axis_env))(*args)
    except Exception:  # an API that changed: no rule for it
        return None

    def search(jaxpr: _compat.Jaxpr) -> _compat.Primitive | None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == name:
                return eqn.primitive
            for param in eqn.params.values():
                subs = param if isinstance(param, (tuple, list)) else (param,)
                for sub in subs:
                    inner = getattr(sub, "jaxpr", sub)
                    if isinstance(inner, _compat.Jaxpr):
                        found = search(inner)
                        if found is not None:
                            return found
        return None

    return search(closed.jaxpr)
