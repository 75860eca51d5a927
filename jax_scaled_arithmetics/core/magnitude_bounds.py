"""Upper bounds on the largest magnitudes of the tensors a function computes.

:func:`evaluate_with_bounds` evaluates a function (traced to a jaxpr and walked equation
by equation, `jit` bodies inlined) and, for the outputs asked for, an upper bound on each
one's largest magnitude, derived from the largest magnitudes of its tensor inputs (one
reduction over the inputs that matter, all of them at once) by interval rules: `|a + b| <=
A + B`, `|a * b| <= A * B`, `|a / c| <= A / |c|` for a divisor whose smallest magnitude is
known (a scalar, a constant), `|sqrt(a)| <= sqrt(A)`... Scalars (a step count, a learning
rate, a bias correction, a global norm) enter as their own magnitudes, exactly. An output
reached by an equation without a rule (or through a division by a tensor) has no bound.

The bounds are computed in float32 with the operations of the values, in their order:
rounding is monotone, so a bound is at least the largest magnitude the program computes,
not only the exact one (a sum of many terms, `reduce_sum` or a contraction, bounded by
`count * largest`, may exceed it by float32 rounding, far below the headroom of a stored
format). Inputs enter with their largest *finite* magnitude: an
element computed from a non-finite input is non-finite in the plain program too.

What it is for: an optimizer's new state leaves are stored with a scale from their bound,
so that each is written by the kernel that computes it (a dynamic scale would wait for a
reduction over the new tensor: a float32 pass of its own). Outputs computed by the same
equations from different inputs (an update mapped over the parameters) share one
computation of their bounds, as one float32 vector.

Examples:
    >>> import jax.numpy as jnp
    >>> from jax_scaled_arithmetics.core.magnitude_bounds import evaluate_with_bounds
    >>> m, g = jnp.array([1.0, -4.0]), jnp.array([2.0, 0.5])
    >>> outs, bounds = evaluate_with_bounds(lambda m, g: (0.75 * m + 0.25 * g,), (m, g))
    >>> outs[0].tolist()  # largest magnitude 2.875
    [1.25, -2.875]
    >>> [(positions, vector.tolist()) for positions, vector in bounds.groups([0])]
    [((0,), [3.5])]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _compat
from .scale_arithmetic import largest_finite_magnitudes_p
from .walker import Frame, JaxprWalker, bind_equation

__all__ = ["Bounds", "elements", "evaluate_with_bounds"]

_F32 = np.dtype(np.float32)

# Equations whose output's largest magnitude is at most their first operand's.
_SAME = frozenset(
    {
        "neg",
        "abs",
        "copy",
        "copy_p",
        "reshape",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "transpose",
        "slice",
        "dynamic_slice",
        "rev",
        "reduce_max",
        "reduce_min",
        "cummax",
        "cummin",
        "real",
        "convert_element_type",
        "reduce_precision",
        "optimization_barrier",
    }
)
# Equations whose output is a broadcast of a scalar when their operand is one.
_KEEPS_A_BROADCAST = frozenset(
    {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose"}
)
# Equations at most 1 in magnitude whatever their operands.
_UNIT = frozenset({"sign", "tanh", "logistic", "sin", "cos", "erf"})
# Equations whose output's largest magnitude is at most the largest of their operands'
# (select_n with a predicate per element: of its cases; pad: of the operand and the padding
# value; dynamic_update_slice: of the operand and the update).
_LARGEST = {
    "max": slice(None),
    "min": slice(None),
    "concatenate": slice(None),
    "select_n": slice(1, None),
    "pad": slice(0, 2),
    "dynamic_update_slice": slice(0, 2),
    "clamp": slice(0, 3, 2),  # within [lo, hi]
}


class _Node:
    """A value of the walk and how its bound is computed: `kind` is "input" (`param`: its
    position among the function's inputs), "const" (`param`: its bound and smallest
    magnitude, known now), "exact" (a scalar: its own magnitude), "opaque" (no bound), or a
    rule applied to `operands` ("same": at most the operand's bound times `param`, and its
    smallest magnitude kept where `param` is 1; "at_most": only the former...).
    `scalar`: the scalar node a tensor is a broadcast of."""

    __slots__ = ("value", "kind", "operands", "param", "scalar")

    def __init__(self, value: Any, kind: str, operands: tuple[_Node, ...] = (), param: Any = None):
        self.value = value
        self.kind = kind
        self.operands = operands
        self.param = param
        self.scalar: _Node | None = None


def _one_choice(predicate: _Node) -> _Node | None:
    """The scalar predicate of a `select_n` that picks one case for the whole tensor (a
    scalar, or its broadcast: `jnp.where(flag, a, b)`), or None."""
    if np.ndim(predicate.value) == 0:
        return predicate
    return predicate.scalar


def _float_kind(dtype: Any) -> bool:
    """Whether values of `dtype` can be bounded in float32 (not float64, not complex)."""
    dtype = np.dtype(dtype)
    return dtype != np.float64 and (
        jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    )


def _leaf_node(value: Any, shape: tuple[int, ...], dtype: Any) -> _Node:
    """A node for a value the rules do not compute: a known constant, a scalar, or opaque."""
    if not _float_kind(dtype) or jnp.issubdtype(np.dtype(dtype), jnp.bool_):
        return _Node(value, "opaque")
    if not _compat.is_tracer(value):
        magnitudes = np.abs(np.asarray(value, np.float64))
        if magnitudes.size == 0 or not np.all(np.isfinite(magnitudes)):
            return _Node(value, "opaque")
        top = np.float32(magnitudes.max())
        if float(top) < float(magnitudes.max()):  # rounded down to float32: one step up
            top = np.nextafter(top, np.float32(np.inf))
        low = np.float32(magnitudes.min())
        if float(low) > float(magnitudes.min()):
            low = np.nextafter(low, np.float32(0))
        return _Node(value, "const", param=(top, low))
    if shape == ():
        return _Node(value, "exact")
    return _Node(value, "opaque")


def _rounding_slack(dtype: Any) -> float:
    """1 plus the largest relative change of rounding float32 values to `dtype`."""
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return 1.0
    mantissa = int(jnp.finfo(dtype).nmant)
    return 1.0 if mantissa >= 23 else 1.0 + 2.0**-mantissa


def _rule(eqn: Any, operands: list[_Node]) -> tuple[str, tuple[_Node, ...], Any]:
    """The rule bounding `eqn`'s (one) output: `(kind, operands, param)`."""
    name = eqn.primitive.name
    if name in _SAME:
        slack = 1.0
        if name == "convert_element_type":
            new_dtype, old_dtype = eqn.params["new_dtype"], eqn.invars[0].aval.dtype
            if not (
                jnp.issubdtype(new_dtype, jnp.floating) and jnp.issubdtype(old_dtype, jnp.floating)
            ):
                # To integers (truncated toward zero: no larger, maybe smaller) or from them
                # (only scalars and constants reach here): no smallest magnitude kept.
                return "at_most", (operands[0],), None
            slack = _rounding_slack(new_dtype)
        elif name == "reduce_precision":
            slack = 1.0 + 2.0 ** -int(eqn.params["mantissa_bits"])
        return "same", (operands[0],), slack
    if name in ("add", "sub", "add_any"):
        return "sum", tuple(operands), None
    if name == "mul":
        return "product", tuple(operands), None
    choice = _one_choice(operands[0]) if name == "select_n" else None
    if choice is not None:  # one case for the whole tensor: the bound is the chosen case's
        return "select", (choice, *operands[1:]), None
    if name in _LARGEST:
        return "largest", tuple(operands[_LARGEST[name]]), None
    if name in _UNIT:
        return "one", (), None
    if name == "div":
        return "quotient", tuple(operands), None
    if name == "sqrt":
        return "sqrt", (operands[0],), None
    if name == "rsqrt":
        return "reciprocal_sqrt", (operands[0],), None
    if name == "square":
        return "power", (operands[0],), 2
    if name == "integer_pow":
        y = int(eqn.params["y"])
        return ("power", (operands[0],), y) if y >= 0 else ("reciprocal_power", (operands[0],), -y)
    if name in ("exp", "exp2"):
        return name, (operands[0],), None
    if name == "reduce_sum":
        shape = eqn.invars[0].aval.shape
        count = int(np.prod([shape[a] for a in eqn.params["axes"]], dtype=np.int64))
        return "times", (operands[0],), float(count)
    if name == "cumsum":
        return "times", (operands[0],), float(eqn.invars[0].aval.shape[eqn.params["axis"]])
    if name == "dot_general":
        (contracting, _), _ = eqn.params["dimension_numbers"]
        shape = eqn.invars[0].aval.shape
        count = int(np.prod([shape[a] for a in contracting], dtype=np.int64))
        return "product", (operands[0], operands[1]), float(count)
    return "opaque", (), None


