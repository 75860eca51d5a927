"""Posits: bit-exact against SoftPosit (live when installed, else its committed golden table)
and an exact pure-Python reference; rounding modes; names; scaled posits."""

import hashlib
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from posit_reference import GOLDEN_FORMATS, decode, decode_numpy, encode, golden_inputs
from quantization_reference import assert_same_bits

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.quantization import (
    POSIT_FORMATS,
    PositFormat,
    block_quantize,
    float_quantize,
    get_format,
    posit_from_bits,
    posit_quantize,
    posit_to_bits,
    posit_values,
)
from jax_scaled_arithmetics.quantization.posit import _encode_f32
from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "posit_golden.npz"
NAMES = [f"posit{n}_es{es}" for n, es in GOLDEN_FORMATS]
KEY = jax.random.key(17)


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as data:
        return {k: data[k] for k in data.files}


def all_codes(nbits):
    return np.arange(2**nbits, dtype=np.uint32)


def canonical_sha256(values):
    bits = np.asarray(values, np.float32).view(np.uint32).copy()
    bits[np.isnan(np.asarray(values, np.float32))] = 0x7FC00000
    return hashlib.sha256(bits.tobytes()).hexdigest()


def reference_values(nbits, es):
    """Exact values of every code (NaN for NaR), from the pure-Python reference."""
    return np.array(
        [np.nan if v is None else float(v) for v in (decode(c, nbits, es) for c in range(2**nbits))]
    )


# --- decoding ------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_code_decodes_to_softposit_value(golden):
    """Every code of every SoftPosit format, by the library and by `decode_numpy`."""
    for (nbits, es), name in zip(GOLDEN_FORMATS, NAMES, strict=True):
        values = posit_from_bits(all_codes(nbits), nbits, es)
        assert values.dtype == np.float32
        assert canonical_sha256(np.asarray(values)) == str(golden[f"decode_sha256/{name}"]), name
        reference = decode_numpy(all_codes(nbits), nbits, es).astype(np.float32)
        assert canonical_sha256(reference) == str(golden[f"decode_sha256/{name}"]), name


@pytest.mark.parametrize("nbits, es", [(8, 0), (10, 1), (6, 2), (9, 3), (3, 1), (2, 0)])
def test_every_code_decodes_to_exact_value(nbits, es):
    values = np.asarray(posit_from_bits(all_codes(nbits), nbits, es)).astype(np.float64)
    np.testing.assert_array_equal(values, reference_values(nbits, es))


def test_decode_wide_formats_and_signed_codes():
    rng = np.random.default_rng(0)
    for nbits, es in [(26, 0), (27, 1), (28, 2), (17, 3)]:
        codes = rng.integers(0, 2**nbits, 2000, dtype=np.uint32)
        got = np.asarray(posit_from_bits(codes, nbits, es)).astype(np.float64)
        values = [decode(int(c), nbits, es) for c in codes]
        ref = np.array([np.nan if v is None else float(v) for v in values])
        np.testing.assert_array_equal(got, ref)
    codes = np.arange(-128, 128, dtype=np.int8)
    np.testing.assert_array_equal(
        np.asarray(posit_from_bits(codes, 8, 0)),
        np.asarray(posit_from_bits(codes.view(np.uint8), 8, 0)),
    )


# --- encoding: golden table and references ---------------------------------------------------


@pytest.fixture(scope="module")
def golden_cases(golden):
    """name -> (inputs, SoftPosit codes)."""
    cases = {}
    for nbits, es in GOLDEN_FORMATS:
        name = f"posit{nbits}_es{es}"
        x = golden_inputs(nbits, es)
        digest = hashlib.sha256(x.tobytes()).hexdigest()
        assert digest == str(golden[f"inputs_sha256/{name}"]), (
            f"{name}: the golden inputs changed; regenerate: python scripts/gen_posit_golden.py"
        )
        cases[name] = (x, np.cumsum(golden[f"encode/{name}"].astype(np.int64)))
    return cases


def test_golden_inputs_cover_binades_ties_and_specials(golden_cases):
    x, _ = golden_cases["posit16_es1"]
    finite = x[np.isfinite(x) & (x != 0)]
    binades = np.unique(np.floor(np.log2(np.abs(finite.astype(np.float64)))))
    assert binades.min() == -149 and binades.max() == 127 and binades.size == 277
    assert np.isnan(x).any() and np.isposinf(x).any() and np.isneginf(x).any()
    assert (x == 0).any() and (np.abs(x) < np.finfo(np.float32).tiny).sum() > 10  # subnormals
    ties = np.asarray(posit_from_bits(np.arange(1, 2**16, 2, dtype=np.uint32), 17, 1))
    assert np.isin(ties, x).all() and np.isin(np.nextafter(ties, np.float32(0)), x).all()


