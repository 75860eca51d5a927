"""Number formats: simulated float, fixed point, posit, lookup-table and block scaled (MX)
quantisation, and the random Hadamard transforms that spread outliers before it.

Pure JAX / numpy; independent of the rest of the library, except the ScaledArray view of
block scaled arrays (`MXArray.to_scaled_array`, `mx_from_scaled_array`).
"""

from ._bits import Rounding as Rounding
from .fixed_point import fixed_point_quantize as fixed_point_quantize
from .float_quantize import float_quantize as float_quantize
from .formats import FORMATS as FORMATS
from .formats import POSIT_FORMATS as POSIT_FORMATS
from .formats import FloatFormat as FloatFormat
from .formats import NanEncoding as NanEncoding
from .formats import PositFormat as PositFormat
from .formats import get_format as get_format
from .hadamard import hadamard_matrix as hadamard_matrix
from .hadamard import inverse_random_hadamard as inverse_random_hadamard
from .hadamard import random_hadamard as random_hadamard
from .mx_array import MXArray as MXArray
from .mx_array import block_dequantize as block_dequantize
from .mx_formats import MX_FORMAT_ALIASES as MX_FORMAT_ALIASES
from .mx_formats import MX_FORMATS as MX_FORMATS
from .mx_formats import as_e8m0 as as_e8m0
from .mx_formats import from_e8m0 as from_e8m0
from .mx_formats import mx_element_format as mx_element_format
from .mx_quantize import block_fake_quantize as block_fake_quantize
from .mx_quantize import block_quantize as block_quantize
from .mx_quantize import mx_from_scaled_array as mx_from_scaled_array
from .nvfp4 import NVFP4Array as NVFP4Array
from .nvfp4 import nvfp4_dequantize as nvfp4_dequantize
from .nvfp4 import nvfp4_fake_quantize as nvfp4_fake_quantize
from .nvfp4 import nvfp4_quantize as nvfp4_quantize
from .posit import posit_from_bits as posit_from_bits
from .posit import posit_quantize as posit_quantize
from .posit import posit_to_bits as posit_to_bits
from .posit import posit_values as posit_values
from .table import NF4 as NF4
from .table import table_decode as table_decode
from .table import table_encode as table_encode
from .table import table_quantize as table_quantize

__all__ = [
    "FORMATS",
    "MX_FORMAT_ALIASES",
    "MX_FORMATS",
    "NF4",
    "POSIT_FORMATS",
    "FloatFormat",
    "MXArray",
    "NVFP4Array",
    "NanEncoding",
    "PositFormat",
    "Rounding",
    "as_e8m0",
    "block_dequantize",
    "block_fake_quantize",
    "block_quantize",
    "fixed_point_quantize",
    "float_quantize",
    "from_e8m0",
    "get_format",
    "hadamard_matrix",
    "inverse_random_hadamard",
    "mx_element_format",
    "mx_from_scaled_array",
    "nvfp4_dequantize",
    "nvfp4_fake_quantize",
    "nvfp4_quantize",
    "posit_from_bits",
    "posit_quantize",
    "posit_to_bits",
    "posit_values",
    "random_hadamard",
    "table_decode",
    "table_encode",
    "table_quantize",
]
