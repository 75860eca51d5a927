"""Table-driven tests of the shape rules, and the table machinery shared by the lax rule tests.

Each table entry is a function using the primitives through `jax.lax` / `jax.numpy`
and an input generator. Every entry runs through `jsa.autoscale` over the full
dtype x scale grid (and a zero scale), a subset under `jit`, and gradient checks
for the differentiable ones. A test per module checks that every primitive the
module registers a rule for is exercised by its table.
"""

from __future__ import annotations

import dataclasses
import importlib
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.core import _compat, registry
from jax_scaled_arithmetics.lax import shape as shape_module
from tests.helpers import (
    FLOAT_DTYPES,
    RTOL,
    WIDE_SCALES,
    assert_close,
    check_autoscale_matches,
    check_grad_matches,
    make_scaled,
    represented,
)

# --- table machinery ---------------------------------------------------------------------

# Gradients wrt the data are `grad * scale`: in float16 they only fit near scale 1.
GRAD_CASES = (
    (np.dtype(np.float32), 2.0**-40),
    (np.dtype(np.float16), 2.0**-3),
    (np.dtype(ml_dtypes.bfloat16), 2.0**20),
)
JIT_CASES = ((np.dtype(np.float16), 2.0**-20), (np.dtype(ml_dtypes.bfloat16), 2.0**30))


@dataclasses.dataclass(frozen=True)
class Case:
    """A table entry.

    Attributes:
        name: the test id.
        fn: the function under test (plain JAX code).
        inputs: `inputs(rng)` returns the input arrays (float ones are scaled).
        plain: positions of inputs passed unscaled (indices, sizes).
        grad: check `grad(autoscale(fn))` against the float32 gradient.
        rtol: multiplier of the dtype's relative tolerance.
        tie_indices: integer outputs are compared at a zero scale too, where every value
            ties (False where JAX breaks ties between signed zeros differently per dtype).
        degree: for a function homogeneous of this degree in its scaled inputs
            (`f(s x) = s**d f(x)`: 2 for products), the reference is `f` on the data
            times `s**d` (in float64): a float32 reference on the values would lose
            precision to denormals at `s**2 = 2**-120`.
    """

    name: str
    fn: Callable[..., Any]
    inputs: Callable[[np.random.Generator], Sequence[Any]]
    plain: tuple[int, ...] = ()
    grad: bool = False
    rtol: float = 1.0
    tie_indices: bool = True
    degree: int = 0


def case_inputs(case: Case) -> list[np.ndarray]:
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    return [np.asarray(x) for x in case.inputs(rng)]


def normal(*shapes: tuple[int, ...] | int) -> Callable[[np.random.Generator], list[np.ndarray]]:
    """Generator of standard normal inputs: `normal(3, 4)` one (3, 4) array, `normal((2,), (3,))`
    two arrays."""
    if all(isinstance(s, int) for s in shapes):
        shapes = (shapes,)
    return lambda rng: [rng.normal(size=s).astype(np.float32) for s in shapes]


