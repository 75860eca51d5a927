"""Unit-scaled functional ops: unit-variance outputs and gradients for unit-variance inputs.

Each op computes `fwd * f(x)` forward and gives each input the gradient `bwd_i * f'(x)^T g`.
The factors are Python floats computed at trace time from shapes: closed forms for the
contractions, numpy quadrature for elementwise functions, and a fixed-seed numpy Monte
Carlo for softmax and attention (cached by shape and by `mult`). Inputs `x ~ N(0, 1)` iid
and an output gradient `g ~ N(0, 1)` iid, independent of `x`, are assumed throughout.

`constraint` (see `Constraint`) ties the output factor to the grad factors of the
operands on the path (activations). The default is `"to_output_scale"`, as for the PyTorch
unit-scaling library's ops and for `unit_scale`: the input gradients on the path get the
output's factor, so every op keeps unit outputs (its input gradients are then off unit by
the ratio of the two factors, e.g. sqrt(out/in) for a linear layer); `"gmean"`, `None` and
the others remain available. The grad factor of a weight (`rhs`, `weight`, `kernel`,
`bias`, `table`) is never tied. So layers written by hand with these ops (`linear` with
its bias, `gelu`, `residual_split`/`residual_add` with the transform's `tau`) compute what
`unit_scale` computes for the same plain layers before the final residual add
(`unit_scale` leaves the ops after it unconstrained: pass `constraint=None` there).

`mult` (softmax, attention, GELU, SiLU, cross-entropy) is u-muP's multiplier of a
non-linearity's input (a temperature): the factors are recomputed for it, by the same
quadrature or Monte Carlo.

Under `jax.vmap` the factors see the per-example shapes: a weight shared across the mapped
axis gets a gradient summed over that axis too, which its factor does not count.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.types import Array
from ._fwd_bwd import Constraint, apply_constraint, check_constraint, multiply, scaled_call
from ._fwd_bwd import scale_bwd as scale_bwd
from ._fwd_bwd import scale_fwd as scale_fwd

__all__ = [
    "add",
    "conv1d",
    "conv2d",
    "cross_entropy",
    "dot_general",
    "dropout",
    "embedding",
    "gelu",
    "layer_norm",
    "linear",
    "linear_readout",
    "matmul",
    "mse_loss",
    "residual_add",
    "residual_apply",
    "residual_split",
    "rms_norm",
    "scaled_dot_product_attention",
    "silu",
    "silu_glu",
    "softmax",
    "transformer_residual_scaling_rule",
]

_SEED = 0  # Every Monte Carlo estimate of a factor draws from this seed.


# ---------------------------------------------------------------------------------------
# Shapes and checks.


def _size(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def _inv_sqrt(count: float) -> float:
    """1/sqrt(count); 1.0 for an empty sum (count 0), where no factor is meaningful."""
    return 1.0 / math.sqrt(count) if count > 0 else 1.0


def _inv_pow(count: float, power: float) -> float:
    """count^(-power); 1.0 for an empty sum (count 0)."""
    return float(count) ** -power if count > 0 else 1.0


def _inv_std(variance: float) -> float:
    """1/sqrt(variance); 1.0 for a degenerate (constant) quantity."""
    return 1.0 / math.sqrt(variance) if variance > 1e-30 else 1.0


def _shape(x: Array) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _require_float(x: Array, name: str) -> None:
    if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        raise TypeError(f"{name} must be a floating-point array, got dtype {jnp.result_type(x)}.")


def _require_same_shape(a: Array, b: Array, names: str) -> None:
    if _shape(a) != _shape(b):
        raise ValueError(f"{names} must have the same shape, got {_shape(a)} and {_shape(b)}.")


def _static_number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a Python number known at trace time, got {value!r}.")
    return float(value)


def _positive_number(value: Any, name: str) -> float:
    number = _static_number(value, name)
    if not (math.isfinite(number) and number > 0.0):
        raise ValueError(f"{name} must be positive and finite, got {number}.")
    return number


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


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}.")


def _reduce(per_term: Array, reduction: str) -> Array:
    if reduction == "mean":
        return jnp.mean(per_term)
    if reduction == "sum":
        return jnp.sum(per_term)
    return per_term


def _broadcast_vector(v: Array, shape: tuple[int, ...], axes: Sequence[int]) -> Array:
    """`v`, whose shape is `shape` restricted to `axes`, broadcast explicitly to `shape`."""
    kept = [shape[a] if a in axes else 1 for a in range(len(shape))]
    return jnp.broadcast_to(jnp.reshape(v, kept), shape)


def _check_bias(bias: Array | None, features: int) -> None:
    if bias is not None and _shape(bias) != (features,):
        raise ValueError(f"bias must have shape {(features,)}, got {_shape(bias)}.")


def _with_bias(f: Callable[[Array, Array], Array]) -> Callable[[Array, Array, Array], Array]:
    """`f(a, b) + bias`, the bias (a vector) broadcast over the output's last axis."""

    def biased(a: Array, b: Array, bias: Array) -> Array:
        y = f(a, b)
        return y + _broadcast_vector(bias, y.shape, (y.ndim - 1,))

    return biased


# ---------------------------------------------------------------------------------------
# Contractions.


def _dims(dims: Sequence[int], ndim: int, name: str) -> tuple[int, ...]:
    out = []
    for d in dims:
        if not -ndim <= int(d) < ndim:
            raise ValueError(f"dimension {d} out of range for {name} of rank {ndim}.")
        out.append(int(d) % ndim)
    return tuple(out)


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


def _int_tuple(value: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)):
        return (int(value),)
    return tuple(int(v) for v in value)


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


