"""Scaled optimizer states: optax states stored as low-precision ScaledArrays.

An optimizer state is stored as ScaledArrays with low-precision data (float16
by default) and a float32 power-of-two scale per tensor. Each update runs the
wrapped optax transformation as its plain update on the represented values in
`compute_dtype` (float32: one multiply per input tensor, no scale algebra op by
op), then, per new state leaf, moves a power of two from data to scale
(:func:`jax_scaled_arithmetics.ops.dynamic_rescale_max`) and casts the data back
to the storage dtype, so the stored data sits at the top of its range. A leaf whose
equations bound its largest magnitude by the stored state's and the gradients' (Adam's
moments: `b1 * max|m| + (1 - b1) * max|g|`, `core/magnitude_bounds.py`) takes its scale
from that bound instead: no reduction over the new tensor, which the kernel computing it
then writes directly; its data's largest magnitude is below the same top, lower by the
factor the bound exceeds it (at most 2 for a sum of non-negative terms, as Adam's second
moment).

Where it runs: `update` and :func:`~jax_scaled_arithmetics.optax.apply_updates` wrap
themselves with :func:`jax_scaled_arithmetics.autoscale`. Inside an autoscaled step (the usual
case: forward, backward and optimizer in one `@jax.jit @jsa.autoscale`
function) that wrapper is the identity; called directly on ScaledArrays outside
`autoscale`, it interprets the update in scaled arithmetic itself.

Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jax_scaled_arithmetics as jsa
    >>> params = jsa.as_scaled_array({"w": jnp.array([1.0, -2.0])}, dtype=jnp.float16)
    >>> opt = jsa.optax.scale_optimizer(optax.adam(1e-2))
    >>> state = opt.init(params)
    >>> @jax.jit
    ... @jsa.autoscale
    ... def step(params, state):
    ...     grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2))(params)
    ...     updates, state = opt.update(grads, state, params)
    ...     return jsa.optax.apply_updates(params, updates), state
    >>> params, state = step(params, state)
    >>> [round(float(v), 3) for v in params["w"].to_array()]  # Adam moves each by lr
    [0.99, -1.99]
    >>> state[0].mu["w"].dtype, state[0].count
    (dtype('float16'), Array(1, dtype=int32))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..core.datatype import ScaledArray, as_scaled_array, is_floating, is_scaled_leaf
from ..core.interpreter import autoscale, trace_notes, tracing_a_scaled_function
from ..core.magnitude_bounds import elements, evaluate_with_bounds
from ..lax.scaling_primitives import rebalance, stop_scaling
from ..ops.dynamic_rescaling import (
    DEFAULT_EPSILON,
    dynamic_rescale_l1,
    dynamic_rescale_l2,
    dynamic_rescale_max,
    match_layout,
    rescale_to_bounds,
    rescale_tree,
)

__all__ = [
    "default_data_exponent",
    "rescale_norm",
    "scale_optimizer",
    "scaled_state",
    "state_nbytes",
    "unstored_update",
]

Rescale = Callable[[Any], Any]
DTypeLike = Any
# The library's own rescalings, which can shift the data up in the same step.
_LIBRARY_RESCALES: dict[Any, str] = {
    dynamic_rescale_max: "max",
    dynamic_rescale_l1: "l1",
    dynamic_rescale_l2: "l2",
}


def rescale_norm(rescale: Any) -> str | None:
    """The norm (`"max"`, `"l1"`, `"l2"`) of one of the library's dynamic rescalings, which
    work leaf by leaf and can shift the data in the same step; None for any other."""
    return _LIBRARY_RESCALES.get(rescale) if rescale is not None else None


def default_data_exponent(state_dtype: DTypeLike) -> int:
    """Power of two that max-rescaled data (largest magnitude in [1, 2)) is shifted by.

    Shifting the data up to just below the format's largest binade keeps the
    whole range of the format below the largest element, which matters for
    Adam's second moment (it spans the square of the gradients' range). It is
    `finfo(dtype).maxexp - 2`, capped at 14: 14 for float16, 7 for float8_e4m3fn.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> jsa.optax.default_data_exponent(jnp.float16)
        14
        >>> jsa.optax.default_data_exponent(jnp.float8_e4m3fn)
        7
    """
    return int(min(jnp.finfo(jnp.dtype(state_dtype)).maxexp - 2, 14))


def _is_stored_scaled(x: Any) -> bool:
    """Floating leaves with at least one dimension are stored scaled; scalars stay as they are."""
    return x is not None and is_floating(x) and np.ndim(x) >= 1


def _is_none(x: Any) -> bool:
    return x is None


def _represented(tree: Any, dtype: DTypeLike) -> Any:
    """Inside autoscale: every floating array leaf as the plain array it represents, in
    `dtype` (`data * scale`, one multiply per tensor); other leaves as they are."""
    return jax.tree_util.tree_map(
        lambda x: stop_scaling(x, dtype=dtype) if x is not None and is_floating(x) else x,
        tree,
        is_leaf=is_scaled_leaf,
    )


_UNSTORED = "jsa.optax.unstored_update"


def _note_unstored(stored: Any, value: Any) -> None:
    """Inside an autoscaled step: remember that the update leaf `stored` is `value` (its
    float32 value before the store) for :func:`unstored_update`."""
    notes = trace_notes()
    if notes is not None and stored is not None and value is not None:
        notes[_UNSTORED, id(stored)] = (stored, value)


def unstored_update(update: Any) -> Any:
    """The plain `compute_dtype` value an update leaf of :func:`scaled_state` had before it
    was stored as a rescaled ScaledArray, when `update` is that very leaf and the call is
    part of the same autoscaled step; None otherwise.

    `jsa.optax.apply_updates` adds it to the parameter instead of the stored update: the new
    parameter is rounded once, and the update's own store (a reduction over the tensor and a
    cast) is left to dead-code elimination when nothing else reads it.
    """
    notes = trace_notes()
    if notes is None or update is None:
        return None
    note = notes.get((_UNSTORED, id(update)))
    return note[1] if note is not None and note[0] is update else None


def _store_update(u: Any, grad: Any, rescale: Rescale | None) -> Any:
    """An update leaf as a ScaledArray on its gradient's block layout, rescaled."""
    if u is None or not is_floating(u) or grad is None:
        return u
    u = match_layout(u, grad)
    return u if rescale is None else rescale(u)


