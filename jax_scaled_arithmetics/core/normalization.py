"""A normalization's float32 statistics recognised in a jaxpr, evaluated as the plain ones.

Layer norms and RMS norms as Flax (linen and NNX), Equinox and handwritten models write
them upcast a low-precision tensor `x` to float32 and compute its statistics there: means
(`reduce_sum` then a division), a variance (`jnp.var`'s nested `jit`, or `E[x^2] - E[x]^2`
clamped at 0), `rsqrt(var + eps)`, the centered and normalized rows, and the derivatives
autodiff keeps of them. The plain program chose float32 for these values; their rules one
by one still measured the sums (a reduction and a site of `delayed_scaling` each) and
carried a scale through every step (a scalar kernel each on XLA:CPU), and held computed
scales between the reductions and their broadcasts, which XLA:GPU's normalization fusions
do not take.

A *normalization run* is a run of equations that compute from one value `x` alone (and
literals): it reduces with `reduce_sum`, takes an `rsqrt` or a `sqrt` (its own or in a
function it calls), and every value it hands on is float32 or wider (or not a float).
Evaluated as a whole, it is the plain equations on `x`'s represented values in float32:
nothing measured. Each float value it hands on takes the scale the static rules would
give it from `x`'s scale `s`, as powers of two (exponent arithmetic on one small kernel):
a sum of `N` terms `N` times its terms', products and quotients the products and
quotients of their operands', a sum or maximum of two values the larger of theirs (so
`var + eps` takes `eps`'s where the variance is below it), roots the roots: the mean at
`s`, the variance at `s^2`, `rsqrt(var + eps)` at `1/s` (at most `eps^-1/2`), the
normalized rows at 1. The data is near unit range where `x`'s is. A run whose outputs
have no such scale (an `exp` of the statistics) keeps the rules, as do narrow statistics
(a bfloat16 variance). Equations in between that do not read the run's values (the
gain's reshape) are evaluated by their rules. Once the statistics are computed, the run
takes in the float32 equations that read its values and others (the gain's product, the
bias's sum: each other value read at its own scale's exponent), and ends at the first
equation that reads its values and computes in a narrow dtype (the output's cast) or at
a product or an `exp` (their own groups start there).

Its *backward pass* is a run too: from the cotangent's cast to float32 (or the first
equation that reads the forward run's outputs), the float32 equations that read the
cotangent, the forward run's outputs or what they compute, with at least one sum (the
statistics' derivatives, the gain's and the bias's gradients), are the plain program's
on the represented values, the cotangents they hand on at the static rules' scales; the
other equations in between (the cotangent's cast back to the data's dtype) are evaluated
by their rules, reading the run's values at their scales. Its cotangents multiply the
statistics before they are narrowed again, which is why the forward run's data is kept
near unit range.

The values are the plain float32 program's: represented values whose squares leave
float32's range (beyond about 2^63 or below 2^-63) overflow or underflow in them as in
that program.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _compat
from .datatype import ScaledArray
from .scale_arithmetic import SCALE_MAX, SCALE_MIN, mark_pow2
from .walker import Group, bind_equation

__all__ = [
    "ROOTS",
    "NormalizationRun",
    "constant_variables",
    "evaluate_normalization_run",
    "normalization_backward_run",
    "normalization_run",
    "power_of_two",
    "primitive_names",
]

# How far a run looks past equations that do not read it before it gives up.
_MAX_FOREIGN_IN_A_ROW = 16
# The square roots whose run is a normalization's.
ROOTS = ("rsqrt", "sqrt")


class NormalizationRun:
    """`groups`' key for a normalization run: `span` the equations from its first to its
    last member, `members` the positions in `span` of those it computes as the plain
    program (the others are evaluated by their rules), `defined` their values, `seeds` the
    values they read from outside (`x`; in a backward pass the statistics, the cotangent,
    the gain), `primary` the seed that must be scaled for the run to be taken, `constants`
    the exponents of the values computed from literals alone that the members read,
    `readers` how many other equations read each value it hands on."""

    def __init__(
        self,
        primary: Any,
        span: list[Any],
        members: frozenset[int],
        defined: set[Any],
        seeds: frozenset[Any],
        constants: dict[Any, Any],
        backward: bool,
        readers: dict[Any, int],
    ) -> None:
        self.primary = primary
        self.span = span
        self.members = members
        self.defined = defined
        self.seeds = seeds
        self.constants = constants
        self.backward = backward
        self.readers = readers


# --- exponents: the power of two each value takes --------------------------------------
# An exponent is a Python int (folded at trace time) or a traced int32 scalar.

_ZERO = "zero"  # a literal 0 (absorbed by a sum, a product's result)
_UNKNOWN = "unknown"  # no static rule gives a scale (`exp` of `x`)
_NOT_FLOAT = "not a float"  # predicates and indices: not scaled

# Primitives whose output takes the exponent of their (first) operand.
_KEEP = frozenset(
    {
        "convert_element_type", "reduce_max", "reduce_min", "broadcast_in_dim", "reshape",
        "squeeze", "expand_dims", "transpose", "neg", "abs", "copy", "copy_p",
        "stop_gradient", "slice", "dynamic_slice", "rev", "reduce_precision", "sign",
    }
)  # fmt: skip
# Primitives whose output takes the largest of their operands' exponents.
_LARGEST = frozenset({"add", "sub", "add_any", "max", "min", "clamp", "concatenate", "pad"})
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "remat"})
# Past its statistics (and in a backward pass) a run takes in the equations with a static
# exponent that read its values; products and `exp`s end it (their own groups start there).
_RUN_PRIMITIVES = (
    _KEEP | _LARGEST | _CALLS
    | {"select_n", "reduce_sum", "mul", "div", "square", "integer_pow", "sqrt", "rsqrt"}
    | {"eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "is_finite"}
)  # fmt: skip
_RUN_ENDS = frozenset({"dot_general", "conv_general_dilated", "exp", "exp2", "logistic"})


def _is_exponent(e: Any) -> bool:
    return not isinstance(e, str)


def _largest(exponents: list[Any]) -> Any:
    if any(isinstance(e, str) and e == _UNKNOWN for e in exponents):
        return _UNKNOWN
    out: Any = _ZERO
    for e in exponents:
        if not _is_exponent(e) or e is out:
            continue
        if isinstance(out, str):
            out = e
        elif isinstance(out, int) and isinstance(e, int):
            out = max(out, e)
        else:
            out = lax.max(*(jnp.asarray(v, np.int32) for v in (out, e)))
    return out


def _combined(exponents: list[Any], signs: Sequence[int]) -> Any:
    """The exponent of a product (+1) or quotient (-1) of values with `exponents`."""
    strings = [e for e in exponents if isinstance(e, str)]
    divides_by_zero = signs[-1] < 0 and isinstance(exponents[-1], str) and exponents[-1] == _ZERO
    if _UNKNOWN in strings or divides_by_zero:
        return _UNKNOWN
    if _ZERO in strings:
        return _ZERO
    total: Any = None
    for e, sign in zip(exponents, signs):
        if isinstance(e, int) and e == 0:
            continue
        if total is None:
            total = e if sign > 0 else -e
        else:
            total = total + e if sign > 0 else total - e
    return 0 if total is None else total


def _times(e: Any, factor: int) -> Any:
    return e if isinstance(e, str) or factor == 1 else e * factor


def _root(e: Any, reciprocal: bool) -> Any:
    """The exponent of a square root (or its reciprocal): half, rounded down."""
    if isinstance(e, str):
        return _UNKNOWN if reciprocal and e == _ZERO else e
    e = -e if reciprocal else e
    return e >> 1 if isinstance(e, int) else lax.shift_right_arithmetic(e, np.int32(1))


def _literal_exponent(value: Any) -> Any:
    """A constant's exponent: of its largest finite magnitude (NaN and infinite fill values
    have none, as zeros)."""
    try:
        values = np.abs(np.asarray(value, np.float64))
    except (TypeError, ValueError):  # not an array of numbers
        return _UNKNOWN
    magnitude = float(np.max(values, initial=0.0, where=np.isfinite(values)))
    if magnitude == 0.0:
        return _ZERO
    return int(np.frexp(magnitude)[1]) - 1


def _equation_exponents(eqn: Any, of: Any) -> list[Any]:
    """The exponents of `eqn`'s outputs, `of(atom)` giving an operand's (asked only where
    needed)."""
    name = eqn.primitive.name
    outs = len(eqn.outvars)
    if all(not jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.outvars):
        return [_NOT_FLOAT] * outs
    ins = eqn.invars
    if name in _KEEP:
        return [of(ins[0])] * outs
    if name in _LARGEST:
        return [_largest([of(a) for a in ins])] * outs
    if name == "select_n":
        return [_largest([of(a) for a in ins[1:]])] * outs
    if name == "reduce_sum":
        shape = ins[0].aval.shape
        count = int(np.prod([shape[a] for a in eqn.params["axes"]], dtype=np.int64))
        return [_combined([of(ins[0]), max(count - 1, 0).bit_length()], (1, 1))]
    if name == "mul":
        return [_combined([of(a) for a in ins], (1, 1))]
    if name == "div":
        return [_combined([of(a) for a in ins], (1, -1))]
    if name == "square":
        return [_times(of(ins[0]), 2)]
    if name == "integer_pow":
        return [_times(of(ins[0]), int(eqn.params["y"]))]
    if name == "sqrt":
        return [_root(of(ins[0]), reciprocal=False)]
    if name == "rsqrt":
        return [_root(of(ins[0]), reciprocal=True)]
    if name in _CALLS:
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if inner is not None and len(getattr(inner, "jaxpr", inner).invars) == len(ins):
            return _jaxpr_exponents(inner, [of(a) for a in ins])
    return [_UNKNOWN] * outs


class _Exponents:
    """The exponents of a jaxpr's values, each computed when first asked for (only those of
    the values handed on, and what they need, are traced)."""

    def __init__(self, eqns: Sequence[Any], known: dict[Any, Any]) -> None:
        self.producers = {v: e for e in eqns for v in e.outvars}
        self.known = dict(known)

    def of(self, atom: Any) -> Any:
        if isinstance(atom, _compat.Literal):
            return _literal_exponent(atom.val)
        if atom not in self.known:
            eqn = self.producers.get(atom)
            if eqn is None:
                return _UNKNOWN
            self.known.update(zip(eqn.outvars, _equation_exponents(eqn, self.of)))
        return self.known[atom]


def _jaxpr_exponents(jaxpr: Any, ins: list[Any]) -> list[Any]:
    consts = getattr(jaxpr, "consts", None)
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    known: dict[Any, Any] = dict(zip(jaxpr.invars, ins))
    for index, var in enumerate(jaxpr.constvars):
        known[var] = _literal_exponent(consts[index]) if consts is not None else _UNKNOWN
    exponents = _Exponents(jaxpr.eqns, known)
    return [exponents.of(v) for v in jaxpr.outvars]


def _exponent_of_scale(scale: Any) -> Any:
    """The exponent of a (power-of-two) scale: an int when it is concrete, else traced
    (excluded from autodiff)."""
    if not _compat.is_tracer(scale):
        return int(np.frexp(np.float64(np.asarray(scale)))[1]) - 1
    bits = lax.bitcast_convert_type(lax.stop_gradient(jnp.asarray(scale, jnp.float32)), np.int32)
    return lax.shift_right_logical(bits, np.int32(23)) - np.int32(127)


def power_of_two(exponent: Any) -> tuple[Any, Any]:
    """`(2^e, 2^-e)` for an exponent clamped so that both stay in `[SCALE_MIN, SCALE_MAX]`:
    NumPy float32 scalars for an int, else from the bits (one small kernel)."""
    lowest = int(np.log2(SCALE_MIN))
    highest = min(int(np.log2(SCALE_MAX)), -lowest)
    if isinstance(exponent, int):
        power = min(max(exponent, lowest), highest)
        return np.float32(2.0**power), np.float32(2.0**-power)
    clamped = lax.clamp(np.int32(lowest), jnp.asarray(exponent, np.int32), np.int32(highest))
    bits = lax.shift_left(clamped + np.int32(127), np.int32(23))
    inverse_bits = np.int32(254 << 23) - bits  # 2^-e: exponent field 127 - e
    return (
        mark_pow2(lax.bitcast_convert_type(bits, np.float32)),
        mark_pow2(lax.bitcast_convert_type(inverse_bits, np.float32)),
    )


def _variables(eqn: Any) -> list[Any]:
    return [a for a in eqn.invars if not isinstance(a, _compat.Literal)]


def _is_wide_or_not_float(var: Any) -> bool:
    dtype = var.aval.dtype
    return not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize >= 4


def constant_variables(jaxpr: Any) -> dict[Any, Any]:
    """The variables of `jaxpr` computed from literals alone (`broadcast_in_dim 1.0`), with
    the exponent of their values where a static rule gives one."""
    constants: dict[Any, Any] = {}

    def of(atom: Any) -> Any:
        if isinstance(atom, _compat.Literal):
            return _literal_exponent(atom.val)
        return constants[atom]

    for eqn in jaxpr.eqns:
        if all(v in constants for v in _variables(eqn)) and not eqn.effects:
            exponents = _equation_exponents(eqn, of)
            constants.update(
                (v, e) for v, e in zip(eqn.outvars, exponents) if not _compat.is_drop_var(v)
            )
    return constants


def _computes_wide(eqn: Any) -> bool:
    """Whether `eqn` computes in float32 or wider: no effects, wide (or non-float) outputs,
    operands too but for a cast's (members read the represented values in float32), and
    so every value of a function it calls."""
    if eqn.effects or not all(_is_wide_or_not_float(v) for v in eqn.outvars):
        return False
    if eqn.primitive.name != "convert_element_type" and not all(
        _is_wide_or_not_float(a) for a in eqn.invars
    ):
        return False
    if eqn.primitive.name in _CALLS:
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        inner = getattr(inner, "jaxpr", inner)
        return inner is not None and all(_computes_wide(e) for e in inner.eqns)
    return True


def _joins_past_statistics(eqn: Any) -> bool:
    """Whether `eqn`, reading a run's values once its statistics are computed (or in a
    backward pass), joins it: computing wide, with a static exponent."""
    return eqn.primitive.name in _RUN_PRIMITIVES and _computes_wide(eqn)


def _grow(
    eqns: Sequence[Any], start: int, seeds: set[Any], constants: dict[Any, Any], strict: bool
) -> tuple[list[int], collections.Counter[str]]:
    """The indices of a run's members from equation `start` (and their primitives' counts):
    the equations that read its values (`seeds` and members' outputs). With `strict`, until
    the members hold a sum and a root they read the run's values alone (besides
    `constants`), and the first equation that reads them and another value ends the run;
    past them, the first that reads the run's values and does not join ends it."""
    run_values = set(seeds)
    members: list[int] = []
    names: collections.Counter[str] = collections.Counter()
    foreign_in_a_row = 0
    cursor = start
    while cursor < len(eqns) and foreign_in_a_row <= _MAX_FOREIGN_IN_A_ROW:
        eqn = eqns[cursor]
        variables = [v for v in _variables(eqn) if v not in constants]
        reads_run = any(v in run_values for v in variables)
        if strict and not (names["reduce_sum"] and any(names[r] for r in ROOTS)):
            if variables and all(v in run_values for v in variables):
                if not _computes_wide(eqn):
                    break  # a narrow value computed from the statistics: the rules scale it
                joins = True
            elif reads_run:
                break  # reads the statistics and another value before they are complete
            else:
                joins = False
        else:
            joins = reads_run and _joins_past_statistics(eqn)
            if not joins and eqn.primitive.name in _RUN_ENDS:
                break
            if not joins and reads_run and strict:
                break  # the normalized values handed on (narrowed): the forward run ends
        if joins:
            members.append(cursor)
            names.update(primitive_names(eqn))
            run_values.update(v for v in eqn.outvars if not _compat.is_drop_var(v))
            foreign_in_a_row = 0
        else:
            foreign_in_a_row += 1
        cursor += 1
    members = _closed(eqns, start, members, constants)
    names = collections.Counter()
    for i in members:
        names.update(primitive_names(eqns[i]))
    return members, names


