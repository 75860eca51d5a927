"""Re-interpreting inner jaxprs (of jit, scan, cond, custom derivatives...) with scaled values.

Higher-order rules flatten their (possibly scaled) operands into plain leaves
(`data`, `scale` for a ScaledArray), trace the scaled interpretation of the inner
jaxpr as a new jaxpr over those leaves, and bind the original primitive on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from . import _compat, registry
from .datatype import ScaledArray

__all__ = [
    "flatten_scaled",
    "unflatten_scaled",
    "leaf_avals",
    "trace_scaled_jaxpr",
    "coerce_scaledness",
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
    avals = []
    for leaf in leaves:
        aval = _compat.typeof(leaf)
        avals.append(
            jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))
        )
    return avals


def coerce_scaledness(value: Any, scaled: bool) -> Any:
    """Make `value` scaled (promoting with scale 1) or unscaled (materialising) as asked."""
    from .interpreter import promote_to_scaled

    if scaled and not isinstance(value, ScaledArray):
        return promote_to_scaled(value)
    if not scaled and isinstance(value, ScaledArray):
        return value.to_array()
    return value


def trace_scaled_jaxpr(
    closed_jaxpr: _compat.ClosedJaxpr,
    args: Sequence[Any],
    known: Sequence[Any] | None = None,
    out_scaled: Sequence[bool] | None = None,
) -> tuple[_compat.ClosedJaxpr, list[Any], tuple[bool, ...]]:
    """Trace the scaled interpretation of `closed_jaxpr` on `args` into a new jaxpr.

    Returns the new jaxpr (over the consts it closes over, then the leaves of
    `args`), those consts, and which outputs are scaled. `out_scaled`, when
    given, forces each output to be scaled or not.
    """
    leaves, in_specs = flatten_scaled(args)
    out_specs_box: list[tuple[bool, ...]] = []

    def flat_fun(*flat: Any) -> list[Any]:
        values = unflatten_scaled(flat, in_specs)
        outs = registry.interpret_closed_jaxpr(closed_jaxpr, values, known)
        if out_scaled is not None:
            outs = [coerce_scaledness(o, s) for o, s in zip(outs, out_scaled)]
        out_leaves, out_specs = flatten_scaled(outs)
        out_specs_box.append(out_specs)
        return out_leaves

    traced = jax.make_jaxpr(flat_fun)(*leaf_avals(leaves))
    new_jaxpr, consts = _compat.hoist_consts(traced)
    return new_jaxpr, consts, out_specs_box[-1]

