"""Program size, compile cost and step time of training steps: plain vs `jsa.autoscale`.

For each case (a training step, or a block's forward + backward), the plain variant is
`jax.jit(step)` on float32 arrays; the scaled variant is `jax.jit(jsa.autoscale(step))` with the
parameters and optimizer state converted by `jsa.as_scaled_array(tree, dtype=...)`. Inputs
(images, tokens, labels) stay plain arrays: floating inputs are cast to the data dtype, tokens
are int32. Measured per variant:

- program size: jaxpr equations of the un-jitted function, sub-jaxprs counted, in total and by
  primitive (`jsa.analysis.equation_counts`);
- trace, lower and compile time (`jax.jit(f).trace(*args)`, `.lower()`, `.compile()`), each
  cold, and the first call (those three plus the first execution);
- memory of compiling: each (case, variant) is traced, lowered and compiled in a fresh
  subprocess, which reports its RSS just before `.compile()` and its peak RSS right after. The
  peak count is restarted before compiling (`/proc/self/clear_refs`) and read from VmHWM, so
  building the case does not mask the compile's own peak; `ru_maxrss` (the process's peak since
  it started: it keeps earlier peaks) is in the JSON;
- step time: the two compiled steps run alternately in one process (warm-up, then `--iters`
  rounds of [plain, scaled]); medians and their ratio. The executables compiled by the
  subprocesses are handed back (`jax.experimental.serialize_executable`), so nothing is compiled
  twice.

With `--no-memory` everything runs in this process: no memory numbers, no `--timeout`, and the
second variant of a case may find JAX's tracing caches of shared helpers warm.

Run:
    python benchmarks/program_size.py [--cases mlp,cnn,block,gpt-adam,...] [--iters 30]
        [--dtype float32|float16|bfloat16] [--by-primitive] [--json out.json]
        [--no-step] [--no-memory] [--timeout 900] [--warmup 5]

    gpt2-small's plain step takes ~20 s on 2 CPU cores: `--cases gpt2-small --warmup 1 --iters 3`.

Cases (`--cases`, default: all but gpt2-small, gpt2-small-scan, gpt2-small-scan-remat,
gpt12-adam and gpt8-scan-remat, which are slow or for the delayed-scaling benchmarks: opt
in):
    mlp: MLP 784-1024x4-10, batch 256, SGD step.
    cnn: 2 conv layers (28x28x1), relu, average and max pooling, dense; batch 64, SGD step.
    block: one pre-norm GPT block (experiments/gpt/model.py; d 128, 4 heads, T 64, batch 16),
        grad of a sum-of-squares loss of its output w.r.t. its params.
    gpt-adam, gpt2-adam, gpt4-adam, gpt8-adam, gpt12-adam: char GPT with 1, 2, 4, 8 or 12
        blocks (same shapes, unrolled), optax.adam step.
    gpt8-scan: gpt8-adam with the blocks stacked and run as a lax.scan over layers.
    gpt8-scan-remat: gpt8-scan with each block under `jax.checkpoint` (recomputed in the
        backward pass).
    gpt-adam-channel: gpt-adam with block scales, one per output channel, on every
        parameter and Adam moment of rank >= 2.
    gpt-scaled-opt: char GPT, 1 block; scaled: `jsa.optax.scale_optimizer(optax.adam)` and
        `jsa.optax.apply_updates`; plain: the float32 optax.adam step.
    gpt-scaled-opt-channel: gpt-scaled-opt with every parameter of rank >= 2 (and so its
        Adam moments) scaled per output channel.
    gpt-unit-fp8: char GPT, 1 block, adam; the "scaled" variant is
        `jsa.ops.simulate_fp8(U.unit_scale(loss))` on float32 `U.unit_init` parameters (no
        autoscale).
    adam-update: the optimizer alone: optax.adam update + optax.apply_updates on the 1-block
        char GPT's parameters and given gradients (scaled: bfloat16 data by default).
    scaled-opt-update: the same with `jsa.optax.scale_optimizer(optax.adam)` and
        `jsa.optax.apply_updates` (float16 data).
    zoo-linen, zoo-nnx, zoo-equinox: the transformers of tests/integration/zoo.py (a Flax
        linen GPT with TrainState, a Flax NNX Llama-like LM with split/merge, an Equinox
        BERT-like classifier with filter_value_and_grad), their own training steps; scaled:
        float16 data and `scale_optimizer(adam)`, plain: float32 optax.adam.
        `zoo-*-grad`: their loss and gradient alone; `zoo-*-update`: their optimizer update
        alone, from given gradients, applied as the framework does (`apply_gradients`,
        `optax.apply_updates`, `eqx.apply_updates`).
    nnx: Flax NNX Linear-LayerNorm-Linear (784-512-10), batch 64, SGD step on `nnx.split`'s state.
    gpt2-small: 12 blocks, d 768, 12 heads, T 256, batch 4, vocab 50257, optax.adam step.
    gpt2-small-scan: the same with its blocks as a lax.scan over layers.
    gpt2-small-scan-remat: gpt2-small-scan with each block checkpointed.

The data dtype of the scaled variant is `--dtype`, by default float32, except float16 for
gpt-scaled-opt, gpt-scaled-opt-channel and the gpt2-small cases. The header line gives
the machine, the git commit and the number of uncommitted changes under
jax_scaled_arithmetics/ (the numbers are of the working tree).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import importlib.metadata
import importlib.util
import json
import os
import pickle
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import serialize_executable

import jax_scaled_arithmetics as jsa
import jax_scaled_arithmetics.unit_scaling as U

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("plain", "scaled")


def _load_gpt_model() -> Any:
    """experiments/gpt/model.py, imported from its path."""
    path = ROOT / "experiments" / "gpt" / "model.py"
    spec = importlib.util.spec_from_file_location("gpt_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpt = _load_gpt_model()


# ----------------------------------------------------------------------------------------------
# Cases: each builds (step, plain args, scaled args).


@dataclasses.dataclass
class Case:
    """A step function with its plain and scaled arguments.

    `scaled_step` is the function `jsa.autoscale` transforms; it is `plain_step` except where
    the scaled version uses a different optimizer (gpt-scaled-opt).
    """

    plain_step: Callable[..., Any]
    plain_args: tuple[Any, ...]
    scaled_args: tuple[Any, ...]
    scaled_step: Callable[..., Any] | None = None
    transform: Callable[..., Any] = jsa.autoscale

    def step(self, variant: str) -> Callable[..., Any]:
        if variant == "plain":
            return self.plain_step
        return self.transform(self.scaled_step or self.plain_step)

    def args(self, variant: str) -> tuple[Any, ...]:
        return self.plain_args if variant == "plain" else self.scaled_args


def _scaled(tree: Any, dtype: Any) -> Any:
    """Parameters / optimizer state: ScaledArrays with `dtype` data (integers stay as they are)."""
    return jsa.as_scaled_array(tree, dtype=dtype)


def _cast(x: jax.Array, dtype: Any) -> jax.Array:
    """A floating input, kept plain, in the data dtype of the scaled variant."""
    return x.astype(dtype)


def _sgd(params: Any, grads: Any, lr: float = 0.01) -> Any:
    return jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)


def _cross_entropy(logits: jax.Array, onehot: jax.Array) -> jax.Array:
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * onehot, axis=-1))


def case_mlp(dtype: Any) -> Case:
    """MLP 784-1024x4-10 (as benchmarks/step_time.py), batch 256, SGD step."""
    key_p, key_x, key_y = jax.random.split(jax.random.PRNGKey(0), 3)
    sizes = [784] + [1024] * 4 + [10]
    keys = jax.random.split(key_p, len(sizes) - 1)
    params = [
        (jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.zeros(b))
        for k, a, b in zip(keys, sizes[:-1], sizes[1:])
    ]
    x = jax.random.normal(key_x, (256, 784))
    y = jax.nn.one_hot(jax.random.randint(key_y, (256,), 0, 10), 10)

    def loss_fn(params, x, y):
        for w, b in params[:-1]:
            x = jax.nn.relu(x @ w + b)
        w, b = params[-1]
        return _cross_entropy(x @ w + b, y)

    def step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return _sgd(params, grads), loss

    return Case(step, (params, x, y), (_scaled(params, dtype), _cast(x, dtype), _cast(y, dtype)))


def case_cnn(dtype: Any) -> Case:
    """CNN on 28x28x1: conv 3x3x16, relu, avg pool, conv 3x3x32, relu, max pool, dense; SGD."""
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    params = {
        "conv1": jax.random.normal(keys[0], (3, 3, 1, 16)) / 3.0,
        "b1": jnp.zeros(16),
        "conv2": jax.random.normal(keys[1], (3, 3, 16, 32)) / 12.0,
        "b2": jnp.zeros(32),
        "dense": jax.random.normal(keys[2], (7 * 7 * 32, 10)) / np.sqrt(7 * 7 * 32),
        "b3": jnp.zeros(10),
    }
    x = jax.random.normal(keys[3], (64, 28, 28, 1))
    y = jax.nn.one_hot(jax.random.randint(keys[4], (64,), 0, 10), 10)

    def conv(x, w, b):
        dims = ("NHWC", "HWIO", "NHWC")
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dims) + b

    def pool(x, init, op):
        return jax.lax.reduce_window(x, init, op, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

    def loss_fn(p, x, y):
        x = jax.nn.relu(conv(x, p["conv1"], p["b1"]))
        x = pool(x, 0.0, jax.lax.add) / 4.0  # average pool: 28 -> 14
        x = jax.nn.relu(conv(x, p["conv2"], p["b2"]))
        x = pool(x, -jnp.inf, jax.lax.max)  # max pool: 14 -> 7
        return _cross_entropy(x.reshape(x.shape[0], -1) @ p["dense"] + p["b3"], y)

    def step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return _sgd(params, grads), loss

    return Case(step, (params, x, y), (_scaled(params, dtype), _cast(x, dtype), _cast(y, dtype)))


def _gpt_config(n_layer: int = 1) -> Any:
    return gpt.GPTConfig(vocab_size=65, block_size=64, n_layer=n_layer, n_head=4, n_embd=128)


def case_block(dtype: Any) -> Case:
    """One pre-norm GPT block (d 128, 4 heads, T 64, batch 16): grad of sum(out**2) wrt params."""
    config = _gpt_config()
    key_p, key_x = jax.random.split(jax.random.PRNGKey(2))
    params = gpt.init_params(key_p, config)["blocks"][0]
    x = jax.random.normal(key_x, (16, config.block_size, config.n_embd))

    def step(p, x):
        return jax.grad(lambda p: jnp.sum(gpt.block(x, p, config) ** 2))(p)

    return Case(step, (params, x), (_scaled(params, dtype), _cast(x, dtype)))


def _tokens(config: Any, batch: int, seed: int = 3) -> tuple[jax.Array, jax.Array]:
    key_t, key_y = jax.random.split(jax.random.PRNGKey(seed))
    shape = (batch, config.block_size)
    return (
        jax.random.randint(key_t, shape, 0, config.vocab_size, jnp.int32),
        jax.random.randint(key_y, shape, 0, config.vocab_size, jnp.int32),
    )


def _gpt_step(config: Any, opt: Any, apply_updates: Callable[..., Any]) -> Callable[..., Any]:
    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(gpt.loss_fn)(params, tokens, targets, config)
        updates, opt_state = opt.update(grads, opt_state, params)
        return apply_updates(params, updates), opt_state, loss

    return step


def _gpt_adam_case(config: Any, batch: int, dtype: Any, scan: bool = False) -> Case:
    """Char GPT training step with optax.adam; params and Adam state scaled alike.

    With `scan`, the blocks are stacked and run as a `lax.scan` over layers. With float16
    (or FP8) data the scaled variant wraps Adam in `jsa.optax.scale_optimizer` (with
    `jsa.optax.apply_updates`): plain optax.adam on float16 data is refused at trace time
    (its eps is 0 in float16)."""
    opt = optax.adam(1e-3)
    params = gpt.init_params(jax.random.PRNGKey(4), config)
    if scan:
        params = gpt.stack_blocks(params)
    state = opt.init(params)
    tokens, targets = _tokens(config, batch)
    plain_step = _gpt_step(config, opt, optax.apply_updates)
    if jnp.finfo(jnp.dtype(dtype)).maxexp < 128:
        scaled_opt = jsa.optax.scale_optimizer(opt)
        scaled_params = _scaled(params, dtype)
        return Case(
            plain_step,
            (params, state, tokens, targets),
            (scaled_params, scaled_opt.init(scaled_params), tokens, targets),
            scaled_step=_gpt_step(config, scaled_opt, jsa.optax.apply_updates),
        )
    return Case(
        plain_step,
        (params, state, tokens, targets),
        (_scaled(params, dtype), _scaled(state, dtype), tokens, targets),
    )


def case_gpt_adam(dtype: Any) -> Case:
    """Char GPT, 1 block (d 128, 4 heads, T 64, batch 16), optax.adam step."""
    return _gpt_adam_case(_gpt_config(1), 16, dtype)


def case_gpt2_adam(dtype: Any) -> Case:
    """Char GPT, 2 blocks, optax.adam step."""
    return _gpt_adam_case(_gpt_config(2), 16, dtype)


def case_gpt4_adam(dtype: Any) -> Case:
    """Char GPT, 4 blocks (unrolled), optax.adam step."""
    return _gpt_adam_case(_gpt_config(4), 16, dtype)


def case_gpt8_adam(dtype: Any) -> Case:
    """Char GPT, 8 blocks (unrolled), optax.adam step."""
    return _gpt_adam_case(_gpt_config(8), 16, dtype)


def case_gpt12_adam(dtype: Any) -> Case:
    """Char GPT, 12 blocks (unrolled), optax.adam step."""
    return _gpt_adam_case(_gpt_config(12), 16, dtype)


def case_gpt8_scan(dtype: Any) -> Case:
    """Char GPT, 8 blocks run as a lax.scan over stacked block parameters, optax.adam step."""
    return _gpt_adam_case(_gpt_config(8), 16, dtype, scan=True)


def case_gpt8_scan_remat(dtype: Any) -> Case:
    """The 8-block scanned char GPT with each block checkpointed (`jax.checkpoint`)."""
    config = dataclasses.replace(_gpt_config(8), remat=True)
    return _gpt_adam_case(config, 16, dtype, scan=True)


def case_gpt_scaled_opt(dtype: Any) -> Case:
    """Char GPT, 1 block; scaled: jsa.optax.scale_optimizer(adam); plain: optax.adam, float32."""
    return _gpt_scaled_opt_case(dtype, lambda params: _scaled(params, dtype))


def case_gpt_unit_fp8(dtype: Any) -> Case:
    """Char GPT, 1 block, adam; "scaled": `jsa.ops.simulate_fp8(U.unit_scale(loss))` on float32
    `U.unit_init` parameters (no autoscale): the cost of the unit-scaling transform and of the
    FP8 casts."""
    config = _gpt_config(1)
    plain = _gpt_adam_case(config, 16, dtype)
    opt = optax.adam(1e-3)
    loss = jsa.ops.simulate_fp8(U.unit_scale(gpt.loss_fn))

    def step(params, opt_state, tokens, targets):
        value, grads = jax.value_and_grad(loss)(params, tokens, targets, config)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params = U.unit_init(plain.plain_args[0])
    return Case(
        plain.plain_step,
        plain.plain_args,
        (params, opt.init(params), *plain.plain_args[2:]),
        scaled_step=step,
        transform=lambda f: f,
    )


class NnxMLP(nnx.Module):
    """Linear 784-512, LayerNorm, relu, Linear 512-10."""

    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(784, 512, rngs=rngs)
        self.norm = nnx.LayerNorm(512, rngs=rngs)
        self.fc2 = nnx.Linear(512, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.relu(self.norm(self.fc1(x))))


def case_nnx(dtype: Any) -> Case:
    """Flax NNX model, batch 64: SGD step as a pure function of the `nnx.split` state."""
    graphdef, state = nnx.split(NnxMLP(nnx.Rngs(5)))
    key_x, key_y = jax.random.split(jax.random.PRNGKey(6))
    x = jax.random.normal(key_x, (64, 784))
    y = jax.nn.one_hot(jax.random.randint(key_y, (64,), 0, 10), 10)

    def loss_fn(state, x, y):
        return _cross_entropy(nnx.merge(graphdef, state)(x), y)

    def step(state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(state, x, y)
        return _sgd(state, grads), loss

    return Case(step, (state, x, y), (_scaled(state, dtype), _cast(x, dtype), _cast(y, dtype)))


def case_gpt2_small(dtype: Any) -> Case:
    """GPT-2-small-shaped step: 12 blocks, d 768, 12 heads, T 256, batch 4, vocab 50257; adam."""
    config = gpt.GPTConfig(vocab_size=50257, block_size=256, n_layer=12, n_head=12, n_embd=768)
    return _gpt_adam_case(config, 4, dtype)


def case_gpt2_small_scan(dtype: Any) -> Case:
    """The GPT-2-small-shaped step with its 12 blocks run as a lax.scan over layers."""
    config = gpt.GPTConfig(vocab_size=50257, block_size=256, n_layer=12, n_head=12, n_embd=768)
    return _gpt_adam_case(config, 4, dtype, scan=True)


def case_gpt2_small_scan_remat(dtype: Any) -> Case:
    """The GPT-2-small-shaped scanned step with each block checkpointed."""
    config = gpt.GPTConfig(
        vocab_size=50257, block_size=256, n_layer=12, n_head=12, n_embd=768, remat=True
    )
    return _gpt_adam_case(config, 4, dtype, scan=True)


def _per_channel_layout(shape: tuple[int, ...]) -> tuple[int, ...]:
    """One scale per entry of the last axis (per output channel), one block elsewhere."""
    return (1,) * (len(shape) - 1) + shape[-1:] if len(shape) >= 2 else (1,) * len(shape)


def case_gpt_adam_channel(dtype: Any) -> Case:
    """case_gpt_adam with block scales: every parameter and Adam moment of rank >= 2 scaled
    per output channel (`(1, N)`), vectors per tensor."""
    plain = case_gpt_adam(dtype)
    params, state, tokens, targets = plain.plain_args

    def per_channel(tree: Any) -> Any:
        return jsa.as_scaled_array(tree, dtype=dtype, scale_shape=_per_channel_layout)

    return Case(
        plain.plain_step,
        plain.plain_args,
        (per_channel(params), per_channel(state), tokens, targets),
    )


def case_gpt_scaled_opt_channel(dtype: Any) -> Case:
    """gpt-scaled-opt with every parameter of rank >= 2 scaled per output channel (`(1, N)`):
    `scale_optimizer` stores their Adam moments with the same block scales."""
    return _gpt_scaled_opt_case(
        dtype,
        lambda params: jsa.as_scaled_array(params, dtype=dtype, scale_shape=_per_channel_layout),
    )


def _gpt_scaled_opt_case(dtype: Any, to_scaled: Callable[[Any], Any]) -> Case:
    """Char GPT, 1 block: plain optax.adam in float32 vs `scale_optimizer(adam)` on the
    parameters `to_scaled` gives."""
    config = _gpt_config(1)
    plain = _gpt_adam_case(config, 16, dtype)
    opt = jsa.optax.scale_optimizer(optax.adam(1e-3))
    params = to_scaled(plain.plain_args[0])
    tokens, targets = plain.plain_args[2:]
    return Case(
        plain.plain_step,
        plain.plain_args,
        (params, opt.init(params), tokens, targets),
        scaled_step=_gpt_step(config, opt, jsa.optax.apply_updates),
    )


def _update_case(opt: Any, apply_updates: Callable[..., Any], dtype: Any) -> Case:
    """The optimizer update alone on the 1-block char GPT's parameters: `opt.update` and
    `apply_updates` from given gradients; plain: float32 optax.adam."""
    config = _gpt_config(1)
    plain_opt = optax.adam(1e-3)
    params = gpt.init_params(jax.random.PRNGKey(4), config)
    grads = jax.tree_util.tree_map(lambda p: 1e-3 * jnp.cos(p), params)

    scaled_params, scaled_grads = _scaled(params, dtype), _scaled(grads, dtype)
    return Case(
        _optax_update(plain_opt, optax.apply_updates),
        (params, plain_opt.init(params), grads),
        (scaled_params, opt.init(scaled_params), scaled_grads),
        scaled_step=_optax_update(opt, apply_updates),
    )


def case_adam_update(dtype: Any) -> Case:
    """optax.adam update + optax.apply_updates alone on the 1-block char GPT's parameters,
    plain float32 vs the same under autoscale (`--dtype` data; bfloat16 or float32: plain
    optax on float16 data is refused)."""
    return _update_case(optax.adam(1e-3), optax.apply_updates, dtype)


def case_scaled_opt_update(dtype: Any) -> Case:
    """`jsa.optax.scale_optimizer(optax.adam)` + `jsa.optax.apply_updates` alone (float16
    data) vs the plain float32 optax.adam update."""
    return _update_case(jsa.optax.scale_optimizer(optax.adam(1e-3)), jsa.optax.apply_updates, dtype)


def _zoo() -> Any:
    """tests/integration/zoo.py: the linen, NNX and Equinox transformers as users write them."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.integration import zoo

    return zoo


