"""Table-driven tests of the indexing rules: dynamic slices, gather, scatter, sort, top-k."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.lax import indexing as indexing_module
from tests.helpers import (
    FLOAT_DTYPES,
    gradient_params,
    in_turn,
    make_scaled,
    one_dtype_each,
    represented,
)
from tests.lax.test_shape import (
    JIT_CASES,
    Case,
    assert_table_covers,
    check_case,
    check_mixed_scales,
    normal,
    run_grads,
    run_grid,
    vjp_of,
)

IDS = np.array([[0, 3], [5, 3], [1, 0]], np.int32)  # embedding ids, with repeats
UNIQUE = np.array([4, 0, 2], np.int32)
REPEATED = np.array([1, 3, 1, 1], np.int32)
OUT_OF_BOUNDS = np.array([2, 7, -9, 0], np.int32)


def _with(*arrays: np.ndarray, shapes: tuple[tuple[int, ...], ...]) -> Callable[..., Any]:
    """Generator: normal float inputs of `shapes` followed by fixed index `arrays`."""
    return lambda rng: [*(rng.normal(size=s).astype(np.float32) for s in shapes), *arrays]


def _two_keys(rng: np.random.Generator) -> list[np.ndarray]:
    k1 = np.round(rng.normal(size=(8,))).astype(np.float32)  # ties, broken by the second key
    return [k1, rng.normal(size=(8,)), rng.normal(size=(8,))]


def _embedding(table):
    return jnp.take(table, IDS, axis=0)


CASES = [
    Case(
        "dynamic_slice",
        lambda x, i: lax.dynamic_slice(x, (i, 1), (2, 3)),
        _with(np.int32(1), shapes=((4, 5),)),
        plain=(1,),
        grad=True,
    ),
    Case(
        "dynamic_update_slice",
        lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 2)),
        _with(np.int32(1), shapes=((4, 5), (2, 3))),
        plain=(2,),
    ),
    Case(
        "dynamic_slice_vjp",
        vjp_of(lambda x: lax.dynamic_slice(x, (1, 2), (2, 2))),
        normal((4, 5), (2, 2)),
    ),
    Case("getitem_array", lambda x, i: x[i], _with(REPEATED, shapes=((5, 3),)), plain=(1,)),
    Case("getitem_strided", lambda x: x[::2, 1:], normal(5, 3)),
    Case(
        "take_embedding",
        lambda t, i: jnp.take(t, i, axis=0),
        _with(IDS, shapes=((6, 4),)),
        plain=(1,),
        grad=True,
    ),
    Case("take_embedding_vjp", vjp_of(_embedding), normal((6, 4), (3, 2, 4))),
    Case(
        "take_fill_value",
        lambda x, i: jnp.take(x, i, axis=0, mode="fill", fill_value=5.0),
        _with(OUT_OF_BOUNDS, shapes=((4, 3),)),
        plain=(1,),
    ),
    Case(
        "take_fill_nan",
        lambda x, i: jnp.take(x, i, axis=1, mode="fill"),
        _with(OUT_OF_BOUNDS, shapes=((3, 4),)),
        plain=(1,),
    ),
    Case(
        "at_set",
        lambda x, u, i: x.at[i].set(u),
        _with(UNIQUE, shapes=((5, 2), (3, 2))),
        plain=(2,),
    ),
    Case(
        "at_add_repeated",
        lambda x, u, i: x.at[i].add(u),
        _with(REPEATED, shapes=((5, 2), (4, 2))),
        plain=(2,),
        grad=True,
    ),
    Case("at_add_vjp", vjp_of(lambda x, u: x.at[REPEATED].add(u)), normal((5, 2), (4, 2), (5, 2))),
    Case(
        "at_subtract",
        lambda x, u, i: x.at[i].subtract(u),
        _with(REPEATED, shapes=((5, 2), (4, 2))),
        plain=(2,),
    ),
    Case(
        "at_mul", lambda x, u, i: x.at[i].mul(u), _with(UNIQUE, shapes=((5, 2), (3, 2))), plain=(2,)
    ),
    Case("at_mul_constant", lambda x: x.at[1].mul(3.0), normal(4, 3)),
    Case(
        "at_min",
        lambda x, u, i: x.at[i].min(u),
        _with(REPEATED, shapes=((5, 2), (4, 2))),
        plain=(2,),
    ),
    Case(
        "at_max",
        lambda x, u, i: x.at[i].max(u),
        _with(REPEATED, shapes=((5, 2), (4, 2))),
        plain=(2,),
    ),
    Case("sort", lambda x: jnp.sort(x, axis=0), normal(5, 3), grad=True),
    Case("sort_vjp", vjp_of(lambda x: jnp.sort(x, axis=1)), normal((3, 5), (3, 5))),
    Case("argsort", lambda x: jnp.argsort(x, axis=1, descending=True), normal(3, 6)),
    Case("sort_key_and_value", lambda k, v: lax.sort((k, v), num_keys=1), normal((7,), (7,))),
    Case("sort_two_keys", lambda a, b, v: lax.sort((a, b, v), num_keys=2), _two_keys),
    Case("top_k", lambda x: lax.top_k(x, 3), normal(4, 6)),
    Case("approx_max_k", lambda x: lax.approx_max_k(x, 2), normal(3, 8), tie_indices=False),
]


# Each case with one dtype in the default run, the dtypes in turn (the slow step runs the
# others: the same rules, eagerly over every scale).
@pytest.mark.parametrize("case, dtype", one_dtype_each(CASES, [c.name for c in CASES]))
def test_indexing_table(case, dtype):
    run_grid(case, dtype)


# Each case with one of JIT_CASES in the default run, in turn; the slow step runs the other.
@pytest.mark.parametrize(
    "case, dtype, scale",
    in_turn(
        CASES[::3], [c.name for c in CASES[::3]], JIT_CASES, [f"{d}-{s}" for d, s in JIT_CASES]
    ),
)
def test_indexing_table_jit(case, dtype, scale):
    check_case(case, dtype, scale, use_jit=True)


# Gradients of dynamic_slice and take_embedding in the default run; the slow step runs the
# others (their backward rules run forward under autoscale in sort_vjp and at_add_vjp).
GRAD_DEFAULT = ("dynamic_slice", "take_embedding")


@pytest.mark.parametrize(
    "case",
    gradient_params(CASES, GRAD_DEFAULT),
)
def test_indexing_table_grad(case):
    run_grads(case)


def test_indexing_table_covers_every_rule():
    assert_table_covers(indexing_module, CASES)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_scatter_and_update_at_different_scales(dtype):
    rng = np.random.default_rng(2)
    x, u = rng.normal(size=(5, 2)), rng.normal(size=(4, 2))
    for scales in ([2.0**-20, 2.0**-14], [2.0**30, 2.0**24]):
        out = check_mixed_scales(lambda a, b: a.at[REPEATED].add(b), [x, u], dtype, scales)
        assert float(out.scale) == max(scales)
        check_mixed_scales(lambda a, b: a.at[UNIQUE[:2]].set(b[:2]), [x, u], dtype, scales)
        check_mixed_scales(
            lambda a, b: lax.dynamic_update_slice(a, b[:2], (3, 0)), [x, u], dtype, scales
        )


def test_sort_keeps_each_operand_scale():
    keys = make_scaled(np.array([3.0, -1.0, 2.0]), np.float16, 2.0**-30)
    values = make_scaled(np.array([1.0, 2.0, 3.0]), np.float16, 2.0**20)
    k, v = jsa.autoscale(lambda a, b: lax.sort((a, b), num_keys=1))(keys, values)
    assert float(k.scale) == 2.0**-30 and float(v.scale) == 2.0**20
    np.testing.assert_array_equal(represented(k), np.array([-1.0, 2.0, 3.0]) * 2.0**-30)
    np.testing.assert_array_equal(represented(v), np.array([2.0, 3.0, 1.0]) * 2.0**20)


def test_scatter_mul_renormalises():
    x = make_scaled(np.full((4,), 1.5), ml_dtypes.bfloat16, 2.0**-10)
    out = jsa.autoscale(lambda a: a.at[2].mul(2.0**40))(x)
    np.testing.assert_array_equal(represented(out)[2], 1.5 * 2.0**30)
    assert np.isfinite(np.asarray(out.data, np.float32)).all()
