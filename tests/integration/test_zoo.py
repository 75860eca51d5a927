"""The transformers of the zoo (`tests/integration/zoo.py`: a Flax linen GPT, a Flax NNX
Llama/Gemma-like LM, an Equinox BERT-like classifier) under `autoscale`, written and trained
as users of each framework do.

- `jsa.as_scaled_array` keeps the structure of each framework's parameter tree (a linen
  variables dict, an NNX `State` of `Variable`s, an Equinox module and its
  `eqx.partition` half), ScaledArrays counted as leaves.
- float16 gradients under autoscale match float32's at the same parameter values.
- A few training steps with each optimizer, the step under `jsa.autoscale`, match the same
  steps in plain float32 from the values the scaled parameters represent; plain
  `optax.adam` on float16 data is refused at trace time, naming `jsa.optax.scale_optimizer`.

Errors are `max |scaled - float32| / max |float32|` per leaf (the leaf's largest value sets
the scale of its error: an entry far below it is not expected to keep the data format's
relative precision). Optimizers that normalise each entry's step (Adam, Lion, Adafactor)
are compared on the entries whose gradient is well above the arithmetic's error (`FLOOR`).
The bounds are `GRAD_TOL` and `TOL`; measured values are in the tests' docstrings (CPU).

Runtime: dominated by XLA compiling the autoscaled steps (each a few seconds, the Equinox
ones about 10 s, the one with `clip_by_global_norm` about 35 s).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import jax_scaled_arithmetics as jsa
from tests.integration import zoo

F16, BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
MODELS = tuple(zoo.CASES)
# The tests that compile a model's autoscaled gradient program: the Equinox one takes ~10 s
# to compile (20 s on a loaded machine), so its tests are `slow` (CI's second step); the
# default run keeps Equinox's structure tests, and trains an Equinox model in
# tests/docs/test_frameworks_doc.py.
PROGRAM_MODELS = [pytest.param(m, marks=pytest.mark.slow) if m == "equinox" else m for m in MODELS]
STEPS = 3
GRAD_TOL = 2e-2


def _is_scaled(x):
    return isinstance(x, jsa.ScaledArray)


def _leaves(tree):
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_scaled)[0]


def _is_floating_array(x):
    return _is_scaled(x) or (eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating))


def _values(x):
    return np.asarray(jsa.asarray(x, jnp.float32), np.float64)


def _arrays(tree):
    """{path: float64 values} of the floating arrays of a tree (a ScaledArray's represented
    value); Python scalars, None and the rest are left out, so an Equinox module and its
    gradients (None where the module holds a Python float) pair up by path."""
    return {
        jax.tree_util.keystr(path): _values(leaf)
        for path, leaf in _leaves(tree)
        if _is_floating_array(leaf)
    }


def _relative_error(got, ref, kept=None):
    """max |got - ref| / max |ref| (over the `kept` entries; max |ref| over all)."""
    got, ref = _values(got), _values(ref)
    kept = np.ones(ref.shape, bool) if kept is None else kept
    error = np.max(np.abs(got - ref)[kept], initial=0.0)
    top = np.max(np.abs(ref), initial=0.0)
    return float(error / top if top > 0 else error)


def _errors(tree, ref, kept=None):
    """{path: relative error} over the floating arrays of two trees (the same paths)."""
    got, expected = _arrays(tree), _arrays(ref)
    assert got.keys() == expected.keys(), set(got) ^ set(expected)
    kept = {} if kept is None else kept
    return {k: _relative_error(got[k], expected[k], kept.get(k)) for k in expected}


def _assert_scaled(tree, dtype, what):
    """Every floating array is a ScaledArray with `dtype` data."""
    for path, leaf in _leaves(tree):
        name = what + jax.tree_util.keystr(path)
        if _is_scaled(leaf):
            assert leaf.dtype == dtype, f"{name}: {leaf.dtype}"
        else:
            assert not _is_floating_array(leaf), f"{name} is not a ScaledArray"


# ---------------------------------------------------------------------------------------------
# `as_scaled_array` keeps each framework's tree.


def _assert_same_structure(converted, original):
    assert jax.tree.structure(converted, is_leaf=_is_scaled) == jax.tree.structure(original)


def _assert_converted(converted, original, dtype):
    """Floating arrays became ScaledArrays representing the same values (to `dtype`'s
    rounding); every other leaf is the same object."""
    for (path, new), old in zip(
        _leaves(converted), jax.tree_util.tree_leaves(original), strict=True
    ):
        name = jax.tree_util.keystr(path)
        if eqx.is_inexact_array(old):
            assert _is_scaled(new) and new.dtype == dtype, name
            assert _relative_error(new, old) <= 2.0**-11, name
        else:
            assert new is old, name


def _filled(shapes):
    """The tree of an initialisation traced, not run (`eval_shape`): each array a fresh
    numpy draw (other leaves kept). Running the init costs its random draws' compiles; the
    structure tests need a tree of distinct values, not the init's."""
    rng = np.random.default_rng(0)

    def fill(leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        return jnp.asarray(rng.standard_normal(leaf.shape).astype(leaf.dtype))

    return jax.tree.map(fill, shapes)


def test_linen_variables_keep_their_structure():
    shapes = jax.eval_shape(zoo.linen_lm().init, jax.random.PRNGKey(0), zoo.lm_batch()["inputs"])
    variables = _filled(shapes)
    scaled = jsa.as_scaled_array(variables, dtype=F16)
    _assert_same_structure(scaled, variables)
    _assert_converted(scaled, variables, F16)
    assert set(scaled) == {"params"}


def _variables(state):
    return jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))


