import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from tests.helpers import FLOAT_DTYPES


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_scaled_array_properties(dtype):
    x = jsa.scaled_array(np.arange(6).reshape(2, 3).astype(dtype), 0.5)
    assert x.dtype == dtype
    assert x.shape == (2, 3)
    assert x.ndim == 2
    assert x.size == 6
    assert len(x) == 2
    assert x.aval.shape == (2, 3) and x.aval.dtype == dtype
    np.testing.assert_array_equal(np.asarray(x), np.arange(6).reshape(2, 3) * 0.5)
    assert "ScaledArray(data=" in repr(x)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_building_from_numpy_compiles_nothing(dtype):
    """NumPy data and scales are moved to the device as they are: `jnp.asarray` of a NumPy
    array compiles JAX's `stage` primitive per new shape (JAX 0.10.2 to 0.12), which made
    every eager ScaledArray of a new shape a compiled program. The arrays are those
    `jnp.asarray` gives (dtype, not weakly typed)."""
    compiles = []

    def count(event, duration, **kwargs):
        if event.endswith("backend_compile_duration"):
            compiles.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        built = [
            jsa.scaled_array(np.full((n, 3), 1.5, dtype), np.float32(2.0**-n)) for n in (17, 18, 19)
        ] + [jsa.as_scaled_array(np.full((n, 2), 0.5, dtype)) for n in (21, 22)]
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert compiles == []
    for x, n in zip(built[:3], (17, 18, 19)):
        assert isinstance(x.data, jax.Array) and x.data.dtype == dtype and x.shape == (n, 3)
        assert x.scale.dtype == np.float32 and not x.data.weak_type and not x.scale.weak_type
        np.testing.assert_array_equal(np.asarray(x.to_array(), np.float32), 1.5 * 2.0**-n)
    assert built[3].data.dtype == dtype and float(built[3].scale) == 1.0
    # float64 NumPy data (64-bit off) still becomes float32, as with `jnp.asarray`.
    assert jsa.scaled_array(np.ones(3), 1.0).dtype == jnp.asarray(np.ones(3)).dtype


def test_scaled_array_is_a_pytree_with_two_leaves():
    x = jsa.scaled_array([1.0, 2.0], 2.0)
    leaves, treedef = jax.tree_util.tree_flatten(x)
    assert len(leaves) == 2
    y = jax.tree_util.tree_unflatten(treedef, [leaves[0] * 2, leaves[1]])
    assert isinstance(y, jsa.ScaledArray)
    np.testing.assert_array_equal(y.to_array(), [4.0, 8.0])
    # Through jit, scale can be traced.
    out = jax.jit(lambda a: jsa.ScaledArray(a.data, a.scale * 2))(x)
    np.testing.assert_array_equal(out.to_array(), [4.0, 8.0])


def test_to_array_is_exact_where_data_times_scale_overflows_the_data_dtype():
    x = jsa.scaled_array(np.array([1.0, 3.0], np.float16), 2.0**-30)
    np.testing.assert_array_equal(x.to_array(jnp.float32), np.array([1.0, 3.0]) * 2.0**-30)
    assert x.to_array().dtype == np.float16


def test_to_array_float8_data():
    data = np.array([1.0, -2.0], ml_dtypes.float8_e4m3fn)
    x = jsa.scaled_array(data, 4.0)
    np.testing.assert_array_equal(x.to_array(jnp.float32), [4.0, -8.0])


def test_astype_keeps_scale():
    x = jsa.scaled_array([1.0, 2.0], 4.0).astype(jnp.float16)
    assert x.dtype == jnp.float16 and float(x.scale) == 4.0


def test_scaled_array_factory_rejects_non_float_data():
    with pytest.raises(TypeError, match="data must have a floating dtype, got int32"):
        jsa.scaled_array(np.array([1, 2], np.int32), 1.0)


def test_scaled_array_factory_rejects_non_broadcasting_scale():
    with pytest.raises(ValueError, match=r"scale of shape \(3,\) does not broadcast"):
        jsa.scaled_array(np.ones((2, 2), np.float32), np.ones(3, np.float32))


def test_scaled_array_factory_rejects_negative_and_integer_scales():
    with pytest.raises(ValueError, match=r"must be finite and non-negative, but it is -2.0"):
        jsa.scaled_array([1.0], -2.0)
    with pytest.raises(TypeError, match="scale must have a floating dtype"):
        jsa.scaled_array([1.0], np.int32(2))


def test_scaled_array_factory_accepts_broadcastable_scale():
    x = jsa.scaled_array(np.ones((2, 3), np.float32), np.array([1.0, 2.0, 4.0], np.float32))
    np.testing.assert_array_equal(x.to_array()[1], [1.0, 2.0, 4.0])


