"""Train an MLP on MNIST with Adam in float32, scaled FP16/BF16 and plain FP16/BF16.

Data: the genuine MNIST test split (IDX files), from `--data-dir` (default: the
`JSA_DATA_DIR` environment variable, then the per-user cache, then a checked
download; see `experiments/data.py`); the first 8,000 images train, the last
2,000 evaluate. Every mode starts from the same float32 initialisation and sees
the same batches (same `--seed`).

Modes:
    fp32         float32 parameters, Adam state and compute (the baseline).
    scaled-fp16  FP16 ScaledArray parameters, inputs and Adam state
                 (`jsa.optax.scale_optimizer`); the whole step runs in one
                 `@jax.jit @jsa.autoscale` function; no loss scaling.
    scaled-bf16  the same with bfloat16 data.
    plain-fp16   float16 parameters, compute and Adam state, no loss scaling.
    plain-bf16   the same with bfloat16.
    mixed-fp16   `jsa.mp` mixed precision: float32 parameters and Adam state,
                 float16 compute, dynamic loss scaling.
    fp8-plain    float32 parameters and Adam; the loss wrapped in `jsa.ops.simulate_fp8`
                 (`jax_scaled_arithmetics.unit_scaling`): matmul operands rounded to
                 E4M3 forward, matmul-output gradients to E5M2 backward, no scaling.
    scaled-fp8   scaled-fp16 plus those FP8 casts after dynamic rescaling
                 (`jsa.ops.simulate_fp8(loss, rescale=True)` inside the autoscaled step).

Test accuracy is measured with the parameters' values in float32, at the end and every
`--eval-every` steps (the accuracy curve). With `--out-dir`, a JSON log per mode is
written there (`mlp_<mode>.json`: config, training losses, accuracy curve, final
accuracy, wall time); `experiments/gpt/plot.py` draws the curves.

The step functions, modes, evaluation and training loop take the model as arguments
(`train_model`), and `experiments/mnist/train_cnn.py` reuses them for a CNN.

Run: python experiments/mnist/train_mlp.py --mode scaled-fp16 --steps 1000
     python experiments/mnist/train_mlp.py --data-dir ../shared/data/mnist  # offline copy
"""

from __future__ import annotations

import argparse
import dataclasses
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

MODES = (
    "fp32",
    "scaled-fp16",
    "scaled-bf16",
    "plain-fp16",
    "plain-bf16",
    "mixed-fp16",
    "fp8-plain",
    "scaled-fp8",
)
N_TRAIN = 8000
ADAM_B2 = 0.999
ADAM_EPS = 1e-8


