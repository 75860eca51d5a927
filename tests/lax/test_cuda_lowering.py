"""FP8 matmuls of ScaledArrays reach CUDA as FP8 `dot_general`s (lowered on this CPU).

On Hopper and newer GPUs XLA runs a `dot_general` whose operands are FP8 and whose result
is float32 as a cuBLASLt FP8 GEMM. Lowering for CUDA needs no GPU: these tests keep the
scaled programs in that form, forward and backward, for a plain matmul of FP8
ScaledArrays under `autoscale` and for `jsa.ops.simulate_fp8` over FP8 ScaledArrays; and
the block-scaled matmuls (`jax.lax.scaled_dot`, `jax.nn.scaled_matmul`) of FP8 ScaledArrays
with e8m0 block scales keep the op XLA or cuDNN runs as a block-scaled GEMM.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa

RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 32)).astype(np.float32)
W = RNG.normal(size=(32, 8)).astype(np.float32)
FP8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def _cuda_dots(fun, *args):
    """(operand types, result type) of every `dot_general` of `jax.jit(fun)` lowered for
    CUDA."""
    text = jax.jit(fun).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    lines = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    return [re.search(r": \((.*)\) -> (tensor<[^>]*>)", line).groups() for line in lines]


def _loss(matmul):
    return lambda x, w: jnp.sum(matmul(x, w).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("fmt", FP8, ids=str)
@pytest.mark.parametrize(
    "name, matmul",
    [("matmul", lambda x, w: x @ w), ("simulate_fp8", jsa.ops.simulate_fp8(lambda x, w: x @ w))],
    ids=["matmul", "simulate_fp8"],
)
def test_fp8_scaled_matmul_is_an_fp8_dot_forward_and_backward(name, matmul, fmt):
    x = jsa.as_scaled_array(X, dtype=FP8[fmt])
    w = jsa.as_scaled_array(W, dtype=FP8[fmt])
    f8 = str(jnp.dtype(FP8[fmt]).name)
    mlir_f8 = {"float8_e4m3fn": "f8E4M3FN", "float8_e5m2": "f8E5M2"}[f8]
    forward = _cuda_dots(jsa.autoscale(matmul), x, w)
    backward = _cuda_dots(jsa.autoscale(jax.grad(_loss(matmul), argnums=(0, 1))), x, w)
    assert len(forward) == 1 and len(backward) == 3  # y = x w; then y, dx and dw
    for operands, result in forward + backward:
        assert operands.count(f"x{mlir_f8}>") == 2, (name, operands)
        assert result.endswith("xf32>"), (name, result)
    # The values: the product of the values, stored in FP8 data (each entry within half an
    # ulp of its format: 2^-4 relative in E4M3, 2^-3 in E5M2; bounded here at twice that).
    got = jsa.autoscale(matmul)(x, w).to_array(np.float32)
    want = jsa.asarray(x, jnp.float32) @ jsa.asarray(w, jnp.float32)
    rtol = {"e4m3": 2.0**-3, "e5m2": 2.0**-2}[fmt]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=2.0**-8 * float(jnp.abs(want).max()))


def test_block_scaled_matmuls_keep_fp8_data_and_e8m0_scales_for_cuda():
    """`jax.lax.scaled_dot` lowers to XLA's `xla.scaled_dot` composite and
    `jax.nn.scaled_matmul` to cuDNN's `__op$block_scaled_dot` custom call: under autoscale,
    both over the FP8 data and the e8m0 block scales, with a float32 result."""
    e4m3, e8m0 = jnp.float8_e4m3fn, jnp.float8_e8m0fnu
    cases = {
        "xla.scaled_dot": (
            lambda u, v, su, sv: jax.lax.scaled_dot(u, v, lhs_scale=su, rhs_scale=sv),
            ((4, 64), (64, 8), (4, 2), (2, 8)),
        ),
        "__op$block_scaled_dot": (
            jax.nn.scaled_matmul,
            ((1, 4, 64), (1, 8, 64), (1, 4, 2), (1, 8, 2)),
        ),
    }
    for op, (fun, shapes) in cases.items():
        a = jsa.scaled_array(jnp.ones(shapes[0], e4m3), np.float32(2.0**-20))
        b = jsa.scaled_array(jnp.ones(shapes[1], e4m3), np.float32(2.0**7))
        blocks = [jnp.ones(shape, e8m0) for shape in shapes[2:]]
        lowered = (
            jax.jit(jsa.autoscale(fun)).trace(a, b, *blocks).lower(lowering_platforms=("cuda",))
        )
        kinds = ("stablehlo.composite", "stablehlo.custom_call")
        text = lowered.as_text().splitlines()
        (line,) = [ln for ln in text if op in ln and any(k in ln for k in kinds)]
        operands, result = re.search(r": \((.*)\) -> (tensor<[^>]*>)", line).groups()
        assert [t.rsplit("x", 1)[-1] for t in operands.split(", ")] == [
            "f8E4M3FN>", "f8E4M3FN>", "f8E8M0FNU>", "f8E8M0FNU>"
        ], (op, operands)  # fmt: skip
        assert result.endswith("xf32>"), (op, result)