@pytest.mark.slow
def test_nnx_state_keeps_its_variables():
    """The whole state (`nnx.Param`s and the rotary tables, a custom `nnx.Variable` type) and
    the `nnx.Param` part of a split: each Variable keeps its type, and the converted state
    merges into a model whose Variables hold ScaledArrays."""
    model = zoo.nnx_init()
    graphdef, state = nnx.split(model)
    scaled = jsa.as_scaled_array(state, dtype=F16)
    _assert_same_structure(scaled, state)
    _assert_converted(scaled, state, F16)
    types = [type(v) for v in _variables(scaled)]
    assert types == [type(v) for v in _variables(state)]
    assert {nnx.Param, zoo.RopeTable} <= set(types)
    merged = nnx.merge(graphdef, scaled)
    kernel = merged.layers[0].attn.q_proj.kernel
    assert type(kernel) is nnx.Param and _is_scaled(kernel[...])
    assert type(merged.layers[0].attn.rope.sin) is zoo.RopeTable

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    scaled_params = jsa.as_scaled_array(params, dtype=F16)
    _assert_same_structure(scaled_params, params)
    assert all(type(v) is nnx.Param for v in _variables(scaled_params))
    merged = nnx.merge(graphdef, scaled_params, rest)
    assert _is_scaled(merged.embed.embedding[...])
    assert not _is_scaled(merged.layers[0].attn.rope.cos[...])


def _equinox_init():
    """`zoo.equinox_init()`'s module, with numpy draws for its arrays (see `_filled`)."""
    return _filled(eqx.filter_eval_shape(zoo.equinox_init))


def test_equinox_module_keeps_its_fields():
    """Floating arrays become ScaledArrays; Python floats (`Dropout.p`), booleans, functions
    and static fields (`LayerNorm.eps`, `activation`, sizes) are untouched."""
    model = _equinox_init()
    scaled = jsa.as_scaled_array(model, dtype=F16)
    _assert_same_structure(scaled, model)
    _assert_converted(scaled, model, F16)
    assert type(scaled) is zoo.BertClassifier
    assert scaled.dropout.p == 0.1 and type(scaled.dropout.p) is float
    assert scaled.layers[0].dropout.inference is False
    assert scaled.embedding_norm.eps == 1e-12 and type(scaled.embedding_norm.eps) is float
    assert scaled.activation is jax.nn.tanh
    assert scaled.layers[0].attention.num_heads == zoo.CONFIG.num_heads
    assert _is_scaled(scaled.layers[1].attention.query_proj.weight)


