"""Bytes of parameters + Adam state: float32 vs FP16 scaled state (`jsa.optax`).

For each model, the parameters and the Adam state are built abstractly with
`jax.eval_shape` (nothing is allocated, so large models are cheap) and their
bytes summed leaf by leaf; a ScaledArray counts its data and its float32 scale.
The MLP is also built concretely, as a cross-check of the abstract count.

Setups:
    fp32         float32 parameters, optax.adam state (mu, nu) in float32.
    mixed-fp16   `jsa.mp` mixed precision: float32 master parameters and Adam
                 state, plus a DynamicLossScale (compute in float16).
    scaled-fp16  ScaledArray parameters with float16 data, and
                 `jsa.optax.scale_optimizer(optax.adam(...))` state.

Run: python benchmarks/optimizer_state_memory.py
"""

from __future__ import annotations

import argparse
import os
import platform
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scaled_arithmetics as jsa
import jax_scaled_arithmetics.optax as jsa_optax

Params = dict[str, jax.Array]


def mlp_params(sizes: tuple[int, ...] = (784, 256, 256, 10)) -> Callable[[], Params]:
    """Initialiser of a dense MLP's float32 parameters."""

    def init() -> Params:
        params = {}
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            params[f"dense{i}/w"] = jnp.ones((n_in, n_out)) / np.sqrt(n_in)
            params[f"dense{i}/b"] = jnp.zeros(n_out)
        return params

    return init


def transformer_params(
    vocab: int = 50257, context: int = 1024, width: int = 768, depth: int = 12
) -> Callable[[], Params]:
    """Initialiser of a GPT-2-small-shaped decoder's float32 parameters (~124M)."""

    def init() -> Params:
        params = {"wte": jnp.ones((vocab, width)), "wpe": jnp.ones((context, width))}
        for i in range(depth):
            p = f"block{i}/"
            for name in ("ln1", "ln2"):
                params[p + name + "/scale"] = jnp.ones(width)
                params[p + name + "/bias"] = jnp.zeros(width)
            params[p + "attn/qkv/w"] = jnp.ones((width, 3 * width))
            params[p + "attn/qkv/b"] = jnp.zeros(3 * width)
            params[p + "attn/proj/w"] = jnp.ones((width, width))
            params[p + "attn/proj/b"] = jnp.zeros(width)
            params[p + "mlp/fc/w"] = jnp.ones((width, 4 * width))
            params[p + "mlp/fc/b"] = jnp.zeros(4 * width)
            params[p + "mlp/proj/w"] = jnp.ones((4 * width, width))
            params[p + "mlp/proj/b"] = jnp.zeros(width)
        params["ln_f/scale"] = jnp.ones(width)
        params["ln_f/bias"] = jnp.zeros(width)
        return params

    return init


MODELS = {
    "MLP 784-256-256-10": mlp_params(),
    "GPT-2-small-shaped": transformer_params(),
}


def setup_fp32(init: Callable[[], Params]) -> tuple[Any, Any]:
    params = init()
    return params, optax.adam(1e-3).init(params)


def setup_mixed_fp16(init: Callable[[], Params]) -> tuple[Any, Any]:
    params = init()
    loss_scale = jsa.mp.DynamicLossScale(jnp.float32(2.0**15))
    return params, (optax.adam(1e-3).init(params), loss_scale)


def setup_scaled_fp16(init: Callable[[], Params]) -> tuple[Any, Any]:
    params = jsa.tree.astype(jsa.as_scaled_array(init()), jnp.float16)
    return params, jsa_optax.scale_optimizer(optax.adam(1e-3)).init(params)


SETUPS = {"fp32": setup_fp32, "mixed-fp16": setup_mixed_fp16, "scaled-fp16": setup_scaled_fp16}


def nbytes(tree: Any) -> int:
    """Bytes of the array leaves of `tree` (concrete arrays or ShapeDtypeStructs)."""
    return int(
        sum(
            int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
            for x in jax.tree_util.tree_leaves(tree)
        )
    )


def measure(init: Callable[[], Params], setup: Callable[..., Any], concrete: bool = False) -> Any:
    """(n_parameters, parameter bytes, state bytes)."""
    params, state = setup(init) if concrete else jax.eval_shape(lambda: setup(init))
    n = sum(
        int(np.prod(leaf.shape))
        for leaf in jax.tree_util.tree_leaves(params, is_leaf=jsa.is_scaled_leaf)
    )
    return n, nbytes(params), nbytes(state)


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} x {cpu}, jax {jax.__version__}, {jax.devices()[0].platform}"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    rows = []
    for model, init in MODELS.items():
        base = None
        for name, setup in SETUPS.items():
            n, p_bytes, s_bytes = measure(init, setup)
            total = p_bytes + s_bytes
            base = total if base is None else base
            rows.append(
                {
                    "model": model,
                    "setup": name,
                    "params": n,
                    "param_bytes": p_bytes,
                    "state_bytes": s_bytes,
                    "total_bytes": total,
                    "ratio": total / base,
                }
            )
    # Cross-check the abstract count on real arrays for the small model.
    mlp = MODELS["MLP 784-256-256-10"]
    for name, setup in SETUPS.items():
        concrete = measure(mlp, setup, concrete=True)
        abstract = measure(mlp, setup)
        assert concrete == abstract, (name, concrete, abstract)
    print("(MLP cross-check: concrete arrays give the same byte counts as eval_shape)")

    print(f"machine: {machine()}")
    header = f"{'model':<20} {'setup':<12} {'#params':>12} {'params B':>13} {'state B':>13} "
    print(header + f"{'total B':>13} {'B/param':>8} {'vs fp32':>8}")
    for r in rows:
        print(
            f"{r['model']:<20} {r['setup']:<12} {r['params']:>12,} {r['param_bytes']:>13,} "
            f"{r['state_bytes']:>13,} {r['total_bytes']:>13,} "
            f"{r['total_bytes'] / r['params']:>8.3f} {r['ratio']:>7.3f}x"
        )
    return rows


if __name__ == "__main__":
    main()
