"""Program size: a transformer-block training step and an Adam update under `autoscale`
stay lean.

Jaxpr equation counts are deterministic, so they are tested (times are not: see
`benchmarks/program_size.py`). Each scaled program may use at most its ratio (`RATIO`,
`UPDATE_RATIO`) times the equations of the plain one, and each primitive at most its
count in the committed budget (`tests/program_size_budget.json`): a rule change that adds
scalar work fails here, naming the program and the primitive whose count grew. After an
intended change, regenerate the budget:

    python -m tests.test_program_size
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scaled_arithmetics as jsa
from tests.helpers import load_script

BUDGET_PATH = Path(__file__).with_name("program_size_budget.json")
# Equations of the scaled step over the plain one: measured 2.3x on JAX 0.12 (620 vs 269)
# since the layer norms' backward passes are evaluated as the plain ones too (2.2x
# before, 584; 2.1x before their forward statistics were: the exponent arithmetic of the
# scales they hand on is a few integer equations more than the rules' measurements, with
# fewer kernels and compile unchanged), 2.3x before the softmax and one-term sums were
# unmeasured; the lean-programs target is 3x, see docs/benchmarks.md.
RATIO = 2.4
# The optimizer update (`scale_optimizer(optax.adam)` + `jsa.optax.apply_updates`, float16
# data) over plain float32 Adam: measured 1.9x (385 vs 204 on JAX 0.12: per input tensor a
# convert and a multiply, per stored moment and new parameter a multiply and a cast; the
# moments' factors from their bounds, one computation per moment on vectors of the stored
# state's and the gradients' largest magnitudes (one reduction), the new parameters' one
# `rescale_factors`; the update itself is added unstored); the target is 2x, see
# docs/benchmarks.md.
UPDATE_RATIO = 2.0
# Kernels of the compiled block step (XLA:CPU) over the plain one's: measured 2.4x on JAX
# 0.12 (206 vs 86), 2.5x on 0.10.0 (231 vs 92); 2.55x and 2.7x (219, 247) before the layer
# norms' backward passes were evaluated as the plain ones, 2.7x and 2.8x (233, 262) before
# their statistics were (core/normalization.py), 3.1x before
# the softmax and one-term sums were unmeasured, 3.7x while a small tensor's largest
# magnitude was three kernels, 5.7x while each ratio and dynamic scale was a kernel of its
# own; issue 43's target is 1.5x (docs/benchmarks.md).
KERNEL_RATIO = 2.75
# Kernels of the compiled optimizer update (XLA:CPU) over the plain one's: measured 3.05x
# on JAX 0.12, 3.15x on 0.10.0 (3.8x before the per-tensor measurements were grouped).
UPDATE_KERNEL_RATIO = 3.4
# Slack over the committed per-primitive counts: JAX releases move a few equations.
SLACK = 1.05


def _init_params(gpt, config):
    """The model's parameters, initialised under one `jax.jit` (eagerly, each operation of
    the initialisation is a compile of its own)."""
    return jax.jit(gpt.init_params, static_argnums=1)(jax.random.PRNGKey(0), config)


@functools.cache
def block_training_step():
    """A pre-norm transformer block (width 128, 4 heads, context 64, batch 16): loss,
    gradient and SGD update, as a function and its float32 arguments (built once)."""
    gpt = load_script("gpt_model", "experiments/gpt/model.py")
    config = gpt.GPTConfig(n_layer=1, n_head=4, n_embd=128, block_size=64)
    params = _init_params(gpt, config)["blocks"][0]
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 64, 128), jnp.float32)

    def loss(params, x):
        return jnp.mean(gpt.block(x, params, config) ** 2)

    def step(params, x):
        grads = jax.grad(loss)(params, x)
        return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads)

    return step, params, x


def equation_counts():
    step, params, x = block_training_step()
    with jax.numpy_rank_promotion("allow"):
        plain = jsa.analysis.equation_counts(step, params, x)
        scaled = jsa.analysis.equation_counts(jsa.autoscale(step), jsa.as_scaled_array(params), x)
    return plain, scaled


@functools.cache
def optimizer_update_programs():
    """The Adam update and `apply_updates` of the block's parameters, given gradients:
    plain float32 optax, and `jsa.optax.scale_optimizer` on float16 ScaledArrays, as
    `(plain step, its arguments, scaled step, its arguments)` (built once)."""
    _, params, _ = block_training_step()
    plain_tx = optax.adam(1e-3)
    scaled_tx = jsa.optax.scale_optimizer(optax.adam(1e-3))

    @jax.jit
    def arguments(params):
        """The programs' arguments, built in one compile (eagerly, each operation on each
        leaf's shape is one)."""
        grads = jax.tree_util.tree_map(lambda p: 1e-3 * jnp.ones_like(p), params)
        scaled_params, scaled_grads = jsa.as_scaled_array((params, grads), dtype=jnp.float16)
        return (
            grads,
            plain_tx.init(params),
            scaled_params,
            scaled_grads,
            scaled_tx.init(scaled_params),
        )

    grads, plain_state, scaled_params, scaled_grads, scaled_state = arguments(params)

    def update(tx, apply):
        def step(params, grads, state):
            updates, state = tx.update(grads, state, params)
            return apply(params, updates), state

        return step

    return (
        update(plain_tx, optax.apply_updates),
        (params, grads, plain_state),
        jsa.autoscale(update(scaled_tx, jsa.optax.apply_updates)),
        (scaled_params, scaled_grads, scaled_state),
    )


