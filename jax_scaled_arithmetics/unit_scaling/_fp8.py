"""`simulate_fp8`: run a function with its matmuls' operands in FP8 and their gradients in FP8."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..core import _compat
from ..ops.casts import reduce_precision_on_backward, reduce_precision_on_forward
from ..ops.rescaling import dynamic_rescale_max, dynamic_rescale_max_grad
from ..quantization import get_format
from ._rewrite import MATMULS, REWRAP, JaxprRewriter, contains_matmul, trace_flat

__all__ = ["simulate_fp8"]


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


class _Fp8Rewriter(JaxprRewriter):
    def __init__(self, forward_format: Any, backward_format: Any, saturate: bool, rescale: bool):
        self.forward_format = forward_format
        self.backward_format = backward_format
        self.saturate = saturate
        self.rescale = rescale

    def operand(self, x: Any) -> Any:
        if not _is_float(x):
            return x
        if self.rescale:
            x = dynamic_rescale_max(x)
        return reduce_precision_on_forward(x, self.forward_format, saturate=self.saturate)

    def result(self, y: Any) -> Any:
        if not _is_float(y):
            return y
        y = reduce_precision_on_backward(y, self.backward_format, saturate=self.saturate)
        if self.rescale:  # applied first on the way back: the gradient is rescaled, then cast
            y = dynamic_rescale_max_grad(y)
        return y

    def rewrite_eqn(
        self, eqn: Any, index: int, invals: list[Any], context: Any
    ) -> list[Any] | None:
        prim = eqn.primitive
        is_matmul = prim.name in MATMULS
        if not is_matmul and prim in (_compat.custom_jvp_call_p, _compat.custom_vjp_call_p):
            # A function with its own derivative rule that multiplies matrices (an attention
            # kernel, a unit-scaled matmul): its operands and gradients are cast at its
            # boundary, and its rule is kept.
            is_matmul = contains_matmul(eqn.params["call_jaxpr"].jaxpr)
        if not is_matmul:
            return None
        subfuns, bind_params = _compat.get_bind_params(eqn)
        outs = prim.bind(*subfuns, *[self.operand(v) for v in invals], **bind_params)
        outs = list(outs) if prim.multiple_results else [outs]
        return [self.result(v) for v in outs]


def simulate_fp8(
    fn: Callable[..., Any],
    *,
    forward_format: Any = "float8_e4m3fn",
    backward_format: Any = "float8_e5m2",
    saturate: bool = True,
    rescale: bool = False,
) -> Callable[..., Any]:
    """`fn` with the operands of its matmuls in FP8 and the gradients of their outputs in FP8.

    Every `dot_general` and `conv_general_dilated` of `fn` (and every custom-derivative
    function containing one, such as an attention kernel or a unit-scaled matmul, at its
    boundary) gets its floating operands rounded to `forward_format` (E4M3 by default) on the
    forward pass, and the gradient of its output rounded to `backward_format` (E5M2) on the
    backward pass, through `jsa.quantization` (simulation: dtypes are kept). The formats'
    largest values clamp overflow when `saturate` (the default; otherwise overflow gives
    inf/NaN). With `rescale=True`, values are first brought to the format's range with
    `jsa.ops.dynamic_rescale_max` (forward) and `dynamic_rescale_max_grad` (backward): under
    `jsa.autoscale` this moves a power of two into the scale; on plain arrays it does nothing.

    Nests with `jax.jit`, `jax.grad`, `jax.vmap`, `jsa.autoscale` and `unit_scale`. Apply
    `jax.grad` outside: the function is traced as given, so `simulate_fp8(jax.grad(f))` casts
    the matmuls of the gradient program as forward matmuls.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> f = U.simulate_fp8(lambda x, w: x @ w)
        >>> f(jnp.array([[1.1, 3.3]]), jnp.ones((2, 1)))  # 1.1 -> 1.125, 3.3 -> 3.25 in E4M3
        Array([[4.375]], dtype=float32)
    """
    if not callable(fn):
        raise TypeError(f"simulate_fp8 expects a callable, got {type(fn).__name__}.")
    forward = get_format(forward_format)
    backward = get_format(backward_format)
    rewriter = _Fp8Rewriter(forward, backward, bool(saturate), bool(rescale))
    options = dict(
        forward_format=forward_format,
        backward_format=backward_format,
        saturate=saturate,
        rescale=rescale,
    )
    autoscaled = getattr(fn, REWRAP, None)
    if autoscaled is not None:  # simulate_fp8(autoscale(f)) is autoscale(simulate_fp8(f))
        inner, rewrap = autoscaled
        return rewrap(simulate_fp8(inner, **options))  # type: ignore[arg-type]

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        closed, leaves, out_tree = trace_flat(fn, args, kwargs)
        outs = rewriter.run_closed(closed, leaves)
        return jax.tree_util.tree_unflatten(out_tree, outs)

    # `unit_scale(simulate_fp8(f))` is `simulate_fp8(unit_scale(f))`.
    wrapped.__jsa_rewrap__ = (fn, lambda g: simulate_fp8(g, **options))  # type: ignore[attr-defined]
    return wrapped
