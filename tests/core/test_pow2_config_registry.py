import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.core import pow2
from jax_scaled_arithmetics.core.registry import get_scaled_rule, unregister_scaled_op
from tests.helpers import make_scaled


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("use_jit", [False, True])
def test_pow2_rounding(dtype, use_jit):
    x = jnp.array([3.0, 4.0, 0.3, 1000.0, 0.0, -3.0, jnp.inf, jnp.nan], dtype)
    down = jax.jit(pow2.pow2_round_down) if use_jit else pow2.pow2_round_down
    up = jax.jit(pow2.pow2_round_up) if use_jit else pow2.pow2_round_up
    np.testing.assert_array_equal(
        np.asarray(down(x), np.float32), [2.0, 4.0, 0.25, 512.0, 0.0, 2.0, np.inf, np.nan]
    )
    np.testing.assert_array_equal(
        np.asarray(up(x), np.float32), [4.0, 4.0, 0.5, 1024.0, 0.0, 4.0, np.inf, np.nan]
    )
    assert down(x).dtype == dtype


def test_pow2_extremes_and_decompose():
    tiny, huge = np.float32(2.0**-126 * 1.5), np.float32(2.0**127 * 1.5)
    assert float(pow2.pow2_round_down(tiny)) == 2.0**-126
    assert float(pow2.pow2_round_down(huge)) == 2.0**127
    assert float(pow2.pow2_round_up(huge)) == np.inf
    # A subnormal float32 is kept, never rounded to zero.
    assert float(pow2.pow2_round_down(np.float32(1e-40))) > 0
    p, rest = pow2.pow2_decompose(jnp.array([-6.0, 0.0, 5.0]))
    np.testing.assert_array_equal(p * rest, [-6.0, 0.0, 5.0])
    np.testing.assert_array_equal(p, [4.0, 1.0, 4.0])
    assert pow2.static_pow2(0.3) == 0.25
    assert pow2.static_pow2(0.3, jsa.Pow2RoundMode.UP) == 0.5
    assert pow2.static_pow2(0.3, jsa.Pow2RoundMode.NONE) == 0.3


def test_config_context_and_validation():
    from jax_scaled_arithmetics.core.config import get_autoscale_config

    base = get_autoscale_config()
    with jsa.AutoScaleConfig(rounding_mode=jsa.Pow2RoundMode.UP, check=False) as cfg:
        assert get_autoscale_config() is cfg
        with jsa.AutoScaleConfig(rounding_mode=jsa.Pow2RoundMode.NONE):
            assert get_autoscale_config().rounding_mode == jsa.Pow2RoundMode.NONE
        assert get_autoscale_config() is cfg
    assert get_autoscale_config() is base
    with pytest.raises(TypeError, match="rounding_mode must be a Pow2RoundMode"):
        jsa.AutoScaleConfig(rounding_mode="down")
    with pytest.raises(TypeError, match="scale_dtype must be a floating dtype"):
        jsa.AutoScaleConfig(scale_dtype=np.int32)


def test_scale_dtype_config_applies_to_promoted_operands():
    x = make_scaled(np.ones(2), np.float32, 2.0)
    with jsa.AutoScaleConfig(scale_dtype=np.float64):
        out = jsa.autoscale(lambda a, b: a * b)(x, np.ones(2, np.float32))
    assert isinstance(out, jsa.ScaledArray)
    np.testing.assert_array_equal(out.to_array(), [2.0, 2.0])


def _identity_primitive(name):
    prim = Primitive(name)
    prim.def_abstract_eval(lambda x, **_: x)
    prim.def_impl(lambda x, **_: x)
    return prim


