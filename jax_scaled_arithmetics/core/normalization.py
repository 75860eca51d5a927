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
literals): it reduces with `reduce_sum`, takes an `rsqrt` or a `sqrt`, and every value it
hands on is float32 or wider (or not a float). Evaluated as a whole, it is the plain
equations on `x`'s represented values in float32: nothing measured. Each float value it
hands on takes the scale the static rules would give it from `x`'s scale `s`, as powers
of two (exponent arithmetic on one small kernel): a sum of `N` terms `N` times its
terms', products and quotients the products and quotients of their operands', a sum or
maximum of two values the larger of theirs (so `var + eps` takes `eps`'s where the
variance is below it), roots the roots: the mean at `s`, the variance at `s^2`,
`rsqrt(var + eps)` at `1/s` (at most `eps^-1/2`), the normalized rows at 1. The data is
near unit range where `x`'s is, which matters in the backward pass: it multiplies
cotangents by these values before narrowing them again. A run whose outputs have no such
scale (an `exp` of the statistics) keeps the rules, as do narrow statistics (a bfloat16
variance). Equations in between that do not read the run's values (the gain's reshape) are
evaluated by the rules, and the run ends at the first equation that reads both its values
and another (the gain's product).

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
    "normalization_run",
    "power_of_two",
]

# How far a run looks past equations that do not read it before it gives up.
_MAX_FOREIGN_IN_A_ROW = 16
# The square roots whose run is a normalization's.
ROOTS = ("rsqrt", "sqrt")


class NormalizationRun:
    """`groups`' key for a normalization run: `x` its input, `members` the equations that
    compute from `x` alone (in order), `foreign` the equations between them that do not
    read the run's values (evaluated by their rules), `constants` the exponents of the
    values computed from literals alone that the members read."""

    def __init__(
        self, x: Any, members: list[Any], foreign: list[Any], constants: dict[Any, Any]
    ) -> None:
        self.x = x
        self.members = members
        self.foreign = foreign
        self.constants = constants


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
    defined: set[Any] = set()
    members: list[int] = []
    foreign_in_a_row = 0
    cursor = index
    while cursor < len(eqns) and foreign_in_a_row <= _MAX_FOREIGN_IN_A_ROW:
        eqn = eqns[cursor]
        variables = [v for v in _variables(eqn) if v not in constants]
        if variables and all(v is x or v in defined for v in variables):
            if not all(_is_wide_or_not_float(v) for v in eqn.outvars) or eqn.effects:
                break  # a narrow value computed from the run: the rules give it a scale
            members.append(cursor)
            defined.update(v for v in eqn.outvars if not _compat.is_drop_var(v))
            foreign_in_a_row = 0
        elif any(v in defined for v in variables):
            break  # reads the run and another value: the run ends here
        else:
            foreign_in_a_row += 1
        cursor += 1
    if not members:
        return None
    names = collections.Counter(eqns[i].primitive.name for i in members)
    if not names["reduce_sum"] or not any(names[root] for root in ROOTS):
        return None
    stop = members[-1] + 1
    member_set = set(members)
    foreign = [eqns[i] for i in range(index, stop) if i not in member_set]
    member_eqns = [eqns[i] for i in members]
    # The run's outputs: its values read after it (or returned); the foreign equations'
    # outputs are written by the rules as they are evaluated.
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
    key = NormalizationRun(x, member_eqns, foreign, read_constants)
    static = _Exponents(member_eqns, {x: 0, **read_constants})
    if any(isinstance(e, str) and e == _UNKNOWN for e in map(static.of, outputs)):
        return None
    span_defines = {v for e in eqns[index:stop] for v in e.outvars}
    read = [v for e in eqns[index:stop] for v in _variables(e) if v not in span_defines]
    group_inputs = tuple(dict.fromkeys([x, *read]))
    return Group(index, stop, key, group_inputs, outputs)


def evaluate_normalization_run(
    key: NormalizationRun,
    inputs: dict[Any, Any],
    outputs: Sequence[Any],
    evaluate_foreign: Any,
    observers: Sequence[Any],
) -> list[Any]:
    """The run's members on `x`'s represented values in at least float32 (as the plain
    program computes them), each float output at the scale its exponent gives. `inputs`
    are the group's input values; `evaluate_foreign(eqn, operands)` evaluates an equation
    in between by its rules and returns its outputs (in program order: none reads the
    run)."""
    values: dict[Any, Any] = dict(inputs)

    def read(atom: Any) -> Any:
        if isinstance(atom, _compat.Literal):
            return atom.val
        return values[atom]

    for eqn in key.foreign:  # they may read `x` as it is
        outs = evaluate_foreign(eqn, [read(a) for a in eqn.invars])
        values.update(zip(eqn.outvars, outs))
    x = inputs[key.x]
    compute = jnp.promote_types(x.dtype, jnp.float32)
    values[key.x] = x.data.astype(compute) * jnp.asarray(x.scale, jnp.float32).astype(compute)
    exponents = _Exponents(key.members, {key.x: _exponent_of_scale(x.scale), **key.constants})
    powers: dict[int, tuple[Any, Any]] = {}

    def at_its_scale(var: Any, value: Any) -> Any:
        """A float value at the power of two of its exponent (others as they are)."""
        if not jnp.issubdtype(value.dtype, jnp.floating):
            return value
        exponent = exponents.of(var)
        exponent = 0 if isinstance(exponent, str) else exponent
        if id(exponent) not in powers and not isinstance(exponent, int):
            powers[id(exponent)] = power_of_two(exponent)
        scale, inverse = (
            power_of_two(exponent) if isinstance(exponent, int) else powers[id(exponent)]
        )
        data = value if isinstance(exponent, int) and exponent == 0 else value * inverse
        return ScaledArray(data, scale)

    for eqn in key.members:
        plain = [_plain(read(a)) for a in eqn.invars]
        operands = _compat.vary_like_plain(eqn, plain)
        with _compat.eqn_context(eqn):
            outs = bind_equation(eqn, operands)
        for var, out in zip(eqn.outvars, outs):
            values[var] = out
        if observers:
            held = [
                x if a is key.x else (at_its_scale(a, v) if isinstance(a, _compat.Var) else v)
                for a, v in zip(eqn.invars, plain)
            ]
            outs_held = [at_its_scale(v, o) for v, o in zip(eqn.outvars, outs)]
            for observer in observers:
                observer(eqn, held, outs_held)
    return [at_its_scale(v, values[v]) for v in outputs]


def _plain(value: Any) -> Any:
    """A constant operand's plain value (a ScaledArray's represented value)."""
    if isinstance(value, ScaledArray):
        return value.data.astype(jnp.float32) * jnp.asarray(value.scale, jnp.float32)
    return value
