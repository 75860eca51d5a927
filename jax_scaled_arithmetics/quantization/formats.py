"""Description of floating point and posit number formats and the built-in presets."""

from __future__ import annotations

import dataclasses
import functools
import re
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

Examples:
    >>> import jax_scaled_arithmetics as jsa
    >>> [jsa.quantization.get_format(n).nan_encoding for n in ("float8_e5m2", "float8_e4m3fn")]
    ['ieee', 'fn']
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
        unsigned: Whether the format has no sign bit (float8_e8m0fnu, float8_e5m3fnu).
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
        dtype=None if dtype is None else np.dtype(dtype),
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
# Unsigned, with zero and subnormals, largest 114688; its ml_dtypes dtype came with
# ml_dtypes 0.7 (the format is simulated without it: `dtype` is then None).
FLOAT8_E5M3FNU = _preset(
    "float8_e5m3fnu",
    5,
    3,
    15,
    "fn",
    getattr(ml_dtypes, "float8_e5m3fnu", None),
    unsigned=True,
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
            FLOAT8_E5M3FNU,
            BFLOAT16,
            FLOAT16,
            FLOAT32,
        )
    }
)
"""The preset formats, by name (read-only).

Examples:
    >>> import jax_scaled_arithmetics as jsa
    >>> e4m3 = jsa.quantization.FORMATS["float8_e4m3fn"]
    >>> e4m3.exponent_bits, e4m3.mantissa_bits, e4m3.max
    (4, 3, 448.0)
"""

_BY_DTYPE: Mapping[np.dtype, FloatFormat] = {
    f.dtype: f for f in FORMATS.values() if f.dtype is not None
}


POSIT_MAX_NBITS: Mapping[int, int] = types.MappingProxyType({0: 26, 1: 27, 2: 28, 3: 17})
"""Widest posit simulated exactly in float32, per ``es`` (read-only).

A ``posit<nbits, es>`` has up to ``nbits - 3 - es`` fraction bits (next to 1) and values
from ``2**-(2**es * (nbits - 2))`` to ``2**(2**es * (nbits - 2))``: it fits float32 (24
significant bits, normal exponents down to ``2**-126``) for ``nbits <= 26 + es`` and
``2**es * (nbits - 2) <= 126``, that is up to posit26_es0, posit27_es1, posit28_es2 and
posit17_es3.
"""

_POSIT_NAME = re.compile(r"posit(\d+)_es(\d+)")


def _posit_range_message(nbits: Any, es: Any) -> str:
    widths = ", ".join(f"[2, {n}] for es={e}" for e, n in POSIT_MAX_NBITS.items())
    return (
        f"posit{nbits}_es{es} is not supported: es must be an integer in [0, 3] and nbits an "
        f"integer in {widths} (the posits float32 simulates exactly)"
    )


