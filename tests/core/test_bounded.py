"""Softmaxes evaluated as the plain equations on the represented values, their outputs at
the scales their bounds give (`core/bounded.py`), through `autoscale`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from tests.helpers import (
    FLOAT_DTYPES,
    RTOL,
    WIDE_SCALES,
    assert_close,
    dynamic_scales,
    make_scaled,
    represented,
)


def plain(tree):
    return jax.tree_util.tree_map(
        lambda a: jnp.asarray(represented(a), jnp.float32), tree, is_leaf=jsa.is_scaled_leaf
    )


def _normalized(e, axis):
    return e / jnp.sum(e, axis=axis, keepdims=True)


def _shifted_exp(x, axis):
    return jnp.exp(x - jnp.max(x, axis=axis, keepdims=True))


def _softmax_and_sum(x):
    e = _shifted_exp(x, -1)
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e / total, total


# Each case, and how many scales its autoscaled form measures.
SHIFTED_EXPS = {
    "softmax": (lambda x: jax.nn.softmax(x, axis=-1), 0),
    "softmax-axis-0": (lambda x: jax.nn.softmax(x, axis=0), 0),
    "softmax-both-axes": (lambda x: jax.nn.softmax(x, axis=(0, 1)), 0),
    "log_softmax": (lambda x: jax.nn.log_softmax(x, axis=0), 1),  # its sum
    "handwritten-exp": (lambda x: _shifted_exp(x, -1), 0),
    "handwritten-softmax": (lambda x: _normalized(_shifted_exp(x, -1), -1), 0),
    "sum-returned": (_softmax_and_sum, 0),  # the sum at the scale of its bound too
}


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(SHIFTED_EXPS))
def test_a_softmax_is_at_the_scales_of_its_bounds_unmeasured(case, dtype, use_jit):
    """`exp(x - max(x))` is at most 1, its quotient by its sum at most 1, the sum in [1, N]:
    scales 1, 1 and pow2(sqrt(N)) without the reductions over their outputs that the `exp`,
    `reduce_sum` and `div` rules measure. Values and gradients as the plain function's."""
    fun, measured = SHIFTED_EXPS[case]
    rng = np.random.default_rng(6)
    x = rng.normal(size=(5, 12)) * 4
    jaxpr = jax.make_jaxpr(jsa.autoscale(fun))(make_scaled(x, dtype, 1.0))
    plain_jaxpr = jax.make_jaxpr(jsa.autoscale(lambda v: jnp.exp(v)))(make_scaled(x, dtype, 1.0))
    assert dynamic_scales(plain_jaxpr) == 1  # a plain exp measures its output
    assert dynamic_scales(jaxpr) == measured
    run = jax.jit(jsa.autoscale(fun)) if use_jit else jsa.autoscale(fun)
    weights = jnp.arange(60.0).reshape(5, 12)

    def loss(v):
        return jnp.sum(jax.tree_util.tree_leaves(fun(v))[0] * weights)

    grad = jax.grad(loss)
    run_grad = jax.jit(jsa.autoscale(grad)) if use_jit else jsa.autoscale(grad)
    for scale in WIDE_SCALES:
        sx = make_scaled(x, dtype, scale)
        outs = jax.tree_util.tree_leaves(run(sx), is_leaf=jsa.is_scaled_leaf)
        for out, want in zip(outs, jax.tree_util.tree_leaves(fun(*plain((sx,))))):
            assert_close(out, want, 4 * RTOL[np.dtype(dtype)])
    # A softmax's gradient from low-precision probabilities cancels: up to 1.8e-2 (float16)
    # and 6.8e-2 (bfloat16) of its largest entry measured, as with measured scales. The
    # handwritten softmaxes sum in bfloat16 themselves (jax.nn.softmax in float32): 0.26-0.41
    # measured, scaled or plain bfloat16 alike.
    grad_rtol = {"float32": 1e-4, "float16": 5e-2, "bfloat16": 0.15}[np.dtype(dtype).name]
    if case in ("handwritten-softmax", "sum-returned") and np.dtype(dtype).name == "bfloat16":
        grad_rtol = 0.5
    for scale in (2.0**-30, 2.0**-4, 1.0):  # larger: saturated, a gradient of 0
        sx = make_scaled(x, dtype, scale)
        assert_close(run_grad(sx), grad(*plain((sx,))), grad_rtol)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_the_scales_are_the_bounds(dtype):
    sx = make_scaled(np.random.default_rng(2).normal(size=(3, 12)), dtype, 2.0**-20)
    probabilities, sums = jsa.autoscale(_softmax_and_sum)(sx)
    assert float(probabilities.scale) == 1.0 and probabilities.dtype == dtype
    assert float(sums.scale) == 2.0 and sums.dtype == dtype  # sqrt(12) rounded down
    assert float(jnp.max(probabilities.data.astype(jnp.float32))) <= 1.0
    assert float(jnp.min(represented(sums))) >= 1.0


def test_the_program_is_the_plain_softmax():
    """No scale arithmetic between the reductions and the broadcasts (XLA:GPU fuses such a
    softmax in one Triton kernel): the compiled program reduces twice, as the plain one,
    and holds no reduction to a scalar."""
    sx = make_scaled(np.random.default_rng(3).normal(size=(16, 32)), np.float16, 2.0**-8)

    def reductions(fun, *args):
        text = jax.jit(fun).lower(*args).compile().as_text()
        return [line for line in text.splitlines() if " reduce(" in line]

    scaled = reductions(jsa.autoscale(lambda x: jax.nn.softmax(x, axis=-1)), sx)
    plain_ones = reductions(lambda x: jax.nn.softmax(x, axis=-1), sx.data)
    assert len(scaled) == len(plain_ones) == 2
    assert not any("[] reduce(" in line for line in scaled)