def adam_train(
    loss: Callable[[Any, jax.Array, jax.Array], jax.Array],
    params: Any,
    train_x: np.ndarray,
    train_y: np.ndarray,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> tuple[Any, np.ndarray, float]:
    """Adam (b2 `ADAM_B2`, eps `ADAM_EPS`) on `loss(params, x, onehot)`, one jitted step per
    batch drawn from shuffled passes over the training set. Returns the parameters, the
    loss of every step and the seconds the loop took."""
    adam = optax.adam(lr, b2=ADAM_B2, eps=ADAM_EPS)
    state = adam.init(params)

    @jax.jit
    def step(params: Any, state: Any, x: jax.Array, onehot: jax.Array) -> Any:
        value, grads = jax.value_and_grad(loss)(params, x, onehot)
        updates, state = adam.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    rng = np.random.default_rng(seed)
    order = np.zeros(0, np.int64)
    losses = np.zeros(steps, np.float32)
    eye = np.eye(10, dtype=np.float32)
    start = time.perf_counter()
    for i in range(steps):
        if order.size < batch_size:
            order = np.concatenate([order, rng.permutation(len(train_x))])
        batch, order = order[:batch_size], order[batch_size:]
        params, state, value = step(params, state, train_x[batch], eye[train_y[batch]])
        losses[i] = float(value)
    return params, losses, time.perf_counter() - start


def as_features(images: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flatten uint8 images to float32 rows in [0, 1] (shape (N, 784)); labels to int32."""
    images = np.asarray(images)
    features = images.reshape(images.shape[0], -1).astype(np.float32) / 255.0
    return features, np.asarray(labels, np.int32)


def load_mnist(
    data_dir: str | os.PathLike[str] | None = None, split: str = "test"
) -> tuple[np.ndarray, np.ndarray]:
    """Images (float32 in [0, 1], shape (N, 784)) and labels (int32) of a genuine MNIST split.

    `data_dir` as in :func:`experiments.data.mnist`: None looks in `$JSA_DATA_DIR`, then the
    per-user cache, then downloads (checked against the recorded SHA-256s).
    """
    return as_features(*datasets.mnist(split, data_dir))


# --- model -------------------------------------------------------------------------------


def init_mlp(key: jax.Array, sizes: Sequence[int]) -> list[dict[str, jax.Array]]:
    """He-initialised dense layers `{"w": (n_in, n_out), "b": (n_out,)}` in float32."""
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (n_in, n_out)) * np.sqrt(2.0 / n_in), "b": jnp.zeros(n_out)}
        for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:])
    ]


def mlp(params: Sequence[dict[str, Any]], x: Any) -> Any:
    """Logits of a relu MLP (explicit broadcasting, rank promotion may be strict)."""
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"][None, :])
    return x @ params[-1]["w"] + params[-1]["b"][None, :]


def cross_entropy(params: Sequence[dict[str, Any]], x: Any, onehot: Any) -> Any:
    """Mean softmax cross-entropy, with `log_softmax`."""
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(mlp(params, x)) * onehot, axis=-1))


# --- training ----------------------------------------------------------------------------


@dataclasses.dataclass
class TrainResult:
    """Outcome of :func:`train`."""

    mode: str
    accuracy: float  # test accuracy in [0, 1]
    test_loss: float
    losses: np.ndarray  # training loss at every step (float32)
    seconds: float
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    """(step, test accuracy) every `eval_every` steps, from step 0 (empty if not asked)."""

    @property
    def first_nan_step(self) -> int | None:
        """Index of the first non-finite training loss, or None."""
        bad = np.flatnonzero(~np.isfinite(self.losses))
        return int(bad[0]) if bad.size else None


def _as_float(x: Any) -> float:
    if isinstance(x, jsa.ScaledArray):
        return float(x.to_array(jnp.float32))
    return float(jnp.asarray(x, jnp.float32))


def _plain_step(
    opt: optax.GradientTransformation, loss_fn: Callable[..., Any] = cross_entropy
) -> Callable[..., Any]:
    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


def _scaled_step(
    opt: optax.GradientTransformation, loss_fn: Callable[..., Any] = cross_entropy
) -> Callable[..., Any]:
    @jax.jit
    @jsa.autoscale
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return jsa_optax.apply_updates(params, updates), state, loss

    return step


def _mixed_step(
    opt: optax.GradientTransformation,
    policy: jsa.mp.Policy,
    loss_fn: Callable[..., Any] = cross_entropy,
) -> Callable[..., Any]:
    @jax.jit
    def step(params, state, x, y):
        opt_state, loss_scale = state

        def scaled_loss(p):
            loss = loss_fn(policy.cast_to_compute(p), x, y)
            return loss_scale.scale(loss.astype(jnp.float32)), loss

        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        grads = loss_scale.unscale(policy.cast_to_param(grads))
        finite = jsa.mp.all_finite(grads)
        updates, new_opt_state = opt.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jsa.mp.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, (opt_state, loss_scale.adjust(finite)), loss

    return step


def _simulate_fp8(loss_fn: Callable[..., Any], rescale: bool) -> Callable[..., Any]:

    return jsa.ops.simulate_fp8(loss_fn, rescale=rescale)


def _setup(
    mode: str, params32: Any, lr: float, loss_fn: Callable[..., Any] = cross_entropy
) -> tuple[Any, Any, Callable[..., Any], Any]:
    """Parameters, optimizer state, step function and input dtype for `mode`.

    `loss_fn(params, x, onehot)` is the model's loss (the MLP's by default)."""
    adam = optax.adam(lr, b2=ADAM_B2, eps=ADAM_EPS)
    if mode == "fp32":
        return params32, adam.init(params32), _plain_step(adam, loss_fn), jnp.float32
    if mode == "fp8-plain":
        step = _plain_step(adam, _simulate_fp8(loss_fn, rescale=False))
        return params32, adam.init(params32), step, jnp.float32
    if mode in ("plain-fp16", "plain-bf16"):
        dtype = jnp.float16 if mode == "plain-fp16" else jnp.bfloat16
        params = jsa.tree.astype(params32, dtype)
        return params, adam.init(params), _plain_step(adam, loss_fn), dtype
    if mode in ("scaled-fp16", "scaled-bf16", "scaled-fp8"):
        dtype = jnp.bfloat16 if mode == "scaled-bf16" else jnp.float16
        if mode == "scaled-fp8":
            loss_fn = _simulate_fp8(loss_fn, rescale=True)
        opt = jsa_optax.scale_optimizer(adam, state_dtype=dtype)
        params = jsa.ops.dynamic_rescale_max(jsa.as_scaled_array(params32, dtype=jnp.float32))
        params = jsa.tree.astype(params, dtype)
        return params, opt.init(params), _scaled_step(opt, loss_fn), dtype
    if mode == "mixed-fp16":
        policy = jsa.mp.get_policy("p=f32,c=f16,o=f32")
        loss_scale = jsa.mp.DynamicLossScale(jnp.float32(2.0**15))
        state = (adam.init(params32), loss_scale)
        return params32, state, _mixed_step(adam, policy, loss_fn), jnp.float16
    raise ValueError(f"Unknown mode {mode!r}; choose from {', '.join(MODES)}.")


def _inputs(x: np.ndarray, y: np.ndarray, mode: str, dtype: Any) -> tuple[Any, Any]:
    onehot = np.eye(10, dtype=np.float32)[y]
    if mode.startswith("scaled"):
        return jsa.as_scaled_array((jnp.asarray(x), jnp.asarray(onehot)), dtype=dtype)
    return jnp.asarray(x, dtype), jnp.asarray(onehot, dtype)


_JITTED: dict[Any, Callable[..., Any]] = {}


def evaluate(
    params: Any, images: np.ndarray, labels: np.ndarray, apply: Callable[..., Any] = mlp
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy, computed in float32 on the parameters' values.

    `apply(params, x)` gives the logits (the MLP's by default)."""
    params32 = jsa.asarray(params, jnp.float32)
    if apply not in _JITTED:
        _JITTED[apply] = jax.jit(apply)
    logits = _JITTED[apply](params32, jnp.asarray(images))
    onehot = jax.nn.one_hot(labels, 10)
    loss = -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * onehot, axis=-1))
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == jnp.asarray(labels))
    return float(accuracy), float(loss)


