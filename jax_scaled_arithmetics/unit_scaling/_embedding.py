"""Unit-scaled `embedding` lookup: the table's gradient is scaled by the lookups per row."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ..core.types import Array
from ._fwd_bwd import scale_bwd
from ._ops_common import shape_of as _shape
from ._ops_common import size as _size

__all__ = ["embedding"]


def embedding(ids: Array, table: Array) -> Array:
    """Unit-scaled embedding lookup `table[ids]`.

    The table gradient sums the output gradients of the lookups of each row: with L =
    `ids.size` lookups spread over V = `table.shape[0]` rows, each entry sums L/V unit
    terms on average, so it is scaled by sqrt(V / L).

    Args:
        ids: integer indices.
        table: shape (V, features); a weight (no constraint).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> table = jax.random.normal(jax.random.key(0), (1000, 64))
        >>> ids = jnp.arange(10) % 1000
        >>> U.embedding(ids, table).shape
        (10, 64)
    """
    if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
        raise TypeError(f"embedding ids must be integers, got dtype {jnp.result_type(ids)}.")
    if np.ndim(table) != 2:
        raise ValueError(f"embedding table must have shape (V, features), got {_shape(table)}.")
    lookups = _size(_shape(ids))
    table = scale_bwd(table, math.sqrt(_shape(table)[0] / lookups) if lookups else 1.0)
    return jnp.asarray(table)[ids]
