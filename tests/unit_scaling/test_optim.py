"""`U.optim`: the u-muP learning-rate rules (each against its formula), independent weight
decay, equivalence with optax, Flax / Equinox parameter trees, scaled states, errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scaled_arithmetics as jsa
import jax_scaled_arithmetics.unit_scaling as U
from tests.helpers import eager_and_jit

ParamSpec = U.optim.ParamSpec
LR = 1e-2


def _maybe_jit(fn, jit):
    return jax.jit(fn) if jit else fn


def _updates(opt, params, grads_list, jit, apply=True):
    """The updates of `opt` for each gradient of `grads_list`, applied as it goes (or not:
    the same parameters at every step)."""
    update = _maybe_jit(opt.update, jit)
    state = opt.init(params)
    out = []
    for grads in grads_list:
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates) if apply else params
        out.append(updates)
    return out


def _normal(seed, shape):
    """A normal draw from numpy (a `jax.random` draw compiles once per shape)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _first_of_each_kind(cases):
    """A predicate for `eager_and_jit`: the eager variant of the first case of each kind
    stays in the default run (the eager update runs the jitted one's code, op by op: a
    compile per operation and shape)."""
    firsts = {}
    for case in cases:
        firsts.setdefault(case[0] if isinstance(case[0], str) else case[0].kind, case)
    return lambda *case: any(case == first for first in firsts.values())


def _adam_first_step(g, eps=1e-8):
    """Adam's first normalised step, by hand: m_hat = g, v_hat = g**2 (optax's float32 bias
    correction, 1 - b2 with b2 rounded to float32, makes it 1 - 6.4e-6 for |g| >> eps)."""
    return g / (jnp.abs(g) + eps)


def test_public_names():
    assert "optim" in U.__all__
    assert set(U.optim.__all__) == {
        "KINDS",
        "OPTIMIZERS",
        "ParamSpec",
        "adam",
        "adamw",
        "lr_scales",
        "scale_by_umup",
        "sgd",
    }
    assert U.optim.KINDS == ("weight", "embedding", "bias", "norm", "output")


# (spec, shape, multiplier written out from the rule).
ADAM_CASES = [
    ("weight", (64, 32), 64**-0.5),
    ("weight", (3, 3, 16, 32), (3 * 3 * 16) ** -0.5),  # HWIO convolution kernel
    (ParamSpec("weight", fan_in=256, depth=4), (64, 32), 256**-0.5 * 4**-0.5),
    (ParamSpec("weight", depth=9), (64, 32), 64**-0.5 / 3),
    ("embedding", (1000, 48), 48**-0.5),
    (ParamSpec("embedding", depth=3), (1000, 48), 48**-0.5 * 3**-0.5),
    ("bias", (32,), 1.0),
    (ParamSpec("bias", depth=4), (32,), 0.5),
    ("norm", (32,), 1.0),
    (ParamSpec("norm", 1, depth=2), (32,), 2**-0.5),
    ("output", (64, 10), 1.0),
    (ParamSpec("output", 64, depth=16), (64, 10), 0.25),
]


def _check_adam_rules(cases, jit):
    """One step: -lr * multiplier * Adam's normalised step; more steps: optax.adam's times
    the multiplier. Each case `(spec, shape, multiplier)` is a leaf of one parameter tree."""
    names = [f"p{i}" for i in range(len(cases))]
    specs = {n: spec for n, (spec, _, _) in zip(names, cases)}
    params = {n: _normal(0, shape) for n, (_, shape, _) in zip(names, cases)}
    grads = [{n: _normal(i + 1, shape) for n, (_, shape, _) in zip(names, cases)} for i in range(3)]
    scales = U.optim.lr_scales(specs, params)
    got = _updates(U.optim.adam(LR, specs), params, grads, jit)
    reference = _updates(optax.adam(LR), params, grads, jit)
    for n, (_, _, multiplier) in zip(names, cases):
        assert scales[n] == pytest.approx(multiplier, rel=1e-12), n
        want = -LR * multiplier * _adam_first_step(grads[0][n])
        np.testing.assert_allclose(got[0][n], want, rtol=1e-5, atol=1e-12, err_msg=n)
        for step, (u, r) in enumerate(zip(got[1:], reference[1:])):
            np.testing.assert_allclose(u[n], multiplier * r[n], rtol=2e-6, err_msg=f"{n} {step}")


