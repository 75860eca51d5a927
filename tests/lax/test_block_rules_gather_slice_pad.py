"""Block scales through gather, dynamic_slice, dynamic_update_slice, pad and scatter
(lax/block_rules/indexing.py).

Each case compares the autoscaled function on block-scaled inputs with the plain function
on the represented values, over layouts, data dtypes and jit on/off (with gradients), and
checks the output's scale shape: the blocks are kept. Float16 cases with rows 2^24 apart
check that the small rows keep their precision (one scale per tensor loses them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_scaled_arithmetics as jsa
from tests.helpers import as_scaled_array_jit
from tests.lax.test_block_rules_conv_concat_control import (
    DTYPE_JIT,
    check,
    dtype_jit_params,
    far_apart,
    per_tensor,
    represented,
    scale_shape,
)

V, D = 8, 4  # table rows, row length
IDS = np.array([[0, 3, 7, 1], [2, 2, 5, 6]], np.int32)  # (B, T) token ids, one repeated


def _scaled(x, shape, dtype):
    if shape == ():
        return per_tensor(x, dtype)
    return as_scaled_array_jit(x, scale_shape=shape, dtype=dtype)


def _row_error(out, ref):
    """Largest error of each row (axis 0), relative to that row's largest value."""
    out, ref = np.asarray(represented(out), np.float64), np.asarray(ref, np.float64)
    out, ref = out.reshape(out.shape[0], -1), ref.reshape(ref.shape[0], -1)
    return np.abs(out - ref).max(axis=1) / np.abs(ref).max(axis=1)


def _rows_far_apart(shape, seed=0):
    """Normal values whose rows (axis 0) range over 2^-12 .. 2^12 (2^24 apart)."""
    rng = np.random.default_rng(seed)
    mag = np.exp2(np.linspace(-12, 12, shape[0])).reshape((-1,) + (1,) * (len(shape) - 1))
    return (rng.normal(size=shape) * mag).astype(np.float32)


# --- gather ---------------------------------------------------------------------------------

# table scale shape -> output scale shape of a (B, T) lookup along axis 0.
GATHER_LAYOUTS = {
    "row": ((V, 1), (2, 4, 1)),
    "column": ((1, D), (1, 1, D)),
    "tile": ((2, 2), (2, 4, 2)),
    "tensor": ((), ()),
}


def _take(t, ids):  # embedding lookup: mode="fill" (out-of-bounds rows are NaN)
    return jnp.take(t, ids, axis=0)


def _index(t, ids):  # NumPy indexing: promise_in_bounds
    return t[ids]


# take over every layout; NumPy indexing (promise_in_bounds) float16 jitted, in the
# default run with row and tile blocks (the slow step: the other layouts).
GATHER_PARAMS = dtype_jit_params(
    {f"{layout}-take": (_take, layout) for layout in GATHER_LAYOUTS}, eager=("tile-take",)
) + [
    pytest.param(
        _index,
        layout,
        np.float16,
        True,
        marks=() if layout in ("row", "tile") else pytest.mark.slow,
        id=f"{layout}-index-float16-jit",
    )
    for layout in GATHER_LAYOUTS
]


@pytest.mark.parametrize("fn, layout, dtype, jit", GATHER_PARAMS)
def test_gather_rows(fn, layout, dtype, jit):
    table_shape, out_shape = GATHER_LAYOUTS[layout]
    table = _scaled(far_apart((V, D), axis=0), table_shape, dtype)
    out = check(fn, (table, IDS), dtype, jit)
    assert scale_shape(out) == out_shape


