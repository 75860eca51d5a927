"""What the rewriting transforms share on top of the walker (`core/walker.py`).

`unit_scale` and `simulate_fp8` are both "trace the user function to a jaxpr, evaluate it
again with some equations swapped for other JAX code": each is a `JaxprWalker` with its own
rules, evaluated under whatever trace is current (so the result nests inside `jit`, `grad`,
`vmap`, `autoscale`). This module holds the rest: tracing with static (non-array)
arguments (`trace_flat`), refusing a traced gradient (`rewrite_call`), and grouping the
equations traced inside one call of a Python function (`find_calls`, from the frames JAX
records for each equation).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import _compat
from .walker import Group, JaxprWalker

__all__ = [
    "Group",
    "code_of",
    "find_calls",
    "gradient_error",
    "rewrite_call",
    "trace_flat",
    "of_leaves",
    "MATMULS",
    "contains_matmul",
    "first_backward_eqn",
    "multiplies_matrices",
    "sub_jaxprs",
]


def code_of(fn: Any) -> Any:
    """The code object of a Python function (through `functools.wraps`/`jax.jit` wrappers),
    or None for callables without one."""
    target = fn
    for _ in range(8):
        code = getattr(target, "__code__", None)
        if code is not None:
            return code
        wrapped = getattr(target, "__wrapped__", None)
        if wrapped is None:
            break
        target = wrapped
    try:
        return inspect.unwrap(fn).__code__
    except AttributeError:
        return None


MATMULS = ("dot_general", "conv_general_dilated")


def sub_jaxprs(eqn: Any) -> list[Any]:
    """The jaxprs an equation's parameters hold (bodies of jit, scan, cond, custom rules...)."""
    found = []
    for param in eqn.params.values():
        items = param if isinstance(param, tuple) else (param,)
        for item in items:
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                found.append(inner)
    return found


def multiplies_matrices(eqn: Any) -> bool:
    """A `dot_general`/`conv_general_dilated`, or an equation whose sub-jaxprs contain one."""
    return eqn.primitive.name in MATMULS or any(contains_matmul(j) for j in sub_jaxprs(eqn))


def first_backward_eqn(jaxpr: Any) -> Any:
    """The first equation (searching sub-jaxprs too) that JAX recorded while transposing a
    derivative (`jax.grad`, `jax.vjp`: its name stack holds `transpose(jvp(...))`), or None."""
    for eqn in jaxpr.eqns:
        if "transpose(jvp" in _compat.eqn_name_stack(eqn):
            return eqn
        for inner in sub_jaxprs(eqn):
            found = first_backward_eqn(inner)
            if found is not None:
                return found
    return None


@functools.lru_cache(maxsize=256)
def contains_matmul(jaxpr: Any) -> bool:
    return any(multiplies_matrices(eqn) for eqn in jaxpr.eqns)


def _outside_reads(jaxpr: Any, start: int, stop: int) -> tuple[list[Any], list[Any]]:
    defined: set[Any] = set()
    inputs: list[Any] = []
    for eqn in jaxpr.eqns[start:stop]:
        for atom in eqn.invars:
            if isinstance(atom, _compat.Literal) or atom in defined or atom in inputs:
                continue
            inputs.append(atom)
        defined.update(v for v in eqn.outvars if not _compat.is_drop_var(v))
    read_later: set[Any] = set()
    for eqn in jaxpr.eqns[stop:]:
        read_later.update(a for a in eqn.invars if not isinstance(a, _compat.Literal))
    read_later.update(v for v in jaxpr.outvars if not isinstance(v, _compat.Literal))
    outputs = [
        v
        for eqn in jaxpr.eqns[start:stop]
        for v in eqn.outvars
        if not _compat.is_drop_var(v) and v in read_later
    ]
    return inputs, outputs


