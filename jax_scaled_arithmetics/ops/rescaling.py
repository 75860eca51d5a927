"""Dynamic rescaling: move a power-of-two factor from data to scale, value unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core import blocks
from ..core.datatype import ScaledArray, is_floating, is_scaled_leaf
from ..core.interpreter import autoscale
from ..lax.scaling import get_data_scale, rebalance

__all__ = [
    "dynamic_rescale_max",
    "dynamic_rescale_l1",
    "dynamic_rescale_l2",
    "dynamic_rescale_max_grad",
    "dynamic_rescale_l1_grad",
    "dynamic_rescale_l2_grad",
]

Array = Any
DEFAULT_EPSILON = 2.0**-60


def _norm_max(data: Array) -> Array:
    return jnp.max(jnp.abs(data))


def _norm_l1(data: Array) -> Array:
    return jnp.mean(jnp.abs(data))


def _norm_l2(data: Array) -> Array:
    return jnp.sqrt(jnp.mean(jnp.square(data)))


def _rescale_leaf(x: Array, norm: Callable[[Array], Array], epsilon: float) -> Array:
    if not is_floating(x) or jnp.size(x) == 0:
        return x
    data, _ = get_data_scale(x)
    magnitude = norm(data.astype(jnp.float32))
    finite = jax.lax.is_finite(magnitude)
    magnitude = jax.lax.select(finite, jnp.maximum(magnitude, np.float32(epsilon)), np.float32(1.0))
    # The power of two at or below the magnitude, as exponent bits: its inverse is exact.
    bits = jax.lax.bitcast_convert_type(magnitude, jnp.int32) & np.int32(0x7F800000)
    bits = jnp.minimum(bits, np.int32(253 << 23))
    inverse = jax.lax.bitcast_convert_type(np.int32(254 << 23) - bits, jnp.float32)
    return rebalance(x, jax.lax.stop_gradient(inverse))


def _block_norms(data: Array, layout: tuple[int, ...], norm: Callable[[Array], Array]) -> Array:
    """`norm` of each block of `layout` (an array of the layout's shape), float32."""
    dims: list[int] = []
    for s, n in zip(layout, data.shape):
        dims += [s, n // s]
    blocked = data.astype(jnp.float32).reshape(tuple(dims))
    # Each block's elements moved to a trailing axis, then the norm over it.
    blocks_first = jnp.transpose(
        blocked, tuple(range(0, 2 * len(layout), 2)) + tuple(range(1, 2 * len(layout), 2))
    ).reshape(tuple(layout) + (-1,))
    return jax.vmap(norm)(blocks_first.reshape((-1, blocks_first.shape[-1]))).reshape(layout)


def _rescale_blocks(x: ScaledArray, norm: Callable[[Array], Array], epsilon: float) -> Any:
    """Block-scaled `x` rescaled block by block: each block's norm moves to its scale."""
    layout = blocks.block_layout(x.shape, np.shape(x.scale))
    if x.size == 0:
        return x
    magnitude = _block_norms(jnp.asarray(x.data), layout, norm)
    finite = jnp.isfinite(magnitude)
    magnitude = jnp.where(finite, jnp.maximum(magnitude, np.float32(epsilon)), np.float32(1.0))
    bits = jax.lax.bitcast_convert_type(magnitude, jnp.int32) & np.int32(0x7F800000)
    bits = jnp.clip(bits, np.int32(1 << 23), np.int32(253 << 23))
    factor = jax.lax.stop_gradient(jax.lax.bitcast_convert_type(bits, jnp.float32))
    inverse = jax.lax.stop_gradient(
        jax.lax.bitcast_convert_type(np.int32(254 << 23) - bits, jnp.float32)
    )
    data = jnp.asarray(x.data).astype(jnp.float32) * blocks.expand_scale(inverse, x.shape)
    scale = jnp.asarray(x.scale, jnp.float32).reshape(layout) * factor
    return ScaledArray(data.astype(x.dtype), scale.astype(jnp.asarray(x.scale).dtype))


def _rescale_tree(tree: Any, norm: Callable[[Array], Array], epsilon: float) -> Any:
    def rescale(x: Any) -> Any:
        if isinstance(x, ScaledArray) and np.ndim(x.scale):
            return _rescale_blocks(x, norm, epsilon)
        if isinstance(x, ScaledArray):
            return autoscale(lambda v: _rescale_leaf(v, norm, epsilon))(x)
        return _rescale_leaf(x, norm, epsilon)

    return jax.tree_util.tree_map(rescale, tree, is_leaf=is_scaled_leaf)


def dynamic_rescale_max(tree: Any, epsilon: float = DEFAULT_EPSILON) -> Any:
    """Rescale every scaled leaf so that its data's largest magnitude is in [1, 2).

    A power of two is moved from the data to the scale, so the value is
    unchanged (exactly). Plain arrays outside `autoscale` are returned as they
    are. `epsilon` floors the norm (all-zero data keeps a finite scale). A
    ScaledArray with a block scale is rescaled block by block (each block's data
    to [1, 2), the layout kept); inside `autoscale` leaves are rescaled per tensor.

    Examples:
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jsa.scaled_array([0.001, -0.002], 1.0)
        >>> y = jsa.ops.dynamic_rescale_max(x)
        >>> float(y.scale), y.to_array().tolist() == x.to_array().tolist()
        (0.001953125, True)
        >>> rows = jsa.scaled_array([[0.001, 0.002], [8.0, 3.0]], [[1.0], [1.0]])
        >>> jsa.ops.dynamic_rescale_max(rows).scale.tolist()
        [[0.001953125], [8.0]]
    """
    return _rescale_tree(tree, _norm_max, epsilon)


def dynamic_rescale_l1(tree: Any, epsilon: float = DEFAULT_EPSILON) -> Any:
    """Like :func:`dynamic_rescale_max`, with the mean absolute value of the data.

    Examples:
        >>> import jax_scaled_arithmetics as jsa
        >>> float(jsa.ops.dynamic_rescale_l1(jsa.scaled_array([4.0, 4.0], 1.0)).scale)
        4.0
    """
    return _rescale_tree(tree, _norm_l1, epsilon)


def dynamic_rescale_l2(tree: Any, epsilon: float = DEFAULT_EPSILON) -> Any:
    """Like :func:`dynamic_rescale_max`, with the root mean square of the data.

    Examples:
        >>> import jax_scaled_arithmetics as jsa
        >>> float(jsa.ops.dynamic_rescale_l2(jsa.scaled_array([3.0, 4.0], 1.0)).scale)
        2.0
    """
    return _rescale_tree(tree, _norm_l2, epsilon)


def _grad_variant(rescale_fn: Callable[..., Any], doc: str) -> Callable[..., Any]:
    @jax.custom_vjp
    def identity(x: Any) -> Any:
        return x

    def fwd(x: Any) -> tuple[Any, None]:
        return x, None

    def bwd(_: None, ct: Any) -> tuple[Any]:
        return (rescale_fn(ct),)

    identity.defvjp(fwd, bwd)

    def grad_rescale(tree: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda x: identity(x) if is_floating(x) else x, tree, is_leaf=is_scaled_leaf
        )

    grad_rescale.__doc__ = doc
    return grad_rescale


dynamic_rescale_max_grad = _grad_variant(
    dynamic_rescale_max,
    """Identity on the forward pass; dynamic_rescale_max of the gradient on the backward pass.""",
)
dynamic_rescale_l1_grad = _grad_variant(
    dynamic_rescale_l1,
    """Identity on the forward pass; dynamic_rescale_l1 of the gradient on the backward pass.""",
)
dynamic_rescale_l2_grad = _grad_variant(
    dynamic_rescale_l2,
    """Identity on the forward pass; dynamic_rescale_l2 of the gradient on the backward pass.""",
)