# The default run holds posit8_es0, posit16_es1 and five widths of the es = 2 sweep (8-bit
# and 16-bit codes among them); the slow step every SoftPosit format. Every format's
# decoding: test_every_code_decodes_to_softposit_value.
GOLDEN_DEFAULT = {"posit8_es0", "posit16_es1", *(f"posit{n}_es2" for n in (4, 5, 8, 12, 16))}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in GOLDEN_DEFAULT else pytest.mark.slow) for n in NAMES]
)
def test_encoding_matches_softposit_golden(name, golden_cases):
    """`posit_to_bits` and `posit_quantize` of every golden input equal SoftPosit's."""
    fmt = get_format(name)
    x, expected = golden_cases[name]
    codes = posit_to_bits(x, fmt.nbits, fmt.es)
    assert codes.dtype == fmt.code_dtype
    got = np.asarray(codes).astype(np.int64)
    bad = np.flatnonzero(got != expected)
    assert bad.size == 0, (name, x[bad[:5]], got[bad[:5]], expected[bad[:5]])
    values = np.asarray(posit_quantize(x, fmt.nbits, fmt.es))
    # SoftPosit's values of its codes: decode_numpy, equal to SoftPosit's decoding (above).
    assert_same_bits(values, decode_numpy(expected, fmt.nbits, fmt.es).astype(np.float32), x, name)


def sample_inputs(nbits, es, n=600, seed=0):
    """Binades, random values, and random ties between neighbours with their neighbours."""
    rng = np.random.default_rng(seed)
    exps = np.arange(-149, 128, 3, dtype=np.float64)
    randoms = np.exp2(rng.uniform(-150, 127, n)) * rng.uniform(1, 2, n)
    odd = 2 * rng.integers(0, 2 ** (nbits - 1), n, dtype=np.int64) + 1
    ties = np.array([float(decode(int(c), nbits + 1, es)) for c in odd])
    values = np.concatenate([2**exps * 1.3, randoms, ties]).astype(np.float32)
    values = np.concatenate(
        [
            values,
            np.nextafter(values[-n:], np.float32(0)),
            np.nextafter(values[-n:], np.float32(np.inf)),
        ]
    )
    return np.concatenate([values, -values[::7]])


@pytest.mark.parametrize(
    "nbits, es", [(8, 0), (16, 1), (5, 1), (12, 3), (17, 3), (26, 0), (27, 1), (28, 2), (10, 0)]
)
def test_encoding_matches_exact_reference(nbits, es):
    """Formats beyond SoftPosit's (es 0, 1 and 3 at other widths, the widest) included."""
    x = sample_inputs(nbits, es, n=300)
    got = np.asarray(posit_to_bits(x, nbits, es)).astype(np.int64)
    ref = np.array([encode(float(v), nbits, es) for v in x])
    bad = np.flatnonzero(got != ref)
    assert bad.size == 0, (x[bad[:5]], got[bad[:5]], ref[bad[:5]])


def test_softposit_live():
    """Checks against SoftPosit itself, when it is installed (the golden table otherwise)."""
    sp = pytest.importorskip(
        "softposit",
        reason="SoftPosit is not installed (pip install softposit builds it from source); "
        "tests/data/posit_golden.npz still checks bit-exactness",
    )
    gen = load_script("gen_posit_golden", "scripts/gen_posit_golden.py")
    for nbits, es in [(8, 0), (16, 1)]:
        values = [gen.softposit_value(sp, c, nbits, es) for c in range(2**nbits)]
        got = np.asarray(posit_from_bits(all_codes(nbits), nbits, es))
        assert canonical_sha256(got) == gen.float32_sha256(np.array(values))
    for nbits, es in GOLDEN_FORMATS:
        x = sample_inputs(nbits, es, n=200, seed=nbits)
        got = np.asarray(posit_to_bits(x, nbits, es)).astype(np.int64)
        ref = np.array([gen.softposit_code(sp, float(v), nbits, es) for v in x])
        np.testing.assert_array_equal(got, ref, err_msg=f"posit{nbits}_es{es}")