@pytest.mark.parametrize(
    "fn, table_shape, out_shape",
    [
        # Columns gathered (axis 1 indexed) from a per-row table: rows pass through.
        (lambda t, i: t[:, i[0]], (V, 1), (V, 1)),
        # Column blocks, columns gathered: one scale per gathered column.
        (lambda t, i: t[:, i[0] % D], (1, 2), (1, 4)),
        # Points (both axes indexed) of a tiled table: one scale per point.
        (lambda t, i: t[i[0], i[1] % D], (2, 2), (4,)),
        # Clipped rows.
        (lambda t, i: jnp.take(t, i + 3, axis=0, mode="clip"), (V, 1), (2, 4, 1)),
        # Out-of-bounds rows filled with 3.0 (scale 1 there), and with 0.
        (lambda t, i: jnp.take(t, i + 3, axis=0, fill_value=3.0), (V, 1), (2, 4, 1)),
        (lambda t, i: jnp.take(t, i + 3, axis=0, fill_value=0.0), (2, 2), (2, 4, 2)),
        (lambda t, i: jnp.take(t, i - 2, axis=0, fill_value=-1.0), (1, D), (2, 4, D)),
        # Windows of 4 rows at traced starts (vmap of dynamic_slice): per element along rows;
        # the columns (indexed at 0, whole) keep their blocks.
        (
            lambda t, i: jax.vmap(lambda s: lax.dynamic_slice(t, (s, 0), (4, D)))(i[0]),
            (2, 2),
            (4, 4, 2),
        ),
        # One element per row (vmap over the table's rows: operand batching dims).
        (lambda t, i: jax.vmap(lambda r, j: r[j])(t, i.reshape(-1)[:V] % D), (V, 1), (V,)),
        (lambda t, i: jax.vmap(lambda r, j: r[j])(t, i.reshape(-1)[:V] % D), (1, D), (V,)),
    ],
    ids=[
        "columns",
        "column-blocks",
        "points",
        "clip",
        "fill",
        "fill-zero",
        "fill-column",
        "windows",
        "batched",
        "batched-columns",
    ],
)
def test_gather_dimension_numbers(fn, table_shape, out_shape):
    table = _scaled(far_apart((V, D), axis=0), table_shape, np.float32)
    out = check(fn, (table, IDS), np.float32, jit=True)
    assert scale_shape(out) == out_shape


def test_gather_rows_keep_small_rows_in_float16():
    """Table rows 2^24 apart in float16: per-row scales keep every looked-up row, one scale
    per tensor loses the small ones."""
    plain = _rows_far_apart((V, D))
    ids = np.arange(V, dtype=np.int32).reshape(2, 4)
    ref = _take(jnp.asarray(plain), ids).reshape(V, D)
    lookup = jax.jit(jsa.autoscale(_take))
    rows = lookup(as_scaled_array_jit(plain, scale_shape=(V, 1), dtype=np.float16), ids)
    tensor = lookup(per_tensor(plain, np.float16), ids)
    assert scale_shape(rows) == (2, 4, 1)
    assert _row_error(rows.to_array(jnp.float32).reshape(V, D), ref).max() < 1e-3
    assert _row_error(tensor.to_array(jnp.float32).reshape(V, D), ref)[0] > 0.1


# --- embedding: lookup, matmul, loss and its gradient ------------------------------------------

K = 3


def _embedding_loss(table, w, ids):
    return jnp.sum((jnp.take(table, ids, axis=0) @ w) ** 2)


@pytest.mark.slow
def test_embedding_model_with_per_row_float16_table():
    """A tiny model (embed, matmul, squared loss) with a per-row-scaled float16 table: the
    lookup is per token `(B, T, 1)`, and the table's gradient (a scatter-add of per-token
    cotangents) comes out per row and keeps the small rows (per tensor loses them)."""
    plain_table = _rows_far_apart((V, D))
    plain_w = np.random.default_rng(1).normal(size=(D, K)).astype(np.float32)
    ids = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [0, 0, 7, 7]], np.int32)
    grad = jax.grad(_embedding_loss, argnums=(0, 1))
    ref_table, ref_w = grad(jnp.asarray(plain_table), jnp.asarray(plain_w), ids)
    w = as_scaled_array_jit(plain_w, dtype=np.float16)
    table = as_scaled_array_jit(plain_table, scale_shape=(V, 1), dtype=np.float16)
    scaled_grad = jax.jit(jsa.autoscale(grad))

    embedded = jax.jit(jsa.autoscale(lambda t, i: jnp.take(t, i, axis=0)))(table, ids)
    assert scale_shape(embedded) == (3, 4, 1)
    g_table, g_w = scaled_grad(table, w, ids)
    assert scale_shape(g_table) == (V, 1)
    assert _row_error(g_table, ref_table).max() < 2e-3
    rel_w = np.abs(represented(g_w) - np.asarray(ref_w)).max() / np.abs(ref_w).max()
    assert rel_w < 4e-3
    g_tensor, _ = scaled_grad(per_tensor(plain_table, np.float16), w, ids)
    assert _row_error(g_tensor, ref_table)[0] > 0.1


@pytest.mark.parametrize(
    "layout, dtype, jit",
    dtype_jit_params(
        # Not eagerly: the eager gather rules with blocks run in test_gather_rows, the eager
        # dot_general ones in tests/core/test_block_scales.py (the slow step runs these).
        {layout: (layout,) for layout in ("row", "tile", "tensor")},
    ),
)
def test_embedding_model_layouts(layout, dtype, jit):
    table_shape, _ = GATHER_LAYOUTS[layout]
    table = _scaled(far_apart((V, D), axis=0), table_shape, dtype)
    w = as_scaled_array_jit(np.random.default_rng(2).normal(size=(D, K)), dtype=dtype)
    check(lambda t, u, i: jnp.take(t, i, axis=0) @ u, (table, w, IDS), dtype, jit, (0, 1))


