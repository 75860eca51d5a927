"""Random Hadamard transforms (`jsa.quantization.random_hadamard`): orthogonal, invertible,
products unchanged, outliers spread; under jit, grad, vmap and autoscale."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.quantization import (
    hadamard_matrix,
    inverse_random_hadamard,
    random_hadamard,
)
from tests import helpers
from tests.helpers import WIDE_SCALES

KEY = jax.random.key(7)
RNG = np.random.default_rng(0)
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
TOL = {np.float32: 2e-6, np.float16: 2e-3, ml_dtypes.bfloat16: 1.6e-2}


def _matrix(size, key):
    """The transform's matrix T, read off the transformed identity (rows are e_i @ T)."""
    return np.asarray(random_hadamard(jnp.eye(size), axis=1, key=key, size=size))


@pytest.mark.parametrize("size", [1, 2, 4, 16, 64])
def test_the_hadamard_matrix(size):
    h = hadamard_matrix(size)
    assert set(np.unique(h)) <= {-1.0, 1.0}
    np.testing.assert_array_equal(h, h.T)
    np.testing.assert_array_equal(h @ h.T, size * np.eye(size))


@pytest.mark.parametrize("size", [2, 4, 16, 32])
@pytest.mark.parametrize("key", [None, KEY], ids=["plain", "random"])
def test_the_transform_is_orthogonal_and_defined_by_the_formula(size, key):
    t = _matrix(size, key)
    np.testing.assert_allclose(t @ t.T, np.eye(size), atol=1e-6)
    signs = np.ones(size) if key is None else np.asarray(jax.random.rademacher(key, (size,)))
    np.testing.assert_allclose(t, np.diag(signs) @ hadamard_matrix(size) / np.sqrt(size), atol=1e-7)


def test_every_block_gets_the_same_transform_along_any_axis():
    x = RNG.normal(size=(3, 32, 5)).astype(np.float32)
    y = np.asarray(random_hadamard(x, axis=1, key=KEY, size=8))
    t = _matrix(8, KEY)
    blocks = np.moveaxis(x, 1, -1).reshape(3, 5, 4, 8)
    expected = np.moveaxis((blocks @ t).reshape(3, 5, 32), -1, 1)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(random_hadamard(x, -2, KEY, 8), y)


