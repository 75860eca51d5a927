"""Shared helpers and rule families for the scaled rules.

Most primitives need no hand-written rule, only the right family:

- `register_linear`: acts on data only, scale kept (shape ops, neg, copies...).
- `register_common_scale`: several scaled operands brought to one common scale
  first (concatenate, select_n, pad, dynamic_update_slice...).
- `register_unscaled_unary`: a non-linear function computed on the unscaled
  value in a safe precision, returned with a static or dynamic scale.
- `register_unscaled_output`: the output is not a scaled quantity (comparisons,
  argmax, is_finite...), computed on data rescaled to a common scale.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import _compat, registry
from ..core.config import Pow2RoundMode
from ..core.datatype import ScaledArray, is_floating
from ..core.pow2 import pow2_round, static_pow2

Array = Any

__all__ = [
    "compute_dtype",
    "choose_scale",
    "safe_div",
    "rescale",
    "to_common_scale",
    "unscaled_value",
    "register_linear",
    "register_common_scale",
    "register_unscaled_unary",
    "register_unscaled_output",
    "dynamic_scale_of",
]


def compute_dtype(dtype: Any) -> Any:
    """The dtype elementwise rules compute in: at least float32."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.float64):
        return jnp.dtype(jnp.float64)
    return jnp.dtype(jnp.float32)


def choose_scale(x: Array) -> Array:
    """A scale chosen from `x`: rounded to a power of two, and excluded from autodiff.

    The value `data * scale` does not depend on which scale a rule picks, so the
    choice carries no gradient.
    """
    return lax.stop_gradient(pow2_round(x))


def safe_div(num: Array, den: Array) -> Array:
    """`num / den`, defined as 0 where `den == 0` (zero scales represent zeros)."""
    den = jnp.asarray(den)
    nonzero = den != 0
    return jnp.where(nonzero, num / jnp.where(nonzero, den, jnp.ones_like(den)), 0)


def rescale(data: Array, ratio: Array, dtype: Any = None) -> Array:
    """`data * ratio` computed in at least float32, cast to `dtype` (default: data's)."""
    dtype = data.dtype if dtype is None else dtype
    cdtype = compute_dtype(data.dtype)
    return (data.astype(cdtype) * jnp.asarray(ratio).astype(cdtype)).astype(dtype)


def unscaled_value(x: ScaledArray, dtype: Any = None) -> Array:
    """The represented value of `x` in `dtype` (default: the safe compute dtype)."""
    dtype = compute_dtype(x.dtype) if dtype is None else dtype
    return x.data.astype(dtype) * jnp.asarray(x.scale).astype(dtype)


# A float32 scale m * 2^e (m in [1/2, 1)) with e in this range and its reciprocal are both
# normal numbers (XLA may divide by multiplying with a reciprocal that it flushes to 0).
_SCALE_EXPONENTS = (-124, 126)
# Powers of two applied to data in two chunks that are normal float32 numbers: enough to
# overflow (or flush) any float16/bfloat16 datum, as the plain float32 value would.
_DATA_EXPONENT_CHUNK = 126


def static_scale(scale: Any) -> float | None:
    """The value of a concrete scalar scale, or None for a traced one."""
    if _compat.is_tracer(scale) or np.shape(scale) != ():
        return None
    try:
        return float(np.asarray(scale, np.float64))
    except Exception:  # an abstract value without a concrete one
        return None


def _exact_pow2(exponent: Array) -> Array:
    """`2^exponent` as float32, exactly, for integer exponents in [-126, 127]."""
    bits = (jnp.asarray(exponent, jnp.int32) + 127).astype(jnp.uint32) << 23
    return lax.bitcast_convert_type(bits, jnp.float32)


