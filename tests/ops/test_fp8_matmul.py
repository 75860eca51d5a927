"""FP8 / MX matmul recipes (`jsa.ops.rowwise_fp8_matmul`, `mx_matmul`,
`tensorwise_fp8_matmul`) against a float64 NumPy reference of the same recipes.

The reference quantises with ml_dtypes casts (saturated first) and accumulates in
float64: the quantised operands must match exactly, outputs and gradients within
float32 accumulation error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.ops import fp8_matmul
from jax_scaled_arithmetics.quantization import FORMATS, MX_FORMATS, block_fake_quantize
from tests.helpers import eager_and_jit

E4M3, E5M2 = FORMATS["float8_e4m3fn"], FORMATS["float8_e5m2"]
MX_NAMES = sorted(MX_FORMATS)


# --- float64 reference ---------------------------------------------------------------------


def cast(v: np.ndarray, fmt) -> np.ndarray:
    """Round to `fmt` with saturation (clip, then the ml_dtypes cast), in float64."""
    clipped = np.clip(v, -fmt.max, fmt.max).astype(np.float32)
    return clipped.astype(fmt.dtype).astype(np.float64)


def ref_pow2(v: np.ndarray, fmt, axis):
    """(elements, scales): the smallest power-of-two scale with amax / s <= max."""
    amax = np.max(np.abs(v), axis=axis, keepdims=True).astype(np.float64)
    _, exp = np.frexp(np.where(amax > 0, amax, 1.0))
    scale = np.exp2(np.clip(exp - 1 - fmt.max_exponent, -126, 126).astype(np.float64))
    scale = np.where(amax / scale > fmt.max, 2 * scale, scale)
    scale = np.where(amax > 0, scale, 1.0)
    return cast(v / scale, fmt), scale


def ref_mx(v: np.ndarray, fmt, block_size: int, axis: int) -> np.ndarray:
    """Dequantized OCP MX blocks along `axis` (zero-padded to whole blocks)."""
    vt = np.moveaxis(v.astype(np.float64), axis, -1)
    n = vt.shape[-1]
    padded = np.concatenate([vt, np.zeros((*vt.shape[:-1], -n % block_size))], axis=-1)
    blocks = padded.reshape(*vt.shape[:-1], -1, block_size)
    amax = np.max(np.abs(blocks), axis=-1, keepdims=True)
    _, exp = np.frexp(np.where(amax > 0, amax, 1.0))
    shared = np.where(amax > 0, np.clip(exp - 1 - fmt.max_exponent, -127, 127), -127)
    scale = np.exp2(shared.astype(np.float64))
    out = (cast(blocks / scale, fmt) * scale).reshape(padded.shape)[..., :n]
    return np.moveaxis(out, -1, axis)


def ref_contract(kind: str, a, a_fmt, b, b_fmt, block_size: int = 32) -> np.ndarray:
    if kind == "mx":
        return ref_mx(a, a_fmt, block_size, 1) @ ref_mx(b, b_fmt, block_size, 0)
    row = kind == "row"
    qa, sa = ref_pow2(a, a_fmt, 1 if row else None)
    qb, sb = ref_pow2(b, b_fmt, 0 if row else None)
    return (qa @ qb) * sa * sb


def ref_recipe(kind, x, w, g, fwd, bwd, block_size=32):
    """(y, dx, dw) of the recipe in float64."""
    x2 = x.reshape(-1, x.shape[-1]).astype(np.float64)
    w64, g2 = w.astype(np.float64), g.reshape(-1, w.shape[1]).astype(np.float64)
    y = ref_contract(kind, x2, fwd, w64, fwd, block_size).reshape(g.shape)
    dx = ref_contract(kind, g2, bwd, w64.T, fwd, block_size).reshape(x.shape)
    dw = ref_contract(kind, x2.T, fwd, g2, bwd, block_size)
    return y, dx, dw


RECIPES: dict[str, Callable[..., Any]] = {
    "tensor": jsa.ops.tensorwise_fp8_matmul,
    "row": jsa.ops.rowwise_fp8_matmul,
    "mx": jsa.ops.mx_matmul,
}


def call(kind: str, x, w, **kw):
    return RECIPES[kind](x, w, **kw)


def data(seed: int, x_shape=(2, 5, 64), n: int = 24, spread: float = 8.0):
    """x, w and an output gradient with rows / columns spread over 2^±spread."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape) * np.exp2(rng.uniform(-spread, spread, (*x_shape[:-1], 1)))
    w = rng.standard_normal((x_shape[-1], n)) * np.exp2(rng.uniform(-spread, spread, (1, n)))
    g = rng.standard_normal((*x_shape[:-1], n)) * 2.0**-12
    return x.astype(np.float32), w.astype(np.float32), g.astype(np.float32)