def _store_updates(new_updates: Any, gradients: Any, rescale: Rescale | None) -> Any:
    """Every update leaf on its gradient's block layout, rescaled: with one of the library's
    rescalings, all of them by one call (their per-tensor factors computed together)."""
    norm = rescale_norm(rescale)
    if norm is None:
        return jax.tree_util.tree_map(
            lambda u, g: _store_update(u, g, rescale), new_updates, gradients, is_leaf=_is_none
        )
    laid_out: list[Any] = []

    def lay_out(u: Any, g: Any) -> Any:
        if u is None or not is_floating(u) or g is None:
            return u
        laid_out.append(match_layout(u, g))
        return _StoredSlot(len(laid_out) - 1)

    slots = jax.tree_util.tree_map(lay_out, new_updates, gradients, is_leaf=_is_none)
    rescaled = rescale_tree(laid_out, norm, DEFAULT_EPSILON, None) if laid_out else []
    return jax.tree_util.tree_map(
        lambda x: rescaled[x.index] if isinstance(x, _StoredSlot) else x,
        slots,
        is_leaf=lambda x: isinstance(x, _StoredSlot),
    )


def _store_leaf(
    x: Any,
    state_dtype: DTypeLike,
    rescale: Rescale | None,
    data_exponent: int,
    like: Any = None,
) -> Any:
    """Inside autoscale: make `x` scaled, bring it to the block layout of `like` (the stored
    leaf it replaces: one layout from step to step), rescale it and cast its data to
    `state_dtype`."""
    # A plain value becomes a ScaledArray; a scaled one keeps its layout (or takes `like`'s).
    x = match_layout(x, x if like is None else like)
    if rescale is not None:
        norm = _LIBRARY_RESCALES.get(rescale)
        if norm is not None:  # the shift in the same step: one multiply, one scale division
            x = rescale_tree(x, norm, DEFAULT_EPSILON, None, shift=data_exponent)
        else:
            x = rescale(x)
            if data_exponent:
                x = rebalance(x, jnp.float32(2.0**data_exponent))
    return x.astype(state_dtype)