def find_calls(jaxpr: Any, codes: dict[Any, Any]) -> list[Group]:
    """Runs of equations traced inside one call of a function whose code object is a key of
    `codes` (the value names the function in the returned groups' `key`).

    An equation belongs to a call when the function's code object is among its recorded
    frames (the outermost such frame when several recognised functions nest). Consecutive
    equations belong to the same call while their frames above the function are the same and
    the bytecode offset inside the function does not go back (a second call from the same
    line, as in a Python loop, starts again from the function's first instructions).
    """
    groups: list[Group] = []
    current: tuple[Any, Any, int, int] | None = None  # (key, caller frames, start, offset)

    def close(stop: int) -> None:
        if current is None:
            return
        key, _, start, _ = current
        inputs, outputs = _outside_reads(jaxpr, start, stop)
        groups.append(Group(start, stop, key, tuple(inputs), tuple(outputs)))

    for index, eqn in enumerate(jaxpr.eqns):
        frames = _compat.eqn_code_frames(eqn)
        found = None
        for depth in range(len(frames) - 1, -1, -1):  # outermost recognised frame wins
            code, offset = frames[depth]
            if code in codes:
                found = (codes[code], tuple(frames[depth + 1 :]), offset)
                break
        if found is None:
            close(index)
            current = None
            continue
        key, callers, offset = found
        if current is not None and current[0] == key and current[1] == callers:
            if offset >= current[3]:
                current = (key, callers, current[2], offset)
                continue
        close(index)
        current = (key, callers, index, offset)
    close(len(jaxpr.eqns))
    return groups


def _is_array_leaf(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or _compat.is_tracer(leaf)


def of_leaves(
    fn: Callable[..., Any], treedef: Any, leaves: Sequence[Any], dynamic: Sequence[int]
) -> Callable[..., Any]:
    """`fn(*args, **kwargs)` as a function of some leaves of `(args, kwargs)` (flattened to
    `leaves` and `treedef`): those at the indices `dynamic`, the others held fixed."""

    def flat_fn(*values: Any) -> Any:
        full = list(leaves)
        for i, v in zip(dynamic, values):
            full[i] = v
        call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, full)
        return fn(*call_args, **call_kwargs)

    return flat_fn


def trace_flat(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[Any, list[Any], Any]:
    """Trace `fn(*args, **kwargs)` to a closed jaxpr over its array leaves.

    Leaves that are not arrays (Python numbers, strings, configuration objects) are static:
    they are baked into the jaxpr. Returns the jaxpr, the array leaves it takes, and the
    output tree structure.
    """
    leaves, treedef = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)))
    dynamic = [i for i, leaf in enumerate(leaves) if _is_array_leaf(leaf)]
    dynamic_leaves = [leaves[i] for i in dynamic]
    flat_fn = of_leaves(fn, treedef, leaves, dynamic)
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dynamic_leaves)
    out_tree = jax.tree_util.tree_structure(out_shape)
    return closed, dynamic_leaves, out_tree


def gradient_error(transform: str, fn: Any) -> ValueError:
    """The error for a function whose traced program computes a gradient."""
    name = getattr(fn, "__name__", "the function")
    return ValueError(
        f"{transform}: {name} computes a gradient (its program has the backward equations of "
        "`jax.grad`, `jax.value_and_grad` or `jax.vjp`). The transform gives each op its own "
        "forward and backward treatment, which a traced gradient program no longer "
        f"separates: apply jax.grad outside, `jax.grad({transform}(f))`."
    )


def rewrite_call(
    transform: str,
    fn: Callable[..., Any],
    walker: JaxprWalker | Callable[[Any], JaxprWalker],
    args: Any,
    kwargs: Any,
) -> Any:
    """`fn(*args, **kwargs)` evaluated by a rewriting transform's `walker`: `fn` traced over
    its array leaves, refused if it computes a gradient, walked, its output tree rebuilt.
    `walker` may be a function of the traced ClosedJaxpr that makes the walker (one that
    needs to see the whole program first)."""
    closed, leaves, out_tree = trace_flat(fn, args, kwargs)
    if first_backward_eqn(closed.jaxpr) is not None:
        raise gradient_error(transform, fn)
    if not isinstance(walker, JaxprWalker):
        walker = walker(closed)
    outs = walker.run_closed(closed, leaves)
    return jax.tree_util.tree_unflatten(out_tree, outs)
