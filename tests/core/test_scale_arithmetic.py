"""The scalar primitives of the scale algebra, on plain arrays and through `autoscale`."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.core import scale_arithmetic as SA
from jax_scaled_arithmetics.core.scale_arithmetic import (
    SCALE_MAX,
    SCALE_MIN,
    common_scale_p,
    dynamic_scale,
    dynamic_scale_p,
    is_pow2,
    largest_finite_magnitudes_p,
    scale_divide_p,
    scale_of_magnitude,
    scale_product_p,
    scale_root_p,
)
from tests.helpers import assert_close, lowered_divides, make_scaled, represented

F32 = np.float32
USE_JIT = [False, True]


def _maybe_jit(fn, use_jit):
    return jax.jit(fn) if use_jit else fn


def _is_power_of_two(value: float) -> bool:
    return value > 0 and np.frexp(value)[0] == 0.5


@pytest.mark.parametrize("use_jit", USE_JIT)
@pytest.mark.parametrize(
    "scales",
    [(2.0**-60, 2.0**40), (1.0, 1.0), (0.0, 2.0**-3), (0.0, 0.0), (2.0**126, 2.0**-124)],
)
def test_common_scale_of_powers_of_two_is_their_largest(scales, use_jit):
    bind = _maybe_jit(lambda *s: common_scale_p.bind(*s, num_wanted=2, pow2=True), use_jit)
    common, *ratios = bind(*(F32(s) for s in scales))
    assert float(common) == max(scales)
    for scale, ratio in zip(scales, ratios):
        # float32's ratio, at least its smallest normal number (XLA flushes a subnormal to 0,
        # and an operand's infinities would become NaN); 0 for a zero scale.
        expected = max(F32(scale / max(scales)), F32(2.0**-126)) if scale else 0.0
        assert float(ratio) == expected


@pytest.mark.parametrize("use_jit", USE_JIT)
@pytest.mark.parametrize("scales", [(3.0, 0.5), (0.3, 1.7e5, 2.0**-70), (5.0, 4.0)])
def test_common_scale_of_any_scales_is_a_power_of_two_at_or_above(scales, use_jit):
    bind = _maybe_jit(
        lambda *s: common_scale_p.bind(*s, num_wanted=len(scales), pow2=False), use_jit
    )
    common, *ratios = bind(*(F32(s) for s in scales))
    common = float(common)
    assert _is_power_of_two(common) and max(scales) <= common < 2 * max(scales)
    for scale, ratio in zip(scales, ratios):
        # Exact: a float32 scale times a power of two.
        assert float(ratio) == float(F32(scale)) / common and float(ratio) <= 1.0


def test_common_scale_extra_operands_get_ratios_but_not_the_max():
    common, wanted_ratio, extra_ratio = common_scale_p.bind(
        F32(2.0**-3), F32(1.0), num_wanted=1, pow2=True
    )
    assert float(common) == 2.0**-3
    assert float(wanted_ratio) == 1.0 and float(extra_ratio) == 8.0


@pytest.mark.parametrize("use_jit", USE_JIT)
@pytest.mark.parametrize(
    "scales, powers, out, ratio",
    [
        ((2.0**-3, 2.0**5), (1, 1), 2.0**2, 1.0),
        ((2.0**100, 2.0**100), (1, 1), SCALE_MAX, 2.0**74),
        ((2.0**-100, 2.0**-100), (1, 1), SCALE_MIN, 2.0**-76),
        ((0.0, 2.0**100), (1, 1), SCALE_MIN, 0.0),
        ((2.0**3, 2.0**-4), (1, -1), 2.0**7, 1.0),
        ((2.0**-60,), (3,), SCALE_MIN, 2.0**-56),
    ],
)
def test_scale_product_clamps_and_returns_the_rest(scales, powers, out, ratio, use_jit):
    bind = _maybe_jit(lambda *s: scale_product_p.bind(*s, powers=powers, pow2=True), use_jit)
    got_out, got_ratio = bind(*(F32(s) for s in scales))
    assert float(got_out) == out and float(got_ratio) == ratio


def test_scale_product_of_any_scales_is_rounded_up_to_a_power_of_two():
    out, ratio = scale_product_p.bind(F32(3.0), F32(0.3), powers=(1, 1), pow2=False)
    product = float(F32(3.0)) * float(F32(0.3))
    assert _is_power_of_two(float(out)) and product <= float(out) < 2 * product
    np.testing.assert_allclose(float(ratio) * float(out), product, rtol=1e-6)
    assert 0.5 < float(ratio) <= 1.0


def test_scale_product_ratio_has_the_derivative_of_the_product():
    def ratio(a, b):
        return scale_product_p.bind(a, b, powers=(1, -1), pow2=False)[1]

    a, b = F32(3.0), F32(5.0)
    out = scale_product_p.bind(a, b, powers=(1, -1), pow2=False)[0]
    da, db = jax.grad(ratio, argnums=(0, 1))(a, b)
    np.testing.assert_allclose(float(da), 1 / 5 / float(out), rtol=1e-6)
    np.testing.assert_allclose(float(db), -3 / 25 / float(out), rtol=1e-6)


@pytest.mark.parametrize("divisor", [2.0**-100, 1.0, 2.0**90, 3.0, 0.7])
def test_scale_divide(divisor):
    exact = _is_power_of_two(divisor)
    got = scale_divide_p.bind(F32(6.0), F32(divisor), zero_gives_inf=True, pow2=exact)
    np.testing.assert_allclose(float(got), 6.0 / float(F32(divisor)), rtol=0 if exact else 1e-6)
    zero = scale_divide_p.bind(F32(6.0), F32(0.0), zero_gives_inf=True, pow2=True)
    assert float(zero) == np.inf


@pytest.mark.parametrize("use_jit", USE_JIT)
def test_dynamic_scale_and_ratio(use_jit):
    bind = _maybe_jit(dynamic_scale_p.bind, use_jit)
    x = jnp.array([0.3, -5.0, jnp.inf, jnp.nan], jnp.float32)
    scale, ratio = bind(x, F32(2.0**-40))
    assert float(scale) == 2.0**-38 and float(ratio) == 0.25
    # All zero (or no finite nonzero value): SCALE_MIN, which lifts no common scale, and
    # the ratio is the factor (zeros stay zeros, infinities infinities).
    assert [float(v) for v in bind(jnp.zeros(3), F32(4.0))] == [SCALE_MIN, 4.0]
    assert [float(v) for v in bind(jnp.array([0.0, jnp.inf, -jnp.inf]), F32(1.0))] == [
        SCALE_MIN,
        1.0,
    ]
    # No magnitude at all: scale 1, so the ratio is the factor.
    assert [float(v) for v in bind(jnp.zeros((0, 3)), F32(4.0))] == [1.0, 4.0]


def _magnitude_pairs():
    """`(x, factor)` pairs and each one's largest finite `|x| * factor`: small and large
    tensors (reduced whole, or in rows), inf and NaN among the values, no magnitude at all."""
    rng = np.random.default_rng(0)
    large = rng.normal(size=(8, 64, 48)).astype(np.float16)
    large[3, 17, 5] = 300.0
    large[0, 0, 0], large[7, 63, 47] = np.inf, np.nan
    tall = rng.normal(size=(5000, 1)).astype(np.float32)
    tall[4321, 0] = -64.0
    wide = jnp.asarray(rng.normal(size=(3, 70000)), jnp.bfloat16)
    many_rows = rng.normal(size=(8192, 40)).astype(np.float16)  # rows merged in pairs
    many_rows[8191, 39] = 1000.0
    prime_rows = rng.normal(size=(4099, 32)).astype(np.float32)  # no merge fits: one row
    prime_rows[0, 0] = -(2.0**50)
    pairs = [
        (jnp.array([0.3, -5.0, jnp.inf, jnp.nan], jnp.float32), F32(2.0**-40), 5.0 * 2.0**-40),
        (jnp.zeros(3), F32(1.0), 0.0),
        (jnp.zeros((0, 3)), F32(4.0), 0.0),
        (jnp.asarray(large), F32(0.5), 150.0),
        (jnp.asarray(tall), F32(2.0**20), 2.0**26),
        (wide, F32(1.0), float(jnp.max(jnp.abs(wide.astype(F32))))),
        (jnp.asarray(many_rows), F32(2.0**-10), 1000.0 * 2.0**-10),
        (jnp.asarray(prime_rows), F32(2.0**60), 2.0**110),
        (F32(8.0), F32(1.0), 8.0),  # a dynamic scale: its own magnitude
        (jnp.full((2, 2), jnp.inf), F32(1.0), 0.0),
    ]
    operands = [operand for x, factor, _ in pairs for operand in (x, factor)]
    return operands, [expected for _, _, expected in pairs]


@pytest.mark.parametrize("use_jit", USE_JIT)
def test_largest_finite_magnitudes_and_their_scales(use_jit):
    """A dynamic scale's reduction without its epilogue, for many tensors at once: the
    largest finite `|x| * factor` of each pair (0 for none), a measurement with a zero
    derivative, shared by a vmapped batch; `scale_of_magnitude` maps it (and a scale: it is
    its own) to the scale."""
    operands, expected = _magnitude_pairs()
    bind = _maybe_jit(largest_finite_magnitudes_p.bind, use_jit)
    assert bind(*operands).tolist() == expected
    rows = jnp.array([[1.0, -3.0], [0.5, 7.0]], jnp.float32)
    factors = jnp.array([2.0, 0.5])
    batched = jax.vmap(lambda r, f: largest_finite_magnitudes_p.bind(r, f, r, F32(1.0)))
    assert batched(rows, factors).tolist() == [[6.0, 7.0], [6.0, 7.0]]
    gradient = jax.grad(lambda v: jnp.sum(bind(v, F32(1.0), v * 2, F32(1.0))))(rows)
    assert gradient.tolist() == [[0.0, 0.0], [0.0, 0.0]]
    magnitudes = jnp.array([5.0, 0.3, 0.0, 4.0, 2.0**-125, 3.0e38], jnp.float32)
    scales = _maybe_jit(scale_of_magnitude, use_jit)(magnitudes)
    assert scales.tolist() == [4.0, 0.25, 1.0, 4.0, SCALE_MIN, SCALE_MAX]
    np.testing.assert_array_equal(scale_of_magnitude(scales), scales)


def test_largest_finite_magnitudes_lower_per_platform_to_the_same_values():
    """XLA:GPU reduces each large tensor in rows and all the rows' results, with the small
    tensors' elements, in one kernel (a kernel of its own finished each tensor's
    reduction); XLA:CPU reduces each tensor whole in one kernel and stacks the results.
    Both forms run here, for equal values."""
    operands, expected = _magnitude_pairs()
    gpu_form = jax.jit(SA._largest_finite_magnitudes_impl)(*operands)
    cpu_form = jax.jit(SA._largest_finite_magnitudes_cpu)(*operands)
    assert gpu_form.tolist() == cpu_form.tolist() == expected
    traced = jax.jit(largest_finite_magnitudes_p.bind).trace(*operands)
    lowered = {p: traced.lower(lowering_platforms=(p,)).as_text() for p in ("cuda", "cpu")}
    # The rows' results gathered into one matrix for XLA:GPU; a stack of scalars (pieces of
    # select chains) for XLA:CPU.
    assert "stablehlo.gather" in lowered["cuda"] and "stablehlo.gather" not in lowered["cpu"]
    # For XLA:GPU a reduction per large tensor (5 of the 10) and the one of them all.
    assert lowered["cuda"].count("applies stablehlo.maximum") == 5 + 1
    # At most 4,096 rows: 8,192 rows of 40 reduced as 4,096 rows of 80.
    assert "tensor<4096x80xf32>" in lowered["cuda"]
    assert lowered["cpu"].count("stablehlo.select") >= len(expected) - 1
    with pytest.raises(TypeError, match="pairs"):
        largest_finite_magnitudes_p.bind(jnp.ones(2))


def test_dynamic_scale_under_vmap_is_shared_by_the_batch():
    x = jnp.array([[1.0, 2.0], [40.0, -3.0]], jnp.float32)
    scale, ratio = jax.vmap(lambda row: dynamic_scale_p.bind(row, F32(1.0)))(x)
    # vmap broadcasts the unbatched outputs: every example sees the batch's scale.
    assert scale.tolist() == [32.0, 32.0] and ratio.tolist() == [1 / 32, 1 / 32]
    jaxpr = jax.make_jaxpr(jax.vmap(lambda row: dynamic_scale_p.bind(row, F32(1.0))))(x)
    scale_eqn = next(e for e in jaxpr.eqns if e.primitive is dynamic_scale_p)
    assert all(v.aval.shape == () for v in scale_eqn.outvars)


def test_known_powers_of_two():
    assert is_pow2(F32(2.0**-100)) and is_pow2(np.float32(0.0)) and not is_pow2(F32(3.0))

    def check(x):
        assert not is_pow2(x)  # an input scale: any value
        assert is_pow2(dynamic_scale(x))
        return x

    jax.jit(check)(jnp.ones(2))


# --- through autoscale: scales that are not powers of two ---------------------------------


@pytest.mark.parametrize("use_jit", USE_JIT)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16])
@pytest.mark.parametrize("scales", [(3.0, 0.3), (1.7e5, 2.0**-50), (0.7, 0.7)])
def test_non_power_of_two_input_scales(scales, dtype, use_jit):
    rng = np.random.default_rng(0)
    a = jsa.scaled_array(rng.normal(size=(4, 8)).astype(dtype), np.float32(scales[0]))
    b = jsa.scaled_array(rng.normal(size=(4, 8)).astype(dtype), np.float32(scales[1]))
    w = jsa.scaled_array(rng.normal(size=(8, 3)).astype(dtype), np.float32(scales[1]))

    def fn(a, b, w):
        return a + b, a * b, a - 2.0 * b, a @ w, jnp.maximum(a, b)

    scaled = _maybe_jit(jsa.autoscale(fn), use_jit)(a, b, w)
    plain = fn(*(np.asarray(x.data, np.float64) * float(x.scale) for x in (a, b, w)))
    rtol = {np.float32: 1e-5, np.float16: 2e-3}.get(dtype, 1.6e-2)
    for got, want in zip(scaled, plain):
        assert isinstance(got, jsa.ScaledArray)
        if use_jit:  # traced scales are rounded to powers of two; static ones are exact
            assert _is_power_of_two(float(got.scale))
        np.testing.assert_allclose(
            np.asarray(got.data, np.float64) * float(got.scale),
            want,
            rtol=rtol,
            atol=rtol * np.abs(want).max(),
        )


@pytest.mark.parametrize("use_jit", USE_JIT)
@pytest.mark.parametrize(
    "scales, fun",
    [
        ((0.3, 2.0**126), lambda a, b: a * b),  # a partial ratio 0.3 * 2^-125 underflowed
        ((0.3, 2.0**-126), lambda a, b: a / b),  # and 0.3 / 2^125 here
        ((2.0**126, 3.0), lambda a, b: a / b),
    ],
)
def test_products_of_scales_at_the_ends_of_float32(scales, fun, use_jit):
    """Through autoscale, traced scales that are not powers of two, beside one near
    SCALE_MAX or SCALE_MIN: the product's value, not zeros."""
    a = jsa.scaled_array(np.array([1.0, -1.5, 0.5], np.float32), np.float32(scales[0]))
    b = jsa.scaled_array(np.array([0.75, 1.25, -1.0], np.float32), np.float32(scales[1]))
    got = _maybe_jit(jsa.autoscale(fun), use_jit)(a, b)
    want = fun(*(np.asarray(x.data, np.float64) * float(x.scale) for x in (a, b)))
    value = np.asarray(got.data, np.float64) * float(got.scale)
    np.testing.assert_allclose(value, want, rtol=2e-6)


