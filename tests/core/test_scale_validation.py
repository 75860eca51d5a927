"""Bad scales at every entry point: a clear error or a documented result, in bounded time.

Property tests (hypothesis) over the kinds of bad scale (NaN, +-inf, negative, zero,
not a power of two, integer dtype, wrong shape), data dtypes and magnitudes, for each way
a scale enters the library: `jsa.scaled_array`, `jsa.as_scaled_array`, a ScaledArray
built with the unchecked constructor and given to `jsa.autoscale` (eager, and under
`jax.jit`), `jsa.ops.dynamic_rescale_*`, `jsa.lax.set_scaling`, `jsa.lax.rebalance`, and
block scales. The contract is in docs/design.md, "What is checked where".
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_scaled_arithmetics as jsa
from tests.helpers import FLOAT_DTYPES, represented

SETTINGS = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
TIME_BOUND_S = 60.0

dtypes = st.sampled_from(FLOAT_DTYPES)
exponents = st.integers(-100, 100)
# Scales no value can be represented with.
invalid = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf]),
    exponents.map(lambda e: -(2.0**e)),
    st.floats(-1e30, -1e-30),
)
FUNCTIONS: dict[str, Callable[[Any], Any]] = {
    "mul": lambda a: a * 2.0,
    "add": lambda a: a + a,
    "tanh": jnp.tanh,
    "sum": jnp.sum,
    "matmul": lambda a: a @ a.T,
    "exp": jnp.exp,
}
# autoscale and jit(autoscale) of each function, built once: the examples of a property
# share a compile per dtype and scale shape (the scale values are arguments).
SCALED = {name: jsa.autoscale(fn) for name, fn in FUNCTIONS.items()}
JITTED = {name: jax.jit(fn) for name, fn in SCALED.items()}


def all_functions(a: Any) -> dict[str, Any]:
    return {name: fn(a) for name, fn in FUNCTIONS.items()}


# Every function in one program (eager: the same rules, one by one), and its reference.
SCALED_ALL = jsa.autoscale(all_functions)
JITTED_ALL = jax.jit(SCALED_ALL)
PLAIN_ALL = jax.jit(all_functions)


def within_time_bound(fn: Callable[[], Any]) -> Any:
    """`fn()`'s result, or its exception re-raised; fails the test if it has not ended
    after TIME_BOUND_S (a hang: the thread is left behind, the test fails)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = jax.block_until_ready(fn())
        except BaseException as error:  # noqa: BLE001  (re-raised below)
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(TIME_BOUND_S)
    assert not thread.is_alive(), f"did not end within {TIME_BOUND_S} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def data_of(dtype: Any, shape: tuple[int, ...] = (2, 4)) -> np.ndarray:
    values = np.array([1.0, -2.0, 0.5, 3.0, -0.25, 1.5, 0.0, -4.0], np.float32)
    return values[: int(np.prod(shape))].reshape(shape).astype(dtype)


# --- the checked constructors --------------------------------------------------------------


@SETTINGS
@given(bad=invalid, dtype=dtypes, block=st.booleans())
def test_constructors_refuse_nan_inf_and_negative_scales(bad, dtype, block):
    data = data_of(dtype)
    scale = np.array([[1.0], [bad]], np.float32) if block else np.float32(bad)
    for build in (
        lambda: jsa.scaled_array(data, scale),
        lambda: jsa.as_scaled_array(data, scale=scale),
        lambda: jsa.as_scaled_array(jnp.asarray(data), scale=jnp.asarray(scale)),
    ):
        with pytest.raises(ValueError, match="scale must be finite and non-negative, but it"):
            within_time_bound(build)


def test_constructor_messages_name_the_bad_value_and_block():
    with pytest.raises(ValueError, match=r"it is inf \(infinite\)"):
        jsa.as_scaled_array(np.array([1.0, -2.0, 3.0]), scale=math.inf)
    with pytest.raises(ValueError, match=r"it has 1 NaN block\(s\), the first at \(1, 0\)"):
        jsa.scaled_array(np.ones((2, 4), np.float32), np.array([[1.0], [math.nan]], np.float32))
    with pytest.raises(ValueError, match=r"it has 2 negative block\(s\), the first at \(0, 1\)"):
        jsa.scaled_array(np.ones((2, 4), np.float32), np.array([[1.0, -1.0], [-2.0, 1.0]]))


