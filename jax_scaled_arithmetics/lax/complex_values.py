"""Scaled rules for primitives that turn scaled real values into complex ones.

A ScaledArray holds real data: `complex(re, im)` and the FFT of real input (rfft)
materialise their scaled operands and return plain complex arrays.
"""

from __future__ import annotations

from jax import lax

from ..core import _compat
from .base import register_materializing

register_materializing(lax.complex_p, remark="real parts materialised; complex output unscaled")
register_materializing(
    _compat.primitives.fft_p, remark="real input materialised; complex output unscaled"
)