@pytest.mark.parametrize(
    "name, fun",
    [
        ("add: common_scale", lambda a, b: a + b),
        ("mul: scale_product", lambda a, b: a * b),
        ("dot, add: dynamic_scale, common_scale", lambda a, b: a @ b + a),
        ("div: scale_product, scale_divide", lambda a, b: a / b),
    ],
)
def test_scales_are_computed_once_on_xla_cpu_only(name, fun):
    """On XLA:CPU the scale `common_scale` and `scale_product` return is materialised (an
    exact division XLA does not copy into the kernels that read it, so that they stay
    alike); the jaxpr is the same, and other backends get the plain lowering."""
    a = jsa.scaled_array(jnp.ones((4, 4)), 2.0)
    b = jsa.scaled_array(jnp.full((4, 4), 0.5), 8.0)
    scaled = jsa.autoscale(fun)
    plain_args = (a.to_array(), b.to_array())

    def divides(platform):
        return lowered_divides(scaled, (a, b), platform), lowered_divides(fun, plain_args, platform)

    scaled_divides, plain_divides = divides("cpu")
    assert scaled_divides > plain_divides
    for platform in ("cuda", "tpu"):  # the plain program's divisions (the data's) only
        scaled_divides, plain_divides = divides(platform)
        assert scaled_divides == plain_divides
    expected = fun(a.to_array(), b.to_array())
    for run in (scaled, jax.jit(scaled)):
        np.testing.assert_array_equal(run(a, b).to_array(), expected)