def fp16_adam_diagnostics(
    params32: Any, images: np.ndarray, labels: np.ndarray, b2: float = ADAM_B2
) -> dict[str, float]:
    """Why plain FP16 Adam breaks: first-step gradient and second-moment statistics.

    Computes the first gradient in plain float16 and reports: Adam's `eps`
    rounded to float16; the fraction of gradient entries flushed to zero in
    float16 (while nonzero in float32); the fraction of nonzero float16
    gradients whose second-moment increment `(1 - b2) * g**2` underflows to
    zero in float16 (those entries then get `mu / eps` = `mu / 0` updates); the
    median nonzero float32 gradient magnitude; the fractions of the entries of
    plain FP16 Adam's first update that are infinite and NaN.
    """
    x, y = jnp.asarray(images), jax.nn.one_hot(labels, 10)
    grad_fn = jax.jit(jax.grad(cross_entropy))
    p16 = jsa.tree.astype(params32, jnp.float16)
    leaves32 = jax.tree_util.tree_leaves(grad_fn(params32, x, y))
    grads16 = grad_fn(p16, x.astype(jnp.float16), y.astype(jnp.float16))
    leaves16 = jax.tree_util.tree_leaves(grads16)
    g32: np.ndarray = np.concatenate([np.ravel(g) for g in leaves32])
    g16: np.ndarray = np.concatenate([np.ravel(g) for g in leaves16])
    nu16 = (1 - np.float16(b2)) * np.square(g16)
    nonzero32, nonzero16 = g32 != 0, g16 != 0
    adam = optax.adam(1e-3, b2=b2, eps=ADAM_EPS)
    update = adam.update(grads16, adam.init(p16), p16)[0]
    u16 = np.concatenate([np.ravel(np.asarray(u, np.float32)) for u in jax.tree.leaves(update)])
    return {
        "eps_in_float16": float(np.float16(ADAM_EPS)),
        "grad_flushed_to_zero": float(np.mean(~nonzero16[nonzero32])),
        "nu_underflow": float(np.mean(nu16[nonzero16] == 0)),
        "grad_abs_median": float(np.median(np.abs(g32[nonzero32]))),
        "first_update_inf": float(np.mean(np.isinf(u16))),
        "first_update_nan": float(np.mean(np.isnan(u16))),
    }


