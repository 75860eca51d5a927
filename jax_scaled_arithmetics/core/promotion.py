"""Promotion of the unscaled operands of a scaled equation to ScaledArrays."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from .config import Pow2RoundMode, ScalePolicy, get_autoscale_config
from .datatype import ScaledArray, is_floating
from .dtypes import compute_dtype
from .pow2 import static_pow2
from .scale_arithmetic import dynamic_scale_p, mark_pow2

__all__ = ["promote_to_scaled"]


def promote_to_scaled(x: Any, known: Any = None) -> Any:
    """Promote an unscaled floating operand of a scaled equation to a ScaledArray.

    A statically known zero gets scale 0; a known scalar (or a broadcast of one) gets a
    power-of-two scale so that its data is in [1, 2) (an infinity or NaN scale 1); any
    other array gets the power of two of its largest finite magnitude (its data then in
    [1, 2), like every output of a sum or contraction: a plain value computed from
    constants, such as the cotangent a loss's mean sends back, joins scaled ones at its
    own magnitude), or scale 1 with `ScalePolicy.STATIC`. Non-floating values and
    ScaledArrays are returned unchanged.
    """
    if isinstance(x, ScaledArray) or not is_floating(x):
        return x
    config = get_autoscale_config()
    scale_dtype = config.scale_dtype
    if known is not None and isinstance(known, (int, float)):
        if not np.isfinite(known):
            # An inf or NaN (a mask's -inf) is itself at any positive scale: scale 1, so
            # that its ratio to another operand's scale (2^-10 at scale 2^10) is never a
            # float32 subnormal, which XLA flushes to 0 (inf * 0 is NaN).
            return ScaledArray(x, np.asarray(1.0, scale_dtype))
        if known == 0:
            return ScaledArray(x, np.asarray(0.0, scale_dtype))
        mode = config.rounding_mode
        scale = static_pow2(known, Pow2RoundMode.DOWN if mode == Pow2RoundMode.NONE else mode)
        dtype = x.dtype
        data = jnp.full(np.shape(x), known / scale, dtype=dtype)
        return ScaledArray(data, np.asarray(scale, scale_dtype))
    if config.policy == ScalePolicy.STATIC or np.ndim(x) == 0:
        return ScaledArray(x, np.asarray(1.0, scale_dtype))
    scale, inverse = dynamic_scale_p.bind(x, np.float32(1.0))
    mark_pow2(scale)
    mark_pow2(inverse)
    cdtype = compute_dtype(x.dtype)
    data = (x.astype(cdtype) * inverse.astype(cdtype)).astype(x.dtype)
    return ScaledArray(data, scale)
