"""Scaled rules for callbacks, barriers, names and placement.

Callbacks (`jax.debug.print`/`callback`, `pure_callback`, `io_callback`) see represented
values; barriers, `checkpoint_name`, `dce_sink`, `device_put` and sharding constraints act
on data and scale.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from ..core import _compat, registry, shardings
from ..core.datatype import ScaledArray
from ..core.dtypes import compute_dtype
from ..core.subjaxpr import (
    find_primitive,
    flatten_scaled,
    unflatten_scaled,
)
from .base import register_materializing

# --- callbacks, barriers, names, placement ----------------------------------------------
#
# Primitives `jax.extend` does not export are found by tracing their public API once
# (`find_primitive`); one that a JAX release renames simply gets no rule.


debug_callback_p = find_primitive(
    lambda x: jax.debug.callback(lambda v: None, x), 1.0, name="debug_callback"
)
debug_print_p = find_primitive(lambda x: jax.debug.print("{}", x), 1.0, name="debug_print")
pure_callback_p = find_primitive(
    lambda x: jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct((), jnp.float32), x),
    1.0,
    name="pure_callback",
)
io_callback_p = find_primitive(
    lambda x: io_callback(lambda v: v, jax.ShapeDtypeStruct((), jnp.float32), x),
    1.0,
    name="io_callback",
)
optimization_barrier_p = find_primitive(
    jax.lax.optimization_barrier, 1.0, name="optimization_barrier"
)

for _prim in (debug_callback_p, debug_print_p):
    register_materializing(
        _prim, compute_dtype, "the callback sees represented values (in at least float32)"
    )
for _prim in (pure_callback_p, io_callback_p):
    register_materializing(
        _prim, None, "the callback sees represented values; its outputs are unscaled"
    )


if optimization_barrier_p is not None:

    @registry.register_scaled_op(
        optimization_barrier_p,
        promote=False,
        family="higher-order",
        remark="one barrier over data and scales",
    )
    def scaled_optimization_barrier(*args: Any, **params: Any) -> list[Any]:
        del params  # none: the barrier is re-emitted with the public API
        leaves, specs = flatten_scaled(args)
        return unflatten_scaled(jax.lax.optimization_barrier(leaves), specs)


@registry.register_scaled_op(
    _compat.primitives.dce_sink_p,
    family="higher-order",
    remark="data and scale both kept from dead-code elimination",
)
def scaled_dce_sink(x: ScaledArray, **params: Any) -> list[Any]:
    """`jax.lax.dce_sink`: a sink on the data and one on the scale, its params forwarded."""
    dce_sink_p = _compat.primitives.dce_sink_p
    dce_sink_p.bind(x.data, **params)
    dce_sink_p.bind(jnp.asarray(x.scale), **params)
    return []


@registry.register_scaled_op(
    _compat.primitives.name_p, family="higher-order", remark="data and scale both named"
)
def scaled_checkpoint_name(x: ScaledArray, **params: Any) -> ScaledArray:
    name_p = _compat.primitives.name_p
    return ScaledArray(name_p.bind(x.data, **params), name_p.bind(jnp.asarray(x.scale), **params))


@registry.register_scaled_op(
    _compat.primitives.sharding_constraint_p,
    family="linear",
    remark="constraint on the data; the scalar scale is left unconstrained",
)
def scaled_sharding_constraint(x: ScaledArray, **params: Any) -> ScaledArray:
    return ScaledArray(_compat.primitives.sharding_constraint_p.bind(x.data, **params), x.scale)


def _reshard_primitive() -> Any:
    try:
        return _compat.primitives.reshard_p
    except AttributeError:  # a JAX without `jax.sharding.reshard`
        return None


if _reshard_primitive() is not None:

    @registry.register_scaled_op(
        _reshard_primitive(),
        family="linear",
        remark="the data resharded; the scale replicated (a block scale with its blocks)",
    )
    def scaled_reshard(x: ScaledArray, **params: Any) -> ScaledArray:
        return ScaledArray(
            _reshard_primitive().bind(x.data, **params), _scale_placement(x, "reshard", params)
        )


def _scale_placement(x: ScaledArray, name: str, params: dict[str, Any]) -> Any:
    """The scale of `x` moved like its data by `reshard` (`dst_sharding`): replicated
    when per tensor, else with its blocks."""
    scale = jnp.asarray(x.scale)
    sharding = params.get("dst_sharding")
    if sharding is None or not isinstance(sharding, jax.sharding.NamedSharding):
        return scale
    target = shardings.scale_sharding(sharding, x.shape, scale)
    prim = _reshard_primitive()
    return prim.bind(scale, **{**params, "dst_sharding": target})


@registry.register_scaled_op(
    _compat.primitives.device_put_p,
    promote=False,
    family="higher-order",
    remark="data and scale put on the same device / memory kind",
)
def scaled_device_put(*args: Any, **params: Any) -> list[Any]:
    leaves, specs = flatten_scaled(args)
    new_params = dict(params)
    for name, value in params.items():
        if isinstance(value, (tuple, list)) and len(value) == len(args):
            expanded: list[Any] = []
            for arg, v, scaled in zip(args, value, specs, strict=True):
                if scaled and name == "devices" and isinstance(v, jax.sharding.NamedSharding):
                    # A scale is replicated (a block scale sharded with its blocks).
                    expanded.extend([v, shardings.scale_sharding(v, arg.shape, arg.scale)])
                else:
                    expanded.extend([v, v] if scaled else [v])
            new_params[name] = type(value)(expanded)
    outs = _compat.primitives.device_put_p.bind(*leaves, **new_params)
    return unflatten_scaled(outs, specs)
