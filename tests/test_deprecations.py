"""Moved and renamed public names keep working for one minor release, with a
`DeprecationWarning` that names the new name (CONTRIBUTING.md, "Deprecations")."""

from __future__ import annotations

import pytest

import jax_scaled_arithmetics as jsa
import jax_scaled_arithmetics.unit_scaling as U


@pytest.mark.parametrize("name", ["simulate_fp8", "simulate_fp4"])
def test_simulate_transforms_moved_to_ops(name):
    with pytest.warns(DeprecationWarning, match=rf"jsa.unit_scaling.{name} .* use jsa.ops.{name}"):
        old = getattr(U, name)
    assert old is getattr(jsa.ops, name)
    assert name not in U.__all__ and name in jsa.ops.__all__


def test_a_missing_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'simulate_fp16'"):
        U.simulate_fp16  # noqa: B018


def test_block_scaled_arrays_name_their_scale_scale():
    """MXArray and NVFP4Array use ScaledArray's vocabulary: `data` and `scale` (NVFP4's
    second level is `tensor_scale`); the old field names warn and read the same array."""
    import jax.numpy as jnp

    x = jnp.linspace(-1.0, 1.0, 32)
    mx = jsa.quantization.block_quantize(x, "mxfp8", block_size=16)
    nv = jsa.quantization.block_quantize(x, "nvfp4")
    assert mx.scale.shape == (2,) and nv.scale.shape == (2,)
    with pytest.warns(
        DeprecationWarning, match=r"MXArray.scales .* use jsa.quantization.MXArray.scale"
    ):
        assert mx.scales is mx.scale
    with pytest.warns(
        DeprecationWarning,
        match=r"NVFP4Array.block_scales .* use jsa.quantization.NVFP4Array.scale",
    ):
        assert nv.block_scales is nv.scale


def test_fixed_point_clamp_is_saturate():
    import jax.numpy as jnp
    import numpy as np

    x = jnp.array([0.3, 9.0, -9.0])
    with pytest.warns(
        DeprecationWarning, match=r"clamp=\.\.\.\) .* fixed_point_quantize\(saturate"
    ):
        old = jsa.quantization.fixed_point_quantize(x, 8, 4, clamp=False)
    np.testing.assert_array_equal(
        old, jsa.quantization.fixed_point_quantize(x, 8, 4, saturate=False)
    )
    np.testing.assert_array_equal(old, [0.3125, 9.0, -9.0])
