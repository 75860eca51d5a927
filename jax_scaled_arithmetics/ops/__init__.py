"""User-facing operations on scaled arrays: dynamic rescaling (and, with `quantization`, casts)."""

from .rescaling import dynamic_rescale_l1 as dynamic_rescale_l1
from .rescaling import dynamic_rescale_l1_grad as dynamic_rescale_l1_grad
from .rescaling import dynamic_rescale_l2 as dynamic_rescale_l2
from .rescaling import dynamic_rescale_l2_grad as dynamic_rescale_l2_grad
from .rescaling import dynamic_rescale_max as dynamic_rescale_max
from .rescaling import dynamic_rescale_max_grad as dynamic_rescale_max_grad

__all__ = [
    "dynamic_rescale_l1",
    "dynamic_rescale_l1_grad",
    "dynamic_rescale_l2",
    "dynamic_rescale_l2_grad",
    "dynamic_rescale_max",
    "dynamic_rescale_max_grad",
]