def assert_close(actual, expected, rtol=1e-5):
    """Within float32 accumulation error, relative to the largest expected magnitude."""
    actual = np.asarray(actual, np.float64)
    atol = rtol * np.max(np.abs(expected))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


# --- quantised operands ----------------------------------------------------------------------


POW2_FORMATS = (E4M3, E5M2, FORMATS["float6_e2m3fn"])
POW2_AXES = (0, 1, None)


@functools.cache
def pow2_operands() -> tuple[np.ndarray, list]:
    """x, and its `_pow2_quantize` operands for every format and axis (in the order of
    POW2_FORMATS x POW2_AXES), from one jitted program: the cases below share it."""
    x, _, _ = data(0, (16, 40), spread=40)
    x[3] = 0.0  # an all-zero row gets scale 1
    x[5, :] = 0.0
    x[:, 7] = 0.0
    quantize_all = jax.jit(
        lambda v: [fp8_matmul._pow2_quantize(v, f, a) for f in POW2_FORMATS for a in POW2_AXES]
    )
    return x, quantize_all(jnp.asarray(x))


@pytest.mark.parametrize("fmt", POW2_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("axis", POW2_AXES)
def test_pow2_operands_match_reference_exactly(fmt, axis):
    x, operands = pow2_operands()
    q, s = operands[POW2_FORMATS.index(fmt) * len(POW2_AXES) + POW2_AXES.index(axis)]
    q_ref, s_ref = ref_pow2(x, fmt, axis)
    np.testing.assert_array_equal(np.asarray(s, np.float64), s_ref)
    np.testing.assert_array_equal(np.asarray(q, np.float64), q_ref)
    # the largest magnitude of every non-zero slice lands in [max / 2, max] (after rounding)
    top = np.max(np.abs(q_ref), axis=axis)
    assert np.all((top == 0) | ((top >= fmt.max / 2) & (top <= fmt.max)))


@functools.cache
def mx_operands() -> tuple[np.ndarray, list]:
    """x, and its MX operands for every format of MX_NAMES, from one jitted program."""
    x, _, _ = data(1, (6, 64), spread=30)
    fmts = [FORMATS[MX_FORMATS[name]] for name in MX_NAMES]
    quantize_all = jax.jit(
        lambda v: [block_fake_quantize(v, fmt, 32, axis=1, pad=True) for fmt in fmts]
    )
    return x, quantize_all(jnp.asarray(x))


@pytest.mark.slow
@pytest.mark.parametrize("name", MX_NAMES)
def test_mx_operands_match_reference_exactly(name):
    """The MX operands of `mx_matmul` (`block_fake_quantize` along the contracting axis)."""
    x, operands = mx_operands()
    out = operands[MX_NAMES.index(name)]
    fmt = FORMATS[MX_FORMATS[name]]
    np.testing.assert_array_equal(np.asarray(out, np.float64), ref_mx(x, fmt, 32, 1))


@pytest.mark.slow
def test_finite_inputs_give_finite_outputs_at_the_extremes():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 32)) * np.array([[1e38], [1e-30], [1.0], [0.0]])
    x = x.astype(np.float32)
    w = rng.standard_normal((32, 6)).astype(np.float32)  # the shapes of the autoscale tests
    for kind in RECIPES:
        y = np.asarray(call(kind, x, w * 1e-30))
        assert np.all(np.isfinite(y)), kind
        np.testing.assert_array_equal(y[3], 0.0)


# --- forward, error bounds ---------------------------------------------------------------------


