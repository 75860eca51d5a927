"""Train a small CNN on MNIST with Adam, in the modes of `train_mlp.py`.

The model: two 3x3 convolutions (16 and 32 channels, same padding), each followed by a
relu and a 2x2 max pooling, then a dense layer to the 10 classes: 28x28x1 -> 14x14x16 ->
7x7x32 -> 10 (20,490 parameters). Data, modes, batches, evaluation and JSON logs are
those of `train_mlp.py` (`train_model`): the genuine MNIST test split from `--data-dir`,
the first 8,000 images train and the last 2,000 evaluate, every mode from the same float32
initialisation and with the same batch order.

Run: python experiments/mnist/train_cnn.py --data-dir ../shared/data/mnist --steps 500
     python experiments/mnist/train_cnn.py --mode fp32 scaled-fp16 scaled-fp8 --out-dir runs
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a script, only this folder is on the path
    sys.path.insert(0, str(REPO_ROOT))

from experiments.mnist import train_mlp as common  # noqa: E402

MODES = common.MODES
CHANNELS = (16, 32)
SIDE = 28  # MNIST images are 28x28
TrainResult = common.TrainResult


def init_cnn(key: jax.Array, n_features: int = SIDE * SIDE) -> dict[str, Any]:
    """He-initialised float32 parameters: HWIO convolution kernels and a dense layer."""
    if n_features != SIDE * SIDE:
        raise ValueError(f"The CNN takes 28x28 images ({SIDE * SIDE} features), not {n_features}.")
    k1, k2, k3 = jax.random.split(key, 3)
    c1, c2 = CHANNELS
    flat = (SIDE // 4) * (SIDE // 4) * c2

    def he(k: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return jax.random.normal(k, shape) * np.sqrt(2.0 / fan_in)

    return {
        "conv1": {"w": he(k1, (3, 3, 1, c1), 9), "b": jnp.zeros(c1)},
        "conv2": {"w": he(k2, (3, 3, c1, c2), 9 * c1), "b": jnp.zeros(c2)},
        "dense": {"w": he(k3, (flat, 10), flat), "b": jnp.zeros(10)},
    }


_init_cnn = jax.jit(init_cnn, static_argnums=1)  # one compilation, not one per random draw


def conv(x: Any, layer: dict[str, Any]) -> Any:
    """3x3 convolution, same padding, NHWC activations and HWIO kernel, plus the bias."""
    y = jax.lax.conv_general_dilated(
        x, layer["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return y + layer["b"][None, None, None, :]


def max_pool(x: Any) -> Any:
    """2x2 max pooling with stride 2 (a reshape and a max over the window axes)."""
    batch, height, width, channels = x.shape
    return jnp.max(x.reshape(batch, height // 2, 2, width // 2, 2, channels), axis=(2, 4))


def cnn(params: dict[str, Any], x: Any) -> Any:
    """Logits for flattened images `x` of shape (batch, 784)."""
    h = x.reshape(x.shape[0], SIDE, SIDE, 1)
    h = max_pool(jax.nn.relu(conv(h, params["conv1"])))
    h = max_pool(jax.nn.relu(conv(h, params["conv2"])))
    h = h.reshape(h.shape[0], -1)
    return h @ params["dense"]["w"] + params["dense"]["b"][None, :]


def train(
    mode: str = "fp32",
    steps: int = 500,
    batch_size: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    data: tuple[np.ndarray, np.ndarray] | None = None,
    n_train: int = common.N_TRAIN,
    eval_every: int = 0,
) -> TrainResult:
    """Train the CNN for `steps` Adam steps in `mode` (arguments as `train_mlp.train`)."""
    return common.train_model(
        mode, _init_cnn, cnn, steps, batch_size, lr, seed, data, n_train, eval_every
    )


def main(argv: Sequence[str] | None = None) -> list[TrainResult]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_arguments(parser, steps=500)
    args = parser.parse_args(argv)

    data = common.load_mnist(args.data_dir)
    config = {
        "channels": list(CHANNELS),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "n_train": common.N_TRAIN,
        "eval_every": args.eval_every,
    }
    results = []
    common.print_header()
    for mode in common.selected_modes(args):
        eval_every = args.eval_every if args.out_dir is not None else 0
        r = train(
            mode, args.steps, args.batch_size, args.lr, args.seed, data, eval_every=eval_every
        )
        common.print_result(r)
        if args.out_dir is not None:
            common.write_log(r, args.out_dir, "cnn", config)
        results.append(r)
    return results


if __name__ == "__main__":
    main()
