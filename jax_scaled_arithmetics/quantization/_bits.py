"""Exact integer rounding on float32 bit patterns (private helpers).

A finite non-negative float32 is decomposed as ``m * 2**e`` with an integer significand
``m < 2**24``. Rounding to a grid ``q * 2**qexp`` and recomposing are done with uint32
integer arithmetic only, so results are exact and independent of the backend's float
behaviour (XLA on CPU flushes float32 subnormals to zero in arithmetic, bit casts do not).
Also what the elementwise quantisers share: their input checks (`prepare`) and their
straight-through gradient (`straight_through`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Rounding = Literal["nearest", "stochastic", "toward_zero"]
"""How a quantiser rounds: to the nearest value (ties to even), stochastically (up with
the probability of the distance to the value below, with a PRNG key), or toward zero.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> import jax_scaled_arithmetics as jsa
    >>> x = jnp.array([1.3, -1.3])
    >>> jsa.quantization.float_quantize(x, "float4_e2m1fn", rounding="toward_zero")
    Array([ 1., -1.], dtype=float32)
"""
ROUNDING_MODES: tuple[str, ...] = ("nearest", "stochastic", "toward_zero")

SIGN_MASK = 0x80000000
ABS_MASK = 0x7FFFFFFF
INF_BITS = 0x7F800000
QNAN_BITS = 0x7FC00000


def check_rounding(rounding: Any, key: Any) -> str:
    """Validates a rounding mode and the presence of a key for stochastic rounding."""
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"Unknown rounding mode {rounding!r}; expected one of {ROUNDING_MODES}")
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs a PRNG key: pass key=jax.random.key(...)")
    return str(rounding)


def quantized_dtype(x: jax.Array, fn: str) -> np.dtype:
    """The dtype a quantiser returns for `x`: floats up to 32 bits keep theirs."""
    dtype = np.dtype(x.dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        if dtype.itemsize > 4:
            raise TypeError(
                f"{fn} computes in float32 and does not accept {dtype.name} inputs; "
                "cast to float32 first"
            )
        return dtype
    if jnp.issubdtype(dtype, jnp.integer) or dtype == np.bool_:
        return np.dtype(np.float32)
    raise TypeError(f"{fn} expects a real floating point or integer array, got {dtype.name}")


def prepare(x: Any, fn: str, rounding: Any, key: Any) -> tuple[jax.Array, str, Any]:
    """A quantiser's input: `x` as an array of the dtype `fn` returns, the rounding mode
    (validated), and the key (None unless the rounding is stochastic)."""
    mode = check_rounding(rounding, key)
    x = jnp.asarray(x)
    dtype = quantized_dtype(x, fn)
    if x.dtype != dtype:
        x = x.astype(dtype)
    return x, mode, key if mode == "stochastic" else None


def u32(v: int) -> jax.Array:
    return jnp.asarray(np.uint32(v))


def to_bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def from_bits(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits, jnp.float32)


def float_bits(value: float) -> int:
    """The float32 bit pattern of a Python float (exactly representable)."""
    return int(np.array(value, np.float32).view(np.uint32))


def shl(v: jax.Array, s: jax.Array) -> jax.Array:
    """uint32 left shift with amounts clipped to [0, 31] (callers mask the rest)."""
    return lax.shift_left(v, jnp.clip(s, 0, 31).astype(jnp.uint32))


def shr(v: jax.Array, s: jax.Array) -> jax.Array:
    """uint32 logical right shift; amounts >= 32 give 0, negative amounts give v."""
    out = lax.shift_right_logical(v, jnp.clip(s, 0, 31).astype(jnp.uint32))
    return jnp.where(s >= 32, u32(0), out)


def decompose(abs_bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Finite non-negative float32 bits -> ``(m, e)`` with value ``m * 2**e``, ``m < 2**24``."""
    biased = lax.shift_right_logical(abs_bits, u32(23))
    frac = abs_bits & u32(0x7FFFFF)
    m = jnp.where(biased > 0, frac | u32(0x800000), frac)
    e = jnp.maximum(biased, u32(1)).astype(jnp.int32) - (127 + 23)
    return m, e


