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
from ..core.delayed import site_recorder
from ..core.dtypes import compute_dtype
from ..core.pow2 import static_pow2
from ..core.scale_arithmetic import (
    F32,
    SCALE_MAX,
    SCALE_MIN,
    common_scale_p,
    dynamic_scale,
    dynamic_scale_p,
    is_pow2,
    largest_finite_magnitudes_p,
    mark_pow2,
    scale_divide_p,
    scale_of_magnitude,
    scale_product_p,
    scale_root_p,
)
from ..core.types import Array

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
    "common_ratios",
    "at_scale_ratio",
    "apply_ratio",
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
        converted = lax.convert_element_type(scale, F32)
        return mark_pow2(converted) if is_pow2(scale) else converted
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
    out = lax.mul(as_f32(a), as_f32(b))
    return mark_pow2(out) if is_pow2(a) and is_pow2(b) else out


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
    out = scale_divide_p.bind(
        *_compat.match_varying(as_f32(a), as_f32(b)), zero_gives_inf=True, pow2=is_pow2(b)
    )
    return mark_pow2(out) if is_pow2(a) and is_pow2(b) else out


def _scale_power(scale: Any, power: int) -> Any:
    out = as_f32(scale)
    for _ in range(abs(power) - 1):
        out = scale_mul(out, scale)
    return out


def _multiply_static(data: Array, factor: float, cdtype: Any) -> Array:
    """`data * factor` for a static factor, in chunks that float32 holds (overflow -> inf)."""
    if factor == 1.0:
        return data
    out = data.astype(cdtype)
    if factor == 0.0 or not np.isfinite(factor):
        return out * np.asarray(factor, cdtype)
    # On the magnitude: a finite non-zero float64 is within 2^+-1075, at most 9 chunks of
    # 2^126 from [2^-126, 2^126], so the loop ends for every factor (a negative one too).
    magnitude = abs(float(factor))
    while magnitude > _CHUNK or magnitude < 1.0 / _CHUNK:
        chunk = _CHUNK if magnitude > 1.0 else 1.0 / _CHUNK
        out = out * np.asarray(chunk, cdtype)
        magnitude /= chunk
    return out * np.asarray(np.copysign(magnitude, factor), cdtype)


