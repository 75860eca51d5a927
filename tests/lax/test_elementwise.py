"""Table-driven tests of the elementwise rules (`jax_scaled_arithmetics/lax/elementwise.py`).

Every table entry is a function (a `jax.lax` / `jax.numpy` call, or a primitive's
`bind`) with an input generator giving data in the function's domain. Each entry
runs through `jsa.autoscale` on ScaledArrays and is compared with the plain
function applied in float32 to the represented values, for every data dtype and
every scale of the entry, with and without jit; with zero scales; with inf/NaN
inputs; with different scales per operand; and through `jax.grad`.

The machinery (`Case`, generators, runners) is shared with `test_transcendental.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.core import _compat, block_scales, registry
from jax_scaled_arithmetics.core.config import default_config
from jax_scaled_arithmetics.lax import elementwise
from tests.helpers import (
    FLOAT_DTYPES,
    RTOL,
    WIDE_SCALES,
    as_scaled_array_jit,
    assert_close,
    check_autoscale_matches,
    make_scaled,
    represented,
    tracer_leak_checks,
)

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
SIZE = 24

# --- input generators: data in the domain of the function, for a given rng ---------------

Gen = Callable[[np.random.Generator], list[np.ndarray]]


def normal(n: int = 1) -> Gen:
    return lambda rng: [rng.normal(size=SIZE).astype(np.float32) for _ in range(n)]


def positive(n: int = 1) -> Gen:
    return lambda rng: [(np.abs(rng.normal(size=SIZE)) + 0.25).astype(np.float32) for _ in range(n)]


def away_from_zero(n: int = 1) -> Gen:
    """Both signs, |x| >= 0.25."""

    def gen(rng: np.random.Generator) -> list[np.ndarray]:
        return [
            (np.sign(rng.normal(size=SIZE)) * (np.abs(rng.normal(size=SIZE)) + 0.25)).astype(
                np.float32
            )
            for _ in range(n)
        ]

    return gen


def uniform(lo: float, hi: float, n: int = 1) -> Gen:
    return lambda rng: [rng.uniform(lo, hi, size=SIZE).astype(np.float32) for _ in range(n)]


def with_ties(rng: np.random.Generator) -> list[np.ndarray]:
    """Two arrays equal on about half of the elements (and with +0/-0 pairs)."""
    a = rng.normal(size=SIZE).astype(np.float32)
    b = np.where(rng.uniform(size=SIZE) < 0.5, a, rng.normal(size=SIZE)).astype(np.float32)
    a[:2], b[:2] = (0.0, -0.0), (-0.0, 0.0)
    return [a, b]


def concat(*gens: Gen) -> Gen:
    return lambda rng: [x for g in gens for x in g(rng)]


# --- table entries -------------------------------------------------------------------------


def scales_between(lo: float, hi: float) -> tuple[float, ...]:
    return tuple(s for s in WIDE_SCALES if lo <= s <= hi)


@dataclasses.dataclass(frozen=True)
class Case:
    """One table entry.

    Attributes:
        name: test id.
        fn: the function under test (all its arguments are scaled).
        gen: the data generator (values are data * scale).
        scales: the scales tested; narrower than `WIDE_SCALES` where the domain
            (in values) or a finite float32 reference requires it (see `note`).
        grad: whether gradients are checked.
        nonfinite: the inf/NaN values put in the inputs (none: not checked).
        rtol: relative tolerance factor on `RTOL` of the data dtype.
        grad_rtol: further factor for gradients.
        f16_min_scale: float16 only, the smallest input scale tested: the rule floors
            its output scale so that the function's largest value fits float16, and
            values below the floor flush (`f16_ratio`: the ratio of the first two
            operands' scales is compared instead, as for atan2).
        inputs_atol: the absolute tolerance is relative to the largest input too: the
            output scale is the largest input scale (add, max, clamp...), so with
            different scales per operand small outputs have its absolute precision.
        slow_eager: slow without jit (a jax.numpy composite with jit or custom_jvp
            sub-calls, re-traced at every eager call, or a primitive with a slow eager
            implementation): the eager checks run for float16 at three scales only
            (the jit checks at every scale).
        note: why the scales are restricted.
    """

    name: str
    fn: Callable[..., Any]
    gen: Gen
    scales: tuple[float, ...] = WIDE_SCALES
    grad: bool = True
    nonfinite: tuple[float, ...] = (np.inf, -np.inf, np.nan)
    rtol: float = 1.0
    grad_rtol: float = 1.0
    f16_min_scale: float = 0.0
    f16_ratio: bool = False
    inputs_atol: bool = False
    slow_eager: bool = False
    note: str = ""

    def accepts(self, dtype: Any, scales: Sequence[float]) -> bool:
        """Whether the case is checked with `dtype` data at these operand scales."""
        if np.dtype(dtype) != F16 or not self.f16_min_scale:
            return True
        nonzero = [s for s in scales if s > 0]
        if self.f16_ratio:
            if len(nonzero) < 2 or len(nonzero) != len(scales):
                return True
            effective = min(scales[0] / scales[1], 1.0)
        else:
            effective = min(nonzero, default=1.0)
        return effective >= self.f16_min_scale

    def scales_for(self, dtype: Any) -> tuple[float, ...]:
        return tuple(s for s in self.scales if self.accepts(dtype, [s]))

    def inputs(self) -> list[np.ndarray]:
        seed = sum(ord(c) * (i + 1) for i, c in enumerate(self.name))
        return self.gen(np.random.default_rng(seed))


def _bind(primitive: Any, **params: Any) -> Callable[..., Any]:
    return lambda *args: primitive.bind(*args, **params)


_PRED = np.arange(SIZE) % 3 == 0

ELEMENTWISE_CASES: tuple[Case, ...] = (
    Case("add", lax.add, normal(2), inputs_atol=True),
    Case("sub", lax.sub, normal(2), inputs_atol=True),
    Case("add_any", _bind(_compat.primitives.add_jaxvals_p), normal(2), inputs_atol=True),
    Case("mul", lax.mul, normal(2)),
    Case("div", lax.div, concat(normal(), away_from_zero())),
    Case("neg", lax.neg, normal()),
    Case("abs", lax.abs, normal()),
    Case("materialize", _bind(block_scales.materialize_p, scalars=False), normal()),
    Case("materialize_on_cpu", block_scales.materialize_on_cpu, normal()),
    Case("max", lax.max, with_ties, inputs_atol=True),
    Case("min", lax.min, with_ties, inputs_atol=True),
    Case("relu", jax.nn.relu, normal(), slow_eager=True),
    Case("select_n", lambda a, b: lax.select_n(_PRED, a, b), normal(2), inputs_atol=True),
    # JAX >= 0.12: a custom_jvp that selects per element among x, x * 2**k and x * 2**-k and
    # squares, interpreted it flushed all but the largest values; it has a rule now.
    Case(
        "hypot",
        jnp.hypot,
        normal(2),
        slow_eager=True,
        f16_min_scale=0.0 if _compat.hypot_with_unit_vector else 2.0**-20,
        note="JAX < 0.12: max / where(max == 0, 1, max), whose 1 and float16 data at 2^-30 "
        "do not fit one scale (the data flushes, the quotient is inf)",
    ),
    Case(
        "clamp", lax.clamp, concat(uniform(-2, -0.5), normal(), uniform(0.5, 2)), inputs_atol=True
    ),
    Case("sign", lax.sign, normal()),
    Case("eq", lax.eq, with_ties, grad=False),
    Case("ne", lax.ne, with_ties, grad=False),
    Case("lt", lax.lt, with_ties, grad=False),
    Case("le", lax.le, with_ties, grad=False),
    Case("gt", lax.gt, with_ties, grad=False),
    Case("ge", lax.ge, with_ties, grad=False),
    Case("eq_to", _bind(_compat.primitives.eq_to_p), with_ties, grad=False),
    Case("le_to", _bind(_compat.primitives.le_to_p), with_ties, grad=False),
    Case("lt_to", _bind(_compat.primitives.lt_to_p), with_ties, grad=False),
    Case("isnan", jnp.isnan, normal(), grad=False, slow_eager=True),
    Case("isinf", jnp.isinf, normal(), grad=False, slow_eager=True),
    Case("is_finite", jnp.isfinite, normal(), grad=False),
    Case("square", lax.square, normal()),
    Case("integer_pow_2", lambda x: lax.integer_pow(x, 2), normal()),
    Case(
        "integer_pow_3",
        lambda x: lax.integer_pow(x, 3),
        normal(),
        scales=scales_between(2.0**-30, 2.0**30),
        note="x**3 overflows float32 at 2^60",
    ),
    Case("integer_pow_-1", lambda x: lax.integer_pow(x, -1), away_from_zero()),
    Case("integer_pow_-2", lambda x: lax.integer_pow(x, -2), away_from_zero()),
    Case(
        "integer_pow_-3",
        lambda x: lax.integer_pow(x, -3),
        away_from_zero(),
        scales=scales_between(2.0**-30, 2.0**30),
        note="three factors in one scale product; x**-3 overflows float32 at 2^-43",
    ),
    Case("integer_pow_0", lambda x: lax.integer_pow(x, 0), normal()),
    Case("sqrt", lax.sqrt, positive()),
    Case("rsqrt", lax.rsqrt, positive()),
    Case("cbrt", lax.cbrt, normal()),
    Case("floor", lax.floor, normal()),
    Case("ceil", lax.ceil, normal()),
    Case("round_away", lambda x: lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO), normal()),
    Case("round_even", lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN), normal()),
    Case("trunc", jnp.trunc, normal(), slow_eager=True),
    Case("rem", lax.rem, concat(normal(), away_from_zero())),
    Case("remainder", jnp.remainder, concat(normal(), away_from_zero()), slow_eager=True),
    Case(
        "nextafter",
        lax.nextafter,
        normal(2),
        grad=False,
        nonfinite=(np.nan,),
        note="nextafter(inf, x) is the largest value of the data format at the scale",
    ),
    Case("reduce_precision_e5m10", lambda x: lax.reduce_precision(x, 5, 10), normal()),
    Case("reduce_precision_e8m7", lambda x: lax.reduce_precision(x, 8, 7), normal()),
    Case("reduce_precision_e4m3", lambda x: lax.reduce_precision(x, 4, 3), normal()),
    # JAX >= 0.12 (the derivative of erf and of gelu): a scaled and three constant coefficients.
    *(
        [
            Case(
                "polynomial",
                lambda x, c: lax.polynomial(x, [1.0, c, 0.5, -0.25]),
                normal(2),
                scales=scales_between(2.0**-30, 2.0**30),
                note="x**3 overflows float32 at 2^60",
            )
        ]
        if _compat.has_primitive("polynomial")
        else []
    ),
)


# --- runners -------------------------------------------------------------------------------

F32_TINY = float(np.finfo(np.float32).tiny)
GRAD_SCALES = {F32: (2.0**-20, 1.0, 2.0**20), F16: (1.0,), BF16: (1.0,)}


def case_id(case: Case) -> str:
    return case.name


def assert_matches(
    out: Any, expected: Any, dtype: Any, rtol: float, atol_floor: float = 0.0
) -> None:
    """Compare an autoscale output with the float32 reference on the represented values.

    The absolute tolerance is `rtol * max|expected|`, and at least `atol_floor` and
    float32's smallest normal number: the float32 reference flushes subnormal results
    to zero, where a scaled result can still hold them.
    """
    expected = np.asarray(expected)
    if not np.issubdtype(expected.dtype, np.floating):
        np.testing.assert_array_equal(np.asarray(out), expected)
        return
    assert isinstance(out, jsa.ScaledArray), f"expected a ScaledArray, got {type(out)}"
    assert out.dtype == np.dtype(dtype), (out.dtype, dtype)
    finite = np.abs(expected[np.isfinite(expected)])
    amax = float(finite.max()) if finite.size else 0.0
    atol_rel = rtol if amax == 0 else max(rtol, max(F32_TINY, atol_floor) / amax)
    assert_close(out, expected, rtol, atol_rel=atol_rel)


def check_output(case: Case, out: Any, args: Sequence[Any], dtype: Any) -> None:
    """`out` against the reference on `args`, with the case's tolerances."""
    rtol = case.rtol * RTOL[np.dtype(dtype)]
    atol_floor = 0.0
    if case.inputs_atol:
        values = np.concatenate([np.abs(represented(a)).ravel() for a in args])
        values = values[np.isfinite(values)]
        atol_floor = rtol * float(values.max()) if values.size else 0.0
    assert_matches(out, reference(case, args), dtype, rtol, atol_floor)


def scaled_args(case: Case, dtype: Any, scales: Sequence[float], inputs: Any = None) -> list[Any]:
    inputs = case.inputs() if inputs is None else inputs
    return [make_scaled(x, dtype, s) for x, s in zip(inputs, scales, strict=True)]


def reference(case: Case, args: Sequence[Any]) -> Any:
    """The plain function in float32 on the represented values."""
    return case.fn(*[jnp.asarray(represented(a), jnp.float32) for a in args])


def check_case(case: Case, dtype: Any, scales: Sequence[float], inputs: Any = None) -> None:
    """`autoscale(case.fn)` (no jit) on ScaledArrays with these scales against the reference."""
    args = scaled_args(case, dtype, scales, inputs)
    try:
        check_output(case, jsa.autoscale(case.fn)(*args), args, dtype)
    except AssertionError as err:
        raise AssertionError(
            f"{case.name}, {np.dtype(dtype)}, scales {list(scales)}: {err}"
        ) from None


def jit_scale_sets(case: Case, dtype: Any) -> list[tuple[float, ...]]:
    """The scale vectors of `batched_jit_outputs` this case is checked at."""
    n = len(case.inputs())
    sets = [(s,) * n for s in case.scales + (0.0,)]
    if n > 1:
        for lo, hi in itertools.permutations((2.0**-20, 1.0, 2.0**20), 2):
            if lo in case.scales and hi in case.scales:
                sets.append((lo,) + (hi,) * (n - 1))
    return [s for s in sets if case.accepts(dtype, s)]


def batched_jit_outputs(cases: Sequence[Case], dtype: Any) -> dict[tuple[str, tuple], Any]:
    """Outputs of every case at every scale vector, from ONE jit compilation per dtype.

    The scales are traced (a vector, one entry per operand: distinct tracers), so
    the compiled function serves every scale; it is traced with tracer-leak checks.
    """
    datas = {c.name: [np.asarray(x).astype(dtype) for x in c.inputs()] for c in cases}
    width = max(len(d) for d in datas.values())

    @jax.jit
    def all_cases(scales: Any, datas: Any) -> Any:
        out = {}
        for c in cases:
            args = [jsa.ScaledArray(d, scales[i]) for i, d in enumerate(datas[c.name])]
            out[c.name] = jsa.autoscale(c.fn)(*args)
        return out

    sets = sorted({s for c in cases for s in jit_scale_sets(c, dtype)}, key=str)
    results: dict[tuple[str, tuple], Any] = {}
    with default_config(jsa.AutoScaleConfig(check=True)), tracer_leak_checks():
        for scale_set in sets:
            vec = np.full(width, scale_set[-1], np.float32)
            vec[: len(scale_set)] = scale_set
            outs = all_cases(vec, datas)
            for c in cases:
                if scale_set in jit_scale_sets(c, dtype):
                    results[(c.name, scale_set)] = outs[c.name]
    return results


def _grad_weights(case: Case) -> np.ndarray:
    shape = np.shape(case.inputs()[0])
    return np.random.default_rng(0).uniform(0.5, 1.5, shape).astype(np.float32)


def batched_jit_grads(cases: Sequence[Case], dtype: Any) -> dict[tuple[str, float], Any]:
    """Gradients w.r.t. the data of `sum(f(x) * w)` for every case, one compilation per dtype."""
    cases = [c for c in cases if c.grad]
    datas = {c.name: [np.asarray(x).astype(dtype) for x in c.inputs()] for c in cases}

    @jax.jit
    def all_grads(scale: Any, datas: Any) -> Any:
        out = {}
        for c in cases:
            weights = _grad_weights(c)

            def loss(*ds: Any, fn: Any = c.fn, w: Any = weights) -> Any:
                out = jsa.autoscale(fn)(*[jsa.ScaledArray(d, scale) for d in ds])
                return jnp.sum(out.to_array(jnp.float32) * w)

            out[c.name] = jax.grad(loss, argnums=tuple(range(len(datas[c.name]))))(*datas[c.name])
        return out

    results: dict[tuple[str, float], Any] = {}
    with default_config(jsa.AutoScaleConfig(check=True)), tracer_leak_checks():
        for scale in GRAD_SCALES[np.dtype(dtype)]:
            outs = all_grads(np.float32(scale), datas)
            for c in cases:
                if scale in c.scales:
                    results[(c.name, scale)] = outs[c.name]
    return results


def check_grads(case: Case, dtype: Any, grads: dict[tuple[str, float], Any]) -> None:
    """Gradients w.r.t. the data equal the float32 gradients on the values times the scale."""
    weights = _grad_weights(case)
    checked = 0
    for scale in GRAD_SCALES[np.dtype(dtype)]:
        if (case.name, scale) not in grads:
            continue
        args = scaled_args(case, dtype, [scale] * len(case.inputs()))
        values = [jnp.asarray(represented(a), jnp.float32) for a in args]
        ref = jax.grad(
            lambda *v: jnp.sum(case.fn(*v) * weights), argnums=tuple(range(len(values)))
        )(*values)
        rtol = 4 * case.rtol * case.grad_rtol * RTOL[np.dtype(dtype)]
        for g, e in zip(grads[(case.name, scale)], ref, strict=True):
            try:
                assert_close(np.asarray(g, np.float64), np.asarray(e, np.float64) * scale, rtol)
            except AssertionError as err:
                raise AssertionError(f"{case.name}, scale {scale}: {err}") from None
        checked += 1
    assert checked, f"{case.name}: no gradient scale in {case.scales}"


def nonfinite_inputs(case: Case) -> list[np.ndarray]:
    """The case's inputs with inf, -inf and NaN at different places in each operand."""
    out = []
    for i, x in enumerate(case.inputs()):
        x = x.copy()
        specials = case.nonfinite
        x[3 * i + 2 : 3 * i + 2 + len(specials)] = specials
        out.append(x)
    return out


def middle_scale(scales: Sequence[float]) -> float:
    return min(scales, key=lambda s: abs(np.log2(s)))


def primitives_of(fn: Callable[..., Any], inputs: Sequence[np.ndarray]) -> set[str]:
    """Names of the primitives `fn` binds, sub-jaxprs included."""
    names: set[str] = set()

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    # A ClosedJaxpr (jit, scan...), or a bare Jaxpr (shard_map).
                    inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
                    if inner is not None:
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*inputs).jaxpr)
    return names


