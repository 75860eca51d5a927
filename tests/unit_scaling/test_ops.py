"""Unit-scaled ops: unit outputs and gradients for unit inputs, exact values, dtypes, jit, vmap.

Measured std of the output and of each input's gradient (unit-normal inputs and output
gradient, the shapes of UNIT_CASES; loss gradients for a cotangent of 1), the expected
value and the tolerance each is checked to. Unconstrained ops expect 1; constrained ones
the deviation their tied factor implies (stated next to the case). The default constraint,
"to_output_scale" ("default" below), keeps every output at 1 and puts the deviation on
the input gradients on the path; "gmean" splits it between the output and them:

| case                          | output (expected)   | gradients (expected)                 | tol |
|-------------------------------|---------------------|--------------------------------------|-----|
| dot_general batch dims, None  | 0.987 (1)           | 0.996, 0.998 (1, 1)                  | .02 |
| dot_general K256 N64, default | 0.987 (1)           | 0.498, 0.998 (0.5, 1)                | .02 |
| dot_general K=256 N=64, gmean | 1.395 (1.414)       | 0.704, 0.998 (0.707, 1)              | .02 |
| matmul, weight broadcast      | 0.993 (1)           | 1.000, 0.992 (1, 1)                  | .02 |
| linear 256->256, default      | 0.997 (1)           | 0.997, 0.996 (1, 1)                  | .02 |
| linear 32->8192 + bias, None  | 1.009 (1)           | 0.989, 1.008, 1.011 (1, 1, 1)        | .02 |
| linear 256->1024, gmean       | 0.703 (0.707)       | 1.407, 0.994 (1.414, 1)              | .03 |
| linear 256->1024, default     | 0.995 (1)           | 1.990, 0.994 (2, 1)                  | .04 |
| linear_readout 64->1000       | 0.124 (0.125)       | 0.997, 0.996 (1, 1)                  | .02 |
| conv1d SAME, default          | 1.027 (1)           | 1.023, 0.994 (1, 1)                  | .03 |
| conv2d stride 2, 2 groups     | 1.009 (1)           | 1.021, 1.011 (1, 1)                  | .03 |
| gelu (tanh / erf), None       | 1.000 (1)           | 1.002 (1)                            | .02 |
| gelu, default                 | 1.000 (1)           | 1.150 (1.148)                        | .02 |
| gelu, gmean                   | 0.934 (0.933)       | 1.073 (1.072)                        | .02 |
| silu, None                    | 1.000 (1)           | 1.002 (1)                            | .02 |
| silu_glu, None                | 0.996 (1)           | 1.001, 0.998 (1, 1)                  | .02 |
| silu_glu, default             | 0.996 (1)           | 1.001, 1.030 (1, 1.033)              | .02 |
| softmax n=512, None           | 0.985 (1)           | 0.994 (1)                            | .03 |
| softmax n=8, None             | 0.996 (1)           | 1.003 (1)                            | .03 |
| softmax n=512, default        | 0.985 (1)           | 1.240 (1.248)                        | .03 |
| softmax n=512, gmean          | 0.882 (0.895)       | 1.110 (1.117)                        | .03 |
| dropout rate 0.25             | 0.998 (1)           | 0.998 (1)                            | .02 |
| layer_norm n=4096 (x, w, b)   | 1.000 (1)           | 1.002, 1.009, 1.019 (1, 1, 1)        | .02 |
| rms_norm n=4096 (x, w)        | 1.000 (1)           | 1.002, 1.010 (1, 1)                  | .02 |
| embedding V=512, 8192 ids     | 0.999 (1)           | 1.008 (1)                            | .03 |
| add, None                     | 0.998 (1)           | 1.000, 1.000 (1, 1)                  | .02 |
| add, default                  | 0.998 (1)           | 0.707, 0.707 (.707, .707)            | .02 |
| add, gmean                    | 1.257 (1.260)       | 0.891, 0.891 (.891, .891)            | .02 |
| add (64, 4096) + (4096,)      | 1.006 (1)           | 1.000, 1.019 (1, 1)                  | .02 |
| residual_add tau=0.5          | 0.998 (1)           | 1.000, 1.000 (1, 1)                  | .02 |
| residual_split tau=0.5        | 0.998, 0.998 (1, 1) | 1.001 (1)                            | .02 |
| residual_apply tau=0.5        | 0.999 (1)           | 1.000 (1)                            | .02 |
| attention 128x128 d=64, None  | 0.976 (1)           | 0.981, 0.983, 1.001 (1, 1, 1)        | .03 |
| attention causal 96x128 dv=32 | 0.981 (1)           | 1.023, 1.033, 0.995 (1, 1, 1)        | .04 |
| attn 128x128 d=64, default    | 0.976 (1)           | 0.949, 0.958, 1.001 (.97, .97, 1)    | .03 |
| attention 128x128 d=64, gmean | 0.991 (1.015)       | 0.963, 0.972, 1.016 (.98, .99, 1.02) | .03 |
| cross_entropy V=1000, mean    | (loss)              | 1.000 (1)                            | .02 |
| cross_entropy V=8, none       | (losses)            | 1.008 (1)                            | .03 |
| mse_loss, mean                | (loss)              | 0.998, 0.998 (1, 1)                  | .02 |

The deviations from the expected values are sampling noise (a single weight, kernel or
key set per case); with 64 attention heads instead of 16 the attention stds are within
1%. The reference PyTorch library measures linear 1.00 / 1.41, gelu 1.04 / 1.19, softmax
0.66 / 0.82 and residual add 1.34.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_scaled_arithmetics.unit_scaling as U
from jax_scaled_arithmetics.unit_scaling import _activations, _attention, _fwd_bwd, _softmax
from tests.helpers import eager_and_jit

DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def normal(seed: int, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """Unit-normal data from numpy (a jax.random draw would compile once per shape)."""
    data = np.random.default_rng(seed).standard_normal(shape, np.float32)
    return jnp.asarray(data).astype(dtype)


def std(x: jax.Array) -> float:
    return float(np.std(np.asarray(x, np.float64)))


def measure(fn: Callable[..., Any], args: tuple[Any, ...]):
    """Std of `fn(*args)` (None for a scalar) and of each floating argument's gradient for a
    unit-normal cotangent (1 for a scalar); integer arguments (ids, labels) get none."""
    out_shape = jax.eval_shape(fn, *args)
    outs = out_shape if isinstance(out_shape, tuple) else (out_shape,)
    cots = tuple(
        jnp.ones(o.shape, o.dtype) if o.ndim == 0 else normal(100 + i, o.shape, o.dtype)
        for i, o in enumerate(outs)
    )

    @jax.jit
    def run(args, cots):
        out, vjp = jax.vjp(fn, *args)
        grads = vjp(cots if isinstance(out, tuple) else cots[0])
        floats = [g for a, g in zip(args, grads) if jnp.issubdtype(a.dtype, jnp.floating)]
        return (out if isinstance(out, tuple) else (out,)), floats

    outs, grads = run(args, cots)
    assert all(x.dtype == jnp.float32 for x in (*outs, *grads))  # the dtype is kept
    out_stds = [std(o) for o in outs]
    if isinstance(out_shape, tuple):
        return out_stds, [std(g) for g in grads]
    return (None if out_shape.ndim == 0 else out_stds[0]), [std(g) for g in grads]


# ---------------------------------------------------------------------------------------
# The table: unit outputs and gradients.


class Case(NamedTuple):
    fn: Callable[..., Any]
    args: Callable[[], tuple[Any, ...]]  # built lazily: only the selected cases pay for data
    out: Any  # expected output std (a list for several outputs; None for a loss)
    grads: tuple[float, ...]  # expected std of each argument's gradient
    tol: float


def normals(*shapes: tuple[int, ...]) -> Callable[[], tuple[jax.Array, ...]]:
    return lambda: tuple(normal(i, s) for i, s in enumerate(shapes))


def gmean(*values: float) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


BATCH_DN = (((2,), (1,)), ((0,), (0,)))
RBG_KEY = jax.random.key(3, impl="rbg")  # compiles in a fraction of threefry's time
N = 1 << 18  # elementwise sample size
GELU_F, GELU_B = _activations._elementwise_factors("gelu_tanh")
SOFTMAX_P, SOFTMAX_DX, _ = _softmax.softmax_moments(512)
_, SILU_SECOND, SILU_GRAD = _activations.gaussian_moments("silu")
ATT = [1 / math.sqrt(v) for v in _attention.attention_moments(128, 128, 64, False)]
ATT_T = gmean(*ATT)


def _ids() -> jax.Array:
    return jnp.asarray(np.random.default_rng(7).integers(0, 512, (64, 128)), jnp.int32)


def _labels(n: int, vocab: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(8).integers(0, vocab, (n,)), jnp.int32)


UNIT_CASES = {
    "dot_general": Case(
        lambda a, b: U.dot_general(a, b, BATCH_DN, constraint=None),
        normals((4, 128, 256), (4, 256, 64)),
        1.0,
        (1.0, 1.0),
        0.02,
    ),
    # The default, to_output_scale: lhs grad factor 1/sqrt(256) on a sum over 64: 1/2.
    "dot_general_to_output": Case(
        lambda a, b: U.dot_general(a, b, BATCH_DN),
        normals((4, 128, 256), (4, 256, 64)),
        1.0,
        (0.5, 1.0),
        0.02,
    ),
    # gmean: fwd = lhs grad factor = (256 * 64)^(-1/4): output (256/64)^(1/4), lhs grad inverse.
    "dot_general_gmean": Case(
        lambda a, b: U.dot_general(a, b, BATCH_DN, constraint="gmean"),
        normals((4, 128, 256), (4, 256, 64)),
        math.sqrt(2.0),
        (1 / math.sqrt(2.0), 1.0),
        0.02,
    ),
    "matmul": Case(U.matmul, normals((8, 64, 256), (256, 256)), 1.0, (1.0, 1.0), 0.02),
    "linear": Case(U.linear, normals((1024, 256), (256, 256)), 1.0, (1.0, 1.0), 0.02),
    # bias gradient: a sum over the 64 rows, 8192 entries.
    "linear_bias": Case(
        lambda x, w, b: U.linear(x, w, b, constraint=None),
        lambda: (normal(0, (64, 32)), normal(1, (32, 8192)), jnp.zeros(8192)),
        1.0,
        (1.0, 1.0, 1.0),
        0.02,
    ),
    # gmean, in=256, out=1024: output (in/out)^(1/4) = 0.71, x grad (out/in)^(1/4) = 1.41.
    "linear_gmean_wide": Case(
        lambda x, w: U.linear(x, w, constraint="gmean"),
        normals((512, 256), (256, 1024)),
        2**-0.5,
        (2**0.5, 1.0),
        0.03,
    ),
    # The default, to_output_scale: the x grad factor 1/sqrt(in) on a sum over out:
    # sqrt(out/in) = 2.
    "linear_to_output": Case(
        U.linear,
        normals((512, 256), (256, 1024)),
        1.0,
        (2.0, 1.0),
        0.04,
    ),
    # u-muP's readout: output factor 1/fan_in, logits of std 1/sqrt(64); unit gradients.
    "linear_readout": Case(
        U.linear_readout, normals((512, 64), (64, 1000)), 0.125, (1.0, 1.0), 0.02
    ),
    "conv1d": Case(U.conv1d, normals((8, 128, 32), (3, 32, 32)), 1.0, (1.0, 1.0), 0.03),
    # 16x16 input, stride 2, "SAME": padding and strides enter the counts.
    "conv2d_strided_grouped": Case(
        lambda x, k: U.conv2d(x, k, strides=2, feature_group_count=2, constraint=None),
        normals((8, 16, 16, 32), (3, 3, 16, 32)),
        1.0,
        (1.0, 1.0),
        0.03,
    ),
    "gelu": Case(lambda x: U.gelu(x, constraint=None), normals((N,)), 1.0, (1.0,), 0.02),
    "gelu_erf": Case(
        lambda x: U.gelu(x, approximate=False, constraint=None), normals((N,)), 1.0, (1.0,), 0.02
    ),
    # The default: the grad factor is the output's, the gradient std GELU_F / GELU_B.
    "gelu_to_output": Case(U.gelu, normals((N,)), 1.0, (GELU_F / GELU_B,), 0.02),
    "gelu_gmean": Case(
        lambda x: U.gelu(x, constraint="gmean"),
        normals((N,)),
        gmean(GELU_F, GELU_B) / GELU_F,
        (gmean(GELU_F, GELU_B) / GELU_B,),
        0.02,
    ),
    "silu": Case(lambda x: U.silu(x, constraint=None), normals((N,)), 1.0, (1.0,), 0.02),
    "silu_glu": Case(
        lambda x, g: U.silu_glu(x, g, constraint=None), normals((N,), (N,)), 1.0, (1.0, 1.0), 0.02
    ),
    # The default: the gate's grad factor is the output's, E[f'^2]^(1/2) / E[f^2]^(1/2).
    "silu_glu_to_output": Case(
        U.silu_glu, normals((N,), (N,)), 1.0, (1.0, (SILU_GRAD / SILU_SECOND) ** 0.5), 0.02
    ),
    "softmax": Case(
        lambda x: U.softmax(x, constraint=None), normals((256, 512)), 1.0, (1.0,), 0.03
    ),
    "softmax_short": Case(
        lambda x: U.softmax(x, axis=0, constraint=None), normals((8, 1 << 14)), 1.0, (1.0,), 0.03
    ),
    "softmax_to_output": Case(
        U.softmax, normals((256, 512)), 1.0, ((SOFTMAX_DX / SOFTMAX_P) ** 0.5,), 0.03
    ),
    "softmax_gmean": Case(
        lambda x: U.softmax(x, constraint="gmean"),
        normals((256, 512)),
        (SOFTMAX_P / SOFTMAX_DX) ** 0.25,
        ((SOFTMAX_DX / SOFTMAX_P) ** 0.25,),
        0.03,
    ),
    "dropout": Case(lambda x: U.dropout(x, 0.25, RBG_KEY), normals((N,)), 1.0, (1.0,), 0.02),
    # The x gradient is the true one: std sqrt(1 - 2/n) (layer_norm), sqrt(1 - 1/n) (rms_norm).
    "layer_norm": Case(
        U.layer_norm,
        lambda: (normal(0, (64, 4096)), jnp.ones(4096), jnp.zeros(4096)),
        1.0,
        (1.0, 1.0, 1.0),
        0.02,
    ),
    "rms_norm": Case(
        U.rms_norm, lambda: (normal(0, (64, 4096)), jnp.ones(4096)), 1.0, (1.0, 1.0), 0.02
    ),
    "embedding": Case(U.embedding, lambda: (_ids(), normal(0, (512, 64))), 1.0, (1.0,), 0.03),
    "add": Case(
        lambda a, b: U.add(a, b, constraint=None), normals((N,), (N,)), 1.0, (1.0, 1.0), 0.02
    ),
    # gmean of 2^(-1/2), 1 and 1 is 2^(-1/6); the output sqrt(2) 2^(-1/6) = 2^(1/3).
    # The default: both grad factors are the output's, 1/sqrt(2).
    "add_to_output": Case(U.add, normals((N,), (N,)), 1.0, (2**-0.5,) * 2, 0.02),
    "add_gmean": Case(
        lambda a, b: U.add(a, b, constraint="gmean"),
        normals((N,), (N,)),
        2 ** (1 / 3),
        (2 ** (-1 / 6),) * 2,
        0.02,
    ),
    # A row vector broadcast over 64 rows: its gradient sums 64 unit terms.
    "add_broadcast": Case(
        lambda a, b: U.add(a, b, constraint=None),
        normals((64, 4096), (4096,)),
        1.0,
        (1.0, 1.0),
        0.02,
    ),
    "residual_add": Case(
        lambda r, s: U.residual_add(r, s, tau=0.5), normals((N,), (N,)), 1.0, (1.0, 1.0), 0.02
    ),
    "residual_split": Case(
        lambda x: U.residual_split(x, tau=0.5), normals((N,)), [1.0, 1.0], (1.0,), 0.02
    ),
    "residual_apply": Case(
        lambda x: U.residual_apply(lambda h: jnp.roll(h, 1), x, tau=0.5),
        normals((N,)),
        1.0,
        (1.0,),
        0.02,
    ),
    "scaled_dot_product_attention": Case(
        lambda q, k, v: U.scaled_dot_product_attention(q, k, v, constraint=None),
        normals((4, 4, 128, 64), (4, 4, 128, 64), (4, 4, 128, 64)),
        1.0,
        (1.0, 1.0, 1.0),
        0.03,
    ),
    "scaled_dot_product_attention_causal_cross": Case(
        lambda q, k, v: U.scaled_dot_product_attention(q, k, v, is_causal=True, constraint=None),
        normals((4, 4, 96, 64), (4, 4, 128, 64), (4, 4, 128, 32)),
        1.0,
        (1.0, 1.0, 1.0),
        0.04,
    ),
    "scaled_dot_product_attention_to_output": Case(
        U.scaled_dot_product_attention,
        normals((4, 4, 128, 64), (4, 4, 128, 64), (4, 4, 128, 64)),
        1.0,
        (ATT[0] / ATT[1], ATT[0] / ATT[2], ATT[0] / ATT[3]),
        0.03,
    ),
    "scaled_dot_product_attention_gmean": Case(
        lambda q, k, v: U.scaled_dot_product_attention(q, k, v, constraint="gmean"),
        normals((4, 4, 128, 64), (4, 4, 128, 64), (4, 4, 128, 64)),
        ATT_T / ATT[0],
        (ATT_T / ATT[1], ATT_T / ATT[2], ATT_T / ATT[3]),
        0.03,
    ),
    "cross_entropy": Case(
        U.cross_entropy,
        lambda: (normal(0, (512, 1000)), _labels(512, 1000)),
        None,
        (1.0,),
        0.02,
    ),
    "cross_entropy_none_small_vocab": Case(
        lambda logits, labels: U.cross_entropy(logits, labels, reduction="none"),
        lambda: (normal(0, (8192, 8)), _labels(8192, 8)),
        None,
        (1.0,),
        0.03,
    ),
    "mse_loss": Case(U.mse_loss, normals((512, 512), (512, 512)), None, (1.0, 1.0), 0.02),
}


@pytest.mark.parametrize("name", UNIT_CASES)
def test_unit_output_and_gradients(name):
    case = UNIT_CASES[name]
    out_std, grad_stds = measure(case.fn, case.args())
    if isinstance(case.out, list):
        np.testing.assert_allclose(out_std, case.out, atol=case.tol)
    elif case.out is not None:
        assert abs(out_std - case.out) <= case.tol, (out_std, case.out)
    np.testing.assert_allclose(grad_stds, case.grads, atol=case.tol)


def test_table_covers_every_op():
    ops = {n for n in U.__all__ if n not in ("Constraint", "apply_constraint")}
    ops -= {"scale_fwd", "scale_bwd"}
    covered = {n for n in ops if any(k.startswith(n) for k in UNIT_CASES)}
    assert ops <= covered | set(_NOT_OURS), sorted(ops - covered)


# Names other sub-modules add to the package (FP8 simulation, graph transform, optimizer
# rules), and a rule that is not an op (tested in test_ops_umup.py).
_NOT_OURS = {
    "optim",
    "parameter_specs",
    "simulate_fp4",
    "simulate_fp8",
    "transformer_residual_scaling_rule",
    "unit_init",
    "unit_scale",
}


# ---------------------------------------------------------------------------------------
# Factors: exact values, and the factors against independent derivations.


def _gaussian_expectation(h: Callable[[np.ndarray], np.ndarray]) -> float:
    """E[h(X)], X ~ N(0, 1), by the trapezoid rule on a fine grid (independent of the code's
    Gauss-Hermite quadrature)."""
    x = np.linspace(-12.0, 12.0, 200_001)
    return float(np.trapezoid(h(x) * np.exp(-0.5 * x * x), x) / math.sqrt(2 * math.pi))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def test_elementwise_factors_match_an_independent_integration():
    gelu = lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    silu = lambda x: x * _sigmoid(x)
    for name, f in (("gelu_tanh", gelu), ("silu", silu)):
        df = lambda x, f=f: (f(x + 1e-5) - f(x - 1e-5)) / 2e-5
        mean, second = _gaussian_expectation(f), _gaussian_expectation(lambda x, f=f: f(x) ** 2)
        fwd, bwd = _activations._elementwise_factors(name)
        assert fwd == pytest.approx((second - mean**2) ** -0.5, rel=1e-6)
        assert bwd == pytest.approx(_gaussian_expectation(lambda x, df=df: df(x) ** 2) ** -0.5)


def test_softmax_moments_exact_for_two_and_asymptotic_for_many():
    # n = 2: p = sigmoid(x1 - x2), x1 - x2 ~ N(0, 2).
    sig = lambda z: _sigmoid(math.sqrt(2.0) * z)
    var_p = _gaussian_expectation(lambda z: sig(z) ** 2) - 0.25
    # dx_1 = p1 p2 (g1 - g2): variance 2 E[(p1 p2)^2].
    var_dx = 2 * _gaussian_expectation(lambda z: (sig(z) * (1 - sig(z))) ** 2)
    p, dx, _ = _softmax.softmax_moments(2)
    assert p == pytest.approx(var_p, rel=0.01) and dx == pytest.approx(var_dx, rel=0.01)
    # Large n: p_i ~ exp(x_i) / (n sqrt(e)): n^2 var p -> e - 1, n^2 var dx -> e.
    n = 1 << 16
    p, dx, _ = _softmax.softmax_moments(n)
    assert p * n * n == pytest.approx(math.e - 1, rel=0.01)
    assert dx * n * n == pytest.approx(math.e, rel=0.01)
    # Longer rows take the limits directly.
    p, dx, _ = _softmax.softmax_moments(4 * n)
    assert p * (4 * n) ** 2 == pytest.approx(math.e - 1, rel=1e-9)


def test_monte_carlo_factors_are_cached_and_deterministic():
    args = (32, 48, 16, True)
    first = _attention.attention_moments.__wrapped__(*args)
    assert first == _attention.attention_moments.__wrapped__(*args)
    _attention.attention_moments(*args)
    hits = _attention.attention_moments.cache_info().hits
    _attention.attention_moments(*args)
    assert _attention.attention_moments.cache_info().hits == hits + 1
    assert _softmax.softmax_moments.__wrapped__(7) == _softmax.softmax_moments.__wrapped__(7)


def test_factors_cost_one_multiply_at_run_time():
    x = jnp.ones((4, 512))
    for unit, plain in ((U.softmax, jax.nn.softmax), (U.gelu, jax.nn.gelu)):
        n_plain = len(jax.make_jaxpr(plain)(x).jaxpr.eqns)
        # The default ties the grad factor to the output's: one multiply by a literal is
        # all that is added.
        eqns = jax.make_jaxpr(unit)(x).jaxpr.eqns
        assert len(eqns) == n_plain + 1 and eqns[-1].primitive.name == "mul"
        # Unconstrained, the input is wrapped in scale_bwd (a custom_vjp call).
        eqns = jax.make_jaxpr(lambda x, u=unit: u(x, constraint=None))(x).jaxpr.eqns
        assert len(eqns) == n_plain + 2 and eqns[-1].primitive.name == "mul"
        assert "custom_vjp" in eqns[0].primitive.name


def vjp_pairs(unit: Callable[..., Any], plain: Callable[..., Any], args: tuple[Any, ...]):
    """`(unit, plain)` outputs and `(unit, plain)` gradients for the same cotangent, jitted."""

    @jax.jit
    def run(args):
        out_u, vjp_u = jax.vjp(unit, *args)
        out_p, vjp_p = jax.vjp(plain, *args)
        cot = normal(99, out_p.shape) if out_p.ndim else jnp.ones(())
        return (out_u, out_p), list(zip(vjp_u(cot), vjp_p(cot)))

    return run(args)


def assert_scaled(pair: tuple[Any, Any], factor: float, rtol: float = 1e-5) -> None:
    """`pair[0] == factor * pair[1]`, to `rtol` of the largest element."""
    unit, plain = (np.asarray(a, np.float64) for a in pair)
    expected = factor * plain
    np.testing.assert_allclose(unit, expected, rtol=rtol, atol=rtol * np.abs(expected).max())


def test_dot_general_is_lax_dot_general_times_factors():
    a, b = normal(0, (4, 16, 32)), normal(1, (4, 32, 8))
    for constraint, constrain_rhs, (fwd, lhs, rhs) in (
        (None, False, (32**-0.5, 8**-0.5, 16**-0.5)),
        ("gmean", False, ((32 * 8) ** -0.25, (32 * 8) ** -0.25, 16**-0.5)),
        ("to_output_scale", False, (32**-0.5, 32**-0.5, 16**-0.5)),
        ("to_grad_input_scale", False, (8**-0.5, 8**-0.5, 16**-0.5)),
        ("gmean", True, ((32 * 8 * 16) ** (-1 / 6),) * 3),
        ("to_output_scale", True, (32**-0.5,) * 3),
        ("to_grad_input_scale", True, ((8 * 16) ** -0.25,) * 3),
    ):
        unit = lambda a, b, c=constraint, r=constrain_rhs: U.dot_general(
            a, b, BATCH_DN, constraint=c, constrain_rhs=r
        )
        out, (ga, gb) = vjp_pairs(unit, lambda a, b: lax.dot_general(a, b, BATCH_DN), (a, b))
        assert_scaled(out, fwd)
        assert_scaled(ga, lhs)
        assert_scaled(gb, rhs)


def test_dot_general_exact_values_and_params():
    a, b = normal(0, (6, 32), jnp.bfloat16), normal(1, (6, 32), jnp.bfloat16)
    dn = (((1,), (1,)), ((), ()))
    out = U.dot_general(a, b, dn, constraint=None, preferred_element_type=jnp.float32)
    plain = lax.dot_general(a, b, dn, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, plain * jnp.float32(32**-0.5))
    out = U.dot_general(a, b, dn, precision=lax.Precision.HIGHEST)
    assert out.dtype == jnp.bfloat16
    ints = jnp.ones((2, 3), jnp.int32)
    np.testing.assert_array_equal(U.dot_general(ints, ints, dn), lax.dot_general(ints, ints, dn))


def test_matmul_linear_conv_factors():
    x, w, bias = normal(0, (3, 16, 64)), normal(1, (64, 128)), normal(2, (128,))
    # matmul broadcasts w over 3 x 16 rows: its grad factor counts them all. The default
    # (to_output_scale) gives x's grad the output factor 1/sqrt(64).
    out, (gx, gw) = vjp_pairs(U.matmul, jnp.matmul, (x, w))
    assert_scaled(out, 64**-0.5), assert_scaled(gx, 64**-0.5), assert_scaled(gw, 48**-0.5)
    unit = lambda x, w, c="gmean": U.matmul(x, w, constraint=c)
    out, (gx, gw) = vjp_pairs(unit, jnp.matmul, (x, w))
    t = (64 * 128) ** -0.25
    assert_scaled(out, t), assert_scaled(gx, t), assert_scaled(gw, 48**-0.5)
    # The bias enters the scaled product; its gradient gets the weight's factor only.
    plain = lambda x, w, b: x @ w + jnp.broadcast_to(b, (3, 16, 128))
    for constraint, gx_factor in ((None, 128**-0.5), ("to_output_scale", 64**-0.5)):
        unit = lambda x, w, b, c=constraint: U.linear(x, w, b, constraint=c)
        out, (gx, gw, gb) = vjp_pairs(unit, plain, (x, w, bias))
        assert_scaled(out, 64**-0.5), assert_scaled(gx, gx_factor)
        assert_scaled(gw, 48**-0.5), assert_scaled(gb, 48**-0.5)
    # "VALID" conv, stride 1: fan-in 3 x 3 x 8, x grad 3 x 3 x 4 (interior), kernel 2 x 6 x 6.
    x, k = normal(0, (2, 8, 8, 8)), normal(1, (3, 3, 8, 4))
    conv = lambda x, k: lax.conv_general_dilated(
        x, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    unit = lambda x, k: U.conv2d(x, k, padding="VALID", constraint=None)
    out, (gx, gk) = vjp_pairs(unit, conv, (x, k))
    assert_scaled(out, 72**-0.5), assert_scaled(gk, 72**-0.5)
    # On average an input element enters 9 x 36/64 windows of 4 outputs: 20.25 products.
    assert_scaled(gx, 20.25**-0.5)


@pytest.mark.slow
def test_elementwise_values_and_gradients_are_plain_times_factors():
    x, gate = normal(0, (64, 32)), normal(1, (64, 32))
    for unit, plain, name in (
        (U.gelu, jax.nn.gelu, "gelu_tanh"),
        (lambda x, **kw: U.gelu(x, approximate=False, **kw), partial_gelu_erf, "gelu"),
        (U.silu, jax.nn.silu, "silu"),
    ):
        fwd, bwd = _activations._elementwise_factors(name)
        out, (g,) = vjp_pairs(lambda x, u=unit: u(x, constraint=None), plain, (x,))
        assert_scaled(out, fwd), assert_scaled(g, bwd)
    _, second, grad_second = _activations.gaussian_moments("silu")
    out, (gx, gg) = vjp_pairs(
        lambda x, g: U.silu_glu(x, g, constraint=None), lambda x, g: x * jax.nn.silu(g), (x, gate)
    )
    assert_scaled(out, second**-0.5), assert_scaled(gx, second**-0.5)
    assert_scaled(gg, grad_second**-0.5)
    var_p, var_dx, _ = _softmax.softmax_moments(32)
    out, (g,) = vjp_pairs(lambda x: U.softmax(x, constraint=None), jax.nn.softmax, (x,))
    assert_scaled(out, var_p**-0.5), assert_scaled(g, var_dx**-0.5)
    out, (ga, gb) = vjp_pairs(lambda a, b: U.add(a, b, constraint=None), jnp.add, (x, gate))
    assert_scaled(out, 2**-0.5), assert_scaled(ga, 1.0), assert_scaled(gb, 1.0)


def partial_gelu_erf(x):
    return jax.nn.gelu(x, approximate=False)


# ---------------------------------------------------------------------------------------
# The defaults: a bias inside the scaled product, and what `unit_scale` computes.


def test_default_linear_and_conv_add_their_bias_inside_the_scaled_product():
    x, w, b = normal(0, (3, 16, 64)), normal(1, (64, 128)), normal(2, (128,))
    expected = (x @ w + jnp.broadcast_to(b, (3, 16, 128))) / math.sqrt(64)
    np.testing.assert_allclose(U.linear(x, w, b), expected, rtol=1e-5, atol=1e-6)
    # The readout's factor 1/in multiplies its bias too.
    expected = (x @ w + jnp.broadcast_to(b, (3, 16, 128))) / 64
    np.testing.assert_allclose(U.linear_readout(x, w, b), expected, rtol=1e-5, atol=1e-6)
    # "VALID", stride 1: every output sums 3 taps x 8 channels.
    x, k, b = normal(3, (2, 12, 8)), normal(4, (3, 8, 4)), normal(5, (4,))
    conv = lax.conv_general_dilated(x, k, (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"))
    expected = (conv + jnp.broadcast_to(b, conv.shape)) / math.sqrt(24)
    np.testing.assert_allclose(U.conv1d(x, k, b, padding="VALID"), expected, rtol=1e-5, atol=1e-6)


ROWS, WIDTH, HIDDEN, OUT = 32, 64, 256, 48


def _mlp_params() -> dict[str, jax.Array]:
    shapes = {
        "w1": (WIDTH, HIDDEN),
        "b1": (HIDDEN,),
        "w2": (HIDDEN, WIDTH),
        "b2": (WIDTH,),
        "w_out": (WIDTH, OUT),
    }
    return {name: normal(10 + i, s) for i, (name, s) in enumerate(shapes.items())}


def _plain_mlp(x, p, readout):
    """A plain residual MLP block (non-zero biases), and optionally a readout after it."""
    hidden = jax.nn.gelu(x @ p["w1"] + p["b1"][None, :])
    x = x + (hidden @ p["w2"] + p["b2"][None, :])
    return x @ p["w_out"] if readout else x


def _unit_mlp(x, p, readout):
    """`_plain_mlp` written by hand with U ops and their default constraint; u-muP's
    `tau` for one residual branch (the transform's default rule), an unconstrained readout
    (the transform leaves the ops after the final residual add unconstrained)."""
    tau = 1 / math.sqrt(0.5)
    residual, skip = U.residual_split(x, tau)
    hidden = U.gelu(U.linear(residual, p["w1"], p["b1"]))
    x = U.residual_add(U.linear(hidden, p["w2"], p["b2"]), skip, tau)
    return U.linear(x, p["w_out"], constraint=None) if readout else x


@pytest.mark.parametrize("readout", [False, True])
def test_a_model_written_with_default_ops_is_unit_scale_of_the_plain_model(readout):
    x, params = normal(0, (ROWS, WIDTH)), _mlp_params()
    transformed = lambda x, p: U.unit_scale(_plain_mlp)(x, p, readout)
    by_hand = lambda x, p: _unit_mlp(x, p, readout)

    @jax.jit
    def run(x, params):
        out_t, vjp_t = jax.vjp(transformed, x, params)
        out_h, vjp_h = jax.vjp(by_hand, x, params)
        cot = normal(99, out_t.shape)
        return (out_t, vjp_t(cot)), (out_h, vjp_h(cot))

    ours, hand = run(x, params)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(hand), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(jnp.abs(b).max()))


@pytest.mark.slow
def test_attention_is_plain_attention_times_factors():
    q, k, v = normal(0, (2, 16, 8)), normal(1, (2, 24, 8)), normal(2, (2, 24, 4))
    mask = jax.random.bernoulli(jax.random.key(5), 0.8, (16, 24)).at[:, 0].set(True)

    def plain(q, k, v):
        s = jnp.einsum("bqd,bkd->bqk", q, k) / math.sqrt(8)
        keep = jnp.broadcast_to(jnp.tril(jnp.ones((16, 24), bool)) & mask, s.shape)
        s = jnp.where(keep, s, -jnp.inf)
        return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)

    unit = lambda q, k, v: U.scaled_dot_product_attention(
        q, k, v, mask=mask, is_causal=True, constraint=None
    )
    var_o, var_dq, var_dk, var_dv = _attention.attention_moments(16, 24, 8, True)
    out, (gq, gk, gv) = vjp_pairs(unit, plain, (q, k, v))
    assert_scaled(out, var_o**-0.5, rtol=1e-4)
    # The q and k grad variances scale with value dim / head dim = 1/2.
    assert_scaled(gq, (var_dq / 2) ** -0.5, rtol=1e-3)
    assert_scaled(gk, (var_dk / 2) ** -0.5, rtol=1e-3)
    assert_scaled(gv, var_dv**-0.5, rtol=1e-4)
    # An all-True mask is no mask.
    full = jnp.ones((16, 24), bool)
    np.testing.assert_array_equal(
        U.scaled_dot_product_attention(q, k, v, mask=full), U.scaled_dot_product_attention(q, k, v)
    )


@pytest.mark.slow
def test_norm_embedding_and_loss_gradients_are_plain_times_factors():
    x, w, b = normal(0, (2, 8, 16)), normal(1, (16,)), normal(2, (16,))

    def plain_ln(x, w, b):
        y = (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)
        return y * jnp.broadcast_to(w, x.shape) + jnp.broadcast_to(b, x.shape)

    out, (gx, gw, gb) = vjp_pairs(U.layer_norm, plain_ln, (x, w, b))
    assert_scaled(out, 1.0, rtol=1e-4), assert_scaled(gx, 1.0, rtol=1e-3)
    assert_scaled(gw, 16**-0.5, rtol=1e-4), assert_scaled(gb, 16**-0.5)

    def plain_rms(x, w):
        return x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * jnp.broadcast_to(w, x.shape)

    out, (gx, gw) = vjp_pairs(U.rms_norm, plain_rms, (x, w))
    assert_scaled(out, 1.0, rtol=1e-4), assert_scaled(gw, 16**-0.5, rtol=1e-4)

    table, ids = normal(3, (10, 4)), jnp.array([[1, 2, 2], [9, 0, 1]])
    out, (gt,) = vjp_pairs(lambda t: U.embedding(ids, t), lambda t: t[ids], (table,))
    assert_scaled(out, 1.0), assert_scaled(gt, math.sqrt(10 / 6))

    logits, labels = normal(4, (6, 5)), jnp.array([0, 4, 2, 1, 1, 3])
    plain = lambda z: -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), labels[:, None], 1))
    _, _, mean_s = _softmax.softmax_moments(5)
    out, (g,) = vjp_pairs(lambda z: U.cross_entropy(z, labels), plain, (logits,))
    assert_scaled(out, 1.0), assert_scaled(g, 6 * math.sqrt(5 / (mean_s + 1 - 2 / 5)))

    p, t = normal(5, (3, 4)), normal(6, (3, 4))
    out, (gp, gt) = vjp_pairs(U.mse_loss, lambda p, t: jnp.mean((p - t) ** 2), (p, t))
    (
        assert_scaled(out, 1.0),
        assert_scaled(gp, 12 / math.sqrt(8)),
        assert_scaled(gt, 12 / 8**0.5),
    )
    per = U.mse_loss(p, t, reduction="none")
    np.testing.assert_allclose(per, (p - t) ** 2, rtol=1e-6)


def test_residual_gradient_is_the_true_gradient():
    x = normal(0, (64, 32))
    w = normal(1, (32, 32)) / math.sqrt(32)
    f = lambda h: jnp.tanh(h @ w)
    for tau in (0.0, 0.5, 1.0, 3.0):
        a, b = tau / math.sqrt(1 + tau**2), 1 / math.sqrt(1 + tau**2)

        def unit(x, tau=tau):
            residual, skip = U.residual_split(x, tau)
            return U.residual_add(f(residual), skip, tau)

        plain = lambda x, a=a, b=b: a * f(x) + b * x
        out, (g,) = vjp_pairs(unit, plain, (x,))
        assert_scaled(out, 1.0, rtol=1e-5), assert_scaled(g, 1.0, rtol=1e-5)


def test_dropout_mask_and_identity():
    x = normal(0, (4096,))
    key = jax.random.key(1)
    y = U.dropout(x, 0.3, key)
    kept = y != 0
    assert abs(float(kept.mean()) - 0.7) < 0.03
    np.testing.assert_allclose(y[kept], x[kept] / math.sqrt(0.7), rtol=1e-6)
    assert U.dropout(x, 0.3, key, deterministic=True) is x
    assert U.dropout(x, 0.0, key) is x
    g = jax.grad(lambda x: jnp.sum(U.dropout(x, 0.3, key)))(x)
    np.testing.assert_allclose(g, kept / math.sqrt(0.7), rtol=1e-6)


# ---------------------------------------------------------------------------------------
# Constraints and the scale primitives.


def test_apply_constraint():
    assert _fwd_bwd.apply_constraint(None, 0.25, 4.0, 1.0) == (0.25, (4.0, 1.0))
    assert _fwd_bwd.apply_constraint("to_output_scale", 0.25, 4.0) == (0.25, (0.25,))
    assert _fwd_bwd.apply_constraint("to_grad_input_scale", 0.25, 4.0) == (4.0, (4.0,))
    assert _fwd_bwd.apply_constraint("to_grad_input_scale", 9.0, 4.0, 1.0) == (2.0, (2.0, 2.0))
    out, grads = _fwd_bwd.apply_constraint("gmean", 0.25, 4.0)
    assert out == pytest.approx(1.0) and grads == (out,)
    assert _fwd_bwd.apply_constraint("gmean", 0.5) == (0.5, ())
    with pytest.raises(ValueError, match="'gmean', 'hmean', 'amean', 'to_output_scale', "):
        _fwd_bwd.apply_constraint("mean", 1.0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive and finite"):
        _fwd_bwd.apply_constraint(None, 0.0, 1.0)


@pytest.mark.parametrize(
    "dtype, use_jit",
    # Eager (each operation a compile) for float32 in the default run; every dtype jitted.
    eager_and_jit(DTYPES, lambda dtype: dtype == jnp.float32),
)
def test_scale_fwd_and_bwd(dtype, use_jit):
    x = jnp.array([1.0, -2.0, 4.0], dtype)
    wrap = jax.jit if use_jit else (lambda f: f)
    fwd = wrap(lambda x: U.scale_fwd(x, 0.25))
    bwd = wrap(lambda x: U.scale_bwd(x, 0.25))
    np.testing.assert_array_equal(fwd(x), x * jnp.asarray(0.25, dtype))
    np.testing.assert_array_equal(bwd(x), x)
    assert fwd(x).dtype == dtype and bwd(x).dtype == dtype
    g_fwd = wrap(jax.grad(lambda x: jnp.sum(U.scale_fwd(x, 0.25)).astype(jnp.float32)))(x)
    g_bwd = wrap(jax.grad(lambda x: jnp.sum(U.scale_bwd(x, 0.25)).astype(jnp.float32)))(x)
    assert g_fwd.dtype == dtype and g_bwd.dtype == dtype
    np.testing.assert_array_equal(g_fwd, jnp.ones(3, dtype))
    np.testing.assert_array_equal(g_bwd, jnp.full(3, 0.25, dtype))
    xs = jnp.stack([x, 2 * x])
    np.testing.assert_array_equal(jax.vmap(fwd)(xs), xs * jnp.asarray(0.25, dtype))
    g = jax.vmap(jax.grad(lambda x: jnp.sum(U.scale_bwd(x, 0.25)).astype(jnp.float32)))(xs)
    np.testing.assert_array_equal(g, jnp.full((2, 3), 0.25, dtype))


def test_scale_of_integers_and_out_of_range_factors():
    ints = jnp.arange(3)
    assert U.scale_fwd(ints, 0.5) is ints and U.scale_bwd(ints, 0.5) is ints
    # 2^20 overflows float16: the product is formed in float32 and cast back.
    x = jnp.full((2,), 2.0**-18, jnp.float16)
    np.testing.assert_array_equal(U.scale_fwd(x, 2.0**20), jnp.full((2,), 4.0, jnp.float16))
    g = jax.grad(lambda x: jnp.sum(U.scale_bwd(x, 2.0**20) * jnp.float16(2.0**-18)))(x)
    np.testing.assert_array_equal(g, jnp.full((2,), 4.0, jnp.float16))
    with pytest.raises(TypeError, match="known at trace time"):
        U.scale_fwd(x, jnp.float32(2.0))


# ---------------------------------------------------------------------------------------
# Dtypes, jit, vmap.


def _small_cases() -> dict[str, tuple[Callable[..., Any], tuple[tuple[int, ...], ...]]]:
    labels = jnp.array([0, 3, 1, 2])
    ids = jnp.array([[0, 3], [1, 1]])
    return {
        "dot_general": (lambda a, b: U.dot_general(a, b, BATCH_DN), ((2, 4, 8), (2, 8, 3))),
        "matmul": (U.matmul, ((4, 8), (8, 3))),
        "linear": (U.linear, ((4, 8), (8, 3), (3,))),
        "linear_readout": (U.linear_readout, ((4, 8), (8, 3))),
        "conv1d": (U.conv1d, ((2, 8, 4), (3, 4, 4), (4,))),
        "conv2d": (U.conv2d, ((2, 5, 5, 4), (3, 3, 4, 4))),
        "gelu": (U.gelu, ((4, 8),)),
        "silu": (U.silu, ((4, 8),)),
        "silu_glu": (U.silu_glu, ((4, 8), (4, 8))),
        "softmax": (U.softmax, ((4, 8),)),
        "dropout": (lambda x: U.dropout(x, 0.5, RBG_KEY), ((4, 8),)),
        "layer_norm": (U.layer_norm, ((4, 8), (8,), (8,))),
        "rms_norm": (U.rms_norm, ((4, 8), (8,))),
        "embedding": (lambda t: U.embedding(ids, t), ((4, 8),)),
        "add": (U.add, ((4, 8), (4, 8))),
        "residual_add": (U.residual_add, ((4, 8), (4, 8))),
        "residual_split": (lambda x: U.residual_split(x)[0], ((4, 8),)),
        "scaled_dot_product_attention": (
            lambda q, k, v: U.scaled_dot_product_attention(q, k, v, is_causal=True),
            ((2, 4, 8), (2, 6, 8), (2, 6, 8)),
        ),
        "cross_entropy": (lambda z: U.cross_entropy(z, labels), ((4, 8),)),
        "mse_loss": (U.mse_loss, ((4, 8), (4, 8))),
    }


def test_every_op_keeps_float16_and_bfloat16():
    """Output and gradient dtypes, at trace time (float32: every case of the table)."""
    for name, (fn, shapes) in _small_cases().items():
        for dtype in (jnp.float16, jnp.bfloat16):
            args = tuple(jax.ShapeDtypeStruct(s, dtype) for s in shapes)

            def run(*args, fn=fn):
                out, vjp = jax.vjp(fn, *args)
                return out, vjp(jnp.ones_like(out))

            out, grads = jax.eval_shape(run, *args)
            assert out.dtype == dtype and all(g.dtype == dtype for g in grads), (name, dtype)


@pytest.mark.slow
def test_low_precision_values_follow_float32():
    """float16 / bfloat16 results match float32 ones to the format's precision; the large
    backward factors (cross_entropy's N sqrt(V) = 2^15 sqrt(8)) neither overflow nor flush."""
    cases = _small_cases()
    names = ("dot_general", "softmax", "scaled_dot_product_attention")
    labels = jnp.zeros(1 << 15, jnp.int32)
    ce = lambda z: U.cross_entropy(z, labels)

    @jax.jit
    def run(dtype_args):
        result = []
        for args in dtype_args:
            for name, a in zip(names, args[:-1]):
                out, vjp = jax.vjp(cases[name][0], *a)
                result.append((out, vjp(normal(99, out.shape, out.dtype))))
            out, vjp = jax.vjp(ce, args[-1])
            result.append((out, vjp(jnp.ones_like(out))))
        return result

    dtypes = (jnp.float32, jnp.float16, jnp.bfloat16)
    dtype_args = [
        [tuple(normal(i, s, d) for i, s in enumerate(cases[n][1])) for n in names]
        + [normal(0, (1 << 15, 8), d)]
        for d in dtypes
    ]
    result = run(dtype_args)
    count = len(names) + 1
    for d, rtol in ((1, 1e-2), (2, 6e-2)):
        for i, (ref, low) in enumerate(zip(result[:count], result[d * count : (d + 1) * count])):
            for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(low)):
                a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
                scale = np.abs(a64).max()
                assert 0.1 < scale < 1e4 and np.all(np.isfinite(b64)), (i, dtypes[d])
                np.testing.assert_allclose(b64, a64, atol=rtol * scale, err_msg=str(dtypes[d]))


@pytest.mark.slow
def test_jit_matches_eager_and_does_not_recompile():
    cases = _small_cases()
    for name in ("dot_general", "softmax"):
        fn, shapes = cases[name]
        args = tuple(normal(i, s) for i, s in enumerate(shapes))
        weights = normal(50, jax.eval_shape(fn, *args).shape)
        loss = lambda *a, fn=fn, w=weights: jnp.sum(fn(*a) * w)
        eager = jax.value_and_grad(loss, argnums=tuple(range(len(args))))
        jitted = jax.jit(eager)
        (v1, g1), (v2, g2) = eager(*args), jitted(*args)
        np.testing.assert_allclose(v1, v2, rtol=2e-5, atol=1e-4, err_msg=name)
        for a, b in zip(g1, g2):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-4, err_msg=name)
        jitted(*args)
        assert jitted._cache_size() == 1, name


