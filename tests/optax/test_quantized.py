"""`jsa.optax.quantized`: `quantize` (gradients, state, updates) and `apply_updates` (weights)."""

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

q = jsa.quantization


def _normal(seed, shape, scale=1.0):
    """A float32 normal draw from numpy (a `jax.random` draw compiles once per shape)."""
    data = scale * np.random.default_rng(seed).standard_normal(shape)
    return jnp.asarray(data.astype(np.float32))


def _params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w": jax.random.normal(k1, (8, 16)) / 4, "b": 0.1 * jax.random.normal(k2, (16,))}


def _grads(seed=1):
    # jax.random draws: test_grad_and_update_specs's bound (a stochastic float8_e4m3fn
    # rounding within 1/8 of the value) holds for these, not for values below e4m3's
    # normal range, which another draw can give.
    keys = jax.random.split(jax.random.PRNGKey(seed), 2)
    return {"w": jax.random.normal(keys[0], (8, 16)), "b": jax.random.normal(keys[1], (16,))}


def _float_leaves(tree):
    return [
        x
        for x in jax.tree_util.tree_leaves(tree, is_leaf=jsa.is_scaled_leaf)
        if jnp.issubdtype(x.dtype, jnp.floating)
    ]


def _mx(x, key):
    del key
    return q.block_dequantize(q.block_quantize(x, "float8_e4m3fn", block_size=8))


GRID_SPECS = {
    # spec, and the nearest quantiser whose fixed points the stored values must be
    "float": ("bfloat16", lambda x: q.float_quantize(x, "bfloat16")),
    "float-stochastic": (
        ("float8_e4m3fn", "stochastic"),
        lambda x: q.float_quantize(x, "float8_e4m3fn"),
    ),
    "custom-float": ((q.FloatFormat.custom(6, 9), "stochastic"), None),
    "fixed-point": (
        lambda x, key: q.fixed_point_quantize(x, 16, 12, "stochastic", key=key),
        lambda x: q.fixed_point_quantize(x, 16, 12),
    ),
    "mx": (_mx, lambda x: _mx(x, None)),
    "posit": (("posit16_es1", "stochastic"), lambda x: q.float_quantize(x, "posit16_es1")),
}


# --- quantize: state, gradients, updates -----------------------------------------------


@pytest.mark.parametrize(
    "name",
    # A format name and a (format, "stochastic") pair for the state are in the default run
    # in test_state_dict_picks_fields (and bfloat16 against float32 Adam in
    # test_chained_with_clip_and_adam); here the slow step runs them.
    [
        pytest.param(n, marks=pytest.mark.slow) if n in ("float", "float-stochastic") else n
        for n in sorted(GRID_SPECS)
    ],
)
@pytest.mark.slow
def test_state_leaves_stay_on_the_grid(name):
    """One parameter leaf (half the program of two; the per-leaf keys are
    test_same_seed_same_run_and_steps_draw_new_keys's)."""
    spec, grid = GRID_SPECS[name]
    if grid is None:
        grid = lambda x: q.float_quantize(x, spec[0])  # noqa: E731
    params = {"w": _params()["w"]}
    opt = jsa.optax.quantize(optax.adam(1e-2), state=spec, key=3)
    ref = optax.adam(1e-2)
    state, ref_state = opt.init(params), ref.init(params)
    step = jax.jit(opt.update)
    for i in range(3):
        grads = {"w": _grads(i)["w"]}
        updates, state = step(grads, state, params)
        ref_updates, ref_state = ref.update(grads, ref_state, params)
        for leaf in _float_leaves(state.inner_state):
            np.testing.assert_array_equal(grid(leaf), leaf)
        assert state.inner_state[0].count.dtype == jnp.int32  # never quantized
        assert int(state.inner_state[0].count) == i + 1
    # Still Adam: with a 16-bit float state, the updates follow float32 Adam's closely.
    for a, b in zip(jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(ref_updates)):
        assert np.all(np.isfinite(a))
        if name in ("float", "custom-float"):
            np.testing.assert_allclose(a, b, rtol=0.05, atol=1e-4)


