import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.ops.dynamic_rescaling import DEFAULT_EPSILON, rescale_factor_p
from tests import helpers
from tests.helpers import FLOAT_DTYPES, WIDE_SCALES, make_scaled

RESCALERS = {
    "max": (jsa.ops.dynamic_rescale_max, lambda d: np.max(np.abs(d))),
    "l1": (jsa.ops.dynamic_rescale_l1, lambda d: np.mean(np.abs(d))),
    "l2": (jsa.ops.dynamic_rescale_l2, lambda d: np.sqrt(np.mean(d * d))),
}


@pytest.mark.parametrize("name", sorted(RESCALERS))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scale", WIDE_SCALES)
def test_dynamic_rescale_keeps_value_and_normalises_data(name, dtype, scale):
    rescale, norm = RESCALERS[name]
    x = make_scaled(np.array([0.001, -0.003, 0.0025]), dtype, scale)
    out = rescale(x)
    np.testing.assert_array_equal(
        np.asarray(out.to_array(jnp.float32)), np.asarray(x.to_array(jnp.float32))
    )
    assert 1.0 <= norm(np.asarray(out.data, np.float64)) < 2.0
    assert out.dtype == dtype


@pytest.mark.parametrize("use_jit", [False, True])
def test_dynamic_rescale_inside_autoscale_on_pytrees(use_jit):
    tree = {"a": make_scaled(np.full(4, 1e-3), np.float16, 1.0), "n": jnp.int32(2)}

    def fn(t):
        return jsa.ops.dynamic_rescale_max({"a": t["a"] * 3.0, "n": t["n"]})

    fn_t = jax.jit(jsa.autoscale(fn)) if use_jit else jsa.autoscale(fn)
    out = fn_t(tree)
    assert int(out["n"]) == 2
    assert 1.0 <= float(jnp.max(jnp.abs(out["a"].data))) < 2.0
    np.testing.assert_allclose(
        np.asarray(out["a"].to_array(jnp.float32)), np.full(4, 3e-3), rtol=1e-3
    )


def test_dynamic_rescale_zeros_and_plain_arrays():
    zeros = make_scaled(np.zeros(3), np.float32, 1.0)
    out = jsa.ops.dynamic_rescale_l2(zeros)
    assert np.isfinite(float(out.scale)) and float(out.scale) > 0
    np.testing.assert_array_equal(out.to_array(), np.zeros(3))
    plain = jnp.array([1e-3, 2e-3])
    np.testing.assert_array_equal(jsa.ops.dynamic_rescale_max(plain), plain)


def test_dynamic_rescale_grad_variant_rescales_the_gradient_only():
    x = make_scaled(np.array([1.0, 2.0]), np.float16, 1.0)

    def loss(a):
        a = jsa.ops.dynamic_rescale_max_grad(a)
        return jnp.sum(a * a * 1e-3)

    out = jsa.autoscale(loss)(x)
    np.testing.assert_allclose(float(out.to_array(jnp.float32)), 5e-3, rtol=1e-3)
    grad = jsa.autoscale(jax.grad(loss))(x)
    # The gradient value is 2e-3 * x, and its data was rescaled to [1, 2).
    np.testing.assert_allclose(np.asarray(grad.to_array(jnp.float32)), [2e-3, 4e-3], rtol=1e-3)
    assert 1.0 <= float(jnp.max(jnp.abs(grad.data))) < 2.0
    # Without the rescaling, the gradient's data is not normalised.
    raw = jsa.autoscale(jax.grad(lambda a: jnp.sum(a * a * 1e-3)))(x)
    assert not 1.0 <= float(jnp.max(jnp.abs(raw.data))) < 2.0


# The default run holds every pair of (rescale, dtype, layout, jit, inside) values; the slow
# step runs the whole product.
PER_BLOCK_CASES = [
    (rescale, dtype, layout, jit, inside)
    for rescale in ("dynamic_rescale_max", "dynamic_rescale_l1", "dynamic_rescale_l2")
    for dtype in FLOAT_DTYPES
    for layout in ((8, 1), (1, 64), (8, 2), (2, 2))
    for jit in (True, False)  # jitted first: the cover's ties go to the cheaper programs
    for inside in (True, False)
]


