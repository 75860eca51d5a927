"""Eager (un-jitted) calls of autoscaled functions: time per call.

`autoscale` traces its function at every call (so results are never stale: docs/design.md,
"What autoscale caches"). This measures what an eager call costs, from a one-multiply
function to the gradient of the Flax linen zoo LM, and how much of it the trace is.

Run: python benchmarks/eager_calls.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import functools
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax_scaled_arithmetics as jsa  # noqa: E402
from tests.integration import zoo  # noqa: E402


def best_of(fn: Callable[[], Any], rounds: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def cases() -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    x = jsa.as_scaled_array(jnp.ones((16, 64)), dtype=jnp.float16)
    weights = jsa.as_scaled_array(
        {"w1": jnp.full((64, 64), 0.1), "w2": jnp.full((64, 8), 0.1)}, dtype=jnp.float16
    )
    _, variables = zoo.linen_lm_init()
    params = jsa.as_scaled_array(variables["params"], dtype=jnp.bfloat16)
    model = zoo.linen_lm(zoo.CONFIG, jnp.bfloat16)
    batch = zoo.lm_batch()
    return {
        "a * 2": (lambda a: a * 2.0, (x,)),
        "MLP forward (2 layers)": (lambda p, a: jnp.tanh(a @ p["w1"]) @ p["w2"], (weights, x)),
        "linen zoo LM loss + grad": (
            lambda p, b: zoo.linen_loss_and_grad(model.apply, p, b),
            (params, batch),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, jax {jax.__version__}, cpu")
    print("| function | eager call (ms) | tracing it once (ms) |")
    print("| --- | ---: | ---: |")
    for name, (fn, fn_args) in cases().items():
        call = best_of(functools.partial(jsa.autoscale(fn), *fn_args), args.rounds)
        avals = jax.tree_util.tree_map(
            lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), jsa.asarray(fn_args)
        )
        # A new function object each time: JAX's own trace cache must not answer.
        trace = best_of(
            lambda fn=fn, avals=avals: jax.make_jaxpr(lambda *a: fn(*a))(*avals), args.rounds
        )
        print(f"| {name} | {1e3 * call:.2f} | {1e3 * trace:.2f} |")


if __name__ == "__main__":
    main()