def _given_gradients(params: Any, dtype: Any) -> tuple[Any, Any]:
    """Gradients for an update-only case: float32 leaves of the parameters' shapes (None
    stays None), and the same as ScaledArrays of `dtype` data."""
    grads = jax.tree_util.tree_map(lambda p: 1e-3 * jnp.cos(p), params)
    return grads, _scaled(grads, dtype)


def _linen_apply_gradients(state: Any, grads: Any) -> Any:
    """`TrainState.apply_gradients` alone: the linen idiom's update."""
    return state.apply_gradients(grads=grads)


def _optax_update(tx: Any, apply: Callable[..., Any]) -> Callable[..., Any]:
    def update(params: Any, opt_state: Any, grads: Any) -> Any:
        updates, opt_state = tx.update(grads, opt_state, params)
        return apply(params, updates), opt_state

    return update


def _zoo_case(model: str, dtype: Any, part: str) -> Case:
    """A zoo model's step (`part="step"`, plain float32 optax.adam vs scaled data with
    `scale_optimizer(adam)`), its gradient alone (`part="grad"`), or its optimizer update
    alone from given gradients (`part="update"`: `opt.update` and the framework's way of
    applying it), as the framework's idiom writes it. Equinox modules hold functions: the
    benchmark jits their array leaves and closes over the rest (what `eqx.filter_jit`
    does)."""
    import equinox as eqx
    from flax.training import train_state

    zoo = _zoo()
    opt = optax.adam(1e-3)
    scaled_opt = jsa.optax.scale_optimizer(optax.adam(1e-3))
    if model == "linen":
        _, variables = zoo.linen_lm_init()
        params = variables["params"]
        sparams = _scaled(params, dtype)
        plain_model, scaled_model = zoo.linen_lm(dtype=jnp.float32), zoo.linen_lm(dtype=dtype)
        batch = zoo.lm_batch()
        if part == "grad":
            return Case(
                lambda p, b: zoo.linen_loss_and_grad(plain_model.apply, p, b),
                (params, batch),
                (sparams, batch),
                scaled_step=lambda p, b: zoo.linen_loss_and_grad(scaled_model.apply, p, b),
            )
        create = train_state.TrainState.create
        if part == "update":
            grads, sgrads = _given_gradients(params, dtype)
            return Case(
                _linen_apply_gradients,
                (create(apply_fn=plain_model.apply, params=params, tx=opt), grads),
                (create(apply_fn=scaled_model.apply, params=sparams, tx=scaled_opt), sgrads),
            )
        return Case(
            zoo.linen_train_step,
            (create(apply_fn=plain_model.apply, params=params, tx=opt), batch),
            (create(apply_fn=scaled_model.apply, params=sparams, tx=scaled_opt), batch),
        )
    if model == "nnx":
        graphdef, params, rest = nnx.split(zoo.nnx_init(), nnx.Param, ...)
        sparams, batch = _scaled(params, dtype), zoo.lm_batch()
        if part == "grad":
            grad = functools.partial(zoo.nnx_loss_and_grad, graphdef, rest)
            return Case(grad, (params, batch), (sparams, batch))
        if part == "update":
            grads, sgrads = _given_gradients(params, dtype)
            return Case(
                _optax_update(opt, optax.apply_updates),
                (params, opt.init(params), grads),
                (sparams, scaled_opt.init(sparams), sgrads),
                scaled_step=_optax_update(scaled_opt, optax.apply_updates),
            )
        return Case(
            zoo.make_nnx_train_step(graphdef, rest, opt),
            (params, opt.init(params), batch),
            (sparams, scaled_opt.init(sparams), batch),
            scaled_step=zoo.make_nnx_train_step(graphdef, rest, scaled_opt),
        )
    module = zoo.equinox_init()
    arrays, static = eqx.partition(module, eqx.is_array)
    sarrays = _scaled(arrays, dtype)
    batch, key = zoo.classification_batch(), jax.random.PRNGKey(2)
    if part == "grad":

        def grad(arrays, batch, key):
            loss, grads = eqx.filter_value_and_grad(zoo.equinox_loss)(
                eqx.combine(static, arrays), batch, key
            )
            return loss, eqx.filter(grads, eqx.is_array)

        return Case(grad, (arrays, batch, key), (sarrays, batch, key))
    if part == "update":
        inexact = eqx.filter(arrays, eqx.is_inexact_array)
        grads, sgrads = _given_gradients(inexact, dtype)

        def updater(tx: Any) -> Callable[..., Any]:
            def update(arrays, opt_state, grads):
                model = eqx.combine(static, arrays)
                updates, opt_state = tx.update(
                    grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
                )
                return eqx.filter(eqx.apply_updates(model, updates), eqx.is_array), opt_state

            return update

        return Case(
            updater(opt),
            (arrays, opt.init(inexact), grads),
            (sarrays, scaled_opt.init(_scaled(inexact, dtype)), sgrads),
            scaled_step=updater(scaled_opt),
        )

    def stepper(tx: Any) -> Callable[..., Any]:
        train_step = zoo.make_equinox_train_step(tx)

        def step(arrays, opt_state, batch, key):
            module, opt_state, loss = train_step(eqx.combine(static, arrays), opt_state, batch, key)
            return eqx.filter(module, eqx.is_array), opt_state, loss

        return step

    def init(tx: Any, arrays: Any) -> Any:
        return tx.init(eqx.filter(eqx.combine(static, arrays), eqx.is_inexact_array))

    return Case(
        stepper(opt),
        (arrays, init(opt, arrays), batch, key),
        (sarrays, init(scaled_opt, sarrays), batch, key),
        scaled_step=stepper(scaled_opt),
    )


