"""Unit-scaled contractions: `dot_general`, `matmul`, `linear`, `linear_readout`,
`conv1d`, `conv2d`.

The factors are closed forms in the shapes: each is a count of products (contracted
terms for the output, outputs an element enters for its gradient) to a power, 1/sqrt by
default. Conventions shared by all ops (constraints, `vmap`) in `_ops_common`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.types import Array
from ._fwd_bwd import Constraint, apply_constraint, check_constraint, scaled_call
from ._ops_common import broadcast_vector as _broadcast_vector
from ._ops_common import int_tuple as _int_tuple
from ._ops_common import inv_sqrt as _inv_sqrt
from ._ops_common import normalize_dims as _dims
from ._ops_common import shape_of as _shape
from ._ops_common import size as _size
from ._ops_common import static_number as _static_number

__all__ = [
    "conv1d",
    "conv2d",
    "dot_general",
    "dot_general_factors",
    "dot_general_with_rows",
    "linear",
    "linear_readout",
    "matmul",
]


def _inv_pow(count: float, power: float) -> float:
    """count^(-power); 1.0 for an empty sum (count 0)."""
    return float(count) ** -power if count > 0 else 1.0


def _scale_power(value: Any) -> tuple[float, float, float]:
    """Check `scale_power`: three finite numbers (output, input grad, weight/bias grad)."""
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise ValueError(
            f"scale_power must be three numbers (output, input grad, weight grad), got {value!r}."
        )
    powers = tuple(_static_number(p, "each scale_power") for p in value)
    if not all(math.isfinite(p) for p in powers):
        raise ValueError(f"scale_power must be finite, got {value!r}.")
    return powers[0], powers[1], powers[2]


def _check_bias(bias: Array | None, features: int) -> None:
    if bias is not None and _shape(bias) != (features,):
        raise ValueError(f"bias must have shape {(features,)}, got {_shape(bias)}.")


def _with_bias(f: Callable[[Array, Array], Array]) -> Callable[[Array, Array, Array], Array]:
    """`f(a, b) + bias`, the bias (a vector) broadcast over the output's last axis."""

    def biased(a: Array, b: Array, bias: Array) -> Array:
        y = f(a, b)
        return y + _broadcast_vector(bias, y.shape, (y.ndim - 1,))

    return biased


def dot_general_factors(
    lhs_shape: Sequence[int],
    rhs_shape: Sequence[int],
    dimension_numbers: Any,
    constraint: Constraint = "to_output_scale",
    constrain_rhs: bool = False,
    *,
    lhs_grad_rows: int = 1,
    rhs_grad_rows: int = 1,
) -> tuple[float, float, float]:
    """`(output, lhs grad, rhs grad)` factors of `dot_general` for these shapes.

    Output: a sum of K = prod(contracting dims) unit products, so 1/sqrt(K). Gradient of
    `lhs`: a sum over the free dims of `rhs`; gradient of `rhs`: over the free dims of `lhs`.
    `lhs_grad_rows`/`rhs_grad_rows` multiply those counts by rows the shapes do not show
    (the examples of an enclosing `jax.vmap` that maps the other operand and not this one).
    """
    check_constraint(constraint)
    (lc, rc), (lb, rb) = dimension_numbers
    lc, lb = _dims(lc, len(lhs_shape), "lhs"), _dims(lb, len(lhs_shape), "lhs")
    rc, rb = _dims(rc, len(rhs_shape), "rhs"), _dims(rb, len(rhs_shape), "rhs")
    lhs_free = [d for i, d in enumerate(lhs_shape) if i not in lc + lb]
    rhs_free = [d for i, d in enumerate(rhs_shape) if i not in rc + rb]
    fwd = _inv_sqrt(_size([lhs_shape[i] for i in lc]))
    lhs_bwd = _inv_sqrt(_size(rhs_free) * lhs_grad_rows)
    rhs_bwd = _inv_sqrt(_size(lhs_free) * rhs_grad_rows)
    if constrain_rhs:
        fwd, (lhs_bwd, rhs_bwd) = apply_constraint(constraint, fwd, lhs_bwd, rhs_bwd)
    else:
        fwd, (lhs_bwd,) = apply_constraint(constraint, fwd, lhs_bwd)
    return fwd, lhs_bwd, rhs_bwd