def _store_state(
    new_state: Any,
    old_state: Any,
    state_dtype: DTypeLike,
    rescale: Rescale | None,
    data_exponent: int,
    bounds: Sequence[tuple[Any, int] | None] | None = None,
) -> Any:
    """Bring `new_state` back to the storage layout of `old_state` (inside autoscale).

    `bounds`: for the `k`-th leaf of `new_state`, `(vector, i)` where `vector[i]` bounds its
    largest magnitude (:func:`_update_with_bounds`), or None; with the library's max
    rescaling, a bounded leaf takes its scale from its bound, not from a reduction."""
    norm = _LIBRARY_RESCALES.get(rescale) if rescale is not None else None
    laid_out: list[Any] = []  # the stored leaves, on their layouts, for one rescale of all
    by_bound: dict[int, tuple[Any, list[int], list[int]]] = {}  # vector: (it, slots, places)
    positions = iter(range(len(jax.tree_util.tree_leaves(new_state, is_leaf=is_scaled_leaf))))

    def store(new: Any, old: Any) -> Any:
        bound = bounds[next(positions)] if bounds is not None else None
        if not (old is not None and is_floating(old)):
            return new
        if _is_stored_scaled(old):
            if norm is None:
                return _store_leaf(new, state_dtype, rescale, data_exponent, like=old)
            laid_out.append(match_layout(new, old))
            if norm == "max" and bound is not None:
                vector, place = bound
                _, slots, places = by_bound.setdefault(id(vector), (vector, [], []))
                slots.append(len(laid_out) - 1)
                places.append(place)
            return _StoredSlot(len(laid_out) - 1)
        return stop_scaling(new, dtype=jnp.dtype(old.dtype))  # scalars: plain, original dtype

    stored = jax.tree_util.tree_map(store, new_state, old_state, is_leaf=is_scaled_leaf)
    if norm is None or not laid_out:
        return stored
    rescaled: list[Any] = [None] * len(laid_out)
    for vector, slots, places in by_bound.values():
        # Scales from the bounds: no reduction over the new tensors.
        outs = rescale_to_bounds(
            [laid_out[i] for i in slots], elements(vector, places), DEFAULT_EPSILON, data_exponent
        )
        for i, out in zip(slots, outs):
            rescaled[i] = out
    measured = [i for i, x in enumerate(rescaled) if x is None]
    if measured:
        # A library rescale with the shift, for the rest of the state at once (the
        # per-tensor max factors computed together: `jsa.ops.rescale_tree`).
        outs = rescale_tree(
            [laid_out[i] for i in measured], norm, DEFAULT_EPSILON, None, shift=data_exponent
        )
        for i, out in zip(measured, outs):
            rescaled[i] = out
    return jax.tree_util.tree_map(
        lambda x: rescaled[x.index].astype(state_dtype) if isinstance(x, _StoredSlot) else x,
        stored,
        is_leaf=lambda x: isinstance(x, _StoredSlot),
    )


class _StoredSlot:
    """Where a stored state leaf goes back (its index among the rescaled leaves)."""

    def __init__(self, index: int):
        self.index = index


def _to_storage(
    x: Any,
    state_dtype: DTypeLike,
    rescale: Rescale | None,
    exp: int,
    scale_shape: tuple[int, ...] | None,
) -> Any:
    """Outside autoscale: one initial state leaf to its storage layout (`scale_shape`: the
    block scale of the parameter it belongs to; None: one scale)."""
    if not _is_stored_scaled(x):
        return x
    x = as_scaled_array(jnp.asarray(x, jnp.float32), scale_shape=scale_shape)
    return autoscale(lambda v: _store_leaf(v, state_dtype, rescale, exp))(x)


def _store_traced(
    x: Any, like: Any, state_dtype: DTypeLike, rescale: Rescale | None, exp: int
) -> Any:
    """Inside autoscale: one initial state leaf to its storage layout, the block layout of
    `like` (its parameter, or None) where it has one."""
    if x is None or not _is_stored_scaled(x):
        return x
    if like is not None and np.shape(like) != np.shape(x):
        like = None
    return _store_leaf(
        as_scaled_array(jnp.asarray(x, jnp.float32)), state_dtype, rescale, exp, like
    )


class _Layout:
    """A parameter's block scale shape (None: per tensor), as one pytree leaf."""

    def __init__(self, scale_shape: tuple[int, ...] | None):
        self.scale_shape = scale_shape


