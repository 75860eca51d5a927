"""Description of floating point number formats and the built-in presets."""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Mapping
from typing import Any, Literal

import ml_dtypes
import numpy as np

NanEncoding = Literal["ieee", "fn", "fnuz", "none"]
"""How a format encodes special values.

* ``"ieee"``: the all-ones exponent is reserved: infinities (zero mantissa) and NaNs
  (non-zero mantissa, so only when ``mantissa_bits > 0``). E.g. float16, float8_e5m2.
* ``"fn"``: finite, no infinities; only the all-ones bit pattern (exponent and mantissa)
  is NaN, the rest of the top binade holds normal numbers. E.g. float8_e4m3fn, and
  float8_e8m0fnu (which has no mantissa, so its whole top exponent is NaN).
* ``"fnuz"``: finite, no infinities, NaN is the "negative zero" pattern, so zero is
  unsigned. E.g. float8_e4m3fnuz.
* ``"none"``: no infinities and no NaN, every pattern is a finite number. E.g. float4_e2m1fn.
"""

_NAN_ENCODINGS: tuple[str, ...] = ("ieee", "fn", "fnuz", "none")


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """A binary floating point format, simulated in float32.

    Values are ``(-1)^s * 2^(E - exponent_bias) * 1.M`` for a non-zero biased exponent
    ``E`` and ``(-1)^s * 2^(1 - exponent_bias) * 0.M`` (subnormals) for ``E == 0``, except
    for formats without zero (``has_zero=False``, only float8_e8m0fnu), where ``E == 0`` is
    the normal number ``2^(-exponent_bias)``. Special values follow ``nan_encoding``.

    Attributes:
        name: Format name (the ml_dtypes name for presets).
        exponent_bits: Width of the exponent field, 1 to 8.
        mantissa_bits: Width of the mantissa (fraction) field, 0 to 23.
        exponent_bias: Exponent bias.
        nan_encoding: How infinities and NaNs are encoded, see :data:`NanEncoding`.
        unsigned: Whether the format has no sign bit (float8_e8m0fnu).
        has_zero: Whether the format has a zero (and subnormals).
        dtype: The matching numpy / ml_dtypes dtype, ``None`` for custom formats.

    Examples:
        >>> fmt = get_format("float8_e4m3fn")
        >>> fmt.max, fmt.min_normal, fmt.min_subnormal, fmt.epsilon
        (448.0, 0.015625, 0.001953125, 0.125)
        >>> fmt.bits, fmt.has_inf, fmt.has_nan
        (8, False, True)
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    exponent_bias: int
    nan_encoding: NanEncoding = "ieee"
    unsigned: bool = False
    has_zero: bool = True
    dtype: np.dtype | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        _check_int("exponent_bits", self.exponent_bits, 1, 8)
        _check_int("mantissa_bits", self.mantissa_bits, 0, 23)
        if isinstance(self.exponent_bias, bool) or not isinstance(
            self.exponent_bias, int | np.integer
        ):
            raise ValueError(f"exponent_bias must be an integer, got {self.exponent_bias!r}")
        if self.nan_encoding not in _NAN_ENCODINGS:
            raise ValueError(
                f"nan_encoding must be one of {_NAN_ENCODINGS}, got {self.nan_encoding!r}"
            )
        if self.nan_encoding == "ieee" and self.exponent_bits < 2:
            raise ValueError(
                "nan_encoding='ieee' reserves the all-ones exponent and needs exponent_bits >= 2; "
                "use nan_encoding='none' or 'fn' for a 1-bit exponent"
            )
        if self.dtype is not None:
            object.__setattr__(self, "dtype", np.dtype(self.dtype))
        # Every value of the format must be exactly representable in float32.
        if self.max_exponent > 127:
            raise ValueError(
                f"format {self.name!r} has largest exponent {self.max_exponent} > 127: "
                "it cannot be simulated in float32 (lower exponent_bits or raise exponent_bias)"
            )
        smallest = self.min_exponent - (self.mantissa_bits if self.has_zero else 0)
        if smallest < -149:
            raise ValueError(
                f"format {self.name!r} has values down to 2**{smallest} < 2**-149: "
                "it cannot be simulated in float32 (lower exponent_bias)"
            )

    @classmethod
    def custom(
        cls,
        exponent_bits: int,
        mantissa_bits: int,
        *,
        exponent_bias: int | None = None,
        nan_encoding: NanEncoding | None = None,
        name: str | None = None,
    ) -> FloatFormat:
        """An IEEE-like signed format with arbitrary field widths.

        Args:
            exponent_bits: Exponent width, 1 to 8.
            mantissa_bits: Mantissa width, 0 to 23.
            exponent_bias: Defaults to ``2**(exponent_bits - 1) - 1``.
            nan_encoding: Defaults to ``"ieee"`` (infinities and NaNs in the all-ones
                exponent), or ``"none"`` for a 1-bit exponent, which has no room for them.
            name: Defaults to ``"e{exponent_bits}m{mantissa_bits}"``.

        Returns:
            The format.

        Raises:
            ValueError: for widths out of range or a format not representable in float32.

        Examples:
            >>> fmt = FloatFormat.custom(3, 2)
            >>> fmt.name, fmt.max, fmt.min_subnormal
            ('e3m2', 14.0, 0.0625)
            >>> FloatFormat.custom(8, 23).max == get_format("float32").max
            True
        """
        exponent_bits = _check_int("exponent_bits", exponent_bits, 1, 8)
        mantissa_bits = _check_int("mantissa_bits", mantissa_bits, 0, 23)
        if exponent_bias is None:
            exponent_bias = 2 ** (exponent_bits - 1) - 1
        if nan_encoding is None:
            nan_encoding = "ieee" if exponent_bits >= 2 else "none"
        if name is None:
            name = f"e{exponent_bits}m{mantissa_bits}"
        return cls(
            name=name,
            exponent_bits=exponent_bits,
            mantissa_bits=mantissa_bits,
            exponent_bias=exponent_bias,
            nan_encoding=nan_encoding,
        )

    @property
    def bits(self) -> int:
        """Total width in bits."""
        return self.exponent_bits + self.mantissa_bits + (0 if self.unsigned else 1)

    @property
    def has_inf(self) -> bool:
        """Whether the format encodes infinities."""
        return self.nan_encoding == "ieee"

    @property
    def has_nan(self) -> bool:
        """Whether the format encodes NaN."""
        if self.nan_encoding == "ieee":
            return self.mantissa_bits > 0
        return self.nan_encoding != "none"

    @property
    def max_exponent(self) -> int:
        """Unbiased exponent of the largest finite value (``emax``)."""
        top = 2**self.exponent_bits - 1
        if self.nan_encoding == "ieee" or (self.nan_encoding == "fn" and self.mantissa_bits == 0):
            top -= 1
        return top - self.exponent_bias

    @property
    def min_exponent(self) -> int:
        """Unbiased exponent of the smallest normal value (``emin``)."""
        return (1 if self.has_zero else 0) - self.exponent_bias

    @property
    def max(self) -> float:
        """Largest finite value."""
        m = self.mantissa_bits
        if self.nan_encoding == "fn" and m > 0:
            significand = 2.0 - 2.0 ** (1 - m)  # the all-ones mantissa is NaN
        else:
            significand = 2.0 - 2.0**-m
        return float(significand * 2.0**self.max_exponent)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value."""
        return float(2.0**self.min_exponent)

    @property
    def min_subnormal(self) -> float | None:
        """Smallest positive subnormal value, ``None`` for formats without subnormals."""
        if not self.has_zero or self.mantissa_bits == 0:
            return None
        return float(2.0 ** (self.min_exponent - self.mantissa_bits))

    @property
    def epsilon(self) -> float:
        """Distance from 1 to the next larger value, ``2**-mantissa_bits``."""
        return float(2.0**-self.mantissa_bits)

    @property
    def jax_dtype(self) -> np.dtype | None:
        """``dtype`` if JAX arrays (on the default backend) support it, else ``None``.

        Examples:
            >>> get_format("float4_e2m1fn").jax_dtype
            dtype(float4_e2m1fn)
            >>> get_format("float6_e2m3fn").jax_dtype is None
            True
        """
        if self.dtype is None:
            return None
        return self.dtype if _jax_supports(self.dtype) else None


