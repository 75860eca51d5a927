"""Low-precision casts and format simulation of scaled data, on the forward or backward pass.

All of them act on the stored data (a ScaledArray's data, whose range its scale was
chosen for; a plain array itself), and all have straight-through gradients:

- `cast_on_forward(x, dtype)`: a real cast of the data (e.g. to float8_e4m3fn); the
  gradient passes through, cast back to the input's dtype.
- `cast_on_backward(x, dtype)`: the identity forward; the gradient's data is rounded
  through a real cast to `dtype` (e.g. float8_e5m2) and back.
- `reduce_precision_on_forward(x, format)` / `_on_backward`: the same with simulated
  formats (any `jsa.quantization` format, nearest / toward-zero / stochastic rounding).
- `quantizer(forward_format, backward_format, ...)`: both at once, as one function.

Recommended FP8 pattern: rescale dynamically first, so the data uses the format's range,
then cast with saturation, e.g.
`jsa.ops.cast_on_forward(jsa.ops.dynamic_rescale_max(x), jnp.float8_e4m3fn, saturate=True)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..core.datatype import ScaledArray, is_floating
from ..core.interpreter import autoscale
from ..core.types import Array
from ..lax.scaling_primitives import apply_to_data
from ..quantization import float_quantize, get_format

__all__ = [
    "cast_on_forward",
    "cast_on_backward",
    "reduce_precision_on_forward",
    "reduce_precision_on_backward",
    "quantizer",
]


@dataclasses.dataclass(frozen=True)
class _DataCast:
    """Cast data to `dtype`, clamping to the format's finite range first when saturating."""

    dtype: Any
    saturate: bool

    def __call__(self, data: Array) -> Array:
        if self.saturate and jnp.issubdtype(self.dtype, jnp.floating):
            bound = float(jnp.finfo(self.dtype).max)
            data32 = data.astype(jnp.float32)
            data = jnp.where(jnp.isnan(data32), data32, jnp.clip(data32, -bound, bound))
        return data.astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class _DataQuantize:
    """Simulate a float format on the data (dtype kept)."""

    format_name: Any
    rounding: str
    saturate: bool

    def __call__(self, data: Array, *key: Array) -> Array:
        rounding: Any = self.rounding
        return float_quantize(
            data, self.format_name, rounding, self.saturate, key[0] if key else None
        )


def _check_float_dtype(dtype: Any) -> Any:
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"Expected a floating dtype, got {dtype!r}.") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"Expected a floating dtype, got {dtype}.")
    return dtype


def _map_floating(fn: Callable[[Any], Any], tree: Any) -> Any:
    def apply(x: Any) -> Any:
        if isinstance(x, ScaledArray):
            return autoscale(fn)(x)
        return fn(x) if is_floating(x) else x

    return jax.tree_util.tree_map(apply, tree, is_leaf=lambda v: isinstance(v, ScaledArray))


def _straight_through_forward(op: Callable[[Array], Array]) -> Callable[[Array], Array]:
    """`op` on the forward pass; the cotangent passes through, in the input's dtype."""

    @jax.custom_vjp
    def forward(x: Array) -> Array:
        return op(x)

    def fwd(x: Array) -> tuple[Array, Any]:
        return op(x), jnp.zeros((0,), x.dtype)

    def bwd(dtype_carrier: Array, ct: Array) -> tuple[Array]:
        return (ct.astype(dtype_carrier.dtype),)

    forward.defvjp(fwd, bwd)
    return forward


def _on_backward(op: Callable[[Array], Array]) -> Callable[[Array], Array]:
    """The identity on the forward pass; `op` applied to the cotangent."""

    @jax.custom_vjp
    def backward(x: Array) -> Array:
        return x

    def fwd(x: Array) -> tuple[Array, None]:
        return x, None

    def bwd(_: None, ct: Array) -> tuple[Array]:
        return (op(ct),)

    backward.defvjp(fwd, bwd)
    return backward


def cast_on_forward(x: Any, dtype: Any, saturate: bool = False) -> Any:
    """Cast the data of every floating leaf of `x` to `dtype`; gradients pass through.

    A ScaledArray keeps its scale and gets data of `dtype` (a real cast, e.g. to
    float8_e4m3fn). With `saturate=True`, data beyond the dtype's largest finite value is
    clamped to it instead of becoming inf/NaN. Works inside `autoscale` and outside it.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jsa.scaled_array(jnp.array([1.0, 1000.0]), 2.0**-40)
        >>> y = jsa.ops.cast_on_forward(x, jnp.float8_e4m3fn, saturate=True)
        >>> y.dtype, y.to_array(jnp.float32) * 2.0**40
        (dtype(float8_e4m3fn), Array([  1., 448.], dtype=float32))
    """
    cast = _DataCast(_check_float_dtype(dtype), bool(saturate))
    return _map_floating(_straight_through_forward(lambda v: apply_to_data(cast, v)), x)


