"""Train the char-level GPT of `model.py` on tiny-shakespeare with Adam, in float32, bfloat16
and several FP8 / scaled low-precision modes.

Data: the genuine tiny-shakespeare corpus (`experiments/data.py`: `--data-dir`, then
`$JSA_DATA_DIR`, then the per-user cache, then a checked download). The first 90% of the
text trains, the last 10% is held out: the validation loss is the mean next-character
cross-entropy on fixed held-out windows, evaluated every `--eval-every` steps. Every mode
starts from the same float32 initialisation (same `--seed`) and sees the same batches.

Modes:
    fp32             float32 parameters, compute and Adam state (the baseline).
    bf16             bfloat16 compute: float32 master parameters and Adam state; the
                     parameters are cast to bfloat16 for the forward and backward passes,
                     the gradients cast back to float32 for Adam. No loss scaling
                     (bfloat16 has float32's exponent range).
    fp8-plain        float32 parameters and Adam; the loss wrapped in
                     `jsa.ops.simulate_fp8`: matmul operands rounded to E4M3 on the forward
                     pass, matmul-output gradients to E5M2 on the backward pass, with no
                     scaling (the naive baseline).
    scaled-fp16      `jsa.autoscale` + `jsa.optax`: float16 ScaledArray parameters and Adam
                     state (`jsa.optax.scale_optimizer`), the whole step in one
                     `jax.jit(jsa.autoscale(step))`, no loss scaling.
    scaled-fp8       scaled-fp16 plus the FP8 casts after dynamic rescaling: the loss is
                     `jsa.ops.simulate_fp8(loss_fn, rescale=True)` inside the autoscaled step
                     (one power of two per matmul operand and per output gradient).
    scaled-fp8-rowwise
                     scaled-fp8 with `scale_layout="axis"`: block scales, one power of two
                     per row of each matmul's lhs (per token of the activations) and per
                     output channel of its rhs (the weights), and per row of each matmul's
                     output gradient; kept through the FP8 rounding and the products.
    scaled-mxfp8     scaled-fp8 with `scale_layout=32`: MX-style blocks of 32 along each
                     matmul operand's contracting axis (one power of two per 32 values of a
                     token's features and of a weight column), and along the last axis of
                     the output gradients.
    unit-scaled-fp8  `U.unit_scale` + `jsa.ops.simulate_fp8`: parameters `U.unit_init(params)`
                     (unit-variance weights, zero biases), loss
                     `jsa.ops.simulate_fp8(U.unit_scale(loss_fn))`, float32 Adam, no loss scaling
                     and no dynamic rescaling. Its own learning rate (`--mode-lr`).

Delayed-scaling modes (`--mode delayed` runs fp32, scaled-fp16, scaled-fp8 and these):
    scaled-fp16-delayed, scaled-fp8-delayed
                     scaled-fp16 / scaled-fp8 with the step under `jsa.delayed_scaling`:
                     each top-level sum and contraction at the largest of its 16 previous
                     dynamic scales; the scale history is carried beside the Adam state,
                     made by the first (dynamic) step. With `--scan-layers` (the blocks
                     stacked and run as a `lax.scan`) each layer's sites hold their own
                     scales (a row of the history per layer).

4-bit modes (`--mode fp4` runs fp32 and all of them): float32 parameters and Adam, the loss
wrapped in `jsa.ops.simulate_fp4(loss_fn, ...)` (the linear layers' three matmuls with 4-bit
operands; the key of step i is `fold_in(key(seed + 1), i)`):
    nvfp4            the full NVFP4 recipe: 16x16 weight blocks, stochastically rounded
                     gradients, random Hadamard transform of the weight gradient's
                     operands, the first and last linear layers in float32.
    nvfp4-no-hadamard, nvfp4-nearest, nvfp4-1d-weights, nvfp4-all-layers
                     the full recipe with one ingredient removed: no Hadamard transform;
                     gradients rounded to nearest; weight blocks 16x1 along the contracted
                     axis; every linear layer in 4 bits.
    mxfp4            the MXFP4 recipe: blocks of 32 with E8M0 scales rounded up, 32x32
                     weight blocks, otherwise as nvfp4.
    mxfp4-floor      mxfp4 with the OCP scale rounding (floor).
    fp4-tensor       naive FP4: E2M1 with one float32 scale per tensor, every linear layer,
                     nearest rounding, no Hadamard transform.

The validation loss is computed in float32 from the parameters' values, with the mode's
model (the unit-scaled one for `unit-scaled-fp8`); the final validation loss is also
computed with the mode's own forward numerics (`final_val_loss_own_numerics`).

A JSON log per run is written to `--out-dir` as `<mode>.json` (config, mode, learning rate,
train-loss curve, validation-loss curve, tokens/s, wall time, final validation loss).

Program size and step time, without training (`--step-cost`): the equations of one step's
jaxpr (sub-jaxprs counted) and its median time, the modes timed in turn.

Run: python experiments/gpt/train.py --data-dir ../shared/data --out-dir runs/gpt
     python experiments/gpt/train.py --mode fp32 scaled-fp8 --steps 100
     python experiments/gpt/train.py --data-dir ../shared/data \
         --out-dir experiments/results/gpt --mode scaled-fp8-rowwise scaled-mxfp8
     python experiments/gpt/train.py --data-dir ../shared/data --step-cost \
         --mode fp32 scaled-fp8 scaled-fp8-rowwise scaled-mxfp8
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scaled_arithmetics as jsa
import jax_scaled_arithmetics.optax as jsa_optax

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a script, only this folder is on the path
    sys.path.insert(0, str(REPO_ROOT))

from experiments import data as datasets  # noqa: E402
from experiments.gpt import model as gpt  # noqa: E402

FP8_MODES = (
    "fp32",
    "bf16",
    "fp8-plain",
    "scaled-fp16",
    "scaled-fp8",
    "scaled-fp8-rowwise",
    "scaled-mxfp8",
    "unit-scaled-fp8",
)
"""The modes of `--mode all`."""
DELAYED_MODES = ("scaled-fp16-delayed", "scaled-fp8-delayed")
"""scaled-fp16 and scaled-fp8 with `jsa.delayed_scaling` (`--mode delayed` runs fp32, both
dynamic modes and these)."""
FP4_RECIPES: dict[str, dict[str, Any]] = {
    "nvfp4": {},
    "nvfp4-no-hadamard": {"hadamard": False},
    "nvfp4-nearest": {"stochastic_gradients": False},
    "nvfp4-1d-weights": {"weight_blocks": "1d"},
    "nvfp4-all-layers": {"high_precision": None},
    "mxfp4": {"recipe": "mxfp4"},
    "mxfp4-floor": {"recipe": "mxfp4", "scale_rounding": "floor"},
    "fp4-tensor": {
        "recipe": "fp4_tensor",
        "hadamard": False,
        "stochastic_gradients": False,
        "high_precision": None,
    },
}
"""The `jsa.ops.simulate_fp4` arguments of each 4-bit mode (`--mode fp4`: fp32 and these)."""
MODES = FP8_MODES + DELAYED_MODES + tuple(FP4_RECIPES)
SCALE_LAYOUTS: dict[str, str | int] = {
    "scaled-fp8": "tensor",
    "scaled-fp8-rowwise": "axis",
    "scaled-mxfp8": 32,
}
"""The `simulate_fp8` scale layout of each autoscaled FP8 mode."""
DEFAULT_LR = 1e-3
DEFAULT_MODE_LR = {"unit-scaled-fp8": 3e-2}
"""Learning rates that differ from `--lr` by default. Unit-scaled weights have unit variance,
so an Adam step of size lr is a relatively smaller change than on 0.02-scaled weights. Chosen
on the default config (400 steps, seed 0; final validation loss): fp32 at lr 5e-4, 1e-3,
2e-3, 4e-3, 6e-3: 2.388, 2.268, 2.347, 2.616, 2.648; unit-scaled-fp8 at lr 1e-2, 2e-2, 3e-2,
6e-2, 1e-1: 2.396, 2.299, 2.274, 2.478, 3.354 (docs/experiments.md)."""
VAL_FRACTION = 0.1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Model shape and training hyperparameters (the defaults: the experiment's config)."""

    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    batch_size: int = 16
    steps: int = 400
    lr: float = DEFAULT_LR
    seed: int = 0
    eval_every: int = 25
    eval_batches: int = 8
    own_numerics: bool = True  # also the final validation loss with the mode's numerics
    scan_layers: bool = False  # blocks stacked (`gpt.stack_blocks`) and run as a lax.scan

    def model(self, vocab_size: int) -> gpt.GPTConfig:
        return gpt.GPTConfig(
            vocab_size=vocab_size,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
        )


