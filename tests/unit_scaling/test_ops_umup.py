"""The u-muP arguments of the unit-scaled ops, each against its defining formula.

Constraints (`hmean`, `amean`, `to_left_grad_scale`, `to_right_grad_scale`), `mult`
(GELU, SiLU, SwiGLU, softmax, attention, cross-entropy), `scale_power` (linear,
convolutions, the u-muP readout), `add` with broadcasting and constants, `residual_apply`
and the transformer residual rule, attention's `scale` and dropout, and cross-entropy's
`ignore_index`, `weight` and `label_smoothing`.

Each is compared with the plain JAX computation on the same inputs: values to float
tolerance, gradients up to the documented factors; the factors' moments against
independent derivations; and the output and gradient stds measured on unit-normal inputs:

| case                                   | output (expected) | gradients (expected)          | tol |
|----------------------------------------|-------------------|-------------------------------|-----|
| gelu mult=4, None                      | 1.000 (1)         | 1.001 (1)                     | .02 |
| silu mult=0.25, None                   | 0.999 (1)         | 1.001 (1)                     | .02 |
| silu_glu mult=3, None                  | 0.996 (1)         | 1.000, 0.996 (1, 1)           | .02 |
| softmax (2048, 512) mult=3, None       | 0.989 (1)         | 1.033 (1)                     | .04 |
| softmax (256, 512) mult=0.25, None     | 0.996 (1)         | 1.000 (1)                     | .03 |
| attention scale="1/d" mult=4, None     | 0.972 (1)         | 0.985, 0.990, 1.015 (1, 1, 1) | .04 |
| attention causal, dropout 0.25, None   | 0.980 (1)         | 0.973, 0.969, 0.990 (1, 1, 1) | .04 |
| linear scale_power (1, 0.5, 0.5)       | 0.0623 (1/16)     | 0.997, 0.996 (1, 1)           | .02 |
| cross_entropy mult=2, smoothing 0.1    | (loss)            | 1.001 (1)                     | .02 |
| cross_entropy, half ignored (kept rows)| (loss)            | 1.000 (1)                     | .02 |

softmax with mult=3 (nearly one-hot rows) has heavy-tailed statistics: 512 rows measure
its gradient std anywhere from 0.99 to 1.11 depending on the draw; the Monte Carlo factor
itself is stable to 1% across seeds. The attention deviations are sampling noise (one
key set), as in test_ops.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jax_scaled_arithmetics.unit_scaling as U
from jax_scaled_arithmetics.unit_scaling import (
    _activations,
    _attention,
    _fwd_bwd,
    _losses,
    _softmax,
)
from tests.helpers import pairwise_params
from tests.unit_scaling.test_ops import assert_scaled, measure, normal, std, vjp_pairs

RBG = jax.random.key(11, impl="rbg")  # compiles in a fraction of threefry's time
TOL = {jnp.float32: 2e-5, jnp.float16: 1e-2, jnp.bfloat16: 6e-2}


def _gaussian_expectation(h: Callable[[np.ndarray], np.ndarray]) -> float:
    """E[h(X)], X ~ N(0, 1), by the trapezoid rule on a grid of step 1e-4."""
    x = np.linspace(-12.0, 12.0, 240_001)
    return float(np.trapezoid(h(x) * np.exp(-0.5 * x * x), x) / math.sqrt(2 * math.pi))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


# ---------------------------------------------------------------------------------------
# Constraints.


def test_means_and_operand_constraints():
    scales = (0.25, 4.0, 1.0)
    hmean = 3 / (1 / 0.25 + 1 / 4.0 + 1.0)
    out, grads = _fwd_bwd.apply_constraint("hmean", *scales)
    assert out == pytest.approx(hmean) and grads == (out, out)
    out, grads = _fwd_bwd.apply_constraint("amean", *scales)
    assert out == pytest.approx(1.75) and grads == (out, out)
    assert _fwd_bwd.apply_constraint("amean", 0.5, 1.5) == (1.0, (1.0,))
    assert _fwd_bwd.apply_constraint("to_left_grad_scale", *scales) == (4.0, (4.0, 4.0))
    assert _fwd_bwd.apply_constraint("to_right_grad_scale", *scales) == (1.0, (1.0, 1.0))
    for name in ("to_left_grad_scale", "to_right_grad_scale"):
        for grads in ((), (1.0,), (1.0, 2.0, 3.0)):
            with pytest.raises(ValueError, match=f"{name}' needs an op with two operands"):
                _fwd_bwd.apply_constraint(name, 1.0, *grads)  # type: ignore[arg-type]
    assert set(_fwd_bwd.CONSTRAINTS) == {
        "gmean",
        "hmean",
        "amean",
        "to_output_scale",
        "to_grad_input_scale",
        "to_left_grad_scale",
        "to_right_grad_scale",
    }


def test_constraints_on_ops_are_plain_times_tied_factors():
    x, w = normal(0, (8, 16)), normal(1, (16, 64))
    fan = (16**-0.5, 64**-0.5)  # linear: output, x grad
    for name, tied in (
        ("hmean", 2 / (1 / fan[0] + 1 / fan[1])),
        ("amean", (fan[0] + fan[1]) / 2),
    ):
        unit = lambda x, w, c=name: U.linear(x, w, constraint=c)
        out, (gx, gw) = vjp_pairs(unit, lambda x, w: x @ w, (x, w))
        assert_scaled(out, tied), assert_scaled(gx, tied), assert_scaled(gw, 8**-0.5)
    # add of a (8, 16) array and a (16,) row: grad factors 1 and 1/sqrt(8).
    row = normal(2, (16,))
    plain_add = lambda a, b: a + jnp.broadcast_to(b, a.shape)
    for name, tied in (("to_left_grad_scale", 1.0), ("to_right_grad_scale", 8**-0.5)):
        unit = lambda a, b, c=name: U.add(a, b, constraint=c)
        out, (ga, gb) = vjp_pairs(unit, plain_add, (x, row))
        assert_scaled(out, tied), assert_scaled(ga, tied), assert_scaled(gb, tied)
    # silu_glu: x grad factor E[silu^2]^(-1/2), gate's E[silu'^2]^(-1/2).
    _, second, grad_second = _activations.gaussian_moments("silu")
    gate = normal(3, (8, 16))
    unit = lambda a, g: U.silu_glu(a, g, constraint="to_right_grad_scale")
    out, (ga, gg) = vjp_pairs(unit, lambda a, g: a * jax.nn.silu(g), (x, gate))
    for pair in (out, ga, gg):
        assert_scaled(pair, grad_second**-0.5)
    # A matmul of two activations: the right operand's grad factor, 1/sqrt(M).
    unit = lambda a, b: U.matmul(a, b, constraint="to_right_grad_scale", constrain_rhs=True)
    out, (ga, gb) = vjp_pairs(unit, jnp.matmul, (x, w))
    for pair in (out, ga, gb):
        assert_scaled(pair, 8**-0.5)


@pytest.mark.parametrize(
    "call",
    [
        lambda: U.gelu(jnp.ones(4), constraint="to_left_grad_scale"),
        lambda: U.linear(jnp.ones((2, 4)), jnp.ones((4, 3)), constraint="to_right_grad_scale"),
        lambda: U.matmul(jnp.ones((2, 4)), jnp.ones((4, 3)), constraint="to_left_grad_scale"),
        lambda: U.scaled_dot_product_attention(
            jnp.ones((4, 8)), jnp.ones((4, 8)), jnp.ones((4, 8)), constraint="to_left_grad_scale"
        ),
    ],
)
def test_operand_constraints_on_ops_that_do_not_fit(call):
    with pytest.raises(ValueError, match="needs an op with two operands on the path"):
        call()


# ---------------------------------------------------------------------------------------
# mult: the moments against independent derivations.


@pytest.mark.parametrize("mult", [0.25, 3.0, 8.0])
def test_elementwise_moments_with_mult(mult):
    """Against the trapezoid rule on a finer grid and a finite-difference derivative."""
    c = math.sqrt(2 / math.pi)
    functions = {
        "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(c * (mult * x + 0.044715 * (mult * x) ** 3))),
        "silu": lambda x: x * _sigmoid(mult * x),
    }
    for name, f in functions.items():
        df = lambda x, f=f: (f(x + 1e-6) - f(x - 1e-6)) / 2e-6
        mean, second, grad_second = _activations.gaussian_moments(name, mult)
        assert mean == pytest.approx(_gaussian_expectation(f), rel=1e-7)
        assert second == pytest.approx(_gaussian_expectation(lambda x, f=f: f(x) ** 2), rel=1e-7)
        assert grad_second == pytest.approx(
            _gaussian_expectation(lambda x, df=df: df(x) ** 2), rel=1e-5
        )
    # The erf form: gelu(mult x)/mult = x Phi(mult x).
    mean, second, _ = _activations.gaussian_moments("gelu", mult)
    assert mean == pytest.approx(mult / math.sqrt(2 * math.pi * (1 + mult**2)), rel=1e-9)
    assert _activations.gaussian_moments.cache_info().currsize >= 3


@pytest.mark.parametrize("mult", [0.5, 3.0])
def test_softmax_moments_with_mult(mult):
    # n = 2: p = sigmoid(mult (x1 - x2)), x1 - x2 ~ N(0, 2); dx_1 = mult p1 p2 (g1 - g2).
    sig = lambda z: _sigmoid(mult * math.sqrt(2.0) * z)
    var_p, var_dx, mean_s = _softmax.softmax_moments(2, mult)
    assert var_p == pytest.approx(_gaussian_expectation(lambda z: sig(z) ** 2) - 0.25, rel=0.01)
    expected_dx = 2 * mult**2 * _gaussian_expectation(lambda z: (sig(z) * (1 - sig(z))) ** 2)
    assert var_dx == pytest.approx(expected_dx, rel=0.01)
    assert mean_s == pytest.approx(2 * _gaussian_expectation(lambda z: sig(z) ** 2), rel=0.01)
    # Long rows take the large-n limits: n^2 var p -> e^(m^2) - 1, E[S] -> e^(m^2) / n
    # (for mult 3, only beyond 2^16 e^9 elements).
    n = 1 << 22
    spread = math.exp(mult**2)
    if n > _softmax._SOFTMAX_ASYMPTOTIC * spread:
        var_p, var_dx, mean_s = _softmax.softmax_moments(n, mult)
        assert var_p * n * n == pytest.approx(spread - 1, rel=1e-9)
        assert mean_s * n == pytest.approx(spread, rel=1e-9)
    # Just below the switch, the Monte Carlo agrees with the limits.
    n = 1 << 14
    var_p, var_dx, mean_s = _softmax.softmax_moments(n, 0.5)
    assert var_p * n * n == pytest.approx(math.exp(0.25) - 1, rel=0.01)
    assert var_dx * n * n == pytest.approx(0.25 * math.exp(0.25), rel=0.01)


def test_attention_moments_follow_the_logit_scale():
    d = 16
    default = _attention.attention_moments(24, 24, d, False)
    assert _attention.attention_moments(24, 24, d, False, d**-0.5) == pytest.approx(
        default, rel=1e-12
    )
    # Logit scale 0: uniform weights over 24 keys, S = 1/24; dq = dk = 0.
    flat = _attention.attention_moments(24, 24, d, False, 1e-9)
    assert flat[0] == pytest.approx(1 / 24, rel=1e-6) and flat[3] == pytest.approx(1 / 24)
    assert flat[1] < 1e-15 and flat[2] < 1e-15
    # Sharper logits concentrate the weights: a larger output variance.
    assert _attention.attention_moments(24, 24, d, False, 1.0)[0] > default[0] > flat[0]


# ---------------------------------------------------------------------------------------
# mult, scale and dropout: each op against the plain computation, every dtype, jit or not.


def _attention_plain(q, k, v, c, keep=None, p=0.0, causal=False):
    s = jnp.einsum("...qd,...kd->...qk", q, k) * c
    if causal:
        tril = jnp.tril(jnp.ones(s.shape[-2:], bool))
        s = jnp.where(jnp.broadcast_to(tril, s.shape), s, -jnp.inf)
    w = jax.nn.softmax(s, axis=-1)
    if keep is not None:
        w = jnp.where(keep, w / (1 - p), 0.0)
    return jnp.einsum("...qk,...kd->...qd", w, v)


def _mult_case(op: str, mult: float):
    """(unit fn, plain fn, shapes, output factor, grad factors)."""
    if op in ("gelu", "gelu_erf", "silu"):
        name = {"gelu": "gelu_tanh", "gelu_erf": "gelu", "silu": "silu"}[op]
        fwd, bwd = _activations._elementwise_factors(name, mult)
        approx = op == "gelu"
        if op == "silu":
            unit = lambda x: U.silu(x, mult=mult, constraint=None)
            plain = lambda x: x * jax.nn.sigmoid(mult * x)
        else:
            unit = lambda x: U.gelu(x, approximate=approx, mult=mult, constraint=None)
            plain = lambda x: jax.nn.gelu(x * mult, approximate=approx) / mult
        return unit, plain, ((16, 32),), fwd, (bwd,)
    if op == "silu_glu":
        _, second, grad_second = _activations.gaussian_moments("silu", mult)
        unit = lambda x, g: U.silu_glu(x, g, mult=mult, constraint=None)
        plain = lambda x, g: x * g * jax.nn.sigmoid(mult * g)
        return unit, plain, ((16, 32),) * 2, second**-0.5, (second**-0.5, grad_second**-0.5)
    if op == "softmax":
        var_p, var_dx, _ = _softmax.softmax_moments(32, mult)
        unit = lambda x: U.softmax(x, mult=mult, constraint=None)
        plain = lambda x: jax.nn.softmax(mult * x, axis=-1)
        return unit, plain, ((16, 32),), var_p**-0.5, (var_dx**-0.5,)
    # Attention: (2, 12, 8) queries, (2, 16, 8) keys, values of dim 4.
    shapes = ((2, 12, 8), (2, 16, 8), (2, 16, 4))
    p, causal, scale = {
        "attention": (0.0, False, None),
        "attention_1/d_dropout": (0.25, False, "1/d"),
        "attention_float_causal": (0.0, True, 0.2),
    }[op]
    c = mult * {None: 8**-0.5, "1/d": 1 / 8, 0.2: 0.2}[scale]
    var_o, var_dq, var_dk, var_dv = _attention.attention_moments(12, 16, 8, causal, c)
    keep = jax.random.bernoulli(RBG, 1 - p, (2, 12, 16)) if p else None

    def unit(q, k, v):
        return U.scaled_dot_product_attention(
            q, k, v, is_causal=causal, dropout_p=p, key=RBG, mult=mult, scale=scale,
            constraint=None,
        )  # fmt: skip

    plain = lambda q, k, v: _attention_plain(q, k, v, c, keep, p, causal)
    grads = tuple((var / (1 - p)) ** -0.5 for var in (var_dq / 2, var_dk / 2, var_dv))
    return unit, plain, shapes, (var_o / (1 - p)) ** -0.5, grads


MULT_OPS = (
    "gelu",
    "gelu_erf",
    "silu",
    "silu_glu",
    "softmax",
    "attention",
    "attention_1/d_dropout",
    "attention_float_causal",
)
MULT_CASES = [
    (op, mult, dtype, jit)
    for op in MULT_OPS
    for mult in (0.5, 3.0)
    for dtype in (jnp.float32, jnp.float16, jnp.bfloat16)
    for jit in (True, False)
]


@pytest.mark.slow
@pytest.mark.parametrize("op, mult, dtype, jit", pairwise_params(MULT_CASES))
def test_mult_ops_are_plain_times_factors(op, mult, dtype, jit):
    unit, plain, shapes, fwd, grads = _mult_case(op, mult)
    args = tuple(normal(i, s, dtype) for i, s in enumerate(shapes))
    cot = normal(99, jax.eval_shape(plain, *args).shape, dtype)

    def run(args, cot):
        out, vjp = jax.vjp(unit, *args)
        return out, vjp(cot)

    out, unit_grads = (jax.jit(run) if jit else run)(args, cot)
    f32 = lambda a: a.astype(jnp.float32)
    plain_out, plain_vjp = jax.vjp(plain, *map(f32, args))
    plain_grads = plain_vjp(f32(cot))
    assert out.dtype == dtype and all(g.dtype == dtype for g in unit_grads)
    assert_scaled((out, plain_out), fwd, rtol=TOL[dtype])
    for g, pg, factor in zip(unit_grads, plain_grads, grads):
        assert_scaled((g, pg), factor, rtol=TOL[dtype])


def test_mult_and_scale_defaults_are_the_plain_ops():
    x = normal(0, (8, 16))
    for op in (U.gelu, U.silu, U.softmax):
        np.testing.assert_array_equal(op(x, mult=1.0), op(x))
    q, k, v = normal(1, (8, 16)), normal(2, (8, 16)), normal(3, (8, 16))
    base = U.scaled_dot_product_attention(q, k, v)
    for kwargs in (
        {"scale": "1/sqrt(d)"},
        {"scale": 0.25},
        {"dropout_p": 0.5, "deterministic": True},
        {"dropout_p": 0.0, "key": RBG},
    ):
        np.testing.assert_allclose(U.scaled_dot_product_attention(q, k, v, **kwargs), base)
    # scale="1/d" with mult=4 is the default scale 1/sqrt(16) = 4/16.
    np.testing.assert_allclose(
        U.scaled_dot_product_attention(q, k, v, scale="1/d", mult=4.0), base, rtol=1e-6
    )


# ---------------------------------------------------------------------------------------
# scale_power, add, residuals.


def test_scale_power_linear_readout_and_convs():
    x, w, b = normal(0, (3, 16, 64)), normal(1, (64, 128)), normal(2, (128,))
    plain = lambda x, w, b: x @ w + jnp.broadcast_to(b, (3, 16, 128))
    for powers in ((1.0, 0.5, 0.5), (0.25, 1.0, 0.0)):
        unit = lambda x, w, b, p=powers: U.linear(x, w, b, constraint=None, scale_power=p)
        # The bias enters the scaled product; its gradient gets the weight's factor only.
        out, (gx, gw, gb) = vjp_pairs(unit, plain, (x, w, b))
        assert_scaled(out, 64 ** -powers[0])
        assert_scaled(gx, 128 ** -powers[1])
        assert_scaled(gw, 48 ** -powers[2]), assert_scaled(gb, 48 ** -powers[2])
    # The readout's default: u-muP's 1/fan_in, unconstrained.
    out, (gx, gw) = vjp_pairs(U.linear_readout, lambda x, w: x @ w, (x, w))
    assert_scaled(out, 1 / 64), assert_scaled(gx, 128**-0.5), assert_scaled(gw, 48**-0.5)
    unit = lambda x, w: U.linear_readout(x, w, scale_power=(0.5, 0.5, 0.5))
    np.testing.assert_allclose(unit(x, w), U.linear(x, w, constraint=None), rtol=1e-6)
    # Convolutions: "VALID", stride 1; the counts of test_matmul_linear_conv_factors.
    x, k = normal(0, (2, 8, 8, 8)), normal(1, (3, 3, 8, 4))
    conv = lambda x, k: lax.conv_general_dilated(
        x, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    powers = (1.0, 0.25, 0.75)
    unit = lambda x, k: U.conv2d(x, k, padding="VALID", constraint=None, scale_power=powers)
    out, (gx, gk) = vjp_pairs(unit, conv, (x, k))
    assert_scaled(out, 72**-1.0), assert_scaled(gx, 20.25**-0.25), assert_scaled(gk, 72**-0.75)
    x, k, bias = normal(0, (2, 12, 8)), normal(1, (3, 8, 4)), normal(2, (4,))
    conv1 = lambda x, k, b: (
        lax.conv_general_dilated(x, k, (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"))
        + jnp.broadcast_to(b, (2, 10, 4))
    )
    unit = lambda x, k, b: U.conv1d(x, k, b, padding="VALID", constraint=None, scale_power=powers)
    # Counts: 3 x 8 = 24 per output; 2 x 10 rows per kernel element and bias; an input
    # element enters 3 taps x 4 outputs x 10/12 (the windows of "VALID") = 10 products.
    out, (gx, gk, gb) = vjp_pairs(unit, conv1, (x, k, bias))
    assert_scaled(out, 24**-1.0)  # the bias inside the scaled product
    assert_scaled(gk, 20**-0.75), assert_scaled(gb, 20**-0.75), assert_scaled(gx, 10.0**-0.25)


def test_add_broadcasting_and_constants():
    a, row, col = normal(0, (8, 16)), normal(1, (16,)), normal(2, (8, 1))
    bc = lambda x: jnp.broadcast_to(x, (8, 16))
    cases = (
        (row, 2**-0.5, (1.0, 8**-0.5)),
        (col, 2**-0.5, (1.0, 16**-0.5)),
        (normal(3, (1, 1)), 1.0, (1.0, 128**-0.5)),  # a single element: an offset
    )
    for b, fwd, (ga_f, gb_f) in cases:
        unit = lambda a, b: U.add(a, b, constraint=None)
        out, (ga, gb) = vjp_pairs(unit, lambda a, b: bc(a) + bc(b), (a, b))
        assert_scaled(out, fwd), assert_scaled(ga, ga_f), assert_scaled(gb, gb_f)
    # An outer sum (8, 1) + (1, 16): each element enters 16 or 8 outputs.
    out, (ga, gb) = vjp_pairs(
        lambda a, b: U.add(a, b, constraint=None), lambda a, b: bc(a) + bc(b), (col, row[None])
    )
    assert_scaled(out, 2**-0.5), assert_scaled(ga, 16**-0.5), assert_scaled(gb, 8**-0.5)
    # Constants (Python numbers, 0-d arrays): the plain sum in both passes.
    for const in (2.0, 3, jnp.float32(2.0), np.float32(0.5)):
        for fn in (lambda x, c=const: U.add(x, c), lambda x, c=const: U.add(c, x)):
            out, vjp = jax.vjp(fn, a)
            np.testing.assert_array_equal(out, a + const)
            np.testing.assert_array_equal(vjp(jnp.ones_like(a))[0], jnp.ones_like(a))
    assert float(U.add(1.0, 2.0)) == 3.0


@pytest.mark.parametrize(
    "dtype, jit", pairwise_params([(d, j) for d in (jnp.float16, jnp.bfloat16) for j in (0, 1)])
)
def test_add_low_precision(dtype, jit):
    a, b = normal(0, (8, 16), dtype), normal(1, (16,), dtype)
    fn = lambda a, b: U.add(a, b, constraint="to_right_grad_scale")
    plain = lambda a, b: a + jnp.broadcast_to(b, a.shape)
    out, (ga, gb) = _vjp_pair_any(fn, plain, (a, b), jit)
    assert out[0].dtype == dtype and ga[0].dtype == dtype and gb[0].dtype == dtype
    for pair in (out, ga, gb):
        assert_scaled(pair, 8**-0.5, rtol=TOL[dtype])


def _vjp_pair_any(unit, plain, args, jit):
    """`vjp_pairs`, jitted or eager; the plain side in float32."""

    def run(args):
        out_u, vjp_u = jax.vjp(unit, *args)
        cot = normal(99, out_u.shape, out_u.dtype)
        return out_u, vjp_u(cot), cot

    out_u, grads_u, cot = (jax.jit(run) if jit else run)(args)
    f32 = lambda x: x.astype(jnp.float32)
    out_p, vjp_p = jax.vjp(plain, *map(f32, args))
    return (out_u, out_p), list(zip(grads_u, vjp_p(f32(cot))))


def test_residual_apply_is_split_branch_add():
    x, w = normal(0, (16, 32)), normal(1, (32, 32))
    fn = lambda h: jnp.tanh(h @ w / math.sqrt(32))
    for tau in (0.2, 1.0, 3.0):
        unit = lambda x, tau=tau: U.residual_apply(fn, x, tau)

        def written_out(x, tau=tau):
            residual, skip = U.residual_split(x, tau)
            return U.residual_add(fn(residual), skip, tau)

        a, b = tau / math.sqrt(1 + tau**2), 1 / math.sqrt(1 + tau**2)
        out, (g,) = vjp_pairs(unit, lambda x, a=a, b=b: a * fn(x) + b * x, (x,))
        assert_scaled(out, 1.0), assert_scaled(g, 1.0)
        out, (g,) = vjp_pairs(unit, written_out, (x,))
        assert_scaled(out, 1.0, rtol=0), assert_scaled(g, 1.0, rtol=0)


def _contributions(tau: Callable[[int, int], float], layers: int) -> np.ndarray:
    """Variance each of embedding, branch 0, ..., branch layers-1 contributes to the final
    residual stream, each residual add mixing a unit branch with weight tau/sqrt(1 + tau^2)."""
    shares = np.array([1.0])
    for i in range(layers):
        t = tau(i, layers)
        shares = np.append(shares / (1 + t * t), t * t / (1 + t * t))
    return shares


@pytest.mark.parametrize("mult, ratio", [(1.0, 1.0), (0.5, 2.0), (2.0, 0.25)])
def test_transformer_residual_scaling_rule(mult, ratio):
    layers = 8
    tau = U.transformer_residual_scaling_rule(residual_mult=mult, residual_attn_ratio=ratio)
    shares = _contributions(tau, layers)
    embedding, attn, mlp = shares[0], shares[1::2], shares[2::2]
    np.testing.assert_allclose(attn, attn[0], rtol=1e-12)
    np.testing.assert_allclose(mlp, mlp[0], rtol=1e-12)
    # All branches on average residual_mult^2 x the embedding, attention / MLP ratio^2.
    assert (attn.sum() + mlp.sum()) / 2 == pytest.approx(mult**2 * embedding)
    assert attn[0] / mlp[0] == pytest.approx(ratio**2)
    # The formula as written.
    a_mlp = mult * math.sqrt(2 / (1 + ratio**2))
    a_attn = ratio * a_mlp
    assert tau(3, layers) == pytest.approx(a_mlp / math.sqrt(4 + 2 * a_attn**2 + a_mlp**2))
    if mult == ratio == 1.0:
        for i in range(layers):
            assert tau(i, layers) == pytest.approx(1 / math.sqrt(layers / 2 + i))


# ---------------------------------------------------------------------------------------
# cross_entropy: PyTorch's semantics, unit logits gradients.


def _torch_cross_entropy(logits, labels, weight=None, ignore_index=-100, reduction="mean", e=0.0):
    """PyTorch's `F.cross_entropy` (class indices), written out as its C++ code computes it:
    `(1 - e) nll_loss(log_softmax, weight) + e / V * smooth_loss`, both normalised alike."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    vocab = logits.shape[-1]
    w = jnp.ones(vocab) if weight is None else weight
    ignored = labels == ignore_index
    safe = jnp.where(ignored, 0, labels)
    w_y = jnp.where(ignored, 0.0, w[safe])
    nll = -w_y * jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
    smooth = jnp.where(ignored, 0.0, -(logp * jnp.broadcast_to(w, logp.shape)).sum(-1))
    if reduction == "none":
        return (1 - e) * nll + e / vocab * smooth
    if reduction == "sum":
        return (1 - e) * nll.sum() + e / vocab * smooth.sum()
    return (1 - e) * nll.sum() / w_y.sum() + e / vocab * smooth.sum() / w_y.sum()