# Jitted, case by case: a compile each, in the slow step; the default run jits the whole table
# in one update (test_adam_rules_in_one_jitted_update).
@pytest.mark.parametrize(
    "spec, shape, multiplier, jit",
    eager_and_jit(ADAM_CASES, _first_of_each_kind(ADAM_CASES), lambda *case: False),
)
def test_adam_rule(spec, shape, multiplier, jit):
    _check_adam_rules([(spec, shape, multiplier)], jit)


def test_adam_rules_in_one_jitted_update():
    """Every case of ADAM_CASES, each a leaf of one tree: one jitted update checks them all."""
    _check_adam_rules(ADAM_CASES, jit=True)


SGD_CASES = [  # readout_constraint="to_output_scale"
    ("weight", (64, 32), 64**0.5),
    (ParamSpec("weight", depth=4), (3, 3, 16, 32), 12.0 * 0.5),
    ("embedding", (1000, 49), 7.0),
    ("bias", (32,), 32.0),
    (ParamSpec("norm", depth=4), (32,), 16.0),
    ("output", (64, 10), 1.0),
    (ParamSpec("output", 64, depth=4), (64, 10), 0.5),
]


def _check_sgd_rules(cases, jit):
    """Each case `(spec, shape, multiplier)` a leaf of one parameter tree."""
    names = [f"p{i}" for i in range(len(cases))]
    specs = {n: spec for n, (spec, _, _) in zip(names, cases)}
    params = {n: _normal(0, shape) for n, (_, shape, _) in zip(names, cases)}
    grads = [{n: _normal(1, shape) for n, (_, shape, _) in zip(names, cases)}]
    opt = U.optim.sgd(LR, specs, readout_constraint="to_output_scale")
    (got,) = _updates(opt, params, grads, jit)
    for n, (_, _, multiplier) in zip(names, cases):
        np.testing.assert_allclose(got[n], -LR * multiplier * grads[0][n], rtol=1e-6, err_msg=n)


# As test_adam_rule: case by case jitted in the slow step, the whole table in one update here.
@pytest.mark.parametrize(
    "spec, shape, multiplier, jit",
    eager_and_jit(SGD_CASES, _first_of_each_kind(SGD_CASES), lambda *case: False),
)
def test_sgd_rule(spec, shape, multiplier, jit):
    _check_sgd_rules([(spec, shape, multiplier)], jit)


def test_sgd_rules_in_one_jitted_update():
    _check_sgd_rules(SGD_CASES, jit=True)


@pytest.mark.parametrize("spec, shape, multiplier", ADAM_CASES)
def test_sgd_with_unconstrained_readout_takes_adams_rules(spec, shape, multiplier):
    params = {"p": _normal(0, shape)}
    (got,) = _updates(U.optim.sgd(LR, {"p": spec}), params, [{"p": params["p"]}], False)
    np.testing.assert_allclose(got["p"], -LR * multiplier * params["p"], rtol=1e-6)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_is_optax_times_multiplier(nesterov):
    params = {"w": _normal(0, (16, 8)), "b": _normal(1, (8,))}
    grads = [jax.tree.map(lambda p, i=i: p * (i + 1.5), params) for i in range(3)]
    specs = {"w": "weight", "b": "bias"}
    kwargs = {"momentum": 0.9, "nesterov": nesterov}
    got = _updates(
        U.optim.sgd(LR, specs, readout_constraint="to_output_scale", **kwargs), params, grads, True
    )
    want = _updates(optax.sgd(LR, **kwargs), params, grads, True)
    for u, r in zip(got, want):
        np.testing.assert_allclose(u["w"], 4.0 * r["w"], rtol=1e-6)
        np.testing.assert_allclose(u["b"], 8.0 * r["b"], rtol=1e-6)


# Eager: U.optim.adam runs eagerly in test_adam_rule's default cases.
@pytest.mark.parametrize("jit", [pytest.param(False, marks=pytest.mark.slow), True])
def test_unit_multipliers_give_optax_adam(jit):
    """With every multiplier 1 (biases, gains, the readout), `U.optim.adam` is optax.adam,
    bit for bit, with a schedule too."""
    params = {"b": _normal(0, (8,)), "g": _normal(1, (8,)), "out": _normal(2, (8, 4))}
    specs = {"b": "bias", "g": ParamSpec("norm"), "out": "output"}
    grads = [jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1)), params) for i in range(4)]
    schedule = optax.linear_schedule(1e-3, 1e-2, 3)
    for lr in (LR, schedule):
        got = _updates(U.optim.adam(lr, specs, b1=0.8, eps=1e-6), params, grads, jit)
        want = _updates(optax.adam(lr, b1=0.8, eps=1e-6), params, grads, jit)
        for u, r in zip(got, want):
            jax.tree.map(np.testing.assert_array_equal, u, r)


