"""`fp4_matmul`: ``x @ w`` with a 4-bit training recipe simulated, forward and backward.

The three matmuls of a linear layer each take 4-bit operands and accumulate in float32.
The recipe's format (`FP4_RECIPES`):

- ``"nvfp4"``: NVIDIA's NVFP4 (E2M1 elements, an E4M3 scale per block of 16 along the
  contracted axis, a float32 scale per tensor: `jsa.quantization.nvfp4_fake_quantize`);
- ``"mxfp4"``: OCP MXFP4 (E2M1 elements, an E8M0 power-of-two scale per block of 32:
  `jsa.quantization.block_fake_quantize(..., "mxfp4_e2m1")`), the scale rounded
  ``"up"`` (no element saturates) or ``"floor"`` (the OCP rule) by `scale_rounding`;
- ``"fp4_tensor"``: E2M1 elements with one float32 scale per tensor (``amax / 6``), no
  blocks: the naive baseline the block formats improve on.

With ``B`` the recipe's block size (16, 32, 16):

- forward ``y = x @ w``: ``x`` in 1xB blocks along K; ``w`` in BxB blocks (`"2d"`, so
  that the backward pass's ``wᵀ`` is the same quantised matrix) or Bx1 along K (`"1d"`);
- input gradient ``dx = g @ wᵀ``: ``g`` in 1xB blocks along N, rounded stochastically
  (`stochastic_gradients`), ``wᵀ`` as above (1D: re-quantised along N);
- weight gradient ``dw = xᵀ @ g``: both along the tokens, after a random Hadamard
  transform of size B along the tokens (`hadamard`; the same signs for both, so the
  product is unchanged in exact arithmetic while outliers are spread), ``g`` rounded
  stochastically.

The random bits come from `key`, split as ``k_dgrad, k_wgrad, k_hadamard = split(key, 3)``.

Under `jsa.autoscale`, the quantisers act on the stored data of ScaledArray operands and
keep their scales (every recipe's quantiser commutes with power-of-two scales), so outputs
and gradients stay ScaledArrays and values beyond the data dtype's range are safe.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax import lax

from ..lax.scaling_primitives import apply_to_data
from ..quantization._bits import Rounding
from ..quantization.float_quantize import float_quantize
from ..quantization.hadamard import random_hadamard
from ..quantization.mx_formats import SCALE_ROUNDINGS, ScaleRounding
from ..quantization.mx_quantize import block_fake_quantize
from ..quantization.nvfp4 import nvfp4_fake_quantize

__all__ = ["FP4_RECIPES", "fp4_matmul", "nvfp4_matmul", "recipe_block_size"]

FP4_RECIPES = ("nvfp4", "mxfp4", "fp4_tensor")
"""The formats `fp4_matmul` and `jsa.ops.simulate_fp4` simulate.

Examples:
    >>> import jax_scaled_arithmetics as jsa
    >>> jsa.ops.FP4_RECIPES
    ('nvfp4', 'mxfp4', 'fp4_tensor')
