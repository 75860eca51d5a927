"""`jsa.AutoScaleConfig` changes the programs `autoscale` traces, under `jax.jit` too.

The configuration in force is part of jit's cache key (as `jax.default_matmul_precision`
is): a jitted autoscaled function called under another configuration is traced again, and
each field gives the same program jitted as eagerly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.core.config import get_autoscale_config
from jax_scaled_arithmetics.core.registry import unregister_scaled_op

X = jsa.as_scaled_array(jnp.array([[3.0, 1.0], [2.0, 5.0]], jnp.float16))
PLAIN = jnp.array([[2.0, 4.0], [1.0, 0.5]], jnp.float16)


def _matmul(a, b):
    return a @ a  # dynamic policy: scale from the data (16); static: sqrt(2) rounded (1)


def _add(a, b):
    return a + a  # sqrt(1^2 + 1^2): 1 rounded down, sqrt(2) unrounded


def _scan(a, b):
    # The carry starts as the plain `b`, promoted with a scale of the configured dtype.
    return jax.lax.scan(lambda c, _: (c + a, None), b, None, length=2)[0]


def _scale_dtype(out):
    return np.dtype(out.scale.dtype)


def _same(observed, expected):
    return observed == (pytest.approx(expected) if isinstance(expected, float) else expected)


# (field, function, observable, value under the default configuration, under `changed`).
FIELDS = [
    ("policy", _matmul, lambda o: float(o.scale), 16.0, jsa.ScalePolicy.STATIC, 1.0),
    ("rounding_mode", _add, lambda o: float(o.scale), 1.0, jsa.Pow2RoundMode.NONE, 2**0.5),
    ("scale_dtype", _scan, _scale_dtype, np.dtype(np.float32), np.float16, np.dtype(np.float16)),
]


@pytest.mark.parametrize(
    "field, fun, observe, default_value, changed, changed_value", FIELDS, ids=[f[0] for f in FIELDS]
)
def test_jit_traces_again_under_another_config(
    field, fun, observe, default_value, changed, changed_value
):
    traces = []

    def counted(a, b):
        traces.append(None)
        return fun(a, b)

    step = jax.jit(jsa.autoscale(counted))
    with jsa.AutoScaleConfig():
        assert _same(observe(step(X, PLAIN)), default_value)
    config = jsa.AutoScaleConfig(**{field: changed})
    with config:
        jitted = step(X, PLAIN)
        eager = jsa.autoscale(fun)(X, PLAIN)
    assert _same(observe(jitted), changed_value)
    assert _same(observe(eager), changed_value)
    np.testing.assert_array_equal(jitted.to_array(np.float32), eager.to_array(np.float32))
    # Back under the first configuration, and again under the second: jit's cache serves
    # both programs, nothing is traced a third time.
    with jsa.AutoScaleConfig():
        assert _same(observe(step(X, PLAIN)), default_value)
    with config:
        assert _same(observe(step(X, PLAIN)), changed_value)
    assert len(traces) == 2


def test_jit_traces_again_when_the_rule_check_is_turned_on():
    """`check=True` verifies every rule's outputs at trace time: a jitted function traced
    with the check off is checked when called again with it on."""
    wrong_p = Primitive("config_test_wrong_dtype")
    wrong_p.def_impl(lambda x: x)
    wrong_p.def_abstract_eval(lambda x: x)
    jsa.register_scaled_op(
        wrong_p, lambda x, **_: jsa.ScaledArray(x.data.astype(np.float32), x.scale)
    )

    try:
        step = jax.jit(jsa.autoscale(lambda a: wrong_p.bind(a)))
        with jsa.AutoScaleConfig(check=False):
            assert step(X).dtype == np.float32  # the rule's (wrong) output, unchecked
        with (
            jsa.AutoScaleConfig(check=True),
            pytest.raises(TypeError, match="config_test_wrong"),
        ):
            step(X)
    finally:  # the registry is global: later tests (the operator docs) list its rules
        unregister_scaled_op(wrong_p)


def test_scale_dtype_spellings_are_one_config():
    """np.float16, "float16" and jnp.float16 are one configuration (one jit cache entry)."""
    configs = {jsa.AutoScaleConfig(scale_dtype=d) for d in (np.float16, "float16", jnp.float16)}
    assert len(configs) == 1
    assert next(iter(configs)).scale_dtype == np.dtype(np.float16)


def test_nested_contexts_restore_the_outer_config():
    outer = jsa.AutoScaleConfig(policy=jsa.ScalePolicy.STATIC)
    inner = jsa.AutoScaleConfig(rounding_mode=jsa.Pow2RoundMode.NONE)
    with outer:
        with inner:
            assert get_autoscale_config() is inner
        assert get_autoscale_config() is outer