def round_significand(
    m: jax.Array,
    e: jax.Array,
    mantissa_bits: int,
    min_quantum_exp: Any,
    rounding: str,
    rbits: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """Rounds ``m * 2**e`` to ``mantissa_bits`` fraction bits and a quantum >= 2**min_quantum_exp.

    Returns ``(q, qexp)``, the rounded value being ``q * 2**qexp`` (``q <= 2**24``).
    """
    msb = 31 - lax.clz(m).astype(jnp.int32)  # -1 for m == 0
    qexp = jnp.maximum(e + msb - mantissa_bits, min_quantum_exp)
    s = jnp.maximum(qexp - e, 0)  # number of low significand bits to drop
    qexp = e + s
    if rounding == "nearest":
        sc = jnp.minimum(s, 25)  # m < 2**24 <= half a quantum when s >= 25: rounds to 0
        q = shr(m, sc)
        rem = m - shl(q, sc)
        half = shr(shl(u32(1), sc), jnp.ones_like(sc))
        up = (rem > half) | ((rem == half) & ((q & u32(1)) == 1) & (sc > 0))
        q = q + up.astype(jnp.uint32)
    elif rounding == "toward_zero":
        q = shr(m, s)
    elif rounding == "stochastic":
        assert rbits is not None
        # Add a uniform integer in [0, 2**sc) and truncate: rounds up with probability
        # (dropped bits) / 2**s. Beyond 31 dropped bits the dropped part is first truncated
        # to 31 bits, a bias below 2**-31 of a quantum.
        sc = jnp.minimum(s, 31)
        m2 = shr(m, s - sc)
        r = jnp.where(sc > 0, shr(rbits, 32 - sc), u32(0))
        q = shr(m2 + r, sc)
    else:  # pragma: no cover - validated by callers
        raise ValueError(rounding)
    return q, qexp


def compose(q: jax.Array, qexp: jax.Array) -> jax.Array:
    """``q * 2**qexp`` -> float32 bits; the value must be representable or overflow (-> inf)."""
    msb = 31 - lax.clz(q).astype(jnp.int32)
    biased = qexp + msb + 127
    frac = jnp.where(msb <= 23, shl(q, 23 - msb), shr(q, msb - 23)) & u32(0x7FFFFF)
    normal = shl(jnp.clip(biased, 0, 255).astype(jnp.uint32), jnp.full_like(biased, 23)) | frac
    normal = jnp.where(biased >= 255, u32(INF_BITS), normal)
    subnormal = shl(q, qexp + 149)
    out = jnp.where(biased >= 1, normal, subnormal)
    return jnp.where(q == 0, u32(0), out)


def scale_abs_bits(abs_bits: jax.Array, exp: jax.Array) -> jax.Array:
    """Exact ``|x| * 2**exp`` on finite float32 bits (round-to-nearest-even on underflow)."""
    m, e = decompose(abs_bits)
    q, qexp = round_significand(m, e + exp, 23, -149, "nearest", None)
    return compose(q, qexp)


def straight_through(*static_argnames: str) -> Callable[[Callable[..., jax.Array]], Any]:
    """Decorator: `quantize(x, key, *settings)` compiled by `jax.jit` (the settings, named
    by `static_argnames`, static), called as ``ste(settings, x, key)``, with a
    straight-through gradient (the identity in `x`). ``ste.compiled`` is the compiled
    `quantize`.

    The custom_jvp wraps the compiled `quantize` rather than the other way round: eager
    calls then run one cached executable and never trace a custom_jvp.
    """

    def wrap(quantize: Callable[..., jax.Array]) -> Any:
        compiled = jax.jit(quantize, static_argnames=static_argnames)

        @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
        def ste(settings: tuple[Any, ...], x: jax.Array, key: Any) -> jax.Array:
            return compiled(x, key, *settings)

        @ste.defjvp
        def jvp(
            settings: tuple[Any, ...], primals: Any, tangents: Any
        ) -> tuple[jax.Array, jax.Array]:
            x, key = primals
            return ste(settings, x, key), tangents[0]

        ste.compiled = compiled  # type: ignore[attr-defined]
        return ste

    return wrap