# --- data --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CharData:
    """A text as int32 character ids, split into a training and a held-out part."""

    vocab: str
    train: np.ndarray
    val: np.ndarray

    @classmethod
    def from_text(cls, text: str, val_fraction: float = VAL_FRACTION) -> CharData:
        """Characters sorted by code point are the vocabulary; the last `val_fraction` of
        the text is held out."""
        vocab = "".join(sorted(set(text)))
        lookup = {c: i for i, c in enumerate(vocab)}
        ids = np.fromiter((lookup[c] for c in text), dtype=np.int32, count=len(text))
        n_train = int(round(len(ids) * (1 - val_fraction)))
        return cls(vocab, ids[:n_train], ids[n_train:])


def train_offsets(n_tokens: int, config: TrainConfig) -> np.ndarray:
    """Start positions of every training window, shape (steps, batch): uniform draws from
    a generator seeded with `config.seed` (the same in every mode)."""
    high = n_tokens - config.block_size - 1
    if high <= 0:
        raise ValueError(f"{n_tokens} training tokens for a context of {config.block_size}.")
    rng = np.random.default_rng(config.seed)
    return rng.integers(0, high + 1, size=(config.steps, config.batch_size))


def eval_offsets(n_tokens: int, config: TrainConfig) -> np.ndarray:
    """Start positions of the fixed held-out windows, shape (eval_batches, batch): evenly
    spaced over the held-out text."""
    high = n_tokens - config.block_size - 1
    if high < 0:
        raise ValueError(f"{n_tokens} held-out tokens for a context of {config.block_size}.")
    count = config.eval_batches * config.batch_size
    offsets = np.linspace(0, high, count).round().astype(np.int64)
    return offsets.reshape(config.eval_batches, config.batch_size)


