"""Number formats: simulated float, fixed point and block scaled (MX) quantisation.

Pure JAX / numpy; independent of the rest of the library.
"""

from ._bits import Rounding as Rounding
from .block import MXArray as MXArray
from .block import as_e8m0 as as_e8m0
from .block import block_dequantize as block_dequantize
from .block import block_quantize as block_quantize
from .block import from_e8m0 as from_e8m0
from .fixed_point import fixed_point_quantize as fixed_point_quantize
from .float_quantize import float_quantize as float_quantize
from .formats import FORMATS as FORMATS
from .formats import FloatFormat as FloatFormat
from .formats import NanEncoding as NanEncoding
from .formats import get_format as get_format

__all__ = [
    "FORMATS",
    "FloatFormat",
    "MXArray",
    "NanEncoding",
    "Rounding",
    "as_e8m0",
    "block_dequantize",
    "block_quantize",
    "fixed_point_quantize",
    "float_quantize",
    "from_e8m0",
    "get_format",
]
