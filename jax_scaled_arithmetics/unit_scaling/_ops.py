"""Unit-scaled functional ops: unit-variance outputs and gradients for unit-variance inputs.

Each op computes `fwd * f(x)` forward and gives each input the gradient `bwd_i * f'(x)^T g`.
The factors are Python floats computed at trace time from shapes: closed forms for the
contractions, numpy Gauss-Hermite quadrature for elementwise functions, and a fixed-seed
numpy Monte Carlo for softmax and attention (cached by shape). Inputs `x ~ N(0, 1)` iid
and an output gradient `g ~ N(0, 1)` iid, independent of `x`, are assumed throughout.

`constraint` (see `Constraint`) ties the output factor to the grad factors of the
operands on the path (activations). The default `"gmean"` ties them to their geometric
mean, as the `gmean` constraint of the PyTorch unit-scaling library does; the grad
factor of a weight (`rhs`, `weight`, `kernel`, `bias`, `table`) is never tied.

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
    "residual_split",
    "rms_norm",
    "scaled_dot_product_attention",
    "silu",
    "silu_glu",
    "softmax",
]

_SEED = 0  # Every Monte Carlo estimate of a factor draws from this seed.


# ---------------------------------------------------------------------------------------
# Shapes and checks.


def _size(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def _inv_sqrt(count: float) -> float:
    """1/sqrt(count); 1.0 for an empty sum (count 0), where no factor is meaningful."""
    return 1.0 / math.sqrt(count) if count > 0 else 1.0


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


def _add_bias(y: Array, bias: Array | None, rows: int) -> Array:
    """`y + bias` over `y`'s last axis; the bias gradient (a sum over `rows`) scaled to unit."""
    if bias is None:
        return y
    if _shape(bias) != (y.shape[-1],):
        raise ValueError(f"bias must have shape {(y.shape[-1],)}, got {_shape(bias)}.")
    bias = scale_bwd(bias, _inv_sqrt(rows))
    return y + _broadcast_vector(bias, y.shape, (y.ndim - 1,))


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
    constraint: Constraint = "gmean",
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
    constraint: Constraint = "gmean",
    constrain_rhs: bool = False,
    **params: Any,
) -> Array:
    """Unit-scaled `jax.lax.dot_general`: exactly `lax.dot_general` times a factor.

    Forward factor 1/sqrt(prod(contracting dims)); `lhs` grad factor 1/sqrt(prod(free dims
    of `rhs`)); `rhs` grad factor 1/sqrt(prod(free dims of `lhs`)); free = neither
    contracting nor batch. Batch dims enter no factor.

    Args:
        lhs: the activation: its grad factor is tied to the output factor by `constraint`.
        rhs: the weight: its grad factor is never tied, unless `constrain_rhs`.
        dimension_numbers: as for `jax.lax.dot_general` (batch dims allowed).
        constraint: see `Constraint`; "gmean" ties the factors to their geometric mean
            as the reference library's constraint does.
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
    constraint: Constraint = "gmean",
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
) -> Array:
    """`f(a, b)`, a bilinear contraction forming `products(out_shape)` products, unit-scaled.

    With P products in all, an output is on average a sum of P / out.size of them, and the
    gradient of an element of `a` a sum of P / a.size (likewise for `b`): each factor is one
    over the square root of that count (for a matmul, K, N and M).
    """
    check_constraint(constraint)
    spec = lambda x: jax.ShapeDtypeStruct(_shape(x), jnp.result_type(x))
    out_shape = tuple(jax.eval_shape(f, spec(a), spec(b)).shape)
    total = products(out_shape)
    per = lambda shape: total / max(_size(shape), 1)
    fwd, a_bwd, b_bwd = (_inv_sqrt(per(s)) for s in (out_shape, _shape(a), _shape(b)))
    if constrain_b:
        fwd, (a_bwd, b_bwd) = apply_constraint(constraint, fwd, a_bwd, b_bwd)
    else:
        fwd, (a_bwd,) = apply_constraint(constraint, fwd, a_bwd)
    return scaled_call(f, fwd, (a, b), (a_bwd, b_bwd))


def matmul(
    a: Array, b: Array, *, constraint: Constraint = "gmean", constrain_rhs: bool = False
) -> Array:
    """Unit-scaled `jnp.matmul` (1-D operands and broadcast leading batch dims included).

    Forward factor 1/sqrt(K), K = `a.shape[-1]`. Each operand's grad factor is one over the
    square root of the number of outputs each of its elements enters (for `a` of shape
    (M, K) and `b` of shape (K, N): 1/sqrt(N) and 1/sqrt(M)), so a weight `b` broadcast
    over a batch counts the batch too.

    Args:
        a: the activation (tied by `constraint`).
        b: the weight (never tied, unless `constrain_rhs`).
        constraint: see `Constraint`; "gmean" ties the factors to their geometric mean
            as the reference library's constraint does.
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
    constraint: Constraint = "gmean",
) -> Array:
    """Unit-scaled `x @ weight + bias`, weight of shape (in, out) (the JAX convention).

    Factors: output 1/sqrt(in); `x` grad 1/sqrt(out); `weight` and `bias` grads
    1/sqrt(rows), rows = `x.size / in`. The bias is added unscaled (it starts at zero).

    Args:
        x: the activation, shape (..., in); its grad factor is tied by `constraint`.
        weight: shape (in, out); its grad factor is never tied.
        bias: optional, shape (out,).
        constraint: see `Constraint`; "gmean" ties the output and `x` grad factors to
            (in * out)^(-1/4), as the reference library's constraint does.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (512, 256))
        >>> w = jax.random.normal(jax.random.key(1), (256, 256))
        >>> round(float(U.linear(x, w).std()), 1)
        1.0
    """
    if np.ndim(weight) != 2 or np.ndim(x) < 1 or _shape(x)[-1] != _shape(weight)[0]:
        raise ValueError(
            f"linear expects x of shape (..., in) and weight of shape (in, out), got "
            f"{_shape(x)} and {_shape(weight)}."
        )
    y = dot_general(x, weight, (((np.ndim(x) - 1,), (0,)), ((), ())), constraint=constraint)
    return _add_bias(y, bias, _size(_shape(x)[:-1]))