def _zoo_builder(model: str, part: str) -> Callable[[Any], Case]:
    """The builder of case `zoo-<model>[-<part>]` (the module docstring describes them)."""
    return lambda dtype: _zoo_case(model, dtype, part)


# name: (builder, default data dtype of the scaled variant)
CASES: dict[str, tuple[Callable[[Any], Case], str]] = {
    "mlp": (case_mlp, "float32"),
    "cnn": (case_cnn, "float32"),
    "block": (case_block, "float32"),
    "gpt-adam": (case_gpt_adam, "float32"),
    "gpt-adam-channel": (case_gpt_adam_channel, "float32"),
    "gpt2-adam": (case_gpt2_adam, "float32"),
    "gpt4-adam": (case_gpt4_adam, "float32"),
    "gpt8-adam": (case_gpt8_adam, "float32"),
    "gpt12-adam": (case_gpt12_adam, "float32"),
    "gpt8-scan": (case_gpt8_scan, "float32"),
    "gpt8-scan-remat": (case_gpt8_scan_remat, "float32"),
    "gpt-scaled-opt": (case_gpt_scaled_opt, "float16"),
    "gpt-scaled-opt-channel": (case_gpt_scaled_opt_channel, "float16"),
    "gpt-unit-fp8": (case_gpt_unit_fp8, "float32"),
    "adam-update": (case_adam_update, "bfloat16"),
    **{
        f"zoo-{model}" + ("" if part == "step" else f"-{part}"): (
            _zoo_builder(model, part),
            "float16",
        )
        for part in ("step", "grad", "update")
        for model in ("linen", "nnx", "equinox")
    },
    "scaled-opt-update": (case_scaled_opt_update, "float16"),
    "nnx": (case_nnx, "float32"),
    "gpt2-small": (case_gpt2_small, "float16"),
    "gpt2-small-scan": (case_gpt2_small_scan, "float16"),
    "gpt2-small-scan-remat": (case_gpt2_small_scan_remat, "float16"),
}
OPT_IN = {
    "gpt2-small",
    "gpt2-small-scan",
    "gpt2-small-scan-remat",
    "gpt12-adam",
    "gpt8-scan-remat",
}