def _state_layouts(inner: Any, params: Any, state: Any) -> tuple[Any, ...] | None:
    """The block scale shape of each leaf of `state` (in flattening order): its parameter's
    where the leaf is a copy of the parameter tree (Adam's moments...), None elsewhere; None
    when every parameter has one scale."""
    layouts = jax.tree_util.tree_map(
        lambda p: _Layout(tuple(np.shape(p.scale)) or None if isinstance(p, ScaledArray) else None),
        params,
        is_leaf=is_scaled_leaf,
    )
    is_layout = lambda x: isinstance(x, _Layout)  # noqa: E731
    if all(m.scale_shape is None for m in jax.tree_util.tree_leaves(layouts, is_leaf=is_layout)):
        return None
    marked = optax.tree_utils.tree_map_params(
        inner,
        lambda _, layout: layout,
        state,
        layouts,
        transform_non_params=lambda _: _Layout(None),
        is_leaf=is_layout,
    )
    return tuple(m.scale_shape for m in jax.tree_util.tree_leaves(marked, is_leaf=is_layout))


def _like_gradients(new_updates: Any, gradients: Any) -> Any:
    """Outside `autoscale`, the updates of plain gradients as plain arrays (their values),
    as optax returns them: `optax.apply_updates` under `jax.jit` then takes them. Inside an
    autoscaled step every leaf stays as the step's interpretation made it."""
    if tracing_a_scaled_function():
        return new_updates

    def like(u: Any, g: Any) -> Any:
        if isinstance(u, ScaledArray) and g is not None and not isinstance(g, ScaledArray):
            return u.to_array(u.dtype)
        return u

    return jax.tree_util.tree_map(like, new_updates, gradients, is_leaf=is_scaled_leaf)


def _update_with_bounds(
    inner: Any, represented: tuple[Any, Any, Any], state: Any, extra_args: dict[str, Any]
) -> tuple[Any, Any, list[tuple[Any, int] | None]]:
    """`inner.update` on the represented values, and for each leaf of the new state stored
    scaled, a bound on its largest magnitude where its equations give one (Adam's moments:
    `b1 * max|m| + (1 - b1) * max|g|`...), from the largest magnitudes of the stored state
    and the gradients (`core.magnitude_bounds`): `(updates, state, bounds)`, `bounds[k]`
    `(vector, i)` for the `k`-th leaf of the new state, or None."""
    leaves, in_tree = jax.tree_util.tree_flatten(represented)
    out_trees: list[Any] = []

    def flat_update(*flat: Any) -> list[Any]:
        updates, old, params = jax.tree_util.tree_unflatten(in_tree, flat)
        out, tree = jax.tree_util.tree_flatten(inner.update(updates, old, params, **extra_args))
        out_trees.append(tree)
        return out

    outputs, bounds = evaluate_with_bounds(flat_update, leaves)
    new_updates, new_state = jax.tree_util.tree_unflatten(out_trees[-1], outputs)
    # The new state's leaves as `_store_state` visits them (None included), and where each
    # array among them is in the outputs (after the updates').
    old_leaves = jax.tree_util.tree_leaves(state, is_leaf=is_scaled_leaf)
    new_leaves = jax.tree_util.tree_leaves(new_state, is_leaf=is_scaled_leaf)
    per_leaf: list[tuple[Any, int] | None] = [None] * len(new_leaves)
    if len(old_leaves) != len(new_leaves):  # not a state of the same structure: measured
        return new_updates, new_state, per_leaf
    position = len(jax.tree_util.tree_leaves(new_updates))
    leaf_at: dict[int, int] = {}
    for k, (new, old) in enumerate(zip(new_leaves, old_leaves)):
        if new is not None:
            if _is_stored_scaled(old):
                leaf_at[position] = k
            position += 1
    for positions, vector in bounds.groups(list(leaf_at)):
        for i, position in enumerate(positions):
            per_leaf[leaf_at[position]] = (vector, i)
    return new_updates, new_state, per_leaf


def _outer_dtypes(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jnp.dtype(x.dtype) if hasattr(x, "dtype") else None, tree, is_leaf=is_scaled_leaf
    )