def linear_readout(
    x: Array,
    weight: Array,
    bias: Array | None = None,
    *,
    constraint: Constraint = None,
) -> Array:
    """`linear` for the final projection (logits): unconstrained by default.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (512, 64))
        >>> w = jax.random.normal(jax.random.key(1), (64, 1000))
        >>> round(float(U.linear_readout(x, w).std()), 1)
        1.0
    """
    return linear(x, weight, bias, constraint=constraint)


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
    params: dict[str, Any],
) -> Array:
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

    y = _contraction(f, x, kernel, products, constraint, False)
    return _add_bias(y, bias, _size(y.shape[:-1]))


def conv1d(
    x: Array,
    kernel: Array,
    bias: Array | None = None,
    *,
    strides: int | Sequence[int] = 1,
    padding: str | Sequence[tuple[int, int]] = "SAME",
    rhs_dilation: int | Sequence[int] = 1,
    feature_group_count: int = 1,
    constraint: Constraint = "gmean",
    **params: Any,
) -> Array:
    """Unit-scaled 1-D convolution, `x` in NWC and `kernel` in WIO layout.

    Away from the borders, with stride 1: output factor 1/sqrt(kernel width x
    in-channels/groups); `x` grad factor 1/sqrt(kernel width x out-channels/groups);
    `kernel` and `bias` grad factors 1/sqrt(batch x output length). Exactly, every count
    is an average over the products the convolution forms: taps that read padding are
    not counted, and strides spread an input element over fewer outputs (so a small
    input with "SAME" padding, or a strided one, still gets unit output and gradients).

    Args:
        x: the activation (tied by `constraint`), shape (batch, width, in).
        kernel: the weight (never tied), shape (kernel width, in/groups, out).
        bias: optional, shape (out,), added unscaled.
        strides, padding, rhs_dilation, feature_group_count: as for
            `jax.lax.conv_general_dilated`.
        constraint: see `Constraint`; "gmean" ties the factors to their geometric mean
            as the reference library's constraint does.
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
        x, kernel, bias, 1, strides, padding, rhs_dilation, feature_group_count, constraint, params
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
    constraint: Constraint = "gmean",
    **params: Any,
) -> Array:
    """Unit-scaled 2-D convolution, `x` in NHWC and `kernel` in HWIO layout.

    Factors as for `conv1d`, the kernel's spatial size being height x width.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (4, 16, 16, 16))
        >>> k = jax.random.normal(jax.random.key(1), (3, 3, 16, 16))
        >>> round(float(U.conv2d(x, k).std()), 1)
        1.0
    """
    return _conv(
        x, kernel, bias, 2, strides, padding, rhs_dilation, feature_group_count, constraint, params
    )


# ---------------------------------------------------------------------------------------
# Elementwise functions: factors by Gauss-Hermite quadrature over x ~ N(0, 1).

_GH_DEGREE = 120


def _gelu_np(x: np.ndarray, approximate: bool) -> tuple[np.ndarray, np.ndarray]:
    if approximate:
        c = math.sqrt(2.0 / math.pi)
        t = np.tanh(c * (x + 0.044715 * x**3))
        df = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x**2)
        return 0.5 * x * (1.0 + t), df
    cdf = 0.5 * (1.0 + np.array([math.erf(v / math.sqrt(2.0)) for v in x]))
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return x * cdf, cdf + x * pdf


def _silu_np(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = 1.0 / (1.0 + np.exp(-x))
    return x * s, s * (1.0 + x * (1.0 - s))


_ELEMENTWISE: dict[str, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]] = {
    "gelu_tanh": functools.partial(_gelu_np, approximate=True),
    "gelu": functools.partial(_gelu_np, approximate=False),
    "silu": _silu_np,
}


@functools.cache
def gaussian_moments(name: str) -> tuple[float, float, float]:
    """`(E[f(X)], E[f(X)^2], E[f'(X)^2])` for X ~ N(0, 1), by Gauss-Hermite quadrature."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(_GH_DEGREE)
    weights = weights / weights.sum()
    f, df = _ELEMENTWISE[name](nodes)
    return float(weights @ f), float(weights @ (f * f)), float(weights @ (df * df))


