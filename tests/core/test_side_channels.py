"""The four places a scaled rule reads something no argument shows (docs/design.md, "What a
rule reads besides its operands"), each checked to be unable to go stale: a power-of-two
mark holds for one tracer object and dies with it, the operand constants are those of the
rule being called, trace notes live for one trace, and a shared scale object only spares
work (equal scales in other objects give the same values)."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.core import interpreter, registry, scale_arithmetic
from tests.helpers import make_scaled


def test_pow2_mark_holds_for_one_tracer_object_and_dies_with_its_trace():
    seen = {}

    def f(s):
        marked = scale_arithmetic.mark_pow2(s * 2.0)
        same_value = s * 2.0  # equal, another object: not marked
        seen["marked"] = scale_arithmetic.is_pow2(marked)
        seen["other"] = scale_arithmetic.is_pow2(same_value)
        return marked + same_value

    before = len(scale_arithmetic._KNOWN_POW2)
    jax.jit(f)(jnp.float32(0.5))
    assert seen == {"marked": True, "other": False}
    gc.collect()
    assert len(scale_arithmetic._KNOWN_POW2) == before  # no entry outlives its tracer


def test_operand_constants_are_those_of_the_rule_being_called():
    prim = jax.extend.core.Primitive("operand_constants_example")
    prim.def_abstract_eval(lambda x, c: x)
    prim.def_impl(lambda x, c: x * c)
    calls = []

    @jsa.register_scaled_op(prim)
    def rule(x, c):
        calls.append(tuple(registry.operand_constants()))
        if len(calls) == 2:
            raise RuntimeError("the rule failed")
        return jsa.ScaledArray(x.data, x.scale * c.data * c.scale)

    x = make_scaled(np.ones(3), np.float32, 2.0)
    try:
        jsa.autoscale(lambda a: prim.bind(a, jnp.full(3, 3.0)))(x)
        with pytest.raises(RuntimeError, match="the rule failed"):
            jsa.autoscale(lambda a: prim.bind(a, a))(x)
    finally:
        registry.unregister_scaled_op(prim)
    assert calls == [(None, 3.0), (None, None)]
    assert registry.operand_constants() == ()  # nothing left after the failed call


def test_trace_notes_live_for_one_trace_of_the_users_function():
    kept = []

    def f(a):
        notes = interpreter.trace_notes()
        assert notes is not None and not notes  # a fresh dict in every trace
        notes["mine"] = a
        kept.append(notes)
        return a * 2

    x = make_scaled(np.ones(2), np.float32, 1.0)
    jsa.autoscale(f)(x)
    jax.jit(jsa.autoscale(f))(x)
    assert interpreter.trace_notes() is None
    assert len(kept) == 2 and kept[0] is not kept[1]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_shared_scale_object_only_spares_work(dtype):
    """`same_scale` takes one scale object for equal scales (no common-scale arithmetic);
    equal scales in distinct objects, traced or concrete, give the same bits."""
    data_a, data_b = np.linspace(-3, 3, 8), np.linspace(1, 2, 8)
    scale = jnp.float32(2.0**-20)
    shared = (
        jsa.scaled_array(data_a.astype(dtype), scale),
        jsa.scaled_array(data_b.astype(dtype), scale),
    )
    apart = (
        jsa.scaled_array(data_a.astype(dtype), jnp.float32(2.0**-20)),
        jsa.scaled_array(data_b.astype(dtype), jnp.float32(2.0**-20)),
    )
    add = jax.jit(jsa.autoscale(lambda a, b: a + b))
    one, two = add(*shared), add(*apart)

    def represented(x):
        return np.asarray(x.data, np.float64) * np.float64(x.scale)

    np.testing.assert_array_equal(represented(one), represented(two))
    exact = np.asarray(data_a.astype(dtype) + data_b.astype(dtype), np.float64) * 2.0**-20
    np.testing.assert_array_equal(represented(one), exact)
    counts = jsa.analysis.equation_counts(jsa.autoscale(lambda a: a + a), shared[0])
    assert "common_scale" not in counts  # one object: no ratio to compute