# The recipes' executables are jitted in the library: a call outside jit runs the programs
# that test_dtypes, test_mx_formats_match_reference and test_second_call_does_not_recompile
# run too, compiled once. The recipes under jit (and grad) are in the default run through
# test_inside_autoscale_with_scaled_arrays, equal to the calls outside jit checked here;
# the slow step runs every recipe under jit too.
@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,use_jit", eager_and_jit(["tensor", "row", "mx"], lambda k: True, lambda k: False)
)
def test_forward_and_gradients_match_reference(kind, use_jit):
    x, w, g = data(3)
    fn = lambda a, b: call(kind, a, b)  # noqa: E731
    y, vjp = jax.vjp(jax.jit(fn) if use_jit else fn, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    y_ref, dx_ref, dw_ref = ref_recipe(kind, x, w, g, E4M3, E5M2)
    assert y.shape == (2, 5, 24) and dx.shape == x.shape and dw.shape == w.shape
    assert_close(y, y_ref)
    assert_close(dx, dx_ref)
    assert_close(dw, dw_ref)


@pytest.mark.slow
def test_second_call_does_not_recompile():
    x, w, _ = data(3)
    for kind in RECIPES:
        call(kind, x, w)
        size = fp8_matmul._forward._cache_size()
        call(kind, x * 2, w)
        assert fp8_matmul._forward._cache_size() == size, kind


# The default run holds MXFP8 E4M3 and MXFP4; every format's operands are checked exactly by
# test_mx_operands_match_reference_exactly (and an 8-, a 6- and the 4-bit format's forward by
# test_relative_error_against_exact_matmul); the slow step runs the others end to end.
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=() if n in ("mxfp8_e4m3", "mxfp4_e2m1") else pytest.mark.slow)
        for n in MX_NAMES
    ],
)
@pytest.mark.one_case
def test_mx_formats_match_reference(name):
    """Every MX element format, forward and backward (E5M2 gradients; N=24 and M=10 are
    padded to one block of 32 in the backward pass)."""
    x, w, g = data(4)
    fmt = FORMATS[MX_FORMATS[name]]
    y, vjp = jax.vjp(lambda a, b: jsa.ops.mx_matmul(a, b, format=name), x, w)
    dx, dw = vjp(g)
    y_ref, dx_ref, dw_ref = ref_recipe("mx", x, w, g, fmt, E5M2)
    for actual, expected in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        assert_close(actual, expected)


# Relative (Frobenius) error against the exact float64 matmul, x (32, 256) and w (256, 32)
# standard Gaussian: measured, and bounded with a margin of about 1.3x.
ERROR_BOUNDS = {
    ("row", "float8_e4m3fn"): 0.05,  # measured 0.0374
    ("row", "float8_e5m2"): 0.10,  # 0.0747
    ("mx", "mxfp8_e4m3"): 0.055,  # 0.0410
    ("mx", "mxfp8_e5m2"): 0.10,  # 0.0773
    ("mx", "mxfp6_e2m3"): 0.055,  # 0.0387
    ("mx", "mxfp6_e3m2"): 0.10,  # 0.0773
    ("mx", "mxfp4_e2m1"): 0.20,  # 0.1544
}


# The slow step holds the MX formats with two mantissa bits (E5M2 row-wise is in the
# default run); their operands: test_mx_operands_match_reference_exactly.
@pytest.mark.parametrize(
    "kind,name",
    [
        pytest.param(*k, marks=pytest.mark.slow if k[1] in ("mxfp8_e5m2", "mxfp6_e3m2") else ())
        for k in sorted(ERROR_BOUNDS)
    ],
)
def test_relative_error_against_exact_matmul(kind, name):
    x, w, _ = data(5, (32, 256), n=32, spread=0)
    kw = {"forward_format": name} if kind == "row" else {"format": name}
    y = np.asarray(call(kind, x, w, **kw), np.float64)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    error = np.linalg.norm(y - exact) / np.linalg.norm(exact)
    assert error < ERROR_BOUNDS[kind, name]
    assert error > ERROR_BOUNDS[kind, name] / 2  # the operands really are quantised