def primitive_names(eqn: Any) -> collections.Counter[str]:
    """The primitives `eqn` binds: its own, and those of the functions it calls (`jit`,
    inlined as the run evaluates them)."""
    names = collections.Counter([eqn.primitive.name])
    if eqn.primitive.name in _CALLS:
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        for inner_eqn in getattr(inner, "jaxpr", inner).eqns if inner is not None else ():
            names.update(primitive_names(inner_eqn))
    return names


def _closed(
    eqns: Sequence[Any], start: int, members: list[int], constants: dict[Any, Any]
) -> list[int]:
    """`members` with the equations between them that could join and compute what they
    read (the cotangent's cast to float32) or read it too (the bias's gradient, a sum of
    the cotangent), and then those that read these, until none is left."""
    if not members:
        return members
    taken = set(members)
    stop = members[-1] + 1
    candidates = [
        i for i in range(start, stop) if i not in taken and _joins_past_statistics(eqns[i])
    ]
    while candidates:
        read = {v for i in taken for v in _variables(eqns[i])}
        defined = {v for i in taken for v in eqns[i].outvars}
        joining = [
            i
            for i in candidates
            if any(v in read for v in eqns[i].outvars)
            or any(v in read or v in defined for v in _variables(eqns[i]) if v not in constants)
        ]
        if not joining:
            break
        taken.update(joining)
        candidates = [i for i in candidates if i not in taken]
    return sorted(taken)