class _BoundWalker(JaxprWalker):
    """Evaluates a jaxpr on `_Node`s: each equation bound on their values, its outputs
    wrapped with the rule that bounds them."""

    def literal(self, value: Any) -> Any:
        return _leaf_node(value, np.shape(value), jnp.result_type(value))

    def run_closed(self, closed: Any, args: Sequence[Any], parent: Any = None) -> list[Any]:
        consts = [
            _leaf_node(c, np.shape(c), jnp.result_type(c)) if not isinstance(c, _Node) else c
            for c in closed.consts
        ]
        return self.run(closed.jaxpr, consts, args, parent)

    def eval_eqn(self, eqn: Any, invals: list[Any], frame: Frame) -> list[Any]:
        if eqn.primitive in (_compat.jit_p, _compat.closed_call_p):
            return self.eval_higher_order(eqn, invals, frame.context)  # inlined
        values = bind_equation(eqn, [n.value for n in invals])
        outs = self._nodes(eqn, invals, values)
        if len(outs) == 1 and eqn.primitive.name in _KEEPS_A_BROADCAST and invals:
            source = invals[0] if np.ndim(invals[0].value) == 0 else invals[0].scalar
            if source is not None:
                outs[0].scalar = source  # a broadcast of one scalar
        return outs

    def _nodes(self, eqn: Any, invals: list[_Node], values: list[Any]) -> list[_Node]:
        """`eqn`'s outputs `values`, each with the rule that bounds it."""
        outs = []
        for var, value in zip(eqn.outvars, values):
            aval = var.aval
            shape, dtype = tuple(getattr(aval, "shape", ())), getattr(aval, "dtype", None)
            if dtype is None or not _float_kind(dtype) or jnp.issubdtype(dtype, jnp.bool_):
                outs.append(_Node(value, "opaque"))
            elif shape == ():
                outs.append(_Node(value, "exact"))
            elif len(values) != 1:
                outs.append(_Node(value, "opaque"))
            else:
                kind, operands, param = _rule(eqn, invals)
                outs.append(_Node(value, kind, operands, param))
        return outs


