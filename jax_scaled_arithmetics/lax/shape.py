"""Scaled rules for shape, layout and type operations: they act on data only."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

from ..core import registry
from ..core.datatype import ScaledArray
from ..core._compat import primitives
from .base import compute_dtype, register_common_scale, register_linear

for _prim in (
    lax.broadcast_in_dim_p,
    lax.reshape_p,
    lax.squeeze_p,
    lax.transpose_p,
    lax.rev_p,
    lax.slice_p,
    lax.copy_p,
    primitives.copy_p,
):
    if not registry.has_scaled_rule(_prim):
        register_linear(_prim)

register_common_scale(lax.concatenate_p, remark="operands at a common scale")


@registry.register_scaled_op(
    lax.convert_element_type_p, family="cast", remark="float: data cast, scale kept"
)
def scaled_convert_element_type(x: ScaledArray, *, new_dtype: Any, **params: Any) -> Any:
    if jnp.issubdtype(new_dtype, jnp.floating):
        return ScaledArray(
            lax.convert_element_type_p.bind(x.data, new_dtype=new_dtype, **params), x.scale
        )
    value = x.to_array(compute_dtype(x.dtype))
    return lax.convert_element_type_p.bind(value, new_dtype=new_dtype, **params)


@registry.register_scaled_op(primitives.stop_gradient_p, family="linear")
def scaled_stop_gradient(x: ScaledArray, **params: Any) -> ScaledArray:
    return ScaledArray(
        primitives.stop_gradient_p.bind(x.data, **params),
        primitives.stop_gradient_p.bind(jnp.asarray(x.scale), **params),
    )