@functools.cache
def _jax_supports(dtype: np.dtype) -> bool:
    """Whether the default JAX backend can hold and convert arrays of `dtype`."""
    import jax
    import jax.numpy as jnp

    try:
        out = jnp.zeros((1,), jnp.float32).astype(dtype).astype(jnp.float32)
        jax.block_until_ready(out)
    except Exception:  # XLA rejects primitive types it does not implement.
        return False
    return True


def _preset(
    name: str,
    exponent_bits: int,
    mantissa_bits: int,
    exponent_bias: int,
    nan_encoding: NanEncoding,
    dtype: Any,
    *,
    unsigned: bool = False,
    has_zero: bool = True,
) -> FloatFormat:
    return FloatFormat(
        name=name,
        exponent_bits=exponent_bits,
        mantissa_bits=mantissa_bits,
        exponent_bias=exponent_bias,
        nan_encoding=nan_encoding,
        unsigned=unsigned,
        has_zero=has_zero,
        dtype=np.dtype(dtype),
    )


FLOAT8_E4M3FN = _preset("float8_e4m3fn", 4, 3, 7, "fn", ml_dtypes.float8_e4m3fn)
FLOAT8_E5M2 = _preset("float8_e5m2", 5, 2, 15, "ieee", ml_dtypes.float8_e5m2)
FLOAT8_E4M3FNUZ = _preset("float8_e4m3fnuz", 4, 3, 8, "fnuz", ml_dtypes.float8_e4m3fnuz)
FLOAT8_E5M2FNUZ = _preset("float8_e5m2fnuz", 5, 2, 16, "fnuz", ml_dtypes.float8_e5m2fnuz)
FLOAT8_E4M3B11FNUZ = _preset("float8_e4m3b11fnuz", 4, 3, 11, "fnuz", ml_dtypes.float8_e4m3b11fnuz)
FLOAT8_E4M3 = _preset("float8_e4m3", 4, 3, 7, "ieee", ml_dtypes.float8_e4m3)
FLOAT8_E3M4 = _preset("float8_e3m4", 3, 4, 3, "ieee", ml_dtypes.float8_e3m4)
FLOAT6_E2M3FN = _preset("float6_e2m3fn", 2, 3, 1, "none", ml_dtypes.float6_e2m3fn)
FLOAT6_E3M2FN = _preset("float6_e3m2fn", 3, 2, 3, "none", ml_dtypes.float6_e3m2fn)
FLOAT4_E2M1FN = _preset("float4_e2m1fn", 2, 1, 1, "none", ml_dtypes.float4_e2m1fn)
FLOAT8_E8M0FNU = _preset(
    "float8_e8m0fnu", 8, 0, 127, "fn", ml_dtypes.float8_e8m0fnu, unsigned=True, has_zero=False
)
BFLOAT16 = _preset("bfloat16", 8, 7, 127, "ieee", ml_dtypes.bfloat16)
FLOAT16 = _preset("float16", 5, 10, 15, "ieee", np.float16)
FLOAT32 = _preset("float32", 8, 23, 127, "ieee", np.float32)

