"""Plain optax inside an autoscaled step: right where the data's range holds the update,
refused at trace time (naming `jsa.optax.scale_optimizer`) where it cannot be, never NaN."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jax_scaled_arithmetics as jsa

RNG = np.random.default_rng(0)
W = jnp.asarray(RNG.normal(size=(32, 32)) * 0.2, jnp.float32)
# Inputs whose columns span 2^-4..2^4: the gradients' entries span more than 2^-12 of their
# largest, where plain optax.adam on float16 data silently produced NaN parameters. (Much
# wider spreads flush the smallest gradients themselves in float16 data at one scale per
# tensor; that is the gradient's format, not the optimizer's, and block scales are the fix.)
X = jnp.asarray(RNG.normal(size=(8, 32)) * np.exp2(np.linspace(-4, 4, 32)), jnp.float32)
BIAS = jnp.zeros((32,), jnp.float32)


def loss(params):
    return jnp.mean(jnp.tanh(X @ params["w"] + params["b"][None, :]) ** 2)


OPTIMIZERS = {
    "sgd-momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=1e-2),
    "lion": lambda: optax.lion(1e-4),
    "adafactor": lambda: optax.adafactor(1e-2),
    "clip-decay-adam-schedule": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.add_decayed_weights(1e-4),
        optax.adam(optax.warmup_cosine_decay_schedule(1e-4, 1e-3, 2, 10)),
    ),
}
# Optimizers that divide by a per-entry statistic: their constants are lost in float16.
DIVIDING = {"adam", "adamw", "adafactor", "clip-decay-adam-schedule"}


def make_step(tx):
    def step(params, state):
        grads = jax.grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), updates, state

    return step


def run(tx, dtype, steps=3):
    """`steps` steps of plain float32 and of the autoscaled step on `dtype` data from the
    same represented values; the first updates of each and the last parameters."""
    scaled = jsa.as_scaled_array({"w": W, "b": BIAS}, dtype=dtype)
    values = jsa.asarray(scaled, jnp.float32)
    plain_step, scaled_step = jax.jit(make_step(tx)), jax.jit(jsa.autoscale(make_step(tx)))
    plain_state, scaled_state = tx.init(values), tx.init(scaled)
    first = None
    for _ in range(steps):
        values, ref_updates, plain_state = plain_step(values, plain_state)
        scaled, updates, scaled_state = scaled_step(scaled, scaled_state)
        first = first or (ref_updates, updates)
    return values, scaled, first


# In the slow step only: AdamW on bfloat16 data (Adam's update and add_decayed_weights run in
# the default run's bfloat16 adam and clip-decay-adam-schedule cases), Lion on float16 data
# (Lion runs on bfloat16 data, float16 data through sgd-momentum) and SGD with momentum on
# bfloat16 data (on float16 data in the default run).
SLOW_CASES = {("adamw", "bfloat16"), ("lion", "float16"), ("sgd-momentum", "bfloat16")}


@pytest.mark.parametrize(
    "name, dtype",
    [
        pytest.param(
            name,
            dtype,
            id=f"{dtype_name}-{name}",
            marks=pytest.mark.slow if (name, dtype_name) in SLOW_CASES else (),
        )
        for dtype, dtype_name in ((ml_dtypes.bfloat16, "bfloat16"), (np.float16, "float16"))
        for name in sorted(OPTIMIZERS)
    ],
)
@pytest.mark.one_case
def test_plain_optax_in_an_autoscaled_step(name, dtype):
    tx = OPTIMIZERS[name]()
    if dtype == np.float16 and name in DIVIDING:
        with pytest.raises(ValueError, match=r"jsa\.optax\.scale_optimizer\(tx\)"):
            run(tx, dtype)
        return
    values, scaled, (ref_updates, updates) = run(tx, dtype)
    for key in ("w", "b"):
        got = np.asarray(jsa.asarray(scaled[key], jnp.float32))
        assert np.all(np.isfinite(got)), key
        # Parameters: within the data format's rounding of float32's (3 steps).
        eps = float(jnp.finfo(dtype).eps)
        np.testing.assert_allclose(got, values[key], atol=8 * eps * float(jnp.max(jnp.abs(W))))
        # The first update's signs agree with float32's wherever float32's is not ~0.
        ref = np.asarray(ref_updates[key], np.float64)
        upd = np.asarray(jsa.asarray(updates[key], jnp.float32), np.float64)
        significant = np.abs(ref) > 1e-2 * np.max(np.abs(ref), initial=0.0)
        agree = np.mean(np.sign(upd[significant]) == np.sign(ref[significant]))
        assert agree >= 0.99, (key, agree)


def test_the_error_names_the_source_line_and_the_format():
    tx = optax.adam(1e-3)
    with pytest.raises(ValueError, match=r"float16 data.*optax.*eps=1e-8 is 0") as err:
        run(tx, np.float16, steps=1)
    assert "optax" in str(err.value) and ".py:" in str(err.value)


def test_scale_optimizer_is_the_fix_for_float16_adam():
    tx = jsa.optax.scale_optimizer(optax.adam(1e-3))
    scaled = jsa.as_scaled_array({"w": W, "b": BIAS}, dtype=np.float16)
    values = jsa.asarray(scaled, jnp.float32)
    state = tx.init(scaled)

    @jax.jit
    @jsa.autoscale
    def step(params, state):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return jsa.optax.apply_updates(params, updates), updates, state

    ref_tx = optax.adam(1e-3)
    _, ref_updates, _ = jax.jit(make_step(ref_tx))(values, ref_tx.init(values))
    params, updates, state = step(scaled, state)
    for key in ("w", "b"):
        upd = np.asarray(jsa.asarray(updates[key], jnp.float32))
        assert np.all(np.isfinite(upd))
        np.testing.assert_allclose(upd, ref_updates[key], atol=2e-3 * 1e-3, rtol=2e-3)


def test_none_leaves_in_jsa_optax():
    """Gradients of frozen parts are `None`, as Equinox's filtered gradients and optax's
    masks make them: `scale_optimizer`, `jsa.optax.apply_updates` and the rescalings keep
    them, as plain optax does."""
    params = jsa.as_scaled_array({"w": W, "frozen": None}, dtype=np.float16)
    tx = jsa.optax.scale_optimizer(optax.adam(1e-3))
    state = tx.init(params)

    @jax.jit
    @jsa.autoscale
    def step(params, state):
        grads = {"w": jax.grad(lambda w: loss({"w": w, "b": BIAS}))(params["w"]), "frozen": None}
        updates, state = tx.update(grads, state, params)
        return jsa.optax.apply_updates(params, updates), optax.apply_updates(params, updates)

    ours, plain = step(params, state)
    assert ours["frozen"] is None and plain["frozen"] is None
    assert np.all(np.isfinite(jsa.asarray(ours["w"], jnp.float32)))
    tree = {"g": jsa.as_scaled_array(W), "none": None, "rate": 0.5}
    for rescale in (jsa.ops.dynamic_rescale_max, jsa.ops.dynamic_rescale_l2_grad):
        out = rescale(tree)
        assert out["none"] is None and out["rate"] == 0.5


def test_optax_losses_are_not_taken_for_an_optimizer():
    """optax's loss functions divide per entry in their backward pass (softmax): that is the
    model's loss, computed by the scaled rules as any other code, not refused."""
    logits = jsa.as_scaled_array(jnp.asarray(RNG.normal(size=(4, 10)), jnp.float16))
    labels = jnp.arange(4)

    def loss(logits):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    grads = jax.jit(jsa.autoscale(jax.grad(loss)))(logits)
    expected = jax.jit(jax.grad(loss))(jsa.asarray(logits, jnp.float32))
    np.testing.assert_allclose(jsa.asarray(grads, jnp.float32), expected, atol=2e-3)


