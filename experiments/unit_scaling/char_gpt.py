"""Unit scaling on a char GPT written as people write one: `U.unit_scale(loss)` against
float32 and against the reference library's `unit_scale(model)`.

The model (`forward`): token plus position embeddings (`wte[x] + wpe[:T]`), pre-norm
blocks (layer norm, causal multi-head attention written out: `softmax(q k^T / sqrt(d))`,
a GELU MLP), a final layer norm and an untied linear readout. Its twin in PyTorch
(`reference_char_gpt.py`) has the same shapes, data and batches, for the reference
library.

Modes:
    fp32       float32, nanoGPT's initialisation (normal(0.02), residual projections
               scaled by 1/sqrt(2 * layers)).
    unit       `U.unit_scale(loss)`, parameters `U.unit_init(params)` (unit-variance
               weights, zero biases).
    unit-fp8   `jsa.ops.simulate_fp8(U.unit_scale(loss))`: matmul operands in E4M3, their output
               gradients in E5M2, no loss scaling.

Optimiser: Adam (betas 0.9/0.99 as the reference's example), optax's `adam`, or with
`--umup` the u-muP learning-rate rules (`U.optim.adam` on `U.parameter_specs`).

Data: tiny-shakespeare (`--data-dir`, see `experiments/data.py`); the first 90% trains, the
validation loss is the mean next-character cross-entropy on fixed windows of the last 10%,
every `--eval-every` steps, computed with the mode's own loss function. Batches are drawn
from a numpy generator seeded with `--seed` (the same in every mode and in the PyTorch
twin).

Run: python experiments/unit_scaling/char_gpt.py --data-dir ../shared/data --mode unit
     python experiments/unit_scaling/char_gpt.py --data-dir ../shared/data \\
         --mode fp32 unit unit-fp8 --out-dir experiments/results/unit-scaling
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a script, only this folder is on the path
    sys.path.insert(0, str(REPO_ROOT))

import jax_scaled_arithmetics as jsa  # noqa: E402
import jax_scaled_arithmetics.unit_scaling as U  # noqa: E402
from experiments import data as datasets  # noqa: E402
from experiments.unit_scaling.chardata import Config, batch_offsets, char_ids  # noqa: E402

MODES = ("fp32", "unit", "unit-fp8")


Params = dict[str, Any]


def init_params(key: jax.Array, config: Config) -> Params:
    """float32 parameters as nanoGPT initialises them."""
    d, v, t = config.n_embd, config.vocab_size, config.block_size
    keys = iter(jax.random.split(key, 3 + 4 * config.n_layer))
    std, proj_std = 0.02, 0.02 / math.sqrt(2 * config.n_layer)

    def normal(shape: tuple[int, ...], scale: float) -> jax.Array:
        return scale * jax.random.normal(next(keys), shape, jnp.float32)

    def norm() -> Params:
        return {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))}

    blocks = [
        {
            "ln1": norm(),
            "qkv": {"w": normal((d, 3 * d), std), "b": jnp.zeros((3 * d,))},
            "proj": {"w": normal((d, d), proj_std), "b": jnp.zeros((d,))},
            "ln2": norm(),
            "fc": {"w": normal((d, 4 * d), std), "b": jnp.zeros((4 * d,))},
            "fc_proj": {"w": normal((4 * d, d), proj_std), "b": jnp.zeros((d,))},
        }
        for _ in range(config.n_layer)
    ]
    return {
        "wte": normal((v, d), std),
        "wpe": normal((t, d), std),
        "blocks": blocks,
        "lnf": norm(),
        "head": normal((d, v), std),
    }


def layer_norm(x: jax.Array, p: Params) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def dense(x: jax.Array, p: Params) -> jax.Array:
    return x @ p["w"] + p["b"]


def attention(x: jax.Array, p: Params, n_head: int) -> jax.Array:
    batch, seq, d = x.shape
    q, k, v = jnp.split(dense(x, p["qkv"]), 3, axis=-1)

    def heads(t: jax.Array) -> jax.Array:
        return t.reshape(batch, seq, n_head, d // n_head).transpose(0, 2, 1, 3)

    q, k, v = heads(q), heads(k), heads(v)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // n_head)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    out = (weights @ v).transpose(0, 2, 1, 3).reshape(batch, seq, d)
    return dense(out, p["proj"])


def forward(params: Params, tokens: jax.Array, n_head: int) -> jax.Array:
    """Logits (batch, seq, vocab) of int32 tokens (batch, seq)."""
    x = params["wte"][tokens] + params["wpe"][: tokens.shape[1]]
    for p in params["blocks"]:
        x = x + attention(layer_norm(x, p["ln1"]), p, n_head)
        x = x + dense(jax.nn.gelu(dense(layer_norm(x, p["ln2"]), p["fc"])), p["fc_proj"])
    return layer_norm(x, params["lnf"]) @ params["head"]


def loss_fn(params: Params, tokens: jax.Array, targets: jax.Array, n_head: int) -> jax.Array:
    """Mean next-character cross-entropy."""
    logp = jax.nn.log_softmax(forward(params, tokens, n_head), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def windows(ids: np.ndarray, offsets: np.ndarray, block: int) -> tuple[jax.Array, jax.Array]:
    index = offsets[..., None] + np.arange(block)
    return jnp.asarray(ids[index]), jnp.asarray(ids[index + 1])


MODELS = ("char-gpt", "linen-lm")
"""`char-gpt`: the model above; `linen-lm`: the Flax linen language model of the test zoo
(`tests/integration/zoo.py`: `nn.MultiHeadDotProductAttention`, a head tied to the
embedding), at the same sizes."""


def _linen_lm(config: Config) -> Any:
    from tests.integration import zoo

    return zoo.TransformerLM(
        vocab_size=config.vocab_size,
        max_len=config.block_size,
        d_model=config.n_embd,
        num_heads=config.n_head,
        num_layers=config.n_layer,
        mlp_dim=4 * config.n_embd,
    )


def model_init(model: str, config: Config) -> Params:
    """The model's float32 parameters, initialised as its code does."""
    key = jax.random.PRNGKey(config.seed)
    if model == "linen-lm":
        tokens = jnp.zeros((1, config.block_size), jnp.int32)
        return _linen_lm(config).init(key, tokens)  # type: ignore[no-any-return]
    return init_params(key, config)


