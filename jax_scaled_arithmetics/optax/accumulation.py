"""Gradient accumulation over microbatches, with scales taken over all of them.

Under :func:`~jax_scaled_arithmetics.autoscale` a sum of gradients written op by op gets
the static add rule's scale, the largest of the summands' (`max(sa, sb)`): the
accumulated gradient's scale is the largest microbatch's, not the power of two of the
sum's own largest magnitude that the one-batch gradient gets from its contraction
(`ScalePolicy.DYNAMIC`). Inside `optax.MultiSteps` the accumulator keeps that scale from
round to round (a reset multiplies the data by 0 and keeps the scale), so it only grows:
float16 gradients that shrink 2^24 below their largest ever are flushed to zero.

Here the microbatch gradients are summed in float32 data and the sum (or mean) gets one
dynamic power-of-two scale per tensor (:func:`~jax_scaled_arithmetics.ops.dynamic_rescale_max`)
before its cast to the gradients' dtype: the accumulated gradient has the scale the
one-batch gradient has, over all microbatches (a microbatch 2^10 larger than the others
shows in the scale whichever position it has).

- :func:`accumulate_gradients`: a `lax.scan` of a gradient function over microbatches.
- :func:`split_microbatches`: a batch as `k` microbatches stacked on a leading axis.
- :func:`multi_steps`: `optax.MultiSteps` whose accumulator is a scaled tensor with a
  dynamic scale at every mini-step, and whose emitted gradient has the one-batch scale.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> import jax_scaled_arithmetics as jsa
    >>> params = jsa.as_scaled_array({"w": jnp.array([0.5, -1.0])}, dtype=jnp.bfloat16)
    >>> x = jnp.array([[1.0, 2.0], [3.0, 1.0], [-1.0, 0.5], [2.0, 2.0]], jnp.bfloat16)
    >>> grad_fn = jax.grad(lambda p, x: jnp.mean((x @ p["w"]) ** 2))
    >>> @jax.jit
    ... @jsa.autoscale
    ... def both(params, x):
    ...     micro = jsa.optax.accumulate_gradients(grad_fn, params, x.reshape(2, 2, 2))
    ...     return micro, grad_fn(params, x)
    >>> micro, one = both(params, x)
    >>> float(micro["w"].scale), float(one["w"].scale)
    (2.0, 2.0)
    >>> micro["w"].to_array().tolist(), one["w"].to_array().tolist()
    ([-0.5, -2.5], [-0.5, -2.5])
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..core.datatype import ScaledArray, is_floating, is_scaled_leaf
from ..core.dtypes import compute_dtype
from ..core.interpreter import autoscale, tracing_a_scaled_function
from ..ops.dynamic_rescaling import dynamic_rescale_max
from . import scaled as _scaled
from .scaled import default_data_exponent

__all__ = ["accumulate_gradients", "multi_steps", "split_microbatches"]

Rescale = Callable[[Any], Any]
DTypeLike = Any


def _wide(x: Any) -> Any:
    """A floating leaf with float32 (or wider) data, same value; others as they are."""
    if x is None or not is_floating(x) or compute_dtype(x.dtype) == x.dtype:
        return x
    return x.astype(jnp.float32)


def _finish(total: Any, dtype: Any, rescale: Rescale | None) -> Any:
    """The accumulated float32 leaf with a dynamic scale, cast to the gradient's dtype."""
    if total is None or dtype is None:
        return total
    if rescale is not None:
        total = rescale(total)
    return total.astype(dtype)


def _num_microbatches(microbatches: Any) -> int:
    lengths = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in _leaves(microbatches)}
    if len(lengths) != 1 or -1 in lengths:
        raise ValueError(
            "accumulate_gradients: every leaf of `microbatches` needs the same leading axis "
            f"(the microbatch index); got leading sizes {sorted(lengths)} (-1: a scalar)."
        )
    return lengths.pop()