Init = Callable[[jax.Array, int], Any]
"""`init(key, n_features)`: a model's float32 parameters."""
Apply = Callable[[Any, Any], Any]
"""`apply(params, x)`: a model's logits for inputs of shape (batch, n_features)."""


def train_model(
    mode: str,
    init: Init,
    apply: Apply,
    steps: int = 300,
    batch_size: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    data: tuple[np.ndarray, np.ndarray] | None = None,
    n_train: int = N_TRAIN,
    eval_every: int = 0,
) -> TrainResult:
    """Train the model `(init, apply)` for `steps` Adam steps in `mode`.

    The loss is the mean softmax cross-entropy of `apply`'s logits. Arguments as in
    :func:`train`; `eval_every > 0` records the test accuracy every `eval_every` steps
    (and at step 0) in `TrainResult.curve`. Evaluation draws no random numbers and its
    time is not counted in `TrainResult.seconds`.
    """
    if mode not in MODES:
        raise ValueError(f"Unknown mode {mode!r}; choose from {', '.join(MODES)}.")
    images, labels = load_mnist() if data is None else data
    train_x, train_y = images[:n_train], labels[:n_train]
    test_x, test_y = images[n_train:], labels[n_train:]

    def loss_fn(params: Any, x: Any, onehot: Any) -> Any:
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(apply(params, x)) * onehot, axis=-1))

    loss = cross_entropy if apply is mlp else loss_fn
    params32 = init(jax.random.PRNGKey(seed), images.shape[1])
    params, state, step, dtype = _setup(mode, params32, lr, loss)
    rng = np.random.default_rng(seed)
    order = np.empty(0, dtype=np.int64)
    losses = np.empty(steps, dtype=np.float32)
    curve: list[tuple[int, float]] = []
    eval_seconds = 0.0
    if eval_every > 0:
        curve.append((0, evaluate(params, test_x, test_y, apply)[0]))
    start = time.perf_counter()
    for i in range(steps):
        if order.size < batch_size:
            order = np.concatenate([order, rng.permutation(n_train)])
        batch, order = order[:batch_size], order[batch_size:]
        x, y = _inputs(train_x[batch], train_y[batch], mode, dtype)
        params, state, loss_value = step(params, state, x, y)
        losses[i] = _as_float(loss_value)
        if eval_every > 0 and ((i + 1) % eval_every == 0 or i + 1 == steps):
            t = time.perf_counter()
            curve.append((i + 1, evaluate(params, test_x, test_y, apply)[0]))
            eval_seconds += time.perf_counter() - t
    seconds = time.perf_counter() - start - eval_seconds
    accuracy, test_loss = evaluate(params, test_x, test_y, apply)
    extra: dict[str, Any] = {}
    if mode == "mixed-fp16":
        extra["final_loss_scale"] = float(state[1].loss_scale)
    return TrainResult(mode, accuracy, test_loss, losses, seconds, extra, curve)


def train(
    mode: str = "fp32",
    steps: int = 300,
    batch_size: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    hidden: Sequence[int] = (256, 256),
    data: tuple[np.ndarray, np.ndarray] | None = None,
    n_train: int = N_TRAIN,
    eval_every: int = 0,
) -> TrainResult:
    """Train the MLP for `steps` Adam steps in `mode`; return test accuracy and loss history.

    Args:
        mode: one of :data:`MODES`.
        steps: number of optimizer steps.
        batch_size: examples per step (batches are drawn from a per-epoch shuffle).
        lr: Adam learning rate.
        seed: seeds the initialisation and the batch order (identical across modes).
        hidden: hidden layer widths.
        data: `(images, labels)` as returned by :func:`load_mnist` (genuine MNIST's test
            split, located as :func:`load_mnist` does, if None).
        n_train: the first `n_train` examples train, the rest evaluate.
        eval_every: record the test accuracy every `eval_every` steps (0: only at the end).
    """

    def init(key: jax.Array, n_features: int) -> Any:
        return init_mlp(key, [n_features, *hidden, 10])

    return train_model(
        mode, init, mlp, steps, batch_size, lr, seed, data, n_train, eval_every=eval_every
    )


