"""Pytree utilities that treat a `ScaledArray` as a single leaf.

`jax.tree_util` flattens a ScaledArray into its two leaves, `data` and `scale`.
The functions here stop at the ScaledArray instead, so that a function mapped
over a tree sees whole ScaledArrays. Leaves are decided by
:func:`~jax_scaled_arithmetics.core.datatype.is_scaled_leaf` (plus an optional
user `is_leaf`); `None` stays an empty subtree, as in `jax.tree_util`.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from ..core import datatype as _datatype
from ..core.datatype import (
    PackedScales,
    ScaledArray,
    is_floating,
    is_packed_or_scaled_leaf,
    is_scaled_leaf,
    pack_scales,
    unpack_scales,
)

DTypeLike = Any
IsLeaf = Callable[[Any], bool]

__all__ = [
    "map",
    "leaves",
    "flatten",
    "unflatten",
    "structure",
    "astype",
    "all",
    "as_scaled_array",
    "asarray",
    "astype_leaf",
    "PackedScales",
    "pack_scales",
    "unpack_scales",
]


def _leaf_predicate(is_leaf: IsLeaf | None) -> IsLeaf:
    """`is_scaled_leaf` (without `None`, an empty subtree) or'ed with the user's `is_leaf`."""
    if is_leaf is None:
        return lambda x: x is not None and is_scaled_leaf(x)
    user_is_leaf = is_leaf
    return lambda x: (x is not None and is_scaled_leaf(x)) or bool(user_is_leaf(x))


def map(  # shadows the builtin on purpose, like tree_util
    fn: Callable[..., Any], tree: Any, *rest: Any, is_leaf: IsLeaf | None = None
) -> Any:
    """Like `jax.tree_util.tree_map`, with every ScaledArray passed whole to `fn`.

    Args:
        fn: function of as many arguments as there are trees.
        tree: the pytree whose structure the result takes.
        *rest: further pytrees, each with `tree`'s structure (or a prefix-compatible one).
        is_leaf: optional extra predicate marking subtrees to treat as leaves.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> tree = {"w": jsa.scaled_array(jnp.ones(2), 4.0), "b": jnp.zeros(3)}
        >>> jsa.tree.map(lambda x: type(x).__name__, tree)
        {'b': 'ArrayImpl', 'w': 'ScaledArray'}
    """
    return jax.tree_util.tree_map(fn, tree, *rest, is_leaf=_leaf_predicate(is_leaf))


def leaves(tree: Any, is_leaf: IsLeaf | None = None) -> list[Any]:
    """The leaves of `tree`, a ScaledArray counting as one leaf.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> tree = [jsa.scaled_array(jnp.ones(2), 4.0), 3, None]
        >>> [type(x).__name__ for x in jsa.tree.leaves(tree)]
        ['ScaledArray', 'int']
    """
    return jax.tree_util.tree_leaves(tree, is_leaf=_leaf_predicate(is_leaf))


def flatten(tree: Any, is_leaf: IsLeaf | None = None) -> tuple[list[Any], Any]:
    """Flatten `tree` into `(leaves, treedef)`, a ScaledArray counting as one leaf.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> flat, treedef = jsa.tree.flatten({"a": jsa.scaled_array(jnp.ones(2), 2.0)})
        >>> len(flat), treedef.num_leaves
        (1, 1)
        >>> jsa.tree.unflatten(treedef, flat)["a"].scale
        Array(2., dtype=float32)
    """
    return jax.tree_util.tree_flatten(tree, is_leaf=_leaf_predicate(is_leaf))


def unflatten(treedef: Any, leaves: Iterable[Any]) -> Any:
    """Rebuild a pytree from a `treedef` (from :func:`flatten` or :func:`structure`) and leaves.

    Examples:
        >>> import jax_scaled_arithmetics as jsa
        >>> treedef = jsa.tree.structure({"a": 0, "b": (0, 0)})
        >>> jsa.tree.unflatten(treedef, [1, 2, 3])
        {'a': 1, 'b': (2, 3)}
    """
    return jax.tree_util.tree_unflatten(treedef, leaves)


def structure(tree: Any, is_leaf: IsLeaf | None = None) -> Any:
    """The treedef of `tree`, a ScaledArray counting as one leaf.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> jsa.tree.structure([jsa.scaled_array(jnp.ones(2), 2.0), 1.0]).num_leaves
        2
    """
    return jax.tree_util.tree_structure(tree, is_leaf=_leaf_predicate(is_leaf))


def _has_dtype(x: Any) -> bool:
    return isinstance(x, ScaledArray) or hasattr(x, "dtype")


def astype_leaf(x: Any, dtype: DTypeLike, floating_only: bool = True) -> Any:
    """Cast one leaf (see :func:`astype`)."""
    if isinstance(x, ScaledArray):
        if floating_only and not is_floating(x.data):
            return x
        return x.astype(dtype)
    if not hasattr(x, "dtype") or not hasattr(x, "astype"):
        # Python scalars (weakly typed in JAX) and other objects are left alone.
        return x
    if floating_only and not is_floating(x):
        return x
    return x.astype(dtype)


def astype(tree: Any, dtype: DTypeLike, floating_only: bool = True) -> Any:
    """Cast the array leaves of `tree` to `dtype`.

    A ScaledArray is cast by casting its data; its scale is kept. With
    `floating_only` (the default) only floating-point leaves are cast, and
    integer and boolean leaves pass through. Leaves without a dtype (Python
    scalars, which JAX treats as weakly typed, strings, ...) are never touched. A
    `PackedScales` is cast as its ScaledArrays are, and stays packed.

    Args:
        tree: a pytree of arrays and ScaledArrays.
        dtype: the target dtype.
        floating_only: cast only floating-point leaves.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> tree = {"w": jsa.scaled_array(jnp.ones(2), 4.0), "b": jnp.zeros(2), "n": jnp.arange(2)}
        >>> out = jsa.tree.astype(tree, jnp.bfloat16)
        >>> out["w"].dtype, out["w"].scale.dtype, out["b"].dtype, out["n"].dtype
        (dtype(bfloat16), dtype('float32'), dtype(bfloat16), dtype('int32'))
    """
    dtype = jnp.dtype(dtype)
    return jax.tree_util.tree_map(
        lambda x: (
            pack_scales(astype(x.unpack(), dtype, floating_only))
            if isinstance(x, PackedScales)
            else astype_leaf(x, dtype, floating_only)
        ),
        tree,
        is_leaf=is_packed_or_scaled_leaf,
    )


def _truthy(x: Any) -> bool:
    if isinstance(x, ScaledArray):
        x = x.to_array()
    return bool(x)


def all(tree: Any, is_leaf: IsLeaf | None = None) -> bool:
    """True iff every leaf of `tree` is truthy, like `jax.tree_util.tree_all`.

    A ScaledArray leaf is truthy as the value it represents (so it must be a
    scalar, as for a plain array). An empty tree gives True.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> jsa.tree.all({"a": True, "b": jnp.array(1.0)})
        True
        >>> jsa.tree.all([jsa.scaled_array(jnp.array(1.0), 0.0)])
        False
    """
    return builtins.all(_truthy(x) for x in leaves(tree, is_leaf=is_leaf))


def as_scaled_array(tree: Any, scale: Any = None, dtype: DTypeLike | None = None) -> Any:
    """Convert the floating leaves of `tree` to ScaledArrays (see `core.datatype`).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> out = jsa.tree.as_scaled_array({"w": jnp.array([2.0, 4.0]), "n": 3}, scale=2.0)
        >>> out["w"].data, out["n"]
        (Array([1., 2.], dtype=float32), 3)
    """
    return _datatype.as_scaled_array(tree, scale=scale, dtype=dtype)


def asarray(tree: Any, dtype: DTypeLike | None = None) -> Any:
    """Convert every ScaledArray of `tree` to the plain array it represents (see `core.datatype`).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> jsa.tree.asarray({"w": jsa.scaled_array(jnp.array([1.0, 3.0]), 2.0)})
        {'w': Array([2., 6.], dtype=float32)}
    """
    return _datatype.asarray(tree, dtype=dtype)
