"""Separate forward and backward scale factors, and the constraints that tie them.

A unit-scaled op computes `fwd * f(x_1, ..., x_n)` in the forward pass and gives input
`x_i` the gradient `bwd_i * (df/dx_i)^T g` in the backward pass. Every factor is a
Python float computed at trace time from shapes, so it costs one multiply at run time.

`scaled_call` builds such an op from a plain function: it wraps each operand in
`scale_bwd(x_i, bwd_i / fwd)` and multiplies the result by `fwd` (a plain product,
which scales the gradient by `fwd` too, hence the ratio).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeAlias, get_args

import jax
import jax.numpy as jnp
import numpy as np

from ..core.dtypes import compute_dtype
from ..core.types import Array

_ConstraintName: TypeAlias = Literal[
    "gmean",
    "hmean",
    "amean",
    "to_output_scale",
    "to_grad_input_scale",
    "to_left_grad_scale",
    "to_right_grad_scale",
]
Constraint: TypeAlias = _ConstraintName | None
"""How an op ties its output factor to the grad factors of its activation operands.

- `None`: unconstrained, every factor as computed (unit output and unit gradients).
- `"gmean"`, `"hmean"`, `"amean"`: the output factor and the grad factors on the path all
  become their geometric, harmonic or arithmetic mean.
- `"to_output_scale"`: the grad factors on the path become the output factor.
- `"to_grad_input_scale"`: the output factor (and every grad factor on the path)
  becomes the grad factor (their geometric mean when several operands are on the path).
- `"to_left_grad_scale"`, `"to_right_grad_scale"`: for an op with two operands on the
  path (`add`, `silu_glu`, a matmul of two activations), every factor becomes the left
  (first) or right (second) operand's grad factor; a `ValueError` for any other op.

Only operands "on the path" (activations) are tied; a weight's grad factor never is.
These are the constraints of the PyTorch library `unit-scaling`, whose ops default to
`"to_output_scale"`; its `gmean` (as its `hmean` and `amean`) also averages over every
factor it is given, which for its `matmul` includes the right operand's, a weight's.

Examples:
    >>> import jax.numpy as jnp
    >>> from jax_scaled_arithmetics import unit_scaling as U
    >>> x = jnp.ones((4, 8))
    >>> U.gelu(x, constraint="to_output_scale").shape
    (4, 8)
