"""Type aliases shared across the package."""

from __future__ import annotations

from typing import Any

__all__ = ["Array"]

Array = Any
"""An array as the library's functions take it: a `jax.Array`, a tracer, a NumPy array or a
NumPy scalar (rules see all of them). `Any` for the type checker: JAX's own `ArrayLike`
leaves tracers out of some signatures."""
