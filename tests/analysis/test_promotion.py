"""`jsa.analysis.dtype_promotions`: where a float16 program silently computes in float32."""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jax_scaled_arithmetics as jsa


class Mlp(nn.Module):
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, dtype=self.dtype)(x)  # the promoting line when dtype is None
        return nn.Dense(4, dtype=self.dtype)(nn.gelu(x))


@pytest.mark.slow
def test_flax_dense_with_float32_parameters_is_reported_with_its_source_line():
    x = jnp.ones((2, 4), jnp.float16)
    variables = Mlp().init(jax.random.PRNGKey(0), x)  # param_dtype float32, dtype None
    report = jsa.analysis.dtype_promotions(lambda v, x: Mlp().apply(v, x), variables, x)
    kinds = [p.kind for p in report.promotions]
    assert kinds.count("input") == 4  # two kernels, two biases in float32
    converts = [p for p in report.promotions if p.kind != "input"]
    assert converts and converts[0].from_dtype == "float16" and converts[0].to_dtype == "float32"
    assert "test_promotion.py" in converts[0].where and "flax" in converts[0].library_source
    assert report.low_dtype == "float16" and report.wide_fraction > 0.5
    assert "float16->float32" in str(report)


@pytest.mark.slow
def test_a_model_configured_for_float16_reports_nothing():
    x = jnp.ones((2, 4), jnp.float16)
    model = Mlp(dtype=jnp.float16)
    variables = jsa.as_scaled_array(model.init(jax.random.PRNGKey(0), x), dtype=jnp.float16)

    def loss(v, x):
        return jnp.sum(model.apply(v, x)).astype(jnp.float32)  # a float32 scalar: not listed

    report = jsa.analysis.dtype_promotions(jax.grad(loss), variables, x)
    # Only the backward of jnp.sum's float32 accumulation (its broadcast cotangent) is wide.
    assert report.promotions == () and report.tensors_by_dtype.get("float32", 0) <= 1


def test_equinox_layer_built_in_float32():
    linear = eqx.nn.Linear(4, 4, key=jax.random.PRNGKey(0))  # float32 weights
    x = jnp.ones((4,), jnp.float16)
    report = jsa.analysis.dtype_promotions(lambda m, x: m(x), linear, x)
    assert {p.kind for p in report.promotions} >= {"input"}
    assert report.wide_fraction > 0.0
    half = jax.tree.map(lambda a: a.astype(jnp.float16) if eqx.is_inexact_array(a) else a, linear)
    assert jsa.analysis.dtype_promotions(lambda m, x: m(x), half, x).promotions == ()


def test_no_floating_argument_needs_a_low_dtype():
    with pytest.raises(ValueError, match="low_dtype"):
        jsa.analysis.dtype_promotions(lambda n: n + 1, 3)
    report = jsa.analysis.dtype_promotions(
        lambda n: jnp.ones((2,), jnp.float16) * n, 3, low_dtype=jnp.float16
    )
    assert report.promotions == ()