def _conv(
    x: Array,
    kernel: Array,
    bias: Array | None,
    spatial: int,
    strides: int | Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    rhs_dilation: int | Sequence[int],
    feature_group_count: int,
    constraint: Constraint,
    scale_power: tuple[float, float, float],
    params: dict[str, Any],
) -> Array:
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
    return _conv(
        x,
        kernel,
        bias,
        1,
        strides,
        padding,
        rhs_dilation,
        feature_group_count,
        constraint,
        scale_power,
        params,
    )


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
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (4, 16, 16, 16))
        >>> k = jax.random.normal(jax.random.key(1), (3, 3, 16, 16))
        >>> round(float(U.conv2d(x, k).std()), 1)
        1.0
    """
    return _conv(
        x,
        kernel,
        bias,
        2,
        strides,
        padding,
        rhs_dilation,
        feature_group_count,
        constraint,
        scale_power,
        params,
    )


# ---------------------------------------------------------------------------------------
# Elementwise functions: factors by quadrature over x ~ N(0, 1).

_QUAD_HALF_WIDTH = 12.0  # the N(0, 1) weight beyond is below 1e-31
_QUAD_STEPS = 2400  # steps on each side at least: a step of 1/200 ...
_QUAD_MAX_STEPS = 100_000  # ... or 1/(200 mult), down to 1.2e-4


def _quadrature(mult: float) -> tuple[np.ndarray, np.ndarray]:
    """Nodes and weights of the trapezoid rule for E[h(X)], X ~ N(0, 1), on [-12, 12].

    For integrands analytic in a strip about the real axis (those below, whose
    singularities lie at a distance of order 1/mult), the trapezoid rule converges
    exponentially in the step over that distance. The step is 1/(200 max(1, mult)), no
    finer than 1.2e-4: the moments agree with those of a grid 20 to 400 times finer to
    1e-13, for mult from 0.01 to 1000.
    """
    half = min(max(_QUAD_STEPS, math.ceil(200.0 * mult * _QUAD_HALF_WIDTH)), _QUAD_MAX_STEPS)
    nodes = np.linspace(-_QUAD_HALF_WIDTH, _QUAD_HALF_WIDTH, 2 * half + 1)
    weights = np.exp(-0.5 * nodes * nodes)
    return nodes, weights / weights.sum()


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu_np(x: np.ndarray, mult: float, approximate: bool) -> tuple[np.ndarray, np.ndarray]:
    """`gelu(mult x) / mult` and its derivative `gelu'(mult x)`."""
    y = mult * x
    if approximate:
        c = math.sqrt(2.0 / math.pi)
        t = np.tanh(c * (y + 0.044715 * y**3))
        df = 0.5 * (1.0 + t) + 0.5 * y * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * y**2)
        return 0.5 * x * (1.0 + t), df
    cdf = 0.5 * (1.0 + _erf(y / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * y * y) / math.sqrt(2.0 * math.pi)
    return x * cdf, cdf + y * pdf


def _silu_np(x: np.ndarray, mult: float) -> tuple[np.ndarray, np.ndarray]:
    """`x sigmoid(mult x)` and its derivative."""
    s = 0.5 * (1.0 + np.tanh(0.5 * mult * x))  # sigmoid, without exp overflow
    return x * s, s * (1.0 + mult * x * (1.0 - s))


_ELEMENTWISE: dict[str, Callable[[np.ndarray, float], tuple[np.ndarray, np.ndarray]]] = {
    "gelu_tanh": functools.partial(_gelu_np, approximate=True),
    "gelu": functools.partial(_gelu_np, approximate=False),
    "silu": _silu_np,
}


@functools.cache
def gaussian_moments(name: str, mult: float = 1.0) -> tuple[float, float, float]:
    """`(E[f(X)], E[f(X)^2], E[f'(X)^2])` for X ~ N(0, 1), `f` the function `name` with
    multiplier `mult` (`gelu(mult x) / mult`, `x sigmoid(mult x)`), by quadrature."""
    nodes, weights = _quadrature(mult)
    f, df = _ELEMENTWISE[name](nodes, mult)
    return float(weights @ f), float(weights @ (f * f)), float(weights @ (df * df))


def _elementwise_factors(name: str, mult: float = 1.0) -> tuple[float, float]:
    """1/std(f(X)) and 1/std(g f'(X)) (= 1/sqrt(E[f'(X)^2]) for g independent of X)."""
    mean, second, grad_second = gaussian_moments(name, float(mult))
    return _inv_std(second - mean * mean), _inv_std(grad_second)


def _elementwise(
    f: Callable[[Array], Array], x: Array, name: str, mult: float, constraint: Constraint
) -> Array:
    fwd, bwd = _elementwise_factors(name, mult)
    fwd, (bwd,) = apply_constraint(constraint, fwd, bwd)
    return scaled_call(f, fwd, (x,), (bwd,))


def _silu_mult(x: Array, mult: float) -> Array:
    """`x * sigmoid(mult * x)` (`jax.nn.silu` for mult 1)."""
    if mult == 1.0:
        return jax.nn.silu(x)
    return x * jax.nn.sigmoid(multiply(x, mult))


def gelu(
    x: Array,
    approximate: bool = True,
    *,
    mult: float = 1.0,
    constraint: Constraint = "to_output_scale",
) -> Array:
    """Unit-scaled `jax.nn.gelu(mult * x) / mult`.

    Factors: 1/std(f(X)) forward and 1/sqrt(E[f'(X)^2]) backward, X ~ N(0, 1), for
    f(x) = gelu(mult x) / mult (f'(x) = gelu'(mult x)), by quadrature: about 1.70 and
    1.48 for mult 1 (either form). A large `mult` makes f a sharper ReLU, a small one
    closer to x / 2. By default (`constraint="to_output_scale"`) the backward factor is
    the forward one: unit outputs, and input gradients of std 1.70/1.48 = 1.15 for mult 1.

    Args:
        x: the activation (tied by `constraint`).
        approximate: the tanh approximation (default, as `jax.nn.gelu`) or the erf form.
        mult: the multiplier of the input (u-muP's), a positive Python number.
        constraint: see `Constraint`; the default "to_output_scale" gives the input
            gradient the output factor; "gmean" ties both to their geometric mean; None
            leaves both unit.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (100_000,))
        >>> round(float(U.gelu(x, constraint=None).std()), 2)
        1.0
    """
    mult = _positive_number(mult, "mult")
    name = "gelu_tanh" if approximate else "gelu"

    def f(x: Array) -> Array:
        if mult == 1.0:
            return jax.nn.gelu(x, approximate=approximate)
        return multiply(jax.nn.gelu(multiply(x, mult), approximate=approximate), 1.0 / mult)

    return _elementwise(f, x, name, mult, constraint)


def silu(x: Array, *, mult: float = 1.0, constraint: Constraint = "to_output_scale") -> Array:
    """Unit-scaled SiLU (swish) `x * sigmoid(mult * x)` (`jax.nn.silu` for mult 1).

    Factors 1/std(f(X)) and 1/sqrt(E[f'(X)^2]) for f(x) = x sigmoid(mult x), by
    quadrature: about 1.79 and 1.62 for mult 1. `mult` and `constraint` as for `gelu`: by
    default (`constraint="to_output_scale"`) the backward factor is the forward one (unit
    outputs, input gradients of std 1.10 for mult 1).

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (100_000,))
        >>> round(float(U.silu(x, constraint=None).std()), 2)
        1.0
    """
    mult = _positive_number(mult, "mult")
    return _elementwise(lambda x: _silu_mult(x, mult), x, "silu", mult, constraint)


def silu_glu(
    x: Array, gate: Array, *, mult: float = 1.0, constraint: Constraint = "to_output_scale"
) -> Array:
    """Unit-scaled gated linear unit `x * gate * sigmoid(mult * gate)` (SwiGLU).

    For independent unit `x` and `gate`: output and `x` grad variance E[f(G)^2],
    `gate` grad variance E[f'(G)^2], f(g) = g sigmoid(mult g) (quadrature); the factors
    are one over their square roots. By default (`constraint="to_output_scale"`) both
    grad factors are the output's: unit outputs and `x` gradients, `gate` gradients of
    std 1.03 for mult 1.

    Args:
        x: the value branch (on the path, tied by `constraint`).
        gate: the gate branch (on the path, tied by `constraint`), same shape as `x`.
        mult: the multiplier inside the gate's sigmoid (u-muP's), a positive number.
        constraint: see `Constraint`; the default "to_output_scale" gives both grads the
            output factor; "gmean" ties all three factors to their geometric mean (the
            reference library's `silu_glu` uses one factor for all three, an empirical
            fit of the gate's).

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (100_000,))
        >>> g = jax.random.normal(jax.random.key(1), (100_000,))
        >>> round(float(U.silu_glu(x, g).std()), 1)
        1.0
    """
    _require_same_shape(x, gate, "x and gate")
    mult = _positive_number(mult, "mult")
    _, second, grad_second = gaussian_moments("silu", mult)
    fwd, (x_bwd, gate_bwd) = apply_constraint(
        constraint, _inv_std(second), _inv_std(second), _inv_std(grad_second)
    )
    return scaled_call(lambda a, b: a * _silu_mult(b, mult), fwd, (x, gate), (x_bwd, gate_bwd))


# ---------------------------------------------------------------------------------------
# Softmax: factors by a fixed-seed Monte Carlo over x, exact expectations over g.

_SOFTMAX_SAMPLES = 1 << 20  # elements drawn per estimate
_SOFTMAX_CHUNK = 1 << 22  # elements drawn at once
_SOFTMAX_ASYMPTOTIC = 1 << 16  # above this length times e^(mult^2), the large-n limits


@functools.cache
def softmax_moments(n: int, mult: float = 1.0) -> tuple[float, float, float]:
    """`(var p, var dx, E[sum p^2])` of `p = softmax(mult x)` over n unit-normal elements.

    `dx = mult p * (g - <p, g>)` for a unit-normal `g`:
    `E_g[dx_i^2] = mult^2 p_i^2 (1 - 2 p_i + S)`, `S = sum p^2`, averaged over x by Monte
    Carlo. For large n (n e^(-mult^2) > 2^16), with `p_i ~ exp(mult x_i) / (n e^(mult^2/2))`:
    `n^2 var p -> e^(m^2) - 1`, `E[S] -> e^(m^2) / n` and
    `n^2 var dx -> m^2 e^(m^2) (1 + e^(m^2) / n)`, m = mult.
    """
    if n <= 1:
        return 0.0, 0.0, float(n)
    m2 = mult * mult
    if m2 < math.log(n / _SOFTMAX_ASYMPTOTIC):  # n > 2^16 e^(m^2), without overflow
        spread = math.exp(m2)
        return (spread - 1.0) / n**2, m2 * spread * (1.0 + spread / n) / n**2, spread / n
    rows = max(16, -(-_SOFTMAX_SAMPLES // n))
    chunk = max(1, _SOFTMAX_CHUNK // n)
    rng = np.random.default_rng(_SEED)
    sum_p2 = sum_dx = sum_s = 0.0
    for start in range(0, rows, chunk):
        x = mult * rng.standard_normal((min(chunk, rows - start), n))
        p = np.exp(x - x.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        s = (p * p).sum(axis=-1, keepdims=True)
        sum_p2 += float(np.sum(p * p))
        sum_dx += float(np.sum(p * p * (1.0 - 2.0 * p + s)))
        sum_s += float(np.sum(s))
    var_p = sum_p2 / (rows * n) - 1.0 / n**2
    return var_p, m2 * sum_dx / (rows * n), sum_s / rows


def softmax(
    x: Array, axis: int = -1, *, mult: float = 1.0, constraint: Constraint = "to_output_scale"
) -> Array:
    """Unit-scaled `jax.nn.softmax(mult * x)` over `axis` (of length n).

    Factors: 1/std of the softmax and of its input gradient for unit-normal x and g,
    estimated by a fixed-seed numpy Monte Carlo cached by (n, mult) (for mult 1, about
    n/sqrt(e - 1) and n/sqrt(e) for large n). By default (`constraint="to_output_scale"`)
    the backward factor is the forward one: unit outputs, and input gradients of std
    sqrt(e/(e - 1)) = 1.26 for mult 1 and large n.

    Args:
        x: the activation (tied by `constraint`).
        axis: the axis to normalise over.
        mult: the multiplier of the input (u-muP's; an inverse temperature), a positive
            Python number.
        constraint: see `Constraint`; the default "to_output_scale" gives the input
            gradient the output factor; "gmean" ties both to their geometric mean; None
            leaves both unit.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (256, 512))
        >>> round(float(U.softmax(x, constraint=None).std()), 1)
        1.0
    """
    mult = _positive_number(mult, "mult")
    n = _shape(x)[axis]
    var_p, var_dx, _ = softmax_moments(n, mult)
    fwd, (bwd,) = apply_constraint(constraint, _inv_std(var_p), _inv_std(var_dx))
    f = lambda x: jax.nn.softmax(multiply(x, mult), axis=axis)
    return scaled_call(f, fwd, (x,), (bwd,))


# ---------------------------------------------------------------------------------------
# Dropout, norms, embedding, add, residuals.


def dropout(x: Array, rate: float, key: Array, *, deterministic: bool = False) -> Array:
    """Unit-scaled dropout: `x * mask / sqrt(1 - rate)`, keeping each element with
    probability `1 - rate`.

    Dividing by `sqrt(1 - rate)` (not the usual `1 - rate`) keeps the variance of a
    zero-mean unit input, and of the gradient, at one; the mean is not kept.

    Args:
        x: a floating-point array.
        rate: the drop probability, a Python number in [0, 1).
        key: a `jax.random` key.
        deterministic: if True (evaluation), the identity; so is `rate == 0`.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (100_000,))
        >>> round(float(U.dropout(x, 0.5, jax.random.key(1)).std()), 1)
        1.0
    """
    rate = _static_number(rate, "rate")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}.")
    _require_float(x, "dropout's x")
    if deterministic or rate == 0.0:
        return x
    x = jnp.asarray(x)
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, multiply(x, 1.0 / math.sqrt(1.0 - rate)), jnp.zeros_like(x))


def _norm_axes(x: Array, axis: int | Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted(_dims(_int_tuple(axis), np.ndim(x), "x")))


def _normalize(
    x: Array,
    axes: tuple[int, ...],
    eps: float,
    center: bool,
    weight: Array | None,
    bias: Array | None,
) -> Array:
    """(x - mean) / sqrt(var + eps) * weight + bias over `axes`, in at least float32."""
    x = jnp.asarray(x)
    shape = x.shape
    compute = jnp.promote_types(x.dtype, jnp.float32)
    y = x.astype(compute)
    if center:
        y = y - jnp.mean(y, axis=axes, keepdims=True)
    y = y * lax.rsqrt(jnp.mean(y * y, axis=axes, keepdims=True) + jnp.asarray(eps, compute))
    if weight is not None:
        y = y * _broadcast_vector(weight, shape, axes).astype(compute)
    if bias is not None:
        y = y + _broadcast_vector(bias, shape, axes).astype(compute)
    return y.astype(x.dtype)


def _norm_params(
    x: Array, params: dict[str, Array | None], axes: tuple[int, ...]
) -> dict[str, Array | None]:
    """Check each parameter's shape; scale its gradient (a sum over rows) to unit."""
    _require_float(x, "x")
    shape = _shape(x)
    norm_shape = tuple(shape[a] for a in axes)
    rows = _size(shape) // max(_size(norm_shape), 1)
    out: dict[str, Array | None] = {}
    for name, p in params.items():
        if p is not None and _shape(p) != norm_shape:
            raise ValueError(f"{name} must have shape {norm_shape}, got {_shape(p)}.")
        out[name] = None if p is None else scale_bwd(p, _inv_sqrt(rows))
    return out


def layer_norm(
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    eps: float = 1e-5,
    axis: int | Sequence[int] = -1,
) -> Array:
    """Layer normalisation over `axis`; the output is already unit.

    The `weight` and `bias` gradients (sums over rows = `x.size / normalised size`) are
    scaled by 1/sqrt(rows). The `x` gradient is the true one: for unit x and g its std is
    sqrt(1 - 2/n) ~ 1 (n the normalised size; measured 1.00 for n = 4096).

    Args:
        x: computed in at least float32, returned in its dtype.
        weight, bias: optional, of the shape of the normalised axes.
        eps: added to the variance.
        axis: an axis or axes to normalise over.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = 3.0 + 2.0 * jax.random.normal(jax.random.key(0), (64, 256))
        >>> round(float(U.layer_norm(x, jnp.ones(256), jnp.zeros(256)).std()), 2)
        1.0
    """
    axes = _norm_axes(x, axis)
    p = _norm_params(x, {"weight": weight, "bias": bias}, axes)
    return _normalize(x, axes, eps, True, p["weight"], p["bias"])


def rms_norm(
    x: Array,
    weight: Array | None = None,
    *,
    eps: float = 1e-6,
    axis: int | Sequence[int] = -1,
) -> Array:
    """RMS normalisation over `axis`; the output is already unit.

    The `weight` gradient is scaled by 1/sqrt(rows); the `x` gradient is the true one
    (std sqrt(1 - 1/n) ~ 1 for unit x and g; measured 1.00 for n = 4096).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = 5.0 * jax.random.normal(jax.random.key(0), (64, 256))
        >>> round(float(U.rms_norm(x, jnp.ones(256)).std()), 2)
        1.0
    """
    axes = _norm_axes(x, axis)
    p = _norm_params(x, {"weight": weight}, axes)
    return _normalize(x, axes, eps, False, p["weight"], None)


def embedding(ids: Array, table: Array) -> Array:
    """Unit-scaled embedding lookup `table[ids]`.

    The table gradient sums the output gradients of the lookups of each row: with L =
    `ids.size` lookups spread over V = `table.shape[0]` rows, each entry sums L/V unit
    terms on average, so it is scaled by sqrt(V / L).

    Args:
        ids: integer indices.
        table: shape (V, features); a weight (no constraint).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> table = jax.random.normal(jax.random.key(0), (1000, 64))
        >>> ids = jnp.arange(10) % 1000
        >>> U.embedding(ids, table).shape
        (10, 64)
    """
    if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
        raise TypeError(f"embedding ids must be integers, got dtype {jnp.result_type(ids)}.")
    if np.ndim(table) != 2:
        raise ValueError(f"embedding table must have shape (V, features), got {_shape(table)}.")
    lookups = _size(_shape(ids))
    table = scale_bwd(table, math.sqrt(_shape(table)[0] / lookups) if lookups else 1.0)
    return jnp.asarray(table)[ids]


def _is_constant(x: Any) -> bool:
    """A Python number or a 0-d array: a constant offset for `add`."""
    return isinstance(x, numbers.Number) or np.ndim(x) == 0


def add(a: Array | float, b: Array | float, *, constraint: Constraint = "to_output_scale") -> Array:
    """Unit-scaled sum `a + b` of two independent unit arrays, with broadcasting.

    Adding a constant (a Python number or a 0-d array) does not change the scale: the
    plain `a + b`, no factor in either pass (a 0-d array's gradient is then the plain sum;
    give a learnable scalar shape (1,) to unit-scale it). Otherwise the output factor is
    1/sqrt(2) (1 when one operand has a single element: an offset, which does not add
    variance), and each operand's grad factor is 1/sqrt(outputs each of its elements
    enters) (1 for an operand of the output's shape, 1/sqrt(rows) for a row vector
    broadcast over rows). Both operands are on the path: `constraint` ties all three. By
    default (`constraint="to_output_scale"`) both grad factors are the output's: a unit
    output, and gradients of std 1/sqrt(2) for two operands of the same shape.

    Args:
        a, b: arrays whose shapes broadcast together (NumPy rules), or constants.
        constraint: see `Constraint`; the default "to_output_scale" gives both grads the
            output factor; "gmean" ties the three factors to their geometric mean
            (2^(-1/6) for two operands of the same shape); None leaves each unit.
            "to_left_grad_scale"/"to_right_grad_scale" tie them to `a`'s/`b`'s.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> a = jax.random.normal(jax.random.key(0), (100_000,))
        >>> b = jax.random.normal(jax.random.key(1), (100_000,))
        >>> round(float(U.add(a, b, constraint=None).std()), 2)
        1.0
        >>> U.add(jnp.zeros(2), 1.0)
        Array([1., 1.], dtype=float32)
    """
    check_constraint(constraint)
    if _is_constant(a) or _is_constant(b):
        return jnp.add(a, b)
    a_shape, b_shape = _shape(a), _shape(b)
    try:
        out_shape = tuple(np.broadcast_shapes(a_shape, b_shape))
    except ValueError:
        raise ValueError(
            f"add's operands must broadcast together, got shapes {a_shape} and {b_shape}."
        ) from None
    sizes = _size(a_shape), _size(b_shape)
    fwd = 1.0 if 1 in sizes else 1.0 / math.sqrt(2.0)
    grads = [_inv_sqrt(_size(out_shape) / s) if s else 1.0 for s in sizes]
    fwd, tied = apply_constraint(constraint, fwd, *grads)
    f = lambda x, y: jnp.add(jnp.broadcast_to(x, out_shape), jnp.broadcast_to(y, out_shape))
    return scaled_call(f, fwd, (a, b), tied)


def _residual_coefficients(tau: float) -> tuple[float, float]:
    tau = _static_number(tau, "tau")
    if not (math.isfinite(tau) and tau >= 0.0):
        raise ValueError(f"tau must be finite and non-negative, got {tau}.")
    norm = math.sqrt(1.0 + tau * tau)
    return tau / norm, 1.0 / norm


def residual_split(x: Array, tau: float = 1.0) -> tuple[Array, Array]:
    """Split `x` into `(residual, skip)` for `residual_add`: both are `x` forward.

    Backward, the residual branch's gradient is multiplied by a = tau/sqrt(1 + tau^2) and
    the skip's by b = 1/sqrt(1 + tau^2) before they are summed: the gradient reaching `x`
    is exactly that of `a * f(x) + b * x`, of variance a^2 + b^2 = 1.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> residual, skip = U.residual_split(jnp.ones(3))
        >>> U.residual_add(residual, skip).tolist()
        [1.4142135381698608, 1.4142135381698608, 1.4142135381698608]
    """
    a, b = _residual_coefficients(tau)
    return scale_bwd(x, a), scale_bwd(x, b)


def residual_add(residual: Array, skip: Array, tau: float = 1.0) -> Array:
    """`a * residual + b * skip`, a = tau/sqrt(1 + tau^2), b = 1/sqrt(1 + tau^2).

    The output has unit variance for independent unit inputs (a^2 + b^2 = 1). `a` and `b`
    are forward-only here: both inputs receive the output gradient unscaled (unit);
    `residual_split` applies them on the way back.

    Args:
        residual: the residual branch's output, e.g. `f(residual)`.
        skip: the skip connection, same shape.
        tau: the weight of the residual branch relative to the skip.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> r = jax.random.normal(jax.random.key(0), (100_000,))
        >>> s = jax.random.normal(jax.random.key(1), (100_000,))
        >>> round(float(U.residual_add(r, s, tau=0.5).std()), 2)
        1.0
    """
    _require_same_shape(residual, skip, "residual and skip")
    a, b = _residual_coefficients(tau)
    return scale_fwd(residual, a) + scale_fwd(skip, b)


def residual_apply(fn: Callable[[Array], Array], x: Array, tau: float = 1.0) -> Array:
    """A residual layer `a * fn(x) + b * x`: `residual_split`, `fn` on the residual
    branch, `residual_add` (a = tau/sqrt(1 + tau^2), b = 1/sqrt(1 + tau^2)).

    The output and the gradient reaching `x` have unit variance when `fn` keeps unit
    scale; `fn`'s own input gradient is weighted by `a`, as its output is.

    Args:
        fn: the residual branch, a function of one array returning the same shape.
        x: the input, also the skip connection.
        tau: the weight of the residual branch relative to the skip.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (100_000,))
        >>> round(float(U.residual_apply(jnp.flip, x, tau=0.5).std()), 2)
        1.0
    """
    if not callable(fn):
        raise TypeError(f"residual_apply's fn must be callable, got {type(fn).__name__}.")
    residual, skip = residual_split(x, tau)
    return residual_add(fn(residual), skip, tau)


def transformer_residual_scaling_rule(
    residual_mult: float = 1.0, residual_attn_ratio: float = 1.0
) -> Callable[[int, int], float]:
    """u-muP's rule for the `tau` of each residual branch of a transformer (its Appendix G).

    For a stack that starts with an embedding and alternates attention (even `index`) and
    MLP (odd `index`) branches, `tau(index, layers)` (of `layers` branches in all) makes
    every attention branch contribute the same variance to the residual stream, and
    every MLP branch; all attention and MLP branches together contribute
    `residual_mult^2` times the embedding's on average, in the ratio
    `residual_attn_ratio^2` (attention to MLP). With weights
    `alpha_mlp = residual_mult * sqrt(2 / (1 + residual_attn_ratio^2))` and
    `alpha_attn = residual_attn_ratio * alpha_mlp`, the embedding counting `layers / 2`:
    `tau = alpha / sqrt(layers / 2 + n_attn alpha_attn^2 + n_mlp alpha_mlp^2)`, the sum
    over the n_attn attention and n_mlp MLP branches before this one. With both
    arguments 1, `tau = 1 / sqrt(layers / 2 + index)`, `unit_scale`'s default rule.

    Args:
        residual_mult: the residual branches' contribution relative to the embedding's.
        residual_attn_ratio: the attention branches' contribution relative to the MLP's.

    Returns:
        `tau(index, layers) -> float`, for `residual_split`/`residual_add`/`residual_apply`.

    Examples:
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> tau = U.transformer_residual_scaling_rule()
        >>> [round(tau(i, 4), 4) for i in range(4)]
        [0.7071, 0.5774, 0.5, 0.4472]
    """
    residual_mult = _positive_number(residual_mult, "residual_mult")
    residual_attn_ratio = _positive_number(residual_attn_ratio, "residual_attn_ratio")
    alpha_mlp = residual_mult * math.sqrt(2.0 / (1.0 + residual_attn_ratio**2))
    alpha_attn = residual_attn_ratio * alpha_mlp

    def tau(index: int, layers: int) -> float:
        for value, name in ((index, "index"), (layers, "layers")):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {value!r}.")
        if not 0 <= index < layers:
            raise ValueError(f"index must be in [0, layers), got index {index} of {layers}.")
        n_attn, n_mlp = (index + 1) // 2, index // 2
        seen = layers / 2.0 + n_attn * alpha_attn**2 + n_mlp * alpha_mlp**2
        return (alpha_attn if index % 2 == 0 else alpha_mlp) / math.sqrt(seen)

    return tau


# ---------------------------------------------------------------------------------------
# Attention: factors by a fixed-seed Monte Carlo over q and k, exact over v and g.

_ATTENTION_SAMPLES = 4096  # query rows drawn per estimate, unless ...
_ATTENTION_COST = 1 << 24  # ... rows x keys x head_dim would exceed this (then >= 1 trial)
_CAUSAL_DENSE = 64  # causal: every one of the first rows, then a geometric grid of rows


def _attention_rows(seq_q: int, is_causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """Query rows to sample and how many rows each stands for.

    A row's statistics depend only on how many keys it sees. Without a causal mask all rows
    are alike; with one, the first rows (which see few keys) are all taken and the rest on a
    geometric grid, each standing for the rows nearest it.
    """
    if not is_causal or seq_q <= 2 * _CAUSAL_DENSE:
        index = np.arange(seq_q if is_causal else min(seq_q, _CAUSAL_DENSE))
        return index, np.ones(index.size)
    grid = np.geomspace(_CAUSAL_DENSE, seq_q - 1, _CAUSAL_DENSE).round().astype(np.int64)
    index = np.unique(np.concatenate([np.arange(_CAUSAL_DENSE), grid]))
    edges = np.concatenate([[0], np.ceil((index[:-1] + index[1:]) / 2.0), [seq_q]])
    return index, np.diff(edges)


@functools.cache
def attention_moments(
    seq_q: int, seq_k: int, head_dim: int, is_causal: bool, logit_scale: float | None = None
) -> tuple[float, float, float, float]:
    """Variances of the output and of the q, k, v gradients of attention (value dim = head_dim).

    For unit-normal q, k, v and output gradient g, with p = softmax(c q k^T) (c the
    `logit_scale`, 1/sqrt(d) by default; top-left causal mask if `is_causal`),
    S_i = sum_j p_ij^2, m1 = sum_j p_ij k_j, m2 = sum_j p_ij^2 k_j:

    - var o = mean_i S_i and var dv = (seq_q/seq_k) mean_i S_i (exact over v, g);
    - var dq = c^2 mean_i [sum_j p_ij^2 |k_j|^2 - 2 m1.m2 + S_i |m1|^2] (exact over v, g);
    - var dk = (seq_q/seq_k) c^2 mean_i [|q_i|^2 sum_j p_ij^2 (1 - 2 p_ij + S_i)] (the
      cross terms between rows vanish: distinct rows' gradients are independent given q, k).

    The dq and dk variances scale with the value dim over head_dim. The expectations over q
    and k are a fixed-seed Monte Carlo over a weighted set of query rows.
    """
    d = head_dim
    c = 1.0 / math.sqrt(d) if logit_scale is None else float(logit_scale)
    index, weights = _attention_rows(seq_q, is_causal)
    trials = -(-_ATTENTION_SAMPLES // index.size)
    trials = max(1, min(trials, _ATTENTION_COST // (index.size * seq_k * d)))
    rng = np.random.default_rng(_SEED)
    q = rng.standard_normal((trials, index.size, d))
    k = rng.standard_normal((trials, seq_k, d))
    s = q @ np.swapaxes(k, -1, -2) * c
    if is_causal:
        s = np.where(np.arange(seq_k)[None, :] <= index[:, None], s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    p2 = p * p
    big_s = p2.sum(axis=-1)
    m1, m2 = p @ k, p2 @ k
    dq = (p2 @ (k * k).sum(-1)[..., None])[..., 0] - 2.0 * (m1 * m2).sum(-1)
    dq = dq + big_s * (m1 * m1).sum(-1)
    dk = (q * q).sum(-1) * (p2 * (1.0 - 2.0 * p + big_s[..., None])).sum(-1)
    mean = lambda a: float(a.mean(axis=0) @ weights / weights.sum())
    ratio = seq_q / seq_k
    return mean(big_s), c * c * mean(dq), ratio * c * c * mean(dk), ratio * mean(big_s)


def _attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None,
    is_causal: bool,
    logit_scale: float,
    dropout_p: float,
    key: Array | None,
) -> Array:
    scores = jnp.einsum("...qd,...kd->...qk", q, k)
    scores = multiply(scores, logit_scale)
    keep = None
    if is_causal:
        sq, sk = scores.shape[-2:]
        keep = jnp.broadcast_to(jnp.tril(jnp.ones((sq, sk), bool)), scores.shape)
    if mask is not None:
        mask = jnp.broadcast_to(mask, scores.shape)
        keep = mask if keep is None else keep & mask
    if keep is not None:
        scores = jnp.where(keep, scores, jnp.full_like(scores, jnp.finfo(scores.dtype).min))
    weights = jax.nn.softmax(scores, axis=-1)
    if dropout_p > 0.0 and key is not None:
        kept = jax.random.bernoulli(key, 1.0 - dropout_p, weights.shape)
        weights = jnp.where(kept, multiply(weights, 1.0 / (1.0 - dropout_p)), 0.0)
    return jnp.einsum("...qk,...kd->...qd", weights, v)


def _logit_scale(scale: Any, head_dim: int) -> float:
    """The logits' multiplier before `mult`: 1/sqrt(d) (None), 1/d ("1/d") or a number."""
    if scale is None or (isinstance(scale, str) and scale == "1/sqrt(d)"):
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, str):
        if scale == "1/d":
            return 1.0 / head_dim
        raise ValueError(f"scale must be None, '1/sqrt(d)', '1/d' or a number, got {scale!r}.")
    return _positive_number(scale, "scale")


def scaled_dot_product_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    mask: Array | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    key: Array | None = None,
    deterministic: bool = False,
    mult: float = 1.0,
    scale: float | str | None = None,
    constraint: Constraint = "to_output_scale",
) -> Array:
    """Unit-scaled attention `dropout(softmax(mult * scale * q k^T)) @ v`.

    `scale` is 1/sqrt(head_dim) by default; `scale="1/d"` gives u-muP's logits
    `mult * q k^T / head_dim` (the reference library's `scale=mult/d_head`). The factors
    (output, q, k and v grads) are one over the std each has for unit-normal inputs and
    output gradient, from a fixed-seed numpy Monte Carlo cached by (seq_q, seq_k,
    head_dim, is_causal, mult * scale); about sqrt(seq_k / e) for long sequences with
    the default logits.

    Dropout (as PyTorch's: each attention weight kept with probability 1 - dropout_p
    and divided by 1 - dropout_p) multiplies all four variances by 1/(1 - dropout_p)
    exactly, so every factor has an extra sqrt(1 - dropout_p), as in the reference.

    By default (`constraint="to_output_scale"`) the q, k and v grad factors are the
    output's: a unit output, and q, k, v gradients whose stds are the ratios of the output
    factor to their own (0.97, 0.97 and 1 for 128 x 128, head_dim = value dim = 64; the q
    and k ones scale with sqrt(value dim / head_dim)).

    Args:
        q: shape (..., seq_q, head_dim), leading dims batch/heads.
        k: shape (..., seq_k, head_dim).
        v: shape (..., seq_k, value_dim).
        mask: optional boolean mask broadcastable to (..., seq_q, seq_k), True where a
            query attends a key; it does not enter the factors.
        is_causal: mask keys after the query (top-left aligned, query i sees keys <= i).
        dropout_p: the probability of dropping an attention weight, a Python number in
            [0, 1).
        key: a `jax.random` key for the dropout mask, required when `dropout_p > 0` and
            not `deterministic`.
        deterministic: no dropout (evaluation), whatever `dropout_p`.
        mult: u-muP's multiplier of the logits, a positive Python number.
        scale: the logits' scale before `mult`: None or "1/sqrt(d)" (1/sqrt(head_dim)),
            "1/d" (1/head_dim), or a positive number.
        constraint: see `Constraint`; q, k and v are all on the path: the default
            "to_output_scale" gives their grads the output factor; "gmean" ties the four
            factors to their geometric mean.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 8, 128, 64))
        >>> round(float(U.scaled_dot_product_attention(q, k, v).std()), 1)
        1.0
    """
    shapes = _shape(q), _shape(k), _shape(v)
    if (
        min(len(s) for s in shapes) < 2
        or not shapes[0][:-2] == shapes[1][:-2] == shapes[2][:-2]
        or shapes[0][-1] != shapes[1][-1]
        or shapes[1][-2] != shapes[2][-2]
    ):
        raise ValueError(
            "attention expects q (..., seq_q, d), k (..., seq_k, d) and v (..., seq_k, dv) "
            f"with equal leading dims, got {shapes[0]}, {shapes[1]} and {shapes[2]}."
        )
    if mask is not None and jnp.result_type(mask) != jnp.bool_:
        raise TypeError(f"attention mask must be boolean, got dtype {jnp.result_type(mask)}.")
    dropout_p = _static_number(dropout_p, "dropout_p")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}.")
    if deterministic:
        dropout_p = 0.0
    if dropout_p > 0.0 and key is None:
        raise ValueError(
            f"dropout_p={dropout_p} needs a random key for the dropout mask (key=...), "
            "or deterministic=True for none."
        )
    mult = _positive_number(mult, "mult")
    (sq, d), (sk, dv) = shapes[0][-2:], shapes[2][-2:]
    logit_scale = mult * _logit_scale(scale, d)
    var_o, var_dq, var_dk, var_dv = attention_moments(sq, sk, d, bool(is_causal), logit_scale)
    keep = 1.0 - dropout_p
    fwd, grads = apply_constraint(
        constraint,
        _inv_std(var_o / keep),
        _inv_std(var_dq * dv / d / keep),
        _inv_std(var_dk * dv / d / keep),
        _inv_std(var_dv / keep),
    )
    f = lambda q_, k_, v_: _attention(
        q_, k_, v_, mask, bool(is_causal), logit_scale, dropout_p, key
    )
    return scaled_call(f, fwd, (q, k, v), grads)


# ---------------------------------------------------------------------------------------
# Losses: the forward value is the true loss; only the backward is scaled.


@jax.custom_vjp
def _divide_forward(x: Array, d: Array) -> Array:
    """`x / d` forward; the gradient reaches `x` undivided (`d` gets none)."""
    return x / d


def _divide_forward_fwd(x: Array, d: Array) -> tuple[Array, Array]:
    return x / d, d


def _divide_forward_bwd(d: Array, g: Array) -> tuple[Array, Array]:
    return g, jnp.zeros_like(d)


_divide_forward.defvjp(_divide_forward_fwd, _divide_forward_bwd)


def cross_entropy_second_moment(
    vocab: int, mult: float = 1.0, label_smoothing: float = 0.0
) -> float:
    """E[sum_c (dL/dz_c)^2] of one term of the cross-entropy on `mult * z` (unit weights).

    The gradient is `mult (p - t)`, p = softmax(mult z), t the target distribution
    `(1 - e) onehot(label) + e / V` (e the label smoothing); for unit-normal z and a label
    independent of it, `E[sum (p - t)^2] = E[sum p^2] - 2/V + (1 - e)^2 + (2 e - e^2) / V`.
    """
    _, _, mean_s = softmax_moments(vocab, mult)
    eps = label_smoothing
    return mult * mult * (mean_s - 2.0 / vocab + (1.0 - eps) ** 2 + (2.0 * eps - eps * eps) / vocab)


def cross_entropy(
    logits: Array,
    labels: Array,
    *,
    reduction: str = "mean",
    mult: float = 1.0,
    ignore_index: int | None = None,
    weight: Array | None = None,
    label_smoothing: float = 0.0,
) -> Array:
    """Softmax cross-entropy of `mult * logits` with integer labels; the class axis is last.

    The value is the true loss (to log), PyTorch's `cross_entropy` (and `optax`'s with
    unit weights) on `mult * logits`: per term `(1 - e) w[y] (-log p_y) + (e / V)
    sum_c w[c] (-log p_c)`, e = `label_smoothing`, w = `weight` (ones if None), a term
    whose label is `ignore_index` 0; "mean" divides the sum by the sum of `w[y]` over the
    terms not ignored (their number, counted at run time, when `weight` is None; NaN when
    every term is ignored, as in PyTorch).

    The logits gradient is unit-scaled. A term's gradient is `mult (p - t)` times its
    weight, t = (1 - e) onehot(y) + e / V, whose V entries have variance
    `mult^2 (E[sum p^2] - 2/V + (1 - e)^2 + (2e - e^2)/V) / V` for unit-normal logits and
    labels independent of them (E[sum p^2] by the softmax Monte Carlo, for `mult`): the
    logits gradient is multiplied by one over its square root (for mult 1 and e = 0,
    sqrt(V / (E[sum p^2] + 1 - 2/V))). "mean"'s division by the number of terms counted
    acts on the forward pass only (the gradient of each term is unit, whatever the batch
    size and however many terms are ignored); its division by the mean weight of those
    terms acts on both passes, so a term's gradient is its weight over the mean weight
    (unit for uniform weights). With "sum" and "none", weights multiply the gradient of
    their terms as they multiply the loss. Ignored terms get no gradient.

    Args:
        logits: shape (..., V), computed in at least float32.
        labels: integer array of shape `logits.shape[:-1]`.
        reduction: "mean", "sum" or "none".
        mult: the multiplier of the logits (u-muP's), a positive Python number.
        ignore_index: a Python int: terms with this label contribute nothing (PyTorch's
            default is -100; here None, no label ignored).
        weight: optional per-class weights, shape (V,), floating; constants (no gradient).
        label_smoothing: e in [0, 1], a Python number (PyTorch's `label_smoothing`).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> logits = jnp.zeros((4, 10))
        >>> round(float(U.cross_entropy(logits, jnp.array([0, 1, 2, 3]))), 4)
        2.3026
        >>> labels = jnp.array([0, 1, -100, -100])
        >>> round(float(U.cross_entropy(logits, labels, ignore_index=-100)), 4)
        2.3026
    """
    _check_reduction(reduction)
    _require_float(logits, "logits")
    if not jnp.issubdtype(jnp.result_type(labels), jnp.integer):
        raise TypeError(f"labels must be integers, got dtype {jnp.result_type(labels)}.")
    if np.ndim(logits) < 1 or _shape(labels) != _shape(logits)[:-1]:
        raise ValueError(
            f"labels must have shape logits.shape[:-1], got {_shape(labels)} for logits "
            f"{_shape(logits)}."
        )
    mult = _positive_number(mult, "mult")
    eps = _static_number(label_smoothing, "label_smoothing")
    if not 0.0 <= eps <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {eps}.")
    if ignore_index is not None and (
        isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral)
    ):
        raise TypeError(f"ignore_index must be a Python int or None, got {ignore_index!r}.")
    logits = jnp.asarray(logits)
    vocab = logits.shape[-1]
    if weight is not None:
        _require_float(weight, "weight")
        if _shape(weight) != (vocab,):
            raise ValueError(
                f"weight must have shape (V,) = {(vocab,)} (one per class), got {_shape(weight)}."
            )
    compute = jnp.promote_types(logits.dtype, jnp.float32)
    factor = _inv_std(cross_entropy_second_moment(vocab, mult, eps) / vocab)
    z = scale_bwd(logits.astype(compute), factor)
    log_p = jax.nn.log_softmax(multiply(z, mult), axis=-1)
    labels = jnp.asarray(labels)
    kept = None if ignore_index is None else labels != ignore_index
    safe = labels if kept is None else jnp.where(kept, labels, jnp.zeros_like(labels))
    picked = jnp.take_along_axis(log_p, jnp.expand_dims(safe, -1), axis=-1)[..., 0]
    w = None if weight is None else lax.stop_gradient(jnp.asarray(weight).astype(compute))
    w_label = None if w is None else w[safe]
    per_term = -picked if w_label is None else -w_label * picked
    if eps > 0.0:
        class_weights = None if w is None else _broadcast_vector(w, log_p.shape, (log_p.ndim - 1,))
        smooth = -jnp.sum(log_p if class_weights is None else log_p * class_weights, axis=-1)
        per_term = (1.0 - eps) * per_term + (eps / vocab) * smooth
    if kept is not None:
        per_term = jnp.where(kept, per_term, jnp.zeros_like(per_term))
    if reduction != "mean":
        return _reduce(per_term, reduction).astype(logits.dtype)
    total = jnp.sum(per_term)
    if kept is None:
        count = jnp.asarray(_size(_shape(labels)), compute)
    else:
        count = jnp.sum(kept, dtype=compute)
    if w_label is not None:
        counted = w_label if kept is None else jnp.where(kept, w_label, jnp.zeros_like(w_label))
        mean_weight = jnp.sum(counted) / count
        total = total / jnp.where(count > 0, mean_weight, jnp.ones_like(mean_weight))
    return _divide_forward(total, count).astype(logits.dtype)


def mse_loss(pred: Array, target: Array, *, reduction: str = "mean") -> Array:
    """Mean squared error; the value is the true loss, the gradients are unit-scaled.

    Per element the gradient is `2 (pred - target)`, of variance 8 for independent unit
    `pred` and `target`: both gradients are scaled by 1/sqrt(8), times N = `pred.size`
    for "mean".

    Args:
        pred, target: floating-point arrays of the same shape, computed in at least
            float32.
        reduction: "mean", "sum" or "none".

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> float(U.mse_loss(jnp.array([1.0, 2.0]), jnp.array([0.0, 0.0])))
        2.5
    """
    _check_reduction(reduction)
    _require_same_shape(pred, target, "pred and target")
    _require_float(pred, "pred")
    pred, target = jnp.asarray(pred), jnp.asarray(target)
    factor = 1.0 / math.sqrt(8.0)
    if reduction == "mean":
        factor *= max(_size(pred.shape), 1)
    compute = jnp.promote_types(jnp.promote_types(pred.dtype, target.dtype), jnp.float32)
    diff = scale_bwd(pred.astype(compute), factor) - scale_bwd(target.astype(compute), factor)
    return _reduce(diff * diff, reduction).astype(pred.dtype)
