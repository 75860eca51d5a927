"""Upper bounds on the largest magnitudes of a function's outputs from its inputs'
(`core/magnitude_bounds.py`): they hold, rule by rule and on the optax updates whose
states `scale_optimizer` stores with them; outputs of one structure share a computation;
what has no rule has no bound."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_scaled_arithmetics.analysis import equation_counts
from jax_scaled_arithmetics.core.magnitude_bounds import evaluate_with_bounds

RNG = np.random.default_rng(0)


def _bounds(fun, args, wanted=None):
    """`fun`'s outputs and `{position: bound}` for the outputs with a bound."""
    outs, bounds = evaluate_with_bounds(fun, args)
    wanted = range(len(outs)) if wanted is None else wanted
    found = {}
    for positions, vector in bounds.groups(list(wanted)):
        assert vector.shape == (len(positions),) and vector.dtype == jnp.float32
        found.update({p: float(b) for p, b in zip(positions, vector)})
    return outs, found


def _largest(x):
    return float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32))))


def _tensor(shape, exponent_range=(-20, 20)):
    """Random signs and magnitudes spread over `2^exponent_range`, some exact zeros."""
    exponents = RNG.uniform(*exponent_range, size=shape)
    values = np.sign(RNG.normal(size=shape)) * 2.0**exponents
    values[RNG.random(shape) < 0.1] = 0.0
    return jnp.asarray(values, jnp.float32)


A = jnp.array([[1.5, -3.0, 0.25], [2.0, 0.0, -0.5]])  # largest magnitude 3
B = jnp.array([[-2.0, 0.5, 4.0], [1.0, -1.0, 0.125]])  # largest magnitude 4


@pytest.mark.parametrize(
    "name, fun, expected",
    [
        ("sum", lambda a, b: a + b, 7.0),
        ("difference", lambda a, b: a - b, 7.0),
        ("product", lambda a, b: a * b, 12.0),
        ("by a literal", lambda a, b: a / 4.0, 0.75),
        ("negation", lambda a, b: -a, 3.0),
        ("square", lambda a, b: jnp.square(b), 16.0),
        ("cube", lambda a, b: a**3, 27.0),
        ("square root", lambda a, b: jnp.sqrt(jnp.abs(b)), 2.0),
        ("exp", lambda a, b: jnp.exp(a), float(np.float32(np.exp(3.0)))),
        ("tanh", lambda a, b: jnp.tanh(a * 100), 1.0),
        ("sign", lambda a, b: jnp.sign(a), 1.0),
        ("maximum", lambda a, b: jnp.maximum(a, b), 4.0),
        ("where", lambda a, b: jnp.where(a > b, a, b), 4.0),
        ("clamp", lambda a, b: jax.lax.clamp(-1.0, b, 2.0), 2.0),
        ("clip: a max, then a min", lambda a, b: jnp.clip(b, -1.0, 2.0), 4.0),
        ("concatenate", lambda a, b: jnp.concatenate([a, b]), 4.0),
        ("transpose and reshape", lambda a, b: a.T.reshape(-1)[::2], 3.0),
        ("row sums", lambda a, b: jnp.sum(a, axis=1), 9.0),
        ("contraction", lambda a, b: a @ b.T, 36.0),
        ("to bfloat16", lambda a, b: (a * 1.001).astype(jnp.bfloat16), 3.003 * (1 + 2**-7)),
        (
            "by a scalar's broadcast",
            lambda a, b: a / jnp.broadcast_to(jnp.sum(b), (2, 3)),
            3 / 2.625,
        ),
        ("reciprocal square", lambda a, b: a * (jnp.sum(b) ** -2), 3 / 2.625**2),
    ],
)
def test_each_rule_bounds_its_output(name, fun, expected):
    outs, found = _bounds(lambda a, b: [fun(a, b)], (A, B))
    np.testing.assert_allclose(found[0], expected, rtol=2e-6, err_msg=name)
    assert _largest(outs[0]) <= found[0], name


@pytest.mark.parametrize(
    "name, fun",
    [
        ("division by a tensor", lambda a, b: a / b),
        ("reciprocal square root of a tensor", lambda a, b: jax.lax.rsqrt(b)),
        ("logarithm", lambda a, b: jnp.log(jnp.abs(a) + 1.0)),
        ("negative power of a tensor", lambda a, b: b**-2),
        ("sort", lambda a, b: jnp.sort(a)),
        (
            "division by truncated values",  # trunc(0.5) is 0: no smallest magnitude kept
            lambda a, b: a / (jnp.broadcast_to(jnp.sum(b), (2, 3)).astype(jnp.int32) * 1.0),
        ),
    ],
)
def test_no_bound_without_a_rule(name, fun):
    _, found = _bounds(lambda a, b: [fun(a, b)], (A, B))
    assert found == {}, name


def test_scalars_enter_with_their_own_magnitude():
    """A scalar input (a learning rate, a step count) and a scalar computed from tensors (a
    global norm) bound as themselves: `g * (c / max(norm, c))` is at most `G`."""

    def clip(g, rate, count):
        norm = jnp.sqrt(jnp.sum(jnp.square(g)))
        clipped = g * (1.0 / jnp.maximum(norm, 1.0))
        return [clipped * rate / (1.0 - 0.9 ** count.astype(jnp.float32))]

    g = _tensor((8, 5))
    rate, count = jnp.float32(-0.01), jnp.int32(3)
    outs, found = _bounds(clip, (g, rate, count))
    norm = float(jnp.sqrt(jnp.sum(jnp.square(g))))
    expected = _largest(g) / max(norm, 1.0) * 0.01 / (1 - 0.9**3)
    np.testing.assert_allclose(found[0], expected, rtol=1e-5)
    assert _largest(outs[0]) <= found[0]


