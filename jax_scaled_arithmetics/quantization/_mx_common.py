"""Pieces the MX modules share: E8M0 scale codes and the decoding of MX blocks.

E8M0 holds ``2**(c - 127)`` for code ``c`` in ``[0, 254]`` and NaN (code 255). Integer
operations on float32 bits only, so every conversion is exact.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _bits

E8M0_NAN = 0xFF
E8M0_BIAS = 127


def e8m0_from_codes(codes: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(codes.astype(jnp.uint8), jnp.float8_e8m0fnu)


def e8m0_codes(scale: jax.Array) -> jax.Array:
    """Raw uint8 codes of a float8_e8m0fnu or uint8 array."""
    dtype = np.dtype(scale.dtype)
    if dtype == np.dtype(jnp.float8_e8m0fnu):
        return lax.bitcast_convert_type(scale, jnp.uint8)
    if dtype == np.uint8:
        return scale
    raise TypeError(f"expected a float8_e8m0fnu or uint8 array of scales, got {dtype.name}")


def floor_log2(abs_bits: jax.Array) -> jax.Array:
    """floor(log2(|x|)) of finite float32 bits as int32 (-150 for zero)."""
    m, e = _bits.decompose(abs_bits)
    return e + 31 - lax.clz(m).astype(jnp.int32)


def e8m0_exponents(codes: jax.Array) -> jax.Array:
    return codes.astype(jnp.int32) - E8M0_BIAS


@functools.partial(jax.jit, static_argnames=("block_size", "axis", "length"))
def block_dequantize_impl(
    data_in: jax.Array, scales: jax.Array, block_size: int, axis: int, length: int
) -> jax.Array:
    data = jnp.moveaxis(data_in.astype(jnp.float32), axis, -1)
    blocks = data.reshape(*data.shape[:-1], data.shape[-1] // block_size, block_size)
    codes = jnp.moveaxis(e8m0_codes(scales), axis, -1)[..., None]
    bits = _bits.to_bits(blocks)
    sign = bits & _bits.u32(_bits.SIGN_MASK)
    a = bits & _bits.u32(_bits.ABS_MASK)
    r = _bits.scale_abs_bits(a, e8m0_exponents(codes))
    out = jnp.where(codes == E8M0_NAN, _bits.u32(_bits.QNAN_BITS), r | sign)
    out = jnp.where(a == _bits.u32(_bits.INF_BITS), bits, out)
    out = jnp.where(a > _bits.u32(_bits.INF_BITS), bits, out)
    values = _bits.from_bits(out).reshape(data.shape)
    values = jnp.moveaxis(values, -1, axis)
    return lax.slice_in_dim(values, 0, length, axis=axis % values.ndim)