def _run_group(
    jaxpr: Any,
    index: int,
    uses: collections.Counter[Any],
    constants: dict[Any, Any],
    members: list[int],
    primary: Any,
    backward: bool,
) -> Group | None:
    """The group of a run starting at `index` with `members` (indices), or None when it
    hands nothing on or a value it hands on has no static exponent."""
    eqns = jaxpr.eqns
    stop = members[-1] + 1
    member_eqns = [eqns[i] for i in members]
    defined = {v for e in member_eqns for v in e.outvars if not _compat.is_drop_var(v)}
    seeds = tuple(
        dict.fromkeys(
            v for e in member_eqns for v in _variables(e) if v not in defined and v not in constants
        )
    )
    # The run's outputs: its values read by the other equations (in the span or after it)
    # or returned.
    inside = collections.Counter(a for e in member_eqns for a in _variables(e))
    results = {id(v) for v in jaxpr.outvars}
    outputs = tuple(
        v
        for e in member_eqns
        for v in e.outvars
        if not _compat.is_drop_var(v) and (uses[v] > inside[v] or id(v) in results)
    )
    if not outputs:
        return None
    read_constants = {v: constants[v] for e in member_eqns for v in _variables(e) if v in constants}
    static = _Exponents(member_eqns, {**{s: 0 for s in seeds}, **read_constants})
    if any(isinstance(e, str) and e == _UNKNOWN for e in map(static.of, outputs)):
        return None
    span = eqns[index:stop]
    span_defines = {v for e in span for v in e.outvars}
    read = [v for e in span for v in _variables(e) if v not in span_defines]
    key = NormalizationRun(
        primary,
        span,
        frozenset(i - index for i in members),
        defined,
        frozenset(seeds),
        read_constants,
        backward,
        _readers(eqns[index:], set(members), index, outputs, uses, inside, results),
    )
    return Group(index, stop, key, tuple(dict.fromkeys([primary, *read])), outputs)


