"""Block scales through conv_general_dilated, concatenate, rev, cond, while and scan
carries (lax/block_rules/, lax/control_flow.py).

Each case compares the autoscaled function on block-scaled inputs with the plain function
on the represented values, over layouts, data dtypes and jit on/off (with gradients), and
checks the output's scale shape: the blocks are kept.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jax_scaled_arithmetics as jsa
from tests import helpers
from tests.helpers import as_scaled_array_jit, represented

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
# Relative to the reference's largest magnitude.
TOL = {np.float32: 1e-5, np.float16: 4e-3, ml_dtypes.bfloat16: 3e-2}


# (data dtype, jit): every dtype jitted, and float32 eagerly too.
DTYPE_JIT = [
    pytest.param(np.float32, False, id="float32-eager"),
    pytest.param(np.float32, True, id="float32-jit"),
    pytest.param(np.float16, True, id="float16-jit"),
    pytest.param(ml_dtypes.bfloat16, True, id="bfloat16-jit"),
]


def dtype_jit_params(cases, eager=()):
    """pytest params `(*values, dtype, jit)` for each case (id -> values) with each DTYPE_JIT
    variant. The default run: each case jitted once, the dtypes in turn over the cases, and
    eagerly (float32) the cases of `eager`; the slow step runs the rest (the same rules in
    the other dtypes; eagerly, each operation is a compile of its own)."""
    jitted = [p.id for p in DTYPE_JIT if p.values[1]]
    params = []
    for i, (name, values) in enumerate(cases.items()):
        default = {jitted[i % len(jitted)]} | ({"float32-eager"} if name in eager else set())
        params += [
            pytest.param(
                *values,
                *p.values,
                marks=() if p.id in default else pytest.mark.slow,
                id=f"{name}-{p.id}",
            )
            for p in DTYPE_JIT
        ]
    return params


# The eager variants in the default run (the others are marked slow: the same rules, each
# operation compiled on its own).
EAGER_CONV = ("spatial_blocks",)
EAGER_CONCAT = ("tiles_and_rows",)


def far_apart(shape, axis, seed=0, binades=6):
    """Normal values whose slices along `axis` differ by up to 2^(2 * binades)."""
    rng = np.random.default_rng(seed)
    size = [1] * len(shape)
    size[axis] = shape[axis]
    mag = np.exp2(rng.integers(-binades, binades + 1, size=size))
    return (rng.normal(size=shape) * mag).astype(np.float32)


def assert_close(out, ref, dtype):
    """`out` within TOL[dtype] of `ref`, relative to the largest |ref|."""
    helpers.assert_close(out, ref, rtol=0.0, atol_rel=TOL[dtype])


def scale_shape(x):
    return tuple(np.shape(x.scale))


def is_float(x):
    return isinstance(x, jsa.ScaledArray) or jnp.issubdtype(jnp.result_type(x), jnp.floating)


def per_tensor(x, dtype):
    """One power-of-two scale for the whole tensor (its largest magnitude), a scalar."""
    y = as_scaled_array_jit(x, scale_shape=(1,) * np.ndim(x), dtype=dtype)
    return jsa.ScaledArray(y.data, y.scale.reshape(()))


@functools.cache
def _programs(fn, argnums):
    """Built once per function: autoscale(fn) eagerly, grad(sum(fn^2)) and its jitted
    autoscale, and one jitted autoscale of both (the value and its gradient: one compile,
    which shares the forward pass). The cases of a function with the same layouts and dtype
    share their compiled programs."""
    grad = jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=argnums)
    both = jax.jit(jsa.autoscale(lambda *a: (fn(*a), grad(*a))))
    return jsa.autoscale(fn), grad, jax.jit(jsa.autoscale(grad)), both


def check(fn, args, dtype, jit, argnums=(0,), extra=()):
    """autoscale(fn) and autoscale(grad(sum(fn^2))) against the plain ones on the values;
    `extra`: more trailing arguments to call them with (one compilation for all). The
    gradient is always jitted (eagerly, only the function itself: keeps the tests fast)."""
    eager, grad, scaled_grad, both = _programs(fn, argnums)
    outs = []
    for tail in [()] if not extra else [(e,) for e in extra]:
        call = (*args, *tail)
        values = [jnp.asarray(represented(a), jnp.float32) if is_float(a) else a for a in call]
        out, grads = both(*call) if jit else (eager(*call), scaled_grad(*call))
        assert_close(out, fn(*values), dtype)
        for g, r in zip(grads, grad(*values), strict=True):
            assert_close(g, r, dtype)
        outs.append(out)
    return outs[0] if not extra else outs


# --- conv_general_dilated -----------------------------------------------------------------

B, HW, C, CO = 4, 6, 3, 8


def _conv_nhwc(x, w):
    return lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _conv_inputs(seed=0):
    x = far_apart((B, HW, HW, C), axis=0, seed=seed)
    w = far_apart((3, 3, C, CO), axis=3, seed=seed + 1) / 4
    return x, w


# (x scale shape, w scale shape, output scale shape): per example and per output channel
# are kept; input channels and spatial blocks (contracted) are applied to the data.
CONV_LAYOUTS = {
    "tensor": ((), (), ()),
    "out_channel": ((), (1, 1, 1, CO), (1, 1, 1, CO)),
    "example_x_out_channel": ((B, 1, 1, 1), (1, 1, 1, CO), (B, 1, 1, CO)),
    "in_channel_blocks": ((1, 1, 1, C), (1, 1, C, CO), (1, 1, 1, CO)),
    "spatial_blocks": ((B, 2, 1, 1), (3, 1, 1, 2), (B, 1, 1, 2)),
}


def _scaled(x, shape, dtype):
    if shape == ():
        return per_tensor(x, dtype)
    return as_scaled_array_jit(x, scale_shape=shape, dtype=dtype)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, dtype, jit",
    dtype_jit_params({layout: (layout,) for layout in CONV_LAYOUTS}, eager=EAGER_CONV),
)
def test_conv_block_layouts(layout, dtype, jit):
    x_shape, w_shape, out_shape = CONV_LAYOUTS[layout]
    x_plain, w_plain = _conv_inputs()
    x, w = _scaled(x_plain, x_shape, dtype), _scaled(w_plain, w_shape, dtype)
    out = check(_conv_nhwc, (x, w), dtype, jit, argnums=(0, 1))
    assert scale_shape(out) == out_shape


@pytest.mark.parametrize(
    "groups, dimension_numbers, x_shape, w_shape, out_shape",
    [
        # Depthwise-style groups (NCHW / OIHW): per example x per output channel kept.
        (
            {"feature_group_count": 2},
            ("NCHW", "OIHW", "NCHW"),
            (B, 2, 1, 1),
            (CO, 1, 1, 1),
            (B, CO, 1, 1),
        ),
        # Batch groups: the lhs batch is contracted (applied to the data).
        (
            {"batch_group_count": 2},
            ("NHWC", "HWIO", "NHWC"),
            (B, 1, 1, 1),
            (1, 1, 1, CO),
            (1, 1, 1, CO),
        ),
    ],
)
@pytest.mark.slow
def test_conv_groups_and_dimension_numbers(groups, dimension_numbers, x_shape, w_shape, out_shape):
    lhs_spec, rhs_spec, _ = dimension_numbers
    rng = np.random.default_rng(3)
    feature = 4
    x_dims = {"N": B, "C": feature, "H": 7, "W": 7}
    in_features = feature // groups.get("feature_group_count", 1)
    w_dims = {"O": CO, "I": in_features, "H": 3, "W": 2}
    x_plain = rng.normal(size=[x_dims[c] for c in lhs_spec]).astype(np.float32)
    x_plain *= np.exp2(np.arange(B) * 4.0 - 6).reshape([-1 if c == "N" else 1 for c in lhs_spec])
    w_plain = rng.normal(size=[w_dims[c] for c in rhs_spec]).astype(np.float32)
    w_plain *= np.exp2(np.arange(CO) * 2.0 - 8).reshape([-1 if c == "O" else 1 for c in rhs_spec])

    def conv(a, b):
        return lax.conv_general_dilated(
            a,
            b,
            (2, 1),
            ((1, 0), (1, 1)),
            rhs_dilation=(1, 2),
            dimension_numbers=dimension_numbers,
            **groups,
        )

    x = as_scaled_array_jit(x_plain, scale_shape=x_shape)
    w = as_scaled_array_jit(w_plain, scale_shape=w_shape)
    out = check(conv, (x, w), np.float32, jit=True, argnums=(0, 1))
    assert scale_shape(out) == out_shape


def _per_channel_error(out, ref):
    """Largest error of each output channel (last axis), relative to its largest value."""
    out, ref = np.asarray(represented(out), np.float64), np.asarray(ref, np.float64)
    axes = tuple(range(ref.ndim - 1))
    return np.abs(out - ref).max(axis=axes) / np.abs(ref).max(axis=axes)


def test_conv_per_channel_keeps_small_channels_in_float16():
    """Output channels 2^24 apart (2^-12 .. 2^12): float16 data with one scale per output
    channel keeps every channel; one scale per tensor loses the small ones."""
    x_plain, w_plain = _conv_inputs()
    x_plain = np.abs(x_plain[:1]) + 0.5  # one example of moderate values
    w_plain = w_plain * np.exp2(np.linspace(-12, 12, CO) - np.log2(np.abs(w_plain).max((0, 1, 2))))
    ref = _conv_nhwc(jnp.asarray(x_plain), jnp.asarray(w_plain))
    x = per_tensor(x_plain, np.float16)
    conv = jax.jit(jsa.autoscale(_conv_nhwc))
    channel = conv(x, as_scaled_array_jit(w_plain, scale_shape=(1, 1, 1, CO), dtype=np.float16))
    tensor = conv(x, per_tensor(w_plain, np.float16))
    assert scale_shape(channel) == (1, 1, 1, CO)
    assert _per_channel_error(channel, ref).max() < TOL[np.float16]
    assert _per_channel_error(tensor, ref).max() > 0.1


def test_rev_moves_blocks_with_the_data():
    x_plain = far_apart((8, 16), axis=0)
    x = as_scaled_array_jit(x_plain, scale_shape=(4, 2))
    out = jsa.autoscale(lambda a: lax.rev(a, (0, 1)))(x)
    assert scale_shape(out) == (4, 2)
    np.testing.assert_array_equal(represented(out), represented(x)[::-1, ::-1])


# --- concatenate ----------------------------------------------------------------------

M, K = 8, 64

# (a's shape, a's scale shape, b's shape, b's scale shape, axis, output scale shape)
CONCAT_CASES = {
    # Equal block sizes along the axis: the blocks are concatenated.
    "rows": ((M, K), (M, 1), (4, K), (4, 1), 0, (12, 1)),
    "rows_and_tensor": ((M, K), (M, 1), (4, K), (), 0, (12, 1)),
    # One block each, sizes 8 and 4: blocks of 4 (the gcd, the smaller block).
    "columns_one_block_each": ((M, K), (1, K), (4, K), (1, K), 0, (3, K)),
    "mx_and_tensor_along_blocks": ((M, K), (M, 2), (M, 32), (), 1, (M, 3)),
    "tiles_and_rows": ((M, K), (4, 2), (6, K), (3, 1), 0, (7, 2)),
    # Block sizes 4 and 6 (gcd 2 finer than both): one block along the axis, the other
    # axes' blocks kept.
    "uneven_blocks": ((M, K), (2, 2), (6, K), (), 0, (1, 2)),
    # No operand with several blocks: the ordinary rule, one scale.
    "one_block_each": ((M, K), (1, 1), (4, K), (), 0, ()),
}


@pytest.mark.parametrize(
    "case, dtype, jit",
    [  # float32 eager and float16 jitted: the data is only moved
        pytest.param(
            case,
            *p.values,
            marks=pytest.mark.slow if not p.values[1] and case not in EAGER_CONCAT else (),
            id=f"{case}-{p.id}",
        )
        for case in CONCAT_CASES
        for p in DTYPE_JIT[::2]
    ],
)
def test_concatenate_block_layouts(case, dtype, jit):
    a_shape, a_scale, b_shape, b_scale, axis, out_shape = CONCAT_CASES[case]
    a = _scaled(far_apart(a_shape, axis=0, seed=1), a_scale, dtype)
    b = _scaled(far_apart(b_shape, axis=0, seed=2), b_scale, dtype)

    def fn(x, y):
        return jnp.concatenate([x, y], axis=axis)

    out = check(fn, (a, b), dtype, jit, argnums=(0, 1))
    assert scale_shape(out) == out_shape
    exact = np.concatenate([represented(a), represented(b)], axis=axis)
    if out_shape and case != "uneven_blocks":  # blocks kept: the data is only moved
        np.testing.assert_array_equal(represented(out), exact)


def test_concatenate_keeps_small_rows_in_float16():
    """Rows at 2^-12 beside rows at 2^12 in float16: per-row blocks keep both; one scale
    per tensor flushes the small rows."""
    small = far_apart((4, K), axis=0, binades=0) * 2.0**-12
    large = far_apart((4, K), axis=0, binades=0, seed=1) * 2.0**12
    ref = np.concatenate([small, large])
    cat = jsa.autoscale(lambda a, b: jnp.concatenate([a, b]))
    rows = cat(
        as_scaled_array_jit(small, scale_shape=(4, 1), dtype=np.float16),
        as_scaled_array_jit(large, scale_shape=(4, 1), dtype=np.float16),
    )
    tensor = cat(per_tensor(small, np.float16), per_tensor(large, np.float16))
    row_err = np.abs(represented(rows) - ref).max(1) / np.abs(ref).max(1)
    tensor_err = np.abs(represented(tensor) - ref).max(1) / np.abs(ref).max(1)
    assert scale_shape(rows) == (8, 1) and row_err.max() < TOL[np.float16]
    assert tensor_err[:4].max() > 0.1


# --- cond -----------------------------------------------------------------------------

LAYOUTS = {"tensor": (), "row": (M, 1), "column": (1, K), "mx32": (M, K // 32)}
CONTROL_LAYOUTS = ["tensor", "row", "mx32"]
# Cond and while over layout x (dtype, jit): eagerly with MX blocks in the default run.
CONTROL_PARAMS = dtype_jit_params({layout: (layout,) for layout in CONTROL_LAYOUTS}, ("mx32",))


def _cond_fn(x, b, index):
    return lax.switch(index, [lambda a, c: a * 2.0 + c, lambda a, c: jnp.tanh(a) * c], x, b)


@pytest.mark.parametrize("layout, dtype, jit", CONTROL_PARAMS)
def test_cond_keeps_block_layouts(layout, dtype, jit):
    x = _scaled(far_apart((M, K), axis=0), LAYOUTS[layout], dtype)
    b = as_scaled_array_jit(np.full((M, K), 0.75, np.float32), dtype=dtype)
    for out in check(_cond_fn, (x, b), dtype, jit, argnums=(0, 1), extra=range(2)):
        assert scale_shape(out) == LAYOUTS[layout]


@pytest.mark.parametrize(
    "x_layout, y_layout, out_shape",
    [
        ("row", "tensor", (M, 1)),  # nested: the finer layout, exact
        ("mx32", "row", (M, K // 32)),
        ("row", "column", ()),  # not nested: the finest layout coarser than both
    ],
)
def test_cond_branches_meet_at_one_layout(x_layout, y_layout, out_shape):
    x = _scaled(far_apart((M, K), axis=0), LAYOUTS[x_layout], np.float32)
    y = _scaled(far_apart((M, K), axis=1, seed=4), LAYOUTS[y_layout], np.float32)

    def fn(a, c, p):
        return lax.cond(p, lambda u, v: u, lambda u, v: v * 3.0, a, c)

    scaled = jax.jit(jsa.autoscale(fn))
    for p, ref in ((True, represented(x)), (False, 3.0 * represented(y))):
        out = scaled(x, y, p)
        assert scale_shape(out) == out_shape
        assert_close(out, ref, np.float32)


def test_cond_keeps_small_rows_in_float16():
    """Rows 2^-12 .. 2^12 through a cond in float16: per-row scales keep every row."""
    x_plain = far_apart((M, K), axis=0, binades=0) * np.exp2(np.linspace(-12, 12, M))[:, None]

    def fn(a, p):
        return lax.cond(p, lambda u: u * 3.0, jnp.tanh, a)

    ref = fn(jnp.asarray(x_plain), True)
    scaled = jax.jit(jsa.autoscale(fn))
    rows = scaled(as_scaled_array_jit(x_plain, scale_shape=(M, 1), dtype=np.float16), True)
    tensor = scaled(per_tensor(x_plain, np.float16), True)
    err = lambda out: np.abs(represented(out) - ref).max(1) / np.abs(ref).max(1)  # noqa: E731
    assert scale_shape(rows) == (M, 1) and err(rows).max() < TOL[np.float16]
    assert err(tensor).max() > 0.1


# --- while and scan carries -------------------------------------------------------------


def _while_fn(x, w):
    def body(carry):
        i, a = carry
        return i + 1, jnp.tanh(a) * 0.5 + a * w

    return lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]


def _while_value_and_tangent(x, w):
    """The loop's value and its tangent along x (one program jitted). Forward mode:
    reverse-mode differentiation of while_loop is not defined."""
    return _while_fn(x, w), jax.jvp(lambda u: _while_fn(u, w), (x,), (x,))[1]


_while_value_and_tangent_jit = jax.jit(_while_value_and_tangent)  # the reference


@pytest.mark.parametrize("layout, dtype, jit", CONTROL_PARAMS)
def test_while_keeps_carry_layouts(layout, dtype, jit):
    """The carry keeps its initial layout, also where the body gives it another (a
    per-column constant): the body's output is brought back to it."""
    x = _scaled(far_apart((M, K), axis=0), LAYOUTS[layout], dtype)
    w = _scaled(np.abs(far_apart((M, K), axis=1, seed=5, binades=3)) / 8, LAYOUTS["column"], dtype)
    values = [jnp.asarray(represented(v)) for v in (x, w)]
    scaled = jsa.autoscale(_while_value_and_tangent)
    out, tangent = (jax.jit(scaled) if jit else scaled)(x, w)
    ref, ref_tangent = _while_value_and_tangent_jit(*values)
    assert scale_shape(out) == LAYOUTS[layout]
    assert_close(out, ref, dtype)
    assert scale_shape(tangent) == LAYOUTS[layout]
    assert_close(tangent, ref_tangent, dtype)


