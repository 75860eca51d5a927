"""`jsa.optax.accumulation`: gradients accumulated over 4 microbatches against one big batch.

The scales must be the one-batch gradient's exactly (`assert_array_equal` on every leaf's
scale). The values match to rounding: float32 data to the summation order (`1e-6` of the
tensor's largest magnitude); float16 and bfloat16 data to the rounding of each
microbatch's gradient and of the result to the data dtype (two ulps of the format at the
tensor's largest magnitude, `2**-9` and `2**-6`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jax_scaled_arithmetics as jsa

K, B = 4, 8  # microbatches, examples per microbatch
DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16]
# Of the largest magnitude of the expected tensor (see the module docstring).
TOL = {
    np.dtype(np.float32): 1e-6,
    np.dtype(np.float16): 2.0**-9,
    np.dtype(ml_dtypes.bfloat16): 2.0**-6,
}


def _problem(dtype, big=None):
    """A two-layer MLP regression; with `big`, that microbatch's targets (and so its
    gradient) are 2**10 larger than the others'."""
    return _convert(*_draw(jax.random.PRNGKey(0)), dtype, big)


# One compile per dtype and `big` (eager, each operation is a compile of its own).
@functools.partial(jax.jit, static_argnums=(3, 4))
def _convert(params, x, y, dtype, big):
    if big is not None:
        y = y.at[big * B : (big + 1) * B].multiply(2.0**10)
    return jsa.as_scaled_array(params, dtype=dtype), x.astype(dtype), y.astype(dtype)


@jax.jit  # one compile for the draws (eager, each shape's draw is a compile of its own)
def _draw(key):
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    params = {
        "w1": jax.random.normal(k1, (8, 16)) / np.sqrt(8),
        "b1": 0.1 * jax.random.normal(k2, (16,)),
        "w2": jax.random.normal(k3, (16, 4)) / 4.0,
        "b2": jnp.zeros(4),
    }
    x = jax.random.normal(k4, (K * B, 8))
    y = jnp.tanh(x[:, :4]) + 0.1 * jax.random.normal(k5, (K * B, 4))
    return params, x, y


def _loss(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"][None, :])
    return jnp.mean((h @ params["w2"] + params["b2"][None, :] - y) ** 2)


_grad = jax.grad(_loss)


def _micro(batch):
    return jsa.optax.split_microbatches(batch, K)


@jax.jit
@jsa.autoscale
def _one_batch(params, x, y):
    return _grad(params, x, y)


@jax.jit
@jsa.autoscale
def _accumulated(params, x, y):
    return jsa.optax.accumulate_gradients(lambda p, b: _grad(p, *b), params, _micro((x, y)))


def _each_microbatch(params, x, y):
    """`_one_batch` of each microbatch (one compile, at the microbatch's shape)."""
    xs, ys = (np.asarray(a).reshape(K, B, -1) for a in (x, y))
    return [_one_batch(params, xs[i], ys[i]) for i in range(K)]


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree, is_leaf=jsa.is_scaled_leaf)


def _value(x):
    if isinstance(x, jsa.ScaledArray):
        x = x.to_array(jnp.float32)
    return np.asarray(x, np.float64)


def _assert_matches(actual, expected):
    """Same scales exactly, same dtypes, values within TOL of each tensor's largest."""
    paths, _ = jax.tree_util.tree_flatten_with_path(expected, is_leaf=jsa.is_scaled_leaf)
    assert len(_leaves(actual)) == len(paths)
    for (path, e), a in zip(paths, _leaves(actual)):
        name = jax.tree_util.keystr(path)
        assert isinstance(a, jsa.ScaledArray) and isinstance(e, jsa.ScaledArray), name
        assert a.dtype == e.dtype, name
        np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(e.scale), err_msg=name)
        atol = TOL[np.dtype(e.dtype)] * np.max(np.abs(_value(e)))
        np.testing.assert_allclose(_value(a), _value(e), rtol=0, atol=atol, err_msg=name)


@pytest.mark.parametrize(
    "dtype",
    # bfloat16 in the default run (its programs serve the other jitted tests); float16
    # accumulation is checked there by test_eager_and_values, and this test's float16 and
    # float32 cases (each a few large programs more to compile) run in the slow step.
    [
        pytest.param(jnp.float32, marks=pytest.mark.slow),
        pytest.param(jnp.float16, marks=pytest.mark.slow),
        jnp.bfloat16,
    ],
    ids=lambda d: jnp.dtype(d).name,
)
@pytest.mark.slow
def test_accumulate_matches_one_batch(dtype):
    params, x, y = _problem(dtype)
    one = _one_batch(params, x, y)
    _assert_matches(_accumulated(params, x, y), one)
    # The static add rule would give the largest microbatch's scale: here it differs.
    micro = _each_microbatch(params, x, y)
    largest = [max(float(g[k].scale) for g in micro) for k in sorted(one)]
    assert largest != [float(one[k].scale) * K for k in sorted(one)]