# On XLA:CPU the scale primitives lower differently (their scales materialised: see
# scale_arithmetic's "lowerings on XLA:CPU"); jitted, `bind` runs that lowering here, and the
# default one (every other backend, and eager calls) is its implementation, run by `jit`.
_POW2_SCALES = [0.0, SCALE_MIN, 2.0**-100, 2.0**-3, 1.0, 2.0**50, 2.0**100, SCALE_MAX, np.inf]
_OTHER_SCALES = [3.0, 0.3, 1e-30, 7e30, 2.0**-40 * 1.5, 2.0**40 * 1.25]
_PRODUCT_POWERS = [(1, 1), (1, -1), (-1, 1), (2, 0), (0, -2), (1, 2), (3, 0), (-1, -2), (0, -3)]


@functools.cache
def _jitted_lowerings(primitive, params):
    """The primitive's XLA:CPU lowering (`bind`) and its default one (`impl`), jitted once
    per primitive and params: the scales are arguments, so every value reuses the program."""
    params = dict(params)
    return (
        jax.jit(lambda *s: primitive.bind(*s, **params)),
        jax.jit(lambda *s: primitive.impl(*s, **params)),
    )


def _both_lowerings(primitive, *scales, **params):
    bind, impl = _jitted_lowerings(primitive, tuple(sorted(params.items())))
    cpu, default = bind(*scales), impl(*scales)
    if not primitive.multiple_results:
        cpu, default = [cpu], [default]
    return [np.asarray(x) for x in cpu], [np.asarray(x) for x in default]