def test_rowwise_beats_tensorwise_when_rows_differ_by_2_pow_10():
    """Rows of x (and columns of w) alternating between magnitudes 1 and 2^-10.

    With power-of-two scales, a row's rounding is the same under any scale as long as it
    stays in the format's normal range, so the gain of row-wise scales is where the
    per-tensor scale pushes the small rows' elements below E4M3's normal range (2^-6,
    about 2^-15 of its max): every quantised element within 2^-12 of its row's largest
    is within E4M3's half-ulp 2^-4 row-wise, not per-tensor, and the small rows'
    quantisation error is lower (the large rows' the same). At 2^10 the gain is small
    (the worst small row: 0.02953 against 0.02981, and matmul outputs within noise of
    each other: per-tensor FP8 is enough for such rows). Beyond the format's range (rows
    2^20 apart) per-tensor flushes the small rows to zero."""
    rng = np.random.default_rng(6)
    small = np.arange(64) % 2 == 1
    x = rng.standard_normal((64, 256)) * np.where(small, 2.0**-10, 1.0)[:, None]
    w = rng.standard_normal((256, 64)) * np.where(small, 2.0**-10, 1.0)[None, :]
    x, w = x.astype(np.float32), w.astype(np.float32)

    def worst_row_error(y, rows):
        d = np.linalg.norm(np.asarray(y, np.float64) - exact, axis=1)
        return np.max((d / np.linalg.norm(exact, axis=1))[rows])

    amax = np.max(np.abs(x), axis=1, keepdims=True)
    considered = np.abs(x) >= amax * 2.0**-12
    errors = {}
    for axis in (1, None):
        q, scale = ref_pow2(x, E4M3, axis)
        quantize = jax.jit(fp8_matmul._pow2_quantize, static_argnums=(1, 2))
        np.testing.assert_array_equal(q, np.asarray(quantize(x, E4M3, axis)[0]))
        d = q * scale - x
        rel = np.abs(d) / np.abs(x)
        errors[axis] = np.linalg.norm(d, axis=1) / np.linalg.norm(x, axis=1)
        assert (np.max(rel[considered]) <= 2.0**-4) == (axis == 1)
    assert np.max(errors[1][small]) < np.max(errors[None][small])  # 0.02953 < 0.02981
    np.testing.assert_array_equal(errors[1][~small], errors[None][~small])

    far = x * np.where(small, 2.0**-10, 1.0)[:, None].astype(np.float32)  # 2^20 apart
    exact = far.astype(np.float64) @ w.astype(np.float64)
    assert worst_row_error(jsa.ops.rowwise_fp8_matmul(far, w), small) < 0.1
    assert worst_row_error(jsa.ops.tensorwise_fp8_matmul(far, w), small) > 0.5


# --- transformations, dtypes, autoscale ---------------------------------------------------------