def test_as_scaled_array_on_pytrees():
    tree = {"w": jnp.ones((2,), jnp.float16), "step": jnp.int32(3), "flag": True, "none": None}
    out = jsa.as_scaled_array(tree)
    assert isinstance(out["w"], jsa.ScaledArray)
    assert out["w"].dtype == jnp.float16 and float(out["w"].scale) == 1.0
    assert out["step"] is tree["step"] and out["flag"] is True and out["none"] is None
    # Idempotent on ScaledArrays.
    assert jsa.as_scaled_array(out)["w"] is out["w"]


@pytest.mark.parametrize("scale", [2.0**-40, 0.5, 2.0**40])
def test_as_scaled_array_with_scale_represents_the_input(scale):
    x = jnp.array([1.0, -3.0, 0.25], jnp.float32) * scale
    out = jsa.as_scaled_array(x, scale=scale)
    np.testing.assert_array_equal(out.data, [1.0, -3.0, 0.25])
    np.testing.assert_array_equal(out.to_array(), x)


def test_as_scaled_array_with_dtype_and_zero_scale():
    out = jsa.as_scaled_array(jnp.array([0.0, 0.0]), scale=0.0, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out.to_array(jnp.float32), [0.0, 0.0])


def test_asarray_round_trip():
    tree = {"a": jsa.scaled_array([1.0, 2.0], 8.0), "b": jnp.arange(2)}
    out = jsa.asarray(tree)
    np.testing.assert_array_equal(out["a"], [8.0, 16.0])
    np.testing.assert_array_equal(out["b"], [0, 1])
    assert jsa.asarray(tree, dtype=jnp.float16)["a"].dtype == jnp.float16


def test_is_scaled_leaf():
    assert jsa.is_scaled_leaf(jsa.scaled_array([1.0], 1.0))
    assert jsa.is_scaled_leaf(jnp.ones(2))
    assert not jsa.is_scaled_leaf({"a": 1})
    leaves = jax.tree_util.tree_leaves(
        {"a": jsa.scaled_array([1.0], 1.0), "b": jnp.ones(1)}, is_leaf=jsa.is_scaled_leaf
    )
    assert isinstance(leaves[0], jsa.ScaledArray) and len(leaves) == 2


def test_python_operators_do_the_scaled_thing():
    a = jsa.scaled_array(np.array([1.0, 2.0], np.float16), 2.0**-20)
    b = jsa.scaled_array(np.array([3.0, 4.0], np.float16), 2.0**-20)
    value_a, value_b = np.array([1.0, 2.0]) * 2.0**-20, np.array([3.0, 4.0]) * 2.0**-20
    # Plain float16 would flush these products to zero; scaled ones are exact.
    prod = a * b
    assert isinstance(prod, jsa.ScaledArray)
    np.testing.assert_allclose(np.asarray(prod.to_array(jnp.float32)), value_a * value_b)
    for result, expected in [
        (a + b, value_a + value_b),
        (a - b, value_a - value_b),
        (b / a, value_b / value_a),
        (-a, -value_a),
        (abs(-a), value_a),
        (a * 2.0, value_a * 2.0),
        (2.0 * a, value_a * 2.0),
        (1.0 - a, 1.0 - value_a),
        (a**2, value_a**2),
        (a[1], value_a[1]),
        (a.reshape(2, 1), value_a.reshape(2, 1)),
        (a.sum(), value_a.sum()),
    ]:
        assert isinstance(result, jsa.ScaledArray)
        np.testing.assert_allclose(
            np.asarray(result.to_array(jnp.float32)), expected, rtol=2e-3, atol=0
        )
    m = jsa.scaled_array(np.eye(2, dtype=np.float16), 2.0**-20)
    np.testing.assert_allclose(
        np.asarray((m @ a).to_array(jnp.float32)), np.eye(2) @ value_a * 2.0**-20, rtol=2e-3
    )
    np.testing.assert_array_equal(np.asarray(a < b), [True, True])
    np.testing.assert_array_equal(np.asarray(a == a), [True, True])
    np.testing.assert_array_equal(np.asarray(a >= b), [False, False])


def test_is_scaled_leaf_descends_into_nodes_that_have_a_shape_attribute():
    """An Equinox module or a Flax NNX Variable has a `shape` but is a pytree node: it is
    descended into (the old predicate took it for an array and `as_scaled_array` crashed on
    Equinox modules and dropped NNX wrappers)."""
    import equinox as eqx
    from flax import nnx

    norm = eqx.nn.LayerNorm(4)
    param = nnx.Param(jnp.ones(3))
    assert hasattr(norm, "shape") and not jsa.is_scaled_leaf(norm)
    assert not jsa.is_scaled_leaf(param)
    assert jsa.is_scaled_leaf(np.ones(2)) and jsa.is_scaled_leaf(np.float32(1.0))


