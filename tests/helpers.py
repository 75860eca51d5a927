"""Shared test helpers: compare a function under `autoscale` with the plain function."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str, relative_path: str) -> Any:
    """Import a script of the repository (experiments, scripts) by its path, as module `name`.

    Registered in `sys.modules`, where dataclasses look their module up."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
WIDE_SCALES = tuple(2.0**e for e in (-60, -30, -20, -4, 0, 4, 20, 30, 60))

# Relative tolerance per data dtype (a few ulps of the data format).
RTOL = {
    np.dtype(np.float32): 1e-5,
    np.dtype(np.float16): 4e-3,
    np.dtype(ml_dtypes.bfloat16): 3e-2,
}


def scales_for(dtype: Any) -> tuple[float, ...]:
    """Every wide scale: the value is held in float32 scales, so all are representable."""
    del dtype
    return WIDE_SCALES


def dynamic_scales(jaxpr: Any) -> int:
    """How many dynamic scales (measurements) a jaxpr computes, sub-jaxprs included."""
    from jax_scaled_arithmetics.core.scale_arithmetic import dynamic_scale_p

    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive is dynamic_scale_p
        for value in eqn.params.values():
            sub = getattr(value, "jaxpr", value)
            if hasattr(sub, "eqns"):
                count += dynamic_scales(sub)
    return count


def make_scaled(x: np.ndarray, dtype: Any, scale: float) -> jsa.ScaledArray:
    """A ScaledArray with data `x` (cast to `dtype`) and scale `scale`."""
    return jsa.scaled_array(np.asarray(x).astype(dtype), np.float32(scale))


def represented(x: Any) -> np.ndarray:
    """The represented value of a ScaledArray (or a plain array) in float64; a block scale
    is repeated over its block."""
    if isinstance(x, jsa.ScaledArray):
        data = np.asarray(x.data, np.float64)
        scale = np.asarray(x.scale, np.float64)
        scale = scale.reshape((1,) * (data.ndim - scale.ndim) + scale.shape)
        for axis, (size, blocks) in enumerate(zip(data.shape, scale.shape)):
            scale = np.repeat(scale, size // blocks, axis=axis)
        return data * scale
    return np.asarray(x, np.float64)


def assert_close(actual: Any, expected: Any, rtol: float, atol_rel: float | None = None) -> None:
    """Compare with a relative tolerance and an absolute one relative to max |expected|.

    A represented value beyond float32's range compares as float32 would hold it (inf, or
    0): scaled data can hold it, the plain float32 reference cannot.
    """
    actual = represented(actual)
    if np.asarray(expected).dtype != np.float64:
        with np.errstate(all="ignore"):
            beyond = np.abs(actual) > float(np.finfo(np.float32).max)
            tiny = np.abs(actual) < float(np.finfo(np.float32).smallest_subnormal)
            actual = np.where(beyond, np.copysign(np.inf, actual), actual)
            actual = np.where(tiny, np.copysign(0.0, actual), actual)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    np.testing.assert_array_equal(actual[np.isinf(expected)], expected[np.isinf(expected)])
    if not finite.any():
        return
    scale = np.max(np.abs(expected[finite]))
    atol = (rtol if atol_rel is None else atol_rel) * scale
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=rtol, atol=atol)


def check_autoscale_matches(
    fn: Callable[..., Any],
    inputs: Sequence[np.ndarray],
    dtype: Any,
    scale: float,
    use_jit: bool,
    rtol: float | None = None,
    scaled_mask: Sequence[bool] | None = None,
    expect_scaled_output: bool = True,
    scaled_fn: Callable[..., Any] | None = None,
) -> Any:
    """Run `fn` under autoscale on scaled inputs and compare with `fn` on their values.

    The reference is `fn` applied in float32 to the values the ScaledArrays
    represent (so it is exact wherever the value is representable in float32).
    `scaled_fn` replaces `jsa.autoscale(fn)` (jitted when `use_jit`): one built once
    (`autoscaled(fn, use_jit)`) shares its compiled program across calls, e.g. scales.
    """
    dtype = np.dtype(dtype)
    scaled_mask = [True] * len(inputs) if scaled_mask is None else scaled_mask
    args = [
        make_scaled(x, dtype, scale) if m else np.asarray(x) for x, m in zip(inputs, scaled_mask)
    ]
    ref_args = [
        jnp.asarray(represented(a), jnp.float32) if m else a for a, m in zip(args, scaled_mask)
    ]
    expected = jax.tree_util.tree_map(np.asarray, fn(*ref_args))
    if scaled_fn is None:
        scaled_fn = autoscaled(fn, use_jit)
    out = scaled_fn(*args)
    rtol = RTOL[dtype] if rtol is None else rtol
    out_leaves = jax.tree_util.tree_leaves(out, is_leaf=jsa.is_scaled_leaf)
    exp_leaves = jax.tree_util.tree_leaves(expected)
    for o, e in zip(out_leaves, exp_leaves):
        if np.issubdtype(np.asarray(e).dtype, np.floating):
            if expect_scaled_output:
                assert isinstance(o, jsa.ScaledArray), f"expected a ScaledArray, got {type(o)}"
                assert o.dtype == dtype, (o.dtype, dtype)
            assert_close(o, e, rtol)
        else:
            np.testing.assert_array_equal(np.asarray(o), e)
    return out