def _lower_known(node: _Node) -> bool:
    """Whether a lower bound on the smallest magnitude of `node` is known now."""
    while node.kind == "same" and node.param == 1.0:
        node = node.operands[0]
    return node.kind in ("exact", "const")


def _boundable(node: _Node, memo: dict[int, bool]) -> bool:
    """Whether `node` has a bound (every operand its rule reads has one)."""
    stack = [node]
    while stack:
        top = stack[-1]
        if id(top) in memo:
            stack.pop()
            continue
        if top.kind == "opaque":
            memo[id(top)] = False
        elif top.kind in ("input", "const", "exact", "one"):
            memo[id(top)] = True
        elif top.kind in ("reciprocal_power", "reciprocal_sqrt"):
            memo[id(top)] = _lower_known(top.operands[0])
        else:
            needed = _bounded_operands(top)
            pending = [n for n in needed if id(n) not in memo]
            if pending:
                stack.extend(pending)
                continue
            ok = all(memo[id(n)] for n in needed)
            if top.kind == "quotient":
                ok = ok and _lower_known(top.operands[1])
            memo[id(top)] = ok
        stack.pop()
    return memo[id(node)]


def _structure(node: _Node) -> tuple[tuple[Any, ...], list[_Node]]:
    """A key equal for nodes computed by the same rules from the same constants and shared
    scalars (inputs in the same places), and the nodes in the order the key lists them."""
    order: list[_Node] = []
    numbers: dict[int, int] = {}
    key: list[Any] = []
    stack: list[_Node] = [node]
    while stack:
        top = stack.pop()
        if id(top) in numbers:
            key.append(("ref", numbers[id(top)]))
            continue
        numbers[id(top)] = len(order)
        order.append(top)
        if top.kind == "exact":
            key.append(("exact", id(top)))
        elif top.kind == "const":
            key.append(("const", float(top.param[0]), float(top.param[1])))
        elif top.kind == "input":
            key.append(("input",))
        elif top.kind == "select":  # the predicate: one value for every member
            key.append(("select", id(top.operands[0]), len(top.operands)))
            stack.extend(reversed(top.operands[1:]))
        else:
            key.append((top.kind, top.param, len(top.operands)))
            stack.extend(reversed(top.operands))
    return tuple(key), order


