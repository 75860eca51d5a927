"""Unit-scaled `softmax`.

Factors by a fixed-seed numpy Monte Carlo over x, exact expectations over g
(`softmax_moments`, cached by length and `mult`; large-n limits in closed form). The
cross-entropy's gradient factor uses the same moments. Conventions shared by all ops in
`_ops_common`.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np

from ..core.types import Array
from ._fwd_bwd import Constraint, apply_constraint, multiply, scaled_call
from ._ops_common import SEED as _SEED
from ._ops_common import inv_std as _inv_std
from ._ops_common import positive_number as _positive_number
from ._ops_common import shape_of as _shape

__all__ = ["softmax", "softmax_moments"]


_SOFTMAX_SAMPLES = 1 << 20  # elements drawn per estimate
_SOFTMAX_CHUNK = 1 << 22  # elements drawn at once
_SOFTMAX_ASYMPTOTIC = 1 << 16  # above this length times e^(mult^2), the large-n limits


@functools.cache
def softmax_moments(n: int, mult: float = 1.0) -> tuple[float, float, float]:
    """`(var p, var dx, E[sum p^2])` of `p = softmax(mult x)` over n unit-normal elements.

    `dx = mult p * (g - <p, g>)` for a unit-normal `g`:
    `E_g[dx_i^2] = mult^2 p_i^2 (1 - 2 p_i + S)`, `S = sum p^2`, averaged over x by Monte
    Carlo. For large n (n e^(-mult^2) > 2^16), with `p_i ~ exp(mult x_i) / (n e^(mult^2/2))`:
    `n^2 var p -> e^(m^2) - 1`, `E[S] -> e^(m^2) / n` and
    `n^2 var dx -> m^2 e^(m^2) (1 + e^(m^2) / n)`, m = mult.
    """
    if n <= 1:
        return 0.0, 0.0, float(n)
    m2 = mult * mult
    if m2 < math.log(n / _SOFTMAX_ASYMPTOTIC):  # n > 2^16 e^(m^2), without overflow
        spread = math.exp(m2)
        return (spread - 1.0) / n**2, m2 * spread * (1.0 + spread / n) / n**2, spread / n
    rows = max(16, -(-_SOFTMAX_SAMPLES // n))
    chunk = max(1, _SOFTMAX_CHUNK // n)
    rng = np.random.default_rng(_SEED)
    sum_p2 = sum_dx = sum_s = 0.0
    for start in range(0, rows, chunk):
        x = mult * rng.standard_normal((min(chunk, rows - start), n))
        p = np.exp(x - x.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        s = (p * p).sum(axis=-1, keepdims=True)
        sum_p2 += float(np.sum(p * p))
        sum_dx += float(np.sum(p * p * (1.0 - 2.0 * p + s)))
        sum_s += float(np.sum(s))
    var_p = sum_p2 / (rows * n) - 1.0 / n**2
    return var_p, m2 * sum_dx / (rows * n), sum_s / rows


def softmax(
    x: Array, axis: int = -1, *, mult: float = 1.0, constraint: Constraint = "to_output_scale"
) -> Array:
    """Unit-scaled `jax.nn.softmax(mult * x)` over `axis` (of length n).

    Factors: 1/std of the softmax and of its input gradient for unit-normal x and g,
    estimated by a fixed-seed numpy Monte Carlo cached by (n, mult) (for mult 1, about
    n/sqrt(e - 1) and n/sqrt(e) for large n). By default (`constraint="to_output_scale"`)
    the backward factor is the forward one: unit outputs, and input gradients of std
    sqrt(e/(e - 1)) = 1.26 for mult 1 and large n.

    Args:
        x: the activation (tied by `constraint`).
        axis: the axis to normalise over.
        mult: the multiplier of the input (u-muP's; an inverse temperature), a positive
            Python number.
        constraint: as for `gelu`.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (256, 512))
        >>> y = U.softmax(x, constraint=None)  # plain softmax: std about 0.0026
        >>> round(float(y.std()), 1)
        1.0
    """
    mult = _positive_number(mult, "mult")
    n = _shape(x)[axis]
    var_p, var_dx, _ = softmax_moments(n, mult)
    fwd, (bwd,) = apply_constraint(constraint, _inv_std(var_p), _inv_std(var_dx))
    f = lambda x: jax.nn.softmax(multiply(x, mult), axis=axis)
    return scaled_call(f, fwd, (x,), (bwd,))
