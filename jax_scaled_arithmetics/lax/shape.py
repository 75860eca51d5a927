"""Scaled rules for shape, layout and type operations.

Most act on the data only and keep the scale; those that merge several floating
operands (concatenate, stack, pad with its padding value) bring them to a common
scale first.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

from ..core import registry
from ..core._compat import primitives
from ..core.datatype import ScaledArray
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
    lax.split_p,
    primitives.tile_p,
):
    if not registry.has_scaled_rule(_prim):
        register_linear(_prim)
# From JAX 0.10.2 (jnp.unstack and jnp.stack were compositions before).
register_linear("unstack")

register_common_scale(lax.concatenate_p, remark="operands at a common scale")
register_common_scale("stack", remark="operands at a common scale")
register_common_scale(
    lax.pad_p,
    scaled_operands=(0, 1),
    remark="operand and padding value at a common scale (a zero padding value keeps the scale)",
)


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


@registry.register_scaled_op(
    lax.bitcast_convert_type_p,
    family="cast",
    remark="same dtype: scale kept; otherwise the bits of the value in the data dtype (plain)",
)
def scaled_bitcast_convert_type(x: ScaledArray, *, new_dtype: Any, **params: Any) -> Any:
    """Bits of a scaled value have no meaning: to a new dtype, bitcast the represented value.

    The value is materialised in the data dtype (out-of-range values become inf),
    so the output is what the plain function computes on that dtype. A bitcast to
    the data's own dtype is the identity and keeps the scale.
    """
    if jnp.dtype(new_dtype) == jnp.dtype(x.dtype):
        data = lax.bitcast_convert_type_p.bind(x.data, new_dtype=new_dtype, **params)
        return ScaledArray(data, x.scale)
    return lax.bitcast_convert_type_p.bind(x.to_array(), new_dtype=new_dtype, **params)
