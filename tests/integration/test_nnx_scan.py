"""A Flax NNX model scanned over stacked layers, with one scale per layer, trained one
SGD step under `jax.jit(jsa.autoscale(step))`.

The model is L blocks of Linear + relu created with `nnx.vmap` (their parameters stacked
along a leading layer axis) and run with `nnx.scan`, then a Linear head. The layers'
magnitudes alternate by 2^20 (2^-10, 2^10, 2^-10, 2^10): the stacked kernel and bias leaves
become ScaledArrays with an `(L, 1, ...)` block scale (one power of two per layer), the
head one scale per tensor. The step's updates and new parameters are compared, layer by
layer, with the plain float32 step on the values the scaled parameters represent.

Why `nnx.scan` (not `flax.linen.scan`): `autoscale` traces the step to a jaxpr with plain
stand-ins for the ScaledArrays, so Flax's transforms never see a ScaledArray leaf, only
arrays; `nnx.scan` lowers to `lax.scan`, whose scaled rule gives each iteration the scale
of its layer (an `(L, 1, ...)` block scale on a scanned input) and stacks the per-layer
scales of the scanned outputs (the gradients) the same way. `nnx.split` turns each
`nnx.Param` into a ScaledArray leaf of the state, and `nnx.merge` accepts it.

Per-layer relative errors measured (max |error| / max |reference| within a layer, layers
0..3, CPU; `TOL` holds the bounds asserted):

| data | scales | kernel update | new kernel | bias update |
| --- | --- | --- | --- | --- |
| float32 | per layer | 0 (bit-identical) | 0 | 0 |
| bfloat16 | per layer | 2.3e-3 2.4e-3 2.2e-3 2.0e-3 | 2.4e-3 0 2.4e-3 0 | 0.9e-3 ... 3.5e-3 |
| float16 | per layer | 2.1e-4 2.8e-4 2.6e-4 3.4e-4 | 3.1e-4 0 3.0e-4 0 | 2.0e-4 ... 3.8e-4 |

(The 2^10 layers' SGD steps are below float precision of their weights: their new kernels
are the old ones, in the plain step too.) Against the float32 step from the float32
parameters, float16 new kernels: per-layer scales 5.9e-4 3.1e-4 5.8e-4 3.0e-4; one scale
for the whole stacked leaf 3.3e-2 3.1e-4 2.9e-2 3.0e-4 (the 2^-10 layers' data are float16
subnormals). bfloat16 has float32's exponent range: one scale for all layers loses nothing
there at a spread of 2^20.

Adam: plain `optax.adam` on float16 ScaledArrays gives NaN where a gradient is zero (dead
relu units; its `eps` underflows at the block's scale, so 0 / 0), per tensor as per block;
`jsa.optax.scale_optimizer` stores the moments of a stacked leaf with the parameter's
block scale (one per layer), so no layer loses its update.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import jax_scaled_arithmetics as jsa

L, WIDTH, BATCH = 4, 32, 16
LOG2_MAGNITUDES = np.array([-10, 10, -10, 10])  # adjacent layers 2^20 apart
LR = 2.0**-24


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.linear(x))


class ScanMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(rngs)

        self.blocks = create(rngs)  # parameters stacked: kernel (L, W, W), bias (L, W)
        self.head = nnx.Linear(WIDTH, 1, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return self.head(forward(x, self.blocks))


def per_layer(shape):
    return (shape[0],) + (1,) * (len(shape) - 1)


def one_scale(shape):
    return (1,) * len(shape)


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    model = ScanMLP(nnx.Rngs(0))
    kernel, bias = model.blocks.linear.kernel, model.blocks.linear.bias
    kernel[...] = kernel[...] * np.exp2(LOG2_MAGNITUDES)[:, None, None].astype(np.float32)
    # Each layer's bias at the magnitude of its output (the product of the magnitudes so far).
    out_magnitude = np.exp2(np.cumsum(LOG2_MAGNITUDES))[:, None]
    bias[...] = (0.1 * rng.standard_normal((L, WIDTH)) * out_magnitude).astype(np.float32)
    graphdef, state = nnx.split(model)
    x = jnp.asarray(rng.standard_normal((BATCH, WIDTH)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((BATCH, 1)), jnp.float32)
    return graphdef, state, x, y


def make_step(graphdef, opt):
    def step(state, opt_state, x, y):
        def loss_fn(state):
            return jnp.mean((nnx.merge(graphdef, state)(x) - y) ** 2)

        grads = jax.grad(loss_fn)(state)
        updates, opt_state = opt.update(grads, opt_state, state)
        return updates, optax.apply_updates(state, updates), opt_state

    return step


def scaled_state(state, dtype, layout):
    """The stacked blocks with `layout` block scales, the head with one scale per tensor."""
    return {
        "blocks": jsa.as_scaled_array(state["blocks"], scale_shape=layout, dtype=dtype),
        "head": jsa.as_scaled_array(state["head"], dtype=dtype),
    }


def layer_errors(got, ref):
    """max |got - ref| / max |ref| within each layer (leading axis)."""
    got = np.asarray(jsa.asarray(got, jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    axes = tuple(range(1, ref.ndim))
    return np.max(np.abs(got - ref), axis=axes) / np.max(np.abs(ref), axis=axes)


def unwrap(tree):
    """The tree with each `nnx.Variable` wrapper (kept by `as_scaled_array`) replaced by its
    value, so the checks below index the arrays directly."""
    return jax.tree_util.tree_map(
        lambda v: v.get_value() if isinstance(v, nnx.Variable) else v,
        tree,
        is_leaf=lambda v: isinstance(v, (nnx.Variable, jsa.ScaledArray)),
    )


@functools.cache
def jitted_steps(graphdef, name, state_dtype=None):
    """`(optimizer, plain step, autoscaled step)`, jitted once per model and optimizer (with
    `state_dtype`, `jsa.optax.scale_optimizer` of it): the tests that run the same program
    (the float32 reference, a dtype and layout already run) share its compile."""
    opt = {"sgd": lambda: optax.sgd(LR), "adam": lambda: optax.adam(1e-3)}[name]()
    if state_dtype is not None:
        opt = jsa.optax.scale_optimizer(opt, state_dtype)
    step = make_step(graphdef, opt)
    return opt, jax.jit(step), jax.jit(jsa.autoscale(step))


def run_step(problem, dtype, layout):
    graphdef, state, x, y = problem
    opt, plain_step, scaled_step = jitted_steps(graphdef, "sgd")
    scaled = scaled_state(state, dtype, layout)
    values = jsa.asarray(scaled, jnp.float32)  # the represented parameters
    expected = plain_step(values, opt.init(values), x, y)
    got = scaled_step(scaled, opt.init(scaled), x, y)
    return scaled, (*unwrap(got[:2]), got[2]), unwrap(expected), scaled_step


# Bounds on the per-layer relative errors: (updates, new parameters).
TOL = {
    np.dtype(np.float32): (1e-5, 1e-6),
    np.dtype(ml_dtypes.bfloat16): (1e-2, 8e-3),
    np.dtype(np.float16): (2e-3, 1e-3),
}


@pytest.mark.parametrize(
    "dtype",
    # float16 (the narrowest range, where one scale per layer matters) by default; float32
    # and bfloat16 (the same per-layer scan rules, compiled again) in the slow step.
    [
        pytest.param(np.float32, marks=pytest.mark.slow),
        pytest.param(ml_dtypes.bfloat16, marks=pytest.mark.slow),
        np.float16,
    ],
    ids=str,
)
@pytest.mark.slow
def test_one_scale_per_layer_sgd_step(problem, dtype):
    scaled, got, expected, step = run_step(problem, dtype, per_layer)
    kernel = unwrap(scaled)["blocks"]["linear"]["kernel"]
    assert kernel.scale.shape == (L, 1, 1) and kernel.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(
        np.log2(kernel.scale.ravel()) - LOG2_MAGNITUDES, np.log2(kernel.scale.ravel()[0]) + 10
    )
    updates, params, _ = got
    for tree in (updates, params):  # every leaf scaled; the stacked ones per layer
        for name in ("kernel", "bias"):
            leaf = tree["blocks"]["linear"][name]
            assert isinstance(leaf, jsa.ScaledArray) and leaf.dtype == np.dtype(dtype)
            assert leaf.scale.shape == per_layer(leaf.shape), name
    update_tol, param_tol = TOL[np.dtype(dtype)]
    ref_updates, ref_params, _ = expected
    for name in ("kernel", "bias"):
        update = layer_errors(
            updates["blocks"]["linear"][name], ref_updates["blocks"]["linear"][name]
        )
        param = layer_errors(params["blocks"]["linear"][name], ref_params["blocks"]["linear"][name])
        print(f"{np.dtype(dtype).name} {name}: update errors {update}, parameter errors {param}")
        assert np.all(update <= update_tol), (name, update)
        assert np.all(param <= param_tol), (name, param)
    for name in ("kernel", "bias"):  # the head: one scale, one "layer"
        update = layer_errors(updates["head"][name][None], ref_updates["head"][name][None])
        assert np.all(update <= update_tol), ("head", name, update)
    compiled = step._cache_size()  # (shared by the dtypes and layouts: see jitted_steps)
    step(scaled, got[2], *problem[2:])  # the new optimizer state: no recompilation
    assert step._cache_size() == compiled


@pytest.mark.slow
def test_one_scale_for_all_layers_loses_the_small_layers_in_float16(problem):
    """The float16 step with one scale for the whole stacked leaf: the small layers' data
    are float16 subnormals, so their parameters lose the precision that per-layer scales
    keep. Both against the plain float32 step from the float32 parameters (so the rounding
    of the parameters to float16 counts). bfloat16, with float32's exponent range, would
    not lose it at this spread."""
    graphdef, state, x, y = problem
    opt, plain_step, _ = jitted_steps(graphdef, "sgd")
    values = jsa.asarray(scaled_state(state, np.float32, one_scale), jnp.float32)
    _, reference, _ = plain_step(values, opt.init(values), x, y)
    reference = reference["blocks"]["linear"]["kernel"]
    errors = {}
    for name, layout in (("per layer", per_layer), ("one scale", one_scale)):
        _, (_, params, _), _, _ = run_step(problem, np.float16, layout)
        errors[name] = layer_errors(params["blocks"]["linear"]["kernel"], reference)
    print(f"float16 new kernels against float32: {errors}")
    small = LOG2_MAGNITUDES < 0
    assert np.all(errors["one scale"][small] > 10 * errors["per layer"][small])
    assert np.all(errors["per layer"] <= 2e-3)


@pytest.mark.parametrize(
    "state_dtype", [np.float16, pytest.param(ml_dtypes.bfloat16, marks=pytest.mark.slow)], ids=str
)
@pytest.mark.slow
def test_scaled_adam_keeps_one_scale_per_layer_in_its_moments(problem, state_dtype):
    """Adam through `jsa.optax.scale_optimizer` on the per-layer-scaled float16 model: the
    moments of a stacked leaf are stored with its parameter's block scale (one per layer,
    from `opt.init`, kept by every update), so every layer's update is within 2e-3 of
    float32 Adam's from the same values. Measured kernel update errors, float16 moments:
    4.1e-4 4.8e-4 4.1e-4 4.8e-4 (with moments per tensor, as before block scales: 4.1e-4,
    0.997, 4.1e-4, 0.997: the layers whose gradients are 2^20 below the others' got no
    update). The step runs twice with one compilation (the state's layout is a fixed
    point)."""
    graphdef, state, x, y = problem
    adam, plain_step, _ = jitted_steps(graphdef, "adam")
    opt, _, step = jitted_steps(graphdef, "adam", state_dtype)
    scaled = scaled_state(state, np.float16, per_layer)
    values = jsa.asarray(scaled, jnp.float32)
    expected, _, _ = plain_step(values, adam.init(values), x, y)
    opt_state = opt.init(scaled)
    updates, _, new_state = step(scaled, opt_state, x, y)
    updates, expected = unwrap(updates), unwrap(expected)
    for moments in (opt_state[0].mu, opt_state[0].nu, new_state[0].mu, new_state[0].nu):
        moments = unwrap(moments)
        kernel = moments["blocks"]["linear"]["kernel"]
        assert kernel.scale.shape == (L, 1, 1) and kernel.dtype == np.dtype(state_dtype)
        assert moments["blocks"]["linear"]["bias"].scale.shape == (L, 1)
        assert moments["head"]["kernel"].scale.shape == ()
    for name in ("kernel", "bias"):
        got = layer_errors(updates["blocks"]["linear"][name], expected["blocks"]["linear"][name])
        print(f"{np.dtype(state_dtype).name} moments, Adam {name} update errors: {got}")
        assert np.all(got <= 2e-3), (name, got)
    compiled = step._cache_size()  # (shared: see jitted_steps)
    step(scaled, new_state, x, y)
    assert step._cache_size() == compiled


@pytest.mark.slow
def test_scaled_adam_over_steps_with_bfloat16_moments(problem):
    """Four Adam steps, float16 parameters with per-layer scales, bfloat16 moments: every
    layer's update stays within 5e-2 of float32 Adam's run from the same values (measured
    at most 2.9e-2: bfloat16 rounding of the moments, compounded over the steps).

    With float16 moments the run diverges at the third step: within one layer the second
    moment spans 1e-13 to 1e-19 of its largest element, beyond float16's 2^-38 range at
    one scale per layer, so some `nu` flush to zero while `mu` does not, and
    `mu / (sqrt(nu) + eps)` explodes (bfloat16 moments, or finer scales, are the remedy)."""
    graphdef, state, x, y = problem
    adam, plain_step, _ = jitted_steps(graphdef, "adam")
    # The step of test_scaled_adam_keeps_one_scale_per_layer_in_its_moments[bfloat16].
    opt, _, scaled_step = jitted_steps(graphdef, "adam", ml_dtypes.bfloat16)
    scaled = scaled_state(state, np.float16, per_layer)
    values = jsa.asarray(scaled, jnp.float32)
    opt_state, ref_state = opt.init(scaled), adam.init(values)
    for _ in range(4):
        updates, scaled, opt_state = scaled_step(scaled, opt_state, x, y)
        ref_updates, values, ref_state = plain_step(values, ref_state, x, y)
        got = layer_errors(
            unwrap(updates)["blocks"]["linear"]["kernel"],
            unwrap(ref_updates)["blocks"]["linear"]["kernel"],
        )
        assert np.all(got <= 5e-2), got
    assert scaled_step._cache_size() == 1  # one program for the steps (and that test)