# Optimizers whose state starts filled with a non-zero constant: plain `tx.init` on
# ScaledArrays maps the data and the scale separately, so the fill `c` would represent c * c.
CONSTANT_FILLED = {
    "adagrad": (lambda: optax.adagrad(1e-2, initial_accumulator_value=0.1), 0.1),
    "yogi": (lambda: optax.yogi(1e-2), 1e-6),  # initial_accumulator_value=1e-6
    "rmsprop": (lambda: optax.rmsprop(1e-3, initial_scale=0.5), 0.5),
}


def _init_from_values(tx, params):
    return jsa.as_scaled_array(tx.init(jsa.asarray(params)))


def _init_scale_optimizer(tx, params):
    return tx.init(params)


@pytest.mark.parametrize("init", [_init_from_values, _init_scale_optimizer], ids=["values", "so"])
@pytest.mark.parametrize("name", sorted(CONSTANT_FILLED))
def test_constant_filled_states_start_from_their_constant(name, init):
    """The two initialisations the docs give for ScaledArray parameters: the state holds
    the constant, and three autoscaled steps follow float32's."""
    make, fill = CONSTANT_FILLED[name]
    scaled = jsa.as_scaled_array({"w": W, "b": BIAS})
    values = jsa.asarray(scaled, jnp.float32)
    tx = make() if init is _init_from_values else jsa.optax.scale_optimizer(make(), jnp.float32)
    state = init(tx, scaled)
    filled = [
        leaf
        for leaf in jax.tree.leaves(state, is_leaf=jsa.is_scaled_leaf)
        if isinstance(leaf, jsa.ScaledArray) and leaf.shape == W.shape
    ]
    assert filled and all(
        np.allclose(jsa.asarray(leaf, jnp.float32), fill, rtol=1e-6) for leaf in filled
    )
    apply = optax.apply_updates if init is _init_from_values else jsa.optax.apply_updates

    @jax.jit
    @jsa.autoscale
    def scaled_step(params, state):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return apply(params, updates), state

    ref_tx = make()
    plain_step = jax.jit(make_step(ref_tx))
    plain_state = ref_tx.init(values)
    for _ in range(3):
        scaled, state = scaled_step(scaled, state)
        values, _, plain_state = plain_step(values, plain_state)
    for key in ("w", "b"):
        change = float(np.max(np.abs(values[key] - {"w": W, "b": BIAS}[key])))
        np.testing.assert_allclose(
            jsa.asarray(scaled[key], jnp.float32), values[key], rtol=0, atol=1e-4 * change
        )