"""
_BLOCK_SIZES = {"nvfp4": 16, "mxfp4": 32, "fp4_tensor": 16}
_E2M1_MAX = 6.0


def recipe_block_size(recipe: str) -> int:
    """The block size (and Hadamard size) of a recipe: what K, N and the tokens must divide."""
    return _BLOCK_SIZES[recipe]


@dataclasses.dataclass(frozen=True)
class _Quantizer:
    """One operand's fake quantisation: 1-D blocks along `axis` of a 2-D array, or the
    weight's 2D tiles (`axis` None); stochastic rounding when called with a key. Hashable,
    for `apply_to_data`: under `jsa.autoscale` it acts on the stored data and keeps the
    scale (the recipes' quantisers commute with power-of-two scales)."""

    format: str
    scale_rounding: ScaleRounding
    axis: int | None

    @property
    def block(self) -> int:
        return _BLOCK_SIZES[self.format]

    def __call__(self, v: jax.Array, key: jax.Array | None = None) -> jax.Array:
        v = v.astype(jnp.float32)
        if self.axis is None and self.format != "fp4_tensor":
            return self._tiles(v)
        axis = 0 if self.axis is None else self.axis
        rounding: Rounding = "nearest" if key is None else "stochastic"
        if self.format == "nvfp4":
            return nvfp4_fake_quantize(v, axis=axis, rounding=rounding, key=key)
        if self.format == "mxfp4":
            return block_fake_quantize(
                v, "mxfp4_e2m1", self.block, axis, rounding, key,
                scale_rounding=self.scale_rounding,
            )  # fmt: skip
        return _per_tensor(v, key)

    def _tiles(self, w: jax.Array) -> jax.Array:
        """``w (K, N)`` in BxB blocks."""
        b = self.block
        if self.format == "nvfp4":
            return nvfp4_fake_quantize(w, block_size=(b, b))
        return block_fake_quantize(w, "mxfp4_e2m1", (b, b), scale_rounding=self.scale_rounding)


@dataclasses.dataclass(frozen=True)
class _Fp4Recipe:
    format: str
    hadamard: bool
    stochastic_gradients: bool
    weight_blocks: str
    scale_rounding: ScaleRounding

    @property
    def block(self) -> int:
        return _BLOCK_SIZES[self.format]

    def quantize(self, v: jax.Array, axis: int | None, key: jax.Array | None = None) -> jax.Array:
        """`v` (2-D) in 1-D blocks along `axis` (None: 2D weight tiles), stochastically
        rounded given a key; on the stored data under `autoscale`."""
        fn = _Quantizer(self.format, self.scale_rounding, axis)
        return apply_to_data(fn, v) if key is None else apply_to_data(fn, v, key)

    def weight(self, w: jax.Array) -> jax.Array:
        """The forward weight ``(K, N)``: BxB blocks (`"2d"`) or Bx1 along K."""
        return self.quantize(w, None if self.weight_blocks == "2d" else 0)

    def weight_transposed(self, w: jax.Array) -> jax.Array:
        """``wᵀ (N, K)`` for the input gradient: the forward's matrix with 2D blocks."""
        if self.weight_blocks == "2d" or self.format == "fp4_tensor":
            return self.weight(w).T
        return self.quantize(w, 1).T

    def gradient(self, g: jax.Array, axis: int, key: jax.Array) -> jax.Array:
        return self.quantize(g, axis, key if self.stochastic_gradients else None)


def _per_tensor(v: jax.Array, key: jax.Array | None) -> jax.Array:
    """E2M1 elements with one float32 scale ``amax * float32(1 / 6)`` (at least ``2**-126``;
    1 for an all-zero tensor). NaN and infinities stay NaN and saturate."""
    f32 = jnp.float32
    amax = jnp.max(jnp.where(jnp.isfinite(v), jnp.abs(v), f32(0)))
    # A product with the rounded reciprocal: XLA may rewrite a division by a constant so.
    scale = jnp.where(amax == 0, f32(1), jnp.maximum(amax * f32(1 / _E2M1_MAX), f32(2.0**-126)))
    rounding: Rounding = "nearest" if key is None else "stochastic"
    q = float_quantize(v / scale, "float4_e2m1fn", rounding, saturate=True, key=key)
    return q * scale


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnums=0)
def _forward(recipe: _Fp4Recipe, x: jax.Array, w: jax.Array) -> jax.Array:
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    y = _dot(recipe.quantize(x2, 1), recipe.weight(w.astype(jnp.float32)))
    return y.reshape(*x.shape[:-1], w.shape[1]).astype(x.dtype)


@functools.partial(jax.jit, static_argnums=0)
def _backward(
    recipe: _Fp4Recipe, x: jax.Array, w: jax.Array, key: jax.Array, g: jax.Array
) -> tuple[jax.Array, jax.Array]:
    k_dgrad, k_wgrad, k_hadamard = jax.random.split(key, 3)
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    g2 = g.reshape(-1, w.shape[1]).astype(jnp.float32)
    dx = _dot(recipe.gradient(g2, 1, k_dgrad), recipe.weight_transposed(w.astype(jnp.float32)))
    if recipe.hadamard:
        x2 = random_hadamard(x2, axis=0, key=k_hadamard, size=recipe.block)
        g2 = random_hadamard(g2, axis=0, key=k_hadamard, size=recipe.block)
    dw = _dot(recipe.quantize(x2, 0).T, recipe.gradient(g2, 0, k_wgrad))
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


