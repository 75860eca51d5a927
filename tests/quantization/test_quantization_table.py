"""Lookup tables: against a brute-force argmin, ties, stochastic rounding, codes, NF4."""

from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from quantization_reference import assert_same_bits

from jax_scaled_arithmetics.quantization import (
    NF4,
    posit_values,
    table_decode,
    table_encode,
    table_quantize,
)

KEY = jax.random.key(4)
# QLoRA's NF4 values as published with bitsandbytes (functional.py, float32).
NF4_PUBLISHED = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]


def tables():
    rng = np.random.default_rng(0)
    out = {
        "uniform4": np.array([-1.5, -0.5, 0.5, 1.5], np.float32),
        "nf4": NF4,
        "random16": np.sort(rng.standard_normal(16)).astype(np.float32),
        "log32": np.concatenate([-(2.0 ** np.arange(15, -1, -1)), 2.0 ** np.arange(16)]).astype(
            np.float32
        ),
        "random256": np.unique(rng.standard_normal(256).astype(np.float32) * 10),
        "posit8_es0": posit_values(8, 0),
        "positive100": np.sort(rng.uniform(1e-3, 1e3, 100)).astype(np.float32),
        "subnormal8": np.array([-3e-45, 0, 1e-45, 3e-45, 1e-40, 1e-39, 1.2e-38, 1.0], np.float32),
        "adjacent5": np.float32(1) + np.arange(5, dtype=np.float32) * np.float32(2.0**-23),
        "huge4": np.array([-3e38, -1.0, 1.0, 3e38], np.float32),
    }
    out["random256"] = out["random256"][:256]
    return out


TABLES = tables()


def brute_force(x, table, rule="nearest"):
    """Exact reference (fractions), element by element; NaN stays NaN, ±inf clamp.

    "nearest": the argmin of the distance over all entries, ties to the even index.
    "geomean": between neighbours a < b of the same sign, x goes up iff x > sign * sqrt(ab)
    (compared exactly as x**2 against ab), elsewhere as "nearest"; ties to the even index.
    """
    t = table.astype(np.float64)
    exact = [Fraction(float(v)) for v in t]
    out = np.empty(x.shape, np.float32)
    for j, v in enumerate(x.astype(np.float64)):
        if np.isnan(v):
            out[j] = np.nan
            continue
        if np.isinf(v):
            out[j] = table[-1] if v > 0 else table[0]
            continue
        xv = Fraction(float(v))
        if rule == "nearest" or not 0 < (i := int(np.searchsorted(t, v, side="right"))) < t.size:
            d = np.abs(v - t)  # rounded distances: the exact minimum is among their minima
            candidates = np.flatnonzero(d == d.min())
            dist = {int(i): abs(xv - exact[i]) for i in candidates}
            best = min(dist.values())
            winners = [i for i in sorted(dist) if dist[i] == best]
            index = winners[0] if len(winners) == 1 else next(i for i in winners if i % 2 == 0)
        else:
            a, b = exact[i - 1], exact[i]
            if a > 0 or b < 0:  # same sign: compare |x|**2 with ab, on the pair's side
                if (xv > 0) != (a > 0):
                    up, tie = b < 0, False
                else:
                    up, tie = (xv * xv > a * b) == (a > 0), xv * xv == a * b
            else:
                up, tie = 2 * xv > a + b, 2 * xv == a + b
            index = i if up and not tie else (i - 1 if not tie else (i if i % 2 == 0 else i - 1))
        out[j] = table[index]
    return out


def adversarial_inputs(table, n_random=2000, seed=0):
    t = table.astype(np.float64)
    mids = ((t[:-1] + t[1:]) / 2).astype(np.float32)  # exact when representable
    with np.errstate(invalid="ignore"):
        geos = np.sign(t[:-1]) * np.sqrt(t[:-1] * t[1:])
    geos = geos[np.isfinite(geos)].astype(np.float32)
    points = np.concatenate([table, mids, geos])
    near = np.concatenate(
        [np.nextafter(points, np.float32(-np.inf)), np.nextafter(points, np.float32(np.inf))]
    )
    rng = np.random.default_rng(seed)
    i = rng.integers(0, t.size - 1, n_random)
    randoms = t[i] + rng.uniform(0, 1, n_random) * (t[i + 1] - t[i])  # between neighbours
    with np.errstate(over="ignore"):
        beyond = np.concatenate([t[:1] * 1.5 - 1, t[-1:] * 1.5 + 1]).astype(np.float32)
        randoms = np.concatenate([randoms.astype(np.float32), beyond])
    specials = np.array(
        [np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38], np.float32
    )
    return np.concatenate([points, near, randoms, specials]).astype(np.float32)


@pytest.mark.parametrize("name", sorted(TABLES))
def test_nearest_and_geomean_match_brute_force(name):
    table = TABLES[name]
    x = adversarial_inputs(table)
    for rule in ("nearest", "geomean"):
        got = np.asarray(table_quantize(x, table, rounding=rule))
        assert_same_bits(got, brute_force(x, table, rule), x, f"{name} {rule}")


