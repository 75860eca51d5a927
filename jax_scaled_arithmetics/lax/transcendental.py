"""Scaled rules for exponentials, logarithms, trigonometric and special functions.

Every function is computed on the represented values in float32 (for float16
and bfloat16 data), so it overflows or underflows only where the plain
function does; the families differ in the output scale:

- `"one"`: outputs bounded away from zero on their typical range (cos, acos,
  acosh, logistic, erfc).
- `"dynamic"`, a power of two near the largest finite output, for everything
  else: fast-growing or unbounded outputs (exp, exp2, expm1, sinh, cosh, tan, pow,
  lgamma, digamma, polygamma, zeta, igamma_grad_a), and outputs that are all tiny
  for tiny inputs (sin, tanh, atan, asin, erf, erf_inv, asinh, atanh, log1p,
  atan2, igamma, igammac, regularized_incomplete_beta, bessel_i0e/i1e): tanh of
  values ~2^-60 is ~2^-60, which a scale of 1 would flush to zero in the data.
  (A scale `min(s, 1)` taken from the input would avoid the reduction, but
  overflows the data for tanh(inf) = 1 or log1p near -1 at tiny scales.)
- log: `log(data) + log(scale)` where the value leaves the float32 range.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import registry
from ..core.datatype import ScaledArray
from .base import compute_dtype, register_unscaled_elementwise

_REGISTERED_BEFORE = frozenset(registry.coverage())

_F32_TINY = float(np.finfo(np.float32).tiny)


@registry.register_scaled_op(
    lax.log_p, family="log", remark="log(value), or log(data) + log(scale) out of float32 range"
)
def scaled_log(x: ScaledArray, **params: Any) -> ScaledArray:
    """log of the value, scale 1.

    Where `data * scale` overflows or underflows float32 (a finite non-zero data
    with a non-zero scale), `log(data) + log(scale)` is used instead.
    """
    cdtype = compute_dtype(x.dtype)
    data = x.data.astype(cdtype)
    scale = jnp.asarray(x.scale).astype(cdtype)
    value = data * scale
    direct = lax.log_p.bind(value, **params)
    out_of_range = (
        ~(jnp.isfinite(value) & (jnp.abs(value) >= _F32_TINY))
        & jnp.isfinite(data)
        & (data != 0)
        & (scale != 0)
    )
    safe_data = jnp.where(out_of_range, data, jnp.ones_like(data))
    safe_scale = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    split = lax.log_p.bind(safe_data, **params) + jnp.log(safe_scale)
    out = jnp.where(out_of_range, split, direct)
    return ScaledArray(out.astype(x.dtype), np.asarray(1.0, np.float32))


_SCALE_ONE = (lax.cos_p, lax.acos_p, lax.acosh_p, lax.logistic_p, lax.erfc_p)
for _prim in _SCALE_ONE:
    register_unscaled_elementwise(_prim, output_scale="one", remark="bounded output, scale 1")

_SCALE_DYNAMIC = (
    lax.sin_p,
    lax.tanh_p,
    lax.atan_p,
    lax.asin_p,
    lax.erf_p,
    lax.erf_inv_p,
    lax.asinh_p,
    lax.atanh_p,
    lax.log1p_p,
    lax.exp_p,
    lax.exp2_p,
    lax.expm1_p,
    lax.sinh_p,
    lax.cosh_p,
    lax.tan_p,
    lax.pow_p,
    lax.atan2_p,
    lax.lgamma_p,
    lax.digamma_p,
    lax.polygamma_p,
    lax.zeta_p,
    lax.igamma_p,
    lax.igammac_p,
    lax.igamma_grad_a_p,
    lax.regularized_incomplete_beta_p,
    lax.bessel_i0e_p,
    lax.bessel_i1e_p,
)
for _prim in _SCALE_DYNAMIC:
    register_unscaled_elementwise(
        _prim, output_scale="dynamic", remark="dynamic scale from the largest finite output"
    )


REGISTERED = tuple(
    info.primitive for name, info in registry.coverage().items() if name not in _REGISTERED_BEFORE
)
"""The primitives whose rules this module registers."""