def _elementwise_factors(name: str) -> tuple[float, float]:
    """1/std(f(X)) and 1/std(g f'(X)) (= 1/sqrt(E[f'(X)^2]) for g independent of X)."""
    mean, second, grad_second = gaussian_moments(name)
    return _inv_std(second - mean * mean), _inv_std(grad_second)


def _elementwise(f: Callable[[Array], Array], x: Array, name: str, constraint: Constraint) -> Array:
    fwd, bwd = _elementwise_factors(name)
    fwd, (bwd,) = apply_constraint(constraint, fwd, bwd)
    return scaled_call(f, fwd, (x,), (bwd,))


def gelu(x: Array, approximate: bool = True, *, constraint: Constraint = "gmean") -> Array:
    """Unit-scaled `jax.nn.gelu`.

    Factors: 1/std(gelu(X)) forward and 1/sqrt(E[gelu'(X)^2]) backward, X ~ N(0, 1)
    (Gauss-Hermite quadrature): about 1.70 and 1.48 (either form).

    Args:
        x: the activation (tied by `constraint`).
        approximate: the tanh approximation (default, as `jax.nn.gelu`) or the erf form.
        constraint: see `Constraint`; "gmean" ties both factors to their geometric mean
            as the reference library's constraint does.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (100_000,))
        >>> round(float(U.gelu(x, constraint=None).std()), 2)
        1.0
    """
    name = "gelu_tanh" if approximate else "gelu"
    return _elementwise(
        functools.partial(jax.nn.gelu, approximate=approximate), x, name, constraint
    )