def test_equinox_partition_keeps_its_none_leaves():
    model = _equinox_init()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    scaled = jsa.as_scaled_array(params, dtype=F16)
    _assert_same_structure(scaled, params)
    assert scaled.dropout.p is None and scaled.activation is jax.nn.tanh  # a static field
    # `eqx.combine` takes the first non-None leaf: with the ScaledArrays first it needs them
    # as leaves (a ScaledArray is a pytree node where the other half has a None leaf).
    for combined in (
        eqx.combine(static, scaled),
        eqx.combine(scaled, static, is_leaf=_is_scaled),
    ):
        _assert_same_structure(combined, model)
        _assert_converted(combined, model, F16)


# ---------------------------------------------------------------------------------------------
# Gradients.


@pytest.fixture(scope="module")
def programs():
    """(scaled case, float32 reference case) per (model, dtype), built once: their jitted
    `loss_and_grad` compile once and serve every test."""
    cache = {}

    def get(model, dtype):
        if (model, dtype) not in cache:
            build = zoo.CASES[model]
            cache[model, dtype] = (build(dtype), build(dtype, reference=True))
        return cache[model, dtype]

    return get


def _loss_and_grad(case, state=None):
    """(loss, gradients) of the step at `state` (by default the case's initial state)."""
    state = case.state if state is None else state
    return case.loss_and_grad(case.params(state), case.batch, case.key(state))


def _gradients(programs, model, dtype):
    """(loss, gradients) at the initial parameters: scaled, float32."""
    scaled, ref = programs(model, dtype)
    return _loss_and_grad(scaled), _loss_and_grad(ref)


@pytest.mark.parametrize(
    "model",
    # By default NNX only: linen trains by default in tests/docs/test_frameworks_doc.py and
    # tests/integration/test_libraries.py; the slow step runs all three.
    [m if m == "nnx" else pytest.param(m, marks=pytest.mark.slow) for m in MODELS],
)
@pytest.mark.slow
def test_float16_gradients_match_float32(programs, model):
    """Every gradient leaf within 2e-2 of float32's (relative to its largest entry), at the
    same parameter values. Measured (largest over the leaves): linen 3.3e-3, NNX 3.8e-4,
    Equinox 2.2e-3 (with bfloat16 data: 2.4e-2, 3.9e-3, 1.6e-2)."""
    (loss, grads), (ref_loss, ref_grads) = _gradients(programs, model, F16)
    _assert_scaled(grads, F16, "gradient")
    errors = _errors(grads, ref_grads)
    print(f"{model}: loss error {_relative_error(loss, ref_loss):.1e}, gradient errors {errors}")
    assert _relative_error(loss, ref_loss) <= 1e-2
    bad = {k: v for k, v in errors.items() if not v <= GRAD_TOL}
    assert not bad, bad


@pytest.mark.slow  # compiles the Equinox gradient program (see PROGRAM_MODELS)
def test_equinox_filter_value_and_grad_keeps_the_tree(programs):
    """`eqx.filter_value_and_grad` under autoscale differentiates the same leaves as without:
    the gradients have the structure of `eqx.filter(model, eqx.is_inexact_array)` (None
    where the model holds a Python float, a boolean, a function)."""
    (_, grads), (_, ref_grads) = _gradients(programs, "equinox", F16)
    _assert_same_structure(grads, ref_grads)
    model = zoo.equinox_init()
    assert jax.tree.structure(ref_grads) == jax.tree.structure(
        eqx.filter(model, eqx.is_inexact_array)
    )
    assert grads.dropout.p is None


# ---------------------------------------------------------------------------------------------
# Training.

