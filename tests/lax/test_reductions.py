"""Table-driven tests of the reduction rules: full, cumulative, windowed and generic."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.core.scale_arithmetic import SCALE_MIN
from jax_scaled_arithmetics.lax import reductions as reductions_module
from tests.helpers import gradient_params, in_turn, make_scaled, one_dtype_each, represented
from tests.lax.test_shape import (
    JIT_CASES,
    Case,
    assert_table_covers,
    check_case,
    normal,
    run_grads,
    run_grid,
    vjp_of,
)


def factors(*shape: int):
    """Inputs of magnitude in [0.5, 2] with random signs (products stay in range)."""
    return lambda rng: [
        (rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)).astype(np.float32)
    ]


# Init values are NumPy scalars: a jnp one makes jax.vjp of lax.reduce_window fail in JAX.
def _zero(x):
    return np.zeros((), x.dtype)


def _one(x):
    return np.ones((), x.dtype)


def avg_pool(x):
    """flax-style average pooling, NHWC."""
    summed = lax.reduce_window(x, _zero(x), lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "SAME")
    return summed / 4


def max_pool(x):
    return lax.reduce_window(
        x, np.array(-np.inf, x.dtype), lax.max, (1, 3, 3, 1), (1, 2, 1, 1), "SAME"
    )


def min_pool(x):
    return lax.reduce_window(x, np.array(np.inf, x.dtype), lax.min, (2, 2), (1, 1), "VALID")


def _argmax_body(a, b):
    (av, ai), (bv, bi) = a, b
    pick = av >= bv
    return lax.select(pick, av, bv), lax.select(pick, ai, bi)


def variadic_argmax(x):
    iota = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    init = (np.array(-np.inf, x.dtype), jnp.int32(0))
    return lax.reduce((x, iota), init, _argmax_body, (1,))


CASES = [
    Case("reduce_sum", lambda x: jnp.sum(x, axis=1), normal(3, 5), grad=True),
    Case("reduce_sum_all", lambda x: jnp.sum(x), normal(4, 6)),
    Case("reduce_sum_empty_axes", lambda x: lax.reduce(x, _zero(x), lax.add, ()), normal(3, 2)),
    Case("reduce_sum_zero_size", lambda x: jnp.sum(x, axis=0), normal(0, 3)),
    Case("mean", lambda x: jnp.mean(x, axis=0), normal(4, 3)),
    Case("norm", lambda x: jnp.linalg.norm(x), normal(4, 3)),
    Case("norm_axis", lambda x: jnp.linalg.norm(x, axis=1), normal(4, 3)),
    Case("reduce_max", lambda x: jnp.max(x, axis=0), normal(4, 3)),
    Case("reduce_min", lambda x: jnp.min(x, axis=(0, 2)), normal(2, 3, 4)),
    Case("reduce_max_zero_size", lambda x: jnp.max(x, axis=0, initial=-1.0), normal(0, 3)),
    Case("argmax", lambda x: jnp.argmax(x, axis=1), normal(3, 5)),
    Case("argmin", lambda x: jnp.argmin(x, axis=0), normal(3, 5)),
    Case("cumsum", lambda x: jnp.cumsum(x, axis=1), normal(3, 6), grad=True),
    Case("cumsum_reverse", lambda x: lax.cumsum(x, axis=0, reverse=True), normal(5, 2)),
    Case("cummax", lambda x: lax.cummax(x, axis=1), normal(3, 6)),
    Case("cummin", lambda x: lax.cummin(x, axis=0, reverse=True), normal(5, 2)),
    Case("cumprod", lambda x: jnp.cumprod(x, axis=1), factors(3, 4)),
    Case("cumlogsumexp", lambda x: lax.cumlogsumexp(x, axis=1), normal(3, 5)),
    Case("reduce_prod", lambda x: jnp.prod(x, axis=0), factors(3, 4)),
    Case("avg_pool", avg_pool, normal(2, 5, 4, 3), grad=True),
    Case("avg_pool_vjp", vjp_of(avg_pool), normal((2, 5, 4, 3), (2, 3, 2, 3))),
    Case("max_pool", max_pool, normal(2, 5, 4, 3), grad=True),
    Case("max_pool_vjp", vjp_of(max_pool), normal((2, 5, 4, 3), (2, 3, 4, 3))),
    Case(
        "max_pool_jvp",
        lambda x, t: jax.jvp(max_pool, (x,), (t,))[1],
        normal((2, 5, 4, 3), (2, 5, 4, 3)),
    ),
    Case("min_pool", min_pool, normal(4, 5)),
    Case(
        "reduce_window_mul",
        lambda x: lax.reduce_window(x, _one(x), lax.mul, (2, 2), (1, 1), "VALID"),
        factors(4, 3),  # no grad: JAX cannot reverse-differentiate a generic reduce_window
    ),
    Case(
        "reduce_window_add_init",
        lambda x: lax.reduce_window(x, _one(x), lax.add, (3,), (2,), "SAME"),
        normal(7),
    ),
    Case(
        "reduce_generic",
        lambda x: lax.reduce(x, _one(x), lambda a, b: a + b, (1,)),
        normal(3, 4),
    ),
    Case("reduce_variadic_argmax", variadic_argmax, normal(3, 6)),
]


# Each case with one dtype in the default run, the dtypes in turn (the slow step runs the
# others: the same rules, eagerly over every scale).
@pytest.mark.parametrize("case, dtype", one_dtype_each(CASES, [c.name for c in CASES]))
def test_reductions_table(case, dtype):
    run_grid(case, dtype)


# Each case with one of JIT_CASES in the default run, in turn; the slow step runs the other.
@pytest.mark.parametrize(
    "case, dtype, scale",
    in_turn(
        CASES[::3], [c.name for c in CASES[::3]], JIT_CASES, [f"{d}-{s}" for d, s in JIT_CASES]
    ),
)
def test_reductions_table_jit(case, dtype, scale):
    check_case(case, dtype, scale, use_jit=True)


# Gradients of reduce_sum and max_pool in the default run; the slow step runs the others
# (their backward rules run forward under autoscale in avg_pool_vjp and cumsum_reverse).
GRAD_DEFAULT = ("reduce_sum", "max_pool")


@pytest.mark.parametrize(
    "case",
    gradient_params(CASES, GRAD_DEFAULT),
)
def test_reductions_table_grad(case):
    run_grads(case)


def test_reductions_table_covers_every_rule():
    assert_table_covers(reductions_module, CASES)


def test_static_policy_sum_scales_by_sqrt_n():
    x = make_scaled(np.ones((16, 3)), np.float16, 2.0**-20)
    with jsa.AutoScaleConfig(policy=jsa.ScalePolicy.STATIC):
        out = jsa.autoscale(lambda a: jnp.sum(a, axis=0))(x)
        cum = jsa.autoscale(lambda a: jnp.cumsum(a, axis=0))(x)
    assert float(out.scale) == 2.0**-18  # sqrt(16) = 4
    np.testing.assert_array_equal(represented(out), np.full(3, 16 * 2.0**-20))
    assert float(cum.scale) == 2.0**-18
    np.testing.assert_array_equal(represented(cum)[-1], represented(out))


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_dynamic_policy_sum_scale_follows_the_sum(use_jit):
    """Sums of non-negative terms grow like N, not sqrt(N): the default (dynamic) policy puts
    the sum's largest magnitude in [1, 2) of the data, for sums that grow and that cancel."""
    x = make_scaled(np.ones((16, 3)), np.float16, 2.0**-20)
    fn = jsa.autoscale(lambda a: (jnp.sum(a, axis=0), jnp.cumsum(a, axis=0), jnp.sum(a - a[:1])))
    out, cum, cancelled = (jax.jit(fn) if use_jit else fn)(x)
    assert float(out.scale) == 2.0**-16  # 16 = 2^4
    np.testing.assert_array_equal(np.asarray(out.data, np.float32), np.ones(3))
    np.testing.assert_array_equal(represented(out), np.full(3, 16 * 2.0**-20))
    assert float(cum.scale) == 2.0**-16
    np.testing.assert_array_equal(represented(cum)[-1], represented(out))
    # Zeros: the smallest scale, which lifts no common scale they join.
    assert float(cancelled.scale) == SCALE_MIN and float(cancelled.data) == 0.0