def check_table_covers(cases: Sequence[Case], registered: Sequence[Any]) -> None:
    covered: set[str] = set()
    for case in cases:
        covered |= primitives_of(case.fn, case.inputs())
    missing = sorted({p.name for p in registered} - covered)
    assert not missing, f"Rules without a table entry: {missing}"


# --- the checks each table runs ---------------------------------------------------------


def _in_turn(i: int, dtype: Any, dtypes: Sequence[Any]) -> tuple[Any, ...]:
    """The marks of case `i` with `dtype`: the default run holds each case with one of
    `dtypes`, the dtypes in turn over the cases; CI's slow step runs the others."""
    return () if list(dtypes).index(dtype) == i % len(dtypes) else (pytest.mark.slow,)


def grid_params(cases: Sequence[Case]) -> list[Any]:
    """(case, dtype) pairs for the eager grid: cases slow without jit run in float16 only
    (their other dtypes run every scale under jit). Eager, each operation compiles per
    dtype: the default run holds each other case with one dtype, in turn (every scale of
    the case; every dtype at every scale under jit too, and float32 in the gradients), the
    slow step the other dtypes."""
    params = []
    fast = 0
    for case in cases:
        for dtype in FLOAT_DTYPES:
            if case.slow_eager and dtype != F16:
                continue
            marks = () if case.slow_eager else _in_turn(fast, dtype, FLOAT_DTYPES)
            params.append(pytest.param(case, dtype, id=f"{case_id(case)}-{dtype}", marks=marks))
        fast += not case.slow_eager
    return params