def test_vmap():
    x, w, q = normal(0, (3, 4, 8)), normal(1, (8, 5)), normal(2, (3, 6, 8))
    gelu_grad = jax.grad(lambda x: jnp.sum(U.gelu(x)))

    @jax.jit
    def run(x, w, q):
        return [
            (jax.vmap(lambda x: U.linear(x, w))(x), U.linear(x.reshape(12, 8), w).reshape(3, 4, 5)),
            (jax.vmap(U.softmax)(x), U.softmax(x)),
            (
                jax.vmap(U.scaled_dot_product_attention)(q, q, q),
                U.scaled_dot_product_attention(q, q, q),
            ),
            (jax.vmap(gelu_grad)(x), gelu_grad(x)),
        ]

    for mapped, direct in run(x, w, q):
        np.testing.assert_allclose(mapped, direct, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------
# Bad input.

_X = jnp.ones((4, 8))
BAD_INPUTS = [
    (lambda: U.gelu(_X, constraint="mean"), ValueError, "Unknown unit-scaling constraint 'mean'"),
    (lambda: U.linear(_X, jnp.ones((4, 8))), ValueError, "weight of shape \\(in, out\\)"),
    (lambda: U.linear(_X, jnp.ones((8, 3)), jnp.ones(4)), ValueError, "bias must have shape"),
    (lambda: U.matmul(_X, jnp.ones(())), ValueError, "at least 1-D"),
    (lambda: U.dot_general(_X, _X, (((2,), (1,)), ((), ()))), ValueError, "out of range"),
    (lambda: U.conv1d(_X, jnp.ones((3, 8, 8))), ValueError, "rank 3"),
    (
        lambda: U.conv2d(jnp.ones((1, 4, 4, 6)), jnp.ones((3, 3, 4, 4)), feature_group_count=2),
        ValueError,
        "feature_group_count",
    ),
    (
        lambda: U.conv1d(jnp.ones((1, 4, 4)), jnp.ones((3, 4, 4)), strides=(1, 2)),
        ValueError,
        "strides",
    ),
    (lambda: U.silu_glu(_X, jnp.ones((4, 4))), ValueError, "x and gate must have the same shape"),
    (lambda: U.add(_X, jnp.ones(4)), ValueError, "must broadcast together, got shapes"),
    (lambda: U.dropout(_X, 1.0, jax.random.key(0)), ValueError, "rate must be in \\[0, 1\\)"),
    (lambda: U.dropout(_X, -0.1, jax.random.key(0)), ValueError, "rate must be in"),
    (lambda: U.dropout(_X, jnp.float32(0.5), jax.random.key(0)), TypeError, "Python number"),
    (lambda: U.dropout(jnp.ones(3, int), 0.5, jax.random.key(0)), TypeError, "floating-point"),
    (lambda: U.layer_norm(_X, jnp.ones(4)), ValueError, "weight must have shape \\(8,\\)"),
    (lambda: U.rms_norm(_X, axis=2), ValueError, "out of range"),
    (lambda: U.embedding(jnp.ones(3), _X), TypeError, "ids must be integers"),
    (lambda: U.embedding(jnp.ones(3, int), jnp.ones(3)), ValueError, "table must have shape"),
    (lambda: U.residual_add(_X, jnp.ones(8)), ValueError, "residual and skip"),
    (lambda: U.residual_split(_X, tau=-1.0), ValueError, "tau must be finite and non-negative"),
    (lambda: U.scaled_dot_product_attention(_X, jnp.ones((4, 6)), _X), ValueError, "equal leading"),
    (
        lambda: U.scaled_dot_product_attention(_X, _X, _X, mask=jnp.ones((4, 4))),
        TypeError,
        "mask must be boolean",
    ),
    (lambda: U.cross_entropy(_X, jnp.ones(4)), TypeError, "labels must be integers"),
    (lambda: U.cross_entropy(_X, jnp.ones(3, int)), ValueError, "logits.shape\\[:-1\\]"),
    (lambda: U.cross_entropy(_X, jnp.ones(4, int), reduction="max"), ValueError, "reduction"),
    (lambda: U.mse_loss(_X, jnp.ones(8)), ValueError, "pred and target"),
]


@pytest.mark.parametrize("call, error, message", BAD_INPUTS)
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_public_names():
    ours = {
        "Constraint", "add", "apply_constraint", "conv1d", "conv2d", "cross_entropy",
        "dot_general", "dropout", "embedding", "gelu", "layer_norm", "linear", "linear_readout",
        "matmul", "mse_loss", "residual_add", "residual_apply", "residual_split", "rms_norm",
        "scale_bwd", "scale_fwd", "scaled_dot_product_attention", "silu", "silu_glu", "softmax",
        "transformer_residual_scaling_rule",
    }  # fmt: skip
    assert ours <= set(U.__all__)
    assert all(hasattr(U, n) for n in U.__all__)
    assert re.match(r"[A-Z]", U.gelu.__doc__ or "")


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_inputs_compute_in_float32(dtype):
    """The ops that compute in float32 take FP8 inputs (JAX promotes no FP8 dtype
    implicitly: they raised TypePromotionError) and give exactly the values they give on
    the same inputs in float32, rounded to the format."""
    import ml_dtypes

    dtype = jnp.dtype(getattr(ml_dtypes, dtype))
    x = normal(0, (4, 16)).astype(dtype)
    labels = jnp.arange(4)
    below_normal = float(jnp.finfo(dtype).tiny) / 2  # cast to FP8, a subnormal factor
    cases = {
        "layer_norm": lambda v: U.layer_norm(v),
        "cross_entropy": lambda v: U.cross_entropy(v, labels),
        "mse_loss": lambda v: U.mse_loss(v, jnp.flip(v, 0)),
        "scale_fwd": lambda v: U.scale_fwd(v, below_normal),
    }
    for name, fn in cases.items():
        got = fn(x)
        assert got.dtype == dtype, name
        want = jnp.asarray(fn(x.astype(jnp.float32)), dtype)
        np.testing.assert_array_equal(
            np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=name
        )
    grad = jax.grad(lambda v: jnp.sum(U.layer_norm(v).astype(jnp.float32) ** 2))(x)
    assert grad.dtype == dtype and np.all(np.isfinite(np.asarray(grad, np.float32)))