def update_equation_counts():
    plain_step, plain_args, scaled_step, scaled_args = optimizer_update_programs()
    plain = jsa.analysis.equation_counts(plain_step, *plain_args)
    scaled = jsa.analysis.equation_counts(scaled_step, *scaled_args)
    return plain, scaled


def _check_budget(program, scaled, plain, ratio_limit):
    budget = json.loads(BUDGET_PATH.read_text())[program]
    grown = {
        name: (count, budget.get(name, 0))
        for name, count in scaled.items()
        if count > SLACK * budget.get(name, 0) + 2
    }
    assert not grown, f"{program}: scaled equations above the budget (count, budget): " + (
        ", ".join(f"{name} {count} > {allowed}" for name, (count, allowed) in sorted(grown.items()))
    )
    ratio = sum(scaled.values()) / sum(plain.values())
    assert ratio <= ratio_limit, f"{program}: scaled / plain equations {ratio:.2f} > {ratio_limit}"


def test_block_training_step_program_size():
    plain, scaled = equation_counts()
    _check_budget("block_step", scaled, plain, RATIO)


def test_optimizer_update_program_size():
    plain, scaled = update_equation_counts()
    _check_budget("optimizer_update", scaled, plain, UPDATE_RATIO)


def test_program_size_ignores_the_data():
    """The scaled program does not depend on the values: static scales fold the same way."""
    step, params, x = block_training_step()
    scaled = jsa.as_scaled_array(params)
    other = jax.tree_util.tree_map(
        lambda p: jsa.ScaledArray(p.data * 3, p.scale * np.float32(0.25)),
        scaled,
        is_leaf=jsa.is_scaled_leaf,
    )
    with jax.numpy_rank_promotion("allow"):
        counts = [jsa.analysis.equation_counts(jsa.autoscale(step), p, x) for p in (scaled, other)]
    assert counts[0] == counts[1]


if __name__ == "__main__":
    budget = {}
    for program, counts in (
        ("block_step", equation_counts),
        ("optimizer_update", update_equation_counts),
    ):
        plain, scaled = counts()
        budget[program] = dict(sorted(scaled.items()))
        print(f"{program}: plain {sum(plain.values())}, scaled {sum(scaled.values())}")
    BUDGET_PATH.write_text(json.dumps(budget, indent=1) + "\n")
    print(f"wrote {BUDGET_PATH}")


def _hlo_instructions(compiled) -> int:
    """Instructions of an optimized HLO module, fusion bodies included (what XLA compiles)."""
    return sum(" = " in line for line in compiled.as_text().splitlines())


def _kernels(compiled) -> int:
    """Kernels of an optimized HLO module, counted as `benchmarks/program_size.py` counts
    them (its ENTRY instructions other than parameters, constants, tuples and bitcasts)."""
    benchmark = load_script("program_size", "benchmarks/program_size.py")
    return benchmark.hlo_counts(compiled.as_text())[0]


