"""Layer and RMS normalisation (`layer_norm`, `rms_norm`): the output is unit already;
only the gradients of the weight and bias (sums over rows) are scaled.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.dtypes import compute_dtype
from ..core.types import Array
from ._fwd_bwd import scale_bwd
from ._ops_common import broadcast_vector as _broadcast_vector
from ._ops_common import int_tuple as _int_tuple
from ._ops_common import inv_sqrt as _inv_sqrt
from ._ops_common import normalize_dims as _dims
from ._ops_common import require_float as _require_float
from ._ops_common import shape_of as _shape
from ._ops_common import size as _size

__all__ = ["layer_norm", "rms_norm"]


def _norm_axes(x: Array, axis: int | Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted(_dims(_int_tuple(axis), np.ndim(x), "x")))


def _normalize(
    x: Array,
    axes: tuple[int, ...],
    eps: float,
    center: bool,
    weight: Array | None,
    bias: Array | None,
) -> Array:
    """(x - mean) / sqrt(var + eps) * weight + bias over `axes`, in at least float32."""
    x = jnp.asarray(x)
    shape = x.shape
    compute = compute_dtype(x.dtype)
    y = x.astype(compute)
    if center:
        y = y - jnp.mean(y, axis=axes, keepdims=True)
    y = y * lax.rsqrt(jnp.mean(y * y, axis=axes, keepdims=True) + jnp.asarray(eps, compute))
    if weight is not None:
        y = y * _broadcast_vector(weight, shape, axes).astype(compute)
    if bias is not None:
        y = y + _broadcast_vector(bias, shape, axes).astype(compute)
    return y.astype(x.dtype)


def _norm_params(
    x: Array, params: dict[str, Array | None], axes: tuple[int, ...]
) -> dict[str, Array | None]:
    """Check each parameter's shape; scale its gradient (a sum over rows) to unit."""
    _require_float(x, "x")
    shape = _shape(x)
    norm_shape = tuple(shape[a] for a in axes)
    rows = _size(shape) // max(_size(norm_shape), 1)
    out: dict[str, Array | None] = {}
    for name, p in params.items():
        if p is not None and _shape(p) != norm_shape:
            raise ValueError(f"{name} must have shape {norm_shape}, got {_shape(p)}.")
        out[name] = None if p is None else scale_bwd(p, _inv_sqrt(rows))
    return out


def layer_norm(
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    eps: float = 1e-5,
    axis: int | Sequence[int] = -1,
) -> Array:
    """Layer normalisation over `axis`; the output is already unit.

    The `weight` and `bias` gradients (sums over rows = `x.size / normalised size`) are
    scaled by 1/sqrt(rows). The `x` gradient is the true one: for unit x and g its std is
    sqrt(1 - 2/n) ~ 1 (n the normalised size; measured 1.00 for n = 4096).

    Args:
        x: computed in at least float32, returned in its dtype.
        weight, bias: optional, of the shape of the normalised axes.
        eps: added to the variance.
        axis: an axis or axes to normalise over.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = 3.0 + 2.0 * jax.random.normal(jax.random.key(0), (64, 256))
        >>> round(float(U.layer_norm(x, jnp.ones(256), jnp.zeros(256)).std()), 2)
        1.0
    """
    axes = _norm_axes(x, axis)
    p = _norm_params(x, {"weight": weight, "bias": bias}, axes)
    return _normalize(x, axes, eps, True, p["weight"], p["bias"])


def rms_norm(
    x: Array,
    weight: Array | None = None,
    *,
    eps: float = 1e-6,
    axis: int | Sequence[int] = -1,
) -> Array:
    """RMS normalisation over `axis`; the output is already unit.

    The `weight` gradient is scaled by 1/sqrt(rows); the `x` gradient is the true one
    (std sqrt(1 - 1/n) ~ 1 for unit x and g; measured 1.00 for n = 4096).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = 5.0 * jax.random.normal(jax.random.key(0), (64, 256))
        >>> round(float(U.rms_norm(x, jnp.ones(256)).std()), 2)
        1.0
    """
    axes = _norm_axes(x, axis)
    p = _norm_params(x, {"weight": weight}, axes)
    return _normalize(x, axes, eps, False, p["weight"], None)
