"""Loss scaling for low-precision training, and the finiteness helpers it needs.

The API follows DeepMind's `jmp` (`NoOpLossScale`, `StaticLossScale`,
`DynamicLossScale`, `all_finite`, `select_tree`). ScaledArray leaves are
handled exactly: scaling a ScaledArray multiplies its scale and keeps its data.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from ..core import _compat
from ..core.datatype import ScaledArray, is_floating
from ..core.dtypes import compute_dtype
from ..core.types import Array
from ..tree._src import leaves as _tree_leaves
from ..tree._src import map as _tree_map

__all__ = [
    "BooleanScalarError",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "DynamicLossScale",
    "all_finite",
    "select_tree",
]


def _as_float_array(x: Any) -> Array:
    """`x` as a JAX array; Python scalars become float32."""
    if isinstance(x, (int, float)):
        return jnp.asarray(x, jnp.float32)
    return jnp.asarray(x)


def _rescale_leaf(x: Any, loss_scale: Array, multiply: bool) -> Any:
    """Multiply (or divide) one floating leaf by `loss_scale`; other leaves pass through."""
    if x is None:
        return x
    if isinstance(x, ScaledArray):
        scale = jnp.asarray(x.scale)
        ls = loss_scale.astype(scale.dtype)
        return ScaledArray(x.data, scale * ls if multiply else scale / ls)
    if not is_floating(x):
        return x
    arr = jnp.asarray(x)
    compute = compute_dtype(arr.dtype, loss_scale.dtype)
    value, ls = arr.astype(compute), loss_scale.astype(compute)
    return (value * ls if multiply else value / ls).astype(arr.dtype)


def _rescale(tree: Any, loss_scale: Any, multiply: bool) -> Any:
    loss_scale = _as_float_array(loss_scale)
    return _tree_map(lambda x: _rescale_leaf(x, loss_scale, multiply), tree)


class BooleanScalarError(TypeError, ValueError, AssertionError):
    """A predicate (`grads_finite`, `select_tree`'s `pred`) that is not a boolean scalar.

    A `TypeError` (wrong dtype) and a `ValueError` (wrong shape), and an `AssertionError`,
    which is what `jmp` raises there: code written for either keeps catching it.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> try:
        ...     jsa.mp.select_tree(jnp.array([True, False]), 1.0, 2.0)
        ... except ValueError as error:  # also a TypeError and an AssertionError
        ...     print(type(error).__name__)
        BooleanScalarError
    """


def _check_bool_scalar(x: Any, name: str) -> Array:
    """Check statically that `x` is a boolean scalar (works on tracers); return it as an array."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        if isinstance(x, (bool, np.bool_)):
            return jnp.asarray(x)
        raise BooleanScalarError(f"{name}: expected boolean scalar, got {type(x).__name__} {x!r}.")
    if jnp.dtype(dtype) != jnp.dtype(bool):
        raise BooleanScalarError(
            f"{name}: expected boolean scalar, got dtype {dtype}; compare explicitly, e.g. "
            "`jsa.mp.all_finite(grads)`."
        )
    shape = tuple(getattr(x, "shape", ()))
    if shape != ():
        raise BooleanScalarError(
            f"{name}: expected boolean scalar, got shape {shape}; reduce it first, e.g. "
            "with `jnp.all`."
        )
    return jnp.asarray(x)


def _warn_if_not_floating(x: Any, name: str) -> None:
    """Warn, as `jmp` does, when a loss-scale field is an array of a non-floating dtype (a
    Python number is computed in float32; a tracer or JAX's placeholder is not checked)."""
    if _compat.is_tracer(x) or not hasattr(x, "dtype") or is_floating(x):
        return
    warnings.warn(
        f"Expected floating type for {name}, got {x.dtype}.",
        stacklevel=4,
    )


class LossScale(Protocol):
    """The interface shared by the loss scales: `loss_scale`, `scale`, `unscale`, `adjust`.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> def scaled_loss(loss_scale: jsa.mp.LossScale, loss):
        ...     return loss_scale.scale(loss)
        >>> scaled_loss(jsa.mp.StaticLossScale(2.0**10), jnp.float32(0.5))
        Array(512., dtype=float32)
        >>> scaled_loss(jsa.mp.NoOpLossScale(), jnp.float32(0.5))
        Array(0.5, dtype=float32)
    """

    @property
    def loss_scale(self) -> Array: ...

    def scale(self, tree: Any) -> Any: ...

    def unscale(self, tree: Any) -> Any: ...

    def adjust(self, grads_finite: Array) -> LossScale: ...


@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale:
    """A loss scale that does nothing: `loss_scale` is 1 and `scale`/`unscale` return the tree.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> ls = jsa.mp.NoOpLossScale()
        >>> float(ls.loss_scale), float(ls.scale(jnp.array(3.0)))
        (1.0, 3.0)
    """

    @property
    def loss_scale(self) -> Array:
        return jnp.ones((), jnp.float32)

    def scale(self, tree: Any) -> Any:
        """Return `tree` unchanged."""
        return tree

    def unscale(self, tree: Any) -> Any:
        """Return `tree` unchanged."""
        return tree

    def adjust(self, grads_finite: Array) -> NoOpLossScale:
        """Return `self` (after checking `grads_finite` is a boolean scalar)."""
        _check_bool_scalar(grads_finite, "grads_finite")
        return self


class _ScalesByLossScale:
    """`scale` and `unscale` by the `loss_scale` attribute (static or dynamic)."""

    loss_scale: Array

    def scale(self, tree: Any) -> Any:
        """Multiply the floating leaves of `tree` by the loss scale."""
        return _rescale(tree, self.loss_scale, multiply=True)

    def unscale(self, tree: Any) -> Any:
        """Divide the floating leaves of `tree` by the loss scale."""
        return _rescale(tree, self.loss_scale, multiply=False)


@dataclasses.dataclass(frozen=True)
class StaticLossScale(_ScalesByLossScale):
    """A constant loss scale.

    `scale` multiplies every floating leaf of a tree by `loss_scale` (computing
    in at least float32 and rounding back to the leaf's dtype); a ScaledArray
    leaf gets its scale multiplied, its data kept, which is exact. `unscale`
    divides likewise. Integer, boolean and `None` leaves pass through.

    As in `jmp`, the class is a pytree with no leaves: the loss scale is static (a
    constant of the compiled program). Build it from a concrete number; a loss scale
    that changes is a :class:`DynamicLossScale`.

    Attributes:
        loss_scale: the loss scale, a float scalar (a power of two keeps
            scaling exact).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> ls = jsa.mp.StaticLossScale(jnp.float32(2.0**10))
        >>> ls.scale(jnp.array([3.0], jnp.float16)).tolist()
        [3072.0]
        >>> ls.unscale(jsa.scaled_array(jnp.ones(2, jnp.float16), 2.0**10)).scale
        Array(1., dtype=float32)
    """

    loss_scale: Array

    def __post_init__(self) -> None:
        _warn_if_not_floating(self.loss_scale, "loss_scale")

    @functools.cached_property
    def _static_loss_scale(self) -> _Static:
        return _Static(self.loss_scale)

    def adjust(self, grads_finite: Array) -> StaticLossScale:
        """Return `self` (after checking `grads_finite` is a boolean scalar)."""
        _check_bool_scalar(grads_finite, "grads_finite")
        return self


def _zero_counter() -> Array:
    return np.zeros((), np.int32)


def _one_float32() -> Array:
    return np.ones((), np.float32)


@dataclasses.dataclass(frozen=True)
class DynamicLossScale(_ScalesByLossScale):
    """A loss scale that grows while gradients stay finite and shrinks when they do not.

    `scale` and `unscale` behave as for :class:`StaticLossScale`. `adjust(grads_finite)`
    returns the next state, by these rules:

    1. Finite gradients: `counter += 1`. When `counter` reaches `period`, it is
       reset to 0 and `loss_scale *= factor` -- but only if the grown loss
       scale is finite; otherwise the loss scale is kept.
    2. Non-finite gradients: `counter = 0` and
       `loss_scale = max(min_loss_scale, loss_scale / factor)`.

    The loss scale and counter keep their dtypes. As in `jmp`, the class is a pytree
    whose leaves are `loss_scale` and `counter`; `period`, `factor` and `min_loss_scale`
    are static metadata, and every field survives flattening and `jit` (`jmp` drops
    `min_loss_scale` there, which then falls back to 1).

    Attributes:
        loss_scale: current loss scale, a float scalar (float32 for Python numbers).
        counter: finite steps since the last change, an int32 scalar.
        period: number of consecutive finite steps before growing (a number >= 1).
        factor: growth and shrink factor (a number >= 1).
        min_loss_scale: floor of the loss scale, a concrete float scalar.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> ls = jsa.mp.DynamicLossScale(jnp.float32(2.0**15), period=2)
        >>> ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
        >>> float(ls.loss_scale), int(ls.counter)
        (65536.0, 0)
        >>> ls = jax.jit(lambda s, f: s.adjust(f))(ls, jnp.array(False))
        >>> float(ls.loss_scale), ls.period
        (32768.0, 2)
    """

    loss_scale: Array
    counter: Array = dataclasses.field(default_factory=_zero_counter)
    period: int = 2000
    factor: int = 2
    min_loss_scale: Array = dataclasses.field(default_factory=_one_float32)

    def __post_init__(self) -> None:
        # The array fields are only warned about: JAX rebuilds the class with
        # placeholder objects as the leaves.
        for name in ("period", "factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer)):
                raise TypeError(f"DynamicLossScale.{name} must be a number, got {value!r}.")
            if not value >= 1:
                raise ValueError(f"DynamicLossScale.{name} must be >= 1, got {value}.")
        _warn_if_not_floating(self.loss_scale, "loss_scale")
        _warn_if_not_floating(self.min_loss_scale, "min_loss_scale")

    @functools.cached_property
    def _static_min_loss_scale(self) -> _Static:
        return _Static(self.min_loss_scale)

    def adjust(self, grads_finite: Array) -> DynamicLossScale:
        """The next loss scale state, given whether the gradients were all finite.

        Args:
            grads_finite: boolean scalar, e.g. `all_finite(grads)`.

        Raises:
            TypeError: `grads_finite` does not have a boolean dtype.
            ValueError: `grads_finite` is not a scalar.
        """
        grads_finite = _check_bool_scalar(grads_finite, "grads_finite")
        loss_scale = _as_float_array(self.loss_scale)
        counter = self.counter
        counter = jnp.asarray(counter, jnp.int32 if isinstance(counter, int) else None)
        min_loss_scale = _as_float_array(self.min_loss_scale).astype(loss_scale.dtype)

        next_counter = counter + 1
        period_done = next_counter >= self.period
        grown = loss_scale * self.factor
        finite_scale = jnp.where(period_done & jnp.isfinite(grown), grown, loss_scale)
        finite_counter = jnp.where(period_done, jnp.zeros_like(counter), next_counter)
        shrunk = jnp.maximum(min_loss_scale, loss_scale / self.factor)

        new_loss_scale = jnp.where(grads_finite, finite_scale, shrunk).astype(loss_scale.dtype)
        new_counter = jnp.where(grads_finite, finite_counter, jnp.zeros_like(counter))
        return dataclasses.replace(
            self, loss_scale=new_loss_scale, counter=new_counter.astype(counter.dtype)
        )


class _Static:
    """A concrete array (or number) as pytree metadata: compared and hashed by its dtype,
    shape and bytes, so that jit finds its compiled program again for an equal value; a
    tracer (a value built inside a traced function) by identity."""

    def __init__(self, value: Any) -> None:
        self.value = value
        if _compat.is_tracer(value):
            self.key: Any = ("tracer", id(value))
        else:
            array = np.asarray(value)
            self.key = (array.dtype.str, array.shape, array.tobytes())

    def __repr__(self) -> str:
        return repr(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


def _flatten_static(ls: StaticLossScale) -> tuple[tuple[()], _Static]:
    return (), ls._static_loss_scale


def _unflatten_static(meta: _Static, leaves: Any) -> StaticLossScale:
    del leaves
    return StaticLossScale(meta.value)


_DYNAMIC_KEYS = (jax.tree_util.GetAttrKey("loss_scale"), jax.tree_util.GetAttrKey("counter"))


def _flatten_dynamic(ls: DynamicLossScale) -> tuple[Any, Any]:
    leaves = zip(_DYNAMIC_KEYS, (ls.loss_scale, ls.counter), strict=True)
    return tuple(leaves), (ls.period, ls.factor, ls._static_min_loss_scale)


def _unflatten_dynamic(meta: Any, leaves: Any) -> DynamicLossScale:
    loss_scale, counter = leaves
    period, factor, min_loss_scale = meta
    return DynamicLossScale(loss_scale, counter, period, factor, min_loss_scale.value)


jax.tree_util.register_dataclass(NoOpLossScale, data_fields=[], meta_fields=[])
jax.tree_util.register_pytree_node(StaticLossScale, _flatten_static, _unflatten_static)
jax.tree_util.register_pytree_with_keys(
    DynamicLossScale,
    _flatten_dynamic,
    _unflatten_dynamic,
    flatten_func=lambda ls: ((ls.loss_scale, ls.counter), _flatten_dynamic(ls)[1]),
)


def _leaf_all_finite(x: Any) -> Array | None:
    if isinstance(x, ScaledArray):
        return jnp.logical_and(jnp.all(jnp.isfinite(x.data)), jnp.all(jnp.isfinite(x.scale)))
    if x is None or not is_floating(x):
        return None
    return jnp.all(jnp.isfinite(jnp.asarray(x)))


def all_finite(tree: Any) -> Array:
    """A boolean scalar array: True iff every floating leaf of `tree` is finite (no inf, NaN).

    A ScaledArray counts as finite when both its data and its scale are finite
    (so the value it represents, `data * scale`, is a finite number). Non-floating
    leaves are ignored; an empty tree gives True.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> bool(jsa.mp.all_finite({"a": jnp.ones(2), "n": jnp.arange(3)}))
        True
        >>> bool(jsa.mp.all_finite([jsa.scaled_array(jnp.array([1.0, jnp.inf]), 1.0)]))
        False
    """
    checks = [c for c in (_leaf_all_finite(x) for x in _tree_leaves(tree)) if c is not None]
    if not checks:
        return jnp.asarray(True)
    return functools.reduce(jnp.logical_and, checks)


def select_tree(pred: Array, a: Any, b: Any) -> Any:
    """Select `a` when `pred` is True, else `b`, leaf by leaf (usable under `jit`).

    `a` and `b` must have identical structures, and matching leaf shapes and
    dtypes. A ScaledArray is selected as its two leaves, data and scale.

    Args:
        pred: boolean scalar.
        a: tree returned where `pred` is True.
        b: tree returned where `pred` is False.

    Raises:
        TypeError: `pred` is not boolean, or two matching leaves differ in dtype.
        ValueError: `pred` is not a scalar, the structures differ, or two matching
            leaves differ in shape.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> jsa.mp.select_tree(jnp.array(False), {"x": jnp.zeros(2)}, {"x": jnp.ones(2)})
        {'x': Array([1., 1.], dtype=float32)}
    """
    pred = _check_bool_scalar(pred, "select_tree pred")
    a_leaves, a_def = jax.tree_util.tree_flatten(a)
    b_leaves, b_def = jax.tree_util.tree_flatten(b)
    if a_def != b_def:  # type: ignore[operator]
        raise ValueError(
            f"select_tree needs two trees of identical structure, got {a_def} and {b_def}."
        )
    out = []
    for i, (x, y) in enumerate(zip(a_leaves, b_leaves, strict=True)):
        x, y = jnp.asarray(x), jnp.asarray(y)
        if x.shape != y.shape:
            raise ValueError(f"select_tree leaf {i}: shapes differ, {x.shape} and {y.shape}.")
        if x.dtype != y.dtype:
            raise TypeError(f"select_tree leaf {i}: dtypes differ, {x.dtype} and {y.dtype}.")
        out.append(jax.lax.select(pred, x, y))
    return jax.tree_util.tree_unflatten(a_def, out)
