"""Shared helpers of the unit-scaled ops: shape counts, factor arithmetic, argument checks.

The ops (`_linear`, `_activations`, `_softmax`, `_dropout`, `_norms`, `_embedding`,
`_residual`, `_attention`, `_losses`) each compute `fwd * f(x)` forward and give each
input the gradient `bwd_i * f'(x)^T g`. The factors are Python floats computed at trace
time from shapes: closed forms for the contractions, numpy quadrature for elementwise
functions, and a fixed-seed (`SEED`) numpy Monte Carlo for softmax and attention (cached
by shape and by `mult`). Inputs `x ~ N(0, 1)` iid and an output gradient `g ~ N(0, 1)`
iid, independent of `x`, are assumed throughout.

`constraint` (see `Constraint`) ties the output factor to the grad factors of the
operands on the path (activations). The default is `"to_output_scale"`, as for the PyTorch
unit-scaling library's ops and for `unit_scale`: the input gradients on the path get the
output's factor, so every op keeps unit outputs (its input gradients are then off unit by
the ratio of the two factors, e.g. sqrt(out/in) for a linear layer); `"gmean"`, `None` and
the others remain available. The grad factor of a weight (`rhs`, `weight`, `kernel`,
`bias`, `table`) is never tied. So layers written by hand with these ops (`linear` with
its bias, `gelu`, `residual_split`/`residual_add` with the transform's `tau`) compute what
`unit_scale` computes for the same plain layers before the final residual add
(`unit_scale` leaves the ops after it unconstrained: pass `constraint=None` there).

`mult` (softmax, attention, GELU, SiLU, cross-entropy) is u-muP's multiplier of a
non-linearity's input (a temperature): the factors are recomputed for it, by the same
quadrature or Monte Carlo.

Under `jax.vmap` the factors see the per-example shapes: a weight shared across the mapped
axis gets a gradient summed over that axis too, which its factor does not count.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..core.types import Array

__all__ = [
    "SEED",
    "broadcast_vector",
    "int_tuple",
    "inv_sqrt",
    "inv_std",
    "normalize_dims",
    "positive_number",
    "require_float",
    "require_same_shape",
    "shape_of",
    "size",
    "static_number",
]

SEED = 0  # Every Monte Carlo estimate of a factor draws from this seed.


def size(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def inv_sqrt(count: float) -> float:
    """1/sqrt(count); 1.0 for an empty sum (count 0), where no factor is meaningful."""
    return 1.0 / math.sqrt(count) if count > 0 else 1.0


def inv_std(variance: float) -> float:
    """1/sqrt(variance); 1.0 for a degenerate (constant) quantity."""
    return 1.0 / math.sqrt(variance) if variance > 1e-30 else 1.0


def shape_of(x: Array) -> tuple[int, ...]:
    return tuple(np.shape(x))


def require_float(x: Array, name: str) -> None:
    if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        raise TypeError(f"{name} must be a floating-point array, got dtype {jnp.result_type(x)}.")


def require_same_shape(a: Array, b: Array, names: str) -> None:
    if shape_of(a) != shape_of(b):
        raise ValueError(f"{names} must have the same shape, got {shape_of(a)} and {shape_of(b)}.")


def static_number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a Python number known at trace time, got {value!r}.")
    return float(value)


def positive_number(value: Any, name: str) -> float:
    number = static_number(value, name)
    if not (math.isfinite(number) and number > 0.0):
        raise ValueError(f"{name} must be positive and finite, got {number}.")
    return number


def broadcast_vector(v: Array, shape: tuple[int, ...], axes: Sequence[int]) -> Array:
    """`v`, whose shape is `shape` restricted to `axes`, broadcast explicitly to `shape`."""
    kept = [shape[a] if a in axes else 1 for a in range(len(shape))]
    return jnp.broadcast_to(jnp.reshape(v, kept), shape)


def normalize_dims(dims: Sequence[int], ndim: int, name: str) -> tuple[int, ...]:
    out = []
    for d in dims:
        if not -ndim <= int(d) < ndim:
            raise ValueError(f"dimension {d} out of range for {name} of rank {ndim}.")
        out.append(int(d) % ndim)
    return tuple(out)


def int_tuple(value: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)):
        return (int(value),)
    return tuple(int(v) for v in value)
