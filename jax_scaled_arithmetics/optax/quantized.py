"""Per-quantity quantization of training: gradients, optimizer state, updates and weights.

:func:`quantize` wraps any optax transformation and rounds, each step, the gradients it
receives, every floating leaf of its state and the updates it returns, each to its own
format. :func:`apply_updates` rounds the new weights, `p + u` computed in float32, to the
parameters' dtype or to a simulated format, to nearest or stochastically.

A *spec* says how one quantity is rounded:

- a format: a preset name (`"bfloat16"`, `"float8_e5m2"`), a dtype (`jnp.bfloat16`) or a
  :class:`~jax_scaled_arithmetics.quantization.FloatFormat` (`FloatFormat.custom(6, 9)`):
  :func:`~jax_scaled_arithmetics.quantization.float_quantize`, round to nearest;
- a `(format, rounding)` pair, rounding `"nearest"`, `"stochastic"` or `"toward_zero"`;
- any callable `(x, key) -> x` (`key` a PRNG key, `x` the stored data), e.g.
  `lambda x, key: fixed_point_quantize(x, 16, 12)` or a block (MX) round trip. Its
  output is cast back to the dtype of `x` and must keep its shape.

The dtype of every leaf is kept (formats are simulated in it). On a ScaledArray the format
applies to the data, whose range its scale was chosen for; the scale is left as it is
(the rescaling hooks of :func:`~jax_scaled_arithmetics.optax.scaled_state` and
:func:`apply_updates` move it). Integer leaves (Adam's `count`) are never quantized.

Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jax_scaled_arithmetics as jsa
    >>> opt = jsa.optax.quantize(optax.adam(1e-2), state=("bfloat16", "stochastic"), key=0)
    >>> state = opt.init({"w": jnp.zeros(3)})
    >>> updates, state = opt.update({"w": jnp.array([0.1, 0.2, 0.3])}, state)
    >>> mu = state.inner_state[0].mu["w"]
    >>> mu.dtype, bool(jnp.all(jsa.quantization.float_quantize(mu, "bfloat16") == mu))
    (dtype('float32'), True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..core.datatype import is_floating, is_scaled_leaf
from ..core.interpreter import autoscale
from ..lax.scaling_primitives import apply_to_data, stop_scaling
from ..ops.dynamic_rescaling import DEFAULT_EPSILON, dynamic_rescale_max, match_layout, rescale_tree
from ..quantization import float_quantize, get_format
from ..quantization._bits import ROUNDING_MODES, check_rounding
from .scaled import rescale_norm, unstored_update

__all__ = ["QuantizeState", "QuantizeSpec", "apply_updates", "quantize", "FormatSpec"]

QuantizeSpec = Any
"""A format (name, dtype or FloatFormat), a `(format, rounding)` pair, or a callable
`(x, key) -> x`; `None` leaves the quantity as it is.

Examples:
    >>> import optax
    >>> import jax_scaled_arithmetics as jsa
    >>> opt = jsa.optax.quantize(
    ...     optax.adam(1e-3),
    ...     grad="float8_e5m2",  # a format name
    ...     state={"mu": ("bfloat16", "stochastic"), "nu": None},  # with rounding; as is
    ...     update=lambda x, key: x,  # a callable
    ... )
