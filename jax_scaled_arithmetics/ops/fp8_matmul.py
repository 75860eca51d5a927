"""FP8 and MX matmul recipes: scales finer than one per tensor, forward and backward.

Every matmul of a recipe, forward or backward, is ``a (M, K) @ b (K, N)`` computed as an
FP8 (or MX) unit computes it: both operands are quantised with scales taken **along the
contracting axis K** (so that a scale is constant over each sum and can be applied to the
float32 accumulator, or, for MX, per block), the quantised products are accumulated in
float32, and the scales are applied to the result. The three matmuls of a dense layer
``y = x @ w`` and the scale layouts (``x`` flattened to ``(M, K)``, ``M`` tokens):

============  =====================  ==========================  ==========================
matmul        contracting axis       left operand                right operand
============  =====================  ==========================  ==========================
y = x @ w     K (features)           x: one scale per token      w: one per output channel
dx = g @ wᵀ   N (output channels)    g: one per token            w: one per input feature
dw = xᵀ @ g   M (tokens)             x: one per input feature    g: one per output channel
============  =====================  ==========================  ==========================

``x`` and ``w`` are quantised to the forward format (E4M3) in all three, the output
gradient ``g`` to the backward format (E5M2); the backward pass re-quantises the saved
high-precision ``x`` and ``w`` along the new contracting axes (as the row-wise recipes of
FP8 training libraries do: a scale that varied along the sum could not be factored out).

- :func:`tensorwise_fp8_matmul`: one scale per operand and matmul (the baseline).
- :func:`rowwise_fp8_matmul`: one scale per row / column, the layouts above.
- :func:`mx_matmul`: OCP MX blocks of ``block_size`` elements along the contracting axis,
  E8M0 scales (``jsa.quantization.block_fake_quantize``). In the backward pass an axis that
  ``block_size`` does not divide (N, M) is zero-padded to whole blocks.

Power-of-two scales (row-wise and tensor-wise): the scale of a row whose largest magnitude
is ``amax`` is the smallest power of two ``s`` with ``amax / s <= format.max``, so the
largest element lands in ``(max / 2, max]``, and the cast saturates: finite inputs never
give inf or NaN. Scales lie in ``[2^-126, 2^127]`` (an all-zero row gets 1). MX scales
follow the OCP rule (``2^(floor(log2 amax) - emax)``), which may clip a block's largest
element to ``max``.

Row-wise and tensor-wise matmuls multiply the quantised operands as FP8 arrays (an FP8
``dot_general`` with a float32 result, which XLA runs as an FP8 GEMM on GPUs that have
one; formats without a JAX dtype are multiplied in float32); MX is simulated in float32
with ``jsa.quantization`` (bit-exact with the real casts). All recipes jit, vmap and
differentiate (a ``jax.custom_vjp``), accept float32, bfloat16 and
float16 inputs (output in ``x``'s dtype, gradients in their primal's), and run inside
``jsa.autoscale``; a ScaledArray argument outside it is handled by ``jsa.autoscale`` too.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax import lax

from ..core.datatype import ScaledArray
from ..core.interpreter import autoscale
from ..core.types import Array
from ..quantization import block_fake_quantize, float_quantize, get_format
from ..quantization.formats import FloatFormat
from ..quantization.mx_formats import SCALE_ROUNDINGS, ScaleRounding, mx_element_format

__all__ = ["mx_matmul", "rowwise_fp8_matmul", "tensorwise_fp8_matmul"]

_MIN_SCALE_EXP = -126
_MAX_SCALE_EXP = 126  # doubled once at most: 2^127


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """How the operands of each matmul are scaled (static, hashable)."""

    granularity: str  # "tensor", "row" or "mx"
    forward: FloatFormat
    backward: FloatFormat
    block_size: int = 0
    scale_rounding: str = "floor"  # MX block scales: "floor" (OCP) or "up"


def _pow2_scale(amax: Array, fmt: FloatFormat) -> Array:
    """The smallest power of two `s` with ``amax / s <= fmt.max`` (1 for zero / non-finite)."""
    _, exp = jnp.frexp(amax)  # amax = m * 2^exp, m in [1/2, 1)
    exp = jnp.clip(exp - 1 - fmt.max_exponent, _MIN_SCALE_EXP, _MAX_SCALE_EXP)
    scale = jnp.ldexp(jnp.ones_like(amax), exp)
    scale = jnp.where(amax / scale > fmt.max, scale * 2, scale)
    return jnp.where((amax > 0) & jnp.isfinite(amax), scale, jnp.ones_like(scale))


def _pow2_quantize(v: Array, fmt: FloatFormat, axis: int | None) -> tuple[Array, Array]:
    """`v` (float32, 2-D) quantised to `fmt` with one power-of-two scale per slice along
    `axis` (None: one for the tensor): ``(elements, scales)``, scales with kept dims."""
    amax = jnp.max(jnp.abs(v), axis=axis, keepdims=True)
    scale = _pow2_scale(amax, fmt)
    return float_quantize(v / scale, fmt, saturate=True), scale


def _dot(a: Array, b: Array) -> Array:
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _contract(recipe: _Recipe, a: Array, a_fmt: FloatFormat, b: Array, b_fmt: FloatFormat) -> Array:
    """``a (M, K) @ b (K, N)`` in float32, operands quantised along K as `recipe` says."""
    if recipe.granularity == "mx":
        # Fake-quantised in float32, no float8 intermediates: under jax.jit, dequantising
        # a float8 MXArray quantised from a constant misplaces elements (docs/design.md).
        rounding = cast(ScaleRounding, recipe.scale_rounding)
        qa = block_fake_quantize(
            a, a_fmt, recipe.block_size, axis=1, pad=True, scale_rounding=rounding
        )
        qb = block_fake_quantize(
            b, b_fmt, recipe.block_size, axis=0, pad=True, scale_rounding=rounding
        )
        return _dot(qa, qb)
    row = recipe.granularity == "row"
    qa, sa = _pow2_quantize(a, a_fmt, 1 if row else None)  # (M, 1) or (1, 1)
    qb, sb = _pow2_quantize(b, b_fmt, 0 if row else None)  # (1, N) or (1, 1)
    # A scale product beyond float32 is beyond it too.
    return _dot(_as_fp8(qa, a_fmt), _as_fp8(qb, b_fmt)) * (sa * sb)


def _as_fp8(q: Array, fmt: FloatFormat) -> Array:
    """`q` (float32 on `fmt`'s grid, saturated) in `fmt`'s FP8 dtype, where it is one: the
    cast is exact, and an FP8 `dot_general` with a float32 result is what XLA runs as an
    FP8 GEMM on GPUs (tests/lax/test_cuda_lowering.py). Other formats stay float32."""
    dtype = fmt.jax_dtype
    if dtype is None or not dtype.name.startswith("float8"):
        return q
    return q.astype(dtype)


# The recipe's computations are compiled once per recipe and shape (eager calls run one
# executable); the custom_vjp sits outside, so jit, vmap, grad and autoscale see it.
@functools.partial(jax.jit, static_argnums=0)
def _forward(recipe: _Recipe, x: Array, w: Array) -> Array:
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    y = _contract(recipe, x2, recipe.forward, w.astype(jnp.float32), recipe.forward)
    return y.reshape(*x.shape[:-1], w.shape[1]).astype(x.dtype)


@functools.partial(jax.jit, static_argnums=0)
def _backward(recipe: _Recipe, x: Array, w: Array, g: Array) -> tuple[Array, Array]:
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    g2 = g.reshape(-1, w.shape[1]).astype(jnp.float32)
    w32 = w.astype(jnp.float32)
    dx = _contract(recipe, g2, recipe.backward, w32.T, recipe.forward)
    dw = _contract(recipe, x2.T, recipe.forward, g2, recipe.backward)
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul(recipe: _Recipe, x: Array, w: Array) -> Array:
    return _forward(recipe, x, w)


def _matmul_fwd(recipe: _Recipe, x: Array, w: Array) -> tuple[Array, tuple[Array, Array]]:
    return _forward(recipe, x, w), (x, w)


def _matmul_bwd(recipe: _Recipe, residuals: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    return _backward(recipe, *residuals, g)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _float_format(name: str, argument: str, value: Any) -> FloatFormat:
    try:
        fmt = get_format(value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name}: unknown {argument} {value!r} ({e})") from None
    if not isinstance(fmt, FloatFormat) or fmt.unsigned or not fmt.has_zero:
        raise ValueError(
            f"{name}: {argument} must be a signed float format with a zero, got {fmt.name!r}"
        )
    return fmt


def _mx_format(name: str, argument: str, value: Any) -> FloatFormat:
    try:
        return mx_element_format(value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name}: unknown {argument} {value!r} ({e})") from None


def _check_operands(name: str, x: Any, w: Any, block_size: int = 0) -> None:
    for label, v in (("x", x), ("w", w)):
        dtype = getattr(v, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"{name}: {label} must be a floating array, got dtype {dtype}")
    if len(x.shape) < 1:
        raise ValueError(f"{name}: x must have at least one dimension (..., K), got a scalar")
    if len(w.shape) != 2:
        raise ValueError(f"{name}: w must have shape (K, N), got shape {tuple(w.shape)}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"{name}: mismatched shapes: x {tuple(x.shape)} has K={x.shape[-1]} but w "
            f"{tuple(w.shape)} has K={w.shape[0]}"
        )
    if block_size and x.shape[-1] % block_size:
        raise ValueError(
            f"{name}: block_size {block_size} does not divide the contracting dimension "
            f"K={x.shape[-1]}"
        )


def _call(recipe: _Recipe, x: Any, w: Any) -> Any:
    if isinstance(x, ScaledArray) or isinstance(w, ScaledArray):
        return autoscale(functools.partial(_matmul, recipe))(x, w)
    return _matmul(recipe, x, w)


def _as_operand(v: Any) -> Any:
    return v if isinstance(v, ScaledArray) else jnp.asarray(v)


def _float_recipe_matmul(
    name: str, layout: str, x: Any, w: Any, forward_format: Any, backward_format: Any
) -> Any:
    """The per-tensor or per-row FP8 recipe (`layout`) on checked operands."""
    recipe = _Recipe(
        layout,
        _float_format(name, "forward_format", forward_format),
        _float_format(name, "backward_format", backward_format),
    )
    x, w = _as_operand(x), _as_operand(w)
    _check_operands(name, x, w)
    return _call(recipe, x, w)


def tensorwise_fp8_matmul(
    x: Any,
    w: Any,
    *,
    forward_format: Any = "float8_e4m3fn",
    backward_format: Any = "float8_e5m2",
) -> Any:
    """``x @ w`` in FP8 with one power-of-two scale per operand of every matmul.

    The per-tensor baseline of :func:`rowwise_fp8_matmul` (same formats, casts and
    accumulation; see the module docstring).

    Args:
        x: Activations, shape ``(..., K)``.
        w: Weights, shape ``(K, N)``.
        forward_format: Format of ``x`` and ``w`` in all three matmuls.
        backward_format: Format of the output gradient.

    Returns ``(..., N)`` in ``x``'s dtype; raises as :func:`rowwise_fp8_matmul`.

    Examples:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([[1000.0, 2000.0], [0.001, 0.003]])
        >>> tensorwise_fp8_matmul(x, jnp.eye(2))  # the small row is below E4M3's range
        Array([[1024., 2048.],
               [   0.,    0.]], dtype=float32)
    """
    return _float_recipe_matmul(
        "tensorwise_fp8_matmul", "tensor", x, w, forward_format, backward_format
    )


def rowwise_fp8_matmul(
    x: Any,
    w: Any,
    *,
    forward_format: Any = "float8_e4m3fn",
    backward_format: Any = "float8_e5m2",
) -> Any:
    """``x @ w`` in FP8 with per-token activation and per-channel weight scales.

    Forward: each row of ``x`` (a token, over K) and each column of ``w`` (an output
    channel, over K) gets the smallest power-of-two scale that fits its largest magnitude
    in `forward_format`; the quantised operands are multiplied with float32 accumulation
    and the result multiplied by the outer product of the row and column scales. Backward
    (a ``jax.custom_vjp``): ``dx = g @ wᵀ`` with ``g`` per token in `backward_format` and
    ``w`` per input feature (over N); ``dw = xᵀ @ g`` with ``x`` per input feature and
    ``g`` per output channel (both over the tokens). See the module docstring.

    Args:
        x: Activations, shape ``(..., K)`` (float32, bfloat16 or float16; or a ScaledArray).
        w: Weights, shape ``(K, N)``.
        forward_format: Format of ``x`` and ``w`` (any signed ``jsa.quantization`` float
            format; E4M3 by default).
        backward_format: Format of the output gradient (E5M2 by default).

    Returns:
        ``(..., N)`` in ``x``'s dtype.

    Raises:
        ValueError: mismatched shapes, non-floating inputs or an unknown format.

    Examples:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([[1000.0, 2000.0], [0.001, 0.003]])
        >>> rowwise_fp8_matmul(x, jnp.eye(2))  # each row scaled into E4M3's range
        Array([[1.0240000e+03, 2.0480000e+03],
               [9.7656250e-04, 2.9296875e-03]], dtype=float32)
    """
    return _float_recipe_matmul("rowwise_fp8_matmul", "row", x, w, forward_format, backward_format)


def mx_matmul(
    x: Any,
    w: Any,
    *,
    format: Any = "mxfp8_e4m3",
    block_size: int = 32,
    backward_format: Any = "mxfp8_e5m2",
    scale_rounding: str = "floor",
) -> Any:
    """``x @ w`` with OCP MX block scaling along the contracting axis, float32 accumulation.

    ``x`` is quantised in blocks of ``1 x block_size`` along K, ``w`` in blocks of
    ``block_size x 1`` along K, each block with an E8M0 scale
    (``jsa.quantization.block_fake_quantize``: OCP MX v1.0 scales, round to nearest,
    saturating elements). Backward (a ``jax.custom_vjp``): ``dx = g @ wᵀ`` with ``g``
    (in `backward_format`) and ``w`` in blocks along N, ``dw = xᵀ @ g`` with ``x`` and
    ``g`` (in `backward_format`) in blocks along the tokens; those axes are zero-padded
    to whole blocks when `block_size` does not divide them.

    Args:
        x: Activations, shape ``(..., K)``; `block_size` must divide K.
        w: Weights, shape ``(K, N)``.
        format: MX format of ``x`` and ``w``: ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``,
            ``"mxfp6_e2m3"``, ``"mxfp6_e3m2"``, ``"mxfp4_e2m1"`` (see
            ``jsa.quantization.MX_FORMATS``) or an element format name.
        block_size: Elements per scale (32 in the MX specification).
        backward_format: MX format of the output gradient.
        scale_rounding: Block scales ``"floor"`` (OCP MX v1.0) or ``"up"``, the smallest
            power of two at which a block's largest magnitude fits (no saturation; the
            fix for MX training divergence of Mishra et al. 2025).

    Returns:
        ``(..., N)`` in ``x``'s dtype.

    Raises:
        ValueError: mismatched shapes, a `block_size` that does not divide K, an invalid
            `block_size`, non-floating inputs or an unknown format.

    Examples:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([[1.0, 2.0, 3.0, 5.0], [0.001, 0.002, 0.003, 0.004]])
        >>> mx_matmul(x, jnp.ones((4, 1)), format="mxfp4_e2m1", block_size=2)  # 5 -> 4
        Array([[1.000000e+01],
               [9.765625e-03]], dtype=float32)
    """
    name = "mx_matmul"
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{name}: block_size must be a positive integer, got {block_size!r}")
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(
            f"{name}: scale_rounding must be one of {SCALE_ROUNDINGS}, got {scale_rounding!r}"
        )
    recipe = _Recipe(
        "mx",
        _mx_format(name, "format", format),
        _mx_format(name, "backward_format", backward_format),
        block_size,
        scale_rounding,
    )
    x, w = _as_operand(x), _as_operand(w)
    _check_operands(name, x, w, block_size)
    return _call(recipe, x, w)
