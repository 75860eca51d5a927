"""A softmax recognised in a jaxpr, evaluated as the plain one on the represented values,
its outputs at the scales their bounds give (no measurement).

`exp(x - m)`, with `m` at least `x`'s largest entry along the axes it was reduced over, is
at most 1; divided by its sum along those axes, at most 1 again; that sum lies in `[1, N]`
for `N` entries. `jax.nn.softmax`, `log_softmax` and handwritten softmaxes write these
equations (a training step's forward pass keeps them). Their rules one by one would align
the scales of `x` and `m`, measure the sum and rescale the quotient: scale arithmetic
between the reductions and the broadcasts that XLA:GPU's normalization fusion (one Triton
kernel for a softmax) does not take, and a reduction per measured scale. Evaluated as a
whole instead, the program is the plain softmax of `x`'s data times its scale.
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
from .dtypes import compute_dtype
from .pow2 import static_pow2
from .walker import Group, bind_equation

__all__ = [
    "ExpAtMostOne",
    "ShiftedExp",
    "evaluate_exp_at_most_one",
    "evaluate_shifted_exp",
    "exp_at_most_one_group",
    "shifted_exp_group",
]

# Equations between a `reduce_max` and the value subtracted that keep it at least the
# maximum: broadcasts, reshapes, `stop_gradient`, and `max` with a constant.
_KEEPS_AT_LEAST_THE_MAX = ("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "stop_gradient")
# Equations that carry a reduction back to the shape of its operand.
_BROADCASTS = ("broadcast_in_dim", "reshape", "expand_dims")
_MOVES = (*_BROADCASTS, "squeeze")


def _max_chain(x: Any, m: Any, producers: dict[Any, Any]) -> list[Any] | None:
    """The equations computing `m` from `x` (`reduce_max(x)`, then equations that keep it at
    least the maximum), in evaluation order; None when `m` is not so computed."""
    chain, subtracted = [], m
    node = producers.get(m)
    while node is not None and node.primitive is not lax.reduce_max_p:
        if node.primitive.name in _KEEPS_AT_LEAST_THE_MAX:
            m = node.invars[0]
        elif node.primitive is lax.max_p:
            variables = [v for v in node.invars if not isinstance(v, _compat.Literal)]
            if len(variables) != 1:
                return None
            m = variables[0]
        else:
            return None
        chain.append(node)
        node = producers.get(m)
    if node is None or node.invars[0] is not x:
        return None
    chain.append(node)
    chain.reverse()
    axes = tuple(node.params["axes"])
    for step in chain[1:]:
        if step.primitive.name in _MOVES and not _carries_the_sum(step, x, axes):
            return None  # a maximum subtracted from other entries than its own
    if tuple(subtracted.aval.shape) not in _layouts(x, axes)[1:]:
        return None
    return chain


def _layouts(terms: Any, axes: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """The shapes of a sum over `axes` of `terms`: summed axes dropped, kept as size 1,
    broadcast back to the terms' shape."""
    shape = tuple(terms.aval.shape)
    kept = tuple(d for i, d in enumerate(shape) if i not in axes)
    keepdims = tuple(1 if i in axes else d for i, d in enumerate(shape))
    return kept, keepdims, shape


def _carries_the_sum(eqn: Any, terms: Any, axes: Sequence[int]) -> bool:
    """Whether a reshape or broadcast of a sum over `axes` of `terms` (laid out with the
    summed axes dropped or of size 1) keeps each sum where the terms it adds are: a reshape
    between those two layouts, or a broadcast of either to the terms' shape."""
    kept, keepdims, full = _layouts(terms, axes)
    before = tuple(eqn.invars[0].aval.shape)
    after = tuple(eqn.outvars[0].aval.shape)
    if before not in (kept, keepdims):
        return False
    if eqn.primitive.name in ("reshape", "expand_dims", "squeeze"):
        transposed = eqn.primitive.name == "reshape" and eqn.params.get("dimensions")
        return after in (kept, keepdims) and not transposed
    if eqn.primitive.name != "broadcast_in_dim" or after not in (keepdims, full):
        return False
    dims = tuple(int(d) for d in eqn.params["broadcast_dimensions"])
    if before == kept:
        return dims == tuple(i for i in range(len(full)) if i not in axes)
    return dims == tuple(range(len(full)))


