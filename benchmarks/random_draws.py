"""Compile time of the package's random draws: shaped (`jax.random`) vs flat and reshaped.

`jsa.core.prng` draws stochastic-rounding bits and dropout masks as a flat vector reshaped
on XLA:CPU (the same bits, `tests/core/test_prng.py`). This measures why: the time to
compile one jitted draw of each shape, the way `jax.random` draws it and flat.

Run: python benchmarks/random_draws.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import math
import platform
import time

import jax
import jax.numpy as jnp

SHAPES = [(64, 64), (8, 128, 32), (4, 16, 16, 16), (3, 3, 16, 16), (8, 4, 64, 64), (2, 3, 4, 5, 6)]


def compile_seconds(draw, shape: tuple[int, ...], rounds: int) -> float:
    """The fastest of `rounds` compiles of a jitted `draw(key, shape)` (a fresh jit each,
    the persistent compilation cache off)."""
    key = jax.random.key(0)
    best = math.inf
    for _ in range(rounds):
        fn = jax.jit(lambda k: draw(k, shape))  # noqa: B023
        lowered = fn.lower(key)
        start = time.perf_counter()
        lowered.compile()
        best = min(best, time.perf_counter() - start)
    return best


def shaped_bits(key, shape):
    return jax.random.bits(key, shape, jnp.uint32)


def flat_bits(key, shape):
    return jax.random.bits(key, (math.prod(shape),), jnp.uint32).reshape(shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    machine = platform.processor() or platform.machine()
    print(f"JAX {jax.__version__}, {jax.default_backend()}, {machine}")
    print("| shape | shaped (s) | flat (s) | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for shape in SHAPES:
        shaped = compile_seconds(shaped_bits, shape, args.rounds)
        flat = compile_seconds(flat_bits, shape, args.rounds)
        print(f"| {shape} | {shaped:.2f} | {flat:.2f} | {shaped / flat:.1f}x |")


if __name__ == "__main__":
    main()
