import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from tests.helpers import FLOAT_DTYPES, make_scaled


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("use_jit", [False, True])
def test_set_scaling_inside_autoscale(dtype, use_jit):
    x = make_scaled(np.array([1.0, 2.0]), dtype, 2.0**-10)

    def fn(a):
        return jsa.lax.set_scaling(a, jnp.float32(2.0**-9))

    fn_t = jax.jit(jsa.autoscale(fn)) if use_jit else jsa.autoscale(fn)
    out = fn_t(x)
    assert float(out.scale) == 2.0**-9
    np.testing.assert_array_equal(np.asarray(out.data, np.float32), [0.5, 1.0])
    # An unscaled input becomes scaled.
    plain_out = jsa.autoscale(fn)(jnp.array([2.0**-8], dtype))
    assert isinstance(plain_out, jsa.ScaledArray) and float(plain_out.scale) == 2.0**-9
    np.testing.assert_array_equal(np.asarray(plain_out.data, np.float32), [2.0])


def test_scaling_primitives_are_identities_outside_autoscale():
    x = jnp.array([1.0, 2.0])

    def fn(a):
        a = jsa.lax.set_scaling(a, 4.0)
        a = jsa.lax.rebalance(a, 2.0)
        data, scale = jsa.lax.get_data_scale(a)
        return jsa.lax.stop_scaling(data * scale, jnp.float16)

    for f in (fn, jax.jit(fn)):
        out = f(x)
        assert out.dtype == jnp.float16
        np.testing.assert_array_equal(out, [1.0, 2.0])
    # vmap and grad work through them.
    np.testing.assert_array_equal(jax.vmap(fn)(jnp.ones((3, 2))), np.ones((3, 2)))
    g = jax.grad(lambda a: fn(a).astype(jnp.float32).sum())(x)
    np.testing.assert_array_equal(g, [1.0, 1.0])


def test_scaling_primitives_under_autoscale_of_vmap_and_grad():
    x = make_scaled(np.array([[1.0, 2.0], [3.0, 4.0]]), np.float16, 2.0**-12)

    def fn(a):
        a = jsa.lax.rebalance(a, jnp.float32(4.0))
        return jnp.sum(a * a)

    out = jsa.autoscale(jax.vmap(fn))(x)
    np.testing.assert_allclose(
        out.to_array(np.float32), np.array([5.0, 25.0]) * 2.0**-24, rtol=1e-3
    )
    grad = jsa.autoscale(jax.grad(fn))(x)
    np.testing.assert_allclose(
        grad.to_array(np.float32), 2 * np.array([[1.0, 2.0], [3.0, 4.0]]) * 2.0**-12, rtol=1e-3
    )


def test_get_data_scale_and_stop_scaling_inside_autoscale():
    x = make_scaled(np.array([1.0, 3.0]), np.float16, 2.0**-20)

    def fn(a):
        data, scale = jsa.lax.get_data_scale(a * 2.0)
        return data, scale, jsa.lax.stop_scaling(a, jnp.float32)

    data, scale, value = jsa.autoscale(fn)(x)
    assert not isinstance(data, jsa.ScaledArray) and data.dtype == jnp.float16
    np.testing.assert_array_equal(
        np.asarray(data, np.float32) * float(scale), [2.0**-19, 3 * 2.0**-19]
    )
    assert not isinstance(value, jsa.ScaledArray)
    np.testing.assert_array_equal(value, np.array([1.0, 3.0], np.float32) * 2.0**-20)


def test_public_helpers_accept_scaled_arrays_directly():
    x = make_scaled(np.array([1.0, 2.0]), np.float32, 4.0)
    y = jsa.lax.rebalance(x, 2.0)
    np.testing.assert_array_equal(y.data, [2.0, 4.0])
    assert float(y.scale) == 2.0
    z = jsa.lax.set_scaling(x, 8.0)
    np.testing.assert_array_equal(z.data, [0.5, 1.0])
    data, scale = jsa.lax.get_data_scale(x)
    assert float(scale) == 4.0
    np.testing.assert_array_equal(jsa.lax.stop_scaling(x), [4.0, 8.0])


def test_bad_scaling_arguments():
    with pytest.raises(ValueError, match="set_scaling: the scale must be a scalar"):
        jsa.lax.set_scaling(jnp.ones(2), jnp.ones(2))
    with pytest.raises(ValueError, match="rebalance: the factor must be a scalar"):
        jsa.lax.rebalance(jnp.ones(2), jnp.ones(2))
    with pytest.raises(
        ValueError, match="set_scaling: the scale must be the same for the whole batch"
    ):
        jax.vmap(jsa.lax.set_scaling)(jnp.ones((2, 3)), jnp.ones(2))


def _stochastic_bf16(data, key):
    return jsa.quantization.float_quantize(data, "bfloat16", "stochastic", key=key)


