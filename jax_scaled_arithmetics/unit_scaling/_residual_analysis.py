"""The analysis behind `unit_scale`: what one jaxpr holds, and the `tau` of each branch.

`analyse` finds the residual adds by dependency analysis (an `add` one of whose operands
is computed from the other, with a matmul on the way), the branch each leaves the skip
connection by, the variables computed by arithmetic (activations, as opposed to the
parameters and their reshapes), the unconstrained tail after the final residual add and,
in it, the chain into the loss and the readout matmul. `residual_kinds` tells attention
branches from MLP ones, `residual_tau` gives each branch its `tau` by `unit_scale`'s rule
(`TAU_RULES` or a function) and `tau_weights` the weights `a`, `b` of branch and skip.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax.numpy as jnp

from ..core import _compat
from ..core.rewrite import MATMULS as _MATMULS
from ..core.rewrite import multiplies_matrices as _multiplies_matrices
from ..core.rewrite import sub_jaxprs as _sub_jaxprs

__all__ = ["TAU_RULES", "Context", "analyse", "residual_kinds", "residual_tau", "tau_weights"]


@dataclasses.dataclass
class Context:
    """What the analysis of one jaxpr found, and where it sits in the program."""

    jaxpr: Any
    residual: dict[int, int]  # eqn index -> position of the skip operand
    branch_reads: dict[tuple[int, int], list[int]]  # (eqn, operand) -> residual adds
    computed: set[Any]  # variables computed by arithmetic (not only reshaped inputs)
    tail: set[int]  # eqns in the unconstrained tail
    output_chain: set[int]  # tail eqns every path to the output goes through (a loss's mean)
    child_mode: dict[int, str]  # eqn index -> mode of its sub-jaxprs
    mode: str  # "search" | "tail" | "none"
    branches: dict[int, frozenset[int]]  # residual add -> the eqns of its branch
    readout: int | None  # the first matmul of the tail (the logits' projection)
    producer: dict[Any, int]  # variable -> index of the eqn computing it


_SHAPE_ONLY = {
    "transpose",
    "reshape",
    "broadcast_in_dim",
    "convert_element_type",
    "squeeze",
    "expand_dims",
    "copy",
    "slice",
    "dynamic_slice",
    "gather",
    "rev",
}


def _is_residual_candidate(eqn: Any) -> bool:
    if eqn.primitive.name != "add" or len(eqn.invars) != 2:
        return False
    a, b = eqn.invars
    if isinstance(a, _compat.Literal) or isinstance(b, _compat.Literal):
        return False
    aval = eqn.outvars[0].aval
    return (
        len(aval.shape) >= 1
        and jnp.issubdtype(aval.dtype, jnp.floating)
        and tuple(a.aval.shape) == tuple(b.aval.shape) == tuple(aval.shape)
    )


@functools.lru_cache(maxsize=256)
def _has_residual(jaxpr: Any) -> bool:
    return bool(analyse(jaxpr, "none").residual) or any(
        _has_residual(inner) for eqn in jaxpr.eqns for inner in _sub_jaxprs(eqn)
    )


def analyse(jaxpr: Any, mode: str) -> Context:
    n = len(jaxpr.eqns)
    node: dict[Any, int] = {}  # var -> node id (invars: n + position)
    for i, var in enumerate(jaxpr.invars):
        node[var] = n + i
    ancestors: dict[int, int] = {}  # node -> bitmask of ancestor nodes (itself excluded)

    def anc_of(var: Any) -> int:
        if isinstance(var, _compat.Literal) or var not in node:
            return 0
        k = node[var]
        return ancestors.get(k, 0) | (1 << k)

    computed_vars: set[Any] = set()
    for j, eqn in enumerate(jaxpr.eqns):
        mask = 0
        for a in eqn.invars:
            mask |= anc_of(a)
        ancestors[j] = mask
        for v in eqn.outvars:
            if not _compat.is_drop_var(v):
                node[v] = j
        if eqn.primitive.name not in _SHAPE_ONLY or any(
            not isinstance(a, _compat.Literal) and a in computed_vars for a in eqn.invars
        ):
            computed_vars.update(v for v in eqn.outvars if not _compat.is_drop_var(v))

    residual: dict[int, int] = {}
    branches: dict[int, frozenset[int]] = {}
    branch_reads: dict[tuple[int, int], list[int]] = {}
    for k, eqn in enumerate(jaxpr.eqns):
        if not _is_residual_candidate(eqn):
            continue
        a, b = eqn.invars
        if a not in node or b not in node:
            continue
        if anc_of(b) >> node[a] & 1:
            skip_pos = 0
        elif anc_of(a) >> node[b] & 1:
            skip_pos = 1
        else:
            continue
        skip, branch = eqn.invars[skip_pos], eqn.invars[1 - skip_pos]
        branch_mask = anc_of(branch)
        skip_bit = 1 << node[skip]
        in_branch = [
            j
            for j in range(k)
            if branch_mask >> j & 1 and (ancestors[j] & skip_bit or j == node[skip])
        ]
        if not any(_multiplies_matrices(jaxpr.eqns[j]) for j in in_branch if j != node[skip]):
            continue  # x + f(x) without a matmul in f (inside a GELU, say): not a residual
        residual[k] = skip_pos
        branches[k] = frozenset(j for j in in_branch if j != node[skip])
        for j in range(k):
            if not (branch_mask >> j & 1):
                continue
            for p, atom in enumerate(jaxpr.eqns[j].invars):
                if atom is skip:
                    branch_reads.setdefault((j, p), []).append(k)

    tail: set[int] = set()
    child_mode: dict[int, str] = {}
    if mode == "tail":
        tail = set(range(n))
        child_mode = {j: "tail" for j in range(n)}
    elif mode == "search":
        last = None
        for j, eqn in enumerate(jaxpr.eqns):
            if j in residual or any(_has_residual(inner) for inner in _sub_jaxprs(eqn)):
                last = j
        readout = False
        if last is None:  # no residual add: the tail starts at the last matmul (the readout)
            for j, eqn in enumerate(jaxpr.eqns):
                if _multiplies_matrices(eqn):
                    last = j
            readout = last is not None and jaxpr.eqns[last].primitive.name in _MATMULS
        if last is not None:
            if readout:
                tail.add(last)
            for j in range(last + 1, n):
                if ancestors[j] >> last & 1:
                    tail.add(j)
                    child_mode[j] = "tail"
            if last not in residual and not readout:
                child_mode[last] = "search"
    output_chain = _output_chain(jaxpr) & tail if mode != "none" else set()
    readout_eqn = None
    if mode == "search":
        readout_eqn = next(
            (j for j in sorted(tail) if jaxpr.eqns[j].primitive.name == "dot_general"), None
        )
    return Context(
        jaxpr,
        residual,
        branch_reads,
        computed_vars,
        tail,
        output_chain,
        child_mode,
        mode,
        branches,
        readout_eqn,
        {v: j for v, j in node.items() if j < n},
    )


_CHAIN = {"mul", "div", "neg", "reduce_sum", "reshape", "squeeze", "convert_element_type", "copy"}


def _output_chain(jaxpr: Any) -> set[int]:
    """Equations on the single path into a loss: walking back from each output through
    one-operand reductions, reshapes and multiplications by literal constants (the `sum / N`
    of a mean loss). A constant there scales every gradient by the same factor. A loss is a
    scalar output, or one computed through a sum (one loss per example: `jax.vmap(loss)`)."""
    producer = {
        v: j for j, e in enumerate(jaxpr.eqns) for v in e.outvars if not _compat.is_drop_var(v)
    }
    readers: dict[Any, int] = {}
    for e in jaxpr.eqns:
        for a in e.invars:
            if not isinstance(a, _compat.Literal):
                readers[a] = readers.get(a, 0) + 1
    chain: set[int] = set()
    for out in jaxpr.outvars:
        if isinstance(out, _compat.Literal):
            continue
        var = out
        path: list[int] = []
        while var in producer and readers.get(var, 0) <= 1:
            j = producer[var]
            eqn = jaxpr.eqns[j]
            operands = [a for a in eqn.invars if not isinstance(a, _compat.Literal)]
            if eqn.primitive.name not in _CHAIN or len(operands) != 1:
                break
            path.append(j)
            var = operands[0]
        if out.aval.shape == () or any(jaxpr.eqns[j].primitive.name == "reduce_sum" for j in path):
            chain.update(path)
    return chain


def _running_mean_tau(depth: int) -> float:
    """tau of the `depth`-th residual add (from 1) so that the embedding and every branch
    contribute equally to the residual stream: a^2 = 1/(depth+1)."""
    return 1.0 / math.sqrt(depth)


TAU_RULES = ("running_mean", "umup", "reference")


def residual_tau(rule: Any, index: int, kinds: tuple[str, ...]) -> float:
    """tau of residual branch `index` (from 0) of the branches `kinds`, by `rule`."""
    if rule == "running_mean":
        return _running_mean_tau(index + 1)
    if isinstance(rule, (int, float)):
        return float(rule)
    if rule == "umup":  # u-muP: the embedding weighs as much as half the branches
        return 1.0 / math.sqrt(len(kinds) / 2 + index)
    if rule == "reference":
        return 0.01 if kinds[index] == "attention" else 0.5
    tau = rule(index, kinds)
    if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
        raise ValueError(f"unit_scale: tau({index}, ...) gave {tau!r}; it must be positive.")
    return float(tau)


def _is_attention_eqn(eqn: Any, softmax_code: Any) -> bool:
    name = str(eqn.params.get("name", "")) + eqn.primitive.name
    if "attention" in name:
        return True
    if softmax_code is not None and any(c is softmax_code for c, _ in _compat.eqn_code_frames(eqn)):
        return True
    return any(_is_attention_eqn(e, softmax_code) for inner in _sub_jaxprs(eqn) for e in inner.eqns)


def residual_kinds(jaxpr: Any, by_code: dict[Any, str]) -> list[str]:
    """ "attention" or "mlp" for every residual add of the program, in program order (a branch
    is attention when it calls a softmax or an attention function; a scan body's, once per
    iteration)."""
    softmax_code = next((c for c, k in by_code.items() if k == "softmax"), None)
    context = analyse(jaxpr, "none")
    kinds: list[str] = []
    for j, eqn in enumerate(jaxpr.eqns):
        # A scan's body runs `length` times: a scanned stack of L layers has L of each.
        repeat = int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else 1
        for inner in _sub_jaxprs(eqn):
            kinds.extend(residual_kinds(inner, by_code) * repeat)
        if j in context.residual:
            attention = any(
                _is_attention_eqn(jaxpr.eqns[i], softmax_code) for i in context.branches[j]
            )
            kinds.append("attention" if attention else "mlp")
    return kinds


def tau_weights(tau: float) -> tuple[float, float]:
    norm = math.sqrt(1.0 + tau * tau)
    return tau / norm, 1.0 / norm
