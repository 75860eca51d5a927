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
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import registry
from ..core.config import Pow2RoundMode
from ..core.datatype import ScaledArray, is_floating
from ..core.dtypes import compute_dtype as compute_dtype
from ..core.pow2 import pow2_round, static_pow2
from ..core.types import Array
from .scale_algebra import (
    SCALE_MIN,
    apply_ratio,
    as_f32,
    at_scale_ratio,
    common_ratios,
    dynamic_scale,
    represent_dynamic,
    scale_div,
    scale_mul,
    static_value,
)

__all__ = [
    "compute_dtype",
    "contraction_dtype",
    "choose_scale",
    "safe_div",
    "rescale",
    "to_common_scale",
    "unscaled_value",
    "register_each",
    "register_linear",
    "register_common_scale",
    "common_scale_rule",
    "select_whole_cases",
    "register_unscaled_unary",
    "register_unscaled_output",
    "dynamic_scale_of",
    "register_materializing",
    "register_higher_order",
    "register_unscaled_elementwise",
    "zeros_where_scale_zero",
    "scaled_output",
    "Slope",
]

_F = TypeVar("_F", bound=Callable[..., Any])


def contraction_dtype(primitive: Any, params: dict, *operands: Any) -> np.dtype:
    """The output dtype of a contraction (`dot_general`, `conv_general_dilated`, ...) of
    `operands`, as the primitive gives it: `preferred_element_type`, else the operands'
    dtype; for operands of two FP8 formats (which JAX promotes to nothing: e4m3fn
    activations times e5m2 gradients) the primitive's own choice."""
    preferred = params.get("preferred_element_type")
    if preferred is not None:
        return np.dtype(preferred)
    if len({np.dtype(x.dtype) for x in operands[:2]}) == 1:
        return np.dtype(operands[0].dtype)
    specs = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in operands]
    return np.dtype(jax.eval_shape(functools.partial(primitive.bind, **params), *specs).dtype)


def choose_scale(x: Array) -> Array:
    """A scale chosen from `x`: rounded to a power of two, and excluded from autodiff.

    The value `data * scale` does not depend on which scale a rule picks, so the
    choice carries no gradient.
    """
    return lax.stop_gradient(pow2_round(x))


def safe_div(num: Array, den: Array) -> Array:
    """`num / den`, defined as 0 where `den == 0` (zero scales represent zeros)."""
    num, den = jnp.asarray(num), jnp.asarray(den)
    dtype = jnp.result_type(num, den)
    num, den = num.astype(dtype), den.astype(dtype)
    nonzero = den != 0
    quotient = lax.div(num, lax.select(nonzero, den, lax.full_like(den, 1)))
    return lax.select(nonzero, quotient, lax.full_like(quotient, 0))


def rescale(data: Array, ratio: Array, dtype: Any = None) -> Array:
    """`data * ratio` computed in at least float32, cast to `dtype` (default: data's)."""
    dtype = data.dtype if dtype is None else dtype
    cdtype = compute_dtype(data.dtype)
    return (data.astype(cdtype) * jnp.asarray(ratio).astype(cdtype)).astype(dtype)


def unscaled_value(x: ScaledArray, dtype: Any = None) -> Array:
    """The represented value of `x` in `dtype` (default: the safe compute dtype)."""
    dtype = compute_dtype(x.dtype) if dtype is None else dtype
    scale = as_f32(x.scale)
    if static_value(scale) == 1.0:
        return x.data.astype(dtype)
    return x.data.astype(dtype) * jnp.asarray(scale).astype(dtype)


def _constant_scale(value: Any, dtype: Any) -> Any:
    """The smallest power-of-two scale at which a known constant fits in `dtype` data."""
    if value == 0 or not np.isfinite(value):
        return np.float32(0.0)
    needed = abs(float(value)) / float(jnp.finfo(dtype).max)
    return np.float32(static_pow2(needed, Pow2RoundMode.UP))


