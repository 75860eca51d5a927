"""`nvfp4_matmul`: ``x @ w`` with NVIDIA's NVFP4 training recipe simulated, forward and backward.

The three matmuls of a linear layer each take NVFP4 operands (E2M1 elements, an E4M3 scale
per block of 16 along the contracted axis, a float32 scale per tensor:
`jsa.quantization.nvfp4_fake_quantize`) and accumulate in float32:

- forward ``y = x @ w``: ``x`` in 1x16 blocks along K; ``w`` in 16x16 blocks (`"2d"`, so
  that the backward pass's ``wᵀ`` is the same quantised matrix) or 16x1 along K (`"1d"`);
- input gradient ``dx = g @ wᵀ``: ``g`` in 1x16 blocks along N, rounded stochastically
  (`stochastic_gradients`), ``wᵀ`` as above (1D: re-quantised along N);
- weight gradient ``dw = xᵀ @ g``: both along the tokens, after a random Hadamard
  transform of size 16 along the tokens (`hadamard`; the same signs for both, so the
  product is unchanged in exact arithmetic while outliers are spread), ``g`` rounded
  stochastically.

The random bits come from `key`, split as ``k_dgrad, k_wgrad, k_hadamard = split(key, 3)``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..quantization.hadamard import random_hadamard
from ..quantization.nvfp4 import nvfp4_fake_quantize

__all__ = ["nvfp4_matmul"]

_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class _Fp4Recipe:
    hadamard: bool
    stochastic_gradients: bool
    weight_blocks: str


def _weight(recipe: _Fp4Recipe, w: jax.Array) -> jax.Array:
    if recipe.weight_blocks == "2d":
        return nvfp4_fake_quantize(w, block_size=(_BLOCK, _BLOCK))
    return nvfp4_fake_quantize(w, axis=0)


def _gradient(recipe: _Fp4Recipe, g: jax.Array, axis: int, key: jax.Array) -> jax.Array:
    if recipe.stochastic_gradients:
        return nvfp4_fake_quantize(g, axis=axis, rounding="stochastic", key=key)
    return nvfp4_fake_quantize(g, axis=axis)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnums=0)
def _forward(recipe: _Fp4Recipe, x: jax.Array, w: jax.Array) -> jax.Array:
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    y = _dot(nvfp4_fake_quantize(x2, axis=1), _weight(recipe, w.astype(jnp.float32)))
    return y.reshape(*x.shape[:-1], w.shape[1]).astype(x.dtype)


@functools.partial(jax.jit, static_argnums=0)
def _backward(
    recipe: _Fp4Recipe, x: jax.Array, w: jax.Array, key: jax.Array, g: jax.Array
) -> tuple[jax.Array, jax.Array]:
    k_dgrad, k_wgrad, k_hadamard = jax.random.split(key, 3)
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    g2 = g.reshape(-1, w.shape[1]).astype(jnp.float32)
    w32 = w.astype(jnp.float32)
    if recipe.weight_blocks == "2d":
        wt = _weight(recipe, w32).T  # 16x16 blocks: the forward's quantised matrix
    else:
        wt = nvfp4_fake_quantize(w32, axis=1).T
    dx = _dot(_gradient(recipe, g2, 1, k_dgrad), wt)
    if recipe.hadamard:
        x2 = random_hadamard(x2, axis=0, key=k_hadamard, size=_BLOCK)
        g2 = random_hadamard(g2, axis=0, key=k_hadamard, size=_BLOCK)
    dw = _dot(nvfp4_fake_quantize(x2, axis=0).T, _gradient(recipe, g2, 0, k_wgrad))
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul(recipe: _Fp4Recipe, x: jax.Array, w: jax.Array, key: jax.Array) -> jax.Array:
    return _forward(recipe, x, w)


def _matmul_fwd(recipe: _Fp4Recipe, x: jax.Array, w: jax.Array, key: jax.Array) -> Any:
    return _forward(recipe, x, w), (x, w, key)


def _matmul_bwd(recipe: _Fp4Recipe, residuals: Any, g: jax.Array) -> Any:
    x, w, key = residuals
    dx, dw = _backward(recipe, x, w, key, g)
    return dx, dw, None


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def nvfp4_matmul(
    x: Any,
    w: Any,
    key: jax.Array | None = None,
    *,
    hadamard: bool = True,
    stochastic_gradients: bool = True,
    weight_blocks: str = "2d",
) -> jax.Array:
    """``x @ w`` with the NVFP4 training recipe's quantisation simulated in all three matmuls.

    See the module docstring for what each matmul quantises. Every ingredient can be
    switched off to measure what it buys.

    Args:
        x: Activations ``(..., K)``; the tokens (all leading axes together) and K must be
            multiples of 16.
        w: Weights ``(K, N)``; N a multiple of 16.
        key: PRNG key for the random Hadamard signs and the stochastic rounding of the
            gradients (required when either is on; draw a new one each step).
        hadamard: Random Hadamard transform of the weight gradient's operands.
        stochastic_gradients: Stochastic rounding of the output gradient.
        weight_blocks: ``"2d"`` (16x16) or ``"1d"`` (16x1 along the contracted axis).

    Returns:
        ``(..., N)`` in ``x``'s dtype.

    Raises:
        ValueError: shapes that 16 does not divide, mismatched shapes, a bad
            `weight_blocks`, or no key where one is needed.
        TypeError: non-floating operands.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> x, w = jnp.ones((16, 32)), jnp.full((32, 16), 0.5)
        >>> nvfp4_matmul(x, w, jax.random.key(0))[0, :2]
        Array([16., 16.], dtype=float32)
    """
    x, w = jnp.asarray(x), jnp.asarray(w)
    for name, v in (("x", x), ("w", w)):
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"nvfp4_matmul: {name} must be floating, got {v.dtype}")
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"nvfp4_matmul: x (..., K) and w (K, N) expected, got {x.shape} and {w.shape}"
        )
    tokens = x.size // x.shape[-1] if x.shape[-1] else 0
    for name, size in (("K", w.shape[0]), ("N", w.shape[1]), ("tokens", tokens)):
        if size % _BLOCK:
            raise ValueError(
                f"nvfp4_matmul: {name} = {size} is not a multiple of the block size {_BLOCK}"
            )
    if weight_blocks not in ("2d", "1d"):
        raise ValueError(f"nvfp4_matmul: weight_blocks must be '2d' or '1d', got {weight_blocks!r}")
    if key is None:
        if hadamard or stochastic_gradients:
            raise ValueError(
                "nvfp4_matmul: the random Hadamard transform and stochastic rounding need a "
                "PRNG key: pass key=jax.random.key(step), or switch both off"
            )
        key = jax.random.key(0)  # unused
    recipe = _Fp4Recipe(bool(hadamard), bool(stochastic_gradients), weight_blocks)
    return _matmul(recipe, x, w, key)