def mixed_params(cases: Sequence[Case], dtypes: Sequence[Any]) -> list[Any]:
    """(case, dtype) pairs for mixed per-operand scales without jit (slow cases: jit only):
    the default run holds each case with one of `dtypes`, in turn; the slow step the
    others (the jit fixtures check mixed scales in float16)."""
    fast = [case for case in cases if not case.slow_eager]
    return [
        pytest.param(case, dtype, id=f"{case_id(case)}-{dtype}", marks=_in_turn(i, dtype, dtypes))
        for i, case in enumerate(fast)
        for dtype in dtypes
    ]


def grid_check(case: Case, dtype: Any) -> None:
    """Every scale of the case (for this dtype), and scale 0, without jit."""
    n = len(case.inputs())
    scales = case.scales_for(dtype)
    if case.slow_eager:  # float16 only (see grid_params); every scale runs under jit
        scales = (scales[0], middle_scale(scales), scales[-1])
    for scale in scales + (0.0,):
        check_case(case, dtype, [scale] * n)


def jit_check(case: Case, dtype: Any, outputs: dict[tuple[str, tuple], Any]) -> None:
    """Every scale of the case, scale 0 and mixed scales, under jit (batched outputs)."""
    for scales in jit_scale_sets(case, dtype):
        args = scaled_args(case, dtype, scales)
        try:
            check_output(case, outputs[(case.name, scales)], args, dtype)
        except AssertionError as err:
            raise AssertionError(f"{case.name}, {dtype}, scales {scales}: {err}") from None


