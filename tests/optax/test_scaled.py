"""`jsa.optax.scaled`: scaled optimizer states against plain float32 optax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scaled_arithmetics as jsa
import jax_scaled_arithmetics.optax as jsa_optax
from tests.helpers import as_scaled_array_jit

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.05),
    "momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lamb": lambda: optax.lamb(1e-2),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
}


def _represented(x):
    if isinstance(x, jsa.ScaledArray):
        return np.asarray(x.data, np.float64) * np.asarray(x.scale, np.float64)
    return np.asarray(x, np.float64)


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree, is_leaf=jsa.is_scaled_leaf)


def _assert_tree_close(actual, expected, rtol, what):
    a_leaves, e_leaves = _leaves(actual), _leaves(expected)
    assert len(a_leaves) == len(e_leaves), what
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        a, e = _represented(a), _represented(e)
        assert a.shape == e.shape, (what, i)
        atol = rtol * max(float(np.max(np.abs(e), initial=0.0)), 1e-30)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"{what} leaf {i}")


def _assert_stored_scaled(state, dtype=jnp.float16):
    """Array state leaves are finite ScaledArrays with `dtype` data; ints and scalars are plain."""
    n_scaled = 0
    for leaf in _leaves(state):
        if isinstance(leaf, jsa.ScaledArray):
            n_scaled += 1
            assert leaf.dtype == jnp.dtype(dtype)
            assert jnp.asarray(leaf.scale).dtype == jnp.float32
            assert np.all(np.isfinite(np.asarray(leaf.data, np.float32)))
            assert np.isfinite(float(leaf.scale)) and float(leaf.scale) > 0
        elif leaf is not None and hasattr(leaf, "dtype"):
            assert np.ndim(leaf) == 0 or not jnp.issubdtype(leaf.dtype, jnp.floating)
    return n_scaled


@jax.jit  # one compile for the draws (eager, each shape's draw is a compile of its own)
def _problem(seed=0):
    """A two-layer MLP regression problem; float16-representable parameters."""
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    params = {
        "w1": jax.random.normal(k1, (8, 16)) / np.sqrt(8),
        "b1": 0.1 * jax.random.normal(k2, (16,)),
        "w2": jax.random.normal(k3, (16, 4)) / 4.0,
        "b2": jnp.zeros(4),
    }
    params = jsa.tree.astype(jsa.tree.astype(params, jnp.float16), jnp.float32)
    x = jax.random.normal(k4, (32, 8)).astype(jnp.float16).astype(jnp.float32)
    y = jnp.tanh(x[:, :4])
    return params, x, y


def _loss(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"][None, :])
    return jnp.mean((h @ params["w2"] + params["b2"][None, :] - y) ** 2)


def _grads(params, scale_exponent):
    """Gradient-like values of magnitude ~2**scale_exponent, exactly representable in float16."""
    grads = _unit_grads(params)
    return _scaled_grads(grads, jnp.float32(2.0**scale_exponent))


@jax.jit  # one compile for every scale (eagerly, each operation is a compile per call)
def _scaled_grads(grads, scale):
    plain = jax.tree_util.tree_map(lambda g: g * scale, grads)
    # Values `plain`, data `grads` (float16), scale `scale`.
    scaled = jsa.as_scaled_array(plain, scale=scale, dtype=jnp.float16)
    return plain, scaled


@jax.jit  # one compile (eagerly, each operation is one)
def _scaled_params(params):
    """`params` as float16 ScaledArrays, max-rescaled (data in [1, 2))."""
    return jsa.ops.dynamic_rescale_max(jsa.tree.astype(jsa.as_scaled_array(params), jnp.float16))


@jax.jit  # one compile for the draws
def _unit_grads(params):
    keys = jax.random.split(jax.random.PRNGKey(7), len(params))
    flat, tree = jax.tree_util.tree_flatten(params)
    grads = [
        jax.random.normal(k, p.shape).astype(jnp.float16).astype(jnp.float32)
        for k, p in zip(keys, flat)
    ]
    return jax.tree_util.tree_unflatten(tree, grads)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.one_case
def test_init_stores_scaled_float16(name):
    params, _, _ = _problem()
    opt = jsa_optax.scale_optimizer(OPTIMIZERS[name]())
    state = opt.init(params)
    plain_state = OPTIMIZERS[name]().init(params)
    assert jax.tree_util.tree_structure(jsa.tree.asarray(state)) == jax.tree_util.tree_structure(
        plain_state
    )
    n_scaled = _assert_stored_scaled(state)
    assert n_scaled == sum(1 for x in _leaves(plain_state) if np.ndim(x) >= 1)
    _assert_tree_close(state, plain_state, 0.0, "init state")


@pytest.mark.parametrize("name", ["adam", "clip_adam"])
@pytest.mark.parametrize("per_row", [False, True])
def test_init_inside_autoscale_and_jit_is_init(name, per_row):
    """`jax.jit(jsa.autoscale(opt.init))`, as a `create_train_state` function calls it,
    builds the state `opt.init` builds (it failed with a TypeError of JAX's bind), block
    layouts of the parameters included, and a step from it matches."""
    params, x, y = _problem()
    opt = jsa_optax.scale_optimizer(OPTIMIZERS[name]())
    s_params = _scaled_params(params)
    if per_row:  # a scale per row of each matrix
        s_params = jsa.as_scaled_array(
            jsa.asarray(s_params), dtype=jnp.float16, scale_shape=lambda s: s[:-1] + (1,)
        )
    expected = opt.init(s_params)
    state = jax.jit(jsa.autoscale(opt.init))(s_params)
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(expected)
    for got, want in zip(_leaves(state), _leaves(expected)):
        assert type(got) is type(want)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            assert (a.shape, a.dtype) == (b.shape, b.dtype)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    @jax.jit
    @jsa.autoscale
    def step(params, state):
        grads = jax.grad(_loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return jsa_optax.apply_updates(params, updates), state

    for got, want in zip(_leaves(step(s_params, state)), _leaves(step(s_params, expected))):
        np.testing.assert_array_equal(_represented(got), _represented(want))


@pytest.mark.parametrize(
    "name",
    # Adam, LAMB and clipped Adam in the default run: SGD and momentum store a subset of
    # Adam's state (its first moment's trace), AdamW adds decayed weights to Adam's update
    # (both in the slow step).
    [
        pytest.param(n, marks=pytest.mark.slow) if n in ("sgd", "momentum", "adamw") else n
        for n in sorted(OPTIMIZERS)
    ],
)
@pytest.mark.one_case
def test_update_matches_float32_optax(name):
    """Same gradients in: scaled FP16 state and plain float32 optax agree for a few steps.

    Gradients of magnitude 2**-24 underflow plain float16 and 2**20 overflow it;
    scaled, they are represented exactly.
    """
    params, _, _ = _problem()
    opt = jsa_optax.scale_optimizer(OPTIMIZERS[name]())

    @jax.jit
    @jsa.autoscale
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return jsa_optax.apply_updates(params, updates), state, updates

    ref = OPTIMIZERS[name]()

    @jax.jit
    def ref_step(params, state, grads):
        updates, state = ref.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    s_params0 = _scaled_params(params)
    s_state0, ref_state0 = opt.init(s_params0), ref.init(params)
    for scale_exponent in (0, -24, 20):  # one compilation: the scale is a value
        plain_grads, scaled_grads = _grads(params, scale_exponent)
        ref_params, ref_state = params, ref_state0
        s_params, s_state = s_params0, s_state0
        for i in range(3):
            what = f"2**{scale_exponent} gradients, step {i}"
            ref_params, ref_state, ref_updates = ref_step(ref_params, ref_state, plain_grads)
            s_params, s_state, s_updates = step(s_params, s_state, scaled_grads)
            _assert_tree_close(s_updates, ref_updates, 5e-3, f"updates, {what}")
            _assert_tree_close(s_state, ref_state, 5e-3, f"state, {what}")
            _assert_tree_close(s_params, ref_params, 2e-3, f"params, {what}")
            _assert_stored_scaled(s_state)
            assert all(leaf.dtype == jnp.float16 for leaf in _leaves(s_params))


@pytest.mark.parametrize(
    "name",
    # Each optimizer's update is checked in the default run by
    # test_update_matches_float32_optax; the step in one function, with Adam.
    [n if n == "adam" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(OPTIMIZERS)],
)
@pytest.mark.one_case
def test_full_step_in_one_autoscale_function(name):
    """Forward, backward and optimizer inside one `@jax.jit @jsa.autoscale` function."""
    params, x, y = _problem()
    ref = OPTIMIZERS[name]()
    opt = jsa_optax.scale_optimizer(OPTIMIZERS[name]())

    @jax.jit
    def ref_step(params, state):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, state = ref.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    @jax.jit
    @jsa.autoscale
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return jsa_optax.apply_updates(params, updates), state, loss

    ref_params, ref_state = params, ref.init(params)
    s_params = _scaled_params(params)
    s_state = opt.init(s_params)
    s_x, s_y = jsa.as_scaled_array((x, y), dtype=jnp.float16)
    structure = jax.tree_util.tree_structure(s_state)
    for _ in range(4):
        ref_params, ref_state, ref_loss = ref_step(ref_params, ref_state)
        s_params, s_state, s_loss = step(s_params, s_state, s_x, s_y)
        assert jax.tree_util.tree_structure(s_state) == structure
        np.testing.assert_allclose(_represented(s_loss), float(ref_loss), rtol=1e-2)
        _assert_stored_scaled(s_state)
    # FP16 gradients (~1e-3 relative) feed Adam's ratio mu / sqrt(nu): compare the parameters.
    _assert_tree_close(s_params, ref_params, 1e-2, "params after 4 steps")
    assert all(isinstance(p, jsa.ScaledArray) and p.dtype == jnp.float16 for p in _leaves(s_params))


# The wrapping is the optimizer's; each compiles a whole scaled step (~4 s): slow step.
@pytest.mark.parametrize("name", ["momentum", "adam"])
@pytest.mark.slow
def test_outside_autoscale_matches_inside(name):
    """`update` and `apply_updates` wrap themselves in autoscale when given ScaledArrays."""
    params, _, _ = _problem()
    _, grads = _grads(params, -10)
    opt = jsa_optax.scale_optimizer(OPTIMIZERS[name]())
    s_params = jax.jit(lambda p: jsa.tree.astype(jsa.as_scaled_array(p), jnp.float16))(params)
    state = opt.init(s_params)

    updates_out, state_out = opt.update(grads, state, s_params)
    params_out = jsa_optax.apply_updates(s_params, updates_out)

    @jax.jit
    @jsa.autoscale
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return jsa_optax.apply_updates(params, updates), state, updates

    params_in, state_in, updates_in = step(s_params, state, grads)
    _assert_stored_scaled(state_out)
    for out, inside in ((updates_out, updates_in), (state_out, state_in), (params_out, params_in)):
        assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(inside)
        _assert_tree_close(out, inside, 1e-3, "outside vs inside")


def test_plain_inputs_outside_autoscale_still_store_scaled():
    params, _, _ = _problem()
    plain_grads, _ = _grads(params, 0)
    opt = jsa_optax.scaled_state(optax.adam(1e-3))
    state = opt.init(params)
    updates, new_state = opt.update(plain_grads, state, params)
    _assert_stored_scaled(new_state)
    assert jax.tree_util.tree_structure(new_state) == jax.tree_util.tree_structure(state)
    # Updates computed from the scaled state are ScaledArrays, with the gradients' dtype.
    assert all(u.dtype == jnp.float32 for u in _leaves(updates))


def test_updates_under_jit_outside_autoscale():
    """Under `jax.jit` without autoscale: plain gradients get plain updates (their values),
    so the FP16 state drops into a plain float32 step with `optax.apply_updates`; ScaledArray
    gradients get ScaledArray updates, which `jsa.optax.apply_updates` adds and
    `optax.apply_updates` refuses with a note that says what to use instead."""
    params, _, _ = _problem()
    plain_grads, scaled_grads = _grads(params, 0)
    opt = jsa_optax.scaled_state(optax.adam(1e-3))
    ref = optax.adam(1e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        updates, state = opt.update(plain_grads, state, params)
        return optax.apply_updates(params, updates), updates

    new_params, updates = step(params, state)
    assert not any(isinstance(u, jsa.ScaledArray) for u in jax.tree.leaves(updates))
    expected = optax.apply_updates(params, ref.update(plain_grads, ref.init(params), params)[0])
    _assert_tree_close(new_params, expected, 1e-6, "params")
    # The same through scale_optimizer, whose update wraps scaled_state's.
    wrapped = jsa_optax.scale_optimizer(optax.adam(1e-3))
    wrapped_updates, _ = jax.jit(wrapped.update)(plain_grads, wrapped.init(params), params)
    assert not any(isinstance(u, jsa.ScaledArray) for u in jax.tree.leaves(wrapped_updates))
    _assert_tree_close(
        optax.apply_updates(params, wrapped_updates), expected, 1e-6, "scale_optimizer"
    )

    @jax.jit
    def scaled_step(params, state):
        updates, state = opt.update(scaled_grads, state, params)
        return jsa_optax.apply_updates(params, updates), updates

    new_params, updates = scaled_step(params, state)
    assert all(
        isinstance(u, jsa.ScaledArray) for u in jax.tree.leaves(updates, is_leaf=jsa.is_scaled_leaf)
    )
    expected = jax.tree_util.tree_map(
        lambda p, u: p + jnp.asarray(u.to_array()), params, updates, is_leaf=jsa.is_scaled_leaf
    )
    _assert_tree_close(new_params, expected, 1e-6, "params")
    with pytest.raises(jax.errors.TracerArrayConversionError, match="jsa.optax.apply_updates"):
        jax.jit(lambda p, s: optax.apply_updates(p, opt.update(scaled_grads, s, p)[0]))(
            params, state
        )


def test_rescaling_keeps_values():
    """Dynamic rescaling moves powers of two only: the stored values do not change."""
    params, _, _ = _problem()
    _, grads = _grads(params, -12)
    states = {}
    for rescale in (jsa.ops.dynamic_rescale_max, None):
        # float32 data: no rounding in the final cast, so the values must be identical.
        opt = jsa_optax.scaled_state(optax.adam(1e-3), state_dtype=jnp.float32, rescale=rescale)
        _, states[rescale] = opt.update(grads, opt.init(params), params)
    rescaled, not_rescaled = states[jsa.ops.dynamic_rescale_max], states[None]
    for a, b in zip(_leaves(rescaled), _leaves(not_rescaled)):
        np.testing.assert_array_equal(_represented(a), _represented(b))
    # Stored in float16: the same values up to float16 rounding, the largest at the top of
    # float16's range (max-rescaled into [1, 2), then shifted by 2**14).
    opt = jsa_optax.scale_optimizer(optax.adam(1e-3))
    _, state = opt.update(grads, opt.init(params), params)
    _assert_tree_close(state, rescaled, 2.0**-11, "float16 vs float32 state")
    for leaf in _leaves(state[0].mu) + _leaves(state[0].nu):
        top = float(np.max(np.abs(np.asarray(leaf.data, np.float32))))
        assert 2.0**14 <= top < 2.0**15


def test_data_exponent_keeps_second_moment_range():
    """Adam's second moment spans the squared gradient range: the top of float16 is needed.

    With gradients 1 and 2**-16, `nu` spans 2**-32 of its maximum: below float16's
    smallest subnormal (2**-24) when the largest element is stored near 1
    (`data_exponent=0`), so the small entries lose their history and their
    update grows; stored near 2**14 (the default), they keep it.
    """
    g = jnp.array([1.0, 2.0**-16, -(2.0**-16), 0.5])
    grads = {"w": jsa.as_scaled_array(g, dtype=jnp.float16)}
    params = {"w": jnp.ones(4)}
    ref = optax.adam(1e-3)
    ref_state = ref.init(params)
    for _ in range(5):
        ref_updates, ref_state = ref.update({"w": g}, ref_state, params)
    ref_u = np.asarray(ref_updates["w"], np.float64)
    results = {}
    for exponent in (None, 0):
        opt = jsa_optax.scale_optimizer(optax.adam(1e-3), data_exponent=exponent)
        update = jax.jit(opt.update)
        state = opt.init(params)
        for _ in range(5):
            updates, state = update(grads, state, params)
        results[exponent] = _represented(updates["w"])
    np.testing.assert_allclose(results[None], ref_u, rtol=1e-2)
    ratio = results[0][1:3] / ref_u[1:3]
    assert np.all(ratio > 2.0), ratio  # nu_hat ~ g**2 / 5 instead of g**2: update * sqrt(5)


def test_scalar_state_leaves_stay_plain():
    """Hyperparameters (scalar floats) keep their dtype and stay plain ArrayS."""
    params, _, _ = _problem()
    _, grads = _grads(params, 0)
    opt = jsa_optax.scale_optimizer(optax.inject_hyperparams(optax.adam)(learning_rate=1e-2))
    state = opt.init(params)
    lr = state.hyperparams["learning_rate"]
    assert not isinstance(lr, jsa.ScaledArray) and lr.dtype == jnp.float32
    step = jax.jit(jsa.autoscale(opt.update))
    _, new_state = step(grads, state, params)
    assert jax.tree_util.tree_structure(new_state) == jax.tree_util.tree_structure(state)
    new_lr = new_state.hyperparams["learning_rate"]
    assert not isinstance(new_lr, jsa.ScaledArray) and float(new_lr) == pytest.approx(1e-2)
    _assert_stored_scaled(new_state)


@pytest.mark.parametrize("state_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_other_state_dtypes(state_dtype):
    params, _, _ = _problem()
    plain_grads, grads = _grads(params, -6)
    opt = jsa_optax.scale_optimizer(optax.sgd(0.1, momentum=0.9), state_dtype=state_dtype)
    _, state = jax.jit(jsa.autoscale(opt.update))(grads, opt.init(params), params)
    _assert_stored_scaled(state, state_dtype)
    rtol = 2.0 ** -(jnp.finfo(state_dtype).nmant)
    _assert_tree_close(state[0].trace, plain_grads, rtol, "momentum trace")


def test_apply_updates():
    p = {
        "w": jsa.scaled_array(jnp.array([1.0, -2.0], jnp.float16), 4.0),
        "b": jnp.array([0.5], jnp.float16),
        "n": jnp.array([3], jnp.int32),
    }
    u = {"w": jsa.scaled_array(jnp.array([1.0, 1.0], jnp.float16), 1.0), "b": None, "n": None}
    new = jsa_optax.apply_updates(p, u)
    assert new["w"].dtype == jnp.float16
    np.testing.assert_array_equal(_represented(new["w"]), [5.0, -7.0])
    assert float(jnp.max(jnp.abs(new["w"].data))) < 2.0  # rescaled: largest data in [1, 2)
    assert new["b"].dtype == jnp.float16 and float(new["b"][0]) == 0.5
    assert int(new["n"][0]) == 3
    kept = jsa_optax.apply_updates(p, u, rescale=None)
    assert float(kept["w"].scale) == 4.0
    np.testing.assert_array_equal(_represented(kept["w"]), [5.0, -7.0])


def _adam_step(return_updates: bool, touch_updates: bool = False):
    """One jitted autoscaled `scale_optimizer(adam)` step from given gradients."""
    opt = jsa_optax.scale_optimizer(optax.adam(1e-2))

    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        if touch_updates:  # the same values, other tracers: the stored updates are added
            updates = jax.tree_util.tree_map(lambda u: u * 1.0, updates)
        new = jsa_optax.apply_updates(params, updates)
        return (new, state, updates) if return_updates else (new, state)

    return opt, step


@pytest.mark.slow
def test_apply_updates_adds_the_update_of_the_same_step_before_its_store():
    """Inside one autoscaled step, `apply_updates` adds `scale_optimizer`'s update as its
    float32 value: the new parameter is rounded once (within half a float16 ulp of float32
    on every entry), and the update's own store (a `rescale_factor` reduction) is left out
    of the program unless something else reads the updates. The new parameters' per-tensor
    factors are computed together (one `rescale_factors`), like, where they are stored, the
    updates'; the moments' come from their bounds."""
    params, _, _ = _problem()
    plain_grads, grads = _grads(params, -10)
    s_params = _scaled_params(params)
    p32 = jsa.asarray(s_params, jnp.float32)
    ref_updates, _ = optax.adam(1e-2).update(plain_grads, optax.adam(1e-2).init(p32), p32)
    expected = jax.tree_util.tree_map(lambda p, u: np.float64(p) + np.float64(u), p32, ref_updates)

    def errors_in_ulps(new_params):
        out = {}
        for name, new in new_params.items():
            ulp = np.float64(new.scale) * 2.0**-10  # data in [1, 2): float16 spacing 2^-10
            top = float(np.max(np.abs(np.asarray(new.data, np.float32))))
            assert 1.0 <= top < 2.0, name  # rescaled before the cast
            out[name] = np.max(np.abs(_represented(new) - expected[name])) / ulp
        return out

    opt, step = _adam_step(return_updates=False)
    state = opt.init(s_params)
    once = errors_in_ulps(jax.jit(jsa.autoscale(step))(s_params, state, grads)[0])
    assert all(e <= 0.5 + 1e-3 for e in once.values()), once
    # The updates read again (here: multiplied by 1): the stored updates are added (their
    # own rounding, far below the parameters' ulp here), and each update keeps its store.
    _, touched = _adam_step(return_updates=False, touch_updates=True)
    twice = errors_in_ulps(jax.jit(jsa.autoscale(touched))(s_params, state, grads)[0])
    assert all(e <= 0.5 + 0.05 for e in twice.values()), twice

    def stores(fun):
        # Per-tensor factors of single tensors, of several tensors measured at once (the n
        # new parameters, the n stored updates), and of several from their bounds (the n
        # first moments, the n second moments).
        counts = jsa.analysis.equation_counts(jsa.autoscale(fun), s_params, state, grads)
        return tuple(
            counts.get(name, 0)
            for name in ("rescale_factor", "rescale_factors", "factors_of_magnitudes")
        )

    assert len(params) > 1
    assert stores(step) == (0, 1, 2)  # the new parameters together; each moment's together
    assert stores(touched) == (0, 2, 2)  # the updates' own stores too, together
    _, returning = _adam_step(return_updates=True)
    assert stores(returning) == (0, 2, 2)
    new, _, updates = jax.jit(jsa.autoscale(returning))(s_params, state, grads)
    _assert_tree_close(updates, ref_updates, 2.0**-10, "returned updates")
    assert errors_in_ulps(new) == once


def test_state_nbytes_halves_for_adam():
    params, _, _ = _problem()
    f32 = jsa_optax.state_nbytes(optax.adam(1e-3).init(params))
    f16 = jsa_optax.state_nbytes(jsa_optax.scale_optimizer(optax.adam(1e-3)).init(params))
    n_arrays = 2 * len(params)
    assert f16 == (f32 - 4) // 2 + 4 + 4 * n_arrays  # half the data, + count, + one scale each


def test_l2_rescale_keeps_data_near_one():
    """With a rescale that does not bound the maximum, the data is not shifted up (no overflow)."""
    g = jnp.ones(1024).at[0].set(1000.0)  # max / rms ~ 32
    opt = jsa_optax.scaled_state(optax.sgd(0.1, momentum=0.9), rescale=jsa.ops.dynamic_rescale_l2)
    _, state = opt.update({"w": g}, opt.init({"w": jnp.zeros(1024)}))
    _assert_stored_scaled(state)
    np.testing.assert_array_equal(_represented(state[0].trace["w"]), np.asarray(g))


@pytest.mark.parametrize("layout", [(1, 16), (8, 1)], ids=["per channel", "per row"])
def test_scaled_state_moments_take_their_parameters_block_scales(layout):
    """A block-scaled parameter's Adam moments are stored with its block layout (`init`),
    which every update keeps; a per-tensor parameter's stay per tensor. Columns 2^24 apart
    in float16: each channel's update matches float32 Adam's."""
    rng = np.random.default_rng(0)
    magnitudes = np.exp2(np.linspace(-12, 12, 16))[None, :]
    w = jnp.asarray(rng.normal(size=(8, 16)) * magnitudes, jnp.float32)
    params = {
        "w": as_scaled_array_jit(w, scale_shape=layout, dtype=jnp.float16),
        "b": as_scaled_array_jit(jnp.ones(16), dtype=jnp.float16),
    }
    grads_value = {"w": w * 1e-3, "b": jnp.full(16, 0.5)}
    adam = optax.adam(1e-2)
    opt = jsa.optax.scale_optimizer(adam)
    state = opt.init(params)
    assert state[0].mu["w"].scale.shape == layout and state[0].nu["w"].scale.shape == layout
    assert state[0].mu["b"].scale.shape == ()

    @jax.jit
    @jsa.autoscale
    def update(grads, state, params):
        return opt.update(grads, state, params)

    grads = {
        "w": as_scaled_array_jit(grads_value["w"], scale_shape=layout, dtype=jnp.float16),
        "b": as_scaled_array_jit(grads_value["b"], dtype=jnp.float16),
    }
    updates, new_state = update(grads, state, params)
    assert new_state[0].nu["w"].scale.shape == layout
    assert new_state[0].mu["b"].scale.shape == ()
    values = jsa.asarray(grads, jnp.float32)
    expected, _ = adam.update(values, adam.init(values))
    got = np.asarray(updates["w"].to_array(jnp.float32))
    np.testing.assert_allclose(got, expected["w"], rtol=2e-3, atol=0)
    update(grads, new_state, params)
    assert update._cache_size() == 1


def _measured_adam():
    """`scale_optimizer(adam)` whose states take dynamic scales measured on each new tensor
    (a rescale that is not the library's: no bounds), shifted as the default is."""
    return jsa_optax.scale_optimizer(
        optax.adam(1e-3), rescale=lambda t: jsa.ops.dynamic_rescale_max(t), data_exponent=14
    )


@jax.jit  # one compile for the whole sequence
def _gradient_sequence(key):
    """60 steps of gradients of a (24, 8) and an (8,) tensor: each step's magnitude 2^k, k
    uniform in [-3, 3] and 2^8 times more at steps 20 and 40, a few rows only at each step
    (the largest elements move), signs random."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    exponents = jax.random.randint(k1, (60, 1, 1), -3, 4).astype(jnp.float32)
    exponents = exponents.at[jnp.array([20, 40])].add(8.0)
    rows = jax.random.bernoulli(k2, 0.3, (60, 24, 1))
    w = jax.random.normal(k3, (60, 24, 8)) * rows * 2.0**exponents
    b = jax.random.normal(k4, (60, 8)) * 2.0 ** exponents[:, 0]
    return {"w": w.astype(jnp.float16), "b": b.astype(jnp.float16)}


def test_moments_take_their_scales_from_bounds_over_many_steps():
    """Adam's moments stored with scales from bounds (`b1 max|m| + (1 - b1) max|g|`, from
    the stored state and the gradients): over 60 steps whose gradients jump by up to 2^14
    and move their largest elements, the stored data never reaches float16's last binade
    (below 2^15), the second moment stays within one binade of the measured top
    (`[2^13, 2^15)`: its terms are not negative, so its bound is at most twice it), and the
    moments are those of the measured scales (the same float32 values rounded to float16 at
    other exponents: equal but for the last float32 bit of the kernels that compute them
    fused with their stores)."""
    sequence = _gradient_sequence(jax.random.PRNGKey(3))
    params = _scaled_params({"w": jnp.full((24, 8), 0.5), "b": jnp.full((8,), -0.25)})
    opts = {"bounds": jsa_optax.scale_optimizer(optax.adam(1e-3)), "measured": _measured_adam()}
    steps = {}
    for name, opt in opts.items():

        def step(params, state, grads, opt=opt):
            updates, state = opt.update(grads, state, params)
            return jsa_optax.apply_updates(params, updates), state

        steps[name] = jax.jit(jsa.autoscale(step))
    states = {name: opt.init(params) for name, opt in opts.items()}
    params = dict.fromkeys(opts, params)
    lowest_nu = np.inf
    for i in range(60):
        grads = jsa.as_scaled_array({key: g[i] for key, g in sequence.items()})
        for name in opts:
            params[name], states[name] = steps[name](params[name], states[name], grads)
        bounded, measured = states["bounds"][0], states["measured"][0]
        for moment in ("mu", "nu"):
            for key in ("w", "b"):
                leaf = getattr(bounded, moment)[key]
                top = float(np.max(np.abs(np.asarray(leaf.data, np.float32))))
                assert np.isfinite(top) and top < 2.0**15, (i, moment, key, top)
                if moment == "nu":
                    lowest_nu = min(lowest_nu, top)
                reference = _represented(getattr(measured, moment)[key])
                # An ulp of the largest element: the two round the same float32 values but
                # for the last bit of a fused kernel, which a later cancellation keeps.
                atol = 2.0**-10 * float(np.max(np.abs(reference)))
                np.testing.assert_allclose(
                    _represented(leaf), reference, rtol=2.0**-9, atol=atol, err_msg=(i, moment)
                )
    assert lowest_nu >= 2.0**13, lowest_nu
    for key in ("w", "b"):
        np.testing.assert_allclose(
            _represented(params["bounds"][key]), _represented(params["measured"][key]), rtol=1e-3
        )


def test_moments_are_stored_without_a_reduction_over_them():
    """In the autoscaled step, the moments' scales come from their bounds (one reduction
    over the stored moments and the gradients for all of them, the factors of each
    moment's tensors from one vector of bounds); only the new parameters' scales are
    measured. Compiled for XLA:CPU, each moment is written by the kernel that computes it:
    the one float32 tensor of a parameter's shape written is its new value (measured
    before its store)."""
    params, _, _ = _problem()
    _, grads = _grads(params, -10)
    s_params = _scaled_params(params)
    opt, step = _adam_step(return_updates=False)
    state = opt.init(s_params)
    counts = jsa.analysis.equation_counts(jsa.autoscale(step), s_params, state, grads)
    assert counts["largest_finite_magnitudes"] == 1
    assert counts["factors_of_magnitudes"] == 2  # the first moments', the second moments'
    assert counts["rescale_factors"] == 1  # the new parameters' (measured)
    hlo = jax.jit(jsa.autoscale(step)).lower(s_params, state, grads).compile().as_text()
    entry = hlo[hlo.index("\nENTRY") :]
    written = [line for line in entry.splitlines() if " = f32[8,16]{" in line and "fusion(" in line]
    assert len(written) <= 1, written


def test_a_state_without_a_bound_keeps_its_measured_scale():
    """A state leaf whose equations have no bound (here divided by a tensor) is stored with
    the scale of its own largest magnitude, at the top of float16's range as before."""

    def init(params):
        return jax.tree_util.tree_map(jnp.ones_like, params)

    def update(updates, state, params=None):
        del params
        state = jax.tree_util.tree_map(lambda g, s: g / (jnp.abs(s) + 1.0), updates, state)
        return updates, state

    opt = jsa_optax.scale_optimizer(optax.GradientTransformation(init, update))
    params, _, _ = _problem()
    plain_grads, grads = _grads(params, 12)
    state = opt.init(params)
    counts = jsa.analysis.equation_counts(jsa.autoscale(opt.update), grads, state, params)
    assert "factors_of_magnitudes" not in counts  # the state and the update: measured
    assert "largest_finite_magnitudes" not in counts and counts["rescale_factors"] == 2
    _, new_state = jax.jit(jsa.autoscale(opt.update))(grads, state, params)
    for key, leaf in new_state.items():
        top = float(np.max(np.abs(np.asarray(leaf.data, np.float32))))
        assert 2.0**14 <= top < 2.0**15, key
        expected = np.asarray(plain_grads[key], np.float64) / 2.0
        np.testing.assert_allclose(_represented(leaf), expected, rtol=2.0**-10)