def _f32(x: Any) -> Any:
    return lax.convert_element_type(x, _F32)


def _lower(node: _Node) -> Any:
    """The known lower bound on the smallest magnitude of `node` (see `_lower_known`)."""
    while node.kind == "same" and node.param == 1.0:
        node = node.operands[0]
    if node.kind == "const":
        return node.param[1]
    return lax.abs(_f32(node.value))


def _bounded_operands(node: _Node) -> tuple[_Node, ...]:
    """The operands whose bounds the bound of `node` reads (a divisor gives its smallest
    magnitude instead, a predicate its value)."""
    if node.kind in ("input", "const", "exact", "opaque", "reciprocal_sqrt", "reciprocal_power"):
        return ()
    if node.kind == "quotient":
        return node.operands[:1]
    if node.kind == "select":
        return node.operands[1:]
    return node.operands


def _operands_first(node: _Node) -> list[_Node]:
    """The nodes whose bounds the bound of `node` reads, each after those it reads."""
    done: set[int] = set()
    out: list[_Node] = []
    stack: list[tuple[_Node, bool]] = [(node, False)]
    while stack:
        top, expanded = stack.pop()
        if id(top) in done:
            continue
        if expanded:
            done.add(id(top))
            out.append(top)
            continue
        stack.append((top, True))
        stack.extend((n, False) for n in reversed(_bounded_operands(top)) if id(n) not in done)
    return out


def _evaluate(order: list[_Node], inputs: dict[int, Any]) -> Any:
    """The bound of `order[0]`, every node of `order` after its operands (`inputs`: the
    bound of each input node, by id: a vector across a group's members)."""
    bounds: dict[int, Any] = {}
    for node in _operands_first(order[0]):
        kind = node.kind
        ops: list[Any] = [bounds.get(id(n)) for n in node.operands]
        if kind == "input":
            out = inputs[id(node)]
        elif kind == "const":
            out = node.param[0]
        elif kind == "exact":
            out = lax.abs(_f32(node.value))
        elif kind == "one":
            out = np.float32(1.0)
        elif kind == "same":
            out = ops[0] if node.param == 1.0 else ops[0] * np.float32(node.param)
        elif kind == "at_most":
            out = ops[0]
        elif kind == "sum":
            out = ops[0]
            for b in ops[1:]:
                out = out + b
        elif kind == "product":
            out = ops[0] * ops[1]
            if node.param is not None:
                out = out * np.float32(node.param)
        elif kind == "select":
            cases = jnp.broadcast_arrays(*ops[1:])
            out = lax.select_n(node.operands[0].value, *cases)
        elif kind == "largest":
            out = ops[0]
            for b in ops[1:]:
                out = jnp.maximum(out, b)
        elif kind == "quotient":
            out = ops[0] / _lower(node.operands[1])
        elif kind == "sqrt":
            out = jnp.sqrt(ops[0])
        elif kind == "reciprocal_sqrt":
            out = lax.rsqrt(_lower(node.operands[0]))
        elif kind == "power":
            out = lax.integer_pow(jnp.asarray(ops[0], _F32), int(node.param))
        elif kind == "reciprocal_power":
            out = lax.integer_pow(np.float32(1.0) / _lower(node.operands[0]), int(node.param))
        elif kind in ("exp", "exp2"):
            out = jnp.exp(ops[0]) if kind == "exp" else jnp.exp2(ops[0])
        elif kind == "times":
            out = ops[0] * np.float32(node.param)
        else:  # pragma: no cover - `_boundable` rules out every other kind
            raise AssertionError(f"no bound for {kind!r}")
        bounds[id(node)] = jnp.asarray(out, _F32)
    return bounds[id(order[0])]