def dot_general(
    lhs: Array,
    rhs: Array,
    dimension_numbers: Any,
    *,
    constraint: Constraint = "to_output_scale",
    constrain_rhs: bool = False,
    **params: Any,
) -> Array:
    """Unit-scaled `jax.lax.dot_general`: exactly `lax.dot_general` times a factor.

    Forward factor 1/sqrt(prod(contracting dims)); `lhs` grad factor 1/sqrt(prod(free dims
    of `rhs`)); `rhs` grad factor 1/sqrt(prod(free dims of `lhs`)); free = neither
    contracting nor batch. Batch dims enter no factor.

    By default (`constraint="to_output_scale"`) the `lhs` grad factor is the output's,
    1/sqrt(K): the output is unit, and the `lhs` gradient has std sqrt(N/K) (K the
    contracting size, N the free size of `rhs`).

    Args:
        lhs: the activation: its grad factor is tied to the output factor by `constraint`.
        rhs: the weight: its grad factor is never tied, unless `constrain_rhs`.
        dimension_numbers: as for `jax.lax.dot_general` (batch dims allowed).
        constraint: see `Constraint`; the default "to_output_scale" gives the `lhs` grad
            (with `constrain_rhs`, the `rhs` one too) the output factor; "gmean" ties them
            to their geometric mean; None leaves every factor unit.
        constrain_rhs: tie `rhs`'s grad factor too (a product of two activations, as in
            attention's `q @ k^T` and `weights @ v`).
        **params: forwarded to `jax.lax.dot_general` (precision, preferred_element_type,
            out_sharding).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (256, 512))
        >>> w = jax.random.normal(jax.random.key(1), (512, 512))
        >>> y = U.dot_general(x, w, (((1,), (0,)), ((), ())))
        >>> round(float(y.std()), 1)
        1.0
    """
    return dot_general_with_rows(
        lhs, rhs, dimension_numbers, constraint=constraint, constrain_rhs=constrain_rhs, **params
    )


def dot_general_with_rows(
    lhs: Array,
    rhs: Array,
    dimension_numbers: Any,
    *,
    constraint: Constraint = "to_output_scale",
    constrain_rhs: bool = False,
    lhs_grad_rows: int = 1,
    rhs_grad_rows: int = 1,
    **params: Any,
) -> Array:
    """:func:`dot_general` with the extra gradient rows of :func:`dot_general_factors`."""
    fwd, lhs_bwd, rhs_bwd = dot_general_factors(
        _shape(lhs),
        _shape(rhs),
        dimension_numbers,
        constraint,
        constrain_rhs,
        lhs_grad_rows=lhs_grad_rows,
        rhs_grad_rows=rhs_grad_rows,
    )
    f = functools.partial(lax.dot_general, dimension_numbers=dimension_numbers, **params)
    return scaled_call(f, fwd, (lhs, rhs), (lhs_bwd, rhs_bwd))


def _contraction(
    f: Callable[[Array, Array], Array],
    a: Array,
    b: Array,
    products: Callable[[tuple[int, ...]], float],
    constraint: Constraint,
    constrain_b: bool,
    powers: tuple[float, float, float] = (0.5, 0.5, 0.5),
    bias: Array | None = None,
) -> Array:
    """`f(a, b)`, a bilinear contraction forming `products(out_shape)` products, unit-scaled.

    With P products in all, an output is on average a sum of P / out.size of them, and the
    gradient of an element of `a` a sum of P / a.size (likewise for `b`): each factor is
    that count to the power minus `powers[i]` (one over its square root by default; for a
    matmul, K, N and M).

    A `bias` (a vector over the output's last axis) enters the scaled product: the result
    is `fwd * (f(a, b) + bias)`. Its gradient, a sum over the rows (`out.size / out.shape[-1]`),
    gets `b`'s power of that count (`b`'s factor for a linear layer or a convolution).
    """
    check_constraint(constraint)
    spec = lambda x: jax.ShapeDtypeStruct(_shape(x), jnp.result_type(x))
    out_shape = tuple(jax.eval_shape(f, spec(a), spec(b)).shape)
    total = products(out_shape)
    per = lambda shape: total / max(_size(shape), 1)
    fwd, a_bwd, b_bwd = (
        _inv_pow(per(s), p) for s, p in zip((out_shape, _shape(a), _shape(b)), powers)
    )
    if constrain_b:
        fwd, (a_bwd, b_bwd) = apply_constraint(constraint, fwd, a_bwd, b_bwd)
    else:
        fwd, (a_bwd,) = apply_constraint(constraint, fwd, a_bwd)
    if bias is None:
        return scaled_call(f, fwd, (a, b), (a_bwd, b_bwd))
    _check_bias(bias, out_shape[-1])
    bias_bwd = _inv_pow(_size(out_shape[:-1]), powers[2])
    return scaled_call(_with_bias(f), fwd, (a, b, bias), (a_bwd, b_bwd, bias_bwd))


