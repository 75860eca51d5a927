"""NVFP4 (`jsa.quantization.nvfp4_quantize`): bit-exact against a NumPy reference written
from the format's arithmetic, special blocks, stochastic rounding unbiased."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.quantization import (
    NVFP4Array,
    block_dequantize,
    block_fake_quantize,
    block_quantize,
    nvfp4_dequantize,
    nvfp4_fake_quantize,
    nvfp4_quantize,
)

F32 = np.float32


def ref_nvfp4(x: np.ndarray, block_size: int = 16):
    """(elements as float32, block scales as float32 (NaN for special blocks), tensor scale,
    dequantized) along the last axis, in float32 arithmetic with ml_dtypes' roundings."""
    blocks = x.astype(F32).reshape(*x.shape[:-1], -1, block_size)
    finite = np.isfinite(blocks)
    magnitude = np.where(finite, np.abs(blocks), F32(0))
    amax = magnitude.max()
    if amax == 0:
        t = F32(1)
    else:
        t = max(F32(amax * F32(1 / 2688)), F32(2.0**-126))
    special = ~finite.all(axis=-1, keepdims=True)
    ratio = np.minimum(magnitude.max(axis=-1, keepdims=True) / (t * F32(6)), F32(448))
    scales = ratio.astype(ml_dtypes.float8_e4m3fn).astype(F32)
    denominator = scales * t
    with np.errstate(all="ignore"):
        scaled = np.where(special | (denominator == 0), F32(0), blocks / denominator)
    elements = np.clip(scaled, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(F32)
    deq = np.where(special, np.nan, elements * denominator).astype(F32)
    scales = np.where(special, np.nan, scales)[..., 0]
    return elements.reshape(x.shape), scales, t, deq.reshape(x.shape)


def inputs(seed: int) -> np.ndarray:
    """131,072 values: blocks of very different magnitudes and the special cases."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4096, 32)) * np.exp2(rng.uniform(-40, 20, (4096, 1)))
    x[::5] *= np.exp2(rng.uniform(-12, 0, x[::5].shape))  # wide ranges inside a block
    x = x.astype(F32)
    x[0] = 0.0  # zero blocks
    x[1, :16] = 3.0  # all equal
    x[2] = np.linspace(-6.0, 6.0, 32) * 2.0**10  # E2M1 grid points, ties
    x[3, 16:] = np.float32(1e-44)  # subnormal float32
    return x


def _bits(a) -> np.ndarray:
    return np.asarray(a, F32).view(np.uint32)


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference_bit_for_bit(seed):
    x = inputs(seed)
    q = nvfp4_quantize(jnp.asarray(x))
    elements, scales, t, deq = ref_nvfp4(x)
    assert q.data.dtype == ml_dtypes.float4_e2m1fn and q.scale.dtype == ml_dtypes.float8_e4m3fn
    assert q.scale.shape == (4096, 2) and q.tensor_scale.dtype == F32
    assert _bits(q.tensor_scale) == _bits(t)
    np.testing.assert_array_equal(_bits(q.data.astype(jnp.float32)), _bits(elements))
    np.testing.assert_array_equal(_bits(q.scale.astype(jnp.float32)), _bits(scales))
    np.testing.assert_array_equal(_bits(nvfp4_dequantize(q)), _bits(deq))
    np.testing.assert_array_equal(_bits(nvfp4_fake_quantize(jnp.asarray(x))), _bits(deq))


def test_special_tensors_and_blocks():
    zeros = nvfp4_quantize(jnp.zeros((2, 16)))
    assert float(zeros.tensor_scale) == 1.0 and not np.any(np.asarray(zeros.dequantize()))
    x = np.ones((4, 16), F32)
    x[1, 3], x[2, 0], x[3, 5] = np.nan, np.inf, -np.inf
    out = np.asarray(nvfp4_fake_quantize(jnp.asarray(x)))
    assert np.isnan(out[1:]).all() and np.array_equal(out[0], np.ones(16))
    assert float(nvfp4_quantize(jnp.asarray(x)).tensor_scale) == np.float32(1 / 2688)
    # A block far below the tensor's largest: its E4M3 scale underflows, it flushes to 0.
    far = np.concatenate([np.ones(16, F32), np.full(16, 1e-6, F32)])
    assert not np.any(np.asarray(nvfp4_fake_quantize(jnp.asarray(far)))[16:])
    # Small and huge tensors keep their values as well as NVFP4 can (below ~2^-100, block
    # scales times the tensor scale are float32 subnormals, which XLA:CPU flushes).
    for scale in (2.0**-100, 2.0**120):
        y = (np.linspace(0.5, 6.0, 16) * scale).astype(F32)
        np.testing.assert_array_equal(
            _bits(nvfp4_fake_quantize(jnp.asarray(y))), _bits(ref_nvfp4(y)[3])
        )


def test_axis_and_jit():
    x = inputs(3)[:64].reshape(4, 16, 32)
    along = nvfp4_quantize(jnp.asarray(x), axis=1)
    assert along.axis == -2 and along.scale.shape == (4, 1, 32)
    moved = np.moveaxis(x, 1, -1)
    np.testing.assert_array_equal(
        _bits(np.moveaxis(np.asarray(along.dequantize()), 1, -1)), _bits(ref_nvfp4(moved)[3])
    )
    jitted = jax.jit(lambda v: nvfp4_quantize(v, axis=1))(jnp.asarray(x))
    np.testing.assert_array_equal(_bits(jitted.dequantize()), _bits(along.dequantize()))


def test_stochastic_rounding_is_unbiased():
    rng = np.random.default_rng(5)
    x = rng.uniform(-5.5, 5.5, (1, 64)).astype(F32)
    x[0, 0] = 6.0  # the block scale of the first block is exactly 448 * t = 1
    keys = jax.random.split(jax.random.key(0), 2000)
    draws = jax.vmap(lambda k: nvfp4_fake_quantize(jnp.asarray(x), rounding="stochastic", key=k))(
        keys
    )
    draws = np.asarray(draws, np.float64)[:, 0, :16]
    error = draws.mean(axis=0) - x[0, :16]
    standard_error = draws.std(axis=0) / np.sqrt(len(keys)) + 1e-12
    assert np.all(np.abs(error) <= 3.5 * standard_error + 1e-6), error / standard_error
    nearest = np.asarray(nvfp4_fake_quantize(jnp.asarray(x)))[0, :16]
    assert not np.allclose(draws[0], nearest)  # it does round differently


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"block_size": 12}, ValueError, "axis 1 has 32 entries, not a multiple of the block"),
        ({"axis": 2}, ValueError, "axis 2 is out of range for an array of rank 2"),
        ({"rounding": "toward_zero"}, ValueError, "round 'nearest' or 'stochastic'"),
        ({"rounding": "stochastic"}, ValueError, "needs a PRNG key"),
        ({"block_size": 0}, ValueError, "block_size must be a positive integer"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        nvfp4_quantize(jnp.ones((2, 32)), **kwargs)


def test_non_float_inputs_are_refused():
    with pytest.raises(TypeError, match="float inputs up to 32 bits, got int32"):
        nvfp4_quantize(jnp.ones((2, 16), jnp.int32))


def _tiled(x: np.ndarray, r: int, c: int) -> np.ndarray:
    m, n = x.shape
    return x.reshape(m // r, r, n // c, c).swapaxes(1, 2).reshape(m // r, n // c, r * c)


@pytest.mark.slow
def test_2d_blocks_match_reference_and_commute_with_transposition():
    w = inputs(4)[:64].reshape(64, 32)  # 4 x 2 tiles of 16 x 16
    q = nvfp4_quantize(jnp.asarray(w), block_size=(16, 16))
    assert q.block_shape == (16, 16) and q.block_size == 256 and q.scale.shape == (4, 2)
    # The reference on each 16 x 16 tile flattened into one block of 256.
    elements, scales, t, deq = ref_nvfp4(_tiled(w, 16, 16).reshape(8, 256), 256)
    assert _bits(q.tensor_scale) == _bits(t)
    np.testing.assert_array_equal(_bits(q.scale.astype(jnp.float32)).ravel(), _bits(scales).ravel())
    np.testing.assert_array_equal(
        _bits(_tiled(np.asarray(q.dequantize()), 16, 16).reshape(8, 256)), _bits(deq)
    )
    transposed = nvfp4_fake_quantize(jnp.asarray(w.T), block_size=(16, 16))
    np.testing.assert_array_equal(_bits(transposed), _bits(np.asarray(q.dequantize()).T))
    # 1D blocks do not commute so: the point of 2D blocks for weights.
    one_d = np.asarray(nvfp4_fake_quantize(jnp.asarray(w)))
    assert not np.array_equal(one_d.T, np.asarray(nvfp4_fake_quantize(jnp.asarray(w.T))))
    # Batch dimensions in front (stacked layers).
    stacked = nvfp4_quantize(jnp.asarray(np.stack([w, 2 * w])), block_size=(16, 16))
    assert stacked.scale.shape == (2, 4, 2)
    np.testing.assert_array_equal(_bits(stacked.dequantize()[0]), _bits(q.dequantize()))


@pytest.mark.parametrize(
    "x_shape, kwargs, match",
    [
        ((32,), {"block_size": (16, 16)}, "need an array of rank 2 or more and axis=-1"),
        ((32, 32), {"block_size": (16, 16), "axis": 0}, "and axis=-1, got rank 2 and axis 0"),
        ((24, 32), {"block_size": (16, 16)}, "axis 0 has 24 entries, not a multiple of the block"),
        ((32, 32), {"block_size": (16, 0)}, "a positive integer or a pair of them"),
    ],
)
def test_bad_2d_blocks_are_refused(x_shape, kwargs, match):
    with pytest.raises(ValueError, match=match):
        nvfp4_quantize(jnp.ones(x_shape), **kwargs)


@pytest.mark.parametrize("block_size, axis", [(None, -1), (16, 0), ((16, 16), -1)])
def test_block_api_entry_is_nvfp4(block_size, axis):
    """`block_quantize` / `block_fake_quantize` / `block_dequantize` with format="nvfp4"."""
    x = jnp.asarray(inputs(5)[:64])
    kwargs = {} if block_size is None else {"block_size": block_size}
    q = block_quantize(x, "nvfp4", axis=axis, **kwargs)
    direct = nvfp4_quantize(x, axis=axis, block_size=16 if block_size is None else block_size)
    assert isinstance(q, NVFP4Array) and q.block_shape == direct.block_shape
    np.testing.assert_array_equal(_bits(block_dequantize(q)), _bits(direct.dequantize()))
    fake = block_fake_quantize(x, "nvfp4", axis=axis, **kwargs)
    np.testing.assert_array_equal(_bits(fake), _bits(direct.dequantize()))


def test_block_api_refuses_what_nvfp4_does_not_have():
    x = jnp.ones((16, 32))
    with pytest.raises(ValueError, match="nvfp4 does not pad"):
        block_quantize(x, "nvfp4", pad=True)
    with pytest.raises(ValueError, match="nvfp4 block scales round to the nearest E4M3"):
        block_fake_quantize(x, "nvfp4", scale_rounding="up")
    with pytest.raises(TypeError, match="expects an MXArray or NVFP4Array, got ndarray"):
        block_dequantize(np.ones(3))


@pytest.mark.parametrize("block_size", [16, (16, 16)])
def test_scaled_array_view_computes_under_autoscale(block_size):
    """The view's values are the dequantized ones; a matmul on two views under autoscale
    is the matmul of the dequantized operands (block scales applied by the dot rule)."""
    rng = np.random.default_rng(6)
    a = jnp.asarray(rng.standard_normal((32, 64)).astype(F32) * 1e-3)
    b = jnp.asarray(rng.standard_normal((64, 32)).astype(F32) * 1e3)
    qa = nvfp4_quantize(a, block_size=block_size)
    qb = nvfp4_quantize(b.T, block_size=block_size)  # blocks along the contraction
    sa, sb = qa.to_scaled_array(), qb.to_scaled_array()
    assert sa.data.dtype == ml_dtypes.float4_e2m1fn
    np.testing.assert_array_equal(_bits(sa.to_array(jnp.float32)), _bits(qa.dequantize()))

    def matmul(u, v):
        return u.astype(jnp.float32) @ v.astype(jnp.float32).T

    got = jax.jit(jsa.autoscale(matmul))(sa, sb)
    assert isinstance(got, jsa.ScaledArray)
    expected = np.asarray(qa.dequantize(), np.float64) @ np.asarray(qb.dequantize(), np.float64).T
    # As accurate as float32 on the dequantized values (its sums of 64 products round too).
    plain_error = np.abs(np.asarray(matmul(qa.dequantize(), qb.dequantize())) - expected).max()
    assert plain_error < 1e-4
    np.testing.assert_allclose(got.to_array(jnp.float32), expected, rtol=0, atol=2 * plain_error)
