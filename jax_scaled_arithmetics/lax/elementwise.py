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
- polynomial (JAX >= 0.12): Horner's rule on the scaled operands, whose mul and add rules
  choose the scales.
- `jnp.hypot` (JAX >= 0.12, a `custom_jvp` whose call `custom_derivatives.py` routes here):
  computed in float32 at the operands' common scale `s`, output scale `2 s`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import _compat, block_scales, registry
from ..core.config import Pow2RoundMode, get_autoscale_config
from ..core.datatype import ScaledArray
from ..core.pow2 import pow2_floor, pow2_round_up, static_pow2
from ..core.promotion import promote_to_scaled
from ..core.registry import operand_constants
from ..core.types import Array
from .base import (
    common_scale_rule,
    compute_dtype,
    register_each,
    register_linear,
    register_unscaled_elementwise,
    select_whole_cases,
    to_common_scale,
    zeros_where_scale_zero,
)
from .scale_algebra import (
    SCALE_MIN,
    apply_ratio,
    as_f32,
    at_scale,
    common_ratios,
    represent,
    same_scale,
    scale_div,
    scale_mul,
    scale_sqrt,
    static_value,
)

_REGISTERED_BEFORE = frozenset(registry.coverage())


def value_at_scale(x: ScaledArray, scale: Array, dtype: Any) -> Array:
    """The data of `x` brought to `scale`, in `dtype` (a zero scale of `x` gives signed zeros)."""
    return at_scale(x.data, x.scale, scale, dtype)


def compare_operands(a: ScaledArray, b: ScaledArray) -> tuple[Array, Array]:
    """Data of `a` and `b` ready to compare: as they are when their scales are statically
    equal (zeroed where that scale is 0), otherwise rescaled in float32 to the larger scale.
    """
    if same_scale(a.scale, b.scale):
        return zeros_where_scale_zero(a), zeros_where_scale_zero(b)
    cdtype = compute_dtype(a.dtype)
    _, (ra, rb) = common_ratios([a.scale, b.scale])
    return apply_ratio(a.data, ra, cdtype), apply_ratio(b.data, rb, cdtype)


# --- add, sub ----------------------------------------------------------------------------


def add_scale(sa: Any, sb: Any) -> tuple[Any, Any, Any]:
    """The output scale of a sum, `sqrt(sa^2 + sb^2)` rounded to a power of two, and the
    operands' ratios to it.

    For powers of two this is `max(sa, sb)` rounding down (the default) and twice that
    rounding up: one :data:`common_scale_p`, no square root. With `Pow2RoundMode.NONE`
    the root is computed (as `max * sqrt(1 + (min / max)^2)`, which cannot overflow).
    """
    mode = get_autoscale_config().rounding_mode
    common, (ra, rb) = common_ratios([sa, sb])
    if mode == Pow2RoundMode.DOWN:
        return common, ra, rb
    if mode == Pow2RoundMode.UP:
        half = np.float32(0.5)
        return scale_mul(common, np.float32(2.0)), scale_mul(ra, half), scale_mul(rb, half)
    low = scale_div(_smaller(sa, sb), common)
    scale = scale_mul(common, _sqrt_scalar(scale_mul(low, low) + np.float32(1.0)))
    return scale, scale_div(sa, scale), scale_div(sb, scale)


def _smaller(sa: Any, sb: Any) -> Any:
    va, vb = static_value(sa), static_value(sb)
    if va is not None and vb is not None:
        return np.float32(min(va, vb))
    return lax.min(as_f32(sa), as_f32(sb))


def _sqrt_scalar(x: Any) -> Any:
    value = static_value(x)
    return np.float32(np.sqrt(value)) if value is not None else lax.sqrt(x)


@register_each(
    lax.add_p,
    lax.sub_p,
    _compat.primitives.add_jaxvals_p,
    family="add",
    remark="scale sqrt(sa^2 + sb^2) rounded: max(sa, sb) for powers of two",
)
def _scaled_add_like(primitive: Any) -> Any:
    def rule(a: ScaledArray, b: ScaledArray, **params: Any) -> ScaledArray:
        if same_scale(a.scale, b.scale) and get_autoscale_config().rounding_mode == (
            Pow2RoundMode.DOWN
        ):
            return ScaledArray(primitive.bind(a.data, b.data, **params), a.scale)
        scale, ra, rb = add_scale(a.scale, b.scale)
        da = apply_ratio(a.data, ra)
        db = apply_ratio(b.data, rb, a.dtype)
        return ScaledArray(primitive.bind(da, db, **params), scale)

    return rule


