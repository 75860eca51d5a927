"""Cost of the weight update's rounding: nearest vs stochastic vs Kahan-compensated.

Times, over a GPT parameter tree (`experiments/gpt/model.py`'s `init_params`; GPT-2
small's shapes by default, 124M parameters, in bfloat16), three jitted weight updates:

- `nearest`: `jsa.optax.apply_updates(params, updates)`, i.e. `(p + u).astype(p.dtype)`;
- `stochastic`: `jsa.optax.apply_updates(params, updates, rounding="stochastic", key=key)`
  (`p + u` in float32, rounded with `jsa.quantization.float_quantize`, random bits from
  `jax.random.bits`, a new key each call);
- `kahan`: `kahan_summation(optax.identity())`'s update followed by `optax.apply_updates`,
  in one jit (reads and writes the bfloat16 compensation buffer too);
- `stochastic, threefry bits`: for comparison, the same stochastic rounding with its
  random bits from `jax.random.bits` (`jsa.quantization.float_quantize(p + u, "bfloat16",
  "stochastic", key=...)` per tensor), which `apply_updates` does not use for bfloat16.

The updates are float32 (what an optimizer computing in float32 hands over). After a
warm-up call each, the first three run in turn for `--repeats` rounds, each round in
another order (a call that follows a heavy one pays for the memory it freed), then the
threefry variant alone, `--threefry-repeats` times; the medians are reported, with each
median's ratio to `nearest`'s. On a shared machine, compare the ratios, measured in the
same run, rather than the absolute times.

Run: python benchmarks/weight_rounding.py [--config gpt2-small|small] [--repeats 15]
[--threefry-repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scaled_arithmetics as jsa

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "gpt2-small": dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "small": dict(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=128),
}


def gpt_model():
    """experiments/gpt/model.py, imported from its path."""
    spec = importlib.util.spec_from_file_location("gpt_model", ROOT / "experiments/gpt/model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def make_tree(config_name: str):
    gpt = gpt_model()
    config = gpt.GPTConfig(**CONFIGS[config_name])
    params = jax.jit(lambda key: gpt.init_params(key, config))(jax.random.PRNGKey(0))
    params = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params)
    updates = jax.jit(
        lambda params: jax.tree_util.tree_map(
            lambda p: 1e-4 * jnp.sign(p.astype(jnp.float32) + 0.01), params
        )
    )(params)
    return params, updates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="gpt2-small")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threefry-repeats", type=int, default=5)
    args = parser.parse_args()

    params, updates = make_tree(args.config)
    n = sum(p.size for p in jax.tree_util.tree_leaves(params))
    kahan = jsa.optax.kahan_summation(optax.identity())
    kahan_state = kahan.init(params)

    @jax.jit
    def nearest(params, updates, key, state):
        return jsa.optax.apply_updates(params, updates), state

    @jax.jit
    def stochastic(params, updates, key, state):
        return jsa.optax.apply_updates(params, updates, rounding="stochastic", key=key), state

    @jax.jit
    def compensated(params, updates, key, state):
        updates, state = kahan.update(updates, state, params)
        return optax.apply_updates(params, updates), state

    @jax.jit
    def stochastic_threefry(params, updates, key, state):
        """The same rounding with `jax.random` bits: `float_quantize`, one key per tensor."""
        leaves, treedef = jax.tree_util.tree_flatten(params)
        keys = jax.random.split(key, len(leaves))
        new = [
            jsa.quantization.float_quantize(
                p.astype(jnp.float32) + u, "bfloat16", "stochastic", key=k
            ).astype(p.dtype)
            for p, u, k in zip(leaves, treedef.flatten_up_to(updates), keys)
        ]
        return jax.tree_util.tree_unflatten(treedef, new), state

    cases = {"nearest": nearest, "stochastic": stochastic, "kahan": compensated}
    times: dict[str, list[float]] = {name: [] for name in [*cases, "stochastic, threefry bits"]}

    def run(name: str, fn, i: int) -> None:
        key = jax.random.key(i + 1)
        start = time.perf_counter()
        jax.block_until_ready(fn(params, updates, key, kahan_state))
        times[name].append(time.perf_counter() - start)

    for fn in [*cases.values(), stochastic_threefry]:  # compile and warm up
        jax.block_until_ready(fn(params, updates, jax.random.key(0), kahan_state))
    names = list(cases)
    for i in range(args.repeats):  # each round in another order: no case always follows another
        for name in names[i % len(names) :] + names[: i % len(names)]:
            run(name, cases[name], i)
    for i in range(args.threefry_repeats):  # slow: timed on its own, after the others
        run("stochastic, threefry bits", stochastic_threefry, i)

    print(
        f"{args.config}: {n:,} bfloat16 parameters, {len(jax.tree_util.tree_leaves(params))} "
        f"tensors, float32 updates; {args.repeats} rounds ({args.threefry_repeats} for threefry)"
    )
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, "
        f"{platform.processor() or platform.machine()}"
    )
    base = float(np.median(times["nearest"]))
    print("| update | median (ms) | min (ms) | vs nearest (medians) |")
    print("| --- | ---: | ---: | ---: |")
    for name, name_times in times.items():
        median = float(np.median(name_times))
        print(
            f"| {name} | {1e3 * median:.1f} | {1e3 * min(times[name]):.1f} | {median / base:.2f}x |"
        )


if __name__ == "__main__":
    main()