def scale_product(data: Array, factors: Sequence[tuple[Any, int]], dtype: Any) -> ScaledArray:
    """`data` at the scale `prod(scale ** power for scale, power in factors)`.

    The product is formed on float32 exponents, so it cannot overflow: where it leaves
    float32's range, the scale is clamped to that range and the remaining power of two
    multiplies the data (in float32), so that each value beyond float32's range becomes
    +-inf (or 0) as in plain float32 arithmetic, instead of the whole tensor getting an
    infinite (or zero) scale, which later turns zeros and every rescale into NaN.
    """
    concrete = [static_scale(scale) for scale, _ in factors]
    if all(c is not None for c in concrete):  # known when tracing: checked here, for free
        with np.errstate(all="ignore"):
            product = float(np.prod([np.float64(c) ** p for c, (_, p) in zip(concrete, factors)]))
        if product == 0 or 2.0 ** (_SCALE_EXPONENTS[0] - 1) <= product < 2.0 ** _SCALE_EXPONENTS[1]:
            return ScaledArray(data.astype(dtype), np.asarray(product, np.float32))
    direct: Array = None  # the plain product: differentiable in the scales
    mantissa: Array = None
    exponent: Array = 0
    for scale, power in factors:
        scale = jnp.asarray(scale, jnp.float32)
        term = scale if power == 1 else lax.integer_pow(scale, power)
        direct = term if direct is None else direct * term
        m, e = jnp.frexp(lax.stop_gradient(scale))
        m = m if power == 1 else lax.integer_pow(m, power)
        mantissa = m if mantissa is None else mantissa * m
        exponent = exponent + (e if power == 1 else e * power)
    m, e = jnp.frexp(mantissa)
    exponent = exponent + e
    kept = lax.clamp(np.int32(_SCALE_EXPONENTS[0]), exponent, np.int32(_SCALE_EXPONENTS[1]))
    clamped = m * _exact_pow2(kept - 1) * 2  # m * 2^kept, with 2^(kept - 1) a normal float32
    scale = lax.select(exponent == kept, direct, clamped)
    limit = np.int32(2 * _DATA_EXPONENT_CHUNK)
    rest = lax.clamp(-limit, exponent - kept, limit)
    first = rest // 2
    out = data.astype(compute_dtype(data.dtype))
    for chunk in (first, rest - first):
        out = out * _exact_pow2(chunk).astype(out.dtype)
    return ScaledArray(out.astype(dtype), scale)


def _constant_scale(value: Any, dtype: Any) -> Any:
    """The smallest power-of-two scale at which a known constant fits in `dtype` data."""
    if value == 0 or not np.isfinite(value):
        return np.float32(0.0)
    needed = abs(float(value)) / float(jnp.finfo(dtype).max)
    return np.float32(static_pow2(needed, Pow2RoundMode.UP))


def to_common_scale(
    *xs: ScaledArray, constants: Sequence[Any] | None = None
) -> tuple[list[Array], Array]:
    """Bring ScaledArrays to one common scale: returns their data at it, and the scale.

    The common scale is the largest scale of the operands, so every data is multiplied
    by `scale_i / common <= 1` and none overflows. An operand known to be a constant
    (`constants[i]` not None, e.g. the `-1e30` of a mask or the `0` of a padding) only
    asks for the smallest scale it fits at, not the power of two it was promoted with:
    `where(mask, x, -1e4)` keeps x's precision.
    """
    constants = [None] * len(xs) if constants is None else list(constants)
    scales = [jnp.asarray(x.scale) for x in xs]
    wanted = [
        _constant_scale(c, x.dtype) if _is_number(c) else s
        for x, s, c in zip(xs, scales, constants)
    ]
    common = wanted[0]
    for s in wanted[1:]:
        common = jnp.maximum(common, s)
    if any(_is_number(c) and not np.isfinite(c) for c in constants):
        # inf / NaN constants fit at any positive scale, but not at a zero one.
        common = jnp.where(common == 0, jnp.ones_like(common), common)
    common = lax.stop_gradient(common)
    datas = [rescale(x.data, safe_div(s, common)) for x, s in zip(xs, scales)]
    return datas, common


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def dynamic_scale_of(y: Array, scale_dtype: Any = np.float32) -> Array:
    """A power-of-two scale close to `max |y|` (1 where that is 0, inf or NaN)."""
    amax = jnp.max(jnp.abs(y)) if y.size else jnp.zeros((), y.dtype)
    amax = amax.astype(scale_dtype)
    scale = choose_scale(amax)
    return lax.stop_gradient(jnp.where(jnp.isfinite(scale) & (scale > 0), scale, 1))


def _as_scaled(x: Any) -> ScaledArray:
    if isinstance(x, ScaledArray):
        return x
    raise TypeError(f"Expected a ScaledArray operand, got {type(x).__name__}.")


