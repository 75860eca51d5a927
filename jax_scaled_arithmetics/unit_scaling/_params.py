"""`parameter_specs`: what each parameter of a model is (a hidden weight, an embedding, the
readout, a bias, a normalisation gain), read from the program, for the u-muP optimiser
rules of `U.optim`."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..core.rewrite import MATMULS, sub_jaxprs

__all__ = ["parameter_specs"]

# Ops that pass a parameter on unchanged in value (its uses are its outputs' uses).
_PASS = {"transpose", "reshape", "convert_element_type", "squeeze", "expand_dims", "copy"}


def _inner_invars(eqn: Any, position: int) -> list[tuple[Any, Any]]:
    """(sub-jaxpr, its invar) that operand `position` of a higher-order eqn becomes."""
    found = []
    for inner in sub_jaxprs(eqn):
        offset = len(eqn.invars) - len(inner.invars)  # cond: the branch index comes first
        k = position - offset
        if 0 <= k < len(inner.invars):
            found.append((inner, inner.invars[k]))
    return found


def _uses(var: Any, jaxpr: Any, in_branch: bool, branch_eqns: Callable[[Any], set[int]]) -> Any:
    """(eqn, operand position, in a residual branch) of every use of `var` in `jaxpr`,
    through value-preserving reshapes and into sub-jaxprs."""
    branch = branch_eqns(jaxpr)
    for j, eqn in enumerate(jaxpr.eqns):
        for p, atom in enumerate(eqn.invars):
            if atom is not var:
                continue
            inside = in_branch or j in branch
            name = eqn.primitive.name
            if name in _PASS:
                yield from _uses(eqn.outvars[0], jaxpr, inside, branch_eqns)
            elif name == "broadcast_in_dim":
                yield eqn, p, inside
                yield from _uses(eqn.outvars[0], jaxpr, inside, branch_eqns)
            elif sub_jaxprs(eqn) and name not in MATMULS:
                for inner, inner_var in _inner_invars(eqn, p):
                    yield from _uses(inner_var, inner, inside, branch_eqns)
            else:
                yield eqn, p, inside


def parameter_specs(
    fn: Callable[..., Any], params: Any, *args: Any, readout: str = "last", **kwargs: Any
) -> Any:
    """The u-muP type of every parameter of `fn(params, *args, **kwargs)`, read from its program.

    Each floating leaf of `params` gets a :class:`U.optim.ParamSpec`:

    - `"weight"`: an operand of a matmul or convolution (a hidden layer's kernel), with
      `fan_in` the number of its elements each output sums over;
    - `"output"`: the weight of the readout (the last matmul of the program, whose output is
      not multiplied by another weight), `fan_in` likewise;
    - `"embedding"`: any other parameter of rank 2 or more (a table read by lookups,
      `table[ids]`, a position table added), `fan_in` its width (last axis);
    - `"norm"`: a vector multiplying activations (a normalisation gain);
    - `"bias"`: a vector added to them (or any other parameter).

    `depth` is set on the parameters used inside a residual branch: the number of residual
    branches of the most frequent kind (attention or MLP, as `unit_scale` tells them apart),
    so a transformer of L blocks gets L, as the reference library's transformer stack does.
    Other leaves (integers, None) are None.

    Args:
        fn: the model or loss; `params` is its first argument.
        params: the parameter pytree.
        *args, **kwargs: example inputs (only their shapes matter).
        readout: "last" (the last matmul reading a parameter is the readout) or "none".

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> params = {"emb": jnp.ones((10, 8)), "w": jnp.ones((8, 8)), "b": jnp.zeros(8),
        ...           "head": jnp.ones((8, 10))}
        >>> def f(p, ids):
        ...     return (jax.nn.relu(p["emb"][ids] @ p["w"] + p["b"][None])) @ p["head"]
        >>> specs = U.parameter_specs(f, params, jnp.zeros(4, jnp.int32))
        >>> [(k, specs[k].kind, specs[k].fan_in) for k in ("emb", "w", "b", "head")]
        [('emb', 'embedding', 8), ('w', 'weight', 8), ('b', 'bias', None), ('head', 'output', 8)]
    """
    from . import _optim, _residual_analysis, _transform

    if readout not in ("last", "none"):
        raise ValueError(f"parameter_specs: readout must be 'last' or 'none', got {readout!r}.")
    leaves, treedef = jax.tree_util.tree_flatten(params)
    closed = jax.make_jaxpr(lambda p, a, k: fn(p, *a, **k))(params, args, kwargs)
    jaxpr = closed.jaxpr
    n_params = len(leaves)

    branch_cache: dict[int, set[int]] = {}

    def branch_eqns(inner: Any) -> set[int]:
        if id(inner) not in branch_cache:
            context = _residual_analysis.analyse(inner, "none")
            branch_cache[id(inner)] = set().union(*context.branches.values())
        return branch_cache[id(inner)]

    _, by_code, _ = _transform._resolve_replace(None)
    kinds = _residual_analysis.residual_kinds(jaxpr, by_code)
    depth = max(kinds.count("attention"), kinds.count("mlp")) if kinds else None

    uses = [
        list(_uses(var, jaxpr, False, branch_eqns)) if i < n_params else []
        for i, var in enumerate(jaxpr.invars)
    ]
    order = {id(eqn): k for k, eqn in enumerate(_program_order(jaxpr))}
    matmuls = [
        eqn for i in range(n_params) for eqn, _, _ in uses[i] if eqn.primitive.name in MATMULS
    ]
    readout_eqn = (
        max(matmuls, key=lambda e: order[id(e)]) if matmuls and readout == "last" else None
    )

    def spec(i: int, leaf: Any) -> Any:
        if not hasattr(leaf, "dtype") or not jnp.issubdtype(leaf.dtype, jnp.floating):
            return None
        shape = tuple(jnp.shape(leaf))
        found = uses[i]
        in_branch = any(inside for _, _, inside in found)
        leaf_depth = depth if in_branch else None
        for eqn, p, _ in found:
            if eqn.primitive.name in MATMULS:
                fan_in = _fan_in(eqn, p)
                kind = "output" if eqn is readout_eqn else "weight"
                return _optim.ParamSpec(kind, fan_in, leaf_depth)
        # Its rank where it is used (a stack scanned over loses its leading axis), counting
        # the axes longer than 1 (a gain reshaped to (1, width) is a vector).
        used_rank = min(
            (sum(n > 1 for n in eqn.invars[p].aval.shape) for eqn, p, _ in found),
            default=len(shape),
        )
        if used_rank >= 2:  # read by lookups or added: an input embedding
            return _optim.ParamSpec("embedding", shape[-1], leaf_depth)
        if any(eqn.primitive.name == "mul" for eqn, _, _ in found):
            return _optim.ParamSpec("norm", None, leaf_depth)
        return _optim.ParamSpec("bias", None, leaf_depth)

    return jax.tree_util.tree_unflatten(treedef, [spec(i, leaf) for i, leaf in enumerate(leaves)])


def _program_order(jaxpr: Any) -> list[Any]:
    """Every equation of `jaxpr` and of its sub-jaxprs, in program order."""
    found = []
    for eqn in jaxpr.eqns:
        for inner in sub_jaxprs(eqn):
            found.extend(_program_order(inner))
        found.append(eqn)
    return found


def _fan_in(eqn: Any, position: int) -> int:
    """How many elements of operand `position` each output element of a matmul sums over."""
    shape = eqn.invars[position].aval.shape
    if eqn.primitive.name == "dot_general":
        contracting, _ = eqn.params["dimension_numbers"]
        return math.prod(shape[d] for d in contracting[position])
    _, rhs_spec, _ = eqn.params["dimension_numbers"]
    kernel = eqn.invars[1].aval.shape
    return math.prod(kernel[d] for d in rhs_spec[2:]) * kernel[rhs_spec[1]]