def _is_float_convert(eqn: Any, operand: Any) -> bool:
    """Whether `eqn` converts `operand` to another floating dtype (values unchanged but
    for rounding)."""
    return (
        eqn.primitive is lax.convert_element_type_p
        and eqn.invars[0] is operand
        and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating)
    )


class ShiftedExp:
    """`groups`' key for `exp(x - m)` (`m` at least the maximum of `x`), alone or followed
    by its sum and the quotient: `chain` computes `m` from `x`, `eqns` are the group's;
    `factors[v]` is the scale of group output `v` (1, or the sum's `pow2(sqrt(N))`)."""

    def __init__(self, x: Any, chain: list[Any], eqns: list[Any], factors: dict[Any, float]):
        self.x = x
        self.chain = chain
        self.eqns = eqns
        self.factors = factors


def _outputs(jaxpr: Any, start: int, stop: int, uses: collections.Counter[Any]) -> tuple[Any, ...]:
    inside = collections.Counter(
        a for e in jaxpr.eqns[start:stop] for a in e.invars if not isinstance(a, _compat.Literal)
    )
    results = {id(v) for v in jaxpr.outvars}
    return tuple(
        v
        for e in jaxpr.eqns[start:stop]
        for v in e.outvars
        if not _compat.is_drop_var(v) and (uses[v] > inside[v] or id(v) in results)
    )


def _sum_and_quotient(
    eqns: Sequence[Any], start: int, terms: Any, axes: tuple[int, ...]
) -> tuple[dict[Any, float], int] | None:
    """When `eqns[start:]` begin with the sum of `terms` over `axes` (after a cast to
    float32, as float16/bfloat16 softmaxes take it), casts and broadcasts of it, and the
    quotient of `terms` by it: each of their outputs' scale (the sum's `pow2(sqrt(N))`,
    the quotient's 1) and the index after the quotient."""
    summed, end = terms, start
    if end < len(eqns) and _is_float_convert(eqns[end], summed):
        summed = eqns[end].outvars[0]
        end += 1
    if end >= len(eqns):
        return None
    total_eqn = eqns[end]
    if not (
        total_eqn.primitive is lax.reduce_sum_p
        and total_eqn.invars[0] is summed
        and tuple(total_eqn.params["axes"]) == axes
    ):
        return None
    total = total_eqn.outvars[0]
    sums = [total]
    end += 1
    while end < len(eqns) and eqns[end].invars[0] is total:
        step = eqns[end]
        carries = step.primitive.name in _BROADCASTS and _carries_the_sum(step, terms, axes)
        if not (carries or _is_float_convert(step, total)):
            break
        total = step.outvars[0]
        sums.append(total)
        end += 1
    if end >= len(eqns):
        return None
    div = eqns[end]
    if not (
        div.primitive is lax.div_p
        and div.invars[0] is terms
        and div.invars[1] is total
        and tuple(total.aval.shape) in _layouts(terms, axes)[1:]
    ):
        return None
    count = int(np.prod([terms.aval.shape[a] for a in axes], dtype=np.int64))
    factor = _sum_factor(count, [v.aval.dtype for v in sums])
    factors = {summed: 1.0, **{v: factor for v in sums}, div.outvars[0]: 1.0}
    return factors, end + 1


def _sum_factor(count: int, dtypes: Sequence[Any]) -> float:
    """The scale of a sum of `count` terms in `[0, 1]`, largest 1 (a value in `[1, count]`):
    the static rule's `pow2(sqrt(count))`, or more where `count` over it would not fit the
    narrowest of `dtypes` (float8_e4m3fn from about 200,000 terms)."""
    largest = min(float(jnp.finfo(d).max) for d in dtypes)
    needed = 2.0 ** int(np.ceil(np.log2(max(count / largest, 1.0))))
    return max(static_pow2(float(np.sqrt(max(count, 1)))), needed)