def register_linear(
    primitive: Any, scaled_operands: Sequence[int] = (0,), remark: str = ""
) -> None:
    """Register a primitive that is linear in one operand and acts on data only.

    Other operands (indices, sizes) are passed through as they are.
    """
    (index,) = scaled_operands

    def rule(*operands: Any, **params: Any) -> Any:
        x = _as_scaled(operands[index])
        args = list(operands)
        args[index] = x.data
        out = primitive.bind(*args, **params)
        if primitive.multiple_results:
            return [ScaledArray(o, x.scale) for o in out]
        return ScaledArray(out, x.scale)

    rule.__name__ = f"scaled_{primitive.name}"
    registry.register_scaled_op(primitive, rule, family="linear", remark=remark)


def register_common_scale(
    primitive: Any,
    scaled_operands: Callable[[int], Sequence[int]] | Sequence[int] | None = None,
    remark: str = "",
) -> None:
    """Register a primitive whose floating operands are brought to one common scale.

    `scaled_operands` gives the positions of the operands that carry values
    (default: every floating operand); the output takes the common scale.
    """

    def rule(*operands: Any, **params: Any) -> Any:
        if scaled_operands is None:
            positions = [i for i, o in enumerate(operands) if isinstance(o, ScaledArray)]
        elif callable(scaled_operands):
            positions = list(scaled_operands(len(operands)))
        else:
            positions = list(scaled_operands)
        positions = [i for i in positions if isinstance(operands[i], ScaledArray)]
        known = list(registry.operand_constants()) or [None] * len(operands)
        datas, scale = to_common_scale(
            *[operands[i] for i in positions], constants=[known[i] for i in positions]
        )
        args = list(operands)
        for i, d in zip(positions, datas):
            args[i] = d
        out = primitive.bind(*args, **params)
        if primitive.multiple_results:
            return [ScaledArray(o, scale) if is_floating(o) else o for o in out]
        return ScaledArray(out, scale)

    rule.__name__ = f"scaled_{primitive.name}"
    registry.register_scaled_op(primitive, rule, family="common scale", remark=remark)


def register_unscaled_unary(
    primitive: Any,
    fn: Callable[..., Array] | None = None,
    output_scale: str = "one",
    remark: str = "",
) -> None:
    """Register a non-linear elementwise primitive, computed on the unscaled value.

    The value is computed in at least float32 (`fn(value, **params)`, by default
    the primitive itself), then returned with scale 1 (`output_scale="one"`, for
    bounded or slowly growing functions) or with a dynamic power-of-two scale
    near the output's largest magnitude (`"dynamic"`, for fast-growing ones).
    """
    if output_scale not in ("one", "dynamic"):
        raise ValueError(f"Unknown output_scale {output_scale!r}.")

    def rule(*operands: Any, **params: Any) -> Any:
        xs = [_as_scaled(o) if isinstance(o, ScaledArray) else o for o in operands]
        dtype = next(o.dtype for o in xs if isinstance(o, ScaledArray))
        cdtype = compute_dtype(dtype)
        values = [unscaled_value(o, cdtype) if isinstance(o, ScaledArray) else o for o in xs]
        y = fn(*values, **params) if fn is not None else primitive.bind(*values, **params)
        return scaled_output(y, dtype, output_scale)

    rule.__name__ = f"scaled_{primitive.name}"
    registry.register_scaled_op(
        primitive, rule, family=f"unscaled ({output_scale} scale)", remark=remark
    )


def scaled_output(y: Array, dtype: Any, output_scale: str = "one") -> ScaledArray:
    """Wrap a value computed in high precision as a ScaledArray with `dtype` data."""
    if output_scale == "one":
        return ScaledArray(y.astype(dtype), np.asarray(1.0, np.float32))
    scale = dynamic_scale_of(y)
    return ScaledArray(rescale(y, 1.0 / scale, dtype), scale)


def register_unscaled_output(
    primitive: Any, scaled_operands: Sequence[int] | None = None, remark: str = ""
) -> None:
    """Register a primitive whose output is not a scaled quantity (bool, int, index).

    Its floating operands are brought to a common scale (rescaling in float32)
    and the primitive is applied to the resulting data.
    """

    def rule(*operands: Any, **params: Any) -> Any:
        positions = [
            i
            for i, o in enumerate(operands)
            if isinstance(o, ScaledArray) and (scaled_operands is None or i in scaled_operands)
        ]
        scaled = [operands[i] for i in positions]
        if len(scaled) == 1:
            x = scaled[0]
            # A zero scale represents zeros, whatever the data.
            datas = [jnp.where(jnp.asarray(x.scale) == 0, jnp.zeros_like(x.data), x.data)]
        else:
            scales = [jnp.asarray(x.scale, jnp.float32) for x in scaled]
            common = scales[0]
            for s in scales[1:]:
                common = jnp.maximum(common, s)
            cdtype = compute_dtype(scaled[0].dtype)
            datas = [
                x.data.astype(cdtype) * safe_div(s, common).astype(cdtype)
                for x, s in zip(scaled, scales)
            ]
        args = list(operands)
        for i, d in zip(positions, datas):
            args[i] = d
        return primitive.bind(*args, **params)

    rule.__name__ = f"scaled_{primitive.name}"
    registry.register_scaled_op(primitive, rule, family="unscaled output", remark=remark)


