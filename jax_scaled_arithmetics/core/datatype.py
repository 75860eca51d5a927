"""`ScaledArray`: an array represented as `data * scale`, and the factories around it."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _compat, block_scales
from .define import define_primitive
from .dtypes import compute_dtype
from .scale_arithmetic import (
    largest_magnitude,
    scale_of_magnitude,
    stacked_in_pieces,
    unstacked_in_pieces,
)
from .types import Array

DTypeLike = Any

__all__ = [
    "ScaledArray",
    "scaled_array",
    "as_scaled_array",
    "asarray",
    "is_scaled_leaf",
    "PackedScales",
    "pack_scales",
    "unpack_scales",
    "stack_scalars",
    "stack_scalars_p",
    "unstack_scalars",
    "unstack_scalars_p",
    "is_packed_or_scaled_leaf",
    "is_floating",
    "is_array",
    "invalid_scale_values",
    "set_operator_transform",
    "set_trace_conversions",
    "scaled_leaf",
]


def is_floating(x: Any) -> bool:
    """True when `x` (an array, tracer, scalar or dtype) has a floating-point dtype (`None`,
    an empty subtree, has none)."""
    if x is None:
        return False
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        if isinstance(x, float):
            return True
        try:
            dtype = np.dtype(x)
        except TypeError:
            return False
    return bool(jnp.issubdtype(dtype, jnp.floating))


# The transform that runs ScaledArray operators (`autoscale`), and whether it is tracing a
# user function now: installed by `core.interpreter` when it is imported (the package's
# `__init__` imports it), so this module imports nothing above it.
_OPERATOR_TRANSFORM: list[tuple[Callable[..., Any], Callable[[], bool]]] = []


def set_operator_transform(
    transform: Callable[[Callable[..., Any]], Callable[..., Any]], tracing: Callable[[], bool]
) -> None:
    """Install the transform that ScaledArray operators (`x * y`, `x[i]`, ...) run through."""
    _OPERATOR_TRANSFORM[:] = [(transform, tracing)]


# How `as_scaled_array` and `asarray` convert a leaf inside a function that autoscale
# traces, where every value is a plain stand-in (a ScaledArray object built there would
# end up as the data of one, and `to_array` has nothing to act on): scaling primitives
# that the interpreter runs (`lax/scaling_primitives.py`), as `scaled(x, scale, dtype,
# scale_shape)` and `plain(x, dtype)`.
_IN_TRACE: dict[str, Callable[..., Any]] = {}


def set_trace_conversions(scaled: Callable[..., Any], plain: Callable[..., Any]) -> None:
    """Install how `as_scaled_array` (`scaled`) and `asarray` (`plain`) convert one floating
    leaf inside a function that autoscale traces."""
    _IN_TRACE.update(scaled=scaled, plain=plain)


def _tracing_scaled_function() -> bool:
    return bool(_OPERATOR_TRANSFORM) and _OPERATOR_TRANSFORM[0][1]()


def _autoscaled(fn: Callable[..., Any]) -> Callable[..., Any]:
    if not _OPERATOR_TRANSFORM:
        raise RuntimeError("The autoscale interpreter is not installed.")
    autoscale, tracing = _OPERATOR_TRANSFORM[0]
    if tracing():
        # Inside the trace of an autoscaled function every value is a plain stand-in: a
        # ScaledArray met there was captured from outside, and cannot enter the jaxpr.
        raise TypeError(
            "A ScaledArray captured by a function that autoscale traces (closed over, or "
            "built inside it) cannot be used there: pass it as an argument of the "
            "autoscaled function instead."
        )
    return autoscale(fn)


@dataclass(frozen=True, eq=False)
class ScaledArray:
    """An array whose value is `data * scale`.

    `data` holds the values in a (usually low-precision) floating dtype, `scale`
    is a float32 scalar, by default a power of two, or a block scale: an array of
    the data's rank whose every dimension divides the data's, one scale per block
    (per row `(M, 1)`, per channel `(1, N)`, MX `(M, K // 32)`, stacked layers
    `(L, 1, 1)`). Shape and dtype are the data's. The class is a pytree with two
    leaves, so it travels through `jit`, `vmap`, `scan` carries and optimizer states
    unchanged.

    Build one with :func:`scaled_array` or :func:`as_scaled_array`, which
    validate their inputs; the constructor itself does not, because JAX rebuilds
    pytrees with placeholder leaves.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jsa.scaled_array(jnp.array([1.0, 1.5], jnp.float16), 4.0)
        >>> x.to_array()
        Array([4., 6.], dtype=float16)
        >>> (x * x).to_array()
        Array([16., 36.], dtype=float16)
    """

    data: Array
    scale: Array

    # NumPy should defer to our reflected operators (`np_array * scaled`).
    __array_priority__ = 1000
    # Comparison operators return arrays, as for jax.Array: not hashable.
    __hash__ = None  # type: ignore[assignment]

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.data.shape, dtype=np.int64))

    @property
    def aval(self) -> Any:
        """The abstract value of the represented array (that of `data`)."""
        return _compat.typeof(self.data)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized ScaledArray")
        return self.shape[0]

    def to_array(self, dtype: DTypeLike | None = None) -> Array:
        """The represented value `data * scale`, in `dtype` (default: the data's dtype).

        The product is computed in at least float32 and then cast, so that a
        value representable in `dtype` is returned exactly even when `data * scale`
        would overflow or underflow in the data's own precision.
        """
        out_dtype = self.data.dtype if dtype is None else jnp.dtype(dtype)
        compute = compute_dtype(self.data.dtype, out_dtype)
        data = jnp.asarray(self.data)
        scale = jnp.asarray(self.scale)
        if scale.ndim:  # a block scale: each entry repeated over its block
            scale = block_scales.expand_scale(scale, data.shape)
        value = data.astype(compute) * scale.astype(compute)
        return value.astype(out_dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        try:
            out = np.asarray(self.to_array())
        except jax.errors.TracerArrayConversionError as error:
            error.add_note(
                "It was a ScaledArray of traced values (under jax.jit, grad or vmap) that a "
                "function outside autoscale asked for its NumPy value (optax.apply_updates "
                "does, with jnp.asarray). Take its value with x.to_array() or "
                "jsa.asarray(tree), add ScaledArray updates with jsa.optax.apply_updates, "
                "or run the step under jsa.autoscale."
            )
            raise
        return out if dtype is None else out.astype(dtype)

    def astype(self, dtype: DTypeLike) -> ScaledArray:
        """Cast the data to `dtype`, keeping the scale (the value is rounded to `dtype`; data
        beyond its range overflows as a plain cast does: convert a float32 value to a
        narrower format with `as_scaled_array(value, dtype=...)`, which fits the scale)."""
        return ScaledArray(jnp.asarray(self.data).astype(dtype), self.scale)

    def __repr__(self) -> str:
        return f"ScaledArray(data={self.data!r}, scale={self.scale!r})"

    # Operators run through `autoscale`, so they do the scaled thing.
    def _binary(self, other: Any, op: Callable[[Any, Any], Any], reflected: bool = False) -> Any:
        if not isinstance(other, ScaledArray):
            # Close over plain operands: Python scalars stay literals (x ** 2 is integer_pow,
            # and constants get their power-of-two scale).
            if reflected:
                return _autoscaled(lambda a: op(other, a))(self)
            return _autoscaled(lambda a: op(a, other))(self)
        if reflected:
            return _autoscaled(lambda a, b: op(b, a))(self, other)
        return _autoscaled(op)(self, other)

    def __add__(self, other: Any) -> Any:
        return self._binary(other, operator.add)

    def __radd__(self, other: Any) -> Any:
        return self._binary(other, operator.add, reflected=True)

    def __sub__(self, other: Any) -> Any:
        return self._binary(other, operator.sub)

    def __rsub__(self, other: Any) -> Any:
        return self._binary(other, operator.sub, reflected=True)

    def __mul__(self, other: Any) -> Any:
        return self._binary(other, operator.mul)

    def __rmul__(self, other: Any) -> Any:
        return self._binary(other, operator.mul, reflected=True)

    def __truediv__(self, other: Any) -> Any:
        return self._binary(other, operator.truediv)

    def __rtruediv__(self, other: Any) -> Any:
        return self._binary(other, operator.truediv, reflected=True)

    def __matmul__(self, other: Any) -> Any:
        return self._binary(other, operator.matmul)

    def __rmatmul__(self, other: Any) -> Any:
        return self._binary(other, operator.matmul, reflected=True)

    def __pow__(self, other: Any) -> Any:
        return self._binary(other, operator.pow)

    def __lt__(self, other: Any) -> Any:
        return self._binary(other, operator.lt)

    def __le__(self, other: Any) -> Any:
        return self._binary(other, operator.le)

    def __gt__(self, other: Any) -> Any:
        return self._binary(other, operator.gt)

    def __ge__(self, other: Any) -> Any:
        return self._binary(other, operator.ge)

    def __eq__(self, other: Any) -> Any:  # type: ignore[override]
        return self._binary(other, operator.eq)

    def __ne__(self, other: Any) -> Any:  # type: ignore[override]
        return self._binary(other, operator.ne)

    def __neg__(self) -> Any:
        return _autoscaled(operator.neg)(self)

    def __pos__(self) -> ScaledArray:
        return self

    def __abs__(self) -> Any:
        return _autoscaled(operator.abs)(self)

    def __getitem__(self, index: Any) -> Any:
        return _autoscaled(lambda x: x[index])(self)

    @property
    def T(self) -> Any:
        return _autoscaled(lambda x: x.T)(self)

    def reshape(self, *shape: Any) -> Any:
        return _autoscaled(lambda x: x.reshape(*shape))(self)

    def sum(self, axis: Any = None, keepdims: bool = False) -> Any:
        return _autoscaled(lambda x: jnp.sum(x, axis=axis, keepdims=keepdims))(self)


jax.tree_util.register_dataclass(ScaledArray, data_fields=["data", "scale"], meta_fields=[])


def is_array(x: Any) -> bool:
    """True for the values JAX treats as arrays: `jax.Array` (tracers included), NumPy arrays
    and NumPy scalars. Python scalars, `None` and other objects (modules, functions, Flax
    `Variable` wrappers) are not."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def is_scaled_leaf(x: Any) -> bool:
    """`is_leaf` predicate for `jax.tree_util` functions: treats a ScaledArray as one leaf.

    Only ScaledArrays, arrays, scalars and `None` are leaves: a pytree node that merely has a
    `shape` attribute (an Equinox `LayerNorm`, a Flax NNX `Param`) is descended into, so its
    arrays are reached and its wrapper kept.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> tree = {"w": jsa.as_scaled_array(jnp.ones(2)), "n": 3}
        >>> len(jax.tree_util.tree_leaves(tree, is_leaf=jsa.is_scaled_leaf))
        2
    """
    return isinstance(x, ScaledArray) or x is None or np.isscalar(x) or is_array(x)


class PackedScales:
    """A pytree of ScaledArrays whose scalar float32 scales travel as one vector.

    `jax.jit` hands a ScaledArray's scale over as an argument of its own, and returns each
    new scale as a result of its own: a training step over a model's parameters and Adam
    moments takes and returns hundreds of scalars, each a buffer the runtime passes on
    every call (a few microseconds each on a CPU). A `PackedScales` holds the same tree
    with those scales stacked into one float32 vector, so it crosses `jit` as its data
    arrays plus one vector. ScaledArrays with a block scale (or a scale of another
    dtype) and every other leaf stay as they are.

    Build one with :func:`pack_scales` (inside the jitted step, on its results) and read
    it back with :func:`unpack_scales`; `autoscale`, `asarray`, `as_scaled_array` and
    `jsa.tree.astype` unpack it themselves, `jsa.sharding.like` places it and `jsa.vmap`
    maps its data and shares its scales. Other pytree functions (`jax.tree.map`,
    `jsa.tree.map`) see its data arrays and its scale vector: unpack it first to work on
    values. The constructor does not validate (JAX rebuilds pytrees with placeholder
    leaves).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> params = jsa.as_scaled_array({"w": jnp.ones((2, 2)), "b": jnp.zeros(2)})
        >>> packed = jsa.tree.pack_scales(params)
        >>> packed.scales
        Array([1., 1.], dtype=float32)
        >>> [x.shape for x in jax.tree_util.tree_leaves(packed)]  # two data arrays, one vector
        [(2,), (2, 2), (2,)]
    """

    __slots__ = ("leaves", "scales", "layout")

    def __init__(self, leaves: Any, scales: Any, layout: Any) -> None:
        self.leaves = tuple(leaves)  # the tree's leaves; a packed ScaledArray's data
        self.scales = scales  # the packed scales, in the order of their leaves
        self.layout = layout  # (treedef, positions of the packed ScaledArrays)

    def tree_flatten(self) -> tuple[tuple[Any, ...], Any]:
        return (*self.leaves, self.scales), self.layout

    @classmethod
    def tree_unflatten(cls, layout: Any, children: Any) -> PackedScales:
        children = tuple(children)
        return cls(children[:-1], children[-1], layout)

    def unpack(self) -> Any:
        """The tree of ScaledArrays (see :func:`unpack_scales`)."""
        treedef, positions = self.layout
        leaves = list(self.leaves)
        if is_array(self.scales) and _compat.is_tracer(self.scales):
            scales = unstack_scalars(jnp.asarray(self.scales))  # one primitive, not a slice each
        else:
            scales = [self._scale(k) for k in range(len(positions))]
        for i, scale in zip(positions, scales):
            leaves[i] = ScaledArray(leaves[i], scale)
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def _scale(self, k: int) -> Any:
        """The `k`-th packed scale: a slice of an array vector, a scalar shape of an abstract
        one (`jax.eval_shape`), and otherwise (a tree of shardings) the vector's own leaf."""
        if isinstance(self.scales, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((), self.scales.dtype)
        if is_array(self.scales):
            return jax.lax.index_in_dim(jnp.asarray(self.scales), k, keepdims=False)
        return self.scales

    def __repr__(self) -> str:
        treedef, positions = self.layout
        return f"PackedScales({len(positions)} scales, {treedef})"


jax.tree_util.register_pytree_node_class(PackedScales)


def is_packed_or_scaled_leaf(x: Any) -> bool:
    """`is_scaled_leaf`, or a `PackedScales` (kept whole by the functions that handle one)."""
    return isinstance(x, PackedScales) or is_scaled_leaf(x)


def _packs(x: Any) -> bool:
    """A ScaledArray whose scale `PackedScales` stacks: a float32 scalar."""
    return (
        isinstance(x, ScaledArray)
        and np.ndim(x.scale) == 0
        and jnp.result_type(x.scale) == jnp.float32
    )


def _stack_batch(primitive: Any, args: Any, dims: Any) -> Any:
    size = next(np.shape(x)[d] for x, d in zip(args, dims) if d is not None)
    columns = [
        lax.broadcast(x, (size,)) if d is None else jnp.moveaxis(x, d, 0)
        for x, d in zip(args, dims)
    ]
    return jnp.stack(columns, axis=1), 0


def _stack_jvp(primitive: Any, primals: Any, tangents: Any) -> Any:
    zeros = [_compat.instantiate_zeros(t) for t in tangents]
    return primitive.bind(*primals), jnp.stack(zeros)


# Float32 scalars as one vector, lowered per platform: `jnp.stack` (which XLA:GPU writes
# in one kernel with each scalar's last instructions fused in), and on XLA:CPU the pieces
# of `stacked_in_pieces` (a `jnp.stack` of many computed scalars there is a kernel per
# scalar; the select chains cost XLA:GPU a kernel per scalar instead: the zoo linen step
# packed, 372 kernels against 318).
stack_scalars_p = define_primitive(
    "stack_scalars",
    lambda *scalars: jnp.stack(scalars),
    lambda *scalars: _compat.aval_like(scalars[0], (len(scalars),), np.float32),
    batching=_stack_batch,
    jvp=_stack_jvp,
    cpu_impl=stacked_in_pieces,
)


def stack_scalars(scalars: list[Any]) -> Any:
    """Float32 scalars as one vector (traced: `stack_scalars_p`, one kernel per platform's
    form); the values of `jnp.stack`."""
    if len(scalars) < 2 or not any(_compat.is_tracer(s) for s in scalars):
        return jnp.stack(scalars)
    return stack_scalars_p.bind(*_compat.match_varying(*scalars))


def _unstack_impl(vector: Array) -> list[Array]:
    return [lax.index_in_dim(vector, i, keepdims=False) for i in range(vector.shape[0])]


def _unstack_batch(primitive: Any, args: Any, dims: Any) -> Any:
    (vector,), (dim,) = args, dims
    vector = jnp.moveaxis(vector, dim, 0)
    return [vector[:, i] for i in range(vector.shape[1])], [0] * vector.shape[1]


def _unstack_jvp(primitive: Any, primals: Any, tangents: Any) -> Any:
    tangent = _compat.instantiate_zeros(tangents[0])
    return primitive.bind(*primals), [tangent[i] for i in range(tangent.shape[0])]


# A vector's elements as scalars, lowered per platform: slices (which XLA:GPU fuses into
# their readers), and on XLA:CPU the variadic reductions of `unstacked_in_pieces`, whose
# outputs the kernels that read them take as parameters (a slice fused into each reader
# would make those kernels distinct, each compiled on its own).
unstack_scalars_p = define_primitive(
    "unstack_scalars",
    _unstack_impl,
    lambda vector: [_compat.aval_like(vector, (), vector.dtype)] * vector.shape[0],
    multiple_results=True,
    batching=_unstack_batch,
    jvp=_unstack_jvp,
    cpu_impl=unstacked_in_pieces,
)


def unstack_scalars(vector: Any) -> list[Any]:
    """The elements of a float32 vector as scalars (traced: `unstack_scalars_p`, whose
    XLA:CPU form writes each in a buffer its readers take as it is); `vector[i]`'s values."""
    if not _compat.is_tracer(vector) or vector.shape[0] < 2:
        return _unstack_impl(vector)
    return list(unstack_scalars_p.bind(vector))


def pack_scales(tree: Any) -> PackedScales:
    """`tree` with the scalar float32 scales of its ScaledArrays stacked into one vector.

    Call it inside the jitted training step, on the parameters and optimizer state it
    returns: the step then takes and returns one scale vector per packed tree rather than
    one scalar per tensor, which saves the runtime a buffer per tensor on every call. A
    `PackedScales` already in `tree` is unpacked first.

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> import jax_scaled_arithmetics as jsa
        >>> params = jsa.as_scaled_array({"w": jnp.full((4, 4), 0.5, jnp.float16)})
        >>> opt = jsa.optax.scale_optimizer(optax.adam(1e-2))
        >>> @jax.jit
        ... def step(params, state):
        ...     loss = lambda p: (p["w"] ** 2).sum()
        ...     grads = jsa.autoscale(jax.grad(loss))(params)  # PackedScales unpacked
        ...     updates, state = jsa.autoscale(opt.update)(grads, state, params)
        ...     params = jsa.autoscale(optax.apply_updates)(params, updates)
        ...     return jsa.tree.pack_scales(params), jsa.tree.pack_scales(state)
        >>> params, state = jsa.tree.pack_scales(params), jsa.tree.pack_scales(opt.init(params))
        >>> for _ in range(3):
        ...     params, state = step(params, state)
        >>> round(float(jsa.asarray(params)["w"][0, 0]), 3)  # 0.5 - 3 steps of 0.01
        0.47
    """
    leaves, treedef = jax.tree_util.tree_flatten(unpack_scales(tree), is_leaf=is_scaled_leaf)
    positions = tuple(i for i, leaf in enumerate(leaves) if _packs(leaf))
    if any(isinstance(leaves[i].scale, jax.ShapeDtypeStruct) for i in positions):
        scales: Any = jax.ShapeDtypeStruct((len(positions),), jnp.float32)  # abstract tree
    elif positions:
        scales = stack_scalars([jnp.asarray(leaves[i].scale, jnp.float32) for i in positions])
    else:
        scales = jnp.zeros((0,), jnp.float32)
    packed = set(positions)
    data = [leaf.data if i in packed else leaf for i, leaf in enumerate(leaves)]
    return PackedScales(data, scales, (treedef, positions))


def unpack_scales(tree: Any) -> Any:
    """`tree` with every `PackedScales` in it turned back into its tree of ScaledArrays.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> packed = jsa.tree.pack_scales([jsa.scaled_array(jnp.ones(2), 4.0), 3])
        >>> jsa.tree.unpack_scales(packed)[0].scale
        Array(4., dtype=float32)
    """
    return jax.tree_util.tree_map(
        lambda x: x.unpack() if isinstance(x, PackedScales) else x,
        tree,
        is_leaf=lambda x: isinstance(x, (PackedScales, ScaledArray)),  # kept as they are
    )


def _is_concrete(x: Any) -> bool:
    return not _compat.is_tracer(x)


def invalid_scale_values(scale: Any) -> str | None:
    """What is wrong with the values of a concrete scale (None when they are finite and
    non-negative, or when the scale is traced and its values unknown), as a phrase such as
    "is -1.0 (negative)" or "has 2 NaN block(s), the first at (0, 1)"."""
    if not _is_concrete(scale):
        return None
    try:
        values = np.asarray(scale, dtype=np.float64)
    except (TypeError, ValueError):  # an abstract value (`jax.ShapeDtypeStruct`): unknown
        return None
    for bad, what in (
        (np.isnan(values), "NaN"),
        (np.isinf(values), "infinite"),
        (values < 0, "negative"),
    ):
        if not bad.any():
            continue
        if values.ndim == 0:
            return f"is {float(values)!r} ({what})"
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        return f"has {int(bad.sum())} {what} block(s), the first at {first}"
    return None


def _check_scale(data: Array, scale: Array) -> None:
    if not is_floating(scale):
        scale_dtype = getattr(scale, "dtype", type(scale))
        raise TypeError(f"ScaledArray scale must have a floating dtype, got {scale_dtype}.")
    block_scales.block_layout(np.shape(data), np.shape(scale))
    problem = invalid_scale_values(scale)
    if problem is not None:
        raise ValueError(
            f"ScaledArray scale must be finite and non-negative, but it {problem}: {scale!r}."
        )


def _at_data_rank(data: Array, scale: Array) -> Array:
    """A block scale reshaped to the data's rank (a lower-rank one gets leading 1s)."""
    if np.ndim(scale) == 0 or np.ndim(scale) == np.ndim(data):
        return scale
    return scale.reshape(block_scales.block_layout(np.shape(data), np.shape(scale)))


def _to_jax_array(x: Any, dtype: DTypeLike | None = None) -> Any:
    """`jnp.asarray(x, dtype)`, with a NumPy array or scalar of a dtype JAX keeps moved by
    `jax.device_put`: `jnp.asarray` stages it through a primitive that XLA compiles once
    per shape and dtype (JAX 0.10.2 to 0.12), a compiled program per new shape in eager
    code. Same array either way (dtype, not weakly typed, uncommitted)."""
    if (
        dtype is None
        and isinstance(x, (np.ndarray, np.generic))
        and not isinstance(x, np.ma.MaskedArray)
        and jax.dtypes.canonicalize_dtype(x.dtype) == x.dtype
    ):
        return jax.device_put(x)
    return jnp.asarray(x, dtype=dtype)


def scaled_array(
    data: Array, scale: Array, dtype: DTypeLike | None = None, npapi: Any = None
) -> ScaledArray:
    """Build a ScaledArray from `data` and `scale`, validating both.

    Args:
        data: floating-point array (or nested list / scalar) holding the data.
        scale: non-negative floating scalar (one scale for the tensor), or a block scale:
            an array whose dimensions divide the data's (`scale.shape[i]` blocks along
            axis `i`; a lower-rank scale gets leading 1s, so `(N,)` is per column).
        dtype: optional dtype to cast the data to.
        npapi: `numpy` or `jax.numpy` (default) to build the arrays with.

    Raises:
        TypeError: the data or the scale is not floating point.
        ValueError: a scale dimension does not divide the data's, or a scale is negative.

    Examples:
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jsa.scaled_array([1.0, 2.0], 0.5, dtype="float16")
        >>> x.to_array()
        Array([0.5, 1. ], dtype=float16)
        >>> jsa.scaled_array([[1.0, 1.0, 1.0, 1.0]], [[2.0, 8.0]]).to_array()  # 2 blocks
        Array([[2., 2., 8., 8.]], dtype=float32)
    """
    if isinstance(scale, float):
        scale = np.float32(scale)
    if npapi is None or npapi is jnp:
        data, scale = _to_jax_array(data, dtype), _to_jax_array(scale)
    else:
        data, scale = npapi.asarray(data, dtype=dtype), npapi.asarray(scale)
    if not is_floating(data):
        raise TypeError(f"ScaledArray data must have a floating dtype, got {data.dtype}.")
    _check_scale(data, scale)
    return ScaledArray(data, _at_data_rank(data, scale))


def _as_scaled_leaf(x: Any, scale: Any, dtype: DTypeLike | None, scale_shape: Any) -> Any:
    if isinstance(x, ScaledArray):
        return x if dtype is None else x.astype(dtype)
    if not is_array(x) or not is_floating(x):
        # Python scalars (a dropout rate, an epsilon), None, functions and other objects of a
        # model's tree, and integer or boolean arrays, stay as they are.
        return x
    if _IN_TRACE and _tracing_scaled_function():
        return _IN_TRACE["scaled"](x, scale, dtype, scale_shape)
    return scaled_leaf(x, scale, dtype, scale_shape)


def scaled_leaf(x: Any, scale: Any, dtype: DTypeLike | None, scale_shape: Any) -> ScaledArray:
    """A floating array `x` as a ScaledArray (`as_scaled_array` of one leaf, wherever it is
    called: a scaled rule's operands are values, not stand-ins)."""
    arr = _to_jax_array(x)
    out_dtype = arr.dtype if dtype is None else jnp.dtype(dtype)
    if scale_shape is not None:
        layout = _block_layout_for(arr.shape, scale_shape)
        scale = block_scales.block_pow2_scale(arr, layout)
    if scale is None:
        if not _narrower_range(out_dtype, arr.dtype):
            return scaled_array(arr.astype(out_dtype), np.float32(1.0))
        scale = _scale_that_fits(arr, out_dtype)
    scale_arr = jnp.asarray(scale, dtype=jnp.float32) if isinstance(scale, float) else scale
    scale_arr = _to_jax_array(scale_arr)
    if not is_floating(scale_arr):
        raise TypeError(f"as_scaled_array scale must be floating point, got {scale_arr.dtype}.")
    _check_scale(arr, scale_arr)
    scale_arr = _at_data_rank(arr, scale_arr)
    compute = compute_dtype(arr.dtype, scale_arr.dtype)
    # data = value / scale, with 0 / 0 defined as 0 (a zero scale represents zeros).
    full_scale = block_scales.expand_scale(scale_arr, arr.shape)
    safe_scale = jnp.where(full_scale == 0, 1, full_scale).astype(compute)
    data = jnp.where(full_scale == 0, 0, arr.astype(compute) / safe_scale)
    return ScaledArray(data.astype(out_dtype), scale_arr)


def _narrower_range(dtype: Any, than: Any) -> bool:
    """Whether floating `dtype`'s exponent range is narrower than `than`'s (float16 and FP8
    against float32; not bfloat16)."""
    if not (jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(than, jnp.floating)):
        return False
    mine, theirs = jnp.finfo(dtype), jnp.finfo(than)
    return bool(mine.maxexp < theirs.maxexp or mine.minexp > theirs.minexp)


def _scale_that_fits(arr: Array, dtype: Any) -> Array:
    """1 where `arr`'s largest finite magnitude is a normal number of `dtype` (or 0), else
    the power of two at or below it: the data then fits `dtype` rather than overflowing it
    or flushing to zero."""
    magnitude = jnp.abs(arr.astype(compute_dtype(arr.dtype)))
    # At least 0: an empty array's maximum is -inf.
    amax = jnp.maximum(largest_magnitude(magnitude, finite_only=True), 0).astype(jnp.float32)
    info = jnp.finfo(dtype)
    fits = (amax == 0) | ((amax <= float(info.max)) & (amax >= float(info.smallest_normal)))
    return jnp.where(fits, np.float32(1.0), scale_of_magnitude(amax))


def _block_layout_for(shape: tuple[int, ...], scale_shape: Any) -> tuple[int, ...]:
    """`scale_shape` for an array of `shape`: a tuple (validated), or a callable of the shape
    (one layout for leaves of several shapes, e.g. `lambda s: s[:-1] + (1,)` per row)."""
    if callable(scale_shape):
        scale_shape = scale_shape(tuple(shape))
    if isinstance(scale_shape, int) or not all(
        isinstance(d, (int, np.integer)) for d in scale_shape
    ):
        raise TypeError(
            f"as_scaled_array scale_shape must be a tuple of ints (or a callable returning "
            f"one), got {scale_shape!r}."
        )
    return block_scales.block_layout(shape, tuple(int(d) for d in scale_shape))


def as_scaled_array(
    tree: Any, scale: Any = None, dtype: DTypeLike | None = None, scale_shape: Any = None
) -> Any:
    """Convert the floating-point arrays of a pytree to ScaledArrays.

    Floating arrays (JAX or NumPy) become `ScaledArray(value / scale, scale)` (scale 1 by
    default), so that the result represents the same values. With a `dtype` of narrower
    range (float16, FP8) and no `scale`, an array whose largest finite magnitude is beyond
    the dtype's largest value or below its smallest normal one gets the power of two at or
    below that magnitude instead of 1: its data fits rather than overflowing to inf or
    flushing to 0. Every other leaf passes
    through unchanged: integer and boolean arrays, existing ScaledArrays, `None`, Python
    scalars (a model's dropout rate stays a Python float, static under `autoscale`) and
    non-array objects. Pytree nodes keep their types and metadata (Flax linen variable
    dicts, NNX `State` and `Param` wrappers, Equinox modules and their static fields), so
    `jax.tree.structure(out, is_leaf=jsa.is_scaled_leaf)` is the input's structure.

    Inside a function that `autoscale` transforms it does the same to the values there: a
    plain one becomes a ScaledArray, one computed from ScaledArrays stays as it is.

    Args:
        tree: a pytree of arrays.
        scale: optional scale (a float scalar, or a block scale) used for every floating
            leaf.
        dtype: optional dtype for the data of the new ScaledArrays.
        scale_shape: optional block layout (a tuple whose dimensions divide the data's,
            or a callable from a leaf's shape to one): each block gets the power of two at
            or below its largest finite magnitude, so its data's largest magnitude is in
            [1, 2). `(M, 1)` is per row, `(1, N)` per column, `(M, K // 32)` MX blocks.

    Raises:
        ValueError: a scale or `scale_shape` dimension does not divide the data's.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jsa.as_scaled_array(jnp.array([2.0, 4.0]), scale=2.0)
        >>> x.data, x.scale
        (Array([1., 2.], dtype=float32), Array(2., dtype=float32))
        >>> big = jsa.as_scaled_array(jnp.array([1e6, -3.0]), dtype=jnp.float16)  # > 65504
        >>> big.scale, big.to_array(jnp.float32)
        (Array(524288., dtype=float32), Array([ 9.99936e+05, -3.00000e+00], dtype=float32))
        >>> rows = jsa.as_scaled_array(jnp.array([[3.0, 1.0], [0.25, 0.5]]), scale_shape=(2, 1))
        >>> rows.scale.tolist(), rows.data.tolist()
        ([[2.0], [0.5]], [[1.5, 0.5], [0.5, 1.0]])
    """
    if scale is not None and scale_shape is not None:
        raise ValueError("as_scaled_array takes `scale` or `scale_shape`, not both.")
    return jax.tree_util.tree_map(
        lambda x: _as_scaled_leaf(x, scale, dtype, scale_shape),
        unpack_scales(tree),
        is_leaf=is_scaled_leaf,
    )


def asarray(tree: Any, dtype: DTypeLike | None = None) -> Any:
    """Convert every ScaledArray of a pytree to the plain array it represents.

    Floating arrays are cast when `dtype` is given; every other leaf (integer arrays,
    Python scalars, `None`, non-array objects of an Equinox module) passes through. Inside a
    function that `autoscale` transforms, a value computed from ScaledArrays becomes plain
    there too.

    Examples:
        >>> import jax_scaled_arithmetics as jsa
        >>> jsa.asarray(jsa.scaled_array([1.0, 3.0], 2.0))
        Array([2., 6.], dtype=float32)
    """

    def convert(x: Any) -> Any:
        if isinstance(x, ScaledArray):
            return x.to_array(dtype)
        if not is_array(x):
            return x
        if _IN_TRACE and is_floating(x) and _tracing_scaled_function():
            return _IN_TRACE["plain"](x, dtype)
        arr = jnp.asarray(x)
        if dtype is not None and is_floating(arr):
            arr = arr.astype(dtype)
        return arr

    return jax.tree_util.tree_map(convert, unpack_scales(tree), is_leaf=is_scaled_leaf)