def _pairs(values):
    return [(F32(a), F32(b)) for a in values for b in values]


@pytest.mark.parametrize("pow2", [True, False])
def test_cpu_lowerings_are_the_default_bit_for_bit(pow2):
    """Every output of every scale primitive, for scales that are powers of two, zero or
    inf, and (unless `pow2` says they are powers of two) any others."""
    values = _POW2_SCALES if pow2 else _POW2_SCALES + _OTHER_SCALES
    for a, b in _pairs(values):
        for num_wanted in (1, 2):
            cpu, default = _both_lowerings(common_scale_p, a, b, num_wanted=num_wanted, pow2=pow2)
            np.testing.assert_array_equal(cpu, default, err_msg=f"common {a} {b} {num_wanted}")
        for powers in _PRODUCT_POWERS:
            cpu, default = _both_lowerings(scale_product_p, a, b, powers=powers, pow2=pow2)
            np.testing.assert_array_equal(cpu, default, err_msg=f"product {a} {b} {powers}")
        for zero_gives_inf in (True, False):
            cpu, default = _both_lowerings(
                scale_divide_p, a, b, zero_gives_inf=zero_gives_inf, pow2=pow2
            )
            np.testing.assert_array_equal(cpu, default, err_msg=f"divide {a} {b}")
    for value in values:
        x = jnp.array([value, -2.0, np.nan], F32)
        cpu, default = _both_lowerings(dynamic_scale_p, x, F32(3.0))
        np.testing.assert_array_equal(cpu, default, err_msg=f"dynamic scale {value}")
        for round_up in (False, True):
            cpu, default = _both_lowerings(scale_root_p, F32(value), degree=2, round_up=round_up)
            np.testing.assert_array_equal(cpu, default, err_msg=f"root {value} {round_up}")
    cpu, default = _both_lowerings(dynamic_scale_p, jnp.zeros((0, 2), F32), F32(3.0))
    np.testing.assert_array_equal(cpu, default, err_msg="dynamic scale of an empty array")