# --- the rounding rules ---------------------------------------------------------------------


def test_ties_are_on_the_bit_string():
    # posit8_es2 next to maxpos: 2**20 and 2**24 are neighbours, the tie is 2**22.
    x = np.array([2.0**22, np.nextafter(np.float32(2.0**22), np.float32(np.inf)), 9e6], np.float32)
    np.testing.assert_array_equal(np.asarray(posit_quantize(x, 8, 2)), [2.0**20, 2.0**24, 2.0**24])
    # In the fraction field the tie is the arithmetic midpoint, to even: 1 + 1/64 -> 1.
    np.testing.assert_array_equal(
        np.asarray(posit_quantize(np.float32([1 + 2**-6, 1 + 3 * 2**-6]), 8, 0)), [1.0, 1.0625]
    )


@pytest.mark.parametrize("name", ["posit8_es0", "posit8_es2", "posit16_es1", "posit4_es2"])
def test_never_zero_or_infinite(name, golden_cases):
    fmt = get_format(name)
    x, _ = golden_cases[name]
    r = np.asarray(posit_quantize(x, fmt.nbits, fmt.es))
    finite_nonzero = np.isfinite(x) & (x != 0)
    assert (np.abs(r[finite_nonzero]) >= fmt.min).all() and (
        np.abs(r[finite_nonzero]) <= fmt.max
    ).all()
    assert (np.sign(r[finite_nonzero]) == np.sign(x[finite_nonzero])).all()
    assert (r[x == 0] == 0).all() and not np.signbit(r[x == 0]).any()
    assert np.isnan(r[~np.isfinite(x)]).all()
    tiny = np.float32([1e-45, -1e-45, 1e-30, 3e38, -np.float32(3e38)])
    np.testing.assert_array_equal(
        np.asarray(posit_quantize(tiny, fmt.nbits, fmt.es)),
        np.float32([fmt.min, -fmt.min, fmt.min, fmt.max, -fmt.max]),
    )


def neighbour_values(x, nbits, es):
    """Finite posit values below (or at) and above |x|, float64 magnitudes; 0 below minpos."""
    v = posit_values(nbits, es).astype(np.float64)
    v = v[v >= 0]
    ax = np.abs(x.astype(np.float64))
    i = np.clip(np.searchsorted(v, ax, side="right") - 1, 0, v.size - 1)
    lo = v[i]
    hi = np.where(lo == ax, lo, v[np.minimum(i + 1, v.size - 1)])
    return lo, hi


@pytest.mark.parametrize("name", ["posit8_es0", "posit8_es2", "posit16_es1", "posit5_es2"])
def test_toward_zero_truncates(name, golden_cases):
    fmt = get_format(name)
    x, _ = golden_cases[name]
    r = np.asarray(posit_quantize(x, fmt.nbits, fmt.es, rounding="toward_zero"))
    finite = np.isfinite(x)
    lo, _ = neighbour_values(x[finite], fmt.nbits, fmt.es)
    np.testing.assert_array_equal(np.abs(r[finite]).astype(np.float64), lo)
    assert (np.signbit(r[finite]) == (np.signbit(x[finite]) & (lo != 0))).all()
    assert np.isnan(r[~finite]).all()
    codes = posit_to_bits(x, fmt.nbits, fmt.es, rounding="toward_zero")
    assert_same_bits(np.asarray(posit_from_bits(codes, fmt.nbits, fmt.es)), r)


def between_every_pair(nbits, es, fraction=0.3):
    """One float32 input strictly between each pair of neighbouring posits (0 included)."""
    v = posit_values(nbits, es).astype(np.float64)
    x = (v[:-1] + fraction * (v[1:] - v[:-1])).astype(np.float32)
    assert ((x > v[:-1]) & (x < v[1:])).all()
    return x, v[:-1], v[1:]