def nonfinite_check(case: Case) -> None:
    """inf, -inf and NaN inputs, float16, at the smallest, middle and largest scales."""
    inputs = nonfinite_inputs(case)
    scales = case.scales_for(F16)
    chosen = (
        {middle_scale(scales)} if case.slow_eager else {scales[0], middle_scale(scales), scales[-1]}
    )
    for scale in sorted(chosen):
        check_case(case, F16, [scale] * len(inputs), inputs=inputs)


def mixed_check(case: Case, dtype: Any) -> None:
    """Different scales per operand (zero scales included), without jit."""
    n = len(case.inputs())
    lo, hi, mid = case.scales[0], case.scales[-1], middle_scale(case.scales)
    for first, other in ((lo, hi), (hi, lo), (mid, lo), (mid, hi), (lo, 0.0), (0.0, hi)):
        check_case(case, dtype, [first] + [other] * (n - 1))


# --- fixtures ------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _strict_autoscale(request: Any) -> Any:
    """tests/conftest.py's fixture, with tracer-leak checks left out of `eager` tests.

    Leak checks make eager dispatch about 100 times slower. Eager rules run on
    concrete values and trace nothing; every rule is traced with the checks on
    in the batched jit and grad fixtures.
    """
    leaks = "eager" not in request.fixturenames
    with default_config(jsa.AutoScaleConfig(check=True)):
        with tracer_leak_checks() if leaks else contextlib.nullcontext():
            yield


