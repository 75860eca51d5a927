"""Low-precision training recipes from the literature, as compositions of `jsa.optax` parts.

Each recipe wraps an optax optimizer with :func:`~jax_scaled_arithmetics.optax.quantize`
and :func:`~jax_scaled_arithmetics.optax.kahan_summation`, and says how the parameters are
stored (`cast_params`) and updated (`apply_updates`, a partial
:func:`~jax_scaled_arithmetics.optax.apply_updates`); :meth:`Recipe.table` lists how each
quantity is stored and rounded.

Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jax_scaled_arithmetics as jsa
    >>> recipe = jsa.optax.bf16_stochastic(optax.adam(1e-3))
    >>> params = recipe.cast_params({"w": jnp.ones(3)})
    >>> state = recipe.optimizer.init(params)
    >>> updates, state = recipe.optimizer.update({"w": jnp.ones(3, jnp.bfloat16)}, state, params)
    >>> params = recipe.apply_updates(params, updates, key=jax.random.key(0))
    >>> params["w"].dtype, state.inner_state[0].mu["w"].dtype
    (dtype(bfloat16), dtype(bfloat16))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ..core.datatype import is_floating, is_scaled_leaf
from ..lax.scaling_primitives import apply_to_data
from ..ops.casts import quantizer
from ..quantization import FloatFormat
from .compensated import kahan_summation
from .quantized import FormatSpec, apply_updates, quantize

__all__ = ["FP16_169", "Recipe", "bf16_kahan", "bf16_stochastic", "ibm8_like"]

FP16_169 = FloatFormat.custom(6, 9, name="fp16_169")
"""The 16-bit float of Wang et al. (2018): 1 sign, 6 exponent (bias 31) and 9 mantissa bits."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A training recipe: the optimizer, how parameters are stored and updated, and its table.

    Attributes:
        name: the recipe's function name.
        optimizer: the wrapped optax transformation (`init`, `update(grads, state, params)`).
        apply_updates: `apply_updates(params, updates, key=None)`, the recipe's weight
            rounding (`key` is needed where it is stochastic: pass a new one each step).
        cast_params: float32 parameters to the recipe's storage.
        model_quantizer: where the recipe quantizes the model itself, a
            :func:`~jax_scaled_arithmetics.ops.quantizer` `q(x, key=None)` to apply to
            weights and activations in the forward pass (it rounds their gradients on the
            way back); `None` otherwise.
        rows: `(quantity, stored as, rounding, done by)` for each quantity.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> import jax_scaled_arithmetics as jsa
        >>> recipe = jsa.optax.bf16_stochastic(optax.sgd(0.1))
        >>> recipe.name
        'bf16_stochastic'
        >>> recipe.cast_params({"w": jnp.ones(2)})["w"].dtype
        dtype(bfloat16)
    """

    name: str
    optimizer: optax.GradientTransformationExtraArgs
    apply_updates: Callable[..., Any]
    cast_params: Callable[[Any], Any]
    model_quantizer: Callable[..., Any] | None
    rows: tuple[tuple[str, str, str, str], ...]

    def table(self) -> str:
        """The per-quantity table, in Markdown.

        Examples:
            >>> import optax, jax_scaled_arithmetics as jsa
            >>> print(jsa.optax.bf16_kahan(optax.adam(1e-3)).table().splitlines()[3])
            | compensation buffer | bfloat16 | nearest | `kahan_summation(..., jnp.bfloat16)` |
        """
        lines = ["| quantity | stored as | rounding | done by |", "| --- | --- | --- | --- |"]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)


def _cast(dtype: Any) -> Callable[[Any], Any]:
    def cast(params: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda p: p.astype(dtype) if is_floating(p) else p, params, is_leaf=is_scaled_leaf
        )

    return cast


def _apply(**kwargs: Any) -> Callable[..., Any]:
    def apply(params: Any, updates: Any, key: Any = None) -> Any:
        return apply_updates(params, updates, key=key, **kwargs)

    return apply


def bf16_stochastic(opt: optax.GradientTransformation, *, key: Any = 0) -> Recipe:
    """Pure bfloat16 training with stochastic weight rounding (Zamirai et al., 2020).

    Reproduces the stochastic-rounding variant of "Revisiting BFloat16 Training"
    (Zamirai, Zhang, Aberger and De Sa, arXiv:2010.06192): weights and optimizer state
    stored in bfloat16, no float32 master copy; the weight update `p + u` is rounded to
    bfloat16 stochastically, so updates below half a bfloat16 ulp (`2**-9` relative) still
    move the weights on average. The optimizer state is rounded to nearest
    (`quantize(opt, state="bfloat16")`; a no-op when the parameters, hence the state, are
    already bfloat16, and a simulation when they are float32). The paper computes the
    update itself in bfloat16 arithmetic; here it computes in the dtypes optax gives it.

    Args:
        opt: the optimizer, e.g. `optax.adam(1e-3)` (the paper's are SGD and Adam).
        key: seed of :func:`~jax_scaled_arithmetics.optax.quantize` (unused by nearest
            rounding, kept for symmetry); the weights' keys are passed to `apply_updates`.

    Examples:
        >>> import optax, jax_scaled_arithmetics as jsa
        >>> print(jsa.optax.bf16_stochastic(optax.adam(1e-3)).table())
        | quantity | stored as | rounding | done by |
        | --- | --- | --- | --- |
        | weights | bfloat16 | stochastic | `apply_updates(rounding="stochastic")` |
        | weight update `p + u` | float32, then rounded | - | `apply_updates` |
        | optimizer state | bfloat16 | nearest | `quantize(state="bfloat16")` |
        | gradients | as the model computes them (bfloat16 weights) | - | model |
    """
    return Recipe(
        name="bf16_stochastic",
        optimizer=quantize(opt, state="bfloat16", key=key),
        apply_updates=_apply(rounding="stochastic"),
        cast_params=_cast(jnp.bfloat16),
        model_quantizer=None,
        rows=(
            ("weights", "bfloat16", "stochastic", '`apply_updates(rounding="stochastic")`'),
            ("weight update `p + u`", "float32, then rounded", "-", "`apply_updates`"),
            ("optimizer state", "bfloat16", "nearest", '`quantize(state="bfloat16")`'),
            ("gradients", "as the model computes them (bfloat16 weights)", "-", "model"),
        ),
    )


def bf16_kahan(opt: optax.GradientTransformation, *, key: Any = 0) -> Recipe:
    """Pure bfloat16 training with Kahan-compensated weight updates (Zamirai et al., 2020).

    Reproduces the Kahan-summation variant of "Revisiting BFloat16 Training" (Zamirai,
    Zhang, Aberger and De Sa, arXiv:2010.06192): weights, optimizer state and the
    compensation buffer all in bfloat16; the weight update is rounded to nearest and
    what it loses is carried to the next step by the buffer
    (`kahan_summation(quantize(opt, state="bfloat16"), jnp.bfloat16)`). With Adam: 8
    bytes per parameter (2 for the weight, 4 for the state, 2 for the buffer).

    Args:
        opt: the optimizer, e.g. `optax.adam(1e-3)`.
        key: seed of :func:`~jax_scaled_arithmetics.optax.quantize` (unused by nearest
            rounding).

    Examples:
        >>> import optax, jax_scaled_arithmetics as jsa
        >>> recipe = jsa.optax.bf16_kahan(optax.sgd(0.1, momentum=0.9))
        >>> recipe.model_quantizer is None, len(recipe.rows)
        (True, 5)
    """
    return Recipe(
        name="bf16_kahan",
        optimizer=kahan_summation(quantize(opt, state="bfloat16", key=key), jnp.bfloat16),
        apply_updates=_apply(),
        cast_params=_cast(jnp.bfloat16),
        model_quantizer=None,
        rows=(
            (
                "weights",
                "bfloat16",
                "nearest, Kahan-compensated",
                "`kahan_summation` + `apply_updates`",
            ),
            ("compensation buffer", "bfloat16", "nearest", "`kahan_summation(..., jnp.bfloat16)`"),
            ("weight update `p + u + c`", "float32, then rounded", "-", "`kahan_summation`"),
            ("optimizer state", "bfloat16", "nearest", '`quantize(state="bfloat16")`'),
            ("gradients", "as the model computes them (bfloat16 weights)", "-", "model"),
        ),
    )


@dataclasses.dataclass(frozen=True)
class _ToFormat:
    """Round the data of a float32 array to a simulated format (nearest)."""

    format: FloatFormat

    def __call__(self, x: jax.Array) -> jax.Array:
        return FormatSpec(self.format, "nearest")(x)


def ibm8_like(opt: optax.GradientTransformation, *, key: Any = 0) -> Recipe:
    """8-bit floating point training after Wang et al. (2018), as far as it is expressible.

    Follows "Training Deep Neural Networks with 8-bit Floating Point Numbers" (Wang,
    Choi, Brand, Chen and Gopalakrishnan, NeurIPS 2018): weights, activations, errors and
    weight gradients of the matrix multiplications in an 8-bit float with 5 exponent and
    2 mantissa bits (here float8_e5m2), and the weight update, with its master weights,
    in a 16-bit float with 6 exponent and 9 mantissa bits (:data:`FP16_169`) and
    stochastic rounding, so no 32-bit weight copy is kept. Here:

    - model side: `model_quantizer = jsa.ops.quantizer("float8_e5m2", "float8_e5m2")`,
      to apply to the weights and activations that enter a matmul (forward: the operand
      is rounded to float8_e5m2; backward: the gradient reaching it is too). The
      gradients also enter the optimizer rounded to float8_e5m2 (`grad`, idempotent on
      already rounded ones);
    - optimizer state (SGD's momentum in the paper) and updates: FP16_169, stochastic;
    - weights: `p + u` computed in float32, rounded stochastically to FP16_169 and stored
      in float32 (`apply_updates(format=FP16_169, rounding="stochastic")`).

    Left out: the paper's chunk-based accumulation (dot products summed in FP16 chunks of
    64 terms, then across chunks); XLA accumulates matmuls in float32 and jsa cannot
    change that, so the accumulation is more precise here than in the paper. The 8-bit
    weight copy is rounded on the fly in each forward pass rather than stored. Which
    layers run in 8 bits (all matmuls, or all but the first and last) is the model's
    choice. Loss scaling is not part of the recipe: float8_e5m2 flushes values below
    2**-16 to zero, so use a loss scale with plain arrays, or ScaledArrays under
    `jsa.autoscale` (the quantizers then act on the data, the scale keeps the range).

    Args:
        opt: the optimizer, e.g. `optax.sgd(0.1, momentum=0.9)` as in the paper.
        key: seed of the stochastic rounding of state and updates.

    Examples:
        >>> import jax.numpy as jnp, optax, jax_scaled_arithmetics as jsa
        >>> recipe = jsa.optax.ibm8_like(optax.sgd(0.1, momentum=0.9))
        >>> recipe.cast_params({"w": jnp.array([1.0 + 2.0**-12])})["w"]  # 9 mantissa bits
        Array([1.], dtype=float32)
        >>> recipe.model_quantizer(jnp.array([1.1, 3.3]))  # float8_e5m2
        Array([1. , 3.5], dtype=float32)
    """
    fp169 = (FP16_169, "stochastic")
    to_fp169 = _ToFormat(FP16_169)

    def cast_params(params: Any) -> Any:
        params = _cast(jnp.float32)(params)
        return jax.tree_util.tree_map(
            lambda p: apply_to_data(to_fp169, p) if is_floating(p) else p,
            params,
            is_leaf=is_scaled_leaf,
        )

    return Recipe(
        name="ibm8_like",
        optimizer=quantize(opt, grad="float8_e5m2", state=fp169, update=fp169, key=key),
        apply_updates=_apply(rounding="stochastic", format=FP16_169),
        cast_params=cast_params,
        model_quantizer=quantizer("float8_e5m2", "float8_e5m2"),
        rows=(
            (
                "weights (master copy)",
                "FP16_169 values in float32",
                "stochastic",
                '`apply_updates(format=FP16_169, rounding="stochastic")`',
            ),
            (
                "weights and activations in matmuls",
                "float8_e5m2 (simulated)",
                "nearest",
                "`model_quantizer` (forward)",
            ),
            (
                "gradients (errors, weight gradients)",
                "float8_e5m2 (simulated)",
                "nearest",
                '`model_quantizer` (backward), `quantize(grad="float8_e5m2")`',
            ),
            ("optimizer state", "FP16_169 (simulated)", "stochastic", "`quantize(state=...)`"),
            ("updates", "FP16_169 (simulated)", "stochastic", "`quantize(update=...)`"),
            ("matmul accumulation", "float32 (paper: FP16 chunks of 64)", "-", "XLA"),
        ),
    )
