"""The char GPT of `train.py` with low-precision weights and optimizer states: the recipes of
`jsa.optax` against float32 and plain bfloat16.

Same data, model, initialisation, batches, Adam learning rate and evaluation as
`train.py` (whose functions this script reuses); only the storage and rounding of the
weights, the optimizer state, the gradients and the updates differ:

    fp32             float32 weights, compute and Adam state (`train.py`'s baseline).
    bf16-nearest     pure bfloat16: bfloat16 weights and Adam state, the weight update
                     rounded to nearest (`quantize(adam, state="bfloat16")` and
                     `jsa.optax.apply_updates`): small updates are rounded away.
    bf16-stochastic  `jsa.optax.bf16_stochastic(adam)`: the same, with the weight update
                     rounded stochastically (a new key each step).
    bf16-kahan       `jsa.optax.bf16_kahan(adam)`: the same, rounded to nearest with a
                     bfloat16 Kahan compensation buffer per parameter.
    ibm8             `jsa.optax.ibm8_like(adam)`: weights, state and updates in the 16-bit
                     FP16_169 float with stochastic rounding (simulated in float32),
                     gradients rounded to float8_e5m2, and the model's matmuls in
                     float8_e5m2 on both passes (`jsa.ops.simulate_fp8(loss, forward_format=
                     "float8_e5m2", backward_format="float8_e5m2")`, saturating), with a
                     constant loss scale of 2**`--ibm8-loss-scale-exp` (float8_e5m2
                     flushes gradients below 2**-16 to zero).

The model computes in float32 from the weights' values (bfloat16 weights are upcast;
their gradients come back in bfloat16), so that only the storage and rounding of the
weights and the optimizer state differ from `fp32` (and, for `ibm8`, the float8 matmuls).
The validation loss is computed the same way. A JSON log per variant goes to `--out-dir`, and
`--plot` draws the validation curves.

Run: python experiments/gpt/train_optimizers.py --data-dir ../shared/data \
         --out-dir runs/gpt_optimizers --plot docs/images/gpt_optimizers.png
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jax_scaled_arithmetics as jsa

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a script, only this folder is on the path
    sys.path.insert(0, str(REPO_ROOT))

from experiments import data as datasets  # noqa: E402
from experiments.gpt import model as gpt  # noqa: E402
from experiments.gpt import train as base  # noqa: E402

VARIANTS = ("fp32", "bf16-nearest", "bf16-stochastic", "bf16-kahan", "ibm8")


@dataclasses.dataclass
class Variant:
    """How a variant stores its weights and updates them.

    `step(params, state, x, y, key) -> (params, state, loss)`.
    """

    name: str
    params: Any
    state: Any
    step: Callable[..., Any]


def _step(
    loss: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    apply: Callable[..., Any],
    loss_scale: float = 1.0,
) -> Callable[..., Any]:
    @jax.jit
    def step(params: Any, state: Any, x: Any, y: Any, key: Any) -> Any:
        def scaled(p: Any) -> Any:
            value = loss(p, x, y)
            return value * loss_scale, value

        grads, value = jax.grad(scaled, has_aux=True)(params)  # scaled: `optimizer` unscales
        updates, state = optimizer.update(grads, state, params)
        return apply(params, updates, key), state, value

    return step


def setup(name: str, params32: Any, model: gpt.GPTConfig, lr: float, ibm8_exp: int) -> Variant:
    """The initial state and step of variant `name`, from the float32 parameters."""

    def loss(p: Any, x: Any, y: Any) -> Any:
        p = jax.tree_util.tree_map(lambda v: v.astype(jnp.float32), p)
        return gpt.loss_fn(p, x, y, model)

    adam = optax.adam(lr)
    if name == "fp32":
        step = _step(loss, adam, lambda p, u, key: optax.apply_updates(p, u))
        return Variant(name, params32, adam.init(params32), step)
    if name == "bf16-nearest":
        optimizer = jsa.optax.quantize(adam, state="bfloat16")
        params = jsa.tree.astype(params32, jnp.bfloat16)
        step = _step(loss, optimizer, lambda p, u, key: jsa.optax.apply_updates(p, u))
        return Variant(name, params, optimizer.init(params), step)
    recipes = {
        "bf16-stochastic": jsa.optax.bf16_stochastic,
        "bf16-kahan": jsa.optax.bf16_kahan,
        "ibm8": jsa.optax.ibm8_like,
    }
    if name not in recipes:
        raise ValueError(f"Unknown variant {name!r}; choose from {', '.join(VARIANTS)}.")
    train_loss, loss_scale = loss, 1.0
    if name == "ibm8":
        train_loss = jsa.ops.simulate_fp8(
            loss, forward_format="float8_e5m2", backward_format="float8_e5m2"
        )
        # The gradients are rounded to float8_e5m2 while scaled, then unscaled (exactly:
        # a power of two) before Adam.
        loss_scale = 2.0**ibm8_exp
        adam = optax.chain(optax.scale(1.0 / loss_scale), adam)
    recipe = recipes[name](adam)
    params = recipe.cast_params(params32)
    step = _step(train_loss, recipe.optimizer, recipe.apply_updates, loss_scale)
    return Variant(name, params, recipe.optimizer.init(params), step)


def run(
    name: str,
    text: str,
    config: base.TrainConfig,
    ibm8_exp: int = 12,
    out_dir: Path | None = None,
) -> dict[str, Any]:
    """Train variant `name`; return (and write to `out_dir/<name>.json`) its log."""
    corpus = base.CharData.from_text(text)
    model = config.model(len(corpus.vocab))
    params32 = base._init_params(jax.random.PRNGKey(config.seed), model)
    offsets = base.train_offsets(len(corpus.train), config)
    val_batches = [
        base.windows(corpus.val, o, config.block_size)
        for o in base.eval_offsets(len(corpus.val), config)
    ]
    float32_loss = functools.partial(base._float32_loss, model=model)
    variant = setup(name, params32, model, config.lr, ibm8_exp)
    params, state = variant.params, variant.state

    def evaluate() -> float:
        values = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params)
        return base.mean_loss(float32_loss, values, val_batches)

    val_steps, val_losses = [0], [evaluate()]
    train_losses = []
    start = time.perf_counter()
    for i in range(config.steps):
        x, y = base.windows(corpus.train, offsets[i], config.block_size)
        key = jax.random.fold_in(jax.random.key(config.seed), i)
        params, state, value = variant.step(params, state, x, y, key)
        train_losses.append(float(value))
        if (i + 1) % config.eval_every == 0 or i + 1 == config.steps:
            val_steps.append(i + 1)
            val_losses.append(evaluate())
    log = {
        "experiment": "gpt-optimizers",
        "variant": name,
        "config": dataclasses.asdict(config),
        "ibm8_loss_scale_exp": ibm8_exp if name == "ibm8" else None,
        "init_digest": base.digest(params32),
        "batches_digest": base.digest(offsets),
        "weights_dtype": str(jax.tree_util.tree_leaves(params)[0].dtype),
        "train_loss": train_losses,
        "val_steps": val_steps,
        "val_loss": val_losses,
        "final_val_loss": val_losses[-1],
        "state_bytes": jsa.optax.state_nbytes(state),
        "param_bytes": jsa.optax.state_nbytes(params),
        "wall_s": time.perf_counter() - start,
        "platform": jax.default_backend(),
        "jax_version": jax.__version__,
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{name}.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


def plot(logs: Sequence[dict[str, Any]], path: Path) -> None:
    """Validation curves (left) and their difference to fp32's (right), to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diff) = plt.subplots(1, 2, figsize=(11, 4.2))
    ref = next((log for log in logs if log["variant"] == "fp32"), None)
    for log in logs:
        ax.plot(log["val_steps"], log["val_loss"], marker=".", label=log["variant"])
        if ref is not None:
            gap = [a - b for a, b in zip(log["val_loss"], ref["val_loss"])]
            diff.plot(log["val_steps"], gap, marker=".", label=log["variant"])
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (float32 model)")
    ax.set_title("char GPT, Adam 1e-3")
    diff.set_xlabel("step")
    diff.set_ylabel("validation loss - fp32's")
    diff.set_title("difference to fp32")
    for a in (ax, diff):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    defaults = base.TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", choices=(*VARIANTS, "all"), nargs="+", default=["all"])
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--lr", type=float, default=defaults.lr, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    parser.add_argument("--ibm8-loss-scale-exp", type=int, default=12)
    parser.add_argument("--out-dir", type=Path, default=Path("runs/gpt_optimizers"))
    parser.add_argument("--plot", type=Path, default=None, help="PNG of the validation curves")
    parser.add_argument("--data-dir", type=Path, default=None, help="as for train.py")
    parser.add_argument(
        "--replot", action="store_true", help="only redraw --plot from the logs in --out-dir"
    )
    args = parser.parse_args(argv)
    names = VARIANTS if "all" in args.variant else tuple(args.variant)
    if args.replot:
        logs = [json.loads((args.out_dir / f"{n}.json").read_text()) for n in names]
        plot(logs, args.plot or Path("gpt_optimizers.png"))
        return logs

    config = dataclasses.replace(
        defaults, steps=args.steps, lr=args.lr, seed=args.seed, eval_every=args.eval_every
    )
    text = datasets.tinyshakespeare(args.data_dir)
    logs = []
    for name in names:
        log = run(name, text, config, args.ibm8_loss_scale_exp, args.out_dir)
        print(f"{name:<16} val loss {log['final_val_loss']:.4f}  ({log['wall_s']:.0f} s)")
        logs.append(log)
    if args.plot is not None:
        plot(logs, args.plot)
    print("\n| variant | weights | final validation loss | vs fp32 |")
    print("| --- | --- | ---: | ---: |")
    ref = next((log["final_val_loss"] for log in logs if log["variant"] == "fp32"), None)
    for log in logs:
        diff = "" if ref is None else f"{log['final_val_loss'] - ref:+.4f}"
        loss = log["final_val_loss"]
        print(f"| {log['variant']} | {log['weights_dtype']} | {loss:.4f} | {diff} |")
    return logs


if __name__ == "__main__":
    main()
