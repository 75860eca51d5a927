"""The MXArray type: a block scaled array with E8M0 scales, and its dequantisation."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax

from .. import _deprecation
from . import nvfp4
from ._mx_common import block_dequantize_impl
from ._tiles import tiles, untiles
from .formats import FloatFormat
from .mx_formats import from_e8m0
from .nvfp4 import NVFP4Array

if TYPE_CHECKING:
    from ..core.datatype import ScaledArray


# eq=False: equal only to itself. Arrays have no single truth value, so a field-wise `==`
# raises (Python 3.13's dataclass `__eq__` compares field by field; earlier ones compared
# tuples, which passed only for the very same arrays).
@dataclasses.dataclass(frozen=True, eq=False)
class MXArray:
    """A block scaled array: ``value = data * scale`` per block along one axis.

    A JAX pytree (``data`` and ``scale`` are leaves, the rest is static metadata), so it
    can cross ``jax.jit`` boundaries and be mapped over with ``jax.tree_util``.

    Attributes:
        data: Elements, shape of the (zero-padded) input. Its dtype is the element
            format's dtype when JAX supports it (float8, float4), else float32 holding
            values of the element format exactly (float6 and custom formats).
        scale: ``float8_e8m0fnu`` block scales, shape of the input with ``axis``
            of length ``ceil(length / block_size)``. NaN marks a block that held NaN/inf.
        format: Element format.
        block_size: Number of elements sharing a scale along `axis`, or ``(r, c)``: 2D
            blocks of r x c over the last two axes (`axis` -1; ``scale`` then has the
            shape of the data with those axes divided by r and c).
        axis: The blocked axis, as a negative index (it stays valid when batch
            dimensions are prepended, e.g. by ``jax.vmap``).
        length: Length of ``axis`` before padding.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jax_scaled_arithmetics.quantization import block_quantize
        >>> mx = block_quantize(jnp.arange(8.0), "float4_e2m1fn", block_size=4)
        >>> mx.data.dtype, mx.scale.dtype, mx.shape
        (dtype(float4_e2m1fn), dtype(float8_e8m0fnu), (8,))
        >>> mx.dequantize()  # 7 / 1 saturates to the float4_e2m1fn max, 6
        Array([0., 1., 2., 3., 4., 4., 6., 6.], dtype=float32)
    """

    data: jax.Array
    scale: jax.Array
    format: FloatFormat
    block_size: int | tuple[int, int]
    axis: int
    length: int

    # Deprecated: `scale`, the name every scaled array type uses.
    scales = _deprecation.RenamedAttribute("jsa.quantization.MXArray", "scale")

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the dequantized array."""
        shape = list(self.data.shape)
        shape[self.axis] = self.length
        return tuple(shape)

    def dequantize(self) -> jax.Array:
        """Same as :func:`block_dequantize`."""
        return block_dequantize(self)

    def to_scaled_array(self) -> ScaledArray:
        """The same values as a block-scaled :class:`~jax_scaled_arithmetics.ScaledArray`.

        A view, nothing is re-quantised: the data are the elements (``data``, in their
        dtype), the scale is the float32 power of two of each block (``scale`` decoded
        from E8M0), of the data's rank with ``shape[axis] // block_size`` blocks along
        ``axis``: ``(M, K // 32)`` for blocks of 32 along the last axis of ``(M, K)``. So
        ``jsa.autoscale`` computes on it with its block rules, and
        :func:`mx_from_scaled_array` gives this MXArray back bit for bit. A block that held
        NaN/inf keeps its NaN scale (it represents NaNs). The smallest E8M0 scale,
        ``2**-127``, is a float32 subnormal, which XLA on CPU flushes to zero in arithmetic:
        there, values of such blocks may read as zeros through ``to_array()``.

        Raises:
            ValueError: the MXArray is padded (``block_quantize(..., pad=True)`` on an
                axis that `block_size` does not divide): a block scale needs whole blocks.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jax_scaled_arithmetics as jsa
            >>> from jax_scaled_arithmetics.quantization import block_quantize
            >>> x = jnp.array([[1.0, 2.0, 96.0, -64.0]])
            >>> sa = block_quantize(x, "mxfp8_e4m3", block_size=2).to_scaled_array()
            >>> sa.scale  # one power of two per block of 2: shape (1, 4 // 2)
            Array([[0.0078125, 0.25     ]], dtype=float32)
            >>> sa.data.dtype
            dtype(float8_e4m3fn)
            >>> jsa.autoscale(lambda a: a.astype(jnp.float32) * 2.0)(sa).to_array()
            Array([[   2.,    4.,  192., -128.]], dtype=float32)
        """
        from ..core.datatype import ScaledArray

        if self.data.shape[self.axis] != self.length:
            raise ValueError(
                f"MXArray padded from length {self.length} to {self.data.shape[self.axis]} "
                f"along axis {self.axis} (block size {self.block_size}) has no ScaledArray "
                "view: a block scale needs whole blocks (quantize without pad=True)"
            )
        return ScaledArray(self.data, from_e8m0(self.scale))


jax.tree_util.register_dataclass(
    MXArray, data_fields=["data", "scale"], meta_fields=["format", "block_size", "axis", "length"]
)


def block_dequantize(mx: MXArray | NVFP4Array) -> jax.Array:
    """Converts an :class:`MXArray` (or an ``NVFP4Array``) back to float32 (exactly:
    ``data * scale``).

    Args:
        mx: The block scaled array.

    Returns:
        A float32 array of shape ``mx.shape`` (padding trimmed).

    Examples:
        >>> import jax.numpy as jnp
        >>> from jax_scaled_arithmetics.quantization import block_quantize
        >>> mx = block_quantize(jnp.array([1.0, 2.0, 3.0]), "float8_e5m2", 2, pad=True)
        >>> block_dequantize(mx)
        Array([1., 2., 3.], dtype=float32)
    """
    if isinstance(mx, NVFP4Array):
        return nvfp4.nvfp4_dequantize(mx)
    if not isinstance(mx, MXArray):
        raise TypeError(
            f"block_dequantize expects an MXArray or NVFP4Array, got {type(mx).__name__}"
        )
    if isinstance(mx.block_size, tuple):  # 2D blocks over the last two axes
        r, c = mx.block_size
        rows = tiles(mx.data, (r, c))
        values = block_dequantize_impl(rows, mx.scale[..., None], r * c, -1, r * c)
        return untiles(values, (r, c))
    return block_dequantize_impl(mx.data, mx.scale, mx.block_size, mx.axis, mx.length)
