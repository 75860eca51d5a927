"""Tests of `jsa.tree`: pytree utilities treating a ScaledArray as one leaf."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
import jax_scaled_arithmetics.tree as jtree
from jax_scaled_arithmetics.core.datatype import ScaledArray, scaled_array
from tests.helpers import load_script


def _tree():
    return {
        "w": scaled_array(jnp.array([1.0, 2.0], jnp.float16), 4.0),
        "b": jnp.array([0.5, 1.5], jnp.float32),
        "n": jnp.array([1, 2], jnp.int32),
        "flag": jnp.array(True),
        "nested": [np.array([3.0]), (None, 7)],
    }


def test_public_names():
    assert sorted(jtree.__all__) == sorted(
        [
            "map",
            "leaves",
            "flatten",
            "unflatten",
            "structure",
            "astype",
            "all",
            "as_scaled_array",
            "asarray",
            "PackedScales",
            "pack_scales",
            "unpack_scales",
        ]
    )
    for name in jtree.__all__:
        assert callable(getattr(jtree, name))  # PackedScales: a class
    # The module-level names shadow builtins only inside the package namespace.
    assert jtree.map is not map and jtree.all is not all


def test_leaves_keep_scaled_array_whole_and_skip_none():
    tree = _tree()
    leaves = jtree.leaves(tree)
    assert len(leaves) == 6  # w, b, n, flag, nested[0], 7 -- None is an empty subtree
    assert sum(isinstance(x, ScaledArray) for x in leaves) == 1
    assert len(jax.tree_util.tree_leaves(tree)) == 7  # jax splits w into data and scale


def test_leaves_with_user_is_leaf():
    tree = {"a": (1, 2), "b": scaled_array(jnp.ones(2), 2.0)}
    leaves = jtree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple))
    assert leaves[0] == (1, 2)
    assert isinstance(leaves[1], ScaledArray)


def test_map_passes_scaled_arrays_whole():
    tree = _tree()
    seen = []
    out = jtree.map(lambda x: seen.append(type(x)) or 0, tree)
    assert ScaledArray in seen
    assert out["w"] == 0 and out["nested"][1] == (None, 0)


def test_map_several_trees():
    a = {"x": scaled_array(jnp.array([1.0, 2.0]), 2.0), "y": jnp.array(1.0)}
    b = {"x": scaled_array(jnp.array([3.0, 4.0]), 0.5), "y": jnp.array(2.0)}

    def add(p, q):
        if isinstance(p, ScaledArray):
            return p.to_array() + q.to_array()
        return p + q

    out = jtree.map(add, a, b)
    np.testing.assert_allclose(out["x"], [3.5, 6.0])
    np.testing.assert_allclose(out["y"], 3.0)


def test_map_under_jit():
    tree = {"w": scaled_array(jnp.array([1.0, 2.0]), 4.0)}
    out = jax.jit(lambda t: jtree.map(lambda x: x.to_array(), t))(tree)
    np.testing.assert_allclose(out["w"], [4.0, 8.0])


def test_flatten_unflatten_structure_round_trip():
    tree = _tree()
    leaves, treedef = jtree.flatten(tree)
    assert treedef == jtree.structure(tree)
    assert treedef.num_leaves == len(leaves) == 6
    rebuilt = jtree.unflatten(treedef, leaves)
    assert isinstance(rebuilt["w"], ScaledArray)
    assert rebuilt["w"] is tree["w"]
    assert rebuilt["nested"][1][0] is None
    # A ScaledArray position can be refilled with anything.
    replaced = jtree.unflatten(treedef, list(range(6)))
    assert replaced["w"] == 0 or replaced["b"] == 0


def test_astype_floating_only():
    out = jtree.astype(_tree(), jnp.bfloat16)
    assert isinstance(out["w"], ScaledArray)
    assert out["w"].dtype == jnp.bfloat16
    assert out["w"].scale.dtype == jnp.float32
    assert float(out["w"].scale) == 4.0
    np.testing.assert_array_equal(np.asarray(out["w"].data, np.float32), [1.0, 2.0])
    assert out["b"].dtype == jnp.bfloat16
    assert out["n"].dtype == jnp.int32
    assert out["flag"].dtype == jnp.bool_
    assert out["nested"][0].dtype == jnp.bfloat16
    assert isinstance(out["nested"][0], np.ndarray)  # numpy leaves stay numpy
    assert out["nested"][1] == (None, 7)


def test_astype_all_dtypes():
    out = jtree.astype(_tree(), jnp.float16, floating_only=False)
    assert out["n"].dtype == jnp.float16
    assert out["flag"].dtype == jnp.float16
    assert out["b"].dtype == jnp.float16
    assert out["nested"][1] == (None, 7)  # Python scalars are never cast


def test_astype_python_scalars_untouched():
    out = jtree.astype({"lr": 0.1, "n": 3}, jnp.float16)
    assert out == {"lr": 0.1, "n": 3}


def test_astype_fp8_keeps_scale():
    x = scaled_array(jnp.array([1.0, -2.0, 0.5]), 2.0**-8)
    out = jtree.astype(x, jnp.float8_e4m3fn)
    assert out.dtype == jnp.float8_e4m3fn
    assert out.scale.dtype == jnp.float32 and float(out.scale) == 2.0**-8
    value = np.asarray(out.data, np.float32) * float(out.scale)
    np.testing.assert_array_equal(value, [2**-8, -(2**-7), 2**-9])


@pytest.mark.parametrize(
    "tree, expected",
    [
        ({}, True),
        ([True, 1, jnp.array(True)], True),
        ([True, 0], False),
        ({"a": jnp.array(False)}, False),
        ([scaled_array(jnp.array(1.0), 2.0)], True),
        ([scaled_array(jnp.array(0.0), 2.0)], False),
        ([scaled_array(jnp.array(1.0), 0.0)], False),
        ([None], True),
    ],
)
def test_all(tree, expected):
    assert jtree.all(tree) is expected
    if not any(isinstance(x, ScaledArray) for x in jtree.leaves(tree)):
        assert jax.tree_util.tree_all(tree) is expected


def test_all_with_is_leaf():
    assert jtree.all({"a": (1, 0)}) is False
    assert jtree.all({"a": (1, 0)}, is_leaf=lambda x: isinstance(x, tuple)) is True


def test_as_scaled_array_and_asarray():
    tree = {"w": jnp.array([2.0, 4.0]), "n": jnp.array([1, 2]), "s": scaled_array([1.0], 8.0)}
    scaled = jtree.as_scaled_array(tree, scale=2.0)
    assert isinstance(scaled["w"], ScaledArray)
    np.testing.assert_array_equal(scaled["w"].data, [1.0, 2.0])
    assert float(scaled["w"].scale) == 2.0
    assert scaled["n"] is tree["n"]
    assert scaled["s"] is tree["s"]
    back = jtree.asarray(scaled)
    np.testing.assert_array_equal(back["w"], [2.0, 4.0])
    np.testing.assert_array_equal(back["s"], [8.0])
    assert not isinstance(back["s"], ScaledArray)
    half = jtree.asarray(scaled, dtype=jnp.float16)
    assert half["w"].dtype == jnp.float16 and half["n"].dtype == jnp.int32


# --- pack_scales / unpack_scales -----------------------------------------------------------


def _mixed_tree():
    """Scalar-scaled ScaledArrays of every data dtype, a block-scaled one, plain leaves."""
    return {
        "f32": scaled_array(jnp.array([1.0, -2.0]), 2.0**-30),
        "f16": scaled_array(jnp.array([[0.5, 1.5]], jnp.float16), 2.0**20),
        "bf16": scaled_array(jnp.array([3.0], jnp.bfloat16), 0.0),
        "rows": ScaledArray(jnp.ones((2, 3), jnp.float16), jnp.array([[2.0], [0.5]])),
        "plain": jnp.arange(3.0),
        "n": jnp.array([1, 2], jnp.int32),
        "rate": 0.1,
        "none": None,
    }


def _assert_same_tree(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert jnp.asarray(a).dtype == jnp.asarray(b).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pack_scales_stacks_scalar_scales_and_round_trips():
    tree = _mixed_tree()
    packed = jtree.pack_scales(tree)
    assert isinstance(packed, jtree.PackedScales)
    assert packed.scales.dtype == jnp.float32
    np.testing.assert_array_equal(packed.scales, [0.0, 2.0**20, 2.0**-30])  # key order
    # Leaves crossing jit: 3 data arrays for 3 scalars + 1 vector; the block-scaled one
    # keeps its data and scale; plain leaves as they are.
    assert len(jax.tree_util.tree_leaves(packed)) == len(jax.tree_util.tree_leaves(tree)) - 2
    _assert_same_tree(jtree.unpack_scales(packed), tree)
    _assert_same_tree(packed.unpack(), tree)
    # Packing a tree that holds a PackedScales packs its ScaledArrays once.
    again = jtree.pack_scales({"inner": packed, "x": scaled_array(jnp.ones(2), 8.0)})
    np.testing.assert_array_equal(again.scales, [0.0, 2.0**20, 2.0**-30, 8.0])
    _assert_same_tree(
        jtree.unpack_scales(again), {"inner": tree, "x": scaled_array(jnp.ones(2), 8.0)}
    )
    # Abstract trees (`jax.eval_shape`): packed and unpacked as shapes.
    abstract = jax.eval_shape(lambda: packed)
    assert abstract.scales.shape == (3,)
    unpacked = jtree.unpack_scales(abstract)
    assert unpacked["f16"].scale.shape == () and unpacked["f16"].data.dtype == jnp.float16
    assert jtree.pack_scales(unpacked).scales == jax.ShapeDtypeStruct((3,), jnp.float32)
    # Nothing to pack: an empty vector.
    empty = jtree.pack_scales({"b": jnp.ones(2)})
    assert empty.scales.shape == (0,) and "0 scales" in repr(empty)
    assert jtree.unpack_scales([3, "x"]) == [3, "x"]


@pytest.mark.parametrize("count", [1, 8, 9, 21])
def test_pack_scales_under_jit_stacks_every_scale_exactly(count):
    """Traced scales are stacked in pieces (a chain of selects each): the same vector as
    eager packing, in order, extreme scales (0, float32's smallest subnormal and normal, its
    largest power of two, not powers of two) included."""
    special = [0.0, 2.0**-149, 2.0**-126, 2.0**127, 3.0, 1.5]
    tree = [
        scaled_array(jnp.full((2,), float(i), jnp.float16), special[i % 6] if i % 4 else 2.0**i)
        for i in range(count)
    ]
    eager = jtree.pack_scales(tree)
    traced = jax.jit(jtree.pack_scales)(tree)
    assert traced.scales.shape == (count,) and traced.scales.dtype == jnp.float32
    np.testing.assert_array_equal(traced.scales, eager.scales)
    _assert_same_tree(traced.unpack(), tree)


@pytest.mark.parametrize("count", [2, 31, 32, 33, 70])
def test_unpacking_under_jit_reads_every_scale_exactly(count):
    """Traced, a packed vector is split into its scales by one primitive (on XLA:CPU a
    variadic reduction per 32 scales, elsewhere slices): each scale as eager unpacking reads
    it, extreme scales included, in both lowerings."""
    from jax_scaled_arithmetics.core.datatype import unstack_scalars_p

    special = [0.0, 2.0**-149, 2.0**-126, 2.0**127, 3.0, 1.5]
    tree = [
        scaled_array(jnp.ones((2,), jnp.float16), special[i % 6] if i % 4 else 2.0 ** (i - 35))
        for i in range(count)
    ]
    packed = jtree.pack_scales(tree)
    read = jax.jit(lambda p: [x.scale for x in jtree.unpack_scales(p)])
    scales = read(packed)
    assert all(s.shape == () and s.dtype == jnp.float32 for s in scales)
    np.testing.assert_array_equal(np.stack(scales), packed.scales)
    np.testing.assert_array_equal(np.stack(unstack_scalars_p.impl(packed.scales)), packed.scales)
    traced = read.trace(packed)
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert cpu.count("stablehlo.reduce") == -(-count // 32)  # a reduction per 32 scales
    assert "stablehlo.reduce" not in cuda and cuda.count("stablehlo.slice") == count


def test_unpacked_scales_follow_vmap_and_gradients():
    vectors = jnp.array([[1.0, 2.0, 4.0], [8.0, 0.5, 0.25]])
    unpack = jax.vmap(
        lambda v: [x.scale for x in jtree.PackedScales([jnp.ones(2)] * 3, v, _three()).unpack()]
    )
    np.testing.assert_array_equal(np.stack(jax.jit(unpack)(vectors), axis=1), vectors)

    def represented_sum(v):
        tree = jtree.PackedScales([jnp.full(2, 3.0)] * 3, v, _three()).unpack()
        return sum(jnp.sum(x.to_array() ** 2) for x in tree)

    grads = jax.jit(jax.grad(represented_sum))(vectors[0])
    np.testing.assert_allclose(grads, 2 * 2 * 9.0 * vectors[0])


def _three():
    """A `PackedScales` layout: three ScaledArrays in a list."""
    tree = [scaled_array(jnp.ones(2), 1.0)] * 3
    return jtree.pack_scales(tree).layout


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's kernels")
def test_kernels_that_read_packed_scales_stay_alike():
    """XLA:CPU generates code once for alike kernels. A packed scale sliced out of its
    vector inside each kernel that reads it made those kernels differ by the index they
    read (24 distinct here; the zoo linen step packed had 360 distinct kernels against 220
    unpacked, its compile 1.2-1.8x longer); split by one primitive, they read a scalar
    each and stay alike (measured: 2 and 3 distinct against 1 and 2 unpacked)."""
    distinct_fusions = load_script("program_size", "benchmarks/program_size.py").distinct_fusions
    tree = [scaled_array(jnp.full((16,), i + 1.0, jnp.float16), 2.0**i) for i in range(24)]
    packed = jtree.pack_scales(tree)

    def values(t):
        return [x.to_array(jnp.float32) * 3.0 for x in t]

    scaled_step = jsa.autoscale(lambda t: [jnp.tanh(x) * 3.0 for x in t])  # unpacks itself

    def distinct(fun, arg):
        return distinct_fusions(jax.jit(fun).lower(arg).compile().as_text())[1]

    assert distinct(lambda p: values(jtree.unpack_scales(p)), packed) <= distinct(values, tree) + 4
    assert distinct(scaled_step, packed) <= distinct(scaled_step, tree) + 4
    _assert_same_tree(jax.jit(lambda p: values(jtree.unpack_scales(p)))(packed), values(tree))
    _assert_same_tree(jax.jit(scaled_step)(packed), jax.jit(scaled_step)(tree))


def test_packing_many_computed_scales_costs_no_kernel_per_scale():
    """XLA:CPU fuses the last computations of at most 8 scalars into the kernel that writes
    their vector: a `jnp.stack` of 24 computed scales left each one's last instructions a
    kernel of its own (97 kernels against 96 returning them unpacked); stacked in pieces of
    8, the step packing them has fewer kernels than the one returning them (73)."""
    tree = {
        f"w{i}": jsa.as_scaled_array(jnp.full((4, 8), float(i + 1)), dtype=jnp.float16)
        for i in range(24)
    }
    rescale = jsa.autoscale(
        lambda t: jax.tree.map(lambda x: jsa.ops.dynamic_rescale_max(x * 3.0), t)
    )

    def kernels(fun):
        text = jax.jit(fun).lower(tree).compile().as_text()
        entry = text[text.index("\nENTRY") : text.index("\n}", text.index("\nENTRY"))]
        return sum(" fusion(" in line or " concatenate(" in line for line in entry.splitlines())

    unpacked = kernels(rescale)
    packed = kernels(lambda t: jtree.pack_scales(rescale(t)))
    assert packed <= unpacked - 16, (packed, unpacked)
    values = jax.jit(lambda t: jtree.pack_scales(rescale(t)))(tree)
    _assert_same_tree(values.unpack(), jax.jit(rescale)(tree))


def test_packing_lowers_to_one_stack_for_a_gpu_and_to_select_chains_for_a_cpu():
    """XLA:GPU writes a `jnp.stack` of computed scales in one kernel, while select chains
    cost it a kernel per scale (the zoo linen step packed, compiled for an H200: 318 kernels
    against 372); XLA:CPU wants the chains (above). The lowering follows the platform."""
    tree = [scaled_array(jnp.full((2,), 1.0, jnp.float16), 2.0**i) for i in range(12)]
    doubled = jax.jit(lambda t: jtree.pack_scales([scaled_array(x.data, x.scale * 2) for x in t]))
    traced = doubled.trace(tree)

    def counts(platform):
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        return text.count("stablehlo.select"), text.count("stablehlo.concatenate")

    assert counts("cpu") == (10, 1)  # pieces of 8 and 4: 7 and 3 selects, concatenated
    assert counts("cuda") == (0, 1)  # one stack
    np.testing.assert_array_equal(doubled(tree).scales, [2.0 ** (i + 1) for i in range(12)])


def test_asarray_and_as_scaled_array_read_a_packed_tree_as_its_values():
    tree = _mixed_tree()
    packed = jtree.pack_scales(tree)
    _assert_same_tree(jtree.asarray(packed), jtree.asarray(tree))
    _assert_same_tree(jtree.as_scaled_array(packed), jtree.as_scaled_array(tree))
    # astype casts the data, never the float32 scale vector, and keeps the tree packed.
    cast = jtree.astype({"packed": packed}, jnp.bfloat16)["packed"]
    assert isinstance(cast, jtree.PackedScales) and cast.scales.dtype == jnp.float32
    _assert_same_tree(cast.unpack(), jtree.astype(tree, jnp.bfloat16))


def _train_step(params, x):
    def loss(p):
        return jnp.mean(jnp.tanh(x @ p["w"] + p["b"][None, :]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    params = jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grads)
    return params, value


def _params():
    rng = np.random.default_rng(3)
    return {
        "w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float16),
        "b": jnp.asarray(rng.normal(size=(4,)), jnp.float16),
    }


@pytest.mark.parametrize("data_dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("scale", [2.0**-40, 1.0, 2.0**30])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_a_packed_step_computes_what_the_scaled_step_computes(data_dtype, scale, jit):
    """Scales crossing `jit` as one vector: the same values as ScaledArrays crossing it."""
    params = jtree.as_scaled_array(jtree.astype(_params(), data_dtype), scale=scale)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(16, 8)), data_dtype)
    scaled = jax.jit(jsa.autoscale(_train_step)) if jit else jsa.autoscale(_train_step)

    def packed_step(packed, x):
        params, value = jsa.autoscale(_train_step)(packed, x)  # unpacked by autoscale
        return jtree.pack_scales(params), value

    packed_step = jax.jit(packed_step) if jit else packed_step
    want, got = params, jtree.pack_scales(params)
    for _ in range(3):
        want, want_loss = scaled(want, x)
        got, got_loss = packed_step(got, x)
        assert isinstance(got, jtree.PackedScales)
        _assert_same_tree(jtree.unpack_scales(got), want)
        np.testing.assert_array_equal(jnp.asarray(got_loss), jnp.asarray(want_loss))
    # The values are the plain step's on the represented values.
    plain = jtree.asarray(params)
    for _ in range(3):
        plain, _ = _train_step(plain, x)
    for name in plain:
        np.testing.assert_allclose(
            np.asarray(jtree.asarray(got)[name], np.float32),
            np.asarray(plain[name], np.float32),
            rtol=0.05,
            atol=0.05 * float(jnp.max(jnp.abs(plain[name].astype(jnp.float32)))),
        )


def test_a_jitted_packed_step_passes_one_scale_buffer_and_compiles_once():
    params = jtree.as_scaled_array(_params())
    x = jnp.ones((16, 8), jnp.float16)
    traces = []

    @jax.jit
    def step(packed, x):
        traces.append(1)
        params, value = jsa.autoscale(_train_step)(packed, x)
        return jtree.pack_scales(params), value

    packed = jtree.pack_scales(params)
    compiled = step.lower(packed, x).compile()
    # Arguments: w, b data, one scale vector, x (ScaledArrays would be 2 x 2 + 1).
    assert len(jax.tree_util.tree_leaves(compiled.args_info)) == 4
    # Results: w, b data, one scale vector, and the loss (a ScaledArray: data and scale).
    assert len(jax.tree_util.tree_leaves(compiled.out_info)) == 5
    packed, _ = step(packed, x)
    traced = len(traces)
    for _ in range(3):  # the packed results are arguments of the same structure: no retrace
        packed, _ = step(packed, x)
    assert len(traces) == traced


def test_autoscale_unpacks_packed_keyword_arguments_and_gradients_flow():
    packed = jtree.pack_scales({"w": scaled_array(jnp.array([1.0, 2.0], jnp.float16), 2.0**-20)})

    def f(scale_by, *, params):
        return (params["w"] * scale_by).sum()

    out = jsa.autoscale(f)(3.0, params=packed)
    assert isinstance(out, ScaledArray)
    assert float(out.to_array()) == pytest.approx(9.0 * 2.0**-20)
    grads = jsa.autoscale(jax.grad(lambda p: (p["w"] ** 2).sum()))(packed)
    np.testing.assert_allclose(jtree.asarray(grads)["w"], [2.0 * 2.0**-20, 4.0 * 2.0**-20])