def autoscaled(fn: Callable[..., Any], use_jit: bool) -> Callable[..., Any]:
    """`jsa.autoscale(fn)`, under `jax.jit` when `use_jit`: built once and passed to
    `check_autoscale_matches(..., scaled_fn=...)` for several scales (the scale is an
    argument), it compiles once where a fresh one per call compiles per call."""
    scaled_fn = jsa.autoscale(fn)
    return jax.jit(scaled_fn) if use_jit else scaled_fn


def check_grad_matches(
    fn: Callable[..., Any],
    inputs: Sequence[np.ndarray],
    dtype: Any,
    scale: float,
    rtol: float | None = None,
    use_jit: bool = False,
) -> None:
    """`grad(autoscale(f))` on the data equals the float32 gradient times the scale.

    The loss is `sum(f(x) * weights)` with fixed random weights; gradients are
    taken with respect to the data of every (scaled) input.
    """
    dtype = np.dtype(dtype)
    args = [make_scaled(x, dtype, scale) for x in inputs]
    ref_args = [jnp.asarray(represented(a), jnp.float32) for a in args]
    out_shape = jax.eval_shape(fn, *ref_args)
    weights = np.random.default_rng(0).uniform(0.5, 1.5, out_shape.shape).astype(np.float32)

    def ref_loss(*xs: Any) -> Any:
        return jnp.sum(fn(*xs) * weights)

    def scaled_loss(*datas: Any) -> Any:
        xs = [jsa.ScaledArray(d, a.scale) for d, a in zip(datas, args)]
        out = jsa.autoscale(lambda *v: jnp.sum(fn(*v) * weights.astype(v[0].dtype)))(*xs)
        return out.to_array(jnp.float32)

    grad_fn = jax.grad(scaled_loss, argnums=tuple(range(len(args))))
    if use_jit:
        grad_fn = jax.jit(grad_fn)
    grads = grad_fn(*[a.data for a in args])
    expected = jax.grad(ref_loss, argnums=tuple(range(len(args))))(*ref_args)
    rtol = 3 * RTOL[dtype] if rtol is None else rtol
    for g, e in zip(grads, expected):
        # d loss / d data = d loss / d value * scale
        assert_close(np.asarray(g, np.float64), np.asarray(e, np.float64) * scale, rtol)


def eager_and_jit(
    cases: Sequence[Any],
    eager_in_default_run: Callable[..., bool],
    jit_in_default_run: Callable[..., bool] | None = None,
) -> list[Any]:
    """pytest params `(*case, jit)` for each case, jitted and eager.

    The eager variant runs the same rules as the jitted one, operation by operation (each
    a compile of its own): it stays in the default run for the cases
    `eager_in_default_run(*case)` chooses, and is marked `slow` for the others, which CI's
    slow step runs. Likewise the jitted variant, where `jit_in_default_run` is given (for
    example `pairwise_cover(cases)`). Nothing is left out; the default run compiles less.
    """
    params = []
    for case in cases:
        case = case if isinstance(case, tuple) else (case,)
        jit_marks = () if jit_in_default_run is None or jit_in_default_run(*case) else _SLOW
        params.append(pytest.param(*case, True, marks=jit_marks))
        marks = () if eager_in_default_run(*case) else _SLOW
        params.append(pytest.param(*case, False, marks=marks))
    return params


_SLOW = (pytest.mark.slow,)


