"""The dtype that arithmetic on narrow floating-point data is computed in."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["compute_dtype"]

_F32 = np.dtype(np.float32)


def compute_dtype(*dtypes: Any) -> np.dtype:
    """The dtype to compute in on values of `dtypes`: at least float32.

    Floating dtypes narrower than 32 bits (float16, bfloat16, the float8 and smaller
    formats) compute in float32; float32 and float64 stay; other dtypes (integers, complex)
    are kept. Several dtypes give the promotion of each one's compute dtype, so float64
    anywhere gives float64.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jax_scaled_arithmetics.core.dtypes import compute_dtype
        >>> compute_dtype(jnp.bfloat16), compute_dtype(jnp.float16, jnp.float64)
        (dtype('float32'), dtype('float64'))
    """
    if not dtypes:
        raise TypeError("compute_dtype expects at least one dtype.")
    out: np.dtype | None = None
    for dtype in dtypes:
        dtype = np.dtype(dtype)
        if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
            dtype = _F32
        out = dtype if out is None else np.dtype(jnp.promote_types(out, dtype))
    assert out is not None
    return out
