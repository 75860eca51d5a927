"""Normalizations' float32 statistics and their backward passes evaluated as the plain
equations on the represented values, at the static rules' scales (`core/normalization.py`),
through `autoscale`."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from tests.helpers import FLOAT_DTYPES, RTOL, assert_close, dynamic_scales, make_scaled, represented

SCALES = tuple(2.0**e for e in (-30, -20, -4, 0, 4, 20, 30))
FEATURES = 32


def _handwritten_layer_norm(x, gain, bias):
    """As a user writes it: statistics in float32 (`jnp.var`, a nested jit), the gain and
    bias in the data's dtype."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    normalized = (x32 - mean) * jax.lax.rsqrt(jnp.var(x32, axis=-1, keepdims=True) + 1e-5)
    return (normalized * gain.reshape(1, 1, -1) + bias.reshape(1, 1, -1)).astype(x.dtype)


def _rms_norm(x, gain, bias):
    """Gemma's RMS norm (the zoo's NNX model): `1 + gain` computed between the statistics
    and the product, no bias."""
    del bias
    x32 = x.astype(jnp.float32)
    mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    one_plus = (1 + gain).reshape(1, 1, -1)
    return (x32 * jax.lax.rsqrt(mean_square + 1e-6) * one_plus).astype(x.dtype)


def _linen_layer_norm(x, gain, bias):
    """Flax linen's LayerNorm (`E[x^2] - E[x]^2` clamped at 0, statistics in float32)."""
    module = nn.LayerNorm(dtype=x.dtype)
    return module.apply({"params": {"scale": gain, "bias": bias}}, x)


def _equinox_layer_norm(x, gain, bias):
    """Equinox's LayerNorm, mapped over the rows as Equinox models do."""
    module = eqx.nn.LayerNorm(FEATURES)
    module = eqx.tree_at(lambda m: (m.weight, m.bias), module, (gain, bias))
    return jax.vmap(module)(x.reshape(-1, FEATURES)).reshape(x.shape)


def _l2_normalized(x, gain, bias):
    """Rows divided by their norm (`jnp.linalg.norm`: a `sqrt`), in float32."""
    del bias
    x32 = x.astype(jnp.float32)
    normalized = x32 / jnp.linalg.norm(x32, axis=-1, keepdims=True)
    return (normalized * gain.reshape(1, 1, -1)).astype(x.dtype)


NORMALIZATIONS = {
    "handwritten-layer-norm": _handwritten_layer_norm,
    "rms-norm": _rms_norm,
    "linen-layer-norm": _linen_layer_norm,
    "equinox-layer-norm": _equinox_layer_norm,
    "l2-normalized": _l2_normalized,
}


def _inputs(dtype, scale):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(3, 5, FEATURES)) * 3 + 1
    gain = make_scaled(1 + 0.1 * rng.normal(size=FEATURES), dtype, 2.0**-3)
    bias = make_scaled(0.1 * rng.normal(size=FEATURES), dtype, 2.0**-6)
    return make_scaled(x, dtype, scale), gain, bias


def _plain(tree):
    """The represented values in float32 (the plain float32 program's inputs)."""
    return jax.tree_util.tree_map(
        lambda a: jnp.asarray(represented(a), jnp.float32), tree, is_leaf=jsa.is_scaled_leaf
    )


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(NORMALIZATIONS))
def test_a_normalization_measures_nothing_and_matches_the_plain_one(case, dtype, use_jit):
    """Statistics taken in float32 are the plain program's values: the forward
    pass measures no scale (each `reduce_sum` rule would), and values and gradients (of
    the input and of the gain) are the plain function's on the represented values."""
    fun = NORMALIZATIONS[case]
    sx, gain, bias = _inputs(dtype, 1.0)
    jaxpr = jax.make_jaxpr(jsa.autoscale(fun))(sx, gain, bias)
    assert dynamic_scales(jaxpr) == 0
    weights = jnp.linspace(-1.0, 1.0, 3 * 5 * FEATURES).reshape(3, 5, FEATURES)

    def loss(x, gain, bias):
        return jnp.sum(fun(x, gain, bias).astype(jnp.float32) * weights)

    grad = jax.grad(loss, argnums=(0, 1))
    run = jax.jit(jsa.autoscale(fun)) if use_jit else jsa.autoscale(fun)
    run_grad = jax.jit(jsa.autoscale(grad)) if use_jit else jsa.autoscale(grad)
    rtol = 4 * RTOL[np.dtype(dtype)]
    for scale in SCALES:
        sx, gain, bias = _inputs(dtype, scale)
        assert_close(run(sx, gain, bias), fun(*_plain((sx, gain, bias))), rtol)
        want_grads = grad(*_plain((sx, gain, bias)))
        for got, expected in zip(run_grad(sx, gain, bias), want_grads):
            assert_close(got, expected, 8 * rtol)


