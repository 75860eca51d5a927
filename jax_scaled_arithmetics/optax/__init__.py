"""Optax hooks for low-precision training: scaled states, quantization, compensation, recipes.

One module per idea:

- :mod:`~jax_scaled_arithmetics.optax.scaled`: optimizer states stored as low-precision
  ScaledArrays (:func:`scaled_state`, :func:`scale_optimizer`), and :func:`state_nbytes`.
- :mod:`~jax_scaled_arithmetics.optax.quantized`: per-quantity quantization, gradients,
  state and updates (:func:`quantize`), and the weights (:func:`apply_updates`, nearest or
  stochastic rounding, to the parameters' dtype or a simulated format).
- :mod:`~jax_scaled_arithmetics.optax.compensated`: Kahan-compensated weight updates
  (:func:`kahan_summation`).
- :mod:`~jax_scaled_arithmetics.optax.recipes`: named compositions of the above from the
  literature (:func:`bf16_stochastic`, :func:`bf16_kahan`, :func:`ibm8_like`).
- :mod:`~jax_scaled_arithmetics.optax.accumulation`: gradient accumulation over microbatches
  with the one-batch scales (:func:`accumulate_gradients`, :func:`split_microbatches`,
  :func:`multi_steps`).

Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jax_scaled_arithmetics as jsa
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> opt = jsa.optax.kahan_summation(optax.sgd(1e-3))
    >>> state = opt.init(params)
    >>> for _ in range(10):  # each step 1e-3, below half a bfloat16 ulp at 1 (2**-8)
    ...     updates, state = opt.update({"w": jnp.ones(3)}, state, params)
    ...     params = optax.apply_updates(params, updates)
    >>> params["w"]  # 1 - 10 * 1e-3, to bfloat16 precision; without Kahan it stays 1
    Array([0.988281, 0.988281, 0.988281], dtype=bfloat16)
"""

from .accumulation import accumulate_gradients as accumulate_gradients
from .accumulation import multi_steps as multi_steps
from .accumulation import split_microbatches as split_microbatches
from .compensated import KahanState as KahanState
from .compensated import kahan_summation as kahan_summation
from .quantized import QuantizeSpec as QuantizeSpec
from .quantized import QuantizeState as QuantizeState
from .quantized import apply_updates as apply_updates
from .quantized import quantize as quantize
from .recipes import Recipe as Recipe
from .recipes import bf16_kahan as bf16_kahan
from .recipes import bf16_stochastic as bf16_stochastic
from .recipes import ibm8_like as ibm8_like
from .scaled import default_data_exponent as default_data_exponent
from .scaled import scale_optimizer as scale_optimizer
from .scaled import scaled_state as scaled_state
from .scaled import state_nbytes as state_nbytes

__all__ = [
    "KahanState",
    "QuantizeSpec",
    "QuantizeState",
    "Recipe",
    "accumulate_gradients",
    "apply_updates",
    "bf16_kahan",
    "bf16_stochastic",
    "default_data_exponent",
    "ibm8_like",
    "kahan_summation",
    "multi_steps",
    "quantize",
    "scale_optimizer",
    "scaled_state",
    "split_microbatches",
    "state_nbytes",
]
