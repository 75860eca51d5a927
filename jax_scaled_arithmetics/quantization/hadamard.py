"""Random Hadamard transforms: orthogonal block rotations that spread outliers before
low-precision quantisation (the 4-bit training recipes apply them to both operands of a
matmul along its contraction axis).

Along `axis`, each consecutive block of `size` entries `v` becomes `v @ T` with
`T = diag(s) @ H / sqrt(size)`: `H` the Sylvester Hadamard matrix of order `size` (entries
+-1, `H @ H.T = size * I`), `s` random signs drawn from `key` (all +1 without a key), the same
`T` for every block. `T` is orthogonal, so applying the same transform to both operands of
a product along their contracted axis leaves the product unchanged in exact arithmetic:
`(A @ T) @ (T.T @ B) = A @ B`, where `T.T @ B` is what `v -> v @ T` does to `B`'s columns.
A block holding one large entry comes out with every entry at `1/sqrt(size)` of it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.dtypes import compute_dtype

__all__ = ["hadamard_matrix", "inverse_random_hadamard", "random_hadamard"]


@functools.cache
def _sylvester(size: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard_matrix(size: int) -> np.ndarray:
    """The Sylvester Hadamard matrix of order `size` (a power of two): entries +-1,
    symmetric, `H @ H.T = size * I`.

    Examples:
        >>> hadamard_matrix(2)
        array([[ 1.,  1.],
               [ 1., -1.]], dtype=float32)
    """
    _check_size(size)
    return _sylvester(size).copy()


def _check_size(size: Any) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"size must be a positive power of two, got {size!r}")
    if size & (size - 1):
        raise ValueError(f"size must be a power of two, got {size}")
    return int(size)


def _signs(key: Any, size: int) -> jax.Array | None:
    if key is None:
        return None
    return jax.random.rademacher(key, (size,), jnp.float32)


def _transform(x: Any, axis: int, key: Any, size: int, inverse: bool) -> Any:
    size = _check_size(size)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"a random Hadamard transform needs floating input, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("a random Hadamard transform needs an array with at least one axis")
    axis = axis + x.ndim if axis < 0 else axis
    if not 0 <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of rank {x.ndim}")
    length = x.shape[axis]
    if length % size:
        raise ValueError(
            f"axis {axis} has {length} entries, not a multiple of the block size {size}"
        )
    dtype = x.dtype
    compute = compute_dtype(dtype)
    moved = jnp.moveaxis(x, axis, -1).astype(compute)
    blocks = moved.reshape(*moved.shape[:-1], length // size, size)
    h = jnp.asarray(_sylvester(size) / np.sqrt(size), compute)
    signs = _signs(key, size)
    if signs is not None:  # explicit ranks (users may run with rank promotion refused)
        signs = signs.reshape((1,) * (blocks.ndim - 1) + (size,))
    if signs is not None and not inverse:
        blocks = blocks * signs.astype(compute)
    # v @ (D H / sqrt(n)) forward; y @ (H / sqrt(n)) D back (H is symmetric).
    blocks = jnp.matmul(blocks, h, precision=jax.lax.Precision.HIGHEST)
    if signs is not None and inverse:
        blocks = blocks * signs.astype(compute)
    return jnp.moveaxis(blocks.reshape(moved.shape), -1, axis).astype(dtype)


def random_hadamard(x: Any, axis: int = -1, key: Any = None, size: int = 16) -> jax.Array:
    """`x` with every block of `size` entries along `axis` rotated by the random Hadamard
    transform `diag(s) H / sqrt(size)` (signs `s` drawn from `key`; none without a key).

    Computed in float32 (or wider) and returned in `x`'s dtype. Use the same `key` and
    `size` on both operands of a product, along the contracted axis, to leave it unchanged.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> x = jnp.array([[8.0, 0.0, 0.0, 0.0]])  # one outlier: spread over its block
        >>> random_hadamard(x, size=4)
        Array([[4., 4., 4., 4.]], dtype=float32)
        >>> a, b = jnp.arange(8.0).reshape(2, 4), jnp.ones((4, 3))
        >>> key = jax.random.key(0)
        >>> ra, rb = random_hadamard(a, 1, key, 4), random_hadamard(b, 0, key, 4)
        >>> bool(jnp.allclose(ra @ rb, a @ b, atol=1e-5))
        True
    """
    return _transform(x, axis, key, size, inverse=False)


def inverse_random_hadamard(y: Any, axis: int = -1, key: Any = None, size: int = 16) -> jax.Array:
    """The inverse (the transpose) of :func:`random_hadamard` with the same `key`, `axis`
    and `size`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> key = jax.random.key(1)
        >>> x = jnp.arange(16.0)
        >>> bool(jnp.allclose(inverse_random_hadamard(random_hadamard(x, key=key), key=key), x))
        True
    """
    return _transform(y, axis, key, size, inverse=True)