def _backward(fun):
    """The pullback of `fun` (the normalization's backward pass alone) on a cotangent."""

    def backward(x, gain, bias, cotangent):
        _, pullback = jax.vjp(fun, x, gain, bias)
        return pullback(cotangent)

    return backward


def _cotangent(dtype, scale):
    rng = np.random.default_rng(15)
    return make_scaled(rng.normal(size=(3, 5, FEATURES)), dtype, scale)


# (input scale, cotangent scale): far apart, both large, both small.
SCALE_PAIRS = ((2.0**-20, 2.0**10), (1.0, 1.0), (2.0**20, 2.0**-10), (2.0**-8, 2.0**-20),
               (2.0**12, 2.0**20))  # fmt: skip


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(NORMALIZATIONS))
def test_the_backward_pass_measures_nothing_and_matches_the_plain_one(case, dtype):
    """The backward pass (the cotangent's row sums through the statistics, the gain's and
    the bias's gradients summed over the rows) is the plain float32 program's on the
    represented values too: no scale measured, each cotangent handed on at the static
    rules' scale, its data near unit range over input and cotangent scales far apart."""
    backward = _backward(NORMALIZATIONS[case])
    sx, gain, bias = _inputs(dtype, 1.0)
    jaxpr = jax.make_jaxpr(jsa.autoscale(backward))(sx, gain, bias, _cotangent(dtype, 1.0))
    assert dynamic_scales(jaxpr) == 0
    run = jax.jit(jsa.autoscale(backward))
    rtol = 32 * RTOL[np.dtype(dtype)]
    for x_scale, cotangent_scale in SCALE_PAIRS:
        sx, gain, bias = _inputs(dtype, x_scale)
        cotangent = _cotangent(dtype, cotangent_scale)
        got = run(sx, gain, bias, cotangent)
        want = backward(*_plain((sx, gain, bias, cotangent)))
        for value, expected in zip(got, want):
            assert_close(value, expected, rtol)
            if isinstance(value, jsa.ScaledArray) and np.dtype(dtype).itemsize == 2:
                data = np.abs(np.asarray(value.data, np.float32))
                assert 2.0**-8 <= data.max() <= 2.0**8, (x_scale, cotangent_scale, data.max())


def test_the_compiled_backward_pass_reduces_as_the_plain_one():
    """No reduction to a scalar (a measured scale) in the compiled pullback of a layer
    norm, its gain and bias included: its reductions are the plain program's."""
    backward = _backward(_linen_layer_norm)
    sx, gain, bias = _inputs(np.float16, 2.0**-8)
    cotangent = _cotangent(np.float16, 2.0**6)

    def reductions(fun, *args):
        text = jax.jit(fun).lower(*args).compile().as_text()
        lines = [line for line in text.splitlines() if " reduce(" in line]
        return len(lines), sum("[] reduce(" in line for line in lines)

    scaled = reductions(jsa.autoscale(backward), sx, gain, bias, cotangent)
    plain = reductions(backward, *_plain((sx, gain, bias, cotangent)))
    assert scaled[1] == 0
    assert scaled[0] <= plain[0]


