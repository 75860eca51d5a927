"""User-facing operations on scaled arrays: dynamic rescaling, low-precision casts, quantisers,
posit activation shortcuts, FP8 / MX / FP4 matmul recipes, and the transforms that simulate
FP8 and FP4 training on a whole function (`simulate_fp8`, `simulate_fp4`)."""

from .casts import cast_on_backward as cast_on_backward
from .casts import cast_on_forward as cast_on_forward
from .casts import quantizer as quantizer
from .casts import reduce_precision_on_backward as reduce_precision_on_backward
from .casts import reduce_precision_on_forward as reduce_precision_on_forward
from .dynamic_rescaling import dynamic_rescale_l1 as dynamic_rescale_l1
from .dynamic_rescaling import dynamic_rescale_l1_grad as dynamic_rescale_l1_grad
from .dynamic_rescaling import dynamic_rescale_l2 as dynamic_rescale_l2
from .dynamic_rescaling import dynamic_rescale_l2_grad as dynamic_rescale_l2_grad
from .dynamic_rescaling import dynamic_rescale_max as dynamic_rescale_max
from .dynamic_rescaling import dynamic_rescale_max_grad as dynamic_rescale_max_grad
from .fp4_matmul import FP4_RECIPES as FP4_RECIPES
from .fp4_matmul import fp4_matmul as fp4_matmul
from .fp4_matmul import nvfp4_matmul as nvfp4_matmul
from .fp4_simulation import simulate_fp4 as simulate_fp4
from .fp8_matmul import mx_matmul as mx_matmul
from .fp8_matmul import rowwise_fp8_matmul as rowwise_fp8_matmul
from .fp8_matmul import tensorwise_fp8_matmul as tensorwise_fp8_matmul
from .fp8_simulation import simulate_fp8 as simulate_fp8
from .posit_activations import posit_sigmoid as posit_sigmoid
from .posit_activations import posit_tanh as posit_tanh

__all__ = [
    "cast_on_backward",
    "cast_on_forward",
    "mx_matmul",
    "nvfp4_matmul",
    "fp4_matmul",
    "FP4_RECIPES",
    "posit_sigmoid",
    "posit_tanh",
    "quantizer",
    "reduce_precision_on_backward",
    "reduce_precision_on_forward",
    "rowwise_fp8_matmul",
    "simulate_fp4",
    "simulate_fp8",
    "tensorwise_fp8_matmul",
    "dynamic_rescale_l1",
    "dynamic_rescale_l1_grad",
    "dynamic_rescale_l2",
    "dynamic_rescale_l2_grad",
    "dynamic_rescale_max",
    "dynamic_rescale_max_grad",
]
