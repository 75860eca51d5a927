"""Random draws of the package (stochastic rounding bits, dropout masks): `jax.random`'s
exact values, drawn on XLA:CPU as a flat vector reshaped to the shape asked for.

With partitionable threefry (JAX's default), the bits of element `i` of a draw depend only
on the key and `i`'s row-major index, so a flat draw reshaped is bit for bit the shaped
draw. XLA:CPU compiles the shaped form slower than the flat one, many times slower for
some rank-4 and rank-5 shapes (NHWC activations, the (B, H, T, T) attention weights that
dropout masks; docs/benchmarks.md, "Random draws"). Other backends get the shaped draw, which
partitions along any sharded axis; both forms are tested for equal values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["bernoulli", "random_bits"]


def random_bits(key: Any, shape: Sequence[int]) -> jax.Array:
    """`jax.random.bits(key, shape, jnp.uint32)`, the same bits.

    Examples:
        >>> key = jax.random.key(0)
        >>> bool((random_bits(key, (6, 20)) == jax.random.bits(key, (6, 20))).all())
        True
    """
    shape = tuple(shape)
    return _per_platform(lambda k, s: jax.random.bits(k, s, jnp.uint32), key, shape)


def bernoulli(key: Any, p: float | jax.Array, shape: Sequence[int]) -> jax.Array:
    """`jax.random.bernoulli(key, p, shape)` for a scalar probability `p`, the same draw.

    Examples:
        >>> key = jax.random.key(0)
        >>> mask = bernoulli(key, 0.9, (8, 32))
        >>> bool((mask == jax.random.bernoulli(key, 0.9, (8, 32))).all())
        True
    """
    if np.ndim(p) != 0:
        raise ValueError(f"bernoulli takes a scalar probability p, got shape {np.shape(p)}")
    shape = tuple(shape)
    return _per_platform(lambda k, s: jax.random.bernoulli(k, p, s), key, shape)


Draw = Callable[[Any, tuple[int, ...]], jax.Array]


def _per_platform(draw: Draw, key: Any, shape: tuple[int, ...]) -> jax.Array:
    """`draw(key, shape)`; on XLA:CPU `draw(key, (size,))` reshaped (for rank 2 and up)."""
    if len(shape) < 2:
        return draw(key, shape)
    return jax.lax.platform_dependent(
        key, cpu=lambda k: flat_draw(draw, k, shape), default=lambda k: draw(k, shape)
    )


def flat_draw(draw: Draw, key: Any, shape: tuple[int, ...]) -> jax.Array:
    """The XLA:CPU form: `draw` of a flat vector, reshaped to `shape`."""
    return draw(key, (math.prod(shape),)).reshape(shape)
