"""Where a ScaledArray's scale lives when its data is sharded: replicated when per tensor,
sharded with its blocks when every device holds whole blocks (`jsa.sharding.like`,
`device_put` and `jax.sharding.reshard` under `autoscale`)."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["replicated", "scale_sharding", "spec_entries"]


def replicated(sharding: Any) -> Any:
    """A sharding that replicates a value over `sharding`'s devices."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(), memory_kind=sharding.memory_kind)
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    if isinstance(sharding, jax.sharding.Sharding):
        devices = sharding._device_assignment  # noqa: SLF001 (no public accessor for order)
        mesh = jax.sharding.Mesh(np.array(devices), ("_all",))
        return NamedSharding(mesh, PartitionSpec())
    raise TypeError(f"jsa.sharding.like: expected a jax.sharding.Sharding, got {sharding!r}.")


def spec_entries(spec: PartitionSpec, ndim: int) -> list[Any]:
    """A spec's entries, one per dimension (None where it names none)."""
    entries = list(spec)
    return entries + [None] * (ndim - len(entries))


def _mesh_size(mesh: Any, entry: Any) -> int:
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[name] for name in names)


def scale_sharding(data_sharding: Any, data_shape: tuple[int, ...], scale: Any) -> Any:
    """Per-tensor scale: replicated. Block scale: the data's spec on every axis where the
    blocks split evenly over the mesh axes (each device then holds its blocks' scales)."""
    scale_shape = tuple(np.shape(scale))
    if not scale_shape or not isinstance(data_sharding, NamedSharding):
        return replicated(data_sharding)
    entries: list[Any] = []
    for entry, n_data, n_scale in zip(
        spec_entries(data_sharding.spec, len(data_shape)), data_shape, scale_shape, strict=True
    ):
        if entry is None or n_scale == 1:
            entries.append(None)
            continue
        parts = _mesh_size(data_sharding.mesh, entry)
        block = n_data // n_scale
        # Each device's slice of the data must hold whole blocks.
        fits = n_scale % parts == 0 and (n_data // parts) % block == 0
        entries.append(entry if fits else None)
    while entries and entries[-1] is None:
        entries.pop()
    return NamedSharding(data_sharding.mesh, PartitionSpec(*entries))