def test_while_keeps_small_rows_in_float16():
    """Rows 2^-12 .. 2^12 carried through a loop in float16 data with per-row scales."""
    x_plain = far_apart((M, K), axis=0, binades=0) * np.exp2(np.linspace(-12, 12, M))[:, None]
    w = as_scaled_array_jit(np.full((M, K), 0.75, np.float32), dtype=np.float16)
    ref = _while_fn(jnp.asarray(x_plain), jnp.asarray(represented(w)))
    scaled = jax.jit(jsa.autoscale(_while_fn))
    rows = scaled(as_scaled_array_jit(x_plain, scale_shape=(M, 1), dtype=np.float16), w)
    tensor = scaled(per_tensor(x_plain, np.float16), w)
    err = lambda out: np.abs(represented(out) - ref).max(1) / np.abs(ref).max(1)  # noqa: E731
    assert scale_shape(rows) == (M, 1) and err(rows).max() < TOL[np.float16]
    assert err(tensor).max() > 0.1


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, dtype", [("row", np.float16), ("mx32", np.float32)], ids=["row-f16", "mx32-f32"]
)
def test_scan_carry_keeps_block_layout(layout, dtype):
    x = _scaled(far_apart((M, K), axis=0), LAYOUTS[layout], dtype)
    ws = as_scaled_array_jit(
        np.abs(far_apart((3, M, K), axis=0, seed=6)) / 8, scale_shape=(3, 1, 1), dtype=dtype
    )

    def fn(a, stacked):
        def body(c, w):
            c = jnp.tanh(c) + c * w
            return c, jnp.sum(c)

        return lax.scan(body, a, stacked)

    def value_and_grads(a, stacked):  # one program for both
        grads = jax.grad(lambda a, s: jnp.sum(fn(a, s)[0] ** 2), (0, 1))(a, stacked)
        return fn(a, stacked), grads

    (carry, ys), grads = jax.jit(jsa.autoscale(value_and_grads))(x, ws)
    assert scale_shape(carry) == LAYOUTS[layout]
    (ref_carry, ref_ys), refs = jax.jit(value_and_grads)(
        jnp.asarray(represented(x)), jnp.asarray(represented(ws))
    )
    assert_close(carry, ref_carry, dtype)
    assert_close(ys, ref_ys, dtype)
    for g, r in zip(grads, refs, strict=True):
        assert_close(g, r, dtype)