# ----------------------------------------------------------------------------------------------
# Measurement.


def _proc_status_mib(field: str) -> float:
    """A memory line of /proc/self/status: VmRSS (current RSS), VmHWM (peak RSS)."""
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith(field + ":"))
    return int(line.split()[1]) / 1024  # kB


def _ru_maxrss_mib() -> float:
    """Peak RSS of the process (Linux: ru_maxrss is in KiB; it also keeps the peak at any
    thread's exit, so restarting the count does not always lower it)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak_rss() -> bool:
    """Restart the peak RSS count from the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_variant(
    case: Case, variant: str, report: Callable[[str, Any], None], memory: bool = True
) -> Any:
    """Trace, lower, count, compile and run once; `report(key, value)` each number as it comes.

    With `memory` (in a fresh process), the peak RSS count (VmHWM) is restarted just before
    `.compile()`, so `peak_rss_compile_mib` is the peak of compiling alone; `ru_maxrss_mib` is
    the process's peak so far. Returns the compiled step.
    """
    fn, args = case.step(variant), case.args(variant)
    start = time.perf_counter()
    traced = jax.jit(fn).trace(*args)
    report("trace_s", time.perf_counter() - start)
    start = time.perf_counter()
    lowered = traced.lower()
    report("lower_s", time.perf_counter() - start)
    counts = jsa.analysis.equation_counts(fn, *args)  # after the timings: they stay cold
    report("eqns", sum(counts.values()))
    report("by_primitive", dict(counts.most_common()))
    if memory:
        report("peak_rss_before_compile_mib", _proc_status_mib("VmHWM"))  # build, trace, lower
        report("peak_rss_reset", _reset_peak_rss())
        report("rss_before_compile_mib", _proc_status_mib("VmRSS"))
    start = time.perf_counter()
    compiled = lowered.compile()
    report("compile_s", time.perf_counter() - start)
    if memory:
        report("peak_rss_compile_mib", _proc_status_mib("VmHWM"))
        report("ru_maxrss_mib", _ru_maxrss_mib())
    hlo_text = compiled.as_text()
    kernels, instructions = hlo_counts(hlo_text)
    report("hlo_kernels", kernels)
    report("hlo_instructions", instructions)
    kinds = kernel_kinds(hlo_text)
    report(
        "hlo_scalar_kernels",
        kinds["scalar: read by kernels"]
        + kinds["scalar: step outputs"]
        + kinds["reduction to a scalar"],
    )
    report("hlo_kernel_kinds", dict(kinds))
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    report("first_exec_s", time.perf_counter() - start)
    return compiled