@pytest.mark.parametrize("scale", [2.0**-12, 2.0**12], ids=["small", "large"])
@pytest.mark.parametrize("case", sorted(NORMALIZATIONS))
def test_the_statistics_are_near_unit_range(case, scale):
    """What the run computes takes the static rules' scales from `x`'s (a sum of `N` terms
    `N` times theirs, `rsqrt(var + eps)` the reciprocal root of the larger of the
    variance's and `eps`'s): float32 data near unit range whether the variance is far above
    `eps` or below it, powers of two; `analysis.tensor_ranges` sees each equation."""
    sx, gain, bias = _inputs(np.float16, scale)
    table = jsa.analysis.tensor_ranges(NORMALIZATIONS[case], sx, gain, bias)
    roots = [row for row in table.rows if row.primitive in ("rsqrt", "sqrt")]
    sums = [row for row in table.rows if row.primitive == "reduce_sum"]
    assert roots and sums
    for row in roots + sums:
        assert row.dtype == "float32"
        assert 2.0**-7 <= row.max_abs <= 2.0**7, (row.primitive, row.max_abs)
        assert np.log2(row.scale) == np.round(np.log2(row.scale))


def test_narrow_statistics_keep_the_rules():
    """A layer norm computed in bfloat16 (no upcast) is left to the rules: its sums take
    measured scales (bfloat16 statistics at scale 1 would round what the scales keep),
    values as the plain function's."""

    def narrow(x):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5)

    sx = make_scaled(np.random.default_rng(12).normal(size=(4, 32)), jnp.bfloat16, 2.0**-40)
    assert dynamic_scales(jax.make_jaxpr(jsa.autoscale(narrow))(sx)) >= 1
    out = jax.jit(jsa.autoscale(narrow))(sx)
    assert float(out.scale) != 1.0 or out.dtype == jnp.bfloat16
    want = narrow(jnp.asarray(represented(sx), jnp.float32))
    assert_close(out, want, 8 * RTOL[np.dtype(jnp.bfloat16)])


def test_a_run_of_plain_inputs_stays_plain():
    x = np.random.default_rng(13).normal(size=(3, 5, FEATURES)).astype(np.float32)
    gain, bias = np.ones(FEATURES, np.float32), np.zeros(FEATURES, np.float32)
    out = jsa.autoscale(_handwritten_layer_norm)(x, gain, bias)
    assert not isinstance(out, jsa.ScaledArray)
    np.testing.assert_allclose(out, _handwritten_layer_norm(x, gain, bias), rtol=1e-6)


def test_delayed_scaling_holds_no_statistics_site():
    """The normalization's sums, forward and backward, are no sites of `delayed_scaling`:
    the step's sites are the products'."""

    def loss(w, x, gain, bias):
        return jnp.sum(_linen_layer_norm(x @ w, gain, bias).astype(jnp.float32) ** 2)

    rng = np.random.default_rng(14)
    w = make_scaled(rng.normal(size=(16, FEATURES)), np.float16, 2.0**-4)
    x = make_scaled(rng.normal(size=(8, 16)), np.float16, 2.0**6)
    _, gain, bias = _inputs(np.float16, 1.0)
    step = jsa.delayed_scaling(jax.grad(loss, argnums=(0, 2)))
    _, history = step.init(w, x, gain, bias)
    forward = jax.make_jaxpr(loss)(*_plain((w, x, gain, bias)))
    sums = sum(e.primitive.name == "reduce_sum" for e in forward.jaxpr.eqns)
    assert sums >= 2  # the mean and the mean square, plain
    # The product and the weight's gradient; the backward pass's row sums and the gain's
    # gradient (sums over the rows) are the plain ones.
    assert len(history.sites) == 2
    grads, _ = jax.jit(step)(history, w, x, gain, bias)
    plain_grads = jax.grad(loss, argnums=(0, 2))(*_plain((w, x, gain, bias)))
    for got, expected in zip(grads, plain_grads):
        assert_close(got, expected, 0.05)


def test_the_compiled_forward_pass_reduces_as_the_plain_one():
    """No reduction to a scalar (a measured scale) in the compiled layer norm: the
    statistics' reductions are the plain program's."""
    sx, gain, bias = _inputs(np.float16, 2.0**-8)

    def reductions(fun, *args):
        text = jax.jit(fun).lower(*args).compile().as_text()
        lines = [line for line in text.splitlines() if " reduce(" in line]
        return len(lines), sum("[] reduce(" in line for line in lines)

    scaled = reductions(jsa.autoscale(_handwritten_layer_norm), sx, gain, bias)
    plain = reductions(_handwritten_layer_norm, *_plain((sx, gain, bias)))
    assert scaled[1] == 0
    assert scaled[0] <= plain[0]