@SETTINGS
@given(dtype=dtypes, block=st.booleans())
def test_a_zero_scale_represents_zeros(dtype, block):
    data = data_of(dtype)
    scale = np.array([[0.0], [2.0]], np.float32) if block else np.float32(0.0)
    x = jsa.scaled_array(data, scale)
    expected = np.where(np.asarray(scale).reshape(-1, 1) == 0, 0.0, data.astype(np.float64) * 2)
    np.testing.assert_array_equal(represented(x), expected)
    # as_scaled_array divides by the scale: a zero scale's blocks get zero data (not NaN).
    y = jsa.as_scaled_array(data.astype(np.float32), scale=scale)
    zero_blocks = np.broadcast_to(np.asarray(scale).reshape(-1, 1) == 0, data.shape)
    np.testing.assert_array_equal(np.asarray(y.data)[zero_blocks], 0.0)
    np.testing.assert_array_equal(
        represented(y), np.where(zero_blocks, 0.0, data.astype(np.float64))
    )
    # Through autoscale, eager and jitted: what the plain function gives on zeros.
    references = PLAIN_ALL(jnp.asarray(represented(x), jnp.float32))
    for run in (SCALED_ALL, JITTED_ALL):
        outs = within_time_bound(functools.partial(run, x))
        for name, reference in references.items():
            np.testing.assert_allclose(
                represented(outs[name]), np.asarray(reference, np.float64), rtol=2e-2, err_msg=name
            )


@SETTINGS
@given(dtype=dtypes, mantissa=st.floats(1.01, 1.99), exponent=st.integers(-40, 40))
def test_scales_that_are_not_powers_of_two_are_accepted_and_computed_with(
    dtype, mantissa, exponent
):
    """Scales are powers of two by default (exact rescaling), not by requirement."""
    scale = np.float32(mantissa * 2.0**exponent)
    x = jsa.scaled_array(data_of(dtype), scale)
    np.testing.assert_array_equal(represented(x), data_of(dtype).astype(np.float64) * scale)
    for run in (SCALED["mul"], JITTED["mul"]):
        out = within_time_bound(functools.partial(run, x))
        np.testing.assert_allclose(represented(out), 2 * represented(x), rtol=1e-2)


def test_wrong_dtype_and_shape_are_type_and_value_errors():
    with pytest.raises(TypeError, match="scale must have a floating dtype, got int32"):
        jsa.scaled_array(np.ones(4, np.float32), np.int32(2))
    with pytest.raises(TypeError, match="as_scaled_array scale must be floating point"):
        jsa.as_scaled_array(np.ones(4, np.float32), scale=np.int32(2))
    with pytest.raises(ValueError, match=r"scale of shape \(3,\) does not broadcast"):
        jsa.scaled_array(np.ones((2, 4), np.float32), np.ones(3, np.float32))
    with pytest.raises(TypeError, match="data must have a floating dtype"):
        jsa.scaled_array(np.ones(4, np.int32), 1.0)


# --- the unchecked constructor given to autoscale -------------------------------------------


@SETTINGS
@given(bad=invalid, dtype=dtypes, block=st.booleans(), name=st.sampled_from(sorted(FUNCTIONS)))
def test_autoscale_refuses_a_bad_concrete_scale_naming_the_argument(bad, dtype, block, name):
    scale = jnp.array([[1.0], [bad]], jnp.float32) if block else jnp.float32(bad)
    x = jsa.ScaledArray(jnp.asarray(data_of(dtype)), scale)  # the unchecked constructor
    run = jsa.autoscale(lambda params: FUNCTIONS[name](params["w"]))
    with pytest.raises(ValueError, match=r"autoscale input argument 0\['w'\]: ScaledArray scale"):
        within_time_bound(lambda: run({"w": x}))


def test_a_negative_scale_no_longer_hangs_autoscale():
    # Was an endless loop in lax/scale_algebra.py (`_multiply_static`) when called eagerly.
    x = jsa.ScaledArray(jnp.ones(3), -1.0)
    with pytest.raises(ValueError, match=r"argument 0: ScaledArray scale is -1.0 \(negative\)"):
        within_time_bound(lambda: jsa.autoscale(lambda a: a * 2.0)(x))


@SETTINGS
@given(bad=invalid, dtype=dtypes, name=st.sampled_from(sorted(FUNCTIONS)))
def test_under_jit_a_traced_bad_scale_is_not_checked_but_every_call_ends(bad, dtype, name):
    """Inside `jax.jit` a scale's value is not known: autoscale cannot check it (the
    documented contract: the values are unspecified). It must still end."""
    x = jsa.ScaledArray(jnp.asarray(data_of(dtype)), jnp.float32(bad))
    out = within_time_bound(lambda: JITTED[name](x))
    assert isinstance(out, jsa.ScaledArray)


def test_mx_nan_blocks_are_refused_by_autoscale_with_their_position():
    from jax_scaled_arithmetics.quantization import block_quantize

    values = np.ones((2, 64), np.float32)
    values[1, 40] = np.nan
    view = block_quantize(values, "mxfp8_e4m3").to_scaled_array()
    with pytest.raises(ValueError, match=r"has 1 NaN block\(s\), the first at \(1, 1\)"):
        jsa.autoscale(lambda a: a * 2.0)(view)


# --- dynamic rescaling, set_scaling, rebalance ----------------------------------------------

RESCALES = [jsa.ops.dynamic_rescale_max, jsa.ops.dynamic_rescale_l1, jsa.ops.dynamic_rescale_l2]


