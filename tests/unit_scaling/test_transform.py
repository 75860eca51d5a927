"""`U.unit_scale`: the graph transform, checked against the same model written with U ops."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
import jax_scaled_arithmetics.unit_scaling as U
from jax_scaled_arithmetics.unit_scaling._residual_analysis import analyse

SEQ, D, VOCAB = 32, 64, 48
MATMUL = (((1,), (0,)), ((), ()))


def layer_norm(x):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5)


def normal(seed, shape, scale=1.0):
    """A normal draw from numpy (a `jax.random` draw compiles once per shape, ~10x an
    elementwise op)."""
    data = scale * np.random.default_rng(seed).standard_normal(shape)
    return jnp.asarray(data.astype(np.float32))


def init(seed, scale=0.02):
    names = ["wq", "wk", "wv", "wo", "w1", "w2", "wout"]
    shapes = [(D, D)] * 4 + [(D, 4 * D), (4 * D, D), (D, VOCAB)]
    params = {n: normal((seed, i), s, scale) for i, (n, s) in enumerate(zip(names, shapes))}
    params.update({n: jnp.asarray(np.zeros(size, np.float32)) for n, size in BIASES.items()})
    params["pos"] = normal((seed, len(names)), (SEQ, D), scale)
    return params


BIASES = {"bo": D, "b1": 4 * D, "b2": D}


def block(x, p):
    """A pre-norm transformer block (one sequence, one head)."""
    h = layer_norm(x)
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
    weights = jax.nn.softmax((q @ k.T) * (1.0 / math.sqrt(D)), axis=-1)
    x = x + ((weights @ v) @ p["wo"] + p["bo"][None, :])
    return x + (
        jax.nn.gelu(layer_norm(x) @ p["w1"] + p["b1"][None, :]) @ p["w2"] + p["b2"][None, :]
    )


def model(x, p):
    x = x + p["pos"]  # not a residual add: neither operand is computed from the other
    return layer_norm(block(x, p)) @ p["wout"]


def loss(x, p):
    return jnp.mean(model(x, p))


# The default "umup" rule, tau_i = 1/sqrt(L/2 + i) with L = 2 branches (the same as the
# running mean 1/sqrt(i + 1) for two branches).
UMUP_TAU = (1.0, 1.0 / math.sqrt(2.0))


def manual_model(
    x, p, tail_constraint=None, tau=UMUP_TAU, constraint="to_output_scale", attention="plain"
):
    """`model` written by hand with U ops: what unit_scale(model) must compute (with the
    default arguments: attention as written, `to_output_scale` constraints)."""

    def mm(a, b, constraint=constraint, constrain_rhs=False):
        if constrain_rhs and attention == "plain":
            return a @ b  # a product of two activations: kept as written
        return U.dot_general(a, b, MATMUL, constraint=constraint, constrain_rhs=constrain_rhs)

    def bias(b):  # summed over the rows on the way back: unit-scaled like a weight gradient
        return U.scale_bwd(b[None, :], 1.0 / math.sqrt(SEQ))

    x = x + p["pos"]
    residual, skip = U.residual_split(x, tau[0])
    h = layer_norm(residual)
    q, k, v = mm(h, p["wq"]), mm(h, p["wk"]), mm(h, p["wv"])
    scores = mm(q, k.T, constrain_rhs=True) * (1.0 / math.sqrt(D))
    if attention == "plain":
        weights = jax.nn.softmax(scores, axis=-1)
    else:
        weights = U.softmax(scores, axis=-1, constraint=constraint)
    x = U.residual_add(
        mm(mm(weights, v, constrain_rhs=True), p["wo"]) + bias(p["bo"]), skip, tau[0]
    )
    residual, skip = U.residual_split(x, tau[1])
    hidden = U.gelu(mm(layer_norm(residual), p["w1"]) + bias(p["b1"]), constraint=constraint)
    x = U.residual_add(mm(hidden, p["w2"]) + bias(p["b2"]), skip, tau[1])
    return mm(layer_norm(x), p["wout"], constraint=tail_constraint)


def manual_loss(x, p):
    logits = manual_model(x, p)
    return U.scale_bwd(jnp.sum(logits), float(logits.size)) / logits.size


@pytest.fixture(scope="module")
def inputs():
    # Jitted (one compile; eager, each operation on each leaf's shape is one), with an
    # `is_bias` that needs no values (the default reads them on the host). Every rank-1 leaf
    # here is a zero bias, as the default finds; test_unit_init_unit_weights_zero_biases_ones_kept
    # runs the default.
    unit_init = jax.jit(functools.partial(U.unit_init, is_bias=lambda v: True))
    params = unit_init(init(0))
    x = normal(1, (SEQ, D))
    return x, params


def _close(a, b, rtol=2e-5, atol=2e-6):
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol)


# --- what the transform finds --------------------------------------------------------------


def test_finds_the_residual_adds_of_a_pre_norm_block_and_leaves_other_adds(inputs):
    x, params = inputs
    jaxpr = jax.make_jaxpr(model)(x, params).jaxpr
    context = analyse(jaxpr, "search")
    adds = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "add"]
    residual = sorted(context.residual)
    assert len(residual) == 2
    # The two residual adds are the block's: their skip operand is the stream entering it.
    first, second = (jaxpr.eqns[i] for i in residual)
    stream_in = jaxpr.eqns[adds[0]].outvars[0]  # x + pos, the first add of the program
    assert first.invars[context.residual[residual[0]]] is stream_in
    assert second.invars[context.residual[residual[1]]] is first.outvars[0]
    # Not residual: the position-embedding add, the three bias adds, the adds inside GELU.
    assert adds[0] not in context.residual
    assert len(adds) - len(residual) >= 1 + 3 + 2
    # The tail after the final residual add: final layer norm, readout; nothing before it.
    assert context.tail and min(context.tail) > residual[-1]
    tail_prims = {jaxpr.eqns[i].primitive.name for i in context.tail}
    assert "dot_general" in tail_prims and "rsqrt" in tail_prims


@pytest.mark.slow
def test_transformed_model_equals_the_model_written_with_unit_scaled_ops(inputs):
    x, params = inputs
    cotangent = normal(2, (SEQ, VOCAB))

    # One compile each (eagerly, every operation of the model is a compile of its own).
    @functools.partial(jax.jit, static_argnums=0)
    def value_and_vjp(fn, x, params):
        out, vjp = jax.vjp(fn, x, params)
        return out, vjp(cotangent)

    ours, ours_grads = value_and_vjp(U.unit_scale(model), x, params)
    manual, manual_grads = value_and_vjp(manual_model, x, params)
    _close(ours, manual)
    _close(ours_grads, manual_grads)


@pytest.mark.slow
def test_final_layer_is_unconstrained_and_the_mean_scales_the_forward_only(inputs):
    x, params = inputs
    grads = jax.grad(U.unit_scale(loss), argnums=(0, 1))(x, params)
    _close(grads, jax.grad(manual_loss, argnums=(0, 1))(x, params))
    # Constrained readout would tie its input gradient to its output factor: different.
    constrained = jax.grad(lambda x, p: jnp.mean(manual_model(x, p, "gmean")))(x, params)
    assert not np.allclose(grads[0], constrained)
    # The loss value is the true mean of the logits.
    np.testing.assert_allclose(U.unit_scale(loss)(x, params), jnp.mean(manual_model(x, params)))
    # The readout's weight gradient is of order one, not 1/N as with the plain mean.
    assert 0.1 < float(jnp.std(grads[1]["wout"])) < 10.0


@pytest.mark.slow
def test_unit_scaled_model_keeps_activations_and_gradients_near_unit(inputs):
    x, params = inputs
    out, vjp = jax.vjp(U.unit_scale(model), x, params)
    cotangent = normal(3, out.shape)
    gx, gp = vjp(cotangent)
    assert 0.8 < float(jnp.std(out)) < 1.25
    assert 0.5 < float(jnp.std(gx)) < 1.25
    # Measured: 0.23 (wq, wk: the attention is near uniform at initialisation) to 0.97 (wout).
    stds = {name: float(jnp.std(g)) for name, g in gp.items()}
    assert all(0.1 < std < 1.5 for std in stds.values()), stds
    # The plain model at its usual initialisation: gradients of 0.0007 (wq) to 5.5 (wout).
    _, plain_vjp = jax.vjp(model, x, init(0))
    plain = {name: float(jnp.std(g)) for name, g in plain_vjp(cotangent)[1].items()}
    assert min(plain.values()) < 0.01 and max(plain.values()) > 3.0, plain


@pytest.mark.slow
def test_fixed_tau_is_used_for_every_residual_add(inputs):
    x, params = inputs
    ours = U.unit_scale(model, tau=0.5)
    _close(ours(x, params), manual_model(x, params, tau=(0.5, 0.5)))


def _stack(x, p, layers=3):
    """`layers` blocks sharing their parameters: 2 * layers residual branches."""
    for _ in range(layers):
        x = block(x, p)
    return x


@pytest.mark.slow
def test_tau_rules_weigh_each_branch_by_its_index_and_kind(inputs):
    x, params = inputs
    seen = []

    def rule(index, kinds):
        seen.append((index, kinds))
        return 0.3 + 0.1 * index

    U.unit_scale(_stack, tau=rule)(x, params)
    kinds = ("attention", "mlp") * 3
    assert seen == [(i, kinds) for i in range(6)]
    # Each named rule is the function of its definition.
    named = {
        "umup": lambda i, kinds: 1.0 / math.sqrt(len(kinds) / 2 + i),
        "running_mean": lambda i, kinds: 1.0 / math.sqrt(i + 1),
        "reference": lambda i, kinds: 0.01 if kinds[i] == "attention" else 0.5,
    }
    for name, fn in named.items():
        _close(U.unit_scale(_stack, tau=name)(x, params), U.unit_scale(_stack, tau=fn)(x, params))
    assert not np.allclose(
        U.unit_scale(_stack, tau="umup")(x, params),
        U.unit_scale(_stack, tau="running_mean")(x, params),
    )


@pytest.mark.slow
def test_a_bias_enters_its_matmul_s_scaled_product(inputs):
    x, params = inputs
    # Non-zero biases (after training): each is multiplied by its matmul's forward factor
    # (to_output_scale: 1/sqrt(fan-in)), as the reference's `U.linear` adds its bias.
    trained = dict(params, bo=jnp.ones(D), b1=jnp.full(4 * D, 0.5), b2=jnp.full(D, -1.0))
    scaled = dict(
        trained,
        bo=trained["bo"] / math.sqrt(D),
        b1=trained["b1"] / math.sqrt(D),
        b2=trained["b2"] / math.sqrt(4 * D),
    )
    _close(U.unit_scale(model)(x, trained), manual_model(x, scaled))
    # The biases' gradients are those of the function written with the scaled biases, times
    # the factors (a forward-only scaling): the same direction.
    cotangent = normal(2, (SEQ, VOCAB))
    ours = jax.vjp(lambda p: U.unit_scale(model)(x, p), trained)[1](cotangent)[0]
    manual = jax.vjp(lambda p: manual_model(x, p), scaled)[1](cotangent)[0]
    for name in ("bo", "b1", "b2"):
        _close(
            ours[name] / jnp.linalg.norm(ours[name]), manual[name] / jnp.linalg.norm(manual[name])
        )


def test_a_stream_given_as_input_is_a_skip_not_a_bias(inputs):
    x, _ = inputs
    w = jnp.zeros((D, D))  # the branch is zero: the output is the skip's share, b * x

    def residual_block(stream, w):
        return stream + jnp.tanh(stream @ w) @ w

    tau = 1.0 / math.sqrt(0.5)  # u-muP's rule for the first of L = 1 branches
    _close(U.unit_scale(residual_block)(x, w), x / math.sqrt(1.0 + tau**2))


@pytest.mark.slow
def test_umup_readout_divides_the_logits_by_the_square_root_of_the_fan_in_again(inputs):
    x, params = inputs
    unit, umup = (U.unit_scale(model, readout=r)(x, params) for r in ("unit", "umup"))
    _close(umup, unit / math.sqrt(D))
    # Only the forward pass: the weight gradients are those of the unit readout's function
    # times one constant (an unconstrained tail).
    cotangent = normal(2, (SEQ, VOCAB))
    g_unit = jax.vjp(lambda p: U.unit_scale(model)(x, p), params)[1](cotangent)[0]
    g_umup = jax.vjp(lambda p: U.unit_scale(model, readout="umup")(x, p), params)[1](cotangent)[0]
    _close(g_umup, g_unit)


@pytest.mark.slow
def test_unit_attention_gmean_and_running_mean_give_the_model_written_so(inputs):
    x, params = inputs
    ours = U.unit_scale(model, tau="running_mean", constraint="gmean", attention="unit")
    manual = functools.partial(manual_model, constraint="gmean", attention="unit")
    _close(ours(x, params), manual(x, params))
    cotangent = normal(2, (SEQ, VOCAB))
    _close(jax.vjp(ours, x, params)[1](cotangent), jax.vjp(manual, x, params)[1](cotangent))


def test_replace_swaps_a_user_function(inputs):
    x, params = inputs

    def my_norm(v):
        return layer_norm(v)

    def f(v, w):
        return my_norm(v) @ w

    calls = []

    def replacement(v):
        calls.append(v.shape)
        return 2.0 * v

    out = U.unit_scale(f, replace={my_norm: replacement})(x, params["wq"])
    expected = U.dot_general(2.0 * x, params["wq"], MATMUL)
    _close(out, expected)
    assert calls == [(SEQ, D)]


def test_replace_a_recognised_library_function(inputs):
    x, _ = inputs
    out = U.unit_scale(jax.nn.gelu, replace={jax.nn.gelu: jnp.tanh})(x)
    _close(out, jnp.tanh(x))


def test_jitted_library_function_recognised_by_name(inputs):
    x, params = inputs
    out = U.unit_scale(lambda v, w: jax.nn.silu(v @ w))(x, params["wq"])
    # The only matmul is the readout: it and the silu after it are unconstrained.
    _close(out, U.silu(U.dot_general(x, params["wq"], MATMUL, constraint=None), constraint=None))


def test_primitives_without_unit_scaled_version_pass_through(inputs):
    x, params = inputs
    f = U.unit_scale(lambda v, w: jnp.sin(v) @ w + jnp.cos(v))
    _close(f(x, params["wq"]), U.dot_general(jnp.sin(x), params["wq"], MATMUL) + jnp.cos(x))


def test_control_flow_bodies_are_transformed(inputs):
    x, params = inputs
    w = params["wq"]

    def scanned(v, w):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), v, None, length=3)[0]

    def unrolled(v, w):
        for _ in range(3):
            v = jnp.tanh(U.dot_general(v, w, MATMUL))
        return v

    _close(U.unit_scale(scanned)(x, w), unrolled(x, w))

    def with_cond(v, w):
        return jax.lax.cond(v.sum() > 0, lambda a: a @ w, lambda a: -(a @ w), v)

    direction = jnp.where(x.sum() > 0, 1.0, -1.0)
    _close(U.unit_scale(with_cond)(x, w), direction * U.dot_general(x, w, MATMUL))

    def looped(v, w):
        return jax.lax.fori_loop(0, 2, lambda i, c: jnp.tanh(c @ w), v)

    _close(
        U.unit_scale(looped)(x, w),
        unrolled(unrolled(x, w)[:0].sum() + x, w)[:] * 0 + looped_ref(x, w),
    )


def looped_ref(x, w):
    for _ in range(2):
        x = jnp.tanh(U.dot_general(x, w, MATMUL))
    return x


# --- bad input ------------------------------------------------------------------------------


def test_bad_input_errors(inputs):
    x, params = inputs
    with pytest.raises(TypeError, match="expects a callable"):
        U.unit_scale(3)
    with pytest.raises(TypeError, match="`replace` key must be the function"):
        U.unit_scale(model, replace={"gelu": jnp.tanh})
    with pytest.raises(TypeError, match="replacement of 'gelu' must be callable"):
        U.unit_scale(model, replace={jax.nn.gelu: 2.0})
    with pytest.raises(ValueError, match="nothing to unit-scale"):
        U.unit_scale(lambda v: jnp.sin(v) + 1.0)(x)
    with pytest.raises(ValueError, match="tau must be a positive number"):
        U.unit_scale(model, tau=-1.0)
    with pytest.raises(ValueError, match="constraint"):
        U.unit_scale(model, constraint="sideways")
    with pytest.raises(ValueError, match="tau must be a positive number, one of"):
        U.unit_scale(model, tau="deep")
    with pytest.raises(ValueError, match=r"tau\(1, \.\.\.\) gave -0.5; it must be positive"):
        U.unit_scale(model, tau=lambda i, kinds: 1.0 - 1.5 * i)(x, params)
    with pytest.raises(ValueError, match="readout must be 'unit' or 'umup'"):
        U.unit_scale(model, readout="mup")
    with pytest.raises(ValueError, match="attention must be 'plain' or 'unit'"):
        U.unit_scale(model, attention="fused")
    with pytest.raises(ValueError, match="returned shape"):
        U.unit_scale(jax.nn.gelu, replace={jax.nn.gelu: lambda v: v[:1]})(x)


# --- nesting ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_nests_with_jit_both_orders(inputs):
    x, params = inputs
    reference = U.unit_scale(loss)
    value, grads = jax.value_and_grad(reference, argnums=(0, 1))(x, params)
    for fn in (jax.jit(reference), U.unit_scale(jax.jit(loss))):
        v, g = jax.value_and_grad(fn, argnums=(0, 1))(x, params)
        _close(v, value)
        _close(g, grads)
    v, g = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(x, params)
    _close((v, g), (value, grads))


# Jitted: four large programs; jit outside `jax.grad(U.unit_scale(f))` and
# `jax.value_and_grad`, and `U.unit_scale(jax.jit(loss))`, are in the default run's
# test_nests_with_jit_both_orders.
@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_grad_outside_the_transform(inputs, jit):
    """`jax.grad(U.unit_scale(f))` (and `jax.value_and_grad`, any `argnums`/`has_aux`,
    jitted inside or outside) differentiates the unit-scaled function: not the plain
    gradient, the same with the loss jitted inside."""
    x, params = inputs
    maybe_jit = jax.jit if jit else (lambda f: f)
    expected = jax.grad(U.unit_scale(loss), argnums=1)(x, params)
    # Not the plain gradient: the unit-scaled one (a readout gradient of order one).
    assert not np.allclose(expected["wout"], jax.grad(loss, argnums=1)(x, params)["wout"])
    _close(maybe_jit(jax.grad(U.unit_scale(loss), argnums=1))(x, params), expected)
    _close(maybe_jit(jax.grad(U.unit_scale(jax.jit(loss)), argnums=1))(x, params), expected)
    value, grads = maybe_jit(jax.value_and_grad(U.unit_scale(loss), argnums=(0, 1)))(x, params)
    _close(value, U.unit_scale(loss)(x, params))
    _close(grads[1], expected)

    def with_aux(v, p):
        out = model(v, p)
        return jnp.mean(out), {"logits_std": jnp.std(out)}

    got, aux = maybe_jit(jax.grad(U.unit_scale(with_aux), argnums=1, has_aux=True))(x, params)
    _close(got, expected)
    assert set(aux) == {"logits_std"}


@pytest.mark.slow
def test_a_traced_gradient_is_refused_naming_the_order_to_use(inputs):
    """A function whose program computes a gradient (`jax.grad` or `jax.value_and_grad` of
    a loss, a training step, `jax.vjp`) has lost which backward equation belongs to which
    op: a ValueError saying to write `jax.grad(U.unit_scale(f))` (was, for `jax.grad`: the
    loss recovered by differentiating candidates again and comparing printed programs)."""
    x, params = inputs

    def train_step(v, p):
        grads = jax.grad(loss, argnums=1)(v, p)
        return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, p, grads)

    refused = {
        "grad": jax.grad(loss, argnums=1),
        "jit(grad)": jax.jit(jax.grad(loss, argnums=1)),
        "value_and_grad": jax.value_and_grad(loss, argnums=(0, 1)),
        "grad of an autoscaled loss": jax.grad(jsa.autoscale(loss), argnums=1),
        "grad of an FP8 loss": jax.grad(jsa.ops.simulate_fp8(loss), argnums=1),
        "train step": train_step,
        "jit(train step)": jax.jit(train_step),
        "vjp": lambda v, p: jax.vjp(lambda q: loss(v, q), p)[1](jnp.float32(1.0)),
    }
    for name, fn in refused.items():
        with pytest.raises(
            ValueError,
            match=r"unit_scale: .* computes a gradient .* apply jax.grad outside, "
            r"`jax.grad\(unit_scale\(f\)\)`",
        ):
            U.unit_scale(fn)(x, params)
        with pytest.raises(ValueError, match=r"simulate_fp8: .* `jax.grad\(simulate_fp8\(f\)\)`"):
            jsa.ops.simulate_fp8(fn)(x, params)
        assert name  # every case checked


def test_a_jitted_transform_is_looked_through(inputs):
    """`jax.jit` copies the attributes of the function it wraps, the way `jsa.autoscale`
    and `jsa.ops.simulate_fp8` declare how to re-apply themselves included: `unit_scale` of a
    jitted autoscaled (or FP8) loss is the transform of the unit-scaled loss."""
    x, params = inputs
    for transform in (jsa.autoscale, jsa.ops.simulate_fp8):
        _close(
            U.unit_scale(jax.jit(transform(loss)))(x, params),
            transform(U.unit_scale(loss))(x, params),
        )


@pytest.mark.slow
def test_nests_with_vmap_both_orders(inputs):
    """`jax.vmap(U.unit_scale(f))` and `U.unit_scale(jax.vmap(f))` give the same values and
    gradients: the weights the vmap shares between examples get the gradient factor of all
    the rows (the transform sees one example's shapes and counts the vmap's examples)."""
    x, params = inputs
    xs = jnp.stack([x, -x, 0.5 * x])
    cotangent = normal(7, xs.shape)
    inner = U.unit_scale(lambda v, p: block(v, p))
    outer = jax.vmap(inner, in_axes=(0, None))
    both = U.unit_scale(jax.vmap(lambda v, p: block(v, p), in_axes=(0, None)))

    # Each side's values and gradients in one jitted program (one compile; eagerly, each
    # vmapped operation is one): the transforms trace the same under `jax.jit`.
    @jax.jit
    def values_and_grads(xs, params, cotangent):
        grads = [
            jax.grad(lambda v, p, f=f: jnp.sum(f(v, p) * cotangent), argnums=(0, 1))(xs, params)
            for f in (outer, both)
        ]
        per_example = jnp.stack([inner(v, params) for v in xs])
        # Not the per-example factor: a shared weight's gradient sums over 3x the rows.
        per_example_grad = sum(
            jax.grad(lambda p, v=v, c=c: jnp.sum(inner(v, p) * c))(params)["w1"]
            for v, c in zip(xs, cotangent)
        )
        return outer(xs, params), both(xs, params), per_example, grads, per_example_grad

    out_outer, out_both, per_example, grads, per_example_grad = values_and_grads(
        xs, params, cotangent
    )
    _close(out_outer, out_both)
    _close(out_outer, per_example)
    _close(grads[0], grads[1])
    _close(grads[0][1]["w1"] * math.sqrt(len(xs)), per_example_grad)


@pytest.mark.slow  # one vmap in both orders stays in the default run
def test_nests_with_nested_vmaps_of_a_loss_in_every_order(inputs):
    """Two vmaps of a mean loss, inside, outside and around the transform: same losses,
    same gradients (the `1/N` of each example's mean acts on the forward pass only)."""
    x, params = inputs
    xs = jnp.stack([jnp.stack([x, -x, 0.5 * x]), jnp.stack([2.0 * x, x, -0.5 * x])])

    def over_examples(f):
        return jax.vmap(jax.vmap(f, in_axes=(0, None)), in_axes=(0, None))

    orders = {
        "outside": over_examples(U.unit_scale(loss)),
        "inside": U.unit_scale(over_examples(loss)),
        "around": jax.vmap(U.unit_scale(jax.vmap(loss, in_axes=(0, None))), in_axes=(0, None)),
    }
    results = {
        name: jax.value_and_grad(lambda v, p, f=f: jnp.sum(f(v, p)), argnums=(0, 1))(xs, params)
        for name, f in orders.items()
    }
    for name in ("inside", "around"):
        _close(results[name], results["outside"])
    # The value is the sum of the unit-scaled model's losses, example by example.
    single = U.unit_scale(loss)
    _close(results["outside"][0], sum(single(v, params) for row in xs for v in row))


# float16 in the default run (the format of limited range, at scale 2**-20); bfloat16 data
# through unit_scale: test_low_precision_inputs_keep_their_dtype.
@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(jnp.float32, marks=pytest.mark.slow),
        jnp.float16,
        pytest.param(jnp.bfloat16, marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow
def test_nests_with_autoscale_both_orders(inputs, dtype):
    x, params = inputs
    scale = 2.0**-20
    sx = jsa.scaled_array(x.astype(dtype), scale)
    sp = jax.tree_util.tree_map(lambda v: jsa.as_scaled_array(v.astype(dtype)), params)

    def f(v, p):
        return block(v, p)

    expected = U.unit_scale(f)(
        sx.to_array(jnp.float32),
        jax.tree_util.tree_map(lambda v: v.to_array(jnp.float32), sp, is_leaf=jsa.is_scaled_leaf),
    )
    # Jitted (one compile each; eagerly, each scaled operation is several): the transforms
    # trace the same under `jax.jit`.
    first = jax.jit(jsa.autoscale(U.unit_scale(f)))(sx, sp)
    second = jax.jit(U.unit_scale(jsa.autoscale(f)))(sx, sp)
    tol = {jnp.float32: 1e-4, jnp.float16: 2e-2, jnp.bfloat16: 1e-1}[dtype]
    for out in (first, second):
        assert isinstance(out, jsa.ScaledArray)
        assert bool(jnp.all(jnp.isfinite(out.to_array(jnp.float32))))
        np.testing.assert_allclose(out.to_array(jnp.float32), expected, rtol=tol, atol=tol)


def test_nests_with_simulate_fp8_both_orders(inputs):
    x, params = inputs
    a = jsa.ops.simulate_fp8(U.unit_scale(loss))
    b = U.unit_scale(jsa.ops.simulate_fp8(loss))
    va, ga = jax.value_and_grad(a, argnums=1)(x, params)
    vb, gb = jax.value_and_grad(b, argnums=1)(x, params)
    _close(va, vb)
    _close(ga, gb)
    # And the casts are there: the values differ from the unit-scaled loss without FP8.
    assert not np.allclose(va, U.unit_scale(loss)(x, params), rtol=1e-4)
    # jax.grad goes outside both (inside either, it is refused: see above).
    with pytest.raises(ValueError, match=r"jax.grad\(simulate_fp8\(f\)\)"):
        jsa.ops.simulate_fp8(jax.grad(U.unit_scale(loss), argnums=1))(x, params)


# --- unit_init ----------------------------------------------------------------------------------


def test_unit_init_unit_weights_zero_biases_ones_kept():
    params = init(0)
    params["b1"] = jnp.full((4 * D,), 0.3)
    params["gain"] = jnp.ones((D,))
    out = U.unit_init(params)
    np.testing.assert_allclose(float(jnp.std(out["w1"])), 1.0, rtol=1e-5)
    np.testing.assert_allclose(
        out["w1"] * jnp.std(params["w1"]), params["w1"], rtol=1e-5, atol=1e-7
    )
    assert float(jnp.abs(out["b1"]).max()) == 0.0
    np.testing.assert_array_equal(out["gain"], params["gain"])
    kept = U.unit_init(params, is_bias=lambda v: False)
    np.testing.assert_array_equal(kept["b1"], params["b1"])
    assert U.unit_init({"n": 3, "i": jnp.arange(3)})["i"].dtype == jnp.arange(3).dtype


def test_gains_and_biases_broadcast_over_rows_get_unit_gradients(inputs):
    x, params = inputs
    gain = jnp.ones((D,)) * 1.5
    bias = jnp.zeros((D,))

    def f(v, g, b, w):
        return (v * g[None, :] + b[None, :]) @ w

    def manual(v, g, b, w):
        rows = 1.0 / math.sqrt(SEQ)
        scaled = v * U.scale_bwd(g[None, :], rows) + U.scale_bwd(b[None, :], rows)
        return U.dot_general(scaled, w, MATMUL)

    args = (x, gain, bias, params["wq"])
    out, vjp = jax.vjp(U.unit_scale(f), *args)
    expected, manual_vjp = jax.vjp(manual, *args)
    _close(out, expected)
    cotangent = normal(4, out.shape)
    grads = vjp(cotangent)
    _close(grads, manual_vjp(cotangent))
    assert 0.5 < float(jnp.std(grads[1])) < 2.0 and 0.5 < float(jnp.std(grads[2])) < 2.0


def test_without_residual_adds_the_readout_is_the_unconstrained_tail(inputs):
    x, params = inputs

    def mlp(v, w1, w2):
        return jnp.mean(jax.nn.gelu(v @ w1) @ w2)

    def manual(v, w1, w2):
        hidden = U.gelu(
            U.dot_general(v, w1, MATMUL, constraint="to_output_scale"), constraint="to_output_scale"
        )
        logits = U.dot_general(hidden, w2, MATMUL, constraint=None)
        return U.scale_bwd(jnp.sum(logits), float(logits.size)) / logits.size

    args = (x, params["w1"], params["w2"])
    value, grads = jax.value_and_grad(U.unit_scale(mlp), argnums=(0, 1, 2))(*args)
    expected_value, expected = jax.value_and_grad(manual, argnums=(0, 1, 2))(*args)
    _close(value, expected_value)
    _close(grads, expected)


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float16, marks=pytest.mark.slow), jnp.bfloat16])
@pytest.mark.slow
def test_low_precision_inputs_keep_their_dtype(inputs, dtype):
    x, params = inputs
    low = jax.tree_util.tree_map(lambda v: v.astype(dtype), (x, params))

    # The values and gradients in one jitted program per dtype (eagerly, each operation on
    # the low-precision shapes is a compile of its own).
    @jax.jit
    def value_and_vjp(x, params, cotangent):
        out, vjp = jax.vjp(U.unit_scale(model), x, params)
        return out, vjp(cotangent.astype(out.dtype))

    cotangent = normal(5, (SEQ, VOCAB))
    out, grads = value_and_vjp(*low, cotangent)
    assert out.dtype == dtype
    expected, reference = value_and_vjp(x, params, cotangent)
    tol = 0.1 if dtype == jnp.bfloat16 else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=tol, atol=tol)
    assert all(g.dtype == dtype for g in jax.tree_util.tree_leaves(grads))
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(reference)):
        assert bool(jnp.all(jnp.isfinite(g)))
        scale = float(jnp.std(r)) + 1e-6
        assert float(jnp.std(g.astype(jnp.float32) - r)) < 0.1 * scale
