"""Scaled rules for exponentials, logarithms and the other non-linear functions."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import registry
from ..core.datatype import ScaledArray
from .base import (
    compute_dtype,
    register_unscaled_unary,
    unscaled_value,
)

_LOG2_E = float(np.log2(np.e))


@registry.register_scaled_op(lax.exp_p, family="exp", remark="dynamic scale exp(max x)")
def scaled_exp(x: ScaledArray, **params: Any) -> ScaledArray:
    """exp(v) = exp(v - k ln 2) * 2^k, with k from the largest input: no overflow in the data."""
    cdtype = compute_dtype(x.dtype)
    value = unscaled_value(x, cdtype)
    vmax = lax.stop_gradient(jnp.max(value)) if value.size else jnp.zeros((), cdtype)
    k = jnp.floor(vmax * _LOG2_E)
    k = jnp.where(jnp.isfinite(k), jnp.clip(k, -125, 126), 0).astype(cdtype)
    data = lax.exp_p.bind(value - k / _LOG2_E, **params)
    scale = lax.stop_gradient(jnp.exp2(k).astype(jnp.float32))
    return ScaledArray(data.astype(x.dtype), scale)


@registry.register_scaled_op(lax.log_p, family="log", remark="log(data) + log(scale), scale 1")
def scaled_log(x: ScaledArray, **params: Any) -> ScaledArray:
    """log(data * scale) = log(data) + log(scale): no underflow of a tiny value."""
    cdtype = compute_dtype(x.dtype)
    log_data = lax.log_p.bind(x.data.astype(cdtype), **params)
    log_scale = jnp.log(jnp.asarray(x.scale).astype(cdtype))
    # log(0 * scale) is -inf whatever the data; keep log(negative) NaN.
    out = jnp.where(jnp.asarray(x.scale) == 0, -jnp.inf, log_data + log_scale)
    return ScaledArray(out.astype(x.dtype), np.asarray(1.0, np.float32))


_BOUNDED = (
    lax.tanh_p,
    lax.logistic_p,
    lax.erf_p,
    lax.erfc_p,
    lax.sin_p,
    lax.cos_p,
    lax.atan_p,
    lax.asin_p,
    lax.acos_p,
    lax.atan2_p,
)
for _prim in _BOUNDED:
    register_unscaled_unary(_prim, output_scale="one", remark="bounded output, scale 1")

for _prim, _remark in (
    (lax.pow_p, "unscaled, dynamic output scale"),
):
    register_unscaled_unary(_prim, output_scale="dynamic", remark=_remark)