@SETTINGS
@given(bad=invalid, dtype=dtypes, rescale=st.sampled_from(RESCALES))
def test_dynamic_rescale_refuses_bad_scales_and_epsilons(bad, dtype, rescale):
    x = jsa.ScaledArray(jnp.asarray(data_of(dtype)), jnp.float32(bad))
    with pytest.raises(ValueError, match="autoscale input argument 0: ScaledArray scale"):
        within_time_bound(lambda: rescale(x))
    good = jsa.as_scaled_array(jnp.asarray(data_of(dtype)))
    for epsilon in (bad, 0.0):
        with pytest.raises(ValueError, match="epsilon must be finite and positive"):
            rescale(good, epsilon)
        with pytest.raises(ValueError, match="epsilon must be finite and positive"):
            jsa.ops.dynamic_rescale_max_grad(good, epsilon)


@SETTINGS
@given(bad=st.one_of(invalid, st.just(0.0)), dtype=dtypes)
def test_set_scaling_and_rebalance_refuse_a_known_bad_scale_or_factor(bad, dtype):
    x = jsa.as_scaled_array(jnp.asarray(data_of(dtype)))
    with pytest.raises(ValueError, match="set_scaling: the scale must be finite and positive"):
        within_time_bound(lambda: jsa.lax.set_scaling(x, bad))
    with pytest.raises(ValueError, match="rebalance: the factor must be finite and positive"):
        within_time_bound(lambda: jsa.lax.rebalance(x, bad))
    inside = jsa.autoscale(lambda a: jsa.lax.set_scaling(a, np.float32(bad)) * 1.0)
    with pytest.raises(ValueError, match="set_scaling: the scale must be finite and positive"):
        inside(x)


# Built once: the examples share a compile per dtype and scale shape.
SET_SCALING_AND_REBALANCE = (
    jax.jit(jsa.autoscale(jsa.lax.set_scaling)),
    jax.jit(jsa.autoscale(jsa.lax.rebalance)),
)


@SETTINGS
@given(bad=st.one_of(invalid, st.just(0.0)), dtype=dtypes, block=st.booleans())
def test_a_traced_bad_scale_or_factor_leaves_the_value_unchanged(bad, dtype, block):
    """Under `jax.jit`, a computed scale is not known: a bad one keeps x's own scale (a
    bad factor is taken as 1), so the represented value is exactly what it was."""
    scale = jnp.array([[2.0**-3], [4.0]], jnp.float32) if block else jnp.float32(2.0**-3)
    x = jsa.scaled_array(jnp.asarray(data_of(dtype)), scale)
    set_to, rebalance = SET_SCALING_AND_REBALANCE
    for out in (
        within_time_bound(lambda: set_to(x, jnp.float32(bad))),
        within_time_bound(lambda: rebalance(x, jnp.float32(bad))),
    ):
        np.testing.assert_array_equal(represented(out), represented(x))
        assert np.all(np.isfinite(np.asarray(out.scale)))
    good = within_time_bound(lambda: set_to(x, jnp.float32(8.0)))
    assert float(good.scale) == 8.0
    np.testing.assert_allclose(represented(good), represented(x), rtol=1e-2)


def test_set_scaling_wrong_shape_dtype_and_non_power_of_two():
    x = jsa.as_scaled_array(jnp.array([8.0, -2.0]))
    with pytest.raises(TypeError, match="set_scaling: the scale must be floating point, got int32"):
        jsa.lax.set_scaling(x, jnp.int32(2))
    assert jsa.lax.set_scaling(x, 2).scale.dtype == jnp.float32  # a Python int is a float32
    with pytest.raises(ValueError, match=r"set_scaling: the scale must be a scalar, got shape"):
        jsa.lax.set_scaling(x, jnp.ones(2))
    y = jsa.lax.set_scaling(x, 3.0)
    assert float(y.scale) == 3.0
    np.testing.assert_allclose(represented(y), [8.0, -2.0], rtol=1e-6)


@SETTINGS
@given(dtype=dtypes, exponent=exponents, bad=st.sampled_from([math.nan, math.inf, -math.inf]))
def test_computed_block_scales_stay_valid_with_non_finite_or_zero_data(dtype, exponent, bad):
    """`as_scaled_array(scale_shape=...)` measures each block's largest finite magnitude:
    inf/NaN elements keep their value in the data, an all-zero block gets scale 1."""
    values = np.array([[1.0, bad, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]]) * 2.0 ** (exponent % 60)
    x = jsa.as_scaled_array(values.astype(np.float32), scale_shape=(2, 1), dtype=dtype)
    scale = np.asarray(x.scale)
    assert np.all(np.isfinite(scale)) and np.all(scale > 0)
    np.testing.assert_array_equal(np.isnan(represented(x)), np.isnan(values))
    np.testing.assert_array_equal(np.isinf(represented(x)), np.isinf(values))
    out = jsa.autoscale(lambda a: a * 2.0)(x)  # valid scales: accepted by autoscale
    np.testing.assert_array_equal(np.isfinite(represented(out)), np.isfinite(values))
