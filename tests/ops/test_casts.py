import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from tests.helpers import FLOAT_DTYPES, make_scaled, represented

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


# Built once: the scales of a dtype share the compiled program (the scale is a value).
_CAST = jsa.autoscale(lambda v: jsa.ops.cast_on_forward(v, E4M3))
_CAST_JIT = jax.jit(_CAST)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scale", [2.0**-40, 1.0, 2.0**40])
@pytest.mark.parametrize("use_jit", [False, True])
def test_cast_on_forward_is_a_real_cast_of_the_data(dtype, scale, use_jit):
    data = np.array([1.1, -3.3, 0.015, 200.0], np.float32)
    x = make_scaled(data, dtype, scale)
    out = (_CAST_JIT if use_jit else _CAST)(x)
    assert isinstance(out, jsa.ScaledArray) and out.dtype == E4M3
    assert float(out.scale) == scale
    expected = np.asarray(x.data).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale
    np.testing.assert_array_equal(represented(out), expected)


def test_cast_on_forward_saturates_when_asked():
    x = make_scaled(np.array([1.0, 1000.0, -1e4, np.nan]), np.float32, 2.0**-20)
    plain_cast = jsa.ops.cast_on_forward(x, E4M3)
    assert np.isnan(np.asarray(plain_cast.data, np.float32)[1])  # e4m3fn has no inf
    saturated = jsa.ops.cast_on_forward(x, E4M3, saturate=True)
    np.testing.assert_array_equal(np.asarray(saturated.data, np.float32)[:3], [1.0, 448.0, -448.0])
    assert np.isnan(np.asarray(saturated.data, np.float32)[3])  # NaN stays NaN


def test_recommended_pattern_rescale_then_cast_avoids_overflow():
    # Data far above e4m3's range (max 448): rescaling first keeps every value.
    x = make_scaled(np.array([3000.0, -1500.0, 700.0]), np.float16, 1.0)
    naive = jsa.ops.cast_on_forward(x, E4M3)
    assert np.isnan(np.asarray(naive.data, np.float32)).all()
    good = jsa.ops.cast_on_forward(jsa.ops.dynamic_rescale_max(x), E4M3, saturate=True)
    np.testing.assert_allclose(represented(good), [3000.0, -1500.0, 700.0], rtol=0.07)


@pytest.mark.parametrize("use_jit", [False, True])
def test_gradients_through_forward_cast_are_straight_through(use_jit):
    x = make_scaled(np.array([1.1, 2.3]), np.float16, 2.0**-10)

    def loss(v):
        return jnp.sum(jsa.ops.cast_on_forward(v, E4M3).astype(jnp.float16) * 3.0)

    grad_fn = jsa.autoscale(jax.grad(loss))
    grads = (jax.jit(grad_fn) if use_jit else grad_fn)(x)
    # A linear function's gradient does not depend on x (so it is not scaled); it passed
    # through the float8 cast unchanged.
    assert grads.dtype == jnp.float16
    np.testing.assert_array_equal(represented(grads), [3.0, 3.0])
    # Plain arrays outside autoscale: the gradient passes through the cast.
    np.testing.assert_array_equal(jax.grad(loss)(jnp.array([1.1, 2.3], jnp.float16)), [3.0, 3.0])


@pytest.mark.parametrize("scale", [2.0**-30, 1.0, 2.0**30])
def test_cast_on_backward_rounds_the_gradient_data(scale):
    x = make_scaled(np.array([1.0, 2.0]), np.float32, scale)

    def loss(v):
        return jnp.sum(jsa.ops.cast_on_backward(v, E5M2) * 1.1)

    out = jsa.autoscale(loss)(x)  # forward unchanged
    np.testing.assert_allclose(float(out.to_array()), 3.3 * scale, rtol=1e-6)
    grad = jsa.autoscale(jax.grad(loss))(x)
    # 1.1 (the gradient's value; its data is unit range) rounds to 1.0 in float8_e5m2.
    np.testing.assert_allclose(represented(grad), [1.0, 1.0], rtol=1e-6)
    # Plain arrays outside autoscale too.
    np.testing.assert_array_equal(jax.grad(loss)(jnp.ones(2)), [1.0, 1.0])