# Shapes whose largest magnitude XLA:CPU's lowering reduces in axes of at most 32 (zero-padded
# where the size is no multiple of 32 or 1,024), and a large one it leaves to XLA.
_DYNAMIC_SCALE_SHAPES = [(33,), (128,), (1000,), (16, 64), (40, 50), (16, 64, 1), (3, 4, 5)]
_DYNAMIC_SCALE_SHAPES += [(4095,), (5000,), (0, 7)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("shape", _DYNAMIC_SCALE_SHAPES, ids=str)
def test_dynamic_scale_lowerings_agree_wherever_the_largest_magnitude_is(shape, dtype):
    """The largest finite magnitude in the first, the last or a middle element, beside
    infinities and NaNs, or none at all: both lowerings give numpy's answer."""
    size = int(np.prod(shape))
    rng = np.random.default_rng(size)
    base = rng.uniform(-1.0, 1.0, size).astype(F32)
    cases = {"random": base, "zeros": np.zeros(size, F32), "no finite": np.full(size, np.inf)}
    for where in {0, size // 2, size - 1} if size else set():
        peak = base.copy()
        peak[where] = -6.5
        cases[f"peak at {where}"] = peak
        blocked = peak.copy()
        blocked[(where + 1) % size] = np.nan
        blocked[(where + size // 3 + 1) % size] = -np.inf
        cases[f"peak at {where}, NaN and inf"] = blocked
    for name, values in cases.items():
        x = jnp.asarray(values.reshape(shape), dtype)
        finite = np.abs(np.asarray(x, F32))[np.isfinite(np.asarray(x, F32))]
        largest = float(finite.max() * F32(3.0)) if finite.size else 0.0
        # No magnitude: SCALE_MIN (1 with no element at all), and the ratio is the factor.
        expected = 2.0 ** np.floor(np.log2(largest)) if largest > 0 else SCALE_MIN
        expected = expected if size else 1.0
        cpu, default = _both_lowerings(dynamic_scale_p, x, F32(3.0))
        np.testing.assert_array_equal(cpu, default, err_msg=f"{shape} {name}")
        assert float(cpu[0]) == expected, (shape, name)
        assert float(cpu[1]) == (3.0 / expected if largest > 0 else 3.0), (shape, name)
        # The same reduction without the epilogue (delayed scaling's sites: a large tensor
        # in rows on XLA:GPU), which `scale_of_magnitude` turns into the same scale.
        cpu, default = _both_lowerings(largest_finite_magnitudes_p, x, F32(3.0))
        np.testing.assert_array_equal(cpu, default, err_msg=f"{shape} {name}")
        assert cpu[0].tolist() == [largest], (shape, name)
        # A history's scale, 1 where there is no magnitude (a held SCALE_MIN would overflow).
        held = expected if largest > 0 else 1.0
        assert float(scale_of_magnitude(cpu[0])[0]) == held, (shape, name)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's kernels")
def test_a_small_tensors_dynamic_scale_is_one_kernel_on_xla_cpu():
    """XLA:CPU splits a reduction with a long axis into a reduce-window and a reduce, neither
    fused with the producer: three kernels for the largest magnitude of a bias or a row
    statistic in the default lowering, one in the XLA:CPU lowering's short axes."""

    def compiled(scale_of, shape):
        def step(x):
            y = jnp.tanh(x)
            return y, scale_of(y, F32(1.0))[0]

        hlo = jax.jit(step).lower(jnp.ones(shape, F32)).compile().as_text()
        entry = hlo[hlo.index("\nENTRY") :]
        return hlo, sum(" fusion(" in line for line in entry.splitlines())

    for shape in [(128,), (16, 64), (1000,)]:
        cpu_hlo, cpu_kernels = compiled(dynamic_scale_p.bind, shape)
        default_hlo, default_kernels = compiled(dynamic_scale_p.impl, shape)
        assert "reduce-window" in default_hlo and "reduce-window" not in cpu_hlo, shape
        assert cpu_kernels <= default_kernels - 2, (shape, cpu_kernels, default_kernels)


def _several_magnitude_tensors():
    """Magnitudes for `largest_of_several`: small tensors of seven sizes in four powers of
    two at or above them (one with a NaN, one with an infinity, one all zero, a scalar, one
    with no finite element), two large ones of one size in two dtypes, one large one alone
    in its size."""
    rng = np.random.default_rng(11)

    def magnitudes(shape, dtype, spread):
        return jnp.asarray(np.abs(rng.normal(size=shape)) * spread, dtype)

    with_inf = np.abs(rng.normal(size=(16, 8))) * 2.0**-20
    with_inf[5, 2] = np.inf
    with_nan = np.abs(rng.normal(size=(32,)))
    with_nan[17] = np.nan
    return [
        jnp.asarray(with_nan, jnp.float32),
        jnp.asarray(with_inf, jnp.float16),
        jnp.zeros((3, 7), jnp.bfloat16),
        magnitudes((), jnp.float32, 2.0**40),
        jnp.full((9,), jnp.inf, jnp.float32),
        magnitudes((64, 64), jnp.float16, 2.0**-10),
        magnitudes((128, 32), jnp.bfloat16, 2.0**100),
        magnitudes((4097,), jnp.float32, 3.0),
        magnitudes((4, 8), jnp.float32, 2.0**-3),
        magnitudes((100,), jnp.float16, 7.0),
    ]


@pytest.mark.parametrize("finite_only", [False, True])
@pytest.mark.parametrize("use_jit", USE_JIT)
def test_largest_of_several_is_each_tensors_own_largest(finite_only, use_jit):
    """XLA:CPU's form for many tensors' largest magnitudes (small tensors padded with zeros
    and reduced together, large ones of one size together, the rest alone): each result is
    that tensor's own largest (finite) magnitude, in float32 (a NaN where it has one)."""
    tensors = _several_magnitude_tensors()
    several = _maybe_jit(
        lambda *t: SA.largest_of_several(list(t), finite_only=finite_only), use_jit
    )
    got = several(*tensors)
    for k, tensor in enumerate(tensors):
        values = np.asarray(tensor, F32)
        if finite_only:
            values = np.where(np.isfinite(values), values, 0.0)
        assert got[k].dtype == F32 and got[k].shape == (), k
        np.testing.assert_array_equal(got[k], values.max(), err_msg=str(k))
    assert np.isnan(got[0]) != finite_only


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's kernels")
def test_several_tensors_largest_magnitudes_in_few_kernels_on_xla_cpu():
    """XLA:CPU gives each reduction a kernel of its own; a variadic one is one loop fused with
    its operands' producers. An optimizer state's per-tensor rescale factors
    (`rescale_factors_p`) and delayed scaling's measured sites
    (`largest_finite_magnitudes_p`) take one kernel for the small tensors of each power of
    two at or above their sizes and one per size of the large ones: 5 reductions for these
    10 tensors (small: 3 powers of two beside the scalar, which needs none; large: 2
    sizes), where one each took 9."""
    from jax_scaled_arithmetics.ops.dynamic_rescaling import (
        _rescale_factors_per_tensor,
        rescale_factors_p,
    )

    tensors = _several_magnitude_tensors()

    def reductions(measure):
        def step(*xs):
            return measure(*[jnp.tanh(x) for x in xs])

        hlo = jax.jit(step).lower(*tensors).compile().as_text()
        bodies = {}  # each computation's instructions, by name
        for block in hlo.split("\n\n"):
            head = block.strip().split("\n", 1)[0].split()
            if head:
                bodies[head[1 if head[0] == "ENTRY" else 0].lstrip("%")] = block
        entry = hlo[hlo.index("\nENTRY") :].splitlines()
        called = [re.search(r"calls=%?([\w.\-]+)", line) for line in entry]
        return sum(  # ENTRY's kernels that reduce (XLA:CPU's library's reductions too)
            " reduce(" in bodies.get(match.group(1), "") or "ynn" in match.group(1)
            for match in called
            if match
        )

    params = dict(epsilon=2.0**-60, shift=3)
    grouped = reductions(lambda *d: rescale_factors_p.bind(*d, **params))
    alone = reductions(lambda *d: _rescale_factors_per_tensor(*d, one_kernel_on_cpu=True, **params))
    measured = reductions(
        lambda *d: largest_finite_magnitudes_p.bind(*[v for x in d for v in (x, F32(2.0))])
    )
    assert (grouped, measured) == (5, 5) and alone >= 9


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's lowering")
@pytest.mark.parametrize("shape", [(96,), (32, 96), (65, 32)], ids=str)
def test_a_sharded_tensors_dynamic_scale_gathers_no_data(shape):
    """Partitioned over the session's 4 devices, `dynamic_scale` keeps the default lowering:
    each device reduces its shard and one all-reduce agrees on the maximum. (The one-device
    lowering's reshape into short axes made the SPMD partitioner all-gather the tensor.) A
    `shard_map` body manual over the mesh is one device's program: the short-axis lowering."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))
    spec = jax.sharding.PartitionSpec("d")
    last_axis = jax.sharding.PartitionSpec(*[None] * (len(shape) - 1), "d")
    values = np.random.default_rng(0).uniform(-1.0, 1.0, shape).astype(F32)
    values.flat[7] = -5.0
    x = jax.device_put(values, jax.sharding.NamedSharding(mesh, last_axis))
    step = jax.jit(lambda v: dynamic_scale_p.bind(jnp.tanh(v), F32(1.0)))
    hlo = step.lower(x).compile().as_text()
    assert "all-gather" not in hlo and "all-reduce" in hlo, hlo
    scale, ratio = step(x)
    assert float(scale) == 0.5 and float(ratio) == 2.0  # tanh(5) in [0.5, 1)

    body = lambda v: dynamic_scale_p.bind(v, F32(1.0))[0][None]  # noqa: E731
    local = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    wide = jax.device_put(np.ones((4 * 128,), F32), jax.sharding.NamedSharding(mesh, spec))
    local_hlo = local.lower(wide).compile().as_text()
    assert "reduce-window" not in local_hlo and "all-gather" not in local_hlo
    np.testing.assert_array_equal(local(wide), np.ones(4, F32))


def test_scale_product_of_any_scales_represents_the_product():
    """Scales that are not powers of two: out is a power of two in [SCALE_MIN, SCALE_MAX]
    and, for two factors, out * ratio the product wherever the ratio is a normal float32
    number (three factors or more may underflow the ratio: `x * y * y`, rare)."""
    values = _OTHER_SCALES + [0.0, 2.0**-126, 2.0**-40, 1.0, 2.0**40, 1.5 * 2.0**125, SCALE_MAX]
    for a, b in _pairs(values):
        for powers in _PRODUCT_POWERS:
            (out, ratio), _ = _both_lowerings(scale_product_p, a, b, powers=powers, pow2=False)
            factors = [float(s) ** p if s or p >= 0 else np.inf for s, p in zip((a, b), powers)]
            product = factors[0] * factors[1]
            if np.isnan(product):  # 0 / 0: NaN data
                continue
            assert _is_power_of_two(float(out)) and SCALE_MIN <= float(out) <= SCALE_MAX
            if product == 0.0:  # a zero scale in the numerator: zero data, not NaN
                assert float(ratio) == 0.0, f"{a} {b} {powers}: ratio {ratio}"
            if sum(map(abs, powers)) <= 2 and 2.0**-240 < product < 2.0**250:
                np.testing.assert_allclose(
                    float(out) * float(ratio), product, rtol=1e-6, err_msg=f"{a} {b} {powers}"
                )
    # Clamped from above by a scale beyond SCALE_MAX: the larger factor first.
    (out, ratio), _ = _both_lowerings(
        scale_product_p, F32(0.5), F32(1.9 * 2.0**127), powers=(1, 1), pow2=False
    )
    assert float(out) == SCALE_MAX
    np.testing.assert_allclose(float(out) * float(ratio), 0.5 * 1.9 * 2.0**127, rtol=1e-6)


@pytest.mark.parametrize("use_jit", USE_JIT)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16])
def test_zeros_known_at_run_time_do_not_flush_the_tensor_they_join(dtype, use_jit):
    """A tensor that is zero only at run time (a sum that cancels; the cotangent that
    `clip_by_global_norm`'s scalar predicate zeroes, promoted by its dynamic scale) takes
    SCALE_MIN, so a common scale with tiny values keeps them: at scale 1 it flushed float16
    gradients at 2^-30, and clipping's gradient at 2^20 was 55% off."""
    rng = np.random.default_rng(1)
    x = make_scaled(rng.normal(size=8), dtype, 1.0)
    g = make_scaled(rng.normal(size=8), dtype, 2.0**-30)

    def cancelled_plus(x, g):
        return jnp.sum(x - x, keepdims=True) + g

    out = _maybe_jit(jsa.autoscale(cancelled_plus), use_jit)(x, g)
    np.testing.assert_array_equal(represented(out), represented(g))

    weights = np.cos(np.arange(32, dtype=np.float32)).reshape(4, 8)

    def clipped_loss(u):
        clipped = optax.clip_by_global_norm(0.5).update({"u": u}, optax.EmptyState())[0]
        return jnp.sum(clipped["u"].astype(jnp.float32) * weights)

    rtol = {np.dtype(np.float32): 1e-6, np.dtype(np.float16): 2e-3}.get(np.dtype(dtype), 1e-2)
    for scale in (2.0**-20, 1.0, 2.0**20):
        u = make_scaled(rng.normal(size=(4, 8)), dtype, scale)
        grad = _maybe_jit(jsa.autoscale(jax.grad(clipped_loss)), use_jit)(u)
        expected = jax.grad(clipped_loss)(jnp.asarray(represented(u), jnp.float32))
        assert_close(grad, np.asarray(expected), rtol)


@pytest.mark.parametrize("use_jit", USE_JIT)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16])
def test_infinities_of_a_tensor_without_magnitude_survive_a_common_scale(dtype, use_jit):
    """An attention bias of zeros and -inf made inside the step (not a known constant) has
    no finite magnitude, so scale SCALE_MIN: its ratio to the scores' scale is below float16's
    range, and its -inf stay -inf (the product is taken in float32), never NaN."""
    rng = np.random.default_rng(2)
    scores = make_scaled(rng.normal(size=(4, 4)), dtype, 2.0**-19)
    mask = np.tril(np.ones((4, 4), bool))

    def biased(s, m):
        return s + jnp.where(m, 0.0, -jnp.inf).astype(s.dtype)

    out = _maybe_jit(jsa.autoscale(biased), use_jit)(scores, jnp.asarray(mask))
    expected = np.where(mask, represented(scores), -np.inf)
    np.testing.assert_array_equal(represented(out), expected)
