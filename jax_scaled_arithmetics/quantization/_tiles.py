"""2D blocks as rows: the r x c tiles of an array's last two axes, for block quantisers."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["tiles", "untiles"]


def tiles(v: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """(..., M, N) -> (..., M / r, N / c, r * c): each r x c block of the last two axes as
    one row (r and c must divide M and N).

    Examples:
        >>> import jax.numpy as jnp
        >>> tiles(jnp.arange(16).reshape(4, 4), (2, 2))[0, 1]
        Array([2, 3, 6, 7], dtype=int32)
    """
    r, c = shape
    m, n = v.shape[-2:]
    v = v.reshape(*v.shape[:-2], m // r, r, n // c, c)
    return jnp.swapaxes(v, -3, -2).reshape(*v.shape[:-4], m // r, n // c, r * c)


def untiles(t: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """The inverse of :func:`tiles`.

    Examples:
        >>> import jax.numpy as jnp
        >>> x = jnp.arange(16).reshape(4, 4)
        >>> bool((untiles(tiles(x, (2, 2)), (2, 2)) == x).all())
        True
    """
    r, c = shape
    mb, nb = t.shape[-3:-1]
    t = jnp.swapaxes(t.reshape(*t.shape[:-3], mb, nb, r, c), -3, -2)
    return t.reshape(*t.shape[:-4], mb * r, nb * c)