def test_exact_ties_go_to_the_even_index():
    table = np.float32([0.0, 1.0, 2.0, 3.0, 5.0])
    x = np.float32([0.5, 1.5, 2.5, 4.0])  # ties between entries (0,1), (1,2), (2,3), (3,4)
    np.testing.assert_array_equal(np.asarray(table_quantize(x, table)), [0.0, 2.0, 2.0, 5.0])
    log = np.float32([1.0, 4.0, 16.0])
    np.testing.assert_array_equal(
        np.asarray(table_quantize(np.float32([2.0, 8.0, 7.9, 2.1]), log, rounding="geomean")),
        [1.0, 16.0, 4.0, 4.0],
    )
    # A midpoint that float32 cannot hold: no tie, the threshold is exact anyway.
    a, b = np.float32(1.0), np.nextafter(np.float32(1.0), np.float32(2))
    x = np.float32([a, b])
    np.testing.assert_array_equal(np.asarray(table_quantize(x, np.float32([a, b]))), x)


def test_hints():
    table = np.float32([-1.0, 0.0, 1.0, 4.0])
    hints = np.float64([-0.875, 0.125, 3.5])
    x = np.float32([-0.95, -0.875, -0.87, 0.125, 0.13, 3.5, 3.51, np.nan, np.inf])
    got = np.asarray(table_quantize(x, table, hints=hints))
    np.testing.assert_array_equal(got, [-1, -1, 0, 0, 1, 1, 4, np.nan, 4])
    # float64 hints between two float32 values: compared exactly.
    h = np.float64(1.0) + 2.0**-30
    x = np.float32([1.0, np.nextafter(np.float32(1), np.float32(2))])
    got = table_quantize(x, np.float32([0.0, 2.0]), hints=[h])
    np.testing.assert_array_equal(np.asarray(got), [0.0, 2.0])
    # Random hints against their definition.
    rng = np.random.default_rng(1)
    t = TABLES["random256"]
    hints = t[:-1] + rng.uniform(0, 1, t.size - 1) * np.diff(t)
    x = adversarial_inputs(t)
    expected = t[np.searchsorted(hints.astype(np.float64), x.astype(np.float64), side="left")]
    expected = np.where(np.isnan(x), np.nan, expected)
    assert_same_bits(np.asarray(table_quantize(x, t, hints=hints)), expected.astype(np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["posit8_es0", "subnormal8"])
def test_stochastic_unbiased_and_between_neighbours(name):
    table = TABLES[name].astype(np.float32)
    t = table.astype(np.float64)
    x = (t[:-1] + 0.3 * np.diff(t)).astype(np.float32)
    lo, hi = t[:-1], t[1:]
    inside = (x > lo) & (x < hi)
    x, lo, hi = x[inside], lo[inside], hi[inside]
    draws = 2000
    xs = jnp.broadcast_to(jnp.asarray(x), (draws, x.size))
    r = np.asarray(table_quantize(xs, table, rounding="stochastic", key=KEY)).astype(np.float64)
    assert ((r == lo) | (r == hi)).all()
    p = (x.astype(np.float64) - lo) / (hi - lo)
    se = (hi - lo) * np.sqrt(p * (1 - p) / draws)
    z = (r.mean(axis=0) - x) / se
    assert np.abs(z).max() < 4.5 and (np.abs(z) > 3).mean() <= 0.02, z
    # Entries stay, out-of-range values clamp, NaN stays NaN.
    edge = np.concatenate([table, np.float32([np.inf, -np.inf, np.nan, 1e38, -1e38])])
    r = np.asarray(table_quantize(edge, table, rounding="stochastic", key=KEY))
    expected = np.concatenate([table, [table[-1], table[0], np.nan, table[-1], table[0]]])
    np.testing.assert_array_equal(r, expected.astype(np.float32))


def test_encode_decode_round_trip():
    x = adversarial_inputs(TABLES["random256"])
    for name, dtype in [("nf4", np.uint8), ("random256", np.uint8), ("posit8_es0", np.uint8)]:
        table = TABLES[name]
        codes = table_encode(x, table)
        assert codes.dtype == dtype
        decoded = np.asarray(table_decode(codes, table))
        if table.size < 256:
            assert_same_bits(decoded, np.asarray(table_quantize(x, table)), x, name)
        else:  # the NaN code 255 is the last entry
            finite = ~np.isnan(x)
            assert_same_bits(decoded[finite], np.asarray(table_quantize(x, table))[finite])
    big = posit_values(10, 1)
    codes = table_encode(np.float32([0.0, 1.0, np.nan, 1e9]), big)
    assert codes.dtype == np.uint16
    np.testing.assert_array_equal(np.asarray(codes), [511, 767, 65535, 1022])
    np.testing.assert_array_equal(np.asarray(table_decode(codes, big))[:2], [0.0, 1.0])
    assert np.isnan(np.asarray(table_decode(codes, big))[2])


def test_decode_codes_outside_the_table_are_nan():
    codes = np.array([0, 15, 16, 255, -1], np.int32)
    np.testing.assert_array_equal(
        np.asarray(table_decode(codes, NF4)), [-1.0, 1.0, np.nan, np.nan, np.nan]
    )
    table = np.arange(256, dtype=np.float32)
    np.testing.assert_array_equal(
        np.asarray(table_decode(np.array([255, 0], np.uint8), table)), [255.0, 0.0]
    )
    np.testing.assert_array_equal(
        np.asarray(table_decode(np.array([255, 256, 70000], np.uint32), table)),
        [255.0, np.nan, np.nan],
    )


def test_nf4_is_derived_from_normal_quantiles():
    assert NF4.dtype == np.float32 and NF4.shape == (16,) and not NF4.flags.writeable
    np.testing.assert_allclose(NF4, NF4_PUBLISHED, rtol=0, atol=1e-6)
    assert NF4[7] == 0 and NF4[0] == -1 and NF4[-1] == 1
    w = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    w /= np.abs(w).max()
    q = np.asarray(table_quantize(w, NF4))
    assert np.isin(q, NF4).all()


def test_dtypes_jit_and_gradient():
    table = TABLES["nf4"]
    x16 = np.linspace(-1.2, 1.2, 97).astype(np.float16)
    r = table_quantize(x16, table)
    assert r.dtype == np.float16
    assert_same_bits(
        np.asarray(r), np.asarray(table_quantize(x16.astype(np.float32), table)).astype(np.float16)
    )
    xb = x16.astype(ml_dtypes.bfloat16)
    assert table_quantize(xb, table).dtype == ml_dtypes.bfloat16
    ints = table_quantize(np.arange(-2, 3, dtype=np.int32), table)
    np.testing.assert_array_equal(np.asarray(ints), [-1, -1, 0, 1, 1])
    x = jnp.linspace(-1, 1, 33)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda v: table_quantize(v, table))(x)),
        np.asarray(table_quantize(x, table)),
    )
    g = jax.grad(lambda v: jnp.sum(table_quantize(v, table) * 3.0))(x)
    np.testing.assert_array_equal(np.asarray(g), np.full(33, 3.0))


