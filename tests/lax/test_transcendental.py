"""Table-driven tests of the transcendental rules (`jax_scaled_arithmetics/lax/transcendental.py`).

Same machinery as `test_elementwise.py`: each entry runs through `jsa.autoscale`
and is compared with the plain function in float32 on the represented values, for
every dtype and scale of the entry, with and without jit, with zero scales,
inf/NaN inputs, different scales per operand and gradients.

Scales are narrowed where the domain is in values (e.g. |x| < 1 for asin: scales
<= 1, data in (-1, 1)) or where the float32 reference overflows (e.g. exp of
values above 88: scales <= 2^4 for data ~ N(0, 1)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.core import _compat
from jax_scaled_arithmetics.lax import transcendental
from tests.helpers import RTOL, assert_close, make_scaled, represented
from tests.lax.test_elementwise import (
    BF16,
    F16,
    F32,
    Case,
    _strict_autoscale,  # noqa: F401  (the module's autouse fixture)
    batched_jit_grads,
    batched_jit_outputs,
    case_id,
    check_grads,
    check_table_covers,
    concat,
    eager,  # noqa: F401  (fixture)
    grid_check,
    grid_params,
    jit_check,
    mixed_check,
    mixed_params,
    nonfinite_check,
    normal,
    positive,
    scales_between,
    uniform,
)

SCALED_AXES = jsa.ScaledArray(data=0, scale=None)
UP_TO_16 = scales_between(0.0, 2.0**4)
UP_TO_1 = scales_between(0.0, 1.0)
FROM_1 = scales_between(1.0, np.inf)
OVERFLOW = "float32 reference overflows (|x| > 88) at larger scales"
# Output scale floored at 2^-14 (|f| <= 2) or 2^-10 (|f| <= 17) for float16 data.
F16_FLOOR_2 = {"f16_min_scale": 2.0**-30}
F16_FLOOR_17 = {"f16_min_scale": 2.0**-20}
F16_FLOOR_NOTE = "float16: tiny values flush below the output-scale floor (2^-14 or 2^-10)"
DOMAIN_UNIT = "domain |x| < 1 in values: data in (-1, 1), scales <= 1"


_KEY = jax.random.key(0)


def _full(value: float):
    """A constant operand, broadcast like `x` (promoted with a power-of-two scale)."""
    return lambda x: jnp.full_like(x, value)


TRANSCENDENTAL_CASES: tuple[Case, ...] = (
    Case("exp", lax.exp, normal(), scales=UP_TO_16, note=OVERFLOW),
    Case("exp2", lax.exp2, normal(), scales=UP_TO_16, note=OVERFLOW),
    Case("expm1", lax.expm1, normal(), scales=UP_TO_16, note=OVERFLOW),
    Case("sinh", lax.sinh, normal(), scales=UP_TO_16, note=OVERFLOW),
    Case("cosh", lax.cosh, normal(), scales=UP_TO_16, note=OVERFLOW),
    Case("log", lax.log, positive()),
    # JAX >= 0.11 (jnp.log2 was log(x) / log(2) before).
    *([Case("log2", lax.log2, positive())] if _compat.has_primitive("log2") else []),
    # JAX >= 0.11 (tanh's derivative; sub and mul before).
    *(
        [Case("one_minus_square", lax.one_minus_square, normal())]
        if _compat.has_primitive("one_minus_square")
        else []
    ),
    Case("log1p", lax.log1p, positive(), **F16_FLOOR_17, note=F16_FLOOR_NOTE),
    Case(
        "log1p_negative",
        lax.log1p,
        uniform(-0.95, 0.95),
        scales=UP_TO_1,
        **F16_FLOOR_17,
        note="x > -1; " + F16_FLOOR_NOTE,
    ),
    Case("tan", lax.tan, normal()),
    Case("sin", lax.sin, normal(), **F16_FLOOR_2, note=F16_FLOOR_NOTE),
    Case("cos", lax.cos, normal()),
    Case("tanh", lax.tanh, normal(), **F16_FLOOR_2, note=F16_FLOOR_NOTE),
    Case("logistic", lax.logistic, normal()),
    Case("atan", lax.atan, normal(), **F16_FLOOR_2, note=F16_FLOOR_NOTE),
    Case("asinh", lax.asinh, normal()),
    Case("erf", lax.erf, normal(), **F16_FLOOR_2, note=F16_FLOOR_NOTE),
    Case("erfc", lax.erfc, normal()),
    Case(
        "asin",
        lax.asin,
        uniform(-0.95, 0.95),
        scales=UP_TO_1,
        **F16_FLOOR_2,
        note=DOMAIN_UNIT + "; " + F16_FLOOR_NOTE,
    ),
    Case("acos", lax.acos, uniform(-0.95, 0.95), scales=UP_TO_1, note=DOMAIN_UNIT),
    Case(
        "atanh",
        lax.atanh,
        uniform(-0.95, 0.95),
        scales=UP_TO_1,
        **F16_FLOOR_17,
        note=DOMAIN_UNIT + "; " + F16_FLOOR_NOTE,
    ),
    Case(
        "erf_inv",
        lax.erf_inv,
        uniform(-0.95, 0.95),
        scales=UP_TO_1,
        **F16_FLOOR_17,
        note=DOMAIN_UNIT + "; " + F16_FLOOR_NOTE,
    ),
    Case("acosh", lax.acosh, lambda rng: [1 + positive()(rng)[0]], scales=FROM_1, note="x >= 1"),
    Case(
        "atan2",
        lax.atan2,
        normal(2),
        f16_min_scale=2.0**-30,
        f16_ratio=True,
        note="scale sy / sx, floored at 2^-13 for float16",
    ),
    Case(
        "pow",
        lax.pow,
        concat(positive(), normal()),
        scales=UP_TO_1,
        note="x^y with y scaled like x overflows float32 at scales > 1",
    ),
    Case("pow_constant_exponent", lambda x: lax.pow(x, _full(1.5)(x)), positive()),
    Case("lgamma", lax.lgamma, positive()),
    Case("digamma", lax.digamma, positive()),
    Case("polygamma", lambda x: lax.polygamma(_full(1.0)(x), x), positive()),
    Case(
        "zeta",
        lambda q: lax.zeta(_full(3.0)(q), q),
        positive(),
        scales=scales_between(2.0**-30, np.inf),
        grad=False,
        note="zeta(3, q) ~ q^-3 overflows float32 below; JAX has no derivative of zeta",
    ),
    Case(
        "zeta_both",
        lax.zeta,
        lambda rng: [1.5 + positive()(rng)[0], positive()(rng)[0]],
        scales=scales_between(1.0, 2.0**4),
        grad=False,
        note="zeta(x, q) for x > 1",
    ),
    Case("igamma", lax.igamma, positive(2)),
    Case("igammac", lax.igammac, positive(2)),
    Case("igamma_grad_a", lax.igamma_grad_a, positive(2), grad=False),
    Case(
        "betainc_ab",
        lambda a, b: lax.betainc(a, b, _full(0.375)(a)),
        positive(2),
        grad=False,
        note="no derivative in a and b",
    ),
    Case(
        "betainc_x",
        lambda x: lax.betainc(_full(2.0)(x), _full(3.0)(x), x),
        uniform(0.05, 0.95),
        scales=UP_TO_1,
        note="x in [0, 1]",
    ),
    Case(
        "bessel_i0e",
        lax.bessel_i0e,
        normal(),
        grad_rtol=400.0,
        note="i0e'(x) = i1e(x) - sign(x) i0e(x) cancels for large x: at scale 2^20 the float32"
        " gradients are a few ulps of i0e, and one compile's rounding moves some by one ulp"
        " (measured: XLA:CPU at LLVM -O0 against -O2, 0.7% of the largest gradient)",
    ),
    Case(
        "random_gamma",
        lambda a: _compat.primitives.random_gamma_p.bind(_KEY, a, log_space=False),
        positive(),
        grad=False,
        slow_eager=True,
        note="its gradient is lax.random_gamma_grad, a while-loop composite tested below",
    ),
    Case(
        "bessel_i1e",
        lax.bessel_i1e,
        normal(),
        grad_rtol=30.0,
        note="i1e'(x) cancels for large x: float32 gradients differ by ~20% between jit and eager",
    ),
)

GRAD_CASES = [c for c in TRANSCENDENTAL_CASES if c.grad]
MULTI_CASES = [c for c in TRANSCENDENTAL_CASES if len(c.inputs()) > 1]


@pytest.fixture(scope="module", params=(F16,), ids=str)
def transcendental_jit(request):
    return request.param, batched_jit_outputs(TRANSCENDENTAL_CASES, request.param)


@pytest.fixture(scope="module", params=(F32, F16), ids=str)
def transcendental_grads(request):
    return request.param, batched_jit_grads(TRANSCENDENTAL_CASES, request.param)


def _random_gamma_slow(params):
    """random_gamma's eager grid (its while loops run op by op: the slowest eager case) in
    the slow step; its rule runs eagerly in test_transcendental_inf_nan_as_plain and at
    every scale under jit in the default run."""
    return [
        pytest.param(*p.values, id=p.id, marks=(*p.marks, pytest.mark.slow))
        if p.values[0].name == "random_gamma"
        else p
        for p in params
    ]


@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("case,dtype", _random_gamma_slow(grid_params(TRANSCENDENTAL_CASES)))
def test_transcendental_matches_plain(case, dtype):
    grid_check(case, dtype)


# Every case: the batched fixture computes all of a dtype's cases in one program.
@pytest.mark.every_case
@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("case", TRANSCENDENTAL_CASES, ids=case_id)
def test_transcendental_matches_plain_under_jit(case, transcendental_jit):
    jit_check(case, *transcendental_jit)


@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("case", TRANSCENDENTAL_CASES, ids=case_id)
def test_transcendental_inf_nan_as_plain(case):
    nonfinite_check(case)


@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("case,dtype", mixed_params(MULTI_CASES, (F32, BF16)))
def test_transcendental_different_scales_per_operand(case, dtype):
    mixed_check(case, dtype)


# Every case: the batched fixture computes all of a dtype's cases in one program.
@pytest.mark.every_case
@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("case", GRAD_CASES, ids=case_id)
def test_transcendental_grad(case, transcendental_grads):
    dtype, grads = transcendental_grads
    check_grads(case, dtype, grads)


def test_table_covers_every_transcendental_rule():
    check_table_covers(TRANSCENDENTAL_CASES, transcendental.REGISTERED)


# --- specific behaviours -------------------------------------------------------------------


@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("use_jit", (False, True))
def test_fp16_exp_log_of_values_out_of_fp16_range(use_jit):
    """Values 2^20 and 2^-20 held as float16 data: log, exp and sqrt stay accurate."""
    data = np.array([1.0, 1.5, 1.75, 1.25], np.float16)
    autoscale = (lambda f: jax.jit(jsa.autoscale(f))) if use_jit else jsa.autoscale
    for exponent in (20, -20):
        x = make_scaled(data, F16, 2.0**exponent)
        value = represented(x)
        for name, fn, expected in (
            ("log", jnp.log, np.log(value)),
            ("sqrt", jnp.sqrt, np.sqrt(value)),
            ("exp", jnp.exp, np.exp(value) if exponent < 0 else np.full(4, np.inf)),
            ("log1p", jnp.log1p, np.log1p(value)),
            ("tanh", jnp.tanh, np.tanh(value)),
        ):
            out = autoscale(fn)(x)
            assert_close(out, expected, RTOL[F16])
            assert out.dtype == F16, name
    # exp of values whose exponential leaves float16's range, both ways.
    for values in ([10.0, 11.0, 12.0], [-20.0, -19.0, -18.0]):
        x = make_scaled(np.array(values) / 16, F16, 16.0)
        out = autoscale(jnp.exp)(x)
        assert_close(out, np.exp(values), RTOL[F16])
        plain = np.asarray(jnp.exp(jnp.asarray(values, F16)), np.float64)
        assert not np.allclose(plain, np.exp(values), rtol=1e-2, atol=0)


@pytest.mark.usefixtures("eager")
def test_log_of_values_beyond_float32_range():
    """log(data) + log(scale) where data * scale leaves float32's range."""
    x = jsa.scaled_array(np.array([2.0**100, 3.0], np.float32), np.float32(2.0**100))
    out = jsa.autoscale(jnp.log)(x)
    np.testing.assert_allclose(represented(out), np.log([2.0**200, 3.0 * 2.0**100]), rtol=1e-6)
    x = jsa.scaled_array(np.array([2.0**-100, 1.0], np.float32), np.float32(2.0**-100))
    out = jsa.autoscale(jnp.log)(x)
    np.testing.assert_allclose(represented(out), np.log([2.0**-200, 2.0**-100]), rtol=1e-6)
    # d log(data * scale) / d data = 1 / data, finite on both branches.
    grad = jax.grad(
        lambda d: jnp.sum(jsa.autoscale(jnp.log)(jsa.ScaledArray(d, x.scale)).to_array())
    )(x.data)
    np.testing.assert_allclose(np.asarray(grad), 1 / np.asarray(x.data), rtol=1e-6)


