"""Refuse, at trace time, an optax update that float16 or FP8 data cannot compute.

Plain optax inside an autoscaled step computes in the dtype of the parameters and
gradients. With float16 (or FP8) data its constants are rounded when the step is traced
(Adam's `eps=1e-8` becomes 0 in float16) and, with one scale per tensor, the squares of
gradients far below a tensor's largest entry flush to zero: Adam-like divisions by
`sqrt(nu) + eps` then give inf or NaN (0/0) where float32 gives a finite update. Nothing
in the traced program can bring the lost constant back, so such a division, traced from
optax's code on narrow-range data, is an error naming the fix:
`jsa.optax.scale_optimizer(tx)` (its update runs on the represented values in float32).

Optimizers that only add and multiply (`sgd` with momentum, `lion`, `add_decayed_weights`,
`clip_by_global_norm`'s division by a scalar norm, `apply_updates`) are unaffected, and so
is every optimizer on bfloat16 or float32 data (their range holds optax's constants).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import _compat, registry
from ..core.datatype import ScaledArray

__all__ = ["is_narrow_range", "traced_from_optax"]


def is_narrow_range(dtype: Any) -> bool:
    """True for floating formats whose range is narrower than float32's (float16, FP8,
    FP6, FP4): optax's small constants (1e-8, 1e-30) round to zero there."""
    dtype = jnp.dtype(dtype)
    return bool(jnp.issubdtype(dtype, jnp.floating)) and jnp.finfo(dtype).maxexp < 128


def traced_from_optax(eqn: Any) -> bool:
    """Whether optax's optimizer code (not its losses) traced the equation (optax imported)."""
    optax = sys.modules.get("optax")
    path = getattr(optax, "__file__", None)
    if not path:
        return False
    root = os.path.dirname(os.path.abspath(path)) + os.sep
    # optax's losses are part of the model's loss (their backward divides legitimately).
    losses = root + "losses" + os.sep
    for code, _ in _compat.eqn_code_frames(eqn):  # innermost first
        if code.co_filename.startswith(losses):
            return False
        if code.co_filename.startswith(root):
            return True
    return False


def _negative_power(eqn: Any, operands: Sequence[Any]) -> bool:
    if eqn.primitive is lax.integer_pow_p:
        return int(eqn.params["y"]) < 0
    exponent = operands[1]  # pow: a literal exponent is a NumPy scalar; unknown counts
    if isinstance(exponent, ScaledArray) or _compat.is_tracer(exponent):
        return True
    return not np.all(np.asarray(exponent) >= 0)


def _guard(tensor_operand: int, what: str, applies: Any = None) -> Any:
    def guard(eqn: Any, operands: Sequence[Any]) -> None:
        operand = operands[tensor_operand]
        out_dtype = eqn.outvars[0].aval.dtype
        if not (isinstance(operand, ScaledArray) and np.ndim(operand.data) > 0):
            return
        if not is_narrow_range(out_dtype) or not traced_from_optax(eqn):
            return
        if applies is not None and not applies(eqn, operands):
            return
        where = _compat.eqn_source_summary(eqn) or "an optax update"
        raise ValueError(
            f"autoscale: optax's update divides by a per-entry statistic ({what}, at {where}) "
            f"on {jnp.dtype(out_dtype).name} data. In {jnp.dtype(out_dtype).name} optax's "
            f"constants are rounded when the step is traced (Adam's eps=1e-8 is 0) and the "
            f"squares of small gradients flush, so the update would be inf or NaN where "
            f"float32 gives a finite one. Wrap the optimizer with "
            f"`jsa.optax.scale_optimizer(tx)` (state stored in {jnp.dtype(out_dtype).name}, "
            f"update computed on the represented values in float32; not with "
            f"`compute_dtype=None`, which computes in the stored dtype), or keep the "
            f"parameters and the optimizer state in bfloat16 or float32 data."
        )

    return guard


registry.register_equation_guard(lax.div_p, _guard(1, "a division by a tensor"))
registry.register_equation_guard(lax.rsqrt_p, _guard(0, "a reciprocal square root"))
registry.register_equation_guard(lax.pow_p, _guard(0, "a negative power", _negative_power))
registry.register_equation_guard(lax.integer_pow_p, _guard(0, "a negative power", _negative_power))
