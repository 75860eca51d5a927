"""Train the MNIST MLP with FP8 matmul recipes: per-tensor, row-wise and MX block scales.

Every matmul of the MLP (forward, and both matmuls of its backward pass) runs through one
of the `jsa.ops` recipes; biases, activations functions, the loss, float32 master weights
and Adam state are float32. Modes (`--modes`):

    fp32            plain float32 matmuls (the baseline).
    tensorwise-fp8  `jsa.ops.tensorwise_fp8_matmul`: E4M3 operands, E5M2 output gradients,
                    one power-of-two scale per operand of each matmul.
    rowwise-fp8     `jsa.ops.rowwise_fp8_matmul`: the same formats, one scale per token of
                    the activations and per output channel of the weights (backward: the
                    scales along each matmul's contracting axis).
    mxfp8           `jsa.ops.mx_matmul`: MXFP8 E4M3 operands, MXFP8 E5M2 gradients, E8M0
                    scales per 32 elements along each contracting axis.
    mxfp6           MXFP6 E2M3 operands, MXFP8 E5M2 gradients.
    mxfp4           MXFP4 E2M1 operands, MXFP8 E5M2 gradients.

Test accuracy is measured with the mode's forward pass (the deployed model). Data, model,
initialisation, batches and optimizer are those of `train_mlp.py` (`init_mlp`,
`load_mnist`: the genuine MNIST test split, first 8,000 images train, last 2,000
evaluate), the same in every mode (`--seed`); the 784 pixels are zero-padded to 800
features in every mode, so that MX blocks of 32 divide the first layer's inputs.

Run: python experiments/mnist/train_fp8_recipes.py --data-dir ../shared/data/mnist \
         --out experiments/mnist/fp8_recipes_results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_scaled_arithmetics as jsa

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a script, only this folder is on the path
    sys.path.insert(0, str(REPO_ROOT))

from experiments.mnist.train_mlp import (  # noqa: E402
    N_TRAIN,
    adam_train,
    init_mlp,
    load_mnist,
)

Matmul = Callable[[jax.Array, jax.Array], jax.Array]


def _plain(x: jax.Array, w: jax.Array) -> jax.Array:
    return x @ w


def _mx(fmt: str) -> Matmul:
    return functools.partial(jsa.ops.mx_matmul, format=fmt, backward_format="mxfp8_e5m2")


MODES: dict[str, Matmul] = {
    "fp32": _plain,
    "tensorwise-fp8": jsa.ops.tensorwise_fp8_matmul,
    "rowwise-fp8": jsa.ops.rowwise_fp8_matmul,
    "mxfp8": _mx("mxfp8_e4m3"),
    "mxfp6": _mx("mxfp6_e2m3"),
    "mxfp4": _mx("mxfp4_e2m1"),
}
FEATURES = 800  # 784 pixels, zero-padded to a multiple of the MX block size


def pad_features(images: np.ndarray, features: int = FEATURES) -> np.ndarray:
    """Zero-pad the rows of `images` to `features` columns."""
    return np.pad(images, [(0, 0), (0, features - images.shape[1])])


def forward(mode: str, params: Sequence[dict[str, Any]], x: jax.Array) -> jax.Array:
    """Logits of the relu MLP, every matmul through the recipe of `mode`."""
    matmul = MODES[mode]
    for i, layer in enumerate(params):
        x = matmul(x, layer["w"]) + layer["b"][None, :]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x


_forward = jax.jit(forward, static_argnums=0)


def _loss(mode: str, params: Any, x: jax.Array, onehot: jax.Array) -> jax.Array:
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(forward(mode, params, x)) * onehot, axis=-1))


@dataclasses.dataclass
class Result:
    """Outcome of :func:`train` for one mode."""

    mode: str
    accuracy: float
    test_loss: float
    losses: np.ndarray
    seconds: float


def evaluate(mode: str, params: Any, images: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of the forward pass of `mode`."""
    logits = _forward(mode, params, jnp.asarray(images))
    onehot = np.eye(10, dtype=np.float32)[labels]
    accuracy = float(jnp.mean(jnp.argmax(logits, axis=-1) == labels))
    return accuracy, float(-jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * onehot, axis=-1)))


def train(
    mode: str,
    steps: int = 1000,
    batch_size: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    hidden: Sequence[int] = (256, 256),
    data: tuple[np.ndarray, np.ndarray] | None = None,
    n_train: int = N_TRAIN,
) -> Result:
    """Adam on the MLP with the matmuls of `mode`; test accuracy with its forward pass."""
    if mode not in MODES:
        raise ValueError(f"Unknown mode {mode!r}; choose from {', '.join(MODES)}.")
    images, labels = load_mnist() if data is None else data
    images = pad_features(images)
    train_x, train_y = images[:n_train], labels[:n_train]
    test_x, test_y = images[n_train:], labels[n_train:]
    params = init_mlp(jax.random.PRNGKey(seed), [images.shape[1], *hidden, 10])
    params, losses, seconds = adam_train(
        lambda p, x, onehot: _loss(mode, p, x, onehot),
        params,
        train_x,
        train_y,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
    )
    accuracy, test_loss = evaluate(mode, params, test_x, test_y)
    return Result(mode, accuracy, test_loss, losses, seconds)


def main(argv: Sequence[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 256])
    parser.add_argument("--n-train", type=int, default=N_TRAIN, help="the rest evaluates")
    parser.add_argument("--data-dir", type=Path, default=None, help="MNIST IDX .gz files")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)

    data = load_mnist(args.data_dir)
    results = []
    print(f"{'mode':<16} {'test acc':>9} {'test loss':>10} {'train loss':>11} {'s':>6}")
    for mode in args.modes:
        r = train(
            mode, args.steps, args.batch_size, args.lr, args.seed, args.hidden, data, args.n_train
        )
        print(
            f"{r.mode:<16} {100 * r.accuracy:>8.2f}% {r.test_loss:>10.4f} "
            f"{float(np.mean(r.losses[-50:])):>11.4f} {r.seconds:>6.1f}"
        )
        results.append(r)
    if args.out is not None:
        log = {
            "experiment": "mnist-mlp-fp8-recipes",
            "config": {
                "steps": args.steps,
                "batch_size": args.batch_size,
                "lr": args.lr,
                "seed": args.seed,
                "hidden": args.hidden,
                "n_train": args.n_train,
                "n_test": int(data[0].shape[0] - args.n_train),
                "features": FEATURES,
            },
            "jax_version": jax.__version__,
            "platform": jax.default_backend(),
            "results": [
                {
                    "mode": r.mode,
                    "accuracy": r.accuracy,
                    "test_loss": r.test_loss,
                    "final_train_loss": float(np.mean(r.losses[-50:])),
                    "seconds": round(r.seconds, 1),
                }
                for r in results
            ],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(log, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