_NOT_KERNELS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "copy-start"}


def hlo_counts(text: str) -> tuple[int, int]:
    """XLA's view of a compiled step, from its optimized HLO text: (kernels, instructions).

    Kernels: the instructions of the ENTRY computation other than parameters, constants,
    tuples and bitcasts (after fusion each is one launched kernel, a fusion, a library call
    or a copy, on GPU; on CPU one loop nest or call). Instructions: every instruction of
    every computation (inside fusions too), the size of what XLA compiles.
    """
    kernels = instructions = 0
    in_entry = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("ENTRY"):
            in_entry = True
            continue
        if in_entry and stripped == "}":
            in_entry = False
        if " = " not in stripped or stripped.startswith(("HloModule", "//")):
            continue
        instructions += 1
        if in_entry:
            match = re.search(r"(?:^|\s)([a-z][a-z0-9_-]*)\(", stripped.split(" = ", 1)[1])
            if match and match.group(1) not in _NOT_KERNELS:
                kernels += 1
    return kernels, instructions


_METADATA = re.compile(r",? metadata=\{[^}]*\}")
_NAME = re.compile(r"%[\w.\-]+")


def distinct_fusions(text: str) -> tuple[int, int]:
    """(fusions, distinct fusions) of an optimized HLO module's ENTRY computation: its fused
    kernels, and how many differ once names and metadata are set aside. XLA:CPU generates
    code once for alike kernels (two fusions of the same instructions on the same shapes),
    so the distinct ones are what its code generation compiles."""
    bodies: dict[str, str] = {}
    name = None
    lines: list[str] = []
    for line in text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            match = _COMPUTATION.match(line)
            name, lines = (match.group(1) if match else None), []
        elif line.startswith("}") and name is not None:
            bodies[name] = "\n".join(lines)
            name = None
        elif name is not None and " = " in line:
            lines.append(_NAME.sub("%", _METADATA.sub("", line.split(" = ", 1)[1])))
    start = text.index("\nENTRY")
    entry = text[start : text.index("\n}", start)]
    called = re.findall(r" fusion\(.*calls=%?([\w.\-]+)", entry)
    return len(called), len({bodies.get(c, c) for c in called})


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s")
_TRIP_COUNT = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def launched_kernels(text: str) -> int:
    """The kernels one call of a compiled step launches, from its optimized HLO text: the
    ENTRY computation's kernels (as `hlo_counts` counts them), each `while` replaced by its
    body's kernels times its known trip count and its condition's times one more (a
    loop's count unknown to XLA: once). A model whose layers are a `lax.scan` runs its
    layers' kernels inside such a loop, which `hlo_counts` does not look into."""
    computations: dict[str, list[str]] = {}
    entry = current = None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            match = _COMPUTATION.match(line)
            current = match.group(1) if match else None
            if current is not None:
                computations[current] = []
                if line.startswith("ENTRY"):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
        elif current is not None and " = " in line:
            computations[current].append(line.split(" = ", 1)[1])

    def count(name: str) -> int:
        total = 0
        for rhs in computations.get(name.lstrip("%"), []):
            match = re.search(r"(?:^|\s)([a-z][a-z0-9_-]*)\(", rhs)
            if match is None or match.group(1) in _NOT_KERNELS:
                continue
            if match.group(1) != "while":
                total += 1
                continue
            body = re.search(r"body=%?([\w.\-]+)", rhs)
            condition = re.search(r"condition=%?([\w.\-]+)", rhs)
            trips = _TRIP_COUNT.search(rhs)
            n = int(trips.group(1)) if trips else 1
            total += n * count(body.group(1)) if body else 0
            total += (n + 1) * count(condition.group(1)) if condition else 0
        return total

    return count(entry) if entry is not None else 0