def matmul(
    a: Array, b: Array, *, constraint: Constraint = "to_output_scale", constrain_rhs: bool = False
) -> Array:
    """Unit-scaled `jnp.matmul` (1-D operands and broadcast leading batch dims included).

    Forward factor 1/sqrt(K), K = `a.shape[-1]`. Each operand's grad factor is one over the
    square root of the number of outputs each of its elements enters (for `a` of shape
    (M, K) and `b` of shape (K, N): 1/sqrt(N) and 1/sqrt(M)), so a weight `b` broadcast
    over a batch counts the batch too. By default (`constraint="to_output_scale"`) the `a`
    grad factor is the output's, 1/sqrt(K): unit outputs.

    Args:
        a: the activation (tied by `constraint`).
        b: the weight (never tied, unless `constrain_rhs`).
        constraint: see `Constraint`; the default "to_output_scale" gives the `a` grad
            (with `constrain_rhs`, the `b` one too) the output factor; "gmean" ties them to
            their geometric mean. The reference library's `matmul` always ties all three.
        constrain_rhs: tie `b`'s grad factor too (two activations).

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> a = jax.random.normal(jax.random.key(0), (4, 64, 256))
        >>> b = jax.random.normal(jax.random.key(1), (256, 256))
        >>> round(float(U.matmul(a, b).std()), 1)
        1.0
    """
    if np.ndim(a) == 0 or np.ndim(b) == 0:
        raise ValueError("matmul operands must be at least 1-D; use a product for scalars.")
    k = _shape(a)[-1]
    return _contraction(jnp.matmul, a, b, lambda out: _size(out) * k, constraint, constrain_rhs)


def linear(
    x: Array,
    weight: Array,
    bias: Array | None = None,
    *,
    constraint: Constraint = "to_output_scale",
    scale_power: tuple[float, float, float] = (0.5, 0.5, 0.5),
) -> Array:
    """Unit-scaled `x @ weight + bias`, weight of shape (in, out) (the JAX convention).

    Factors: output in^(-p0); `x` grad out^(-p1); `weight` and `bias` grads rows^(-p2),
    rows = `x.size / in`, `(p0, p1, p2) = scale_power`. Unconstrained, the default powers
    1/2 give unit output and gradients; u-muP's readout takes p0 = 1 (see
    `linear_readout`). By default (`constraint="to_output_scale"`) the `x` grad factor is
    the output's, in^(-p0): unit outputs, and an `x` gradient of std sqrt(out/in) for the
    default powers.

    The bias enters the scaled product, as in the reference library's `linear`: the
    output is `(x @ weight + bias) * in^(-p0)` (a zero bias, as at initialisation, changes
    nothing; a trained one moves the output as much per unit as a weight does). Its
    gradient, a sum over the rows, is multiplied by rows^(-p2) only (not by the output
    factor): unit, like the weight's.

    Args:
        x: the activation, shape (..., in); its grad factor is tied by `constraint`.
        weight: shape (in, out); its grad factor is never tied.
        bias: optional, shape (out,); multiplied by the output factor with `x @ weight`.
        constraint: see `Constraint`; the default "to_output_scale" gives the `x` grad
            the output factor; "gmean" ties both to their geometric mean, (in *
            out)^(-1/4) for the default powers. The weight's and bias's factors are never
            tied (nor are they by the reference library's `linear`).
        scale_power: the powers (output, `x` grad, `weight`/`bias` grad) of the counts
            above, as the reference library's `scale_power`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (512, 256))
        >>> w = jax.random.normal(jax.random.key(1), (256, 256))
        >>> round(float(U.linear(x, w).std()), 1)
        1.0
        >>> round(float((U.linear(x, w, jnp.ones(256)) - U.linear(x, w)).mean()), 4)  # 1/16
        0.0625
    """
    if np.ndim(weight) != 2 or np.ndim(x) < 1 or _shape(x)[-1] != _shape(weight)[0]:
        raise ValueError(
            f"linear expects x of shape (..., in) and weight of shape (in, out), got "
            f"{_shape(x)} and {_shape(weight)}."
        )
    p_out, p_x, p_w = _scale_power(scale_power)
    fan_in, fan_out = _shape(weight)
    rows = _size(_shape(x)[:-1])
    fwd, (x_bwd,) = apply_constraint(constraint, _inv_pow(fan_in, p_out), _inv_pow(fan_out, p_x))
    f = functools.partial(lax.dot_general, dimension_numbers=(((np.ndim(x) - 1,), (0,)), ((), ())))
    w_bwd = _inv_pow(rows, p_w)
    if bias is None:
        return scaled_call(f, fwd, (x, weight), (x_bwd, w_bwd))
    _check_bias(bias, fan_out)
    # The bias enters the scaled product; its gradient, a sum over the rows, has the
    # weight's factor (scaled_call's bwd / fwd undoes the output factor on the way back).
    return scaled_call(_with_bias(f), fwd, (x, weight, bias), (x_bwd, w_bwd, w_bwd))