def windows(ids: np.ndarray, offsets: np.ndarray, block_size: int) -> tuple[Any, Any]:
    """Inputs and next-character targets, int32 arrays of shape offsets.shape + (block,)."""
    index = offsets[..., None] + np.arange(block_size)
    return jnp.asarray(ids[index]), jnp.asarray(ids[index + 1])


def digest(tree: Any) -> str:
    """SHA-256 of the bytes of a pytree's leaves (to compare initialisations and batches)."""
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()


# --- modes -------------------------------------------------------------------------------


@dataclasses.dataclass
class Mode:
    """A mode's training state and functions.

    `step(params, state, x, y) -> (params, state, loss)`; `values(params)` the parameters'
    values in float32; `eval_loss(values, x, y)` the model's loss in float32;
    `own_loss(params, x, y)` the loss with the mode's own forward numerics.
    """

    name: str
    lr: float
    params: Any
    state: Any
    step: Callable[..., Any]
    values: Callable[[Any], Any]
    eval_loss: Callable[..., Any]
    own_loss: Callable[..., Any]


def _unit_scaling() -> Any:
    import jax_scaled_arithmetics.unit_scaling as U

    return U


def _float32(x: Any) -> float:
    if isinstance(x, jsa.ScaledArray):
        return float(x.to_array(jnp.float32))
    return float(jnp.asarray(x, jnp.float32))