@pytest.fixture
def eager() -> None:
    """Marks a test as eager-only (see `_strict_autoscale`)."""


# --- the table-driven tests ----------------------------------------------------------------

GRAD_CASES = [c for c in ELEMENTWISE_CASES if c.grad]
MULTI_CASES = [c for c in ELEMENTWISE_CASES if len(c.inputs()) > 1]
NONFINITE_CASES = [c for c in ELEMENTWISE_CASES if c.nonfinite]


@pytest.fixture(scope="module", params=(F32, F16, BF16), ids=str)
def elementwise_jit(request: Any) -> Any:
    return request.param, batched_jit_outputs(ELEMENTWISE_CASES, request.param)


@pytest.fixture(scope="module", params=(F32, F16), ids=str)
def elementwise_grads(request: Any) -> Any:
    return request.param, batched_jit_grads(ELEMENTWISE_CASES, request.param)


@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("case,dtype", grid_params(ELEMENTWISE_CASES))
def test_elementwise_matches_plain(case, dtype):
    grid_check(case, dtype)


# Every case: the batched fixture computes all of a dtype's cases in one program.
@pytest.mark.every_case
@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("case", ELEMENTWISE_CASES, ids=case_id)
def test_elementwise_matches_plain_under_jit(case, elementwise_jit):
    jit_check(case, *elementwise_jit)


@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("case", NONFINITE_CASES, ids=case_id)
def test_elementwise_inf_nan_as_plain(case):
    nonfinite_check(case)


@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("case,dtype", mixed_params(MULTI_CASES, (F32, BF16)))
def test_elementwise_different_scales_per_operand(case, dtype):
    mixed_check(case, dtype)


# Every case: the batched fixture computes all of a dtype's cases in one program.
@pytest.mark.every_case
@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("case", GRAD_CASES, ids=case_id)
def test_elementwise_grad(case, elementwise_grads):
    dtype, grads = elementwise_grads
    check_grads(case, dtype, grads)


def test_table_covers_every_elementwise_rule():
    check_table_covers(ELEMENTWISE_CASES, elementwise.REGISTERED)


# --- specific behaviours -------------------------------------------------------------------

FP16_WIDE = np.array([1.0, 1.5, -1.75, 1.25, 1.875, -1.125], np.float16)