def linear_readout(
    x: Array,
    weight: Array,
    bias: Array | None = None,
    *,
    constraint: Constraint = None,
    scale_power: tuple[float, float, float] = (1.0, 0.5, 0.5),
) -> Array:
    """`linear` for the final projection (logits), with u-muP's readout rule.

    The output factor is 1/in (`scale_power=(1.0, 0.5, 0.5)`, as the reference library's
    `linear_readout`): unit inputs and weights give logits of std 1/sqrt(in), near zero
    for a wide model, so the loss starts near its value for uniform predictions and the
    logits' response to an optimiser step does not grow with the width. The gradients
    stay unit (`x` grad 1/sqrt(out), `weight` and `bias` grads 1/sqrt(rows)), and the
    factors are unconstrained by default (a constraint would tie the `x` grad factor to
    the small output factor). The bias enters the product, as in `linear` (multiplied by
    1/in). `scale_power=(0.5, 0.5, 0.5)` gives unit logits instead.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (512, 64))
        >>> w = jax.random.normal(jax.random.key(1), (64, 1000))
        >>> round(float(U.linear_readout(x, w).std() * 64**0.5), 1)
        1.0
    """
    return linear(x, weight, bias, constraint=constraint, scale_power=scale_power)


def _as_tuple(value: int | Sequence[int], n: int, name: str) -> tuple[int, ...]:
    out = _int_tuple(value)
    if len(out) == 1 and isinstance(value, (int, np.integer)):
        out = out * n
    if len(out) != n:
        raise ValueError(f"{name} must be an int or {n} ints, got {value}.")
    return out


