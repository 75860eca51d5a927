"""Tests of `jsa.mp` loss scales, `all_finite` and `select_tree`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics.mp as mp
from jax_scaled_arithmetics.core.datatype import ScaledArray, scaled_array

F32_MAX = float(np.finfo(np.float32).max)
TRUE, FALSE = jnp.array(True), jnp.array(False)

_jit_adjust = jax.jit(lambda s, f: s.adjust(f))


def _adjust(ls, finite, jit):
    flag = jnp.asarray(finite)
    return _jit_adjust(ls, flag) if jit else ls.adjust(flag)


def _reference_step(loss_scale, counter, finite, period, factor, min_loss_scale):
    """The documented `DynamicLossScale.adjust` rules, in float32 NumPy."""
    loss_scale = np.float32(loss_scale)
    if finite:
        counter += 1
        if counter == period:
            counter = 0
            with np.errstate(over="ignore"):
                grown = np.float32(loss_scale * np.float32(factor))
            if np.isfinite(grown):
                loss_scale = grown
        return loss_scale, counter
    return max(np.float32(min_loss_scale), np.float32(loss_scale / np.float32(factor))), 0


# --------------------------------------------------------------------------------------
# Pytree registration: every field survives flatten/unflatten and jit.


def _dynamic():
    return mp.DynamicLossScale(
        jnp.float32(2.0**10),
        counter=jnp.int32(3),
        period=7,
        factor=4,
        min_loss_scale=jnp.float32(0.5),
    )


def _assert_same_dynamic(a, b):
    assert isinstance(b, mp.DynamicLossScale)
    assert float(a.loss_scale) == float(b.loss_scale)
    assert int(a.counter) == int(b.counter)
    assert float(a.min_loss_scale) == float(b.min_loss_scale)
    assert (a.period, a.factor) == (b.period, b.factor)
    assert jnp.asarray(b.loss_scale).dtype == jnp.float32
    assert jnp.asarray(b.counter).dtype == jnp.int32
    assert jnp.asarray(b.min_loss_scale).dtype == jnp.float32


def test_dynamic_pytree_leaves_and_metadata():
    ls = _dynamic()
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    assert len(leaves) == 2  # loss_scale, counter (as in jmp)
    assert [float(x) for x in leaves] == [1024.0, 3.0]
    _assert_same_dynamic(ls, jax.tree_util.tree_unflatten(treedef, leaves))
    other = mp.DynamicLossScale(jnp.float32(1.0), period=8, factor=4)
    assert jax.tree_util.tree_structure(other) != treedef  # period is static metadata
    lower = dataclasses.replace(ls, min_loss_scale=jnp.float32(0.25))
    assert jax.tree_util.tree_structure(lower) != treedef  # so is min_loss_scale
    same = dataclasses.replace(ls, min_loss_scale=np.float32(0.5))
    assert jax.tree_util.tree_structure(same) == treedef  # compared by value
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(ls)]
    assert paths == [".loss_scale", ".counter"]


def test_dynamic_survives_identity_jit():
    ls = _dynamic()
    _assert_same_dynamic(ls, jax.jit(lambda s: s)(ls))


def test_dynamic_adjust_under_jit_keeps_every_field():
    ls = _dynamic()
    out = _jit_adjust(ls, TRUE)
    assert float(out.min_loss_scale) == 0.5
    assert (out.period, out.factor) == (7, 4)
    assert int(out.counter) == 4
    # The min_loss_scale must still be honoured after a jitted round trip.
    small = dataclasses.replace(ls, loss_scale=jnp.float32(1.0))
    out = _jit_adjust(_jit_adjust(small, FALSE), FALSE)
    assert float(out.loss_scale) == 0.5
    assert float(out.min_loss_scale) == 0.5


def test_static_and_noop_pytrees():
    static = mp.StaticLossScale(jnp.float32(8.0))
    assert jax.tree_util.tree_leaves(static) == []  # static, as in jmp
    out = jax.jit(lambda s: s)(static)
    assert isinstance(out, mp.StaticLossScale) and float(out.loss_scale) == 8.0
    traces = []

    @jax.jit
    def scale(ls, x):
        traces.append(None)
        return ls.scale(x)

    x = jnp.ones(2, jnp.float16)
    assert scale(static, x).tolist() == [8.0, 8.0]
    assert scale(mp.StaticLossScale(jnp.float32(8.0)), x).tolist() == [8.0, 8.0]
    assert len(traces) == 1  # an equal loss scale finds the compiled program
    assert scale(mp.StaticLossScale(jnp.float32(4.0)), x).tolist() == [4.0, 4.0]
    assert len(traces) == 2
    noop = mp.NoOpLossScale()
    assert jax.tree_util.tree_leaves(noop) == []
    assert isinstance(jax.jit(lambda s: s)(noop), mp.NoOpLossScale)


def test_dynamic_defaults():
    ls = mp.DynamicLossScale(jnp.float32(2.0**15))
    assert (ls.period, ls.factor) == (2000, 2)
    assert int(ls.counter) == 0 and jnp.asarray(ls.counter).dtype == jnp.int32
    assert float(ls.min_loss_scale) == 1.0
    assert jnp.asarray(ls.min_loss_scale).dtype == jnp.float32


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"period": 0}, ValueError, r"period must be >= 1"),
        ({"factor": 0}, ValueError, r"factor must be >= 1"),
        ({"period": 0.5}, ValueError, r"period must be >= 1"),
        ({"period": "2"}, TypeError, r"period must be a number"),
        ({"factor": True}, TypeError, r"factor must be a number"),
    ],
)
def test_dynamic_rejects_bad_metadata(kwargs, error, match):
    with pytest.raises(error, match=match):
        mp.DynamicLossScale(jnp.float32(1.0), **kwargs)


# --------------------------------------------------------------------------------------
# DynamicLossScale.adjust semantics, step by step against the documented rules.


@pytest.mark.parametrize("jit", [False, True])
def test_growth_every_period_finite_steps(jit):
    ls = mp.DynamicLossScale(jnp.float32(4.0), period=3, factor=2)
    expected = [(4.0, 1), (4.0, 2), (8.0, 0), (8.0, 1), (8.0, 2), (16.0, 0), (16.0, 1)]
    for loss_scale, counter in expected:
        ls = _adjust(ls, True, jit)
        assert (float(ls.loss_scale), int(ls.counter)) == (loss_scale, counter)


@pytest.mark.parametrize("jit", [False, True])
def test_period_one_grows_every_step(jit):
    ls = mp.DynamicLossScale(jnp.float32(1.0), period=1, factor=4)
    for step in range(1, 5):
        ls = _adjust(ls, True, jit)
        assert float(ls.loss_scale) == 4.0**step and int(ls.counter) == 0


@pytest.mark.parametrize("jit", [False, True])
def test_no_growth_past_float32_max(jit):
    start = np.float32(2.0**127)  # the largest power of two in float32
    ls = mp.DynamicLossScale(jnp.float32(start), period=2, factor=2)
    for _ in range(6):
        ls = _adjust(ls, True, jit)
        assert float(ls.loss_scale) == float(start)  # 2**128 overflows: kept
        assert bool(jnp.isfinite(ls.loss_scale))
    assert int(ls.counter) == 0  # the counter still resets at each period
    near_max = mp.DynamicLossScale(jnp.float32(F32_MAX), period=1, factor=2)
    assert float(_adjust(near_max, True, jit).loss_scale) == F32_MAX


@pytest.mark.parametrize("jit", [False, True])
def test_shrink_to_min_loss_scale_and_not_below(jit):
    ls = mp.DynamicLossScale(
        jnp.float32(64.0), counter=jnp.int32(5), period=10, min_loss_scale=jnp.float32(4.0)
    )
    for expected in [32.0, 16.0, 8.0, 4.0, 4.0, 4.0]:
        ls = _adjust(ls, False, jit)
        assert float(ls.loss_scale) == expected
        assert int(ls.counter) == 0


@pytest.mark.parametrize("jit", [False, True])
def test_min_loss_scale_not_a_power_of_factor(jit):
    ls = mp.DynamicLossScale(jnp.float32(10.0), min_loss_scale=jnp.float32(3.0))
    ls = _adjust(ls, False, jit)
    assert float(ls.loss_scale) == 5.0
    ls = _adjust(ls, False, jit)
    assert float(ls.loss_scale) == 3.0  # max(3, 2.5)


@pytest.mark.parametrize("jit", [False, True])
def test_non_finite_resets_counter(jit):
    ls = mp.DynamicLossScale(jnp.float32(2.0**15), period=3)
    ls = _adjust(_adjust(ls, True, jit), True, jit)
    assert int(ls.counter) == 2
    ls = _adjust(ls, False, jit)
    assert (float(ls.loss_scale), int(ls.counter)) == (2.0**14, 0)
    ls = _adjust(_adjust(ls, True, jit), True, jit)
    assert (float(ls.loss_scale), int(ls.counter)) == (2.0**14, 2)  # no growth yet
    ls = _adjust(ls, True, jit)
    assert (float(ls.loss_scale), int(ls.counter)) == (2.0**15, 0)


@pytest.mark.parametrize("jit", [False, True])
def test_against_reference_sequence(jit):
    rng = np.random.default_rng(0)
    period, factor, min_ls = 3, 2, 2.0**-2
    ls = mp.DynamicLossScale(
        jnp.float32(2.0**125), period=period, factor=factor, min_loss_scale=jnp.float32(min_ls)
    )
    ref_scale, ref_counter = np.float32(2.0**125), 0
    # Long finite runs hit the float32 ceiling, long non-finite runs the floor.
    pattern = [True] * 12 + [False] * 140 + list(rng.random(60) < 0.8)
    for finite in pattern:
        ls = _adjust(ls, bool(finite), jit)
        ref_scale, ref_counter = _reference_step(
            ref_scale, ref_counter, finite, period, factor, min_ls
        )
        assert float(ls.loss_scale) == float(ref_scale)
        assert int(ls.counter) == ref_counter


def test_adjust_keeps_dtypes():
    ls = mp.DynamicLossScale(jnp.float32(2.0**15), period=1)
    for flag in (TRUE, FALSE):
        out = ls.adjust(flag)
        assert out.loss_scale.dtype == jnp.float32
        assert out.counter.dtype == jnp.int32


def test_adjust_accepts_python_numbers_and_bools():
    ls = mp.DynamicLossScale(2.0**15, counter=0, period=1)
    out = ls.adjust(True)
    assert float(out.loss_scale) == 2.0**16 and out.loss_scale.dtype == jnp.float32
    out = ls.adjust(np.bool_(False))
    assert float(out.loss_scale) == 2.0**14 and out.counter.dtype == jnp.int32


@pytest.mark.parametrize(
    "ls",
    [
        mp.NoOpLossScale(),
        mp.StaticLossScale(jnp.float32(2.0)),
        mp.DynamicLossScale(jnp.float32(2.0)),
    ],
    ids=["noop", "static", "dynamic"],
)
@pytest.mark.parametrize("jit", [False, True])
def test_adjust_rejects_non_boolean_or_non_scalar(ls, jit):
    adjust = jax.jit(lambda s, f: s.adjust(f)) if jit else (lambda s, f: s.adjust(f))
    with pytest.raises(TypeError, match=r"grads_finite: expected boolean scalar, got dtype"):
        adjust(ls, jnp.float32(1.0))
    with pytest.raises(TypeError, match=r"grads_finite: expected boolean scalar, got dtype"):
        adjust(ls, jnp.int32(1))
    with pytest.raises(ValueError, match=r"grads_finite: expected boolean scalar, got shape"):
        adjust(ls, jnp.array([True, False]))
    with pytest.raises(TypeError, match=r"grads_finite: expected boolean scalar, got int"):
        ls.adjust(1)


def test_static_and_noop_adjust_return_self():
    static = mp.StaticLossScale(jnp.float32(2.0**8))
    assert static.adjust(FALSE) is static
    noop = mp.NoOpLossScale()
    assert noop.adjust(TRUE) is noop


# --------------------------------------------------------------------------------------
# scale / unscale.


def _grads():
    return {
        "w": scaled_array(jnp.array([1.0, -0.5, 2.0], jnp.float16), 2.0**-3),
        "b": jnp.array([0.25, 3.0], jnp.float16),
        "v": jnp.array([1.0, 2.0], jnp.bfloat16),
        "f32": jnp.array([1.5], jnp.float32),
        "step": jnp.array(3, jnp.int32),
        "mask": jnp.array([True]),
        "none": None,
    }


@pytest.mark.parametrize("cls", [mp.StaticLossScale, mp.DynamicLossScale])
@pytest.mark.parametrize("jit", [False, True])
def test_scale_unscale(cls, jit):
    ls = cls(jnp.float32(2.0**10))
    grads = _grads()
    scale = jax.jit(lambda s, t: s.scale(t)) if jit else (lambda s, t: s.scale(t))
    unscale = jax.jit(lambda s, t: s.unscale(t)) if jit else (lambda s, t: s.unscale(t))
    scaled = scale(ls, grads)

    assert jax.tree_util.tree_structure(scaled) == jax.tree_util.tree_structure(grads)
    # ScaledArray: the scale is multiplied, the data kept bit for bit.
    assert isinstance(scaled["w"], ScaledArray)
    np.testing.assert_array_equal(scaled["w"].data, grads["w"].data)
    assert scaled["w"].data.dtype == jnp.float16
    assert float(scaled["w"].scale) == 2.0**7 and scaled["w"].scale.dtype == jnp.float32
    # Plain floating leaves are multiplied and keep their dtype.
    for key in ("b", "v", "f32"):
        assert scaled[key].dtype == grads[key].dtype
        np.testing.assert_array_equal(
            np.asarray(scaled[key], np.float32), np.asarray(grads[key], np.float32) * 2**10
        )
    np.testing.assert_array_equal(scaled["step"], 3)
    assert scaled["mask"].dtype == jnp.bool_
    assert scaled["none"] is None

    back = unscale(ls, scaled)
    assert float(back["w"].scale) == 2.0**-3
    np.testing.assert_array_equal(back["w"].data, grads["w"].data)
    for key in ("b", "v", "f32"):
        assert back[key].dtype == grads[key].dtype
        np.testing.assert_array_equal(back[key], grads[key])


def test_scale_overflow_in_float16_gives_inf():
    ls = mp.StaticLossScale(jnp.float32(2.0**16))
    out = ls.scale({"g": jnp.array([2.0], jnp.float16)})
    assert out["g"].dtype == jnp.float16
    assert not bool(mp.all_finite(out))
    # The same value held as a ScaledArray does not overflow: its scale takes the factor.
    scaled = ls.scale({"g": scaled_array(jnp.array([2.0], jnp.float16), 1.0)})
    assert bool(mp.all_finite(scaled))
    assert float(scaled["g"].scale) == 2.0**16


def test_scale_with_loss_scale_beyond_float16_range_unscales_exactly():
    ls = mp.StaticLossScale(jnp.float32(2.0**20))
    grad = jnp.array([2.0**-22, 2.0**-24], jnp.float16)
    np.testing.assert_array_equal(ls.unscale(ls.scale(grad)), grad)


def test_scale_fp8_leaf_and_python_scalars():
    ls = mp.StaticLossScale(4.0)
    x = jnp.array([0.5, 1.0], jnp.float8_e4m3fn)
    out = ls.scale(x)
    assert out.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(out, np.float32), [2.0, 4.0])
    assert float(ls.scale(1.5)) == 6.0
    assert ls.scale(3) == 3  # integers are not floating: untouched


def test_noop_scale_unscale_identity():
    ls = mp.NoOpLossScale()
    grads = _grads()
    assert ls.scale(grads) is grads
    assert ls.unscale(grads) is grads
    assert float(ls.loss_scale) == 1.0


def test_training_step_pattern_under_jit():
    """The usual jmp loop: scale the loss, unscale grads, skip non-finite updates."""

    def loss_fn(w, x):
        return jnp.sum((w * x) ** 2)

    @jax.jit
    def step(w, ls, x):
        grads = jax.grad(lambda w: ls.scale(loss_fn(w, x)))(w)
        grads = ls.unscale(grads)
        finite = mp.all_finite(grads)
        new_w = mp.select_tree(finite, w - 0.1 * grads, w)
        return new_w, ls.adjust(finite), finite

    w = jnp.array([1.0, 2.0], jnp.float32)
    ls = mp.DynamicLossScale(jnp.float32(2.0**100), period=1)
    w1, ls1, finite = step(w, ls, jnp.array([1.0, 1.0]))
    assert bool(finite)
    np.testing.assert_allclose(w1, w - 0.1 * 2 * w)
    assert float(ls1.loss_scale) == 2.0**101
    w2, ls2, finite = step(w1, ls1, jnp.array([jnp.inf, 1.0]))
    assert not bool(finite)
    np.testing.assert_array_equal(w2, w1)  # update skipped
    assert float(ls2.loss_scale) == 2.0**100


def test_skipped_scaled_adam_step_keeps_parameters_and_state_bit_for_bit():
    """A scaled float16 Adam step under `autoscale` that skips a NaN batch the jmp way:
    after the NaN batch, every parameter and optimizer-state leaf (data and scale) is the
    one before it, as if the batch had never been seen."""
    import optax

    import jax_scaled_arithmetics as jsa

    rng = np.random.default_rng(0)
    params = jsa.as_scaled_array(
        {"w": rng.normal(size=(4, 3)), "b": np.full(3, 0.1)}, dtype=jnp.float16
    )
    tx = jsa.optax.scale_optimizer(optax.adam(1e-2))

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"] + p["b"][None, :]) ** 2)

    @jax.jit
    @jsa.autoscale
    def step(p, state, x):
        grads = jax.grad(loss)(p, x)
        updates, new_state = tx.update(grads, state, p)
        finite = mp.all_finite(grads)
        return mp.select_tree(finite, (jsa.optax.apply_updates(p, updates), new_state), (p, state))

    x = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    before = step(params, tx.init(params), x)  # a real step: moments with scales of their own
    after = step(*before, x.at[0, 0].set(jnp.nan))
    leaves_before = jax.tree_util.tree_leaves(before)
    leaves_after = jax.tree_util.tree_leaves(after)
    assert len(leaves_before) == len(leaves_after) > 8
    for old, new in zip(leaves_before, leaves_after, strict=True):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
        assert np.asarray(new).dtype == np.asarray(old).dtype


# --------------------------------------------------------------------------------------
# all_finite.


@pytest.mark.parametrize(
    "tree, expected",
    [
        ({}, True),
        ({"a": jnp.ones(3), "n": jnp.arange(3)}, True),
        ({"a": jnp.array([1.0, jnp.inf])}, False),
        ({"a": jnp.array([-jnp.inf])}, False),
        ({"a": jnp.array([1.0, jnp.nan])}, False),
        ({"a": jnp.array([1.0], jnp.float16), "b": jnp.array([jnp.nan], jnp.bfloat16)}, False),
        ([scaled_array(jnp.array([1.0, 2.0], jnp.float16), 2.0**-10)], True),
        ([scaled_array(jnp.array([1.0, jnp.inf], jnp.float16), 1.0)], False),
        ([scaled_array(jnp.array([1.0, jnp.nan]), 1.0)], False),
        ([ScaledArray(jnp.array([1.0, 2.0]), jnp.float32(jnp.inf))], False),
        ([ScaledArray(jnp.array([1.0, 2.0]), jnp.float32(jnp.nan))], False),
        ([scaled_array(jnp.zeros(2), 0.0)], True),
        ([1.0, 2, None, jnp.array(True)], True),
        ([float("nan")], False),
        ([np.array([np.inf], np.float32)], False),
    ],
)
@pytest.mark.parametrize("jit", [False, True])
def test_all_finite(tree, expected, jit):
    fn = jax.jit(mp.all_finite) if jit else mp.all_finite
    out = fn(tree)
    assert out.shape == () and out.dtype == jnp.bool_
    assert bool(out) is expected


# --------------------------------------------------------------------------------------
# select_tree.


def _pair():
    a = {"w": scaled_array(jnp.array([1.0, 2.0], jnp.float16), 2.0), "n": jnp.int32(1)}
    b = {"w": scaled_array(jnp.array([3.0, 4.0], jnp.float16), 0.5), "n": jnp.int32(2)}
    return a, b


@pytest.mark.parametrize("jit", [False, True])
def test_select_tree(jit):
    a, b = _pair()
    fn = jax.jit(mp.select_tree) if jit else mp.select_tree
    for pred, src in ((TRUE, a), (FALSE, b)):
        out = fn(pred, a, b)
        assert isinstance(out["w"], ScaledArray)
        np.testing.assert_array_equal(out["w"].data, src["w"].data)
        assert float(out["w"].scale) == float(src["w"].scale)
        assert out["w"].data.dtype == jnp.float16
        assert int(out["n"]) == int(src["n"])


def test_select_tree_python_bool_pred():
    a, b = _pair()
    assert int(mp.select_tree(True, a, b)["n"]) == 1


def test_select_tree_mismatched_structures():
    a, b = _pair()
    with pytest.raises(ValueError, match=r"identical structure.*PyTreeDef.*and.*PyTreeDef"):
        mp.select_tree(TRUE, a, {"w": b["w"]})
    plain = {"w": jnp.ones(2, jnp.float16), "n": jnp.int32(2)}
    with pytest.raises(ValueError, match=r"identical structure"):
        mp.select_tree(TRUE, a, plain)  # ScaledArray against a plain array


def test_select_tree_mismatched_leaves():
    with pytest.raises(ValueError, match=r"shapes differ, \(2,\) and \(3,\)"):
        mp.select_tree(TRUE, [jnp.ones(2)], [jnp.ones(3)])
    with pytest.raises(TypeError, match=r"dtypes differ, float32 and float16"):
        mp.select_tree(TRUE, [jnp.ones(2)], [jnp.ones(2, jnp.float16)])


@pytest.mark.parametrize(
    "pred, error, match",
    [
        (jnp.array([True, False]), ValueError, r"pred: expected boolean scalar, got shape \(2,\)"),
        (jnp.float32(1.0), TypeError, r"pred: expected boolean scalar, got dtype float32"),
        (1, TypeError, r"pred: expected boolean scalar, got int"),
    ],
)
def test_select_tree_bad_pred(pred, error, match):
    a, b = _pair()
    with pytest.raises(error, match=match):
        mp.select_tree(pred, a, b)
