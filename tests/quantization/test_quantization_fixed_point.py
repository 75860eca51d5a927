import jax
import jax.numpy as jnp
import numpy as np
import pytest
from quantization_reference import BFLOAT16, assert_same_bits, bits_of, random_values

from jax_scaled_arithmetics.quantization import fixed_point_quantize

KEY = jax.random.key(5)
# (word_bits, frac_bits): narrow, wide, integer-only, sub-unit steps, float32 extremes.
WIDTHS = [(8, 4), (1, 0), (2, 1), (16, 8), (25, 0), (25, 24), (4, 30), (12, 149), (25, 149)]


def ref_fixed_point(x, word_bits, frac_bits, rounding="nearest", clamp=True):
    """Float64 reference: scale, round (half to even), clamp, unscale; no negative zero."""
    with np.errstate(all="ignore"):
        y = np.asarray(x, np.float32).astype(np.float64) * 2.0**frac_bits
        n = np.round(y) if rounding == "nearest" else np.trunc(y)
        if clamp:
            n = np.clip(n, -(2.0 ** (word_bits - 1)), 2.0 ** (word_bits - 1) - 1)
        r = n * 2.0**-frac_bits
        r = np.where(r == 0, 0.0, r)
        return r.astype(np.float32)


def probes(word_bits, frac_bits):
    """Grid points near zero and near both bounds, midpoints, and their neighbours."""
    top = 2 ** (word_bits - 1)
    k = np.unique(
        np.concatenate(
            [np.arange(-50, 51), np.arange(-top - 50, -top + 50), np.arange(top - 50, top + 50)]
        )
    ).astype(np.float64)
    values = np.concatenate([k, k + 0.5, k + 0.25]) * 2.0**-frac_bits
    with np.errstate(all="ignore"):
        v = values.astype(np.float32)
        specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3e38, -3e38], np.float32)
        v = np.concatenate([v, specials])
        return np.concatenate(
            [v, np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(-np.inf))]
        )


def quantize_jit(xs, configs, key=None):
    """fixed_point_quantize(x, *config) for each config in one jit (one trace)."""

    def fn(xs, k):
        return [
            fixed_point_quantize(v, w, f, r, c, key=k if r == "stochastic" else None)
            for v, (w, f, r, c) in zip(xs, configs, strict=True)
        ]

    return [np.asarray(o) for o in jax.jit(fn)([jax.device_put(v) for v in xs], key)]


@pytest.mark.parametrize(
    "part",
    # One program of all 36 configurations takes seconds to compile: half of them (each
    # width with both roundings and both clamps, the four rounding x clamp pairs across
    # widths) in the default run, the other half in the slow step.
    ["cover", pytest.param("rest", marks=pytest.mark.slow)],
)
def test_matches_reference(part):
    rand = random_values(20_000, seed=11)
    xs, configs = [], []
    for i, (w, f) in enumerate(WIDTHS):
        x = np.concatenate([probes(w, f), rand])
        for rounding in ("nearest", "toward_zero"):
            for clamp in (True, False):
                in_cover = (rounding == "nearest") == (clamp == bool(i % 2))
                if in_cover == (part == "cover"):
                    xs.append(x)
                    configs.append((w, f, rounding, clamp))
    for x, config, got in zip(xs, configs, quantize_jit(xs, configs), strict=True):
        assert_same_bits(got, ref_fixed_point(x, *config), x, str(config))


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BFLOAT16], ids=str)
def test_half_precision_inputs(dtype):
    with np.errstate(all="ignore"):
        x = np.concatenate([probes(8, 4), random_values(5_000, 3)]).astype(dtype)
    got = np.asarray(fixed_point_quantize(jax.device_put(x), 8, 4))
    assert got.dtype == dtype
    with np.errstate(all="ignore"):
        ref = ref_fixed_point(x.astype(np.float32), 8, 4).astype(dtype)
    assert_same_bits(got, ref, x)


def test_examples_and_no_negative_zero():
    x = jnp.array([0.3, -0.3, 0.375, 9.0, -9.0, -0.01, 0.03125, 0.09375])
    got = fixed_point_quantize(x, word_bits=8, frac_bits=4)
    np.testing.assert_array_equal(got, [0.3125, -0.3125, 0.375, 7.9375, -8.0, 0.0, 0.0, 0.125])
    assert bits_of(np.asarray(got))[5] == 0  # -0.01 rounds to +0
    unclamped = fixed_point_quantize(x, 8, 4, saturate=False)
    np.testing.assert_array_equal(unclamped[3:5], [9.0, -9.0])
    inf = fixed_point_quantize(jnp.array([jnp.inf, -jnp.inf, jnp.nan]), 8, 4)
    np.testing.assert_array_equal(inf[:2], [7.9375, -8.0])
    assert np.isnan(inf[2])
    inf_free = fixed_point_quantize(jnp.array([jnp.inf, -jnp.inf]), 8, 4, saturate=False)
    np.testing.assert_array_equal(inf_free, [np.inf, -np.inf])
    ints = fixed_point_quantize(jnp.arange(-3, 4), 3, 0)
    assert ints.dtype == jnp.float32
    np.testing.assert_array_equal(ints, [-3, -2, -1, 0, 1, 2, 3])


