"""Many tensors' largest magnitudes on XLA:CPU: one reduction each vs a few variadic ones.

`scale_optimizer` rescales every leaf of an optimizer state per tensor, and
`delayed_scaling` measures every site's largest magnitude at the end of a step. XLA:CPU
gives each reduction a kernel of its own; its lowering of `rescale_factors_p` reduces the
small tensors together and the large ones of each size together (a variadic reduction
each, `largest_of_several`). This times both forms, in one process, alternated, on the
Adam moments (float16, each written by one multiply, as an update writes them) of three
models: the zoo's linen transformer (tests/integration/zoo.py), the 2-block char GPT and
GPT-2-small's shape (d 768, 12 blocks, the embedding cut to an eighth).

Run: python benchmarks/largest_magnitudes.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_scaled_arithmetics.ops.dynamic_rescaling import (
    _rescale_factors_per_tensor,
    rescale_factors_p,
)


def _gpt_shapes(blocks: int, width: int, vocab: int, context: int) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(vocab, width), (context, width)]
    for _ in range(blocks):
        shapes += [(width,), (width,), (width, 3 * width), (3 * width,), (width, width)]
        shapes += [(width,), (width,), (width,), (width, 4 * width), (4 * width,)]
        shapes += [(4 * width, width), (width,)]
    return shapes


MODELS = {
    "zoo linen": [(32,)] * 12
    + [(32, 4, 8)] * 6
    + [(64, 32)] * 3
    + [(64,)] * 2
    + [(32, 64)] * 2
    + [(4, 8, 32)] * 2
    + [(1, 16, 32)],
    "char GPT, 2 blocks": _gpt_shapes(2, 128, 65, 64),
    "GPT-2-small shape": _gpt_shapes(12, 768, 50257 // 8, 1024),
}


def time_both(shapes: list[tuple[int, ...]], rounds: int) -> tuple[int, float, float, float]:
    """(tensors, elements, median ms grouped, median ms one reduction each) for the two
    moments of every parameter of `shapes`."""
    rng = np.random.default_rng(0)
    moments = [jnp.asarray(rng.normal(size=s), jnp.float16) for s in shapes for _ in range(2)]
    params = dict(epsilon=2.0**-60, shift=14)
    decay = np.float16(0.9)
    grouped = jax.jit(lambda *m: rescale_factors_p.bind(*[x * decay for x in m], **params))
    alone = jax.jit(
        lambda *m: _rescale_factors_per_tensor(
            *[x * decay for x in m], one_kernel_on_cpu=True, **params
        )
    )
    times: dict[str, list[float]] = {"grouped": [], "alone": []}
    for fn in (grouped, alone):
        jax.block_until_ready(fn(*moments))
    for _ in range(rounds):
        for name, fn in (("grouped", grouped), ("alone", alone)):
            start = time.perf_counter()
            jax.block_until_ready(fn(*moments))
            times[name].append(time.perf_counter() - start)
    elements = sum(int(m.size) for m in moments)
    grouped_ms, alone_ms = (1e3 * float(np.median(times[k])) for k in ("grouped", "alone"))
    return len(moments), elements, grouped_ms, alone_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="alternated rounds per model")
    args = parser.parse_args()
    print(
        f"{platform.processor() or platform.machine()}, JAX {jax.__version__}, {jax.devices()[0]}"
    )
    print("| model | tensors | elements | together (ms) | one each (ms) | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for model, shapes in MODELS.items():
        count, elements, grouped_ms, alone_ms = time_both(shapes, args.rounds)
        print(
            f"| {model} | {count} | {elements:,} | {grouped_ms:.3f} | {alone_ms:.3f} "
            f"| {grouped_ms / alone_ms:.2f}x |"
        )


if __name__ == "__main__":
    main()
