"""Unit-scaled `dropout`: keeps the variance (not the mean) of a unit input and gradient."""

from __future__ import annotations

import math

import jax.numpy as jnp

from ..core import prng
from ..core.types import Array
from ._fwd_bwd import multiply
from ._ops_common import require_float as _require_float
from ._ops_common import static_number as _static_number

__all__ = ["dropout"]


def dropout(x: Array, rate: float, key: Array, *, deterministic: bool = False) -> Array:
    """Unit-scaled dropout: `x * mask / sqrt(1 - rate)`, keeping each element with
    probability `1 - rate`.

    Dividing by `sqrt(1 - rate)` (not the usual `1 - rate`) keeps the variance of a
    zero-mean unit input, and of the gradient, at one; the mean is not kept.

    Args:
        x: a floating-point array.
        rate: the drop probability, a Python number in [0, 1).
        key: a `jax.random` key.
        deterministic: if True (evaluation), the identity; so is `rate == 0`.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (100_000,))
        >>> round(float(U.dropout(x, 0.5, jax.random.key(1)).std()), 1)
        1.0
    """
    rate = _static_number(rate, "rate")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}.")
    _require_float(x, "dropout's x")
    if deterministic or rate == 0.0:
        return x
    x = jnp.asarray(x)
    keep = prng.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, multiply(x, 1.0 / math.sqrt(1.0 - rate)), jnp.zeros_like(x))
