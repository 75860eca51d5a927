"""Scaled rules for elementwise arithmetic, rounding, selection and comparisons.

Scale strategies:

- add/sub: both operands rescaled in float32 to `sqrt(sa^2 + sb^2)` (power of two).
- mul/div/square/sqrt/rsqrt/cbrt/integer_pow: data and scale transformed
  separately (the scales multiply, divide, take a power or a power-of-two root);
  static, so unit-range data is assumed (float16 data products above 65504 overflow).
  A divisor of scale 0 gives the plain inf/NaN.
- neg/abs: data only; select_n: cases at their largest scale; max/min: at the
  larger scale, except against a constant bound that cannot exceed the other
  operand (max(x, c <= 0), min(x, c >= 0): clip, relu), where x's scale is kept;
  clamp likewise. Output scales depend on input scales only (unbatched under vmap).
- floor/ceil/round: value computed in float32, scale `max(s, 1)`, so that an
  integer output of a tiny-scale input (ceil(1e-20) = 1) is not out of range.
- rem: scale `min(sx, sy)` (|rem(x, y)| <= min(|x|, |y|)); reduce_precision:
  input scale (rounding is applied to the represented value).
- nextafter: the next value of the data format at the input's scale.
- comparisons, is_finite: no output scale; data compared directly when both
  scales are statically equal, otherwise in float32 at a common scale.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import _compat, registry
from ..core.datatype import ScaledArray
from ..core.registry import operand_constants
from .base import (
    choose_scale,
    compute_dtype,
    nonzero_or_one,
    register_common_scale,
    register_linear,
    register_unscaled_elementwise,
    rescale,
    safe_div,
    scale_product,
    static_scale,
)

Array = Any

_REGISTERED_BEFORE = frozenset(registry.coverage())


def same_scale(sa: Any, sb: Any) -> bool:
    """Whether two scales are known to be equal when tracing: same object, or equal constants."""
    if sa is sb:
        return True
    va, vb = static_scale(sa), static_scale(sb)
    return va is not None and va == vb


def value_at_scale(x: ScaledArray, scale: Array, dtype: Any) -> Array:
    """The data of `x` brought to `scale`, in `dtype` (a zero scale of `x` gives signed zeros)."""
    sx = jnp.asarray(x.scale, jnp.float32)
    ratio = jnp.where(sx == 0, 0, safe_div(sx, scale))
    return x.data.astype(dtype) * ratio.astype(dtype)


def compare_operands(a: ScaledArray, b: ScaledArray) -> tuple[Array, Array]:
    """Data of `a` and `b` ready to compare: as they are when their scales are statically
    equal (zeroed where that scale is 0), otherwise rescaled in float32 to the larger scale.
    """
    if same_scale(a.scale, b.scale):
        known = static_scale(a.scale)
        if known is not None and known != 0:
            return a.data, b.data
        zero = jnp.asarray(a.scale) == 0
        # data * 0 keeps the sign of zero, as the represented value does.
        return jnp.where(zero, a.data * 0, a.data), jnp.where(zero, b.data * 0, b.data)
    cdtype = compute_dtype(a.dtype)
    common = lax.stop_gradient(
        jnp.maximum(jnp.asarray(a.scale, jnp.float32), jnp.asarray(b.scale, jnp.float32))
    )
    return value_at_scale(a, common, cdtype), value_at_scale(b, common, cdtype)


# --- add, sub ----------------------------------------------------------------------------


def _add_scale(sa: Any, sb: Any) -> Any:
    """sqrt(sa^2 + sb^2), computed as max * sqrt(1 + (min/max)^2), rounded to a power of two."""
    sa = jnp.asarray(sa, jnp.float32)
    sb = jnp.asarray(sb, jnp.float32)
    hi = jnp.maximum(sa, sb)
    lo = jnp.minimum(sa, sb)
    ratio = safe_div(lo, hi)
    return choose_scale(hi * jnp.sqrt(1 + ratio * ratio))


def _scaled_add_like(primitive: Any) -> Any:
    def rule(a: ScaledArray, b: ScaledArray, **params: Any) -> ScaledArray:
        scale = _add_scale(a.scale, b.scale)
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


# --- mul, div ----------------------------------------------------------------------------


@registry.register_scaled_op(lax.mul_p, family="mul", remark="scales multiply")
def scaled_mul(a: ScaledArray, b: ScaledArray, **params: Any) -> ScaledArray:
    """Data multiply, scales multiply (a product beyond float32's range overflows the data,
    elementwise, as plain float32 does, rather than the scale)."""
    data = lax.mul_p.bind(a.data, b.data, **params)
    return scale_product(data, [(a.scale, 1), (b.scale, 1)], data.dtype)


@registry.register_scaled_op(
    lax.div_p, family="div", remark="scales divide; a zero-scale divisor gives inf/NaN as plain"
)
def scaled_div(a: ScaledArray, b: ScaledArray, **params: Any) -> ScaledArray:
    """Data divide, scales divide. A divisor of scale 0 is a (signed) zero: the output is
    then the plain quotient of the represented values (inf or NaN), with scale 1.
    """
    sb_known = static_scale(b.scale)
    if sb_known is not None and sb_known != 0:
        data = lax.div_p.bind(a.data, b.data, **params)
        return scale_product(data, [(a.scale, 1), (b.scale, -1)], data.dtype)
    cdtype = compute_dtype(a.dtype)
    sa = jnp.asarray(a.scale, jnp.float32)
    sb = jnp.asarray(b.scale, jnp.float32)
    zero = sb == 0
    regular = lax.div_p.bind(a.data, b.data, **params)
    # Divisor data * 0 is a zero with the sign of the represented value; 1 elsewhere, so that
    # the branch not taken carries no inf into gradients.
    den = jnp.where(zero, b.data.astype(cdtype) * 0, jnp.ones((), cdtype))
    special = (a.data.astype(cdtype) * sa.astype(cdtype)) / den
    quotient = scale_product(regular, [(sa, 1), (jnp.where(zero, 1, sb), -1)], regular.dtype)
    data = jnp.where(zero, special.astype(a.dtype), quotient.data)
    scale = jnp.where(zero, jnp.ones_like(sa), quotient.scale)
    return ScaledArray(data, scale)


# --- sign-like, linear and selection -----------------------------------------------------

register_linear(lax.neg_p)
register_linear(lax.abs_p, remark="scales are non-negative")


def _keeps_scale(constant: Any, is_max: bool) -> bool:
    """Whether max/min with this constant is always the other operand or a smaller value.

    max(x, c) with c <= 0 is x, or c where x < c, so |c| < |x|: x's scale holds it.
    """
    if not isinstance(constant, (int, float)) or not np.isfinite(constant):
        return False
    return constant <= 0 if is_max else constant >= 0


def _minmax_rule(primitive: Any, is_max: bool) -> Any:
    def rule(a: ScaledArray, b: ScaledArray, **params: Any) -> ScaledArray:
        if same_scale(a.scale, b.scale):
            return ScaledArray(primitive.bind(a.data, b.data, **params), a.scale)
        known = list(operand_constants()) or [None, None]
        sa = jnp.asarray(a.scale, jnp.float32)
        sb = jnp.asarray(b.scale, jnp.float32)
        if _keeps_scale(known[1], is_max) and known[0] is None:
            scale = sa
        elif _keeps_scale(known[0], is_max) and known[1] is None:
            scale = sb
        else:
            scale = jnp.maximum(sa, sb)
        scale = lax.stop_gradient(scale)
        cdtype = compute_dtype(a.dtype)
        out = primitive.bind(
            value_at_scale(a, scale, cdtype), value_at_scale(b, scale, cdtype), **params
        )
        return ScaledArray(out.astype(a.dtype), scale)

    rule.__name__ = f"scaled_{primitive.name}"
    return rule


for _prim, _is_max in ((lax.max_p, True), (lax.min_p, False)):
    registry.register_scaled_op(
        _prim,
        _minmax_rule(_prim, _is_max),
        family="common scale",
        remark="the larger scale; the array's own against a constant bound (clip, relu)",
    )

register_common_scale(
    lax.select_n_p, scaled_operands=lambda n: range(1, n), remark="cases at a common scale"
)


@registry.register_scaled_op(
    lax.clamp_p,
    family="common scale",
    remark="x's scale between constant bounds around 0, else the largest scale",
)
def scaled_clamp(lo: ScaledArray, x: ScaledArray, hi: ScaledArray, **params: Any) -> ScaledArray:
    """clamp in float32 at x's scale when the bounds are constants around 0 (the output
    is then x, or a bound smaller in magnitude), otherwise at the largest scale.
    """
    cdtype = compute_dtype(x.dtype)
    known = list(operand_constants()) or [None] * 3
    if _keeps_scale(known[0], is_max=True) and _keeps_scale(known[2], is_max=False):
        scale = jnp.asarray(x.scale, jnp.float32)
    else:
        scale = jnp.maximum(
            jnp.maximum(jnp.asarray(lo.scale, jnp.float32), jnp.asarray(x.scale, jnp.float32)),
            jnp.asarray(hi.scale, jnp.float32),
        )
    scale = lax.stop_gradient(scale)
    datas = [value_at_scale(o, scale, cdtype) for o in (lo, x, hi)]
    return ScaledArray(lax.clamp_p.bind(*datas, **params).astype(x.dtype), scale)


@registry.register_scaled_op(lax.sign_p, family="unscaled output", remark="scale 1")
def scaled_sign(x: ScaledArray, **params: Any) -> ScaledArray:
    """sign(data), scale 1 (zeros where the scale is 0)."""
    data = jnp.where(jnp.asarray(x.scale) == 0, x.data * 0, x.data)
    return ScaledArray(lax.sign_p.bind(data, **params), np.asarray(1.0, np.float32))


# --- comparisons -------------------------------------------------------------------------


def _comparison_rule(primitive: Any) -> Any:
    def rule(a: ScaledArray, b: ScaledArray, **params: Any) -> Array:
        da, db = compare_operands(a, b)
        return primitive.bind(da, db, **params)

    rule.__name__ = f"scaled_{primitive.name}"
    return rule


_COMPARISONS = (
    lax.eq_p,
    lax.ne_p,
    lax.lt_p,
    lax.le_p,
    lax.gt_p,
    lax.ge_p,
    _compat.primitives.eq_to_p,
    _compat.primitives.le_to_p,
    _compat.primitives.lt_to_p,
)
for _prim in _COMPARISONS:
    registry.register_scaled_op(
        _prim,
        _comparison_rule(_prim),
        family="unscaled output",
        remark="data compared directly at equal scales, else in float32 at a common scale",
    )


@registry.register_scaled_op(lax.is_finite_p, family="unscaled output", remark="on data and scale")
def scaled_is_finite(x: ScaledArray, **params: Any) -> Array:
    """is_finite(data * scale) without the product: data and scale both finite."""
    finite_scale = jnp.isfinite(jnp.asarray(x.scale))
    return lax.is_finite_p.bind(x.data, **params) & finite_scale


# --- powers and roots --------------------------------------------------------------------


@registry.register_scaled_op(lax.integer_pow_p, family="pow", remark="scale ** y")
def scaled_integer_pow(x: ScaledArray, *, y: int, **params: Any) -> ScaledArray:
    """data ** y (computed in float32) with scale ** y; x ** 0 is 1 with scale 1.

    Static, like mul: unit-range data stays in range (float16 data in
    [2^-14, 2^16] has reciprocals in range), while subnormal float16 data
    overflows for y < 0.
    """
    cdtype = compute_dtype(x.dtype)
    data = lax.integer_pow_p.bind(x.data.astype(cdtype), y=y, **params)
    if y == 0:
        return ScaledArray(data.astype(x.dtype), np.asarray(1.0, np.float32))
    return scale_product(data, [(x.scale, y)], x.dtype)


def _sqrt_scale(scale: Any) -> tuple[Any, Any]:
    """A power-of-two square root of `scale` and the factor left in the data."""
    root = choose_scale(jnp.sqrt(jnp.asarray(scale, jnp.float32)))
    return root, safe_div(scale, root * root)


@registry.register_scaled_op(lax.sqrt_p, family="pow", remark="scale sqrt(s) rounded")
def scaled_sqrt(x: ScaledArray, **params: Any) -> ScaledArray:
    """sqrt(data * rest) with scale root, where scale = root^2 * rest."""
    root, rest = _sqrt_scale(x.scale)
    data = lax.sqrt_p.bind(rescale(x.data, rest, compute_dtype(x.dtype)), **params)
    return ScaledArray(data.astype(x.dtype), root)


@registry.register_scaled_op(lax.rsqrt_p, family="pow", remark="scale 1/sqrt(s) rounded")
def scaled_rsqrt(x: ScaledArray, **params: Any) -> ScaledArray:
    """rsqrt(data * rest) with scale 1/root; a zero scale gives inf (scale 1) as plain."""
    root, rest = _sqrt_scale(x.scale)
    # A zero scale gives rest 0 and data * 0 a signed zero: rsqrt is then +-inf.
    data = lax.rsqrt_p.bind(rescale(x.data, rest, compute_dtype(x.dtype)), **params)
    return ScaledArray(data.astype(x.dtype), safe_div(1.0, nonzero_or_one(root)))


@registry.register_scaled_op(lax.cbrt_p, family="pow", remark="scale cbrt(s) rounded")
def scaled_cbrt(x: ScaledArray, **params: Any) -> ScaledArray:
    """cbrt(data * rest) with scale root, where scale = root^3 * rest."""
    scale = jnp.asarray(x.scale, jnp.float32)
    root = choose_scale(jnp.cbrt(scale))
    rest = safe_div(scale, root * root * root)
    data = lax.cbrt_p.bind(rescale(x.data, rest, compute_dtype(x.dtype)), **params)
    return ScaledArray(data.astype(x.dtype), root)


@registry.register_scaled_op(lax.square_p, family="pow", remark="scale squared")
def scaled_square(x: ScaledArray, **params: Any) -> ScaledArray:
    """data^2 (in float32) with scale^2."""
    cdtype = compute_dtype(x.dtype)
    data = lax.square_p.bind(x.data.astype(cdtype), **params)
    return scale_product(data, [(x.scale, 2)], x.dtype)


# --- rounding and remainders -------------------------------------------------------------

for _prim in (lax.floor_p, lax.ceil_p, lax.round_p):
    register_unscaled_elementwise(
        _prim, output_scale="input_at_least_one", remark="on the value; scale max(s, 1)"
    )

register_unscaled_elementwise(
    lax.rem_p, output_scale="smallest_input", remark="on the values; scale min(sx, sy)"
)
register_unscaled_elementwise(
    lax.reduce_precision_p,
    output_scale="input",
    remark="rounds the represented value (its exponent range too); input scale",
)


@registry.register_scaled_op(
    lax.nextafter_p, family="nextafter", remark="next value of the data format at x1's scale"
)
def scaled_nextafter(x1: ScaledArray, x2: ScaledArray, **params: Any) -> ScaledArray:
    """The next value after x1 towards x2 among `data * scale` with x1's scale.

    The step is one unit in the last place of x1's data dtype at x1's scale. When
    that scale is 0, the scale is float32's smallest normal number, so that the step
    from zero is as small as float32's. The direction is found by comparing the values.
    """
    s1 = jnp.asarray(x1.scale, jnp.float32)
    tiny = np.finfo(np.float32).tiny
    scale = lax.stop_gradient(jnp.where(s1 == 0, jnp.full_like(s1, tiny), s1))
    c1, c2 = compare_operands(x1, x2)
    d1 = value_at_scale(x1, scale, x1.dtype)
    d2 = value_at_scale(x2, scale, x1.dtype)  # used where the values are equal (or NaN)
    inf = jnp.asarray(jnp.inf, x1.dtype)
    target = jnp.where(c2 > c1, inf, jnp.where(c2 < c1, -inf, d2))
    return ScaledArray(lax.nextafter_p.bind(d1, target, **params), scale)


REGISTERED = tuple(
    info.primitive for name, info in registry.coverage().items() if name not in _REGISTERED_BEFORE
)
"""The primitives whose rules this module registers."""