_SCALAR = re.compile(r"^\(?[a-z0-9]+\[\]")


def _entry(hlo_text: str) -> list[tuple[str, str, str, list[str]]]:
    """(name, shape, opcode or fusion kind, operand names) of each ENTRY instruction."""
    start = hlo_text.index("\nENTRY")
    body = hlo_text[start : hlo_text.index("\n}", start)]
    rows = []
    for line in body.splitlines()[1:]:
        if " = " not in line:
            continue
        lhs, rhs = line.split(" = ", 1)
        match = re.search(r"(?:^|\s)([a-z][a-z0-9_-]*)\(", rhs)
        if match is None:
            continue
        kind = match.group(1)
        if kind == "fusion":
            kind = re.search(r"kind=(\w+)", rhs).group(1)  # type: ignore[union-attr]
            backend = re.search(r'"kind":"([\w$]+)"', rhs)
            if backend:
                kind += ":" + backend.group(1)
        elif kind == "custom-call":
            kind += ":" + re.search(r'custom_call_target="([^"]+)"', rhs).group(1)  # type: ignore[union-attr]
        args, depth, end = rhs[match.end() :], 1, 0
        while depth and end < len(args):
            depth += {"(": 1, ")": -1}.get(args[end], 0)
            end += 1
        operands = re.findall(r"%[\w.\-]+", args[:end])
        name = lhs.strip().removeprefix("ROOT ").strip()
        rows.append((name, rhs.split(" ", 1)[0], kind, operands))
    return rows


def _reducing_fusions(hlo_text: str) -> set[str]:
    """The ENTRY fusions whose fused computation reduces (`reduce` or `reduce-window`)."""
    bodies = dict(re.findall(r"\n(%[\w.\-]+) \([^\n]*\{\n(.*?)\n\}", hlo_text, re.S))
    reducing = {name for name, body in bodies.items() if re.search(r" reduce(-window)?\(", body)}
    entry = hlo_text[hlo_text.index("\nENTRY") :]
    found = set()
    for line in entry.splitlines():
        match = re.search(r"calls=(%[\w.\-]+)", line)
        if " = " in line and " fusion(" in line and match and match.group(1) in reducing:
            found.add(line.split(" = ", 1)[0].strip().removeprefix("ROOT ").strip())
    return found


def kernel_kinds(hlo_text: str) -> collections.Counter[str]:
    """The kernels of an optimized HLO module (those `hlo_counts` counts), by kind.

    A kernel whose result is read only through bitcasts and tuple elements by the ENTRY's
    root tuple is a step output's kernel. GEMMs are library calls (`__cublas...`) and
    fusions whose backend kind names a GEMM; `gemm (fp8)` counts those with two FP8
    operands. Reductions are XLA:GPU's input fusions and, on XLA:CPU, the loop and library
    fusions that reduce (a dynamic scale's largest magnitude is a "reduction to a scalar"
    on both).
    """
    rows = _entry(hlo_text)
    reducing = _reducing_fusions(hlo_text)
    shape = {name: s for name, s, _, _ in rows}
    kind_of = {name: k for name, _, k, _ in rows}
    readers: dict[str, list[str]] = collections.defaultdict(list)
    for name, _, _, operands in rows:
        for operand in operands:
            readers[operand].append(name)

    def final_readers(name: str) -> list[str]:
        out = []
        for reader in readers[name]:
            if kind_of[reader] in ("bitcast", "get-tuple-element"):
                out += final_readers(reader)
            else:
                out.append(reader)
        return out

    counts: collections.Counter[str] = collections.Counter()
    for name, out_shape, kind, operands in rows:
        opcode = kind.split(":")[0]
        if opcode in _NOT_KERNELS:
            continue
        scalar = bool(_SCALAR.match(out_shape))
        if "gemm" in kind or kind.startswith("custom-call:__cublas"):
            fp8 = sum(bool(re.match(r"f8e", shape.get(o, ""))) for o in operands) >= 2
            counts["gemm (fp8)" if fp8 else "gemm"] += 1
        elif kind == "kInput":
            if out_shape.startswith("("):
                counts["reduction, several outputs"] += 1
            else:
                counts["reduction to a scalar" if scalar else "reduction to a tensor"] += 1
        elif name in reducing and (kind == "kLoop" or kind.startswith("kCustom:__ynn")):
            # XLA:CPU's reductions: loop fusions, or library (YNNPACK) fusions.
            counts["reduction to a scalar" if scalar else "reduction to a tensor"] += 1
        elif kind == "kLoop" and scalar:
            only_outputs = all(kind_of[r] == "tuple" for r in final_readers(name))
            counts["scalar: step outputs" if only_outputs else "scalar: read by kernels"] += 1
        elif kind == "kLoop":
            counts["elementwise on tensors"] += 1
        else:
            counts[kind] += 1
    return counts