# name: (data dtype, optimizer under autoscale, float32 reference optimizer or None: the same)
OPTIMIZERS = {
    "scaled-adam-f16": (
        F16,
        lambda: jsa.optax.scale_optimizer(optax.adam(1e-3)),
        lambda: optax.adam(1e-3),
    ),
    "sgd-momentum-f16": (F16, lambda: optax.sgd(1e-2, momentum=0.9), None),
    "sgd-momentum-bf16": (BF16, lambda: optax.sgd(1e-2, momentum=0.9), None),
    "adam-bf16": (BF16, lambda: optax.adam(1e-3), None),
    "adamw-bf16": (BF16, lambda: optax.adamw(1e-3, weight_decay=1e-2), None),
    "lion-bf16": (BF16, lambda: optax.lion(1e-4), None),
    "adafactor-bf16": (BF16, lambda: optax.adafactor(1e-2), None),
    "clip-decay-adam-schedule-bf16": (
        BF16,
        lambda: optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.add_decayed_weights(1e-4),
            optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 10)),
        ),
        None,
    ),
}
ON_EVERY_MODEL = ("scaled-adam-f16", "adam-bf16", "sgd-momentum-f16")
# Every training run is a `slow` test (tens of seconds each, mostly compiling; CI's second
# step, `-m slow`); the default run checks the gradients and the refusal of plain Adam on
# float16 data.
TRAINING = [
    pytest.param(
        model,
        opt,
        id=f"{model}-{opt}",
        marks=pytest.mark.slow,
    )
    for model in MODELS
    for opt in OPTIMIZERS
    if model == "linen" or opt in ON_EVERY_MODEL
]
# Optimizers whose update normalises each entry (Adam's m / sqrt(v), Lion's sign, Adafactor
# on vectors): an entry's step is about the learning rate whatever its gradient, so its
# sign follows the sign of a gradient that may be below the arithmetic's precision.
NORMALISING = {opt for opt in OPTIMIZERS if not opt.startswith("sgd")}
# Adam-family optimizers: the step whose update's signs are compared (the schedule's
# learning rate is 0 at the first step, so its first nonzero update is the second's).
SIGN_STEP = {
    "scaled-adam-f16": 0,
    "adam-bf16": 0,
    "adamw-bf16": 0,
    "lion-bf16": 0,
    "clip-decay-adam-schedule-bf16": 1,
}
SIGN_AGREEMENT = 0.99
# Normalising optimizers are compared on the entries whose float32 gradient stayed at or above
# FLOOR times its leaf's largest at every step: 2 to 15 times the gradient errors of
# `test_float16_gradients_match_float32` (float16 data at most 3.3e-3 of the leaf's largest,
# bfloat16 2.4e-2), so that the sign of each kept entry's gradient, hence of its step, is
# the float32 one. Below it the sign is rounding's: a zero-initialised bias whose one entry
# steps the other way has a relative error of 2/3 after three steps (measured over all
# entries: 0.66 with float16 `scale_optimizer(adam)`, 0.67 with bfloat16 Lion). Kept:
# linen 54% to 72% of the entries, NNX 72%, Equinox 29% (rows of the token embedding absent
# from the batch have no gradient; dropout changes the small gradients from step to step).
FLOOR = 5e-2
# Parameters after STEPS steps: max |error| / max |float32| per leaf (over the kept entries),
# by data dtype and whether the optimizer normalises. A kept entry of a normalising
# optimizer still moves by about the learning rate times (gradient / its RMS over steps):
# the gradient's error relative to the entry (up to the leaf-relative error / FLOOR) goes
# into its step, and on a zero-initialised leaf (biases, norms' offsets) the step is the
# whole value.
TOL = {
    (F16, False): 1e-2,
    (BF16, False): 3e-2,
    (F16, True): 3e-2,
    (BF16, True): 1.5e-1,
}


def _train(case, steps=STEPS):
    states, losses = [case.state], []
    for _ in range(steps):
        state, loss = case.step(states[-1], case.batch)
        states.append(state)
        losses.append(float(_values(loss)))
    return states, losses


def _kept(grads, floor):
    """{path: entries whose |gradient| is at least `floor` of their leaf's largest}."""
    return {
        k: np.abs(g) >= floor * np.max(np.abs(g), initial=0.0) for k, g in _arrays(grads).items()
    }


