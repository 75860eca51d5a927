"""`jsa.ops.simulate_fp8`: matmul operands in E4M3 forward, output gradients in E5M2 backward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.quantization import float_quantize
from tests.helpers import eager_and_jit

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def q4(x):
    return float_quantize(x, E4M3, saturate=True)


def q5(x):
    return float_quantize(x, E5M2, saturate=True)


def normal(seed, shape):
    """A float32 normal draw from numpy (a `jax.random` draw compiles once per shape)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


@pytest.fixture(scope="module")
def operands():
    # jax.random draws (test_rescale_brings_small_data_into_the_format_range's exact
    # comparison holds for these; not for every draw).
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


@pytest.mark.parametrize(
    "dtype, jit",
    # Eager (a compile per operation) in the default run for float32; float16 and bfloat16
    # jitted, their eager variants in the slow step.
    eager_and_jit([jnp.float32, jnp.float16, jnp.bfloat16], lambda dtype: dtype == jnp.float32),
)
def test_matmul_operands_and_output_gradient_are_rounded(operands, jit, dtype):
    x, w, g = (v.astype(dtype) for v in operands)
    f = jsa.ops.simulate_fp8(lambda a, b: a @ b)
    f = jax.jit(f) if jit else f
    out, vjp = jax.vjp(f, x, w)
    assert out.dtype == dtype
    expected, grads = jax.jit(reference)(x, w, g)  # one compile (eager: one per operation)
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    _close(out, expected, tol)
    _close(vjp(g), grads, tol)
    # The rounding is real: the plain product differs.
    assert not np.allclose(np.asarray(out, np.float32), np.asarray(x @ w, np.float32), rtol=1e-3)


def test_saturation(operands):
    x, w, _ = operands
    big = x.at[0, 0].set(1000.0)
    out = jsa.ops.simulate_fp8(lambda a, b: a @ b)(big, w)
    _close(out, q4(big) @ q4(w))
    assert float(q4(big)[0, 0]) == 448.0
    unsaturated = jsa.ops.simulate_fp8(lambda a, b: a @ b, saturate=False)(big, w)
    assert not bool(jnp.all(jnp.isfinite(unsaturated[0])))


def test_other_formats(operands):
    x, w, _ = operands
    f = jsa.ops.simulate_fp8(lambda a, b: a @ b, forward_format="float8_e5m2")
    _close(f(x, w), q5(x) @ q5(w))


def test_convolution_operands_are_rounded():
    x, k = normal(1, (2, 9, 9, 3)), normal(2, (3, 3, 3, 5))

    def conv(a, b):
        return jax.lax.conv_general_dilated(
            a, b, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    _close(jsa.ops.simulate_fp8(conv)(x, k), conv(q4(x), q4(k)), 1e-5)


def test_control_flow_and_vmap(operands):
    x, w, _ = operands
    w2 = normal(3, (16, 16)) * 0.25

    def scanned(a):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w2), None), a, None, length=3)[0]

    expected = x
    for _ in range(3):
        expected = jnp.tanh(q4(expected) @ q4(w2))
    _close(jsa.ops.simulate_fp8(scanned)(x), expected, 1e-6)

    xs = jnp.stack([x, 2.0 * x])
    f = lambda a, b: a @ b  # noqa: E731
    outer = jax.vmap(jsa.ops.simulate_fp8(f), in_axes=(0, None))(xs, w)
    inner = jsa.ops.simulate_fp8(jax.vmap(f, in_axes=(0, None)))(xs, w)
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
    out, vjp = jax.vjp(jsa.ops.simulate_fp8(product), x, w)
    expected, (gx, gw) = reference(x, w, g)
    _close(out, expected)
    _close(vjp(g), (2.0 * gx, 2.0 * gw))


def test_integer_matmuls_are_left_alone():
    a = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    out = jsa.ops.simulate_fp8(lambda u, v: u @ v)(a, a.T)
    np.testing.assert_array_equal(out, a @ a.T)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_nests_with_autoscale_both_orders(operands, dtype):
    x, w, g = operands
    sx = jsa.scaled_array(x.astype(dtype), 2.0**-30)
    sw = jsa.as_scaled_array(w.astype(dtype))
    f = lambda a, b: a @ b  # noqa: E731
    first = jsa.autoscale(jsa.ops.simulate_fp8(f))(sx, sw)
    second = jsa.ops.simulate_fp8(jsa.autoscale(f))(sx, sw)
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
    flushed = jsa.autoscale(jsa.ops.simulate_fp8(f))(sx, sw).to_array()
    assert float(jnp.abs(flushed).max()) == 0.0
    rescaled = jsa.autoscale(jsa.ops.simulate_fp8(f, rescale=True))(sx, sw).to_array()
    _close(rescaled, q4(x) @ q4(w), 1e-5)
    # On plain arrays, rescaling does nothing.
    _close(jsa.ops.simulate_fp8(f, rescale=True)(x, w), q4(x) @ q4(w))


