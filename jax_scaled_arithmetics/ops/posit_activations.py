"""Posit activation shortcuts: sigmoid and tanh from bit operations on ``posit<n, 0>`` codes.

For ``es = 0`` posits, flipping the sign bit of a code and shifting it right by two
bits gives (the code of) an approximation of ``sigmoid`` (Gustafson, "Beating floating
point at its own game", 2017), and ``tanh(x) = 2 * sigmoid(2x) - 1`` follows with two
more posit operations that are exact or nearly so (Cococcioni et al., "A fast
approximation of the hyperbolic tangent when using posit numbers", 2020). These are the
cheap activations of posit hardware; here they are simulated in float32, bit-exactly.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ..core.dtypes import compute_dtype
from ..quantization import posit_from_bits, posit_quantize, posit_to_bits
from ..quantization.formats import POSIT_MAX_NBITS

__all__ = ["posit_sigmoid", "posit_tanh"]

MIN_NBITS = 4


def _check_nbits(nbits: Any) -> int:
    top = POSIT_MAX_NBITS[0]
    if isinstance(nbits, bool) or not isinstance(nbits, int) or not MIN_NBITS <= nbits <= top:
        raise ValueError(f"nbits must be an integer in [{MIN_NBITS}, {top}], got {nbits!r}")
    return nbits


def _input(x: Any, fn: str) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize > 4:
        raise TypeError(f"{fn} expects a float array of at most 32 bits, got {x.dtype.name}")
    return x


def _fast_sigmoid_codes(codes: jax.Array, nbits: int) -> jax.Array:
    """Flip the sign bit, shift right by two (on the low `nbits` bits)."""
    codes = codes.astype(jnp.uint32)
    return jnp.right_shift(codes ^ (1 << (nbits - 1)), 2)


def _saturated_codes(x: jax.Array, nbits: int) -> jax.Array:
    """posit<nbits, 0> codes of `x`, with ±inf saturated to ±maxpos instead of NaR."""
    codes = posit_to_bits(x, nbits, 0).astype(jnp.uint32)
    maxpos = 2 ** (nbits - 1) - 1
    codes = jnp.where(x == jnp.inf, maxpos, codes)
    return jnp.where(x == -jnp.inf, 2**nbits - maxpos, codes)


@functools.partial(jax.jit, static_argnames=("nbits",))
def _posit_sigmoid_impl(x: jax.Array, nbits: int) -> jax.Array:
    codes = _fast_sigmoid_codes(_saturated_codes(x, nbits), nbits)
    out = posit_from_bits(codes, nbits, 0)
    return jnp.where(jnp.isnan(x), jnp.nan, out).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("nbits",))
def _posit_tanh_impl(x: jax.Array, nbits: int) -> jax.Array:
    codes = _saturated_codes(x, nbits)
    magnitude = jnp.abs(posit_from_bits(codes, nbits, 0))  # the input as a posit
    doubled = posit_quantize(2 * magnitude, nbits, 0)  # rounds only when |x| >= 1
    s = posit_from_bits(_fast_sigmoid_codes(posit_to_bits(doubled, nbits, 0), nbits), nbits, 0)
    out = 2 * s - 1  # s in [1/2, 1): exact, a posit<n, 0> value
    # jnp.signbit takes no 8-bit dtype: the sign of the value widened (-0 stays -0).
    out = jnp.where(jnp.signbit(x.astype(compute_dtype(x.dtype))), -out, out)
    return jnp.where(jnp.isnan(x), jnp.nan, out).astype(x.dtype)


def _exact_grad(impl: Any, exact: Any) -> Any:
    @functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
    def fn(x: jax.Array, nbits: int) -> jax.Array:
        return impl(x, nbits)

    @fn.defjvp
    def fn_jvp(nbits: int, primals: Any, tangents: Any) -> tuple[jax.Array, jax.Array]:
        (x,), (t,) = primals, tangents
        _, slope = jax.jvp(exact, (x.astype(jnp.float32),), (jnp.ones(x.shape, jnp.float32),))
        return fn(x, nbits), (t * slope.astype(t.dtype)).astype(t.dtype)

    return fn


_posit_sigmoid = _exact_grad(_posit_sigmoid_impl, jax.nn.sigmoid)
_posit_tanh = _exact_grad(_posit_tanh_impl, jnp.tanh)


def posit_sigmoid(x: Any, nbits: int = 8) -> jax.Array:
    """The posit fast sigmoid: flip the sign bit of the ``posit<nbits, 0>`` code, shift right by 2.

    `x` is rounded to ``posit<nbits, 0>`` (nearest; ±inf saturate to ±maxpos), its code
    ``c`` becomes ``(c ^ 2**(nbits-1)) >> 2``, and that code's value is returned, in the
    dtype of `x`: always a ``posit<nbits, 0>`` value in ``[0, 1)``; NaN stays NaN.

    Maximum absolute error against ``jax.nn.sigmoid`` (measured exhaustively, tested):

    * ``nbits=8``: 0.0607 at the 255 posit inputs (the worst near ``x = 3.4``, where the
      shortcut gives 0.906), 0.0627 over all real inputs (their rounding to the posit
      included).
    * ``nbits=16``: 0.0491, at posit inputs and over all real inputs.

    More bits do not make it exact: the shortcut is a fixed piecewise approximation of
    the sigmoid's shape (``0.5 + x/4`` on ``[-1, 1]``, linear between consecutive powers
    of two beyond), which more bits only sample more finely.

    Gradient: that of the exact sigmoid (a straight-through estimator).

    Args:
        x: Float array (up to 32 bits).
        nbits: Posit width, 4 to 26.

    Returns:
        An array of the shape and dtype of `x`.

    Raises:
        ValueError: for `nbits` out of range.
        TypeError: for non-float inputs.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> jsa.ops.posit_sigmoid(jnp.array([-1.0, 0.0, 1.0, 2.0])).tolist()
        [0.25, 0.5, 0.75, 0.875]
    """
    return _posit_sigmoid(_input(x, "posit_sigmoid"), _check_nbits(nbits))


def posit_tanh(x: Any, nbits: int = 8) -> jax.Array:
    """The posit fast tanh: ``tanh(x) = 2 * sigmoid(2x) - 1`` with the fast sigmoid.

    For ``x >= 0`` rounded to ``posit<nbits, 0>``: ``2x`` is rounded to the posit (exact
    for ``|x| < 1``), the fast sigmoid (:func:`posit_sigmoid`) gives ``s`` in
    ``[1/2, 1)``, and ``2s - 1`` is exact in ``posit<nbits, 0>`` (whose values in
    ``[0, 1]`` are a fixed-point grid of step ``2**-(nbits-2)``); odd symmetry for
    ``x < 0``. Returns ``posit<nbits, 0>`` values in ``(-1, 1)`` in the dtype of `x`;
    ±inf saturate, NaN stays NaN.

    Maximum absolute error against ``jnp.tanh`` (measured exhaustively, tested), twice the
    sigmoid's:

    * ``nbits=8``: 0.1214 at the 255 posit inputs, 0.1233 over all real inputs.
    * ``nbits=16``: 0.0981, at posit inputs and over all real inputs.

    Gradient: that of the exact tanh (a straight-through estimator). Arguments, result
    and errors as for :func:`posit_sigmoid`.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> jsa.ops.posit_tanh(jnp.array([-1.0, 0.0, 0.5, 1.0])).tolist()
        [-0.75, 0.0, 0.5, 0.75]
    """
    return _posit_tanh(_input(x, "posit_tanh"), _check_nbits(nbits))
