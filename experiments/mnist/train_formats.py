"""Train the MNIST MLP with weights and activations in 8-bit posits, float8 and NF4.

Quantisation-aware training: float32 master weights and Adam state; on the forward pass
the two operands of every matmul (the layer's input activations and its weights) are
rounded to the format, with straight-through gradients; the backward pass is float32.
Test accuracy is measured with the same quantised forward pass (the deployed model).
The table also gives each configuration's post-training quantisation accuracy: the
float32-trained weights evaluated with that configuration's quantised forward pass.

Formats (`--formats`): `posit8_es0`, `posit8_es2`, `float8_e4m3fn`, `float8_e5m2`
(weights and activations, float8 saturating) and `nf4` (weights only, to the 16 NF4
values of `jsa.quantization.NF4`; activations stay float32), each

    unscaled  the values rounded as they are;
    scaled    each tensor a `ScaledArray` (`jsa.as_scaled_array`) whose data
              `jsa.ops.dynamic_rescale_l2` brings to RMS in [1, 2), where posits are
              most precise, then rounded with `jsa.ops.reduce_precision_on_forward`; for
              NF4, `jsa.ops.dynamic_rescale_max` and half that scale so that the data
              fill [-1, 1] (QLoRA's absmax scaling, per tensor, with a power-of-two scale).

plus `fp32` (no rounding). Data, model, initialisation, batches and optimizer are those of
`train_mlp.py` (`init_mlp`, `load_mnist`: the genuine MNIST test split, first 8,000
images train, last 2,000 evaluate), the same for every configuration (`--seed`).

Run: python experiments/mnist/train_formats.py --data-dir ../shared/data/mnist \
         --steps 1000 --out experiments/mnist/formats_results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.quantization import NF4, float_quantize, table_quantize

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a script, only this folder is on the path
    sys.path.insert(0, str(REPO_ROOT))

from experiments.mnist.train_mlp import (  # noqa: E402
    N_TRAIN,
    adam_train,
    init_mlp,
    load_mnist,
)

FORMATS = ("posit8_es0", "posit8_es2", "float8_e4m3fn", "float8_e5m2", "nf4")
WEIGHTS_ONLY = ("nf4",)

Quantizer = Callable[[jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Config:
    """A format (None: float32) and whether tensors are scaled before rounding."""

    format: str | None
    scaled: bool = False

    @property
    def name(self) -> str:
        if self.format is None:
            return "fp32"
        return f"{self.format}-{'scaled' if self.scaled else 'unscaled'}"


def configs(formats: Sequence[str] = FORMATS) -> list[Config]:
    """fp32, then every format unscaled and scaled."""
    return [Config(None)] + [Config(f, s) for f in formats for s in (False, True)]


def _round(fmt: str) -> Quantizer:
    if fmt == "nf4":
        return lambda v: table_quantize(v, NF4)
    return lambda v: float_quantize(v, fmt, saturate=True)


def quantizer(config: Config) -> Quantizer:
    """The function rounding one tensor (its value: a plain float32 array) in `config`."""
    if config.format is None:
        return lambda v: v
    fmt = config.format
    if not config.scaled:
        return _round(fmt)
    if fmt == "nf4":

        def nf4_scaled(v: jax.Array) -> jax.Array:
            s = jsa.ops.dynamic_rescale_max(jsa.as_scaled_array(v))  # max |data| in [1, 2)
            s = jsa.ScaledArray(s.data * 0.5, s.scale * 2)  # in [1/2, 1): NF4's range
            return jsa.ScaledArray(table_quantize(s.data, NF4), s.scale).to_array()

        return nf4_scaled

    def scaled(v: jax.Array) -> jax.Array:
        s = jsa.ops.dynamic_rescale_l2(jsa.as_scaled_array(v))  # data RMS in [1, 2)
        return jsa.ops.reduce_precision_on_forward(s, fmt, saturate=True).to_array()

    return scaled


def forward(config: Config, params: Sequence[dict[str, Any]], x: jax.Array) -> jax.Array:
    """Logits of the relu MLP with the matmul operands rounded as `config` says."""
    q = quantizer(config)
    q_act = (lambda v: v) if config.format in WEIGHTS_ONLY else q
    for i, layer in enumerate(params):
        x = q_act(x) @ q(layer["w"]) + layer["b"][None, :]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x


_forward = jax.jit(forward, static_argnums=0)


def _loss(config: Config, params: Any, x: jax.Array, onehot: jax.Array) -> jax.Array:
    logits = forward(config, params, x)
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * onehot, axis=-1))


@dataclasses.dataclass
class Result:
    """Outcome of :func:`train` for one configuration."""

    config: str
    accuracy: float
    test_loss: float
    losses: np.ndarray
    seconds: float
    params: Any = None


def train(
    config: Config,
    steps: int = 1000,
    batch_size: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    hidden: Sequence[int] = (256, 256),
    data: tuple[np.ndarray, np.ndarray] | None = None,
    n_train: int = N_TRAIN,
) -> Result:
    """Adam on the quantised MLP; test accuracy with the quantised forward pass."""
    images, labels = load_mnist() if data is None else data
    train_x, train_y = images[:n_train], labels[:n_train]
    test_x, test_y = images[n_train:], labels[n_train:]
    params = init_mlp(jax.random.PRNGKey(seed), [images.shape[1], *hidden, 10])
    params, losses, seconds = adam_train(
        lambda p, x, onehot: _loss(config, p, x, onehot),
        params,
        train_x,
        train_y,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
    )
    accuracy, test_loss = evaluate(config, params, test_x, test_y)
    return Result(config.name, accuracy, test_loss, losses, seconds, params)


def evaluate(
    config: Config, params: Any, images: np.ndarray, labels: np.ndarray
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of the quantised forward pass of `config`."""
    logits = _forward(config, params, images)
    onehot = np.eye(10, dtype=np.float32)[labels]
    accuracy = float(jnp.mean(jnp.argmax(logits, axis=-1) == labels))
    return accuracy, float(-jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * onehot, axis=-1)))


def main(argv: Sequence[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
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
    test_x, test_y = data[0][args.n_train :], data[1][args.n_train :]
    results, ptq = [], []
    print(f"{'config':<24} {'test acc':>9} {'PTQ acc':>8} {'test loss':>10} {'s':>6}")
    for config in configs(args.formats):
        r = train(
            config, args.steps, args.batch_size, args.lr, args.seed, args.hidden, data, args.n_train
        )
        # Post-training quantisation: the float32 run's weights, this quantised forward.
        ptq.append(evaluate(config, (results[0] if results else r).params, test_x, test_y)[0])
        print(
            f"{r.config:<24} {100 * r.accuracy:>8.2f}% {100 * ptq[-1]:>7.2f}% "
            f"{r.test_loss:>10.4f} {r.seconds:>6.1f}"
        )
        results.append(r)
    if args.out is not None:
        log = {
            "experiment": "mnist-mlp-formats",
            "config": {
                "steps": args.steps,
                "batch_size": args.batch_size,
                "lr": args.lr,
                "seed": args.seed,
                "hidden": args.hidden,
                "n_train": args.n_train,
                "n_test": int(data[0].shape[0] - args.n_train),
            },
            "jax_version": jax.__version__,
            "platform": jax.default_backend(),
            "results": [
                {
                    "config": r.config,
                    "accuracy": r.accuracy,
                    "ptq_accuracy": p,
                    "test_loss": r.test_loss,
                    "final_train_loss": float(np.mean(r.losses[-50:])),
                    "seconds": round(r.seconds, 1),
                }
                for r, p in zip(results, ptq, strict=True)
            ],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(log, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