# Eager: independent weight decay runs eagerly in test_weight_decay_mask.
@pytest.mark.parametrize("jit", [pytest.param(False, marks=pytest.mark.slow), True])
@pytest.mark.one_case
def test_independent_weight_decay_constant_lr(jit):
    """Each step decays p by weight_decay * p, whatever the learning rate and multiplier."""
    wd = 0.1
    params = {"w": _normal(0, (64, 16)), "e": _normal(1, (100, 16))}
    specs = {"w": ParamSpec("weight", depth=4), "e": "embedding"}
    multipliers = {"w": 64**-0.5 * 0.5, "e": 16**-0.5}
    grads = [jax.tree.map(lambda p, i=i: jnp.cos(p * (i + 1)), params) for i in range(3)]
    opt = U.optim.adamw(LR, specs, weight_decay=wd)
    update = _maybe_jit(opt.update, jit)
    adam = optax.adam(LR)
    adam_update = jax.jit(adam.update)  # the reference: one compile (eager, one per operation)
    state, adam_state, p = opt.init(params), adam.init(params), params
    for g in grads:
        updates, state = update(g, state, p)
        adam_updates, adam_state = adam_update(g, adam_state, p)
        for name in params:
            want = multipliers[name] * adam_updates[name] - wd * p[name]
            np.testing.assert_allclose(updates[name], want, rtol=1e-5, atol=1e-9)
        p = optax.apply_updates(p, updates)


def test_independent_weight_decay_follows_the_schedule():
    """With a schedule: the decay is weight_decay * p * lr(t) / peak_learning_rate."""
    wd, peak = 0.05, 1e-2
    schedule = optax.linear_schedule(0.0, peak, 4)  # 0, peak/4, peak/2, ...
    params = {"w": _normal(0, (32, 8))}
    grads = [{"w": _normal(i + 1, (32, 8))} for i in range(4)]
    for name, opt in (
        (
            "adamw",
            U.optim.adamw(schedule, {"w": "weight"}, weight_decay=wd, peak_learning_rate=peak),
        ),
        ("sgd", U.optim.sgd(schedule, {"w": "weight"}, weight_decay=wd, peak_learning_rate=peak)),
    ):
        direction = optax.adam(schedule) if name == "adamw" else optax.sgd(schedule)
        update, d_update = jax.jit(opt.update), jax.jit(direction.update)
        state, d_state, p = opt.init(params), direction.init(params), params
        for step, g in enumerate(grads):
            updates, state = update(g, state, p)
            d_updates, d_state = d_update(g, d_state, p)
            decay = wd * p["w"] * float(schedule(step)) / peak
            want = 32**-0.5 * d_updates["w"] - decay
            np.testing.assert_allclose(
                updates["w"], want, rtol=1e-5, atol=1e-9, err_msg=f"{name} {step}"
            )
            p = optax.apply_updates(p, updates)
    with pytest.raises(ValueError, match="peak_learning_rate"):
        U.optim.adamw(schedule, {"w": "weight"}, weight_decay=wd)
    # No decay, no peak needed.
    U.optim.adamw(schedule, {"w": "weight"})


def test_dependent_weight_decay_is_optax_adamw_times_multiplier():
    params = {"w": _normal(0, (16, 8))}
    grads = [{"w": _normal(i + 1, (16, 8))} for i in range(3)]
    opt = U.optim.adamw(LR, {"w": "weight"}, weight_decay=0.1, independent_weight_decay=False)
    got = _updates(opt, params, grads, True, apply=False)
    want = _updates(optax.adamw(LR, weight_decay=0.1), params, grads, True, apply=False)
    for u, r in zip(got, want):
        np.testing.assert_allclose(u["w"], 0.25 * r["w"], rtol=1e-5)


def test_weight_decay_mask():
    params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
    opt = U.optim.adamw(
        LR, {"w": "weight", "b": "bias"}, weight_decay=0.1, mask={"w": True, "b": False}
    )
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zeros, opt.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1, rtol=1e-6)
    np.testing.assert_array_equal(updates["b"], 0.0)


