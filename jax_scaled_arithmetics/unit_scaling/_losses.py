"""Unit-scaled losses: `cross_entropy`, `mse_loss`.

The forward value is the true loss; only the backward is scaled.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.dtypes import compute_dtype
from ..core.types import Array
from ._fwd_bwd import multiply, scale_bwd
from ._ops_common import broadcast_vector as _broadcast_vector
from ._ops_common import inv_std as _inv_std
from ._ops_common import positive_number as _positive_number
from ._ops_common import require_float as _require_float
from ._ops_common import require_same_shape as _require_same_shape
from ._ops_common import shape_of as _shape
from ._ops_common import size as _size
from ._ops_common import static_number as _static_number
from ._softmax import softmax_moments

__all__ = ["cross_entropy", "cross_entropy_second_moment", "mse_loss"]


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}.")


def _reduce(per_term: Array, reduction: str) -> Array:
    if reduction == "mean":
        return jnp.mean(per_term)
    if reduction == "sum":
        return jnp.sum(per_term)
    return per_term


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
    compute = compute_dtype(logits.dtype)
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
    compute = compute_dtype(pred.dtype, target.dtype)
    diff = scale_bwd(pred.astype(compute), factor) - scale_bwd(target.astype(compute), factor)
    return _reduce(diff * diff, reduction).astype(pred.dtype)
