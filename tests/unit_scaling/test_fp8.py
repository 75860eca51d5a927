"""`U.simulate_fp8`: matmul operands in E4M3 forward, their output gradients in E5M2 backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
import jax_scaled_arithmetics.unit_scaling as U
from jax_scaled_arithmetics.quantization import float_quantize

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def q4(x):
    return float_quantize(x, E4M3, saturate=True)


def q5(x):
    return float_quantize(x, E5M2, saturate=True)


@pytest.fixture(scope="module")
def operands():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (8, 16))
    w = jax.random.normal(keys[1], (16, 4))
    g = jax.random.normal(keys[2], (8, 4))
    return x, w, g


def reference(x, w, g):
    """What simulate_fp8(x @ w) computes: value and vjp with cotangent g."""
    xq, wq = q4(x), q4(w)
    gq = q5(g.astype(jnp.float32)).astype(g.dtype)
    return xq @ wq, (gq @ wq.T, xq.T @ gq)


def _close(a, b, tol=1e-6):
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(
            np.asarray(u, np.float32), np.asarray(v, np.float32), rtol=tol, atol=tol
        )


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_matmul_operands_and_output_gradient_are_rounded(operands, jit, dtype):
    x, w, g = (v.astype(dtype) for v in operands)
    f = U.simulate_fp8(lambda a, b: a @ b)
    f = jax.jit(f) if jit else f
    out, vjp = jax.vjp(f, x, w)
    assert out.dtype == dtype
    expected, grads = reference(x, w, g)
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    _close(out, expected, tol)
    _close(vjp(g), grads, tol)
    # The rounding is real: the plain product differs.
    assert not np.allclose(np.asarray(out, np.float32), np.asarray(x @ w, np.float32), rtol=1e-3)


def test_saturation(operands):
    x, w, _ = operands
    big = x.at[0, 0].set(1000.0)
    out = U.simulate_fp8(lambda a, b: a @ b)(big, w)
    _close(out, q4(big) @ q4(w))
    assert float(q4(big)[0, 0]) == 448.0
    unsaturated = U.simulate_fp8(lambda a, b: a @ b, saturate=False)(big, w)
    assert not bool(jnp.all(jnp.isfinite(unsaturated[0])))


def test_other_formats(operands):
    x, w, _ = operands
    f = U.simulate_fp8(lambda a, b: a @ b, forward_format="float8_e5m2")
    _close(f(x, w), q5(x) @ q5(w))


def test_convolution_operands_are_rounded():
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 9, 9, 3))
    k = jax.random.normal(jax.random.PRNGKey(2), (3, 3, 3, 5))

    def conv(a, b):
        return jax.lax.conv_general_dilated(
            a, b, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    _close(U.simulate_fp8(conv)(x, k), conv(q4(x), q4(k)), 1e-5)


def test_control_flow_and_vmap(operands):
    x, w, _ = operands
    w2 = jax.random.normal(jax.random.PRNGKey(3), (16, 16)) * 0.25

    def scanned(a):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w2), None), a, None, length=3)[0]

    expected = x
    for _ in range(3):
        expected = jnp.tanh(q4(expected) @ q4(w2))
    _close(U.simulate_fp8(scanned)(x), expected, 1e-6)

    xs = jnp.stack([x, 2.0 * x])
    f = lambda a, b: a @ b  # noqa: E731
    outer = jax.vmap(U.simulate_fp8(f), in_axes=(0, None))(xs, w)
    inner = U.simulate_fp8(jax.vmap(f, in_axes=(0, None)))(xs, w)
    _close(outer, inner)
    _close(outer[1], q4(2.0 * x) @ q4(w))


def test_custom_vjp_function_with_a_matmul_is_cast_at_its_boundary(operands):
    x, w, g = operands

    @jax.custom_vjp
    def product(a, b):
        return a @ b

    def fwd(a, b):
        return a @ b, (a, b)

    def bwd(res, ct):  # a deliberately unusual rule: it must survive the transform
        a, b = res
        return 2.0 * (ct @ b.T), 2.0 * (a.T @ ct)

    product.defvjp(fwd, bwd)
    out, vjp = jax.vjp(U.simulate_fp8(product), x, w)
    expected, (gx, gw) = reference(x, w, g)
    _close(out, expected)
    _close(vjp(g), (2.0 * gx, 2.0 * gw))


def test_integer_matmuls_are_left_alone():
    a = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    out = U.simulate_fp8(lambda u, v: u @ v)(a, a.T)
    np.testing.assert_array_equal(out, a @ a.T)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_nests_with_autoscale_both_orders(operands, dtype):
    x, w, g = operands
    sx = jsa.scaled_array(x.astype(dtype), 2.0**-30)
    sw = jsa.as_scaled_array(w.astype(dtype))
    f = lambda a, b: a @ b  # noqa: E731
    first = jsa.autoscale(U.simulate_fp8(f))(sx, sw)
    second = U.simulate_fp8(jsa.autoscale(f))(sx, sw)
    assert isinstance(first, jsa.ScaledArray) and isinstance(second, jsa.ScaledArray)
    _close(first.to_array(jnp.float32), second.to_array(jnp.float32), 0.0)
    expected = (
        q4(x.astype(dtype)).astype(jnp.float32) @ q4(w.astype(dtype)).astype(jnp.float32)
    ) * 2.0**-30
    np.testing.assert_allclose(first.to_array(jnp.float32), expected, rtol=2e-2, atol=1e-12)


def test_rescale_brings_small_data_into_the_format_range(operands):
    x, w, _ = operands
    tiny = 2.0**-14  # below E4M3's smallest subnormal (2^-9): flushed to zero unscaled
    sx = jsa.scaled_array(x * tiny, 1.0 / tiny)
    sw = jsa.as_scaled_array(w)
    f = lambda a, b: a @ b  # noqa: E731
    flushed = jsa.autoscale(U.simulate_fp8(f))(sx, sw).to_array()
    assert float(jnp.abs(flushed).max()) == 0.0
    rescaled = jsa.autoscale(U.simulate_fp8(f, rescale=True))(sx, sw).to_array()
    _close(rescaled, q4(x) @ q4(w), 1e-5)
    # On plain arrays, rescaling does nothing.
    _close(U.simulate_fp8(f, rescale=True)(x, w), q4(x) @ q4(w))


def test_gradient_program_under_jit_and_grad(operands):
    x, w, g = operands

    def loss(b):
        return jnp.sum(U.simulate_fp8(lambda a, c: a @ c)(x, b) * g)

    _close(jax.jit(jax.grad(loss))(w), reference(x, w, g)[1][1])


def test_bad_input():
    with pytest.raises(TypeError, match="expects a callable"):
        U.simulate_fp8("x @ w")
    with pytest.raises(ValueError, match="float8_e9m9"):
        U.simulate_fp8(lambda a: a, forward_format="float8_e9m9")