"""
Rescale = Callable[[Any], Any]


# --- specs -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """Round to a float format (`float_quantize`); takes raw key data when stochastic."""

    format: Any  # what `get_format` returns: a FloatFormat, or another format it knows
    rounding: str

    @property
    def needs_key(self) -> bool:
        return self.rounding == "stochastic"

    def __call__(self, x: jax.Array, *key_data: jax.Array) -> jax.Array:
        key = jax.random.wrap_key_data(key_data[0]) if key_data else None
        return float_quantize(x, self.format, self.rounding, key=key)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class _CallableSpec:
    """A user quantizer `(x, key) -> x`; its output is cast back to the dtype of `x`."""

    fn: Callable[[jax.Array, jax.Array], Any]
    needs_key = True

    def __call__(self, x: jax.Array, key_data: jax.Array) -> jax.Array:
        out = jnp.asarray(self.fn(x, jax.random.wrap_key_data(key_data)))
        if out.shape != x.shape:
            raise ValueError(
                f"quantize: the quantizer {self.fn!r} returned shape {out.shape} for a leaf of "
                f"shape {x.shape}; a quantizer must keep the shape"
            )
        return out.astype(x.dtype)


Spec = FormatSpec | _CallableSpec
SpecOf = Callable[[Any], Spec | None]
"""The spec of a leaf, from its path in the tree."""


def _is_format_like(spec: Any) -> bool:
    if isinstance(spec, str | np.dtype | type):
        return True
    return isinstance(getattr(spec, "dtype", None), np.dtype)  # jnp.bfloat16 and friends


def _as_spec(spec: Any, what: str) -> Spec | None:
    """Normalise one spec; `what` names the argument in error messages."""
    if spec is None:
        return None
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], str):
        if spec[1] not in ROUNDING_MODES:
            raise ValueError(
                f"quantize: unknown rounding {spec[1]!r} in {what}={spec!r}; "
                f"expected one of {ROUNDING_MODES}"
            )
        return FormatSpec(get_format(spec[0]), spec[1])
    if _is_format_like(spec):
        return FormatSpec(get_format(spec), "nearest")
    if callable(spec):
        return _CallableSpec(spec)
    message = (
        f"quantize: {what} must be a format (name, dtype or FloatFormat), a (format, rounding) "
        f"pair or a callable (x, key) -> x; got {spec!r} of type {type(spec).__name__}"
    )
    if isinstance(spec, Mapping):
        raise TypeError(message + " (a dict of specs is for `state` only)")
    try:  # FloatFormat and any other format object `get_format` knows
        return FormatSpec(get_format(spec), "nearest")
    except TypeError:
        raise TypeError(message) from None


def _lowbias32(x: jax.Array) -> jax.Array:
    """An integer hash of uint32 values with good avalanche (C. Wellons' "lowbias32")."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


@dataclasses.dataclass(frozen=True)
class _StochasticBfloat16:
    """Stochastic rounding of float32 data to the values of bfloat16, kept in float32.

    bfloat16 is the top half of a float32: adding 16 uniform random bits to the low half
    and clearing it rounds up with probability (low half) / 2**16, the exact stochastic
    rounding (carries propagate into the exponent; past the largest bfloat16, to inf;
    NaN is kept). The bits come from a counter-based hash of each element's index and
    the key (`_lowbias32`), computed in the same fused loop as the update: drawing them
    with `jax.random.bits` (threefry) costs several times the whole update on CPU.
    """

    def __call__(self, x: jax.Array, key_data: jax.Array) -> jax.Array:
        u32 = jnp.uint32
        bits = jax.lax.bitcast_convert_type(x, u32)
        index = jax.lax.iota(u32, x.size).reshape(x.shape)
        seed = key_data.astype(u32)
        noise = _lowbias32((index ^ seed[-1]) * np.uint32(0x9E3779B9) + seed[0]) >> np.uint32(16)
        rounded = jax.lax.bitcast_convert_type((bits + noise) & np.uint32(0xFFFF0000), x.dtype)
        return jnp.where(jnp.isnan(x), x, rounded)


# --- keys --------------------------------------------------------------------------------


def as_key_data(key: Any) -> jax.Array:
    """Raw uint32 data of a PRNG key given as an integer seed (maybe traced) or a key."""
    if isinstance(key, bool):
        raise TypeError(f"key must be an integer seed or a PRNG key, got {key!r}")
    if isinstance(key, int | np.integer):
        return jax.random.key_data(jax.random.key(key))
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    if dtype is not None and jnp.issubdtype(dtype, jnp.integer):
        if np.ndim(key) == 0:  # a seed, traced under vmap or jit
            return jax.random.key_data(jax.random.key(key))
        if dtype == np.uint32 and np.ndim(key) == 1:  # raw key data, e.g. jax.random.PRNGKey(0)
            return jnp.asarray(key)
    raise TypeError(f"key must be an integer seed or a PRNG key, got {key!r}")


def _split(key: jax.Array, num: int) -> jax.Array:
    return jax.random.split(key, max(num, 1))


# --- trees -------------------------------------------------------------------------------


def _is_float_leaf(x: Any) -> bool:
    return hasattr(x, "dtype") and is_floating(x)


def _quantize_tree(tree: Any, spec_of: SpecOf, key: jax.Array) -> Any:
    """Quantize every floating leaf of `tree` with `spec_of(path)`, one key per leaf."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_scaled_leaf)
    keys = _split(key, len(leaves))
    out = []
    for i, (path, leaf) in enumerate(leaves):
        spec = spec_of(path)
        if spec is None or not _is_float_leaf(leaf):
            out.append(leaf)
            continue
        extra = (jax.random.key_data(keys[i]),) if spec.needs_key else ()
        out.append(apply_to_data(spec, leaf, *extra))
    return jax.tree_util.tree_unflatten(treedef, out)


def _field_names(tree: Any) -> set[str]:
    """Names of the attribute fields (NamedTuple, dataclass) in `tree`, empty ones included."""
    names: set[str] = set()
    for path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_scaled_leaf)[0]:
        names.update(k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey))

    def walk(x: Any) -> None:  # fields without leaves (Adam's `mu` of empty params)
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            names.update(x._fields)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type) and not is_scaled_leaf(x):
            names.update(f.name for f in dataclasses.fields(x))
            x = [getattr(x, f.name) for f in dataclasses.fields(x)]
        if isinstance(x, list | tuple):
            for child in x:
                walk(child)
        elif isinstance(x, Mapping):
            for child in x.values():
                walk(child)

    walk(tree)
    return names


def _check_fields(specs: Mapping[str, Spec | None], inner_state: Any) -> None:
    fields = _field_names(inner_state)
    unknown = sorted(set(specs) - fields)
    if unknown:
        raise ValueError(
            f"quantize: state names {unknown}, which the inner state does not have; "
            f"its fields are {sorted(fields)}"
        )


def _same_for_all(spec: Spec | None) -> SpecOf | None:
    return None if spec is None else (lambda path: spec)


def _state_spec_of(specs: Mapping[str, Spec | None]) -> SpecOf:
    def spec_of(path: Any) -> Spec | None:
        for k in reversed(path):  # the innermost named field decides
            if isinstance(k, jax.tree_util.GetAttrKey) and k.name in specs:
                return specs[k.name]
        return None

    return spec_of


# --- quantize ----------------------------------------------------------------------------


class QuantizeState(NamedTuple):
    """State of :func:`quantize`: the inner state, and the raw PRNG key of the next step.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> import jax_scaled_arithmetics as jsa
        >>> opt = jsa.optax.quantize(optax.sgd(0.1), grad="float8_e5m2")
        >>> state = opt.init({"w": jnp.zeros(2)})
        >>> type(state).__name__, state.key.shape
        ('QuantizeState', (2,))
    """

    inner_state: Any
    key: jax.Array


def quantize(
    opt: optax.GradientTransformation,
    *,
    grad: QuantizeSpec = None,
    state: QuantizeSpec | Mapping[str, QuantizeSpec] = None,
    update: QuantizeSpec = None,
    key: Any = 0,
) -> optax.GradientTransformationExtraArgs:
    """Wrap an optax transformation so that its gradients, state and updates are quantized.

    Each step, `grad` rounds the incoming gradients, the inner transformation updates,
    `state` rounds every floating leaf of the new inner state (one spec for all, or a dict
    from field name to spec: `{"mu": ..., "nu": ...}` for Adam, `{"trace": ...}` for SGD
    momentum; a leaf takes the spec of the innermost field on its path that the dict
    names, others are left as they are), and `update` rounds the outgoing updates. Specs
    are described in the module docstring; `None` leaves a quantity as it is. Floating
    hyperparameters (`optax.inject_hyperparams`) are state leaves too: name the fields to
    leave them out.

    Stochastic rounding draws from a PRNG key kept in the state: `key` seeds it (an
    integer, traced or not, so `jax.vmap` over seeds works, or a PRNG key). Each update
    splits it into the next step's key and one key per quantity, split again per leaf:
    the same seed gives the same run, and no two steps or leaves share a key.

    Args:
        opt: any optax transformation (plain or scaled state, chains, ...).
        grad: spec of the gradients, before the inner update.
        state: spec, or dict from state field name to spec, of the new inner state.
        update: spec of the updates the inner transformation returns.
        key: seed or PRNG key of the stochastic rounding.

    Returns:
        A transformation whose state is :class:`QuantizeState` `(inner_state, key)`.

    Raises:
        TypeError: a spec is neither a format, a `(format, rounding)` pair nor a callable,
            or `key` is neither a seed nor a key.
        ValueError: a `state` dict names a field the inner state does not have (raised by
            `init` and `update`; the message lists the fields it has), or an unknown
            format or rounding.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> import jax_scaled_arithmetics as jsa
        >>> opt = jsa.optax.quantize(
        ...     optax.sgd(0.1, momentum=0.9),
        ...     grad="float8_e5m2",
        ...     state={"trace": ("bfloat16", "stochastic")},
        ... )
        >>> state = opt.init({"w": jnp.zeros(2)})
        >>> updates, state = opt.update({"w": jnp.array([0.3, -1.1])}, state)
        >>> state.inner_state[0].trace["w"]  # 0.3 and -1.1 rounded to float8_e5m2
        Array([ 0.3125, -1.    ], dtype=float32)
        >>> jsa.optax.quantize(optax.adam(1e-3), state={"momentum": "bfloat16"}).init({})
        Traceback (most recent call last):
        ...
        ValueError: quantize: state names ['momentum'], which the inner state does not have; \
its fields are ['count', 'mu', 'nu']
    """
    inner = optax.with_extra_args_support(opt)
    grad_spec_of = _same_for_all(_as_spec(grad, "grad"))
    update_spec_of = _same_for_all(_as_spec(update, "update"))
    state_specs: Mapping[str, Spec | None] | None = None
    state_spec_of: SpecOf | None
    if isinstance(state, Mapping):
        for name in state:
            if not isinstance(name, str):
                raise TypeError(f"quantize: state dict keys are field names, got {name!r}")
        state_specs = {name: _as_spec(s, f"state[{name!r}]") for name, s in state.items()}
        state_spec_of = _state_spec_of(state_specs)
    else:
        state_spec_of = _same_for_all(_as_spec(state, "state"))
    if not isinstance(key, int | np.integer) or isinstance(key, bool):
        as_key_data(key)  # validate eagerly when it is not a plain seed

    def init_fn(params: Any) -> QuantizeState:
        inner_state = inner.init(params)
        if state_specs is not None:
            _check_fields(state_specs, inner_state)
        return QuantizeState(inner_state, as_key_data(key))

    def update_fn(
        updates: Any, state: QuantizeState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, QuantizeState]:
        if state_specs is not None:
            _check_fields(state_specs, state.inner_state)
        next_key, grad_key, state_key, update_key = jax.random.split(
            jax.random.wrap_key_data(state.key), 4
        )
        if grad_spec_of is not None:
            updates = _quantize_tree(updates, grad_spec_of, grad_key)
        updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        if state_spec_of is not None:
            inner_state = _quantize_tree(inner_state, state_spec_of, state_key)
        if update_spec_of is not None:
            updates = _quantize_tree(updates, update_spec_of, update_key)
        return updates, QuantizeState(inner_state, jax.random.key_data(next_key))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --- weights -----------------------------------------------------------------------------


class _Rescaled(NamedTuple):
    """Where `apply_updates` puts a new parameter it rescales with the others: its position
    among them (a pytree node it replaces)."""

    position: int


def apply_updates(
    params: Any,
    updates: Any,
    rescale: Rescale | None = dynamic_rescale_max,
    *,
    rounding: str = "nearest",
    key: Any = None,
    format: Any = None,
) -> Any:
    """Like `optax.apply_updates`, with a choice of rounding, then rescale the new parameters.

    With the defaults (`rounding="nearest"`, no `format`), each floating parameter
    becomes `(p + u).astype(p.dtype)` (the dtype of a ScaledArray is its data's), as
    optax does. Otherwise `p + u` is computed in float32 and rounded to the parameter's
    dtype, or to the simulated `format` (then stored in the parameter's dtype, which
    must hold it), with `rounding`: `"stochastic"` rounds up with probability the
    fraction of the gap to the next value, so updates far below the parameter's
    precision still move it on average, and needs `key` (split per leaf). To bfloat16,
    the random bits come from a hash of the key and each element's index, computed in
    the update's own loop (threefry's bits would cost several times the update on CPU);
    to other formats, from `jax.random` through
    :func:`~jax_scaled_arithmetics.quantization.float_quantize`.

    Then `rescale` moves a power of two into the scale of every scaled parameter. `None`
    updates leave their parameter as it is, and so do integer parameters. Wraps itself in
    :func:`~jax_scaled_arithmetics.autoscale`.

    An update that :func:`~jax_scaled_arithmetics.optax.scale_optimizer` made in the same
    autoscaled step (and nothing changed since) is added as its float32 value, before its
    store: the new parameter is computed in float32, rescaled (with the library's
    rescalings), then cast, and the update's own store is left out of the program when
    nothing else reads it.

    Args:
        params: the parameters (arrays or ScaledArrays).
        updates: the updates, a tree like `params` (`None` for parameters left alone).
        rescale: dynamic rescaling of the new parameters; `None` keeps their scales.
        rounding: `"nearest"`, `"stochastic"` or `"toward_zero"`.
        key: PRNG key (or integer seed) of the stochastic rounding.
        format: a float format to round to instead of the parameters' dtype.

    Raises:
        ValueError: an unknown rounding, stochastic rounding without a key, or an
            unknown format.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> p = jsa.scaled_array(jnp.array([1.0, 2.0], jnp.float16), 1.0)
        >>> u = jsa.scaled_array(jnp.array([1.0, 1.0], jnp.float16), 2.0**-4)
        >>> new = jsa.optax.apply_updates(p, u)
        >>> new.dtype, new.scale, new.to_array().tolist()
        (dtype('float16'), Array(2., dtype=float32), [1.0625, 2.0625])
        >>> w = jnp.ones(4096, jnp.bfloat16)  # 1e-3 is below half a bfloat16 ulp at 1
        >>> jsa.optax.apply_updates(w, jnp.full(4096, 1e-3))[0]
        Array(1, dtype=bfloat16)
        >>> new = jsa.optax.apply_updates(w, jnp.full(4096, 1e-3), rounding="stochastic", key=0)
        >>> round(float(jnp.mean(new.astype(jnp.float32))), 3)  # unbiased: 1.001 on average
        1.001
        >>> sorted(set(new.tolist()))  # each rounded down to 1 or up to 1 + 2**-7
        [1.0, 1.0078125]
    """
    mode = check_rounding(rounding, key)
    fmt = None if format is None else get_format(format)
    if mode == "nearest" and fmt is None:  # optax's rounding
        norm = rescale_norm(rescale)

        def _apply(params: Any, updates: Any) -> Any:
            # The library's rescalings work leaf by leaf: every new parameter is rescaled in
            # one equation (`rescale_tree`: their per-tensor factors computed together).
            # An update `scale_optimizer` made in the same step is added as its float32
            # value before the store, and the sum rounded once, after its rescale.
            news: list[Any] = []
            dtypes: list[Any] = []  # the dtype a new parameter is rounded to after it

            def add(p: Any, u: Any) -> Any:
                if p is None or not is_floating(p):
                    return p
                value = unstored_update(u) if norm is not None and u is not None else None
                if value is not None:
                    new, dtype = (
                        match_layout(stop_scaling(p, dtype=value.dtype) + value, p),
                        p.dtype,
                    )
                else:
                    new, dtype = (p if u is None else (p + u).astype(p.dtype)), None
                if norm is None:
                    return new
                news.append(new)
                dtypes.append(dtype)
                return _Rescaled(len(news) - 1)

            new = jax.tree_util.tree_map(add, params, updates, is_leaf=lambda x: x is None)
            if rescale is None:
                return new
            if norm is None:  # a rescaling of the user's: on the whole tree
                return rescale(new)
            rescaled = rescale_tree(news, norm, DEFAULT_EPSILON, None) if news else []

            def finish(x: _Rescaled) -> Any:
                dtype = dtypes[x.position]
                return rescaled[x.position] if dtype is None else rescaled[x.position].astype(dtype)

            return jax.tree_util.tree_map(
                lambda x: finish(x) if isinstance(x, _Rescaled) else x,
                new,
                is_leaf=lambda x: isinstance(x, _Rescaled),
            )

        return autoscale(_apply)(params, updates)

    leaves, treedef = jax.tree_util.tree_flatten(params, is_leaf=is_scaled_leaf)
    update_leaves = treedef.flatten_up_to(updates)  # type: ignore[attr-defined]
    keys = None
    if mode == "stochastic":
        keys = jax.random.key_data(_split(jax.random.wrap_key_data(as_key_data(key)), len(leaves)))

    def _round(leaves: list[Any], update_leaves: list[Any], keys: jax.Array | None) -> Any:
        out = []
        for i, (p, u) in enumerate(zip(leaves, update_leaves)):
            if u is None or p is None or not is_floating(p):
                out.append(p)
                continue
            target = fmt if fmt is not None else get_format(p.dtype)
            new = p.astype(jnp.float32) + u.astype(jnp.float32)
            if keys is not None and target == get_format(jnp.bfloat16):
                new = apply_to_data(_StochasticBfloat16(), new, keys[i])
            elif target != get_format(jnp.float32):  # a float32 sum is already rounded
                extra = (keys[i],) if keys is not None else ()
                new = apply_to_data(FormatSpec(target, mode), new, *extra)
            out.append(new.astype(p.dtype))
        new_params = jax.tree_util.tree_unflatten(treedef, out)
        return new_params if rescale is None else rescale(new_params)

    return autoscale(_round)(leaves, update_leaves, keys)