# --- Elementwise family with an explicit output-scale strategy -------------------------

OUTPUT_SCALES = (
    "one",
    "dynamic",
    "input",
    "input_at_least_one",
    "input_at_most_one",
    "ratio_at_most_one",
    "smallest_input",
)


def nonzero_or_one(scale: Array) -> Array:
    """`scale` as a float32 array, with 1 in place of 0, inf or NaN (a usable output scale)."""
    scale = jnp.asarray(scale, jnp.float32)
    return jnp.where(jnp.isfinite(scale) & (scale != 0), scale, jnp.ones_like(scale))


def finite_dynamic_scale(y: Array) -> Array:
    """A power-of-two scale near the largest finite `|y|` (1 when there is none, or it is 0).

    Infinities and NaNs are left out, so that one of them does not push every
    other element of the output to zero or infinity.
    """
    if not y.size:
        return np.asarray(1.0, np.float32)
    amag = jnp.abs(y).astype(jnp.float32)
    amax = jnp.max(jnp.where(jnp.isfinite(amag), amag, jnp.zeros_like(amag)))
    return lax.stop_gradient(nonzero_or_one(choose_scale(amax)))


def smallest_scale_for(bound: float, dtype: Any) -> float:
    """The smallest power of two `s` such that `bound / s` is at most half `dtype`'s maximum."""
    finfo = jnp.finfo(dtype)
    tiny = float(np.finfo(np.float32).tiny)
    if bound <= 0:
        return tiny
    return max(tiny, float(2.0 ** np.ceil(np.log2(2 * bound / float(finfo.max)))))


def elementwise_output_scale(
    strategy: str,
    scales: Sequence[Array],
    y: Array,
    dtype: Any = None,
    bound: float = 0.0,
    slope: Slope | None = None,
) -> Array:
    """The output scale of an elementwise function `y` of operands with `scales`.

    `strategy` is one of `OUTPUT_SCALES`:

    - `"one"`; `"dynamic"` (a power of two near the largest finite `|y|`);
    - `"input"`, `"input_at_least_one"`: the first operand's scale, or at least 1;
    - `"smallest_input"`: the smallest operand scale;
    - `"input_at_most_one"` (the first scale) and `"ratio_at_most_one"` (first /
      second), clipped to `[smallest_scale_for(bound, dtype), 1]`: for functions
      with `|f(x)| <= min(C |x|, bound)`, tiny inputs keep their precision and the
      largest output `bound` still fits the data dtype. With a `slope` (C, and
      whether `|f(x)| <= C |x|` holds everywhere or for `|x| <= 1/2` only), an
      input scale small enough for that bound to apply to every representable
      input gives the output scale `2^ceil(log2 C)` times the input scale, with no
      floor: `f(2^-60 d)` keeps `d`'s precision even in float16 (functions with
      finite limits at infinity keep the floor, so that `f(inf)` fits).

    All but `"dynamic"` depend on the scales only (so scales stay unbatched under
    `vmap`). A zero scale becomes 1.
    """
    if strategy == "one":
        return np.asarray(1.0, np.float32)
    if strategy == "dynamic":
        return finite_dynamic_scale(y)
    first = jnp.asarray(scales[0], jnp.float32)
    if strategy == "input":
        scale = first
    elif strategy == "input_at_least_one":
        scale = jnp.maximum(first, 1)
    elif strategy in ("input_at_most_one", "ratio_at_most_one"):
        if strategy == "ratio_at_most_one":
            first = safe_div(first, jnp.asarray(scales[1], jnp.float32))
            first = jnp.where(jnp.asarray(scales[1]) == 0, 1, first)
        dtype = y.dtype if dtype is None else dtype
        scale = jnp.clip(first, smallest_scale_for(bound, dtype), 1)
        if slope is not None:
            by_slope = jnp.minimum(first * slope.factor, 1)
            largest = float(jnp.finfo(dtype).max)
            if not slope.everywhere:  # only where every representable |x| <= 1/2
                by_slope = jnp.where(first * largest <= 0.5, by_slope, scale)
            if slope.saturates:  # f(+-inf) is finite: keep the floor so that it fits
                by_slope = jnp.maximum(by_slope, smallest_scale_for(bound, dtype))
            scale = by_slope
    elif strategy == "smallest_input":
        scale = first
        for s in scales[1:]:
            scale = jnp.minimum(scale, jnp.asarray(s, jnp.float32))
    else:
        raise ValueError(f"Unknown output scale strategy {strategy!r}; use one of {OUTPUT_SCALES}.")
    return lax.stop_gradient(nonzero_or_one(scale))


