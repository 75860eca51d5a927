"""The scale algebra: what rules compute on scales, at the lowest cost.

A scale is a float32 scalar, either concrete when tracing (a static value: a constant's
power of two, or any scale outside `jit`) or traced. Every helper here folds static
scales in Python at trace time and recognises a scale shared by several operands (the
same traced value), so that the scalar work left in the program is what cannot be
known before running it:

- :func:`represent` turns an accumulated value `acc * prod(scale_i ** p_i)` into a
  ScaledArray: its output scale is that product (times an optional extra factor, such
  as a dynamic scale), kept within `[SCALE_MIN, SCALE_MAX]` only where the product
  could leave it, the rest of the factor then multiplying the data, so that values
  beyond float32 overflow elementwise as in plain float32 (and zero scales, zero
  divisors and underflow give the plain result too);
- :func:`common_scale` / :func:`at_scale`: operands brought to the largest of their
  scales (`max`, no rounding: powers of two stay powers of two);
- :func:`dynamic_scale`: the power of two of a tensor's largest finite magnitude, one
  primitive (`dynamic_scale_p`); under `vmap` it is taken over the whole batch, so the
  scale stays one scalar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
from jax import lax

from ..core import _compat
from ..core.config import Pow2RoundMode, get_autoscale_config
from ..core.datatype import ScaledArray
from ..core.pow2 import static_pow2
from ..core.scale_primitives import (
    F32,
    SCALE_MAX,
    SCALE_MIN,
    dynamic_scale,
    dynamic_scale_p,
    scale_divide_p,
    scale_root_p,
)

Array = Any
Factor = tuple[Any, int]

__all__ = [
    "SCALE_MIN",
    "SCALE_MAX",
    "static_value",
    "same_scale",
    "as_f32",
    "scale_mul",
    "scale_div",
    "represent",
    "common_scale",
    "reciprocal",
    "at_scale",
    "dynamic_scale",
    "dynamic_scale_p",
    "represent_dynamic",
    "scale_divide_p",
    "scale_root_p",
    "scale_sqrt",
]

# Powers of two applied to data in chunks that are normal float32 numbers.
_CHUNK = 2.0**126


def static_value(scale: Any) -> float | None:
    """The value of a concrete scalar scale (known when tracing), or None for a traced one."""
    if scale is None or _compat.is_tracer(scale) or np.shape(scale) != ():
        return None
    try:
        return float(np.asarray(scale, np.float64))
    except Exception:  # an abstract value without a concrete one
        return None


def same_scale(sa: Any, sb: Any) -> bool:
    """Whether two scales are known to be equal when tracing: one value, or equal constants."""
    if sa is sb:
        return True
    va, vb = static_value(sa), static_value(sb)
    return va is not None and va == vb


def as_f32(scale: Any) -> Any:
    """A scale as a float32 scalar: a NumPy float32 when static, a float32 array otherwise."""
    value = static_value(scale)
    if value is not None:
        return np.float32(value)
    if scale.dtype != F32:
        return lax.convert_element_type(scale, F32)
    return scale


def scale_mul(a: Any, b: Any) -> Any:
    """`a * b` on scales, folded when static (and skipped for a factor of 1)."""
    va, vb = static_value(a), static_value(b)
    if va is not None and vb is not None:
        with np.errstate(all="ignore"):
            return np.float32(va * vb)
    if va == 1.0:
        return as_f32(b)
    if vb == 1.0:
        return as_f32(a)
    return lax.mul(as_f32(a), as_f32(b))


def scale_div(a: Any, b: Any) -> Any:
    """`a / b` on scales, folded when static (and skipped for a divisor of 1).

    Traced, it is :data:`scale_divide_p` (exact for a power-of-two divisor, without the
    division instruction XLA will not fuse), or a true division with
    `Pow2RoundMode.NONE`, whose scales are not powers of two.
    """
    va, vb = static_value(a), static_value(b)
    if va is not None and vb is not None:
        with np.errstate(all="ignore"):
            return np.float32(np.float64(va) / np.float64(vb))
    if vb == 1.0:
        return as_f32(a)
    if get_autoscale_config().rounding_mode == Pow2RoundMode.NONE:
        return lax.div(as_f32(a), as_f32(b))
    return scale_divide_p.bind(*_compat.match_varying(as_f32(a), as_f32(b)), zero_gives_inf=True)


def _scale_power(scale: Any, power: int) -> Any:
    out = as_f32(scale)
    for _ in range(abs(power) - 1):
        out = lax.mul(out, as_f32(scale))
    return out


def _multiply_static(data: Array, factor: float, cdtype: Any) -> Array:
    """`data * factor` for a static factor, in chunks that float32 holds (overflow -> inf)."""
    if factor == 1.0:
        return data
    out = data.astype(cdtype)
    if factor == 0.0 or not np.isfinite(factor):
        return out * np.asarray(factor, cdtype)
    while factor > _CHUNK or factor < 1.0 / _CHUNK:
        chunk = _CHUNK if factor > 1.0 else 1.0 / _CHUNK
        out = out * np.asarray(chunk, cdtype)
        factor /= chunk
    return out * np.asarray(factor, cdtype)


def _compute_dtype(dtype: Any) -> Any:
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else F32


def represent(
    acc: Array,
    factors: Sequence[Factor],
    dtype: Any,
    extra: Any = None,
) -> ScaledArray:
    """`acc * prod(scale ** power)` as a ScaledArray with `dtype` data.

    The output scale is the product of the factors, times `extra` when given (a scale
    chosen for the data, e.g. :func:`dynamic_scale` of `acc`: the data is then
    `acc / extra`). Static factors are folded at trace time. Where the product could
    leave `[SCALE_MIN, SCALE_MAX]` it is clamped into it and the rest multiplies the
    data (computed in float32), so that values beyond float32's range become +-inf and
    values below it 0, elementwise, as in plain float32; a zero divisor scale gives
    `+-inf` / NaN as plain division by zero does. When the product is known to stay in
    range (static, or one traced scale times a static factor of at most 1), no scalar
    work is added at all.
    """
    static = 1.0
    traced: list[Factor] = []
    for scale, power in factors:
        if power == 0:
            continue
        value = static_value(scale)
        if value is None:
            traced.append((scale, power))
        else:
            with np.errstate(all="ignore"):
                static *= float(np.float64(value) ** power)
    extra_value = static_value(extra) if extra is not None else 1.0
    cdtype = _compute_dtype(acc.dtype)

    if not traced and extra_value is not None:
        out = static * extra_value
        if out == 0.0 or SCALE_MIN <= out <= SCALE_MAX:
            data = acc if extra_value == 1.0 else _multiply_static(acc, 1.0 / extra_value, cdtype)
            return ScaledArray(data.astype(dtype), np.float32(out))
        scale = float(np.clip(out, SCALE_MIN, SCALE_MAX)) if np.isfinite(out) else SCALE_MAX
        with np.errstate(all="ignore"):
            ratio = static / scale if np.isfinite(static) else static
        return ScaledArray(_multiply_static(acc, ratio, cdtype).astype(dtype), np.float32(scale))

    # The product of the traced factors, the static one and `extra`.
    product: Any = None
    for scale, power in traced:
        term = _scale_power(scale, power)
        if product is None:
            product = term if power > 0 else scale_div(np.float32(1.0), term)
        else:
            product = lax.mul(product, term) if power > 0 else scale_div(product, term)
    if product is None:
        product = np.float32(static)
    elif static != 1.0:
        product = lax.mul(product, np.float32(static))
    if extra is not None and extra_value is None:
        product = lax.mul(product, as_f32(extra))
    elif extra_value != 1.0:
        product = lax.mul(product, np.float32(extra_value))

    single = len(traced) == 1 and traced[0][1] == 1 and extra_value is not None
    if single and static * extra_value <= 1.0:
        # One traced scale times a static factor at most 1: it can only underflow (to a
        # scale that represents what plain float32 flushes to zero anyway).
        data = acc if extra_value == 1.0 else _multiply_static(acc, 1.0 / extra_value, cdtype)
        return ScaledArray(data.astype(dtype), product)
    out_scale = lax.clamp(np.float32(SCALE_MIN), product, np.float32(SCALE_MAX))
    # ratio = prod(factors) / out_scale, one factor at a time, in an order that neither
    # overflows nor divides a zero factor's product by a tiny out_scale (0 * inf).
    numerators = [as_f32(scale) for scale, power in traced for _ in range(max(power, 0))]
    denominators = [as_f32(scale) for scale, power in traced for _ in range(max(-power, 0))]
    if len(numerators) == 2 and numerators[0] is not numerators[1]:
        # The smaller one first: it is the one that is small when the product is clamped
        # from below (a zero scale included), and it is not when clamped from above.
        numerators = [lax.min(*numerators), lax.max(*numerators)]
    if numerators:
        ratio = scale_div(numerators[0], out_scale)
        for scale in numerators[1:]:
            ratio = lax.mul(ratio, scale)
    else:
        ratio = scale_div(np.float32(1.0), out_scale)
    for scale in denominators:
        ratio = scale_div(ratio, scale)
    if static != 1.0:
        ratio = lax.mul(ratio, np.float32(static))
    if sum(abs(power) for _, power in traced) + (static != 1.0) > 2:
        # A ratio of three factors or more may overflow float32 itself (x ** 3 with a scale
        # beyond 2^43): capped, it still overflows every nonzero datum, and zeros stay zero.
        ratio = lax.min(ratio, np.float32(2.0**127))
    data = acc.astype(cdtype) * ratio.astype(cdtype)
    return ScaledArray(data.astype(dtype), out_scale)


def common_scale(scales: Sequence[Any]) -> Any:
    """The largest of `scales` (static zeros, i.e. known zeros, need no scale).

    Shared and static scales are folded. It may be 0 when every operand's scale is: the
    ratios of :func:`at_scale` are then 0 (with `Pow2RoundMode.NONE`, whose ratios are
    true divisions, a traced result is floored at `SCALE_MIN` instead).
    """
    unique: list[Any] = []
    static_max: float | None = None
    for scale in scales:
        value = static_value(scale)
        if value is not None:
            static_max = value if static_max is None else max(static_max, value)
        elif not any(scale is u for u in unique):
            unique.append(scale)
    if not unique:
        return np.float32(static_max if static_max is not None else 1.0)
    out = as_f32(unique[0])
    for scale in unique[1:]:
        out = lax.max(out, as_f32(scale))
    if static_max is not None and static_max > 0:
        return lax.max(out, np.float32(static_max))
    if len(unique) > 1 and get_autoscale_config().rounding_mode == Pow2RoundMode.NONE:
        return lax.max(out, np.float32(SCALE_MIN))
    return out


def reciprocal(scale: Any) -> Any:
    """`1 / scale` for ratios to it: 2^127 for a zero scale (so that the ratio of a zero
    scale to it is 0, not NaN), exact for powers of two, no division instruction."""
    value = static_value(scale)
    if value is not None:
        return np.float32(min(1.0 / value, 2.0**127) if value else 2.0**127)
    if get_autoscale_config().rounding_mode == Pow2RoundMode.NONE:
        return lax.div(np.float32(1.0), as_f32(scale))
    return scale_divide_p.bind(np.float32(1.0), as_f32(scale), zero_gives_inf=False)


def at_scale(
    data: Array, scale_in: Any, scale_out: Any, dtype: Any = None, inverse_out: Any = None
) -> Array:
    """`data` (at `scale_in`) brought to `scale_out`, in `dtype` (default: data's).

    No work when the scales are the same; a zero `scale_in` gives (signed) zeros. Pass
    `inverse_out` (:func:`reciprocal` of `scale_out`) when bringing several operands to
    one scale, so that it is computed once.
    """
    dtype = data.dtype if dtype is None else dtype
    if same_scale(scale_in, scale_out):
        return data.astype(dtype)
    if static_value(scale_in) == 0.0:  # known zeros
        return data.astype(dtype) * np.asarray(0, dtype)
    v_in, v_out = static_value(scale_in), static_value(scale_out)
    if v_in is not None and v_out is not None:
        ratio: Any = np.float64(v_in) / np.float64(v_out) if v_out else 0.0
    else:
        inverse = reciprocal(scale_out) if inverse_out is None else inverse_out
        ratio = scale_mul(scale_in, inverse)
    static = static_value(ratio)
    if static is None:
        return data.astype(dtype) * ratio.astype(dtype)
    finfo = ml_dtypes.finfo(dtype)
    if static == 0.0 or float(finfo.tiny) <= abs(static) <= float(finfo.max):
        return data.astype(dtype) * np.asarray(static, dtype)
    return _multiply_static(data, static, _compute_dtype(dtype)).astype(dtype)


def scale_sqrt(scale: Any, round_up: bool = False) -> Any:
    """The power of two `pow2_round(sqrt(scale))` (down, or up), by exponent arithmetic.

    A choice of scale: excluded from autodiff. Zero gives 2^-64 (any scale represents zeros).
    """
    value = static_value(scale)
    if value is not None:
        mode = Pow2RoundMode.UP if round_up else Pow2RoundMode.DOWN
        return np.float32(static_pow2(np.sqrt(value), mode) if value > 0 else 2.0**-64)
    return scale_root_p.bind(as_f32(scale), degree=2, round_up=round_up)


def represent_dynamic(acc: Array, factors: Sequence[Factor], dtype: Any) -> ScaledArray:
    """`acc * prod(scale ** power)` as a ScaledArray whose scale follows the value.

    The output scale `t` is the power of two of the value's largest finite magnitude
    (:data:`dynamic_scale_p` of `|acc| * prod`, one reduction), and the data is
    `acc * (prod / t)`: its largest magnitude is in [1, 2), values beyond float32's range
    overflow elementwise, and tiny values keep their precision (the value itself is never
    formed). `t` depends on the data only, not on the input scales: the scalar work that
    XLA fuses into each kernel does not grow along the program.
    """
    cdtype = _compute_dtype(acc.dtype)
    acc = acc.astype(cdtype)
    static = 1.0
    product: Any = None
    for scale, power in factors:
        if power == 0:
            continue
        known = static_value(scale)
        if known is not None:
            with np.errstate(all="ignore"):
                static *= float(np.float64(known) ** power)
            continue
        term = _scale_power(scale, power)
        if power < 0:
            term = scale_div(np.float32(1.0), term)
        product = term if product is None else lax.mul(product, term)
    if not (static == 0.0 or SCALE_MIN <= abs(static) <= SCALE_MAX):
        # A static product beyond float32's range (huge or tiny constant scales): formed
        # without overflow by the static path, which moves the excess into the data.
        return represent(acc, factors, dtype)
    if product is None:
        product = np.float32(static)
    elif static != 1.0:
        product = lax.mul(product, np.float32(static))
    scale, inverse = dynamic_scale_p.bind(acc, product)
    ratio = scale_mul(product, inverse)
    return ScaledArray((acc * as_f32(ratio).astype(cdtype)).astype(dtype), scale)
