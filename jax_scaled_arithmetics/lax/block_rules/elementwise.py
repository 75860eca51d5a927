"""Block rules of elementwise primitives.

- mul / div: data multiplied / divided, scales multiplied / divided per block;
- exp, log, tanh, logistic, sqrt, rsqrt, sin, cos, erf, integer powers...: computed on
  the value in float32, one dynamic scale per block of the output;
- add, sub, max, min, select_n: each block at the larger of its operands' scales.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ...core import _compat, block_scales, registry
from ...core.datatype import ScaledArray
from ...core.types import Array
from ..base import compute_dtype, select_whole_cases
from ._common import F32, dynamic_blocks, layout_of, scale_on, scaled


def _full(xs: Sequence[ScaledArray]) -> list[ScaledArray]:
    """Operands broadcast to one shape (JAX binds scalar literals, and size-1 axes, beside
    full arrays); a broadcast axis has one block."""
    shape = tuple(np.broadcast_shapes(*[x.shape for x in xs]))
    out = []
    for x in xs:
        if x.shape != shape:
            scale = x.scale
            if np.ndim(scale):
                lead = (1,) * (len(shape) - x.ndim)
                scale = jnp.asarray(scale).reshape(lead + layout_of(x))
            x = ScaledArray(jnp.broadcast_to(x.data, shape), scale)
        out.append(x)
    return out


def _common(xs: Sequence[ScaledArray]) -> tuple[tuple[int, ...], list[Array]]:
    xs = _full(xs)
    shape = xs[0].shape
    layout = block_scales.common_layout(shape, *[layout_of(x) for x in xs])
    return layout, [scale_on(x, layout) for x in xs]


@registry.register_block_rule(lax.mul_p)
def _mul(a: ScaledArray, b: ScaledArray, **params: Any) -> Any:
    a, b = _full([a, b])
    layout, (sa, sb) = _common([a, b])
    cdtype = compute_dtype(a.dtype)
    data = (a.data.astype(cdtype) * b.data.astype(cdtype)).astype(a.dtype)
    return scaled(data, sa * sb)


@registry.register_block_rule(lax.div_p)
def _div(a: ScaledArray, b: ScaledArray, **params: Any) -> Any:
    a, b = _full([a, b])
    layout, (sa, sb) = _common([a, b])
    cdtype = compute_dtype(a.dtype)
    data = lax.div(a.data.astype(cdtype), b.data.astype(cdtype)).astype(a.dtype)
    return scaled(data, sa / sb)


def _at_common_scale(xs: Sequence[ScaledArray]) -> tuple[list[Array], Array]:
    """The operands' data at one scale per block (the largest of theirs), compute dtype."""
    xs = _full(xs)
    layout, scales = _common(xs)
    distinct: list[Array] = []
    for scale in scales:
        if not any(scale is d for d in distinct):
            distinct.append(scale)
    common = distinct[0]
    for scale in distinct[1:]:
        common = lax.max(common, scale)
    # No stop_gradient: each operand's value `data * ratio(s, common) * common` does not
    # depend on `common`, and autodiff of the ratio (scale_divide_p) says so exactly.
    out = []
    for x, scale in zip(xs, scales):
        cdtype = compute_dtype(x.dtype)
        if scale is common:  # already at the common scale
            out.append(x.data.astype(cdtype))
            continue
        factor = block_scales.expand_scale(block_scales.ratio(scale, common), x.shape).astype(
            cdtype
        )
        out.append(x.data.astype(cdtype) * factor)
    return out, common


def _common_scale_rule(primitive: Any) -> None:
    def rule(*operands: Any, **params: Any) -> Any:
        xs = [o for o in operands if isinstance(o, ScaledArray)]
        datas, common = _at_common_scale(xs)
        it = iter(datas)
        args = [next(it).astype(o.dtype) if isinstance(o, ScaledArray) else o for o in operands]
        return scaled(primitive.bind(*args, **params), common)

    registry.register_block_rule(primitive, rule)


for _prim in (
    lax.add_p,
    lax.sub_p,
    _compat.primitives.add_jaxvals_p,
    lax.max_p,
    lax.min_p,
):
    _common_scale_rule(_prim)


@registry.register_block_rule(lax.select_n_p)
def _select_n_blocks(which: Any, *cases: Any, **params: Any) -> Any:
    """A scalar predicate selects a whole case, blocks and all; otherwise each block of the
    cases at the largest of their scales."""
    whole = select_whole_cases(which, cases, **params)
    if whole is not None:
        return whole
    datas, common = _at_common_scale(list(cases))
    return scaled(
        lax.select_n_p.bind(which, *[d.astype(c.dtype) for d, c in zip(datas, cases)], **params),
        common,
    )


# Non-linear functions of one operand: computed on the value in float32, each block of
# the output at the power of two of its largest magnitude (one block reduction).


def _unary_value_rule(primitive: Any) -> None:
    def rule(x: ScaledArray, **params: Any) -> Any:
        layout = layout_of(x)
        cdtype = compute_dtype(x.dtype)
        scale = block_scales.expand_scale(jnp.asarray(x.scale, F32), x.shape).astype(cdtype)
        value = primitive.bind(x.data.astype(cdtype) * scale, **params)
        return dynamic_blocks(value, np.float32(1.0), layout, x.dtype)

    registry.register_block_rule(primitive, rule)


for _name in (
    "exp_p exp2_p log_p log1p_p expm1_p tanh_p logistic_p sqrt_p rsqrt_p cbrt_p sin_p cos_p "
    "erf_p integer_pow_p square_p"
).split():
    if hasattr(lax, _name):
        _unary_value_rule(getattr(lax, _name))