def _taps(
    in_len: int,
    out_len: int,
    kernel: int,
    stride: int,
    pad_lo: int,
    lhs_dilation: int,
    rhs_dilation: int,
) -> int:
    """How many (output position, kernel tap) pairs of one spatial dim read an input element."""
    pos = (np.arange(out_len) * stride)[:, None] + (np.arange(kernel) * rhs_dilation)[None, :]
    pos = pos - pad_lo
    valid = (pos >= 0) & (pos % lhs_dilation == 0) & (pos // lhs_dilation < in_len)
    return int(valid.sum())


# The window arguments of `conv1d`/`conv2d`, in their order: strides, padding,
# rhs_dilation, feature_group_count.
_Window = tuple[int | Sequence[int], str | Sequence[tuple[int, int]], int | Sequence[int], int]


def _conv(
    x: Array,
    kernel: Array,
    bias: Array | None,
    spatial: int,
    window: _Window,
    constraint: Constraint,
    scale_power: tuple[float, float, float],
    params: dict[str, Any],
) -> Array:
    strides, padding, rhs_dilation, feature_group_count = window
    powers = _scale_power(scale_power)
    ndim = spatial + 2
    if np.ndim(x) != ndim or np.ndim(kernel) != ndim:
        raise ValueError(
            f"conv{spatial}d expects x and kernel of rank {ndim}, got {_shape(x)} and "
            f"{_shape(kernel)}."
        )
    groups = int(feature_group_count)
    in_ch, k_in, out_ch = _shape(x)[-1], _shape(kernel)[-2], _shape(kernel)[-1]
    if groups < 1 or k_in * groups != in_ch or out_ch % groups:
        raise ValueError(
            f"kernel in-channels ({k_in}) x feature_group_count ({groups}) must equal the "
            f"input channels ({in_ch}), and out-channels ({out_ch}) be divisible by it."
        )
    strides = _as_tuple(strides, spatial, "strides")
    rhs_dilation = _as_tuple(rhs_dilation, spatial, "rhs_dilation")
    lhs_dilation = _as_tuple(params.pop("lhs_dilation", None) or 1, spatial, "lhs_dilation")
    in_sp, k_sp = _shape(x)[1:-1], _shape(kernel)[:-2]
    if isinstance(padding, str):
        effective = [(k - 1) * r + 1 for k, r in zip(k_sp, rhs_dilation)]
        pads = lax.padtype_to_pads(in_sp, effective, strides, padding)
    else:
        pads = [(int(lo), int(hi)) for lo, hi in padding]
    layout = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC")}[spatial]
    f = functools.partial(
        lax.conv_general_dilated,
        window_strides=strides,
        padding=padding,
        lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation,
        dimension_numbers=layout,
        feature_group_count=groups,
        **params,
    )

    def products(out_shape: tuple[int, ...]) -> float:
        taps = math.prod(
            _taps(*dims)
            for dims in zip(
                in_sp,
                out_shape[1:-1],
                k_sp,
                strides,
                [p[0] for p in pads],
                lhs_dilation,
                rhs_dilation,
            )
        )
        return out_shape[0] * taps * k_in * out_ch

    return _contraction(f, x, kernel, products, constraint, False, powers, bias)


def conv1d(
    x: Array,
    kernel: Array,
    bias: Array | None = None,
    *,
    strides: int | Sequence[int] = 1,
    padding: str | Sequence[tuple[int, int]] = "SAME",
    rhs_dilation: int | Sequence[int] = 1,
    feature_group_count: int = 1,
    constraint: Constraint = "to_output_scale",
    scale_power: tuple[float, float, float] = (0.5, 0.5, 0.5),
    **params: Any,
) -> Array:
    """Unit-scaled 1-D convolution, `x` in NWC and `kernel` in WIO layout.

    Away from the borders, with stride 1: output factor 1/sqrt(kernel width x
    in-channels/groups); `x` grad factor 1/sqrt(kernel width x out-channels/groups);
    `kernel` and `bias` grad factors 1/sqrt(batch x output length). Exactly, every count
    is an average over the products the convolution forms: taps that read padding are
    not counted, and strides spread an input element over fewer outputs (so a small
    input with "SAME" padding, or a strided one, still gets unit output and gradients).
    With `scale_power=(p0, p1, p2)` each factor is its count to the power -p0 (output),
    -p1 (`x` grad) or -p2 (`kernel` and `bias` grads) instead of -1/2. By default
    (`constraint="to_output_scale"`) the `x` grad factor is the output's: unit outputs.

    The bias enters the scaled product, as in the reference library's `conv1d`: the
    output is `(conv(x, kernel) + bias)` times the output factor; its gradient, a sum over
    batch x output length, is multiplied by the `kernel` grad factor only.

    Args:
        x: the activation (tied by `constraint`), shape (batch, width, in).
        kernel: the weight (never tied), shape (kernel width, in/groups, out).
        bias: optional, shape (out,); multiplied by the output factor with the
            convolution.
        strides, padding, rhs_dilation, feature_group_count: as for
            `jax.lax.conv_general_dilated`.
        constraint: see `Constraint`; the default "to_output_scale" gives the `x` grad
            the output factor; "gmean" ties both to their geometric mean.
        scale_power: the powers (output, `x` grad, `kernel`/`bias` grad) of the counts,
            as the reference library's `scale_power`.
        **params: forwarded to `jax.lax.conv_general_dilated` (precision, ...).

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (8, 128, 32))
        >>> k = jax.random.normal(jax.random.key(1), (3, 32, 32))
        >>> round(float(U.conv1d(x, k).std()), 1)
        1.0
    """
    window = (strides, padding, rhs_dilation, feature_group_count)
    return _conv(x, kernel, bias, 1, window, constraint, scale_power, params)


def conv2d(
    x: Array,
    kernel: Array,
    bias: Array | None = None,
    *,
    strides: int | Sequence[int] = 1,
    padding: str | Sequence[tuple[int, int]] = "SAME",
    rhs_dilation: int | Sequence[int] = 1,
    feature_group_count: int = 1,
    constraint: Constraint = "to_output_scale",
    scale_power: tuple[float, float, float] = (0.5, 0.5, 0.5),
    **params: Any,
) -> Array:
    """Unit-scaled 2-D convolution, `x` in NHWC and `kernel` in HWIO layout.

    Factors (`scale_power`, `constraint`, and the bias inside the scaled product) as for
    `conv1d`, the kernel's spatial size being height x width.

    Examples:
        >>> import numpy as np
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> rng = np.random.default_rng(0)
        >>> x = rng.normal(size=(4, 16, 16, 16)).astype(np.float32)
        >>> k = rng.normal(size=(3, 3, 16, 16)).astype(np.float32)
        >>> round(float(U.conv2d(x, k).std()), 1)
        1.0
    """
    window = (strides, padding, rhs_dilation, feature_group_count)
    return _conv(x, kernel, bias, 2, window, constraint, scale_power, params)
