"""A char GPT under `autoscale`: float16/bfloat16 gradients and Adam steps match float32.

The model is the 2-block char GPT of `experiments/gpt/model.py` (width 128, 4 heads,
context 64), parameters converted with `jsa.as_scaled_array` and no rescaling placed by
hand: the scales the rules choose must follow the data through the forward and backward
passes, or the gradients far from the loss flush to zero in float16.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jax_scaled_arithmetics as jsa
from tests.helpers import as_scaled_array_jit, load_script

gpt = load_script("gpt_model", "experiments/gpt/model.py")


@pytest.fixture(autouse=True)
def _implicit_broadcasting():
    """The model broadcasts biases implicitly, as model code does (the suite raises on it)."""
    with jax.numpy_rank_promotion("allow"):
        yield


CONFIG = gpt.GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64)
BATCH = 8


@pytest.fixture(scope="module")
def problem():
    # Under one `jax.jit` (eagerly, each operation of the initialisation is a compile).
    params = jax.jit(gpt.init_params, static_argnums=1)(jax.random.PRNGKey(0), CONFIG)
    rng = np.random.default_rng(0)
    shape = (BATCH, CONFIG.block_size)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, shape), jnp.int32)
    targets = jnp.asarray(rng.integers(0, CONFIG.vocab_size, shape), jnp.int32)
    return params, tokens, targets


def grad_fn(params, tokens, targets):
    return jax.grad(gpt.loss_fn)(params, tokens, targets, CONFIG)


def _leaves(tree):
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=jsa.is_scaled_leaf)[0]


@pytest.mark.parametrize(
    "dtype",
    [np.float16, pytest.param(ml_dtypes.bfloat16, marks=pytest.mark.slow)],
    ids=["float16", "bfloat16"],
)
@pytest.mark.slow
def test_gradients_match_float32(problem, dtype):
    """Every gradient tensor within 2e-2 (max abs error / max abs) of the float32 gradient
    at the same parameter values, with at most 1% of its significant entries flushed to zero.

    Significant: at least 2^-14 (float16's smallest normal) times the tensor's largest
    magnitude, so that data at the tensor's scale holds them as normal numbers. Smaller
    reference entries include float32 rounding noise around exact zeros (the key biases'
    gradients, zero since softmax ignores a shift of its row, are ~1e-9 of the largest
    entry in float32): float16 rounds those to 0, which says nothing about the scales."""
    params, tokens, targets = problem
    scaled = as_scaled_array_jit(params, dtype=dtype)
    values = jax.jit(jsa.asarray, static_argnums=1)(scaled, jnp.float32)
    expected = jax.jit(grad_fn)(values, tokens, targets)
    grads = jax.jit(jsa.autoscale(grad_fn))(scaled, tokens, targets)
    for (path, grad), ref in zip(_leaves(grads), jax.tree_util.tree_leaves(expected), strict=True):
        assert isinstance(grad, jsa.ScaledArray) and grad.dtype == np.dtype(dtype)
        got = np.asarray(grad.to_array(np.float32), np.float64)
        ref = np.asarray(ref, np.float64)
        error = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
        significant = np.abs(ref) >= 2.0**-14 * np.max(np.abs(ref))
        flushed = np.mean(got[significant] == 0)
        name = jax.tree_util.keystr(path)
        assert error < 2e-2, f"{name}: relative error {error:.2e}"
        assert flushed <= 0.01, f"{name}: {flushed:.1%} of its entries flushed to zero"


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(np.float32, marks=pytest.mark.slow),
        # Scans over stacked layers run by default in tests/integration/test_nnx_scan.py and
        # tests/lax/test_control_flow.py.
        pytest.param(np.float16, marks=pytest.mark.slow),
        pytest.param(ml_dtypes.bfloat16, marks=pytest.mark.slow),
    ],
    ids=["float32", "float16", "bfloat16"],
)
def test_scan_over_layers_matches_the_unrolled_model(problem, dtype):
    """Blocks stacked and run as a `lax.scan` (a scaled carry; the scan's stacked outputs,
    the residuals its backward pass reads, keep one scale per layer as `(L, 1, ...)` block
    scales): the gradients under autoscale match float32 gradients of the unrolled model.

    In float16 this needs the constants of the jitted `jnp.var` helper (its normalizer and
    NaN fill) known across the jit boundary: without them the variance lost its scale and
    the layer norm's derivative `rsqrt(v) / v` overflowed to inf (NaN gradients)."""
    params, tokens, targets = problem
    stacked = jsa.as_scaled_array(gpt.stack_blocks(params), dtype=dtype)
    values = jsa.asarray(stacked, jnp.float32)
    unstacked = dict(
        values,
        blocks=[
            jax.tree_util.tree_map(lambda leaf, i=i: leaf[i], values["blocks"])
            for i in range(CONFIG.n_layer)
        ],
    )
    expected = gpt.stack_blocks(jax.jit(grad_fn)(unstacked, tokens, targets))
    grads = jax.jit(jsa.autoscale(grad_fn))(stacked, tokens, targets)
    tol = 1e-4 if dtype == np.float32 else 2e-2
    for (path, grad), ref in zip(_leaves(grads), jax.tree_util.tree_leaves(expected), strict=True):
        assert isinstance(grad, jsa.ScaledArray) and grad.dtype == np.dtype(dtype)
        got = np.asarray(grad.to_array(np.float32), np.float64)
        ref = np.asarray(ref, np.float64)
        error = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
        assert error < tol, f"{jax.tree_util.keystr(path)}: relative error {error:.2e}"


@pytest.mark.slow
def test_checkpointed_scanned_blocks_under_delayed_scaling_match_float32(problem):
    """`GPTConfig(remat=True)`: each block under `jax.checkpoint`, the blocks scanned. The
    delayed-scaling step (its checkpointed backward bodies at held scales, a row per layer)
    gives the float32 gradients of the same model from a history of the same batch."""
    params, tokens, targets = problem
    config = dataclasses.replace(CONFIG, remat=True)

    def grads_of(params, tokens, targets):
        return jax.grad(gpt.loss_fn)(params, tokens, targets, config)

    stacked = jsa.as_scaled_array(gpt.stack_blocks(params), dtype=np.float16)
    expected = jax.jit(grads_of)(jsa.asarray(stacked, jnp.float32), tokens, targets)
    step = jsa.delayed_scaling(grads_of)
    _, history = jax.jit(step.init)(stacked, tokens, targets)
    assert any(": checkpoint 0: " in site for site in history.sites)
    grads, _ = jax.jit(step)(history, stacked, tokens, targets)
    for (path, grad), ref in zip(_leaves(grads), jax.tree_util.tree_leaves(expected), strict=True):
        got = np.asarray(grad.to_array(np.float32), np.float64)
        ref = np.asarray(ref, np.float64)
        error = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
        assert error < 2e-2, f"{jax.tree_util.keystr(path)}: relative error {error:.2e}"


def _adam_step(opt, apply):
    def step(params, state, tokens, targets):
        grads = grad_fn(params, tokens, targets)
        updates, state = opt.update(grads, state, params)
        return apply(params, updates), state

    return step


def _check_updates(new_params, reference, before, grads, tol, floor):
    """Parameter updates within `tol` (max abs error / max abs update) of the reference.

    Adam divides each gradient by its own root mean square, so an entry's update is its
    gradient's sign whatever its magnitude: entries whose gradient is below the
    computation's absolute error get a step of either sign. In float32 that is the key
    bias of attention (zero in exact arithmetic, softmax ignores it; rounding noise of
    1e-12 in plain float32 too), in float16 gradients below its precision relative to the
    tensor's largest. Entries whose float32 gradient is below `floor` times the tensor's
    largest are left out: no precision decides their update. On top of `tol`, each
    entry may differ by one float32 ulp of its new value: a step of 1e-3 on a parameter
    near 1 (layer norm gains) is resolved to 1.2e-7, 1.2e-4 of the step, and the scaled
    and plain sums may round to neighbouring float32 values.
    """
    flat = zip(
        _leaves(new_params),
        jax.tree_util.tree_leaves(reference),
        jax.tree_util.tree_leaves(before),
        jax.tree_util.tree_leaves(grads),
        strict=True,
    )
    for (path, new), ref, old, grad in flat:
        new = np.asarray(jsa.asarray(new, jnp.float32), np.float64)
        ref, old, grad = (np.asarray(a, np.float64) for a in (ref, old, grad))
        conditioned = np.abs(grad) >= floor * np.max(np.abs(grad))
        update, expected = (new - old)[conditioned], (ref - old)[conditioned]
        ulp = np.spacing(np.abs(ref[conditioned]).astype(np.float32)).astype(np.float64)
        excess = np.abs(update - expected) - ulp
        error = max(np.max(excess), 0.0) / np.max(np.abs(expected))
        assert error < tol, f"{jax.tree_util.keystr(path)}: update error {error:.2e}"


@pytest.mark.slow  # a training step (plain optax on scaled float32 data: also test_zoo.py)
def test_adam_step_matches_float32(problem):
    """`optax.adam` on float32 ScaledArrays: the updated parameters are those of float32."""
    params, tokens, targets = problem
    opt = optax.adam(1e-3)
    expected, _ = jax.jit(_adam_step(opt, optax.apply_updates))(
        params, opt.init(params), tokens, targets
    )
    scaled = jsa.as_scaled_array(params)
    step = jax.jit(jsa.autoscale(_adam_step(opt, optax.apply_updates)))
    new_params, state = step(scaled, jsa.as_scaled_array(opt.init(params)), tokens, targets)
    grads = jax.jit(grad_fn)(params, tokens, targets)
    _check_updates(new_params, expected, params, grads, tol=1e-4, floor=1e-4)
    assert isinstance(state[0].mu["wte"], jsa.ScaledArray)


@pytest.mark.slow  # a training step; scale_optimizer's steps: tests/optax/test_scaled.py
def test_scaled_optimizer_float16_step(problem):
    """`jsa.optax.scale_optimizer(optax.adam)` with float16 parameters and state: updates
    within 2e-2 of float32 Adam's, for entries whose gradient is above float16's precision
    (2e-2 of the largest); the new float16 parameters are the old plus the update, rounded
    to float16 (within half a float16 ulp of the parameter, plus that tolerance)."""
    params, tokens, targets = problem
    scaled = jsa.as_scaled_array(params, dtype=jnp.float16)
    values = jsa.asarray(scaled, jnp.float32)
    adam = optax.adam(1e-3)
    opt = jsa.optax.scale_optimizer(adam)

    def step(params, state, tokens, targets):
        grads = grad_fn(params, tokens, targets)
        updates, state = opt.update(grads, state, params)
        return updates, jsa.optax.apply_updates(params, updates), state

    updates, new_params, _ = jax.jit(jsa.autoscale(step))(scaled, opt.init(scaled), tokens, targets)
    grads = jax.jit(grad_fn)(values, tokens, targets)
    expected, _ = adam.update(grads, adam.init(values), values)
    flat = zip(
        _leaves(updates),
        _leaves(new_params),
        jax.tree_util.tree_leaves(expected),
        jax.tree_util.tree_leaves(values),
        jax.tree_util.tree_leaves(grads),
        strict=True,
    )
    for (path, update), (_, new), ref, old, grad in flat:
        name = jax.tree_util.keystr(path)
        assert new.dtype == np.float16, name
        update = np.asarray(update.to_array(np.float32), np.float64)
        new = np.asarray(new.to_array(np.float32), np.float64)
        ref, old, grad = (np.asarray(a, np.float64) for a in (ref, old, grad))
        conditioned = np.abs(grad) >= 2e-2 * np.max(np.abs(grad))
        error = np.max(np.abs(update - ref)[conditioned]) / np.max(np.abs(ref[conditioned]))
        assert error < 2e-2, f"{name}: update error {error:.2e}"
        half_ulp = np.spacing(np.abs(old).astype(np.float16)).astype(np.float64) / 2
        slack = half_ulp + 2e-2 * np.max(np.abs(ref))
        assert np.all(np.abs(new - (old + update)) <= slack), f"{name}: parameters"


@pytest.mark.slow
def test_float16_data_stays_in_range(problem):
    """`jsa.analysis` over the gradient computation (one block): the data of every scaled
    float16 tensor, forward and backward, has its RMS within [2^-10, 2^8] (zeros aside)."""
    params, tokens, targets = problem
    config = gpt.GPTConfig(n_layer=1, n_head=4, n_embd=128, block_size=64)
    params = gpt.init_params(jax.random.PRNGKey(1), config)
    scaled = jsa.as_scaled_array(params, dtype=jnp.float16)

    def grads(params, tokens, targets):
        return jax.grad(gpt.loss_fn)(params, tokens, targets, config)

    table = jsa.analysis.tensor_ranges(grads, scaled, tokens[:4], targets[:4])
    rows = [
        row
        for row in table.select(scaled=True)
        if row.dtype == "float16" and np.isfinite(row.rms) and row.rms > 0
    ]
    assert {row.phase for row in rows} == {"forward", "backward"}
    for row in rows:
        assert 2.0**-10 <= row.rms <= 2.0**8, (row.phase, row.primitive, row.source, row.rms)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
def test_causal_attention_with_large_logits_is_finite(dtype):
    """The model masks attention with `jnp.where(causal, scores, -jnp.inf)`. Once the
    logits' scale reached 2^3 (weights 16x their initialisation here), the mask's ratio
    to it was a float32 subnormal, XLA flushed it to 0, and `-inf * 0` made 94% of the
    attention's outputs NaN; the gradient too."""
    config = gpt.GPTConfig(n_layer=1, n_head=4, n_embd=64, block_size=16)
    params = jax.jit(gpt.init_params, static_argnums=1)(jax.random.PRNGKey(0), config)
    block = jax.tree_util.tree_map(lambda a: 16.0 * a, params["blocks"][0])
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 64))

    def loss(p, x):
        return jnp.sum(gpt.attention(x, p, config.n_head) ** 2)

    scaled = jsa.as_scaled_array((block, x), dtype=dtype)
    value, grads = jax.jit(jsa.autoscale(jax.value_and_grad(loss)))(*scaled)
    plain = jax.tree_util.tree_map(
        lambda a: jnp.asarray(jsa.asarray(a), jnp.float32), scaled, is_leaf=jsa.is_scaled_leaf
    )
    expected_value, expected_grads = jax.value_and_grad(loss)(*plain)
    tol = 1e-4 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(jsa.asarray(value, jnp.float32), expected_value, rtol=tol)
    for (path, g), e in zip(_leaves(grads), jax.tree_util.tree_leaves(expected_grads)):
        g = np.asarray(jsa.asarray(g, jnp.float32))
        assert np.isfinite(g).all(), jax.tree_util.keystr(path)
        if not np.any(e):  # a parameter of the block attention does not read
            assert not np.any(g), jax.tree_util.keystr(path)
            continue
        err = np.max(np.abs(g - e)) / np.max(np.abs(e))
        assert err <= tol, f"{jax.tree_util.keystr(path)}: {err:.3g}"
