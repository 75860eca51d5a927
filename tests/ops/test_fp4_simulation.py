"""`jsa.ops.simulate_fp4`: the linear-layer matmuls as `jsa.ops.fp4_matmul`, the rest kept."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.ops import fp4_simulation

RNG = np.random.default_rng(0)
X = RNG.standard_normal((32, 32)).astype(np.float32)
PARAMS = [(RNG.standard_normal((32, 48)) / 6).astype(np.float32) for _ in range(3)]
PARAMS[1] = (RNG.standard_normal((48, 64)) / 7).astype(np.float32)
PARAMS[2] = (RNG.standard_normal((64, 16)) / 8).astype(np.float32)
KEY = jax.random.key(3)


def _rng(seed: int) -> np.random.Generator:
    """A generator of the test's own: draws that do not depend on which tests ran before
    in the same process (the module-level RNG only draws the shared operands above)."""
    return np.random.default_rng(seed)


def mlp(x, params, matmul=jnp.matmul):
    for i, w in enumerate(params):
        x = matmul(i, x, w)
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x


def plain(i, x, w):
    return x @ w


def loss(x, params, matmul=plain):
    return jnp.mean(mlp(x, params, matmul) ** 2)


def by_hand(keep, key=KEY, **options):
    """The MLP with `nvfp4_matmul` where `keep(i)` is False, key fold_in(key, i)."""

    def matmul(i, x, w):
        if keep(i):
            return x @ w
        return jsa.ops.nvfp4_matmul(x, w, jax.random.fold_in(key, i), **options)

    return matmul


@pytest.mark.parametrize(
    "high_precision, keep",
    [
        ("first_and_last", lambda i: i in (0, 2)),
        # high_precision=None and predicates: also in the default run's test_other_recipes
        # (None); the slow step runs these.
        pytest.param(None, lambda i: False, marks=pytest.mark.slow),
        pytest.param(
            lambda index, count: index == count - 1, lambda i: i == 2, marks=pytest.mark.slow
        ),
    ],
    ids=["first_and_last", "none", "predicate"],
)
@pytest.mark.slow
def test_value_and_gradients_are_the_recipe_on_the_chosen_matmuls(high_precision, keep):
    simulated = jsa.ops.simulate_fp4(loss, high_precision=high_precision)
    value, grads = jax.jit(jax.value_and_grad(lambda p, k: simulated(X, p, key=k)))(PARAMS, KEY)
    # The reference in one compile (eagerly, each operation of the quantisers is one).
    ref_value, ref_grads = jax.jit(jax.value_and_grad(lambda p: loss(X, p, by_hand(keep))))(PARAMS)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
    # And the simulation is not the plain program (unless every matmul is kept).
    assert not np.allclose(value, loss(X, PARAMS))


@pytest.mark.slow  # the default run passes options through test_other_recipes
def test_options_reach_every_matmul():
    off = {"hadamard": False, "stochastic_gradients": False, "weight_blocks": "1d"}
    simulated = jsa.ops.simulate_fp4(loss, high_precision=None, **off)
    grads = jax.grad(lambda p: simulated(X, p))(PARAMS)  # no key needed with both off
    ref = jax.grad(lambda p: loss(X, p, by_hand(lambda i: False, **off)))(PARAMS)
    for g, r in zip(grads, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "recipe, options",
    [
        # MXFP4's recipe runs by default in tests/ops/test_fp4_matmul.py; through the
        # transform (options passed on) in the slow step.
        pytest.param(
            "mxfp4", {"scale_rounding": "floor", "weight_blocks": "1d"}, marks=pytest.mark.slow
        ),
        ("fp4_tensor", {"hadamard": False, "stochastic_gradients": False}),
    ],
)
def test_other_recipes(recipe, options):
    """MXFP4 (blocks of 32: the 32x48 matmul stays exact) and per-tensor E2M1."""
    rng = _rng(1)
    params = [
        (rng.standard_normal(shape) / 6).astype(np.float32)
        for shape in ((32, 64), (64, 32), (32, 48))
    ]
    simulated = jsa.ops.simulate_fp4(loss, recipe=recipe, high_precision=None, **options)
    grads = jax.jit(jax.grad(lambda p, k: simulated(X, p, key=k)))(params, KEY)
    block = 32 if recipe == "mxfp4" else 16

    def matmul(i, x, w):
        if w.shape[1] % block:
            return x @ w
        return jsa.ops.fp4_matmul(x, w, jax.random.fold_in(KEY, i), recipe=recipe, **options)

    # References jitted: eagerly, each operation of the quantisers is a compile of its own.
    ref = jax.jit(jax.grad(lambda p: loss(X, p, matmul)))(params)
    for g, r in zip(grads, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
    exact = jax.jit(jax.grad(lambda p: loss(X, p)))(params)
    assert not np.allclose(grads[1], exact[1], rtol=1e-2)  # quantised
    if recipe == "mxfp4":  # the N = 48 matmul kept: its weight gradient has exact operands
        # (its input, the second matmul's output, is still the quantised one's)
        assert fp4_simulation._count_linear(jax.make_jaxpr(loss)(X, params).jaxpr, 32) == 2


def test_other_matmuls_are_kept():
    """Attention's batched products and shapes 16 does not divide stay exact."""

    def attention(q, k):
        return jnp.einsum("bqd,bkd->bqk", q, k)

    q = _rng(3).standard_normal((2, 16, 32)).astype(np.float32)
    np.testing.assert_array_equal(jsa.ops.simulate_fp4(attention)(q, q, key=KEY), attention(q, q))
    odd = _rng(4).standard_normal((16, 24)).astype(np.float32)
    w = _rng(5).standard_normal((24, 16)).astype(np.float32)
    f = jsa.ops.simulate_fp4(lambda a, b: a @ b, high_precision=None)
    np.testing.assert_allclose(f(odd, w, key=KEY), odd @ w, rtol=1e-5, atol=1e-5)