"""

CONSTRAINTS: tuple[str, ...] = get_args(_ConstraintName)

__all__ = [
    "CONSTRAINTS",
    "Constraint",
    "apply_constraint",
    "check_constraint",
    "multiply",
    "scale_bwd",
    "scale_fwd",
    "scaled_call",
]


def check_constraint(constraint: Any) -> None:
    """Raise a ValueError naming the valid constraints unless `constraint` is one (or None)."""
    if constraint is not None and constraint not in CONSTRAINTS:
        raise ValueError(
            f"Unknown unit-scaling constraint {constraint!r}; expected one of "
            f"{', '.join(repr(c) for c in CONSTRAINTS)} or None."
        )


def _gmean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _hmean(values: Sequence[float]) -> float:
    return len(values) / sum(1.0 / v for v in values)


def _amean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def apply_constraint(
    constraint: Constraint, output_scale: float, *grad_input_scales: float
) -> tuple[float, tuple[float, ...]]:
    """Tie the output factor and the grad factors of the operands on the path.

    Args:
        constraint: one of `Constraint`'s values.
        output_scale: the factor that gives a unit-variance output.
        *grad_input_scales: the factors that give unit-variance gradients, one per
            operand on the path (pass a weight's factor to no constraint).

    Returns:
        `(output_scale, grad_input_scales)` after the constraint.

    Raises:
        ValueError: for an unknown constraint, a factor that is not positive and finite,
            or `"to_left_grad_scale"`/`"to_right_grad_scale"` with other than two grad
            factors.

    Examples:
        >>> apply_constraint("gmean", 0.25, 1.0)
        (0.5, (0.5,))
        >>> apply_constraint("to_output_scale", 0.25, 1.0, 2.0)
        (0.25, (0.25, 0.25))
        >>> apply_constraint("to_right_grad_scale", 0.25, 1.0, 2.0)
        (2.0, (2.0, 2.0))
        >>> apply_constraint(None, 0.25, 1.0)
        (0.25, (1.0,))
    """
    check_constraint(constraint)
    scales = (float(output_scale), *(float(s) for s in grad_input_scales))
    if any(not (math.isfinite(s) and s > 0.0) for s in scales):
        raise ValueError(f"Scale factors must be positive and finite, got {scales}.")
    if constraint in ("to_left_grad_scale", "to_right_grad_scale") and len(scales) != 3:
        raise ValueError(
            f"Constraint {constraint!r} needs an op with two operands on the path (a left "
            f"and a right one), but this op has {len(scales) - 1}; use 'to_grad_input_scale' "
            "or another constraint (for a matmul of two activations, pass constrain_rhs=True)."
        )
    if constraint is None or not grad_input_scales:
        return scales[0], scales[1:]
    if constraint == "to_output_scale":
        tied = scales[0]
    elif constraint == "to_grad_input_scale":
        tied = _gmean(scales[1:])
    elif constraint == "to_left_grad_scale":
        tied = scales[1]
    elif constraint == "to_right_grad_scale":
        tied = scales[2]
    else:
        tied = {"gmean": _gmean, "hmean": _hmean, "amean": _amean}[constraint](scales)
    return tied, (tied,) * len(grad_input_scales)


def _is_inexact(x: Array) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def multiply(x: Array, factor: float) -> Array:
    """`x * factor` in `x`'s dtype; integer and boolean arrays are returned unchanged.

    The factor is cast to `x`'s dtype, unless that cast would overflow or underflow it
    (e.g. a factor of 2^20 for float16): then the product is formed in float32.
    """
    if not _is_inexact(x) or factor == 1.0:
        return x
    x = jnp.asarray(x)
    dtype = x.dtype
    info = jnp.finfo(dtype)
    if float(info.tiny) <= abs(factor) <= float(info.max):
        return x * jnp.asarray(factor, dtype)
    compute = compute_dtype(dtype)
    return (x.astype(compute) * jnp.asarray(factor, compute)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scale_fwd(x: Array, factor: float) -> Array:
    return multiply(x, factor)


def _scale_fwd_fwd(x: Array, factor: float) -> tuple[Array, None]:
    return multiply(x, factor), None


def _scale_fwd_bwd(factor: float, res: None, g: Array) -> tuple[Array]:
    del factor, res
    return (g,)


_scale_fwd.defvjp(_scale_fwd_fwd, _scale_fwd_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scale_bwd(x: Array, factor: float) -> Array:
    del factor
    return x


def _scale_bwd_fwd(x: Array, factor: float) -> tuple[Array, None]:
    del factor
    return x, None


def _scale_bwd_bwd(factor: float, res: None, g: Array) -> tuple[Array]:
    del res
    return (multiply(g, factor),)


_scale_bwd.defvjp(_scale_bwd_fwd, _scale_bwd_bwd)


def _check_factor(factor: Any) -> float:
    if isinstance(factor, bool) or not isinstance(factor, (int, float, np.integer, np.floating)):
        raise TypeError(
            f"A scale factor must be a Python number known at trace time, got {type(factor)}."
        )
    return float(factor)


def _scaled(scale: Callable[[Array, float], Array], x: Array, factor: Any) -> Array:
    """`scale(x, factor)` for a floating `x`; `x` itself when it is not one or `factor` is 1."""
    factor = _check_factor(factor)
    if not _is_inexact(x) or factor == 1.0:
        return x
    return scale(jnp.asarray(x), factor)


def scale_fwd(x: Array, factor: float) -> Array:
    """Multiply `x` by `factor` in the forward pass; the gradient passes unscaled.

    Args:
        x: any array; integer and boolean arrays are returned unchanged.
        factor: a Python float (static).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> scale_fwd(jnp.array([1.0, 2.0]), 0.5)
        Array([0.5, 1. ], dtype=float32)
        >>> jax.grad(lambda x: scale_fwd(x, 0.5).sum())(jnp.array([1.0, 2.0]))
        Array([1., 1.], dtype=float32)
    """
    return _scaled(_scale_fwd, x, factor)


def scale_bwd(x: Array, factor: float) -> Array:
    """Identity in the forward pass; the gradient is multiplied by `factor` (the mirror of
    :func:`scale_fwd`, same arguments).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> y, pullback = jax.vjp(lambda x: scale_bwd(x, 0.5), jnp.array([1.0, 2.0]))
        >>> y, pullback(jnp.ones(2))[0]
        (Array([1., 2.], dtype=float32), Array([0.5, 0.5], dtype=float32))
    """
    return _scaled(_scale_bwd, x, factor)


def scaled_call(
    f: Callable[..., Array],
    output_scale: float,
    operands: Sequence[Array],
    grad_scales: Sequence[float],
) -> Array:
    """`output_scale * f(*operands)`, where operand i's gradient is `grad_scales[i] * f_i'^T g`.

    Operands that `f` should see unchanged (masks, labels) belong in a closure of `f`.
    """
    if len(operands) != len(grad_scales):
        raise ValueError(f"{len(operands)} operands but {len(grad_scales)} grad scales.")
    scaled = [scale_bwd(x, s / output_scale) for x, s in zip(operands, grad_scales)]
    return multiply(f(*scaled), output_scale)
