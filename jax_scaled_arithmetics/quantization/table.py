"""Lookup-table formats: quantisation to the entries of a sorted table, codes, NF4."""

from __future__ import annotations

import functools
from statistics import NormalDist
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from ..core import prng
from . import _bits

TableRounding = Literal["nearest", "geomean", "stochastic"]
TABLE_ROUNDING_MODES: tuple[str, ...] = ("nearest", "geomean", "stochastic")
MAX_CODES = 2**16
"""Largest table :func:`table_encode` takes (uint16 codes)."""


def _normal_float(bits: int = 4, offset: float = 0.9677083) -> np.ndarray:
    """The NormalFloat table of QLoRA (Dettmers et al. 2023), as bitsandbytes builds it.

    ``2**(bits-1)`` positive and ``2**(bits-1) - 1`` negative quantiles of the standard
    normal at probabilities evenly spaced from `offset` to 1/2 (one end of each range
    dropped), an exact zero, normalised to [-1, 1]. `offset` is bitsandbytes' constant,
    the mean of ``1 - 1/(2*15)`` and ``1 - 1/(2*16)``.
    """
    normal = NormalDist()
    half = 2 ** (bits - 1)
    positive = [normal.inv_cdf(p) for p in np.linspace(offset, 0.5, half + 1)[:-1]]
    negative = [-normal.inv_cdf(p) for p in np.linspace(offset, 0.5, half)[:-1]]
    values = np.sort(np.array([*positive, 0.0, *negative]))
    values = (values / values.max()).astype(np.float32)
    values.flags.writeable = False
    return values


NF4: np.ndarray = _normal_float(4)
"""The 16 NormalFloat-4 values of QLoRA, sorted, in float32 (a read-only numpy array).

Derived from normal quantiles (:func:`_normal_float`); within 1e-6 of the values
published with bitsandbytes. Meant for weights scaled to ``[-1, 1]`` by their absolute
maximum (per tensor, or per block as QLoRA does).

Examples:
    >>> import jax_scaled_arithmetics as jsa
    >>> nf4 = jsa.quantization.NF4
    >>> nf4.shape, float(nf4[0]), float(nf4[7]), float(nf4[-1])
    ((16,), -1.0, 0.0, 1.0)
"""