def to_common_scale(
    *xs: ScaledArray, constants: Sequence[Any] | None = None, dtype: Any = None
) -> tuple[list[Array], Array]:
    """Bring ScaledArrays to one common scale: returns their data at it (in `dtype`, default
    each data's own), and the scale.

    The common scale is the largest scale of the operands, so every data is multiplied
    by `scale_i / common <= 1` and none overflows. An operand known to be a constant
    (`constants[i]` not None, e.g. the `-1e30` of a mask or the `0` of a padding) only
    asks for the smallest scale it fits at, not the power of two it was promoted with:
    `where(mask, x, -1e4)` keeps x's precision. Operands sharing one scale, and static
    scales, cost no scalar work.
    """
    constants = [None] * len(xs) if constants is None else list(constants)
    wanted = [
        _constant_scale(c, x.dtype) if _is_number(c) else x.scale for x, c in zip(xs, constants)
    ]
    common, ratios = common_ratios([x.scale for x in xs], wanted)
    if static_value(common) == 0.0 and any(_is_number(c) and not np.isfinite(c) for c in constants):
        # inf / NaN constants fit at any positive scale, but not at a zero one.
        common = np.float32(1.0)
        ratios = [at_scale_ratio(x.scale, common) for x in xs]
    datas = [apply_ratio(x.data, ratio, dtype) for x, ratio in zip(xs, ratios, strict=True)]
    return datas, common


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def dynamic_scale_of(y: Array, scale_dtype: Any = np.float32) -> Array:
    """A power-of-two scale close to `max |y|` (SCALE_MIN where that is 0; infinities left
    out)."""
    return dynamic_scale(y).astype(scale_dtype)


def _as_scaled(x: Any) -> ScaledArray:
    if isinstance(x, ScaledArray):
        return x
    raise TypeError(f"Expected a ScaledArray operand, got {type(x).__name__}.")


def _installed(primitive: Any) -> tuple[str, Any]:
    """The name of `primitive` and the primitive itself, for a primitive or the name of one
    that only some supported JAX releases have (`registry.register_scaled_op` takes either):
    None where the installed JAX does not have it (the rule is then declared, never
    called)."""
    if isinstance(primitive, str):
        return primitive, registry.installed_primitive(primitive)
    return primitive.name, primitive


def register_each(*cases: Any, family: str, remark: str = "") -> Callable[[_F], _F]:
    """Decorate a rule factory: register `factory(primitive, *args)` for each case, a
    primitive (or the name of one that only some supported JAX releases have) or a tuple
    `(primitive, *args)`, named `scaled_<primitive name>` (the rules of primitives that
    differ only in what the rule binds)."""

    def decorate(factory: _F) -> _F:
        for case in cases:
            primitive, *args = case if isinstance(case, tuple) else (case,)
            name, installed = _installed(primitive)
            rule = factory(installed, *args)
            rule.__name__ = f"scaled_{name}"
            registry.register_scaled_op(primitive, rule, family=family, remark=remark)
        return factory

    return decorate


def register_linear(
    primitive: Any, scaled_operands: Sequence[int] = (0,), remark: str = ""
) -> None:
    """Register a primitive that is linear in one operand and acts on data only.

    Other operands (indices, sizes) are passed through as they are. `primitive` is a
    primitive, or the name of one that only some supported JAX releases have.
    """
    (index,) = scaled_operands
    name, prim = _installed(primitive)

    def rule(*operands: Any, **params: Any) -> Any:
        x = _as_scaled(operands[index])
        args = list(operands)
        args[index] = x.data
        out = prim.bind(*args, **params)
        if prim.multiple_results:
            return [ScaledArray(o, x.scale) for o in out]
        return ScaledArray(out, x.scale)

    rule.__name__ = f"scaled_{name}"
    registry.register_scaled_op(primitive, rule, family="linear", remark=remark)


