"""Tests of `jsa.tree`: pytree utilities treating a ScaledArray as one leaf."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics.tree as jtree
from jax_scaled_arithmetics.core.datatype import ScaledArray, scaled_array


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
        ]
    )
    for name in jtree.__all__:
        assert callable(getattr(jtree, name))
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
