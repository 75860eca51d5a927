"""`jsa.optax.recipes`: the named recipes train, store what they say, and checkpoint bit-exactly."""

from __future__ import annotations

import functools
from pathlib import Path

import flax.serialization as fs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scaled_arithmetics as jsa
import jax_scaled_arithmetics.checkpoint  # noqa: F401  (registers ScaledArray with Flax)

q = jsa.quantization
FP16_169 = jsa.optax.recipes.FP16_169
RECIPES = {
    "bf16_stochastic": lambda: jsa.optax.bf16_stochastic(optax.adam(1e-2), key=1),
    "bf16_kahan": lambda: jsa.optax.bf16_kahan(optax.adam(1e-2)),
    "ibm8_like": lambda: jsa.optax.ibm8_like(optax.sgd(0.05, momentum=0.9), key=1),
}


def _problem():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w1": jax.random.normal(k1, (8, 32)) / np.sqrt(8), "b1": jnp.zeros(32),
              "w2": jax.random.normal(k2, (32, 2)) / np.sqrt(32)}  # fmt: skip
    x = jax.random.normal(k3, (64, 8))
    y = jnp.stack([jnp.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=-1)
    return params, x, y


def _loss(params, x, y, quantize=None):
    w1, w2 = params["w1"], params["w2"]
    if quantize is not None:  # the model side of a recipe: matmul operands and their gradients
        w1, w2, x = quantize(w1), quantize(w2), quantize(x)
    h = jnp.tanh(x @ w1.astype(jnp.float32) + params["b1"].astype(jnp.float32)[None, :])
    if quantize is not None:
        h = quantize(h)
    return jnp.mean((h @ w2.astype(jnp.float32) - y) ** 2)


@functools.lru_cache
def _train(name, steps=150):
    recipe = RECIPES[name]()
    params, x, y = _problem()
    params = recipe.cast_params(params)
    state = recipe.optimizer.init(params)

    @jax.jit
    def step(params, state, key):
        loss, grads = jax.value_and_grad(_loss)(params, x, y, recipe.model_quantizer)
        updates, state = recipe.optimizer.update(grads, state, params)
        return recipe.apply_updates(params, updates, key), state, loss

    losses = []
    for i in range(steps):
        params, state, loss = step(params, state, jax.random.key(i))
        losses.append(float(loss))
    return recipe, params, state, losses


def _float_leaves(tree):
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=jsa.is_scaled_leaf)
    return [x for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_trains(name):
    params, x, y = _problem()
    initial = float(_loss(params, x, y))
    _, _, _, losses = _train(name)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * initial, (initial, losses[-1])


@pytest.mark.parametrize("name", ["bf16_stochastic", "bf16_kahan"])
@pytest.mark.slow
def test_bf16_recipes_store_bfloat16(name):
    recipe, params, state, _ = _train(name)
    assert all(p.dtype == jnp.bfloat16 for p in _float_leaves(params))
    quantized = state.inner_state if name == "bf16_kahan" else state
    adam = quantized.inner_state[0]
    assert adam.mu["w1"].dtype == jnp.bfloat16 and adam.nu["w1"].dtype == jnp.bfloat16
    if name == "bf16_kahan":
        assert all(c.dtype == jnp.bfloat16 for c in _float_leaves(state.compensation))
        # 2 bytes of parameter, 4 of Adam state, 2 of buffer per parameter (+ count and key).
        n = sum(p.size for p in _float_leaves(params))
        assert jsa.optax.state_nbytes(state) == 6 * n + 4 + 8


@pytest.mark.slow
def test_ibm8_like_stores_its_formats():
    recipe, params, state, _ = _train("ibm8_like")
    for p in _float_leaves(params):
        assert p.dtype == jnp.float32
        np.testing.assert_array_equal(q.float_quantize(p, FP16_169), p)
    for leaf in _float_leaves(state.inner_state):
        np.testing.assert_array_equal(q.float_quantize(leaf, FP16_169), leaf)
    # The model side rounds matmul operands to float8_e5m2, and their gradients too.
    qz = recipe.model_quantizer
    w = params["w1"]
    np.testing.assert_array_equal(qz(w), q.float_quantize(w, "float8_e5m2"))
    g = jax.grad(lambda v: jnp.sum(qz(v) * 1.1))(w)
    np.testing.assert_array_equal(g, q.float_quantize(jnp.full_like(w, 1.1), "float8_e5m2"))


def test_stochastic_rounding_beats_nearest_on_small_steps():
    """What the bf16 recipes are for: lr * update below half a bfloat16 ulp of the weights."""
    params = {"w": jnp.ones(1024)}
    grads = {"w": jnp.full(1024, -1.0, jnp.bfloat16)}
    finals = {}
    for name in ("nearest", "bf16_stochastic", "bf16_kahan"):
        if name == "nearest":
            recipe = jsa.optax.bf16_stochastic(optax.sgd(1e-3))
            apply = lambda p, u, key: jsa.optax.apply_updates(p, u)  # noqa: E731
        else:
            recipe = getattr(jsa.optax, name)(optax.sgd(1e-3))
            apply = recipe.apply_updates
        p = recipe.cast_params(params)
        state = recipe.optimizer.init(p)

        @jax.jit
        def step(p, state, key, recipe=recipe, apply=apply):
            updates, state = recipe.optimizer.update(grads, state, p)
            return apply(p, updates, key), state

        for i in range(100):
            p, state = step(p, state, jax.random.key(i))
        finals[name] = np.asarray(p["w"], np.float64)
    np.testing.assert_array_equal(finals["nearest"], 1.0)  # 1e-3 < 2**-8: rounded away
    assert abs(finals["bf16_stochastic"].mean() - 1.1) < 5e-3  # 100 * 1e-3
    np.testing.assert_array_equal(finals["bf16_kahan"], 1.1015625)  # nearest bfloat16 to 1.1


def test_tables_and_citations():
    for name, make in RECIPES.items():
        recipe = make()
        assert recipe.name == name
        table = recipe.table().splitlines()
        assert table[0] == "| quantity | stored as | rounding | done by |"
        assert len(table) == 2 + len(recipe.rows)
        doc = getattr(jsa.optax, name).__doc__
        assert "et al." in doc and ("2020" in doc or "2018" in doc)
    assert "Left out" in jsa.optax.ibm8_like.__doc__


# --- checkpoints of the new states -------------------------------------------------------


def _assert_bit_identical(restored, original):
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(original)
    for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(original)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def _scaled_state():
    """`quantize` around `scale_optimizer`, under Kahan: ScaledArray states after two steps."""
    params = jsa.ops.dynamic_rescale_max(
        jsa.tree.astype(jsa.as_scaled_array(_problem()[0]), jnp.bfloat16)
    )
    inner = jsa.optax.scale_optimizer(optax.adam(1e-2), state_dtype=jnp.bfloat16)
    opt = jsa.optax.kahan_summation(
        jsa.optax.quantize(inner, state=("bfloat16", "stochastic"), key=4)
    )
    grads = jsa.as_scaled_array(
        jax.tree_util.tree_map(lambda p: 1e-6 * jnp.ones(p.shape), _problem()[0]),
        dtype=jnp.float16,
    )

    @jax.jit
    @jsa.autoscale
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return jsa.optax.apply_updates(params, updates), state

    state = opt.init(params)
    for _ in range(2):
        params, state = step(params, state, grads)
    return {"params": params, "opt_state": state}


@pytest.mark.slow
@pytest.mark.parametrize("name", [*sorted(RECIPES), "scaled"])
def test_checkpoints_round_trip(name, tmp_path):
    if name == "scaled":
        tree = _scaled_state()
        assert isinstance(tree["opt_state"].compensation["w1"], jsa.ScaledArray)
    else:
        _, params, state, _ = _train(name)
        tree = {"params": params, "opt_state": state}
    jsa.checkpoint.save(tmp_path / "ckpt", tree)
    _assert_bit_identical(jsa.checkpoint.restore(tmp_path / "ckpt", tree), tree)
    abstract = jax.eval_shape(lambda: tree)
    _assert_bit_identical(jsa.checkpoint.restore(tmp_path / "ckpt", abstract), tree)
    _assert_bit_identical(fs.from_bytes(tree, fs.to_bytes(tree)), tree)


def test_docs_tables_are_current():
    """docs/training.md shows each recipe's `table()` as it is."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    for name in RECIPES:
        table = getattr(jsa.optax, name)(optax.adam(1e-3)).table()
        assert f"`{name}`:\n\n{table}\n" in doc, f"regenerate the {name} table in the docs"