@dataclasses.dataclass(frozen=True)
class Slope:
    """`|f(x)| <= C |x|`, for every `x` or (`everywhere=False`) for `|x| <= 1/2`.

    `saturates`: `f(+-inf)` is finite (tanh, atan, erf): the output of an infinite
    input, which the bound does not cover, must fit, so the scale keeps its floor.
    """

    C: float
    everywhere: bool = True
    saturates: bool = False

    @property
    def factor(self) -> float:
        """The power of two `2^ceil(log2 C)`: `f(x) / (factor * s)` is at most `|x| / s`."""
        return float(2.0 ** np.ceil(np.log2(self.C)))


def register_unscaled_elementwise(
    primitive: Any,
    fn: Callable[..., Array] | None = None,
    output_scale: str = "dynamic",
    bound: float = 0.0,
    slope: Slope | None = None,
    remark: str = "",
) -> None:
    """Register an elementwise primitive computed on the unscaled values in float32.

    `fn(*values, **params)` (default: the primitive) runs on the represented
    values in at least float32, so it overflows or underflows only where the
    plain function does. The result is stored as data `y / scale` in the data
    dtype, with `scale` chosen by `output_scale` (and `bound`, the largest finite
    `|f|`, and `slope`, for the `*_at_most_one` strategies; see
    `elementwise_output_scale`).
    """
    if output_scale not in OUTPUT_SCALES:
        raise ValueError(f"Unknown output_scale {output_scale!r}; use one of {OUTPUT_SCALES}.")

    def rule(*operands: Any, **params: Any) -> Any:
        scaled = [o for o in operands if isinstance(o, ScaledArray)]
        dtype = scaled[0].dtype
        cdtype = compute_dtype(dtype)
        values = [unscaled_value(o, cdtype) if isinstance(o, ScaledArray) else o for o in operands]
        y = fn(*values, **params) if fn is not None else primitive.bind(*values, **params)
        scale = elementwise_output_scale(
            output_scale, [o.scale for o in scaled], y, dtype=dtype, bound=bound, slope=slope
        )
        data = y / jnp.asarray(scale, y.dtype)
        return ScaledArray(data.astype(dtype), jnp.asarray(scale, jnp.float32))

    rule.__name__ = f"scaled_{primitive.name}"
    registry.register_scaled_op(
        primitive, rule, family=f"unscaled ({output_scale.replace('_', ' ')} scale)", remark=remark
    )


def materialized_values(args: Sequence[Any], dtype: Any = None) -> list[Any]:
    """The represented values of the scaled operands (others unchanged)."""
    out = []
    for a in args:
        if isinstance(a, ScaledArray):
            a = a.to_array(dtype(a.dtype) if callable(dtype) else dtype)
        out.append(a)
    return out


def register_materializing(prim: Any, dtype: Any = None, remark: str = "") -> None:
    """Register a rule that calls `prim` on the represented values of its operands.

    For primitives whose outputs are not scaled quantities (callbacks, complex numbers,
    FFTs): each scaled operand is materialised in `dtype` (a dtype, a function of the
    operand's dtype, or None for its own) and the outputs are plain arrays.
    """
    if prim is None or registry.has_scaled_rule(prim):
        return

    def rule(*args: Any, **params: Any) -> Any:
        return prim.bind(*materialized_values(args, dtype), **params)

    rule.__name__ = f"scaled_{prim.name}"
    registry.register_scaled_op(prim, rule, promote=False, family="materialised", remark=remark)