def test_gradient_program_under_jit_and_grad(operands):
    x, w, g = operands

    def loss(b):
        return jnp.sum(jsa.ops.simulate_fp8(lambda a, c: a @ c)(x, b) * g)

    _close(jax.jit(jax.grad(loss))(w), reference(x, w, g)[1][1])


def test_bad_input():
    with pytest.raises(TypeError, match="expects a callable"):
        jsa.ops.simulate_fp8("x @ w")
    with pytest.raises(ValueError, match="float8_e9m9"):
        jsa.ops.simulate_fp8(lambda a: a, forward_format="float8_e9m9")


# --- scale_layout: one power of two per row / channel / MX block --------------------------

M, K, N, B = 4, 32, 16, 8  # x: (M, K), w: (K, N), output gradient: (M, N); MX blocks of B


def round_blocks(v, quantize, block):
    """numpy reference: each block (of shape `block`) of `v` rounded by `quantize` at its own
    power of two (the one at or below its largest magnitude), as dynamic_rescale_max does."""
    v = np.asarray(v, np.float64)
    out = np.empty_like(v)
    for i in range(0, v.shape[0], block[0]):
        for j in range(0, v.shape[1], block[1]):
            part = v[i : i + block[0], j : j + block[1]]
            scale = 2.0 ** np.floor(np.log2(np.abs(part).max()))
            rounded = np.asarray(quantize(jnp.asarray(part / scale, jnp.float32)), np.float64)
            out[i : i + block[0], j : j + block[1]] = rounded * scale
    return out


def assert_product(got, a, b):
    """`got` is `a @ b` up to float32 accumulation: within 1e-5 of `|a| @ |b|` (the bound
    that holds where large terms cancel and leave the small ones)."""
    got = np.asarray(got.to_array() if isinstance(got, jsa.ScaledArray) else got, np.float64)
    assert np.all(np.abs(got - a @ b) <= 1e-5 * (np.abs(a) @ np.abs(b)))


def layout_blocks(layout):
    """The blocks of x, w and of the output gradient g for each `scale_layout`."""
    return {
        "tensor": ((M, K), (K, N), (M, N)),
        "axis": ((1, K), (K, 1), (1, N)),  # per row of x, per output channel of w, per row of g
        B: ((1, B), (B, 1), (1, B)),  # MX blocks along the contracting axis (and g's last)
    }[layout]


def spread(shape, axis, period, key):
    """Normal values whose blocks of `period` along `axis` alternate between magnitudes 1
    and 2^-20 (E4M3's range is 2^-9..448: one power of two cannot hold both)."""
    index = np.arange(shape[axis]) // period % 2
    factor = np.where(index == 1, 2.0**-20, 1.0)
    factor = factor.reshape([-1 if a == axis else 1 for a in range(len(shape))])
    return np.random.default_rng(key).standard_normal(shape).astype(np.float32) * factor


def matmul_and_gradients(layout):
    f = jsa.ops.simulate_fp8(lambda a, b: a @ b, rescale=True, scale_layout=layout)

    def step(x, w, g):
        out, vjp = jax.vjp(f, x, w)
        return out, vjp(g)

    return jax.jit(jsa.autoscale(step))


@pytest.mark.parametrize(
    "pattern",
    ["rows", "blocks"],  # magnitudes alternate from row to row / from block to block in a row
)
@pytest.mark.parametrize("layout", ["tensor", "axis", B])
def test_scale_layouts_round_each_block_at_its_own_scale(layout, pattern):
    if pattern == "rows":  # rows of x and g, columns of w, 2^20 apart
        x, w, g = spread((M, K), 0, 1, 0), spread((K, N), 1, 1, 1), spread((M, N), 0, 1, 2)
    else:  # blocks of B along the contracting axis (and along g's rows) 2^20 apart
        x, w, g = spread((M, K), 1, B, 0), spread((K, N), 0, B, 1), spread((M, N), 1, B, 2)
    sx, sw, sg = (jsa.as_scaled_array(jnp.asarray(v, jnp.float32)) for v in (x, w, g))
    out, (gx, gw) = matmul_and_gradients(layout)(sx, sw, sg)
    for v in (out, gx, gw):
        assert isinstance(v, jsa.ScaledArray)

    bx, bw, bg = layout_blocks(layout)
    xq, wq, gq = round_blocks(x, q4, bx), round_blocks(w, q4, bw), round_blocks(g, q5, bg)
    for got, (a, b) in zip((out, gx, gw), ((xq, wq), (gq, wq.T), (xq.T, gq)), strict=True):
        assert_product(got, a, b)

    # What each layout keeps: a small row (pattern "rows") or block ("blocks") of x is lost
    # (flushed to zero) when it shares its power of two with values 2^20 larger.
    kept = layout == B or (layout == "axis" and pattern == "rows")
    small = (slice(1, 2), slice(None)) if pattern == "rows" else (slice(None), slice(B, 2 * B))
    assert bool(np.all(xq[small] != 0.0)) == kept
    assert bool(np.all(gq[small] != 0.0)) == kept