def test_search_is_not_an_argmin():
    """The compiled program searches sorted thresholds (a loop of log2(n) steps)."""
    from jax_scaled_arithmetics.quantization.table import _prepare, _table_quantize_jit

    x, consts, key, mode = _prepare(
        jnp.zeros(8), TABLES["random256"], "nearest", None, None, "table_quantize"
    )
    text = _table_quantize_jit.lower(x, *consts, key, mode).as_text()
    assert "argmin" not in text and "reduce" not in text


def test_errors():
    x = jnp.ones(3)
    with pytest.raises(ValueError, match=r"the table must be 1-D, got shape \(2, 2\)"):
        table_quantize(x, np.ones((2, 2)))
    with pytest.raises(ValueError, match="the table must be sorted in strictly increasing order"):
        table_quantize(x, [0.0, 2.0, 1.0])
    with pytest.raises(ValueError, match="the table must be sorted in strictly increasing order"):
        table_quantize(x, [0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="strictly increasing order \\(in float32\\)"):
        table_quantize(x, np.float64([1.0, 1.0 + 1e-12]))
    with pytest.raises(ValueError, match="the table has NaN entries"):
        table_quantize(x, [0.0, np.nan, 1.0])
    with pytest.raises(ValueError, match="the table must be finite"):
        table_quantize(x, [0.0, np.inf])
    with pytest.raises(ValueError, match="the table needs at least 2 entries, got 1"):
        table_quantize(x, [0.0])
    with pytest.raises(ValueError, match="the table must hold real numbers"):
        table_quantize(x, np.array([1 + 1j, 2j]))
    with pytest.raises(ValueError, match="Unknown rounding mode 'up'; expected one of"):
        table_quantize(x, NF4, rounding="up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rounding='stochastic' needs a PRNG key"):
        table_quantize(x, NF4, rounding="stochastic")
    with pytest.raises(ValueError, match="hints replace the rounding rule"):
        table_quantize(x, NF4, rounding="geomean", hints=np.zeros(15))
    with pytest.raises(ValueError, match="hints must be a 1-D array of 15 thresholds"):
        table_quantize(x, NF4, hints=np.zeros(4))
    with pytest.raises(ValueError, match="hints have NaN entries"):
        table_quantize(x, [0.0, 1.0], hints=[np.nan])
    with pytest.raises(ValueError, match="hints must be sorted"):
        table_quantize(x, [0.0, 1.0, 2.0], hints=[1.0, 0.9])
    with pytest.raises(ValueError, match="each hint must lie between the two table entries"):
        table_quantize(x, [0.0, 1.0, 2.0], hints=[1.5, 1.6])
    with pytest.raises(ValueError, match="table_encode takes tables of at most 65536 entries"):
        table_encode(x, np.arange(70000, dtype=np.float32))
    with pytest.raises(TypeError, match="expects a real floating point or integer array"):
        table_quantize(jnp.ones(3, jnp.complex64), NF4)
    with pytest.raises(TypeError, match="table_decode expects integer codes"):
        table_decode(x, NF4)
    with pytest.raises(TypeError, match="the table must be a concrete array"):
        jax.jit(lambda v, t: table_quantize(v, t))(x, jnp.asarray(NF4))