def test_one_bit_word():
    got = fixed_point_quantize(jnp.array([-2.0, -0.6, -0.4, 0.4, 3.0]), 1, 0)
    np.testing.assert_array_equal(got, [-1.0, -1.0, 0.0, 0.0, 0.0])


def test_stochastic():
    n = 200_000
    cases = [(0.3, 8, 4), (-2.71, 8, 2), (2.0**-14, 8, 4), (100.3, 8, 0)]
    xs = [np.full(n, v, np.float32) for v, _, _ in cases]
    configs = [(w, f, "stochastic", True) for _, w, f in cases]
    outs = quantize_jit(xs, configs, KEY)
    for (value, _, f), r in zip(cases, outs, strict=True):
        step = 2.0**-f
        v = np.float64(np.float32(value))
        lo = np.floor(v / step) * step
        hi = lo + step
        assert set(np.unique(r.astype(np.float64))) <= {lo, hi}, value
        p = (v - lo) / step
        sd = step * np.sqrt(p * (1 - p))
        assert abs(r.astype(np.float64).mean() - v) <= 5 * sd / np.sqrt(n), value
    sat = fixed_point_quantize(jnp.full((1000,), 200.5), 8, 0, "stochastic", key=KEY)
    assert (sat == 127).all()
    x = jnp.full((1000,), 0.3)
    first = np.asarray(fixed_point_quantize(x, 8, 4, "stochastic", key=KEY))
    assert_same_bits(np.asarray(fixed_point_quantize(x, 8, 4, "stochastic", key=KEY)), first)
    other = np.asarray(fixed_point_quantize(x, 8, 4, "stochastic", key=jax.random.key(6)))
    assert (other != first).any()


def test_straight_through_gradient_jit_and_vmap():
    x = jnp.array([0.3, -1.7, 100.0, -100.0, 0.0])
    w = jnp.arange(1.0, 6.0)

    def loss(v):
        near = fixed_point_quantize(v, 8, 4)
        sr = fixed_point_quantize(v, 8, 4, "stochastic", key=KEY)
        return jnp.sum((near + sr) * w)

    np.testing.assert_array_equal(jax.grad(loss)(x), 2 * w)
    np.testing.assert_array_equal(jax.jit(jax.grad(loss))(x), 2 * w)
    g16 = jax.grad(lambda v: jnp.sum(fixed_point_quantize(v, 8, 4)))(x.astype(jnp.bfloat16))
    assert g16.dtype == jnp.bfloat16 and (g16 == 1).all()
    rows = jnp.stack([x, -x])
    batched = jax.vmap(lambda r: fixed_point_quantize(r, 8, 4))(rows)
    np.testing.assert_array_equal(batched, fixed_point_quantize(rows, 8, 4))


@pytest.mark.parametrize(
    "word_bits, frac_bits, match",
    [
        (0, 4, r"word_bits must be an integer in \[1, 25\], got 0"),
        (-8, 4, r"word_bits must be an integer in \[1, 25\], got -8"),
        (26, 4, r"word_bits must be an integer in \[1, 25\], got 26"),
        (8.0, 4, r"word_bits must be an integer in \[1, 25\], got 8.0"),
        (True, 4, r"word_bits must be an integer in \[1, 25\], got True"),
        (8, -1, r"frac_bits must be an integer in \[0, 149\], got -1"),
        (8, 150, r"frac_bits must be an integer in \[0, 149\], got 150"),
        (8, None, r"frac_bits must be an integer in \[0, 149\], got None"),
    ],
)
def test_bad_widths(word_bits, frac_bits, match):
    with pytest.raises(ValueError, match=match):
        fixed_point_quantize(jnp.ones(3), word_bits, frac_bits)


def test_bad_arguments():
    with pytest.raises(ValueError, match="Unknown rounding mode 'floor'"):
        fixed_point_quantize(jnp.ones(3), 8, 4, rounding="floor")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rounding='stochastic' needs a PRNG key"):
        fixed_point_quantize(jnp.ones(3), 8, 4, rounding="stochastic")
    with pytest.raises(TypeError, match="fixed_point_quantize expects a real floating point"):
        fixed_point_quantize(jnp.ones(3, jnp.complex64), 8, 4)