def test_tied_embedding_readout_uses_the_transposed_weight():
    emb = _rng(6).standard_normal((64, 32)).astype(np.float32)  # (vocab, d)

    def readout(h, e):
        return h @ e.T  # dot_general contracting e's second axis

    got = jsa.ops.simulate_fp4(readout, high_precision=None)(X, emb, key=KEY)
    expected = jsa.ops.nvfp4_matmul(X, emb.T, jax.random.fold_in(KEY, 0))
    np.testing.assert_array_equal(got, expected)


def test_jit_inside_and_keys_matter():
    """One layer (the claim does not depend on depth)."""
    simulated = jsa.ops.simulate_fp4(jax.jit(loss), high_precision=None)
    grad = jax.jit(jax.grad(lambda p, k: simulated(X, p, key=k)))  # the jit of loss inside
    a = grad(PARAMS[:1], jax.random.key(1))
    b = grad(PARAMS[:1], jax.random.key(2))
    assert not np.allclose(a[0], b[0])


def test_bad_uses_are_refused():
    with pytest.raises(TypeError, match="simulate_fp4 expects a callable"):
        jsa.ops.simulate_fp4(3)
    with pytest.raises(ValueError, match="recipe must be one of"):
        jsa.ops.simulate_fp4(loss, recipe="mxfp8")
    with pytest.raises(ValueError, match="scale_rounding must be 'up' or 'floor'"):
        jsa.ops.simulate_fp4(loss, recipe="mxfp4", scale_rounding="down")
    with pytest.raises(ValueError, match="high_precision must be 'first_and_last', None"):
        jsa.ops.simulate_fp4(loss, high_precision="first")
    with pytest.raises(ValueError, match="weight_blocks must be '2d' or '1d'"):
        jsa.ops.simulate_fp4(loss, weight_blocks="3d")
    with pytest.raises(ValueError, match="need a PRNG key"):
        jsa.ops.simulate_fp4(loss, high_precision=None)(X, PARAMS)
    with pytest.raises(ValueError, match=r"jax.grad\(simulate_fp4\(f\)\)"):
        jsa.ops.simulate_fp4(jax.grad(loss, argnums=1))(X, PARAMS, key=KEY)