def inline_jits(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with the `jit`s of its jaxpr inlined (one trace per input signature).

    jax.numpy functions are `jit`s; the scaled `jit` rule re-traces their body on
    every call, so without jit each call would compile them anew. The inlined
    function binds the same primitives, which the grid runs then reuse.
    """
    cache: dict[Any, Any] = {}

    def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        read = lambda a: a.val if isinstance(a, _compat.Literal) else env[a]  # noqa: E731
        for eqn in jaxpr.eqns:
            invals = [read(a) for a in eqn.invars]
            if eqn.primitive is _compat.jit_p:
                inner = eqn.params["jaxpr"]
                outs = evaluate(inner.jaxpr, inner.consts, invals)
            else:
                subfuns, params = _compat.get_bind_params(eqn)
                outs = eqn.primitive.bind(*subfuns, *invals, **params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(v) for v in jaxpr.outvars]

    def inlined(*args: Any) -> Any:
        avals = tuple(jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)) for a in args)
        if avals not in cache:
            cache[avals] = jax.make_jaxpr(fn, return_shape=True)(*avals)
        closed, out_shape = cache[avals]
        outs = evaluate(closed.jaxpr, closed.consts, args)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return inlined


def check_case(case: Case, dtype: Any, scale: float, use_jit: bool = False, fn: Any = None) -> None:
    inputs = case_inputs(case)
    mask = [i not in case.plain for i in range(len(inputs))]
    fn = case.fn if fn is None else fn
    if scale == 0 and not case.tie_indices:
        full_fn = fn

        def fn(*args: Any) -> list[Any]:
            outs = jax.tree_util.tree_leaves(full_fn(*args))
            return [o for o in outs if jnp.issubdtype(o.dtype, jnp.floating)]

    rtol = RTOL[np.dtype(dtype)] * case.rtol
    if case.degree and scale != 0:
        check_homogeneous(fn, inputs, mask, dtype, scale, case.degree, use_jit, rtol)
        return
    check_autoscale_matches(fn, inputs, dtype, scale, use_jit, rtol=rtol, scaled_mask=mask)


def check_homogeneous(
    fn: Callable[..., Any],
    inputs: Sequence[np.ndarray],
    mask: Sequence[bool],
    dtype: Any,
    scale: float,
    degree: int,
    use_jit: bool,
    rtol: float,
) -> None:
    """autoscale(fn) equals `fn(data) * scale**degree`, for a homogeneous `fn`."""
    args = [make_scaled(x, dtype, scale) if m else x for x, m in zip(inputs, mask, strict=True)]
    data = [jnp.asarray(a.data, jnp.float32) if m else a for a, m in zip(args, mask, strict=True)]
    expected = jax.tree_util.tree_leaves(fn(*data))
    scaled_fn = jax.jit(jsa.autoscale(fn)) if use_jit else jsa.autoscale(fn)
    outs = jax.tree_util.tree_leaves(scaled_fn(*args), is_leaf=jsa.is_scaled_leaf)
    assert len(outs) == len(expected)
    for out, exp in zip(outs, expected, strict=True):
        assert isinstance(out, jsa.ScaledArray) and out.dtype == np.dtype(dtype)
        assert_close(out, np.asarray(exp, np.float64) * scale**degree, rtol)


def check_case_grad(case: Case, dtype: Any, scale: float, fn: Any = None) -> None:
    inputs = case_inputs(case)
    plain = {i: inputs[i] for i in case.plain}
    floats = [x for i, x in enumerate(inputs) if i not in plain]
    case_fn = case.fn if fn is None else fn

    def fn(*values: Any) -> Any:
        it = iter(values)
        return case_fn(*[plain[i] if i in plain else next(it) for i in range(len(inputs))])

    check_grad_matches(fn, floats, dtype, scale, rtol=3 * RTOL[np.dtype(dtype)] * case.rtol)


def run_grid(case: Case, dtype: Any) -> None:
    """Every wide scale and a zero scale, without jit.

    The first float16 run is the plain one. The others run the function with its
    `jit`s inlined (see `inline_jits`) and without the session's tracer-leak
    check, which disables JAX's caches: the rules see the same primitives,
    20-100x faster.
    """
    scales = (*WIDE_SCALES, 0.0)
    if np.dtype(dtype) == np.dtype(np.float16):
        check_case(case, dtype, scales[0])
        scales = scales[1:]
    fn = inline_jits(case.fn)
    with jax.check_tracer_leaks(False):
        for scale in scales:
            check_case(case, dtype, scale, fn=fn)


def vjp_of(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`(x..., ct) -> vjp(fn)(ct)`: the primitives of the backward pass, under autoscale."""

    def backward(*args: Any) -> Any:
        *xs, ct = args
        _, pullback = jax.vjp(fn, *xs)
        grads = pullback(ct)
        return grads if len(grads) > 1 else grads[0]

    return backward


def primitives_in(jaxpr: Any) -> set[str]:
    """Names of the primitives of a jaxpr and of its sub-jaxprs."""
    names: set[str] = set()
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for value in eqn.params.values():
            values = value if isinstance(value, (tuple, list)) else (value,)
            for v in values:
                if isinstance(v, (_compat.Jaxpr, _compat.ClosedJaxpr)):
                    names |= primitives_in(v)
    return names


def exercised_primitives(cases: Iterable[Case]) -> set[str]:
    names: set[str] = set()
    for case in cases:
        inputs = case_inputs(case)
        for dtype in (np.float32, np.float16):
            args = [
                x if i in case.plain or not np.issubdtype(x.dtype, np.floating) else x.astype(dtype)
                for i, x in enumerate(inputs)
            ]
            names |= primitives_in(jax.make_jaxpr(case.fn)(*args))
    return names


def registered_by(module: Any) -> set[str]:
    """The primitives `module` registers rules for (its import re-run against a recorder)."""
    recorded: set[str] = set()

    def recorder(primitive: Any, rule: Any = None, **kwargs: Any) -> Any:
        if isinstance(primitive, str):  # a primitive only some releases have, by name
            primitive = registry.installed_primitive(primitive)
        if primitive is not None:
            recorded.add(primitive.name)
        return rule if rule is not None else (lambda fn: fn)

    with (
        mock.patch.object(registry, "register_scaled_op", recorder),
        mock.patch.object(registry, "has_scaled_rule", lambda primitive: False),
    ):
        importlib.reload(module)
    return recorded


def assert_table_covers(module: Any, cases: Iterable[Case]) -> None:
    registered = registered_by(module)
    assert registered, f"{module.__name__} registers no rule?"
    missing = registered - exercised_primitives(cases)
    assert not missing, f"Rules of {module.__name__} without a table entry: {sorted(missing)}"


def case_params(cases: Sequence[Case]) -> list[Any]:
    return [pytest.param(c, id=c.name) for c in cases]


def grad_params(cases: Sequence[Case]) -> list[Any]:
    return [pytest.param(c, id=c.name) for c in cases if c.grad]


def run_grads(case: Case) -> None:
    """Gradient checks at GRAD_CASES; the first one plain, the others as in `run_grid`."""
    (dtype, scale), *others = GRAD_CASES
    check_case_grad(case, dtype, scale)
    fn = inline_jits(case.fn)
    with jax.check_tracer_leaks(False):
        for dtype, scale in others:
            check_case_grad(case, dtype, scale, fn=fn)


def check_mixed_scales(
    fn: Callable[..., Any], inputs: Sequence[np.ndarray], dtype: Any, scales: Sequence[float]
) -> Any:
    """autoscale(fn) on inputs with different scales equals fn on their values."""
    args = [make_scaled(x, dtype, s) for x, s in zip(inputs, scales, strict=True)]
    expected = fn(*[jnp.asarray(represented(a), jnp.float32) for a in args])
    out = jsa.autoscale(fn)(*args)
    assert isinstance(out, jsa.ScaledArray)
    assert_close(out, np.asarray(expected), RTOL[np.dtype(dtype)])
    return out


# --- the shape table -----------------------------------------------------------------------


def _pad_scalar(rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.normal(size=(3, 4)).astype(np.float32), np.float32(rng.normal())]


CASES = [
    Case(
        "broadcast_in_dim",
        lambda x: jnp.broadcast_to(x[:, None, :], (3, 2, 4)),
        normal(3, 4),
    ),
    Case("reshape", lambda x: x.reshape(2, 6), normal(3, 4)),
    Case("squeeze", lambda x: lax.squeeze(x, (1,)), normal(3, 1, 4)),
    Case("transpose", lambda x: jnp.transpose(x, (2, 0, 1)), normal(2, 3, 4)),
    Case("rev", lambda x: x[::-1], normal(3, 4)),
    Case("slice_strided", lambda x: x[1:, ::2], normal(3, 5)),
    Case("copy", lambda x: jnp.array(x, copy=True), normal(3, 4)),
    Case("split", lambda x: jnp.split(x, [1, 3], axis=1), normal(3, 4)),
    Case("unstack", lambda x: jnp.unstack(x, axis=1), normal(3, 4)),
    Case("tile", lambda x: jnp.tile(x, (2, 1)), normal(3, 4)),
    Case(
        "concatenate",
        lambda x, y: jnp.concatenate([x, y], axis=0),
        lambda rng: [rng.normal(size=(2, 4)), rng.normal(size=(3, 4))],
        grad=True,
    ),
    Case(
        "concatenate_full",
        lambda x: jnp.concatenate([x, jnp.full((1, 4), 3.0, x.dtype)]),
        normal(2, 4),
    ),
    Case(
        "concatenate_iota",
        lambda x: jnp.concatenate([x, jnp.arange(4, dtype=x.dtype)[None]]),
        normal(2, 4),
    ),
    Case(
        "stack",
        lambda x, y: jnp.stack([x, y], axis=1),
        lambda rng: [rng.normal(size=(2, 4)), rng.normal(size=(2, 4))],
    ),
    Case(
        "pad_zero_interior_negative",
        lambda x: lax.pad(x, jnp.zeros((), x.dtype), ((1, 2, 1), (-1, 1, 0))),
        normal(3, 4),
        grad=True,
    ),
    Case(
        "jnp_pad_constant",
        lambda x: jnp.pad(x, ((1, 0), (2, 1)), constant_values=3.0),
        normal(3, 4),
    ),
    Case("pad_scaled_value", lambda x, v: lax.pad(x, v, ((1, 1, 0), (0, 2, 1))), _pad_scalar),
    Case(
        "convert_element_type_float", lambda x: x.astype(jnp.float32).astype(x.dtype), normal(3, 4)
    ),
    Case("convert_element_type_int", lambda x: (x * 4).astype(jnp.int32), normal(3, 4)),
    Case("stop_gradient", lambda x: lax.stop_gradient(x), normal(3, 4)),
    Case("bitcast_same_dtype", lambda x: lax.bitcast_convert_type(x, x.dtype), normal(3, 4)),
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", case_params(CASES))
def test_shape_table(case, dtype):
    run_grid(case, dtype)


@pytest.mark.parametrize("dtype,scale", JIT_CASES, ids=str)
@pytest.mark.parametrize("case", case_params(CASES[::3]))
def test_shape_table_jit(case, dtype, scale):
    check_case(case, dtype, scale, use_jit=True)


@pytest.mark.parametrize("case", grad_params(CASES))
def test_shape_table_grad(case):
    run_grads(case)


def test_shape_table_covers_every_rule():
    assert_table_covers(shape_module, CASES)


# --- mixed scales, bitcast -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_concatenate_different_scales(dtype):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(2, 3)), rng.normal(size=(4, 3))
    out = check_mixed_scales(
        lambda a, b: jnp.concatenate([a, b]), [x, y], dtype, [2.0**-10, 2.0**12]
    )
    assert float(out.scale) == 2.0**12  # the larger scale: no overflow


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_pad_and_stack_different_scales(dtype):
    rng = np.random.default_rng(1)
    x, v = rng.normal(size=(3, 2)), np.float32(1.5)
    check_mixed_scales(
        lambda a, p: lax.pad(a, p, ((1, 1, 1), (0, 0, 0))), [x, v], dtype, [2.0**40, 2.0**38]
    )
    check_mixed_scales(lambda a, b: jnp.stack([a, b]), [x, x[::-1]], dtype, [2.0**-30, 2.0**-28])


def test_pad_with_zero_keeps_the_scale():
    x = make_scaled(np.ones((2, 2)), np.float16, 2.0**-40)
    out = jsa.autoscale(lambda a: jnp.pad(a, 1))(x)
    assert float(out.scale) == 2.0**-40
    np.testing.assert_array_equal(represented(out)[1:3, 1:3], np.full((2, 2), 2.0**-40))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_bitcast_to_another_dtype_bitcasts_the_value(dtype):
    x = make_scaled(np.array([1.0, -2.5, 0.0]), dtype, 2.0**-3)
    int_dtype = {2: jnp.int16, 4: jnp.int32}[np.dtype(dtype).itemsize]
    out = jsa.autoscale(lambda a: lax.bitcast_convert_type(a, int_dtype))(x)
    assert not isinstance(out, jsa.ScaledArray)
    expected = lax.bitcast_convert_type(x.to_array(), int_dtype)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