def _readers(
    eqns: Sequence[Any],
    members: set[int],
    offset: int,
    outputs: Sequence[Any],
    uses: collections.Counter[Any],
    inside: collections.Counter[Any],
    results: set[int],
) -> dict[Any, int]:
    """How many equations read each output outside the run (`eqns` from its start, at
    `offset`; its `members` skipped), for the walk's materialisation: an output that one
    cast or reshape reads, whose result two or more read, counts as read twice (the rules
    materialise no result whose scale is its operand's, so the output's data is written
    once here, not recomputed with the whole normalization inside each reader of the
    cast: a post-norm residual stream's fusions grew with every block)."""
    readers = {v: uses[v] - inside[v] + (id(v) in results) for v in outputs}
    # The value each chain of one-reader casts from an output has reached, and its output.
    reached = {v: v for v, n in readers.items() if n == 1}
    for position, eqn in enumerate(eqns if reached else ()):
        if not reached:
            break
        if position + offset in members:
            continue  # the run's own reads
        for atom in _variables(eqn):
            origin = reached.pop(atom, None)
            if origin is None:
                continue
            out = eqn.outvars[0] if len(eqn.outvars) == 1 else None
            if eqn.primitive.name not in _KEEP or out is None:
                continue  # read by a rule that computes: it materialises what it writes
            if uses[out] >= 2 or id(out) in results:
                readers[origin] = 2
            else:
                reached[out] = origin
    return readers