def _ce_factor(vocab: int, mult: float, e: float) -> float:
    """One over the std of an entry of a term's gradient (the documented formula)."""
    _, _, mean_s = _softmax.softmax_moments(vocab, mult)
    second = mean_s - 2 / vocab + (1 - e) ** 2 + (2 * e - e * e) / vocab
    return (mult * mult * second / vocab) ** -0.5


CE_CASES = [
    (reduction, ignore, weighted, e, mult)
    for reduction in ("mean", "sum", "none")
    for ignore in (False, True)
    for weighted in (False, True)
    for e in (0.0, 0.2)
    for mult in (1.0, 2.5)
]


@pytest.mark.parametrize("reduction, ignore, weighted, e, mult", pairwise_params(CE_CASES))
def test_cross_entropy_is_pytorch_and_its_gradient_is_scaled(reduction, ignore, weighted, e, mult):
    logits = normal(0, (2, 6, 10))
    labels = jnp.asarray(np.random.default_rng(1).integers(0, 10, (2, 6)), jnp.int32)
    if ignore:
        labels = labels.at[0, :4].set(-100).at[1, 5].set(-100)
    weight = jnp.linspace(0.5, 2.0, 10) if weighted else None
    unit = lambda z: U.cross_entropy(
        z,
        labels,
        reduction=reduction,
        mult=mult,
        ignore_index=-100 if ignore else None,
        weight=weight,
        label_smoothing=e,
    )
    plain = lambda z: _torch_cross_entropy(mult * z, labels, weight, -100, reduction, e)
    out, (g,) = vjp_pairs(unit, plain, (logits,))
    assert_scaled(out, 1.0)
    count = 12 - 5 * ignore if reduction == "mean" else 1  # "mean": 1/count forward only
    assert_scaled(g, _ce_factor(10, mult, e) * count)