@pytest.mark.parametrize(
    "rescale, dtype, layout, jit, inside", helpers.pairwise_params(PER_BLOCK_CASES)
)
def test_dynamic_rescale_of_block_scales_is_per_block(rescale, dtype, layout, jit, inside):
    """A block-scaled array is rescaled block by block, on its own or inside an autoscaled
    function: the layout is kept, the values are unchanged exactly, and each block's norm
    of the data is in [1, 2) (max: its largest magnitude)."""
    rng = np.random.default_rng(0)
    value = rng.normal(size=(8, 64)) * np.exp2(np.arange(-12, 12, 3))[:, None]
    x = jsa.as_scaled_array(jnp.asarray(value, jnp.float32), scale_shape=layout, dtype=dtype)
    # Data 2^8 below where it should be (exactly: powers of two, normal in every dtype; in
    # NumPy, as the comparisons below: no program for each).
    data = (np.asarray(x.data, np.float32) * np.float32(2.0**-8)).astype(dtype)
    x = jsa.ScaledArray(jnp.asarray(data), jnp.asarray(np.asarray(x.scale) * np.float32(2.0**8)))
    fn = getattr(jsa.ops, rescale)
    fn = jsa.autoscale(fn) if inside else fn
    y = (jax.jit(fn) if jit else fn)(x)
    assert y.scale.shape == layout and y.dtype == x.dtype
    np.testing.assert_array_equal(helpers.represented(y), helpers.represented(x))
    blocks_of = np.abs(np.asarray(y.data, np.float64)).reshape(
        layout[0], -1, layout[1], 64 // layout[1]
    )
    norm = {
        "dynamic_rescale_max": lambda b: b.max(axis=(1, 3)),
        "dynamic_rescale_l1": lambda b: b.mean(axis=(1, 3)),
        "dynamic_rescale_l2": lambda b: np.sqrt((b**2).mean(axis=(1, 3))),
    }[rescale](blocks_of)
    assert ((norm >= 1) & (norm < 2)).all(), norm


# --- another block layout: scale_shape ------------------------------------------------------

M, K = 8, 64
TARGETS = {
    "tensor": (),
    "row": (M, 1),
    "column": (1, K),
    "mx32": (M, K // 32),
    "tile": (2, 2),
}


def _rows_apart(seed=0):
    """Rows 2^0 ... 2^-7, elements within a factor 2 of their row's magnitude: normal
    numbers of every data dtype at one scale per tensor."""
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], size=(M, K))
    return signs * rng.uniform(0.5, 1.0, size=(M, K)) * np.exp2(-np.arange(M))[:, None]


