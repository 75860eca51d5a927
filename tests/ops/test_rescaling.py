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


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("layout", [(8, 1), (1, 64), (8, 2), (2, 2)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(
    "rescale", ["dynamic_rescale_max", "dynamic_rescale_l1", "dynamic_rescale_l2"]
)
def test_dynamic_rescale_of_block_scales_is_per_block(rescale, dtype, layout, jit):
    """A block-scaled array is rescaled block by block: the layout is kept, the values are
    unchanged exactly, and each block's norm of the data is in [1, 2) (max: its largest
    magnitude)."""
    rng = np.random.default_rng(0)
    value = rng.normal(size=(8, 64)) * np.exp2(np.arange(-12, 12, 3))[:, None]
    x = jsa.as_scaled_array(jnp.asarray(value, jnp.float32), scale_shape=layout, dtype=dtype)
    # Data 2^8 below where it should be (exactly: powers of two, normal in every dtype).
    x = jsa.ScaledArray((x.data.astype(jnp.float32) * 2.0**-8).astype(dtype), x.scale * 2.0**8)
    fn = getattr(jsa.ops, rescale)
    y = (jax.jit(fn) if jit else fn)(x)
    assert y.scale.shape == layout and y.dtype == x.dtype
    np.testing.assert_array_equal(y.to_array(jnp.float32), x.to_array(jnp.float32))
    blocks_of = np.abs(np.asarray(y.data, np.float64)).reshape(
        layout[0], -1, layout[1], 64 // layout[1]
    )
    norm = {
        "dynamic_rescale_max": lambda b: b.max(axis=(1, 3)),
        "dynamic_rescale_l1": lambda b: b.mean(axis=(1, 3)),
        "dynamic_rescale_l2": lambda b: np.sqrt((b**2).mean(axis=(1, 3))),
    }[rescale](blocks_of)
    assert ((norm >= 1) & (norm < 2)).all(), norm