# vmap of the custom_vjp is the same for every recipe; the batching of MX's block
# quantisation: tests/quantization/test_quantization_block.py::test_pytree_jit_and_vmap.
@pytest.mark.parametrize("kind", ["row", pytest.param("mx", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_vmap_over_a_leading_axis(kind):
    x, _, _ = data(7, (3, 4, 32))
    # slices of the shapes of test_inside_autoscale_with_scaled_arrays (compiled once)
    w = np.stack([data(8 + i, (4, 32), n=6)[1] for i in range(3)])

    def value_and_dw(a, b):
        y, vjp = jax.vjp(lambda v: call(kind, a, v), b)
        return y, vjp(jnp.ones_like(y))[0]

    out, grads = jax.vmap(value_and_dw)(x, w)
    for i in range(3):
        y, dw = value_and_dw(x[i], w[i])
        np.testing.assert_array_equal(out[i], y)
        np.testing.assert_array_equal(grads[i], dw)


@pytest.mark.parametrize(
    "kind,dtype",
    [
        ("tensor", jnp.float16),
        ("row", jnp.bfloat16),
        # the conversions are in _forward / _backward, the same for every recipe
        pytest.param("mx", jnp.float16, marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow
def test_dtypes(kind, dtype):
    """Outputs in x's dtype, gradients in their primals'; values those of the float32
    recipe (tested above, same shapes) on the same (exactly converted) inputs, rounded
    once to the dtype."""
    # (conversions in NumPy, rounding to nearest even as XLA's: no program for each)
    x, w, g = (v.astype(dtype) for v in data(9, spread=2))
    y, vjp = jax.vjp(lambda a, b: call(kind, a, b), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    assert y.dtype == dx.dtype == dw.dtype == dtype
    x32, w32, g32 = (jnp.asarray(v.astype(np.float32)) for v in (x, w, g))
    y32, vjp32 = jax.vjp(lambda a, b: call(kind, a, b), x32, w32)
    for low, high in zip((y, dx, dw), (y32, *vjp32(g32)), strict=True):
        np.testing.assert_array_equal(low, np.asarray(high).astype(dtype))


AUTOSCALE_SCALES = {"row": 2.0**20, "mx": 2.0**-20}


def scaled_data(kind):
    """x, w, g, and x, w as ScaledArrays (x with a scale far from 1)."""
    x, w, g = data(10, (4, 32), n=6)
    scale = np.float32(AUTOSCALE_SCALES[kind])
    xs = jsa.scaled_array(jnp.asarray(x / scale), scale)
    return x, w, g, xs, jsa.as_scaled_array(jnp.asarray(w))


# MX in the slow step (its backward program under autoscale alone compiles for seconds): the
# gradients under autoscale go through the recipes' one custom_vjp (row here), MX's
# gradients are checked against the reference in test_forward_and_gradients_match_reference,
# and MX's scaled interpretation in the default run's test_called_on_scaled_arrays_outside_jit.
@pytest.mark.parametrize("kind", ["row", pytest.param("mx", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_inside_autoscale_with_scaled_arrays(kind):
    """Called inside `jsa.autoscale` on ScaledArrays under jit: the plain call's values,
    and its gradients (of the data: those of the value times the scale), from one program
    (the value as `grad`'s auxiliary output). tensorwise_fp8_matmul shares row-wise's
    code."""
    x, w, g, xs, ws = scaled_data(kind)

    @jsa.autoscale
    def value_and_loss(a, b):
        y = call(kind, a, b)
        return y, jnp.sum(y * g)

    def loss_with_value(a, b):
        y, loss = value_and_loss(a, b)
        return jsa.asarray(loss), y

    (dxs, dws), ys = jax.jit(jax.grad(loss_with_value, (0, 1), has_aux=True))(xs, ws)
    expected = call(kind, x, w)
    np.testing.assert_array_equal(jsa.asarray(ys, jnp.float32), expected)
    dx, dw = jax.grad(lambda a, b: jnp.sum(call(kind, a, b) * g), argnums=(0, 1))(x, w)
    np.testing.assert_array_equal(dxs.data, dx * np.float32(AUTOSCALE_SCALES[kind]))
    np.testing.assert_array_equal(dws.data, dw)


# The call dispatches every recipe alike (`autoscale` of the recipe): MX in the default run
# (its scaled interpretation, forward; row-wise's under jit with gradients:
# test_inside_autoscale_with_scaled_arrays), row-wise in the slow step.
@pytest.mark.parametrize("kind", [pytest.param("row", marks=pytest.mark.slow), "mx"])
@pytest.mark.slow
def test_called_on_scaled_arrays_outside_jit(kind):
    """Called on ScaledArrays directly (outside autoscale and jit): the plain call's
    values."""
    x, w, _, xs, ws = scaled_data(kind)
    np.testing.assert_array_equal(jsa.asarray(call(kind, xs, ws), jnp.float32), call(kind, x, w))


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn,args,kwargs,match",
    [
        (jsa.ops.rowwise_fp8_matmul, ((2, 8), (4, 3)), {}, "mismatched shapes.*K=8.*K=4"),
        (jsa.ops.rowwise_fp8_matmul, ((2, 8), (8,)), {}, r"w must have shape \(K, N\)"),
        (jsa.ops.rowwise_fp8_matmul, ((), (8, 2)), {}, "at least one dimension"),
        (
            jsa.ops.rowwise_fp8_matmul,
            ((2, 8), (8, 2)),
            {"forward_format": "float7"},
            "unknown forward_format 'float7'",
        ),
        (
            jsa.ops.tensorwise_fp8_matmul,
            ((2, 8), (8, 2)),
            {"backward_format": "float8_e8m0fnu"},
            "backward_format must be a signed float format",
        ),
        (jsa.ops.mx_matmul, ((2, 48), (48, 2)), {}, "block_size 32 does not divide.*K=48"),
        (jsa.ops.mx_matmul, ((2, 32), (16, 2)), {}, "mismatched shapes"),
        (jsa.ops.mx_matmul, ((2, 32), (32, 2)), {"format": "mxfp7"}, "unknown format 'mxfp7'"),
        (
            jsa.ops.mx_matmul,
            ((2, 32), (32, 2)),
            {"backward_format": "nope"},
            "unknown backward_format 'nope'",
        ),
        (jsa.ops.mx_matmul, ((2, 32), (32, 2)), {"block_size": 0}, "block_size must be"),
    ],
)
def test_bad_inputs_raise_value_error(fn, args, kwargs, match):
    x, w = (jnp.ones(shape, jnp.float32) for shape in args)
    with pytest.raises(ValueError, match=match):
        fn(x, w, **kwargs)


def test_integer_inputs_raise():
    with pytest.raises(ValueError, match="x must be a floating array"):
        jsa.ops.rowwise_fp8_matmul(jnp.ones((2, 4), jnp.int32), jnp.ones((4, 2)))


SCALE_ROUNDING_X = np.array([[1.0, 2.0, 3.0, 7.0], [0.001, 0.002, 0.003, 0.004]], np.float32)
SCALE_ROUNDING_KW = {"format": "mxfp4_e2m1", "block_size": 2}


@pytest.mark.slow
def test_mx_scale_rounding_up():
    """`scale_rounding="up"`: every MX operand quantised with the rounded-up block scales
    (no saturation); the OCP rule saturates 7 -> 6 here, "up" keeps it (3.5 ties to 4 at
    the doubled scale: 8)."""
    x, w, kw = SCALE_ROUNDING_X, np.ones((4, 2), np.float32), SCALE_ROUNDING_KW
    up = jsa.ops.mx_matmul(x, w, **kw, scale_rounding="up")
    expected = jsa.quantization.block_fake_quantize(
        x, "mxfp4_e2m1", 2, axis=1, scale_rounding="up"
    ) @ jsa.quantization.block_fake_quantize(w, "mxfp4_e2m1", 2, axis=0, scale_rounding="up")
    np.testing.assert_array_equal(up, expected)
    ocp = jsa.ops.mx_matmul(x, w, **kw)
    assert np.asarray(up)[0, 0] == 14.0 and np.asarray(ocp)[0, 0] == 12.0
    with pytest.raises(ValueError, match="mx_matmul: scale_rounding must be one of"):
        jsa.ops.mx_matmul(x, w, **kw, scale_rounding="nearest")


# The backward program of this recipe alone takes seconds to compile; the scale rounding
# reaches the backward's quantisers through the same recipe field as the forward's (above),
# and MX gradients are checked against the reference by test_forward_and_gradients_*.
@pytest.mark.slow
def test_mx_scale_rounding_up_backward():
    """`scale_rounding="up"` in the backward pass: finite gradients of x's shape."""
    x, w, kw = SCALE_ROUNDING_X, np.ones((4, 2), np.float32), SCALE_ROUNDING_KW
    g = jax.grad(lambda x: jnp.sum(jsa.ops.mx_matmul(x, w, **kw, scale_rounding="up")))(x)
    assert g.shape == x.shape and np.isfinite(g).all()


@pytest.mark.parametrize("recipe", ["tensor", "row"])
def test_recipes_lower_to_fp8_dots_for_cuda(recipe):
    """Row-wise and per-tensor recipes multiply FP8 operands (E4M3 forward; E5M2 gradient
    with E4M3 operand backward) into float32: XLA's FP8 GEMM form on GPUs. Lowered for CUDA
    on this CPU; the MX recipe (block scales along K) stays a float32 simulation."""
    from tests.lax.test_cuda_lowering import _cuda_dots

    matmul = {"tensor": jsa.ops.tensorwise_fp8_matmul, "row": jsa.ops.rowwise_fp8_matmul}[recipe]
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 32)).astype(np.float32)
    w = rng.normal(size=(32, 8)).astype(np.float32)
    forward = _cuda_dots(matmul, x, w)
    grads = _cuda_dots(jax.grad(lambda x, w: jnp.sum(matmul(x, w) ** 2), argnums=(0, 1)), x, w)
    assert [ops for ops, _ in forward] == ["tensor<16x32xf8E4M3FN>, tensor<32x8xf8E4M3FN>"]
    assert sorted(ops for ops, _ in grads) == sorted(
        [
            "tensor<16x32xf8E4M3FN>, tensor<32x8xf8E4M3FN>",  # the forward again
            "tensor<16x8xf8E5M2>, tensor<8x32xf8E4M3FN>",  # dx = g w^T
            "tensor<32x16xf8E4M3FN>, tensor<16x8xf8E5M2>",  # dw = x^T g
        ]
    )
    assert all(result.endswith("xf32>") for _, result in forward + grads)