def test_reduce_precision_on_forward_and_backward():
    x = make_scaled(np.array([1.1, 3.3, 0.3]), np.float16, 2.0**-30)
    fwd = jsa.autoscale(lambda v: jsa.ops.reduce_precision_on_forward(v, "float8_e4m3fn"))(x)
    assert fwd.dtype == jnp.float16  # simulated: dtype kept
    expected = np.asarray(x.data).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0**-30
    np.testing.assert_array_equal(represented(fwd), expected)

    def loss(v):
        return jnp.sum(jsa.ops.reduce_precision_on_backward(v, "float8_e5m2") * 1.1)

    grad = jsa.autoscale(jax.grad(loss))(x)
    np.testing.assert_allclose(represented(grad), [1.0, 1.0, 1.0])


def test_stochastic_rounding_is_reproducible_and_unbiased():
    x = make_scaled(np.full(20000, 1.1), np.float32, 2.0**-20)
    key = jax.random.PRNGKey(0)
    out1 = jsa.ops.reduce_precision_on_forward(x, "float8_e4m3fn", "stochastic", key=key)
    out2 = jsa.ops.reduce_precision_on_forward(x, "float8_e4m3fn", "stochastic", key=key)
    np.testing.assert_array_equal(out1.data, out2.data)
    assert set(np.unique(np.asarray(out1.data))) == {1.0, 1.125}
    np.testing.assert_allclose(np.mean(np.asarray(out1.data, np.float64)), 1.1, atol=2e-3)


def test_quantizer_forward_and_backward_formats():
    q = jsa.ops.quantizer("float8_e4m3fn", "float8_e5m2")
    x = make_scaled(np.array([1.1, 3.3]), np.float32, 2.0**20)
    out = jsa.autoscale(q)(x)
    np.testing.assert_array_equal(out.data, [1.125, 3.25])
    grad = jsa.autoscale(jax.grad(lambda v: jnp.sum(q(v) * 1.1)))(x)
    np.testing.assert_allclose(represented(grad), [1.0, 1.0])
    assert jsa.ops.quantizer(None, None)(x) is x


def test_bad_arguments():
    x = jnp.ones(2)
    with pytest.raises(TypeError, match="Expected a floating dtype, got int8"):
        jsa.ops.cast_on_forward(x, jnp.int8)
    with pytest.raises(ValueError, match="Unknown float format 'float7'"):
        jsa.ops.reduce_precision_on_forward(x, "float7")
    with pytest.raises(ValueError, match="needs a PRNG `key`"):
        jsa.ops.reduce_precision_on_forward(x, "float8_e4m3fn", "stochastic")
    with pytest.raises(ValueError, match="Unknown float format"):
        jsa.ops.quantizer("nope")


@pytest.mark.parametrize("use_jit", [False, True])
def test_fp8_scaled_matmul_with_float32_accumulator(use_jit):
    rng = np.random.default_rng(0)
    a_val = rng.normal(size=(8, 32)) * 2.0**-30
    b_val = rng.normal(size=(32, 4)) * 2.0**25
    a = jsa.ops.dynamic_rescale_max(jsa.as_scaled_array(jnp.asarray(a_val, jnp.float32)))
    b = jsa.ops.dynamic_rescale_max(jsa.as_scaled_array(jnp.asarray(b_val, jnp.float32)))
    a8 = jsa.ops.cast_on_forward(a, E4M3, saturate=True)
    b8 = jsa.ops.cast_on_forward(b, E4M3, saturate=True)
    assert a8.dtype == E4M3 and b8.dtype == E4M3

    def matmul(x, y):
        return jax.lax.dot(x, y, preferred_element_type=jnp.float32)

    fn = jax.jit(jsa.autoscale(matmul)) if use_jit else jsa.autoscale(matmul)
    out = fn(a8, b8)
    assert isinstance(out, jsa.ScaledArray) and out.dtype == jnp.float32
    expected = represented(a8) @ represented(b8)
    np.testing.assert_allclose(
        represented(out), expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max()
    )
    # And close to the full-precision product (e4m3 has 3 mantissa bits).
    np.testing.assert_allclose(
        represented(out), a_val @ b_val, atol=0.1 * np.abs(a_val @ b_val).max()
    )