def normalization_run(
    jaxpr: Any, index: int, uses: collections.Counter[Any], constants: dict[Any, Any]
) -> Group | None:
    """The normalization run starting at equation `index` (which must read one value `x`,
    besides literals and `constants`), or None when the equations from there are not one."""
    eqns = jaxpr.eqns
    inputs = [v for v in _variables(eqns[index]) if v not in constants]
    if not inputs or any(v is not inputs[0] for v in inputs):
        return None
    x = inputs[0]
    members, names = _grow(eqns, index, {x}, constants, strict=True)
    if not members or not names["reduce_sum"] or not any(names[root] for root in ROOTS):
        return None
    return _run_group(jaxpr, index, uses, constants, members, x, backward=False)


def normalization_backward_run(
    jaxpr: Any,
    index: int,
    uses: collections.Counter[Any],
    constants: dict[Any, Any],
    anchors: set[Any],
) -> Group | None:
    """The backward pass of normalization runs (whose outputs are `anchors`) starting at
    equation `index`: one that reads an anchor or widens a narrow value (the cotangent's
    cast to float32), with the equations that read what it computes, at least one sum
    among them and an anchor read; or None."""
    eqn = jaxpr.eqns[index]
    variables = [v for v in _variables(eqn) if v not in constants]
    widens = (
        eqn.primitive.name == "convert_element_type"
        and len(variables) == 1
        and jnp.issubdtype(variables[0].aval.dtype, jnp.floating)
        and not _is_wide_or_not_float(variables[0])
    )
    if not (widens or any(v in anchors for v in variables)) or not _joins_past_statistics(eqn):
        return None
    members, names = _grow(jaxpr.eqns, index, {*anchors, *variables}, constants, strict=False)
    if not members or not names["reduce_sum"]:
        return None
    read_anchors = [v for i in members for v in _variables(jaxpr.eqns[i]) if v in anchors]
    if not read_anchors:
        return None
    return _run_group(jaxpr, index, uses, constants, members, read_anchors[0], backward=True)


