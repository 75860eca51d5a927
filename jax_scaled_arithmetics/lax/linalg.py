"""Scaled rules for dot_general and convolutions (unit-scaling rule: scale * sqrt(fan-in))."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import registry
from ..core.datatype import ScaledArray
from ..core.pow2 import static_pow2


def fan_in_factor(fan_in: int) -> float:
    """sqrt(fan_in) rounded to a power of two (a static Python float)."""
    return static_pow2(float(np.sqrt(max(fan_in, 1))))


def _accumulator_dtype(dtype: Any, preferred: Any) -> Any:
    if preferred is not None:
        return preferred
    if jnp.dtype(dtype).itemsize < 4 and jnp.issubdtype(dtype, jnp.floating):
        return jnp.float32
    return None


@registry.register_scaled_op(
    lax.dot_general_p, family="dot", remark="scale sa * sb * sqrt(K), any dimension numbers"
)
def scaled_dot_general(lhs: ScaledArray, rhs: ScaledArray, **params: Any) -> ScaledArray:
    (lhs_contract, _), _ = params["dimension_numbers"]
    fan_in = int(np.prod([lhs.shape[d] for d in lhs_contract], dtype=np.int64))
    factor = fan_in_factor(fan_in)
    out_dtype = params.get("preferred_element_type") or jnp.result_type(lhs.dtype, rhs.dtype)
    bind_params = dict(params)
    bind_params["preferred_element_type"] = _accumulator_dtype(
        out_dtype, params.get("preferred_element_type")
    )
    out = lax.dot_general_p.bind(lhs.data, rhs.data, **bind_params)
    acc = out.dtype
    out = (out * jnp.asarray(1.0 / factor, acc)).astype(out_dtype)
    scale = jnp.asarray(lhs.scale, jnp.float32) * jnp.asarray(rhs.scale, jnp.float32) * factor
    return ScaledArray(out, scale)