def represent(
    acc: Array,
    factors: Sequence[Factor],
    dtype: Any,
    extra: float = 1.0,
) -> ScaledArray:
    """`acc * prod(scale ** power)` as a ScaledArray with `dtype` data.

    The output scale is the product of the factors, times the static `extra` (a factor
    chosen for the data, such as the unit-scaling `sqrt(K)` of a contraction: the data is
    then `acc / extra`). Static factors are folded at trace time. Where the product could
    leave `[SCALE_MIN, SCALE_MAX]`, :data:`scale_product_p` clamps it into that range and
    returns the rest, which multiplies the data (in float32), so that values beyond
    float32's range become +-inf and values below it 0, elementwise, as in plain
    float32; a zero divisor scale gives `+-inf` / NaN as plain division by zero does.
    When the product is known to stay in range (static, or one traced scale times a
    static factor of at most 1), it is formed directly.
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
    cdtype = compute_dtype(acc.dtype)
    data_factor = 1.0 / extra  # what the data is multiplied by, beside the clamped excess
    static *= extra

    if not traced:
        if static == 0.0 or SCALE_MIN <= static <= SCALE_MAX:
            data = _multiply_static(acc, data_factor, cdtype).astype(dtype)
            return ScaledArray(data, np.float32(static))
        scale = float(np.clip(static, SCALE_MIN, SCALE_MAX)) if np.isfinite(static) else SCALE_MAX
        with np.errstate(all="ignore"):
            ratio = static / scale if np.isfinite(static) else static
        data = _multiply_static(acc, ratio * data_factor, cdtype)
        return ScaledArray(data.astype(dtype), np.float32(scale))

    if len(traced) == 1 and traced[0][1] == 1 and static <= 1.0:
        # One traced scale times a static factor at most 1: it can only underflow (to a
        # scale that represents what plain float32 flushes to zero anyway).
        product = scale_mul(traced[0][0], np.float32(static))
        return ScaledArray(_multiply_static(acc, data_factor, cdtype).astype(dtype), product)
    if not (SCALE_MIN <= static <= SCALE_MAX):
        # A static factor beyond float32's range (a huge or tiny constant) multiplies the
        # data itself, in chunks, instead of entering the scale product.
        data_factor *= static
        static = 1.0
    operands = [as_f32(scale) for scale, _ in traced]
    powers = tuple(power for _, power in traced)
    if static != 1.0:
        operands.append(np.float32(static))
        powers += (1,)
    pow2 = all(is_pow2(operand) for operand in operands)
    out_scale, ratio = scale_product_p.bind(
        *_compat.match_varying(*operands), powers=powers, pow2=pow2
    )
    mark_pow2(out_scale)  # a power of two always (rounded up when the factors are not)
    if pow2:
        mark_pow2(ratio)
    data = acc.astype(cdtype) * ratio.astype(cdtype)
    return ScaledArray(_multiply_static(data, data_factor, cdtype).astype(dtype), out_scale)


def common_scale(scales: Sequence[Any]) -> Any:
    """The largest of `scales` (see :func:`common_ratios`, which also gives the ratios)."""
    return common_ratios(scales)[0]


def common_ratios(
    scales: Sequence[Any], wanted: Sequence[Any] | None = None
) -> tuple[Any, list[Any]]:
    """The largest of `scales` and each scale's ratio to it: `(common, [s_i / common])`.

    `wanted`, when given, is the scale each operand asks for, which may be smaller than
    its own when it is static (a constant asks only for the smallest scale it fits at):
    the common scale is the largest wanted one, the ratios are of the operands' scales.
    Static scales are folded and a scale shared by several operands counts once; known
    zeros (static scale 0) need no scale and get ratio 0. Traced, it is one
    :data:`common_scale_p` (the ratios of powers of two are exact; a zero common scale
    gives ratios 0). With `Pow2RoundMode.NONE` the ratios are true divisions by a
    common scale floored at `SCALE_MIN`.
    """
    wanted = list(scales) if wanted is None else list(wanted)
    values = [static_value(scale) for scale in scales]
    unique: list[Any] = []  # distinct traced wanted scales: they take part in the max
    static_max = 0.0
    any_static = False
    for w in wanted:
        value = static_value(w)
        if value is None:
            if not any(w is u for u in unique):
                unique.append(w)
        else:
            any_static = True
            static_max = max(static_max, value)
    if not unique:
        static_common = np.float32(static_max if any_static else 1.0)
        return static_common, [at_scale_ratio(scale, static_common) for scale in scales]
    if get_autoscale_config().rounding_mode == Pow2RoundMode.NONE:
        traced_common: Any = as_f32(unique[0])
        for scale in unique[1:]:
            traced_common = lax.max(traced_common, as_f32(scale))
        if static_max > 0.0:
            traced_common = lax.max(traced_common, np.float32(max(static_max, SCALE_MIN)))
        return traced_common, [at_scale_ratio(scale, traced_common) for scale in scales]
    operands = [as_f32(scale) for scale in unique]
    if static_max > 0.0:
        # Floored at a normal number: XLA flushes subnormal scales (and their ratios) to 0.
        operands.append(np.float32(max(static_max, SCALE_MIN)))
    num_wanted = len(operands)
    # Operands' scales that are not among the wanted ones (a constant's, which asks for
    # less than it has) get their ratios from extra operands, which are not in the max.
    extra: list[Any] = []
    for scale, value in zip(scales, values, strict=True):
        if value == 0.0 or (value is None and any(scale is u for u in unique)):
            continue
        if value is None:
            if not any(scale is e for e in extra):
                extra.append(scale)
        elif not any(static_value(e) == value for e in extra):
            extra.append(np.float32(value))
    if num_wanted == 1 and not extra:  # one traced scale, beside known zeros
        return unique[0], [0.0 if value == 0.0 else 1.0 for value in values]
    extra_f32 = [as_f32(e) for e in extra]
    pow2 = all(is_pow2(operand) for operand in operands)
    common, *all_ratios = common_scale_p.bind(
        *_compat.match_varying(*operands, *extra_f32), num_wanted=num_wanted, pow2=pow2
    )
    mark_pow2(common)  # a power of two always (rounded up when the wanted are not)
    for operand, ratio in zip(operands + extra_f32, all_ratios, strict=True):
        if is_pow2(operand):
            mark_pow2(ratio)
    ratios = []
    for scale, value in zip(scales, values, strict=True):
        if value == 0.0:
            ratios.append(0.0)
        elif value is None and any(scale is u for u in unique):
            ratios.append(all_ratios[next(i for i, u in enumerate(unique) if u is scale)])
        elif value is None:
            ratios.append(
                all_ratios[num_wanted + next(i for i, e in enumerate(extra) if e is scale)]
            )
        else:
            index = next(i for i, e in enumerate(extra) if static_value(e) == value)
            ratios.append(all_ratios[num_wanted + index])
    return common, ratios


def at_scale_ratio(scale_in: Any, scale_out: Any) -> Any:
    """`scale_in / scale_out` (0 for a known zero `scale_in`), folded when static."""
    v_in, v_out = static_value(scale_in), static_value(scale_out)
    if v_in == 0.0:
        return 0.0
    if v_in is not None and v_out is not None:
        return float(np.float64(v_in) / np.float64(v_out)) if v_out else 0.0
    if get_autoscale_config().rounding_mode == Pow2RoundMode.NONE:
        return lax.div(as_f32(scale_in), as_f32(scale_out))
    return scale_div(scale_in, scale_out)


_F32_MIN_EXP = int(np.finfo(np.float32).minexp)


def apply_ratio(data: Array, ratio: Any, dtype: Any = None) -> Array:
    """`data * ratio` in `dtype` (default: data's); nothing to do for a static ratio of 1."""
    dtype = data.dtype if dtype is None else dtype
    static = static_value(ratio) if not isinstance(ratio, float) else ratio
    if static is None:
        if ml_dtypes.finfo(dtype).minexp > _F32_MIN_EXP:
            # A ratio below the format's range (a tensor with no magnitude, at SCALE_MIN,
            # joining others) would round to 0 there and turn its infinities into NaN.
            return (data.astype(F32) * as_f32(ratio)).astype(dtype)
        return data.astype(dtype) * ratio.astype(dtype)
    if static == 1.0:
        return data.astype(dtype)
    finfo = ml_dtypes.finfo(dtype)
    if static == 0.0 or float(finfo.tiny) <= abs(static) <= float(finfo.max):
        return data.astype(dtype) * np.asarray(static, dtype)
    return _multiply_static(data, static, compute_dtype(dtype)).astype(dtype)


def reciprocal(scale: Any) -> Any:
    """`1 / scale` for ratios to it: 2^127 for a zero scale (so that the ratio of a zero
    scale to it is 0, not NaN), exact for powers of two, no division instruction."""
    value = static_value(scale)
    if value is not None:
        return np.float32(min(1.0 / value, 2.0**127) if value else 2.0**127)
    if get_autoscale_config().rounding_mode == Pow2RoundMode.NONE:
        return lax.div(np.float32(1.0), as_f32(scale))
    pow2 = is_pow2(scale)
    out = scale_divide_p.bind(np.float32(1.0), as_f32(scale), zero_gives_inf=False, pow2=pow2)
    return mark_pow2(out) if pow2 else out


def at_scale(data: Array, scale_in: Any, scale_out: Any, dtype: Any = None) -> Array:
    """`data` (at `scale_in`) brought to `scale_out`, in `dtype` (default: data's).

    No work when the scales are the same; a zero `scale_in` gives (signed) zeros. To
    bring several operands to their largest scale, use :func:`common_ratios`.
    """
    if same_scale(scale_in, scale_out):
        return data.astype(data.dtype if dtype is None else dtype)
    return apply_ratio(data, at_scale_ratio(scale_in, scale_out), dtype)


def scale_sqrt(scale: Any, round_up: bool = False) -> Any:
    """The power of two `pow2_round(sqrt(scale))` (down, or up), by exponent arithmetic.

    A choice of scale: excluded from autodiff. Zero gives 2^-64 (any scale represents zeros).
    """
    value = static_value(scale)
    if value is not None:
        mode = Pow2RoundMode.UP if round_up else Pow2RoundMode.DOWN
        return np.float32(static_pow2(np.sqrt(value), mode) if value > 0 else 2.0**-64)
    return mark_pow2(scale_root_p.bind(as_f32(scale), degree=2, round_up=round_up))


def _clamped_dynamic_scale(acc: Array, static: float) -> Array:
    """The dynamic scale of `acc * static` for a static factor beyond float32's range: the
    power of two of `acc`'s largest magnitude times the factor, in two float32 halves,
    clamped to `[SCALE_MIN, SCALE_MAX]` as the dynamic scale is."""
    half = float(2.0 ** np.clip(np.floor(np.log2(abs(static)) / 2), -126, 126))
    rest = float(np.clip(abs(static) / half, 2.0**-126, 2.0**126))
    # A history's scale (1 where there is no magnitude, as `scale_of_magnitude` gives).
    of_acc = scale_of_magnitude(largest_finite_magnitudes_p.bind(acc, np.float32(1.0)))[0]
    product = of_acc * np.float32(half) * np.float32(rest)
    return lax.clamp(np.float32(SCALE_MIN), product, np.float32(SCALE_MAX))


def represent_dynamic(
    acc: Array, factors: Sequence[Factor], dtype: Any, *, delayable: bool = False
) -> ScaledArray:
    """`acc * prod(scale ** power)` as a ScaledArray whose scale follows the value.

    The output scale `t` is the power of two of the value's largest finite magnitude
    (:data:`dynamic_scale_p` of `|acc| * prod`, one reduction), and the data is
    `acc * (prod / t)`: its largest magnitude is in [1, 2), values beyond float32's range
    overflow elementwise, and tiny values keep their precision (the value itself is never
    formed). `t` depends on the data only, not on the input scales: the scalar work that
    XLA fuses into each kernel does not grow along the program.

    `delayable`: a site of `jsa.delayed_scaling` (a sum or contraction) when one is being
    traced here: `t` is recorded for the next step's history, and the output takes the
    site's held scale from the earlier steps instead (the data then does not wait for its
    own reduction).
    """
    cdtype = compute_dtype(acc.dtype)
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
        product = term if product is None else scale_mul(product, term)
    recorder = site_recorder() if delayable else None
    description = f"{np.dtype(dtype).name}{list(np.shape(acc))}"
    if not (static == 0.0 or SCALE_MIN <= abs(static) <= SCALE_MAX):
        # A static product beyond float32's range (huge or tiny constant scales): formed
        # without overflow by the static path, which moves the excess into the data. Still
        # a site (the sites of a program do not depend on its scales' values).
        if recorder is not None:
            recorder.record(_clamped_dynamic_scale(acc, static), np.float32(1.0), description)
        return represent(acc, factors, dtype)
    if product is None:
        product = np.float32(static)
    elif static != 1.0:
        product = scale_mul(product, np.float32(static))
    if recorder is not None and recorder.holding:
        # Measured for the next step's history only: the largest magnitude of
        # `acc * product`, reduced with every other site's at the end of the step; the data
        # takes the held scale.
        scale = mark_pow2(recorder.record(acc, product, description))
        ratio = scale_div(product, scale)
    else:
        scale, ratio = dynamic_scale_p.bind(*_compat.match_varying(acc, product))
        mark_pow2(scale)
        if recorder is not None:
            # Measured again for the history (its scale is 1 where the output is all zero,
            # where the dynamic scale is SCALE_MIN: a held SCALE_MIN would overflow the
            # site's first nonzero output).
            recorder.record(acc, product, description)
    if is_pow2(product):
        mark_pow2(ratio)
    return ScaledArray((acc * ratio.astype(cdtype)).astype(dtype), scale)