def evaluate_normalization_run(
    key: NormalizationRun,
    inputs: dict[Any, Any],
    outputs: Sequence[Any],
    evaluate_foreign: Any,
    observers: Sequence[Any],
    promote: Any,
    exponents_of: dict[Any, Any],
    settle: Any,
) -> list[Any]:
    """The run's equations in program order: its members on the represented values of what
    they read in at least float32 (as the plain program computes them), the others by
    their rules, reading the members' values at the scales their exponents give (as do
    the outputs). `inputs` are the group's input values; `evaluate_foreign(eqn, operands)`
    evaluates an equation by its rules and returns its outputs; `promote(var, value)`
    gives a plain float value the members read a scale (as the rules would);
    `exponents_of` holds the exponents of the scales earlier runs gave their outputs (read
    for the seeds among them, instead of the scales' bits) and takes this run's;
    `settle(value, readers)` is the walk's materialisation of a value that `readers`
    equations read (as after each rule)."""
    values: dict[Any, Any] = dict(inputs)
    plain: dict[Any, Any] = {}  # the members' values and the represented seeds
    held: dict[Any, Any] = {}  # the members' values at their scales, as handed on
    member_eqns = [e for i, e in enumerate(key.span) if i in key.members]
    exponents = _Exponents(member_eqns, dict(key.constants))
    powers: dict[int, tuple[Any, Any]] = {}

    def read(atom: Any) -> Any:
        if isinstance(atom, _compat.Literal):
            return atom.val
        return values[atom]

    def represented(atom: Any) -> Any:
        """A member's operand as the plain program holds it."""
        if isinstance(atom, _compat.Literal):
            return atom.val
        if atom in plain:
            return plain[atom]
        value = values[atom]
        if atom not in key.seeds or not jnp.issubdtype(value.dtype, jnp.floating):
            return _plain(value)  # a constant, or not a float
        if not isinstance(value, ScaledArray):
            value = promote(atom, value)
        compute = jnp.promote_types(value.dtype, jnp.float32)
        scale = jnp.asarray(value.scale, jnp.float32)
        if np.ndim(scale):  # per-block scales: the largest gives the exponent
            plain[atom] = value.to_array(compute)
            scale = jnp.max(scale)
        else:
            plain[atom] = value.data.astype(compute) * scale.astype(compute)
        known = exponents_of.get(atom)
        if known is not None and known[0] is value:
            exponents.known[atom] = known[1]
        else:
            exponents.known[atom] = _exponent_of_scale(scale)
        return plain[atom]

    def at_its_scale(var: Any) -> Any:
        """A member's float value at the power of two of its exponent (others as they are)."""
        if var in held:
            return held[var]
        value = plain[var]
        if not jnp.issubdtype(value.dtype, jnp.floating):
            held[var] = value
            return value
        exponent = exponents.of(var)
        exponent = 0 if isinstance(exponent, str) else exponent
        if isinstance(exponent, int):
            scale, inverse = power_of_two(exponent)
        else:
            if id(exponent) not in powers:
                powers[id(exponent)] = power_of_two(exponent)
            scale, inverse = powers[id(exponent)]
        data = value if isinstance(exponent, int) and exponent == 0 else value * inverse
        held[var] = settle(ScaledArray(data, scale), key.readers.get(var, 0))
        return held[var]

    def handed_on(atom: Any) -> Any:
        """An operand of another equation: a member's value at its scale."""
        if isinstance(atom, _compat.Var) and atom in key.defined:
            return at_its_scale(atom)
        return read(atom)

    for index, eqn in enumerate(key.span):
        if index not in key.members:
            outs = evaluate_foreign(eqn, [handed_on(a) for a in eqn.invars])
            values.update(zip(eqn.outvars, outs))
            continue
        operands = _compat.vary_like_plain(eqn, [represented(a) for a in eqn.invars])
        with _compat.eqn_context(eqn):
            if observers and eqn.primitive.name in _INLINED_WHEN_OBSERVED:
                outs = _observed_call(eqn, operands, list(map(exponents.of, eqn.invars)), observers)
            else:
                outs = bind_equation(eqn, operands)
        plain.update((v, o) for v, o in zip(eqn.outvars, outs) if not _compat.is_drop_var(v))
        if observers:
            held_in = [handed_on(a) for a in eqn.invars]
            held_out = [
                o if _compat.is_drop_var(v) else at_its_scale(v) for v, o in zip(eqn.outvars, outs)
            ]
            for observer in observers:
                observer(eqn, held_in, held_out)
    handed = [at_its_scale(v) for v in outputs]
    for var, value in zip(outputs, handed):
        exponent = exponents.of(var)
        if isinstance(value, ScaledArray) and not isinstance(exponent, str):
            exponents_of[var] = (value, exponent)
    return handed


