"""A jaxpr re-evaluator that lets a transform replace equations (and runs of equations).

`unit_scale` and `simulate_fp8` are both "trace the user function to a jaxpr, evaluate it
again with some equations swapped for other JAX code". This module holds what they share:
tracing with static (non-array) arguments, evaluating a jaxpr equation by equation under
whatever trace is current (so the result nests inside `jit`, `grad`, `vmap`, `autoscale`),
inlining `jit` calls, rebuilding `scan`/`while`/`cond`/`checkpoint` over rewritten bodies
through the public `jax.lax` API, and grouping the equations traced inside one call of a
Python function (found from the frames JAX records for each equation).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ..core import _compat

__all__ = [
    "GradientOf",
    "Group",
    "JaxprRewriter",
    "code_of",
    "find_calls",
    "gradient_error",
    "recover_gradient",
    "trace_flat",
    "unwrap_outer",
    "MATMULS",
    "contains_matmul",
    "first_backward_eqn",
    "own_rewrap",
    "multiplies_matrices",
    "sub_jaxprs",
]


@dataclasses.dataclass(frozen=True)
class Group:
    """The equations `eqns[start:stop]` of one call of a recognised Python function.

    `inputs` are the variables the run reads but does not define (in order of first use),
    `outputs` those it defines and something after it reads.
    """

    start: int
    stop: int
    key: Any
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]


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


REWRAP = "__jsa_rewrap__"


def own_rewrap(fn: Any) -> tuple[Any, Callable[[Any], Any]] | None:
    """`fn`'s own `(inner, rewrap)` declaration, or None. A wrapper made with
    `functools.wraps` (`jax.grad`, `jax.jit`) copies the attributes of the function it wraps,
    the declaration included: it is `fn`'s own only when `fn` wraps `inner` directly. A
    `jax.jit` (a wrapper that can be lowered) is looked through: jitting does not change
    values, and the re-wrapped function can be jitted again from outside."""
    entry = getattr(fn, REWRAP, None)
    if entry is None:
        return None
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is entry[0]:
        return entry
    if wrapped is not None and callable(getattr(fn, "lower", None)):
        return own_rewrap(wrapped)
    return None


def unwrap_outer(fn: Any) -> tuple[Any, Callable[[Any], Any]]:
    """`(inner, rewrap)` for a function made by a transform that declares how to re-apply
    itself (`jsa.autoscale`, `simulate_fp8`): `rewrap(inner)` is `fn`. For other functions,
    `(fn, identity)`. A transform applied to `fn` can then act on `inner` and re-wrap it,
    so that it commutes with those transforms."""
    entry = own_rewrap(fn)
    if entry is None:
        return fn, lambda g: g
    inner, rewrap = entry
    inner, inner_rewrap = unwrap_outer(inner)
    return inner, lambda g: rewrap(inner_rewrap(g))


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

    def flat_fn(*values: Any) -> Any:
        full = list(leaves)
        for i, v in zip(dynamic, values):
            full[i] = v
        call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, full)
        return fn(*call_args, **call_kwargs)

    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dynamic_leaves)
    out_tree = jax.tree_util.tree_structure(out_shape)
    return closed, dynamic_leaves, out_tree


@dataclasses.dataclass(frozen=True)
class GradientOf:
    """`jax.grad(target, argnums, has_aux)` (or `jax.value_and_grad` when `with_value`)."""

    target: Callable[..., Any]
    argnums: int | tuple[int, ...]
    has_aux: bool
    with_value: bool

    def apply(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The same gradient transform of another function."""
        make = jax.value_and_grad if self.with_value else jax.grad
        return make(fn, argnums=self.argnums, has_aux=self.has_aux)


_MAX_GRADIENT_CANDIDATES = 64