def test_cross_entropy_matches_optax():
    logits = normal(0, (32, 10))
    labels = jnp.asarray(np.random.default_rng(2).integers(0, 10, 32), jnp.int32)
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    np.testing.assert_allclose(U.cross_entropy(logits, labels, reduction="none"), expected, 1e-6)
    np.testing.assert_allclose(U.cross_entropy(logits, labels), expected.mean(), rtol=1e-6)
    smooth = optax.smooth_labels(jax.nn.one_hot(labels, 10), 0.1)
    expected = optax.softmax_cross_entropy(3.0 * logits, smooth).mean()
    np.testing.assert_allclose(
        U.cross_entropy(logits, labels, mult=3.0, label_smoothing=0.1), expected, rtol=1e-6
    )


def test_cross_entropy_second_moment_by_monte_carlo():
    """E[sum (dL/dz)^2] for one term against a direct estimate (another seed)."""
    rng = np.random.default_rng(123)
    vocab, rows = 12, 200_000
    for mult, e in ((1.0, 0.0), (2.0, 0.1), (0.5, 0.5)):
        z = mult * rng.standard_normal((rows, vocab))
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        t = (1 - e) * np.eye(vocab)[rng.integers(0, vocab, rows)] + e / vocab
        estimate = mult * mult * ((p - t) ** 2).sum(-1).mean()
        assert _losses.cross_entropy_second_moment(vocab, mult, e) == pytest.approx(
            estimate, rel=0.01
        )