# Functions a member calls that the run evaluates equation by equation when its equations
# are observed (`analysis.tensor_ranges`), so that what they compute is seen; custom
# derivatives are kept whole.
_INLINED_WHEN_OBSERVED = frozenset({"jit", "pjit", "closed_call", "core_call"})


def _observed_call(
    eqn: Any, operands: list[Any], operand_exponents: list[Any], observers: Sequence[Any]
) -> list[Any]:
    """A member call's outputs, its equations evaluated one by one on the plain values and
    observed at the scales their exponents give."""
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    jaxpr = getattr(inner, "jaxpr", inner)
    if jaxpr is None or len(jaxpr.invars) != len(operands):
        return bind_equation(eqn, operands)
    consts = list(getattr(inner, "consts", ()))
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, operands))
    known = dict(zip(jaxpr.invars, operand_exponents))
    known.update((v, _literal_exponent(c)) for v, c in zip(jaxpr.constvars, consts))
    exponents = _Exponents(jaxpr.eqns, known)

    def value(atom: Any) -> Any:
        return atom.val if isinstance(atom, _compat.Literal) else env[atom]

    def held(atom: Any, plain: Any) -> Any:
        if not jnp.issubdtype(jnp.result_type(plain), jnp.floating):
            return plain
        exponent = exponents.of(atom)
        scale, inverse = power_of_two(0 if isinstance(exponent, str) else exponent)
        return ScaledArray(jnp.asarray(plain) * inverse, scale)

    for inner_eqn in jaxpr.eqns:
        ins = [value(a) for a in inner_eqn.invars]
        if inner_eqn.primitive.name in _INLINED_WHEN_OBSERVED:
            outs = _observed_call(
                inner_eqn, ins, list(map(exponents.of, inner_eqn.invars)), observers
            )
        else:
            outs = bind_equation(inner_eqn, ins)
        env.update(zip(inner_eqn.outvars, outs))
        held_in = [held(a, v) for a, v in zip(inner_eqn.invars, ins)]
        held_out = [held(v, o) for v, o in zip(inner_eqn.outvars, outs)]
        for observer in observers:
            observer(inner_eqn, held_in, held_out)
    return [value(v) for v in jaxpr.outvars]


def _plain(value: Any) -> Any:
    """A constant operand's plain value (a ScaledArray's represented value)."""
    if isinstance(value, ScaledArray):
        return value.data.astype(jnp.float32) * jnp.asarray(value.scale, jnp.float32)
    return value
