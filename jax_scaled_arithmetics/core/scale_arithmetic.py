"""Scalar primitives of the scale algebra, cheap for XLA to fuse.

XLA does not fuse a scalar division or square root into the elementwise operations that
broadcast it (it would recompute it per element), so each becomes a kernel of its own, and
compile time grows with their number; and XLA copies the cheap scalar work a kernel needs
into every kernel. Scales are powers of two: dividing by one, or taking its root, is
exponent arithmetic, which fuses like a multiply. These primitives are that arithmetic,
and the dynamic scale (a tensor's largest finite magnitude, as a power of two) that lets
a rule's output scale follow its data.

Each is the identity-free, pure function of its operands on plain arrays: it runs, jits,
vmaps and differentiates outside `autoscale` (derivatives of chosen scales are zero).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import jax
import numpy as np
from jax import lax

from . import _compat
from .define import batch_along_operand_0, define_primitive, zero_tangents
from .types import Array

__all__ = [
    "F32",
    "SCALE_MIN",
    "SCALE_MAX",
    "dynamic_scale",
    "dynamic_scale_p",
    "largest_finite_magnitudes_p",
    "largest_of_each",
    "largest_of_several",
    "partial_maxima",
    "stacked_in_pieces",
    "unstacked_in_pieces",
    "UNSTACK_PIECE",
    "scale_of_magnitude",
    "common_scale_p",
    "scale_divide_p",
    "scale_product_p",
    "scale_root_p",
    "is_pow2",
    "mark_pow2",
    "materialize_impl",
    "largest_magnitude",
    "split_long_axes",
    "max_in_one_kernel",
]

F32 = np.dtype(np.float32)
# Scales computed by rules stay in this range: their reciprocals are normal float32 numbers
# (XLA may divide by multiplying with a reciprocal, which it flushes to zero if subnormal).
SCALE_MIN = 2.0**-124
SCALE_MAX = 2.0**126

# --- scales known to be powers of two -----------------------------------------------------

# Traced scales that rules produced as powers of two (dynamic scales, their products,
# ratios and roots), by identity: the primitives skip the mantissa work for them. Weak:
# an entry lives as long as its tracer.
_KNOWN_POW2: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def mark_pow2(scale: Any) -> Any:
    """Record that the traced `scale` is a power of two (or 0 or inf); returns it."""
    if _compat.is_tracer(scale):
        _KNOWN_POW2[id(scale)] = scale
    return scale


def is_pow2(scale: Any) -> bool:
    """Whether `scale` is known, when tracing, to be a power of two (or 0 or inf)."""
    if _compat.is_tracer(scale):
        return _KNOWN_POW2.get(id(scale)) is scale
    try:
        value = float(np.asarray(scale, np.float64))
    except Exception:  # an abstract value, or not a scalar
        return False
    return value == 0.0 or not np.isfinite(value) or abs(np.frexp(value)[0]) == 0.5


# --- division and roots of scales ---------------------------------------------------------

_EXPONENT_MASK = np.int32(0x7F800000)
_MANTISSA_MASK = np.int32(0x007FFFFF)
_TWO_127 = np.int32(254 << 23)  # the bits of 2^127


def _reciprocal_of_mantissa(mantissa_bits: Array) -> Array:
    """1 / m for m = 1.mantissa in [1, 2), exactly 1 for m = 1 (Newton's iterations)."""
    half_m = lax.bitcast_convert_type(mantissa_bits | np.int32(126 << 23), F32)  # m / 2
    x = np.float32(48.0 / 17.0) - np.float32(32.0 / 17.0) * half_m
    for _ in range(3):
        x = x * (np.float32(2.0) - half_m * x)
    return lax.select(mantissa_bits == 0, lax.full_like(x, 1.0), x * np.float32(0.5))


def materialize_impl(scale: Array, *, scalars: bool = False) -> Array:
    """`scale` unchanged, ending in a division, so that XLA computes it once per element.

    XLA:CPU fuses cheap elementwise producers into their consumers and recomputes them for
    every element a consumer reads: a block scale's arithmetic (ratios, the bits of powers
    of two) broadcast over its block's data would run once per data element instead of once
    per block (docs/benchmarks.md, "Block scales"). A division is one of the "expensive"
    operations XLA does not duplicate into a consumer that reuses its elements, so the
    scale is materialised. Dividing by `scale == scale` (1; 0 for a NaN scale, whose block is NaN
    anyway) is exact and cannot be simplified away. Scalars are left alone unless
    `scalars`: a scalar that many kernels read is materialised so that XLA does not copy its
    producers into each (the interpreter's fan-out rule, and on XLA:CPU the scale each
    scale primitive returns: `_materialized`)."""
    if np.ndim(scale) == 0 and not scalars:
        return scale
    one = lax.convert_element_type(lax.eq(scale, scale), scale.dtype)
    return lax.div(scale, one)


def _scale_divide_impl(a: Array, b: Array, *, zero_gives_inf: bool, pow2: bool = False) -> Array:
    """`a / b` (0 for inf `b`; inf or 2^127 * a for zero `b`). With `pow2`, `b` is known to
    be a power of two (or 0 or inf): its mantissa is not read, a few operations fewer. Array
    results (block scales) are materialised (`materialize_impl`)."""
    bits = lax.bitcast_convert_type(b, np.int32)
    exponent = bits & _EXPONENT_MASK
    inverse_bits = lax.clamp(np.int32(0), _TWO_127 - exponent, _TWO_127)
    inverse = lax.bitcast_convert_type(inverse_bits, F32)  # 2^-e (0 for inf, 2^127 for 0)
    if not pow2:
        inverse = inverse * _reciprocal_of_mantissa(bits & _MANTISSA_MASK)
    if zero_gives_inf:
        inverse = lax.select(b == 0, lax.full_like(inverse, np.inf), inverse)
    return materialize_impl(a * inverse)


# --- the lowerings on XLA:CPU: each scale computed once ------------------------------------
#
# Left to XLA:CPU, the exponent arithmetic that forms a scale (a clamp, a rounding up, the
# bits of a product) is copied into every kernel that reads the scale or a ratio formed
# from it: each kernel carries its operands' whole chain, no two are alike, and each is
# compiled by LLVM on its own (XLA:CPU compiles identical kernels once). So on XLA:CPU the
# scale that `common_scale` and `scale_product` return (and `scale_root`'s root) is
# materialised (`_materialized`): one small kernel, read by the others (a dynamic scale, a
# reduction's result and a few instructions, is left to XLA). The ratios are the default
# lowering's exponent arithmetic on that materialised scale, a few instructions fused into
# the kernels that multiply data by them; the values are the default lowering's bit for
# bit (tests/core/test_scale_arithmetic.py). Each ratio was once a division of its own too
# (one kernel each): twice the kernels and slower steps, for the same compile time, once
# the interpreter stopped XLA recomputing rescaled tensors in every reader
# (docs/benchmarks.md, "Scales computed once, ratios fused").


def _materialized(scale: Array) -> Array:
    """A scale that an XLA:CPU lowering returns, computed once in a kernel of its own."""
    return materialize_impl(scale, scalars=True)


def _as_computed(scale: Array) -> Array:
    """A scale that the default lowering returns: left to XLA."""
    return scale


def _elementwise_batch(primitive: Any, args: Any, dims: Any, **params: Any) -> Any:
    """Batching of an elementwise primitive: every operand with the batch axis first."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    moved = []
    for x, d in zip(args, dims):
        if d is None:
            moved.append(lax.broadcast(x, (size,)))
        else:
            moved.append(jax.numpy.moveaxis(x, d, 0))
    return primitive.bind(*moved, **params), 0


def _scale_divide_jvp(primitive: Any, primals: Any, tangents: Any, **params: Any) -> Any:
    a, b = primals
    da, db = (_compat.instantiate_zeros(t) for t in tangents)
    out = primitive.bind(a, b, **params)
    inverse = primitive.bind(lax.full_like(b, 1.0), b, **params)
    return out, da * inverse - out * inverse * db


def _scale_divide_arrays(a: Any, b: Any, **params: Any) -> Array:
    return _scale_divide_impl(jax.numpy.asarray(a), jax.numpy.asarray(b), **params)


scale_divide_p = define_primitive(
    "scale_divide",
    _scale_divide_arrays,
    lambda a, b, **params: a if a.ndim >= b.ndim else b,
    batching=_elementwise_batch,
    jvp=_scale_divide_jvp,
)


def _scale_root_impl(scale: Array, *, degree: int, round_up: bool) -> Array:
    bits = lax.bitcast_convert_type(scale, np.int32)
    exponent = lax.shift_right_arithmetic(bits & _EXPONENT_MASK, np.int32(23)) - np.int32(127)
    root = lax.shift_right_arithmetic(exponent, np.int32(1)) if degree == 2 else exponent
    if round_up:  # up unless the scale is an even power of two
        exact = ((bits & _MANTISSA_MASK) == 0) & ((exponent & np.int32(1)) == 0)
        root = root + lax.convert_element_type(~exact, np.int32)
    return lax.bitcast_convert_type(lax.shift_left(root + np.int32(127), np.int32(23)), F32)


scale_root_p = define_primitive(
    "scale_root",
    _scale_root_impl,
    lambda scale, **params: scale,
    batching=batch_along_operand_0,
    jvp=zero_tangents,  # a chosen scale: no derivative
    cpu_impl=lambda scale, **params: _materialized(_scale_root_impl(scale, **params)),
)


def _pow2_up(scale: Array) -> Array:
    """The power of two at or above a non-negative scale (0 stays 0, inf stays inf).

    `scale * (2 - 2^-23)` rounds to a number in [2^e, 2^(e+1)) for `scale` 2^e, and in
    [2^(e+1), 2^(e+2)) for any scale in (2^e, 2^(e+1)): its exponent bits are the answer
    (three instructions; beyond 2^127 the product overflows to inf, as the answer does)."""
    product = lax.bitcast_convert_type(scale * _JUST_BELOW_TWO, np.int32)
    return lax.bitcast_convert_type(product & _EXPONENT_MASK, F32)


_JUST_BELOW_TWO = np.float32(2.0 - 2.0**-23)


def _reciprocal(scale: Array, pow2: bool = False) -> Array:
    """`1 / scale` without a division: exact for powers of two, 2^127 for 0, 0 for inf."""
    return _scale_divide_impl(np.float32(1.0), scale, zero_gives_inf=False, pow2=pow2)


def _multi_output(name: str, impl: Any, jvp: Any, count: Any) -> Any:
    """A primitive of scalar scales with `count(num_operands, **params)` scalar outputs: the
    first a scale, the others ratios; on XLA:CPU `impl` with its scale materialised."""

    def batch(primitive: Any, args: Any, dims: Any, **params: Any) -> Any:
        outs, _ = _elementwise_batch(primitive, args, dims, **params)
        return outs, [0] * len(outs)

    def arrays_impl(*scales: Any, **params: Any) -> Any:
        return impl(*map(jax.numpy.asarray, scales), **params)

    def cpu_impl(*scales: Any, **params: Any) -> Any:
        return impl(*map(jax.numpy.asarray, scales), finish=_materialized, **params)

    return define_primitive(
        name,
        arrays_impl,
        lambda *scales, **params: (
            [max(scales, key=lambda a: a.ndim)] * count(len(scales), **params)
        ),
        multiple_results=True,
        batching=batch,
        jvp=jvp,
        cpu_impl=cpu_impl,
    )


# --- the largest of several scales, and each one's ratio to it ------------------------------


def _common_scale_impl(
    *scales: Array, num_wanted: int, pow2: bool, finish: Any = _as_computed
) -> list[Array]:
    """(common, s_i / common...): common the power of two at or above the largest of the
    first `num_wanted` scales (that largest itself when `pow2` says they are powers of two);
    every operand (those after them too) gets its ratio to it, at most 1, exact. `finish`
    is applied to the common scale before the ratios are formed from it.

    A ratio is at least float32's smallest normal number (0 for a zero scale): XLA flushes
    a subnormal one to 0, and the infinities of an operand with no finite magnitude (a
    mask of 0 and -inf, at SCALE_MIN) would become NaN at a common scale above 2^2. The
    floor only meets an operand more than 2^126 below the common scale, whose finite data
    was multiplied by 0 before and by 2^-126 now: below 2^-125 of the common scale for
    data near unit range."""
    common = scales[0]
    for scale in scales[1:num_wanted]:
        common = lax.max(common, scale)
    if not pow2:
        common = _pow2_up(common)
    common = finish(common)
    inverse = _reciprocal(common, pow2=True)
    return [common, *(_ratio(scale, inverse) for scale in scales)]


_SMALLEST_NORMAL = np.float32(2.0**-126)


def _ratio(scale: Array, inverse: Array) -> Array:
    """`scale * inverse`, a float32 normal number or 0 (for a zero scale)."""
    return lax.max(scale * inverse, lax.min(scale, _SMALLEST_NORMAL))


def _common_scale_jvp(
    primitive: Any, primals: Any, tangents: Any, *, num_wanted: int, pow2: bool
) -> Any:
    common, *ratios = primitive.bind(*primals, num_wanted=num_wanted, pow2=pow2)
    inverse = _reciprocal(common, pow2=True)
    # The common scale is a choice (no derivative); each ratio is linear in its scale.
    out_tangents = [lax.full_like(common, 0)]
    for tangent in tangents:
        out_tangents.append(_compat.instantiate_zeros(tangent) * inverse)
    return [common, *ratios], out_tangents


common_scale_p = _multi_output(
    "common_scale",
    _common_scale_impl,
    _common_scale_jvp,
    lambda n, **params: n + 1,
)


# --- a product of scales, kept in range, and what it leaves for the data --------------------


def _scale_product_impl(
    *scales: Array, powers: tuple[int, ...], pow2: bool, finish: Any = _as_computed
) -> list[Array]:
    """`(out, ratio)`: out the product `prod(s_i ** p_i)` clamped to [SCALE_MIN, SCALE_MAX]
    (and rounded up to a power of two unless `pow2` says the scales are powers of two),
    ratio `product / out` (1 unless clamped or rounded), formed one factor at a time in an
    order that neither overflows nor multiplies a zero scale by an infinite intermediate.
    `finish` is applied to out before the ratio is formed from it."""
    product = None
    numerators: list[Array] = []
    denominators: list[Array] = []
    for scale, power in zip(scales, powers, strict=True):
        numerators += [scale] * max(power, 0)
        denominators += [scale] * max(-power, 0)
    for scale in numerators:
        product = scale if product is None else product * scale
    if product is None:
        product = lax.full_like(scales[0], 1.0)
    for scale in denominators:
        product = _scale_divide_impl(product, scale, zero_gives_inf=True, pow2=pow2)
    out = lax.clamp(np.float32(SCALE_MIN), product, np.float32(SCALE_MAX))
    if not pow2:
        out = _pow2_up(out)
    out = finish(out)
    inverse = _reciprocal(out, pow2=True)
    if len(numerators) == 2 and len(scales) == 2:
        # The first factor times 1 / out must stay a normal number: the smaller one first
        # where out is SCALE_MIN (at most 2^62; a zero scale included, where larger / out
        # may overflow), else the larger one (at most 1 / smaller). The smaller first
        # underflowed beside a scale beyond SCALE_MAX (0.5 * 2^127: 0.5 * 2^-126).
        smaller, larger = lax.min(*numerators), lax.max(*numerators)
        below = out <= np.float32(SCALE_MIN)
        numerators = [lax.select(below, smaller, larger), lax.select(below, larger, smaller)]
    ratio = inverse
    for scale in numerators:
        ratio = scale * ratio
    for scale in denominators:
        ratio = _scale_divide_impl(ratio, scale, zero_gives_inf=True, pow2=pow2)
    if len(numerators) + len(denominators) > 2:
        # A ratio of three factors or more may overflow float32 itself (x ** 3 with a scale
        # beyond 2^43): capped, it still overflows every nonzero datum, and zeros stay zero.
        # A zero factor's ratio is 0 (one factor at a time, 7e30 * 2^124 * 0 was NaN).
        ratio = lax.min(ratio, np.float32(2.0**127))
        if numerators:
            zero = functools.reduce(lax.bitwise_or, [scale == 0 for scale in numerators])
            ratio = lax.select(zero, lax.full_like(ratio, 0.0), ratio)
    if not pow2 and len(numerators) == len(denominators) == 1:
        # a / out / b: a / out is about b, subnormal for b near SCALE_MIN once out is rounded
        # up (0.3 / 2^-126 gave the ratio 0). There a * (1 / out / b), about a / a, is
        # normal: both are subnormal only if b < 2^-125 < 2^125 < a, where out is SCALE_MAX
        # and a / out normal. (Powers of two: out is the product, a / out exactly b.)
        a, b = numerators[0], denominators[0]
        safe = a * _scale_divide_impl(inverse, b, zero_gives_inf=True, pow2=pow2)
        normal = (a * inverse >= np.float32(2.0**-126)) | (out <= np.float32(SCALE_MIN))
        ratio = lax.select(normal, ratio, safe)  # out SCALE_MIN: a may be 0, 1 / out / b inf
    return [out, ratio]


def _scale_product_jvp(
    primitive: Any, primals: Any, tangents: Any, *, powers: tuple[int, ...], pow2: bool
) -> Any:
    out, ratio = primitive.bind(*primals, powers=powers, pow2=pow2)
    inverse = _reciprocal(out, pow2=True)
    # out is a choice (no derivative); ratio = product / out carries d product / out.
    tangent = lax.full_like(ratio, 0)
    for i, (scale, power, dscale) in enumerate(zip(primals, powers, tangents, strict=True)):
        if power == 0 or _compat.is_symbolic_zero(dscale):
            continue
        partial = lax.full_like(scale, float(power))  # d product / d scale_i
        for j, (other, other_power) in enumerate(zip(primals, powers, strict=True)):
            exponent = other_power - 1 if j == i else other_power
            for _ in range(abs(exponent)):
                if exponent > 0:
                    partial = partial * other
                else:
                    partial = _scale_divide_impl(partial, other, zero_gives_inf=True, pow2=pow2)
        tangent = tangent + _compat.instantiate_zeros(dscale) * partial * inverse
    return [out, ratio], [lax.full_like(out, 0), tangent]


scale_product_p = _multi_output(
    "scale_product",
    _scale_product_impl,
    _scale_product_jvp,
    lambda n, **params: 2,
)


# --- dynamic scale -----------------------------------------------------------------------


# XLA:CPU splits a reduction with an axis longer than 32 elements into a reduce-window and a
# reduce, neither fused with its producer (three kernels for a bias's or a row statistic's
# largest magnitude), unless it hands the reduction to its reduction library (tensors of
# 4,096 elements or more on JAX 0.10.2 and 0.12, larger ones on 0.10.0; the library takes no
# producer either: two kernels). Larger tensors are left to it: one loop measured no faster.
_SHORT_AXIS = 32
_SMALL_REDUCTION = 4096


def _in_short_axes(values: Array) -> Array | None:
    """A small tensor flattened, zero-padded and reshaped into axes of at most 32 elements
    (None where it is large, or its axes are short already)."""
    if values.size >= _SMALL_REDUCTION or max(values.shape, default=0) <= _SHORT_AXIS:
        return None
    block = _SHORT_AXIS if values.size <= _SHORT_AXIS**2 else _SHORT_AXIS**2
    padded = -(-values.size // block) * block
    flat = values.reshape(-1)
    if padded != values.size:
        flat = lax.pad(flat, np.array(0, flat.dtype), [(0, padded - values.size, 0)])
    return flat.reshape((padded // block, *([_SHORT_AXIS] * (2 if block > _SHORT_AXIS else 1))))


def largest_magnitude(
    magnitude: Array, *, finite_only: bool, one_kernel_on_cpu: bool = False
) -> Array:
    """The largest element of a tensor of magnitudes (non-negative or NaN): a NaN if there is
    one, or, with `finite_only`, the largest finite one (0 where there is none).

    `one_kernel_on_cpu` (the XLA:CPU lowerings): a small tensor is reduced in axes of at most
    32 elements behind a select (the filter, or one that keeps every element), in which
    form XLA:CPU neither splits the reduction nor moves the reshape back into it: one loop,
    fused with the magnitudes' producers. Same value (the padding is 0).
    """
    short = _in_short_axes(magnitude) if one_kernel_on_cpu else None
    if short is not None:
        magnitude = short
    if finite_only:
        magnitude = lax.select(lax.is_finite(magnitude), magnitude, lax.full_like(magnitude, 0))
    elif short is not None:
        magnitude = _keeping_every_element(magnitude)
    return lax.reduce_max(magnitude, tuple(range(magnitude.ndim))) if magnitude.ndim else magnitude


def _keeping_every_element(values: Array) -> Array:
    """`values` unchanged, behind a select XLA does not simplify away (NaN for NaN)."""
    return lax.select(values != values, lax.full_like(values, np.nan), values)


def split_long_axes(values: Array, axes: tuple[int, ...]) -> tuple[Array, tuple[int, ...]]:
    """`values` (a small tensor) with each of its reduced `axes` longer than 32 elements
    split into `(n // 32, 32)` where 32 divides it, and the reduced axes after the split: the
    form in which XLA:CPU reduces it in one loop when a select follows the reshape (see
    `largest_magnitude`). Large tensors are returned as they are."""
    if values.size >= _SMALL_REDUCTION:
        return values, axes
    shape: list[int] = []
    new_axes: list[int] = []
    for axis, n in enumerate(values.shape):
        split = axis in axes and n > _SHORT_AXIS and n % _SHORT_AXIS == 0
        pieces = [n // _SHORT_AXIS, _SHORT_AXIS] if split and n <= _SHORT_AXIS**2 else [n]
        if axis in axes:
            new_axes += range(len(shape), len(shape) + len(pieces))
        shape += pieces
    return values.reshape(tuple(shape)), tuple(new_axes)


def max_in_one_kernel(values: Array, axes: tuple[int, ...]) -> Array:
    """`lax.reduce_max(values, axes)` of a small tensor in the form XLA:CPU reduces in one
    loop fused with the tensor's producer (`split_long_axes`, behind a select that keeps
    every element); the same reduction where no axis needs splitting. The same value on
    every backend (for XLA:GPU a reshape and an identity select in the reduction's input)."""
    split, split_axes = split_long_axes(values, axes)
    if split.shape == values.shape:
        return lax.reduce_max(values, axes)
    return lax.reduce_max(_keeping_every_element(split), split_axes)


def largest_of_several(magnitudes: list[Array], *, finite_only: bool) -> list[Array]:
    """XLA:CPU's form for the largest element of each of several non-empty tensors of
    magnitudes (non-negative or NaN), as float32 scalars: as `largest_magnitude` computes
    it (a NaN where there is one, or, with `finite_only`, the largest finite one).

    XLA:CPU fuses no two reductions into one kernel, but it runs a variadic reduction (one
    `reduce` of several operands of one shape) as one loop fused with every operand's
    producer. So the small tensors (fewer than 4,096 elements: biases, norms' gains, a
    small model's weights) are flattened, padded with zeros to the longest of their group
    (those of one power of two at or above their sizes) and reduced together,
    and the large ones of one size (an optimizer state's moments, the layers' parameters)
    together: one kernel for each group. A tensor alone in its group
    is reduced as `largest_magnitude` reduces it (one kernel too). The values are those of
    one `reduce_max` each (a zero pad never exceeds a magnitude)."""
    groups: dict[int, list[int]] = {}
    for index, magnitude in enumerate(magnitudes):
        size = int(magnitude.size)
        # Small tensors by the power of two at or above their size, each padded to the
        # longest of its group: at most twice its size. (Padded to the longest of all, the
        # biases of 32 elements beside weights of 2,048 were most of the elements read, in
        # one loop on one thread: the zoo steps 18% slower. Fewer groups, mixing sizes
        # under a budget of padded elements, were slower still: a padded operand is not
        # read as fast as a tensor of the group's own size.)
        key = -(1 << (size - 1).bit_length()) if size < _SMALL_REDUCTION else size
        groups.setdefault(key, []).append(index)
    out: list[Any] = [None] * len(magnitudes)
    for indices in groups.values():
        if len(indices) == 1:
            (index,) = indices
            amax = largest_magnitude(
                magnitudes[index], finite_only=finite_only, one_kernel_on_cpu=True
            )
            out[index] = lax.convert_element_type(amax, F32)
            continue
        length = max(int(magnitudes[i].size) for i in indices)
        flat = []
        for i in indices:
            magnitude = lax.convert_element_type(magnitudes[i].reshape(-1), F32)
            if finite_only:
                magnitude = lax.select(
                    lax.is_finite(magnitude), magnitude, lax.full_like(magnitude, 0)
                )
            if magnitude.size < length:
                magnitude = lax.pad(magnitude, np.float32(0), [(0, length - magnitude.size, 0)])
            flat.append(magnitude)
        lowest = [np.float32(-np.inf)] * len(flat)
        maxima = lax.reduce(flat, lowest, _max_of_each, (0,))
        for index, amax in zip(indices, maxima):
            out[index] = amax
    return out


def _max_of_each(left: list[Array], right: list[Array]) -> list[Array]:
    return [lax.max(a, b) for a, b in zip(left, right)]


def _scaled_magnitudes(x: Array, factor: Array) -> Array:
    """`|x| * factor`, computed in float32 (or float64)."""
    magnitude = lax.abs(x)
    if magnitude.dtype != F32 and magnitude.dtype != np.float64:
        magnitude = lax.convert_element_type(magnitude, F32)
    return magnitude * lax.convert_element_type(factor, magnitude.dtype)


def _largest_finite_product(x: Array, factor: Array, *, one_kernel_on_cpu: bool = False) -> Array:
    """The largest finite `|x| * factor` as a float32 scalar (0 where there is none)."""
    if x.size == 0:  # no element: the reduction's identity would be -inf
        return lax.full((), 0.0, F32)
    magnitude = _scaled_magnitudes(x, factor)
    amax = largest_magnitude(magnitude, finite_only=True, one_kernel_on_cpu=one_kernel_on_cpu)
    return lax.convert_element_type(amax, F32)


def _clamped_power_bits(amax: Array) -> Array:
    """Elementwise: the float32 bits of the power of two at or below `amax` (non-negative
    and finite), within [SCALE_MIN, SCALE_MAX] (SCALE_MIN's where `amax` is 0)."""
    bits = lax.bitcast_convert_type(amax, np.int32) & _EXPONENT_MASK
    return lax.clamp(_SCALE_MIN_BITS, bits, _SCALE_MAX_BITS)


def _scale_bits_of_magnitude(amax: Array) -> Array:
    """`_clamped_power_bits`, but 1's bits where `amax` is 0 (a history's scale)."""
    bits = _clamped_power_bits(amax)
    return lax.select(amax > 0, bits, lax.full_like(bits, _ONE_BITS))


def scale_of_magnitude(amax: Array) -> Array:
    """Elementwise: the dynamic scale of a tensor whose largest finite magnitude is `amax`
    (float32, non-negative): the power of two at or below it within `[SCALE_MIN,
    SCALE_MAX]`, 1 where it is 0. A dynamic scale is its own `scale_of_magnitude`, so a
    vector may mix largest magnitudes and scales (`jsa.delayed_scaling`'s histories).

    Examples:
        >>> import jax.numpy as jnp
        >>> from jax_scaled_arithmetics.core.scale_arithmetic import scale_of_magnitude
        >>> scale_of_magnitude(jnp.array([5.0, 0.3, 0.0, 4.0]))
        Array([4.  , 0.25, 1.  , 4.  ], dtype=float32)
    """
    amax = lax.convert_element_type(amax, F32)
    return lax.bitcast_convert_type(_scale_bits_of_magnitude(amax), F32)


def _dynamic_scale_impl(x: Array, factor: Array, *, one_kernel_on_cpu: bool = False) -> list[Array]:
    """(t, factor / t): t the power of two at or below the largest finite `|x| * factor`.

    Where that is 0 (every value zero, infinite or NaN) t is SCALE_MIN and the ratio is
    `factor`: the data is then what it would be at scale 1, zeros stay zeros and infinities
    infinities, and the tensor does not lift a common scale it joins (a zero tensor at
    scale 1 added to gradients at 2^-30 flushed them in float16).
    """
    if x.size == 0:  # no magnitude: t = 1
        return [np.float32(1.0), lax.convert_element_type(factor, F32)]
    amax = _largest_finite_product(x, factor, one_kernel_on_cpu=one_kernel_on_cpu)
    bits = _clamped_power_bits(amax)
    scale = lax.bitcast_convert_type(bits, F32)
    inverse_bits = lax.select(amax > 0, _TWO_127 - bits, lax.full_like(bits, _ONE_BITS))
    inverse = lax.bitcast_convert_type(inverse_bits, F32)  # 2^-e, exactly
    return [scale, lax.convert_element_type(factor, F32) * inverse]


_SCALE_MIN_BITS = np.int32((127 - 124) << 23)
_SCALE_MAX_BITS = np.int32((127 + 126) << 23)
_ONE_BITS = np.int32(127 << 23)


def _per_example_factor_applied(x: Array, x_dim: Any, factor: Array, factor_dim: int) -> Any:
    """`(factor, x * factor)` with the batch axis first: a batched factor (one per
    example) applied to its example's values (`x` broadcast when unbatched)."""
    factor = jax.numpy.moveaxis(factor, factor_dim, 0)
    if x_dim is None:
        x = lax.broadcast(x, (factor.shape[0],))
    else:
        x = jax.numpy.moveaxis(x, x_dim, 0)
    return factor, x * factor.reshape(factor.shape + (1,) * (x.ndim - 1)).astype(x.dtype)


def _dynamic_scale_batch(primitive: Any, args: Any, dims: Any) -> Any:
    # One scale for the whole batch: any positive scale represents the values, and one
    # that stays a scalar keeps `vmap`'s scales unbatched.
    x, factor = args
    x_dim, factor_dim = dims
    if factor_dim is None:
        return primitive.bind(x, factor), [None, None]
    # One factor per example: applied to its example's values; the ratio is per example.
    factor, scaled = _per_example_factor_applied(x, x_dim, factor, factor_dim)
    scale, inverse = primitive.bind(scaled, np.float32(1.0))
    return [scale, factor.astype(F32) * inverse], [None, 0]


def _dynamic_scale_jvp(primitive: Any, primals: Any, tangents: Any) -> Any:
    scale, ratio = primitive.bind(*primals)
    # The scale is a choice (no derivative); ratio = factor / scale is linear in factor.
    dfactor = _compat.instantiate_zeros(tangents[1])
    return [scale, ratio], [lax.full_like(scale, 0), dfactor * _reciprocal(scale, pow2=True)]


dynamic_scale_p = define_primitive(
    "dynamic_scale",
    _dynamic_scale_impl,
    lambda x, factor: [_compat.scalar_aval_like(x, F32)] * 2,
    multiple_results=True,
    batching=_dynamic_scale_batch,
    jvp=_dynamic_scale_jvp,
    # On XLA:CPU a small tensor's largest magnitude in one kernel (`largest_magnitude`). Its
    # scale is not materialised: the reduction's result and a few instructions, which XLA
    # may copy into the kernels that read it (materialised, it was one kernel more per
    # dynamic scale, and no faster: docs/benchmarks.md).
    cpu_impl=functools.partial(_dynamic_scale_impl, one_kernel_on_cpu=True),
)


# On XLA:CPU, scalars are stacked in pieces of this many: XLA:CPU fuses the scalar
# computations of at most 8 operands into the kernel that writes a vector (a concatenate
# of more leaves each operand's computation a kernel of its own).
_STACK_PIECE = 8


def stacked_in_pieces(*scalars: Array) -> Array:
    """Scalars as one vector in XLA:CPU's best form: each piece of `_STACK_PIECE` a chain
    of selects (one kernel with the computations of its scalars), the pieces concatenated."""
    pieces = []
    for start in range(0, len(scalars), _STACK_PIECE):
        part = scalars[start : start + _STACK_PIECE]
        where = lax.iota(np.int32, len(part))
        piece = lax.broadcast(part[0], (len(part),))
        for index, scalar in enumerate(part[1:], 1):
            piece = lax.select(where == index, lax.broadcast(scalar, (len(part),)), piece)
        pieces.append(piece)
    return pieces[0] if len(pieces) == 1 else lax.concatenate(pieces, 0)


# On XLA:CPU, a vector is split into scalars in pieces of this many: each piece one kernel
# (compile time measured flat from 16 to 64 per piece, 300 scalars).
UNSTACK_PIECE = 32


def unstacked_in_pieces(vector: Array) -> list[Array]:
    """The elements of a vector as scalars, in XLA:CPU's form: each piece of
    `UNSTACK_PIECE` elements one variadic reduction, whose outputs are buffers of their
    own. The elements' bits are moved, not computed on (each the bitwise or of its own bits
    and zeros: XLA:CPU's float maximum would flush a subnormal to zero), so the values are
    `vector[i]`'s exactly.

    XLA:CPU fuses a slice of a vector into every kernel that reads it, and those kernels
    then differ by the index they read: alike kernels that read a scalar are compiled once,
    kernels that slice a vector each on their own (the zoo steps with their scales packed
    had 140 more distinct kernels, their compile 1.2-1.8x the unpacked step's). A reduction's
    outputs are not fused into their readers."""
    bits_dtype = np.dtype(f"uint{8 * np.dtype(vector.dtype).itemsize}")
    outs: list[Array] = []
    for start in range(0, vector.shape[0], UNSTACK_PIECE):
        piece = lax.bitcast_convert_type(vector[start : start + UNSTACK_PIECE], bits_dtype)
        where = lax.iota(np.int32, piece.shape[0])
        zeros = lax.full_like(piece, 0)
        operands = [lax.select(where == i, piece, zeros) for i in range(piece.shape[0])]
        identity = [np.array(0, bits_dtype)] * len(operands)
        bits = lax.reduce(operands, identity, _or_of_each, (0,))
        outs += [lax.bitcast_convert_type(b, vector.dtype) for b in bits]
    return outs


def _or_of_each(left: list[Array], right: list[Array]) -> list[Array]:
    return [lax.bitwise_or(a, b) for a, b in zip(left, right)]


# A tensor of at most this many elements is read as it is by `_partial_magnitudes` (its
# elements are its partials); a larger one is reduced in rows of at least `_PARTIAL_ROW`
# elements (its trailing axes; consecutive rows merged where there would be more than
# `_MOST_PARTIALS`).
_READ_AS_IS = 2048
_PARTIAL_ROW = 32
_MOST_PARTIALS = 4096


def partial_maxima(magnitude: Array) -> Array:
    """A float32 vector whose largest element is the largest of `magnitude` (a non-empty
    tensor of magnitudes: non-negative, or NaN): a large tensor's rows reduced each
    (XLA:GPU's one-kernel row reduction), a small tensor's elements as they are (a
    reduction of its own would be a kernel of its own where XLA:GPU does not merge it with
    the tensor's producer, as after another reduction: a bias's gradient)."""
    if magnitude.size <= _READ_AS_IS:
        return lax.convert_element_type(magnitude.reshape(-1), F32)
    row, axis = 1, magnitude.ndim
    while axis > 0 and row < _PARTIAL_ROW:
        axis -= 1
        row *= magnitude.shape[axis]
    # Too many rows: consecutive rows merged, the fewest at a time that leaves at most
    # `_MOST_PARTIALS` (a reshape of the contiguous tensor, not a copy).
    count = magnitude.size // row
    merged = -(-count // _MOST_PARTIALS)
    while count % merged:
        merged += 1
    rows = magnitude.reshape((count // merged, row * merged))
    return lax.convert_element_type(lax.reduce_max(rows, (1,)), F32)


def _partial_magnitudes(x: Array, factor: Array) -> Array:
    """`partial_maxima` of the finite `|x| * factor` (0 where there is none)."""
    if x.size == 0:
        return lax.full((1,), 0.0, F32)
    magnitude = _scaled_magnitudes(x, factor)
    magnitude = lax.select(lax.is_finite(magnitude), magnitude, lax.full_like(magnitude, 0))
    return partial_maxima(magnitude)


def largest_of_each(partials: list[Array]) -> Array:
    """The largest element of each vector of `partials` (each from `partial_maxima`: 0 or
    more, or NaN), as one float32 vector computed in one kernel on XLA:GPU: the vectors
    gathered as the rows of one matrix, padded with 0 (read past the end), and reduced."""
    if all(p.shape == (1,) for p in partials):
        return lax.concatenate(partials, 0)
    ends = np.cumsum([p.shape[0] for p in partials])
    longest = max(p.shape[0] for p in partials)
    where = np.full((len(partials), longest), ends[-1], np.int32)
    for index, (end, p) in enumerate(zip(ends, partials)):
        where[index, : p.shape[0]] = np.arange(end - p.shape[0], end)
    flat = lax.concatenate(partials, 0)
    padded = jax.numpy.take(flat, where, mode="fill", fill_value=0.0)
    return lax.reduce_max(padded, (1,))


def _pairs(operands: tuple[Any, ...]) -> list[tuple[Any, Any]]:
    """`largest_finite_magnitudes_p`'s operands as `(tensor, factor)` pairs."""
    if not operands or len(operands) % 2:
        raise TypeError(
            f"largest_finite_magnitudes takes (tensor, factor) pairs, got {len(operands)} operands."
        )
    return list(zip(operands[::2], operands[1::2]))


def _largest_finite_magnitudes_impl(*operands: Array) -> Array:
    """Each pair `(x, factor)`'s largest finite `|x| * factor`, as one float32 vector: every
    large tensor's rows reduced where it is written (no kernel of its own finishing each
    reduction), small tensors read as they are, and the partials of all of them reduced
    in one kernel."""
    return largest_of_each([_partial_magnitudes(x, f) for x, f in _pairs(operands)])


def _largest_finite_magnitudes_partitioned(*operands: Array) -> Array:
    """The form for a program partitioned over devices: each tensor's largest magnitude a
    reduction of its own (on each device its shard's, then one scalar all-reduce), where
    gathering partials of tensors into one vector would gather sharded tensors whole."""
    return jax.numpy.stack([_largest_finite_product(x, f) for x, f in _pairs(operands)])


def _largest_finite_magnitudes_cpu(*operands: Array) -> Array:
    """XLA:CPU's form: the tensors reduced a few at a time, each few in one kernel
    (`largest_of_several`), the scalars stacked in pieces (XLA:CPU fuses no reduction
    with the kernel that writes its tensor, so partial rows would only add a reduction per
    tensor there)."""
    pairs = _pairs(operands)
    measured = [i for i, (x, _) in enumerate(pairs) if x.size]
    magnitudes = [_scaled_magnitudes(*pairs[i]) for i in measured]
    scalars: list[Any] = [lax.full((), 0.0, F32)] * len(pairs)  # no element: 0
    for i, amax in zip(measured, largest_of_several(magnitudes, finite_only=True)):
        scalars[i] = amax
    return stacked_in_pieces(*scalars)


def _largest_finite_magnitudes_batch(primitive: Any, args: Any, dims: Any) -> Any:
    # One magnitude per pair for the whole batch, as `dynamic_scale_p` takes one scale for
    # it: a batched tensor is reduced over its batch axis too; a batched factor is applied
    # to its example's values first.
    operands = []
    for x, f, x_dim, f_dim in zip(args[::2], args[1::2], dims[::2], dims[1::2]):
        if f_dim is None:
            operands += [x, f]
        else:
            operands += [_per_example_factor_applied(x, x_dim, f, f_dim)[1], np.float32(1.0)]
    return primitive.bind(*_compat.match_varying(*operands)), None


def _largest_finite_magnitudes_abstract(*operands: Any) -> Any:
    pairs = _pairs(operands)
    return _compat.aval_like(operands[0], (len(pairs),), F32)


# The largest finite `|x| * factor` of each `(x, factor)` pair of its operands, as one
# float32 vector (0 where there is none): dynamic scales' reductions without their
# epilogue (`scale_of_magnitude`), for tensors whose data does not wait for them (the sites
# of `jsa.delayed_scaling`, measured for the next step). One primitive for all of them so
# that XLA:GPU finishes every tensor's reduction in one kernel (each large tensor's took a
# kernel of its own). A measurement: its derivative is zero.
largest_finite_magnitudes_p = define_primitive(
    "largest_finite_magnitudes",
    _largest_finite_magnitudes_impl,
    _largest_finite_magnitudes_abstract,
    batching=_largest_finite_magnitudes_batch,
    jvp=zero_tangents,
    cpu_impl=_largest_finite_magnitudes_cpu,
    partitioned_impl=_largest_finite_magnitudes_partitioned,
)


def dynamic_scale(y: Array) -> Array:
    """The power of two at or below the largest finite `|y|` (SCALE_MIN when there is none,
    or it is 0), within `[SCALE_MIN, SCALE_MAX]`: `y / dynamic_scale(y)` has its largest
    finite magnitude in [1, 2). Excluded from autodiff (a choice of representation).

    Examples:
        >>> import jax.numpy as jnp
        >>> from jax_scaled_arithmetics.core.scale_arithmetic import dynamic_scale
        >>> dynamic_scale(jnp.array([0.3, -5.0, jnp.inf]))
        Array(4., dtype=float32)
    """
    return mark_pow2(dynamic_scale_p.bind(y, np.float32(1.0))[0])