@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("dtype, exponent", ((F32, -60), (BF16, -60), (F16, -20)), ids=str)
def test_tiny_inputs_of_odd_functions_keep_precision(dtype, exponent):
    """sin, tanh, asin... of values ~2^-60 are ~2^-60, not flushed to zero by a scale of 1
    (float16: tanh, atan and erf down to their output-scale floor, 2^-14 or 2^-10, so
    that f(inf) fits; the others at every scale)."""
    x = make_scaled(np.array([1.0, -1.5, 0.75]), dtype, 2.0**exponent)
    value = jnp.asarray(represented(x), jnp.float32)
    functions = [jnp.sin, jnp.arcsin, jnp.arcsinh, jnp.log1p, jnp.arctanh, lax.erf_inv]
    if dtype == F16:  # the same functions at 2^-60, and float16's own extremes
        x = make_scaled(np.array([1.0, -1.5, 0.75, 65504.0, 2.0**-24]), dtype, 2.0**-60)
        value = jnp.asarray(represented(x), jnp.float32)
        for fn in functions:
            assert_close(jsa.autoscale(fn)(x), np.asarray(fn(value)), RTOL[dtype])
        x = make_scaled(np.array([1.0, -1.5, 0.75]), dtype, 2.0**exponent)
        value = jnp.asarray(represented(x), jnp.float32)
    for fn in (*functions, jnp.tanh, jnp.arctan, lax.erf):
        out = jsa.autoscale(fn)(x)
        assert_close(out, np.asarray(fn(value)), RTOL[dtype])
        # The scale depends on the input scale only: no reduction, unbatched under vmap
        # (one scale for the batch; under vmap it goes out at the data's rank).
        batched = jax.vmap(jsa.autoscale(fn), in_axes=(SCALED_AXES,), out_axes=SCALED_AXES)
        assert np.size(batched(make_scaled(np.ones((2, 3)), dtype, 0.5)).scale) == 1