@pytest.mark.parametrize("flag", [False, True])
def test_a_choice_for_the_whole_tensor_bounds_as_the_chosen_case(flag):
    """`select_n` on a scalar predicate (or its broadcast: `jnp.where(flag, ...)`) takes one
    case for every element: its bound is that case's, chosen at run time, not the largest
    of the cases (optax's `clip_by_global_norm` selects the unclipped gradients or the
    clipped ones so)."""

    def choose(a, flag):
        return [jax.lax.select(flag, a * 1e6, a), jnp.where(flag, a * 1e6, a)]

    outs, found = _bounds(choose, (A, jnp.bool_(flag)))
    expected = 3e6 if flag else 3.0
    assert found == {0: pytest.approx(expected), 1: pytest.approx(expected)}
    assert all(_largest(out) <= found[i] for i, out in enumerate(outs))


def test_non_finite_inputs_enter_with_their_largest_finite_magnitude():
    """An element computed from an inf or NaN is not finite in the plain program either:
    the bound covers the others."""
    g = jnp.array([1.0, -jnp.inf, 2.0, jnp.nan])
    outs, found = _bounds(lambda g: [jnp.where(jnp.isfinite(g), 0.5 * g, 0.0)], (g,))
    assert found[0] == 1.0 and _largest(outs[0]) == 1.0


def test_bound_is_exact_where_the_largest_elements_align():
    """Adam's first moment from zero: `0.1 * max|g|`, computed as the value is."""
    g = _tensor((16, 4))
    mu = jnp.zeros_like(g)
    outs, found = _bounds(lambda m, g: [0.9 * m + 0.1 * g], (mu, g))
    assert found[0] == _largest(outs[0])


OPTIMIZERS = {
    "adam": (optax.adam(1e-3), ("mu", "nu")),
    "adamw": (optax.adamw(1e-3, weight_decay=0.1), ("mu", "nu")),
    "clipped adam": (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), ("mu", "nu")),
    "lion": (optax.lion(1e-4), ("mu",)),
    "nesterov sgd": (optax.sgd(0.1, momentum=0.9, nesterov=True), ("trace",)),
    "rmsprop": (optax.rmsprop(1e-3), ("nu",)),
    "adabelief": (optax.adabelief(1e-3), ("mu",)),
}


def _state_leaves(state, names):
    """The leaves of `state` under fields called `names` (with their flat positions)."""
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    return [
        i
        for i, (path, _) in enumerate(paths)
        if any(getattr(k, "name", None) in names for k in path)
    ]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_bounds_hold_over_optax_updates(name):
    """Several steps of each optimizer on tensors spanning 2^-20..2^20: every state leaf it
    keeps a moment in has a bound, at least its largest magnitude, and the leaves of one
    structure share one computation."""
    opt, moments = OPTIMIZERS[name]
    params = {"w": _tensor((12, 7)), "b": _tensor((7,)), "e": _tensor((5, 3, 2))}
    state = opt.init(params)
    for _ in range(3):
        grads = jax.tree_util.tree_map(lambda p: _tensor(p.shape), params)
        leaves, tree = jax.tree_util.tree_flatten((grads, state, params))

        def flat_update(*flat, tree=tree):
            g, s, p = jax.tree_util.tree_unflatten(tree, flat)
            return jax.tree_util.tree_leaves(opt.update(g, s, p))

        first = len(jax.tree_util.tree_leaves(grads))
        expected = [first + i for i in _state_leaves(state, moments)]
        outs, found = _bounds(flat_update, leaves, expected)
        assert sorted(found) == expected, name
        for position in expected:
            assert np.isfinite(found[position])
            assert _largest(outs[position]) <= found[position], name
        updates, state = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(opt.update(grads, state, params)), outs
        )
        params = optax.apply_updates(params, updates)


def test_leaves_of_one_structure_share_one_computation():
    """Adam's moments of 6 parameters: 2 groups (first and second moments), their inputs'
    largest magnitudes in one reduction, each group's bound computed once on vectors."""
    opt = optax.adam(1e-3)
    params = {f"p{i}": _tensor((4, i + 1)) for i in range(6)}
    state = opt.init(params)
    leaves, tree = jax.tree_util.tree_flatten((params, state, params))

    def flat_update(*flat):
        g, s, p = jax.tree_util.tree_unflatten(tree, flat)
        return jax.tree_util.tree_leaves(opt.update(g, s, p))

    def bounds_only(*flat):
        outs, bounds = evaluate_with_bounds(flat_update, flat)
        return [vector for _, vector in bounds.groups(range(len(outs)))]

    vectors = jax.eval_shape(bounds_only, *leaves)
    assert [v.shape for v in vectors] == [(6,), (6,)]
    counts = equation_counts(bounds_only, *leaves)
    assert counts["largest_finite_magnitudes"] == 1
    # Per group: 2 slices of the magnitudes, 3 products, a power (nu) and a sum; no
    # equation per parameter.
    assert counts["slice"] == 4 and counts["integer_pow"] == 2 + 2 * 6