def silu(x: Array, *, constraint: Constraint = "gmean") -> Array:
    """Unit-scaled `jax.nn.silu` (swish): factors 1/std(silu(X)) and 1/sqrt(E[silu'(X)^2]).

    About 1.79 and 1.62 (Gauss-Hermite quadrature). `constraint` as for `gelu`.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (100_000,))
        >>> round(float(U.silu(x, constraint=None).std()), 2)
        1.0
    """
    return _elementwise(jax.nn.silu, x, "silu", constraint)


def silu_glu(x: Array, gate: Array, *, constraint: Constraint = "gmean") -> Array:
    """Unit-scaled gated linear unit `x * silu(gate)` (SwiGLU).

    For independent unit `x` and `gate`: output and `x` grad variance E[silu(G)^2],
    `gate` grad variance E[silu'(G)^2]; the factors are one over their square roots.

    Args:
        x: the value branch (on the path, tied by `constraint`).
        gate: the gate branch (on the path, tied by `constraint`), same shape as `x`.
        constraint: see `Constraint`; "gmean" ties all three factors to their geometric
            mean as the reference library's constraint does.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (100_000,))
        >>> g = jax.random.normal(jax.random.key(1), (100_000,))
        >>> round(float(U.silu_glu(x, g).std()), 1)
        1.0
    """
    _require_same_shape(x, gate, "x and gate")
    _, second, grad_second = gaussian_moments("silu")
    fwd, (x_bwd, gate_bwd) = apply_constraint(
        constraint, _inv_std(second), _inv_std(second), _inv_std(grad_second)
    )
    return scaled_call(lambda a, b: a * jax.nn.silu(b), fwd, (x, gate), (x_bwd, gate_bwd))


# ---------------------------------------------------------------------------------------
# Softmax: factors by a fixed-seed Monte Carlo over x, exact expectations over g.

_SOFTMAX_SAMPLES = 1 << 20  # elements drawn per estimate
_SOFTMAX_ASYMPTOTIC = 1 << 16  # above this length, the large-n limits are exact enough