def _child_main(spec: dict[str, Any]) -> None:
    """Subprocess entry: measure one (case, variant), appending JSON lines to spec["out"]."""
    builder, _ = CASES[spec["case"]]
    case = builder(jnp.dtype(spec["dtype"]))
    with open(spec["out"], "a") as out:

        def report(key: str, value: Any) -> None:
            out.write(json.dumps({key: value}) + "\n")
            out.flush()

        compiled = measure_variant(case, spec["variant"], report)
        if spec.get("executable"):  # hand the executable to the parent for step timing
            try:
                payload = pickle.dumps(serialize_executable.serialize(compiled))
            except (pickle.PicklingError, AttributeError, TypeError) as e:
                # Argument trees whose nodes pickle badly (optax's local init functions,
                # Equinox modules holding jnp functions): the parent compiles the step again.
                report("executable_not_serialized", f"{type(e).__name__}: {e}"[:300])
            else:
                with open(spec["executable"], "wb") as f:
                    f.write(payload)
        report("status", "ok")


def run_child(
    name: str, variant: str, dtype: str, timeout: float, workdir: str, keep_executable: bool
) -> dict:
    """`measure_variant` in a fresh subprocess; partial results and a status on timeout/error."""
    out = os.path.join(workdir, f"{name}-{variant}.jsonl")
    exe = os.path.join(workdir, f"{name}-{variant}.exe") if keep_executable else ""
    spec = {"case": name, "variant": variant, "dtype": dtype, "out": out, "executable": exe}
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", json.dumps(spec)]
    result: dict[str, Any] = {}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
            result["status"] = "error"
            result["error"] = lines[-1][:300]
    except subprocess.TimeoutExpired:
        result["status"] = "timeout"
    if os.path.exists(out):
        with open(out) as f:
            for line in f:
                result.update(json.loads(line))
        if result.get("status") == "ok" and exe and os.path.exists(exe):
            result["executable"] = exe
    result.setdefault("status", "error")
    return result


def load_executable(path: str) -> Any:
    with open(path, "rb") as f:
        return serialize_executable.deserialize_and_load(*pickle.load(f))


def time_steps(steps: dict[str, tuple[Any, tuple]], iters: int, warmup: int = 5) -> dict:
    """Median seconds per step; the steps run alternately, one after the other, each round."""
    for _ in range(warmup):
        for fn, args in steps.values():
            jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(iters):
        for name, (fn, args) in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def run_case(name: str, dtype: str, args: argparse.Namespace, workdir: str) -> dict:
    """All the numbers of one case: {"dtype", "plain": {...}, "scaled": {...}, "step_s": {...}}."""
    builder, _ = CASES[name]
    case = None
    result: dict[str, Any] = {"dtype": dtype}
    compiled: dict[str, Any] = {}
    for variant in VARIANTS:
        wall = time.perf_counter()
        if args.no_memory:
            case = case or builder(jnp.dtype(dtype))
            numbers: dict[str, Any] = {}
            try:
                compiled[variant] = measure_variant(case, variant, numbers.__setitem__, False)
                numbers["status"] = "ok"
            except Exception as e:  # report it in the table, go on with the next
                numbers.update(status="error", error=f"{type(e).__name__}: {e}"[:300])
        else:
            numbers = run_child(name, variant, dtype, args.timeout, workdir, not args.no_step)
            if "executable" in numbers:
                compiled[variant] = numbers.pop("executable")
        if "compile_s" in numbers:
            stages = ("trace_s", "lower_s", "compile_s")
            numbers["trace_lower_compile_s"] = sum(numbers[k] for k in stages)
        if "first_exec_s" in numbers:
            numbers["first_call_s"] = numbers["trace_lower_compile_s"] + numbers["first_exec_s"]
        if "peak_rss_compile_mib" in numbers:
            numbers["compile_rss_delta_mib"] = (
                numbers["peak_rss_compile_mib"] - numbers["rss_before_compile_mib"]
            )
        numbers["wall_s"] = time.perf_counter() - wall  # with the subprocess's start and imports
        result[variant] = numbers
        _progress(
            f"{name} {variant}: {numbers['status']}, {numbers.get('eqns', '?')} eqns, "
            f"trace+lower+compile {_fmt(numbers.get('trace_lower_compile_s'), '.1f')} s "
            f"(wall {numbers['wall_s']:.1f} s)"
        )
    if not args.no_step:
        for variant in VARIANTS:
            if result[variant]["status"] == "ok" and variant not in compiled:
                # Its executable could not be handed over: compiled again here.
                case = case or builder(jnp.dtype(dtype))
                compiled[variant] = measure_variant(case, variant, lambda *_: None, False)
    if not args.no_step and compiled:
        case = case or builder(jnp.dtype(dtype))
        steps = {}
        for variant, exe in compiled.items():
            fn = load_executable(exe) if isinstance(exe, str) else exe
            steps[variant] = (fn, case.args(variant))
        result["step_s"] = time_steps(steps, args.iters, args.warmup)
        _progress(
            f"{name} step (ms): "
            + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in result["step_s"].items())
        )
    return result


# ----------------------------------------------------------------------------------------------
# Report.


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict[str, Any]:
    processor = platform.processor()
    try:  # platform.processor() is often empty or just the architecture on Linux
        with open("/proc/cpuinfo") as f:
            model = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        processor = model[0] if model else processor
    except OSError:
        pass
    return {
        "processor": processor,
        "machine": platform.machine(),
        "nproc": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "optax": optax.__version__,
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "git_head": _git("rev-parse", "--short", "HEAD"),
        # uncommitted changes to the package: the numbers are of the working tree
        "package_changes": len(
            _git("status", "--porcelain", "--", "jax_scaled_arithmetics").splitlines()
        ),
    }


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _cell(numbers: dict, key: str, spec: str) -> str:
    """A number, or why it is missing (timeout / error)."""
    if key in numbers:
        return format(numbers[key], spec)
    return numbers.get("status", "-") if numbers.get("status") != "ok" else "-"


def _ratio(a: Any, b: Any) -> str:
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0
    return f"{b / a:.1f}x" if ok else "-"


