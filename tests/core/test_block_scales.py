"""Block scales (scales finer than one per tensor): the datatype contract, and autoscale
keeping them through the block rules (lax/block_rules/) or going per tensor elsewhere.

Every case compares the autoscaled function on block-scaled inputs with the plain
function on the represented values, over layouts (per tensor, per row, per column, MX
1x32 blocks, tiles), data dtypes and jit on/off, with gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.core import block_scales
from tests import helpers
from tests.helpers import as_scaled_array_jit, represented

M, K, N = 8, 64, 16
# Block layouts of an (M, K) array.
LAYOUTS = {
    "tensor": (1, 1),
    "row": (M, 1),
    "column": (1, K),
    "mx32": (M, K // 32),
    "tile": (M // 4, K // 32),
}
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
# Relative to the output's largest magnitude; float8_e4m3fn: 3 mantissa bits, rounded at
# the inputs and again at each stored intermediate.
TOL = {np.float32: 1e-6, np.float16: 4e-3, ml_dtypes.bfloat16: 3e-2, ml_dtypes.float8_e4m3fn: 0.25}


def rows_far_apart(shape, seed=0, binades=6):
    """Normal values whose rows differ by up to 2^(2 * binades) in magnitude."""
    rng = np.random.default_rng(seed)
    size = (shape[0],) + (1,) * (len(shape) - 1)
    mag = np.exp2(rng.integers(-binades, binades + 1, size=size))
    return (rng.normal(size=shape) * mag).astype(np.float32)


def assert_close(out, ref, dtype):
    """`out` within TOL[dtype] of `ref`, relative to the largest |ref|."""
    helpers.assert_close(out, ref, rtol=0.0, atol_rel=TOL[dtype])


SLOW = pytest.mark.slow


# --- the datatype ------------------------------------------------------------------------


def test_to_array_repeats_each_scale_over_its_block():
    data = np.arange(1.0, 9.0, dtype=np.float32).reshape(2, 4)
    x = jsa.scaled_array(data, np.float32([[1.0, 4.0], [0.5, 2.0]]))
    expected = data * np.float32([[1, 1, 4, 4], [0.5, 0.5, 2, 2]])
    np.testing.assert_array_equal(x.to_array(), expected)


def test_lower_rank_scale_is_per_trailing_axis():
    x = jsa.scaled_array(np.ones((2, 3), np.float32), np.float32([1.0, 2.0, 4.0]))
    assert x.scale.shape == (1, 3)
    np.testing.assert_array_equal(x.to_array()[1], [1.0, 2.0, 4.0])


@pytest.mark.parametrize("scale_shape", [(3, 1), (2, 5), (1, 1, 1)])
def test_scale_that_does_not_tile_the_data_is_rejected(scale_shape):
    with pytest.raises(ValueError, match=r"does not broadcast to data of shape \(4, 64\)"):
        jsa.scaled_array(np.ones((4, 64), np.float32), np.ones(scale_shape, np.float32))


# Eagerly (each operation a compile per layout) with the per-tensor and the tile layouts in
# the default run, jitted (the program the tests below reuse) with the others; the slow step
# runs the other layouts eagerly too.
EAGER_AS_SCALED_LAYOUTS = ("tensor", "tile")


@pytest.mark.parametrize(
    "name, jit",
    [
        pytest.param(name, jit, marks=() if jit == (name not in EAGER_AS_SCALED_LAYOUTS) else SLOW)
        for name in LAYOUTS
        for jit in (False, True)
    ],
)
@pytest.mark.parametrize("dtype", DTYPES + [ml_dtypes.float8_e4m3fn])
def test_as_scaled_array_with_scale_shape(name, jit, dtype):
    x = rows_far_apart((M, K))
    as_scaled = as_scaled_array_jit if jit else jsa.as_scaled_array
    y = as_scaled(x, scale_shape=LAYOUTS[name], dtype=dtype)
    assert y.scale.shape == LAYOUTS[name] and y.dtype == dtype
    data = np.abs(np.asarray(y.data, np.float32)).reshape(
        LAYOUTS[name][0], -1, LAYOUTS[name][1], K // LAYOUTS[name][1]
    )
    # Each block's largest magnitude is in [1, 2) (before the cast to the data dtype).
    block_max = data.max(axis=(1, 3))
    assert ((block_max >= 1) & (block_max <= 2)).all()
    scale = np.asarray(y.scale)
    assert (np.frexp(scale)[0] == 0.5).all()  # powers of two
    # Error within the format's precision relative to each block's largest magnitude.
    tol = {ml_dtypes.float8_e4m3fn: 0.07}.get(dtype, TOL.get(dtype, 0))
    rows, cols = LAYOUTS[name]
    block_max = np.abs(x).reshape(rows, M // rows, cols, K // cols).max(axis=(1, 3))
    block_ref = np.repeat(np.repeat(block_max, M // rows, axis=0), K // cols, axis=1)
    assert (np.abs(np.asarray(y.to_array(jnp.float32)) - x) <= tol * block_ref).all()


def test_as_scaled_array_scale_shape_callable_and_errors():
    tree = {"w": jnp.ones((4, 8)), "b": jnp.ones((8,))}
    out = jsa.as_scaled_array(tree, scale_shape=lambda s: (1,) * (len(s) - 1) + (s[-1],))
    assert out["w"].scale.shape == (1, 8) and out["b"].scale.shape == (8,)
    with pytest.raises(ValueError, match="takes `scale` or `scale_shape`, not both"):
        jsa.as_scaled_array(tree["w"], scale=2.0, scale_shape=(4, 1))
    with pytest.raises(ValueError, match="each scale dimension must divide"):
        jsa.as_scaled_array(tree["w"], scale_shape=(3, 1))
    with pytest.raises(TypeError, match="scale_shape must be a tuple of ints"):
        jsa.as_scaled_array(tree["w"], scale_shape=4)


def test_autoscale_rejects_a_scale_that_is_not_a_block_scale():
    bad = jsa.ScaledArray(jnp.ones((4, 8)), jnp.ones((3, 1)))
    with pytest.raises(ValueError, match=r"scale of shape \(3, 1\) is not a block scale"):
        jsa.autoscale(lambda a: a * 2)(bad)


def test_blocks_helpers():
    assert block_scales.common_layout((8, 64), (8, 1), (1, 2)) == (8, 2)
    assert block_scales.common_layout((8, 64), (2, 2), (4, 1)) == (4, 2)
    scale = jnp.float32([[1.0, 2.0], [4.0, 8.0]])
    np.testing.assert_array_equal(
        block_scales.refine_scale(scale, (4, 4), (4, 2)), [[1, 2], [1, 2], [4, 8], [4, 8]]
    )
    data, largest = block_scales.to_per_tensor(jnp.ones((2, 4)), scale)
    assert float(largest) == 8.0
    np.testing.assert_array_equal(data, [[0.125, 0.125, 0.25, 0.25], [0.5, 0.5, 1.0, 1.0]])


# --- autoscale over block layouts --------------------------------------------------------


def _linear_relu(x, w, b):
    return jax.nn.relu(x @ w + b[None, :])


def _norm_rows(x):
    centred = x - jnp.mean(x, axis=-1, keepdims=True)
    return centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + 1e-5)


def _elementwise_mix(x):
    return jnp.maximum(x, 0.0) * 2.0 - jnp.abs(x) / 4.0 + jnp.where(x > 0, x, -x)


def _reductions(x):
    return jnp.stack([x.sum(axis=1), jnp.max(x, axis=1), jnp.min(x, axis=1)]).T.sum(axis=0)


def _shapes(x):
    y = x.T[:, :4]  # transpose, slice
    return y.reshape(K, 2, 2).sum(axis=-1) + jnp.broadcast_to(x[:1, :1], (K, 2))


def _softmax_cross_entropy(x):
    return -jnp.mean(jax.nn.log_softmax(x, axis=-1)[:, 0])


FUNCTIONS = {
    "linear_relu": _linear_relu,
    "norm_rows": _norm_rows,
    "elementwise_mix": _elementwise_mix,
    "reductions": _reductions,
    "shapes": _shapes,
    "softmax_cross_entropy": _softmax_cross_entropy,
}


def _inputs(name):
    # Squares of rows 2^12 apart span 2^24: more than float16 holds at one scale.
    x = rows_far_apart((M, K), binades=3 if name == "norm_rows" else 6)
    if name != "linear_relu":
        return (x,)
    rng = np.random.default_rng(1)
    w = (rng.normal(size=(K, N)) / 8).astype(np.float32)
    return x, w, np.full(N, 0.1, np.float32)


# float8_e4m3fn data (no inf; largest 448) with the functions FP8 data is used for: the
# normalisation and the log-softmax need an infinity (the -inf start of a max) or a range
# the format does not have, in plain float8 too.
FP8_FUNCTIONS = ("linear_relu", "elementwise_mix", "reductions", "shapes")
BLOCK_LAYOUT_CASES = [(f, d, layout) for f in FUNCTIONS for d in DTYPES for layout in LAYOUTS] + [
    (f, ml_dtypes.float8_e4m3fn, layout) for f in FP8_FUNCTIONS for layout in LAYOUTS
]


# Eagerly in the default run: with tiles (the finest layout), the dtypes in turn, the
# functions whose rules cover the block rules' families (reductions and rsqrt, max/min
# reductions, shapes); each operation is a compile of its own: the slow step runs the
# others. dot_general and elementwise rules run eagerly on block scales in
# test_gradients_through_block_scaled_inputs[row-float32] (its gradient outside autoscale).
EAGER_BLOCK_LAYOUT_CASES = {
    "norm_rows": ml_dtypes.bfloat16,
    "reductions": np.float32,
    "shapes": ml_dtypes.float8_e4m3fn,
}
# Jitted in the default run: every (function, dtype), (function, layout) and (dtype, layout)
# pair (test_autoscale_matches_plain_on_block_layouts_jitted, one program per layout); the
# slow step runs the whole product, a program per case.
BLOCK_LAYOUT_COVER = helpers.pairwise_cover(BLOCK_LAYOUT_CASES)


def _block_layout_case(fn_name, dtype, layout):
    """Block-scaled inputs of `fn_name` and the float32 reference on their values."""
    plain = _inputs(fn_name)
    x = as_scaled_array_jit(plain[0], scale_shape=LAYOUTS[layout], dtype=dtype)
    rest = [as_scaled_array_jit(p, dtype=dtype) for p in plain[1:]]
    values = [represented(x)] + [represented(r) for r in rest]  # exact in float32
    return [x, *rest], _block_layout_references[fn_name](*[np.float32(v) for v in values])


# The references in one program per function (eagerly, each operation is a compile).
_block_layout_references = {name: jax.jit(fn) for name, fn in FUNCTIONS.items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    "fn_name, dtype, layout, jit",
    helpers.eager_and_jit(
        BLOCK_LAYOUT_CASES,
        lambda f, d, layout: layout == "tile" and EAGER_BLOCK_LAYOUT_CASES.get(f) is d,
        lambda f, d, layout: False,
    ),
)
def test_autoscale_matches_plain_on_block_layouts(fn_name, dtype, layout, jit):
    args, ref = _block_layout_case(fn_name, dtype, layout)
    scaled_fn = jsa.autoscale(FUNCTIONS[fn_name])
    if jit:
        scaled_fn = jax.jit(scaled_fn)
    assert_close(scaled_fn(*args), ref, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_autoscale_matches_plain_on_block_layouts_jitted(layout):
    """The default run's pairwise cover of test_autoscale_matches_plain_on_block_layouts,
    jitted: the cases of one layout in one program (one compile where a program per case
    compiles about twice as long), each compared as there."""
    cases = [c for c in BLOCK_LAYOUT_CASES if c[2] == layout and BLOCK_LAYOUT_COVER(*c)]
    assert cases
    prepared = [_block_layout_case(*case) for case in cases]
    outs = jax.jit(
        jsa.autoscale(lambda all_args: [FUNCTIONS[f](*a) for (f, _, _), a in zip(cases, all_args)])
    )([args for args, _ in prepared])
    for case, out, (_, ref) in zip(cases, outs, prepared, strict=True):
        assert isinstance(out, jsa.ScaledArray), case
        assert_close(out, ref, case[1])


@pytest.mark.parametrize(
    "layout, jit",
    # Eagerly (each operation a compile per layout) with tiles in the default run, jitted
    # with the others; the slow step runs the other pairs.
    [
        pytest.param(layout, jit, marks=() if jit == (layout != "tile") else pytest.mark.slow)
        for layout in ("row", "mx32", "tile")
        for jit in (False, True)
    ],
)
def test_block_layouts_kept_by_block_rules(layout, jit):
    x = as_scaled_array_jit(rows_far_apart((M, K)), scale_shape=LAYOUTS[layout])
    transform = (lambda f: jax.jit(jsa.autoscale(f))) if jit else jsa.autoscale
    out = transform(lambda a: (-a * a).T)(x)
    assert out.scale.shape == LAYOUTS[layout][::-1]
    assert transform(jnp.tanh)(x).scale.shape == LAYOUTS[layout]
    # A primitive without a block rule (atan) gets the operand per tensor: a scalar scale.
    assert transform(jnp.arctan)(x).scale.shape == ()


def test_row_scales_keep_rows_that_one_float16_scale_loses():
    """Rows 2^24 apart: normalising each row in float16 data works with one scale per row,
    and loses the small rows with one scale per tensor (their squares underflow)."""
    x = np.ones((4, 32), np.float32) * np.float32([[2.0**-12], [1.0], [2.0**6], [2.0**12]])
    x[:, ::2] *= -1
    ref = _norm_rows(jnp.asarray(x))
    # Jitted (the eager rules: test_autoscale_matches_plain_on_block_layouts).
    norm_rows = jax.jit(jsa.autoscale(_norm_rows))
    rows = norm_rows(as_scaled_array_jit(x, scale_shape=(4, 1), dtype=np.float16))
    assert_close(rows, ref, np.float16)
    tensor = norm_rows(as_scaled_array_jit(x, scale_shape=(1, 1), dtype=np.float16))
    assert np.abs(represented(tensor)[0] - np.asarray(ref)[0]).max() > 0.1


W_LAYOUTS = [(1, 1), (1, N), (2, 1), (2, N)]


@pytest.mark.slow
def test_dot_general_block_layouts():
    """Per tensor / row / MX blocks of x and column / MX blocks of w (every pair, in one
    program): the product is exact in float32 (power-of-two scales), and the output keeps
    x's row blocks."""
    x_plain, w_plain, _ = _inputs("linear_relu")
    x_layouts = ["tensor", "row", "mx32"]
    xs = [as_scaled_array_jit(x_plain, scale_shape=LAYOUTS[name]) for name in x_layouts]
    ws = [as_scaled_array_jit(w_plain, scale_shape=layout) for layout in W_LAYOUTS]
    outs = jax.jit(jsa.autoscale(lambda az, bs: [[jnp.matmul(a, b) for b in bs] for a in az]))(
        xs, ws
    )
    for x_layout, x_outs in zip(x_layouts, outs, strict=True):
        rows = LAYOUTS[x_layout][0]
        for w_layout, out in zip(W_LAYOUTS, x_outs, strict=True):
            np.testing.assert_allclose(
                out.to_array(),
                x_plain @ w_plain,
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"x {x_layout}, w {w_layout}",
            )
            assert np.shape(out.scale) == ((rows, 1) if rows > 1 else ()), (x_layout, w_layout)


