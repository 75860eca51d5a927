"""`vmap` over ScaledArrays: the data is mapped, a per-tensor scale is shared.

`jax.vmap` maps every leaf of its arguments, a ScaledArray's scalar scale too, which it
cannot (`in_axes=jsa.ScaledArray(0, None)` says not to). :func:`vmap` writes those
`in_axes` itself and gives back per-tensor ScaledArrays: an output whose scale came out
batched (one per example) is brought to the batch's largest scale.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .datatype import PackedScales, ScaledArray, is_packed_or_scaled_leaf, is_scaled_leaf
from .dtypes import compute_dtype

__all__ = ["vmap", "scaled_axes"]

Axis = int | None


def scaled_axes(tree: Any, axis: Axis = 0) -> Any:
    """`jax.vmap` axes for `tree`: `axis` for every array, and for a ScaledArray its data
    (`ScaledArray(axis, None)`: its scalar scale is shared by the batch).

    A ScaledArray whose scale is not a scalar (one scale per example, stacked) has its
    scale mapped along `axis` too. A `jsa.tree.PackedScales` has its data mapped and its
    scale vector shared.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jsa.as_scaled_array(jnp.ones((3, 2)))
        >>> axes = jsa.scaled_axes(x)
        >>> axes
        ScaledArray(data=0, scale=None)
        >>> jax.vmap(jsa.autoscale(lambda r: r * 2.0), in_axes=(axes,), out_axes=axes)(x).shape
        (3, 2)
    """

    def leaf_axes(leaf: Any) -> Any:
        if isinstance(leaf, PackedScales):  # its data mapped, its scalar scales shared
            packed = set(leaf.layout[1])
            axes = [axis if i in packed else leaf_axes(x) for i, x in enumerate(leaf.leaves)]
            return PackedScales(axes, None, leaf.layout)
        if isinstance(leaf, ScaledArray):
            scale_axis = None if axis is None or np.ndim(leaf.scale) == 0 else axis
            return ScaledArray(axis, scale_axis)  # type: ignore[arg-type]
        return axis

    return jax.tree_util.tree_map(leaf_axes, tree, is_leaf=is_packed_or_scaled_leaf)


def _expand_in_axes(in_axes: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    if isinstance(in_axes, list):
        in_axes = tuple(in_axes)
    if not isinstance(in_axes, tuple):
        in_axes = (in_axes,) * len(args)
    if len(in_axes) != len(args):
        raise ValueError(
            f"vmap in_axes has {len(in_axes)} entries for {len(args)} positional arguments;"
            " give one per argument (or a single int / None for all)."
        )
    expanded = []
    for prefix, arg in zip(in_axes, args, strict=True):
        expanded.append(
            jax.tree_util.tree_map(
                lambda axis, sub: axis if isinstance(axis, ScaledArray) else scaled_axes(sub, axis),
                prefix,
                arg,
                is_leaf=lambda x: x is None or isinstance(x, ScaledArray),
            )
        )
    return tuple(expanded)


def _per_tensor(out: ScaledArray, axis: int) -> ScaledArray:
    """A ScaledArray with a batched scale (shape `(B,)`) at the batch's largest scale."""
    scale = out.scale
    if np.ndim(scale) == 0:
        return out
    common = jnp.max(scale)
    ratio = jnp.where(common > 0, scale / jnp.where(common > 0, common, 1), 0)
    shape = [1] * out.data.ndim
    shape[axis] = scale.shape[0]
    compute = compute_dtype(out.data.dtype)
    data = out.data.astype(compute) * ratio.astype(compute).reshape(shape)
    return ScaledArray(data.astype(out.data.dtype), common.astype(scale.dtype))


def _apply_out_axes(out_axes: Any, outputs: Any) -> Any:
    def move(axis: Any, sub: Any) -> Any:
        def leaf(x: Any) -> Any:
            if axis is None or isinstance(axis, ScaledArray):  # given as jax.vmap takes it
                return x
            if isinstance(x, ScaledArray):
                data = jnp.moveaxis(x.data, 0, axis)
                return _per_tensor(ScaledArray(data, x.scale), axis % data.ndim)
            return jnp.moveaxis(x, 0, axis)

        return jax.tree_util.tree_map(leaf, sub, is_leaf=is_scaled_leaf)

    return jax.tree_util.tree_map(
        move, out_axes, outputs, is_leaf=lambda x: x is None or isinstance(x, ScaledArray)
    )


def vmap(
    fun: Callable[..., Any], in_axes: Any = 0, out_axes: Any = 0, **vmap_kwargs: Any
) -> Callable[..., Any]:
    """`jax.vmap` for functions of ScaledArrays: their data is mapped, their scale shared.

    `in_axes` and `out_axes` are as for `jax.vmap` (an int or None for everything, or a
    prefix tree), with an axis meaning the data's axis for a ScaledArray (a
    `ScaledArray(data_axis, scale_axis)` entry is passed to `jax.vmap` as given); other keyword
    arguments of `vmap` (`axis_name`, `axis_size`, `spmd_axis_name`) are passed on; keyword
    arguments of the batched function are mapped along axis 0. Outputs are
    per-tensor ScaledArrays: an output whose scale is one per example is brought to the
    largest of them (exact for powers of two). Works for `fun` under `jsa.autoscale` and
    for plain functions of ScaledArrays alike.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jsa.as_scaled_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), scale=2.0)
        >>> y = jsa.vmap(jsa.autoscale(lambda row: row * 2.0))(x)
        >>> y.to_array()
        Array([[2., 4.],
               [6., 8.]], dtype=float32)
    """
    if isinstance(out_axes, list):
        out_axes = tuple(out_axes)
    jax_out_axes = jax.tree_util.tree_map(
        lambda axis: axis if axis is None or isinstance(axis, ScaledArray) else 0,
        out_axes,
        is_leaf=lambda x: x is None or isinstance(x, ScaledArray),
    )

    @functools.wraps(fun)
    def batched(*args: Any, **kwargs: Any) -> Any:
        # Keyword arguments are mapped along axis 0, as `jax.vmap` maps them.
        axes = (_expand_in_axes(in_axes, args), scaled_axes(kwargs, 0))
        mapped = jax.vmap(
            lambda a, k: fun(*a, **k), in_axes=axes, out_axes=jax_out_axes, **vmap_kwargs
        )
        return _apply_out_axes(out_axes, mapped(args, kwargs))

    return batched
