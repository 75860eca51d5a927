"""JAX Scaled Arithmetics: low-precision deep learning with scaled arrays."""

from . import mp as mp
from . import quantization as quantization
from .core.datatype import ScaledArray as ScaledArray
from .core.datatype import as_scaled_array as as_scaled_array
from .core.datatype import asarray as asarray
from .core.datatype import is_scaled_leaf as is_scaled_leaf
from .core.datatype import scaled_array as scaled_array

__version__ = "0.1.0"