def test_scale_layout_operand_scale_shapes():
    """The scale shapes asked for a dot_general's operands and its output gradient."""
    from jax_scaled_arithmetics.ops import fp8_simulation as _fp8

    assert _fp8._operand_scale_shape((2, 3, 64), (2,), "tensor") is None
    assert _fp8._operand_scale_shape((2, 3, 64), (2,), "axis") == (2, 3, 1)
    assert _fp8._operand_scale_shape((64, 5), (0,), "axis") == (1, 5)
    assert _fp8._operand_scale_shape((2, 3, 64), (2,), 32) == (2, 3, 2)
    assert _fp8._operand_scale_shape((64, 5), (0,), 32) == (2, 5)
    assert _fp8._operand_scale_shape((2, 3, 64), (1, 2), 32) == (2, 3, 2)  # blocks on the last
    assert _fp8._operand_scale_shape((2, 3, 48), (2,), 32) == (2, 3, 1)  # 32 does not divide 48
    assert _fp8._gradient_scale_shape((2, 3, 64), "axis") == (2, 3, 1)
    assert _fp8._gradient_scale_shape((2, 3, 64), 32) == (2, 3, 2)
    assert _fp8._gradient_scale_shape((), 32) is None


@pytest.mark.parametrize("layout", ["axis", B])
def test_scale_layout_in_an_einsum_and_under_vmap(layout):
    """Batch dimensions and vmap: the blocks follow the dimension numbers, the values match a
    per-example computation."""
    x = jnp.asarray(spread((3, M, K), 1, 1, 0), jnp.float32)
    w = jnp.asarray(spread((3, K, N), 2, 1, 1), jnp.float32)
    sx, sw = jsa.as_scaled_array(x), jsa.as_scaled_array(w)
    fp8 = functools.partial(jsa.ops.simulate_fp8, rescale=True, scale_layout=layout)
    batched = jax.jit(jsa.autoscale(fp8(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b))))(sx, sw)
    mapped = jax.jit(jsa.autoscale(jax.vmap(fp8(lambda a, b: a @ b))))(sx, sw)
    bx, bw, _ = layout_blocks(layout)
    for i in range(3):
        a, b = round_blocks(x[i], q4, bx), round_blocks(w[i], q4, bw)
        for got in (batched, mapped):
            assert_product(got.to_array()[i], a, b)


def test_scale_layout_keeps_convolutions_per_tensor():
    x, k = normal(1, (2, 9, 9, 3)), normal(2, (3, 3, 3, 5))

    def conv(a, b):
        return jax.lax.conv_general_dilated(
            a, b, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    sx, sk = jsa.as_scaled_array(x), jsa.as_scaled_array(k)
    per_tensor = jsa.autoscale(jsa.ops.simulate_fp8(conv, rescale=True))(sx, sk)
    axis = jsa.autoscale(jsa.ops.simulate_fp8(conv, rescale=True, scale_layout="axis"))(sx, sk)
    _close(axis.to_array(), per_tensor.to_array(), 0.0)


def test_scale_layout_without_autoscale_and_bad_layouts(operands):
    x, w, _ = operands
    f = lambda a, b: a @ b  # noqa: E731
    # On plain arrays rescaling does nothing, whatever the layout.
    _close(jsa.ops.simulate_fp8(f, rescale=True, scale_layout=B)(x, w), q4(x) @ q4(w))
    with pytest.raises(ValueError, match="needs rescale=True"):
        jsa.ops.simulate_fp8(f, scale_layout="axis")
    with pytest.raises(ValueError, match="needs rescale=True"):
        jsa.ops.simulate_fp8(f, rescale=False, scale_layout=32)
    for bad in ("row", 0, 2.5, True):
        with pytest.raises(ValueError, match="scale_layout"):
            jsa.ops.simulate_fp8(f, rescale=True, scale_layout=bad)
