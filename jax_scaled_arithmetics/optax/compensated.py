"""Kahan-compensated weight updates: low-precision parameters on the float32 trajectory.

With bfloat16 parameters, an update smaller than half a unit in the last place of its
parameter (`2**-9` relative) is rounded away, and larger ones lose their low bits, every
step. :func:`kahan_summation` keeps what each step lost in a compensation buffer, one per
floating parameter, and adds it back into the next update (Kahan's compensated
summation), so the parameters follow the float32 sum of the updates to within the
precision of the buffer.

The scheme, per floating parameter `p` (float32 arithmetic, `c` the buffer):

1. `y = u + c`: the inner optimizer's update `u` plus what earlier steps lost;
2. `t = round(p + y)`: the new parameter, rounded to nearest in `p`'s dtype (with
   `lax.reduce_precision`, which XLA keeps under `jit`; float16's subnormals flush to
   zero, the buffer keeps what that loses); on a ScaledArray, the data is rounded;
3. the update returned is `t - p` (float32; the difference of two values of `p`'s dtype,
   exact in float32), so applying it gives exactly `t`;
4. `c = y - (t - p)`: the part of `y` the parameter could not take, stored in the
   buffer's dtype (`compensation_dtype`, the parameter's dtype by default).

`p + c` carries the running sum of the updates and `p` is its nearest value in `p`'s
dtype. Each step still rounds, but in the buffer: `c` is below half an ulp of `p`, and
storing it costs at most half an ulp of `c`, about `2**-9` of an ulp of `p` for a
bfloat16 buffer (`2**-24` for float32), against up to half an ulp of `p` (the whole
update when it is smaller) without compensation. The cost is one buffer per floating
parameter (its size times the buffer's itemsize: 2 bytes per parameter in bfloat16) and
a few elementwise operations per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ..core.datatype import ScaledArray, is_floating, is_scaled_leaf
from ..core.interpreter import autoscale, tracing_a_scaled_function
from ..lax.scaling_primitives import apply_to_data
from ..ops.dynamic_rescaling import dynamic_rescale_max
from ..quantization import float_quantize

__all__ = ["KahanState", "kahan_summation"]

DTypeLike = Any


class KahanState(NamedTuple):
    """State of :func:`kahan_summation`: the inner state and one buffer per parameter.

    `compensation` has the structure of the parameters, `None` for parameters that are
    not floating; a ScaledArray parameter gets a ScaledArray buffer.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> import jax_scaled_arithmetics as jsa
        >>> opt = jsa.optax.kahan_summation(optax.sgd(0.1))
        >>> state = opt.init({"w": jnp.ones(2, jnp.bfloat16), "step": jnp.int32(0)})
        >>> state.compensation
        {'step': None, 'w': Array([0, 0], dtype=bfloat16)}
    """

    inner_state: Any
    compensation: Any


def _is_leaf(x: Any) -> bool:
    return x is None or is_scaled_leaf(x)


@dataclasses.dataclass(frozen=True)
class _ZerosOf:
    """Zeros of `dtype` in place of the data (a Kahan buffer at `init`)."""

    dtype: Any

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.zeros(jnp.shape(x), self.dtype)


@dataclasses.dataclass(frozen=True)
class _RoundTo:
    """Round float32 data to the values of `dtype`, to nearest, keeping float32.

    Not `x.astype(dtype).astype(float32)`: XLA may drop that pair of conversions under
    `jit` (excess precision), and the rounding with it. `lax.reduce_precision` is kept
    (it flushes the subnormals of `dtype` to zero, a value of `dtype` too).
    """

    dtype: Any

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = jnp.dtype(self.dtype)
        if dtype in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
            info = jnp.finfo(dtype)
            return jax.lax.reduce_precision(x, int(info.nexp), int(info.nmant))
        return float_quantize(x, dtype)  # other formats: exact integer rounding


def _compensate(updates: Any, compensation: Any, params: Any) -> tuple[Any, Any]:
    """Steps 1-4 of the module docstring on every floating parameter."""
    f32 = jnp.float32

    def leaf(p: Any, u: Any, c: Any) -> tuple[Any, Any]:
        if p is None or u is None or c is None or not is_floating(p):
            return u, c
        y = u.astype(f32) + c.astype(f32)
        p32 = p.astype(f32)
        applied = apply_to_data(_RoundTo(jnp.dtype(p.dtype)), p32 + y) - p32
        lost = dynamic_rescale_max(y - applied)  # scaled: the data sits in [1, 2)
        return applied, lost.astype(c.dtype)

    treedef = jax.tree_util.tree_structure(params, is_leaf=_is_leaf)
    flat = [treedef.flatten_up_to(t) for t in (params, updates, compensation)]  # type: ignore[attr-defined]
    pairs = [leaf(p, u, c) for p, u, c in zip(*flat)]
    new_updates = jax.tree_util.tree_unflatten(treedef, [u for u, _ in pairs])
    new_compensation = jax.tree_util.tree_unflatten(treedef, [c for _, c in pairs])
    return new_updates, new_compensation


def kahan_summation(
    opt: optax.GradientTransformation, compensation_dtype: DTypeLike | None = None
) -> optax.GradientTransformationExtraArgs:
    """Wrap an optimizer so that low-precision parameters follow the float32 sum of its updates.

    The state holds, next to the inner state, one compensation buffer per floating
    parameter (zeros at `init`, in `compensation_dtype`, the parameter's dtype by default;
    a ScaledArray for a ScaledArray parameter). `update` needs the parameters: it returns
    float32 updates `t - p` such that `optax.apply_updates(params, updates)` (or
    :func:`~jax_scaled_arithmetics.optax.apply_updates` with nearest rounding) gives
    exactly `t`, the parameter plus the update plus the buffer rounded to nearest; the
    buffer keeps what that rounding lost (the module docstring has the scheme). Use it as
    the outermost transformation (it must see the final updates), with nearest rounding
    when applying them.

    Args:
        opt: any optax transformation.
        compensation_dtype: dtype of the buffers; default: each parameter's dtype (its
            data's for a ScaledArray). A float16 buffer of a float16 parameter underflows
            for parameters below about 2**-4 (the buffer is ~2**-11 of its parameter):
            prefer bfloat16 or float32 buffers, or ScaledArray parameters, there.

    Returns:
        A transformation whose state is :class:`KahanState`.

    Raises:
        ValueError: `update` called without `params`.

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> import jax_scaled_arithmetics as jsa
        >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
        >>> opt = jsa.optax.kahan_summation(optax.identity())
        >>> state = opt.init(params)
        >>> state.compensation["w"].dtype
        dtype(bfloat16)
        >>> step = jax.jit(lambda p, s, u: opt.update(u, s, p))
        >>> for _ in range(100):
        ...     updates, state = step(params, state, {"w": jnp.full(2, 1e-4)})
        ...     params = optax.apply_updates(params, updates)
        >>> params["w"]  # the nearest bfloat16 to 1 + 100 * 1e-4 (plain bfloat16 stays at 1)
        Array([1.00781, 1.00781], dtype=bfloat16)
        >>> total = params["w"].astype(jnp.float32) + state.compensation["w"]
        >>> round(float(total[0]), 4)  # 1.01, but for the buffer's own bfloat16 roundings
        1.0103
    """
    inner = optax.with_extra_args_support(opt)

    def buffer(p: Any) -> Any:
        if p is None or not is_floating(p):
            return None
        dtype = jnp.dtype(compensation_dtype if compensation_dtype is not None else p.dtype)
        if isinstance(p, ScaledArray) or tracing_a_scaled_function():
            # Zeros on the parameter's scale, so in its block layout, as `update` stores
            # the buffer; inside autoscale `p` stands for a value that may be scaled, and
            # the buffer is scaled where it is.
            return apply_to_data(_ZerosOf(dtype), p)
        return jnp.zeros(jnp.shape(p), dtype)

    def init_fn(params: Any) -> KahanState:
        compensation = jax.tree_util.tree_map(buffer, params, is_leaf=_is_leaf)
        return KahanState(inner.init(params), compensation)

    def update_fn(
        updates: Any, state: KahanState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, KahanState]:
        if params is None:
            raise ValueError(
                "kahan_summation needs the parameters: call update(updates, state, params)"
            )
        updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        leaves = jax.tree_util.tree_leaves((updates, state.compensation, params), is_leaf=_is_leaf)
        compensate = _compensate
        if any(isinstance(x, ScaledArray) for x in leaves):  # outside autoscale
            compensate = autoscale(_compensate)
        updates, compensation = compensate(updates, state.compensation, params)
        return updates, KahanState(inner_state, compensation)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
