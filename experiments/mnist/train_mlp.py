"""Train an MLP on MNIST with Adam in float32, scaled FP16/BF16 and plain FP16/BF16.

Data: the genuine MNIST test split (IDX files) from `../shared/data/mnist`
relative to the repository root; the first 8,000 images train, the last 2,000
evaluate. Every mode starts from the same float32 initialisation and sees the
same batches (same `--seed`).

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

Test accuracy is measured with the parameters' values in float32.

Run: python experiments/mnist/train_mlp.py --mode scaled-fp16 --steps 1000
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import struct
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

MODES = ("fp32", "scaled-fp16", "scaled-bf16", "plain-fp16", "plain-bf16", "mixed-fp16")
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data" / "mnist"
N_TRAIN = 8000
ADAM_B2 = 0.999
ADAM_EPS = 1e-8

_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed) into a NumPy array."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    zero, type_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or type_code not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (magic {raw[:4].hex()}).")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=_IDX_DTYPES[type_code], offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {data.size} values for shape {shape}.")
    return data.reshape(shape)


def load_mnist(path: str | Path = DEFAULT_DATA_DIR, split: str = "t10k") -> tuple[Any, Any]:
    """Images (float32 in [0, 1], shape (N, 784)) and labels (int32) of an MNIST split.

    Raises:
        FileNotFoundError: the IDX files are not in `path`.
    """
    path = Path(path)
    images_file = path / f"{split}-images-idx3-ubyte.gz"
    labels_file = path / f"{split}-labels-idx1-ubyte.gz"
    for file in (images_file, labels_file):
        if not file.is_file():
            raise FileNotFoundError(f"MNIST file {file} not found (expected ../shared/data/mnist).")
    images = read_idx(images_file).astype(np.float32) / 255.0
    labels = read_idx(labels_file).astype(np.int32)
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {labels.shape[0]} labels.")
    return images.reshape(images.shape[0], -1), labels


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

    @property
    def first_nan_step(self) -> int | None:
        """Index of the first non-finite training loss, or None."""
        bad = np.flatnonzero(~np.isfinite(self.losses))
        return int(bad[0]) if bad.size else None


def _as_float(x: Any) -> float:
    if isinstance(x, jsa.ScaledArray):
        return float(x.to_array(jnp.float32))
    return float(jnp.asarray(x, jnp.float32))


def _plain_step(opt: optax.GradientTransformation) -> Callable[..., Any]:
    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(cross_entropy)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


def _scaled_step(opt: optax.GradientTransformation) -> Callable[..., Any]:
    @jax.jit
    @jsa.autoscale
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(cross_entropy)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return jsa_optax.apply_updates(params, updates), state, loss

    return step


def _mixed_step(opt: optax.GradientTransformation, policy: jsa.mp.Policy) -> Callable[..., Any]:
    @jax.jit
    def step(params, state, x, y):
        opt_state, loss_scale = state

        def scaled_loss(p):
            loss = cross_entropy(policy.cast_to_compute(p), x, y)
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


def _setup(mode: str, params32: Any, lr: float) -> tuple[Any, Any, Callable[..., Any], Any]:
    """Parameters, optimizer state, step function and input dtype for `mode`."""
    adam = optax.adam(lr, b2=ADAM_B2, eps=ADAM_EPS)
    if mode == "fp32":
        return params32, adam.init(params32), _plain_step(adam), jnp.float32
    if mode in ("plain-fp16", "plain-bf16"):
        dtype = jnp.float16 if mode == "plain-fp16" else jnp.bfloat16
        params = jsa.tree.astype(params32, dtype)
        return params, adam.init(params), _plain_step(adam), dtype
    if mode in ("scaled-fp16", "scaled-bf16"):
        dtype = jnp.float16 if mode == "scaled-fp16" else jnp.bfloat16
        opt = jsa_optax.scale_optimizer(adam, state_dtype=dtype)
        params = jsa.ops.dynamic_rescale_max(jsa.as_scaled_array(params32, dtype=jnp.float32))
        params = jsa.tree.astype(params, dtype)
        return params, opt.init(params), _scaled_step(opt), dtype
    if mode == "mixed-fp16":
        policy = jsa.mp.get_policy("p=f32,c=f16,o=f32")
        loss_scale = jsa.mp.DynamicLossScale(jnp.float32(2.0**15))
        state = (adam.init(params32), loss_scale)
        return params32, state, _mixed_step(adam, policy), jnp.float16
    raise ValueError(f"Unknown mode {mode!r}; choose from {', '.join(MODES)}.")


def _inputs(x: np.ndarray, y: np.ndarray, mode: str, dtype: Any) -> tuple[Any, Any]:
    onehot = np.eye(10, dtype=np.float32)[y]
    if mode.startswith("scaled"):
        return jsa.as_scaled_array((jnp.asarray(x), jnp.asarray(onehot)), dtype=dtype)
    return jnp.asarray(x, dtype), jnp.asarray(onehot, dtype)


def evaluate(params: Any, images: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """Accuracy and mean cross-entropy, computed in float32 on the parameters' values."""
    params32 = jsa.asarray(params, jnp.float32)
    logits = jax.jit(mlp)(params32, jnp.asarray(images))
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
    zero in float16 (those entries then get `mu / eps` = `mu / 0` updates).
    """
    x, y = jnp.asarray(images), jax.nn.one_hot(labels, 10)
    grad_fn = jax.jit(jax.grad(cross_entropy))
    g32 = jax.tree_util.tree_leaves(grad_fn(params32, x, y))
    p16 = jsa.tree.astype(params32, jnp.float16)
    g16 = jax.tree_util.tree_leaves(grad_fn(p16, x.astype(jnp.float16), y.astype(jnp.float16)))
    g32 = np.concatenate([np.ravel(g) for g in g32])
    g16 = np.concatenate([np.ravel(g) for g in g16])
    nu16 = (1 - np.float16(b2)) * np.square(g16)
    nonzero32, nonzero16 = g32 != 0, g16 != 0
    return {
        "eps_in_float16": float(np.float16(ADAM_EPS)),
        "grad_flushed_to_zero": float(np.mean(~nonzero16[nonzero32])),
        "nu_underflow": float(np.mean(nu16[nonzero16] == 0)),
        "grad_abs_median": float(np.median(np.abs(g32[nonzero32]))),
    }


def train(
    mode: str = "fp32",
    steps: int = 300,
    batch_size: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    hidden: Sequence[int] = (256, 256),
    data: tuple[np.ndarray, np.ndarray] | None = None,
    n_train: int = N_TRAIN,
) -> TrainResult:
    """Train the MLP for `steps` Adam steps in `mode`; return test accuracy and loss history.

    Args:
        mode: one of :data:`MODES`.
        steps: number of optimizer steps.
        batch_size: examples per step (batches are drawn from a per-epoch shuffle).
        lr: Adam learning rate.
        seed: seeds the initialisation and the batch order (identical across modes).
        hidden: hidden layer widths.
        data: `(images, labels)` as returned by :func:`load_mnist` (loaded if None).
        n_train: the first `n_train` examples train, the rest evaluate.
    """
    if mode not in MODES:
        raise ValueError(f"Unknown mode {mode!r}; choose from {', '.join(MODES)}.")
    images, labels = load_mnist() if data is None else data
    train_x, train_y = images[:n_train], labels[:n_train]
    test_x, test_y = images[n_train:], labels[n_train:]

    params32 = init_mlp(jax.random.PRNGKey(seed), [images.shape[1], *hidden, 10])
    params, state, step, dtype = _setup(mode, params32, lr)
    rng = np.random.default_rng(seed)
    order = np.empty(0, dtype=np.int64)
    losses = np.empty(steps, dtype=np.float32)
    start = time.perf_counter()
    for i in range(steps):
        if order.size < batch_size:
            order = np.concatenate([order, rng.permutation(n_train)])
        batch, order = order[:batch_size], order[batch_size:]
        x, y = _inputs(train_x[batch], train_y[batch], mode, dtype)
        params, state, loss = step(params, state, x, y)
        losses[i] = _as_float(loss)
    seconds = time.perf_counter() - start
    accuracy, test_loss = evaluate(params, test_x, test_y)
    extra: dict[str, Any] = {}
    if mode == "mixed-fp16":
        extra["final_loss_scale"] = float(state[1].loss_scale)
    return TrainResult(mode, accuracy, test_loss, losses, seconds, extra)


def main(argv: Sequence[str] | None = None) -> list[TrainResult]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=(*MODES, "all"), default="all")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 256])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    args = parser.parse_args(argv)

    data = load_mnist(args.data_dir)
    modes = MODES if args.mode == "all" else (args.mode,)
    results = []
    print(
        f"{'mode':<12} {'test acc':>9} {'test loss':>10} {'last loss':>10} {'NaN at':>7} {'s':>6}"
    )
    for mode in modes:
        r = train(mode, args.steps, args.batch_size, args.lr, args.seed, args.hidden, data)
        nan_at = "-" if r.first_nan_step is None else str(r.first_nan_step)
        print(
            f"{mode:<12} {100 * r.accuracy:>8.2f}% {r.test_loss:>10.4f} {r.losses[-1]:>10.4f} "
            f"{nan_at:>7} {r.seconds:>6.1f}"
        )
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