@pytest.mark.slow
def test_state_dict_picks_fields():
    params = _params()
    opt = jsa.optax.quantize(
        optax.adam(1e-2), state={"mu": "float8_e4m3fn", "nu": ("bfloat16", "stochastic")}
    )
    _, state = opt.update(_grads(), opt.init(params), params)
    _, ref_state = optax.adam(1e-2).update(_grads(), optax.adam(1e-2).init(params), params)
    mu, nu = state.inner_state[0].mu, state.inner_state[0].nu
    for leaf, ref in zip(jax.tree_util.tree_leaves(mu), jax.tree_util.tree_leaves(ref_state[0].mu)):
        np.testing.assert_array_equal(leaf, q.float_quantize(ref, "float8_e4m3fn"))
    for leaf in jax.tree_util.tree_leaves(nu):
        np.testing.assert_array_equal(q.float_quantize(leaf, "bfloat16"), leaf)
        assert not np.array_equal(q.float_quantize(leaf, "float8_e4m3fn"), leaf)


def test_sgd_momentum_trace_and_hyperparameters():
    """`trace` names SGD's momentum; other fields, hyperparameters included, are left alone."""
    params = _params()
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    opt = jsa.optax.quantize(inner, state={"trace": "float8_e5m2"})
    _, state = opt.update(_grads(), opt.init(params), params)
    for leaf in jax.tree_util.tree_leaves(state.inner_state.inner_state[0].trace):
        np.testing.assert_array_equal(q.float_quantize(leaf, "float8_e5m2"), leaf)
    assert float(state.inner_state.hyperparams["learning_rate"]) == pytest.approx(0.1, rel=1e-7)
    # One spec for the whole state rounds the floating hyperparameters too (0.1 in e5m2).
    opt = jsa.optax.quantize(inner, state="float8_e5m2")
    _, state = opt.update(_grads(), opt.init(params), params)
    assert float(state.inner_state.hyperparams["learning_rate"]) == 0.09375


def test_grad_and_update_specs():
    params = _params()
    opt = jsa.optax.quantize(record(), grad="float8_e5m2", update=("float8_e4m3fn", "stochastic"))
    updates, state = opt.update(_grads(), opt.init(params), params)
    for seen, g in zip(
        jax.tree_util.tree_leaves(state.inner_state), jax.tree_util.tree_leaves(_grads())
    ):
        np.testing.assert_array_equal(seen, q.float_quantize(g, "float8_e5m2"))
    for u, seen in zip(
        jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(state.inner_state)
    ):
        np.testing.assert_array_equal(q.float_quantize(u, "float8_e4m3fn"), u)
        assert np.all(np.abs(np.asarray(u) - np.asarray(seen)) <= np.abs(np.asarray(seen)) / 8)


def test_dtypes_kept_and_none_updates():
    params = {"w": jnp.ones(4, jnp.bfloat16), "n": jnp.arange(3), "skip": jnp.ones(2)}
    opt = jsa.optax.quantize(optax.sgd(0.1), grad="float8_e5m2", update="float8_e5m2")
    grads = {"w": jnp.full(4, 0.3, jnp.bfloat16), "n": None, "skip": None}
    updates, _ = opt.update(grads, opt.init(params), params)
    assert updates["w"].dtype == jnp.bfloat16 and updates["n"] is None and updates["skip"] is None
    np.testing.assert_array_equal(updates["w"].astype(jnp.float32), -0.03125)  # 0.1 * 0.3125


# --- keys ------------------------------------------------------------------------------


def _stochastic_opt(seed):
    return jsa.optax.quantize(record(), state=("bfloat16", "stochastic"), key=seed)


def test_same_seed_same_run_and_steps_draw_new_keys():
    params = {"a": jnp.zeros(4096), "b": jnp.zeros(4096)}
    grads = {"a": jnp.full(4096, 1.0 + 2.0**-10), "b": jnp.full(4096, 1.0 + 2.0**-10)}

    def run(seed, steps=2):
        opt = _stochastic_opt(seed)
        state, traces = opt.init(params), []
        for _ in range(steps):
            _, state = opt.update(grads, state, params)
            traces.append(state.inner_state.trace)
        return state, traces

    state, traces = run(7)
    again, traces_again = run(7)
    assert np.array_equal(state.key, again.key)
    for x, y in zip(jax.tree_util.tree_leaves(traces), jax.tree_util.tree_leaves(traces_again)):
        np.testing.assert_array_equal(x, y)
    first, second = traces
    assert not np.array_equal(first["a"], second["a"])  # consecutive steps: new keys
    assert not np.array_equal(first["a"], first["b"])  # two leaves: two keys
    assert not np.array_equal(run(8)[1][0]["a"], first["a"])  # another seed
    # Unbiased: 1 + 2**-10 rounds up to 1 + 2**-7 one time in eight.
    assert abs(float(jnp.mean(first["a"])) - (1.0 + 2.0**-10)) < 4e-4
    assert state.key.dtype == jnp.uint32


