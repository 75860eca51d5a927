"""Unit-scaled sums: `add`, and the residual connections (`residual_split`,
`residual_add`, `residual_apply`) with u-muP's `transformer_residual_scaling_rule` for
their `tau`. Conventions shared by all ops in `_ops_common`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..core.types import Array
from ._fwd_bwd import (
    Constraint,
    apply_constraint,
    check_constraint,
    scale_bwd,
    scale_fwd,
    scaled_call,
)
from ._ops_common import inv_sqrt as _inv_sqrt
from ._ops_common import positive_number as _positive_number
from ._ops_common import require_same_shape as _require_same_shape
from ._ops_common import shape_of as _shape
from ._ops_common import size as _size
from ._ops_common import static_number as _static_number

__all__ = [
    "add",
    "residual_add",
    "residual_apply",
    "residual_split",
    "transformer_residual_scaling_rule",
]


def _is_constant(x: Any) -> bool:
    """A Python number or a 0-d array: a constant offset for `add`."""
    return isinstance(x, numbers.Number) or np.ndim(x) == 0


def add(a: Array | float, b: Array | float, *, constraint: Constraint = "to_output_scale") -> Array:
    """Unit-scaled sum `a + b` of two independent unit arrays, with broadcasting.

    Adding a constant (a Python number or a 0-d array) does not change the scale: the
    plain `a + b`, no factor in either pass (a 0-d array's gradient is then the plain sum;
    give a learnable scalar shape (1,) to unit-scale it). Otherwise the output factor is
    1/sqrt(2) (1 when one operand has a single element: an offset, which does not add
    variance), and each operand's grad factor is 1/sqrt(outputs each of its elements
    enters) (1 for an operand of the output's shape, 1/sqrt(rows) for a row vector
    broadcast over rows). Both operands are on the path: `constraint` ties all three. By
    default (`constraint="to_output_scale"`) both grad factors are the output's: a unit
    output, and gradients of std 1/sqrt(2) for two operands of the same shape.

    Args:
        a, b: arrays whose shapes broadcast together (NumPy rules), or constants.
        constraint: see `Constraint`; the default "to_output_scale" gives both grads the
            output factor; "gmean" ties the three factors to their geometric mean
            (2^(-1/6) for two operands of the same shape); None leaves each unit.
            "to_left_grad_scale"/"to_right_grad_scale" tie them to `a`'s/`b`'s.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> a = jax.random.normal(jax.random.key(0), (100_000,))
        >>> b = jax.random.normal(jax.random.key(1), (100_000,))
        >>> round(float(U.add(a, b, constraint=None).std()), 2)
        1.0
        >>> U.add(jnp.zeros(2), 1.0)
        Array([1., 1.], dtype=float32)
    """
    check_constraint(constraint)
    if _is_constant(a) or _is_constant(b):
        return jnp.add(a, b)
    a_shape, b_shape = _shape(a), _shape(b)
    try:
        out_shape = tuple(np.broadcast_shapes(a_shape, b_shape))
    except ValueError:
        raise ValueError(
            f"add's operands must broadcast together, got shapes {a_shape} and {b_shape}."
        ) from None
    sizes = _size(a_shape), _size(b_shape)
    fwd = 1.0 if 1 in sizes else 1.0 / math.sqrt(2.0)
    grads = [_inv_sqrt(_size(out_shape) / s) if s else 1.0 for s in sizes]
    fwd, tied = apply_constraint(constraint, fwd, *grads)
    f = lambda x, y: jnp.add(jnp.broadcast_to(x, out_shape), jnp.broadcast_to(y, out_shape))
    return scaled_call(f, fwd, (a, b), tied)


def _residual_coefficients(tau: float) -> tuple[float, float]:
    tau = _static_number(tau, "tau")
    if not (math.isfinite(tau) and tau >= 0.0):
        raise ValueError(f"tau must be finite and non-negative, got {tau}.")
    norm = math.sqrt(1.0 + tau * tau)
    return tau / norm, 1.0 / norm


def residual_split(x: Array, tau: float = 1.0) -> tuple[Array, Array]:
    """Split `x` into `(residual, skip)` for `residual_add`: both are `x` forward.

    Backward, the residual branch's gradient is multiplied by a = tau/sqrt(1 + tau^2) and
    the skip's by b = 1/sqrt(1 + tau^2) before they are summed: the gradient reaching `x`
    is exactly that of `a * f(x) + b * x`, of variance a^2 + b^2 = 1.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> residual, skip = U.residual_split(jnp.ones(3))
        >>> U.residual_add(residual, skip).tolist()
        [1.4142135381698608, 1.4142135381698608, 1.4142135381698608]
    """
    a, b = _residual_coefficients(tau)
    return scale_bwd(x, a), scale_bwd(x, b)


def residual_add(residual: Array, skip: Array, tau: float = 1.0) -> Array:
    """`a * residual + b * skip`, a = tau/sqrt(1 + tau^2), b = 1/sqrt(1 + tau^2).

    The output has unit variance for independent unit inputs (a^2 + b^2 = 1). `a` and `b`
    are forward-only here: both inputs receive the output gradient unscaled (unit);
    `residual_split` applies them on the way back.

    Args:
        residual: the residual branch's output, e.g. `f(residual)`.
        skip: the skip connection, same shape.
        tau: the weight of the residual branch relative to the skip.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> r = jax.random.normal(jax.random.key(0), (100_000,))
        >>> s = jax.random.normal(jax.random.key(1), (100_000,))
        >>> round(float(U.residual_add(r, s, tau=0.5).std()), 2)
        1.0
    """
    _require_same_shape(residual, skip, "residual and skip")
    a, b = _residual_coefficients(tau)
    return scale_fwd(residual, a) + scale_fwd(skip, b)


def residual_apply(fn: Callable[[Array], Array], x: Array, tau: float = 1.0) -> Array:
    """A residual layer `a * fn(x) + b * x`: `residual_split`, `fn` on the residual
    branch, `residual_add` (a = tau/sqrt(1 + tau^2), b = 1/sqrt(1 + tau^2)).

    The output and the gradient reaching `x` have unit variance when `fn` keeps unit
    scale; `fn`'s own input gradient is weighted by `a`, as its output is.

    Args:
        fn: the residual branch, a function of one array returning the same shape.
        x: the input, also the skip connection.
        tau: the weight of the residual branch relative to the skip.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (100_000,))
        >>> round(float(U.residual_apply(jnp.flip, x, tau=0.5).std()), 2)
        1.0
    """
    if not callable(fn):
        raise TypeError(f"residual_apply's fn must be callable, got {type(fn).__name__}.")
    residual, skip = residual_split(x, tau)
    return residual_add(fn(residual), skip, tau)


def transformer_residual_scaling_rule(
    residual_mult: float = 1.0, residual_attn_ratio: float = 1.0
) -> Callable[[int, int], float]:
    """u-muP's rule for the `tau` of each residual branch of a transformer (its Appendix G).

    For a stack that starts with an embedding and alternates attention (even `index`) and
    MLP (odd `index`) branches, `tau(index, layers)` (of `layers` branches in all) makes
    every attention branch contribute the same variance to the residual stream, and
    every MLP branch; all attention and MLP branches together contribute
    `residual_mult^2` times the embedding's on average, in the ratio
    `residual_attn_ratio^2` (attention to MLP). With weights
    `alpha_mlp = residual_mult * sqrt(2 / (1 + residual_attn_ratio^2))` and
    `alpha_attn = residual_attn_ratio * alpha_mlp`, the embedding counting `layers / 2`:
    `tau = alpha / sqrt(layers / 2 + n_attn alpha_attn^2 + n_mlp alpha_mlp^2)`, the sum
    over the n_attn attention and n_mlp MLP branches before this one. With both
    arguments 1, `tau = 1 / sqrt(layers / 2 + index)`, `unit_scale`'s default rule.

    Args:
        residual_mult: the residual branches' contribution relative to the embedding's.
        residual_attn_ratio: the attention branches' contribution relative to the MLP's.

    Returns:
        `tau(index, layers) -> float`, for `residual_split`/`residual_add`/`residual_apply`.

    Examples:
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> tau = U.transformer_residual_scaling_rule()
        >>> [round(tau(i, 4), 4) for i in range(4)]
        [0.7071, 0.5774, 0.5, 0.4472]
    """
    residual_mult = _positive_number(residual_mult, "residual_mult")
    residual_attn_ratio = _positive_number(residual_attn_ratio, "residual_attn_ratio")
    alpha_mlp = residual_mult * math.sqrt(2.0 / (1.0 + residual_attn_ratio**2))
    alpha_attn = residual_attn_ratio * alpha_mlp

    def tau(index: int, layers: int) -> float:
        for value, name in ((index, "index"), (layers, "layers")):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {value!r}.")
        if not 0 <= index < layers:
            raise ValueError(f"index must be in [0, layers), got index {index} of {layers}.")
        n_attn, n_mlp = (index + 1) // 2, index // 2
        seen = layers / 2.0 + n_attn * alpha_attn**2 + n_mlp * alpha_mlp**2
        return (alpha_attn if index % 2 == 0 else alpha_mlp) / math.sqrt(seen)

    return tau
