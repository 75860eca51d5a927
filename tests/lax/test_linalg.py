"""Table-driven tests of the dot_general and convolution rules."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.lax import linalg as linalg_module
from tests.helpers import (
    FLOAT_DTYPES,
    gradient_params,
    in_turn,
    make_scaled,
    one_dtype_each,
    represented,
)
from tests.lax.test_shape import (
    JIT_CASES,
    Case,
    assert_table_covers,
    case_inputs,
    check_case,
    check_mixed_scales,
    normal,
    run_grads,
    run_grid,
    vjp_of,
)

NHWC = ("NHWC", "HWIO", "NHWC")
NCHW = ("NCHW", "OIHW", "NCHW")


def conv_nhwc_groups(x, w):
    """Strides, kernel dilation and 2 feature groups, NHWC / HWIO."""
    return lax.conv_general_dilated(
        x, w, (2, 1), "SAME", rhs_dilation=(1, 2), dimension_numbers=NHWC, feature_group_count=2
    )


def conv_nchw_lhs_dilation(x, w):
    """Explicit padding and input (lhs) dilation, NCHW / OIHW."""
    return lax.conv_general_dilated(
        x, w, (1, 2), ((1, 1), (2, 0)), lhs_dilation=(2, 1), dimension_numbers=NCHW
    )


def bilinear(*args, **kwargs) -> Case:
    """A case whose output is a product of two scaled inputs (its reference: see Case.degree)."""
    return Case(*args, degree=2, **kwargs)


CASES = [
    bilinear("matmul", lambda a, b: a @ b, normal((3, 4), (4, 5)), grad=True),
    bilinear("dot_vector", lambda a, b: jnp.dot(a, b), normal((6,), (6,))),
    bilinear("matvec", lambda a, b: a @ b, normal((3, 5), (5,))),
    bilinear(
        "einsum_batch",
        lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
        normal((2, 3, 4), (2, 4, 5)),
    ),
    bilinear(
        "einsum_two_contracting",
        lambda a, b: jnp.einsum("ijk,jkl->il", a, b),
        normal((2, 3, 4), (3, 4, 5)),
    ),
    bilinear(
        "dot_general_preferred_f32",
        lambda a, b: lax.dot_general(
            a, b, (((0,), (1,)), ((2,), (0,))), preferred_element_type=jnp.float32
        ).astype(a.dtype),
        normal((5, 3, 2), (2, 5, 4)),
    ),
    bilinear("matmul_vjp", vjp_of(lambda a, b: a @ b), normal((3, 4), (4, 5), (3, 5))),
    bilinear("conv_nhwc_groups", conv_nhwc_groups, normal((2, 6, 5, 4), (3, 2, 2, 6)), grad=True),
    bilinear(
        "conv_nhwc_groups_vjp",
        vjp_of(conv_nhwc_groups),
        normal((2, 6, 5, 4), (3, 2, 2, 6), (2, 3, 5, 6)),
    ),
    bilinear(
        "conv_nchw_lhs_dilation",
        conv_nchw_lhs_dilation,
        normal((2, 3, 4, 5), (4, 3, 2, 3)),
        grad=True,
    ),
    bilinear(
        "conv_nchw_vjp",
        vjp_of(conv_nchw_lhs_dilation),
        normal((2, 3, 4, 5), (4, 3, 2, 3), (2, 4, 8, 3)),
    ),
    bilinear(
        "conv_depthwise",
        lambda x, w: lax.conv_general_dilated(
            x, w, (1, 1), "VALID", dimension_numbers=NHWC, feature_group_count=3
        ),
        normal((1, 5, 5, 3), (2, 2, 1, 3)),
    ),
    bilinear(
        "conv_batch_groups",
        lambda x, w: lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=NCHW, batch_group_count=2
        ),
        normal((4, 3, 4, 4), (4, 3, 3, 3)),
    ),
    bilinear(
        "conv_transpose",
        lambda x, w: lax.conv_transpose(x, w, (2, 2), "SAME", dimension_numbers=NHWC),
        normal((1, 3, 3, 2), (3, 3, 2, 4)),
    ),
    bilinear(
        "ragged_dot",
        lambda a, b, g: lax.ragged_dot(a, b, g),
        lambda rng: [rng.normal(size=(6, 4)), rng.normal(size=(3, 4, 2)), np.int32([2, 0, 4])],
        plain=(2,),
        grad=True,
    ),
    bilinear(
        "scaled_dot_block_scales",
        lambda a, b, sa, sb: lax.scaled_dot(
            a, b, lhs_scale=sa, rhs_scale=sb, preferred_element_type=jnp.float32
        ).astype(a.dtype),
        lambda rng: [
            rng.normal(size=(3, 8)),
            rng.normal(size=(8, 5)),
            2.0 ** rng.integers(-3, 4, size=(3, 2)),  # one per 4 contracted elements
            2.0 ** rng.integers(-3, 4, size=(2, 5)),
        ],
        plain=(2, 3),
    ),
    bilinear(
        "conv_1d_preferred_f32",
        lambda x, w: lax.conv_general_dilated(
            x, w, (1,), "SAME", preferred_element_type=jnp.float32
        ).astype(x.dtype),
        normal((2, 3, 8), (4, 3, 3)),
    ),
]


def _plain_runs(fn: Any, *args: Any) -> bool:
    """Whether plain JAX runs `fn` on this backend."""
    try:
        jax.block_until_ready(fn(*args))
    except NotImplementedError:  # JAX 0.10 lowers jax.nn.scaled_matmul for CUDA only
        return False
    return True


SCALED_MATMUL_CASE = bilinear(
    "nn_scaled_matmul_block_scales",
    lambda a, b, sa, sb: jax.nn.scaled_matmul(a, b, sa, sb).astype(a.dtype),
    lambda rng: [
        rng.normal(size=(2, 3, 8)),  # (B, M, K)
        rng.normal(size=(2, 5, 8)),  # (B, N, K)
        2.0 ** rng.integers(-3, 4, size=(2, 3, 2)),
        2.0 ** rng.integers(-3, 4, size=(2, 5, 2)),
    ],
    plain=(2, 3),
)
# Where plain JAX cannot run it here, the case still counts for the table's coverage and its
# scaled program is checked by trace (test_nn_scaled_matmul_traces_on_the_data).
if _plain_runs(
    SCALED_MATMUL_CASE.fn, *(x.astype(np.float32) for x in case_inputs(SCALED_MATMUL_CASE))
):
    CASES.append(SCALED_MATMUL_CASE)


# Each case with one dtype in the default run, the dtypes in turn (the slow step runs the
# others: the same rules, eagerly over every scale).
@pytest.mark.parametrize("case, dtype", one_dtype_each(CASES, [c.name for c in CASES]))
def test_linalg_table(case, dtype):
    run_grid(case, dtype)


# Each case with one of JIT_CASES in the default run, in turn; the slow step runs the other.
@pytest.mark.parametrize(
    "case, dtype, scale",
    in_turn(
        CASES[::3], [c.name for c in CASES[::3]], JIT_CASES, [f"{d}-{s}" for d, s in JIT_CASES]
    ),
)
def test_linalg_table_jit(case, dtype, scale):
    check_case(case, dtype, scale, use_jit=True)


# Gradients of matmul and ragged_dot in the default run; the slow step runs the convolutions'
# (their backward rules run forward under autoscale in conv_nhwc_groups_vjp, conv_nchw_vjp).
GRAD_DEFAULT = ("matmul", "ragged_dot")


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    gradient_params(CASES, GRAD_DEFAULT),
)
def test_linalg_table_grad(case):
    run_grads(case)


def test_linalg_table_covers_every_rule():
    assert_table_covers(linalg_module, [*CASES, SCALED_MATMUL_CASE])


def _conv_vjp_fan_ins(dtype):
    """Output scales of the two convolutions of a conv's gradient (unit input scales)."""
    x = make_scaled(np.ones((2, 6, 5, 4)), dtype, 1.0)
    w = make_scaled(np.ones((3, 2, 2, 6)), dtype, 1.0)
    ct = make_scaled(np.ones((2, 3, 5, 6)), dtype, 1.0)
    return jsa.autoscale(vjp_of(conv_nhwc_groups))(x, w, ct)