@pytest.mark.parametrize("nbits, es", [(8, 0), (8, 2)])
def test_stochastic_is_unbiased_between_every_pair(nbits, es):
    """Mean over 10,000 keys for inputs between every pair of neighbouring posit8 values:
    every pair's mean is within 3 standard errors of its input (the issue's criterion,
    checked on one fixed key sequence, so the test is deterministic), and the mean of the
    standardised errors over all pairs is within 3 standard errors of 0.
    `test_stochastic_probabilities_exact` checks the rounding probabilities themselves.
    """
    x, lo, hi = between_every_pair(nbits, es)
    draws = 10_000
    keys = jax.random.split(KEY, draws)
    r = jax.vmap(lambda k: posit_quantize(x, nbits, es, rounding="stochastic", key=k))(keys)
    r = np.asarray(r).astype(np.float64)
    assert ((r == lo) | (r == hi)).all()  # never leaves the two neighbours
    p = (x.astype(np.float64) - lo) / (hi - lo)
    se = (hi - lo) * np.sqrt(p * (1 - p) / draws)
    z = (r.mean(axis=0) - x) / se
    assert np.abs(z).max() < 3, np.abs(z).max()
    assert abs(z.mean()) * np.sqrt(z.size) < 3


@pytest.mark.parametrize("nbits, es", [(8, 0), (8, 2), (16, 1), (9, 3)])
def test_stochastic_probabilities_exact(nbits, es):
    """Through the random bits directly: over an even grid of 2**12 of them, the mean of
    the result is the input (up to the grid's resolution and 2**-24)."""
    x, lo, hi = between_every_pair(nbits, es, fraction=0.37)
    if x.size > 1000:
        x, lo, hi = x[::64], lo[::64], hi[::64]
    grid = (np.arange(2**12, dtype=np.uint32) << 20) | np.uint32(1 << 19)
    xs = jnp.broadcast_to(jnp.asarray(x)[None, :], (grid.size, x.size))
    rbits = jnp.broadcast_to(jnp.asarray(grid)[:, None], xs.shape)
    codes = jax.jit(lambda a, r: _encode_f32(a, nbits, es, "stochastic", r))(xs, rbits)
    r = np.asarray(posit_from_bits(codes, nbits, es)).astype(np.float64)
    assert ((r == lo) | (r == hi)).all()
    error = np.abs(r.mean(axis=0) - x) / (hi - lo)
    assert error.max() <= 2.0**-12 + 2.0**-23, error.max()


def test_stochastic_specials_and_reproducible():
    specials = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1e30, -1e30, 64.0, 1.0])
    x = np.concatenate([specials, np.linspace(-3, 3, 1001, dtype=np.float32)])
    a = np.asarray(posit_quantize(x, 8, 0, rounding="stochastic", key=KEY))
    np.testing.assert_array_equal(a[:9], [0, 0, np.nan, np.nan, np.nan, 64, -64, 64, 1])
    np.testing.assert_array_equal(a, np.asarray(posit_quantize(x, 8, 0, "stochastic", KEY)))
    b = np.asarray(posit_quantize(x, 8, 0, "stochastic", jax.random.PRNGKey(3)))  # raw key
    assert (a[9:] != b[9:]).any()


# --- dtypes, transformations, errors -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_half_precision_inputs(dtype):
    x = np.linspace(-100, 100, 4001).astype(dtype)
    for nbits, es in [(8, 0), (16, 1)]:
        r = np.asarray(posit_quantize(x, nbits, es))
        assert r.dtype == dtype
        with np.errstate(over="ignore"):
            expected = np.asarray(posit_quantize(x.astype(np.float32), nbits, es)).astype(dtype)
        assert_same_bits(r, expected, x, f"posit{nbits}_es{es}")


def test_integer_inputs_give_float32():
    r = posit_quantize(jnp.arange(-3, 100, dtype=jnp.int32), 8, 0)
    assert r.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(r), np.asarray(posit_quantize(np.arange(-3, 100).astype(np.float32), 8, 0))
    )
    assert posit_to_bits(jnp.array([1, 2], jnp.int8), 8, 0).dtype == jnp.uint8


def test_code_dtypes_and_round_trip():
    x = np.linspace(-5, 5, 101).astype(np.float32)
    for nbits, es, dtype in [
        (4, 0, np.uint8),
        (8, 2, np.uint8),
        (12, 1, np.uint16),
        (20, 2, np.uint32),
    ]:
        codes = posit_to_bits(x, nbits, es)
        assert codes.dtype == dtype
        assert_same_bits(
            np.asarray(posit_from_bits(codes, nbits, es)), np.asarray(posit_quantize(x, nbits, es))
        )