FORMATS: Mapping[str, FloatFormat] = types.MappingProxyType(
    {
        f.name: f
        for f in (
            FLOAT8_E4M3FN,
            FLOAT8_E5M2,
            FLOAT8_E4M3FNUZ,
            FLOAT8_E5M2FNUZ,
            FLOAT8_E4M3B11FNUZ,
            FLOAT8_E4M3,
            FLOAT8_E3M4,
            FLOAT6_E2M3FN,
            FLOAT6_E3M2FN,
            FLOAT4_E2M1FN,
            FLOAT8_E8M0FNU,
            BFLOAT16,
            FLOAT16,
            FLOAT32,
        )
    }
)
"""The preset formats, by name (read-only)."""

_BY_DTYPE: Mapping[np.dtype, FloatFormat] = {
    f.dtype: f for f in FORMATS.values() if f.dtype is not None
}


def get_format(name_or_dtype: str | FloatFormat | Any) -> FloatFormat:
    """Look up a float format.

    Args:
        name_or_dtype: A preset name (see :data:`FORMATS`), a dtype (numpy, ml_dtypes or
            ``jnp`` scalar type) of a preset, or a :class:`FloatFormat` (returned as is).

    Returns:
        The format.

    Raises:
        ValueError: for an unknown name or dtype (the message lists the known formats).
        TypeError: for an argument that is neither a string, a dtype nor a format.

    Examples:
        >>> import jax.numpy as jnp
        >>> get_format("float8_e5m2").max
        57344.0
        >>> get_format(jnp.bfloat16).name
        'bfloat16'
    """
    if isinstance(name_or_dtype, FloatFormat):
        return name_or_dtype
    known = ", ".join(FORMATS)
    if isinstance(name_or_dtype, str):
        if name_or_dtype in FORMATS:
            return FORMATS[name_or_dtype]
        raise ValueError(f"Unknown float format {name_or_dtype!r}; known formats: {known}")
    if name_or_dtype is None:
        raise TypeError("get_format expects a format name, a dtype or a FloatFormat, got None")
    try:
        dtype = np.dtype(name_or_dtype)
    except TypeError as e:
        raise TypeError(
            "get_format expects a format name, a dtype or a FloatFormat, "
            f"got {name_or_dtype!r} of type {type(name_or_dtype).__name__}"
        ) from e
    if dtype in _BY_DTYPE:
        return _BY_DTYPE[dtype]
    raise ValueError(f"Unknown float format for dtype {dtype.name!r}; known formats: {known}")
