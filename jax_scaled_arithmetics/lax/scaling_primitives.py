"""Scaling primitives: set, stop, read and rebalance the scale of an array.

Each is a real JAX primitive, the identity on the represented value outside
`autoscale` (so a function using them still runs, jits, vmaps and
differentiates without the transform), and a scale manipulation inside it.
Their derivatives pass tangents through unchanged: scaling is a choice of
representation, not a change of value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core import _compat, block_scales, registry
from ..core.datatype import ScaledArray, is_floating, scaled_leaf, set_trace_conversions
from ..core.define import (
    batch_along_operand_0,
    batch_along_operand_0_if_unbatched,
    define_identity_primitive,
    define_primitive,
)
from ..core.dtypes import compute_dtype
from ..core.types import Array
from .scale_algebra import as_f32, at_scale, same_scale, scale_div, scale_mul, static_value

__all__ = [
    "set_scaling",
    "stop_scaling",
    "get_data_scale",
    "rebalance",
    "apply_to_data",
    "rebalance_by",
    "block_rebalance_by",
    "register_scaling_op",
]


def register_scaling_op(primitive: Any, remark: str, *, always_scaled: bool = True) -> Any:
    """Register the scaled rule of a scaling primitive (a decorator): in the "scaling"
    family, its operands left as they are (no promotion to ScaledArrays)."""
    return registry.register_scaled_op(
        primitive, always_scaled=always_scaled, promote=False, family="scaling", remark=remark
    )


def _plain(x: Any) -> Any:
    return x.to_array() if isinstance(x, ScaledArray) else x


def _usable_factor(value: Any, name: str, what: str, fallback: Any) -> Any:
    """`value` (the scalar scale or factor operand, index 1, of the rule being called) when
    it is finite and positive. A known bad one (a concrete array, a constant under `jit`)
    raises a ValueError naming it; a traced one is replaced by `fallback` where it is bad,
    which leaves the represented value unchanged (NaN, inf, zero and negative scales
    represent nothing: data * scale loses the value). A known good one costs nothing."""
    constants = registry.operand_constants()
    known = constants[1] if len(constants) > 1 and constants[1] is not None else None
    known = static_value(value) if known is None else float(known)
    if known is not None:
        if not (np.isfinite(known) and known > 0):
            raise ValueError(
                f"{name}: the {what} must be finite and positive, got {known!r}: a zero "
                f"{what} cannot carry a non-zero value, and NaN, infinite or negative ones "
                f"represent nothing."
            )
        return value
    valid = jnp.isfinite(value) & (value > 0)
    fallback = jnp.asarray(fallback, value.dtype)
    # Inside `shard_map`: a fallback that varies over mesh axes the value does not (x's own
    # scale, per device) would make the result vary too; the largest over those axes is
    # the same everywhere and still represents x's value (its data only gets smaller).
    extra = _compat.varying_axes(_compat.typeof(fallback)) - _compat.varying_axes(
        _compat.typeof(value)
    )
    if extra:
        fallback = jax.lax.pmax(fallback, tuple(sorted(extra, key=str)))
    return jnp.where(valid, value, fallback)


# --- set_scaling -------------------------------------------------------------------------

set_scaling_p = define_identity_primitive(
    "set_scaling", batch_along_operand_0_if_unbatched(scale=1)
)


@register_scaling_op(set_scaling_p, "rescale to the given scale")
def scaled_set_scaling(x: Any, scale: Any) -> ScaledArray:
    scale = jnp.asarray(_plain(scale))
    if not isinstance(x, ScaledArray):
        x = ScaledArray(x, np.float32(1.0))
    # A traced bad scale falls back to x's (largest) scale: the value stays as it was.
    fallback = x.scale if np.ndim(x.scale) == 0 else block_scales.largest_scale(x.scale)
    scale = _usable_factor(scale, "set_scaling", "scale", as_f32(fallback))
    if same_scale(x.scale, scale):
        return x
    cdtype = compute_dtype(x.dtype)
    data = at_scale(x.data, x.scale, scale, cdtype)
    return ScaledArray(data.astype(x.dtype), scale)


def set_scaling(x: Array, scale: Array) -> Any:
    """Represent `x` with the given `scale` (value unchanged; identity outside autoscale).

    The scale must be finite and positive: a known bad one (NaN, inf, zero, negative)
    raises a ValueError; inside `jax.jit`, where a computed scale is not known, a bad one
    leaves `x` at its own scale.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> y = jsa.lax.set_scaling(jsa.as_scaled_array(jnp.array([8.0])), 4.0)
        >>> y.data, y.scale
        (Array([2.], dtype=float32), Array(4., dtype=float32))
    """
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        scale = jnp.asarray(float(scale), jnp.float32)
    if np.shape(scale) != ():
        raise ValueError(f"set_scaling: the scale must be a scalar, got shape {np.shape(scale)}.")
    if not is_floating(scale):
        raise TypeError(
            f"set_scaling: the scale must be floating point, got {getattr(scale, 'dtype', scale)}."
        )
    if isinstance(x, ScaledArray) or isinstance(scale, ScaledArray):
        from ..core.interpreter import autoscale

        return autoscale(set_scaling_p.bind)(x, scale)
    return set_scaling_p.bind(x, scale)


# --- stop_scaling ------------------------------------------------------------------------


def _stop_scaling_impl(x: Array, *, dtype: Any) -> Array:
    return x if dtype is None else jax.lax.convert_element_type(x, dtype)


def _stop_scaling_jvp(primitive: Any, primals: Any, tangents: Any, *, dtype: Any) -> Any:
    x_dot = _compat.instantiate_zeros(tangents[0])
    return primitive.bind(*primals, dtype=dtype), _stop_scaling_impl(x_dot, dtype=dtype)


stop_scaling_p = define_primitive(
    "stop_scaling",
    _stop_scaling_impl,
    lambda x, *, dtype: x if dtype is None else x.update(dtype=jnp.dtype(dtype), weak_type=False),
    batching=batch_along_operand_0,
    jvp=_stop_scaling_jvp,
)


@register_scaling_op(stop_scaling_p, "materialise the value")
def scaled_stop_scaling(x: Any, *, dtype: Any) -> Array:
    if isinstance(x, ScaledArray):
        return x.to_array(dtype)
    return _stop_scaling_impl(x, dtype=dtype)


# A block scale is applied block by block (`to_array` repeats it over its block), without a
# detour through one scale per tensor, which would flush the blocks far below the largest.
registry.register_block_rule(stop_scaling_p, scaled_stop_scaling)


def stop_scaling(x: Array, dtype: Any = None) -> Array:
    """The plain array `x` represents, optionally cast to `dtype`.

    Examples:
        >>> import jax_scaled_arithmetics as jsa
        >>> jsa.lax.stop_scaling(jsa.scaled_array([1.0, 2.0], 4.0))
        Array([4., 8.], dtype=float32)
    """
    if dtype is not None:
        dtype = jnp.dtype(dtype)
    if isinstance(x, ScaledArray):
        return x.to_array(dtype)
    return stop_scaling_p.bind(x, dtype=dtype)


# --- as_scaled: `as_scaled_array` inside a function that autoscale traces ----------------


def _as_scaled_impl(x: Array, *scale: Array, dtype: Any, scale_shape: Any) -> Array:
    return x if dtype is None else jax.lax.convert_element_type(x, dtype)


def _as_scaled_jvp(primitive: Any, primals: Any, tangents: Any, **params: Any) -> Any:
    x_dot = _compat.instantiate_zeros(tangents[0])
    return primitive.bind(*primals, **params), _as_scaled_impl(x_dot, **params)


def _as_scaled_batch(primitive: Any, args: Any, dims: Any, **params: Any) -> Any:
    if len(dims) > 1 and dims[1] is not None:
        raise ValueError(
            "as_scaled_array: the scale must be the same for the whole batch, but it is "
            "batched by vmap."
        )
    return primitive.bind(*args, **params), dims[0]


as_scaled_p = define_primitive(
    "as_scaled",
    _as_scaled_impl,
    lambda x, *scale, dtype, scale_shape: (
        x if dtype is None else x.update(dtype=jnp.dtype(dtype), weak_type=False)
    ),
    batching=_as_scaled_batch,
    jvp=_as_scaled_jvp,
)


@register_scaling_op(as_scaled_p, "a value made scaled (as_scaled_array inside autoscale)")
def scaled_as_scaled(x: Any, *scale: Any, dtype: Any, scale_shape: Any) -> Any:
    if isinstance(x, ScaledArray):  # scaled already: kept, as `as_scaled_array` keeps it
        return x if dtype is None else x.astype(dtype)
    return scaled_leaf(x, _plain(scale[0]) if scale else None, dtype, scale_shape)


registry.register_block_rule(as_scaled_p, scaled_as_scaled)


def _bind_as_scaled(x: Array, scale: Any, dtype: Any, scale_shape: Any) -> Array:
    """`as_scaled_array` of one floating leaf inside a function that autoscale traces: a
    stand-in that the interpreter makes a ScaledArray (one that is scaled already stays as
    it is), as outside."""
    if isinstance(scale_shape, list):
        scale_shape = tuple(scale_shape)
    params = {"dtype": None if dtype is None else jnp.dtype(dtype), "scale_shape": scale_shape}
    if scale is None:
        return as_scaled_p.bind(x, **params)
    return as_scaled_p.bind(x, jnp.asarray(scale, jnp.float32), **params)


def _bind_stop_scaling(x: Array, dtype: Any) -> Array:
    """`asarray` of one floating leaf inside a function that autoscale traces: the plain
    array it represents."""
    return stop_scaling_p.bind(x, dtype=None if dtype is None else jnp.dtype(dtype))


set_trace_conversions(_bind_as_scaled, _bind_stop_scaling)


# --- get_data_scale ----------------------------------------------------------------------


def _get_data_scale_impl(x: Array) -> list[Array]:
    return [x, jnp.ones((), jnp.float32)]


def _get_data_scale_jvp(primitive: Any, primals: Any, tangents: Any) -> Any:
    data, scale = primitive.bind(*primals)
    x_dot = _compat.instantiate_zeros(tangents[0])
    return [data, scale], [x_dot, jnp.zeros_like(scale)]


get_data_scale_p = define_primitive(
    "get_data_scale",
    _get_data_scale_impl,
    lambda x: [x, jax.core.ShapedArray((), jnp.float32)],
    multiple_results=True,
    batching=lambda primitive, args, dims: (primitive.bind(*args), [dims[0], None]),
    jvp=_get_data_scale_jvp,
)


@register_scaling_op(get_data_scale_p, "(data, scale) as plain arrays")
def scaled_get_data_scale(x: Any) -> list[Array]:
    if isinstance(x, ScaledArray):
        return [x.data, jnp.asarray(x.scale)]
    return _get_data_scale_impl(x)


def get_data_scale(x: Array) -> tuple[Array, Array]:
    """The `(data, scale)` of `x`; a plain array gives `(x, 1.0)`.

    Examples:
        >>> import jax_scaled_arithmetics as jsa
        >>> jsa.lax.get_data_scale(jsa.scaled_array([1.0], 4.0))
        (Array([1.], dtype=float32), Array(4., dtype=float32))
    """
    if isinstance(x, ScaledArray):
        return x.data, jnp.asarray(x.scale)
    data, scale = get_data_scale_p.bind(x)
    return data, scale


# --- rebalance ---------------------------------------------------------------------------

rebalance_p = define_identity_primitive("rebalance", batch_along_operand_0_if_unbatched(factor=1))


@register_scaling_op(rebalance_p, "move a factor from scale to data")
def scaled_rebalance(x: Any, factor: Any) -> Any:
    if not isinstance(x, ScaledArray):
        return x
    return rebalance_by(x, _usable_factor(jnp.asarray(_plain(factor)), "rebalance", "factor", 1.0))


def rebalance_by(x: ScaledArray, factor: Any, inverse: Any = None) -> ScaledArray:
    """`x`'s data times `factor`, its scale divided by it (times `inverse`, `1 / factor`
    exactly, when the caller has it), for a factor the caller knows to be finite and
    positive (dynamic rescaling's powers of two): no check."""
    cdtype = compute_dtype(x.dtype)
    data = (x.data.astype(cdtype) * factor.astype(cdtype)).astype(x.dtype)
    if inverse is not None:
        return ScaledArray(data, scale_mul(x.scale, inverse))
    return ScaledArray(data, scale_div(x.scale, factor.astype(jnp.float32)))


@registry.register_block_rule(rebalance_p)
def _block_rebalance(x: Any, factor: Any) -> Any:
    """Every block's data multiplied by `factor`, its scale divided by it."""
    factor = _usable_factor(jnp.asarray(_plain(factor), jnp.float32), "rebalance", "factor", 1.0)
    return block_rebalance_by(x, factor)


def block_rebalance_by(x: ScaledArray, factor: Any) -> ScaledArray:
    """:func:`rebalance_by` for a block-scaled `x`: every block's scale divided by `factor`."""
    cdtype = compute_dtype(x.dtype)
    data = (x.data.astype(cdtype) * factor.astype(cdtype)).astype(x.dtype)
    scale = jnp.asarray(x.scale, jnp.float32)
    return ScaledArray(data, block_scales.ratio(scale, jnp.broadcast_to(factor, scale.shape)))


def rebalance(x: Array, factor: Array) -> Any:
    """Multiply the data by `factor` and divide the scale by it (value unchanged).

    The factor must be finite and positive: a known bad one raises a ValueError; inside
    `jax.jit`, where a computed factor is not known, a bad one is taken as 1.

    Examples:
        >>> import jax_scaled_arithmetics as jsa
        >>> y = jsa.lax.rebalance(jsa.scaled_array([1.0], 4.0), 2.0)
        >>> y.data, y.scale
        (Array([2.], dtype=float32), Array(2., dtype=float32))
    """
    if np.shape(factor) != ():
        raise ValueError(f"rebalance: the factor must be a scalar, got shape {np.shape(factor)}.")
    if not is_floating(factor):
        raise TypeError("rebalance: the factor must be floating point.")
    if isinstance(x, ScaledArray):
        from ..core.interpreter import autoscale

        return autoscale(rebalance_p.bind)(x, factor)
    return rebalance_p.bind(x, factor)


# --- apply_to_data -----------------------------------------------------------------------
#
# An elementwise function applied to what is stored: the data of a ScaledArray (scale kept),
# or the array itself when it is plain. Casts to FP8 and format simulation act on the stored
# data, whose range the scale was chosen for, not on the represented value.


def _apply_to_data_impl(x: Array, *extra: Array, fn: Any) -> Array:
    return fn(x, *extra)


def _apply_to_data_abstract_eval(x: Any, *extra: Any, fn: Any) -> Any:
    out = jax.eval_shape(
        fn,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        *[jax.ShapeDtypeStruct(e.shape, e.dtype) for e in extra],
    )
    same = tuple(out.shape) == tuple(x.shape)
    return _compat.aval_like(x, out.shape, out.dtype, range(len(out.shape)) if same else None)


@dataclasses.dataclass(frozen=True)
class _MappedOverBatch:
    """`fn` mapped over the leading axis of its operands (`None` in `in_axes`: not mapped)."""

    fn: Any
    in_axes: tuple[int | None, ...]

    def __call__(self, *args: Array) -> Array:
        return jax.vmap(self.fn, in_axes=self.in_axes)(*args)


def _apply_to_data_batch(primitive: Any, args: Any, dims: Any, *, fn: Any) -> Any:
    if all(dim is None for dim in dims[1:]):  # `fn` is elementwise in the data
        return primitive.bind(*args, fn=fn), dims[0]
    # A batched extra operand (one PRNG key per batch element): map `fn` itself over the
    # batch, with the data's batch axis first (broadcast when only the extras are batched).
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    x = args[0]
    x = jnp.broadcast_to(x, (size, *x.shape)) if dims[0] is None else jnp.moveaxis(x, dims[0], 0)
    extra = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args[1:], dims[1:])]
    in_axes = (0, *(None if d is None else 0 for d in dims[1:]))
    return primitive.bind(x, *extra, fn=_MappedOverBatch(fn, in_axes)), 0