def test_as_scaled_array_keeps_equinox_modules_and_their_non_array_leaves():
    import equinox as eqx

    key = jax.random.PRNGKey(0)
    model = [eqx.nn.Linear(3, 2, key=key), eqx.nn.LayerNorm(2), eqx.nn.Dropout(0.1), jnp.tanh]
    out = jsa.as_scaled_array(model, dtype=jnp.float16)
    is_leaf = lambda x: isinstance(x, jsa.ScaledArray)  # noqa: E731
    assert jax.tree.structure(out, is_leaf=is_leaf) == jax.tree.structure(model)
    assert isinstance(out[0].weight, jsa.ScaledArray) and out[0].weight.dtype == jnp.float16
    assert out[2].p == 0.1 and type(out[2].p) is float and out[3] is jnp.tanh
    back = jsa.asarray(out, jnp.float32)
    assert jax.tree.structure(back) == jax.tree.structure(model)
    np.testing.assert_allclose(back[0].weight, model[0].weight, rtol=1e-3)
    # The partitioned half (None where a leaf is not an inexact array).
    params, static = eqx.partition(model, eqx.is_inexact_array)
    scaled_params = jsa.as_scaled_array(params)
    assert jax.tree.structure(scaled_params, is_leaf=is_leaf) == jax.tree.structure(params)
    assert eqx.combine(jsa.asarray(scaled_params), static)[2].p == 0.1


def test_as_scaled_array_keeps_flax_nnx_variables():
    from flax import nnx

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    out = jsa.as_scaled_array(state, dtype=jnp.float16)
    is_leaf = lambda x: isinstance(x, jsa.ScaledArray)  # noqa: E731
    assert jax.tree.structure(out, is_leaf=is_leaf) == jax.tree.structure(state)
    assert isinstance(out["kernel"], nnx.Param)
    assert isinstance(out["kernel"].get_value(), jsa.ScaledArray)
    merged = nnx.merge(graphdef, jsa.asarray(out, jnp.float32))
    np.testing.assert_allclose(merged.kernel[...], model.kernel[...], rtol=1e-3)


def test_is_floating_of_none_is_false():
    from jax_scaled_arithmetics.core.datatype import is_floating

    assert not is_floating(None) and is_floating(1.0) and not is_floating(3)


@pytest.mark.parametrize(
    "dtype, values",
    [
        (jnp.float16, [1e6, -3.0, 0.5]),  # beyond float16's 65504
        (jnp.float16, [1e-7, -3e-8, 0.0]),  # below its smallest normal: flushed or subnormal
        (jnp.float8_e4m3fn, [1000.0, 3.0, -0.25]),  # beyond E4M3's 448
    ],
)
@pytest.mark.parametrize("jit", [False, True])
def test_as_scaled_array_to_a_narrow_dtype_fits_the_data(dtype, values, jit):
    """Without a scale, values out of the narrow dtype's range get the power of two at or
    below their largest magnitude: finite data, the values to the dtype's precision (scale
    1 overflowed to inf or flushed to 0)."""
    x = jnp.asarray(values, jnp.float32)
    convert = lambda a: jsa.as_scaled_array(a, dtype=dtype)  # noqa: E731
    out = jax.jit(convert)(x) if jit else convert(x)
    amax = float(jnp.max(jnp.abs(x)))
    assert out.dtype == dtype and float(out.scale) == 2.0 ** np.floor(np.log2(amax))
    assert np.all(np.isfinite(np.asarray(out.data, np.float32)))
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(out.to_array(jnp.float32), x, rtol=eps, atol=eps * amax)
    inside = jax.jit(jsa.autoscale(lambda a: jsa.asarray(convert(a) * 1.0, jnp.float32)))(x)
    np.testing.assert_allclose(inside, x, rtol=eps, atol=eps * amax)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float8_e5m2])
def test_as_scaled_array_keeps_scale_one_where_the_data_fits(dtype):
    """Values the dtype holds as normal numbers (or any value, for bfloat16's float32 range)
    keep scale 1: the data is the cast values."""
    x = jnp.asarray([0.75, -2.0, 100.0] if dtype != jnp.bfloat16 else [1e30, -1e-30])
    out = jsa.as_scaled_array(x, dtype=dtype)
    assert float(out.scale) == 1.0
    np.testing.assert_array_equal(np.asarray(out.data), np.asarray(x.astype(dtype)))
