"""Property-based tests (hypothesis) of the scaled arithmetic and comparison rules.

Random data, random power-of-two scales in [2^-60, 2^60] (one per operand),
float32 / float16 / bfloat16 data: `autoscale(op)` equals `op` applied in float32
to the represented values.

The data are those of well-scaled arrays: magnitudes in [2^-6, 2^7) (and zeros).
With such data the static output scales of mul and div cannot overflow float16
data (|product| < 2^14, |quotient| < 2^13); far larger data can (see the
elementwise rules). Tolerances:

- mul, div, neg, abs: relative, per element (a few ulps of the data dtype);
- add, sub, max, min: relative to the largest input magnitude too, and at least
  the smallest step of the data format at the larger input scale: their output
  scale comes from the input scales (a result much smaller than the inputs, by
  cancellation or from the smaller-scale operand, is held with the absolute
  precision of the larger scale, even when that operand's values are all zero);
- comparisons: exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from jax import lax

import jax_scaled_arithmetics as jsa
from tests.helpers import FLOAT_DTYPES, RTOL, make_scaled, represented
from tests.lax.test_elementwise import (
    _strict_autoscale,  # noqa: F401  (autouse fixture)
    eager,  # noqa: F401  (fixture)
)

SIZE = 6
PROPERTY_SETTINGS = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

dtypes = st.sampled_from(FLOAT_DTYPES)
scales = st.integers(-60, 60).map(lambda e: 2.0**e)
# Magnitudes in [2^-6, 2^7), both signs, and some zeros.
elements = st.one_of(
    st.just(0.0),
    st.tuples(
        st.sampled_from((-1.0, 1.0)), st.floats(1.0, 2.0, exclude_max=True), st.integers(-6, 6)
    ).map(lambda t: t[0] * t[1] * 2.0 ** t[2]),
)
datas = st.lists(elements, min_size=SIZE, max_size=SIZE).map(np.array)

ARITHMETIC = {
    "add": (lax.add, "inputs"),
    "sub": (lax.sub, "inputs"),
    "max": (lax.max, "inputs"),
    "min": (lax.min, "inputs"),
    "mul": (lax.mul, "elementwise"),
    "div": (lax.div, "elementwise"),
}
COMPARISONS = {
    "eq": lax.eq,
    "ne": lax.ne,
    "lt": lax.lt,
    "le": lax.le,
    "gt": lax.gt,
    "ge": lax.ge,
}
# One jitted function per operation, reused by every example (scales are traced).
JITTED = {name: jax.jit(jsa.autoscale(fn)) for name, (fn, _) in ARITHMETIC.items()}
JITTED.update({name: jax.jit(jsa.autoscale(fn)) for name, fn in COMPARISONS.items()})


def _rtol(dtype) -> float:
    return 2 * RTOL[np.dtype(dtype)]


def _check_close(out, expected, dtype, atol: float = 0.0) -> None:
    """|out - expected| <= rtol * |expected| + atol, NaNs and infs equal."""
    assert isinstance(out, jsa.ScaledArray) and out.dtype == np.dtype(dtype)
    actual = represented(out)
    expected = np.asarray(expected, np.float64)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(actual[~finite], expected[~finite])
    atol = max(atol, float(np.finfo(np.float32).tiny))
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=_rtol(dtype), atol=atol)


def _inputs_atol(a, b, dtype) -> float:
    """rtol * the largest input, and at least the data format's smallest step at the larger
    scale (an operand whose values are all zero still sets the output scale)."""
    values = np.abs(np.concatenate([represented(a), represented(b)]))
    quantum = float(ml_dtypes.finfo(dtype).smallest_subnormal) * float(max(a.scale, b.scale))
    return max(_rtol(dtype) * float(values.max()), 2 * quantum)


def _values(*xs):
    return [jnp.asarray(represented(x), jnp.float32) for x in xs]


@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("use_jit", (False, True), ids=("eager", "jit"))
@pytest.mark.parametrize("name", sorted(ARITHMETIC))
@PROPERTY_SETTINGS
@given(dtype=dtypes, da=datas, db=datas, sa=scales, sb=scales)
def test_binary_arithmetic_matches_float32(name, use_jit, dtype, da, db, sa, sb):
    fn, tolerance = ARITHMETIC[name]
    if name == "div":
        db = np.where(db == 0, 1.0, db)
    a, b = make_scaled(da, dtype, sa), make_scaled(db, dtype, sb)
    expected = fn(*_values(a, b))
    # Only where the float32 reference is representable (a product of values near 2^60
    # overflows float32, while its scaled representation need not).
    assume(bool(np.all(np.isfinite(np.asarray(expected)))))
    out = (JITTED[name] if use_jit else jsa.autoscale(fn))(a, b)
    atol = _inputs_atol(a, b, dtype) if tolerance == "inputs" else 0.0
    _check_close(out, expected, dtype, atol)


@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("name", ("neg", "abs"))
@PROPERTY_SETTINGS
@given(dtype=dtypes, data=datas, scale=scales)
def test_unary_arithmetic_is_exact(name, dtype, data, scale):
    fn = {"neg": lax.neg, "abs": lax.abs}[name]
    x = make_scaled(data, dtype, scale)
    out = jsa.autoscale(fn)(x)
    assert isinstance(out, jsa.ScaledArray) and out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(represented(out), np.asarray(fn(*_values(x)), np.float64))


@st.composite
def comparison_operands(draw):
    """Two operands; in about half the examples, with values partly equal, held at
    different scales (data shifted by a power of two)."""
    dtype = draw(dtypes)
    da, sa, db = draw(datas), draw(scales), draw(datas)
    if draw(st.booleans()):
        shift = draw(st.integers(-4, 4))
        equal = np.array(draw(st.lists(st.booleans(), min_size=SIZE, max_size=SIZE)))
        db = np.where(equal, da, db) * 2.0**shift
        sb = sa * 2.0**-shift
    else:
        sb = draw(scales)
    return dtype, make_scaled(da, dtype, sa), make_scaled(db, dtype, sb)


@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("use_jit", (False, True), ids=("eager", "jit"))
@pytest.mark.parametrize("name", sorted(COMPARISONS))
@PROPERTY_SETTINGS
@given(operands=comparison_operands())
def test_comparisons_match_float32_exactly(name, use_jit, operands):
    dtype, a, b = operands
    fn = COMPARISONS[name]
    out = (JITTED[name] if use_jit else jsa.autoscale(fn))(a, b)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(fn(*_values(a, b))))
    # Against itself (the same scale object: data compared directly).
    same = jsa.autoscale(lambda x: fn(x, x))(a)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(fn(*_values(a, a))))


@pytest.mark.usefixtures("eager")
@PROPERTY_SETTINGS
@given(dtype=dtypes, da=datas, db=datas, sa=scales, sb=scales)
def test_add_then_sub_recovers_within_tolerance(dtype, da, db, sa, sb):
    """(a + b) - b == a, relative to the largest input (composition of two scaled rules)."""
    a, b = make_scaled(da, dtype, sa), make_scaled(db, dtype, sb)
    out = jsa.autoscale(lambda x, y: (x + y) - y)(a, b)
    _check_close(out, represented(a), dtype, 2 * _inputs_atol(a, b, dtype))


# --- a scalar predicate selects one branch as it is ----------------------------------------


def _cond(pred, a, b):
    return lax.cond(pred, lambda: a, lambda: b)


SELECTS = {
    "select_n": lambda pred, a, b: lax.select_n(pred, b, a),
    "where": jnp.where,
    "select_tree": lambda pred, a, b: jsa.mp.select_tree(pred, {"x": a}, {"x": b})["x"],
    "cond": _cond,
}
_SELECTS_JIT = {name: jax.jit(jsa.autoscale(fn)) for name, fn in SELECTS.items()}
# Any positive finite float32 scale (a mantissa too, not only powers of two), far apart.
any_scales = st.tuples(st.floats(1.0, 2.0, exclude_max=True), st.integers(-120, 120)).map(
    lambda t: float(np.float32(t[0] * 2.0 ** t[1]))
)


@PROPERTY_SETTINGS
@given(
    name=st.sampled_from(sorted(SELECTS)),
    dtype=dtypes,
    data_a=datas,
    data_b=datas,
    scale_a=any_scales,
    scale_b=any_scales,
    pred=st.booleans(),
    use_jit=st.booleans(),
)
def test_a_scalar_predicate_returns_one_branch_bit_for_bit(
    name, dtype, data_a, data_b, scale_a, scale_b, pred, use_jit
):
    """`select_n`, `jnp.where`, `jsa.mp.select_tree` and `lax.cond` between two ScaledArrays
    with a scalar predicate, under `autoscale`: the chosen branch's data and scale, bit for
    bit (a skipped training step keeps its state exactly), whatever the two scales."""
    a, b = make_scaled(data_a, dtype, scale_a), make_scaled(data_b, dtype, scale_b)
    select = _SELECTS_JIT[name] if use_jit else jsa.autoscale(SELECTS[name])
    out = select(jnp.asarray(pred), a, b)
    chosen = a if pred else b
    assert isinstance(out, jsa.ScaledArray) and out.dtype == np.dtype(dtype)
    for got, want in ((out.data, chosen.data), (out.scale, chosen.scale)):
        got, want = np.asarray(got), np.asarray(want)
        assert (got.dtype, got.shape, got.tobytes()) == (want.dtype, want.shape, want.tobytes())