def _norm_of_blocks(data, layout):
    layout = layout or (1, 1)
    b = np.abs(np.asarray(data, np.float64)).reshape(layout[0], -1, layout[1], K // layout[1])
    return b.max(axis=(1, 3))


SOURCES = {"tensor": (), "row": (M, 1), "tile": (2, 2)}
# The default run holds every pair of (dtype, target, source, jit, inside) values; the slow
# step runs the whole product.
RELAYOUT_CASES = [
    (dtype, target, source, jit, inside)
    for dtype in FLOAT_DTYPES
    for target in TARGETS
    for source in SOURCES
    for jit in (True, False)  # jitted first: the cover's ties go to the cheaper programs
    for inside in ("autoscale", "outside")
]


@pytest.mark.parametrize(
    "dtype, target, source, jit, inside", helpers.pairwise_params(RELAYOUT_CASES)
)
def test_dynamic_rescale_to_another_layout(dtype, target, source, jit, inside):
    """`scale_shape` picks one power of two per block of the asked layout, whatever the
    input's: values unchanged (exactly: the data stay normal numbers), each new block's
    largest magnitude in [1, 2)."""
    value = jnp.asarray(_rows_apart(), jnp.float32)
    x = jsa.as_scaled_array(value, scale_shape=SOURCES[source] or None, dtype=dtype)
    layout = TARGETS[target]

    def fn(v):
        return jsa.ops.dynamic_rescale_max(v, scale_shape=layout)

    fn = jsa.autoscale(fn) if inside == "autoscale" else fn
    y = (jax.jit(fn) if jit else fn)(x)
    assert y.scale.shape == layout and y.dtype == x.dtype
    np.testing.assert_array_equal(helpers.represented(y), helpers.represented(x))
    norm = _norm_of_blocks(y.data, layout)
    assert ((norm >= 1) & (norm < 2)).all(), norm


def test_dynamic_rescale_scale_shape_as_a_function_of_the_shape():
    """A callable `scale_shape` gets each leaf's shape: per-row scales for a pytree."""
    tree = {
        "a": jsa.as_scaled_array(jnp.asarray(_rows_apart(), jnp.float32)),
        "b": jsa.as_scaled_array(jnp.ones((4, 3), jnp.float32)),
    }
    out = jsa.ops.dynamic_rescale_l2(tree, scale_shape=lambda shape: (shape[0], 1))
    assert out["a"].scale.shape == (M, 1) and out["b"].scale.shape == (4, 1)
    np.testing.assert_array_equal(out["a"].to_array(), tree["a"].to_array())


def test_dynamic_rescale_rejects_a_layout_that_does_not_tile_the_data():
    x = jsa.as_scaled_array(jnp.ones((M, K), jnp.float32))
    with pytest.raises(ValueError, match=r"scale of shape \(3, 1\) does not broadcast"):
        jsa.ops.dynamic_rescale_max(x, scale_shape=(3, 1))


@pytest.mark.parametrize("layout", [(), (M, 1)], ids=["per tensor", "per row"])
def test_per_row_rescale_keeps_rows_far_apart_in_float16(layout):
    """The use: inside an autoscaled function, float32 data with one scale, rows 2^36
    apart, rescaled then cast to float16 and squared. Per row, every row keeps float16's
    precision; per tensor, the small rows are float16 subnormals or zeros."""
    value = np.ones((M, K)) * np.exp2(np.arange(M) * -5.0)[:, None]  # rows 2^35 apart
    value *= np.random.default_rng(0).uniform(0.5, 1.0, size=(M, K))

    @jax.jit
    @jsa.autoscale
    def square(x):
        y = jsa.ops.dynamic_rescale_max(x, scale_shape=layout).astype(jnp.float16)
        return y * y

    out = square(jsa.as_scaled_array(jnp.asarray(value, jnp.float32)))
    assert out.scale.shape == layout
    got = np.asarray(out.to_array(jnp.float32), np.float64)
    errors = np.max(np.abs(got - value**2), axis=1) / np.max(value**2, axis=1)
    if layout:
        assert (errors < 2e-3).all(), errors
    else:
        assert errors[0] < 2e-3 and errors[-1] > 0.1, errors


@pytest.mark.parametrize("jit", [False, True])
def test_dynamic_rescale_with_scale_shape_differentiates_as_the_identity(jit):
    """Through `jax.grad` inside autoscale the rescaling is the identity: the gradient is
    the plain one; the `_grad` variant rescales the gradient to the asked layout."""
    value = jnp.asarray(_rows_apart(), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(M, K)), jnp.float32)

    def grads(x, w):
        def loss(x):
            return jnp.sum(jnp.sin(jsa.ops.dynamic_rescale_l1(x, scale_shape=(M, 1))) * w)

        def rescaled_cotangent(v):  # the cotangent of `v` is `w`, a scaled input
            return jnp.sum(jsa.ops.dynamic_rescale_max_grad(v, scale_shape=(2, 2)) * w)

        return jax.grad(loss)(x), jax.grad(rescaled_cotangent)(x)

    fn = jsa.autoscale(grads)
    g, h = (jax.jit(fn) if jit else fn)(jsa.as_scaled_array(value), jsa.as_scaled_array(w))
    np.testing.assert_allclose(
        np.asarray(jsa.asarray(g, jnp.float32)), jnp.cos(value) * w, rtol=1e-5, atol=1e-6
    )
    assert h.scale.shape == (2, 2)
    np.testing.assert_array_equal(np.asarray(h.to_array(jnp.float32)), w)
    norm = _norm_of_blocks(h.data, (2, 2))
    assert ((norm >= 1) & (norm < 2)).all(), norm


