"""The package's random draws are `jax.random`'s exact values; XLA:CPU draws them flat."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
import jax_scaled_arithmetics.unit_scaling as U
from jax_scaled_arithmetics.core import prng

# A rank-4 draw of jax.random compiles for seconds on XLA:CPU (the reason for the flat
# form): that shape runs in the slow step.
SHAPES = [
    (),
    (7,),
    (3, 5),
    (2, 3, 4),
    pytest.param((2, 3, 4, 5), marks=pytest.mark.slow),
    (2, 0, 3, 4),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("jit", [False, True])
def test_random_bits_are_jax_random_bits(shape, jit):
    key = jax.random.key(3)
    draw = jax.jit(prng.random_bits, static_argnums=1) if jit else prng.random_bits
    bits = draw(key, shape)
    assert bits.dtype == jnp.uint32 and bits.shape == shape
    np.testing.assert_array_equal(bits, jax.random.bits(key, shape, jnp.uint32))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bernoulli_is_jax_random_bernoulli(shape):
    key = jax.random.key(4)
    mask = jax.jit(prng.bernoulli, static_argnums=2)(key, 0.7, shape)
    assert mask.dtype == jnp.bool_ and mask.shape == shape
    np.testing.assert_array_equal(mask, jax.random.bernoulli(key, 0.7, shape))


def test_both_forms_draw_the_same_values():
    """The flat form (XLA:CPU) and the shaped form (other backends) agree, so a program's
    random draws do not depend on where it runs."""
    key = jax.random.key(5)
    for shape in [(3, 5, 7, 2)]:
        bits = lambda k, s: jax.random.bits(k, s, jnp.uint32)  # noqa: E731
        np.testing.assert_array_equal(prng.flat_draw(bits, key, shape), bits(key, shape))
        uniform = lambda k, s: jax.random.uniform(k, s)  # noqa: E731
        np.testing.assert_array_equal(prng.flat_draw(uniform, key, shape), uniform(key, shape))


@pytest.mark.slow
def test_vmap_over_keys_and_legacy_keys():
    keys = jax.random.split(jax.random.key(6), 3)
    shape = (2, 3, 4, 5)
    bits = jax.vmap(lambda k: prng.random_bits(k, shape))(keys)
    expected = jax.vmap(lambda k: jax.random.bits(k, shape, jnp.uint32))(keys)
    np.testing.assert_array_equal(bits, expected)
    legacy = jax.random.PRNGKey(7)  # raw uint32 key data
    np.testing.assert_array_equal(
        prng.random_bits(legacy, shape), jax.random.bits(legacy, shape, jnp.uint32)
    )


def test_bernoulli_rejects_an_array_of_probabilities():
    with pytest.raises(ValueError, match="scalar probability p, got shape \\(3,\\)"):
        prng.bernoulli(jax.random.key(0), jnp.full((3,), 0.5), (2, 3, 4, 3))


def test_dropout_inside_autoscale_keeps_jax_random_mask():
    """Unit-scaled dropout of a rank-4 ScaledArray under autoscale and jit drops exactly
    the entries `jax.random.bernoulli` drops."""
    key = jax.random.key(8)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4, 8, 8)) + 3.0, jnp.float16)
    scaled = jsa.as_scaled_array(x)
    out = jax.jit(jsa.autoscale(lambda a: U.dropout(a, 0.25, key)))(scaled)
    kept = jax.random.bernoulli(key, 0.75, x.shape)
    np.testing.assert_array_equal(np.asarray(jsa.asarray(out, jnp.float32)) != 0, kept)