@functools.cache  # one model for the tests (and its init's compiles once)
def _flax_mlp():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(32)(x))
            x = nn.relu(nn.Dense(32)(x))
            return nn.Dense(10)(x)

    x = _normal(0, (16, 48))
    model = MLP()
    # The initialisation under one `jax.jit` (eagerly, each of its operations is a compile).
    return model, U.unit_init(jax.jit(model.init)(jax.random.key(1), x)), x


FLAX_SPECS = {
    "params": {
        "Dense_0": {"kernel": "weight", "bias": "bias"},
        "Dense_1": {"kernel": ParamSpec("weight", 32), "bias": "bias"},
        "Dense_2": {"kernel": "output", "bias": "bias"},
    }
}
FLAX_MULTIPLIERS = {"Dense_0": 48**-0.5, "Dense_1": 32**-0.5, "Dense_2": 1.0}


def _flax_specs_from_paths(params):
    """A callable spec: the last Dense is the readout."""

    def spec(path, leaf):
        layer, name = path[-2].key, path[-1].key
        if name == "bias":
            return "bias"
        return "output" if layer == "Dense_2" else "weight"

    return jax.tree_util.tree_map_with_path(spec, params)


@pytest.mark.parametrize(
    "specs, jit",
    [
        # Eager, the Flax model's every operation is a compile of its own (~100): the same
        # updates as jitted, in the slow step; eager U.optim updates run by default in
        # test_adam_rule, test_sgd_rule and test_sgd_momentum_is_optax_times_multiplier.
        pytest.param(FLAX_SPECS, False, marks=pytest.mark.slow),
        (FLAX_SPECS, True),
        pytest.param(_flax_specs_from_paths, False, marks=pytest.mark.slow),
        # Callable specs jitted: the same programs as the tree's (jitted above).
        (_flax_specs_from_paths, True),
    ],
    ids=["tree-False", "tree-True", "callable-False", "callable-True"],
)
@pytest.mark.slow
def test_flax_dense_model(specs, jit):
    model, params, x = _flax_mlp()
    multipliers = U.optim.lr_scales(specs, params)
    for layer, m in FLAX_MULTIPLIERS.items():
        assert multipliers["params"][layer] == {"kernel": pytest.approx(m), "bias": 1.0}

    def loss(p):
        return jnp.mean(model.apply(p, x) ** 2)

    opt, reference = U.optim.adam(LR, specs), optax.adam(LR)
    grad = _maybe_jit(jax.grad(loss), jit)
    update, ref_update = _maybe_jit(opt.update, jit), _maybe_jit(reference.update, jit)
    p, state, r_state = params, opt.init(params), reference.init(params)
    for _ in range(3):  # the same gradients into both: the updates differ by the multipliers
        g = grad(p)
        updates, state = update(g, state, p)
        r_updates, r_state = ref_update(g, r_state, p)
        jax.tree.map(
            lambda u, r, m: np.testing.assert_allclose(u, m * r, rtol=1e-6),
            updates,
            r_updates,
            multipliers,
        )
        p = optax.apply_updates(p, updates)


def test_none_leaves_pass_through():
    """None parameters (a Flax/Equinox layer without bias) pass, whether their spec is None
    or a kind."""
    params = {"w": _normal(0, (16, 4)), "b": None, "layers": [None, {"w": _normal(1, (4, 4))}]}
    grads = jax.tree.map(jnp.ones_like, params)
    for specs in (
        {"w": "weight", "b": None, "layers": [None, {"w": "weight"}]},
        {"w": "weight", "b": "bias", "layers": "weight"},  # a prefix
        lambda tree: jax.tree.map(lambda _: "weight", tree),
    ):
        for opt in (
            U.optim.adamw(LR, specs, weight_decay=0.1),
            U.optim.sgd(LR, specs, momentum=0.9),
        ):
            updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)
            assert updates["b"] is None and updates["layers"][0] is None
            assert updates["w"].shape == (16, 4)
    assert U.optim.lr_scales({"w": "weight", "b": None, "layers": "weight"}, params) == {
        "w": 0.25,
        "b": None,
        "layers": [None, {"w": 0.5}],
    }