def test_a_state_mapped_over_data_and_scale_is_refused_with_the_fixes():
    """`zero_nans` keeps a boolean per parameter: its plain init on ScaledArrays makes
    ScaledArrays of booleans, which the step refuses, naming both initialisations; both
    then run."""
    tx = optax.chain(optax.zero_nans(), optax.sgd(1e-2))
    scaled = jsa.as_scaled_array({"w": W, "b": BIAS})

    def step(params, state):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    with pytest.raises(
        TypeError, match=r"found_nan\['b'\]: ScaledArray data must be floating"
    ) as err:
        jax.jit(jsa.autoscale(step))(scaled, tx.init(scaled))
    message = str(err.value)
    assert "jax.tree.map descends into a ScaledArray" in message
    assert "jsa.optax.scale_optimizer(tx).init(params)" in message
    assert "jsa.as_scaled_array(tx.init(jsa.asarray(params)))" in message
    params, state = jax.jit(jsa.autoscale(step))(scaled, _init_from_values(tx, scaled))
    assert not bool(state[0].found_nan["w"])
    assert np.all(np.isfinite(jsa.asarray(params["w"], jnp.float32)))


DRIFTING = {
    # name: (optimizer, parameters' power of two, gradients' power of two)
    "agc": (lambda: optax.chain(optax.adaptive_grad_clip(0.1), optax.sgd(0.1)), -20, 0),
    "adafactor": (lambda: optax.adafactor(1e-2), 20, 0),
    "prodigy": (lambda: optax.contrib.prodigy(), 0, -20),
}


def _drift_case(name, scaled_tx, apply):
    """Five steps of `DRIFTING[name]` on parameters near 2^p with gradients near 2^g: the
    autoscaled step's parameters and float32's."""
    make, p, g = DRIFTING[name]
    small = {"w": W[:8, :16] * 2.0**p, "b": W[8, 16:] * 2.0**p}
    target = W[16:24, :16] * 2.0**p

    def drift_loss(params):
        fit = params["w"] * jnp.tanh(params["b"])[None, :] + params["w"] - target
        return jnp.sum(fit**2) * 2.0 ** (g - 2 * p)

    def step(tx, apply_updates):
        def run_step(params, state):
            updates, state = tx.update(jax.grad(drift_loss)(params), state, params)
            return apply_updates(params, updates), state

        return run_step

    scaled = jsa.as_scaled_array(small)
    values = jsa.asarray(scaled, jnp.float32)
    tx, ref_tx = scaled_tx(make()), make()
    scaled_step = jax.jit(jsa.autoscale(step(tx, apply)))
    plain_step = jax.jit(step(ref_tx, optax.apply_updates))
    state, plain_state = tx.init(scaled), ref_tx.init(values)
    for _ in range(5):
        scaled, state = scaled_step(scaled, state)
        values, plain_state = plain_step(values, plain_state)
    return small, scaled, values