@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("exponent", (20, -20))
def test_fp16_values_beyond_fp16_range_are_accurate(exponent):
    """Values 2^20 or 2^-20 (out of float16's normal range) held as float16 data."""
    scale = 2.0**exponent
    x = make_scaled(FP16_WIDE, F16, scale)
    y = make_scaled(FP16_WIDE[::-1].copy(), F16, scale)
    value_x, value_y = represented(x), represented(y)
    fns = {
        "mul": (lambda a, b: a * b, value_x * value_y),
        "add": (lambda a, b: a + b, value_x + value_y),
        "sub": (lambda a, b: a - b, value_x - value_y),
        "div": (lambda a, b: a / b, value_x / value_y),
        "sqrt": (lambda a, b: jnp.sqrt(jnp.abs(a)), np.sqrt(np.abs(value_x))),
        "square": (lambda a, b: a**2, value_x**2),
    }
    for name, (fn, expected) in fns.items():
        out = jsa.autoscale(fn)(x, y)
        assert isinstance(out, jsa.ScaledArray) and out.dtype == F16, name
        assert np.all(np.isfinite(represented(out))), name
        assert_close(out, expected, RTOL[F16])
        # Plain float16 on these values overflows or underflows.
        plain_x = jnp.asarray(value_x, jnp.float32).astype(F16)
        plain_y = jnp.asarray(value_y, jnp.float32).astype(F16)
        plain = np.asarray(fn(plain_x, plain_y), np.float64)
        if name in ("mul", "square"):
            assert not np.allclose(plain, expected, rtol=1e-2, atol=0), name


def test_comparisons_use_data_directly_when_scales_are_the_same():
    da = np.array([1.0, 2.0, 3.0], np.float16)
    db = np.array([2.0, 2.0, 1.0], np.float16)
    scale = np.float32(2.0**-20)

    def fn(a, b):
        return a < b, a == b, a >= a

    def with_constant_scales(a, b):
        # Two equal constant scales: known equal when tracing.
        return jsa.autoscale(fn)(jsa.ScaledArray(a, scale), jsa.ScaledArray(b, np.float32(scale)))

    def with_traced_scales(a, b, sa, sb):
        # `a >= a`: the same tracer; `a < b`: different tracers, equal only at run time.
        return jsa.autoscale(fn)(jsa.ScaledArray(a, sa), jsa.ScaledArray(b, sb))

    # Same scale: no conversion of the data to float32.
    assert "convert_element_type" not in str(jax.make_jaxpr(with_constant_scales)(da, db))
    jaxpr = jax.make_jaxpr(with_traced_scales)(da, db, scale, scale)
    assert "convert_element_type" in str(jaxpr)
    for out in (
        with_constant_scales(da, db),
        jax.jit(with_traced_scales)(da, db, scale, scale),
        jax.jit(with_traced_scales)(da, db * 2, scale, scale / 2),
    ):
        lt, eq, ge = out
        np.testing.assert_array_equal(lt, [True, False, False])
        np.testing.assert_array_equal(eq, [False, True, False])
        np.testing.assert_array_equal(ge, [True, True, True])


@pytest.mark.usefixtures("eager")
def test_comparisons_at_far_apart_scales():
    x = make_scaled(np.array([1.0, -1.0, 3.0, 0.0]), F16, 2.0**-60)
    y = make_scaled(np.array([1.0, 1.0, 0.0, 0.0]), F16, 2.0**60)
    for use_jit in (False, True):
        fn = jsa.autoscale(lambda a, b: (a < b, a > b, a == b, a == 0.0))
        fn = jax.jit(fn) if use_jit else fn
        lt, gt, eq, zero = fn(x, y)
        np.testing.assert_array_equal(lt, [True, True, False, False])
        np.testing.assert_array_equal(gt, [False, False, True, False])
        np.testing.assert_array_equal(eq, [False, False, False, True])
        np.testing.assert_array_equal(zero, [False, False, False, True])


def test_comparison_of_zero_scales_compares_zeros():
    x = make_scaled(np.array([1.0, 2.0]), F16, 0.0)
    y = make_scaled(np.array([3.0, -2.0]), F16, 0.0)
    fn = jsa.autoscale(lambda a, b: (a == b, a < b, a == a))
    for f in (fn, jax.jit(fn)):
        eq, lt, same = f(x, y)
        np.testing.assert_array_equal(eq, [True, True])
        np.testing.assert_array_equal(lt, [False, False])
        np.testing.assert_array_equal(same, [True, True])


@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("use_jit", (False, True))
def test_div_by_zero_scale_gives_inf_and_nan_as_plain(use_jit):
    a = make_scaled(np.array([1.0, -2.0, 0.0, 3.0]), F16, 2.0**10)
    b = make_scaled(np.array([1.0, 1.0, 1.0, -1.0]), F16, 0.0)
    fn = jsa.autoscale(lambda p, q: p / q)
    fn = jax.jit(fn) if use_jit else fn
    out = fn(a, b)
    expected = np.array([np.inf, -np.inf, np.nan, -np.inf])
    np.testing.assert_array_equal(represented(out), expected)
    # And its gradient stays finite where the divisor is not zero.
    g = jax.grad(
        lambda d: jsa.autoscale(lambda p, q: jnp.sum(p / q))(
            jsa.ScaledArray(d, a.scale), make_scaled(np.ones(4), F16, 1.0)
        ).to_array(jnp.float32)
    )(a.data)
    assert np.all(np.isfinite(np.asarray(g, np.float32)))


@pytest.mark.parametrize("use_jit", (False, True))
def test_clip_of_small_scale_values_by_constants_keeps_precision(use_jit):
    data = np.random.default_rng(1).normal(size=16)
    x = make_scaled(data, F16, 2.0**-20)
    fn = jsa.autoscale(lambda v: jnp.clip(v, -1.0, 1.0))
    out = (jax.jit(fn) if use_jit else fn)(x)
    assert float(out.scale) <= 2.0**-18
    assert_close(out, represented(x), RTOL[F16])