def test_equinox_module():
    """Equinox's Linear stores (out, in): its specs give the fan-in explicitly."""
    import equinox as eqx

    def build():
        return eqx.nn.Sequential(
            [
                eqx.nn.Linear(12, 8, use_bias=False, key=jax.random.key(0)),
                eqx.nn.Linear(8, 3, key=jax.random.key(1)),
            ]
        )

    # The module's structure traced, its arrays numpy draws (its init's random draws each
    # compile; the test needs the shapes).
    model = jax.tree.map(
        lambda a: _normal(0, a.shape) if isinstance(a, jax.ShapeDtypeStruct) else a,
        eqx.filter_eval_shape(build),
    )
    params = eqx.filter(model, eqx.is_array)
    specs = jax.tree.map(
        lambda a: ParamSpec("weight", fan_in=a.shape[-1]) if a.ndim == 2 else "bias", params
    )
    assert params.layers[0].bias is None
    multipliers = U.optim.lr_scales(specs, params)
    assert multipliers.layers[0].weight == pytest.approx(12**-0.5)
    assert multipliers.layers[1].weight == pytest.approx(8**-0.5)
    grads = jax.tree.map(jnp.ones_like, params)
    opt = U.optim.adam(LR, specs)
    updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)
    np.testing.assert_allclose(updates.layers[0].weight, -LR * 12**-0.5, rtol=1e-5)
    np.testing.assert_allclose(updates.layers[1].bias, -LR, rtol=1e-5)


def test_scalar_and_integer_leaves():
    params = {"w": jnp.ones((4, 4)), "step": jnp.array(3), "t": jnp.array(2.0)}
    specs = {"w": "weight", "step": None, "t": "norm"}
    assert U.optim.lr_scales(specs, params) == {"w": 0.5, "step": None, "t": 1.0}
    assert (
        U.optim.lr_scales(specs, params, optimizer="sgd", readout_constraint="to_output_scale")["t"]
        == 1.0
    )


def test_errors():
    params = {"w": jnp.ones((8, 4)), "b": jnp.ones(4)}
    good = {"w": "weight", "b": "bias"}
    with pytest.raises(
        ValueError, match=r"unknown parameter kind 'wieght': expected one of \('weight'"
    ):
        U.optim.scale_by_umup({"w": "wieght", "b": "bias"}).init(params)
    with pytest.raises(ValueError, match="unknown parameter kind 'hidden'"):
        ParamSpec("hidden", 8)
    with pytest.raises(TypeError, match="a parameter kind must be a string"):
        ParamSpec(3, 8)
    with pytest.raises(TypeError, match="a spec is a ParamSpec, a kind .* or None, got int"):
        U.optim.adam(LR, {"w": 3, "b": "bias"}).init(params)
    with pytest.raises(
        ValueError, match=r"specs do not match the parameters' structure .*Dict key mismatch"
    ):
        U.optim.adam(LR, {"w": "weight", "c": "bias"}).init(params)
    with pytest.raises(
        ValueError, match=r"specs do not match .*Expected list, got \{'b': 0, 'w': 0\}"
    ):
        U.optim.lr_scales(["weight", "bias"], params)
    with pytest.raises(ValueError, match=r"fan_in must be positive, got 0"):
        ParamSpec("weight", 0)
    with pytest.raises(ValueError, match=r"fan_in must be positive, got -3"):
        ParamSpec("embedding", fan_in=-3)
    with pytest.raises(ValueError, match=r"depth must be positive, got 0"):
        ParamSpec("bias", depth=0)
    with pytest.raises(TypeError, match=r"fan_in must be an int or None, got 2.5"):
        ParamSpec("weight", 2.5)
    with pytest.raises(ValueError, match=r"shape \(0, 4\) has fan_in 0"):
        U.optim.lr_scales("weight", {"w": jnp.ones((0, 4))})
    with pytest.raises(
        ValueError, match=r"'weight' parameter of shape \(4,\).*ParamSpec\('weight', fan_in\)"
    ):
        U.optim.lr_scales("weight", params)
    with pytest.raises(ValueError, match=r"floating parameter of shape \(4,\) has no spec"):
        U.optim.sgd(LR, {"w": "weight", "b": None}).init(params)
    assert (
        U.optim.lr_scales({"w": "weight", "b": None}, params, allow_non_unit_scaling_params=True)[
            "b"
        ]
        == 1.0
    )
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        U.optim.scale_by_umup(good, optimizer="lion")
    with pytest.raises(ValueError, match="readout_constraint must be one of"):
        U.optim.sgd(LR, good, readout_constraint="gmean")
    with pytest.raises(ValueError, match="Adam's do not depend on it"):
        U.optim.scale_by_umup(good, readout_constraint="to_output_scale")
    with pytest.raises(ValueError, match="weight_decay must be non-negative"):
        U.optim.adamw(LR, good, weight_decay=-0.1)
    with pytest.raises(ValueError, match="peak learning rate, which must be positive"):
        U.optim.sgd(0.0, good, weight_decay=0.1)
    with pytest.raises(ValueError, match="without fan_in reads it from the parameter's shape"):
        ParamSpec("weight").lr_scale()
    with pytest.raises(ValueError, match="SGD's rule for a 'norm' needs its shape"):
        ParamSpec("norm").lr_scale("sgd", readout_constraint="to_output_scale")
    # Numpy integers are accepted (and stored as int).
    assert ParamSpec("weight", np.int64(16)).fan_in == 16