# Every layout in the default run, float32 and float16 (the slow step: the other pairs).
GRADIENT_CASES = [(layout, dtype) for layout in ("row", "mx32") for dtype in DTYPES]
# (row, bfloat16) in the slow step: bfloat16 gradients through block scales are in the
# default run's test_tiles_of_fp8_training_through_a_matmul_with_gradients (128x128 tiles)
# and test_stacked_layer_scales_with_gradients (per-layer scales).
GRADIENT_DEFAULT = {("row", np.float32), ("mx32", np.float16)}


@pytest.mark.parametrize(
    "layout, dtype",
    [
        pytest.param(*case, marks=() if case in GRADIENT_DEFAULT else pytest.mark.slow)
        for case in GRADIENT_CASES
    ],
)
@pytest.mark.one_case
def test_gradients_through_block_scaled_inputs(layout, dtype):
    x_plain, w_plain, b_plain = _inputs("linear_relu")

    def loss(x, w, b):
        return jnp.sum(_linear_relu(x, w, b) ** 2)

    x = as_scaled_array_jit(x_plain, scale_shape=LAYOUTS[layout], dtype=dtype)
    w = as_scaled_array_jit(w_plain, scale_shape=(1, N), dtype=dtype)
    b = as_scaled_array_jit(b_plain, dtype=dtype)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    grads = jax.jit(jsa.autoscale(grad))(x, w, b)
    ref = jax.jit(grad)(represented(x), represented(w), represented(b))
    for g, r in zip(grads, ref):
        assert_close(g, r, dtype)
    # Outside autoscale, the gradient with respect to the data is dL/dvalue times the
    # data's block scale (eagerly in float32, jitted in the other dtypes).
    outer = jax.grad(lambda x: jsa.autoscale(loss)(x, w, b).to_array(jnp.float32))
    outer = (outer if dtype is np.float32 else jax.jit(outer))(x)
    assert_close(
        outer.data.astype(np.float32) / block_scales.expand_scale(x.scale, x.shape), ref[0], dtype
    )


