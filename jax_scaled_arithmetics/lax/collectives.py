"""Scaled rules for collectives and `shard_map`.

Each device may hold its own scale (data-dependent rescaling inside `shard_map`
gives each shard its own). Reductions, gathers and all-to-alls therefore first
bring the data to the largest scale over the axes (a `pmax` of the scalar
scales; for sums times `2^ceil(log2 n)` over n devices, so that the sum of data
at the top of a format does not overflow it), then apply the collective to the
data; `ppermute`, `pbroadcast` and `pvary` move or retype data and scale alike.
`shard_map` is re-emitted with `jax.shard_map` over leaves, a scale being a
replicated scalar: the largest over the mesh axes, for every floating output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core import _compat, registry
from ..core.datatype import ScaledArray, is_floating
from ..core.subjaxpr import coerce_scaledness, find_primitive, flatten_scaled, unflatten_scaled
from .base import register_higher_order, rescale, safe_div
from .control_flow import operand_known

# --- collectives ------------------------------------------------------------------------
#
# Each device may hold its own scale: reductions and gathers first bring the data to the
# largest scale over the axes (a `pmax` of the scalar scales), then apply the collective
# to the data. `ppermute` and `pvary` move or retype data and scale alike.


def _axis_common_scale(x: ScaledArray, axes: Any, axis_index_groups: Any = None) -> Any:
    scale = jax.lax.stop_gradient(jnp.asarray(x.scale))
    return jax.lax.pmax(scale, axes, axis_index_groups=axis_index_groups)


def _sum_headroom(axes: Any, axis_index_groups: Any) -> float:
    """`2^ceil(log2 n)` for a sum over `n` devices: the factor a sum's common scale takes
    on, so that `n` data at the top of their format do not overflow it."""
    if axis_index_groups is not None:
        n = max(len(group) for group in axis_index_groups)
    else:
        n = 1
        for name in _as_axes(axes):
            n *= int(jax.lax.axis_size(name))
    return float(2.0 ** max(0, int(np.ceil(np.log2(n))))) if n > 1 else 1.0


def _register_common_scale_collective(prim: Any, axes_param: str, sums: bool = False) -> None:
    if prim is None or registry.has_scaled_rule(prim):
        return

    def rule(x: ScaledArray, **params: Any) -> ScaledArray:
        groups = params.get("axis_index_groups")
        common = _axis_common_scale(x, params[axes_param], groups)
        if sums:
            common = common * np.float32(_sum_headroom(params[axes_param], groups))
        data = rescale(x.data, safe_div(jnp.asarray(x.scale), common))
        return ScaledArray(prim.bind(data, **params), common)

    rule.__name__ = f"scaled_{prim.name}"
    registry.register_scaled_op(
        prim, rule, family="collective", remark="data at the largest scale over the axes"
    )


def _varying_axes(x: Any) -> frozenset[Any]:
    """Mesh axes over which `x` varies inside `shard_map` (empty when not tracked)."""
    return _compat.varying_axes(_compat.typeof(x))


def _as_axes(axes: Any) -> tuple[Any, ...]:
    return tuple(axes) if isinstance(axes, (tuple, list, frozenset, set)) else (axes,)


def _register_leafwise_collective(prim: Any, axes_param: str | None) -> None:
    """Register a collective that moves data and scale alike (the scale made varying first)."""
    if prim is None or registry.has_scaled_rule(prim):
        return

    def rule(x: ScaledArray, **params: Any) -> ScaledArray:
        if axes_param is None:  # pvary: a type cast of the data only
            # Only over the axes the data does not vary over yet (autoscale may trace the
            # user's function on leaves whose varying axes it does not know).
            axes = tuple(a for a in params["axes"] if a not in _varying_axes(x.data))
            data = prim.bind(x.data, **{**params, "axes": axes}) if axes else x.data
            return ScaledArray(data, x.scale)
        data = prim.bind(x.data, **params)
        scale = jnp.asarray(x.scale)
        axes = _as_axes(params[axes_param])
        missing = tuple(a for a in axes if a in _varying_axes(x.data) - _varying_axes(scale))
        if missing:
            scale = jax.lax.pcast(scale, missing, to="varying")
        return ScaledArray(data, prim.bind(scale, **params))

    rule.__name__ = f"scaled_{prim.name}"
    registry.register_scaled_op(
        prim, rule, family="collective", remark="applied to data and scale alike"
    )


def _collective_primitive(fn: Any, name: str) -> Any:
    return find_primitive(fn, np.ones((1, 2), np.float32), name=name, axis_env=[("i", 1)])


_P = _compat.primitives
for _prim, _axes, _sums in (
    (_P.psum_p, "axes", True),
    (_P.pmax_p, "axes", False),
    (_P.pmin_p, "axes", False),
    (_P.all_gather_p, "axis_name", False),
    (_P.all_to_all_p, "axis_name", False),
    (
        _collective_primitive(lambda x: jax.lax.psum_scatter(x, "i"), "reduce_scatter"),
        "axis_name",
        True,
    ),
):
    _register_common_scale_collective(_prim, _axes, _sums)
_register_leafwise_collective(_P.ppermute_p, "axis_name")


def _register_ragged_all_to_all(prim: Any) -> None:
    if prim is None or registry.has_scaled_rule(prim):
        return

    @registry.register_scaled_op(
        prim, family="collective", remark="operand and output at the largest scale over the axes"
    )
    def scaled_ragged_all_to_all(
        operand: ScaledArray, output: ScaledArray, *offsets_and_sizes: Any, **params: Any
    ) -> ScaledArray:
        """Received slices land in another device's `output`: one scale for all of them.

        The common scale is the largest of the operand and output scales over the axis
        (group); a known-zero output buffer (scale 0) does not raise it.
        """
        local = jnp.maximum(
            jax.lax.stop_gradient(jnp.asarray(operand.scale)),
            jax.lax.stop_gradient(jnp.asarray(output.scale)),
        )
        common = jax.lax.pmax(
            local, params["axis_name"], axis_index_groups=params.get("axis_index_groups")
        )
        dtype = output.data.dtype
        operand_data = rescale(operand.data, safe_div(jnp.asarray(operand.scale), common), dtype)
        output_data = rescale(output.data, safe_div(jnp.asarray(output.scale), common))
        data = prim.bind(operand_data, output_data, *offsets_and_sizes, **params)
        return ScaledArray(data, common)


ragged_all_to_all_p = _compat.primitives.ragged_all_to_all_p
_register_ragged_all_to_all(ragged_all_to_all_p)


def _shard_map_primitive(fn: Any, name: str, in_spec: Any) -> Any:
    """A primitive that only appears inside `shard_map`, found by tracing `fn` (on an abstract
    1-device mesh, with `in_specs=in_spec(P)`, or, where JAX infers them from the argument's
    own sharding, `_compat.SHARD_MAP_INFERS_IN_SPECS`, without).

    Raises:
        RuntimeError: `fn` does not bind `name` (the installed JAX spells it otherwise).
    """
    spec = jax.sharding.PartitionSpec
    mesh = jax.sharding.AbstractMesh((1,), ("i",))
    specs = {} if _compat.SHARD_MAP_INFERS_IN_SPECS else {"in_specs": in_spec(spec)}
    mapped = jax.shard_map(fn, mesh=mesh, out_specs=spec("i"), **specs)
    found = find_primitive(mapped, np.ones((2,), np.float32), name=name)
    if found is None:
        raise RuntimeError(f"JAX {jax.__version__}: tracing its public API binds no '{name}'.")
    return found


def _varying(x: Any) -> Any:
    """`x` made to vary over the mesh axis "i" where specs are inferred (a replicated argument);
    with explicit `in_specs=P("i")` it varies already."""
    return jax.lax.pcast(x, "i", to="varying") if _compat.SHARD_MAP_INFERS_IN_SPECS else x


psum_invariant_p = _shard_map_primitive(
    lambda x: jax.lax.psum(x, "i"), "psum_invariant", lambda p: p()
)
pvary_p = _shard_map_primitive(
    lambda x: jax.lax.pcast(x, "i", to="varying"), "pvary", lambda p: p()
)
pbroadcast_p = _shard_map_primitive(
    lambda x: jax.lax.pbroadcast(_varying(x), "i", 0), "pbroadcast", lambda p: p("i")
)
_register_common_scale_collective(psum_invariant_p, "axes", sums=True)
_register_leafwise_collective(pvary_p, None)
_register_leafwise_collective(pbroadcast_p, "axis_name")

shard_map_p = _shard_map_primitive(lambda x: x, "shard_map", lambda p: p("i"))


def _expand_specs(specs: Sequence[Any], scaled: Sequence[bool]) -> tuple[Any, ...]:
    """Per-leaf partition specs: a scale is a replicated scalar."""
    out: list[Any] = []
    for spec, s in zip(specs, scaled, strict=True):
        out.extend([spec, jax.sharding.PartitionSpec()] if s else [spec])
    return tuple(out)


@register_higher_order(
    shard_map_p,
    remark="jax.shard_map over leaves; scales replicated (largest over the mesh axes)",
)
def scaled_shard_map(
    *args: Any, jaxpr: Any, mesh: Any, in_specs: Any, out_specs: Any, **params: Any
) -> list[Any]:
    known = operand_known(len(args))
    leaves, in_scaled = flatten_scaled(args)
    axes = tuple(params.get("newly_manual_axes", mesh.axis_names))
    closed = _compat.ClosedJaxpr(jaxpr, ())
    # Every floating output is scaled, so the output structure is known before tracing.
    out_scaled = [is_floating(v.aval.dtype) for v in jaxpr.outvars]

    def body(*flat: Any) -> tuple[Any, ...]:
        values = unflatten_scaled(flat, in_scaled)
        outs = registry.interpret_closed_jaxpr(closed, values, known)
        unified = []
        for out, s in zip(outs, out_scaled, strict=True):
            out = coerce_scaledness(out, s)
            if s:  # one scale for all the shards
                common = _axis_common_scale(out, axes)
                out = ScaledArray(rescale(out.data, safe_div(out.scale, common)), common)
            unified.append(out)
        return tuple(flatten_scaled(unified)[0])

    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=_expand_specs(in_specs, in_scaled),
        out_specs=_expand_specs(out_specs, out_scaled),
        axis_names=frozenset(axes),
        check_vma=params.get("check_vma", True),
    )
    return unflatten_scaled(mapped(*leaves), out_scaled)
