"""An exact pure-Python posit reference (integers and fractions), and the test inputs.

Independent of the library and of SoftPosit: `decode` reads a code field by field,
`encode` builds the (infinite) bit string of a value and rounds it to nearest, ties to
even, as the posit standard (2022) says. Slow; fine for a few thousand values.

`golden_inputs(nbits, es)` is the float32 input set of the golden table
(`scripts/gen_posit_golden.py`, `tests/data/posit_golden.npz`).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

GOLDEN_FORMATS = ((8, 0), (16, 1), *((n, 2) for n in range(4, 17)))
"""The formats SoftPosit implements: posit8 (es 0), posit16 (es 1), posit_2 (es 2)."""


def decode(code: int, nbits: int, es: int) -> Fraction | None:
    """The exact value of a posit code (None for NaR)."""
    mask = (1 << nbits) - 1
    code &= mask
    if code == 0:
        return Fraction(0)
    if code == 1 << (nbits - 1):
        return None
    negative = code >> (nbits - 1)
    if negative:
        code = (-code) & mask
    body = format(code, f"0{nbits - 1}b")  # the bits after the sign
    run = len(body) - len(body.lstrip(body[0]))
    k = run - 1 if body[0] == "1" else -run
    rest = body[run + 1 :]
    exponent = int(rest[:es].ljust(es, "0") or "0", 2)
    fraction_bits = rest[es:]
    fraction = Fraction(int(fraction_bits or "0", 2), 2 ** len(fraction_bits))
    value = Fraction(2) ** (k * 2**es + exponent) * (1 + fraction)
    return -value if negative else value


def decode_numpy(codes: np.ndarray, nbits: int, es: int) -> np.ndarray:
    """Vectorised exact decoding with numpy integers (float64; NaR gives NaN)."""
    codes = np.asarray(codes, np.int64) & ((1 << nbits) - 1)
    negative = codes >> (nbits - 1) == 1
    magnitude = np.where(negative, (-codes) & ((1 << nbits) - 1), codes)
    body = nbits - 1
    first = (magnitude >> (body - 1)) & 1
    run = np.zeros_like(codes)
    same = np.ones(codes.shape, bool)
    for i in range(body - 1, -1, -1):  # count the leading bits equal to the first one
        same &= ((magnitude >> i) & 1) == first
        run += same
    k = np.where(first == 1, run - 1, -run)
    left = np.maximum(body - run - 1, 0)  # bits after the regime and its terminator
    rest = magnitude & ((1 << left) - 1)
    exponent_bits = np.minimum(left, es)
    exponent = (rest >> (left - exponent_bits)) << (es - exponent_bits)
    fraction_bits = left - exponent_bits
    fraction = (rest & ((1 << fraction_bits) - 1)) / 2.0**fraction_bits
    value = np.ldexp(1 + fraction, (k * 2**es + exponent).astype(np.int32))
    value = np.where(magnitude == 0, 0.0, np.where(negative, -value, value))
    return np.where(codes == 1 << (nbits - 1), np.nan, value)


def values(nbits: int, es: int) -> np.ndarray:
    """Sorted finite values (float64, exact for the formats tested)."""
    out = [decode(c, nbits, es) for c in range(2**nbits)]
    return np.array(sorted(float(v) for v in out if v is not None))


def _floor_log2(x: Fraction) -> int:
    s = x.numerator.bit_length() - x.denominator.bit_length()
    return s - 1 if Fraction(2) ** s > x else s


def encode(x: float, nbits: int, es: int) -> int:
    """The posit code of `x` rounded to nearest (ties to even on the bit string)."""
    if math.isnan(x) or math.isinf(x):
        return 1 << (nbits - 1)
    if x == 0:
        return 0
    mask = (1 << nbits) - 1
    magnitude = abs(Fraction(x))
    max_exponent = 2**es * (nbits - 2)
    if magnitude >= Fraction(2) ** max_exponent:
        code = (1 << (nbits - 1)) - 1  # maxpos
    elif magnitude <= Fraction(2) ** -max_exponent:
        code = 1  # minpos: non-zero values never round to zero
    else:
        scale = _floor_log2(magnitude)
        k, exponent = divmod(scale, 2**es)
        regime = "1" * (k + 1) + "0" if k >= 0 else "0" * (-k) + "1"
        head = regime + (format(exponent, f"0{es}b") if es else "")
        fraction = magnitude / Fraction(2) ** scale - 1  # in [0, 1)
        precision = nbits + 2  # enough fraction bits for the kept part and the guard bit
        scaled = fraction * 2**precision
        bits = head + format(int(scaled), f"0{precision}b")
        sticky = scaled.denominator != 1 or "1" in bits[nbits:]
        code = int(bits[: nbits - 1], 2)
        if bits[nbits - 1] == "1" and (sticky or code & 1):
            code += 1
    return (-code) & mask if x < 0 else code


def _with_neighbours(v: np.ndarray) -> np.ndarray:
    v = v.astype(np.float32)
    return np.concatenate(
        [v, np.nextafter(v, np.float32(-np.inf)), np.nextafter(v, np.float32(np.inf))]
    )


def _pseudo_random_float32(n: int, seed: int) -> np.ndarray:
    """Positive float32 values with random bit patterns (every exponent, random fractions).

    A 64-bit linear congruential generator (Knuth's MMIX constants) in Python integers,
    so the values do not depend on numpy's random generators across versions.
    """
    state, out = seed, []
    while len(out) < n:
        state = (6364136223846793005 * state + 1442695040888963407) % 2**64
        bits = (state >> 32) & 0x7FFFFFFF
        if bits < 0x7F800000:  # finite
            out.append(bits)
    return np.array(out, np.uint32).view(np.float32)


def golden_inputs(nbits: int, es: int) -> np.ndarray:
    """float32 inputs covering every binade, every tie and its neighbours, specials.

    * every binade of float32: ``2**E * {1, 1.5, prev(2)}`` for E in [-149, 127],
      subnormals included;
    * every posit value and every tie between neighbouring posits (the values of the odd
      codes of ``posit<nbits + 1, es>``: the bit-string midpoints), each with its two
      float32 neighbours;
    * ±0, ±inf, NaN, the extreme float32 values, and 200 pseudo-random bit patterns;
    * all of it with both signs; sorted (NaN last).

    The posit values come from :func:`decode_numpy` (checked against :func:`decode`); the
    golden file records the SHA-256 of these inputs, so any change to them fails loudly.
    """
    parts = []
    exponents = np.arange(-149, 128, dtype=np.float64)
    parts.append(np.concatenate([2**exponents, 1.5 * 2**exponents]).astype(np.float32))
    parts.append(np.nextafter((2 * 2 ** exponents[:-1]).astype(np.float32), np.float32(0)))
    codes = np.arange(1, 2 ** (nbits - 1), dtype=np.uint32)
    parts.append(_with_neighbours(decode_numpy(codes, nbits, es)))
    odd = np.arange(1, 2**nbits, 2, dtype=np.uint32)
    parts.append(_with_neighbours(decode_numpy(odd, nbits + 1, es)))
    parts.append(_pseudo_random_float32(200, seed=nbits * 10 + es))
    tiny = np.float32(2.0**-149)
    specials = [0.0, np.inf, np.finfo(np.float32).max, np.finfo(np.float32).tiny, tiny, 3 * tiny]
    parts.append(np.array(specials, np.float32))
    x = np.unique(np.concatenate(parts))
    return np.concatenate([-x[::-1], x, np.array([np.nan], np.float32)])