def test_a_scalar_every_leaf_reads_is_computed_once():
    """`clip_by_global_norm`'s factor is a scalar ScaledArray computed through every leaf's
    sum: XLA copied its chain of cheap scale arithmetic into each leaf's kernel (80x the
    plain step's HLO instructions on 24 leaves) until the interpreter computed such scalars
    once (`materialize_scalar`): 19x measured on JAX 0.10.2, values bit-identical."""
    params = {f"w{i}": jnp.full((8, 8), 0.1 * (i + 1)) for i in range(24)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2))

    def step(params, state):
        grads = jax.grad(lambda p: sum(jnp.sum(jnp.tanh(v) ** 2) for v in p.values()))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    plain = _hlo_instructions(jax.jit(step).lower(params, state).compile())
    scaled_params = jsa.as_scaled_array(params, dtype=jnp.bfloat16)
    scaled_step = jax.jit(jsa.autoscale(step))
    scaled = _hlo_instructions(scaled_step.lower(scaled_params, state).compile())
    assert scaled <= 40 * plain, f"scaled {scaled} HLO instructions, plain {plain}"
    new_params, _ = scaled_step(scaled_params, state)
    reference, _ = jax.jit(step)(jsa.asarray(scaled_params, jnp.float32), state)
    for name in params:
        np.testing.assert_allclose(
            jsa.asarray(new_params[name], jnp.float32), reference[name], rtol=1e-2
        )