def _apply_to_data_jvp(primitive: Any, primals: Any, tangents: Any, *, fn: Any) -> Any:
    out = primitive.bind(*primals, fn=fn)
    # Straight-through: the tangent passes unchanged (in the output's dtype).
    x_dot = _compat.instantiate_zeros(tangents[0])
    return out, jax.lax.convert_element_type(x_dot, out.dtype)


apply_to_data_p = define_primitive(
    "apply_to_data",
    _apply_to_data_impl,
    _apply_to_data_abstract_eval,
    batching=_apply_to_data_batch,
    jvp=_apply_to_data_jvp,
)


@register_scaling_op(apply_to_data_p, "elementwise function of the data", always_scaled=False)
def scaled_apply_to_data(x: Any, *extra: Any, fn: Any) -> Any:
    if isinstance(x, ScaledArray):
        return ScaledArray(fn(x.data, *[_plain(e) for e in extra]), x.scale)
    return fn(x, *[_plain(e) for e in extra])


@registry.register_block_rule(apply_to_data_p)
def _block_apply_to_data(x: Any, *extra: Any, fn: Any) -> Any:
    """Block scales are kept (`fn` acts element by element on the data: an FP8 cast or
    format simulation of each block at its own scale); per tensor if `fn` changes shape."""
    if isinstance(x, ScaledArray) and np.ndim(x.scale):
        data = fn(x.data, *[_plain(e) for e in extra])
        if np.shape(data) == x.shape:
            return ScaledArray(data, x.scale)
        x = ScaledArray(*block_scales.to_per_tensor(x.data, x.scale))
    return scaled_apply_to_data(x, *extra, fn=fn)


def apply_to_data(fn: Any, x: Array, *extra: Array) -> Any:
    """Apply the elementwise `fn(data, *extra)` to the stored data of `x`, keeping its scale.

    On a plain array (outside `autoscale`) `fn` applies to the array itself. `fn` must be
    hashable and compare equal across calls for jit caching (e.g. a frozen dataclass or a
    module-level function); its derivative is taken as the identity (straight-through).
    Under `vmap`, batched extra operands (one PRNG key per example) map `fn` itself over
    the batch.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jsa.scaled_array(jnp.array([1.2, -3.7]), 2.0**-30)
        >>> y = jsa.lax.apply_to_data(jnp.round, x)
        >>> y.data, y.scale == x.scale
        (Array([ 1., -4.], dtype=float32), Array(True, dtype=bool))
    """
    if isinstance(x, ScaledArray):
        from ..core.interpreter import autoscale

        return autoscale(lambda v, *e: apply_to_data_p.bind(v, *e, fn=fn))(x, *extra)
    return apply_to_data_p.bind(x, *extra, fn=fn)