def _shapes_like(tree: Any, shapes: Any) -> bool:
    """`shapes` (avals) has the structure of `tree` (arrays) and the same leaf shapes."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    shape_leaves, shape_def = jax.tree_util.tree_flatten(shapes)
    same_structure: bool = bool(treedef == shape_def)  # type: ignore[operator]
    return same_structure and all(
        tuple(np.shape(a)) == tuple(b.shape) for a, b in zip(leaves, shape_leaves)
    )


def _gradient_candidates(args: Sequence[Any], out: Any) -> list[tuple[Any, bool, bool]]:
    """`(argnums, has_aux, with_value)` whose gradient transform would give outputs shaped
    like `out` (avals) for these positional arguments: single argument numbers first, then
    tuples by size."""
    n = len(args)
    argnums: list[Any] = list(range(n))
    for size in range(1, n + 1):
        argnums.extend(itertools.combinations(range(n), size))
    found = []
    for nums in argnums:
        grads = args[nums] if isinstance(nums, int) else tuple(args[i] for i in nums)
        pair = isinstance(out, tuple) and len(out) == 2
        forms = [
            (False, False, out),
            (True, False, out[0] if pair else None),
            (False, True, out[1] if pair else None),
            (True, True, out[1] if pair else None),
        ]
        for has_aux, with_value, part in forms:
            if part is None or not _shapes_like(grads, part):
                continue
            if with_value:
                value = out[0][0] if has_aux and isinstance(out[0], tuple) else out[0]
                if getattr(value, "shape", None) != ():
                    continue
            found.append((nums, has_aux, with_value))
        if len(found) >= _MAX_GRADIENT_CANDIDATES:
            break
    return found


def _program_text(closed: Any) -> str:
    """The printed program, with an outer `jit` that takes and returns everything removed."""
    while len(closed.jaxpr.eqns) == 1:
        eqn = closed.jaxpr.eqns[0]
        if (
            eqn.primitive is not _compat.jit_p
            or list(eqn.invars) != list(closed.jaxpr.invars)
            or list(eqn.outvars) != list(closed.jaxpr.outvars)
        ):
            break
        closed = eqn.params["jaxpr"]
    return str(closed)


def recover_gradient(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], closed: Any, out_tree: Any
) -> GradientOf | None:
    """How `fn` (traced to `closed`, `out_tree` on these arguments) was made by `jax.grad` or
    `jax.value_and_grad` from a function it wraps, or None.

    The functions these (and `jax.jit`) return name the function they wrap in `__wrapped__`
    (the `functools.wraps` convention). Each function down that chain, with each `argnums`,
    `has_aux` and value-or-not whose outputs have the right shapes, is differentiated again
    and traced on the same arguments: the one giving exactly the same program (printed,
    outer `jit` aside) and output structure is the answer. A gradient computed inside a larger
    function (a training step), or through `jax.vjp`, is not recovered.
    """
    text = _program_text(closed)
    out = jax.tree_util.tree_unflatten(out_tree, closed.out_avals)
    target = getattr(fn, "__wrapped__", None)
    for _ in range(8):
        if target is None or not callable(target):
            return None
        for argnums, has_aux, with_value in _gradient_candidates(args, out):
            candidate = GradientOf(target, argnums, has_aux, with_value)
            try:
                traced, _, traced_tree = trace_flat(candidate.apply(target), args, kwargs)
            except Exception:  # noqa: BLE001 - a candidate that does not apply is not the one
                continue
            if traced_tree == out_tree and _program_text(traced) == text:
                return candidate
        target = getattr(target, "__wrapped__", None)
    return None


def gradient_error(transform: str, fn: Any) -> ValueError:
    """The error for a function that computes a gradient `recover_gradient` cannot undo."""
    name = getattr(fn, "__name__", "the function")
    return ValueError(
        f"{transform}: {name} computes a gradient that is not `jax.grad`/`jax.value_and_grad` "
        "of a function (a gradient inside a larger function, or `jax.vjp`). The transform "
        "gives each op its own forward and backward treatment, which a traced gradient "
        f"program no longer separates: apply jax.grad outside, `jax.grad({transform}(f))`, "
        f"or pass {transform} the `jax.grad` of the loss."
    )


class JaxprRewriter:
    """Evaluates jaxprs equation by equation; subclasses override :meth:`rewrite_eqn` and
    :meth:`rewrite_group` to replace some of them.

    Every equation not replaced is bound again unchanged (with its source information), so
    the evaluation builds the same program under the current trace. `jit` calls are inlined
    (evaluated with the rewriter); `scan`, `while`, `cond` and `checkpoint` are rebuilt with
    the public `jax.lax` functions over rewritten bodies; custom-derivative functions are
    bound unchanged, keeping their rules (a subclass may replace them).
    """

    def groups(self, jaxpr: Any) -> list[Group]:
        """The runs of equations of `jaxpr` to hand to :meth:`rewrite_group`."""
        return []

    def rewrite_eqn(
        self, eqn: Any, index: int, invals: list[Any], context: Any
    ) -> list[Any] | None:
        """Replacement outputs for equation `index`, or None to keep it (`invals` may be
        modified in place: the kept equation is then bound on the modified inputs)."""
        return None

    def rewrite_group(self, group: Group, invals: list[Any], context: Any) -> list[Any] | None:
        """Replacement outputs (for `group.outputs`) of a run of equations, or None to keep it."""
        return None

    def context_for(self, jaxpr: Any, parent: Any) -> Any:
        """Per-jaxpr information handed to the rewrite methods (None by default)."""
        return parent

    def sub_context(self, context: Any, index: int) -> Any:
        """The context of the sub-jaxprs of equation `index` of the jaxpr of `context`."""
        return context

    # --- evaluation ----------------------------------------------------------------------

    def run_closed(self, closed: Any, args: Sequence[Any], parent: Any = None) -> list[Any]:
        return self.run(closed.jaxpr, closed.consts, args, parent)

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], parent: Any) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(atom: Any) -> Any:
            return atom.val if isinstance(atom, _compat.Literal) else env[atom]

        for var, value in zip(jaxpr.constvars, consts, strict=True):
            env[var] = value
        if len(args) != len(jaxpr.invars):
            raise TypeError(f"jaxpr takes {len(jaxpr.invars)} arguments, got {len(args)}.")
        for var, value in zip(jaxpr.invars, args):
            env[var] = value
        context = self.context_for(jaxpr, parent)
        starts = {g.start: g for g in self.groups(jaxpr)}
        index = 0
        eqns = jaxpr.eqns
        while index < len(eqns):
            group = starts.get(index)
            if group is not None:
                outs = self.rewrite_group(group, [read(v) for v in group.inputs], context)
                if outs is not None:
                    if len(outs) != len(group.outputs):
                        raise ValueError(
                            f"replacement for {group.key!r} returned {len(outs)} outputs, "
                            f"the function it replaces has {len(group.outputs)}."
                        )
                    for var, out in zip(group.outputs, outs):
                        env[var] = _check_like(var, out, group.key)
                    index = group.stop
                    continue
            eqn = eqns[index]
            invals = [read(a) for a in eqn.invars]
            with _compat.eqn_context(eqn):
                outs = self.rewrite_eqn(eqn, index, invals, context)
                if outs is None:
                    outs = self.default_eqn(eqn, invals, self.sub_context(context, index))
            for var, out in zip(eqn.outvars, outs, strict=True):
                if not _compat.is_drop_var(var):
                    env[var] = out
            index += 1
        return [read(v) for v in jaxpr.outvars]

    def default_eqn(self, eqn: Any, invals: list[Any], context: Any) -> list[Any]:
        prim = eqn.primitive
        params = eqn.params
        if prim is _compat.jit_p:
            return self.run_closed(params["jaxpr"], invals, context)
        if prim is _compat.closed_call_p:
            return self.run_closed(params["call_jaxpr"], invals, context)
        if prim is _compat.scan_p:
            return self._scan(eqn, invals, context)
        if prim is _compat.while_p:
            return self._while(eqn, invals, context)
        if prim is _compat.cond_p:
            return self._cond(eqn, invals, context)
        if prim is _compat.remat_p:
            return self._remat(eqn, invals, context)
        subfuns, bind_params = _compat.get_bind_params(eqn)
        outs = prim.bind(*subfuns, *invals, **bind_params)
        return list(outs) if prim.multiple_results else [outs]

    def _scan(self, eqn: Any, invals: list[Any], context: Any) -> list[Any]:
        params = eqn.params
        num_consts, num_carry = params["num_consts"], params["num_carry"]
        consts = invals[:num_consts]
        carry = invals[num_consts : num_consts + num_carry]
        xs = invals[num_consts + num_carry :]
        body = params["jaxpr"]

        def step(c: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            outs = self.run_closed(body, [*consts, *c, *x], context)
            return outs[:num_carry], outs[num_carry:]

        carry_out, ys = jax.lax.scan(
            step,
            carry,
            xs,
            length=params["length"],
            reverse=params["reverse"],
            unroll=params["unroll"],
        )
        return [*carry_out, *ys]

    def _while(self, eqn: Any, invals: list[Any], context: Any) -> list[Any]:
        params = eqn.params
        n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
        cond_consts = invals[:n_cond]
        body_consts = invals[n_cond : n_cond + n_body]
        init = invals[n_cond + n_body :]

        def cond_fun(carry: Any) -> Any:
            return self.run_closed(params["cond_jaxpr"], [*cond_consts, *carry], context)[0]

        def body_fun(carry: Any) -> Any:
            return self.run_closed(params["body_jaxpr"], [*body_consts, *carry], context)

        return list(jax.lax.while_loop(cond_fun, body_fun, init))

    def _cond(self, eqn: Any, invals: list[Any], context: Any) -> list[Any]:
        index, *operands = invals

        def branch(closed: Any) -> Callable[..., list[Any]]:
            return lambda *ops: self.run_closed(closed, list(ops), context)

        branches = [branch(b) for b in eqn.params["branches"]]
        return list(jax.lax.switch(index, branches, *operands))

    def _remat(self, eqn: Any, invals: list[Any], context: Any) -> list[Any]:
        params = eqn.params
        inner = params["jaxpr"]

        def body(*args: Any) -> list[Any]:
            return self.run(inner, (), args, context)

        wrapped = jax.checkpoint(body, prevent_cse=params["prevent_cse"], policy=params["policy"])
        return list(wrapped(*invals))


def _check_like(var: Any, out: Any, key: Any) -> Any:
    aval = var.aval
    shape = getattr(out, "shape", None)
    if shape is not None and tuple(shape) != tuple(aval.shape):
        raise ValueError(
            f"replacement for {key!r} returned shape {tuple(shape)}; the function it replaces "
            f"returns {tuple(aval.shape)}."
        )
    return out