def test_delayed_scaling_records_no_softmax_site():
    def loss(w, x):
        return jnp.sum(jax.nn.softmax(x @ w, axis=-1) ** 2)

    rng = np.random.default_rng(4)
    w = make_scaled(rng.normal(size=(8, 6)), np.float16, 2.0**-3)
    x = make_scaled(rng.normal(size=(4, 8)), np.float16, 2.0**10)
    step = jsa.delayed_scaling(jax.grad(loss))
    _, history = step.init(w, x)
    # The product, the backward pass's row sums and the weight gradient; not the softmax.
    assert history.sites == ("float16[4, 6]", "float16[4]", "float16[8, 6]")
    grads, _ = jax.jit(step)(history, w, x)
    assert_close(grads, jax.grad(loss)(*plain((w, x))), 8 * RTOL[np.dtype(np.float16)])


@pytest.mark.parametrize(
    "fun",
    [
        lambda x: jax.nn.logsumexp(x, axis=-1),  # subtracts 0 where the maximum is infinite
        lambda x: jax.nn.softmax(x, axis=-1, where=x > -1.0),  # the maximum of some entries
        lambda x: jnp.exp(x - jnp.max(x[:, :3], axis=-1, keepdims=True)),  # of other values
        lambda x: jnp.exp(x - jnp.min(x, axis=-1, keepdims=True)),
        # Each row shifted by another row's maximum: entries above 1 (up to e^20 here).
        lambda x: jnp.exp(x - jnp.max(x, axis=1)[None, :]),
        # Each row divided by another row's sum, or by the sums along the other axis.
        lambda x: (lambda e: e / jnp.sum(e, axis=1)[None, :])(_shifted_exp(x, 1)),
        lambda x: (lambda e: e / jnp.sum(e, axis=0, keepdims=True))(_shifted_exp(x, 1)),
    ],
    ids=[
        "logsumexp",
        "softmax-where",
        "max-of-a-slice",
        "min",
        "max-of-another-row",
        "sum-of-another-row",
        "sum-along-another-axis",
    ],
)
def test_an_exp_shifted_or_divided_by_something_else_measures_its_scale(fun):
    """Only the softmax's own maximum and sum give bounds: any other shift or divisor keeps
    the rules' measured scales, and values as the plain function's (finite where the
    float32 function's are, though float16 at scale 1 would overflow)."""
    x = np.random.default_rng(7).normal(size=(12, 12)) * 4
    x[0] = -20.0
    sx = make_scaled(x / 2**10, np.float16, 2.0**10)
    jaxpr = jax.make_jaxpr(jsa.autoscale(fun))(sx)
    assert dynamic_scales(jaxpr) >= 1
    out = jax.jit(jsa.autoscale(fun))(sx)
    want = fun(*plain((sx,)))
    assert np.all(np.isfinite(represented(out))) and np.all(np.isfinite(want))
    assert_close(out, want, 8 * RTOL[np.dtype(np.float16)])


def test_observers_see_the_softmax_at_its_scales():
    sx = make_scaled(np.random.default_rng(8).normal(size=(3, 8)), np.float16, 4.0)
    table = jsa.analysis.tensor_ranges(lambda x: jax.nn.softmax(x, axis=-1), sx)
    rows = {row.primitive: row for row in table.rows}
    assert tuple(rows["exp"].shape) == (3, 8) and rows["exp"].scale == 1.0
    assert tuple(rows["div"].shape) == (3, 8) and rows["div"].scale == 1.0
    assert rows["reduce_sum"].scale == 2.0  # pow2(sqrt(8)), rounded down


def test_a_long_float8_sum_fits_its_format():
    """The sum's static scale `pow2(sqrt(N))` leaves N / scale above float8_e4m3fn's largest
    value (448) from about 200,000 terms: the scale is raised so that N fits."""
    import ml_dtypes

    count = 2**18
    sx = make_scaled(np.zeros((1, count)), ml_dtypes.float8_e4m3fn, 1.0)
    probabilities, sums = jax.jit(jsa.autoscale(_softmax_and_sum))(sx)
    assert float(sums.scale) == 2.0**10  # sqrt(2^18) = 2^9 would give data 512
    np.testing.assert_array_equal(represented(sums), [[float(count)]])
    assert float(probabilities.scale) == 1.0


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("case", ["handwritten-exp", "handwritten-softmax", "sum-returned"])
def test_a_float8_softmax(case, dtype):
    """FP8 data: computed in float32 (no implicit promotion exists from FP8), values as the
    plain function's on the represented values, to the format's precision. (`jax.nn.softmax`
    itself shifts by `max(nan, x)` in float8_e4m3fn, which has no infinity: NaN, plain or
    scaled.)"""
    import ml_dtypes

    fun, measured = SHIFTED_EXPS[case]
    dtype = np.dtype(getattr(ml_dtypes, dtype))
    rng = np.random.default_rng(9)
    for scale in (2.0**-20, 1.0, 2.0**20):
        sx = make_scaled(rng.normal(size=(4, 12)), dtype, scale)
        assert dynamic_scales(jax.make_jaxpr(jsa.autoscale(fun))(sx)) == measured
        outs = jax.tree_util.tree_leaves(
            jax.jit(jsa.autoscale(fun))(sx), is_leaf=jsa.is_scaled_leaf
        )
        for out, want in zip(outs, jax.tree_util.tree_leaves(fun(*plain((sx,))))):
            assert out.dtype == dtype
            assert_close(out, want, 0.13)  # 3 mantissa bits (e4m3), 2 (e5m2): a few ulps