def pairwise_cover(cases: Sequence[Any]) -> Callable[..., bool]:
    """A predicate choosing a subset of `cases` (tuples of parameter values) that holds
    every pair of values that two of the parameters take together in some case (so every
    value of each parameter too): the default run's share of a table whose full product
    CI's slow step runs.

    Chosen greedily (the case that covers the most pairs not yet covered first), so the
    choice is deterministic, as xdist's workers need.

    Examples:
        >>> cases = [(f, d, j) for f in "ab" for d in (16, 32) for j in (0, 1)]
        >>> chosen = pairwise_cover(cases)
        >>> sum(chosen(*c) for c in cases)
        4
    """
    tuples = [tuple(c) if isinstance(c, tuple) else (c,) for c in cases]

    def pairs(case: tuple) -> set:
        keys = [repr(v) for v in case]
        return {(i, keys[i], j, keys[j]) for i in range(len(keys)) for j in range(i + 1, len(keys))}

    case_pairs = [pairs(c) for c in tuples]
    uncovered = set().union(*case_pairs) if case_pairs else set()
    chosen: set[tuple] = set()
    while uncovered:
        best = max(range(len(tuples)), key=lambda k: len(case_pairs[k] & uncovered))
        chosen.add(tuple(repr(v) for v in tuples[best]))
        uncovered -= case_pairs[best]
    return lambda *case: tuple(repr(v) for v in case) in chosen


def pairwise_params(cases: Sequence[Any]) -> list[Any]:
    """pytest params for `cases`: a pairwise cover (`pairwise_cover`) in the default run,
    the other cases marked `slow`."""
    chosen = pairwise_cover(cases)
    return [
        pytest.param(*c, marks=() if chosen(*c) else _SLOW)
        for c in (c if isinstance(c, tuple) else (c,) for c in cases)
    ]


def lowered_divides(fun: Callable[..., Any], args: Sequence[Any], platform: str) -> int:
    """Divisions in `jax.jit(fun)` lowered for `platform` (no device of it needed)."""
    lowered = jax.jit(fun).trace(*args).lower(lowering_platforms=(platform,))
    return lowered.as_text().count("stablehlo.divide")


_AS_SCALED_ARRAY = jax.jit(jsa.as_scaled_array, static_argnames=("dtype", "scale_shape"))


def as_scaled_array_jit(x: Any, scale_shape: Any = None, dtype: Any = None) -> Any:
    """`jsa.as_scaled_array(x, scale_shape=scale_shape, dtype=dtype)` under one `jax.jit`: a
    compile per input shape, layout and dtype, where eagerly each of its operations compiles
    for every new layout (~28 compiles for the first, ~17 for each other). The same values
    (block maxima, powers of two, divisions by them: exact). For building test inputs; the
    eager function has tests of its own (tests/core/test_block_scales.py)."""
    return _AS_SCALED_ARRAY(x, scale_shape=scale_shape, dtype=dtype)


def in_turn(
    cases: Sequence[Any], ids: Sequence[str], variants: Sequence[tuple], variant_ids: Sequence[str]
) -> list[Any]:
    """pytest params `(case, *variant)` for each case with each variant, with ids
    `f"{id}-{variant_id}"`. The default run holds each case with one variant, the variants in
    turn over the cases; CI's slow step runs the others."""
    return [
        pytest.param(
            case,
            *variant,
            marks=() if (i + j) % len(variants) == 0 else _SLOW,
            id=f"{name}-{variant_id}",
        )
        for i, (case, name) in enumerate(zip(cases, ids, strict=True))
        for j, (variant, variant_id) in enumerate(zip(variants, variant_ids, strict=True))
    ]


def one_dtype_each(cases: Sequence[Any], ids: Sequence[str]) -> list[Any]:
    """pytest params `(case, dtype)` for each case with each of FLOAT_DTYPES (`in_turn`): the
    default run holds each case with one dtype, so each dtype with a third of the cases."""
    return in_turn(cases, ids, [(d,) for d in FLOAT_DTYPES], [str(d) for d in FLOAT_DTYPES])


def gradient_params(cases: Sequence[Any], in_default_run: Sequence[str]) -> list[Any]:
    """pytest params, one per case with `case.grad` (id `case.name`): the cases named in
    `in_default_run` in the default run, the others marked `slow`."""
    return [
        pytest.param(c, id=c.name, marks=() if c.name in in_default_run else _SLOW)
        for c in cases
        if c.grad
    ]


@contextlib.contextmanager
def tracer_leak_checks() -> Iterator[None]:
    """`jax.check_tracer_leaks()` with the objects that exist before it frozen out of the
    garbage collector's view (`gc.freeze`).

    The check runs `gc.collect()` at the end of every trace; late in a test session the
    collector would walk every object the session built (cached programs, jaxprs), about
    30 s for one traced model. Tracers made inside the block are new objects, so a leaked
    one is still found (tests/core/test_tracer_leaks.py shows it).
    """
    gc.freeze()  # O(1): moves the generations' lists into the permanent one
    try:
        with jax.check_tracer_leaks():
            yield
    finally:
        gc.unfreeze()