@functools.cache
def softmax_moments(n: int) -> tuple[float, float, float]:
    """`(var p, var dx, E[sum p^2])` of `p = softmax(x)` over n unit-normal elements.

    `dx = p * (g - <p, g>)` for a unit-normal `g`: `E_g[dx_i^2] = p_i^2 (1 - 2 p_i + S)`,
    `S = sum p^2`, averaged over x by Monte Carlo. For large n, `n^2 var p -> e - 1` and
    `n^2 var dx -> e` (`p_i ~ exp(x_i) / (n sqrt(e))`).
    """
    if n <= 1:
        return 0.0, 0.0, float(n)
    if n > _SOFTMAX_ASYMPTOTIC:
        return (math.e - 1.0) / n**2, math.e * (1.0 + math.e / n) / n**2, math.e / n
    rows = max(16, -(-_SOFTMAX_SAMPLES // n))
    x = np.random.default_rng(_SEED).standard_normal((rows, n))
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    s = (p * p).sum(axis=-1, keepdims=True)
    var_p = float(np.mean(p * p)) - 1.0 / n**2
    var_dx = float(np.mean(p * p * (1.0 - 2.0 * p + s)))
    return var_p, var_dx, float(np.mean(s))


def softmax(x: Array, axis: int = -1, *, constraint: Constraint = "gmean") -> Array:
    """Unit-scaled `jax.nn.softmax` over `axis` (of length n).

    Factors: 1/std of the softmax and of its input gradient for unit-normal x and g,
    estimated by a fixed-seed numpy Monte Carlo cached by n (about n/sqrt(e - 1) and
    n/sqrt(e) for large n).

    Args:
        x: the activation (tied by `constraint`).
        axis: the axis to normalise over.
        constraint: see `Constraint`; "gmean" ties both factors to their geometric mean
            as the reference library's constraint does.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> x = jax.random.normal(jax.random.key(0), (256, 512))
        >>> round(float(U.softmax(x, constraint=None).std()), 1)
        1.0
    """
    n = _shape(x)[axis]
    var_p, var_dx, _ = softmax_moments(n)
    fwd, (bwd,) = apply_constraint(constraint, _inv_std(var_p), _inv_std(var_dx))
    return scaled_call(functools.partial(jax.nn.softmax, axis=axis), fwd, (x,), (bwd,))


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


def add(a: Array, b: Array, *, constraint: Constraint = "gmean") -> Array:
    """Unit-scaled sum `(a + b) / sqrt(2)` of two independent unit arrays.

    Each gradient is naturally unit: unconstrained, the factors are 1/sqrt(2) forward
    and 1 backward (one grad factor shared by `a` and `b`).

    Args:
        a, b: activations of the same shape (both on the path).
        constraint: see `Constraint`; "gmean" ties the factors to 2^(-1/4) (their
            geometric mean) as the reference library's constraint does.

    Examples:
        >>> import jax
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> a = jax.random.normal(jax.random.key(0), (100_000,))
        >>> b = jax.random.normal(jax.random.key(1), (100_000,))
        >>> round(float(U.add(a, b, constraint=None).std()), 2)
        1.0
    """
    _require_same_shape(a, b, "add's operands")
    fwd, (bwd,) = apply_constraint(constraint, 1.0 / math.sqrt(2.0), 1.0)
    return scaled_call(jnp.add, fwd, (a, b), (bwd, bwd))


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
    seq_q: int, seq_k: int, head_dim: int, is_causal: bool
) -> tuple[float, float, float, float]:
    """Variances of the output and of the q, k, v gradients of attention (value dim = head_dim).

    For unit-normal q, k, v and output gradient g, with p = softmax(q k^T / sqrt(d)) (top-left
    causal mask if `is_causal`), S_i = sum_j p_ij^2, m1 = sum_j p_ij k_j, m2 = sum_j p_ij^2 k_j:

    - var o = mean_i S_i and var dv = (seq_q/seq_k) mean_i S_i (exact over v, g);
    - var dq = mean_i [sum_j p_ij^2 |k_j|^2 - 2 m1.m2 + S_i |m1|^2] / d (exact over v, g);
    - var dk = (seq_q/seq_k) mean_i [|q_i|^2/d sum_j p_ij^2 (1 - 2 p_ij + S_i)] (the cross
      terms between rows vanish: distinct rows' gradients are independent given q, k).

    The dq and dk variances scale with the value dim over head_dim. The expectations over q
    and k are a fixed-seed Monte Carlo over a weighted set of query rows.
    """
    d = head_dim
    index, weights = _attention_rows(seq_q, is_causal)
    trials = -(-_ATTENTION_SAMPLES // index.size)
    trials = max(1, min(trials, _ATTENTION_COST // (index.size * seq_k * d)))
    rng = np.random.default_rng(_SEED)
    q = rng.standard_normal((trials, index.size, d))
    k = rng.standard_normal((trials, seq_k, d))
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(d)
    if is_causal:
        s = np.where(np.arange(seq_k)[None, :] <= index[:, None], s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    p2 = p * p
    big_s = p2.sum(axis=-1)
    m1, m2 = p @ k, p2 @ k
    dq = (p2 @ (k * k).sum(-1)[..., None])[..., 0] - 2.0 * (m1 * m2).sum(-1)
    dq = dq + big_s * (m1 * m1).sum(-1)
    dk = (q * q).sum(-1) / d * (p2 * (1.0 - 2.0 * p + big_s[..., None])).sum(-1)
    mean = lambda a: float(a.mean(axis=0) @ weights / weights.sum())
    ratio = seq_q / seq_k
    return mean(big_s), mean(dq) / d, ratio * mean(dk), ratio * mean(big_s)


def _attention(q: Array, k: Array, v: Array, mask: Array | None, is_causal: bool) -> Array:
    d = q.shape[-1]
    scores = jnp.einsum("...qd,...kd->...qk", q, k)
    scores = multiply(scores, 1.0 / math.sqrt(d))
    keep = None
    if is_causal:
        sq, sk = scores.shape[-2:]
        keep = jnp.broadcast_to(jnp.tril(jnp.ones((sq, sk), bool)), scores.shape)
    if mask is not None:
        mask = jnp.broadcast_to(mask, scores.shape)
        keep = mask if keep is None else keep & mask
    if keep is not None:
        scores = jnp.where(keep, scores, jnp.full_like(scores, jnp.finfo(scores.dtype).min))
    return jnp.einsum("...qk,...kd->...qd", jax.nn.softmax(scores, axis=-1), v)


def scaled_dot_product_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    mask: Array | None = None,
    is_causal: bool = False,
    constraint: Constraint = "gmean",
) -> Array:
    """Unit-scaled attention `softmax(q k^T / sqrt(head_dim)) @ v`.

    The factors (output, q, k and v grads) are one over the std each has for unit-normal
    inputs and output gradient, from a fixed-seed numpy Monte Carlo cached by
    (seq_q, seq_k, head_dim, is_causal); about sqrt(seq_k / e) for long sequences.

    Args:
        q: shape (..., seq_q, head_dim), leading dims batch/heads.
        k: shape (..., seq_k, head_dim).
        v: shape (..., seq_k, value_dim).
        mask: optional boolean mask broadcastable to (..., seq_q, seq_k), True where a
            query attends a key; it does not enter the factors.
        is_causal: mask keys after the query (top-left aligned, query i sees keys <= i).
        constraint: see `Constraint`; q, k and v are all on the path, and "gmean" ties
            the four factors to their geometric mean as the reference library's
            constraint does.

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
    (sq, d), (sk, dv) = shapes[0][-2:], shapes[2][-2:]
    var_o, var_dq, var_dk, var_dv = attention_moments(sq, sk, d, bool(is_causal))
    fwd, grads = apply_constraint(
        constraint,
        _inv_std(var_o),
        _inv_std(var_dq * dv / d),
        _inv_std(var_dk * dv / d),
        _inv_std(var_dv),
    )
    f = lambda q_, k_, v_: _attention(q_, k_, v_, mask, bool(is_causal))
    return scaled_call(f, fwd, (q, k, v), grads)


# ---------------------------------------------------------------------------------------
# Losses: the forward value is the true loss; only the backward is scaled.


def cross_entropy(logits: Array, labels: Array, *, reduction: str = "mean") -> Array:
    """Softmax cross-entropy with integer labels; the class axis is last.

    The value is the true loss (to log). The logits gradient is scaled to unit variance:
    per term it is `p - onehot(label)`, whose V entries have variance
    (E[sum p^2] + 1 - 2/V) / V for unit-normal logits and labels independent of them
    (E[sum p^2] by the softmax Monte Carlo); "mean" divides by the N = `labels.size`
    terms. So the factor is sqrt(V / (E[sum p^2] + 1 - 2/V)), times N for "mean".

    Args:
        logits: shape (..., V), computed in at least float32.
        labels: integer array of shape `logits.shape[:-1]`.
        reduction: "mean", "sum" or "none".

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics.unit_scaling as U
        >>> logits = jnp.zeros((4, 10))
        >>> round(float(U.cross_entropy(logits, jnp.array([0, 1, 2, 3]))), 4)
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
    logits = jnp.asarray(logits)
    vocab = logits.shape[-1]
    _, _, mean_s = softmax_moments(vocab)
    factor = _inv_std((mean_s + 1.0 - 2.0 / vocab) / vocab)
    if reduction == "mean":
        factor *= max(_size(_shape(labels)), 1)
    x = scale_bwd(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), factor)
    picked = jnp.take_along_axis(x, jnp.expand_dims(labels, -1), axis=-1)[..., 0]
    per_term = jax.nn.logsumexp(x, axis=-1) - picked
    return _reduce(per_term, reduction).astype(logits.dtype)


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
