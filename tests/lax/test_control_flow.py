"""Higher-order primitives under autoscale (lax/control_flow.py): jit and calls, loops and
conditionals, nesting and batching; their gradients, also with respect to the scales."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import jax_scaled_arithmetics as jsa
from tests.helpers import (
    FLOAT_DTYPES,
    RTOL,
    WIDE_SCALES,
    as_scaled_array_jit,
    assert_close,
    check_autoscale_matches,
    make_scaled,
    represented,
)
from tests.lax.test_elementwise import primitives_of

SCALES = (2.0**-40, 1.0, 2.0**40)

RNG = np.random.default_rng(42)
X = RNG.uniform(0.5, 1.5, (5, 3)).astype(np.float32)
V = RNG.uniform(-1.0, 1.0, (3,)).astype(np.float32)


def _ids(value: object) -> str:
    if isinstance(value, np.dtype):
        return value.name
    if isinstance(value, float):
        return f"2^{int(np.log2(value))}"
    return str(value)


def _scaled_inputs(inputs, dtype, scale, scaled_mask=None):
    mask = [True] * len(inputs) if scaled_mask is None else scaled_mask
    args = [make_scaled(x, dtype, scale) if m else x for x, m in zip(inputs, mask, strict=True)]
    refs = [
        jnp.asarray(represented(a), jnp.float32) if m else a
        for a, m in zip(args, mask, strict=True)
    ]
    return args, refs


def check_matches_over_scales(fn, inputs, dtype, scales, use_jit=True, rtol=None, **kwargs):
    """`autoscale(fn)` on scaled inputs matches `fn` on their values, for every scale.

    Jitted, the program is compiled once: the scales are runtime values.
    """
    dtype = np.dtype(dtype)
    scaled_fn = jax.jit(jsa.autoscale(fn)) if use_jit else jsa.autoscale(fn)
    ref_fn = jax.jit(fn)
    rtol = RTOL[dtype] if rtol is None else rtol
    for scale in scales:
        args, refs = _scaled_inputs(inputs, dtype, scale, kwargs.get("scaled_mask"))
        out = scaled_fn(*args)
        expected = ref_fn(*refs)
        outs = jax.tree_util.tree_leaves(out, is_leaf=jsa.is_scaled_leaf)
        for o, e in zip(outs, jax.tree_util.tree_leaves(expected), strict=True):
            if jnp.issubdtype(e.dtype, jnp.floating):
                assert isinstance(o, jsa.ScaledArray), f"expected a ScaledArray, got {type(o)}"
                assert o.dtype == dtype
                assert_close(o, e, rtol)
            else:
                np.testing.assert_array_equal(o, e)


def check_grad_over_scales(fn, inputs, dtype, scales, rtol):
    """`grad(autoscale(f))` w.r.t. the data is the float32 gradient times the scale."""
    dtype = np.dtype(dtype)
    weights = RNG.uniform(0.5, 1.5, jax.eval_shape(fn, *inputs).shape).astype(np.float32)

    @jax.jit
    def scaled_grad(datas, scale):
        def loss(*ds):
            xs = [jsa.ScaledArray(d, scale) for d in ds]
            out = jsa.autoscale(lambda *v: jnp.sum(fn(*v) * weights.astype(dtype)))(*xs)
            return out.to_array(jnp.float32)

        return jax.grad(loss, argnums=tuple(range(len(datas))))(*datas)

    ref_grad = jax.jit(jax.grad(lambda *v: jnp.sum(fn(*v) * weights), argnums=(0,)))
    for scale in scales:
        args, refs = _scaled_inputs(inputs, dtype, scale)
        grads = scaled_grad([a.data for a in args], np.float32(scale))
        for g, e in zip(grads, ref_grad(*refs), strict=True):
            assert_close(np.asarray(g, np.float64), np.asarray(e, np.float64) * scale, rtol)


def _scan_fn(xs, v):
    def body(c, x):
        c = c * 0.5 + x * v
        return c, c * x

    c, ys = jax.lax.scan(body, jnp.zeros_like(v), xs)
    _, rev = jax.lax.scan(lambda c, x: (c + x, c - x), xs[0], xs, reverse=True, unroll=2)
    return c, ys, rev


def _fori_fn(xs, v):
    static = jax.lax.fori_loop(0, 3, lambda i, c: c * 0.75 + v, xs[0])  # lowered to a scan
    n = jnp.asarray(xs.shape[0] - 2)
    dynamic = jax.lax.fori_loop(0, n, lambda i, c: c + xs[i] * v, v)  # a while loop
    return static, dynamic


def _while_fn(xs, v):
    # The condition reads scaled values: it is computed on the represented values.
    def cond(state):
        i, c = state
        return (i < 10) & (jnp.max(jnp.abs(c)) < 4 * jnp.max(jnp.abs(xs)))

    return jax.lax.while_loop(cond, lambda s: (s[0] + 1, s[1] * 2 + xs[s[0] % 5]), (0, v))


def _cond_fn(xs, v):
    a = jax.lax.cond(jnp.sum(v) > 0, lambda a, b: a * b, lambda a, b: a - b, xs[0], v)
    b = jax.lax.cond(jnp.sum(v) <= 0, lambda a, b: a * b, lambda a, b: a - b, xs[0], v)
    index = jnp.argmax(xs[:, 0])
    c = jax.lax.switch(index % 3, [lambda a: a * 2, lambda a: -a, lambda a: a * a], v)
    return a, b, c


def _barrier_fn(xs, v):
    a, b = jax.lax.optimization_barrier((xs * 2, v))
    return a + b[None], jax.checkpoint(lambda x, y: x * y[None] - x)(xs, v)


def _invariant_scan(w, xs):
    body = lambda c, x: (c * jnp.sin(w) + x, x * c * jnp.cos(w))  # noqa: E731
    return jnp.sum(jax.lax.scan(body, jnp.zeros_like(w), xs)[1])


def _sin_axpy(a, b, /, *, k):
    return jnp.sin(a) * k + b[None]


_sin_axpy_composite = jax.lax.composite(_sin_axpy, name="jsa_test.sin_axpy")


def _calls_fn(xs, v):
    """A jit, a closed_call, a composite, custom derivatives, a linear solve, a name, a
    placement, a sink."""
    kept = jax.jit(lambda a, b: a * b[None] + jnp.sin(a), inline=False)(xs, v)
    composed = _sin_axpy_composite(xs, v, k=2.0)
    # The gradient of a rematerialised scan hoists its loop-invariant part into a closed_call.
    called = jax.grad(jax.checkpoint(_invariant_scan))(v, xs)
    custom = _sin_fake_jvp(v) + _square_fake_vjp(v, xs[1])
    solved = _diag_solve(jnp.abs(xs[0]) + 1, v)
    placed = jax.device_put(checkpoint_name(v * 3, "placed"))
    jax.lax.dce_sink(xs * 5)  # kept although unused: data and scale
    return kept, composed, called, custom, solved, placed


FUNCTIONS = {
    "calls": _calls_fn,
    "scan": _scan_fn,
    "fori": _fori_fn,
    "while": _while_fn,
    "cond": _cond_fn,
    "barrier_checkpoint": _barrier_fn,
}


# The default run: each function with one dtype, the dtypes in turn, and scan with a
# second one (every function eagerly in float16: test_control_flow_without_jit); the slow
# step runs the other pairs.
MATCHES_DEFAULT = {
    ("barrier_checkpoint", FLOAT_DTYPES[0]),
    ("calls", FLOAT_DTYPES[1]),
    ("cond", FLOAT_DTYPES[2]),
    ("fori", FLOAT_DTYPES[0]),
    ("scan", FLOAT_DTYPES[1]),
    ("scan", FLOAT_DTYPES[2]),
    ("while", FLOAT_DTYPES[2]),
}


@pytest.mark.parametrize(
    "name, dtype",
    [
        pytest.param(
            name,
            dtype,
            marks=() if (name, dtype) in MATCHES_DEFAULT else pytest.mark.slow,
            id=f"{name}-{dtype.name}",
        )
        for name in sorted(FUNCTIONS)
        for dtype in FLOAT_DTYPES
    ],
)
def test_control_flow_matches_plain(name, dtype):
    fn = FUNCTIONS[name]
    # Jitted once: every scale from 2^-60 to 2^60 runs the same compiled program.
    check_matches_over_scales(fn, [X, V], dtype, WIDE_SCALES, rtol=2 * RTOL[np.dtype(dtype)])


def test_table_covers_every_higher_order_rule():
    registered = {name for name, info in jsa.coverage().items() if info.family == "higher-order"}
    covered: set[str] = set()
    for fn in FUNCTIONS.values():
        covered |= primitives_of(fn, [X, V])
    for fn in GRAD_FUNCTIONS.values():
        covered |= primitives_of(jax.grad(lambda x, f=fn: jnp.sum(f(x))), [X[:3]])
    # shard_map: tests/lax/test_collectives.py; custom_lin only exists inside the linear
    # function of jax.linearize, which autoscale rejects with a clear error (tested below).
    assert registered - covered == {"shard_map", "custom_lin"}


@pytest.mark.slow
def test_control_flow_without_jit():
    """Eagerly (rule by rule), every function at once: one run, many primitives."""

    def fn(xs, v):
        return {name: f(xs, v) for name, f in FUNCTIONS.items()}

    check_autoscale_matches(fn, [X, V], np.float16, 2.0**-40, use_jit=False, rtol=8e-3)


def test_scan_inner_scan_and_plain_operands():
    def fn(xs, w):
        def outer(c, x):
            inner, _ = jax.lax.scan(lambda d, y: (d + y * w, None), c, x[None])
            return inner, inner * 2

        return jax.lax.scan(outer, jnp.zeros(3, xs.dtype), xs)

    # `w` is a plain constant: only the scaled xs make the carry scaled.
    check_matches_over_scales(
        fn, [X, np.float32(0.5)], np.float32, [2.0**30], scaled_mask=[True, False]
    )


def _jaxpr_text(fn, *args):
    return str(jax.make_jaxpr(fn)(*args))


def test_scan_carry_promoted_once_to_fixed_point():
    """`b` becomes scaled only through `a`: two rounds of promotion, one scan."""

    def fn(xs):
        def body(carry, x):
            a, b, n = carry
            return (x * 2, a + 1.0, n + 1), b

        init = (jnp.zeros(3, xs.dtype), jnp.zeros(3, xs.dtype), 0)
        return jax.lax.scan(body, init, xs)

    xs = make_scaled(X, np.float16, 2.0**20)
    (a, b, n), ys = jsa.autoscale(fn)(xs)
    assert isinstance(a, jsa.ScaledArray) and isinstance(b, jsa.ScaledArray)
    assert isinstance(ys, jsa.ScaledArray) and not isinstance(n, jsa.ScaledArray)
    (ea, eb, en), eys = fn(jnp.asarray(represented(xs), jnp.float32))
    for out, ref in ((a, ea), (b, eb), (ys, eys)):
        assert_close(out, ref, RTOL[np.dtype(np.float16)])
    assert int(n) == int(en) == 5
    text = _jaxpr_text(jsa.autoscale(fn), xs)
    assert text.count("scan[") == 1


def test_carry_scaled_on_input_stays_scaled():
    def fn(x):
        return jax.lax.fori_loop(0, 2, lambda i, c: jnp.ones_like(c), x)

    out = jsa.autoscale(fn)(make_scaled(V, np.float32, 2.0**10))
    assert isinstance(out, jsa.ScaledArray)
    assert_close(out, np.ones(3), 0)


def test_carry_scale_changes_per_iteration():
    """The scale is a carried leaf: multiplying by a power of two changes only the scale."""
    x = make_scaled(V, np.float16, 2.0**-30)
    out = jsa.autoscale(lambda c: jax.lax.fori_loop(0, 4, lambda i, c: c * 4.0, c))(x)
    np.testing.assert_array_equal(np.asarray(out.data), np.asarray(x.data))
    assert float(out.scale) == 2.0**-30 * 4.0**4


def test_scan_stacked_outputs_with_varying_and_constant_scales():
    def fn(x):
        def body(c, _):
            return c * 2.0, (c, x)  # `c`'s scale doubles, `x`'s does not change

        return jax.lax.scan(body, x, None, length=4)

    x = make_scaled(V, np.float32, 2.0**-50)
    c, (ys, xs) = jsa.autoscale(fn)(x)
    ec, (eys, exs) = fn(jnp.asarray(represented(x), jnp.float32))
    assert_close(c, ec, 1e-6)
    assert_close(ys, eys, 1e-6)
    assert_close(xs, exs, 0)
    # The loop-invariant scale is kept as it is; the varying one is kept per iteration, as a
    # block scale with one block per iteration along the stacked axis.
    assert float(xs.scale) == 2.0**-50
    per_iteration = 2.0**-50 * 2.0 ** np.arange(4)
    assert ys.scale.shape == (4,) + (1,) * (ys.ndim - 1)
    np.testing.assert_array_equal(np.asarray(ys.scale).ravel(), per_iteration)


# float16 reversed and bfloat16 forward in the default run (float32 stacked layers: in
# tests/core/test_block_scales.py); the slow step runs the others.
@pytest.mark.parametrize(
    "dtype, reverse",
    [
        pytest.param(
            dtype,
            reverse,
            marks=()
            if (dtype, reverse) in {(np.float16, True), (ml_dtypes.bfloat16, False)}
            else pytest.mark.slow,
        )
        for dtype in (np.float32, np.float16, ml_dtypes.bfloat16)
        for reverse in (False, True)
    ],
)
@pytest.mark.one_case
def test_scan_over_stacked_per_layer_scales(dtype, reverse):
    """Layers 2^30 apart, stacked with one scale per layer `(L, 1, 1)`: each iteration sees
    its own layer's scale (float16 could not hold them at one scale), forward and backward,
    and the stacked outputs keep one scale per layer."""
    rng = np.random.default_rng(0)
    magnitudes = np.exp2(np.array([-20.0, -5.0, 0.0, 10.0]))[:, None, None]
    w = (rng.normal(size=(4, 8, 8)) * magnitudes).astype(np.float32)
    x = rng.normal(size=(2, 8)).astype(np.float32)

    def fn(w, x):
        def body(c, wl):
            y = c @ wl
            return jnp.tanh(y), y

        return jax.lax.scan(body, x, w, reverse=reverse)

    def loss(w, x):
        return jnp.sum(fn(w, x)[1][:, 0] ** 2)

    def outputs_and_grad(w, x):  # one program for both
        return fn(w, x)[1], jax.grad(loss)(w, x)

    ws = as_scaled_array_jit(w, scale_shape=(4, 1, 1), dtype=dtype)
    plain_w = jnp.asarray(represented(ws), jnp.float32)
    tol = {np.float32: 1e-5, np.float16: 4e-3, ml_dtypes.bfloat16: 3e-2}[dtype]
    ys, grad = jax.jit(jsa.autoscale(outputs_and_grad))(ws, x)
    ref, ref_grad = jax.jit(outputs_and_grad)(plain_w, x)
    assert ys.scale.shape == (4, 1, 1)
    for got, want in [(ys, ref), (grad, ref_grad)]:
        got = np.asarray(got.to_array(jnp.float32), np.float64)
        want = np.asarray(want, np.float64)
        # Per layer: each layer's error relative to its own largest value.
        err = np.abs(got - want).max(axis=(1, 2)) / np.abs(want).max(axis=(1, 2))
        assert (err <= tol).all(), err


def test_while_carry_promoted():
    def fn(x):
        return jax.lax.while_loop(
            lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] + x, s[1]), (0, jnp.zeros(3), jnp.ones(3))
        )

    x = make_scaled(V, np.float32, 2.0**35)
    n, acc, prev = jsa.autoscale(fn)(x)
    assert isinstance(acc, jsa.ScaledArray) and isinstance(prev, jsa.ScaledArray)
    en, eacc, eprev = fn(jnp.asarray(represented(x), jnp.float32))
    assert int(n) == int(en)
    assert_close(acc, eacc, 1e-6)
    assert_close(prev, eprev, 1e-6)


def test_cond_branch_outputs_share_one_structure():
    def fn(p, x):
        return jax.lax.cond(p, lambda v: v * 3, lambda v: jnp.zeros_like(v), x)

    x = make_scaled(V, np.float16, 2.0**-35)
    for pred in (True, False):
        out = jsa.autoscale(fn)(pred, x)
        assert isinstance(out, jsa.ScaledArray)
        assert_close(out, fn(pred, jnp.asarray(represented(x), jnp.float32)), 4e-3)


def test_cond_without_scaled_operands_unchanged():
    fn = lambda x: jax.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x)  # noqa: E731
    out = jsa.autoscale(fn)(V)
    assert not isinstance(out, jsa.ScaledArray)
    np.testing.assert_allclose(out, fn(V), rtol=1e-6)


# --- gradients ----------------------------------------------------------------------------


def _grad_scan(x):
    c, ys = jax.lax.scan(lambda c, xi: (c * 0.5 + xi, c * xi), x[0], x)
    return c + jnp.sum(ys, axis=0)


def _grad_cond(x):
    return jax.lax.cond(jnp.sum(x) > 0, lambda v: v * v, lambda v: v * 2, x)


def _grad_fori(x):
    return jax.lax.fori_loop(0, 3, lambda i, c: c * 0.5 + x, x) * x[:1]


def _grad_checkpoint(x):
    return jax.checkpoint(lambda v: v * v * 0.5 - v)(x)


def _grad_calls(x):
    kept = jax.jit(lambda v: v * jnp.sin(v))(x)
    return kept + _sin_fake_jvp(x) + _square_fake_vjp(x, x) + _diag_solve(jnp.abs(x) + 1, x)


GRAD_FUNCTIONS = {
    "calls": _grad_calls,
    "scan": _grad_scan,
    "cond": _grad_cond,
    "fori": _grad_fori,
    "checkpoint": _grad_checkpoint,
}


# The default run: each function with one dtype, in turn (scan with two), every dtype for
# some; every function and dtype forward: test_control_flow_matches_plain. The slow step
# runs the other pairs.
GRAD_DEFAULT = {
    ("calls", FLOAT_DTYPES[0]),
    ("checkpoint", FLOAT_DTYPES[1]),
    ("cond", FLOAT_DTYPES[2]),
    ("fori", FLOAT_DTYPES[0]),
    ("scan", FLOAT_DTYPES[1]),
    ("scan", FLOAT_DTYPES[2]),
}


@pytest.mark.parametrize(
    "name, dtype",
    [
        pytest.param(
            name,
            dtype,
            marks=() if (name, dtype) in GRAD_DEFAULT else pytest.mark.slow,
            id=f"{name}-{dtype.name}",
        )
        for name in sorted(GRAD_FUNCTIONS)
        for dtype in FLOAT_DTYPES
    ],
)
def test_grad_through_control_flow(name, dtype):
    # d loss / d data = d loss / d value * scale ~ value * scale: keep it in float16's range.
    scales = (2.0**-4, 2.0**4) if dtype == np.float16 else (2.0**-40, 2.0**40)
    fn = GRAD_FUNCTIONS[name]
    check_grad_over_scales(fn, [X[:3] * 0.5], dtype, scales, rtol=6 * RTOL[np.dtype(dtype)])


@pytest.mark.parametrize("name", sorted(GRAD_FUNCTIONS))
def test_autoscale_of_grad_through_control_flow(name):
    fn = GRAD_FUNCTIONS[name]
    xs = X[:3] * 0.5
    loss = lambda v: jnp.sum(fn(v))  # noqa: E731
    x = make_scaled(xs, np.float32, 2.0**-20)
    g = jax.jit(jsa.autoscale(jax.grad(loss)))(x)
    assert isinstance(g, jsa.ScaledArray)
    assert_close(g, jax.jit(jax.grad(loss))(jnp.asarray(represented(x), jnp.float32)), 1e-5)


# Custom-derivative functions, used here inside loops and by test_custom_derivatives.py.


@jax.custom_jvp
def _sin_fake_jvp(x):
    return jnp.sin(x)


@_sin_fake_jvp.defjvp
def _sin_fake_jvp_rule(primals, tangents):
    (x,), (t,) = primals, tangents
    return jnp.sin(x), 3.0 * x * t  # not cos(x): the rule must win


@jax.custom_vjp
def _square_fake_vjp(x, y):
    return x * y


def _square_fwd(x, y):
    return x * y, (x, y)


def _square_bwd(res, ct):
    x, y = res
    return 5.0 * ct * y, -ct  # not (ct * y, ct * x)


_square_fake_vjp.defvjp(_square_fwd, _square_bwd)


# --- calls, nesting, batching -----------------------------------------------------------------


def test_jit_inside_keeps_name_and_donation():
    @jax.jit
    def plain_inner(a):
        return a * 2

    inner = jax.jit(lambda a, b: a * b + 1.0, donate_argnums=(0,))

    def fn(x, y):
        return inner(x, y), plain_inner(y)

    x, y = make_scaled(V, np.float16, 2.0**12), make_scaled(V, np.float16, 2.0**-3)
    jaxpr = jax.make_jaxpr(jsa.autoscale(fn))(x, y)
    jits = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    assert [e.params["name"] for e in jits] == ["<lambda>", "plain_inner"]
    donated = jits[0].params["donated_invars"]
    # consts first, then (data, scale) of x, (data, scale) of y: only x's data is donated
    assert donated[-4:] == (True, False, False, False) and not any(donated[:-4])
    expected = represented(x) * represented(y) + 1
    out, _ = jsa.autoscale(fn)(x, y)  # x's data is donated: not usable afterwards
    assert_close(out, expected, 4e-3)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=_ids)
def test_composite_decomposition_interpreted(dtype):
    """`jax.lax.composite` with a pytree output, an attribute and a captured constant: the
    decomposition's values, the composite itself not kept (a kernel for the named op would
    compute it on the data)."""
    weights = np.linspace(-1.0, 1.0, 3, dtype=np.float32)

    softmax_stats = jax.lax.composite(
        lambda a, /, *, axis: {
            "p": jax.nn.softmax(a * weights[None].astype(a.dtype), axis),
            "m": jnp.max(a, axis),
        },
        name="jsa_test.softmax_stats",
        version=1,
    )

    def fn(a):
        return softmax_stats(a, axis=1)

    check_matches_over_scales(fn, [X], dtype, WIDE_SCALES, rtol=2 * RTOL[np.dtype(dtype)])
    assert "composite" in primitives_of(fn, [X])
    assert "composite" not in primitives_of(jsa.autoscale(fn), [make_scaled(X, dtype, 2.0**10)])


def test_grad_of_autoscaled_composite_is_its_decomposition_gradient():
    # Plain JAX has no derivative of a composite; interpreted, the decomposition has one:
    # d loss / d data = d loss / d value * scale.
    x = make_scaled(X, np.float32, 2.0**-30)
    loss = lambda a, b: jnp.sum(_sin_axpy_composite(a, b, k=3.0) ** 2)  # noqa: E731
    plain = lambda a, b: jnp.sum(_sin_axpy(a, b, k=3.0) ** 2)  # noqa: E731
    with pytest.raises(ValueError, match="JVP rule for composite not implemented"):
        jax.grad(loss)(X, V)

    def data_loss(data, b):
        return jsa.autoscale(loss)(jsa.ScaledArray(data, x.scale), b).to_array(jnp.float32)

    grads = jax.jit(jax.grad(data_loss, argnums=(0, 1)))(x.data, V)
    value = jnp.asarray(represented(x), jnp.float32)
    expected = jax.grad(plain, argnums=(0, 1))(value, V)
    assert_close(grads[0], expected[0] * 2.0**-30, 1e-5)
    assert_close(grads[1], expected[1], 1e-5)


def test_nested_autoscale_is_transparent():
    inner = jsa.autoscale(lambda a: jax.lax.fori_loop(0, 2, lambda i, c: c * a, a))
    fn = lambda a: inner(a) + 1.0  # noqa: E731
    x = make_scaled(V, np.float32, 2.0**-10)
    once = jsa.autoscale(fn)(x)
    nested = jsa.autoscale(lambda a: fn(a))(x)
    assert_close(nested, represented(once), 0)


def _batched_fn(x):
    c, ys = jax.lax.scan(lambda c, xi: (c + xi, c * xi), jnp.zeros((), x.dtype), x)
    return jax.lax.cond(c > 0, lambda: ys * 2, lambda: -ys)


def test_vmap_of_autoscale_with_control_flow():
    x = make_scaled(X, np.float32, 2.0**25)
    expected = jax.vmap(_batched_fn)(jnp.asarray(represented(x), jnp.float32))
    # Per-example output scales come out as a (B, 1) block scale: `to_array` reads them.
    batched_value = lambda out: np.asarray(out.to_array())  # noqa: E731
    # one scale shared by the batch (the output scales are computed per example)
    out = jax.jit(jax.vmap(jsa.autoscale(_batched_fn), in_axes=(jsa.ScaledArray(0, None),)))(x)
    np.testing.assert_allclose(batched_value(out), expected, rtol=1e-5)
    # one scale per example
    scales = jnp.asarray(2.0 ** np.arange(-20, 30, 10), jnp.float32)
    outb = jax.jit(jax.vmap(jsa.autoscale(_batched_fn)))(jsa.ScaledArray(x.data, scales))
    ref = jax.vmap(_batched_fn)(x.data * scales[:, None])
    # Per example, the scan's stacked `ys` keep one scale per iteration (here per element,
    # as the scan runs over scalars) and the cond keeps that layout: (B, 3).
    assert outb.scale.shape == (scales.size, x.shape[1])
    np.testing.assert_allclose(batched_value(outb), ref, rtol=1e-5)


def test_autoscale_of_vmap_with_control_flow():
    x = make_scaled(X, np.float16, 2.0**-35)
    out = jax.jit(jsa.autoscale(jax.vmap(_batched_fn)))(x)
    assert isinstance(out, jsa.ScaledArray)
    assert_close(out, jax.vmap(_batched_fn)(jnp.asarray(represented(x), jnp.float32)), 8e-3)


def _diag_solve(d, v):
    return jax.lax.custom_linear_solve(lambda x: d * x, v, lambda mv, r: r / d, lambda mv, r: r / d)


@pytest.mark.parametrize(
    "fn", [_grad_scan, _grad_cond, _grad_fori, _diag_solve], ids=["scan", "cond", "fori", "solve"]
)
def test_gradient_with_respect_to_scales(fn):
    """Scales are differentiable leaves: d/d scale = sum(d/d value * data)."""
    if fn is _diag_solve:
        args = [make_scaled(np.abs(X[0]) + 1, np.float32, 0.5), make_scaled(X[1], np.float32, 4.0)]
    else:
        args = [make_scaled(X[:3] * 0.5, np.float32, 0.5)]

    def leaf_loss(leaves):
        values = [jsa.ScaledArray(d, s) for d, s in leaves]
        return jsa.autoscale(lambda *v: weighted_sum(fn(*v)))(*values).to_array()

    def plain_loss(leaves):
        return weighted_sum(fn(*[d * s for d, s in leaves]))

    leaves = [(a.data, a.scale) for a in args]
    got = jax.jit(jax.grad(leaf_loss))(leaves)
    expected = jax.jit(jax.grad(plain_loss))(leaves)
    for g, e in zip(
        jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected), strict=True
    ):
        assert_close(g, e, 1e-5)


def weighted_sum(y):
    return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape))


def test_while_with_batched_predicate():
    """`vmap` of a while loop gives a vector predicate: each element stops on its own."""

    def loop(r):
        return jax.lax.while_loop(lambda c: jnp.sum(c) < 20 * jnp.max(r), lambda c: c * 2, r)

    x = np.abs(X) + np.arange(5, dtype=np.float32)[:, None] ** 2  # different trip counts
    check_matches_over_scales(jax.vmap(loop), [x], np.float16, [2.0**-20, 2.0**20])


def test_forward_mode_through_scaled_while():
    """A while loop has no reverse mode, but jvp through the scaled loop works."""

    def fn(v):
        body = lambda c: (c[0] + 1, c[1] * 1.5 + v)  # noqa: E731
        return jax.lax.while_loop(lambda c: jnp.sum(c[1]) < 20.0, body, (0, v))[1]

    x, scale = np.abs(V) + 0.5, np.float32(2.0**-6)
    scaled = lambda d: jsa.autoscale(fn)(jsa.ScaledArray(d, scale)).to_array()  # noqa: E731
    primal, tangent = jax.jit(lambda d, t: jax.jvp(scaled, (d,), (t,)))(x / scale, np.ones(3))
    expected_primal, expected_tangent = jax.jvp(fn, (x,), (scale * np.ones(3, np.float32),))
    np.testing.assert_allclose(primal, expected_primal, rtol=1e-6)
    np.testing.assert_allclose(tangent, expected_tangent, rtol=1e-6)