def _rss_cell(numbers: dict) -> str:
    if "peak_rss_compile_mib" not in numbers:
        return _cell(numbers, "peak_rss_compile_mib", ".0f")
    star = "" if numbers.get("peak_rss_reset") else "*"
    peak, delta = numbers["peak_rss_compile_mib"], numbers["compile_rss_delta_mib"]
    return f"{peak:.0f} (+{delta:.0f}){star}"


def print_tables(results: dict[str, dict], by_primitive: bool) -> None:
    print()
    print(
        "| case | dtype | eqns plain | eqns scaled | ratio "
        "| trace+lower+compile plain (s) | scaled (s) | ratio "
        "| peak compile RSS plain (MiB) | scaled (MiB) "
        "| step plain (ms) | step scaled (ms) | ratio |"
    )
    print("| --- | --- |" + " ---: |" * 11)
    for name, r in results.items():
        p, s, step = r["plain"], r["scaled"], r.get("step_s", {})
        cells = [
            name,
            r["dtype"],
            _cell(p, "eqns", "d"),
            _cell(s, "eqns", "d"),
            _ratio(p.get("eqns"), s.get("eqns")),
            _cell(p, "trace_lower_compile_s", ".2f"),
            _cell(s, "trace_lower_compile_s", ".2f"),
            _ratio(p.get("trace_lower_compile_s"), s.get("trace_lower_compile_s")),
            _rss_cell(p),
            _rss_cell(s),
            _fmt(step["plain"] * 1e3, ".2f") if "plain" in step else "-",
            _fmt(step["scaled"] * 1e3, ".2f") if "scaled" in step else "-",
            _ratio(step.get("plain"), step.get("scaled")),
        ]
        print("| " + " | ".join(cells) + " |")
    print("\nXLA's view (optimized HLO): kernels (ENTRY instructions other than parameters,")
    print("constants, tuples, bitcasts), those of them elementwise on scalars, and all")
    print("instructions, fusions' bodies included (kernels by kind in the JSON).\n")
    print(
        "| case | kernels plain | kernels scaled | ratio | scalar kernels plain | scaled"
        " | HLO instr. plain | scaled | ratio |"
    )
    print("| --- |" + " ---: |" * 8)
    for name, r in results.items():
        p, s = r["plain"], r["scaled"]
        cells = [
            _cell(p, "hlo_kernels", "d"),
            _cell(s, "hlo_kernels", "d"),
            _ratio(p.get("hlo_kernels"), s.get("hlo_kernels")),
            _cell(p, "hlo_scalar_kernels", "d"),
            _cell(s, "hlo_scalar_kernels", "d"),
            _cell(p, "hlo_instructions", "d"),
            _cell(s, "hlo_instructions", "d"),
            _ratio(p.get("hlo_instructions"), s.get("hlo_instructions")),
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    variants = [r[v] for r in results.values() for v in VARIANTS]
    if any("peak_rss_compile_mib" in n for n in variants):
        print("\nPeak compile RSS: the subprocess's peak RSS (VmHWM, count restarted just")
        print("before `.compile()`), and in parentheses its increase over the RSS before it.")
    if any(n.get("peak_rss_reset") is False for n in variants):
        print("* the count could not be restarted: peak of the whole subprocess.")

    print("\nStages (s): trace / lower / compile / first call (all three + first execution).\n")
    print("| case | variant | trace | lower | compile | first call | RSS before compile (MiB) |")
    print("| --- | --- |" + " ---: |" * 5)
    for name, r in results.items():
        for variant in VARIANTS:
            n = r[variant]
            keys = ("trace_s", "lower_s", "compile_s", "first_call_s")
            cells = [_cell(n, k, ".2f") for k in keys] + [_cell(n, "rss_before_compile_mib", ".0f")]
            print(f"| {name} | {variant} | " + " | ".join(cells) + " |")
        errors = [f"{v}: {r[v]['error']}" for v in VARIANTS if "error" in r[v]]
        for error in errors:
            print(f"\n{name} {error}")

    if by_primitive:
        for name, r in results.items():
            plain = r["plain"].get("by_primitive", {})
            scaled = r["scaled"].get("by_primitive", {})
            if not scaled:
                continue
            diff = {k: scaled.get(k, 0) - plain.get(k, 0) for k in set(plain) | set(scaled)}
            top = sorted(diff.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
            print(f"\n{name}: top primitives by scaled - plain equations\n")
            print("| primitive | plain | scaled | scaled - plain |")
            print("| --- | ---: | ---: | ---: |")
            for prim, d in top:
                print(f"| {prim} | {plain.get(prim, 0)} | {scaled.get(prim, 0)} | {d:+d} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_cases = [c for c in CASES if c not in OPT_IN]
    parser.add_argument(
        "--cases",
        default=",".join(default_cases),
        help=f"comma list of {', '.join(CASES)} (default: all but {', '.join(OPT_IN)})",
    )
    parser.add_argument("--iters", type=int, default=30, help="rounds of [plain, scaled] steps")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up rounds before timing")
    parser.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        help="data dtype of the scaled variant (default: float32; float16 for "
        "gpt-scaled-opt[-channel] and gpt2-small[-scan])",
    )
    parser.add_argument("--by-primitive", action="store_true", help="top-10 primitives per case")
    parser.add_argument("--json", metavar="PATH", help="write all the numbers as JSON")
    parser.add_argument("--no-step", action="store_true", help="skip step timing")
    parser.add_argument("--no-memory", action="store_true", help="no subprocesses, no memory")
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds per subprocess (default 900)"
    )
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        _child_main(json.loads(args._child))
        return

    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    info = machine()
    print(
        f"{info['processor']} ({info['machine']}), nproc {info['nproc']}, Python {info['python']}, "
        f"jax {info['jax']}, jaxlib {info['jaxlib']}, optax {info['optax']}, "
        f"{info['backend']} ({info['device_kind']})"
    )
    print(
        f"git {info['git_head']}, {info['package_changes']} uncommitted change(s) under "
        "jax_scaled_arithmetics/"
    )
    memory = "no memory (in-process)" if args.no_memory else f"timeout {args.timeout:.0f} s"
    print(f"cases {','.join(names)}; step rounds {args.warmup} + {args.iters}; {memory}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="program_size_") as workdir:
        for name in names:
            dtype = args.dtype or CASES[name][1]
            results[name] = run_case(name, dtype, args, workdir)
            if args.json:  # after each case: a long run leaves what it measured
                with open(args.json, "w") as f:
                    json.dump(
                        {"machine": info, "args": vars(args), "results": results}, f, indent=1
                    )
    print_tables(results, args.by_primitive)
    if args.json:
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
