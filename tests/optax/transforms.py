"""Optax transformations for the tests of `jsa.optax`."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class RecordState(NamedTuple):
    trace: Any


def record() -> optax.GradientTransformation:
    """The identity, whose state is the last updates it saw (field `trace`)."""
    return optax.GradientTransformation(
        lambda params: RecordState(jax.tree_util.tree_map(jnp.zeros_like, params)),
        lambda updates, state, params=None: (updates, RecordState(updates)),
    )