# --- scatter ----------------------------------------------------------------------------------


def _scatter_add(t, u, i):
    return t.at[i[0]].add(u)


def _scatter_set(t, u, i):
    return t.at[i[0]].set(u)


def _scatter_add_drop(t, u, i):
    return t.at[i[0]].add(-u, mode="drop")


@pytest.mark.slow
@pytest.mark.parametrize(
    "fn, out_shape, dtype, jit",
    dtype_jit_params(
        {
            "add": (_scatter_add, (V, 1)),
            "set": (_scatter_set, (V, 1)),
            "add-drop": (_scatter_add_drop, (V, 1)),
        },
        eager=("add-drop",),
    ),
)
def test_scatter_per_row(fn, out_shape, dtype, jit):
    table = _scaled(far_apart((V, D), axis=0), (V, 1), dtype)
    updates = _scaled(far_apart((4, D), axis=0, seed=1), (4, 1), dtype)
    out = check(fn, (table, updates, IDS), dtype, jit, argnums=(0, 1))
    assert scale_shape(out) == out_shape


# --- dynamic_slice ------------------------------------------------------------------------------

T_, H = 8, 4  # sequence length, features

# x scale shape -> scale shape of a (3, H) dynamic slice at a traced start.
DYNAMIC_SLICE_LAYOUTS = {
    "row": ((T_, 1), (3, 1)),
    "column": ((1, H), (1, H)),
    "tile": ((4, 2), (3, 2)),  # rows go to one scale per element
    "tensor": ((), ()),
}


def _dynamic_slice(x, start):
    return lax.dynamic_slice(x, (start, 0), (3, H))


@pytest.mark.parametrize(
    "layout, dtype, jit",
    dtype_jit_params({layout: (layout,) for layout in DYNAMIC_SLICE_LAYOUTS}, eager=("tile",)),
)
def test_dynamic_slice_layouts(layout, dtype, jit):
    x_shape, out_shape = DYNAMIC_SLICE_LAYOUTS[layout]
    x = _scaled(far_apart((T_, H), axis=0), x_shape, dtype)
    outs = check(_dynamic_slice, (x,), dtype, jit, extra=(np.int32(2), np.int32(7)))
    assert all(scale_shape(out) == out_shape for out in outs)  # start 7 is clamped to 5


# --- dynamic_update_slice -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "x_shape, u_shape, out_shape, dtype, jit",
    dtype_jit_params(
        {
            "row-tensor": ((T_, 1), (), (T_, 1)),  # a per-row cache, a per-tensor row written
            "row-row": ((T_, 1), (2, 1), (T_, 1)),
            # partial along rows: one scale per element of them
            "column-tensor": ((1, H), (), (T_, H)),
            "tile-tensor": ((4, 2), (1, 1), (T_, 2)),
            "tensor-row": ((), (2, 1), (T_, 1)),
            "column-cols": ((1, H), (1, 2), (T_, H)),
        },
        eager=("tile-tensor",),
    ),
)
def test_dynamic_update_slice_layouts(x_shape, u_shape, out_shape, dtype, jit):
    x = _scaled(far_apart((T_, H), axis=0), x_shape, dtype)
    update = _scaled(far_apart((2, H), axis=0, seed=1) * 64, u_shape, dtype)

    def write(a, u, start):
        return lax.dynamic_update_slice(a, u, (start, 0))

    outs = check(write, (x, update), dtype, jit, argnums=(0, 1), extra=(np.int32(3), np.int32(9)))
    assert all(scale_shape(out) == out_shape for out in outs)