@dataclasses.dataclass(frozen=True)
class PositFormat:
    """A posit format ``posit<nbits, es>`` (posit standard 2022, any ``es``), simulated in float32.

    An ``nbits``-bit two's complement pattern: sign, regime (a run of identical bits of
    variable length), up to ``es`` exponent bits and the remaining fraction bits. The
    values are 0, NaR ("not a real", the pattern ``1000...0``) and ``±useed**k * 2**e *
    1.f`` with ``useed = 2**(2**es)``; precision is highest near 1 and tapers towards
    ``maxpos = useed**(nbits - 2)`` and ``minpos = 1 / maxpos``.

    Looked up by name with :func:`get_format` (``"posit{nbits}_es{es}"``); quantised
    with :func:`~jax_scaled_arithmetics.quantization.posit_quantize`.

    Attributes:
        nbits: Width in bits, 2 to ``POSIT_MAX_NBITS[es]``.
        es: Exponent field width, 0 to 3.

    Examples:
        >>> fmt = get_format("posit8_es0")
        >>> fmt.max, fmt.min, fmt.fraction_bits, fmt.epsilon
        (64.0, 0.015625, 5, 0.03125)
        >>> PositFormat(16, 1).name, PositFormat(16, 1).code_dtype
        ('posit16_es1', dtype('uint16'))
    """

    nbits: int
    es: int

    def __post_init__(self) -> None:
        nbits, es = self.nbits, self.es
        ok = all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in (nbits, es))
        if not ok or int(es) not in POSIT_MAX_NBITS or not 2 <= nbits <= POSIT_MAX_NBITS[int(es)]:
            raise ValueError(_posit_range_message(nbits, es))
        object.__setattr__(self, "nbits", int(nbits))
        object.__setattr__(self, "es", int(es))

    @property
    def name(self) -> str:
        """``"posit{nbits}_es{es}"``."""
        return f"posit{self.nbits}_es{self.es}"

    @property
    def bits(self) -> int:
        """Total width in bits (``nbits``)."""
        return self.nbits

    @property
    def useed(self) -> int:
        """``2**(2**es)``: the factor between consecutive regimes."""
        return 2 ** (2**self.es)

    @property
    def max_exponent(self) -> int:
        """``log2(maxpos) = 2**es * (nbits - 2)``."""
        return 2**self.es * (self.nbits - 2)

    @property
    def max(self) -> float:
        """Largest value, ``maxpos``."""
        return float(2.0**self.max_exponent)

    @property
    def min(self) -> float:
        """Smallest positive value, ``minpos = 1 / maxpos``."""
        return float(2.0**-self.max_exponent)

    @property
    def fraction_bits(self) -> int:
        """Fraction bits of the values in ``[1, useed)``, the most precise range."""
        return max(self.nbits - 3 - self.es, 0)

    @property
    def epsilon(self) -> float | None:
        """Distance from 1 to the next larger value (``None`` when 1 is ``maxpos``)."""
        if self.nbits == 2:
            return None
        cut = self.es - (self.nbits - 3)  # exponent bits cut off next to 1
        if cut <= 0:
            return float(2.0**-self.fraction_bits)
        return float(2.0 ** (2**cut) - 1.0)

    @property
    def code_dtype(self) -> np.dtype:
        """Unsigned integer dtype of the bit patterns: uint8, uint16 or uint32."""
        if self.nbits <= 8:
            return np.dtype(np.uint8)
        return np.dtype(np.uint16) if self.nbits <= 16 else np.dtype(np.uint32)


POSIT_FORMATS: Mapping[str, PositFormat] = types.MappingProxyType(
    {
        f.name: f
        for f in (
            PositFormat(8, 0),
            PositFormat(8, 1),
            PositFormat(8, 2),
            PositFormat(16, 1),
            PositFormat(16, 2),
        )
    }
)
"""Posit presets listed in the docs (read-only); any valid ``"posit{n}_es{e}"`` name works.

Examples:
    >>> import jax_scaled_arithmetics as jsa
    >>> list(jsa.quantization.POSIT_FORMATS)
    ['posit8_es0', 'posit8_es1', 'posit8_es2', 'posit16_es1', 'posit16_es2']
    >>> jsa.quantization.get_format("posit12_es1").nbits  # not a preset, still a format
    12
"""

Format = FloatFormat | PositFormat
"""What :func:`get_format` returns."""


def get_format(name_or_dtype: str | Format | Any) -> Format:
    """Look up a float or posit format.

    Args:
        name_or_dtype: A preset name (see :data:`FORMATS`), a posit name
            ``"posit{nbits}_es{es}"`` (see :class:`PositFormat`), a dtype (numpy, ml_dtypes
            or ``jnp`` scalar type) of a preset, or a :class:`FloatFormat` or
            :class:`PositFormat` (returned as is).

    Returns:
        The format.

    Raises:
        ValueError: for an unknown name or dtype (the message lists the known formats), or
            a posit name out of the supported range (the message gives the range).
        TypeError: for an argument that is neither a string, a dtype nor a format.

    Examples:
        >>> import jax.numpy as jnp
        >>> get_format("float8_e5m2").max
        57344.0
        >>> get_format(jnp.bfloat16).name
        'bfloat16'
        >>> get_format("posit16_es1")
        PositFormat(nbits=16, es=1)
    """
    if isinstance(name_or_dtype, FloatFormat | PositFormat):
        return name_or_dtype
    known = ", ".join(FORMATS) + ", posit{nbits}_es{es}"
    if isinstance(name_or_dtype, str):
        if name_or_dtype in FORMATS:
            return FORMATS[name_or_dtype]
        match = _POSIT_NAME.fullmatch(name_or_dtype)
        if match:
            return PositFormat(int(match.group(1)), int(match.group(2)))
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
