"""Scaled rules for exponentials, logarithms, trigonometric and special functions.

Every function is computed on the represented values in float32 (for float16
and bfloat16 data), so it overflows or underflows only where the plain
function does; the families differ in the output scale:

- `"one"`: outputs bounded and not small on their range (cos, acos, acosh,
  logistic, erfc).
- `"input_at_most_one"`: functions with |f(x)| <= C min(|x|, bound) (sin, tanh,
  atan, asin, erf, asinh, and log1p, atanh, erf_inv whose float32 outputs stay
  below 17): the input scale times `2^ceil(log2 C)` for the slope bound
  |f(x)| <= C |x|, capped at 1. Tiny inputs keep their precision in every dtype
  (sin(2^-60 d) has data d, even in float16); tanh, atan and erf, finite at
  infinity, keep a floor so that tanh(inf) = 1 fits (float16: 2^-14 or 2^-10).
  log1p, atanh and erf_inv have that bound only for |x| <= 1/2: scales at which
  some representable input is larger are floored so that 17 fits the data dtype.
  The scale depends on the input scale only, so it stays unbatched under `vmap`.
- atan2: the same with the ratio of the scales (atan2(y, x) ~ y / x).
- `"dynamic"`, a power of two near the largest finite output: fast-growing or
  unbounded outputs (exp, exp2, expm1, sinh, cosh, tan, pow, lgamma, digamma,
  polygamma, zeta, igamma_grad_a), special functions whose outputs may all
  be tiny (igamma, igammac, regularized_incomplete_beta, bessel_i0e/i1e), and
  random_gamma (samples drawn with the unscaled alpha; the key stays plain).
- log, log2: `log(data) + log(scale)` where the value leaves the float32 range.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import _compat, registry
from ..core.datatype import ScaledArray
from .base import Slope, compute_dtype, register_unscaled_elementwise

_REGISTERED_BEFORE = frozenset(registry.coverage())

_F32_TINY = float(np.finfo(np.float32).tiny)


def _log_rule(name: str, prim: Any, log_of_scale: Any) -> Any:
    """The rule of `log` or `log2` (`prim`, None where the installed JAX lacks it),
    `log_of_scale` the same logarithm in jax.numpy."""

    def scaled_log(x: ScaledArray, **params: Any) -> ScaledArray:
        """The logarithm of the value, scale 1.

        Where `data * scale` overflows or underflows float32 (a finite non-zero data
        with a non-zero scale), `log(data) + log(scale)` is used instead.
        """
        cdtype = compute_dtype(x.dtype)
        data = x.data.astype(cdtype)
        scale = jnp.asarray(x.scale).astype(cdtype)
        value = data * scale
        out_of_range = (
            ~(jnp.isfinite(value) & (jnp.abs(value) >= _F32_TINY))
            & jnp.isfinite(data)
            & (data != 0)
            & (scale != 0)
        )
        # Each branch only sees the values it is used for, so neither puts inf into gradients.
        direct = prim.bind(jnp.where(out_of_range, jnp.ones_like(value), value), **params)
        safe_data = jnp.where(out_of_range, data, jnp.ones_like(data))
        safe_scale = jnp.where(scale > 0, scale, jnp.ones_like(scale))
        split = prim.bind(safe_data, **params) + log_of_scale(safe_scale)
        out = jnp.where(out_of_range, split, direct)
        return ScaledArray(out.astype(x.dtype), np.asarray(1.0, np.float32))

    scaled_log.__name__ = f"scaled_{name}"
    return scaled_log


scaled_log = registry.register_scaled_op(
    lax.log_p,
    _log_rule("log", lax.log_p, jnp.log),
    family="log",
    remark="log(value), or log(data) + log(scale) out of float32 range",
)
# From JAX 0.11 (`jnp.log2` was `log(x) / log(2)` before).
registry.register_scaled_op(
    "log2",
    _log_rule("log2", registry.installed_primitive("log2"), jnp.log2),
    family="log",
    remark="log2(value), or log2(data) + log2(scale) out of float32 range",
)


_SCALE_ONE = (lax.cos_p, lax.acos_p, lax.acosh_p, lax.logistic_p, lax.erfc_p)
for _prim in _SCALE_ONE:
    register_unscaled_elementwise(_prim, output_scale="one", remark="bounded output, scale 1")

# Largest finite |f| in float32 over the domain (log1p(-1 + 2^-24) = -16.6), and the slope
# bound |f(x)| <= C |x| (everywhere, or for |x| <= 1/2 near a singularity at +-1).
_BOUNDED_BY_INPUT = (
    (lax.sin_p, 1.0, Slope(1.0)),
    (lax.tanh_p, 1.0, Slope(1.0, saturates=True)),
    (lax.erf_p, 1.0, Slope(2 / np.sqrt(np.pi), saturates=True)),
    (lax.atan_p, np.pi / 2, Slope(1.0, saturates=True)),
    (lax.asin_p, np.pi / 2, Slope(np.pi / 2)),
    (lax.asinh_p, 0.0, Slope(1.0)),  # |asinh(x)| <= |x|: data never grows
    (lax.log1p_p, 17.0, Slope(2 * np.log(2), everywhere=False)),  # log1p(-1/2) = -ln 2
    (lax.atanh_p, 17.0, Slope(2 * np.arctanh(0.5), everywhere=False)),
    (lax.erf_inv_p, 17.0, Slope(1.0, everywhere=False)),  # erf_inv(1/2) = 0.477
)
for _prim, _bound, _slope in _BOUNDED_BY_INPUT:
    register_unscaled_elementwise(
        _prim,
        output_scale="input_at_most_one",
        bound=_bound,
        slope=_slope,
        remark="f(x) ~ x near 0: input scale (times the slope bound) capped at 1",
    )

register_unscaled_elementwise(
    lax.atan2_p,
    output_scale="ratio_at_most_one",
    bound=float(np.pi),
    remark="atan2(y, x) ~ y / x: scale sy / sx capped at 1, floored so pi fits",
)

_SCALE_DYNAMIC = (
    lax.exp_p,
    lax.exp2_p,
    lax.expm1_p,
    lax.sinh_p,
    lax.cosh_p,
    lax.tan_p,
    lax.pow_p,
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
    _compat.primitives.random_gamma_p,
)
for _prim in _SCALE_DYNAMIC:
    register_unscaled_elementwise(
        _prim, output_scale="dynamic", remark="dynamic scale from the largest finite output"
    )


# `1 - x^2` (JAX 0.11 and later write tanh's derivative with it): its own primitive there,
# `sub` and `mul` in older releases, whose rules cover them.
register_unscaled_elementwise(
    "one_minus_square",
    output_scale="dynamic",
    remark="1 - x^2 on the value, dynamic scale",
)


REGISTERED = tuple(
    info.primitive for name, info in registry.coverage().items() if name not in _REGISTERED_BEFORE
)
"""The primitives whose rules this module registers."""