def select_whole_cases(which: Any, cases: Sequence[Any], **params: Any) -> ScaledArray | None:
    """`select_n` by a scalar predicate: the chosen case's data and scale as they are, each
    selected on its own (exact: no case is brought to another's scale and rounded), so a
    step that keeps the old state (`jmp.select_tree(finite, new, old)`) keeps it bit for
    bit. None where that does not apply (a predicate per element, cases whose data dtypes
    or scale shapes differ, a plain case): the caller then uses a common scale."""
    if np.ndim(which) != 0 or not all(isinstance(c, ScaledArray) for c in cases):
        return None
    scales = [jnp.asarray(c.scale) for c in cases]
    if len({(c.dtype, np.shape(c.scale), s.dtype) for c, s in zip(cases, scales)}) != 1:
        return None
    data = lax.select_n_p.bind(which, *[c.data for c in cases], **params)
    return ScaledArray(data, lax.select_n(which, *scales))


def common_scale_rule(
    primitive: Any,
    scaled_operands: Callable[[int], Sequence[int]] | Sequence[int] | None = None,
) -> Callable[..., Any]:
    """The rule of a primitive whose floating operands are brought to one common scale.

    `scaled_operands` gives the positions of the operands that carry values
    (default: every floating operand); the output takes the common scale. `primitive` is a
    primitive, or the name of one that only some supported JAX releases have.
    """
    name, prim = _installed(primitive)

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
        out = prim.bind(*args, **params)
        if prim.multiple_results:
            return [ScaledArray(o, scale) if is_floating(o) else o for o in out]
        return ScaledArray(out, scale)

    rule.__name__ = f"scaled_{name}"
    return rule


def register_common_scale(
    primitive: Any,
    scaled_operands: Callable[[int], Sequence[int]] | Sequence[int] | None = None,
    remark: str = "",
) -> None:
    """Register `common_scale_rule(primitive, scaled_operands)` as the primitive's rule."""
    rule = common_scale_rule(primitive, scaled_operands)
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
        return ScaledArray(y.astype(dtype), np.float32(1.0))
    return represent_dynamic(y, (), dtype)


def zeros_where_scale_zero(x: ScaledArray) -> Array:
    """The data of `x`, or `data * 0` where its scale is 0: the (signed) zeros it represents.

    Free when the scale is static and nonzero.
    """
    value = static_value(x.scale)
    if value is not None and value != 0:
        return x.data
    if value == 0:
        return x.data * np.asarray(0, x.dtype)
    zero = as_f32(x.scale) == 0
    return lax.select(lax.broadcast(zero, x.data.shape), x.data * np.asarray(0, x.dtype), x.data)


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
            datas = [zeros_where_scale_zero(scaled[0])]
        else:
            _, ratios = common_ratios([x.scale for x in scaled])
            cdtype = compute_dtype(scaled[0].dtype)
            datas = [apply_ratio(x.data, r, cdtype) for x, r in zip(scaled, ratios)]
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
    """`scale` as a float32 scalar, with 1 in place of 0, inf or NaN (a usable output scale)."""
    value = static_value(scale)
    if value is not None:
        return np.float32(value if np.isfinite(value) and value != 0 else 1.0)
    scale = as_f32(scale)
    usable = (scale > 0) & (scale < np.float32(np.inf))
    return lax.select(usable, scale, np.float32(1.0))


def smallest_scale_for(bound: float, dtype: Any) -> float:
    """The smallest power of two `s` such that `bound / s` is at most half `dtype`'s maximum."""
    finfo = jnp.finfo(dtype)
    tiny = float(np.finfo(np.float32).tiny)
    if bound <= 0:
        return tiny
    return max(tiny, float(2.0 ** np.ceil(np.log2(2 * bound / float(finfo.max)))))


def _clamp_scale(lo: float, scale: Any, hi: float) -> Any:
    value = static_value(scale)
    if value is not None:
        return np.float32(np.clip(value, lo, hi))
    return lax.clamp(np.float32(lo), as_f32(scale), np.float32(hi))