# --- mul, div ----------------------------------------------------------------------------


@registry.register_scaled_op(lax.mul_p, family="mul", remark="scales multiply")
def scaled_mul(a: ScaledArray, b: ScaledArray, **params: Any) -> ScaledArray:
    """Data multiply, scales multiply (a product beyond float32's range overflows the data,
    elementwise, as plain float32 does, rather than the scale)."""
    data = lax.mul_p.bind(a.data, b.data, **params)
    return represent(data, [(a.scale, 1), (b.scale, 1)], data.dtype)


@registry.register_scaled_op(
    lax.div_p, family="div", remark="scales divide; a zero-scale divisor gives inf/NaN as plain"
)
def scaled_div(a: ScaledArray, b: ScaledArray, **params: Any) -> ScaledArray:
    """Data divide, scales divide. A divisor of scale 0 is a (signed) zero: the output is
    then the plain quotient of the represented values (+-inf or NaN).
    """
    data = lax.div_p.bind(a.data, b.data, **params)
    return represent(data, [(a.scale, 1), (b.scale, -1)], data.dtype)


# --- sign-like, linear and selection -----------------------------------------------------

register_linear(lax.neg_p)
register_linear(lax.abs_p, remark="scales are non-negative")
# The library's own identities (a value computed once by XLA), met again when a program that
# `autoscale` produced is interpreted with ScaledArrays: the data computed once, scale kept.
register_linear(block_scales.materialize_p, remark="the data materialised, scale kept")
register_linear(block_scales.materialize_on_cpu_p, remark="the data materialised, scale kept")


def _keeps_scale(constant: Any, is_max: bool) -> bool:
    """Whether max/min with this constant is always the other operand or a smaller value.

    max(x, c) with c <= 0 is x, or c where x < c, so |c| < |x|: x's scale holds it.
    """
    if not isinstance(constant, (int, float)) or not np.isfinite(constant):
        return False
    return constant <= 0 if is_max else constant >= 0


@register_each(
    (lax.max_p, True),
    (lax.min_p, False),
    family="common scale",
    remark="the larger scale; the array's own against a constant bound (clip, relu)",
)
def _minmax_rule(primitive: Any, is_max: bool) -> Any:
    def rule(a: ScaledArray, b: ScaledArray, **params: Any) -> ScaledArray:
        if same_scale(a.scale, b.scale):
            return ScaledArray(primitive.bind(a.data, b.data, **params), a.scale)
        known = list(operand_constants()) or [None, None]
        if _keeps_scale(known[1], is_max) and known[0] is None:
            scale = a.scale
            da, db = a.data, value_at_scale(b, scale, a.dtype)
        elif _keeps_scale(known[0], is_max) and known[1] is None:
            scale = b.scale
            da, db = value_at_scale(a, scale, a.dtype), b.data
        else:
            scale, (ra, rb) = common_ratios([a.scale, b.scale])
            da, db = apply_ratio(a.data, ra), apply_ratio(b.data, rb, a.dtype)
        return ScaledArray(primitive.bind(da, db, **params), scale)

    return rule


_select_n_at_common_scale = common_scale_rule(lax.select_n_p, lambda n: range(1, n))


@registry.register_scaled_op(
    lax.select_n_p,
    family="common scale",
    remark="cases at a common scale; by a scalar predicate, the chosen case as it is",
)
def scaled_select_n(which: Any, *cases: Any, **params: Any) -> ScaledArray:
    """A scalar predicate selects a whole case (data and scale: exact); a predicate per
    element selects among the cases brought to a common scale."""
    whole = select_whole_cases(which, cases, **params)
    if whole is not None:
        return whole
    out: ScaledArray = _select_n_at_common_scale(which, *cases, **params)
    return out


def scaled_hypot_with_unit_vector(x1: Any, x2: Any) -> list[ScaledArray] | None:
    """`jnp.hypot`'s core on JAX >= 0.12, `(r, x1 / r, x2 / r)` with `r = hypot(x1, x2)`.

    hypot is homogeneous: it runs in float32 on the operands at their common scale `s`,
    and `r` takes scale `2 s` (`r <= sqrt(2) max(|x1|, |x2|)`: no overflow); the unit
    vector has scale 1. Interpreted instead, the plain computation multiplies each element
    by `2**k`, `2**-k` or 1 before squaring, whose selection at one scale per tensor
    flushes the values far below the largest. None for block scales (interpreted then).
    """
    hypot = _compat.hypot_with_unit_vector
    known = list(operand_constants()) or [None, None]
    x1, x2 = (promote_to_scaled(x, k) for x, k in zip((x1, x2), known, strict=True))
    if hypot is None or np.ndim(x1.scale) or np.ndim(x2.scale) or x1.dtype != x2.dtype:
        return None
    dtype = x1.dtype
    (v1, v2), scale = to_common_scale(x1, x2, constants=known, dtype=compute_dtype(dtype))
    r, u1, u2 = hypot(v1, v2)
    one = np.float32(1.0)
    return [
        ScaledArray((r * 0.5).astype(dtype), scale_mul(scale, np.float32(2.0))),
        ScaledArray(u1.astype(dtype), one),
        ScaledArray(u2.astype(dtype), one),
    ]


