"""`define_primitive`: one of the library's own JAX primitives from a small spec.

Every primitive the library defines (the scaling primitives users call, the scalar scale
primitives, dynamic rescaling) needs the same five registrations: an implementation, an
abstract evaluation, an MLIR lowering (the implementation, lowered), a batching rule and a
JVP rule. They are written once here; a primitive names its implementation, its abstract
evaluation and, for batching and JVP, either a rule of its own or one of the common ones
below. A rule of its own is `rule(primitive, ...)`: it gets the primitive to bind.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax_scaled_arithmetics.core import define
    >>> twice_p = define.define_primitive(
    ...     "twice_example",
    ...     lambda x: 2 * x,
    ...     lambda x: x,
    ...     batching=define.batch_along_operand_0,
    ...     jvp=define.tangent_of_operand_0,
    ... )
    >>> jax.vmap(twice_p.bind)(jnp.ones((2, 3))).shape
    (2, 3)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from . import _compat

__all__ = [
    "define_primitive",
    "define_identity_primitive",
    "identity_on_operand_0",
    "batch_along_operand_0",
    "batch_along_operand_0_if_unbatched",
    "tangent_of_operand_0",
    "zero_tangents",
]

Rule = Callable[..., Any]


def define_primitive(
    name: str,
    impl: Callable[..., Any],
    abstract_eval: Callable[..., Any],
    *,
    multiple_results: bool = False,
    batching: Rule | None = None,
    jvp: Rule | None = None,
    cpu_impl: Callable[..., Any] | None = None,
    partitioned_impl: Callable[..., Any] | None = None,
) -> _compat.Primitive:
    """A new primitive: `impl` is its implementation and, lowered with `mlir.lower_fun`, its
    XLA lowering; `abstract_eval` its abstract evaluation; `batching(primitive, args, dims,
    **params)` and `jvp(primitive, primals, tangents, **params)` its rules (omitted: the
    primitive cannot be vmapped / differentiated); `cpu_impl`, the same values computed
    another way, its lowering on XLA:CPU for one device; `partitioned_impl` (default
    `impl`), the same values again, its lowering on every platform in a program the SPMD
    partitioner splits over devices, where a form that reshapes a tensor into short axes
    or concatenates tensors would make it gather a sharded tensor whole."""
    primitive = _compat.new_primitive(name, multiple_results)
    primitive.def_impl(impl)
    primitive.def_abstract_eval(abstract_eval)
    _compat.register_lowering(
        primitive, impl, multiple_results=multiple_results, partitioned_impl=partitioned_impl
    )
    if cpu_impl is not None:
        _compat.register_lowering(
            primitive,
            cpu_impl,
            multiple_results=multiple_results,
            platform="cpu",
            partitioned_impl=impl if partitioned_impl is None else partitioned_impl,
        )
    if batching is not None:
        _compat.register_batching(primitive, functools.partial(batching, primitive))
    if jvp is not None:
        _compat.register_jvp(primitive, functools.partial(jvp, primitive))
    return primitive


def identity_on_operand_0(x: Any, *others: Any, **params: Any) -> Any:
    """The implementation (and abstract evaluation) of a primitive that is the identity on
    its first operand outside `autoscale` (the scaling primitives)."""
    return x


def batch_along_operand_0(primitive: Any, args: Any, dims: Any, **params: Any) -> Any:
    """Batching of a single-output primitive that maps along its first operand's batch
    axis, its other operands unbatched (or elementwise alike)."""
    return primitive.bind(*args, **params), dims[0]


def batch_along_operand_0_if_unbatched(**unbatched: int) -> Rule:
    """:func:`batch_along_operand_0`, with a ValueError when an operand that must be the same
    for the whole batch (`name=index`: `scale=1`) is batched."""

    def rule(primitive: Any, args: Any, dims: Any, **params: Any) -> Any:
        for what, index in unbatched.items():
            if dims[index] is not None:
                raise ValueError(
                    f"{primitive.name}: the {what} must be the same for the whole batch (a "
                    f"scalar), but it is batched by vmap."
                )
        return batch_along_operand_0(primitive, args, dims, **params)

    return rule


def tangent_of_operand_0(primitive: Any, primals: Any, tangents: Any, **params: Any) -> Any:
    """JVP of a primitive that is the identity on the value of its first operand: the
    tangent passes unchanged (scaling is a choice of representation)."""
    return primitive.bind(*primals, **params), _compat.instantiate_zeros(tangents[0])


def zero_tangents(primitive: Any, primals: Any, tangents: Any, **params: Any) -> Any:
    """JVP of a primitive whose outputs are choices (scales, powers of two): no derivative."""
    out = primitive.bind(*primals, **params)
    if primitive.multiple_results:
        return out, [jnp.zeros_like(o) for o in out]
    return out, jnp.zeros_like(out)


def define_identity_primitive(name: str, batching: Rule) -> _compat.Primitive:
    """A primitive that is the identity on its first operand outside `autoscale` (a scaling
    primitive: it only changes the representation), tangents passing through it."""
    return define_primitive(
        name,
        identity_on_operand_0,
        identity_on_operand_0,
        batching=batching,
        jvp=tangent_of_operand_0,
    )