def test_rebalance_keeps_block_scales_inside_autoscale():
    x = jsa.as_scaled_array(jnp.asarray(_rows_apart(), jnp.float32), scale_shape=(M, 1))
    y = jsa.autoscale(lambda v: jsa.lax.rebalance(v, jnp.float32(4.0)))(x)
    assert y.scale.shape == (M, 1)
    np.testing.assert_array_equal(y.scale, x.scale / 4)
    np.testing.assert_array_equal(y.to_array(), x.to_array())


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("norm", ["max", "l1", "l2"])
def test_dynamic_rescale_under_vmap_of_autoscale(norm, jit):
    """`jsa.vmap` of an autoscaled rescale: each example gets its own power of two inside
    (the `rescale_factor` primitive batched), the values are unchanged, and the batch's
    output has the largest example's scale."""
    rescale = getattr(jsa.ops, f"dynamic_rescale_{norm}")
    data = jnp.array([[1.0, -2.0, 0.5], [1e-3, 2e-3, -4e-3], [100.0, 3.0, 0.0]], jnp.float32)
    x = jsa.ScaledArray(data, jnp.float32(2.0))
    fn = jsa.vmap(jsa.autoscale(lambda a: rescale(a * 1.0)))
    out = (jax.jit(fn) if jit else fn)(x)
    np.testing.assert_array_equal(jsa.asarray(out), data * 2.0)
    per_example = [rescale(jsa.ScaledArray(row, jnp.float32(2.0))).scale for row in data]
    assert float(out.scale) == max(float(s) for s in per_example)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(3,), (64,), (64, 32), (40, 50), (5000,)], ids=str)