def _as_table(table: Any) -> np.ndarray:
    """Validates a table: a concrete, 1-D, strictly increasing, finite array -> float32."""
    try:
        values = np.asarray(table)
    except jax.errors.TracerArrayConversionError:
        raise TypeError(
            "the table must be a concrete array (numpy, or a JAX array outside jit): its "
            "thresholds are computed when the function is traced"
        ) from None
    if values.ndim != 1:
        raise ValueError(f"the table must be 1-D, got shape {values.shape}")
    if values.size < 2:
        raise ValueError(f"the table needs at least 2 entries, got {values.size}")
    if not (np.issubdtype(values.dtype, np.floating) or np.issubdtype(values.dtype, np.integer)):
        raise ValueError(f"the table must hold real numbers, got dtype {values.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):
        values32 = values.astype(np.float32)
    if np.isnan(values32).any():
        raise ValueError("the table has NaN entries")
    if not np.isfinite(values32).all():
        raise ValueError("the table must be finite (in float32)")
    if not (np.diff(values32) > 0).all():
        raise ValueError("the table must be sorted in strictly increasing order (in float32)")
    return values32


def _round_down(candidate: np.ndarray, sign: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Largest float32 <= t, given a float32 within one ulp of t and the sign of t - it."""
    below = np.nextafter(candidate, np.float32(-np.inf)).astype(np.float32)
    return np.where(sign < 0, below, candidate), sign == 0


def _midpoints(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact (a + b) / 2 of float32 pairs rounded down to float32, and whether it is exact."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    s = a64 + b64
    bb = s - a64
    err = (a64 - (s - bb)) + (b64 - bb)  # TwoSum: a + b == s + err exactly
    with np.errstate(over="ignore"):
        candidate = (s / 2).astype(np.float32)
    return _round_down(candidate, np.sign((s / 2 - candidate.astype(np.float64)) + err / 2))


def _geomeans(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact -sqrt(a * b) for negative pairs, sqrt(a * b) for positive ones, rounded down."""
    product = a.astype(np.float64) * b.astype(np.float64)  # exact: 48 significant bits
    root = np.sqrt(np.abs(product)).astype(np.float32)
    above = np.sign(root.astype(np.float64) ** 2 - np.abs(product))  # sign of root - sqrt
    negative = a < 0
    return _round_down(np.where(negative, -root, root), np.where(negative, above, -above))


def _hint_thresholds(hints: Any, table: np.ndarray) -> np.ndarray:
    try:
        h = np.asarray(hints, np.float64)
    except jax.errors.TracerArrayConversionError:
        raise TypeError("hints must be a concrete array, like the table") from None
    if h.shape != (table.size - 1,):
        raise ValueError(
            f"hints must be a 1-D array of {table.size - 1} thresholds (one fewer than the "
            f"table's entries), got shape {h.shape}"
        )
    if np.isnan(h).any():
        raise ValueError("hints have NaN entries")
    if not (np.diff(h) >= 0).all():
        raise ValueError("hints must be sorted in increasing order")
    if not ((table[:-1] <= h) & (h <= table[1:])).all():
        raise ValueError("each hint must lie between the two table entries it separates")
    with np.errstate(over="ignore"):
        candidate = h.astype(np.float32)
    sign = np.sign(h - candidate.astype(np.float64))
    return _round_down(candidate, sign)[0]


def _thresholds(table: np.ndarray, rounding: str, hints: Any) -> np.ndarray:
    """float32 h with: x goes above entry i iff x > h[i] (ties already resolved)."""
    if hints is not None:
        return _hint_thresholds(hints, table)
    a, b = table[:-1], table[1:]
    lower, exact = _midpoints(a, b)
    if rounding == "geomean":
        same_sign = ((a > 0) & (b > 0)) | ((a < 0) & (b < 0))
        geo_lower, geo_exact = _geomeans(a, b)
        lower = np.where(same_sign, geo_lower, lower)
        exact = np.where(same_sign, geo_exact, exact)
    # An exact tie goes to the even index: up from an odd index i to i + 1.
    tie_up = exact & (np.arange(a.size) % 2 == 1)
    below = np.nextafter(lower, np.float32(-np.inf)).astype(np.float32)
    return np.where(tie_up, below, lower).astype(np.float32)


def _check_table_rounding(rounding: Any, hints: Any, key: Any) -> str:
    if rounding not in TABLE_ROUNDING_MODES:
        raise ValueError(
            f"Unknown rounding mode {rounding!r}; expected one of {TABLE_ROUNDING_MODES}"
        )
    if hints is not None and rounding != "nearest":
        raise ValueError(
            f"hints replace the rounding rule: pass rounding='nearest', not {rounding!r}"
        )
    return _bits.check_rounding("stochastic" if rounding == "stochastic" else "nearest", key)


def _order_keys(x: Any) -> Any:
    """int32 keys ordered as the float32 values (-0 == +0), numpy or JAX.

    Comparing keys instead of floats keeps subnormals exact: XLA on CPU flushes them to
    zero in float comparisons.
    """
    if isinstance(x, np.ndarray):
        n = x.astype(np.float32).view(np.int32)
        return np.where(n < 0, -(n & np.int32(_bits.ABS_MASK)), n).astype(np.int32)
    i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(i < 0, -(i & np.int32(_bits.ABS_MASK)), i)


def _log2_floor(abs_bits: jax.Array) -> jax.Array:
    m, e = _bits.decompose(abs_bits)
    return e + 31 - jax.lax.clz(m).astype(jnp.int32)


def _scaled(bits: jax.Array, exp: jax.Array) -> jax.Array:
    """Exact ``x * 2**exp`` of float32 bits (rounded to nearest below float32's range)."""
    a = bits & _bits.u32(_bits.ABS_MASK)
    return _bits.from_bits(_bits.scale_abs_bits(a, exp) | (bits & _bits.u32(_bits.SIGN_MASK)))


def _count_below(keys: jax.Array, xk: jax.Array, inclusive: bool) -> jax.Array:
    """How many sorted `keys` are < `xk` (<= when `inclusive`): a branchless binary search.

    ``ceil(log2(n + 1))`` steps, each one gather from the (padded) keys and a compare;
    no loop and no comparison with all entries.
    """
    n = keys.shape[0]
    levels = max(n.bit_length(), 1)  # 2**levels - 1 >= n
    top = np.iinfo(np.int32).max  # above every key, NaN's included
    padded = jnp.concatenate([keys, jnp.full((2**levels - 1 - n,), top, jnp.int32)])
    count = jnp.zeros(xk.shape, jnp.int32)
    for level in reversed(range(levels)):
        step = 1 << level
        probe = padded[count + (step - 1)]
        up = xk >= probe if inclusive else xk > probe
        count = jnp.where(up, count + step, count)
    return count


def _indices(
    x: jax.Array, table: jax.Array, keys: jax.Array, thresholds: jax.Array, key: Any, mode: str
) -> jax.Array:
    """int32 index of the entry `x` (float32) goes to (NaN: any index)."""
    xk = _order_keys(x)
    if mode != "stochastic":
        return _count_below(thresholds, xk, inclusive=False)
    n = table.shape[0]
    lower = jnp.clip(_count_below(keys, xk, inclusive=True) - 1, 0, n - 2)
    lo, hi = table[lower], table[lower + 1]
    # (x - lo) / (hi - lo) on values scaled exactly so that max(|lo|, |hi|) is in [1, 2):
    # no overflow, and no subnormal that the CPU would flush.
    lo_bits, hi_bits = _bits.to_bits(lo), _bits.to_bits(hi)
    top = jnp.maximum(lo_bits & _bits.u32(_bits.ABS_MASK), hi_bits & _bits.u32(_bits.ABS_MASK))
    shift = -_log2_floor(top)
    xs = _scaled(_bits.to_bits(x), shift)
    los, his = _scaled(lo_bits, shift), _scaled(hi_bits, shift)
    p = (xs - los) / (his - los)
    u = (prng.random_bits(key, x.shape) >> 8).astype(jnp.float32) * np.float32(2.0**-24)
    index = lower + (u < p).astype(jnp.int32)
    index = jnp.where(xk < keys[0], 0, index)
    return jnp.where(xk >= keys[n - 1], n - 1, index)


@functools.partial(jax.jit, static_argnames=("mode",))
def _table_quantize_jit(
    x: jax.Array, table: jax.Array, keys: jax.Array, thresholds: jax.Array, key: Any, mode: str
) -> jax.Array:
    x32 = x.astype(jnp.float32)
    out = table[_indices(x32, table, keys, thresholds, key, mode)]
    return jnp.where(jnp.isnan(x32), x32, out).astype(x.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _table_quantize_ste(
    mode: str, x: jax.Array, table: jax.Array, keys: jax.Array, thresholds: jax.Array, key: Any
) -> jax.Array:
    return _table_quantize_jit(x, table, keys, thresholds, key, mode)


@_table_quantize_ste.defjvp
def _table_quantize_jvp(mode: str, primals: Any, tangents: Any) -> tuple[jax.Array, jax.Array]:
    return _table_quantize_ste(mode, *primals), tangents[0]


def _prepare(
    x: Any, table: Any, rounding: Any, hints: Any, key: Any, fn: str
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array], Any, str]:
    """Validated input, (table, its order keys, threshold keys) on device, key, mode."""
    table32 = _as_table(table)
    _check_table_rounding(rounding, hints, key)
    thresholds = _order_keys(_thresholds(table32, str(rounding), hints))
    consts = (jnp.asarray(table32), jnp.asarray(_order_keys(table32)), jnp.asarray(thresholds))
    x = jnp.asarray(x)
    dtype = _bits.quantized_dtype(x, fn)
    if x.dtype != dtype:
        x = x.astype(dtype)
    mode = "stochastic" if rounding == "stochastic" else "threshold"
    return x, consts, key if mode == "stochastic" else None, mode


def table_quantize(
    x: Any,
    table: Any,
    rounding: TableRounding = "nearest",
    hints: Any = None,
    key: jax.Array | None = None,
) -> jax.Array:
    """Rounds each element of `x` to an entry of a sorted table, keeping the dtype of `x`.

    * ``"nearest"``: the nearest entry; an exact tie goes to the entry of even index.
    * ``"geomean"``: between two entries of the same sign the threshold is their
      geometric mean (``±sqrt(a * b)``), for log-like tables; elsewhere the midpoint.
      Ties to the even index.
    * ``"stochastic"``: between its two neighbouring entries ``lo <= x < hi``, `x` goes
      to ``hi`` with probability ``(x - lo) / (hi - lo)`` (unbiased up to float32
      rounding of that ratio); needs `key`.
    * ``hints``: explicit thresholds ``h`` (one fewer than the entries, sorted, each
      between the two entries it separates): `x` goes above entry ``i`` iff ``x > h[i]``.
      Only with ``rounding="nearest"``.

    Thresholds are computed exactly once per call (from the float32 entries, with no
    rounding error: ties are exact) and `x` is placed with a branchless binary search
    over them (``log2`` of the table size steps, comparing integer keys ordered as the
    floats, so subnormals are exact even where the CPU flushes them in float compares).
    Values beyond the ends (±inf included) give the end entries; NaN stays NaN. float16 /
    bfloat16 inputs are compared in float32 and the entry is cast to their dtype; integer
    inputs give float32.

    Gradient: straight-through (identity), as :func:`float_quantize`.

    Args:
        x: Input array.
        table: Concrete 1-D array of at least 2 finite entries, strictly increasing once
            converted to float32 (e.g. :data:`NF4`, ``posit_values(8, 1)``).
        rounding: ``"nearest"``, ``"geomean"`` or ``"stochastic"``.
        hints: Optional thresholds replacing the rounding rule.
        key: PRNG key, required for (and only used by) ``rounding="stochastic"``.

    Returns:
        The quantised array, with the dtype and shape of `x`.

    Raises:
        ValueError: a table that is not 1-D, not strictly increasing, or has NaN or inf;
            bad hints; unknown rounding; stochastic rounding without a key.
        TypeError: for a traced table, non-real inputs or float64 inputs.

    Examples:
        >>> import jax.numpy as jnp
        >>> table = jnp.array([-1.0, 0.0, 1.0, 4.0])
        >>> table_quantize(jnp.array([-7.0, -0.4, 0.5, 2.0, 2.6, jnp.nan]), table)
        Array([-1.,  0.,  1.,  1.,  4., nan], dtype=float32)
        >>> table_quantize(jnp.array([-0.5, 2.5]), table)  # ties go to the even index
        Array([-1.,  1.], dtype=float32)
        >>> table_quantize(jnp.array([1.9, 2.1]), table, rounding="geomean")  # sqrt(4) = 2
        Array([1., 4.], dtype=float32)
        >>> table_quantize(jnp.array([0.9]), table, hints=[-0.5, 0.9, 3.0])
        Array([0.], dtype=float32)
    """
    x, consts, key, mode = _prepare(x, table, rounding, hints, key, "table_quantize")
    return _table_quantize_ste(mode, x, *consts, key)


def _code_dtype(size: int) -> np.dtype:
    if size > MAX_CODES:
        raise ValueError(f"table_encode takes tables of at most {MAX_CODES} entries, got {size}")
    return np.dtype(np.uint8) if size <= 256 else np.dtype(np.uint16)


@functools.partial(jax.jit, static_argnames=("mode", "dtype"))
def _table_encode_jit(
    x: jax.Array,
    table: jax.Array,
    keys: jax.Array,
    thresholds: jax.Array,
    key: Any,
    mode: str,
    dtype: np.dtype,
) -> jax.Array:
    x32 = x.astype(jnp.float32)
    codes = _indices(x32, table, keys, thresholds, key, mode)
    return jnp.where(jnp.isnan(x32), np.iinfo(dtype).max, codes).astype(dtype)


def table_encode(
    x: Any,
    table: Any,
    rounding: TableRounding = "nearest",
    hints: Any = None,
    key: jax.Array | None = None,
) -> jax.Array:
    """Indices of the entries :func:`table_quantize` picks: uint8 or uint16 codes.

    ``table_decode(table_encode(x, table), table)`` equals ``table_quantize(x, table)``
    (in float32). NaN gets the all-ones code (255 or 65535), which decodes to NaN when the
    table is smaller than 256 (or 65536) entries; with a full table it decodes to the last
    entry.

    Args:
        x: Input array (float up to 32 bits, or integer).
        table: As in :func:`table_quantize`, at most 65536 entries.
        rounding: As in :func:`table_quantize`.
        hints: As in :func:`table_quantize`.
        key: As in :func:`table_quantize`.

    Returns:
        uint8 codes for tables of up to 256 entries, uint16 up to 65536; the shape of `x`.

    Raises:
        ValueError: as :func:`table_quantize`, or a table of more than 65536 entries.
        TypeError: as :func:`table_quantize`.

    Examples:
        >>> import jax.numpy as jnp
        >>> codes = table_encode(jnp.array([-0.3, 0.05, 0.99]), NF4)
        >>> codes
        Array([ 4,  8, 15], dtype=uint8)
        >>> table_decode(codes, NF4).tolist() == [NF4[4], NF4[8], NF4[15]]
        True
    """
    x, consts, key, mode = _prepare(x, table, rounding, hints, key, "table_encode")
    dtype = _code_dtype(consts[0].shape[0])
    return _table_encode_jit(x, *consts, key, mode, dtype)


@jax.jit
def _table_decode_jit(codes: jax.Array, table: jax.Array) -> jax.Array:
    last = table.shape[0] - 1
    valid = codes >= 0
    if last < np.iinfo(codes.dtype).max:  # else every code of this dtype is in the table
        valid = valid & (codes <= np.asarray(last, codes.dtype))
    values = table[jnp.where(valid, codes, 0).astype(jnp.int32)]
    return jnp.where(valid, values, np.float32(np.nan))


def table_decode(codes: Any, table: Any) -> jax.Array:
    """The table entries of integer `codes` (float32); codes outside the table give NaN.

    Args:
        codes: Integer array of indices into `table` (e.g. from :func:`table_encode`).
        table: The table they index (validated as in :func:`table_quantize`).

    Returns:
        A float32 array of the shape of `codes`.

    Raises:
        ValueError: invalid table.
        TypeError: for non-integer codes.

    Examples:
        >>> import jax.numpy as jnp
        >>> table_decode(jnp.array([0, 7, 15, 255], jnp.uint8), NF4)
        Array([-1.,  0.,  1., nan], dtype=float32)
    """
    table32 = _as_table(table)
    codes = jnp.asarray(codes)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise TypeError(f"table_decode expects integer codes, got {codes.dtype.name}")
    return _table_decode_jit(codes, jnp.asarray(table32))