def test_static_policy_conv_gradient_scales_use_the_contracted_size():
    with jsa.AutoScaleConfig(policy=jsa.ScalePolicy.STATIC):
        gx, gw = _conv_vjp_fan_ins(np.float16)
    # d/dx contracts 3 output features per group x 3x2 kernel taps = 18 -> pow2(sqrt) = 4.
    assert float(gx.scale) == 4.0
    # d/dw contracts batch x output positions = 2 * 3 * 5 = 30 -> pow2(sqrt(30)) = 4.
    assert float(gw.scale) == 4.0


def test_dynamic_policy_conv_gradient_data_in_unit_range():
    gx, gw = _conv_vjp_fan_ins(np.float16)
    for grad in (gx, gw):
        largest = float(np.max(np.abs(np.asarray(grad.data, np.float32))))
        assert 1.0 <= largest < 2.0


def test_static_policy_dot_scale_and_float32_accumulation():
    a = make_scaled(np.full((2, 64), 1.0), np.float16, 2.0**-30)
    b = make_scaled(np.full((64, 3), 1.0), np.float16, 2.0**-30)
    with jsa.AutoScaleConfig(policy=jsa.ScalePolicy.STATIC):
        out = jsa.autoscale(lambda u, v: u @ v)(a, b)
    assert float(out.scale) == 2.0**-60 * 8  # sqrt(64)
    np.testing.assert_array_equal(represented(out), np.full((2, 3), 64 * 2.0**-60))


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_dynamic_policy_dot_scale_and_float32_accumulation(use_jit):
    """The default policy: the output scale is the power of two of the largest output (64
    here: data 1), the float16 data accumulated in float32 (64 * 2048 overflows float16)."""
    a = make_scaled(np.full((2, 64), 2048.0), np.float16, 2.0**-30)
    b = make_scaled(np.full((64, 3), 1.0), np.float16, 2.0**-30)
    fn = jsa.autoscale(lambda u, v: u @ v)
    out = (jax.jit(fn) if use_jit else fn)(a, b)
    assert float(out.scale) == 2.0**-60 * 64 * 2048
    np.testing.assert_array_equal(np.asarray(out.data, np.float32), np.ones((2, 3)))
    np.testing.assert_array_equal(represented(out), np.full((2, 3), 64 * 2048 * 2.0**-60))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_conv_different_scales(dtype):
    rng = np.random.default_rng(3)
    x, w = rng.normal(size=(2, 6, 5, 4)), rng.normal(size=(3, 2, 2, 6))
    check_mixed_scales(conv_nhwc_groups, [x, w], dtype, [2.0**-40, 2.0**25])