def scaled_state(
    inner: optax.GradientTransformation,
    state_dtype: DTypeLike = jnp.float16,
    rescale: Rescale | None = dynamic_rescale_max,
    *,
    compute_dtype: DTypeLike | None = jnp.float32,
    data_exponent: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Store the state of an optax transformation as ScaledArrays with `state_dtype` data.

    `init` runs `inner.init` on the float32 values of the parameters, then stores
    every floating state leaf with at least one dimension as a ScaledArray:
    data in `state_dtype`, float32 scale. Integer leaves (Adam's `count`) and
    scalar floating leaves (hyperparameters, loss scales) are kept as they are.

    `update` runs `inner.update` as the plain update on the values the state,
    gradients and parameters represent, in `compute_dtype` (float32 by default:
    optax's constants such as Adam's `eps=1e-8` are zero in float16; with `None`
    it runs in scaled arithmetic on the stored dtypes), then applies `rescale` to
    every new state leaf, shifts its data up by
    `2**data_exponent` and casts it to `state_dtype`. With `dynamic_rescale_max`, a leaf
    whose equations bound its largest magnitude (Adam's moments, SGD's trace) takes its
    scale from that bound, with no reduction over it (see the module's description). The
    updates come back with
    the gradients' dtype, and outside `autoscale` as plain arrays for plain gradients (a
    plain float32 step keeps `optax.apply_updates`, the state stored in float16). `update`
    wraps itself in :func:`~jax_scaled_arithmetics.autoscale`: call it inside an autoscaled
    step, or directly on ScaledArrays or plain arrays.

    Args:
        inner: the optax transformation whose state is stored scaled.
        state_dtype: data dtype of the stored state (float16, bfloat16, float8, ...).
        rescale: dynamic rescaling applied to each new state leaf (and to the
            updates); `None` keeps the scales the scaled rules produced.
        compute_dtype: data dtype the inner update computes in; `None` computes
            in the stored dtypes.
        data_exponent: power of two the rescaled data is multiplied by before the
            cast; 0 keeps it at ~1. Default: :func:`default_data_exponent` with
            `dynamic_rescale_max` (which bounds the data by 2), 0 otherwise.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> import jax_scaled_arithmetics as jsa
        >>> opt = jsa.optax.scaled_state(optax.sgd(0.1, momentum=0.9))
        >>> state = opt.init({"w": jnp.ones(3)})
        >>> trace = state[0].trace["w"]
        >>> type(trace).__name__, trace.dtype, trace.to_array().tolist()
        ('ScaledArray', dtype('float16'), [0.0, 0.0, 0.0])
        >>> grads = {"w": jsa.scaled_array([1.0, 2.0, -4.0], 2.0**-30, dtype=jnp.float16)}
        >>> updates, state = opt.update(grads, state)  # outside autoscale: wraps itself
        >>> state[0].trace["w"].to_array(jnp.float32) * 2**30  # 2**-30: zero in plain float16
        Array([ 1.,  2., -4.], dtype=float32)
    """
    inner = optax.with_extra_args_support(inner)
    if data_exponent is not None:
        exp = int(data_exponent) if rescale is not None else 0
    else:  # only max rescaling bounds the data (by 2): shift it to the top of the range
        exp = default_data_exponent(state_dtype) if rescale is dynamic_rescale_max else 0

    @functools.partial(jax.jit, static_argnums=1)
    def to_storage(state: Any, layouts: tuple[Any, ...] | None) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(state)
        layouts = layouts or (None,) * len(leaves)
        stored = [_to_storage(x, state_dtype, rescale, exp, s) for x, s in zip(leaves, layouts)]
        return jax.tree_util.tree_unflatten(treedef, stored)

    def init_fn(params: Any) -> Any:
        plain = jax.tree_util.tree_map(
            lambda p: p.to_array(jnp.float32) if isinstance(p, ScaledArray) else p,
            params,
            is_leaf=is_scaled_leaf,
        )
        state = inner.init(plain)
        if tracing_a_scaled_function():
            # Inside autoscale the parameters' block layouts are not known yet: each state
            # leaf that copies a parameter takes its layout when the step is interpreted.
            likes = optax.tree_utils.tree_map_params(
                inner, lambda _, p: p, state, params, transform_non_params=lambda _: None
            )
            return jax.tree_util.tree_map(
                lambda x, like: _store_traced(x, like, state_dtype, rescale, exp),
                state,
                likes,
                is_leaf=lambda x: x is None,
            )
        return to_storage(state, _state_layouts(inner, params, state))

    def _update(updates: Any, state: Any, params: Any, extra_args: dict[str, Any]) -> Any:
        out_dtypes = _outer_dtypes(updates)
        if compute_dtype is not None:
            # The update is elementwise per leaf: it runs as the plain optax update on the
            # represented values in `compute_dtype` (one multiply per input tensor, no scale
            # algebra op by op), and each new state leaf and update goes back to a scaled
            # tensor once, with a dynamic scale.
            represented = (
                _represented(updates, compute_dtype),
                _represented(state, compute_dtype),
                _represented(params, compute_dtype),
            )
            if rescale is dynamic_rescale_max:
                new_updates, new_state, bounds = _update_with_bounds(
                    inner, represented, state, extra_args
                )
            else:
                new_updates, new_state = inner.update(*represented, **extra_args)
                bounds = None
        else:
            new_updates, new_state = inner.update(updates, state, params, **extra_args)
            bounds = None
        new_state = _store_state(new_state, state, state_dtype, rescale, exp, bounds)
        values = new_updates
        new_updates = _store_updates(new_updates, updates, rescale)
        new_updates = jax.tree_util.tree_map(
            lambda u, d: u if d is None or u is None else u.astype(d),
            new_updates,
            out_dtypes,
            is_leaf=_is_none,
        )
        if compute_dtype is not None and rescale in _LIBRARY_RESCALES:
            # `jsa.optax.apply_updates` in the same step adds the update's value as it was
            # before its store (see `unstored_update`).
            jax.tree_util.tree_map(
                lambda stored, value: _note_unstored(stored, value),
                new_updates,
                values,
                is_leaf=_is_none,
            )
        return new_updates, new_state

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        new_updates, new_state = autoscale(_update)(updates, state, params, extra_args)
        return _like_gradients(new_updates, updates), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scale_optimizer(
    opt: optax.GradientTransformation,
    state_dtype: DTypeLike = jnp.float16,
    grad_rescale: Rescale | None = dynamic_rescale_l2,
    *,
    rescale: Rescale | None = dynamic_rescale_max,
    compute_dtype: DTypeLike | None = jnp.float32,
    data_exponent: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Turn any optax optimizer into its scaled-state version, rescaling incoming gradients.

    The incoming gradients go through `grad_rescale` (root-mean-square in
    [1, 2) by default, value unchanged), then through :func:`scaled_state`.
    Pair it with :func:`~jax_scaled_arithmetics.optax.apply_updates`: in the same
    autoscaled step it adds the updates before their store (one rounding of each new
    parameter, one reduction per tensor less).

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> import jax_scaled_arithmetics as jsa
        >>> adam = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
        >>> opt = jsa.optax.scale_optimizer(adam)
        >>> state = opt.init({"w": jnp.ones((2, 2))})
        >>> state[1][0].nu["w"].dtype
        dtype('float16')
    """
    inner = scaled_state(
        opt, state_dtype, rescale, compute_dtype=compute_dtype, data_exponent=data_exponent
    )

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        def _update(updates: Any, state: Any, params: Any, extra_args: dict[str, Any]) -> Any:
            if grad_rescale is not None and compute_dtype is None:
                # (With a compute dtype the update reads the represented values: rescaling
                # the gradients, which keeps their values, would change nothing.)
                updates = grad_rescale(updates)
            return inner.update(updates, state, params, **extra_args)

        new_updates, new_state = autoscale(_update)(updates, state, params, extra_args)
        return _like_gradients(new_updates, updates), new_state

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def state_nbytes(tree: Any) -> int:
    """Bytes held by the arrays of a pytree (a ScaledArray counts its data and its scale).

    Leaves may be arrays or `jax.ShapeDtypeStruct`s (`jax.eval_shape` of an `init`), so
    the state of a large model is counted without allocating it.

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> import jax_scaled_arithmetics as jsa
        >>> scaled = jsa.as_scaled_array(jnp.ones(4), dtype=jnp.float16)  # 8 + 4 bytes
        >>> jsa.optax.state_nbytes({"w": jnp.ones(4), "s": scaled})
        28
        >>> shapes = jax.ShapeDtypeStruct((1000, 1000), jnp.float32)
        >>> jsa.optax.state_nbytes(jax.eval_shape(optax.adam(1e-3).init, shapes))  # + count
        8000004
    """

    def nbytes(x: Any) -> int:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
        return int(np.asarray(x).nbytes)

    return int(sum(nbytes(x) for x in jax.tree_util.tree_leaves(tree)))
