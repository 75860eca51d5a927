import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from tests.helpers import FLOAT_DTYPES, WIDE_SCALES, make_scaled

RESCALERS = {
    "max": (jsa.ops.dynamic_rescale_max, lambda d: np.max(np.abs(d))),
    "l1": (jsa.ops.dynamic_rescale_l1, lambda d: np.mean(np.abs(d))),
    "l2": (jsa.ops.dynamic_rescale_l2, lambda d: np.sqrt(np.mean(d * d))),
}


@pytest.mark.parametrize("name", sorted(RESCALERS))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scale", WIDE_SCALES)
def test_dynamic_rescale_keeps_value_and_normalises_data(name, dtype, scale):
    rescale, norm = RESCALERS[name]
    x = make_scaled(np.array([0.001, -0.003, 0.0025]), dtype, scale)
    out = rescale(x)
    np.testing.assert_array_equal(
        np.asarray(out.to_array(jnp.float32)), np.asarray(x.to_array(jnp.float32))
    )
    assert 1.0 <= norm(np.asarray(out.data, np.float64)) < 2.0
    assert out.dtype == dtype


@pytest.mark.parametrize("use_jit", [False, True])
def test_dynamic_rescale_inside_autoscale_on_pytrees(use_jit):
    tree = {"a": make_scaled(np.full(4, 1e-3), np.float16, 1.0), "n": jnp.int32(2)}

    def fn(t):
        return jsa.ops.dynamic_rescale_max({"a": t["a"] * 3.0, "n": t["n"]})

    fn_t = jax.jit(jsa.autoscale(fn)) if use_jit else jsa.autoscale(fn)
    out = fn_t(tree)
    assert int(out["n"]) == 2
    assert 1.0 <= float(jnp.max(jnp.abs(out["a"].data))) < 2.0
    np.testing.assert_allclose(
        np.asarray(out["a"].to_array(jnp.float32)), np.full(4, 3e-3), rtol=1e-3
    )


def test_dynamic_rescale_zeros_and_plain_arrays():
    zeros = make_scaled(np.zeros(3), np.float32, 1.0)
    out = jsa.ops.dynamic_rescale_l2(zeros)
    assert np.isfinite(float(out.scale)) and float(out.scale) > 0
    np.testing.assert_array_equal(out.to_array(), np.zeros(3))
    plain = jnp.array([1e-3, 2e-3])
    np.testing.assert_array_equal(jsa.ops.dynamic_rescale_max(plain), plain)


def test_dynamic_rescale_grad_variant_rescales_the_gradient_only():
    x = make_scaled(np.array([1.0, 2.0]), np.float16, 1.0)

    def loss(a):
        a = jsa.ops.dynamic_rescale_max_grad(a)
        return jnp.sum(a * a * 1e-3)

    out = jsa.autoscale(loss)(x)
    np.testing.assert_allclose(float(out.to_array(jnp.float32)), 5e-3, rtol=1e-3)
    grad = jsa.autoscale(jax.grad(loss))(x)
    # The gradient value is 2e-3 * x, and its data was rescaled to [1, 2).
    np.testing.assert_allclose(np.asarray(grad.to_array(jnp.float32)), [2e-3, 4e-3], rtol=1e-3)
    assert 1.0 <= float(jnp.max(jnp.abs(grad.data))) < 2.0
    # Without the rescaling, the gradient's data is not normalised.
    raw = jsa.autoscale(jax.grad(lambda a: jnp.sum(a * a * 1e-3)))(x)
    assert not 1.0 <= float(jnp.max(jnp.abs(raw.data))) < 2.0