def test_key_arguments():
    params = {"a": jnp.zeros(64)}
    grads = {"a": jnp.full(64, 1.0 + 2.0**-10)}
    for key in (5, np.int64(5), jax.random.key(5), jax.random.PRNGKey(5)):
        _, state = _stochastic_opt(key).update(grads, _stochastic_opt(key).init(params))
        _, ref = _stochastic_opt(5).update(grads, _stochastic_opt(5).init(params))
        np.testing.assert_array_equal(state.inner_state.trace["a"], ref.inner_state.trace["a"])
    with pytest.raises(TypeError, match="key must be an integer seed or a PRNG key, got 1.5"):
        _stochastic_opt(1.5)
    with pytest.raises(TypeError, match="key must be an integer seed or a PRNG key, got True"):
        _stochastic_opt(True).init(params)


@pytest.mark.slow
def test_jit_does_not_recompile_and_vmap_over_seeds():
    """One parameter leaf (two compile twice the program; test_same_seed_... has two)."""
    params, grads = {"w": _params()["w"]}, {"w": _grads()["w"]}

    def spec_opt(seed):
        stochastic = ("bfloat16", "stochastic")
        return jsa.optax.quantize(optax.adam(1e-2), state=stochastic, update=stochastic, key=seed)

    traces = []
    opt = spec_opt(0)  # `update` reads the key from the state: it serves every seed's state

    def update(grads, state, params):
        traces.append(None)
        return opt.update(grads, state, params)

    step = jax.jit(update)
    state = opt.init(params)
    for _ in range(3):
        updates, state = step(grads, state, params)
    assert len(traces) == 1

    # Two steps over three seeds under `jax.vmap` (init and update each vmapped: one compile
    # of one step, where a vmapped two-step run compiled both steps) against each seed's
    # run through `step`.
    init = jax.jit(jax.vmap(lambda seed: spec_opt(seed).init(params)))
    batched_step = jax.jit(jax.vmap(update, in_axes=(None, 0, None)))
    batched_state = init(jnp.arange(3))
    for _ in range(2):
        batched_updates, batched_state = batched_step(grads, batched_state, params)
    batched = (batched_updates, batched_state)
    for i in range(3):
        state = spec_opt(i).init(params)
        for _ in range(2):
            updates, state = step(grads, state, params)
        single = (updates, state)
        for x, y in zip(jax.tree_util.tree_leaves(single), jax.tree_util.tree_leaves(batched)):
            np.testing.assert_array_equal(x, y[i])
    assert step._cache_size() == 1
    nu = batched[1].inner_state[0].nu["w"]
    assert not np.array_equal(nu[0], nu[1])


# --- ScaledArrays ----------------------------------------------------------------------


def test_scaled_leaves_quantize_their_data():
    """The format applies to the data, the scale is kept: tiny values survive float8."""
    data = jnp.array([1.1, -3.3, 0.3, 100.0])
    grads = {"w": jsa.scaled_array(data, 2.0**-40)}
    params = {"w": jnp.zeros(4)}
    opt = jsa.optax.quantize(record(), grad="float8_e4m3fn")
    expected = q.float_quantize(data, "float8_e4m3fn")

    _, outside = opt.update(grads, opt.init(params))  # ScaledArray objects
    inside = jax.jit(jsa.autoscale(opt.update))(grads, opt.init(params))[1]  # traced values
    for state in (outside, inside):
        seen = state.inner_state.trace["w"]
        assert isinstance(seen, jsa.ScaledArray) and float(seen.scale) == 2.0**-40
        np.testing.assert_array_equal(seen.data, expected)
    # The same values as plain float32 arrays: below float8's range, flushed to zero.
    plain = opt.update({"w": data * 2.0**-40}, opt.init(params))[1].inner_state.trace["w"]
    np.testing.assert_array_equal(plain, 0.0)