@pytest.mark.parametrize("model, opt", TRAINING)
def test_training_steps_match_float32(programs, model, opt):
    """STEPS steps of the framework's own training step under `jsa.autoscale`, from the
    scaled parameters, against the same steps in plain float32 from the values they
    represent. Every parameter is finite and still a ScaledArray of the data dtype, the
    losses are within 1% of float32's, and the parameters within `TOL` (max |error| / max
    |float32| per leaf; for normalising optimizers over the entries kept by `FLOOR`). For
    the Adam family, the update at `SIGN_STEP` has float32's sign on at least 99% of each
    leaf's kept entries (measured: 100% on every leaf of every case).

    Measured parameter errors (largest over the leaves, CPU):

    | optimizer | data | linen | NNX | Equinox |
    | --- | --- | --- | --- | --- |
    | `scale_optimizer(adam(1e-3))` | float16 | 9.9e-3 | 1.4e-3 | 3.1e-3 |
    | `sgd(1e-2, momentum=0.9)` | float16 | 4.2e-3 | 8.5e-4 | 1.3e-3 |
    | `sgd(1e-2, momentum=0.9)` | bfloat16 | 1.4e-2 | | |
    | `adam(1e-3)` | bfloat16 | 4.6e-2 | 1.3e-2 | 1.4e-2 |
    | `adamw(1e-3, weight_decay=1e-2)` | bfloat16 | 5.1e-2 | | |
    | `lion(1e-4)` | bfloat16 | 4.5e-3 | | |
    | `adafactor(1e-2)` | bfloat16 | 5.1e-2 | | |
    | clip, decay, adam with warmup-cosine | bfloat16 | 6.9e-2 | | |
    """
    dtype, make_opt, make_ref_opt = OPTIMIZERS[opt]
    build = zoo.CASES[model]
    case = build(dtype, make_opt)
    ref = build(dtype, make_ref_opt or make_opt, reference=True)
    states, losses = _train(case)
    ref_states, ref_losses = _train(ref)
    params, ref_params = case.params(states[-1]), ref.params(ref_states[-1])
    _assert_scaled(params, dtype, "parameter")
    for path, values in _arrays(params).items():
        assert np.all(np.isfinite(values)), f"{path} not finite"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-2)

    normalising = opt in NORMALISING
    scaled_program, ref_program = programs(model, dtype)
    kept = {k: np.ones(v.shape, bool) for k, v in _arrays(ref_params).items()}
    for ref_state in ref_states[:-1] if normalising else ():
        step_kept = _kept(_loss_and_grad(ref_program, ref_state)[1], FLOOR)
        kept = {k: kept[k] & step_kept[k] for k in kept}
    errors = _errors(params, ref_params, kept)
    worst = max(errors, key=errors.get)
    fraction = sum(k.sum() for k in kept.values()) / sum(k.size for k in kept.values())
    print(
        f"{model} {opt}: losses {losses} vs {ref_losses}; worst {worst} {errors[worst]:.1e}"
        f" over {fraction:.0%} of the entries"
    )
    bad = {k: v for k, v in errors.items() if not v <= TOL[dtype, normalising]}
    assert not bad, bad

    if opt in SIGN_STEP:
        k = SIGN_STEP[opt]
        _, grads = _loss_and_grad(scaled_program, states[k])
        _, ref_grads = _loss_and_grad(ref_program, ref_states[k])
        updates = _arrays(case.update(states[k], grads))
        ref_updates = _arrays(ref.update(ref_states[k], ref_grads))
        step_kept = _kept(ref_grads, FLOOR)
        agreement = {
            path: float(np.mean((np.sign(updates[path]) == np.sign(ref))[step_kept[path]]))
            for path, ref in ref_updates.items()
        }
        worst = min(agreement, key=agreement.get)
        print(f"{model} {opt}: sign agreement, worst {worst} {agreement[worst]:.3f}")
        bad = {k: v for k, v in agreement.items() if v < SIGN_AGREEMENT}
        assert not bad, bad


@pytest.mark.parametrize(
    "model",
    # The refusal is the optimizer's, whatever the model: NNX in the default run (its
    # gradient program compiled once for test_float16_gradients_match_float32); linen's
    # would compile another, and Equinox's is slow (see PROGRAM_MODELS).
    [m if m == "nnx" else pytest.param(m, marks=pytest.mark.slow) for m in MODELS],
)
@pytest.mark.slow
def test_plain_adam_on_float16_data_is_refused(programs, model):
    """Plain `optax.adam` on float16 ScaledArrays would divide by `sqrt(nu) + eps` with
    `eps` rounded to 0 in float16 (NaN parameters): the step, and the optimizer's update on
    its own, fail at trace time with a ValueError naming `jsa.optax.scale_optimizer`."""
    case = zoo.CASES[model](F16, lambda: optax.adam(1e-3))
    with pytest.raises(ValueError, match="scale_optimizer"):
        case.step(case.state, case.batch)
    _, grads = _loss_and_grad(programs(model, F16)[0], case.state)
    with pytest.raises(ValueError, match="scale_optimizer"):
        case.update(case.state, grads)
