"""Pytree utilities that treat a `ScaledArray` as a single leaf."""

from ._src import PackedScales as PackedScales
from ._src import all as all
from ._src import as_scaled_array as as_scaled_array
from ._src import asarray as asarray
from ._src import astype as astype
from ._src import flatten as flatten
from ._src import leaves as leaves
from ._src import map as map
from ._src import pack_scales as pack_scales
from ._src import structure as structure
from ._src import unflatten as unflatten
from ._src import unpack_scales as unpack_scales

__all__ = [
    "PackedScales",
    "all",
    "as_scaled_array",
    "asarray",
    "astype",
    "flatten",
    "leaves",
    "map",
    "pack_scales",
    "structure",
    "unflatten",
    "unpack_scales",
]