class Bounds:
    """The bounds :func:`evaluate_with_bounds` can give on the outputs of a function."""

    def __init__(self, nodes: list[_Node]) -> None:
        self._nodes = nodes

    def groups(self, wanted: Sequence[int]) -> list[tuple[tuple[int, ...], Any]]:
        """Bounds on the largest magnitudes of the outputs at the positions `wanted`, in
        groups `(positions, bounds)`: `bounds` a float32 vector, one element per position,
        one computation on vectors for the group. A wanted output without a bound (or a
        scalar) is in no group.

        The inputs whose largest magnitudes the bounds read are reduced together: one
        `largest_finite_magnitudes` equation, ordered so that each group's inputs at one
        place of its rule (the moments of every parameter...) are one slice of it."""
        memo: dict[int, bool] = {}
        grouped: dict[tuple[Any, ...], list[tuple[int, list[_Node]]]] = {}
        for position in wanted:
            node = self._nodes[position]
            if np.ndim(node.value) == 0 or not _boundable(node, memo):
                continue
            key, order = _structure(node)
            grouped.setdefault(key, []).append((position, order))
        slots: dict[int, int] = {}
        pairs: list[Any] = []
        for members in grouped.values():
            for k, node in enumerate(members[0][1]):
                if node.kind == "input":
                    for _, order in members:
                        if order[k].param not in slots:
                            slots[order[k].param] = len(slots)
                            pairs += [order[k].value, np.float32(1.0)]
        maxima = largest_finite_magnitudes_p.bind(*_compat.match_varying(*pairs)) if pairs else None
        groups = []
        for members in grouped.values():
            _, order = members[0]
            inputs_of: dict[int, Any] = {}
            for k, node in enumerate(order):
                if node.kind == "input" and id(node) not in inputs_of:
                    inputs_of[id(node)] = elements(maxima, [slots[m[1][k].param] for m in members])
            bounds = jnp.broadcast_to(_evaluate(order, inputs_of), (len(members),))
            groups.append((tuple(p for p, _ in members), bounds))
        return groups


def evaluate_with_bounds(
    fun: Callable[..., Sequence[Any]], args: Sequence[Any]
) -> tuple[list[Any], Bounds]:
    """`fun(*args)` (`args` and the outputs flat sequences of arrays) and the bounds it
    allows on the largest magnitudes of its outputs (:meth:`Bounds.groups`).

    `fun` is traced once and its jaxpr evaluated (`jit` bodies inlined): the outputs are
    the values `fun` computes, with the same equations. Tensor inputs of a floating dtype
    (float64 aside) enter with their largest finite magnitude, scalars with their own.
    """
    closed = jax.make_jaxpr(lambda *a: list(fun(*a)))(*args)
    inputs = []
    for position, value in enumerate(args):
        shape, dtype = tuple(np.shape(value)), jnp.result_type(value)
        if shape != () and _float_kind(dtype) and jnp.issubdtype(dtype, jnp.floating):
            inputs.append(_Node(value, "input", param=position))
        else:
            inputs.append(_leaf_node(value, shape, dtype))
    nodes = _BoundWalker().run_closed(closed, inputs)
    return [n.value for n in nodes], Bounds(nodes)


def elements(vector: Any, where: list[int]) -> Any:
    """`vector[where]` (static indices): a slice where they are consecutive, else a gather."""
    if where == list(range(where[0], where[0] + len(where))):
        return lax.slice(vector, (where[0],), (where[0] + len(where),))
    dimension_numbers = lax.GatherDimensionNumbers(
        offset_dims=(), collapsed_slice_dims=(0,), start_index_map=(0,)
    )
    indices = np.asarray(where, np.int32)[:, None]
    return lax.gather(
        vector,
        indices,
        dimension_numbers,
        (1,),
        mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS,
        indices_are_sorted=bool(np.all(np.diff(where) >= 0)),
    )