@pytest.mark.slow
def test_scaled_parameters_and_state():
    """`quantize` around `scale_optimizer`, all in one autoscaled step, with stochastic weights."""
    # The inputs built under one `jax.jit` (eagerly, each operation is a compile).
    params = jax.jit(
        lambda p: jsa.ops.dynamic_rescale_max(jsa.tree.astype(jsa.as_scaled_array(p), jnp.float16))
    )(_params())
    # Gradients ~2**-20: their squares (Adam's second moment) are zero in plain float16.
    tiny = jax.tree_util.tree_map(lambda g: g * 2.0**-20, _grads())
    grads = jax.jit(lambda g: jsa.as_scaled_array(g, scale=2.0**-20, dtype=jnp.float16))(tiny)
    inner = jsa.optax.scale_optimizer(optax.adam(1e-2))
    opt = jsa.optax.quantize(inner, grad="float8_e4m3fn", state="bfloat16", key=1)

    @jax.jit
    @jsa.autoscale
    def step(params, state, grads, key):
        updates, state = opt.update(grads, state, params)
        return jsa.optax.apply_updates(params, updates, rounding="stochastic", key=key), state

    @jax.jit
    @jsa.autoscale
    def ref_step(params, state, grads):
        updates, state = inner.update(grads, state, params)
        return jsa.optax.apply_updates(params, updates), state

    state, ref_state = opt.init(params), inner.init(params)
    structure = jax.tree_util.tree_structure(state)
    new, ref = params, params
    for i in range(3):
        new, state = step(new, state, grads, jax.random.key(i))
        ref, ref_state = ref_step(ref, ref_state, grads)
        assert jax.tree_util.tree_structure(state) == structure
    for leaf in _float_leaves(state.inner_state):
        assert isinstance(leaf, jsa.ScaledArray) and leaf.dtype == jnp.float16
        np.testing.assert_array_equal(q.float_quantize(leaf.data, "bfloat16"), leaf.data)
    leaves = [jax.tree_util.tree_leaves(t, is_leaf=jsa.is_scaled_leaf) for t in (new, ref, params)]
    for p, r, p0 in zip(*leaves):
        assert isinstance(p, jsa.ScaledArray) and p.dtype == jnp.float16
        # Adam moves each parameter by about the learning rate per step, despite the tiny
        # gradients; float8 gradients and a bfloat16 state change that by a fraction.
        moved, ref_moved = represented(p) - represented(p0), represented(r) - represented(p0)
        assert np.median(np.abs(ref_moved)) > 0.02
        np.testing.assert_allclose(moved, ref_moved, atol=0.01)


# --- chained with clipping ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("order", ["quantize(chain)", "chain(clip, quantize)"])
def test_chained_with_clip_and_adam(order):
    params = _params()
    spec = {"mu": "bfloat16", "nu": ("bfloat16", "stochastic")}
    clip = optax.clip_by_global_norm(1.0)
    if order == "quantize(chain)":
        opt = jsa.optax.quantize(optax.chain(clip, optax.adam(1e-2)), state=spec)
    else:
        opt = optax.chain(clip, jsa.optax.quantize(optax.adam(1e-2), state=spec))
    ref = optax.chain(clip, optax.adam(1e-2))
    step, ref_step = jax.jit(opt.update), jax.jit(ref.update)
    state, ref_state = opt.init(params), ref.init(params)
    p, ref_p = params, params
    for i in range(5):
        updates, state = step(_grads(i), state, p)
        ref_updates, ref_state = ref_step(_grads(i), ref_state, ref_p)
        p, ref_p = optax.apply_updates(p, updates), optax.apply_updates(ref_p, ref_updates)
    for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(ref_p)):
        np.testing.assert_allclose(a, b, atol=3e-3)
    for leaf in _float_leaves(state):
        if leaf.ndim:
            np.testing.assert_array_equal(q.float_quantize(leaf, "bfloat16"), leaf)


# --- bad input --------------------------------------------------------------------------