def test_tanh_of_inf_with_tiny_scale_is_one():
    x = make_scaled(np.array([np.inf, -np.inf, 1.0]), F16, 2.0**-40)
    out = jsa.autoscale(jnp.tanh)(x)
    np.testing.assert_allclose(represented(out)[:2], [1.0, -1.0])


@pytest.mark.usefixtures("eager")
def test_dynamic_scale_ignores_inf_and_nan_outputs():
    x = make_scaled(np.array([1.0, 2.0, np.inf, np.nan]), F16, 4.0)
    out = jsa.autoscale(jnp.exp)(x)
    np.testing.assert_allclose(represented(out)[:2], np.exp([4.0, 8.0]), rtol=RTOL[F16])
    assert np.isinf(represented(out)[2]) and np.isnan(represented(out)[3])


@pytest.mark.slow
@pytest.mark.usefixtures("eager")
def test_random_gamma_grad_composite():
    """`lax.random_gamma_grad` is not a primitive: a composite with while loops.

    (Without leak checks: it exercises the control-flow rules, tested elsewhere.)
    """
    a = np.array([0.5, 1.0, 2.0, 4.0])
    x = np.array([0.3, 1.2, 1.5, 5.0])
    fn = jax.jit(jsa.autoscale(lax.random_gamma_grad))
    scale = 0.5
    out = fn(make_scaled(a, F32, scale), make_scaled(x, F32, scale))
    expected = lax.random_gamma_grad(jnp.asarray(a * scale, jnp.float32), x * scale)
    assert_close(out, np.asarray(expected), 1e-4)
