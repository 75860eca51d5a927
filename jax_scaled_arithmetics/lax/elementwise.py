"""Scaled rules for elementwise arithmetic, selection and comparisons."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

from ..core import _compat, registry
from ..core.datatype import ScaledArray
from .base import (
    choose_scale,
    compute_dtype,
    register_common_scale,
    register_linear,
    register_unscaled_output,
    rescale,
    safe_div,
)

def _add_scale(sa: Any, sb: Any) -> Any:
    """sqrt(sa^2 + sb^2), computed as max * sqrt(1 + (min/max)^2), rounded to a power of two."""
    sa = jnp.asarray(sa, jnp.float32) if not hasattr(sa, "dtype") else sa
    sb = jnp.asarray(sb, jnp.float32) if not hasattr(sb, "dtype") else sb
    hi = jnp.maximum(sa, sb)
    lo = jnp.minimum(sa, sb)
    ratio = safe_div(lo, hi)
    return choose_scale(hi * jnp.sqrt(1 + ratio * ratio))


def _scaled_add_like(primitive: Any) -> Any:
    def rule(a: ScaledArray, b: ScaledArray, **params: Any) -> ScaledArray:
        scale = _add_scale(jnp.asarray(a.scale), jnp.asarray(b.scale))
        cdtype = compute_dtype(a.dtype)
        da = a.data.astype(cdtype) * safe_div(a.scale, scale).astype(cdtype)
        db = b.data.astype(cdtype) * safe_div(b.scale, scale).astype(cdtype)
        out = primitive.bind(da, db, **params)
        return ScaledArray(out.astype(a.dtype), scale)

    rule.__name__ = f"scaled_{primitive.name}"
    return rule


for _prim in (lax.add_p, lax.sub_p, _compat.primitives.add_jaxvals_p):
    registry.register_scaled_op(
        _prim, _scaled_add_like(_prim), family="add", remark="scale sqrt(sa^2 + sb^2)"
    )


@registry.register_scaled_op(lax.mul_p, family="mul", remark="scales multiply")
def scaled_mul(a: ScaledArray, b: ScaledArray, **params: Any) -> ScaledArray:
    return ScaledArray(lax.mul_p.bind(a.data, b.data, **params), a.scale * b.scale)


@registry.register_scaled_op(lax.div_p, family="div", remark="scales divide")
def scaled_div(a: ScaledArray, b: ScaledArray, **params: Any) -> ScaledArray:
    return ScaledArray(lax.div_p.bind(a.data, b.data, **params), a.scale / b.scale)


register_linear(lax.neg_p)
register_linear(lax.abs_p, remark="scales are non-negative")
register_linear(lax.real_p)
register_linear(lax.imag_p)
register_linear(lax.conj_p)

for _prim in (lax.max_p, lax.min_p):
    register_common_scale(_prim, remark="common scale: the larger one")

register_common_scale(
    lax.select_n_p, scaled_operands=lambda n: range(1, n), remark="cases at a common scale"
)
register_common_scale(
    lax.clamp_p, remark="bounds and operand at a common scale"
)

for _prim in (lax.eq_p, lax.ne_p, lax.lt_p, lax.le_p, lax.gt_p, lax.ge_p):
    register_unscaled_output(_prim, remark="data compared at a common scale")


@registry.register_scaled_op(lax.sign_p, family="unscaled output", remark="scale 1")
def scaled_sign(x: ScaledArray, **params: Any) -> ScaledArray:
    data = jnp.where(jnp.asarray(x.scale) == 0, jnp.zeros_like(x.data), x.data)
    return ScaledArray(lax.sign_p.bind(data, **params), jnp.ones_like(jnp.asarray(x.scale)))


@registry.register_scaled_op(lax.integer_pow_p, family="pow", remark="scale ** y")
def scaled_integer_pow(x: ScaledArray, *, y: int, **params: Any) -> ScaledArray:
    cdtype = compute_dtype(x.dtype)
    data = lax.integer_pow_p.bind(x.data.astype(cdtype), y=y, **params)
    scale = jnp.asarray(x.scale, jnp.float32)
    return ScaledArray(data.astype(x.dtype), scale**y)


def _sqrt_scale(scale: Any) -> tuple[Any, Any]:
    """A power-of-two square root of `scale` and the factor left in the data."""
    root = choose_scale(jnp.sqrt(jnp.asarray(scale, jnp.float32)))
    return root, safe_div(scale, root * root)


@registry.register_scaled_op(lax.sqrt_p, family="pow", remark="scale sqrt(s) rounded")
def scaled_sqrt(x: ScaledArray, **params: Any) -> ScaledArray:
    root, rest = _sqrt_scale(x.scale)
    data = lax.sqrt_p.bind(rescale(x.data, rest, compute_dtype(x.dtype)), **params)
    return ScaledArray(data.astype(x.dtype), root)


@registry.register_scaled_op(lax.rsqrt_p, family="pow", remark="scale 1/sqrt(s) rounded")
def scaled_rsqrt(x: ScaledArray, **params: Any) -> ScaledArray:
    root, rest = _sqrt_scale(x.scale)
    # rsqrt(0 * scale) is inf, as in plain JAX.
    value = rescale(x.data, rest, compute_dtype(x.dtype))
    value = jnp.where(jnp.asarray(x.scale) == 0, jnp.zeros_like(value), value)
    data = lax.rsqrt_p.bind(value, **params)
    return ScaledArray(data.astype(x.dtype), safe_div(1.0, root))


@registry.register_scaled_op(lax.cbrt_p, family="pow", remark="scale cbrt(s) rounded")
def scaled_cbrt(x: ScaledArray, **params: Any) -> ScaledArray:
    scale = jnp.asarray(x.scale, jnp.float32)
    root = choose_scale(jnp.cbrt(scale))
    rest = safe_div(scale, root * root * root)
    data = lax.cbrt_p.bind(rescale(x.data, rest, compute_dtype(x.dtype)), **params)
    return ScaledArray(data.astype(x.dtype), root)


@registry.register_scaled_op(lax.square_p, family="pow", remark="scale squared")
def scaled_square(x: ScaledArray, **params: Any) -> ScaledArray:
    cdtype = compute_dtype(x.dtype)
    data = lax.square_p.bind(x.data.astype(cdtype), **params)
    return ScaledArray(data.astype(x.dtype), jnp.asarray(x.scale, jnp.float32) ** 2)

