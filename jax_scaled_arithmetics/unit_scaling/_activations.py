"""Unit-scaled elementwise activations: `gelu`, `silu`, `silu_glu`.

Factors by quadrature over x ~ N(0, 1) of the function with u-muP's multiplier `mult`
(`gaussian_moments`, cached by name and `mult`). Conventions shared by all ops in
`_ops_common`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import numpy as np

from ..core.types import Array
from ._fwd_bwd import Constraint, apply_constraint, multiply, scaled_call
from ._ops_common import inv_std as _inv_std
from ._ops_common import positive_number as _positive_number
from ._ops_common import require_same_shape as _require_same_shape

__all__ = ["gaussian_moments", "gelu", "silu", "silu_glu"]


_QUAD_HALF_WIDTH = 12.0  # the N(0, 1) weight beyond is below 1e-31
_QUAD_STEPS = 2400  # steps on each side at least: a step of 1/200 ...
_QUAD_MAX_STEPS = 100_000  # ... or 1/(200 mult), down to 1.2e-4


def _quadrature(mult: float) -> tuple[np.ndarray, np.ndarray]:
    """Nodes and weights of the trapezoid rule for E[h(X)], X ~ N(0, 1), on [-12, 12].

    For integrands analytic in a strip about the real axis (those below, whose
    singularities lie at a distance of order 1/mult), the trapezoid rule converges
    exponentially in the step over that distance. The step is 1/(200 max(1, mult)), no
    finer than 1.2e-4: the moments agree with those of a grid 20 to 400 times finer to
    1e-13, for mult from 0.01 to 1000.
    """
    half = min(max(_QUAD_STEPS, math.ceil(200.0 * mult * _QUAD_HALF_WIDTH)), _QUAD_MAX_STEPS)
    nodes = np.linspace(-_QUAD_HALF_WIDTH, _QUAD_HALF_WIDTH, 2 * half + 1)
    weights = np.exp(-0.5 * nodes * nodes)
    return nodes, weights / weights.sum()


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu_np(x: np.ndarray, mult: float, approximate: bool) -> tuple[np.ndarray, np.ndarray]:
    """`gelu(mult x) / mult` and its derivative `gelu'(mult x)`."""
    y = mult * x
    if approximate:
        c = math.sqrt(2.0 / math.pi)
        t = np.tanh(c * (y + 0.044715 * y**3))
        df = 0.5 * (1.0 + t) + 0.5 * y * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * y**2)
        return 0.5 * x * (1.0 + t), df
    cdf = 0.5 * (1.0 + _erf(y / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * y * y) / math.sqrt(2.0 * math.pi)
    return x * cdf, cdf + y * pdf


def _silu_np(x: np.ndarray, mult: float) -> tuple[np.ndarray, np.ndarray]:
    """`x sigmoid(mult x)` and its derivative."""
    s = 0.5 * (1.0 + np.tanh(0.5 * mult * x))  # sigmoid, without exp overflow
    return x * s, s * (1.0 + mult * x * (1.0 - s))


_ELEMENTWISE: dict[str, Callable[[np.ndarray, float], tuple[np.ndarray, np.ndarray]]] = {
    "gelu_tanh": functools.partial(_gelu_np, approximate=True),
    "gelu": functools.partial(_gelu_np, approximate=False),
    "silu": _silu_np,
}


@functools.cache
def gaussian_moments(name: str, mult: float = 1.0) -> tuple[float, float, float]:
    """`(E[f(X)], E[f(X)^2], E[f'(X)^2])` for X ~ N(0, 1), `f` the function `name` with
    multiplier `mult` (`gelu(mult x) / mult`, `x sigmoid(mult x)`), by quadrature."""
    nodes, weights = _quadrature(mult)
    f, df = _ELEMENTWISE[name](nodes, mult)
    return float(weights @ f), float(weights @ (f * f)), float(weights @ (df * df))


def _elementwise_factors(name: str, mult: float = 1.0) -> tuple[float, float]:
    """1/std(f(X)) and 1/std(g f'(X)) (= 1/sqrt(E[f'(X)^2]) for g independent of X)."""
    mean, second, grad_second = gaussian_moments(name, float(mult))
    return _inv_std(second - mean * mean), _inv_std(grad_second)


def _elementwise(
    f: Callable[[Array], Array], x: Array, name: str, mult: float, constraint: Constraint
) -> Array:
    fwd, bwd = _elementwise_factors(name, mult)
    fwd, (bwd,) = apply_constraint(constraint, fwd, bwd)
    return scaled_call(f, fwd, (x,), (bwd,))


def _silu_mult(x: Array, mult: float) -> Array:
    """`x * sigmoid(mult * x)` (`jax.nn.silu` for mult 1)."""
    if mult == 1.0:
        return jax.nn.silu(x)
    return x * jax.nn.sigmoid(multiply(x, mult))


def gelu(
    x: Array,
    approximate: bool = True,
    *,
    mult: float = 1.0,
    constraint: Constraint = "to_output_scale",
) -> Array:
    """Unit-scaled `jax.nn.gelu(mult * x) / mult`.

    Factors: 1/std(f(X)) forward and 1/sqrt(E[f'(X)^2]) backward, X ~ N(0, 1), for
    f(x) = gelu(mult x) / mult (f'(x) = gelu'(mult x)), by quadrature: about 1.70 and
    1.48 for mult 1 (either form). A large `mult` makes f a sharper ReLU, a small one
    closer to x / 2. By default (`constraint="to_output_scale"`) the backward factor is
    the forward one: unit outputs, and input gradients of std 1.70/1.48 = 1.15 for mult 1.

    Args:
        x: the activation (tied by `constraint`).
        approximate: the tanh approximation (default, as `jax.nn.gelu`) or the erf form.
        mult: the multiplier of the input (u-muP's), a positive Python number.
        constraint: see `Constraint`; the default "to_output_scale" gives the input
            gradient the output factor; "gmean" ties both to their geometric mean; None
            leaves both unit.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (100_000,))
        >>> round(float(U.gelu(x, constraint=None).std()), 2)
        1.0
    """
    mult = _positive_number(mult, "mult")
    name = "gelu_tanh" if approximate else "gelu"

    def f(x: Array) -> Array:
        if mult == 1.0:
            return jax.nn.gelu(x, approximate=approximate)
        return multiply(jax.nn.gelu(multiply(x, mult), approximate=approximate), 1.0 / mult)

    return _elementwise(f, x, name, mult, constraint)


def silu(x: Array, *, mult: float = 1.0, constraint: Constraint = "to_output_scale") -> Array:
    """Unit-scaled SiLU (swish) `x * sigmoid(mult * x)` (`jax.nn.silu` for mult 1).

    Factors 1/std(f(X)) and 1/sqrt(E[f'(X)^2]) for f(x) = x sigmoid(mult x), by
    quadrature: about 1.79 and 1.62 for mult 1. `mult` and `constraint` as for `gelu`: by
    default (`constraint="to_output_scale"`) the backward factor is the forward one (unit
    outputs, input gradients of std 1.10 for mult 1).

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (100_000,))
        >>> round(float(U.silu(x, mult=2.0, constraint=None).std()), 2)  # for any `mult`
        1.0
    """
    mult = _positive_number(mult, "mult")
    return _elementwise(lambda x: _silu_mult(x, mult), x, "silu", mult, constraint)


def silu_glu(
    x: Array, gate: Array, *, mult: float = 1.0, constraint: Constraint = "to_output_scale"
) -> Array:
    """Unit-scaled gated linear unit `x * gate * sigmoid(mult * gate)` (SwiGLU).

    For independent unit `x` and `gate`: output and `x` grad variance E[f(G)^2],
    `gate` grad variance E[f'(G)^2], f(g) = g sigmoid(mult g) (quadrature); the factors
    are one over their square roots. By default (`constraint="to_output_scale"`) both
    grad factors are the output's: unit outputs and `x` gradients, `gate` gradients of
    std 1.03 for mult 1.

    Args:
        x: the value branch (on the path, tied by `constraint`).
        gate: the gate branch (on the path, tied by `constraint`), same shape as `x`.
        mult: the multiplier inside the gate's sigmoid (u-muP's), a positive number.
        constraint: see `Constraint`; the default "to_output_scale" gives both grads the
            output factor; "gmean" ties all three factors to their geometric mean (the
            reference library's `silu_glu` uses one factor for all three, an empirical
            fit of the gate's).

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (100_000,))
        >>> g = jax.random.normal(jax.random.key(1), (100_000,))
        >>> round(float(U.silu_glu(x, g).std()), 1)
        1.0
    """
    _require_same_shape(x, gate, "x and gate")
    mult = _positive_number(mult, "mult")
    _, second, grad_second = gaussian_moments("silu", mult)
    fwd, (x_bwd, gate_bwd) = apply_constraint(
        constraint, _inv_std(second), _inv_std(second), _inv_std(grad_second)
    )
    return scaled_call(lambda a, b: a * _silu_mult(b, mult), fwd, (x, gate), (x_bwd, gate_bwd))