def _by_slope(first: Any, bound_scale: Any, slope: Slope, bound: float, dtype: Any) -> Any:
    """The `"input_at_most_one"` scale refined by a slope bound (see `elementwise_output_scale`)."""
    floor = smallest_scale_for(bound, dtype) if slope.saturates else SCALE_MIN
    by_slope = _clamp_scale(floor, scale_mul(first, np.float32(slope.factor)), 1.0)
    if slope.everywhere:
        return by_slope
    # Only where every representable |x| <= 1/2, i.e. first * largest <= 1/2.
    limit = np.float32(0.5 / float(jnp.finfo(dtype).max))
    value = static_value(first)
    if value is not None:
        return by_slope if value <= limit else bound_scale
    return lax.select(as_f32(first) <= limit, as_f32(by_slope), as_f32(bound_scale))


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
    `vmap`), and fold at trace time when the scales are static. A zero scale becomes 1.
    """
    if strategy == "one":
        return np.float32(1.0)
    if strategy == "dynamic":
        return dynamic_scale(y)
    first = scales[0]
    if strategy == "input":
        return nonzero_or_one(first)
    if strategy == "input_at_least_one":
        value = static_value(first)
        if value is not None:
            return np.float32(max(value, 1.0))
        return lax.max(as_f32(first), np.float32(1.0))
    if strategy == "smallest_input":
        scale = first
        for other in scales[1:]:
            va, vb = static_value(scale), static_value(other)
            if va is not None and vb is not None:
                scale = np.float32(min(va, vb))
            else:
                scale = lax.min(as_f32(scale), as_f32(other))
        return nonzero_or_one(scale)
    if strategy not in ("input_at_most_one", "ratio_at_most_one"):
        raise ValueError(f"Unknown output scale strategy {strategy!r}; use one of {OUTPUT_SCALES}.")
    if strategy == "ratio_at_most_one":
        first = nonzero_or_one(scale_div(first, nonzero_or_one(scales[1])))
    dtype = y.dtype if dtype is None else dtype
    bound_scale = _clamp_scale(smallest_scale_for(bound, dtype), first, 1.0)
    if slope is None:
        return bound_scale
    return _by_slope(first, bound_scale, slope, bound, dtype)


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
    `elementwise_output_scale`). `primitive` is a primitive, or the name of one that only
    some supported JAX releases have.
    """
    if output_scale not in OUTPUT_SCALES:
        raise ValueError(f"Unknown output_scale {output_scale!r}; use one of {OUTPUT_SCALES}.")
    name, prim = _installed(primitive)

    def rule(*operands: Any, **params: Any) -> Any:
        scaled = [o for o in operands if isinstance(o, ScaledArray)]
        dtype = scaled[0].dtype
        cdtype = compute_dtype(dtype)
        values = [unscaled_value(o, cdtype) if isinstance(o, ScaledArray) else o for o in operands]
        y = fn(*values, **params) if fn is not None else prim.bind(*values, **params)
        if output_scale == "dynamic":
            return represent_dynamic(y, (), dtype)
        scale = elementwise_output_scale(
            output_scale, [o.scale for o in scaled], y, dtype=dtype, bound=bound, slope=slope
        )
        inverse = scale_div(np.float32(1.0), scale)
        data = y if static_value(scale) == 1.0 else y * as_f32(inverse).astype(y.dtype)
        return ScaledArray(data.astype(dtype), as_f32(scale))

    rule.__name__ = f"scaled_{name}"
    family = f"unscaled ({output_scale.replace('_', ' ')} scale)"
    registry.register_scaled_op(primitive, rule, family=family, remark=remark)


def materialized_values(args: Sequence[Any], dtype: Any = None) -> list[Any]:
    """The represented values of the scaled operands (others unchanged)."""
    out = []
    for a in args:
        if isinstance(a, ScaledArray):
            a = a.to_array(dtype(a.dtype) if callable(dtype) else dtype)
        out.append(a)
    return out


def register_higher_order(prim: Any, rule: Any = None, *, remark: str = "") -> Any:
    """Register the rule of a higher-order primitive (`jit`, `scan`, `custom_vjp`, ...); a
    decorator. The rule runs for scaled and plain operands alike and gets its operands as
    they are: it interprets the inner jaxprs itself."""
    return registry.register_scaled_op(
        prim, rule, always_scaled=True, promote=False, family="higher-order", remark=remark
    )


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