def test_register_scaled_op_decorator_and_function_forms():
    prim = _identity_primitive("double_scale_example")
    try:

        @jsa.register_scaled_op(prim, family="example", remark="doubles the value")
        def rule(x, **params):
            assert params == {"flag": True}  # params forwarded untouched
            return jsa.ScaledArray(x.data, x.scale * 2)

        assert get_scaled_rule(prim).rule is rule
        assert jsa.coverage()["double_scale_example"].remark == "doubles the value"
        out = jsa.autoscale(lambda a: prim.bind(a, flag=True))(
            make_scaled(np.ones(2), np.float32, 1.0)
        )
        np.testing.assert_array_equal(out.to_array(), [2.0, 2.0])
        with pytest.raises(
            ValueError, match="already registered for primitive 'double_scale_example'"
        ):
            jsa.register_scaled_op(prim, rule)
    finally:
        unregister_scaled_op(prim)
    prim2 = _identity_primitive("function_form_example")
    try:
        jsa.register_scaled_op(prim2, lambda x: x)
        assert "function_form_example" in jsa.coverage()
    finally:
        unregister_scaled_op(prim2)


def test_one_record_per_primitive_in_any_registration_order():
    """A primitive's block rule and guards live in its one record, registered before or
    after its rule; the record is what the interpreter runs, and removing it removes all."""
    from jax_scaled_arithmetics.core import registry

    prim = _identity_primitive("one_record_example")
    seen = []
    try:
        registry.register_equation_guard(prim, lambda eqn, operands: seen.append("guard"))
        assert not registry.has_scaled_rule(prim)  # a guard alone is no rule
        assert "one_record_example" not in jsa.coverage()
        with pytest.raises(NotImplementedError, match="No scaled rule"):
            get_scaled_rule(prim)

        @registry.register_block_rule(prim)
        def block_rule(x, **params):
            seen.append("block")
            return x

        @jsa.register_scaled_op(prim, family="example")
        def rule(x, **params):
            seen.append("rule")
            return x

        record = get_scaled_rule(prim)
        assert (record.rule, record.block_rule, len(record.guards)) == (rule, block_rule, 1)
        assert registry.get_block_rule(prim) is block_rule
        with pytest.raises(ValueError, match="block rule is already registered"):
            registry.register_block_rule(prim, block_rule)
        per_tensor = make_scaled(np.ones(4), np.float32, 2.0)
        jsa.autoscale(prim.bind)(per_tensor)
        blocks = jsa.ScaledArray(jnp.ones(4, jnp.float32), jnp.array([1.0, 2.0], jnp.float32))
        jsa.autoscale(prim.bind)(blocks)
        assert seen == ["guard", "rule", "guard", "block"]
    finally:
        unregister_scaled_op(prim)
    assert registry.get_block_rule(prim) is None and not registry.equation_guards(prim)


def test_register_scaled_op_rejects_non_primitives():
    with pytest.raises(TypeError, match="expects a JAX primitive, got 3"):
        jsa.register_scaled_op(3)
    # A name is only for the primitives some supported releases lack.
    with pytest.raises(ValueError, match=r"'add' is not in .*PRIMITIVE_RELEASES.*add_p"):
        jsa.register_scaled_op("add")


def test_missing_rule_message():
    prim = _identity_primitive("unregistered_example")
    with pytest.raises(NotImplementedError, match="'unregistered_example'.*register_scaled_op"):
        get_scaled_rule(prim)


def test_public_names_are_pinned():
    assert sorted(jsa.__all__) == sorted(
        [
            "AutoScaleConfig",
            "analysis",
            "Pow2RoundMode",
            "ScaleHistory",
            "ScalePolicy",
            "ScaledArray",
            "as_scaled_array",
            "asarray",
            "autoscale",
            "checkpoint",
            "coverage",
            "delayed_scaling",
            "is_scaled_leaf",
            "lax",
            "mp",
            "ops",
            "optax",
            "quantization",
            "register_scaled_op",
            "scaled_array",
            "scalify",
            "sharding",
            "scaled_axes",
            "tree",
            "unit_scaling",
            "vmap",
        ]
    )
    for name in jsa.__all__:
        assert getattr(jsa, name) is not None
    assert sorted(jsa.lax.__all__) == [
        "apply_to_data",
        "get_data_scale",
        "rebalance",
        "set_scaling",
        "stop_scaling",
    ]