def shifted_exp_group(
    jaxpr: Any, index: int, producers: dict[Any, Any], uses: collections.Counter[Any]
) -> Group | None:
    """The group starting at equation `index` when it is `x - m` read only by the `exp`
    after it (a softmax's shift), through the sum of that `exp` and the quotient when they
    follow; None otherwise."""
    eqns = jaxpr.eqns
    shift = eqns[index]
    if shift.primitive is not lax.sub_p or index + 1 >= len(eqns):
        return None
    exp = eqns[index + 1]
    shifted = shift.outvars[0]
    if exp.primitive is not lax.exp_p or exp.invars[0] is not shifted or uses[shifted] != 1:
        return None
    if any(v is shifted for v in jaxpr.outvars):
        return None
    x, m = shift.invars
    if isinstance(x, _compat.Literal) or isinstance(m, _compat.Literal):
        return None
    chain = _max_chain(x, m, producers)
    if chain is None:
        return None
    terms = exp.outvars[0]
    factors: dict[Any, float] = {terms: 1.0}
    stop = index + 2
    normalized = _sum_and_quotient(eqns, stop, terms, tuple(chain[0].params["axes"]))
    if normalized is not None:
        sums, stop = normalized
        factors.update(sums)
    outputs = _outputs(jaxpr, index, stop, uses)
    if any(v not in factors for v in outputs):
        return None
    key = ShiftedExp(x, chain, list(eqns[index:stop]), factors)
    return Group(index, stop, key, (x,), outputs)


def evaluate_shifted_exp(
    key: ShiftedExp, x: ScaledArray, outputs: Sequence[Any], observers: Sequence[Any]
) -> list[Any]:
    """The group's equations on `x`'s represented values in at least float32 (the maximum
    taken again from them), each output at the scale its bound gives, cast to its dtype."""
    compute = compute_dtype(x.dtype)
    values: dict[Any, Any] = {
        key.x: x.data.astype(compute) * jnp.asarray(x.scale, jnp.float32).astype(compute)
    }

    def read(atom: Any) -> Any:
        if isinstance(atom, _compat.Literal):
            return np.asarray(atom.val, compute)
        return values[atom]

    for eqn in (*key.chain, *key.eqns):
        if eqn.primitive is lax.convert_element_type_p:  # all in `compute`, cast at the end
            values[eqn.outvars[0]] = read(eqn.invars[0])
            continue
        operands = _compat.vary_like_plain(eqn, [read(a) for a in eqn.invars])
        with _compat.eqn_context(eqn):
            for var, out in zip(eqn.outvars, bind_equation(eqn, operands)):
                values[var] = out
    scaled: dict[Any, ScaledArray] = {}
    wanted = key.factors if observers else {v: key.factors[v] for v in outputs}
    for var, factor in wanted.items():
        if var in values:
            data = values[var] if factor == 1.0 else values[var] * np.asarray(1 / factor, compute)
            scaled[var] = ScaledArray(data.astype(var.aval.dtype), np.float32(factor))
    held = {key.x: x, **scaled}
    for eqn in key.eqns:
        if all(v in scaled for v in eqn.outvars):
            ins = [held[a] if a in held else read(a) for a in eqn.invars]
            for observer in observers:
                observer(eqn, ins, [scaled[v] for v in eqn.outvars])
    return [scaled[v] for v in outputs]


class ExpAtMostOne:
    """`groups`' key for an `exp` of a value shifted by its maximum that the shift's own
    rule computed (the shift is read elsewhere too: `log_softmax`'s)."""

    def __init__(self, eqn: Any) -> None:
        self.eqn = eqn


def exp_at_most_one_group(jaxpr: Any, index: int, producers: dict[Any, Any]) -> Group | None:
    """Equation `index` alone when it is `exp(x - m)`, `m` at least `x`'s maximum."""
    eqn = jaxpr.eqns[index]
    if eqn.primitive is not lax.exp_p:
        return None
    shift = producers.get(eqn.invars[0])
    if shift is None or shift.primitive is not lax.sub_p:
        return None
    x, m = shift.invars
    if isinstance(x, _compat.Literal) or isinstance(m, _compat.Literal):
        return None
    if _max_chain(x, m, producers) is None:
        return None
    return Group(index, index + 1, ExpAtMostOne(eqn), tuple(eqn.invars), tuple(eqn.outvars))


def evaluate_exp_at_most_one(
    key: ExpAtMostOne, shifted: ScaledArray, observers: Sequence[Any]
) -> list[Any]:
    """`exp` of a value at most 0, computed on the represented values in at least float32
    as the `exp` rule computes it, at the scale 1 its largest output has."""
    compute = compute_dtype(shifted.dtype)
    scale = jnp.asarray(shifted.scale, jnp.float32).astype(compute)
    value = shifted.data.astype(compute) * scale
    with _compat.eqn_context(key.eqn):
        out = ScaledArray(lax.exp(value).astype(shifted.dtype), np.float32(1.0))
    for observer in observers:
        observer(key.eqn, [shifted], [out])
    return [out]