def test_keys_draw_new_signs():
    assert not np.allclose(_matrix(16, jax.random.key(1)), _matrix(16, jax.random.key(2)))
    np.testing.assert_array_equal(_matrix(16, jax.random.key(1)), _matrix(16, jax.random.key(1)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inverse_and_products_unchanged(dtype):
    a = RNG.normal(size=(8, 64)).astype(dtype)
    b = RNG.normal(size=(64, 6)).astype(dtype)
    ra, rb = random_hadamard(a, 1, KEY), random_hadamard(b, 0, KEY)
    assert ra.dtype == dtype and rb.dtype == dtype
    exact = a.astype(np.float64) @ b.astype(np.float64)
    got = np.asarray(ra, np.float64) @ np.asarray(rb, np.float64)
    # The transformed operands are rounded once to the dtype: a few ulps of the product.
    np.testing.assert_allclose(got, exact, atol=16 * TOL[dtype] * np.abs(exact).max())
    back = np.asarray(inverse_random_hadamard(ra, 1, KEY), np.float32)
    np.testing.assert_allclose(back, a.astype(np.float32), atol=4 * TOL[dtype] * np.abs(a).max())


def test_outliers_are_spread_over_their_block():
    x = np.zeros((4, 64), np.float32)
    x[np.arange(4), [3, 17, 40, 63]] = [1e4, -3e3, 5.0, 2e2]
    y = np.asarray(random_hadamard(x, key=KEY, size=16))
    for row, value, col in zip(y, [1e4, -3e3, 5.0, 2e2], [3, 17, 40, 63], strict=True):
        block = row[col // 16 * 16 : col // 16 * 16 + 16]
        np.testing.assert_allclose(np.abs(block), abs(value) / 4, rtol=1e-6)
        assert np.count_nonzero(row) == 16  # other blocks stay zero


def test_jit_vmap_and_gradient():
    x = RNG.normal(size=(4, 32)).astype(np.float32)
    w = RNG.normal(size=(4, 32)).astype(np.float32)

    def loss(v, key):
        return jnp.sum(random_hadamard(v, key=key) * w)

    np.testing.assert_allclose(
        jax.jit(random_hadamard, static_argnums=(1, 3))(x, -1, KEY, 16), random_hadamard(x, key=KEY)
    )
    keys = jax.random.split(KEY, 4)
    mapped = jax.vmap(lambda v, k: random_hadamard(v, key=k))(x, keys)
    for i in range(4):
        np.testing.assert_allclose(mapped[i], random_hadamard(x[i], key=keys[i]), atol=1e-6)
    # Linear and orthogonal: the gradient is the inverse transform of the cotangent.
    grad = jax.jit(jax.grad(loss))(x, KEY)
    np.testing.assert_allclose(grad, inverse_random_hadamard(w, key=KEY), atol=1e-6)


# Built once: the cases share the compiled programs of a dtype (the scale is a value).
_SCALED_HADAMARD = jsa.autoscale(lambda v: random_hadamard(v, key=KEY))
_SCALED_HADAMARD_JIT = jax.jit(_SCALED_HADAMARD)


@pytest.mark.parametrize(
    "dtype, scale, jit",
    # Every pair of (dtype, scale, jit) values by default; the whole product in the slow step.
    helpers.pairwise_params(
        [(d, s, j) for d in DTYPES for s in WIDE_SCALES[::2] for j in (True, False)]
    ),
)
def test_inside_autoscale_matches_plain(dtype, scale, jit):
    x = jsa.as_scaled_array(RNG.normal(size=(4, 32)).astype(np.float32), dtype=dtype)
    x = jsa.scaled_array(x.data, np.float32(scale) * x.scale)
    out = (_SCALED_HADAMARD_JIT if jit else _SCALED_HADAMARD)(x)
    assert isinstance(out, jsa.ScaledArray) and out.dtype == dtype
    ref = np.asarray(random_hadamard(x.to_array(jnp.float32), key=KEY))
    got = np.asarray(out.to_array(jnp.float32))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=4 * TOL[dtype] * np.abs(ref).max())


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"size": 12}, ValueError, "size must be a power of two, got 12"),
        ({"size": 0}, ValueError, "size must be a positive power of two"),
        ({"size": 64}, ValueError, "axis 1 has 48 entries, not a multiple of the block size 64"),
        ({"axis": 2}, ValueError, "axis 2 is out of range for an array of rank 2"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        random_hadamard(jnp.ones((2, 48)), **kwargs)


def test_non_floating_and_scalar_inputs_are_refused():
    with pytest.raises(TypeError, match="needs floating input, got int32"):
        random_hadamard(jnp.ones((2, 16), jnp.int32))
    with pytest.raises(ValueError, match="at least one axis"):
        random_hadamard(jnp.float32(1.0), size=1)


def test_the_formats_doc_example_runs():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "formats.md").read_text()
    section = text.split("## Random Hadamard transforms", 1)[1]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)[:1]
    exec(compile(block, "docs/formats.md", "exec"), {})


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_inputs_are_transformed_in_float32(dtype):
    """FP8 data (which JAX promotes implicitly to nothing) is transformed in float32 and
    rounded once to its format: the same as the float32 transform of its values."""
    import ml_dtypes

    dtype = np.dtype(getattr(ml_dtypes, dtype))
    a = RNG.normal(size=(4, 32)).astype(dtype)
    got = random_hadamard(a, 1, KEY)
    assert got.dtype == dtype
    want = np.asarray(random_hadamard(a.astype(np.float32), 1, KEY)).astype(dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32), want.astype(np.float32))
    back = inverse_random_hadamard(got, 1, KEY)
    assert back.dtype == dtype