def cast_on_backward(x: Any, dtype: Any, saturate: bool = False) -> Any:
    """The identity forward; on the backward pass the gradient's data is cast to `dtype`.

    The cotangent's data goes through a real cast to `dtype` (e.g. float8_e5m2) and back to
    the input's dtype, so the gradient is rounded to the format (saturating if asked).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> grad = jax.grad(lambda v: (jsa.ops.cast_on_backward(v, jnp.float8_e5m2) * 1.1).sum())
        >>> grad(jnp.ones(2))  # 1.1 rounded to float8_e5m2
        Array([1., 1.], dtype=float32)
    """
    cast_to = _DataCast(_check_float_dtype(dtype), bool(saturate))

    def round_trip(ct: Array) -> Array:
        back = _DataCast(jnp.dtype(ct.dtype), False)
        return apply_to_data(back, apply_to_data(cast_to, ct))

    return _map_floating(_on_backward(round_trip), x)


def _quantize_op(
    format: Any, rounding: str, saturate: bool, key: Array | None
) -> Callable[[Array], Array]:
    fmt = get_format(format)
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs a PRNG `key`.")
    quantize = _DataQuantize(fmt, rounding, bool(saturate))
    if key is None:
        return lambda v: apply_to_data(quantize, v)
    return lambda v: apply_to_data(quantize, v, key)


def reduce_precision_on_forward(
    x: Any,
    format: Any,
    rounding: str = "nearest",
    saturate: bool = False,
    key: Array | None = None,
) -> Any:
    """Round the data of every floating leaf of `x` to a float `format`; gradients pass through.

    `format` is any `jsa.quantization` format (preset name, dtype, `FloatFormat`, or a
    posit name `"posit{nbits}_es{es}"` / `PositFormat`), the dtype is kept (simulation).
    See `jsa.quantization.float_quantize` for rounding modes.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jsa.scaled_array(jnp.array([1.1, 3.3]), 2.0**-50)
        >>> jsa.ops.reduce_precision_on_forward(x, "float8_e4m3fn").data
        Array([1.125, 3.25 ], dtype=float32)
    """
    op = _quantize_op(format, rounding, saturate, key)
    return _map_floating(_straight_through_forward(op), x)


def reduce_precision_on_backward(
    x: Any,
    format: Any,
    rounding: str = "nearest",
    saturate: bool = False,
    key: Array | None = None,
) -> Any:
    """The identity forward; on the backward pass the gradient's data is rounded to `format`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> f = lambda v: (jsa.ops.reduce_precision_on_backward(v, "float8_e5m2") * 1.1).sum()
        >>> jax.grad(f)(jnp.ones(2))
        Array([1., 1.], dtype=float32)
    """
    op = _quantize_op(format, rounding, saturate, key)
    return _map_floating(_on_backward(op), x)


def quantizer(
    forward_format: Any = None,
    backward_format: Any = None,
    forward_rounding: str = "nearest",
    backward_rounding: str = "nearest",
    saturate: bool = False,
) -> Callable[..., Any]:
    """A function quantising the data to `forward_format` and its gradient to `backward_format`.

    Either format may be None (no quantisation on that pass). The returned function takes
    `(x, key=None)`; stochastic rounding needs the key (split for the two passes).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> q = jsa.ops.quantizer("float8_e4m3fn", "float8_e5m2")
        >>> q(jnp.array([1.1, 3.3]))
        Array([1.125, 3.25 ], dtype=float32)
    """
    for fmt in (forward_format, backward_format):
        if fmt is not None:
            get_format(fmt)

    def quantize(x: Any, key: Array | None = None) -> Any:
        forward_key = backward_key = None
        if key is not None:
            forward_key, backward_key = jax.random.split(key)
        if forward_format is not None:
            x = reduce_precision_on_forward(
                x, forward_format, forward_rounding, saturate, forward_key
            )
        if backward_format is not None:
            x = reduce_precision_on_backward(
                x, backward_format, backward_rounding, saturate, backward_key
            )
        return x

    return quantize
