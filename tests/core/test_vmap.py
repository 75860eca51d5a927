"""`jsa.vmap`: mapping ScaledArrays without `in_axes` ceremony."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from tests import helpers

USE_JIT = [False, True]


def _values(x):
    return np.asarray(x.data, np.float64) * np.asarray(x.scale, np.float64)


def _row_fn(row, w):
    return jnp.tanh(row @ w) * 2.0 + jnp.sum(row)


# The default run: every (autoscaled, dtype), (autoscaled, jit) and (dtype, jit) pair; the
# slow step runs the whole product.
MAP_CASES = [
    (autoscaled, dtype, use_jit)
    for autoscaled in [False, True]
    for dtype in [np.float32, np.float16, jnp.bfloat16]
    for use_jit in USE_JIT
]


@pytest.mark.parametrize(
    "autoscaled, dtype, use_jit",
    helpers.pairwise_params(MAP_CASES),
    ids=[f"{a}-{np.dtype(d).name}-{j}" for a, d, j in MAP_CASES],
)
def test_vmap_maps_data_and_shares_the_scale(autoscaled, dtype, use_jit):
    rng = np.random.default_rng(0)
    x = jsa.scaled_array(rng.normal(size=(5, 8)).astype(dtype), np.float32(2.0**-20))
    w = jsa.scaled_array(rng.normal(size=(8, 3)).astype(dtype), np.float32(2.0**12))
    fn = (
        jsa.autoscale(_row_fn) if autoscaled else (lambda r, w: _row_fn(r.to_array(), w.to_array()))
    )
    batched = jsa.vmap(fn, in_axes=(0, None))
    out = (jax.jit(batched) if use_jit else batched)(x, w)
    want = jax.vmap(_row_fn, in_axes=(0, None))(
        jnp.asarray(_values(x), jnp.float32), jnp.asarray(_values(w), jnp.float32)
    )
    if autoscaled:
        assert isinstance(out, jsa.ScaledArray) and np.ndim(out.scale) == 0
        rtol = {np.float32: 1e-5, np.float16: 4e-3}.get(dtype, 3e-2)
        np.testing.assert_allclose(
            _values(out), want, rtol=rtol, atol=rtol * float(jnp.abs(want).max())
        )
    else:  # a plain function of ScaledArrays: what jax.vmap computes with explicit axes
        explicit = jax.vmap(fn, in_axes=(jsa.ScaledArray(0, None), None))(x, w)  # type: ignore[arg-type]
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(explicit, np.float32))


def test_vmap_default_in_axes_maps_every_argument():
    x = jsa.as_scaled_array(jnp.arange(6.0).reshape(3, 2), scale=4.0)
    out = jsa.vmap(jsa.autoscale(lambda a, b: a * b))(x, x)
    np.testing.assert_array_equal(np.asarray(out.to_array()), np.arange(6.0).reshape(3, 2) ** 2)


def test_vmap_maps_keyword_arguments_along_axis_0():
    x = jsa.as_scaled_array(jnp.arange(6.0).reshape(3, 2), scale=0.5)
    out = jsa.vmap(jsa.autoscale(lambda a, *, b: a + b))(x, b=x)
    np.testing.assert_array_equal(np.asarray(out.to_array()), 2 * np.arange(6.0).reshape(3, 2))


def test_vmap_out_axes_moves_the_data_axis():
    x = jsa.as_scaled_array(jnp.arange(6.0).reshape(3, 2))
    out = jsa.vmap(jsa.autoscale(lambda row: (row * 2.0, jnp.sum(row))), out_axes=(1, 0))(x)
    assert out[0].shape == (2, 3) and np.ndim(out[0].scale) == 0
    np.testing.assert_array_equal(
        np.asarray(out[0].to_array()), 2.0 * np.arange(6.0).reshape(3, 2).T
    )
    np.testing.assert_array_equal(np.asarray(out[1].to_array()), [1.0, 5.0, 9.0])


def test_vmap_per_example_scales_come_out_at_the_largest():
    x = jsa.as_scaled_array(jnp.ones((3, 2)))
    scales = jnp.array([2.0**-10, 2.0**5, 1.0], jnp.float32)
    # Each example rescaled by its own scale: the scale is batched inside the function.
    out = jsa.vmap(lambda row, s: jsa.ScaledArray(row.data, row.scale * s))(x, scales)
    assert np.ndim(out.scale) == 0 and float(out.scale) == 2.0**5
    np.testing.assert_array_equal(
        np.asarray(out.to_array()), np.repeat(np.asarray(scales)[:, None], 2, axis=1)
    )


def test_vmap_under_grad_and_in_pytrees():
    params = {"w": jsa.as_scaled_array(jnp.full((4, 2), 0.5)), "b": jnp.zeros(2)}
    # tanh's arguments stay below 2: at 11 and 19 (inputs arange(12)) 1 - tanh^2 is below
    # float32's resolution, and what both sides computed for it was tanh's rounding error.
    xs = jsa.as_scaled_array(jnp.arange(12.0).reshape(3, 4) / 12.0)

    def loss(params, x):
        return jnp.sum(jnp.tanh(x @ params["w"] + params["b"]))

    def batch_loss(params, xs):
        return jnp.sum(jsa.vmap(loss, in_axes=(None, 0))(params, xs))

    g = jax.jit(jsa.autoscale(jax.grad(batch_loss)))(params, xs)
    plain = {"w": jnp.full((4, 2), 0.5), "b": jnp.zeros(2)}
    want = jax.grad(lambda p: jnp.sum(jax.vmap(loss, in_axes=(None, 0))(p, xs.to_array())))(plain)
    np.testing.assert_allclose(np.asarray(jsa.asarray(g["w"])), want["w"], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(jsa.asarray(g["b"])), want["b"], rtol=1e-5, atol=1e-7)


def test_scaled_axes_for_jax_vmap():
    x = jsa.as_scaled_array(jnp.ones((3, 2)), scale=2.0)
    axes = jsa.scaled_axes({"x": x, "n": jnp.arange(3)})
    assert axes["x"].data == 0 and axes["x"].scale is None and axes["n"] == 0
    out = jax.vmap(jsa.autoscale(lambda t: t["x"] * 3.0), in_axes=(axes,), out_axes=axes["x"])(
        {"x": x, "n": jnp.arange(3)}
    )
    np.testing.assert_array_equal(np.asarray(out.to_array()), np.full((3, 2), 3.0))


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_vmap_of_a_packed_tree_maps_the_data_and_shares_the_scales(use_jit):
    """A tree packed with `jsa.tree.pack_scales`: the data arrays mapped, the scale vector
    (one scalar per tensor) shared, as for the unpacked tree."""
    rng = np.random.default_rng(0)
    tree = {
        "a": jsa.as_scaled_array(jnp.asarray(rng.normal(size=(4, 3)), jnp.float16), scale=2.0**-20),
        "b": jsa.as_scaled_array(jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), scale=8.0),
        "rows": jsa.as_scaled_array(jnp.ones((4, 3)), scale_shape=(4, 1)),
    }
    packed = jsa.tree.pack_scales(tree)
    axes = jsa.scaled_axes(packed)
    assert isinstance(axes, jsa.tree.PackedScales) and axes.scales is None
    fun = jsa.vmap(jsa.autoscale(lambda t: (t["a"] * t["b"]).sum() + t["rows"].sum()))
    fun = jax.jit(fun) if use_jit else fun
    got, want = fun(packed), fun(tree)
    np.testing.assert_array_equal(np.asarray(jsa.asarray(got)), np.asarray(jsa.asarray(want)))
    assert got.shape == (4,)


def test_vmap_explicit_scaled_array_axes_are_kept():
    x = jsa.as_scaled_array(jnp.ones((3, 2)), scale=2.0)
    out = jsa.vmap(jsa.autoscale(lambda t: t + 1.0), in_axes=(jsa.ScaledArray(0, None),))(x)
    np.testing.assert_array_equal(np.asarray(out.to_array()), np.full((3, 2), 2.0))


def test_vmap_wrong_number_of_in_axes():
    x = jsa.as_scaled_array(jnp.ones((3, 2)))
    with pytest.raises(ValueError, match="in_axes has 2 entries for 1 positional arguments"):
        jsa.vmap(lambda a: a, in_axes=(0, 0))(x)


def test_plain_jax_vmap_needs_the_axes():
    """What `jsa.vmap` saves: `jax.vmap` maps the scalar scale too, and fails."""
    x = jsa.as_scaled_array(jnp.ones((3, 2)))
    with pytest.raises(ValueError, match="axis 0"):
        jax.vmap(jsa.autoscale(lambda t: t * 2.0))(x)
