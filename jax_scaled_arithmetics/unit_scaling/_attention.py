"""Unit-scaled `scaled_dot_product_attention`.

Factors by a fixed-seed numpy Monte Carlo over q and k, exact over v and g
(`attention_moments`, cached by shapes, causality and logit scale). Conventions shared by
all ops in `_ops_common`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core import prng
from ..core.types import Array
from ._fwd_bwd import Constraint, apply_constraint, multiply, scaled_call
from ._ops_common import SEED as _SEED
from ._ops_common import inv_std as _inv_std
from ._ops_common import positive_number as _positive_number
from ._ops_common import shape_of as _shape
from ._ops_common import static_number as _static_number

__all__ = ["attention_moments", "scaled_dot_product_attention"]


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
        kept = prng.bernoulli(key, 1.0 - dropout_p, weights.shape)
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
