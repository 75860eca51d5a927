"""`simulate_fp8`: run a function with its matmuls' operands in FP8 and their gradients in FP8."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp

from ..core import _compat
from ..core.rewrite import MATMULS, contains_matmul, rewrite_call
from ..core.walker import Frame, JaxprWalker, declare_rewrap, own_rewrap
from ..quantization import get_format
from .casts import reduce_precision_on_backward, reduce_precision_on_forward
from .dynamic_rescaling import dynamic_rescale_max, dynamic_rescale_max_grad

__all__ = ["simulate_fp8"]


ScaleLayout = str | int
"""`"tensor"`, `"axis"`, or an int block size (see :func:`simulate_fp8`)."""


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _check_layout(scale_layout: Any, rescale: bool) -> ScaleLayout:
    if isinstance(scale_layout, str):
        if scale_layout not in ("tensor", "axis"):
            raise ValueError(
                f"scale_layout must be 'tensor', 'axis' or a block size, got {scale_layout!r}."
            )
    elif isinstance(scale_layout, bool) or not isinstance(scale_layout, int):
        raise ValueError(
            f"scale_layout must be 'tensor', 'axis' or a block size, got {scale_layout!r}."
        )
    elif scale_layout < 1:
        raise ValueError(f"scale_layout: a block size must be at least 1, got {scale_layout}.")
    if scale_layout != "tensor" and not rescale:
        raise ValueError(
            f"scale_layout={scale_layout!r} chooses the block scales of the dynamic rescaling; "
            f"it needs rescale=True."
        )
    return scale_layout


def _blocks_along(size: int, block: int) -> int:
    """The number of scales along an axis of `size` cut in blocks of `block` (one when
    `block` does not divide it)."""
    return size // block if size % block == 0 else 1


def _operand_scale_shape(
    shape: Sequence[int], contracting: Sequence[int], scale_layout: ScaleLayout
) -> tuple[int, ...] | None:
    """The scale shape of a `dot_general` operand of `shape` contracted over `contracting`:
    None per tensor; `"axis"`: one scale per element of the other axes and one along the
    contracting ones; an int `b`: blocks of `b` along the last contracting axis, one scale
    per element of every other axis."""
    if scale_layout == "tensor":
        return None
    contracting = [a % len(shape) for a in contracting]
    out = [1 if a in contracting else int(n) for a, n in enumerate(shape)]
    if not isinstance(scale_layout, str) and contracting:
        last = max(contracting)
        for a in contracting:
            out[a] = _blocks_along(int(shape[a]), scale_layout) if a == last else int(shape[a])
    return tuple(out)


def _gradient_scale_shape(
    shape: Sequence[int], scale_layout: ScaleLayout
) -> tuple[int, ...] | None:
    """The scale shape of a matmul's output gradient of `shape`: None per tensor; `"axis"`:
    one scale per element of every axis but the last; an int `b`: blocks of `b` along the
    last axis, one scale per element of the others."""
    if scale_layout == "tensor" or len(shape) == 0:
        return None
    last = 1 if isinstance(scale_layout, str) else _blocks_along(int(shape[-1]), scale_layout)
    return tuple(int(n) for n in shape[:-1]) + (last,)


class _Fp8Rewriter(JaxprWalker):
    """`simulate_fp8`'s walk: a matmul (or a custom-derivative function containing one)
    gets its operands cast to the forward format and its output's gradient to the backward
    format; every other equation is kept (bodies of jit, scan, while, cond walked too)."""

    def __init__(
        self,
        forward_format: Any,
        backward_format: Any,
        saturate: bool,
        rescale: bool,
        scale_layout: ScaleLayout = "tensor",
    ):
        self.forward_format = forward_format
        self.backward_format = backward_format
        self.saturate = saturate
        self.rescale = rescale
        self.scale_layout = scale_layout

    def operand(self, x: Any, contracting: Sequence[int] | None = None) -> Any:
        if not _is_float(x):
            return x
        if self.rescale:
            layout = "tensor" if contracting is None else self.scale_layout
            x = dynamic_rescale_max(
                x, scale_shape=_operand_scale_shape(jnp.shape(x), contracting or (), layout)
            )
        return reduce_precision_on_forward(x, self.forward_format, saturate=self.saturate)

    def result(self, y: Any, blocked: bool = False) -> Any:
        if not _is_float(y):
            return y
        y = reduce_precision_on_backward(y, self.backward_format, saturate=self.saturate)
        if self.rescale:  # applied first on the way back: the gradient is rescaled, then cast
            layout = self.scale_layout if blocked else "tensor"
            y = dynamic_rescale_max_grad(y, scale_shape=_gradient_scale_shape(jnp.shape(y), layout))
        return y

    def eval_eqn(self, eqn: Any, invals: list[Any], frame: Frame) -> list[Any]:
        prim = eqn.primitive
        is_matmul = prim.name in MATMULS
        if not is_matmul and prim in (_compat.custom_jvp_call_p, _compat.custom_vjp_call_p):
            # A function with its own derivative rule that multiplies matrices (an attention
            # kernel, a unit-scaled matmul): its operands and gradients are cast at its
            # boundary, and its rule is kept.
            is_matmul = contains_matmul(eqn.params["call_jaxpr"].jaxpr)
        if not is_matmul:
            return self.eval_higher_order(eqn, invals, frame.context)
        subfuns, bind_params = _compat.get_bind_params(eqn)
        if prim.name == "dot_general":  # block scales follow the dimension numbers
            (lhs_contracting, rhs_contracting), _ = eqn.params["dimension_numbers"]
            lhs, rhs = invals
            operands = [self.operand(lhs, lhs_contracting), self.operand(rhs, rhs_contracting)]
        else:  # convolutions and custom-derivative functions: per tensor
            operands = [self.operand(v) for v in invals]
        blocked = prim.name == "dot_general"
        outs = prim.bind(*subfuns, *operands, **bind_params)
        outs = list(outs) if prim.multiple_results else [outs]
        return [self.result(v, blocked) for v in outs]


def simulate_fp8(
    fn: Callable[..., Any],
    *,
    forward_format: Any = "float8_e4m3fn",
    backward_format: Any = "float8_e5m2",
    saturate: bool = True,
    rescale: bool = False,
    scale_layout: ScaleLayout = "tensor",
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

    `scale_layout` (with `rescale=True` only; a ValueError otherwise) chooses how many powers
    of two that rescaling uses, for each `dot_general`:

    - `"tensor"` (the default): one per operand and one per output gradient.
    - `"axis"`: one per element of each operand's batch and free axes, one along its
      contracting axes (`x @ w`: one per row of `x`, one per output channel of `w`); the
      output gradient one per element of all its axes but the last (one per row).
    - an int `b` (MX-style, e.g. 32): blocks of `b` along each operand's last contracting
      axis and one per element of its other axes (`x @ w`: `x` in `(M, K // b)` blocks,
      `w` in `(K // b, N)`); the output gradient in blocks of `b` along its last axis. An
      axis that `b` does not divide gets one block along it.

    Under `jsa.autoscale` the block scales are kept through the FP8 rounding (it acts on
    each block's data at its own scale) and into the product. Convolutions and
    custom-derivative functions containing a matmul are rescaled per tensor whatever the
    layout.

    Nests with `jax.jit`, `jax.vmap`, `jsa.autoscale` and `unit_scale` in either order, and
    with `jax.grad` outside: `jax.grad(simulate_fp8(f))`. A function whose program computes
    a gradient (`simulate_fp8(jax.grad(f))`, a training step, `jax.vjp`) raises a
    ValueError saying to write `jax.grad(simulate_fp8(f))`: its traced program no longer
    says which matmuls are the backward pass's.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> f = jsa.ops.simulate_fp8(lambda x, w: x @ w)
        >>> f(jnp.array([[1.1, 3.3]]), jnp.ones((2, 1)))  # 1.1 -> 1.125, 3.3 -> 3.25 in E4M3
        Array([[4.375]], dtype=float32)
    """
    if not callable(fn):
        raise TypeError(f"simulate_fp8 expects a callable, got {type(fn).__name__}.")
    forward = get_format(forward_format)
    backward = get_format(backward_format)
    layout = _check_layout(scale_layout, bool(rescale))
    rewriter = _Fp8Rewriter(forward, backward, bool(saturate), bool(rescale), layout)
    options = dict(
        forward_format=forward_format,
        backward_format=backward_format,
        saturate=saturate,
        rescale=rescale,
        scale_layout=scale_layout,
    )
    autoscaled = own_rewrap(fn)
    if autoscaled is not None:  # simulate_fp8(autoscale(f)) is autoscale(simulate_fp8(f))
        inner, rewrap = autoscaled
        return rewrap(simulate_fp8(inner, **options))  # type: ignore[arg-type]

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return rewrite_call("simulate_fp8", fn, rewriter, args, kwargs)

    # `unit_scale(simulate_fp8(f))` is `simulate_fp8(unit_scale(f))`.
    return declare_rewrap(wrapped, fn, lambda g: simulate_fp8(g, **options))
