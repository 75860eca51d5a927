"""`jsa.optax.compensated`: Kahan-compensated updates of low-precision parameters."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scaled_arithmetics as jsa
from tests.helpers import represented
from tests.optax.transforms import record

BF16_ULP_AT_1 = 2.0**-7


def _run(opt, params, grads_fn, steps, apply=optax.apply_updates):
    @jax.jit
    def body(i, carry):
        params, state = carry
        updates, state = opt.update(grads_fn(i), state, params)
        return apply(params, updates), state

    return jax.lax.fori_loop(0, steps, body, (params, opt.init(params)))


def test_small_updates_follow_the_float32_sum():
    """bfloat16 1.0 plus 1,000 updates of 1e-4: Kahan ends at the nearest bfloat16 to 1.1."""
    params = jnp.ones(512, jnp.bfloat16)
    step = lambda i: jnp.full(512, 1e-4, jnp.float32)  # noqa: E731
    plain, _ = _run(optax.identity(), params, step, 1000)
    kahan, state = _run(jsa.optax.kahan_summation(optax.identity()), params, step, 1000)
    plain, kahan = np.asarray(plain, np.float64), np.asarray(kahan, np.float64)
    print(f"nearest {plain.mean():.6f}, Kahan {kahan.mean():.6f} (target 1.1)")
    np.testing.assert_array_equal(plain, 1.0)
    assert np.all(np.abs(kahan - 1.1) <= BF16_ULP_AT_1 / 2)
    np.testing.assert_array_equal(kahan, 1.1015625)  # the nearest bfloat16 to 1.1
    # p + c holds the sum, up to the bfloat16 buffer's own roundings (2**-17 per step at most).
    total = kahan + np.asarray(state.compensation, np.float64)
    np.testing.assert_allclose(total, 1.1, atol=1000 * 2.0**-17)


@pytest.mark.parametrize("apply", ["optax", "jsa"])
@pytest.mark.parametrize(
    ("dtype", "compensation_dtype", "atol"),
    [
        (jnp.bfloat16, None, 3e-4),  # each step rounds the buffer: up to 2**-17 per step
        (jnp.bfloat16, jnp.float32, 5e-5),
        (jnp.float16, jnp.float32, 5e-5),
    ],
)
def test_random_updates_follow_float32(apply, dtype, compensation_dtype, atol):
    """300 random updates of ~1e-3 on parameters in [1, 2): the float32 sum, to one rounding."""
    steps, n = 300, 256
    updates = 1e-3 * (0.3 + jax.random.normal(jax.random.PRNGKey(1), (steps, n)))
    p0 = jnp.linspace(1.0, 1.5, n).astype(dtype).astype(jnp.float32)  # representable
    ref = np.asarray(jnp.cumsum(jnp.concatenate([p0[None], updates]), axis=0)[-1], np.float64)
    apply_fn = optax.apply_updates if apply == "optax" else jsa.optax.apply_updates

    opt = jsa.optax.kahan_summation(optax.identity(), compensation_dtype)

    # The steps in one scan (step by step, each was two dispatches from Python); the
    # parameters and the buffer are the carry, so each step's roundings are kept.
    @jax.jit
    def run(params, updates):
        def step(carry, update):
            params, state = carry
            new_updates, state = opt.update(update, state, params)
            assert new_updates.dtype == jnp.float32
            return (apply_fn(params, new_updates), state), None

        (params, state), _ = jax.lax.scan(step, (params, opt.init(params)), updates)
        # Without compensation the same updates lose their low bits every step.
        plain = jax.lax.scan(
            lambda p, u: (optax.apply_updates(p, u), None), p0.astype(dtype), updates
        )
        return params, state, plain[0]

    params, state, plain = run(p0.astype(dtype), updates)
    assert params.dtype == dtype
    assert state.compensation.dtype == (compensation_dtype or dtype)
    total = np.asarray(params, np.float64) + np.asarray(state.compensation, np.float64)
    np.testing.assert_allclose(total, ref, atol=atol)
    half_ulp = float(jnp.finfo(dtype).eps) * 2.0 / 2  # values in [1, 4)
    assert np.all(np.abs(np.asarray(params, np.float64) - ref) <= half_ulp + atol)
    assert np.max(np.abs(np.asarray(plain, np.float64) - ref)) > 4 * half_ulp


def test_adam_chain_follows_its_float32_sum():
    params = {"w": jax.random.normal(jax.random.PRNGKey(0), (8, 16)).astype(jnp.bfloat16)}
    # `record` keeps the updates Kahan receives in the state: their float32 sum is the target.
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3), record())
    opt = jsa.optax.kahan_summation(inner, jnp.float32)
    state = opt.init(params)
    # float32 gradients: Adam's moments (bfloat16 at init, like the parameters) become float32
    # at the first step, and so do its updates. (With bfloat16 updates, XLA may hand Kahan
    # their float32 value under jit while the recorded ones are rounded.)
    grads = {"w": jax.random.normal(jax.random.PRNGKey(1), (8, 16))}
    traces = []

    @jax.jit
    def step(grads, state, params):
        traces.append(None)
        return opt.update(grads, state, params)

    ref = params["w"].astype(jnp.float32)
    for i in range(20):
        updates, state = step(grads, state, params)
        params = optax.apply_updates(params, updates)
        ref = ref + state.inner_state[2].trace["w"]
        if i == 1:
            n_traces = len(traces)
    assert len(traces) == n_traces <= 2  # no recompilation once Adam's state is float32
    total = params["w"].astype(jnp.float32) + state.compensation["w"]
    np.testing.assert_allclose(total, ref, atol=1e-5)  # 20 Adam steps of 1e-3
    half_ulp = 2.0**-8 * np.maximum(np.abs(np.asarray(ref)), 2.0**-126)
    assert np.all(np.abs(np.asarray(params["w"], np.float32) - ref) <= half_ulp + 1e-5)


def test_non_floating_parameters_and_none_updates():
    params = {"w": jnp.ones(3, jnp.bfloat16), "n": jnp.arange(3), "frozen": jnp.ones(2)}
    opt = jsa.optax.kahan_summation(optax.sgd(1e-3))
    state = opt.init(params)
    assert state.compensation["n"] is None and state.compensation["frozen"].dtype == jnp.float32
    grads = {"w": jnp.ones(3), "n": None, "frozen": None}
    updates, new_state = opt.update(grads, state, params)
    assert updates["n"] is None and updates["frozen"] is None
    np.testing.assert_array_equal(new_state.compensation["frozen"], 0.0)
    np.testing.assert_array_equal(updates["w"], 0.0)  # -1e-3 is below half an ulp at 1
    np.testing.assert_allclose(new_state.compensation["w"].astype(jnp.float32), -1e-3, rtol=4e-3)


@pytest.mark.parametrize("compensation_dtype", [None, jnp.float32])
def test_scaled_parameters(compensation_dtype):
    """ScaledArray parameters get ScaledArray buffers; the whole step runs under autoscale."""
    values = jnp.linspace(1.0, 2.0, 32).astype(jnp.bfloat16).astype(jnp.float32) * 2.0**-40
    params = {"w": jsa.as_scaled_array(values, scale=2.0**-40, dtype=jnp.bfloat16)}
    opt = jsa.optax.kahan_summation(optax.identity(), compensation_dtype)
    state = opt.init(params)
    assert isinstance(state.compensation["w"], jsa.ScaledArray)
    assert state.compensation["w"].dtype == (compensation_dtype or jnp.bfloat16)
    update = jsa.as_scaled_array(jnp.full(32, 2.0**-50), scale=2.0**-50, dtype=jnp.float32)

    @jax.jit
    @jsa.autoscale
    def step(params, state, updates):
        updates, state = opt.update(updates, state, params)
        return jsa.optax.apply_updates(params, updates), state

    structure = jax.tree_util.tree_structure(state)
    for _ in range(100):
        params, state = step(params, state, {"w": update})
        assert jax.tree_util.tree_structure(state) == structure
    w = params["w"]
    assert isinstance(w, jsa.ScaledArray) and w.dtype == jnp.bfloat16
    expected = np.asarray(values, np.float64) + 100 * 2.0**-50  # plain bfloat16 stays put
    total = represented(w) + represented(state.compensation["w"])
    rtol = 2.0**-20 if compensation_dtype is not None else 2.0**-9
    np.testing.assert_allclose(total, expected, rtol=rtol)
    assert np.all(np.abs(represented(w) - expected) <= (2.0**-8 + rtol) * expected)
    # Outside autoscale, on ScaledArray objects, the update wraps itself.
    updates, _ = opt.update({"w": update}, state, params)
    assert isinstance(updates["w"], jsa.ScaledArray)


@pytest.mark.parametrize("scale_shape", [None, (4, 1)])
def test_init_state_keeps_its_layout_through_steps(scale_shape):
    """The buffers `init` makes, outside autoscale or inside it (`jax.jit(jsa.autoscale(
    opt.init))`), are those `update` stores: ScaledArrays in the parameter's block layout
    for ScaledArray parameters, so a `lax.scan` over steps carries the state unchanged."""
    values = (jnp.arange(32.0).reshape(4, 8) + 1).astype(jnp.bfloat16)
    params = {"w": jsa.as_scaled_array(values, scale_shape=scale_shape), "b": jnp.ones(8)}
    opt = jsa.optax.kahan_summation(optax.sgd(1e-3))
    outside = opt.init(params)
    inside = jax.jit(jsa.autoscale(opt.init))(params)

    def layout(tree):
        leaves = jax.tree_util.tree_leaves(tree)
        return jax.tree_util.tree_structure(tree), [(x.shape, x.dtype) for x in leaves]

    assert layout(inside) == layout(outside)
    assert isinstance(outside.compensation["w"], jsa.ScaledArray)
    assert not isinstance(outside.compensation["b"], jsa.ScaledArray)
    for state in (outside, inside):
        np.testing.assert_array_equal(represented(state.compensation["w"]), 0.0)

    @jax.jit
    @jsa.autoscale
    def steps(params, state):
        def body(carry, _):
            params, state = carry
            grads = jax.tree_util.tree_map(lambda p: p * 0 + 10.0, params)  # steps of 0.01
            updates, state = opt.update(grads, state, params)
            return (jsa.optax.apply_updates(params, updates), state), None

        return jax.lax.scan(body, (params, state), None, length=3)[0]

    for state in (outside, inside):
        new_params, new_state = steps(params, state)
        assert layout(new_state) == layout(outside)
        # Parameter and buffer sum to the float32 result: bfloat16 alone drops the steps
        # below half its ulp (0.6% of the value here), the buffer's own rounding costs
        # 2**-16 of it at most.
        np.testing.assert_allclose(
            represented(new_params["w"]) + represented(new_state.compensation["w"]),
            np.asarray(values, np.float64) - 0.03,
            rtol=2.0**-12,
        )


def test_update_needs_params():
    opt = jsa.optax.kahan_summation(optax.sgd(0.1))
    state = opt.init({"w": jnp.ones(2)})
    with pytest.raises(
        ValueError,
        match=re.escape(
            "kahan_summation needs the parameters: call update(updates, state, params)"
        ),
    ):
        opt.update({"w": jnp.ones(2)}, state)
