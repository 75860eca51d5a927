"""Scaled rules for dot_general and convolutions.

The data is contracted (low-precision data accumulated in float32, unless
`preferred_element_type` says otherwise) and the output scale is
`lhs.scale * rhs.scale * t`, the data being the accumulator divided by `t`:

- `ScalePolicy.DYNAMIC` (default): the output scale is the power of two of the
  output value's largest finite magnitude (one reduction over the output, the value
  formed in float32 as plain float32 forms it), so the output data's largest
  magnitude is in [1, 2) whatever the inputs were;
- `ScalePolicy.STATIC`: the unit-scaling rule `t = pow2(sqrt(K))`, K the number of
  products summed into each output element, fixed at trace time.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import _compat, registry
from ..core.config import ScalePolicy, get_autoscale_config
from ..core.datatype import ScaledArray
from ..core.pow2 import static_pow2
from .base import contraction_dtype
from .scale_algebra import represent, represent_dynamic


def fan_in_factor(fan_in: int) -> float:
    """sqrt(fan_in) rounded to a power of two (a static Python float)."""
    return static_pow2(float(np.sqrt(max(fan_in, 1))))


def _accumulator_dtype(out_dtype: Any, preferred: Any) -> Any:
    """float32 for outputs narrower than float32 (the data is then divided by the output
    scale factor before its cast, so a sum beyond the narrow format's range still fits)."""
    if jnp.issubdtype(out_dtype, jnp.floating) and jnp.dtype(out_dtype).itemsize < 4:
        return jnp.float32
    return preferred


def represent_accumulation(acc: Any, factors: Any, dtype: Any, fan_in: int) -> ScaledArray:
    """The output of a sum or contraction of `fan_in` terms: `acc * prod(factors)`, with the
    configured policy's output scale (see the module docstring)."""
    if get_autoscale_config().policy == ScalePolicy.STATIC:
        return represent(acc, factors, dtype, extra=float(fan_in_factor(fan_in)))
    return represent_dynamic(acc, factors, dtype, delayable=True)


def _scaled_contraction(
    primitive: Any,
    lhs: ScaledArray,
    rhs: ScaledArray,
    fan_in: int,
    params: dict,
    *others: Any,
) -> ScaledArray:
    preferred = params.get("preferred_element_type")
    out_dtype = contraction_dtype(primitive, params, lhs, rhs, *others)
    acc_dtype = _accumulator_dtype(out_dtype, preferred)
    bind_params = dict(params, preferred_element_type=acc_dtype)
    ldata, rdata = _compat.accumulation_operands(lhs.data, rhs.data, acc_dtype)
    acc = primitive.bind(ldata, rdata, *others, **bind_params)
    return represent_accumulation(acc, [(lhs.scale, 1), (rhs.scale, 1)], out_dtype, fan_in)


@registry.register_scaled_op(
    lax.dot_general_p,
    family="dot",
    remark="scale sa * sb * t (t dynamic, or sqrt(K)), any dimension numbers",
)
def scaled_dot_general(lhs: ScaledArray, rhs: ScaledArray, **params: Any) -> ScaledArray:
    """K is the product of the lhs contracting dimensions (batch dimensions excluded)."""
    (lhs_contract, _), _ = params["dimension_numbers"]
    fan_in = int(np.prod([lhs.shape[d] for d in lhs_contract], dtype=np.int64))
    return _scaled_contraction(lax.dot_general_p, lhs, rhs, fan_in, params)


@registry.register_scaled_op(
    lax.conv_general_dilated_p,
    family="dot",
    remark="scale sa * sb * t (t dynamic, or sqrt(K)), K from the kernel layout",
)
def scaled_conv_general_dilated(lhs: ScaledArray, rhs: ScaledArray, **params: Any) -> ScaledArray:
    """K is read from the kernel (rhs) layout, whatever the dimension numbers.

    The kernel's input-feature dimension already holds the features of one group
    (feature_group_count) and all features with batch_group_count, so K is the
    number of products summed per output element for any convolution, including
    the transposed ones that appear in gradients (where the "kernel" is the
    cotangent or the input). Padding and dilation only skip some of them.
    """
    dnums = params.get("dimension_numbers")
    rhs_spec = tuple(range(rhs.ndim)) if dnums is None else tuple(dnums.rhs_spec)
    fan_in = int(np.prod([rhs.shape[d] for d in rhs_spec[1:]], dtype=np.int64))
    return _scaled_contraction(lax.conv_general_dilated_p, lhs, rhs, fan_in, params)


def _ragged_dot_general_p() -> Any:
    """The primitive of `lax.ragged_dot` (not exported by jax.lax), read from its jaxpr."""
    f32, i32 = jnp.float32, jnp.int32
    avals = (((2, 2), f32), ((1, 2, 2), f32), ((1,), i32))
    jaxpr = jax.make_jaxpr(lax.ragged_dot)(*(jax.ShapeDtypeStruct(s, d) for s, d in avals))
    return next(e.primitive for e in jaxpr.eqns if e.primitive.name == "ragged_dot_general")


ragged_dot_general_p = _ragged_dot_general_p()


@registry.register_scaled_op(
    ragged_dot_general_p,
    family="dot",
    remark="scale sa * sb * t (t dynamic, or sqrt(K)), group sizes plain",
)
def scaled_ragged_dot_general(
    lhs: ScaledArray, rhs: ScaledArray, group_sizes: Any, **params: Any
) -> ScaledArray:
    """K: the lhs contracting dimensions (a ragged contracting dimension counted whole)."""
    (lhs_contract, _), _ = params["ragged_dot_dimension_numbers"].dot_dimension_numbers
    fan_in = int(np.prod([lhs.shape[d] for d in lhs_contract], dtype=np.int64))
    return _scaled_contraction(ragged_dot_general_p, lhs, rhs, fan_in, params, group_sizes)


def _data_and_scale(x: Any) -> tuple[Any, Any]:
    """A ScaledArray's data and scale; a plain array and scale 1 (left as it is)."""
    if isinstance(x, ScaledArray):
        return x.data, x.scale
    return x, np.float32(1.0)


def _block_scaled_contraction(
    primitive: Any, operands: tuple[Any, ...], fan_in: int, params: dict
) -> ScaledArray | list[ScaledArray]:
    """A block-scaled contraction (`lhs`, `rhs` and their block scales, linear in each) on
    the data: a scaled operand's scale factors out, plain operands are bound as they are.
    Accumulated in float32 when the output is narrower; one output, or a list of one."""
    out_dtype = np.dtype(params["preferred_element_type"])
    acc_dtype = np.dtype(_accumulator_dtype(out_dtype, out_dtype))
    datas, scales = zip(*(_data_and_scale(x) for x in operands))
    acc = primitive.bind(*datas, **dict(params, preferred_element_type=acc_dtype))
    if primitive.multiple_results:
        return [represent_accumulation(acc[0], [(s, 1) for s in scales], out_dtype, fan_in)]
    return represent_accumulation(acc, [(s, 1) for s in scales], out_dtype, fan_in)


@registry.register_scaled_op(
    _compat.primitives.scaled_dot_p,
    promote=False,
    family="dot",
    remark="on the data, plain operands (e8m0 block scales) as they are: scale the product "
    "of the operands' scales times t (t dynamic, or sqrt(K))",
)
def scaled_scaled_dot(lhs: Any, rhs: Any, lhs_scale: Any, rhs_scale: Any, **params: Any) -> Any:
    """`jax.lax.scaled_dot` (XLA's block-scaled dot: `(lhs * lhs_scale) @ (rhs *
    rhs_scale)`, each block scale repeated over its sub-channel) is linear in each of its
    four operands, so a scaled operand's scale factors out: the op runs on the data (FP8 or
    FP4 data and e8m0 block scales stay in their formats, for the kernels that take them;
    plain operands are not promoted), accumulated in float32 when the output is narrower.
    K is the product of the lhs contracting dimensions."""
    (lhs_contract, _), _ = params["dimension_numbers"]
    fan_in = int(np.prod([lhs.shape[d] for d in lhs_contract], dtype=np.int64))
    return _block_scaled_contraction(
        _compat.primitives.scaled_dot_p, (lhs, rhs, lhs_scale, rhs_scale), fan_in, params
    )


def _register_cudnn_scaled_matmul(primitive: Any) -> None:
    @registry.register_scaled_op(
        primitive,
        promote=False,
        family="dot",
        remark="jax.nn.scaled_matmul on the data, plain operands (block scales) as they are: "
        "scale the product of the operands' scales times t (t dynamic, or sqrt(K))",
    )
    def scaled_cudnn_scaled_matmul(
        lhs: Any, rhs: Any, lhs_scales: Any, rhs_scales: Any, **params: Any
    ) -> Any:
        """`(B, M, K) x (B, N, K)` with `(B, M, K / block)` and `(B, N, K / block)` block
        scales (cuDNN's block-scaled matmul on GPUs, XLA's lowering elsewhere), linear in
        each operand as `scaled_dot` is. K is the last lhs dimension."""
        operands = (lhs, rhs, lhs_scales, rhs_scales)
        return _block_scaled_contraction(primitive, operands, int(lhs.shape[-1]), params)


for _primitive in _compat.cudnn_scaled_matmul_primitives()[:1]:  # the one a jaxpr holds
    _register_cudnn_scaled_matmul(_primitive)