@functools.partial(jax.jit, static_argnums=3)
def _float32_loss(params: Any, x: Any, y: Any, model: gpt.GPTConfig) -> Any:
    """The model's loss in float32: one compilation shared by the modes."""
    return gpt.loss_fn(params, x, y, model)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _init_params(key: jax.Array, model: gpt.GPTConfig, scan_layers: bool = False) -> Any:
    params = gpt.init_params(key, model)
    return gpt.stack_blocks(params) if scan_layers else params


@jax.jit
def _to_scaled_fp16(params32: Any) -> Any:
    """ScaledArrays of float16 data, each rescaled so that its largest entry is in [1, 2)."""
    params = jsa.ops.dynamic_rescale_max(jsa.as_scaled_array(params32, dtype=jnp.float32))
    return jsa.tree.astype(params, jnp.float16)


def _adam(lr: float) -> optax.GradientTransformation:
    return optax.adam(lr)


def _plain_step(loss: Callable[..., Any], opt: optax.GradientTransformation) -> Callable[..., Any]:
    @jax.jit
    def step(params: Any, state: Any, x: Any, y: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return step


def _scaled_step(loss: Callable[..., Any], opt: optax.GradientTransformation) -> Callable[..., Any]:
    def step(params: Any, state: Any, x: Any, y: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return jsa_optax.apply_updates(params, updates), state, value

    return jax.jit(jsa.autoscale(step))


def _delayed_step(
    loss: Callable[..., Any], opt: optax.GradientTransformation
) -> Callable[..., Any]:
    """`_scaled_step` under `jsa.delayed_scaling`: the state is `(optimizer state, scale
    history)`; the first step (history None) is the dynamic step that makes the history."""

    def step(params: Any, state: Any, x: Any, y: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return jsa_optax.apply_updates(params, updates), state, value

    delayed = jsa.delayed_scaling(step)
    first, later = jax.jit(delayed.init), jax.jit(delayed)

    def run(params: Any, state: Any, x: Any, y: Any) -> Any:
        opt_state, history = state
        if history is None:
            (params, opt_state, value), history = first(params, opt_state, x, y)
        else:
            (params, opt_state, value), history = later(history, params, opt_state, x, y)
        return params, (opt_state, history), value

    return run


def setup_mode(name: str, params32: Any, model: gpt.GPTConfig, lr: float, seed: int = 0) -> Mode:
    """The state and functions of mode `name`, from the float32 parameters `params32`
    (`seed`: of the 4-bit modes' random bits)."""

    def loss(p: Any, x: Any, y: Any) -> Any:
        return gpt.loss_fn(p, x, y, model)

    float32_loss = functools.partial(_float32_loss, model=model)
    identity: Callable[[Any], Any] = lambda p: p  # noqa: E731
    if name in ("fp32", "bf16", "fp8-plain"):
        if name == "fp32":
            train_loss = loss
        elif name == "bf16":

            def train_loss(p: Any, x: Any, y: Any) -> Any:
                # The cast's transpose casts the bfloat16 gradients back to float32.
                return loss(jsa.tree.astype(p, jnp.bfloat16), x, y).astype(jnp.float32)

        else:
            train_loss = jsa.ops.simulate_fp8(loss)
        opt = _adam(lr)
        return Mode(
            name,
            lr,
            params32,
            opt.init(params32),
            _plain_step(train_loss, opt),
            identity,
            float32_loss,
            float32_loss if name == "fp32" else jax.jit(train_loss),
        )
    delayed = name in DELAYED_MODES
    base = name.removesuffix("-delayed")
    if base == "scaled-fp16" or base in SCALE_LAYOUTS:
        train_loss = loss
        if base in SCALE_LAYOUTS:
            train_loss = jsa.ops.simulate_fp8(loss, rescale=True, scale_layout=SCALE_LAYOUTS[base])
        opt = jsa_optax.scale_optimizer(_adam(lr), state_dtype=jnp.float16)
        params = _to_scaled_fp16(params32)
        opt_state = jax.jit(opt.init)(params)
        return Mode(
            name,
            lr,
            params,
            (opt_state, None) if delayed else opt_state,
            _delayed_step(train_loss, opt) if delayed else _scaled_step(train_loss, opt),
            lambda p: jsa.asarray(p, jnp.float32),
            float32_loss,
            jax.jit(jsa.autoscale(train_loss)),
        )
    if name == "unit-scaled-fp8":
        U = _unit_scaling()
        unit_loss = U.unit_scale(loss)
        train_loss = jsa.ops.simulate_fp8(unit_loss)
        params = U.unit_init(params32)
        opt = _adam(lr)
        return Mode(
            name,
            lr,
            params,
            opt.init(params),
            _plain_step(train_loss, opt),
            identity,
            jax.jit(unit_loss),
            jax.jit(train_loss),
        )
    if name in FP4_RECIPES:
        return _fp4_mode(name, loss, params32, float32_loss, lr, seed)
    raise ValueError(f"Unknown mode {name!r}; choose from {', '.join(MODES)}.")


def _fp4_mode(
    name: str,
    loss: Callable[..., Any],
    params32: Any,
    float32_loss: Callable[..., Any],
    lr: float,
    seed: int,
) -> Mode:
    """A 4-bit mode: float32 parameters and Adam, `loss` through `jsa.ops.simulate_fp4`; the
    optimizer state carries the step count, which picks the step's key."""
    fp4_loss = jsa.ops.simulate_fp4(loss, **FP4_RECIPES[name])
    opt = _adam(lr)
    base_key = jax.random.key(seed + 1)

    @jax.jit
    def step(params: Any, state: Any, x: Any, y: Any) -> Any:
        opt_state, count = state
        key = jax.random.fold_in(base_key, count)
        value, grads = jax.value_and_grad(lambda p: fp4_loss(p, x, y, key=key))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), (opt_state, count + 1), value

    return Mode(
        name,
        lr,
        params32,
        (opt.init(params32), jnp.zeros((), jnp.int32)),
        step,
        lambda p: p,
        float32_loss,
        # The forward pass draws no random bits (they are the backward pass's).
        jax.jit(lambda p, x, y: fp4_loss(p, x, y, key=base_key)),
    )


# --- training ----------------------------------------------------------------------------


def mean_loss(loss: Callable[..., Any], params: Any, batches: Sequence[tuple[Any, Any]]) -> float:
    """The mean of `loss(params, x, y)` over equal-size batches, in float32."""
    return float(np.mean([_float32(loss(params, x, y)) for x, y in batches]))


def train(
    mode: str,
    text: str,
    config: TrainConfig | None = None,
    lr: float | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train the GPT on `text` in `mode`; return the run's log (and write it to
    `out_dir/<mode>.json` when `out_dir` is given).

    Args:
        mode: one of :data:`MODES`.
        text: the corpus; the last 10% is held out for validation.
        config: model shape and training hyperparameters (default: `TrainConfig()`).
        lr: the Adam learning rate (default: `DEFAULT_MODE_LR[mode]`, else `config.lr`).
        out_dir: where to write the JSON log.
        progress: show a progress bar (tqdm).
    """
    if mode not in MODES:
        raise ValueError(f"Unknown mode {mode!r}; choose from {', '.join(MODES)}.")
    config = TrainConfig() if config is None else config
    lr = DEFAULT_MODE_LR.get(mode, config.lr) if lr is None else lr
    corpus = CharData.from_text(text)
    model = config.model(len(corpus.vocab))
    params32 = _init_params(jax.random.PRNGKey(config.seed), model, config.scan_layers)
    offsets = train_offsets(len(corpus.train), config)
    val_batches = [
        windows(corpus.val, o, config.block_size) for o in eval_offsets(len(corpus.val), config)
    ]
    run = setup_mode(mode, params32, model, lr, config.seed)
    params, state = run.params, run.state

    val_steps: list[int] = []
    val_losses: list[float] = []

    def evaluate(step: int) -> None:
        val_steps.append(step)
        val_losses.append(mean_loss(run.eval_loss, run.values(params), val_batches))

    evaluate(0)
    tokens_per_step = config.batch_size * config.block_size
    train_losses = np.full(config.steps, np.nan, dtype=np.float64)
    bar = _progress_bar(config.steps, mode, progress)
    start = time.perf_counter()
    first_step_s = 0.0
    eval_s = 0.0
    for i in range(config.steps):
        x, y = windows(corpus.train, offsets[i], config.block_size)
        params, state, loss = run.step(params, state, x, y)
        train_losses[i] = _float32(loss)
        if i == 0:
            first_step_s = time.perf_counter() - start  # includes the compilation
        if i + 1 == config.steps or (config.eval_every > 0 and (i + 1) % config.eval_every == 0):
            t = time.perf_counter()
            evaluate(i + 1)
            eval_s += time.perf_counter() - t
        if bar is not None:
            elapsed = time.perf_counter() - start - first_step_s - eval_s
            rate = tokens_per_step * i / elapsed if i and elapsed > 0 else float("nan")
            bar.set_postfix(
                loss=f"{train_losses[i]:.3f}", val=f"{val_losses[-1]:.3f}", tok_s=f"{rate:,.0f}"
            )
            bar.update()
    wall_s = time.perf_counter() - start
    if bar is not None:
        bar.close()
    steady_s = wall_s - first_step_s - eval_s
    steady_tokens = tokens_per_step * (config.steps - 1)
    final_own = mean_loss(run.own_loss, params, val_batches) if config.own_numerics else None
    log = {
        "experiment": "gpt",
        "mode": mode,
        "lr": lr,
        "config": dataclasses.asdict(config),
        "model": dataclasses.asdict(model),
        "n_params": int(sum(np.size(p) for p in jax.tree_util.tree_leaves(params32))),
        "train_tokens": int(len(corpus.train)),
        "val_tokens": int(len(corpus.val)),
        "init_digest": digest(params32),
        "batches_digest": digest(offsets),
        "steps": config.steps,
        "train_loss": [_json_float(v) for v in train_losses],
        "val_steps": val_steps,
        "val_loss": [_json_float(v) for v in val_losses],
        "final_val_loss": _json_float(val_losses[-1]),
        "final_val_loss_own_numerics": None if final_own is None else _json_float(final_own),
        "tokens_per_s": steady_tokens / steady_s if steady_s > 0 else None,
        "first_step_s": first_step_s,
        "eval_s": eval_s,
        "wall_s": wall_s,
        "platform": jax.default_backend(),
        "jax_version": jax.__version__,
    }
    if out_dir is not None:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / f"{mode}.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


def step_cost(
    modes: Sequence[str], text: str, config: TrainConfig | None = None, iters: int = 20
) -> dict[str, dict[str, float]]:
    """Program size and step time of one training step of each mode, on the first batch.

    `equations`: the equations of the step's jaxpr (the jitted, autoscaled step for the
    scaled modes), sub-jaxprs counted (`jsa.analysis.equation_counts`). `step_s`: the
    median of `iters` timed steps, the modes run in turn (round robin, after one warm-up
    step each), so that a busy machine slows them alike.
    """
    config = TrainConfig() if config is None else config
    corpus = CharData.from_text(text)
    model = config.model(len(corpus.vocab))
    params32 = _init_params(jax.random.PRNGKey(config.seed), model, config.scan_layers)
    x, y = windows(corpus.train, train_offsets(len(corpus.train), config)[0], config.block_size)
    runs = {
        name: setup_mode(name, params32, model, DEFAULT_MODE_LR.get(name, config.lr), config.seed)
        for name in modes
    }
    out: dict[str, dict[str, float]] = {}
    for name, run in runs.items():
        counts = jsa.analysis.equation_counts(run.step, run.params, run.state, x, y)
        out[name] = {"equations": float(sum(counts.values()))}
        jax.block_until_ready(run.step(run.params, run.state, x, y))  # compile, warm up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(iters):
        for name, run in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(run.step(run.params, run.state, x, y))
            times[name].append(time.perf_counter() - start)
    for name in runs:
        out[name]["step_s"] = float(np.median(times[name]))
    return out


def _json_float(x: float) -> float | None:
    """`x`, or None when it is not finite (JSON has no NaN)."""
    return float(x) if np.isfinite(x) else None


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=f"{desc:<15}", leave=True, dynamic_ncols=True)


def _parse_mode_lr(items: Sequence[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in MODES:
            raise SystemExit(f"--mode-lr expects MODE=LR with MODE in {', '.join(MODES)}: {item}")
        out[name] = float(value)
    return out


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--mode",
        choices=(*MODES, "all", "fp4", "delayed"),
        nargs="+",
        default=["all"],
        help="one or more modes; all: the FP8 and scaled modes, fp4: fp32 and the 4-bit modes, "
        "delayed: fp32, scaled-fp16, scaled-fp8 and their delayed_scaling modes",
    )
    parser.add_argument("--n-layer", type=int, default=defaults.n_layer, help="depth")
    parser.add_argument("--n-head", type=int, default=defaults.n_head, help="attention heads")
    parser.add_argument("--n-embd", type=int, default=defaults.n_embd, help="width")
    parser.add_argument("--block-size", type=int, default=defaults.block_size, help="context")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--lr", type=float, default=defaults.lr, help="Adam learning rate")
    parser.add_argument(
        "--mode-lr",
        nargs="*",
        default=[],
        metavar="MODE=LR",
        help="per-mode learning rates (default: "
        + ", ".join(f"{k}={v:g}" for k, v in DEFAULT_MODE_LR.items())
        + ")",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    parser.add_argument("--eval-batches", type=int, default=defaults.eval_batches)
    parser.add_argument("--out-dir", type=Path, default=Path("runs/gpt"), help="JSON logs")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="folder with tiny-shakespeare's input.txt or input.txt.gz (default: "
        f"${datasets.DATA_DIR_ENV}, then the cache, then a download)",
    )
    parser.add_argument(
        "--scan-layers",
        action="store_true",
        help="stack the blocks and run them as a lax.scan over layers (as deep models are)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--step-cost",
        action="store_true",
        help="print each mode's equations per step and median step time (no training)",
    )
    args = parser.parse_args(argv)

    config = TrainConfig(
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        block_size=args.block_size,
        batch_size=args.batch_size,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        scan_layers=args.scan_layers,
    )
    mode_lr = _parse_mode_lr(args.mode_lr)
    text = datasets.tinyshakespeare(args.data_dir)
    groups = {
        "all": FP8_MODES,
        "fp4": ("fp32", *FP4_RECIPES),
        "delayed": ("fp32", "scaled-fp16", "scaled-fp8", *DELAYED_MODES),
    }
    modes = tuple(dict.fromkeys(m for name in args.mode for m in groups.get(name, (name,))))
    if args.step_cost:
        costs = step_cost(modes, text, config)
        print(f"{'mode':<20} {'equations':>9} {'step ms':>8}")
        for name, cost in costs.items():
            print(f"{name:<20} {cost['equations']:>9.0f} {1e3 * cost['step_s']:>8.1f}")
        return []
    logs = []
    for mode in modes:
        logs.append(
            train(mode, text, config, mode_lr.get(mode), args.out_dir, not args.no_progress)
        )

    def number(x: float | None) -> str:
        return "nan" if x is None else f"{x:.4f}"

    print(f"\n{'mode':<16} {'lr':>8} {'val loss':>9} {'own num.':>9} {'tok/s':>8} {'wall s':>7}")
    for log in logs:
        print(
            f"{log['mode']:<16} {log['lr']:>8.2g} {number(log['final_val_loss']):>9} "
            f"{number(log['final_val_loss_own_numerics']):>9} {log['tokens_per_s']:>8,.0f} "
            f"{log['wall_s']:>7.1f}"
        )
    print(f"logs in {args.out_dir}")
    return logs


if __name__ == "__main__":
    main()
