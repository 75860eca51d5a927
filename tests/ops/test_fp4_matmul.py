"""`jsa.ops.fp4_matmul` / `nvfp4_matmul`: a 4-bit recipe's three quantised matmuls (NVFP4,
MXFP4, per-tensor E2M1), checked against the same steps written with the public quantisers,
ingredient by ingredient."""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.quantization import block_fake_quantize, float_quantize, random_hadamard
from jax_scaled_arithmetics.quantization import nvfp4_fake_quantize as fq

fp4_module = importlib.import_module("jax_scaled_arithmetics.ops.fp4_matmul")

RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 16, 32)).astype(np.float32)  # 64 tokens, K = 32
W = (RNG.standard_normal((32, 64)) / 6).astype(np.float32)  # N = 64
G = RNG.standard_normal((4, 16, 64)).astype(np.float32)
KEY = jax.random.key(11)


def _dot(a, b):
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _quantizer(recipe, scale_rounding="up"):
    """(q(v, axis, key=None), q2d(w)) of a recipe, from the public quantisers."""
    if recipe == "nvfp4":

        def q(v, axis, key=None):
            return fq(
                v, axis=axis, rounding="stochastic" if key is not None else "nearest", key=key
            )

        return q, lambda w: fq(w, block_size=(16, 16))
    if recipe == "mxfp4":

        def q(v, axis, key=None):
            rounding = "stochastic" if key is not None else "nearest"
            return block_fake_quantize(
                v, "mxfp4_e2m1", 32, axis, rounding, key, scale_rounding=scale_rounding
            )

        def q2d(w):  # every 32x32 tile of w one block of 1024
            k, n = w.shape
            tiles = w.reshape(k // 32, 32, n // 32, 32).transpose(0, 2, 1, 3)
            tiles = block_fake_quantize(
                tiles.reshape(k // 32, n // 32, 1024), "mxfp4_e2m1", 1024, -1,
                scale_rounding=scale_rounding,
            )  # fmt: skip
            return tiles.reshape(k // 32, n // 32, 32, 32).transpose(0, 2, 1, 3).reshape(k, n)

        return q, q2d

    def per_tensor(v, axis, key=None):
        scale = jnp.max(jnp.abs(v)) * np.float32(1 / 6)
        rounding = "stochastic" if key is not None else "nearest"
        return float_quantize(v / scale, "float4_e2m1fn", rounding, saturate=True, key=key) * scale

    return per_tensor, lambda w: per_tensor(w, 0)


@functools.partial(
    jax.jit, static_argnames=("hadamard", "stochastic", "weight_blocks", "recipe", "rounding")
)
def _reference(x, w, g, key, hadamard, stochastic, weight_blocks, recipe="nvfp4", rounding="up"):
    """The recipe written out with the public quantisers (the module docstring's steps), as
    one program (operation by operation, each would be a compile of its own)."""
    q, q2d = _quantizer(recipe, rounding)
    block = 32 if recipe == "mxfp4" else 16
    k_dgrad, k_wgrad, k_hadamard = jax.random.split(key, 3)
    x2, g2 = x.reshape(-1, 32), g.reshape(-1, 64)
    wq = q2d(w) if weight_blocks == "2d" else q(w, 0)
    y = _dot(q(x2, 1), wq)
    wt = wq.T if weight_blocks == "2d" or recipe == "fp4_tensor" else q(w, 1).T

    def grad_q(v, axis, k):
        return q(v, axis, k) if stochastic else q(v, axis)

    dx = _dot(grad_q(g2, 1, k_dgrad), wt)
    if hadamard:
        x2 = random_hadamard(x2, axis=0, key=k_hadamard, size=block)
        g2 = random_hadamard(g2, axis=0, key=k_hadamard, size=block)
    dw = _dot(q(x2, 0).T, grad_q(g2, 0, k_wgrad))
    return y.reshape(4, 16, 64), dx.reshape(x.shape), dw


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


_RECIPE_CASES = [
    (r, sr, h, s, w)
    for r in ("nvfp4", "mxfp4", "fp4_tensor")
    for sr in (("up", "floor") if r == "mxfp4" else ("up",))
    for h in (True, False)
    for s in (True, False)
    for w in ("2d", "1d")
]
# Every value of every parameter (each recipe, MXFP4's two scale roundings, each ingredient
# on and off) in the default run, the ingredients on together (the largest programs) in two
# cases only; the other cases in the slow step.
_DEFAULT_RECIPE_CASES = {
    ("nvfp4", "up", True, True, "2d"),
    ("mxfp4", "up", True, True, "1d"),
    ("mxfp4", "floor", False, False, "2d"),
    ("fp4_tensor", "up", False, False, "1d"),
}


@pytest.mark.parametrize(
    "recipe, scale_rounding, hadamard, stochastic, weight_blocks",
    [
        pytest.param(*c, marks=() if c in _DEFAULT_RECIPE_CASES else pytest.mark.slow)
        for c in _RECIPE_CASES
    ],
)
@pytest.mark.slow
def test_each_matmul_is_the_recipe_step(
    recipe, scale_rounding, hadamard, stochastic, weight_blocks
):
    def loss(x, w):
        y = jsa.ops.fp4_matmul(
            x,
            w,
            KEY,
            recipe=recipe,
            hadamard=hadamard,
            stochastic_gradients=stochastic,
            weight_blocks=weight_blocks,
            scale_rounding=scale_rounding,
        )
        return jnp.sum(y * G), y

    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    # NVFP4 with its default ingredients outside jit: the library's jitted forward and
    # backward, whose programs test_keys_change_the_random_parts_only calls again (compiled
    # once); the others under jit (NVFP4 under jit: test_stochastic_gradients_*).
    if (recipe, hadamard, stochastic, weight_blocks) != ("nvfp4", True, True, "2d"):
        value_and_grad = jax.jit(value_and_grad)
    (_, y), (dx, dw) = value_and_grad(X, W)
    ref_y, ref_dx, ref_dw = _reference(
        X,
        W,
        G,
        KEY,
        hadamard=hadamard,
        stochastic=stochastic,
        weight_blocks=weight_blocks,
        recipe=recipe,
        rounding=scale_rounding,
    )
    np.testing.assert_array_equal(_bits(y), _bits(ref_y))
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dw, ref_dw, rtol=1e-6, atol=1e-5)
    # And close to the exact float32 matmuls (E2M1 keeps ~1 bit of mantissa).
    exact = np.einsum("btk,kn->btn", X, W)
    bound = 0.4 if recipe == "fp4_tensor" else 0.25
    assert np.linalg.norm(np.asarray(y) - exact) <= bound * np.linalg.norm(exact)
    exact_dw = np.einsum("btk,btn->kn", X, G)
    assert np.linalg.norm(np.asarray(dw) - exact_dw) <= 0.4 * np.linalg.norm(exact_dw)


# The ingredients switched off below (OFF) in several tests: one recipe, compiled once.
OFF = {"hadamard": False, "stochastic_gradients": False}


def test_nvfp4_matmul_is_the_nvfp4_recipe():
    got = jax.grad(lambda w: jnp.sum(jsa.ops.nvfp4_matmul(X, w, KEY, **OFF) * G))(W)
    want = jax.grad(lambda w: jnp.sum(jsa.ops.fp4_matmul(X, w, KEY, recipe="nvfp4", **OFF) * G))(W)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_block_formats_beat_one_scale_per_tensor(recipe):
    """With an outlier row, blocks keep the other rows; one tensor scale flushes them."""
    x = X.copy()  # X's shape: the programs of the other tests
    x[0, 0] *= 1000.0
    exact = x.reshape(-1, 32) @ W
    errors = {}
    for r in (recipe, "fp4_tensor"):
        y = np.asarray(jsa.ops.fp4_matmul(x, W, recipe=r, **OFF)).reshape(-1, 64)
        errors[r] = np.linalg.norm(y[1:] - exact[1:]) / np.linalg.norm(exact[1:])
    assert errors[recipe] < 0.25 and errors["fp4_tensor"] > 0.9, errors


def test_2d_weight_blocks_make_the_backward_weight_the_forward_one():
    """With 16x16 blocks, dx uses exactly the forward's quantised weight (transposed)."""
    g2 = G.reshape(-1, 64)
    _, vjp = jax.vjp(lambda x: jsa.ops.nvfp4_matmul(x, W, KEY, **OFF), X)
    (dx,) = vjp(G)
    expected = _dot(fq(g2, axis=1), fq(W, block_size=(16, 16)).T).reshape(X.shape)
    np.testing.assert_allclose(dx, expected, rtol=1e-6, atol=1e-6)


def test_stochastic_gradients_average_to_the_deterministic_product():
    keys = jax.random.split(jax.random.key(2), 400)

    def input_grad(key):
        _, vjp = jax.vjp(lambda x: jsa.ops.nvfp4_matmul(x, W, key, hadamard=False), X)
        return vjp(G)[0]

    draws = np.asarray(jax.jit(jax.vmap(input_grad))(keys), np.float64)
    target = np.asarray(_dot(G.reshape(-1, 64), fq(W, block_size=(16, 16)).T)).reshape(X.shape)
    single = np.linalg.norm(draws[0] - target)
    mean = np.linalg.norm(draws.mean(axis=0) - target)
    assert single > 0 and mean < 0.15 * single  # unbiased: 400 draws shrink the error ~20x


def test_keys_change_the_random_parts_only():
    def grads(key, **kwargs):
        return jax.grad(
            lambda x, w: jnp.sum(jsa.ops.nvfp4_matmul(x, w, key, **kwargs) * G), (0, 1)
        )(X, W)

    a, b = grads(jax.random.key(1)), grads(jax.random.key(2))
    assert not np.allclose(a[0], b[0]) and not np.allclose(a[1], b[1])
    c, d = grads(jax.random.key(1), **OFF), grads(jax.random.key(2), **OFF)
    np.testing.assert_array_equal(c[0], d[0])
    np.testing.assert_array_equal(c[1], d[1])
    assert jsa.ops.nvfp4_matmul(X, W, **OFF).shape == (4, 16, 64)  # no key needed then


def test_low_precision_operands_keep_their_dtype():
    """The recipe computes in float32 from the operands' entry (the ingredients, switched
    off here to keep the program small, never see the low-precision dtype)."""
    x = X.astype(ml_dtypes.bfloat16)
    y, vjp = jax.vjp(
        lambda x, w: jsa.ops.nvfp4_matmul(x, w, KEY, **OFF), x, W.astype(ml_dtypes.bfloat16)
    )
    dx, dw = vjp(jnp.ones_like(y))
    assert y.dtype == dx.dtype == dw.dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize(
    "x_shape, w_shape, kwargs, error, match",
    [
        ((16, 24), (24, 16), {}, ValueError, "K = 24 is not a multiple of the block size 16"),
        ((16, 32), (32, 8), {}, ValueError, "N = 8 is not a multiple"),
        ((8, 32), (32, 16), {}, ValueError, "tokens = 8 is not a multiple"),
        ((16, 32), (16, 16), {}, ValueError, r"x \(..., K\) and w \(K, N\) expected"),
        ((16, 32), (32, 16), {"weight_blocks": "3d"}, ValueError, "must be '2d' or '1d'"),
        ((16, 32), (32, 16), {"key": None}, ValueError, "need a PRNG key"),
        (
            (32, 32),
            (32, 16),
            {"recipe": "mxfp4"},
            ValueError,
            "N = 16 is not a multiple of the block size 32",
        ),
        ((32, 32), (32, 32), {"recipe": "mxfp8"}, ValueError, "recipe must be one of"),
        (
            (32, 32),
            (32, 32),
            {"recipe": "mxfp4", "scale_rounding": "down"},
            ValueError,
            "scale_rounding must be one of",
        ),
    ],
)
def test_bad_arguments_are_refused(x_shape, w_shape, kwargs, error, match):
    kwargs = {"key": KEY, **kwargs}
    with pytest.raises(error, match=match):
        jsa.ops.fp4_matmul(jnp.ones(x_shape), jnp.ones(w_shape), **kwargs)


def test_non_floating_operands_are_refused():
    with pytest.raises(TypeError, match="x must be floating, got int32"):
        jsa.ops.nvfp4_matmul(jnp.ones((16, 16), jnp.int32), jnp.ones((16, 16)), KEY)
