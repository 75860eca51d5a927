"""Pytree utilities that treat a `ScaledArray` as a single leaf."""

from ._src import all as all
from ._src import as_scaled_array as as_scaled_array
from ._src import asarray as asarray
from ._src import astype as astype
from ._src import flatten as flatten
from ._src import leaves as leaves
from ._src import map as map
from ._src import structure as structure
from ._src import unflatten as unflatten

__all__ = [
    "all",
    "as_scaled_array",
    "asarray",
    "astype",
    "flatten",
    "leaves",
    "map",
    "structure",
    "unflatten",
]