def test_per_tensor_max_factor_is_the_same_in_both_lowerings(shape, dtype):
    """The per-tensor `max` factor: on XLA:CPU a small tensor's largest magnitude is reduced
    in one kernel (in axes of at most 32, zero-padded); jitted, `bind` runs that lowering
    here and `impl` the default one. Same factors, a NaN or an infinity included, wherever
    the largest magnitude sits."""
    params = dict(norm="max", epsilon=DEFAULT_EPSILON, shift=0, axes=tuple(range(len(shape))))
    cpu = jax.jit(lambda d: rescale_factor_p.bind(d, **params))
    default = jax.jit(lambda d: rescale_factor_p.impl(d, **params))
    size = int(np.prod(shape))
    base = np.random.default_rng(size).uniform(-1e-3, 1e-3, size)
    for where in (0, size // 2, size - 1):
        for special in (None, np.nan, np.inf):
            values = base.copy()
            values[where] = -7e-3
            if special is not None:
                values[(where + 1) % size] = special
            data = jnp.asarray(values.reshape(shape), dtype)
            got, want = cpu(data), default(data)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(
                    np.asarray(a), np.asarray(b), err_msg=f"{where} {special}"
                )
            if special is np.nan:
                continue  # a NaN is the largest magnitude or not, as XLA:CPU's reduction has it
            largest = float(jnp.max(jnp.abs(data.astype(jnp.float32))))
            expected = 1.0 if special else 2.0 ** -np.floor(np.log2(largest))
            assert float(got[0]) == expected, (where, special)


def _many_tensors():
    """Tensors whose per-tensor factors `rescale_factors_p` computes together: small ones
    (read as they are on XLA:GPU) and large ones (in rows; 8,192 rows merged in pairs), an
    infinity, zeros, a scalar, three dtypes."""
    rng = np.random.default_rng(7)
    small = rng.uniform(-1e-3, 1e-3, (16, 8))
    small[3, 4] = -7e-3
    tall = rng.normal(size=(8192, 40)) * 2.0**20
    tall[8000, 3] = 3e7
    wide = rng.normal(size=(3, 5000))
    wide[1, 1] = np.inf
    square = rng.normal(size=(64, 64)) * 2.0**-30
    return [
        jnp.asarray(small, jnp.float16),
        jnp.asarray(tall, jnp.float32),
        jnp.asarray(wide, jnp.bfloat16),
        jnp.asarray(square, jnp.float32),
        jnp.zeros(5, jnp.float32),
        jnp.asarray(7.0, jnp.float32),
    ]


@pytest.mark.parametrize("jit", [False, True])
def test_rescale_factors_of_many_tensors_are_each_tensors_own(jit):
    """One equation for the per-tensor max factors of many tensors, in both lowerings (the
    XLA:GPU one finishes every tensor's largest magnitude in one kernel; the XLA:CPU one
    reduces each tensor as `rescale_factor_p` does): the factors of each tensor alone."""
    from jax_scaled_arithmetics.ops.dynamic_rescaling import (
        _rescale_factors_impl,
        rescale_factors_p,
    )

    tensors = _many_tensors()
    params = dict(epsilon=DEFAULT_EPSILON, shift=3)
    gpu_form = _rescale_factors_impl
    cpu_form = lambda *d: rescale_factors_p.bind(*d, **params)  # noqa: E731 (XLA:CPU's, jitted)
    if jit:
        gpu_form, cpu_form = (
            jax.jit(gpu_form, static_argnames=("epsilon", "shift")),
            jax.jit(cpu_form),
        )
    results = [gpu_form(*tensors, **params), cpu_form(*tensors)]
    for k, data in enumerate(tensors):
        own = rescale_factor_p.impl(data, norm="max", axes=tuple(range(data.ndim)), **params)
        for result in results:
            assert [float(result[2 * k]), float(result[2 * k + 1])] == [float(v) for v in own], k
    assert float(results[0][2]) == 2.0 ** (3 - 24)  # 3e7 -> 2^24, shifted by 3
    assert float(results[0][4]) == 2.0**3  # an infinity: the norm counts as 1
    lowered = {
        p: jax.jit(cpu_form).trace(*tensors).lower(lowering_platforms=(p,)).as_text()
        for p in ("cuda", "cpu")
    }
    # For XLA:GPU a reduction per large tensor (3 of the 6) and the one of them all.
    assert lowered["cuda"].count("applies stablehlo.maximum") == 3 + 1
    assert "stablehlo.gather" in lowered["cuda"] and "stablehlo.gather" not in lowered["cpu"]


def test_rescale_factors_under_vmap_are_per_example():
    from jax_scaled_arithmetics.ops.dynamic_rescaling import rescale_factors_p

    batch = jnp.array([[1.0, -2.0, 0.5], [1e-3, 2e-3, -4e-3]], jnp.float32)
    shared = jnp.array([300.0, 1.0], jnp.float16)
    params = dict(epsilon=DEFAULT_EPSILON, shift=0)
    out = jax.vmap(lambda b: rescale_factors_p.bind(b, shared, **params))(batch)
    assert out[0].tolist() == [0.5, 2.0**8] and out[1].tolist() == [2.0, 2.0**-8]
    assert out[2].tolist() == [2.0**-8] * 2 and out[3].tolist() == [2.0**8] * 2


@pytest.mark.parametrize("jit", [False, True])
def test_rescale_tree_rescales_each_leaf_as_alone(jit):
    """`dynamic_rescale_max` of a tree takes the per-tensor factors of its leaves together
    (one `rescale_factors` equation in the autoscaled program), leaving each leaf as it
    alone would be rescaled: per-tensor leaves of every dtype and wide scales, a
    block-scaled one, a plain array and an integer; its derivative is the identity."""
    rng = np.random.default_rng(3)
    tree = {
        "w": [
            make_scaled(rng.normal(size=(32, 16)) * 1e-3, dtype, scale)
            for dtype in FLOAT_DTYPES
            for scale in (2.0**-60, 1.0, 2.0**50)
        ],
        "blocks": jsa.ScaledArray(
            jnp.asarray(rng.normal(size=(4, 6)), jnp.float16), jnp.array([[0.5], [2.0]] * 2)
        ),
        "plain": jnp.asarray(rng.normal(size=3), jnp.float32),
        "step": jnp.int32(4),
    }
    rescale = jax.jit(jsa.ops.dynamic_rescale_max) if jit else jsa.ops.dynamic_rescale_max
    out = rescale(tree)
    alone = jax.tree_util.tree_map(
        jsa.ops.dynamic_rescale_max, tree, is_leaf=lambda x: isinstance(x, jsa.ScaledArray)
    )
    for got, want in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(alone)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    fn = jsa.autoscale(lambda t: jsa.ops.dynamic_rescale_max([a * 2.0 for a in t]))
    jaxpr = jax.make_jaxpr(fn)(tree["w"])
    names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert names.count("rescale_factors") == 1 and "rescale_factor" not in names
    values = [jnp.array([1.0, -3.0]), jnp.array([[5.0]])]
    grads = jax.grad(lambda v: sum(jnp.sum(a * a) for a in jsa.ops.dynamic_rescale_max(v)))(values)
    for g, v in zip(grads, values):
        np.testing.assert_array_equal(g, 2 * v)


@pytest.mark.parametrize("jit", [False, True])
def test_rescale_tree_under_vmap_of_autoscale_is_each_leafs_own(jit):
    """`jsa.vmap` of an autoscaled rescale of two leaves: the factors computed together are
    batched per example as each leaf's alone are (the same outputs)."""
    data = jnp.array([[1.0, -2.0, 0.5], [1e-3, 2e-3, -4e-3]], jnp.float32)
    x = jsa.ScaledArray(data, jnp.float32(2.0))
    y = jsa.ScaledArray(jnp.array([[300.0], [0.25]], jnp.float16), jnp.float32(0.5))
    together = jsa.vmap(jsa.autoscale(lambda a, b: jsa.ops.dynamic_rescale_max([a * 1.0, b])))
    alone = jsa.vmap(
        jsa.autoscale(lambda a, b: [jsa.ops.dynamic_rescale_max(v) for v in (a * 1.0, b)])
    )
    got = (jax.jit(together) if jit else together)(x, y)
    for g, w in zip(got, alone(x, y)):
        np.testing.assert_array_equal(np.asarray(g.data), np.asarray(w.data))
        np.testing.assert_array_equal(np.asarray(g.scale), np.asarray(w.scale))


def test_rescaling_brings_back_data_far_from_unit_range():
    """Static rules take data near unit range (docs/design.md, numerical rules): data 2^-14
    of its value compounds through `cumprod`'s products until the gradient's scale leaves
    float32's range; rescaled first, the same step follows float32."""
    values = np.random.default_rng(3).normal(size=(6, 8)).astype(np.float32)
    far = jsa.scaled_array(values * 2.0**-14, 2.0**14)

    def loss(x):
        return jnp.sum(jnp.cumprod(x * 0.5 + 1, axis=-1) * jnp.linspace(0.5, 2.0, 8)[None, :])

    expected = jax.grad(loss)(jnp.asarray(values))
    scale = float(jnp.max(jnp.abs(expected)))
    lost = jax.jit(jsa.autoscale(jax.grad(loss)))(far)
    assert float(jnp.max(jnp.abs(lost.to_array(jnp.float32) - expected))) > 0.5 * scale
    grad = jax.jit(jsa.autoscale(lambda x: jax.grad(loss)(jsa.ops.dynamic_rescale_max(x))))(far)
    np.testing.assert_allclose(grad.to_array(jnp.float32), expected, rtol=1e-5, atol=1e-5 * scale)