def test_parameter_specs_are_leaves():
    specs = {"w": ParamSpec("weight", 64, depth=2), "b": ParamSpec("bias")}
    assert jax.tree.leaves(specs) == [specs["b"], specs["w"]]
    assert jax.tree.map(lambda s: s.kind, specs) == {"w": "weight", "b": "bias"}


def _scaled_problem():
    params = {"w": 0.3 * _normal(0, (32, 16)), "e": _normal(1, (50, 32)), "b": jnp.zeros(16)}
    specs = {"w": ParamSpec("weight", depth=4), "e": "embedding", "b": "bias"}
    ids = jnp.arange(8) % 50

    def loss(p):
        return jnp.mean(jnp.tanh(p["e"][ids] @ p["w"] + p["b"][None, :]) ** 2)

    return params, specs, loss


@pytest.mark.parametrize(
    "wrapped",
    # scale_optimizer around U.optim under autoscale: test_float16_scaled_state in the
    # default run (float16 state data), the float32 state here in the slow step.
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["autoscale", "scale_optimizer"],
)
@pytest.mark.slow
def test_scaled_arrays_under_autoscale(wrapped):
    """ScaledArray parameters in `jsa.autoscale` (the optimizer plain, or its state scaled by
    `jsa.optax.scale_optimizer` in float32): the values of plain float32 parameters."""
    params, specs, loss = _scaled_problem()
    opt = U.optim.adamw(LR, specs, weight_decay=0.1)

    @jax.jit
    def ref_step(p, state):
        updates, state = opt.update(jax.grad(loss)(p), state, p)
        return optax.apply_updates(p, updates), state

    scaled_opt = jsa.optax.scale_optimizer(opt, state_dtype=jnp.float32) if wrapped else opt
    apply = jsa.optax.apply_updates if wrapped else optax.apply_updates

    @jax.jit
    @jsa.autoscale
    def step(p, state):
        updates, state = scaled_opt.update(jax.grad(loss)(p), state, p)
        return apply(p, updates), state

    r, r_state = params, opt.init(params)
    s = jsa.as_scaled_array(params)
    s_state = scaled_opt.init(s if wrapped else params)
    for _ in range(3):
        r, r_state = ref_step(r, r_state)
        s, s_state = step(s, s_state)
    assert all(
        isinstance(leaf, jsa.ScaledArray) for leaf in jax.tree.leaves(s, is_leaf=jsa.is_scaled_leaf)
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a.to_array(), b, rtol=1e-5, atol=1e-7),
        s,
        r,
        is_leaf=jsa.is_scaled_leaf,
    )


@pytest.mark.slow
def test_float16_scaled_state():
    """The default `scale_optimizer` (float16 state data): close to float32 optax."""
    params, specs, loss = _scaled_problem()
    opt = U.optim.adam(LR, specs)
    scaled_opt = jsa.optax.scale_optimizer(U.optim.adam(LR, specs))

    @jax.jit
    @jsa.autoscale
    def step(p, state):
        updates, state = scaled_opt.update(jax.grad(loss)(p), state, p)
        return updates, state

    s = jsa.as_scaled_array(params)
    updates, state = step(s, scaled_opt.init(s))
    assert state[0].mu["w"].dtype == jnp.float16
    # The float32 reference in one compile (op by op, a compile per operation).
    want, _ = jax.jit(lambda p: opt.update(jax.grad(loss)(p), opt.init(p), p))(params)
    for name in params:
        np.testing.assert_allclose(updates[name].to_array(), want[name], rtol=2e-3, atol=1e-8)