_optax_ce = optax.softmax_cross_entropy_with_integer_labels


def test_cross_entropy_mean_counts_at_run_time():
    logits = normal(0, (8, 10))
    loss = jax.jit(
        jax.value_and_grad(
            lambda z, y: U.cross_entropy(z, y, ignore_index=-1, weight=jnp.full(10, 3.0))
        )
    )

    # The plain terms and the gradient of the kept ones' sum, at one shape (one compile;
    # eager, with the kept rows selected, every count was a compile of its own).
    @jax.jit
    def reference(z, y, kept):
        terms, vjp = jax.vjp(lambda z: _optax_ce(z, y), z)
        return terms, vjp(kept.astype(z.dtype))[0]

    base = np.arange(8) % 10
    for ignored in (0, 3, 7):
        labels = base.copy()
        labels[:ignored] = -1
        value, g = loss(logits, jnp.asarray(labels))
        kept = labels != -1
        terms, plain = reference(logits, jnp.asarray(np.where(kept, labels, 0)), kept)
        np.testing.assert_allclose(value, np.mean(np.asarray(terms)[kept]), rtol=1e-6)
        # Uniform weights: each kept term's gradient is its unit gradient, whatever the count.
        np.testing.assert_allclose(g, plain * _ce_factor(10, 1.0, 0.0), rtol=1e-5, atol=1e-6)
    assert loss._cache_size() == 1
    # Every term ignored: PyTorch's NaN loss; no gradient.
    value, g = loss(logits, jnp.full(8, -1))
    assert np.isnan(value) and np.all(g == 0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, jit", pairwise_params([(jnp.float16, 1), (jnp.bfloat16, 0)]))
def test_cross_entropy_low_precision(dtype, jit):
    logits = normal(0, (64, 10), dtype)
    labels = jnp.asarray(np.random.default_rng(3).integers(0, 10, 64), jnp.int32).at[:5].set(-100)
    kwargs = dict(ignore_index=-100, label_smoothing=0.1, mult=2.0, weight=jnp.linspace(1, 2, 10))
    fn = jax.value_and_grad(lambda z: U.cross_entropy(z, labels, **kwargs))
    value, g = (jax.jit(fn) if jit else fn)(logits)
    ref_value, ref_g = fn(logits.astype(jnp.float32))
    assert value.dtype == dtype and g.dtype == dtype
    np.testing.assert_allclose(float(value), float(ref_value), rtol=TOL[dtype])
    scale = float(jnp.abs(ref_g).max())
    np.testing.assert_allclose(
        np.asarray(g, np.float32), ref_g, atol=TOL[dtype] * scale, rtol=TOL[dtype]
    )


# ---------------------------------------------------------------------------------------
# Unit output and gradient stds for the new arguments (the table above).

N = 1 << 18


def _ids_labels(n: int, vocab: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(8).integers(0, vocab, (n,)), jnp.int32)


UNIT = {
    "gelu_mult4": (lambda x: U.gelu(x, mult=4.0, constraint=None), [(N,)], 1.0, (1.0,), 0.02),
    "silu_mult0.25": (lambda x: U.silu(x, mult=0.25, constraint=None), [(N,)], 1.0, (1.0,), 0.02),
    "silu_glu_mult3": (
        lambda x, g: U.silu_glu(x, g, mult=3.0, constraint=None),
        [(N,), (N,)],
        1.0,
        (1.0, 1.0),
        0.02,
    ),
    "softmax_mult3": (
        lambda x: U.softmax(x, mult=3.0, constraint=None),
        [(2048, 512)],
        1.0,
        (1.0,),
        0.04,
    ),
    "softmax_mult0.25": (
        lambda x: U.softmax(x, mult=0.25, constraint=None),
        [(256, 512)],
        1.0,
        (1.0,),
        0.03,
    ),
    "attention_1/d_mult4": (
        lambda q, k, v: U.scaled_dot_product_attention(
            q, k, v, scale="1/d", mult=4.0, constraint=None
        ),
        [(4, 4, 128, 64)] * 3,
        1.0,
        (1.0, 1.0, 1.0),
        0.04,
    ),
    "attention_causal_dropout": (
        lambda q, k, v: U.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=0.25, key=RBG, constraint=None
        ),
        [(4, 4, 128, 64)] * 3,
        1.0,
        (1.0, 1.0, 1.0),
        0.04,
    ),
    "linear_scale_power": (
        lambda x, w: U.linear(x, w, constraint=None, scale_power=(1.0, 0.5, 0.5)),
        [(1024, 256), (256, 256)],
        1 / 16,
        (1.0, 1.0),
        0.02,
    ),
}