def fp4_matmul(
    x: Any,
    w: Any,
    key: jax.Array | None = None,
    *,
    recipe: str = "nvfp4",
    hadamard: bool = True,
    stochastic_gradients: bool = True,
    weight_blocks: str = "2d",
    scale_rounding: str = "up",
) -> jax.Array:
    """``x @ w`` with a 4-bit training recipe's quantisation simulated in all three matmuls.

    See the module docstring for what each matmul quantises. Every ingredient can be
    switched off to measure what it buys.

    Args:
        x: Activations ``(..., K)``; the tokens (all leading axes together) and K must be
            multiples of the recipe's block size (16 for NVFP4 and per tensor, 32 for
            MXFP4).
        w: Weights ``(K, N)``; N a multiple of the block size.
        key: PRNG key for the random Hadamard signs and the stochastic rounding of the
            gradients (required when either is on; draw a new one each step).
        recipe: ``"nvfp4"``, ``"mxfp4"`` or ``"fp4_tensor"`` (`FP4_RECIPES`).
        hadamard: Random Hadamard transform of the weight gradient's operands.
        stochastic_gradients: Stochastic rounding of the output gradient.
        weight_blocks: ``"2d"`` (BxB) or ``"1d"`` (Bx1 along the contracted axis); the
            same for ``"fp4_tensor"``, which has no blocks.
        scale_rounding: MXFP4's E8M0 block scales: ``"up"`` (default, as Mishra et al.
            2025 recommend) or ``"floor"`` (the OCP rule); the other recipes ignore it.

    Returns:
        ``(..., N)`` in ``x``'s dtype.

    Raises:
        ValueError: an unknown recipe, shapes that the block size does not divide,
            mismatched shapes, a bad `weight_blocks` or `scale_rounding`, or no key where
            one is needed.
        TypeError: non-floating operands.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> x, w = jnp.ones((32, 32)), jnp.full((32, 32), 0.5)
        >>> fp4_matmul(x, w, jax.random.key(0), recipe="mxfp4")[0, :2]
        Array([16., 16.], dtype=float32)
    """
    if recipe not in FP4_RECIPES:
        raise ValueError(f"fp4_matmul: recipe must be one of {FP4_RECIPES}, got {recipe!r}")
    return _checked_matmul(
        "fp4_matmul", x, w, key, recipe, hadamard, stochastic_gradients, weight_blocks,
        scale_rounding,
    )  # fmt: skip


def _checked_matmul(
    name: str,
    x: Any,
    w: Any,
    key: jax.Array | None,
    recipe: str,
    hadamard: bool,
    stochastic_gradients: bool,
    weight_blocks: str,
    scale_rounding: str,
) -> jax.Array:
    x, w = jnp.asarray(x), jnp.asarray(w)
    for operand, v in (("x", x), ("w", w)):
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"{name}: {operand} must be floating, got {v.dtype}")
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"{name}: x (..., K) and w (K, N) expected, got {x.shape} and {w.shape}")
    block = _BLOCK_SIZES[recipe]
    tokens = x.size // x.shape[-1] if x.shape[-1] else 0
    for axis_name, size in (("K", w.shape[0]), ("N", w.shape[1]), ("tokens", tokens)):
        if size % block:
            raise ValueError(
                f"{name}: {axis_name} = {size} is not a multiple of the block size {block}"
            )
    if weight_blocks not in ("2d", "1d"):
        raise ValueError(f"{name}: weight_blocks must be '2d' or '1d', got {weight_blocks!r}")
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(
            f"{name}: scale_rounding must be one of {SCALE_ROUNDINGS}, got {scale_rounding!r}"
        )
    if key is None:
        if hadamard or stochastic_gradients:
            raise ValueError(
                f"{name}: the random Hadamard transform and stochastic rounding need a "
                "PRNG key: pass key=jax.random.key(step), or switch both off"
            )
        key = jax.random.key(0)  # unused
    config = _Fp4Recipe(
        recipe,
        bool(hadamard),
        bool(stochastic_gradients),
        weight_blocks,
        cast(ScaleRounding, scale_rounding),
    )
    return _matmul(config, x, w, key)


def nvfp4_matmul(
    x: Any,
    w: Any,
    key: jax.Array | None = None,
    *,
    hadamard: bool = True,
    stochastic_gradients: bool = True,
    weight_blocks: str = "2d",
) -> jax.Array:
    """``x @ w`` with the NVFP4 training recipe simulated: ``fp4_matmul(x, w, key,
    recipe="nvfp4", ...)`` (K, N and the tokens multiples of 16; errors as there).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> x, w = jnp.ones((16, 32)), jnp.full((32, 16), 0.5)
        >>> nvfp4_matmul(x, w, jax.random.key(0))[0, :2]
        Array([16., 16.], dtype=float32)
    """
    return _checked_matmul(
        "nvfp4_matmul", x, w, key, "nvfp4", hadamard, stochastic_gradients, weight_blocks, "up"
    )