# --- command line (shared with train_cnn.py) ---------------------------------------------


def add_arguments(parser: argparse.ArgumentParser, steps: int = 1000) -> None:
    """The options every MNIST script takes (modes, steps, batch, lr, seed, data, logs)."""
    parser.add_argument(
        "--mode", choices=(*MODES, "all"), nargs="+", default=["all"], help="one or more modes"
    )
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=f"folder with the MNIST IDX .gz files (default: ${datasets.DATA_DIR_ENV}, then the "
        "cache, then a download)",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=50,
        help="test accuracy every N steps, for the curve in the JSON log (0: only at the end)",
    )
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="write a JSON log per mode to this folder"
    )


def selected_modes(args: argparse.Namespace) -> tuple[str, ...]:
    return MODES if "all" in args.mode else tuple(args.mode)


def write_log(
    result: TrainResult, out_dir: str | os.PathLike[str], model: str, config: dict[str, Any]
) -> Path:
    """Write `result` as `out_dir/<model>_<mode>.json`: the model's name and config, the
    mode, final test accuracy and loss, training losses, accuracy curve and wall time."""
    log = {
        "experiment": f"mnist-{model}",
        "model": model,
        "mode": result.mode,
        "config": config,
        "steps": len(result.losses),
        "accuracy": result.accuracy,
        "test_loss": result.test_loss if np.isfinite(result.test_loss) else None,
        "first_nan_step": result.first_nan_step,
        "train_loss": [float(v) if np.isfinite(v) else None for v in result.losses],
        "curve_steps": [s for s, _ in result.curve],
        "curve_accuracy": [a for _, a in result.curve],
        "wall_s": result.seconds,
        "extra": result.extra,
        "platform": jax.default_backend(),
        "jax_version": jax.__version__,
    }
    path = Path(out_dir) / f"{model}_{result.mode}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(log, indent=1) + "\n")
    return path


def print_header() -> None:
    print(
        f"{'mode':<12} {'test acc':>9} {'test loss':>10} {'last loss':>10} {'NaN at':>7} {'s':>6}"
    )


def print_result(r: TrainResult) -> None:
    nan_at = "-" if r.first_nan_step is None else str(r.first_nan_step)
    print(
        f"{r.mode:<12} {100 * r.accuracy:>8.2f}% {r.test_loss:>10.4f} {r.losses[-1]:>10.4f} "
        f"{nan_at:>7} {r.seconds:>6.1f}"
    )


def main(argv: Sequence[str] | None = None) -> list[TrainResult]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 256])
    args = parser.parse_args(argv)

    data = load_mnist(args.data_dir)
    modes = selected_modes(args)
    config = {
        "hidden": args.hidden,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "n_train": N_TRAIN,
        "eval_every": args.eval_every,
    }
    results = []
    print_header()
    for mode in modes:
        r = train(
            mode,
            args.steps,
            args.batch_size,
            args.lr,
            args.seed,
            args.hidden,
            data,
            eval_every=args.eval_every if args.out_dir is not None else 0,
        )
        print_result(r)
        if args.out_dir is not None:
            write_log(r, args.out_dir, "mlp", config)
        results.append(r)
    if "plain-fp16" in modes:
        params32 = init_mlp(jax.random.PRNGKey(args.seed), [data[0].shape[1], *args.hidden, 10])
        diag = fp16_adam_diagnostics(
            params32, data[0][: args.batch_size], data[1][: args.batch_size]
        )
        print("plain FP16 Adam, first batch:", ", ".join(f"{k}={v:.3g}" for k, v in diag.items()))
    return results


if __name__ == "__main__":
    main()
