"""The scaled rule of `custom_linear_solve`: the public `jax.lax.custom_linear_solve` runs
on the data of the right-hand side with fixed scales, so its implicit derivatives apply.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..core import _compat, registry
from ..core.config import ScalePolicy, get_autoscale_config
from ..core.datatype import ScaledArray
from ..core.promotion import promote_to_scaled
from ..core.subjaxpr import (
    coerce_scaledness,
)
from .base import rescale, safe_div
from .control_flow import operand_known, split_groups

# --- custom_linear_solve ----------------------------------------------------------------
#
# Re-emitted with the public `jax.lax.custom_linear_solve` on the *data* of the right-hand
# side, so that its implicit derivatives still apply. With fixed scales s_b (of b) and s_x
# (chosen for x), the data-space system is D_b^-1 A D_x: its matvec, solve and transpose
# solve are the original jaxprs interpreted on ScaledArrays and rescaled to the fixed
# scales. Any s_x is exact; s_x = s_b / (scale matvec gives to a unit-scale x) keeps the
# solution's data in range.


def _interpret_fixed_scales(
    closed: Any,
    consts: Sequence[Any],
    datas: Sequence[Any],
    in_scales: Sequence[Any],
    out_scales: Sequence[Any],
) -> list[Any]:
    """`closed(consts, data * in_scale)` as data at `out_scales` (plain arrays).

    Interpreted with the static scale policy: the solve's functions must stay linear in
    the data (JAX transposes them), which data-dependent output scales are not.
    """
    values = [ScaledArray(d, s) for d, s in zip(datas, in_scales, strict=True)]
    static = dataclasses.replace(get_autoscale_config(), policy=ScalePolicy.STATIC)
    with static:
        outs = registry.interpret_closed_jaxpr(closed, [*consts, *values])
    result = []
    for out, scale, like in zip(outs, out_scales, datas, strict=True):
        out = coerce_scaledness(out, True)
        ratio = safe_div(jnp.asarray(out.scale, jnp.float32), scale)
        result.append(rescale(out.data, ratio, like.dtype))
    return result


@registry.register_scaled_op(
    _compat.primitives.linear_solve_p,
    promote=False,
    family="higher-order",
    remark="lax.custom_linear_solve on the data of b, scales fixed: implicit derivatives kept",
)
def scaled_linear_solve(*args: Any, const_lengths: Any, jaxprs: Any) -> list[Any]:
    *groups, b = split_groups(args, tuple(const_lengths))
    *_, k_b = split_groups(operand_known(len(args)), tuple(const_lengths))
    b = [promote_to_scaled(v, k) for v, k in zip(b, k_b, strict=True)]
    matvec_c, _, solve_c, tsolve_c = groups
    matvec_j, _, solve_j, tsolve_j = jaxprs
    # x's scales follow b's (differentiably): x = x_data * s_b / c, c from the matvec alone.
    b_scales = [jnp.asarray(v.scale, jnp.float32) for v in b]
    b_data = [v.data for v in b]
    ones = [jnp.ones((), jnp.float32)] * len(b)
    unit_outs = registry.interpret_closed_jaxpr(
        matvec_j, [*matvec_c, *[ScaledArray(d, o) for d, o in zip(b_data, ones, strict=True)]]
    )
    x_scales = [
        safe_div(s, jax.lax.stop_gradient(jnp.asarray(o.scale, jnp.float32)))
        if isinstance(o, ScaledArray)
        else s
        for s, o in zip(b_scales, unit_outs, strict=True)
    ]
    x_scales = [jnp.where(s > 0, s, 1.0) for s in x_scales]
    inv_x = [safe_div(1.0, s) for s in x_scales]
    inv_b = [safe_div(1.0, s) for s in b_scales]

    def matvec(x: list[Any]) -> list[Any]:
        return _interpret_fixed_scales(matvec_j, matvec_c, x, x_scales, b_scales)

    def solve(_: Any, rhs: list[Any]) -> list[Any]:
        return _interpret_fixed_scales(solve_j, solve_c, rhs, b_scales, x_scales)

    def transpose_solve(_: Any, rhs: list[Any]) -> list[Any]:
        # (D_b^-1 A D_x)^-T c = s_b A^-T (c / s_x): data at scale 1 / s_b.
        return _interpret_fixed_scales(tsolve_j, tsolve_c, rhs, inv_x, inv_b)

    x_data = jax.lax.custom_linear_solve(
        matvec, b_data, solve, transpose_solve if tsolve_j is not None else None
    )
    return [ScaledArray(d, s) for d, s in zip(x_data, x_scales, strict=True)]
