"""`jsa.delayed_scaling`: sums and contractions at scales held from earlier steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics import optax as jsa_optax
from tests.helpers import (
    FLOAT_DTYPES,
    RTOL,
    WIDE_SCALES,
    assert_close,
    load_script,
    make_scaled,
    represented,
)

# The gradient step multiplies input scales pairwise: beyond 2^+-30 its products leave
# float32's range, where the dynamic step (test_interpreter) keeps only zeros or edges,
# and a history of them says nothing about the next step.
STEP_SCALES = tuple(s for s in WIDE_SCALES if 2.0**-30 <= s <= 2.0**30)


def mlp_loss(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"][None, :])
    return jnp.mean(jnp.square(h @ params["w2"]))


def mlp_inputs(dtype, scale):
    rng = np.random.default_rng(0)
    params = {
        "w1": make_scaled(rng.normal(size=(8, 16)) / 4, dtype, 0.5),
        "b1": make_scaled(rng.normal(size=(16,)), dtype, scale),
        "w2": make_scaled(rng.normal(size=(16, 4)) / 4, dtype, 0.25),
    }
    return params, make_scaled(rng.normal(size=(5, 8)), dtype, scale)


def grad_step(params, x):
    loss, grads = jax.value_and_grad(mlp_loss)(params, x)
    return loss, grads


def _maybe_jit(fun, jit):
    return jax.jit(fun) if jit else fun


def _scale_values(tree):
    return [
        float(leaf.scale)
        for leaf in jax.tree_util.tree_leaves(tree, is_leaf=jsa.is_scaled_leaf)
        if isinstance(leaf, jsa.ScaledArray)
    ]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("scale", WIDE_SCALES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_init_is_the_dynamic_step_and_its_scales_fill_the_history(dtype, scale, jit):
    params, x = mlp_inputs(dtype, scale)
    step = jsa.delayed_scaling(grad_step, history_length=3)
    out, history = _maybe_jit(step.init, jit)(params, x)
    dynamic = _maybe_jit(jsa.autoscale(grad_step), jit)(params, x)
    for got, want in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(dynamic)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    scales = np.asarray(history.as_matrix())
    assert scales.shape == (len(history.sites), 3) and len(history.sites) >= 6
    np.testing.assert_array_equal(scales, scales[:, :1].repeat(3, axis=1))
    # Powers of two: the dynamic scales themselves.
    assert np.all(np.exp2(np.round(np.log2(scales))) == scales)


def check_a_step_from_a_larger_input(step, grad_step, history, params, x, dtype, jit):
    """`step` (a `delayed_scaling` of `grad_step`) from an input 8 times larger than the
    one `history` was made from: every held scale is 8 times too small, but data stays far
    from float16's largest value. Its values are the dynamic step's (themselves the plain
    function's: test_interpreter; float32 does not hold them at every scale here), it
    measures the dynamic step's scales, and the history rolls. Returns that input."""
    x2 = jsa.scaled_array(x.data, x.scale * 8)
    (loss, grads), new = _maybe_jit(step, jit)(history, params, x2)
    want_loss, want_grads = jax.jit(jsa.autoscale(grad_step))(params, x2)
    assert_close(loss, represented(want_loss), RTOL[dtype] * 4)
    for name in grads:
        assert_close(grads[name], represented(want_grads[name]), RTOL[dtype] * 8, RTOL[dtype])
        assert np.all(np.isfinite(np.asarray(grads[name].data, np.float32)))
    _, dynamic = jax.jit(step.init)(params, x2)
    np.testing.assert_array_equal(new.scales[:, 0], dynamic.scales[:, 0])
    np.testing.assert_array_equal(new.scales[:, 1], history.scales[:, 0])
    assert new.sites == history.sites
    return x2


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("scale", STEP_SCALES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_steps_match_the_plain_function_at_the_held_scales(dtype, scale, jit):
    """Each step's values are the dynamic step's, the outputs of sums and contractions at
    the held scales, and the history rolls."""
    params, x = mlp_inputs(dtype, scale)
    step = jsa.delayed_scaling(grad_step, history_length=2)
    _, history = jax.jit(step.init)(params, x)
    check_a_step_from_a_larger_input(step, grad_step, history, params, x, dtype, jit)


@pytest.mark.parametrize("margin", [-1, 0, 2])
def test_the_held_scale_is_the_largest_in_the_history_times_two_to_the_margin(margin):
    step = jsa.delayed_scaling(lambda w, v: w @ v, history_length=3, margin=margin)
    w = jsa.as_scaled_array(jnp.full((2, 2), 3.0, jnp.float16))
    v = jsa.as_scaled_array(jnp.ones((2,), jnp.float16))
    history = jsa.ScaleHistory(jnp.array([[2.0, 16.0, 4.0]], jnp.float32), ("float16[2]",))
    y, new = jax.jit(step)(history, w, v)
    assert float(y.scale) == 16.0 * 2.0**margin
    np.testing.assert_array_equal(represented(y), [6.0, 6.0])
    np.testing.assert_array_equal(np.asarray(new.as_matrix()), [[4.0, 2.0, 16.0]])


def test_a_delayed_step_costs_no_more_kernels_than_the_dynamic_step():
    """The held scales come from one small kernel (a vector for every site, split into its
    scalars there), each site's measurement is its reduction without the scale's epilogue,
    and the epilogues and the new history are written together. The delayed MLP step has
    29 kernels against the dynamic step's 37 (33 when each site's held scale was a kernel
    of its own, 62 when each site read and wrote its own history)."""
    hlo_counts = load_script("program_size", "benchmarks/program_size.py").hlo_counts
    params, x = mlp_inputs(np.dtype(np.float16), 1.0)
    step = jsa.delayed_scaling(grad_step, history_length=4)
    _, history = jax.jit(step.init)(params, x)

    def kernels(fun, *args):
        return hlo_counts(jax.jit(fun).lower(*args).compile().as_text())[0]

    assert len(history.sites) == 7  # 2 products, the loss, 3 backward products, a bias grad
    assert kernels(step, history, params, x) <= kernels(jsa.autoscale(grad_step), params, x)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's kernels")
def test_held_scales_are_read_by_alike_kernels():
    """XLA:CPU generates code once for alike kernels. A site's held scale sliced out of
    the history's vector made its kernel differ from every other site's: a chain of 20
    alike products had 31 distinct kernels delayed against 9 dynamic, and 86 kernels (a
    held scale each). Split into scalars a piece of 32 at a time (one kernel each), the
    sites' kernels stay alike: 11 distinct, 66 kernels against the dynamic step's 102."""
    program_size = load_script("program_size", "benchmarks/program_size.py")

    def chain(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    rng = np.random.default_rng(0)
    ws = [make_scaled(rng.normal(size=(16, 16)) / 4, np.dtype(np.float16), 1.0) for _ in range(20)]
    x = make_scaled(rng.normal(size=(8, 16)), np.dtype(np.float16), 1.0)
    step = jsa.delayed_scaling(chain, history_length=4)
    _, history = jax.jit(step.init)(ws, x)
    sites = len(history.sites)
    assert sites == 20

    def counts(fun, *args):
        text = jax.jit(fun).lower(*args).compile().as_text()
        return program_size.hlo_counts(text)[0], program_size.distinct_fusions(text)[1]

    dynamic_kernels, dynamic_distinct = counts(jsa.autoscale(chain), ws, x)
    delayed_kernels, delayed_distinct = counts(step, history, ws, x)
    assert delayed_distinct <= dynamic_distinct + 5, (delayed_distinct, dynamic_distinct)
    assert delayed_kernels + sites <= dynamic_kernels, (delayed_kernels, dynamic_kernels)
    out, _ = jax.jit(step)(history, ws, x)
    expected = chain([represented(w) for w in ws], represented(x))
    assert_close(out, np.asarray(expected), RTOL[np.dtype(np.float16)])


def test_every_site_is_measured_by_one_primitive_at_the_end_of_the_step():
    """A site records its output; one `largest_finite_magnitudes` takes every site's at the
    end of the step (on XLA:GPU all the tensors' partial reductions finish in one kernel
    there), and its values are the measured scales of the next history."""
    from jax_scaled_arithmetics.core.scale_arithmetic import largest_finite_magnitudes_p

    params, x = mlp_inputs(np.dtype(np.float16), 1.0)
    step = jsa.delayed_scaling(grad_step, history_length=4)
    _, history = jax.jit(step.init)(params, x)
    jaxpr = jax.make_jaxpr(step)(history, params, x).jaxpr
    measured = [e for e in jaxpr.eqns if e.primitive is largest_finite_magnitudes_p]
    assert len(measured) == 1 and len(measured[0].invars) == 2 * len(history.sites)
    _, next_history = jax.jit(step)(history, params, x)
    # The same inputs again: the newest column is the dynamic step's scales (`init`'s).
    assert len(set(history.scales[:, 0].tolist())) > 1  # sites told apart by their scales
    np.testing.assert_array_equal(next_history.scales[:, 0], history.scales[:, 0])


def test_gradients_flow_through_a_delayed_step_as_through_autoscale():
    """`jax.grad` outside the transform: the gradient of the represented loss."""
    params, x = mlp_inputs(np.dtype(np.float32), 1.0)
    step = jsa.delayed_scaling(mlp_loss)
    _, history = step.init(params, x)

    def loss_of_values(p):
        loss, _ = step(history, p, x)
        return jnp.asarray(represented_jnp(loss), jnp.float32)

    grads = jax.grad(loss_of_values)(params)
    reference = jax.grad(lambda p: represented_jnp(jsa.autoscale(mlp_loss)(p, x)))(params)
    for name in params:
        np.testing.assert_allclose(
            np.asarray(grads[name].data), np.asarray(reference[name].data), rtol=1e-5, atol=1e-7
        )


def represented_jnp(x):
    return x.data.astype(jnp.float32) * x.scale if isinstance(x, jsa.ScaledArray) else x


def test_a_scaled_adam_step_trains_with_the_history_in_its_state():
    """The history carried beside the optimizer state, as users carry it: the losses of a
    few Adam steps match the dynamic run's, and the parameters stay finite. (Adam moves
    each parameter by about its learning rate: from parameters of 2^-20 a step would grow
    outputs by 2^13 and more, beyond what a history can hold: see `delayed_scaling`.)"""
    params, x = mlp_inputs(np.dtype(np.float16), 2.0**-6)
    opt = jsa_optax.scale_optimizer(optax.adam(1e-2), state_dtype=jnp.float16)

    def train_step(p, s, batch):
        loss, grads = jax.value_and_grad(mlp_loss)(p, batch)
        updates, s = opt.update(grads, s, p)
        return jsa_optax.apply_updates(p, updates), s, loss

    delayed = jsa.delayed_scaling(train_step)
    dynamic = jax.jit(jsa.autoscale(train_step))
    state = jax.jit(opt.init)(params)
    (p1, s1, _), history = jax.jit(delayed.init)(params, state, x)
    p2, s2, _ = dynamic(params, state, x)
    step = jax.jit(delayed)
    for _ in range(3):
        (p1, s1, loss1), history = step(history, p1, s1, x)
        p2, s2, loss2 = dynamic(p2, s2, x)
        np.testing.assert_allclose(represented(loss1), represented(loss2), rtol=2e-2)
    for leaf in jax.tree_util.tree_leaves(p1):
        assert np.all(np.isfinite(np.asarray(leaf, np.float32)))


def test_sites_are_the_top_level_sums_and_contractions():
    """A jit without shardings is inlined (its sites count); a top-level scan's body sites
    are one row per iteration; a cond branch keeps dynamic scales (traced apart); the
    static policy has no sites."""
    w = jsa.as_scaled_array(jnp.eye(4, dtype=jnp.float16) * 3)
    v = jsa.as_scaled_array(jnp.ones((4,), jnp.float16))

    def f(w, v):
        h = jax.jit(lambda a, b: a @ b)(w, v)
        h = jax.lax.scan(lambda c, _: (w @ c, None), h, None, length=2)[0]
        h = jax.lax.cond(h[0] > 0, lambda c: w @ c, lambda c: c, h)
        return jnp.sum(h)

    _, history = jsa.delayed_scaling(f).init(w, v)
    assert history.sites == (
        "float16[4]",
        "scan 0 (2 iterations), iteration 0: float16[4]",
        "scan 0 (2 iterations), iteration 1: float16[4]",
        "float32[]",  # jnp.sum accumulates float16 in float32
    )
    np.testing.assert_array_equal(history.scales[:, 0], [2.0, 8.0, 16.0, 256.0])
    # The loop and branch outputs are right at the held and dynamic scales.
    (out, new) = jax.jit(jsa.delayed_scaling(f))(history, w, v)
    assert_close(out, np.float32(4 * 81.0), 1e-3)
    np.testing.assert_array_equal(new.scales[:, 0], history.scales[:, 0])
    with jsa.AutoScaleConfig(policy=jsa.ScalePolicy.STATIC):
        _, static_history = jsa.delayed_scaling(f).init(w, v)
    assert static_history.sites == () and static_history.scales.shape == (0, 16)
    y, empty = jax.jit(jsa.delayed_scaling(lambda a: a * 2))(static_history, v)
    np.testing.assert_array_equal(represented(y), np.full(4, 2.0))
    assert empty.sites == () and empty.scales.shape == (0, 16)


def stacked_loss(params, x):
    """An MLP whose layers are stacked and run as a `lax.scan`, as deep models are."""

    def layer(h, p):
        return jax.nn.relu(h @ p["w"] + p["b"][None, :]), None

    h, _ = jax.lax.scan(layer, x, params)
    return jnp.mean(jnp.square(h))


def stacked_inputs(dtype, scale):
    """Three layers at weights 2^-2, 1 and 2^2 (a block scale, one per layer)."""
    rng = np.random.default_rng(4)
    gains = np.array([0.25, 1.0, 4.0], np.float32)[:, None, None]
    w = jsa.scaled_array((rng.normal(size=(3, 6, 6)) / 3).astype(dtype), gains)
    params = {"w": w, "b": make_scaled(rng.normal(size=(3, 6)), dtype, scale)}
    return params, make_scaled(rng.normal(size=(5, 6)), dtype, scale)


def stacked_grad_step(params, x):
    return jax.value_and_grad(stacked_loss)(params, x)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("scale", STEP_SCALES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_a_scanned_models_sites_hold_one_scale_per_layer(dtype, scale, jit):
    """The forward scan's and the backward (reversed) scan's sums and contractions are
    rows of the history, one per layer: `init` is the dynamic step and records each
    layer's own scale; a step from an input 8 times larger computes the dynamic step's
    values at the held scales, and measures the dynamic step's scales."""
    params, x = stacked_inputs(dtype, scale)
    step = jsa.delayed_scaling(stacked_grad_step, history_length=2)
    out, history = _maybe_jit(step.init, jit)(params, x)
    dynamic = _maybe_jit(jsa.autoscale(stacked_grad_step), jit)(params, x)
    for got, want in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(dynamic)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    scan_rows = [s for s in history.sites if s.startswith("scan")]
    assert len(scan_rows) >= 9 and all("(3 iterations)" in s for s in scan_rows)
    # Each layer's matmul has a scale of its own (weights 2^-2, 1, 2^2).
    forward = np.asarray(history.scales)[[history.sites.index(s) for s in scan_rows[:3]], 0]
    assert len(set(forward.tolist())) > 1

    check_a_step_from_a_larger_input(step, stacked_grad_step, history, params, x, dtype, jit)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["scan", "scan-checkpoint"])
def test_a_scan_whose_carry_starts_unscaled_holds_its_scales(checkpointed):
    """A plain input carried through scaled layers (Flax linen's `nn.scan` over a model's
    input): the body is traced first with an unscaled carry, whose sites are not the final
    body's, then again; only the final trace is checked against the history (the first
    one refused it)."""
    params, x = stacked_inputs(np.dtype(np.float16), 1.0)

    def layer(h, p):
        h = h - jnp.mean(h, axis=-1, keepdims=True)  # a sum of the carry: a site once scaled
        return jax.nn.relu(h @ p["w"] + p["b"][None, :])

    def loss(params, x):
        run = jax.checkpoint(layer) if checkpointed else layer
        h, _ = jax.lax.scan(lambda h, p: (run(h, p), None), x, params)
        return jnp.mean(jnp.square(h))

    grad_step = jax.value_and_grad(loss)
    plain_x = jnp.asarray(represented(x), jnp.float32)
    step = jsa.delayed_scaling(grad_step)
    _, history = jax.jit(step.init)(params, plain_x)
    (got_loss, got), _ = jax.jit(step)(history, params, plain_x)
    want_loss, want = jax.jit(jsa.autoscale(grad_step))(params, plain_x)
    assert_close(got_loss, represented(want_loss), RTOL[np.dtype(np.float16)] * 4)
    for name in got:
        assert_close(got[name], represented(want[name]), RTOL[np.dtype(np.float16)] * 8)


def test_each_iteration_of_a_scan_takes_its_own_rows_held_scale():
    """Row `i` of a scan's site is iteration `i`'s held scale: the stacked output of
    `w_i @ v` has the held scales of its rows, and no dynamic scale is left in the body."""
    from jax_scaled_arithmetics.core.scale_arithmetic import dynamic_scale_p

    ws = jsa.as_scaled_array(jnp.ones((3, 2, 2), jnp.float16))
    v = jsa.as_scaled_array(jnp.ones((2,), jnp.float16))
    step = jsa.delayed_scaling(lambda ws, v: jax.lax.scan(lambda c, w: (c, w @ v), 0.0, ws)[1])
    _, history = step.init(ws, v)
    assert history.sites == tuple(
        f"scan 0 (3 iterations), iteration {i}: float16[2]" for i in range(3)
    )
    held = jsa.ScaleHistory(jnp.array([[4.0], [8.0], [64.0]], jnp.float32), history.sites)
    ys, new = jax.jit(step)(held, ws, v)
    np.testing.assert_array_equal(np.ravel(ys.scale), [4.0, 8.0, 64.0])
    np.testing.assert_array_equal(represented(ys), np.full((3, 2), 2.0))
    np.testing.assert_array_equal(new.scales[:, 0], [2.0, 2.0, 2.0])
    scans = [e for e in jax.make_jaxpr(step)(held, ws, v).jaxpr.eqns if e.primitive.name == "scan"]
    body = scans[0].params["jaxpr"].jaxpr
    assert not [e for e in body.eqns if e.primitive is dynamic_scale_p]
    assert [e for e in jax.make_jaxpr(step.init)(ws, v).jaxpr.eqns if e.primitive.name == "scan"]


def test_a_scan_within_a_scan_body_holds_a_scale_per_iteration_of_both():
    ws = jsa.as_scaled_array(jnp.ones((2, 2, 2), jnp.float16))
    v = jsa.as_scaled_array(jnp.ones((2,), jnp.float16))

    def f(ws, v):
        def outer(c, w):
            inner = jax.lax.scan(lambda d, _: (w @ d, None), c, None, length=3)[0]
            return w @ inner, None

        return jax.lax.scan(outer, v, ws)[0]

    out, history = jsa.delayed_scaling(f).init(ws, v)
    assert history.sites == tuple(
        f"scan 0 (2 iterations), iteration {i}: {site}"
        for i in range(2)
        for site in [
            *(f"scan 0 (3 iterations), iteration {j}: float16[2]" for j in range(3)),
            "float16[2]",
        ]
    )
    # 2^(4 i + j + 1): each product doubles the value.
    np.testing.assert_array_equal(history.scales[:, 0], [2, 4, 8, 16, 32, 64, 128, 256])
    y, new = jax.jit(jsa.delayed_scaling(f))(history, ws, v)
    np.testing.assert_array_equal(represented(y), np.full(2, 256.0))
    np.testing.assert_array_equal(represented(out), np.full(2, 256.0))
    np.testing.assert_array_equal(new.scales[:, 0], history.scales[:, 0])


def checkpointed_loss(params, x):
    """Each layer checkpointed (`jax.checkpoint`), in a scan over stacked layers: autodiff
    recomputes a layer inside a checkpoint of the backward scan's body."""

    def layer(h, p):
        return jax.nn.relu(h @ p["w"] + p["b"][None, :])

    h, _ = jax.lax.scan(lambda h, p: (jax.checkpoint(layer)(h, p), None), x, params)
    return jnp.mean(jnp.square(h))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("scale", [2.0**-20, 1.0, 2.0**20])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_checkpointed_layers_hold_their_scales_too(dtype, scale, jit):
    """The sums and contractions of a checkpointed function (the backward pass of a
    checkpointed layer, its forward recomputed) are rows of the history, in a scan's body
    too; a step at the held scales gives the dynamic step's values, and no dynamic scale
    is left in the checkpointed bodies."""
    from jax_scaled_arithmetics.core.scale_arithmetic import dynamic_scale_p

    params, x = stacked_inputs(dtype, scale)
    grad_step = jax.value_and_grad(checkpointed_loss)
    step = jsa.delayed_scaling(grad_step, history_length=2)
    _, history = jax.jit(step.init)(params, x)
    rows = [s for s in history.sites if ": checkpoint 0: " in s]
    assert len(rows) >= 3 * 4 and all(s.startswith("scan 1 (3 iterations)") for s in rows)
    x2 = check_a_step_from_a_larger_input(step, grad_step, history, params, x, dtype, jit)

    def checkpoint_bodies(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("checkpoint", "remat2", "remat"):
                yield eqn.params["jaxpr"]
            for value in eqn.params.values():
                sub = getattr(value, "jaxpr", value)  # a ClosedJaxpr's, or a Jaxpr
                if hasattr(sub, "eqns"):
                    yield from checkpoint_bodies(sub)

    bodies = list(checkpoint_bodies(jax.make_jaxpr(step)(history, params, x2).jaxpr))
    assert bodies and not any(e.primitive is dynamic_scale_p for b in bodies for e in b.eqns)


def test_a_checkpoint_at_the_top_level_is_a_group_of_rows():
    w = jsa.as_scaled_array(jnp.full((3, 3), 3.0, jnp.float16))
    v = jsa.as_scaled_array(jnp.ones((3,), jnp.float16))
    f = jax.grad(lambda w, v: jnp.sum(jax.checkpoint(lambda w, v: jnp.tanh(w @ v))(w, v)))
    _, history = jsa.delayed_scaling(f).init(w, v)
    assert any(s.startswith("checkpoint 0: ") for s in history.sites), history.sites
    got, _ = jax.jit(jsa.delayed_scaling(f))(history, w, v)
    assert_close(got, represented(jax.jit(jsa.autoscale(f))(w, v)), 1e-3)


def test_a_history_of_another_program_is_refused_naming_the_fix():
    step = jsa.delayed_scaling(lambda w, v: w @ v)
    w = jsa.as_scaled_array(jnp.ones((3, 3), jnp.float16))
    _, history = step.init(w, jnp.ones((3,), jnp.float16))
    with pytest.raises(
        ValueError,
        match=r"site 0 of the step is a sum or contraction of float16\[3, 3\] "
        r"here, float16\[3\] in the history.*`init`",
    ):
        step(history, w, jnp.ones((3, 3), jnp.float16))
    two = jsa.delayed_scaling(lambda w, v: w @ (w @ v))
    with pytest.raises(
        ValueError,
        match=r"site 1 of the step is a sum or contraction of float16\[3\] here, "
        r"no site in the history \(1 sites\)",
    ):
        two(history, w, jnp.ones((3,), jnp.float16))
    _, two_sites = two.init(w, jnp.ones((3,), jnp.float16))
    with pytest.raises(ValueError, match=r"2 sums and contractions in the history, 1 in this"):
        step(two_sites, w, jnp.ones((3,), jnp.float16))
    one = jsa.delayed_scaling(lambda ws, v: jax.lax.scan(lambda c, w: (w @ c, None), v, ws)[0])
    deeper = jsa.delayed_scaling(
        lambda ws, v: jax.lax.scan(lambda c, w: (w @ (w @ c), None), v, ws)[0]
    )
    ws = jsa.as_scaled_array(jnp.ones((2, 3, 3), jnp.float16))
    _, one_history = one.init(ws, jnp.ones((3,), jnp.float16))
    with pytest.raises(
        ValueError,
        match=r"site 1 of scan 0 \(2 iterations\) \(in the step\) is a sum or contraction of "
        r"float16\[3\] here, no site in the history \(1 sites\)",
    ):
        deeper(one_history, ws, jnp.ones((3,), jnp.float16))
    _, deeper_history = deeper.init(ws, jnp.ones((3,), jnp.float16))
    with pytest.raises(
        ValueError, match=r"1 sums and contractions in scan 0 \(2 iterations\) \(in the step\) "
    ):
        one(deeper_history, ws, jnp.ones((3,), jnp.float16))
    with pytest.raises(
        ValueError, match=r"site 0 of the step is 'scan 0 \(2 iterations\).*a scan of 3 iter"
    ):
        one(one_history, jsa.as_scaled_array(jnp.ones((3, 3, 3), jnp.float16)), jnp.ones(3))
    with pytest.raises(
        TypeError, match="first argument of a delayed_scaling step is its ScaleHistory"
    ):
        step(w, w, w)
    with pytest.raises(ValueError, match="called inside jsa.autoscale; call it outside"):
        jsa.autoscale(lambda a: step.init(a, a))(w)
    with pytest.raises(ValueError, match="history_length must be an int of at least 1"):
        jsa.delayed_scaling(lambda a: a, history_length=0)
    with pytest.raises(TypeError, match="margin must be an int"):
        jsa.delayed_scaling(lambda a: a, margin=0.5)


def test_history_is_a_pytree_with_static_sites():
    history = jsa.ScaleHistory(
        jnp.array([[1.0] * 4, [2.0] * 4], jnp.float32), ("float32[]", "float16[3]")
    )
    leaves, treedef = jax.tree_util.tree_flatten(history)
    assert len(leaves) == 1 and history.as_matrix().shape == (2, 4)
    doubled = jax.tree_util.tree_map(lambda a: 2 * a, history)
    assert doubled.sites == history.sites
    np.testing.assert_array_equal(np.asarray(doubled.as_matrix()), [[2.0] * 4, [4.0] * 4])
    assert jax.tree_util.tree_unflatten(treedef, leaves).sites == history.sites


def test_a_history_whose_scales_do_not_match_its_sites_is_refused():
    step = jsa.delayed_scaling(lambda w, v: w @ v)
    w = jsa.as_scaled_array(jnp.ones((2, 2), jnp.float16))
    v = jsa.as_scaled_array(jnp.ones((2,), jnp.float16))
    for scales in (jnp.ones((2, 4)), jnp.ones((4,)), jnp.ones((1, 0))):
        with pytest.raises(ValueError, match=r"one \[sites, length\] array: 1 sites here"):
            step(jsa.ScaleHistory(scales, ("float16[2]",)), w, v)


def test_data_stays_finite_while_outputs_grow_less_than_float16_range():
    """Held scales from a step 2^12 times smaller: float16 data up to 2^13, finite; the
    values are still the plain ones."""
    step = jsa.delayed_scaling(lambda w, v: w @ v)
    w = jsa.as_scaled_array(jnp.full((4, 4), 1.5, jnp.float16))
    _, history = step.init(w, jsa.as_scaled_array(jnp.ones((4,), jnp.float16)))
    v = jsa.scaled_array(jnp.ones((4,), jnp.float16), np.float32(2.0**12))
    y, _ = jax.jit(step)(history, w, v)
    assert np.all(np.isfinite(np.asarray(y.data, np.float32)))
    np.testing.assert_array_equal(represented(y), np.full(4, 6.0 * 2.0**12))


@pytest.mark.slow
def test_a_history_is_saved_and_restored_with_the_training_state(tmp_path):
    """`jsa.checkpoint` keeps a ScaleHistory bit-exact with its sites, and the restored
    history continues the run as the one in memory does."""
    step = jsa.delayed_scaling(lambda w, v: w @ v, history_length=4)
    w = jsa.as_scaled_array(jnp.full((2, 2), 3.0, jnp.float16))
    v = jsa.as_scaled_array(jnp.ones((2,), jnp.float16))
    _, history = step.init(w, v)
    _, history = step(history, w, 2 * v)
    jsa.checkpoint.save(tmp_path / "ckpt", {"w": w, "history": history})
    template = jax.eval_shape(lambda: {"w": w, "history": history})
    restored = jsa.checkpoint.restore(tmp_path / "ckpt", template)["history"]
    assert isinstance(restored, jsa.ScaleHistory) and restored.sites == history.sites
    np.testing.assert_array_equal(np.asarray(restored.as_matrix()), [[8.0, 4.0, 4.0, 4.0]])
    (y1, h1), (y2, h2) = step(history, w, 4 * v), step(restored, w, 4 * v)
    np.testing.assert_array_equal(np.asarray(y1.data), np.asarray(y2.data))
    np.testing.assert_array_equal(np.asarray(h1.as_matrix()), np.asarray(h2.as_matrix()))


def test_a_site_that_is_zero_at_init_holds_scale_one():
    """An all-zero output's dynamic scale is SCALE_MIN (it lifts no common scale), but its
    history records 1, as `scale_of_magnitude` maps no magnitude: held at SCALE_MIN, the
    site's first nonzero output would overflow float16."""
    step = jsa.delayed_scaling(lambda w, v: w @ v)
    w = jsa.as_scaled_array(jnp.full((4, 4), 1.5, jnp.float16))
    _, history = step.init(w, jsa.as_scaled_array(jnp.zeros((4,), jnp.float16)))
    np.testing.assert_array_equal(np.asarray(history.as_matrix()), np.ones((1, 16)))
    y, _ = jax.jit(step)(history, w, jsa.as_scaled_array(jnp.ones((4,), jnp.float16)))
    assert float(y.scale) == 1.0
    np.testing.assert_array_equal(represented(y), np.full(4, 6.0))