def test_float8_data_with_mx_blocks_through_a_matmul():
    """MXFP8-style operands: float8_e4m3fn data with one scale per 32 elements."""
    x_plain, w_plain, _ = _inputs("linear_relu")
    x = as_scaled_array_jit(x_plain, scale_shape=(M, K // 32), dtype=ml_dtypes.float8_e4m3fn)
    w = as_scaled_array_jit(w_plain, scale_shape=(K // 32, 1), dtype=ml_dtypes.float8_e4m3fn)
    out = jax.jit(jsa.autoscale(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32)))(
        x, w
    )
    ref = represented(x).astype(np.float64) @ represented(w).astype(np.float64)
    np.testing.assert_allclose(out.to_array(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # Against per-tensor float8 scaling, MX blocks keep the small rows' precision.
    x_tensor = as_scaled_array_jit(x_plain, scale_shape=(1, 1), dtype=ml_dtypes.float8_e4m3fn)
    err_mx = np.abs(represented(x) - x_plain).max(axis=1) / np.abs(x_plain).max(axis=1)
    err_tensor = np.abs(represented(x_tensor) - x_plain).max(axis=1) / np.abs(x_plain).max(axis=1)
    assert err_mx.max() < 0.07 < err_tensor.max()


# --- FP8-training layouts at their real sizes: 1x128 and 128x128 tiles, stacked layers ---

T = 256  # two 128-tiles per axis
TILE_PAIRS = {  # (x layout, w layout) of x (T, T) @ w (T, T)
    "tensor x tensor": ((1, 1), (1, 1)),
    "row x column": ((T, 1), (1, T)),
    "1x128 x 128x128": ((T, T // 128), (T // 128, T // 128)),
    "128x128 x 128x128": ((T // 128, T // 128), (T // 128, T // 128)),
    "1x128 x column": ((T, T // 128), (1, T)),
}
TILE_DTYPES = DTYPES + [ml_dtypes.float8_e4m3fn]


def _tile_inputs():
    rng = np.random.default_rng(3)
    # Each 128x128 tile of x 2^(3k) apart; w's output columns 2^(2j) apart.
    x = rng.normal(size=(T, T)) * np.kron(np.exp2([[0, 6], [-6, 3]]), np.ones((128, 128)))
    w = rng.normal(size=(T, T)) / 16 * np.exp2(np.arange(T) % 4 * 2.0)[None, :]
    return x.astype(np.float32), w.astype(np.float32)


def _tile_loss(x, w):
    return jnp.sum(jnp.tanh(x @ w) * (x @ w)) / T


# The default run: the tiled layout pairs jitted once, the dtypes in turn (float8 with the
# 1x128 x 128x128 recipe); the slow step runs every pair with every dtype, jitted and
# eagerly. Per tensor x per tensor is the rest of the suite's layout (float32 gradients:
# tests/core/test_interpreter.py's MLP); 1x128 x column is 1x128 tiles of x (1x128 x
# 128x128) and columns of w (row x column), both in the default run.
TILE_DEFAULT_JIT = {
    ("row x column", np.float16),
    ("1x128 x 128x128", ml_dtypes.float8_e4m3fn),
    ("128x128 x 128x128", ml_dtypes.bfloat16),
}


def _tile_loss_grads_and_product(x, w):
    return jax.value_and_grad(_tile_loss, argnums=(0, 1))(x, w), x @ w


_tile_reference = jax.jit(_tile_loss_grads_and_product)


@pytest.mark.slow
@pytest.mark.parametrize(
    "pair, dtype, jit",
    helpers.eager_and_jit(
        [(pair, dtype) for pair in TILE_PAIRS for dtype in TILE_DTYPES],
        # Not eagerly: the block rules run eagerly in
        # test_autoscale_matches_plain_on_block_layouts, and their gradients in
        # test_gradients_through_block_scaled_inputs (the slow step runs these).
        lambda pair, dtype: False,
        lambda pair, dtype: (pair, dtype) in TILE_DEFAULT_JIT,
    ),
)
def test_tiles_of_fp8_training_through_a_matmul_with_gradients(pair, dtype, jit):
    """x (256, 256) @ w (256, 256) with the layouts of FP8 training recipes (per tensor,
    row x column, 1x128 activation tiles x 128x128 weight tiles): the autoscaled value and
    gradients match the plain ones on the represented values, and the product keeps x's
    row blocks. float8_e4m3fn data: the value and the product (its gradients store every
    intermediate in 3 mantissa bits, a test of the format rather than of the scales)."""
    x_layout, w_layout = TILE_PAIRS[pair]
    x_plain, w_plain = _tile_inputs()
    x = as_scaled_array_jit(x_plain, scale_shape=x_layout, dtype=dtype)
    w = as_scaled_array_jit(w_plain, scale_shape=w_layout, dtype=dtype)
    assert x.scale.shape == x_layout and w.scale.shape == w_layout
    fn = jsa.autoscale(_tile_loss_grads_and_product)  # one program for all three
    (loss, grads), out = (jax.jit(fn) if jit else fn)(x, w)
    xv, wv = jnp.asarray(represented(x)), jnp.asarray(represented(w))
    (ref_loss, ref_grads), ref_out = _tile_reference(xv, wv)
    tol = {ml_dtypes.float8_e4m3fn: 0.25, ml_dtypes.bfloat16: 3e-2}.get(dtype, 4e-3)
    assert abs(float(represented(loss)) - float(ref_loss)) <= tol * abs(float(ref_loss))
    if dtype != ml_dtypes.float8_e4m3fn:
        for g, r in zip(grads, ref_grads):
            assert_close(g, r, dtype if dtype != np.float32 else np.float16)
    np.testing.assert_allclose(
        represented(out), np.asarray(ref_out), rtol=0, atol=2 * tol * float(jnp.abs(ref_out).max())
    )
    rows = x_layout[0]
    assert np.shape(out.scale) == ((rows, 1) if rows > 1 else ())


L_LAYERS = 4


def _stacked_inputs():
    rng = np.random.default_rng(4)
    mags = np.exp2(np.array([-9.0, 9.0, -3.0, 6.0]))[:, None, None]  # layers 2^18 apart
    x = rng.normal(size=(L_LAYERS, M, K)) * mags
    w = rng.normal(size=(L_LAYERS, K, N)) / 8
    return x.astype(np.float32), w.astype(np.float32)


STACKED_FUNCTIONS = {
    "layer_matmul": lambda x, w: jnp.sum(jnp.tanh(jnp.einsum("lmk,lkn->lmn", x, w)) ** 2),
    # Gradients ~ 1 / |x|: the layers' gradients are 2^18 apart, in the other order.
    "norm_rows": lambda x, w: jnp.sum(
        _norm_rows(x) * np.linspace(-1.0, 2.0, K, dtype=np.float32)[None, None]
    ),
    "elementwise_reduce": lambda x, w: jnp.sum(jnp.max(_elementwise_mix(x), axis=-1) ** 2),
}


STACKED_REFERENCES = {name: jax.jit(jax.grad(fn)) for name, fn in STACKED_FUNCTIONS.items()}


@pytest.mark.parametrize(
    "fn_name, dtype, jit",
    helpers.eager_and_jit(
        [(fn_name, dtype) for fn_name in STACKED_FUNCTIONS for dtype in DTYPES],
        # Not eagerly: autoscale(grad) with block scales runs eagerly in
        # test_tiles_of_fp8_training_through_a_matmul_with_gradients, the block rules in
        # test_autoscale_matches_plain_on_block_layouts (the slow step runs these).
        lambda fn_name, dtype: False,
        # Default run: each function jitted once, the dtypes in turn (the slow step: the
        # other pairs).
        lambda fn_name, dtype: (
            (fn_name, dtype)
            in {
                ("layer_matmul", np.float32),
                ("norm_rows", np.float16),
                ("elementwise_reduce", ml_dtypes.bfloat16),
            }
        ),
    ),
)
@pytest.mark.slow
def test_stacked_layer_scales_with_gradients(fn_name, dtype, jit):
    """Stacked layers with one scale each, `(L, 1, 1)`, layers 2^18 apart: value and
    gradient (which keeps the per-layer layout) match the plain ones per layer."""
    x, w, ref = _stacked_case(fn_name, dtype)
    grad_fn = jsa.autoscale(jax.grad(STACKED_FUNCTIONS[fn_name]))
    grad_fn = jax.jit(grad_fn) if jit else grad_fn
    _check_stacked(grad_fn(x, w), ref, dtype)


def _stacked_case(fn_name, dtype):
    x_plain, w_plain = _stacked_inputs()
    x = as_scaled_array_jit(x_plain, scale_shape=(L_LAYERS, 1, 1), dtype=dtype)
    w = as_scaled_array_jit(w_plain, scale_shape=(L_LAYERS, 1, 1), dtype=dtype)
    ref = STACKED_REFERENCES[fn_name](jnp.asarray(represented(x)), jnp.asarray(represented(w)))
    return x, w, ref


def _check_stacked(g, ref, dtype):
    assert g.scale.shape == (L_LAYERS, 1, 1)
    for layer in range(L_LAYERS):  # each layer against its own magnitude
        assert_close(g[layer], np.asarray(ref)[layer], dtype)


# --- vmap: per-example scales ---------------------------------------------------------


def _per_example(x):
    """One power-of-two scale per example (leading axis): a (B, 1, ...) block scale."""
    return as_scaled_array_jit(x, scale_shape=(x.shape[0],) + (1,) * (x.ndim - 1))


@pytest.mark.parametrize("jit", [False, True])
def test_vmap_of_autoscale_stacks_per_example_scales_as_blocks(jit):
    x = rows_far_apart((M, K))
    xs = _per_example(x)

    def fn(a):
        return jnp.tanh(a) * 3.0 + a

    mapped = jax.vmap(jsa.autoscale(fn))
    if jit:
        mapped = jax.jit(mapped)
    out = mapped(xs)
    assert out.scale.shape == (M, 1)
    assert_close(out, jax.vmap(fn)(jnp.asarray(x)), np.float32)
    # The stacked output is a valid ScaledArray: autoscale takes it as an input again.
    again = jsa.autoscale(lambda a: a * 2.0)(out)
    assert_close(again, 2 * jax.vmap(fn)(jnp.asarray(x)), np.float32)


def test_autoscale_of_vmap_with_per_example_scales():
    x = rows_far_apart((M, K))
    w = (np.random.default_rng(2).normal(size=(K, N)) / 8).astype(np.float32)

    def per_example(a, w):
        return jax.nn.relu(a @ w)

    out = jax.jit(jsa.autoscale(jax.vmap(per_example, in_axes=(0, None))))(
        _per_example(x), as_scaled_array_jit(w)
    )
    assert out.scale.shape == (M, 1)
    assert_close(out, jax.vmap(per_example, in_axes=(0, None))(x, w), np.float32)


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_materialize_on_cpu_is_the_identity_everywhere_a_division_on_xla_cpu(dtype, use_jit):
    """The interpreter's "computed once" marker: the value unchanged (also for inf and NaN),
    an exact division by one in the XLA:CPU lowering only (its scaled rule, through
    autoscale, is in tests/lax/test_elementwise.py's table)."""
    x = jnp.array([[1.5, -0.0, np.inf], [np.nan, 3e-5, -7.0]], dtype)
    run = jax.jit(block_scales.materialize_on_cpu) if use_jit else block_scales.materialize_on_cpu
    np.testing.assert_array_equal(np.float32(run(x)), np.float32(x))
    assert helpers.lowered_divides(block_scales.materialize_on_cpu, (x,), "cpu") == 1
    for platform in ("cuda", "tpu"):
        assert helpers.lowered_divides(block_scales.materialize_on_cpu, (x,), platform) == 0


@pytest.mark.parametrize("dtype", helpers.FLOAT_DTYPES)
@pytest.mark.parametrize(
    "shape, layout",
    [
        ((16, 64), (1, 1)),  # one block: flattened and padded on XLA:CPU
        ((40, 50), (1, 1)),
        ((16, 64), (16, 1)),  # per row: the 64 split into 2 x 32
        ((64, 128), (1, 128)),  # per column: 64 x 1 blocks, the 64 split
        ((30, 96), (3, 2)),  # 10 x 48 blocks: 48 not a multiple of 32, kept
        ((128, 64), (4, 2)),  # 32 x 32 blocks
        ((80, 80), (1, 1)),  # 6,400 elements: left to XLA's reduction library
    ],
    ids=str,
)
def test_block_dynamic_scale_lowerings_agree(shape, layout, dtype):
    """`block_dynamic_scale` on XLA:CPU reduces a small tensor's blocks in one kernel (axes
    split into 32s, or one block flattened and padded); jitted, `bind` runs that lowering
    here and `impl` the default one: the same scales and ratios, beside infinities and NaNs,
    wherever each block's largest magnitude sits, and numpy's block maxima."""
    p = block_scales.block_dynamic_scale_p
    factor = jnp.full(layout, 3.0, jnp.float32)
    cpu = jax.jit(lambda x, f: p.bind(x, f, layout=layout))
    default = jax.jit(lambda x, f: p.impl(x, f, layout=layout))
    rng = np.random.default_rng(shape[1])
    values = rng.uniform(-1.0, 1.0, shape)
    values[0, -1] = -6.5  # a block's largest magnitude at its end, another's at its start
    values[-1, 0] = 5.0
    values[shape[0] // 2, 1] = np.nan
    values[1, shape[1] // 2] = -np.inf
    x = jnp.asarray(values, dtype)
    got, want = cpu(x, factor), default(x, factor)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    data = np.abs(np.asarray(x, np.float32))
    data[~np.isfinite(data)] = 0
    rows, cols = shape[0] // layout[0], shape[1] // layout[1]
    largest = data.reshape(layout[0], rows, layout[1], cols).max(axis=(1, 3)) * np.float32(3)
    expected = np.where(largest > 0, 2.0 ** np.floor(np.log2(np.maximum(largest, 1e-30))), 1.0)
    np.testing.assert_array_equal(np.asarray(got[0]), expected)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's kernels")
@pytest.mark.parametrize("layout", [(1, 1), (16, 1)], ids=str)
def test_small_block_maxima_are_one_kernel_on_xla_cpu(layout):
    """A `[16, 64]` tensor's block maxima: a reduce-window and a reduce beside the filter in
    the default lowering on XLA:CPU, one loop fused with the filter in its own lowering."""
    p = block_scales.block_dynamic_scale_p

    def kernels(bind):
        def step(x, factor):
            y = jnp.tanh(x)
            return y, bind(y, factor, layout=layout)

        hlo = jax.jit(step).lower(jnp.ones((16, 64)), jnp.ones(layout)).compile().as_text()
        entry = hlo[hlo.index("\nENTRY") :]
        return "reduce-window" in hlo, sum(" fusion(" in line for line in entry.splitlines())

    (cpu_split, cpu_kernels), (default_split, default_kernels) = kernels(p.bind), kernels(p.impl)
    assert default_split and not cpu_split
    assert cpu_kernels <= default_kernels - 2


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "shape, axes",
    [((1, 1, 128), (2,)), ((1, 384), None), ((128,), None), ((4, 96), (1,)), ((3, 50), (0, 1))],
    ids=str,
)
def test_largest_scale_is_jnp_max(shape, axes, jit):
    """The largest block scale along `axes` (one kernel on XLA:CPU where an axis longer than
    32 is split), equal to `jnp.max`, a NaN, an infinity, zeros and negative values
    included."""
    rng = np.random.default_rng(len(shape))
    values = 2.0 ** rng.integers(-30, 30, size=shape).astype(np.float32)
    values.reshape(-1)[-1] = 2.0**40  # the largest at the very end
    for special in (None, np.nan, np.inf, 0.0, -8.0):
        scale = values.copy()
        if special is not None:
            scale.reshape(-1)[scale.size // 2] = special
        scale = jnp.asarray(scale)
        for keepdims in (False, True):
            largest = functools.partial(block_scales.largest_scale, axes=axes, keepdims=keepdims)
            got = (jax.jit(largest) if jit else largest)(scale)
            want = jnp.max(scale, axis=axes, keepdims=keepdims)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(special))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's kernels")
def test_largest_scale_of_a_per_channel_scale_is_one_kernel_on_xla_cpu():
    """`jnp.max` of a `[1, 1, 128]` block scale over its channels: a reduce-window and a
    reduce on XLA:CPU; `largest_scale`: one loop fused with the scale's producer."""

    def kernels(largest):
        def step(x):
            scale = jnp.exp2(jnp.round(x))
            return scale, largest(scale)

        hlo = jax.jit(step).lower(jnp.ones((1, 1, 128))).compile().as_text()
        entry = hlo[hlo.index("\nENTRY") :]
        return "reduce-window" in hlo, sum(" fusion(" in line for line in entry.splitlines())

    split, plain = kernels(lambda s: jnp.max(s, axis=2, keepdims=True))
    one_loop, fewer = kernels(lambda s: block_scales.largest_scale(s, (2,), keepdims=True))
    assert split and not one_loop
    assert fewer <= plain - 1