@registry.register_scaled_op(
    lax.clamp_p,
    family="common scale",
    remark="x's scale between constant bounds around 0, else the largest scale",
)
def scaled_clamp(lo: ScaledArray, x: ScaledArray, hi: ScaledArray, **params: Any) -> ScaledArray:
    """clamp at x's scale when the bounds are constants around 0 (the output is then x, or
    a bound smaller in magnitude), otherwise at the largest scale.
    """
    known = list(operand_constants()) or [None] * 3
    if _keeps_scale(known[0], is_max=True) and _keeps_scale(known[2], is_max=False):
        scale = x.scale
        datas = [value_at_scale(o, scale, x.dtype) for o in (lo, x, hi)]
    else:
        scale, ratios = common_ratios([lo.scale, x.scale, hi.scale])
        datas = [apply_ratio(o.data, r, x.dtype) for o, r in zip((lo, x, hi), ratios)]
    return ScaledArray(lax.clamp_p.bind(*datas, **params), scale)


@registry.register_scaled_op(lax.sign_p, family="unscaled output", remark="scale 1")
def scaled_sign(x: ScaledArray, **params: Any) -> ScaledArray:
    """sign(data), scale 1 (zeros where the scale is 0)."""
    return ScaledArray(lax.sign_p.bind(zeros_where_scale_zero(x), **params), np.float32(1.0))


# --- comparisons -------------------------------------------------------------------------


@register_each(
    lax.eq_p,
    lax.ne_p,
    lax.lt_p,
    lax.le_p,
    lax.gt_p,
    lax.ge_p,
    _compat.primitives.eq_to_p,
    _compat.primitives.le_to_p,
    _compat.primitives.lt_to_p,
    family="unscaled output",
    remark="data compared directly at equal scales, else in float32 at a common scale",
)
def _comparison_rule(primitive: Any) -> Any:
    def rule(a: ScaledArray, b: ScaledArray, **params: Any) -> Array:
        da, db = compare_operands(a, b)
        return primitive.bind(da, db, **params)

    return rule


@registry.register_scaled_op(lax.is_finite_p, family="unscaled output", remark="on data and scale")
def scaled_is_finite(x: ScaledArray, **params: Any) -> Array:
    """is_finite(data * scale) without the product: data and scale both finite."""
    finite = lax.is_finite_p.bind(x.data, **params)
    value = static_value(x.scale)
    if value is not None:
        return finite if np.isfinite(value) else lax.full_like(finite, False)
    return finite & lax.is_finite(as_f32(x.scale))


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
        return ScaledArray(data.astype(x.dtype), np.float32(1.0))
    return represent(data, [(x.scale, y)], x.dtype)


def _pow2_root(scale: Any, degree: int) -> tuple[Any, Any]:
    """`(root, rest)` with `scale = root ** degree * rest`, root a power of two (rounded with
    the configured mode: `rest` in [1, 2^degree) rounding down), by exponent arithmetic."""
    mode = get_autoscale_config().rounding_mode
    value = static_value(scale)
    root: Any
    if value is not None:
        exact = float(np.float64(value) ** (1.0 / degree))
        root = exact if mode == Pow2RoundMode.NONE else static_pow2(exact, mode)
        root = max(root, SCALE_MIN)
        return np.float32(root), np.float32(value / root**degree)
    scale = as_f32(scale)
    if mode == Pow2RoundMode.NONE:
        traced_root = lax.sqrt(scale) if degree == 2 else lax.cbrt(scale)
        root = lax.max(traced_root, np.float32(SCALE_MIN))
    elif degree == 2:
        root = scale_sqrt(scale, round_up=mode == Pow2RoundMode.UP)
    else:
        root = lax.max(pow2_floor(lax.cbrt(scale)), np.float32(SCALE_MIN))
        if mode == Pow2RoundMode.UP:
            root = lax.max(pow2_round_up(lax.cbrt(scale)), np.float32(SCALE_MIN))
    # Divided by one root at a time: no underflow of root ** degree.
    rest = scale
    for _ in range(degree):
        rest = scale_div(rest, root)
    return root, rest