def plain_loss(model: str, config: Config) -> Callable[..., Any]:
    """The model's mean next-character cross-entropy, as its users write it."""
    if model == "linen-lm":
        apply = _linen_lm(config).apply

        def linen_loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
            logits = apply(params, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        return linen_loss

    def loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        return loss_fn(params, x, y, config.n_head)

    return loss


def make_loss(
    mode: str, loss: Callable[..., Any], unit_options: dict[str, Any]
) -> Callable[..., Any]:
    if mode == "fp32":
        return loss
    unit = U.unit_scale(loss, **unit_options)
    return jsa.ops.simulate_fp8(unit) if mode == "unit-fp8" else unit


def make_optimizer(
    lr: float, config: Config, umup: bool, specs: Any = None
) -> optax.GradientTransformation:
    if umup:
        return U.optim.adam(lr, specs, b1=config.b1, b2=config.b2)
    return optax.adam(lr, b1=config.b1, b2=config.b2)


def train(
    mode: str,
    lr: float,
    config: Config,
    text: str,
    *,
    umup: bool = False,
    unit_options: dict[str, Any] | None = None,
    model: str = "char-gpt",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """One run; returns its log (config, curves, final validation loss)."""
    unit_options = dict(unit_options or {})
    train_ids, val_ids, vocab = char_ids(text)
    config = dataclasses.replace(config, vocab_size=vocab)
    params = model_init(model, config)
    if mode != "fp32":
        params = U.unit_init(params)
    written = plain_loss(model, config)
    loss = make_loss(mode, written, unit_options)
    train_off, val_off = batch_offsets(len(train_ids), len(val_ids), config)
    specs = None
    if umup:
        x0, y0 = windows(train_ids, train_off[0], config.block_size)
        specs = U.parameter_specs(written, params, x0, y0)
    opt = make_optimizer(lr, config, umup, specs)
    state = opt.init(params)

    @jax.jit
    def step(params: Params, state: Any, x: jax.Array, y: jax.Array) -> Any:
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    eval_loss = jax.jit(loss)
    val_batches = [windows(val_ids, o, config.block_size) for o in val_off]

    def evaluate() -> float:
        return float(np.mean([float(eval_loss(params, x, y)) for x, y in val_batches]))

    curve: list[tuple[int, float]] = [(0, evaluate())]
    train_curve: list[float] = []
    start = time.perf_counter()
    for i in range(config.steps):
        x, y = windows(train_ids, train_off[i], config.block_size)
        params, state, value = step(params, state, x, y)
        train_curve.append(float(value))
        if (i + 1) % config.eval_every == 0 or i + 1 == config.steps:
            curve.append((i + 1, evaluate()))
            log(f"{mode} lr={lr:g} step {i + 1}: train {value:.3f} val {curve[-1][1]:.3f}")
    final = curve[-1][1]
    return {
        "mode": mode,
        "model": model,
        "lr": lr,
        "umup": umup,
        "unit_options": {k: repr(v) for k, v in unit_options.items()},
        "config": dataclasses.asdict(config),
        "val_curve": curve,
        "train_curve": train_curve,
        "final_val_loss": final if math.isfinite(final) else None,
        "wall_s": time.perf_counter() - start,
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", nargs="+", default=["unit"], choices=MODES)
    parser.add_argument("--model", default="char-gpt", choices=MODELS)
    parser.add_argument("--lr", type=float, nargs="+", default=None)
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--n-layer", type=int, default=Config.n_layer)
    parser.add_argument("--n-embd", type=int, default=Config.n_embd)
    parser.add_argument("--n-head", type=int, default=Config.n_head)
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--umup", action="store_true", help="u-muP learning-rate rules")
    parser.add_argument(
        "--unit-options", default="{}", help="JSON of keyword arguments for U.unit_scale"
    )
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    config = Config(
        steps=args.steps,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        seed=args.seed,
    )
    text = datasets.tinyshakespeare(args.data_dir)
    options: dict[str, Any] = json.loads(args.unit_options)
    if isinstance(options.get("tau"), dict):  # {"attention": tau, "mlp": tau}
        taus = options["tau"]
        options["tau"] = lambda index, kinds: taus[kinds[index]]
    results = []
    for mode in args.mode:
        for lr in args.lr or [1e-3 if mode == "fp32" else 2e-2]:
            result = train(
                mode, lr, config, text, umup=args.umup, unit_options=options, model=args.model
            )
            print(f"{mode} lr={lr:g}: final validation loss {result['final_val_loss']}")
            results.append(result)
            if args.out_dir:
                out = Path(args.out_dir)
                out.mkdir(parents=True, exist_ok=True)
                prefix = "" if args.model == "char-gpt" else f"{args.model}-"
                name = f"{prefix}{mode}{args.tag}-d{config.n_embd}-l{config.n_layer}-lr{lr:g}.json"
                (out / name).write_text(json.dumps(result, indent=1))
    return results


if __name__ == "__main__":
    main()