@pytest.mark.parametrize("name", UNIT)
def test_unit_stds(name):
    fn, shapes, out, grads, tol = UNIT[name]
    out_std, grad_stds = measure(fn, tuple(normal(i, s) for i, s in enumerate(shapes)))
    assert abs(out_std - out) <= tol, (out_std, out)
    np.testing.assert_allclose(grad_stds, grads, atol=tol)


def test_cross_entropy_unit_gradients():
    logits = normal(0, (4096, 100))
    labels = _ids_labels(4096, 100)
    g = jax.jit(jax.grad(lambda z: U.cross_entropy(z, labels, mult=2.0, label_smoothing=0.1)))(
        logits
    )
    assert abs(std(g) - 1.0) < 0.02, std(g)
    ignored = labels.at[::2].set(-100)
    g = jax.jit(jax.grad(lambda z: U.cross_entropy(z, ignored, ignore_index=-100)))(logits)
    assert abs(std(g[1::2]) - 1.0) < 0.02, std(g[1::2])
    assert np.all(np.asarray(g[::2]) == 0)


# ---------------------------------------------------------------------------------------
# Bad input.

_X = jnp.ones((4, 8))
_L = jnp.zeros(4, jnp.int32)
BAD_INPUTS = [
    (lambda: U.gelu(_X, mult=0.0), ValueError, "mult must be positive and finite, got 0.0"),
    (lambda: U.silu(_X, mult=-1.0), ValueError, "mult must be positive"),
    (lambda: U.softmax(_X, mult=float("inf")), ValueError, "mult must be positive"),
    (lambda: U.silu_glu(_X, _X, mult=jnp.float32(2.0)), TypeError, "mult must be a Python number"),
    (lambda: U.linear(_X, jnp.ones((8, 3)), scale_power=(1.0, 0.5)), ValueError, "three numbers"),
    (
        lambda: U.conv1d(jnp.ones((1, 4, 4)), jnp.ones((3, 4, 4)), scale_power=(1, "a", 1)),
        TypeError,
        "each scale_power must be a Python number",
    ),
    (
        lambda: U.linear_readout(_X, jnp.ones((8, 3)), scale_power=(1, 1, math.nan)),
        ValueError,
        "finite",
    ),  # fmt: skip
    (lambda: U.add(_X, jnp.ones((3, 8))), ValueError, "must broadcast together, got shapes"),
    (lambda: U.add(_X, _X, constraint="mean"), ValueError, "Unknown unit-scaling constraint"),
    (lambda: U.residual_apply(_X, _X), TypeError, "fn must be callable"),
    (
        lambda: U.transformer_residual_scaling_rule(0.0),
        ValueError,
        "residual_mult must be positive",
    ),  # fmt: skip
    (lambda: U.transformer_residual_scaling_rule(1.0, -1.0), ValueError, "residual_attn_ratio"),
    (
        lambda: U.transformer_residual_scaling_rule()(4, 4),
        ValueError,
        "index must be in \\[0, layers\\)",
    ),  # fmt: skip
    (lambda: U.transformer_residual_scaling_rule()(1.0, 4), TypeError, "index must be an int"),
    (
        lambda: U.scaled_dot_product_attention(_X, _X, _X, dropout_p=0.1),
        ValueError,
        "dropout_p=0.1 needs a random key",
    ),
    (
        lambda: U.scaled_dot_product_attention(_X, _X, _X, dropout_p=1.0, key=RBG),
        ValueError,
        "dropout_p must be in \\[0, 1\\)",
    ),
    (
        lambda: U.scaled_dot_product_attention(_X, _X, _X, dropout_p=0.1, dropout_key=RBG),
        TypeError,
        "unexpected keyword argument 'dropout_key'",
    ),  # the dropout key is `key=` only
    (
        lambda: U.scaled_dot_product_attention(_X, _X, _X, scale="1/e"),
        ValueError,
        "scale must be None",
    ),  # fmt: skip
    (
        lambda: U.scaled_dot_product_attention(_X, _X, _X, scale=-1.0),
        ValueError,
        "scale must be positive",
    ),  # fmt: skip
    (
        lambda: U.scaled_dot_product_attention(_X, _X, _X, mult=0),
        ValueError,
        "mult must be positive",
    ),  # fmt: skip
    (
        lambda: U.cross_entropy(_X, _L, label_smoothing=1.5),
        ValueError,
        "label_smoothing must be in \\[0, 1\\]",
    ),  # fmt: skip
    (
        lambda: U.cross_entropy(_X, _L, ignore_index=1.5),
        TypeError,
        "ignore_index must be a Python int",
    ),  # fmt: skip
    (
        lambda: U.cross_entropy(_X, _L, weight=jnp.ones(4)),
        ValueError,
        "weight must have shape \\(V,\\) = \\(8,\\)",
    ),  # fmt: skip
    (
        lambda: U.cross_entropy(_X, _L, weight=jnp.ones(8, int)),
        TypeError,
        "weight must be a floating-point",
    ),  # fmt: skip
    (lambda: U.cross_entropy(_X, _L, mult=-2.0), ValueError, "mult must be positive"),
]


@pytest.mark.parametrize("call, error, message", BAD_INPUTS)
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()