@pytest.mark.parametrize("data_batched", [True, False])
def test_apply_to_data_maps_over_batched_keys(data_batched):
    """One PRNG key per batch element (vmap over seeds): `fn` is mapped over the batch."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = jnp.full((3, 64) if data_batched else (64,), 1.0 + 2.0**-10, jnp.float32)

    def one(data, key):
        return jsa.lax.apply_to_data(_stochastic_bf16, data, key)

    out = jax.vmap(one, in_axes=(0 if data_batched else None, 0))(x, keys)
    assert out.shape == (3, 64)
    for i in range(3):  # each row rounded with its own key
        expected = _stochastic_bf16(x[i] if data_batched else x, keys[i])
        np.testing.assert_array_equal(out[i], expected)
    assert not np.array_equal(out[0], out[1])
    # Inside autoscale, on the data of a ScaledArray (scale kept).
    scaled = jsa.scaled_array(jnp.full((3, 64), 1.0 + 2.0**-10), 2.0**-40)
    inner = jax.vmap(lambda d, k: jsa.lax.apply_to_data(_stochastic_bf16, d, k))
    got = jsa.autoscale(inner)(scaled, keys)
    assert float(got.scale) == 2.0**-40
    np.testing.assert_array_equal(got.data, out)  # the same values, the same keys


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("use_jit", [False, True])
def test_as_scaled_array_inside_autoscale_gives_one_scaled_array(dtype, use_jit):
    """Inside a function autoscale traces, `as_scaled_array` makes a plain value scaled and
    keeps a scaled one, as outside: never a ScaledArray whose data is a ScaledArray."""
    x = make_scaled(np.array([[1.5, -2.0], [0.25, 3.0]]), dtype, 2.0**-20)

    def fn(a):
        return (
            jsa.as_scaled_array(a * 2),  # scaled already: kept
            jsa.as_scaled_array(jnp.zeros(a.shape, jnp.float32), dtype=dtype),
            jsa.as_scaled_array(jnp.full((2,), 12.0), scale=4.0),
            jsa.as_scaled_array(jnp.array([[3.0, 1.0], [0.25, 0.5]]), scale_shape=(2, 1)),
        )

    transformed = jax.jit(jsa.autoscale(fn)) if use_jit else jsa.autoscale(fn)
    doubled, zeros, fixed, rows = transformed(x)
    for out in (doubled, zeros, fixed, rows):
        assert isinstance(out, jsa.ScaledArray)
        assert isinstance(out.data, jax.Array) and isinstance(out.scale, jax.Array)
    assert doubled.dtype == dtype and float(doubled.scale) == 2.0**-19
    np.testing.assert_array_equal(
        doubled.to_array(np.float32), np.array([[3.0, -4.0], [0.5, 6.0]]) * 2.0**-20
    )
    assert zeros.dtype == dtype and float(zeros.scale) == 1.0
    np.testing.assert_array_equal(zeros.to_array(np.float32), np.zeros((2, 2)))
    assert float(fixed.scale) == 4.0
    np.testing.assert_array_equal(fixed.data, [3.0, 3.0])
    np.testing.assert_array_equal(rows.scale, [[2.0], [0.5]])
    np.testing.assert_array_equal(rows.data, [[1.5, 0.5], [0.5, 1.0]])


def test_as_scaled_array_inside_autoscale_differentiates_as_the_identity():
    x = make_scaled(np.array([1.0, -3.0]), np.float16, 2.0**-12)
    grad = jsa.autoscale(jax.grad(lambda a: jnp.sum(jsa.as_scaled_array(a) ** 2)))(x)
    np.testing.assert_array_equal(grad.to_array(np.float32), np.array([2.0, -6.0]) * 2.0**-12)
    # Under vmap, a scale shared by the batch is fine; one per example is refused.
    xs = jnp.ones((3, 2), jnp.float32)
    out = jsa.autoscale(jax.vmap(lambda a: jsa.as_scaled_array(a, scale=2.0)))(xs)
    np.testing.assert_array_equal(out.to_array(), np.ones((3, 2)))
    with pytest.raises(ValueError, match="as_scaled_array: the scale must be the same for"):
        jsa.autoscale(jax.vmap(lambda a, s: jsa.as_scaled_array(a, scale=s)))(xs, jnp.ones(3))


@pytest.mark.parametrize("use_jit", [False, True])
def test_asarray_and_constants_inside_autoscale_come_out_plain(use_jit):
    """`jsa.asarray` inside an autoscaled function returns the plain arrays it returns
    outside, and an output the function computes from nothing is a JAX array (not the
    NumPy constant the jaxpr holds), as under `jax.jit`."""
    x = make_scaled(np.array([1.0, 2.0]), np.float16, 2.0**-3)

    def fn(a):
        return jsa.asarray({"a": a * 2, "b": a}, jnp.float32), jnp.float32(1.5), jnp.arange(2)

    transformed = jax.jit(jsa.autoscale(fn)) if use_jit else jsa.autoscale(fn)
    plain, constant, indices = transformed(x)
    for out in (plain["a"], plain["b"], constant, indices):
        assert isinstance(out, jax.Array) and not isinstance(out, np.ndarray)
    assert plain["a"].dtype == jnp.float32
    np.testing.assert_array_equal(plain["a"], [0.25, 0.5])
    np.testing.assert_array_equal(plain["b"], [0.125, 0.25])
    assert float(constant) == 1.5