def test_jit_vmap_and_no_recompilation():
    x = jnp.linspace(-3, 3, 64).reshape(8, 8)
    eager = posit_quantize(x, 8, 1)
    np.testing.assert_array_equal(jax.jit(lambda v: posit_quantize(v, 8, 1))(x), eager)
    np.testing.assert_array_equal(jax.vmap(lambda v: posit_quantize(v, 8, 1))(x), eager)
    from jax_scaled_arithmetics.quantization.posit import _posit_quantize_ste

    posit_quantize(x + 1, 8, 1)
    size = _posit_quantize_ste.compiled._cache_size()
    posit_quantize(x * 2, 8, 1)
    assert _posit_quantize_ste.compiled._cache_size() == size


def test_straight_through_gradient():
    x = jnp.array([0.3, -1.7, 1000.0, 1e-9, 0.0])
    g = jax.grad(lambda v: jnp.sum(posit_quantize(v, 8, 0) * jnp.arange(5.0)))(x)
    np.testing.assert_array_equal(np.asarray(g), np.arange(5.0))
    g = jax.grad(lambda v: jnp.sum(posit_quantize(v, 8, 0, "stochastic", KEY)))(x)
    np.testing.assert_array_equal(np.asarray(g), np.ones(5))


def test_errors():
    x = jnp.ones(3)
    message = r"posit{}_es{} is not supported: es must be an integer in \[0, 3\] and nbits"
    for nbits, es in [(1, 0), (27, 0), (29, 2), (18, 3), (8, 4), (8, -1), (8.0, 0), (True, 0)]:
        with pytest.raises(ValueError, match=message.format(nbits, es)):
            posit_quantize(x, nbits, es)
    with pytest.raises(ValueError, match=r"\[2, 26\] for es=0, \[2, 27\] for es=1"):
        posit_to_bits(x, 40, 0)
    with pytest.raises(ValueError, match="posit29_es2 is not supported"):
        get_format("posit29_es2")
    with pytest.raises(ValueError, match="Unknown float format 'posit8'"):
        get_format("posit8")
    with pytest.raises(ValueError, match="posit8_es5 is not supported"):
        float_quantize(x, "posit8_es5")
    with pytest.raises(ValueError, match="Unknown rounding mode 'up'"):
        posit_quantize(x, 8, 0, rounding="up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rounding='stochastic' needs a PRNG key"):
        posit_quantize(x, 8, 0, rounding="stochastic")
    with pytest.raises(ValueError, match="rounding='stochastic' needs a PRNG key"):
        posit_to_bits(x, 8, 0, rounding="stochastic")
    with pytest.raises(TypeError, match="expects a real floating point or integer array"):
        posit_quantize(jnp.ones(3, jnp.complex64), 8, 0)
    with jax.enable_x64(True):
        with pytest.raises(TypeError, match="does not accept float64 inputs"):
            posit_quantize(jnp.ones(3, jnp.float64), 8, 0)
    with pytest.raises(TypeError, match="posit_from_bits expects integer codes, got float32"):
        posit_from_bits(x, 8, 0)
    with pytest.raises(ValueError, match="posit_values lists posits of at most 16 bits"):
        posit_values(17, 1)
    with pytest.raises(ValueError, match="block element format must be a float format"):
        block_quantize(x, "posit8_es0", block_size=3)


# --- formats, names and tables -----------------------------------------------------------------


@pytest.mark.parametrize("name", [*POSIT_FORMATS, "posit2_es0", "posit3_es1", "posit5_es3"])
def test_format_properties(name):
    fmt = get_format(name)
    assert isinstance(fmt, PositFormat) and fmt.name == name and fmt.bits == fmt.nbits
    v = reference_values(fmt.nbits, fmt.es)
    v = v[np.isfinite(v)]
    assert fmt.max == v.max() and fmt.min == v[v > 0].min()
    above_one = v[v > 1]
    assert fmt.epsilon == (above_one.min() - 1 if above_one.size else None)
    if fmt.nbits >= 3 + fmt.es:
        assert np.diff(v[(v >= 1) & (v <= 2)]).max() == 2.0**-fmt.fraction_bits
    assert get_format(fmt) is fmt and PositFormat(fmt.nbits, fmt.es) == fmt


def test_posit_values():
    for nbits, es in [(2, 0), (4, 0), (8, 0), (8, 2), (12, 1)]:
        v = posit_values(nbits, es)
        assert v.dtype == np.float32 and v.size == 2**nbits - 1
        assert (np.diff(v) > 0).all() and (v == -v[::-1]).all() and 0 in v
        ref = reference_values(nbits, es)
        np.testing.assert_array_equal(v.astype(np.float64), np.sort(ref[np.isfinite(ref)]))
    v = posit_values(8, 0)
    v[0] = 5.0  # a copy: the cache is untouched
    assert posit_values(8, 0)[0] == -64.0