@pytest.mark.parametrize(
    "recipe",
    # The recipes differ only in the quantiser the shared apply_to_data path calls: NVFP4
    # in the default run, the others in the slow step.
    [
        "nvfp4",
        pytest.param("mxfp4", marks=pytest.mark.slow),
        pytest.param("fp4_tensor", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow
def test_composes_with_autoscale(recipe):
    """Under `jsa.autoscale` with float16 ScaledArray inputs: ScaledArray gradients close to
    the float32 program's on the same values (float16 roundings elsewhere flip some 4-bit
    roundings: sums of 4-bit products often tie exactly between two E2M1 values, hence the
    tolerance); and with the input 2**24 larger, values float16 cannot hold (the loss
    passes 2**30), exactly the same data at scales 2**48 larger: the quantisers act on the
    stored data and commute with power-of-two scales."""
    rng = _rng(2)
    params = [(rng.standard_normal(shape) / 6).astype(np.float32) for shape in ((32, 64), (64, 32))]

    def two_layers(x, ws):
        h = jax.nn.relu(x @ ws[0])
        return jnp.mean((h @ ws[1]).astype(jnp.float32) ** 2)

    def values(a):
        return jsa.asarray(a, jnp.float32)

    simulated = jsa.ops.simulate_fp4(two_layers, recipe=recipe, high_precision=None)
    value_and_grad = jax.value_and_grad(lambda x, ws, k: simulated(x, ws, key=k), argnums=1)
    scaled_step = jax.jit(jsa.autoscale(value_and_grad))
    sws = [jsa.scaled_array(jnp.asarray(w, jnp.float16), 2.0**-3) for w in params]
    x16 = jnp.asarray(X, jnp.float16)
    value, grads = scaled_step(jsa.scaled_array(x16, 1.0), sws, KEY)
    ref_value, ref_grads = jax.jit(value_and_grad)(values(x16), [values(w) for w in sws], KEY)
    assert all(isinstance(g, jsa.ScaledArray) and g.dtype == jnp.float16 for g in grads)
    np.testing.assert_allclose(values(value), ref_value, rtol=1e-3)
    for g, r in zip(grads, ref_grads, strict=True):
        got, want = np.asarray(values(g)), np.asarray(r)
        assert np.linalg.norm(got - want) < 0.1 * np.linalg.norm(want)

    big_value, big_grads = scaled_step(jsa.scaled_array(x16, 2.0**24), sws, KEY)
    assert float(jsa.asarray(big_value, jnp.float32)) > 2.0**30
    np.testing.assert_array_equal(
        jsa.asarray(big_value, jnp.float32), jsa.asarray(value, jnp.float32) * 2.0**48
    )
    for g, big in zip(grads, big_grads, strict=True):
        np.testing.assert_array_equal(big.data, g.data)
        np.testing.assert_array_equal(big.scale, g.scale * 2.0**48)


@pytest.mark.slow
def test_scan_iterations_draw_new_bits():
    """The same input and weight at two iterations of a scan: the stochastically rounded
    input gradients differ between the iterations (each folds its index into the key),
    and equal the loop written out with those keys."""
    w = PARAMS[0]  # (32, 48)
    xs = np.stack([X, X])  # two identical iterations
    g = _rng(7).standard_normal((2, 32, 48)).astype(np.float32)
    g[1] = g[0]

    def scanned(xs, w):
        _, ys = jax.lax.scan(lambda c, x: (c, x @ w), 0.0, xs)
        return jnp.sum(ys * g)

    simulated = jsa.ops.simulate_fp4(scanned, high_precision=None, hadamard=False)
    dxs = jax.jit(jax.grad(lambda xs, k: simulated(xs, w, key=k)))(xs, KEY)
    assert not np.array_equal(dxs[0], dxs[1])

    def by_hand(xs):
        keys = [jax.random.fold_in(jax.random.fold_in(KEY, t), 0) for t in range(2)]
        ys = [jsa.ops.fp4_matmul(xs[t], w, keys[t], hadamard=False) for t in range(2)]
        return jnp.sum(jnp.stack(ys) * g)

    np.testing.assert_allclose(dxs, jax.jit(jax.grad(by_hand))(xs), rtol=1e-6, atol=1e-6)