def test_einsum_under_jit_and_vmap():
    rng = np.random.default_rng(4)
    a = make_scaled(rng.normal(size=(3, 2, 4)), np.float16, 2.0**10)
    b = make_scaled(rng.normal(size=(3, 4, 5)), np.float16, 2.0**-12)
    axes = jsa.ScaledArray(0, None)
    fn = jax.jit(
        jax.vmap(jsa.autoscale(lambda u, v: jnp.einsum("ij,jk->ik", u, v)), in_axes=(axes, axes))
    )
    out = fn(a, b)  # one scale per example: a (3, 1, 1) block scale
    assert out.scale.shape == (3, 1, 1)
    value = np.asarray(out.to_array(np.float32), np.float64)
    expected = np.einsum("bij,bjk->bik", represented(a), represented(b))
    np.testing.assert_allclose(value, expected, rtol=4e-3, atol=4e-3 * abs(expected).max())


def test_bfloat16_batched_contraction_that_xla_cpu_cannot_accumulate_in_float32():
    """An attention-gradient-shaped dot_general (batch dims not leading in the rhs): XLA:CPU
    has no BF16 x BF16 = F32 kernel for it; the rule still runs it, in float32."""
    a = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4, 8, 16)), jnp.bfloat16)
    b = jnp.asarray(np.random.default_rng(1).normal(size=(4, 16, 4, 8)), jnp.bfloat16)
    dims = (((2,), (3,)), ((0, 1), (0, 2)))
    f = lambda x, y: jax.lax.dot_general(x, y, dims)  # noqa: E731
    out = jax.jit(jsa.autoscale(f))(jsa.as_scaled_array(a), jsa.as_scaled_array(b))
    expected = f(a.astype(jnp.float32), b.astype(jnp.float32))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(represented(out), expected, rtol=2e-2, atol=2e-2 * 8)


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_a_product_of_two_fp8_formats_has_the_plain_products_dtype(use_jit):
    """E4M3 activations or weights times E5M2 gradients with no `preferred_element_type`:
    JAX promotes no FP8 format to another (the rule's `result_type` raised
    TypePromotionError), its `dot_general` gives an E5M2 output; so does the rule, its
    data accumulated in float32, for the product and its gradients, a block-scaled operand
    too. (A convolution of two formats JAX refuses, plain or scaled.)"""
    import ml_dtypes

    e4m3, e5m2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
    rng = np.random.default_rng(11)
    a = make_scaled(rng.normal(size=(6, 16)), e4m3, 2.0**-12)
    b = make_scaled(rng.normal(size=(16, 5)), e5m2, 2.0**20)

    def product(u, v):
        return lax.dot_general(u, v, (((1,), (0,)), ((), ())))

    blocks = jsa.scaled_array(a.data, np.array([[2.0**-12], [2.0**-9]] * 3, np.float32))
    for fun, operands in ((product, (a, b)), (product, (blocks, b))):
        run = jsa.autoscale(fun)
        out = (jax.jit(run) if use_jit else run)(*operands)
        assert out.dtype == fun(*(o.data for o in operands)).dtype == e5m2
        want = fun(*(jnp.asarray(represented(o), jnp.float32) for o in operands))
        # E5M2 keeps 2 mantissa bits: an eighth of the largest entry at most.
        np.testing.assert_allclose(
            represented(out), want, atol=0.125 * float(jnp.max(jnp.abs(want)))
        )
    grad = jax.grad(lambda u, v: jnp.sum(product(u, v).astype(jnp.float32)), argnums=(0, 1))
    run_grad = jax.jit(jsa.autoscale(grad)) if use_jit else jsa.autoscale(grad)
    ga, gb = run_grad(a, b)
    assert (ga.dtype, gb.dtype) == (e4m3, e5m2)
    want_a, want_b = grad(*(jnp.asarray(represented(o), jnp.float32) for o in (a, b)))
    for got, want in ((ga, want_a), (gb, want_b)):
        np.testing.assert_allclose(
            represented(got), want, atol=0.13 * float(jnp.max(jnp.abs(want)))
        )


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_scaled_dot_keeps_fp8_data_and_e8m0_block_scales(use_jit):
    """`jax.lax.scaled_dot` as MX recipes call it: FP8 operands, e8m0 block scales (one per
    32 contracted elements). With ScaledArray operands the op runs on their FP8 data and the
    plain e8m0 block scales as they are (nothing converted or promoted: the form XLA maps
    to block-scaled GEMMs), and the per-tensor scales multiply the output's scale."""
    import ml_dtypes

    e4m3, e8m0 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e8m0fnu)
    rng = np.random.default_rng(5)
    a = make_scaled(rng.normal(size=(2, 4, 64)), e4m3, 2.0**-40)
    b = make_scaled(rng.normal(size=(2, 64, 8)), e4m3, 2.0**25)
    a_blocks = (2.0 ** rng.integers(-4, 4, size=(2, 4, 2))).astype(e8m0)
    b_blocks = (2.0 ** rng.integers(-4, 4, size=(2, 2, 8))).astype(e8m0)

    def fn(u, v, su, sv):
        return lax.scaled_dot(u, v, lhs_scale=su, rhs_scale=sv)

    run = jsa.autoscale(fn)
    out = (jax.jit(run) if use_jit else run)(a, b, a_blocks, b_blocks)
    plain = fn(a.data, b.data, a_blocks, b_blocks)  # bfloat16, at scale 1
    assert isinstance(out, jsa.ScaledArray) and out.dtype == plain.dtype == jnp.bfloat16
    want = np.asarray(plain, np.float64) * 2.0**-15
    np.testing.assert_allclose(represented(out), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    jaxpr = jax.make_jaxpr(run)(a, b, a_blocks, b_blocks).jaxpr
    (dot,) = [e for e in jaxpr.eqns if e.primitive.name == "scaled_dot"]
    assert [v.aval.dtype for v in dot.invars] == [e4m3, e4m3, e8m0, e8m0]


def test_nn_scaled_matmul_traces_on_the_data():
    """`jax.nn.scaled_matmul` (cuDNN's block-scaled matmul) under autoscale binds the same
    primitive on the FP8 data and the plain e8m0 block scales, whether or not this JAX
    lowers it for this backend (JAX 0.10 lowers it for CUDA only)."""
    import ml_dtypes

    e4m3, e8m0 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e8m0fnu)
    a = make_scaled(np.ones((1, 4, 64)), e4m3, 2.0**-20)
    b = make_scaled(np.ones((1, 8, 64)), e4m3, 2.0**7)
    blocks_a, blocks_b = np.ones((1, 4, 2), e8m0), np.ones((1, 8, 2), e8m0)
    jaxpr = jax.make_jaxpr(jsa.autoscale(jax.nn.scaled_matmul))(a, b, blocks_a, blocks_b)
    found = []

    def walk(inner: Any) -> None:
        for eqn in inner.eqns:
            if eqn.primitive.name == "scaled_matmul_wrapper":
                found.append([v.aval.dtype for v in eqn.invars])
            for param in eqn.params.values():
                if hasattr(param, "jaxpr"):
                    walk(param.jaxpr)

    walk(jaxpr.jaxpr)
    assert found == [[e4m3, e4m3, e8m0, e8m0]]