def test_names_work_wherever_formats_are_accepted():
    x = jnp.array([0.3, 1.03, -3.0, 100.0, 1e-9])
    expected = np.asarray(posit_quantize(x, 8, 2))
    np.testing.assert_array_equal(np.asarray(float_quantize(x, "posit8_es2")), expected)
    np.testing.assert_array_equal(np.asarray(float_quantize(x, PositFormat(8, 2))), expected)
    # ScaledArray data (simulated casts), forward and backward.
    s = jsa.scaled_array(np.asarray(x), np.float32(2.0**-10))
    y = jsa.ops.reduce_precision_on_forward(s, "posit8_es2")
    assert isinstance(y, jsa.ScaledArray) and float(y.scale) == 2.0**-10
    np.testing.assert_array_equal(np.asarray(y.data), expected)
    g = jax.grad(lambda v: jnp.sum(jsa.ops.reduce_precision_on_backward(v, "posit8_es0") * 1.03))(
        jnp.ones(2)
    )
    np.testing.assert_array_equal(np.asarray(g), [1.03125, 1.03125])
    q = jsa.ops.quantizer("posit16_es1", "posit8_es0")
    np.testing.assert_array_equal(np.asarray(q(x)), np.asarray(posit_quantize(x, 16, 1)))

    f = jsa.ops.simulate_fp8(lambda a, b: a @ b, forward_format="posit8_es0")
    np.testing.assert_array_equal(
        np.asarray(f(jnp.array([[1.03, 3.3]]), jnp.ones((2, 1)))), [[4.28125]]
    )
    r = jsa.ops.reduce_precision_on_forward(x, "posit8_es0", rounding="stochastic", key=KEY)
    lo, hi = neighbour_values(np.asarray(x), 8, 0)
    magnitude = np.abs(np.asarray(r, np.float64))
    assert ((magnitude == lo) | (magnitude == hi) | (magnitude == 1 / 64)).all()


@pytest.mark.parametrize("use_jit", [False, True])
def test_under_autoscale_sees_represented_values(use_jit):
    x = jsa.scaled_array(np.array([1.1, -3.3, 0.3, 7.7, -0.05, 0.0], np.float32), np.float32(8.0))
    fn = jsa.autoscale(lambda v: posit_quantize(v, 8, 1))
    out = (jax.jit(fn) if use_jit else fn)(x)
    expected = posit_quantize(np.asarray(x.to_array(jnp.float32)), 8, 1)
    np.testing.assert_array_equal(np.asarray(jsa.asarray(out, jnp.float32)), np.asarray(expected))


# --- scaled posits ------------------------------------------------------------------------------


def relative_rms_error(quantised, x):
    return float(np.sqrt(np.mean((np.asarray(quantised, np.float64) - x) ** 2) / np.mean(x**2)))


def test_scaled_posits_put_the_data_near_one():
    """posit8 on data of RMS 1e-3: unscaled, most values fall below posit8_es0's minpos
    (1/64); as a ScaledArray rescaled by its RMS (`dynamic_rescale_l2`) the data sit in
    [1, 2) RMS, where posits are most precise, and the error is that of 5 fraction bits."""
    x = (np.random.default_rng(0).standard_normal(50_000) * 1e-3).astype(np.float32)
    errors = {}
    for name in ("posit8_es0", "posit8_es2"):
        plain = float_quantize(x, name)
        scaled = jsa.ops.dynamic_rescale_l2(jsa.as_scaled_array(jnp.asarray(x)))
        assert 1 <= float(jnp.sqrt(jnp.mean(scaled.data**2))) < 2
        quantised = jsa.ops.reduce_precision_on_forward(scaled, name)
        errors[name] = (
            relative_rms_error(plain, x),
            relative_rms_error(quantised.to_array(jnp.float32), x),
        )
    assert errors["posit8_es0"][0] > 5  # everything below 1/64 becomes ±1/64
    assert errors["posit8_es0"][1] < 0.03
    assert errors["posit8_es2"][0] > 0.05  # 1e-3 is far from 1: one or two fraction bits
    assert errors["posit8_es2"][1] < 0.05
    assert errors["posit8_es2"][1] < errors["posit8_es2"][0] / 2