def test_rsqrt_of_zero_scale_is_inf():
    x = make_scaled(np.array([1.0, 2.0]), F16, 0.0)
    out = jsa.autoscale(lax.rsqrt)(x)
    np.testing.assert_array_equal(represented(out), [np.inf, np.inf])


def test_ceil_of_tiny_value_does_not_overflow_the_data():
    x = make_scaled(np.array([0.5, -0.5, 1.5]), F16, 2.0**-20)
    out = jsa.autoscale(jnp.ceil)(x)
    np.testing.assert_array_equal(represented(out), [1.0, -0.0, 1.0])
    out = jsa.autoscale(jnp.floor)(x)
    np.testing.assert_array_equal(represented(out), [0.0, -1.0, 0.0])


def test_nextafter_steps_one_ulp_of_the_data_format():
    data = np.array([1.0, 1.0, -2.0, 0.0], np.float16)
    x = make_scaled(data, F16, 2.0**30)
    y = make_scaled(np.array([2.0, 0.5, -2.0, 1.0]), F16, 2.0**30)
    out = jsa.autoscale(lax.nextafter)(x, y)
    expected = np.nextafter(data, np.array([np.inf, -np.inf, -2.0, np.inf], np.float16))
    np.testing.assert_array_equal(np.asarray(out.data), expected)
    assert float(out.scale) == 2.0**30


@pytest.mark.parametrize("use_jit", (False, True), ids=("eager", "jit"))
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_nextafter_in_fp8_formats(dtype, use_jit):
    """Steps of one ulp of FP8 data, as plain `nextafter` on the data: float8_e4m3fn has
    no infinity (it casts inf to NaN), so the step up or down aims at its largest value.
    (The rule aimed at inf: every step of e4m3fn data was NaN.)"""
    dtype = np.dtype(getattr(ml_dtypes, dtype))
    rng = np.random.default_rng(12)
    data = rng.normal(size=(32,)).astype(dtype)
    towards = rng.normal(size=(32,)).astype(dtype)
    towards[:4] = data[:4]  # equal values: the data itself
    fn = jsa.autoscale(lax.nextafter)
    for scale in (2.0**-20, 1.0, 2.0**20):
        out = (jax.jit(fn) if use_jit else fn)(
            jsa.scaled_array(data, scale), jsa.scaled_array(towards, scale)
        )
        assert out.dtype == dtype and float(out.scale) == scale
        np.testing.assert_array_equal(
            np.asarray(out.data, np.float32), np.asarray(lax.nextafter(data, towards), np.float32)
        )


def test_reduce_precision_rounds_the_value_not_the_data():
    # 2^-20 is below float16's normal range: as a value, e5m10 makes it subnormal / zero.
    x = make_scaled(np.array([1.0, 1.0 + 2.0**-10, 1.5]), F16, 2.0**-30)
    out = jsa.autoscale(lambda v: lax.reduce_precision(v, 5, 10))(x)
    expected = lax.reduce_precision(jnp.asarray(represented(x), jnp.float32), 5, 10)
    np.testing.assert_array_equal(represented(out), np.asarray(expected, np.float64))
    assert np.all(represented(out) == 0)
    # Above the format's range: inf.
    x = make_scaled(np.array([1.0, -1.0]), F16, 2.0**20)
    out = jsa.autoscale(lambda v: lax.reduce_precision(v, 5, 10))(x)
    np.testing.assert_array_equal(represented(out), [np.inf, -np.inf])


@pytest.mark.parametrize("use_jit", (False, True))
def test_reciprocal_of_values_out_of_fp16_range(use_jit):
    """1/x of values ~2^-32 (unit-range float16 data at scale 2^-20): 2^32, no overflow."""
    x = make_scaled(np.array([2.0**-12, 1.0, -4.0, 2.0**15]), F16, 2.0**-20)
    fn = jsa.autoscale(jnp.reciprocal)
    out = (jax.jit(fn) if use_jit else fn)(x)
    np.testing.assert_allclose(represented(out), 1 / represented(x), rtol=RTOL[F16])


def test_copysign_composite():
    """`jnp.copysign` is a composite (signbit through bitcast_convert_type, abs, select_n)."""
    inputs = [np.array([1.0, -2.0, 3.0, -4.0]), np.array([-1.0, 1.0, 0.5, -0.25])]
    for scale in (2.0**-20, 2.0**20):
        check_autoscale_matches(jnp.copysign, inputs, F16, scale, use_jit=False)
        check_autoscale_matches(jnp.signbit, inputs[:1], F16, scale, use_jit=False)


