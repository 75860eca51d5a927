"""Scaled rules for reductions."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import registry
from ..core.datatype import ScaledArray
from .base import compute_dtype, register_linear, register_unscaled_output
from .linalg import fan_in_factor


@registry.register_scaled_op(lax.reduce_sum_p, family="reduce", remark="scale * sqrt(N)")
def scaled_reduce_sum(x: ScaledArray, *, axes: Any, **params: Any) -> ScaledArray:
    count = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    factor = fan_in_factor(count)
    cdtype = compute_dtype(x.dtype)
    out = lax.reduce_sum_p.bind(x.data.astype(cdtype), axes=axes, **params)
    out = (out * jnp.asarray(1.0 / factor, cdtype)).astype(x.dtype)
    return ScaledArray(out, jnp.asarray(x.scale, jnp.float32) * factor)


register_linear(lax.reduce_max_p, remark="scale kept")
register_linear(lax.reduce_min_p, remark="scale kept")
register_unscaled_output(lax.argmax_p)
register_unscaled_output(lax.argmin_p)