@pytest.mark.slow  # ~9 s to compile; the default run keeps the budgets and the scalar check
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's lowering of the scales")
def test_compiled_block_step_reads_each_scale_from_memory():
    """XLA compiles what the scale algebra lowers to: on XLA:CPU each scale is computed
    once, in a kernel of its own, and read by the kernels that use it (its ratios fused
    into them). Copied into every reader instead, a scale's exponent arithmetic made the
    block step's optimized HLO 12x the plain one's, and no two of its scalar kernels alike,
    each compiled on its own (measured 5.3-5.4x since the softmax and one-term sums are
    unmeasured, JAX 0.10.0 and 0.12; 6.4-6.6x since the scales and rescaled tensors read
    twice are materialised). The kernels are counted too: a rule change that adds kernels
    fails here."""
    step, params, x = block_training_step()
    with jax.numpy_rank_promotion("allow"):
        plain_compiled = jax.jit(step).lower(params, x).compile()
        scaled_step = jax.jit(jsa.autoscale(step))
        scaled_params = jsa.as_scaled_array(params)
        scaled_compiled = scaled_step.lower(scaled_params, x).compile()
        plain, scaled = map(_hlo_instructions, (plain_compiled, scaled_compiled))
        new_params = scaled_step(scaled_params, x)
        reference = jax.jit(step)(params, x)
    assert scaled <= 6.5 * plain, f"scaled {scaled} HLO instructions, plain {plain}"
    kernels = _kernels(scaled_compiled) / _kernels(plain_compiled)
    assert kernels <= KERNEL_RATIO, f"scaled / plain kernels {kernels:.2f} > {KERNEL_RATIO}"
    for got, want in zip(
        jax.tree_util.tree_leaves(new_params, is_leaf=jsa.is_scaled_leaf),
        jax.tree_util.tree_leaves(reference),
        strict=True,
    ):
        np.testing.assert_allclose(got.to_array(), want, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's kernels")
def test_compiled_optimizer_update_measures_its_tensors_together():
    """XLA:CPU gives each reduction a kernel of its own; the scaled update's per-tensor
    measurements (the stored moments', the new parameters') are variadic reductions of
    several tensors each, one kernel for each group: 3.05x the plain update's kernels
    measured on JAX 0.12 (119 against 39; 0.10.0: 123), 3.8x when each tensor's largest
    magnitude was a kernel of its own. The values: float32 Adam's."""
    plain_step, plain_args, scaled_step, scaled_args = optimizer_update_programs()
    plain_compiled = jax.jit(plain_step).lower(*plain_args).compile()
    scaled_compiled = jax.jit(scaled_step).lower(*scaled_args).compile()
    kernels = _kernels(scaled_compiled) / _kernels(plain_compiled)
    assert kernels <= UPDATE_KERNEL_RATIO, (
        f"scaled / plain kernels {kernels:.2f} > {UPDATE_KERNEL_RATIO}"
    )
    new_params, _ = scaled_compiled(*scaled_args)
    reference, _ = plain_compiled(*plain_args)
    for got, want in zip(
        jax.tree_util.tree_leaves(new_params, is_leaf=jsa.is_scaled_leaf),
        jax.tree_util.tree_leaves(reference),
        strict=True,
    ):
        np.testing.assert_allclose(got.to_array().astype(np.float32), want, rtol=2e-3, atol=1e-6)


def _largest_fusion(compiled) -> int:
    """Instructions of the largest fused computation of an optimized HLO module."""
    sizes: list[int] = []
    inside = False
    for line in compiled.as_text().splitlines():
        if line.startswith(("%fused", "%wrapped")):
            inside = True
            sizes.append(0)
        elif line.startswith("}"):
            inside = False
        elif inside and " = " in line:
            sizes[-1] += 1
    return max(sizes)


@pytest.mark.slow  # ~30 s: two 3-block GPT gradients compiled (fewer blocks: no margin)
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's lowering of the scales")
def test_deep_residual_stream_is_computed_once():
    """XLA:CPU recomputes cheap elementwise producers inside each of their consumers: the
    backward pass's residual chain, two ratio multiplies per scaled add, went into every
    block's kernels (3 blocks: largest fusion 728 instructions, plain 261; 8 blocks of the
    char GPT: 1,760, compile 21 s against plain 4 s). A rescaled tensor that two or more
    equations read is computed once instead (measured: largest fusion 52, HLO instructions
    3.6x plain, 5.0x before), and the gradient is unchanged."""
    gpt = load_script("gpt_model", "experiments/gpt/model.py")
    config = gpt.GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=32)
    params = _init_params(gpt, config)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 17), 0, 32)

    def gradient(params, tokens):
        return jax.grad(gpt.loss_fn)(params, tokens[:, :-1], tokens[:, 1:], config)

    with jax.numpy_rank_promotion("allow"):
        plain = jax.jit(gradient).lower(params, tokens).compile()
        scaled_gradient = jax.jit(jsa.autoscale(gradient))
        scaled_params = jsa.as_scaled_array(params)
        scaled = scaled_gradient.lower(scaled_params, tokens).compile()
        grads = scaled_gradient(scaled_params, tokens)
        reference = plain(params, tokens)
    assert _largest_fusion(scaled) <= _largest_fusion(plain), (
        f"largest fusion: scaled {_largest_fusion(scaled)}, plain {_largest_fusion(plain)}"
    )
    ratio = _hlo_instructions(scaled) / _hlo_instructions(plain)
    assert ratio <= 4.2, f"scaled / plain HLO instructions {ratio:.2f}"
    for got, want in zip(
        jax.tree_util.tree_leaves(grads, is_leaf=jsa.is_scaled_leaf),
        jax.tree_util.tree_leaves(reference),
        strict=True,
    ):
        scale = np.abs(np.asarray(want)).max()
        np.testing.assert_allclose(got.to_array(), want, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.slow  # ~10 s: the zoo's Equinox gradient compiled twice
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's fusion of producers")
def test_a_post_norm_residual_stream_is_computed_once():
    """The zoo's Equinox BERT is post-norm: each layer norm's float32 output, cast to
    float16, is the residual stream every later equation of the block reads. The norm's
    output is written once (core/normalization.py's `_readers`), so XLA:CPU's fusions do
    not recompute the blocks before it in each reader: without, the gradient's largest
    fusion was 1,401 instructions (plain 367) and 10 more reductions were split over
    threads, the step 18% slower than before the backward pass was a run."""
    benchmark = load_script("program_size", "benchmarks/program_size.py")
    case = benchmark.CASES["zoo-equinox-grad"][0](jnp.float16)
    plain = jax.jit(case.plain_step).lower(*case.plain_args).compile()
    scaled_step = jsa.autoscale(case.scaled_step or case.plain_step)
    scaled = jax.jit(scaled_step).lower(*case.scaled_args).compile()
    assert _largest_fusion(scaled) <= 1.5 * _largest_fusion(plain), (
        f"largest fusion: scaled {_largest_fusion(scaled)}, plain {_largest_fusion(plain)}"
    )