def _leaves(tree: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(tree, is_leaf=is_scaled_leaf)


def accumulate_gradients(
    grad_fn: Callable[..., Any],
    params: Any,
    microbatches: Any,
    *,
    mean: bool = True,
    has_value: bool = False,
    rescale: Rescale | None = dynamic_rescale_max,
) -> Any:
    """The gradient over all microbatches: a `lax.scan` of `grad_fn` summing in float32.

    `microbatches` is a pytree whose leaves stack the microbatches on a leading axis
    (:func:`split_microbatches`); `grad_fn(params, microbatch)` returns the gradients,
    or with `has_value=True` a pair `(value, grads)` as `jax.value_and_grad` does. The
    gradients are summed in float32 data (a ScaledArray sum at the largest summand's
    scale), divided by the number of microbatches when `mean` (the gradient of the
    mean loss over the whole batch, for equal microbatches and a per-microbatch mean
    loss), then each tensor gets one dynamic scale, `rescale` (the power of two of its
    largest magnitude, as every contraction's output gets under `ScalePolicy.DYNAMIC`)
    and goes back to its gradient's dtype. So the result's scales are the one-batch
    gradient's whenever the one-batch gradient's scale is dynamic (weights, biases and
    gains: a contraction or a sum over the batch), except where rounding moves a
    tensor's largest magnitude across a power of two; its values match to the
    rounding of the summation order and of each microbatch's gradient to its dtype.

    Call it inside an autoscaled step; outside `autoscale` it wraps itself (and with
    plain arrays it is a plain `lax.scan`; `rescale` is then the identity).

    Returns:
        The accumulated gradients, or `(values, grads)` with `has_value`: `values` the
        microbatches' values stacked on a leading axis (their mean is the one-batch
        mean loss).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> params = jsa.as_scaled_array({"w": jnp.ones(2)}, dtype=jnp.float16)
        >>> x = jnp.array([[1.0, 2.0], [1.0, 0.0], [2.0**10, 0.0]], jnp.float16)
        >>> loss = lambda p, x: jnp.mean((x @ p["w"]) ** 2) / 2
        >>> values, grads = jsa.optax.accumulate_gradients(
        ...     jax.value_and_grad(loss), params, x.reshape(3, 1, 2), has_value=True)
        >>> g = grads["w"]  # mean([3, 6], [1, 0], [2**20, 0]), in float16 data
        >>> g.dtype, g.to_array(jnp.float32).tolist(), float(g.scale)
        (dtype('float16'), [349440.0, 2.0], 262144.0)
        >>> values.to_array(jnp.float32).tolist()  # the loss of each microbatch
        [4.5, 0.5, 524288.0]
    """

    def accumulate(params: Any, microbatches: Any) -> Any:
        count = _num_microbatches(microbatches)
        first = jax.tree_util.tree_map(lambda x: x[0], microbatches, is_leaf=is_scaled_leaf)
        shapes = jax.eval_shape(grad_fn, params, first)
        shapes = shapes[1] if has_value else shapes
        dtypes = jax.tree_util.tree_map(lambda s: None if s is None else s.dtype, shapes)
        zeros = jax.tree_util.tree_map(
            lambda s: None if s is None else jnp.zeros(s.shape, compute_dtype(s.dtype)), shapes
        )

        def body(total: Any, microbatch: Any) -> tuple[Any, Any]:
            out = grad_fn(params, microbatch)
            value, grads = out if has_value else (None, out)
            total = jax.tree_util.tree_map(
                lambda t, g: None if t is None else t + _wide(g),
                total,
                grads,
                is_leaf=_scaled._is_none,
            )
            return total, value

        total, values = jax.lax.scan(body, zeros, microbatches)
        if mean:
            total = jax.tree_util.tree_map(
                lambda t: None if t is None else t / count, total, is_leaf=_scaled._is_none
            )
        grads = jax.tree_util.tree_map(
            lambda t, d: _finish(t, d, rescale), total, dtypes, is_leaf=_scaled._is_none
        )
        return (values, grads) if has_value else grads

    return autoscale(accumulate)(params, microbatches)


def split_microbatches(batch: Any, num_microbatches: int) -> Any:
    """Every leaf of `batch`, of leading size `n`, reshaped to `(num_microbatches, n //
    num_microbatches, ...)`: consecutive examples form a microbatch.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> jsa.optax.split_microbatches({"x": jnp.zeros((8, 3))}, 4)["x"].shape
        (4, 2, 3)
    """
    k = int(num_microbatches)

    def split(x: Any) -> Any:
        n = int(np.shape(x)[0]) if np.ndim(x) else 0
        if k < 1 or n % k:
            raise ValueError(
                f"split_microbatches: a leading size of {n} does not split into {k} "
                "equal microbatches."
            )
        return x.reshape((k, n // k) + tuple(np.shape(x)[1:]))

    def split_tree(batch: Any) -> Any:
        return jax.tree_util.tree_map(split, batch, is_leaf=is_scaled_leaf)

    if any(isinstance(x, ScaledArray) for x in _leaves(batch)):
        return autoscale(split_tree)(batch)
    return split_tree(batch)


def _scale_shape(p: Any) -> tuple[int, ...] | None:
    """The block scale shape of a parameter (None: one scale)."""
    return tuple(np.shape(p.scale)) or None if isinstance(p, ScaledArray) else None


def multi_steps(
    opt: optax.GradientTransformation,
    every_k_schedule: int | Callable[[Any], Any],
    *,
    use_grad_mean: bool = True,
    should_skip_update_fn: Any = None,
    accumulator_dtype: DTypeLike = jnp.float32,
    rescale: Rescale | None = dynamic_rescale_max,
    data_exponent: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """`optax.MultiSteps(opt, every_k_schedule, ...)` with a scaled accumulator.

    The accumulated gradients (the running mean, or sum without `use_grad_mean`) are
    stored as ScaledArrays with `accumulator_dtype` data and, at every mini-step, one
    dynamic power-of-two scale per tensor over all the microbatches accumulated so far
    (`rescale`, data shifted up by `data_exponent` as in
    :func:`~jax_scaled_arithmetics.optax.scaled_state`); a reset starts from a zero
    accumulator, not from the last round's scale. The gradient handed to `opt` gets one
    dynamic scale per tensor and the gradients' dtype: the one-batch gradient's scale.
    The state is an `optax.MultiStepsState` (`opt`'s state as `opt` stores it: wrap `opt`
    in :func:`~jax_scaled_arithmetics.optax.scale_optimizer` for a scaled one), so
    `optax.MultiSteps(opt, k).has_updated(state)` reads it. `update` wraps itself in
    :func:`~jax_scaled_arithmetics.autoscale`.

    `jsa.optax.scale_optimizer(optax.MultiSteps(opt, k))` gives the same scales, with the
    accumulator and `opt`'s state all in the scaled state's dtype (float16 by default);
    a plain `optax.MultiSteps` under `autoscale` accumulates at the largest scale ever
    seen (see the module's docstring).

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> import jax_scaled_arithmetics as jsa
        >>> params = jsa.as_scaled_array({"w": jnp.ones(2)}, dtype=jnp.bfloat16)
        >>> opt = jsa.optax.multi_steps(optax.sgd(1.0), every_k_schedule=2)
        >>> state = opt.init(params)
        >>> @jax.jit
        ... @jsa.autoscale
        ... def step(params, state, g):
        ...     updates, state = opt.update(g, state, params)
        ...     return jsa.optax.apply_updates(params, updates), updates, state
        >>> g1 = {"w": jsa.scaled_array([1.0, -1.0], 16.0, dtype=jnp.bfloat16)}
        >>> g2 = {"w": jsa.scaled_array([1.0, 0.5], 1.0, dtype=jnp.bfloat16)}
        >>> _, updates, state = step(params, state, g1)  # accumulates, updates are 0
        >>> acc = state.acc_grads["w"]  # float32 data at the top of its range (2**14)
        >>> acc.to_array().tolist(), float(acc.scale) * 2**14
        ([16.0, -16.0], 16.0)
        >>> _, updates, state = step(params, state, g2)  # emits -mean([g1, g2])
        >>> updates["w"].to_array().tolist(), float(updates["w"].scale)
        ([-8.5, 7.75], 8.0)
        >>> float(state.acc_grads["w"].scale) < 2.0**-60  # reset: zeros, no stale scale
        True
    """
    inner = optax.with_extra_args_support(opt)
    acc_dtype = jnp.dtype(accumulator_dtype)
    if data_exponent is not None:
        exp = int(data_exponent) if rescale is not None else 0
    else:
        exp = default_data_exponent(acc_dtype) if rescale is dynamic_rescale_max else 0

    def wrapped(out_dtypes: Any, like: Any) -> optax.MultiSteps:
        """`optax.MultiSteps` over float32 gradients, whose `opt` receives the accumulated
        gradients rescaled on the layout of `like` and cast to `out_dtypes`."""

        def update(acc: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
            grads = jax.tree_util.tree_map(
                lambda a, g: _scaled._store_update(a, g, rescale),
                acc,
                like,
                is_leaf=_scaled._is_none,
            )
            grads = jax.tree_util.tree_map(
                lambda g, d: g if g is None or d is None else g.astype(d),
                grads,
                out_dtypes,
                is_leaf=_scaled._is_none,
            )
            return inner.update(grads, state, params, **extra_args)

        return optax.MultiSteps(
            optax.GradientTransformationExtraArgs(inner.init, update),
            every_k_schedule,
            use_grad_mean=use_grad_mean,
            should_skip_update_fn=should_skip_update_fn,
            accumulator_dtype=jnp.float32,
        )

    @functools.partial(jax.jit, static_argnums=1)
    def acc_storage(zeros: Any, scale_shapes: tuple[Any, ...]) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(zeros)
        stored = [
            _scaled._to_storage(z, acc_dtype, rescale, exp, s) for z, s in zip(leaves, scale_shapes)
        ]
        return jax.tree_util.tree_unflatten(treedef, stored)

    def init_fn(params: Any) -> optax.MultiStepsState:
        plain = jax.tree_util.tree_map(
            lambda p: p.to_array(jnp.float32) if isinstance(p, ScaledArray) else p,
            params,
            is_leaf=is_scaled_leaf,
        )
        zeros = optax.tree.zeros_like(plain, dtype=jnp.float32)
        gradient_step = jnp.zeros([], jnp.int32)
        skip_state: Any = ()
        if should_skip_update_fn is not None:
            _, skip_state = should_skip_update_fn(zeros, gradient_step, plain)
        if tracing_a_scaled_function():  # each parameter's block layout, once interpreted
            acc_grads = jax.tree_util.tree_map(
                lambda z, p: _scaled._store_traced(z, p, acc_dtype, rescale, exp), zeros, params
            )
        else:
            acc_grads = acc_storage(zeros, tuple(_scale_shape(p) for p in _leaves(params)))
        return optax.MultiStepsState(
            mini_step=jnp.zeros([], jnp.int32),
            gradient_step=gradient_step,
            inner_opt_state=inner.init(params),
            acc_grads=acc_grads,
            skip_state=skip_state,
        )

    def _update(updates: Any, state: Any, params: Any, extra_args: dict[str, Any]) -> Any:
        ms = wrapped(_scaled._outer_dtypes(updates), updates)
        wide = jax.tree_util.tree_map(_wide, updates, is_leaf=is_scaled_leaf)
        acc = jax.tree_util.tree_map(_wide, state.acc_grads, is_leaf=is_scaled_leaf)
        new_updates, new_state = ms.update(
            wide, state._replace(acc_grads=acc), params, **extra_args
        )
        stored = _scaled._store_state(new_state.acc_grads, state.acc_grads, acc_dtype, rescale, exp)
        return new_updates, new_state._replace(acc_grads=stored)

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        new_updates, new_state = autoscale(_update)(updates, state, params, extra_args)
        return _scaled._like_gradients(new_updates, updates), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