def test_kv_cache_per_token_float16():
    """A per-token KV cache `(B, T, 1, 1)` in float16 with tokens 2^24 apart: writing a new
    token (per tensor) and reading a window back keep one scale per token and every token's
    precision; a per-tensor cache loses the small tokens."""
    b, t, h, d = 2, 8, 2, 4
    plain = np.moveaxis(_rows_far_apart((t, b, h, d)), 0, 1)
    new = np.random.default_rng(3).normal(size=(b, 1, h, d)).astype(np.float32)

    def step(cache, token, pos):
        cache = lax.dynamic_update_slice(cache, token, (0, pos, 0, 0))
        return lax.dynamic_slice(cache, (0, pos - 5, 0, 0), (b, 6, h, d))

    ref = step(jnp.asarray(plain), jnp.asarray(new), 5)
    scaled_step = jax.jit(jsa.autoscale(step))
    token = as_scaled_array_jit(new, dtype=np.float16)
    cache = as_scaled_array_jit(plain, scale_shape=(b, t, 1, 1), dtype=np.float16)
    out = scaled_step(cache, token, np.int32(5))
    assert scale_shape(out) == (b, 6, 1, 1)
    errors = _row_error(jnp.moveaxis(out.to_array(jnp.float32), 1, 0), np.moveaxis(ref, 1, 0))
    assert errors.max() < 1e-3
    tensor = scaled_step(per_tensor(plain, np.float16), token, np.int32(5))
    errors = _row_error(jnp.moveaxis(tensor.to_array(jnp.float32), 1, 0), np.moveaxis(ref, 1, 0))
    assert errors[0] > 0.1  # token 0 (2^-24 below the largest cached)


# --- pad ------------------------------------------------------------------------------------------

PAD_CONFIGS = {
    "rows-whole-blocks": ((4, -4, 0), (0, 0, 0)),
    "rows-inside-blocks": ((1, 2, 0), (0, 0, 0)),
    "interior-and-crop": ((1, -1, 1), (0, 0, 0)),
    "columns": ((0, 0, 0), (2, -1, 0)),
}

# (x scale shape, padding config, padding value) -> output scale shape.
PAD_CASES = [
    ((T_, 1), "rows-inside-blocks", 0.0, (T_ + 3, 1)),
    ((T_, 1), "columns", 0.0, (T_, 1)),  # zeros at any scale: the rows' blocks kept
    ((T_, 1), "columns", 2.5, (T_, H + 1)),
    ((1, H), "interior-and-crop", 0.0, (1, H)),
    ((1, H), "columns", -1.5, (1, H + 1)),
    ((4, 2), "rows-whole-blocks", 1.0, (4, 2)),
    ((4, 2), "rows-inside-blocks", 0.0, (T_ + 3, 2)),
    ((4, 2), "interior-and-crop", 0.0, (2 * T_ - 1, 2)),
    ((), "rows-inside-blocks", 0.0, ()),
]


# Zero padding values over every dtype, other values in float32 (keeps the file fast). The
# default run: each case jitted once (the zero-padded ones in the dtypes in turn), eagerly
# the tiles cropped and interior-padded; the slow step runs the others.
PAD_DEFAULT = {
    (0, "float32-jit"),
    (1, "float16-jit"),
    (2, "float32-jit"),
    (3, "bfloat16-jit"),
    (4, "float32-jit"),
    (5, "float32-jit"),
    (6, "float16-jit"),
    (7, "bfloat16-jit"),
    (7, "float32-eager"),
    (8, "float32-jit"),
}
PAD_PARAMS = [
    pytest.param(
        *case,
        *p.values,
        marks=() if (i, p.id) in PAD_DEFAULT else pytest.mark.slow,
        id=f"{case[0]}-{case[1]}-{case[2]}-{p.id}",
    )
    for i, case in enumerate(PAD_CASES)
    for p in DTYPE_JIT
    if case[2] == 0.0 or p.values[0] == np.float32
]


@pytest.mark.parametrize("x_shape, config, value, out_shape, dtype, jit", PAD_PARAMS)
def test_pad_layouts(x_shape, config, value, out_shape, dtype, jit):
    x = _scaled(far_apart((T_, H), axis=0), x_shape, dtype)

    def pad(a):
        return lax.pad(a, np.array(value, a.dtype), PAD_CONFIGS[config])

    out = check(pad, (x,), dtype, jit)
    assert scale_shape(out) == out_shape


def test_jnp_pad_per_row_keeps_small_rows_in_float16():
    """jnp.pad of a per-row float16 array with rows 2^24 apart: every row keeps its
    precision (per tensor loses the small ones)."""
    plain = _rows_far_apart((T_, H))

    def pad(a):
        return jnp.pad(a, ((1, 1), (2, 0)))

    ref = pad(jnp.asarray(plain))[1:-1]
    scaled_pad = jax.jit(jsa.autoscale(pad))
    rows = scaled_pad(as_scaled_array_jit(plain, scale_shape=(T_, 1), dtype=np.float16))
    assert scale_shape(rows) == (T_ + 2, 1)
    assert _row_error(rows.to_array(jnp.float32)[1:-1], ref).max() < 1e-3
    tensor = scaled_pad(per_tensor(plain, np.float16))
    assert _row_error(tensor.to_array(jnp.float32)[1:-1], ref)[0] > 0.1