# The default run compiles the jitted programs in bfloat16 only; float16 data (its own
# programs) in the slow step. float16 runs by default in test_eager_and_values,
# test_scale_optimizer_of_multi_steps and test_multi_steps_forgets_the_last_rounds_scale.
_BF16_DEFAULT = [pytest.param(jnp.float16, marks=pytest.mark.slow), jnp.bfloat16]


@pytest.mark.parametrize("big", [0, 2], ids=["first", "third"])
@pytest.mark.parametrize("dtype", _BF16_DEFAULT, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.slow
def test_one_large_microbatch(dtype, big):
    """One microbatch's gradient 2**10 larger: the scale is its (over all four), not the
    last microbatch's."""
    params, x, y = _problem(dtype, big=big)
    one, acc = _one_batch(params, x, y), _accumulated(params, x, y)
    _assert_matches(acc, one)
    last = _each_microbatch(params, x, y)[-1]
    for k in one:
        assert float(acc[k].scale) >= 2.0**6 * float(last[k].scale), k


def _linear_loss(params, x, y):
    """A smaller model (two matrices, no bias or activation) for the tests whose claim does
    not depend on the model: fewer operations to compile (eagerly, each one a compile)."""
    return jnp.mean((x @ params["w1"] @ params["w2"] - y) ** 2)


def _linear_problem(dtype, big=None):
    params, x, y = _problem(dtype, big)
    return {k: params[k] for k in ("w1", "w2")}, x, y


_linear_one_batch = jax.jit(jsa.autoscale(jax.grad(_linear_loss)))


@pytest.mark.slow
def test_eager_and_values():
    """Outside `jit` and `autoscale` (it wraps itself); `has_value` stacks the losses."""
    params, x, y = _linear_problem(jnp.float16)
    vg = jax.value_and_grad(_linear_loss)
    values, grads = jsa.optax.accumulate_gradients(
        lambda p, b: vg(p, *b), params, _micro((x, y)), has_value=True
    )
    _assert_matches(grads, _linear_one_batch(params, x, y))
    loss = jax.jit(jsa.autoscale(_linear_loss))(params, x, y)
    assert values.shape == (K,)
    np.testing.assert_allclose(np.mean(_value(values)), _value(loss), rtol=2.0**-9)


@pytest.mark.slow
def test_sum():
    """`mean=False`: the sum of the microbatch gradients, the gradient of the summed loss."""
    params, x, y = _linear_problem(jnp.bfloat16)
    # The gradient of the summed loss is K (a power of two: exact) times the one-batch
    # gradient of the mean loss.
    one = {
        k: jsa.ScaledArray(g.data, g.scale * K) for k, g in _linear_one_batch(params, x, y).items()
    }
    grad = jax.grad(_linear_loss)
    acc = jax.jit(
        jsa.autoscale(
            lambda p, x, y: jsa.optax.accumulate_gradients(
                lambda p, b: grad(p, *b), p, _micro((x, y)), mean=False
            )
        )
    )(params, x, y)
    _assert_matches(acc, one)


def _block_problem(dtype):
    """A tiny transformer block: layer norm, one attention head, a residual, an MLP."""
    return _convert(*_block_draw(jax.random.PRNGKey(1)), dtype, None)


@jax.jit  # one compile for the draws
def _block_draw(key):
    ks = jax.random.split(key, 6)
    d = 8
    params = {
        "gain": 1.0 + 0.1 * jax.random.normal(ks[0], (d,)),
        "qkv": jax.random.normal(ks[1], (d, 3 * d)) / np.sqrt(d),
        "out": jax.random.normal(ks[2], (d, d)) / np.sqrt(d),
        "mlp": jax.random.normal(ks[3], (d, d)) / np.sqrt(d),
    }
    x = jax.random.normal(ks[4], (K * 2, 4, d))
    y = jax.random.normal(ks[5], (K * 2, 4, d))
    return params, x, y


def _block_loss(p, x, y):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    h = (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["gain"][None, None, :]
    q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
    att = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(q.shape[-1]), axis=-1)
    h = x + jnp.einsum("bqk,bkd->bqd", att, v) @ p["out"]
    out = h + jax.nn.gelu(h @ p["mlp"])
    return jnp.mean((out - y) ** 2)


# The accumulation of a richer model (layer norm, attention, GELU: each op's scaled rule has
# its own tests) in the slow step; test_accumulate_matches_one_batch checks the same claim
# on the MLP by default.
@pytest.mark.slow
def test_transformer_block():
    params, x, y = _block_problem(jnp.bfloat16)
    grad = jax.grad(_block_loss)

    @jax.jit
    @jsa.autoscale
    def both(params, x, y):
        acc = jsa.optax.accumulate_gradients(lambda p, b: grad(p, *b), params, _micro((x, y)))
        return acc, grad(params, x, y)

    acc, one = both(params, x, y)
    _assert_matches(acc, one)


# --- optax.MultiSteps ---------------------------------------------------------------------


def _run_steps(opt, params, x, y, apply=jsa.optax.apply_updates, grad=_grad):
    """`K` mini-steps of `opt`, one per microbatch: the last parameters, updates and state."""
    state = opt.init(params)
    step = _step(opt, apply, grad)
    xs, ys = _micro((x, y))
    for i in range(K):
        params, updates, state = step(params, state, xs[i], ys[i])
    return params, updates, state


@functools.cache  # one jitted step per optimizer: the cases of a dtype share its compile
def _step(opt, apply, grad):
    @jax.jit
    @jsa.autoscale
    def step(params, state, x, y):
        updates, state = opt.update(grad(params, x, y), state, params)
        return apply(params, updates), updates, state

    return step


_MULTI_IDENTITY = jsa.optax.multi_steps(optax.identity(), K)


@pytest.mark.slow
@pytest.mark.parametrize("big", [None, 1], ids=["even", "large_second"])
@pytest.mark.parametrize("dtype", _BF16_DEFAULT, ids=lambda d: jnp.dtype(d).name)
def test_multi_steps_emits_the_one_batch_gradient(dtype, big):
    """With `optax.identity()` inside, the k-th update is the accumulated mean gradient."""
    params, x, y = _problem(dtype, big=big)
    _, updates, state = _run_steps(_MULTI_IDENTITY, params, x, y, optax.apply_updates)
    _assert_matches(updates, _one_batch(params, x, y))
    assert int(state.mini_step) == 0 and int(state.gradient_step) == 1
    for acc in _leaves(state.acc_grads):  # reset: zeros, stored float32 data
        assert acc.dtype == jnp.float32 and not np.any(_value(acc))


@pytest.mark.slow
def test_scale_optimizer_of_multi_steps():
    """`scale_optimizer(optax.MultiSteps(...))` also emits the one-batch scales (its
    accumulator in the scaled state's dtype, float16: a looser tolerance). On the linear
    model (the claim does not depend on the model)."""
    params, x, y = _linear_problem(jnp.float16, big=0)
    opt = jsa.optax.scale_optimizer(optax.MultiSteps(optax.identity(), K))
    _, updates, _ = _run_steps(opt, params, x, y, optax.apply_updates, grad=jax.grad(_linear_loss))
    one = _linear_one_batch(params, x, y)
    for k in one:
        np.testing.assert_array_equal(np.asarray(updates[k].scale), np.asarray(one[k].scale))
        atol = 2.0**-8 * np.max(np.abs(_value(one[k])))
        np.testing.assert_allclose(_value(updates[k]), _value(one[k]), rtol=0, atol=atol)


def _assert_close_to_ulp(actual, expected, ulp):
    for a, e in zip(_leaves(actual), _leaves(expected)):
        atol = ulp * np.max(np.abs(_value(e)))
        np.testing.assert_allclose(_value(a), _value(e), rtol=0, atol=atol)


@pytest.mark.parametrize(
    "inner",
    [
        pytest.param(lambda: jsa.optax.scale_optimizer(optax.adam(1e-3)), id="scaled_adam"),
        # A stateless inner optimizer: the stateful one (scaled Adam) checks the parameters
        # and the inner state in the default run.
        pytest.param(lambda: optax.sgd(0.1), id="sgd", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow
def test_multi_steps_parameters(inner):
    """After the k-th mini-step the parameters (bfloat16) and the inner state (Adam's
    moments) are the one-batch step's, one bfloat16 ulp apart at most (of the tensor's
    largest magnitude): the two bfloat16 gradients' rounding."""
    params, x, y = _problem(jnp.bfloat16)
    opt = inner()

    @jax.jit
    @jsa.autoscale
    def one_step(params, state, x, y):
        updates, state = opt.update(_grad(params, x, y), state, params)
        return jsa.optax.apply_updates(params, updates), state

    expected, expected_state = one_step(params, opt.init(params), x, y)
    actual, _, state = _run_steps(jsa.optax.multi_steps(inner(), K), params, x, y)
    assert all(a.dtype == jnp.bfloat16 for a in _leaves(actual))
    _assert_close_to_ulp(actual, expected, 2.0**-7)
    _assert_close_to_ulp(state.inner_opt_state, expected_state, 2.0**-7)


def test_multi_steps_init_inside_autoscale_is_init():
    """`jax.jit(jsa.autoscale(opt.init))` stores the accumulators (and a scaled inner
    state) as `opt.init` does, in the block layouts of per-row scaled parameters."""
    values = (jnp.arange(32.0).reshape(4, 8) + 1).astype(jnp.bfloat16)
    params = {"w": jsa.as_scaled_array(values, scale_shape=(4, 1)), "b": jnp.ones(8)}
    opt = jsa.optax.multi_steps(jsa.optax.scale_optimizer(optax.adam(1e-3)), K)
    outside = opt.init(params)
    inside = jax.jit(jsa.autoscale(opt.init))(params)
    assert jax.tree_util.tree_structure(inside) == jax.tree_util.tree_structure(outside)
    assert outside.acc_grads["w"].scale.shape == (4, 1)
    for a, b in zip(jax.tree_util.tree_leaves(inside), jax.tree_util.tree_leaves(outside)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_multi_steps_forgets_the_last_rounds_scale():
    """float16 gradients 2**-30 below the first round's: `multi_steps` emits them; plain
    `optax.MultiSteps` keeps the accumulator at the largest scale it saw (the reset
    multiplies the data by 0) and the cast to float16 flushes them."""
    params = jsa.as_scaled_array({"w": jnp.ones(4)}, dtype=jnp.float16)
    grad = jnp.array([1.0, 0.5, -0.25, 1.5], jnp.float16)
    for opt, flushed in [
        (jsa.optax.multi_steps(optax.identity(), 2), False),
        (optax.MultiSteps(optax.identity(), 2), True),
    ]:
        state = opt.init(params)
        step = jax.jit(jsa.autoscale(lambda g, s, opt=opt: opt.update(g, s, params)))
        for e in (0, 0, -30, -30):
            updates, state = step({"w": jsa.scaled_array(grad, 2.0**e)}, state)
        expected = np.asarray(grad, np.float64) * 2.0**-30
        if flushed:
            assert not np.any(_value(updates["w"]))
        else:
            np.testing.assert_array_equal(_value(updates["w"]), expected)
            assert float(updates["w"].scale) == 2.0**-30


def test_split_microbatches():
    batch = {"x": jnp.zeros((8, 3)), "s": jsa.scaled_array(np.ones((8,), np.float16), 2.0)}
    out = jsa.optax.split_microbatches(batch, 4)
    assert out["x"].shape == (4, 2, 3) and out["s"].shape == (4, 2)
    assert isinstance(out["s"], jsa.ScaledArray) and float(out["s"].scale) == 2.0
    with pytest.raises(ValueError, match="does not split into 3"):
        jsa.optax.split_microbatches(batch, 3)


def test_mismatched_microbatches():
    with pytest.raises(ValueError, match="same leading axis"):
        jsa.optax.accumulate_gradients(
            lambda p, b: p, jnp.ones(2), (jnp.zeros((4, 2)), jnp.zeros((3, 2)))
        )


def test_multi_steps_on_plain_gradients_under_jit():
    """Plain float32 parameters and gradients, the accumulator stored in float16, a plain
    jitted step with `optax.apply_updates`: plain updates, and optax.MultiSteps' parameters
    (the gradients are float16-representable, so the sums are exact)."""
    params = {"w": jnp.linspace(-1.0, 1.0, 8)}
    grads = [{"w": jnp.linspace(0.5, 4.0, 8) * (k + 1)} for k in range(4)]
    tx, ref = jsa.optax.multi_steps(optax.adam(1e-2), 2), optax.MultiSteps(optax.adam(1e-2), 2)

    def make_step(tx):
        @jax.jit
        def step(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, updates

        return step

    step, ref_step = make_step(tx), make_step(ref)
    state, ref_state, ref_params = tx.init(params), ref.init(params), params
    for g in grads:
        params, state, updates = step(params, state, g)
        ref_params, ref_state, _ = ref_step(ref_params, ref_state, g)
        assert not isinstance(updates["w"], jsa.ScaledArray)
    np.testing.assert_allclose(params["w"], ref_params["w"], rtol=1e-6)
    assert not np.allclose(params["w"], jnp.linspace(-1.0, 1.0, 8))