@pytest.mark.parametrize("use_jit", (False, True), ids=("eager", "jit"))
def test_products_beyond_float32_overflow_elementwise_like_plain(use_jit):
    """A scale product beyond float32's range moves into the data: values overflow to +-inf
    (zeros stay zeros) as plain float32 does, and no later rescale turns them into NaN."""
    big = make_scaled(np.array([0.0, 1.5, -1.0]), np.float16, 2.0**100)

    def fn(x, y):
        product = x * y  # 2^200: beyond float32
        return product, product + x, jnp.dot(x, y), x**3, jnp.square(x)

    scaled_fn = jax.jit(jsa.autoscale(fn)) if use_jit else jsa.autoscale(fn)
    outs = scaled_fn(big, big)
    value = jnp.asarray(represented(big), jnp.float32)
    for out, expected in zip(outs, fn(value, value), strict=True):
        got = np.asarray(out.to_array(np.float32))
        assert float(out.scale) < np.inf
        np.testing.assert_array_equal(got, np.asarray(expected))

    # Data far from unit range: the value is fine in float32 although the scales' product
    # is not (2^-40 * 2^100 squared is 2^120).
    far = make_scaled(np.array([2.0**-40, -(2.0**-40)]), np.float32, 2.0**100)
    np.testing.assert_array_equal(
        np.asarray(scaled_fn(far, far)[0].to_array()), np.array([2.0**120, 2.0**120], np.float32)
    )


@pytest.mark.parametrize(
    "scale_shape, use_jit",
    # Eagerly per row in the default run (the same rule as per tensor); the slow step runs
    # per tensor eagerly.
    [
        pytest.param((), False, id="per_tensor-eager", marks=pytest.mark.slow),
        pytest.param((), True, id="per_tensor-jit"),
        pytest.param((2, 1), False, id="per_row-eager"),
        pytest.param((2, 1), True, id="per_row-jit"),
    ],
)
def test_select_by_a_scalar_predicate_returns_the_case_as_it_is(scale_shape, use_jit):
    """`lax.select(pred, a, b)` with a scalar `pred` (jmp's `select_tree`, a skipped step):
    the chosen case's data and scale, bit for bit, however far apart the cases' scales;
    a predicate per element still selects at a common scale."""
    rng = np.random.default_rng(3)
    # Built under one jit (the eager function: tests/core/test_block_scales.py).
    a = as_scaled_array_jit(rng.normal(size=(2, 4)) * 2.0**-20, scale_shape=scale_shape)
    b = as_scaled_array_jit(rng.normal(size=(2, 4)) * 2.0**9, scale_shape=scale_shape)
    a, b = (jsa.ScaledArray(x.data.astype(np.float16), x.scale) for x in (a, b))
    select = jsa.autoscale(lambda p, x, y: lax.select(p, x, y))
    select = jax.jit(select) if use_jit else select
    for pred, chosen in ((True, a), (False, b)):
        out = select(jnp.asarray(pred), a, b)
        np.testing.assert_array_equal(np.asarray(out.data), np.asarray(chosen.data))
        np.testing.assert_array_equal(np.asarray(out.scale), np.asarray(chosen.scale))
    mask = jnp.asarray([[True, False, True, False]] * 2)
    out = select(mask, a, b)
    want = np.where(np.asarray(mask), represented(a), represented(b))
    assert_close(out, want, RTOL[F16])


@pytest.mark.parametrize(
    "primitive, family, binary",
    [
        (lax.sub_p, "add", True),
        (lax.min_p, "common scale", True),
        (lax.ge_p, "unscaled output", True),
        (lax.reduce_min_p, "linear", False),
        (lax.scatter_sub_p, "common scale", False),
        (lax.approx_top_k_p, "sort", False),
    ],
)
def test_family_rule_made_for_each_primitive(primitive: Any, family: str, binary: bool) -> None:
    """A rule factory registered for several primitives (`lax.base.register_each`) gives
    each its own rule, named for it (the operator listing shows the names); through
    autoscale a binary one computes its own primitive, not a sibling's."""
    info = registry.get_scaled_rule(primitive)
    assert (info.rule.__name__, info.family) == (f"scaled_{primitive.name}", family)
    if binary:
        a, b = jsa.scaled_array([1.0, 2.0], 2.0), jsa.scaled_array([3.0, 1.0], 0.5)
        out = jsa.autoscale(primitive.bind)(a, b)
        want = primitive.bind(represented(a), represented(b))
        np.testing.assert_array_equal(np.asarray(represented(out)), np.asarray(want))


def test_max_with_zero_keeps_the_scale_object():
    """max(x, 0) is x or 0: x's scale as it is (no scale arithmetic, later adds with x share it)."""
    x = make_scaled(np.array([1.0, -2.0, 0.5], np.float32), F16, 2.0**-20)
    jaxpr = jax.make_jaxpr(jsa.autoscale(lambda a: jnp.maximum(a, 0.0) + a))(x)
    assert "common_scale" not in str(jaxpr)


def test_clip_of_an_infinity_at_a_scale_too_small_for_the_bound_stays_infinite():
    """The documented trade-off (docs/design.md, numerical rules): at float16 scale 2^-20
    the bound 3 does not fit x's data, so the output keeps x's scale (the finite elements'
    precision) and an infinity stays infinite; where the bound fits, it is the bound."""
    values = np.array([np.inf, -np.inf, 0.25, np.nan], np.float32)
    fn = jax.jit(jsa.autoscale(lambda a: jnp.clip(a, -3.0, 3.0)))
    tiny = fn(make_scaled(values, F16, 2.0**-20))
    assert float(tiny.scale) == 2.0**-20
    np.testing.assert_array_equal(represented(tiny)[:2], [np.inf, -np.inf])
    fits = represented(fn(make_scaled(values, F16, 2.0**-8)))
    np.testing.assert_array_equal(fits[:3], [3.0, -3.0, 0.25 * 2.0**-8])
    assert np.isnan(fits[3])