def test_long_float16_sum_does_not_overflow():
    # 4096 values of 500: the sum (2e6) overflows a plain float16 cumsum, not the scaled one.
    x = make_scaled(np.full((4096,), 500.0), np.float16, 1.0)
    assert not np.isfinite(np.asarray(jnp.cumsum(x.data))).all()
    out = jsa.autoscale(lambda a: jnp.cumsum(a))(x)
    assert np.isfinite(np.asarray(out.data, np.float32)).all()
    np.testing.assert_allclose(represented(out)[-1], 4096 * 500.0, rtol=1e-3)


def test_max_keeps_the_scale():
    x = make_scaled(np.array([[1.0, -3.0], [2.0, 0.5]]), np.float16, 2.0**40)
    out = jsa.autoscale(lambda a: jnp.max(a, axis=0))(x)
    assert float(out.scale) == 2.0**40
    np.testing.assert_array_equal(represented(out), np.array([2.0, 0.5]) * 2.0**40)


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16], ids=str)
def test_a_sum_of_one_term_is_the_term_at_its_scale(dtype, use_jit):
    """A sum over axes of size 1 (autodiff writes one for every broadcast of a kept
    dimension: 37 of the 95 sums of the 2-block char GPT's step) has one term per output:
    exact at the operand's scale, with no measurement, for every scale; its gradient too."""
    from jax_scaled_arithmetics.core.scale_arithmetic import dynamic_scale_p

    def fun(a):
        return (
            jnp.sum(a, axis=1),
            jnp.cumsum(a, axis=1),
            lax.reduce_window(a, _zero(a), lax.add, (1, 1), (1, 1), "VALID"),
        )

    values = np.random.default_rng(5).normal(size=(6, 1)) * 3
    jaxpr = jax.make_jaxpr(jsa.autoscale(fun))(make_scaled(values, dtype, 1.0))
    assert not any(e.primitive is dynamic_scale_p for e in jaxpr.jaxpr.eqns)
    run = jax.jit(jsa.autoscale(fun)) if use_jit else jsa.autoscale(fun)
    grad = jax.grad(lambda a: jnp.sum(jnp.sum(a, axis=1) * jnp.arange(6.0, dtype=a.dtype)))
    run_grad = jax.jit(jsa.autoscale(grad)) if use_jit else jsa.autoscale(grad)
    for scale in (2.0**-60, 2.0**-20, 1.0, 2.0**30, 2.0**60):
        x = make_scaled(values, dtype, scale)
        for out, want in zip(run(x), fun(jnp.asarray(represented(x), jnp.float32))):
            assert float(out.scale) == scale and out.dtype == x.dtype
            np.testing.assert_array_equal(represented(out), np.asarray(want, np.float64))
        np.testing.assert_array_equal(
            represented(run_grad(x)), np.broadcast_to(np.arange(6.0)[:, None], (6, 1))
        )