def _scale_optimizer(tx):
    return jsa.optax.scale_optimizer(tx, jnp.float32)


def _as_is(tx):
    return tx


# The fixes docs/design.md names for each, and the plain step that drifts without them.
DRIFT_FIXES = {
    "agc": ([_as_is, _scale_optimizer], _as_is, optax.apply_updates),
    "adafactor": ([_as_is, _scale_optimizer], _as_is, optax.apply_updates),
    "prodigy": ([_scale_optimizer], _as_is, jsa.optax.apply_updates),
}


@pytest.mark.parametrize("name", sorted(DRIFTING))
def test_the_fixes_follow_float32_where_plain_state_drifts(name):
    """Parameters or gradients far from unit range: a `where` choosing the clipped case
    (agc), a product whose large entries do not meet (adafactor with zero gradients), or
    scalar estimates multiplying each other (prodigy) carry scales that run ahead of their
    values from step to step (five steps flush or poison the plain step); with
    `jsa.optax.apply_updates` rescaling the parameters, and `scale_optimizer` the state
    where it holds such estimates, the steps follow float32's."""
    fixes, drifting_tx, drifting_apply = DRIFT_FIXES[name]
    for wrap in fixes:
        small, scaled, values = _drift_case(name, wrap, jsa.optax.apply_updates)
        for key in ("w", "b"):
            # (b's gradient is 0 where tanh saturates, at 2^20: it must then stay as it is.)
            change = float(np.max(np.abs(values[key] - small[key])))
            assert change > 0 or key == "b"
            np.testing.assert_allclose(
                jsa.asarray(scaled[key], jnp.float32), values[key], rtol=0, atol=1e-4 * change
            )
    # Without the fix: the documented drift (docs/design.md).
    _, drifted, values = _drift_case(name, drifting_tx, drifting_apply)
    got = np.asarray(jsa.asarray(drifted["w"], jnp.float32))
    error = np.max(np.abs(got - values["w"]), initial=0.0, where=np.isfinite(got))
    assert not np.all(np.isfinite(got)) or error > 0.1 * np.max(np.abs(values["w"]))


LONG_RUN = {
    "adam": lambda: optax.adam(1e-3),
    "adafactor": lambda: optax.adafactor(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "lamb": lambda: optax.lamb(1e-3),
    "agc": lambda: optax.chain(optax.adaptive_grad_clip(0.1), optax.sgd(1e-2)),
}


@pytest.mark.parametrize("name", sorted(LONG_RUN))
def test_plain_optax_state_drift_is_bounded_at_unit_scale(name):
    """200 steps of an MLP, float32 data at unit scale, plain optax and
    `optax.apply_updates`: the scales drift (nothing resets them, docs/design.md) but the
    data stays far inside float32's range and the parameters follow float32's."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(64, 4)), jnp.float32)
    start = {
        "w1": jnp.asarray(rng.normal(size=(16, 32)) / 4, jnp.float32),
        "b1": jnp.zeros(32),
        "w2": jnp.asarray(rng.normal(size=(32, 4)) / 6, jnp.float32),
        "b2": jnp.zeros(4),
    }

    def mlp_loss(params):
        hidden = jax.nn.gelu(x @ params["w1"] + params["b1"][None, :])
        return jnp.mean((hidden @ params["w2"] + params["b2"][None, :] - y) ** 2)

    tx = LONG_RUN[name]()

    def step(params, state):
        updates, state = tx.update(jax.grad(mlp_loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    plain_step, scaled_step = jax.jit(step), jax.jit(jsa.autoscale(step))
    values, plain_state = start, tx.init(start)
    scaled, state = jsa.as_scaled_array(start), jsa.as_scaled_array(tx.init(start))
    for _ in range(200):
        values, plain_state = plain_step(values, plain_state)
        scaled, state = scaled_step(scaled, state)
    for key in start:
        change = float(jnp.max(jnp.abs(values[key] - start[key])))
        np.testing.assert_allclose(
            jsa.asarray(scaled[key], jnp.float32), values[key], rtol=0, atol=2e-5 * change
        )
    for leaf in jax.tree.leaves((scaled, state), is_leaf=jsa.is_scaled_leaf):
        if isinstance(leaf, jsa.ScaledArray) and bool(jnp.any(leaf.data != 0)):
            assert 2.0**-24 < float(jnp.max(jnp.abs(leaf.data))) < 2.0**24