def _root_rule(primitive: Any, degree: int, inverse: bool) -> Any:
    def rule(x: ScaledArray, **params: Any) -> ScaledArray:
        root, rest = _pow2_root(x.scale, degree)
        cdtype = compute_dtype(x.dtype)
        data = x.data.astype(cdtype)
        if static_value(rest) != 1.0:
            data = data * as_f32(rest).astype(cdtype)
        out = primitive.bind(data, **params).astype(x.dtype)
        return ScaledArray(out, scale_div(np.float32(1.0), root) if inverse else root)

    rule.__name__ = f"scaled_{primitive.name}"
    return rule


for _prim, _degree, _inverse, _remark in (
    (lax.sqrt_p, 2, False, "scale sqrt(s) rounded"),
    (lax.rsqrt_p, 2, True, "scale 1/sqrt(s) rounded; a zero scale gives inf as plain"),
    (lax.cbrt_p, 3, False, "scale cbrt(s) rounded"),
):
    registry.register_scaled_op(
        _prim, _root_rule(_prim, _degree, _inverse), family="pow", remark=_remark
    )


@registry.register_scaled_op(lax.square_p, family="pow", remark="scale squared")
def scaled_square(x: ScaledArray, **params: Any) -> ScaledArray:
    """data^2 (in float32) with scale^2."""
    cdtype = compute_dtype(x.dtype)
    data = lax.square_p.bind(x.data.astype(cdtype), **params)
    return represent(data, [(x.scale, 2)], x.dtype)


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
    tiny = np.float32(np.finfo(np.float32).tiny)
    value = static_value(x1.scale)
    if value is not None:
        scale: Any = np.float32(value if value != 0 else tiny)
    else:
        s1 = as_f32(x1.scale)
        scale = lax.stop_gradient(lax.select(s1 == 0, tiny, s1))
    c1, c2 = compare_operands(x1, x2)
    d1 = value_at_scale(x1, scale, x1.dtype)
    d2 = value_at_scale(x2, scale, x1.dtype)  # used where the values are equal (or NaN)
    # Formats without infinities (float8_e4m3fn...) cast inf to NaN: step towards their
    # largest value instead.
    has_inf = np.isinf(np.asarray(np.inf, np.float32).astype(x1.dtype).astype(np.float32))
    far = jnp.asarray(np.inf if has_inf else jnp.finfo(x1.dtype).max, x1.dtype)
    target = jnp.where(c2 > c1, far, jnp.where(c2 < c1, -far, d2))
    return ScaledArray(lax.nextafter_p.bind(d1, target, **params), scale)


# --- polynomial (JAX 0.12) ----------------------------------------------------------------


def _horner(x: Array, *coeffs: Array) -> Array:
    """`sum_k coeffs[k] * x^k` by Horner's rule, as JAX lowers `polynomial` (operands
    broadcast to one shape first)."""
    shape = np.broadcast_shapes(*(np.shape(o) for o in (x, *coeffs)))
    x, *terms = [jnp.broadcast_to(o, shape) for o in (x, *coeffs)]
    acc = terms[-1]
    for c in reversed(terms[:-1]):
        acc = lax.add(lax.mul(acc, x), c)
    return acc


@registry.register_scaled_op(
    "polynomial",
    promote=False,
    family="expanded",
    remark="Horner's rule: the mul and add rules choose the scales; coefficients scaled or plain",
)
def scaled_polynomial(x: Any, *coeffs: Any, **params: Any) -> Any:
    """`lax.polynomial` (the derivative of erf, of gelu) as the mul/add chain of Horner's
    rule, run with the scaled interpreter: constant coefficients keep their known values
    (power-of-two scales), scaled ones their scales. `unroll` only shapes JAX's lowering."""
    del params
    operands = [x, *coeffs]
    avals = [
        _compat.shape_dtype_struct(_compat.typeof(o.data if isinstance(o, ScaledArray) else o))
        for o in operands
    ]
    closed = jax.make_jaxpr(_horner)(*avals)
    (out,) = registry.interpret_closed_jaxpr(closed, operands, operand_constants())
    return out


REGISTERED = tuple(
    info.primitive for name, info in registry.coverage().items() if name not in _REGISTERED_BEFORE
)
"""The primitives whose rules this module registers."""
