"""Sharded ScaledArrays and collectives with a low-precision wire format.

JAX's own engine does the distribution: `jax.sharding.Mesh`, `NamedSharding`, `jax.jit`'s
in/out shardings and `jax.shard_map`. A ScaledArray is a pytree of two arrays, so it is
sharded like any pytree; this module gives its scales the layout they need and moves data
between devices in a narrow format with one scale shared by all devices.

- :func:`like`: the shardings of a ScaledArray tree from its parameters' shardings (data as
  the parameter, per-tensor scales replicated, block scales sharded with their blocks).
- :func:`device_put`: `jax.device_put` of a tree with those shardings.
- :func:`state_like`: an optimizer state's shardings, its moments sharded like the
  parameters they mirror.
- :func:`all_gather`, :func:`psum_scatter`, :func:`psum`: inside `shard_map`, the collective
  on the represented values, with the data on the wire in `dtype` (e.g. float8_e4m3fn or
  bfloat16) at one power-of-two scale agreed on by a scalar all-reduce of the largest
  magnitude. They work on plain arrays and, under `jsa.autoscale`, on ScaledArrays.
- :func:`gather_params`: the FSDP recipe: parameter shards all-gathered in `dtype` for the
  forward pass, their gradients reduce-scattered in `grad_dtype` with a shared scale
  (replicated parameters' gradients all-reduced the same way).

Examples:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> import jax_scaled_arithmetics as jsa
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    >>> params = jsa.as_scaled_array({"w": jnp.ones((4, 2))}, dtype=jnp.float16)
    >>> shardings = jsa.sharding.like(params, {"w": NamedSharding(mesh, P("fsdp"))})
    >>> shardings["w"].scale.spec == P()  # a per-tensor scale: replicated
    True
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .core.datatype import (
    PackedScales,
    ScaledArray,
    is_packed_or_scaled_leaf,
)
from .core.shardings import replicated, scale_sharding, spec_entries
from .lax.scaling_primitives import apply_to_data, get_data_scale, rebalance, set_scaling

__all__ = [
    "all_gather",
    "device_put",
    "gather_params",
    "like",
    "psum",
    "psum_scatter",
    "state_like",
]


# --- shardings of ScaledArray trees ------------------------------------------------------


def like(tree: Any, shardings: Any) -> Any:
    """The shardings of `tree` (ScaledArrays included) from its values' shardings.

    Args:
        tree: parameters, optimizer states... with ScaledArray leaves (or their
            `jax.ShapeDtypeStruct`s, e.g. from `jax.eval_shape`). A
            `jsa.tree.PackedScales` in it takes the shardings of its unpacked tree; its
            scale vector is replicated.
        shardings: one `jax.sharding.Sharding` for every leaf, or a tree of shardings with
            `tree`'s structure in which a ScaledArray's place holds the sharding of the
            array it represents (the plain parameters' shardings), or a ScaledArray of
            shardings. One sharding is replicated for leaves of lower rank than its spec.

    Returns:
        A tree of shardings with `tree`'s structure, for `jax.device_put` or `jax.jit`'s
        `in_shardings`/`out_shardings`: a ScaledArray's data sharded as given, a per-tensor
        scale replicated on the same devices, a block scale sharded with its blocks where
        every device holds whole blocks (replicated along other axes). Leaves that are not
        arrays (None, Python scalars) get None.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        >>> import jax_scaled_arithmetics as jsa
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
        >>> x = jsa.as_scaled_array(jnp.ones((8, 4)), dtype=jnp.bfloat16)
        >>> s = jsa.sharding.like(x, NamedSharding(mesh, P("dp", None)))
        >>> s.data.spec == P("dp", None), s.scale.spec == P()
        (True, True)
    """
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(
            lambda leaf: _leaf_shardings(leaf, _fitting(shardings, leaf)),
            tree,
            is_leaf=is_packed_or_scaled_leaf,
        )
    return jax.tree.map(
        _leaf_shardings,
        tree,
        shardings,
        is_leaf=is_packed_or_scaled_leaf,
    )


def _packed_shardings(packed: PackedScales, shardings: Any) -> PackedScales:
    """A `PackedScales` of shardings for `packed`: each leaf's as in its unpacked tree (where
    `shardings` has the unpacked tree's structure), the scale vector replicated like the
    per-tensor scales it stacks."""
    treedef, positions = packed.layout
    leaves = treedef.flatten_up_to(like(packed.unpack(), shardings))
    placed = [leaf for leaf in jax.tree.leaves(leaves) if isinstance(leaf, jax.sharding.Sharding)]
    if positions:
        vector = leaves[positions[0]].scale
    elif placed:
        vector = replicated(placed[0])
    else:
        vector = None
    stacked = set(positions)
    data = [leaf.data if i in stacked else leaf for i, leaf in enumerate(leaves)]
    return PackedScales(data, vector, packed.layout)


def _fitting(sharding: Any, leaf: Any) -> Any:
    """One sharding given for every leaf: replicated for a leaf of lower rank than its
    spec (a step counter, a scalar)."""
    if isinstance(sharding, NamedSharding) and hasattr(leaf, "shape"):
        if len(leaf.shape) < len(sharding.spec):
            return replicated(sharding)
    return sharding


def _leaf_shardings(leaf: Any, sharding: Any) -> Any:
    if isinstance(leaf, PackedScales):
        return _packed_shardings(leaf, sharding)
    if isinstance(sharding, ScaledArray):
        return sharding
    if leaf is None or not hasattr(leaf, "shape"):
        return None
    if isinstance(leaf, ScaledArray):
        if not isinstance(sharding, jax.sharding.Sharding):
            raise TypeError(
                f"jsa.sharding.like: a ScaledArray of shape {leaf.shape} needs a "
                f"jax.sharding.Sharding for its data, got {sharding!r}."
            )
        return ScaledArray(sharding, scale_sharding(sharding, leaf.shape, leaf.scale))
    return sharding


def device_put(tree: Any, shardings: Any) -> Any:
    """`jax.device_put(tree, like(tree, shardings))`: place a ScaledArray tree on devices.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        >>> import jax_scaled_arithmetics as jsa
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
        >>> x = jsa.sharding.device_put(
        ...     jsa.as_scaled_array(jnp.ones(4), dtype=jnp.float16), NamedSharding(mesh, P("dp"))
        ... )
        >>> x.data.sharding.spec == P("dp"), x.scale.sharding.spec == P()
        (True, True)
    """
    return jax.device_put(tree, like(tree, shardings))


def state_like(optimizer: Any, params: Any, shardings: Any) -> Any:
    """The shardings of `optimizer.init(params)`'s state: every leaf that mirrors a
    parameter (moments, accumulators) sharded like that parameter, ScaledArrays by
    :func:`like`, other leaves (step counts) replicated.

    Args:
        optimizer: an optax `GradientTransformation` (`jsa.optax.scale_optimizer(...)`
            included).
        params: the parameters (arrays, ScaledArrays or their `ShapeDtypeStruct`s).
        shardings: the parameters' shardings, as :func:`like` takes them.

    Returns:
        A tree of shardings for `jax.jit(optimizer.init, out_shardings=...)` or
        `jax.device_put`.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np, optax
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        >>> import jax_scaled_arithmetics as jsa
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
        >>> params = jsa.as_scaled_array({"w": jnp.ones((4, 2))}, dtype=jnp.float16)
        >>> opt = jsa.optax.scale_optimizer(optax.adam(1e-3))
        >>> spec = jsa.sharding.state_like(opt, params, {"w": NamedSharding(mesh, P("fsdp"))})
        >>> state = jax.jit(opt.init, out_shardings=spec)(params)
        >>> state[0].mu["w"].data.sharding.spec == P("fsdp"), state[0].count.sharding.spec == P()
        (True, True)
    """
    import optax

    param_shardings = like(params, shardings)
    first = next(
        s for s in jax.tree.leaves(param_shardings) if isinstance(s, jax.sharding.Sharding)
    )
    replicate = replicated(first)
    shapes = jax.eval_shape(optimizer.init, params)
    return optax.tree_map_params(
        optimizer,
        like,  # a moment may be a ScaledArray where its parameter is not
        shapes,
        param_shardings,
        transform_non_params=lambda _: replicate,
        is_leaf=lambda x: isinstance(x, ScaledArray),
    )


# --- collectives with a low-precision wire format ----------------------------------------
#
# Each is written with the scaling primitives, so that one program means the same inside
# and outside `autoscale`: `set_scaling(x, t)` puts a ScaledArray's data at the shared
# scale `t` (the identity on a plain array), and `c = t / get_data_scale(...)[1]` is then 1
# for a ScaledArray and `t` for a plain array, so `data / c` is the payload `value / t`
# either way. All-gathers and reduce-scatters run inside `apply_to_data` on the payload
# (every device's data is at `t`, so the scale needs no collective of its own); an
# all-reduce goes through JAX's `psum` (under `autoscale`, its scaled rule).

_NO_MAGNITUDE = -(1 << 20)  # the exponent bound of an all-zero (or all non-finite) tensor


def _axis_size(axis_name: Any) -> int:
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    return math.prod(int(jax.lax.axis_size(name)) for name in names)


def _max_exponent(dtype: Any) -> int:
    """The largest e with 2^e <= the format's largest finite value."""
    return int(math.floor(math.log2(float(jnp.finfo(dtype).max))))


def _headroom(axis_name: Any) -> int:
    """Binades left free for a sum over the devices of `axis_name`."""
    return max(0, math.ceil(math.log2(_axis_size(axis_name))))


def _top_exponent(x: Any, wire_dtype: Any) -> int:
    """The payload's exponent bound: the largest both the wire format and `x`'s dtype hold,
    at most float16's (formats with float32's exponent range need not sit at their top:
    their precision is the same in every binade)."""
    return min(_max_exponent(wire_dtype), _max_exponent(x.dtype), _max_exponent(jnp.float16))


def _to_unit_range(out: Any, x: Any, wire_dtype: Any) -> Any:
    """The collective's result with its data's largest magnitude below 2 (the payload sat
    at the top of the wire format, which leaves no room for the squares and products of
    what follows): the scale takes the power of two, the value is unchanged."""
    return rebalance(out, np.float32(2.0 ** -(_top_exponent(x, wire_dtype) - 1)))


def _shared_scale(x: Any, axis_name: Any, wire_dtype: Any, headroom: int) -> Any:
    """A power of two `t`, the same on every device of `axis_name`, with every finite
    `|value| / t` of every device below `2^(e - headroom)`, `e = _top_exponent(...)` (the
    payload is `x`'s data at scale `t`)."""
    data, scale = get_data_scale(x)
    magnitude = jnp.abs(data.astype(jnp.float32))
    amax = jnp.max(jnp.where(jnp.isfinite(magnitude), magnitude, 0.0), initial=0.0)
    # amax < 2^e_data and scale < 2^e_scale (frexp's exponents), so |value| < 2^(sum).
    _, e_data = jnp.frexp(amax)
    _, e_scale = jnp.frexp(jnp.max(jnp.asarray(scale, jnp.float32)))
    local = jnp.where(amax > 0, e_data + e_scale, _NO_MAGNITUDE)
    exponent = jax.lax.pmax(local, axis_name)
    exponent = jnp.clip(exponent + headroom - _top_exponent(x, wire_dtype), -126, 127)
    exponent = exponent.astype(jnp.int32)
    # 2^exponent from its bits (a normal float32: biased exponent, zero mantissa).
    bits = jax.lax.shift_left(exponent + 127, jnp.int32(23))
    return jax.lax.stop_gradient(jax.lax.bitcast_convert_type(bits, jnp.float32))


def _to_wire(data: Any, c: Any, dtype: Any) -> Any:
    """`data / c` in the wire dtype, finite values clamped to its range."""
    payload = data.astype(jnp.float32) / c
    bound = float(jnp.finfo(dtype).max)
    payload = jnp.where(jnp.isfinite(payload), jnp.clip(payload, -bound, bound), payload)
    return payload.astype(dtype)


def _from_wire(payload: Any, c: Any, dtype: Any) -> Any:
    return (payload.astype(jnp.float32) * c).astype(dtype)


@dataclasses.dataclass(frozen=True)
class _WireCollective:
    """An all-gather or reduce-scatter of `data / c` in `wire_dtype`, back to `data * c`."""

    kind: str  # "all_gather" | "psum_scatter"
    axis_name: Any
    axis: int
    tiled: bool
    wire_dtype: Any

    def __call__(self, data: Any, c: Any) -> Any:
        payload = _to_wire(data, c, self.wire_dtype)
        if self.kind == "all_gather":
            # Sent as bytes: XLA:CPU would widen an 8-bit float gather to float16.
            as_bits = jnp.dtype(f"uint{8 * payload.dtype.itemsize}")
            bits = jax.lax.bitcast_convert_type(payload, as_bits)
            bits = jax.lax.all_gather(bits, self.axis_name, axis=self.axis, tiled=self.tiled)
            payload = jax.lax.bitcast_convert_type(bits, self.wire_dtype)
        else:
            payload = jax.lax.psum_scatter(
                payload, self.axis_name, scatter_dimension=self.axis, tiled=self.tiled
            )
        return _from_wire(payload, c, data.dtype)


def _wire_dtype(x: Any, dtype: Any) -> Any:
    wire = jnp.dtype(x.dtype if dtype is None else dtype)
    if not (jnp.issubdtype(wire, jnp.floating) and jnp.issubdtype(x.dtype, jnp.floating)):
        raise TypeError(
            f"jsa.sharding: the operand and the wire dtype must be floating, got an operand "
            f"of {jnp.dtype(x.dtype)} and dtype={dtype!r}."
        )
    return wire


def _collective(x: Any, kind: str, axis_name: Any, axis: int, tiled: bool, dtype: Any) -> Any:
    headroom = 0 if kind == "all_gather" else _headroom(axis_name)
    shared = _shared_scale(x, axis_name, dtype, headroom)
    scaled = set_scaling(x, shared)
    c = shared / get_data_scale(scaled)[1]
    out = apply_to_data(_WireCollective(kind, axis_name, axis, tiled, dtype), scaled, c)
    return _to_unit_range(out, x, dtype)


# all_gather and psum_scatter are each other's transpose: one custom VJP for both, the
# backward pass the other collective in the gradients' wire dtype.
_TRANSPOSE = {"all_gather": "psum_scatter", "psum_scatter": "all_gather"}


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _wire_collective(x: Any, config: tuple[Any, ...]) -> Any:
    kind, axis_name, axis, tiled, dtype, _ = config
    return _collective(x, kind, axis_name, axis, tiled, dtype)


def _wire_collective_fwd(x: Any, config: tuple[Any, ...]) -> tuple[Any, None]:
    return _wire_collective(x, config), None


def _wire_collective_bwd(config: tuple[Any, ...], _: None, ct: Any) -> tuple[Any]:
    kind, axis_name, axis, tiled, _, grad_dtype = config
    return (_collective(ct, _TRANSPOSE[kind], axis_name, axis, tiled, grad_dtype),)


_wire_collective.defvjp(_wire_collective_fwd, _wire_collective_bwd)


def all_gather(
    x: Any,
    axis_name: Any,
    *,
    axis: int = 0,
    tiled: bool = False,
    dtype: Any = None,
    grad_dtype: Any = None,
) -> Any:
    """`jax.lax.all_gather` with the data sent in `dtype` at one shared power-of-two scale.

    For use inside `shard_map`. The devices agree on the scale with a scalar all-reduce of
    the largest magnitude's exponent; each sends `value / scale` cast to `dtype` (finite
    values clamped to its range: an FP8 format saturates; FP8's missing infinity gives
    NaN), and the result holds the gathered values in `x`'s dtype (under `autoscale`, data
    below 2 at one power of two shared by all devices). Under
    `jsa.autoscale` a ScaledArray's data is what travels (1 byte an entry in FP8), at the
    shared scale; without it, the values do. Its gradient is the reduce-scatter
    :func:`psum_scatter` with `dtype=grad_dtype`. `dtype`/`grad_dtype` None: `x`'s dtype.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> import jax_scaled_arithmetics as jsa
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("i",))
        >>> gather = jax.shard_map(
        ...     lambda w: jsa.sharding.all_gather(w, "i", tiled=True, dtype=jnp.float8_e4m3fn),
        ...     mesh=mesh, in_specs=P("i"), out_specs=P("i"),
        ... )
        >>> gather(jnp.array([1000.0, 3.0]))  # FP8 (3 mantissa bits) at a shared scale
        Array([1024.,    3.], dtype=float32)
    """
    wires = (_wire_dtype(x, dtype), _wire_dtype(x, grad_dtype))
    return _wire_collective(x, ("all_gather", axis_name, axis, tiled, *wires))


def psum_scatter(
    x: Any,
    axis_name: Any,
    *,
    scatter_dimension: int = 0,
    tiled: bool = False,
    dtype: Any = None,
    grad_dtype: Any = None,
) -> Any:
    """`jax.lax.psum_scatter` summed in `dtype` at one shared power-of-two scale.

    The shared scale leaves `ceil(log2(devices))` binades of the format free, so the sum
    does not overflow it. Its gradient is :func:`all_gather` in `grad_dtype`. See
    :func:`all_gather`.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> import jax_scaled_arithmetics as jsa
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("i",))
        >>> scatter = jax.shard_map(
        ...     lambda g: jsa.sharding.psum_scatter(g, "i", tiled=True, dtype=jnp.bfloat16),
        ...     mesh=mesh, in_specs=P("i"), out_specs=P("i"),
        ... )
        >>> scatter(jnp.array([2.0**-100, 3.0]))  # bfloat16 data at a shared scale
        Array([7.888609e-31, 3.000000e+00], dtype=float32)
    """
    wires = (_wire_dtype(x, dtype), _wire_dtype(x, grad_dtype))
    return _wire_collective(x, ("psum_scatter", axis_name, scatter_dimension, tiled, *wires))


def psum(x: Any, axis_name: Any, *, dtype: Any = None) -> Any:
    """`jax.lax.psum` summed in `dtype` at one shared power-of-two scale (an all-reduce of
    gradients in bfloat16, say). See :func:`psum_scatter`.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> import jax_scaled_arithmetics as jsa
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("i",))
        >>> total = jax.shard_map(
        ...     lambda g: jsa.sharding.psum(g, "i", dtype=jnp.bfloat16),
        ...     mesh=mesh, in_specs=P("i"), out_specs=P(),
        ... )
        >>> total(jnp.array([2.0**-100, 3.0]))
        Array([7.888609e-31, 3.000000e+00], dtype=float32)
    """
    wire = _wire_dtype(x, dtype)
    shared = _shared_scale(x, axis_name, wire, _headroom(axis_name))
    scaled = set_scaling(x, shared)
    # (The same on every device: the result of the sum does not vary over the axes.)
    c = shared / jax.lax.pmax(get_data_scale(scaled)[1], axis_name)
    payload = apply_to_data(functools.partial(_to_wire, dtype=wire), scaled, c)
    total = jax.lax.psum(payload, axis_name)
    out = apply_to_data(functools.partial(_from_wire, dtype=jnp.dtype(x.dtype)), total, c)
    return _to_unit_range(out, x, wire)


# --- FSDP ---------------------------------------------------------------------------------


def _axis_names(axis_name: Any) -> tuple[Any, ...]:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _replicated_param(x: Any, config: tuple[Any, ...]) -> Any:
    axis_names, _ = config
    return jax.lax.pcast(x, axis_names, to="varying")


def _replicated_fwd(x: Any, config: tuple[Any, ...]) -> tuple[Any, None]:
    return _replicated_param(x, config), None


def _replicated_bwd(config: tuple[Any, ...], _: None, ct: Any) -> tuple[Any]:
    axis_names, grad_dtype = config
    return (psum(ct, axis_names, dtype=grad_dtype),)


_replicated_param.defvjp(_replicated_fwd, _replicated_bwd)


def gather_params(
    params: Any, specs: Any, axis_name: Any, *, dtype: Any = None, grad_dtype: Any = None
) -> Any:
    """FSDP inside `shard_map`: every parameter shard all-gathered over `axis_name` in
    `dtype`, its gradient reduce-scattered in `grad_dtype`, each at one shared scale.

    `params` are the shards `shard_map` passes for `in_specs=specs`; every floating leaf
    whose spec names a mesh axis of `axis_name` on some dimension is gathered along that
    dimension with :func:`all_gather` (under `jsa.autoscale`: a ScaledArray's data, so FP8
    data moves 1 byte an entry, plus one scalar all-reduce for the shared scale). Leaves
    replicated over `axis_name` are passed through, and their gradient is all-reduced
    with :func:`psum` in `grad_dtype`. Gradients are sums over the devices of `axis_name`
    (as JAX's transposes of the collectives give): differentiate the `pmean` of the
    per-device loss for the mean. Other leaves (integers, None) pass through.

    Args:
        params: parameter shards (a pytree; ScaledArrays under `autoscale`).
        specs: their `PartitionSpec`s, as given to `shard_map`'s `in_specs` (a tree with
            `params`' structure, a spec where `params` has an array).
        axis_name: the mesh axis (or axes) the parameters are sharded and the batch split
            over.
        dtype: the all-gather's wire dtype (e.g. `jnp.float8_e4m3fn`); None: the data's.
        grad_dtype: the reduce-scatter's (e.g. `jnp.bfloat16`); None: the gradient's own.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> import jax_scaled_arithmetics as jsa
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
        >>> specs = {"w": P("fsdp", None), "b": P()}
        >>> def loss(params, x):
        ...     p = jsa.sharding.gather_params(params, specs, "fsdp", dtype=jnp.float8_e4m3fn)
        ...     return jax.lax.pmean(jnp.sum(x @ p["w"] + p["b"][None]), "fsdp")
        >>> grad = jax.shard_map(
        ...     jax.grad(loss), mesh=mesh, in_specs=(specs, P("fsdp")), out_specs=specs
        ... )
        >>> params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
        >>> grad(params, jnp.ones((4, 3)))["w"]
        Array([[4., 4.],
               [4., 4.],
               [4., 4.]], dtype=float32)
    """
    names = _axis_names(axis_name)

    def gather_leaf(spec: Any, x: Any) -> Any:
        if x is None or not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        if spec is None:
            spec = PartitionSpec()
        if not isinstance(spec, PartitionSpec):
            raise TypeError(
                f"jsa.sharding.gather_params: expected a PartitionSpec for a parameter of "
                f"shape {tuple(x.shape)}, got {spec!r}."
            )
        sharded = False
        for dim, entry in enumerate(spec_entries(spec, x.ndim)):
            axes = tuple(a for a in _axis_names(entry) if a in names) if entry else ()
            if axes and len(axes) != len(_axis_names(entry)):
                raise NotImplementedError(
                    f"jsa.sharding.gather_params: dimension {dim} of a parameter of shape "
                    f"{tuple(x.shape)} is split over {entry!r}, of which only {axes!r} are "
                    f"in axis_name: gathering part of a dimension's axes is not supported."
                )
            if axes:
                sharded = True
                axes_arg = axes if len(axes) > 1 else axes[0]
                x = all_gather(
                    x, axes_arg, axis=dim, tiled=True, dtype=dtype, grad_dtype=grad_dtype
                )
        if sharded:
            return x
        grad_wire = _wire_dtype(x, grad_dtype)
        return _replicated_param(x, (names, grad_wire))

    return jax.tree.map(
        gather_leaf, specs, params, is_leaf=lambda s: s is None or isinstance(s, PartitionSpec)
    )