def test_unknown_state_field():
    opt = jsa.optax.quantize(optax.adam(1e-3), state={"mu": "bfloat16", "momentum": "bfloat16"})
    message = (
        "quantize: state names ['momentum'], which the inner state does not have; "
        "its fields are ['count', 'mu', 'nu']"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.init(_params())
    good = jsa.optax.quantize(optax.adam(1e-3), state={"mu": "bfloat16"})
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.update(_grads(), good.init(_params()), _params())
    sgd = jsa.optax.quantize(optax.sgd(0.1, momentum=0.9), state={"mu": "bfloat16"})
    with pytest.raises(ValueError, match=re.escape("its fields are ['trace']")):
        sgd.init(_params())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"grad": 3}, "quantize: grad must be a format (name, dtype or FloatFormat), a (format, "
         "rounding) pair or a callable (x, key) -> x; got 3 of type int"),
        ({"update": ["bfloat16"]}, "quantize: update must be a format"),
        ({"state": {"mu": 0.5}}, "quantize: state['mu'] must be a format"),
        ({"grad": {"w": "bfloat16"}}, "(a dict of specs is for `state` only)"),
        ({"state": {1: "bfloat16"}}, "quantize: state dict keys are field names, got 1"),
    ],
)  # fmt: skip
def test_bad_specs_raise_type_error(kwargs, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        jsa.optax.quantize(optax.adam(1e-3), **kwargs)


def test_bad_formats_and_roundings_raise_value_error():
    with pytest.raises(ValueError, match="Unknown float format 'float7'"):
        jsa.optax.quantize(optax.adam(1e-3), grad="float7")
    with pytest.raises(ValueError, match=re.escape("quantize: unknown rounding 'up' in state=")):
        jsa.optax.quantize(optax.adam(1e-3), state=("bfloat16", "up"))


def test_quantizer_must_keep_the_shape():
    opt = jsa.optax.quantize(record(), grad=lambda x, key: x[:1])
    with pytest.raises(ValueError, match=r"returned shape \(1,\) for a leaf of shape \(3,\)"):
        opt.update({"w": jnp.ones(3)}, opt.init({"w": jnp.ones(3)}))


# --- apply_updates ------------------------------------------------------------------------

N_PARAMS, N_STEPS, STEP = 512, 1000, 1e-4


def _accumulate(rounding):
    """512 bfloat16 parameters at 1.0, 1,000 updates of 1e-4 each."""
    updates = jnp.full(N_PARAMS, STEP, jnp.float32)

    def body(i, p):
        key = jax.random.fold_in(jax.random.key(0), i) if rounding == "stochastic" else None
        return jsa.optax.apply_updates(p, updates, rounding=rounding, key=key)

    run = jax.jit(lambda p: jax.lax.fori_loop(0, N_STEPS, body, p))
    return np.asarray(run(jnp.ones(N_PARAMS, jnp.bfloat16)), np.float64)


def test_small_updates_nearest_stalls_stochastic_is_unbiased():
    nearest = _accumulate("nearest")
    np.testing.assert_array_equal(nearest, 1.0)  # 1e-4 < half a bfloat16 ulp at 1 (2**-8)
    stochastic = _accumulate("stochastic")
    mean, stderr = stochastic.mean(), stochastic.std(ddof=1) / np.sqrt(N_PARAMS)
    print(f"nearest {nearest.mean():.6f}, stochastic {mean:.6f} +- {stderr:.6f} (target 1.1)")
    assert abs(mean - (1.0 + N_STEPS * STEP)) < 3 * stderr
    assert len(np.unique(stochastic)) > 1


def test_stochastic_bfloat16_bits():
    """The hashed random bits of bfloat16 rounding: unbiased per fraction, independent of
    the neighbouring element and of the previous step, and the same for the same key."""
    n = 1 << 16
    frac = (jnp.arange(n) % 16 + 0.5) / 16  # of the bfloat16 ulp at 1 (2**-7), exact
    p, u = jnp.ones(n, jnp.bfloat16), frac * 2.0**-7

    apply = jax.jit(lambda key: jsa.optax.apply_updates(p, u, rounding="stochastic", key=key))

    def up(key):
        new = apply(key)
        assert set(np.unique(np.asarray(new, np.float64)).tolist()) <= {1.0, 1.0 + 2.0**-7}
        return np.asarray(new > 1, np.float64)

    up0, up1 = up(jax.random.key(0)), up(jax.random.key(1))
    np.testing.assert_array_equal(up(jax.random.key(0)), up0)
    f = np.asarray(frac, np.float64)
    for k in range(16):  # 4,096 samples per fraction
        rows = slice(k, None, 16)
        bound = 4 * np.sqrt(f[k] * (1 - f[k]) / up0[rows].size)
        assert abs(up0[rows].mean() - f[k]) < bound, (f[k], up0[rows].mean())
    e0, e1 = up0 - f, up1 - f
    for a, b in ((e0, e1), (e0[:-1], e0[1:]), (e0[:-16], e0[16:])):
        assert abs(np.corrcoef(a, b)[0, 1]) < 4 / np.sqrt(a.size)


def test_nearest_default_is_optax():
    """Without rounding or format arguments: optax's `(p + u).astype(p.dtype)`, bit for bit."""
    params = {"w": _normal(3, (64,)).astype(jnp.bfloat16)}
    updates = {"w": _normal(4, (64,), 1e-3)}
    new = jsa.optax.apply_updates(params, updates)
    np.testing.assert_array_equal(new["w"], optax.apply_updates(params, updates)["w"])
    explicit = jsa.optax.apply_updates(params, updates, rounding="nearest", format="bfloat16")
    np.testing.assert_array_equal(explicit["w"], new["w"])  # float32 sum, rounded once


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_stochastic_rounding_picks_a_neighbour_of_the_sum(dtype):
    p = _normal(5, (4096,)).astype(dtype)
    u = _normal(6, (4096,), 1e-3)
    new = jsa.optax.apply_updates(p, u, rounding="stochastic", key=jax.random.key(0))
    assert new.dtype == dtype

    @jax.jit  # the reference in one compile (eagerly, each operation is one)
    def neighbours(p, u):
        total = p.astype(jnp.float32) + u
        down = q.float_quantize(total, dtype, "toward_zero").astype(dtype)
        up = jnp.nextafter(down, (jnp.sign(total) * jnp.inf).astype(dtype))
        return total, down, up

    total, down, up = (np.asarray(x, np.float64) for x in neighbours(p, u))
    new = np.asarray(new, np.float64)
    exact = down == total
    assert np.all(np.where(exact, new == down, (new == down) | (new == up)))
    # Unbiased: the rounding errors, in units of the gap, average to zero.
    gap = (up - down)[~exact]
    error = (new - total)[~exact] / gap
    assert abs(float(np.mean(error))) < 4 * 0.5 / np.sqrt(error.size)


def test_simulated_format_and_keys():
    p = jnp.full(1000, 1.0, jnp.float32)
    u = jnp.full(1000, 2.0**-11)  # a quarter of FP16_169's ulp at 1 (2**-9)
    fp169 = jsa.optax.recipes.FP16_169
    near = jsa.optax.apply_updates(p, u, format=fp169)
    np.testing.assert_array_equal(near, 1.0)
    sr = jsa.optax.apply_updates(p, u, format=fp169, rounding="stochastic", key=3)
    assert sr.dtype == jnp.float32 and set(np.unique(sr).tolist()) == {1.0, 1.0 + 2.0**-9}
    np.testing.assert_array_equal(q.float_quantize(sr, fp169), sr)
    again = jsa.optax.apply_updates(p, u, format=fp169, rounding="stochastic", key=3)
    np.testing.assert_array_equal(sr, again)
    # One key per leaf: two identical leaves round differently.
    two = jsa.optax.apply_updates((p, p), (u, u), format=fp169, rounding="stochastic", key=3)
    assert not np.array_equal(two[0], two[1])


def test_apply_updates_leaves_and_errors():
    params = {
        "w": jnp.ones(3, jnp.bfloat16),
        "n": jnp.arange(3),
        "kept": jnp.ones(2, jnp.bfloat16),
        "s": jsa.scaled_array(jnp.array([1.0, 2.0], jnp.bfloat16), 2.0**-50),
    }
    updates = {
        "w": jnp.full(3, 0.5),
        "n": None,
        "kept": None,
        "s": jsa.scaled_array(jnp.array([1.0, 1.0], jnp.float32), 2.0**-60),
    }
    new = jsa.optax.apply_updates(params, updates, rounding="stochastic", key=0)
    np.testing.assert_array_equal(new["w"].astype(jnp.float32), 1.5)
    assert new["n"] is params["n"] and new["kept"] is params["kept"]
    assert isinstance(new["s"], jsa.ScaledArray) and new["s"].dtype == jnp.bfloat16
    np.testing.assert_allclose(represented(new["s"]), np.array([1.0, 2.0]) * 2.0**-50, rtol=2**-7)
    assert float(jnp.max(jnp.abs(new["s"].data.astype(jnp.float32)))) < 2.0  # rescaled
    with pytest.raises(ValueError, match=re.escape("rounding='stochastic' needs a PRNG key")):
        jsa.optax.apply_updates(params, updates, rounding="stochastic")
    with pytest.raises(ValueError, match="Unknown rounding mode 'up'"):
        jsa.optax.apply_updates(params, updates, rounding="up")
