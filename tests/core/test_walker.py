"""The one jaxpr walker (`core/walker.py`): what a transform built on it gets for free."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics.core import _compat, interpreter, known_scalars
from jax_scaled_arithmetics.core.walker import (
    Frame,
    Group,
    JaxprWalker,
    observe_equations,
    unwrap_outer,
)
from jax_scaled_arithmetics.ops import fp8_simulation
from jax_scaled_arithmetics.unit_scaling import _transform


class SinToCos(JaxprWalker):
    """A whole transform: one rule, every body reached through the walker's helpers."""

    def eval_eqn(self, eqn, invals, frame):
        if eqn.primitive is lax.sin_p:
            return [lax.cos(invals[0])]
        return self.eval_higher_order(eqn, invals, frame.context)


def transformed(fn):
    def wrapped(*args):
        closed = jax.make_jaxpr(fn)(*args)
        return SinToCos().run_closed(closed, list(args))

    return wrapped


def with_bodies(x):
    """sin at the top level and inside jit, scan, while, cond and checkpoint bodies."""
    a = jnp.sin(x) * 2.0  # a literal operand
    b = jax.jit(jnp.sin)(x)
    c, _ = lax.scan(lambda carry, _: (carry + jnp.sin(carry), None), x, None, length=2)
    d = lax.while_loop(lambda v: v[1] < 2, lambda v: (v[0] + jnp.sin(v[0]), v[1] + 1), (x, 0))[0]
    e = lax.cond(x > 0, jnp.sin, jnp.cos, x)
    f = jax.checkpoint(jnp.sin)(x)
    _, g = jnp.linalg.slogdet(jnp.eye(2) * jnp.sin(x))  # outputs the program drops
    return a + b + c + d + e + f + g


def with_bodies_cos(x):
    a = jnp.cos(x) * 2.0
    b = jnp.cos(x)
    c = x
    for _ in range(2):
        c = c + jnp.cos(c)
    d = x
    for _ in range(2):
        d = d + jnp.cos(d)
    e = jnp.where(x > 0, jnp.cos(x), jnp.cos(x))
    f = jnp.cos(x)
    _, g = jnp.linalg.slogdet(jnp.eye(2) * jnp.cos(x))
    return a + b + c + d + e + f + g


@pytest.mark.parametrize("jit", [False, True])
def test_a_one_rule_transform_reaches_every_body(jit):
    x = jnp.float32(0.7)
    fn = transformed(with_bodies)
    got = (jax.jit(fn) if jit else fn)(x)
    assert len(got) == 1
    np.testing.assert_allclose(got[0], with_bodies_cos(x), rtol=1e-6)
    # And it composes with differentiation like any JAX code (forward mode: reverse mode
    # refuses the while loop, with or without the walker).
    _, tangent = jax.jvp(lambda v: transformed(with_bodies)(v)[0], (x,), (1.0,))
    np.testing.assert_allclose(tangent, jax.jvp(with_bodies_cos, (x,), (1.0,))[1], rtol=1e-5)


def test_kept_equations_keep_their_source_information():
    """Equations the walker binds again carry their name stack (`jax.named_scope`), so
    profiles and `jsa.analysis` see the user's names through every transform."""

    def fn(x):
        with jax.named_scope("my_block"):
            return jnp.tanh(x) + jnp.sin(x)

    closed = jax.make_jaxpr(transformed(fn))(jnp.ones(3))
    stacks = {e.primitive.name: _compat.eqn_name_stack(e) for e in closed.jaxpr.eqns}
    assert "my_block" in stacks["tanh"] and "my_block" in stacks["cos"]


class ReplaceFirstTwo(JaxprWalker):
    """Offers the first two equations as a group and replaces them by `replacement`."""

    def __init__(self, replacement):
        self.replacement = replacement

    def groups(self, jaxpr, context):
        outputs = tuple(jaxpr.eqns[1].outvars)
        return [Group(0, 2, "first two", tuple(jaxpr.invars), outputs)]

    def eval_group(self, group, invals, frame):
        assert isinstance(frame, Frame) and group.key == "first two"
        return self.replacement(*invals)


def test_a_group_of_equations_is_replaced_as_a_whole():
    def fn(x):
        return jnp.exp(jnp.sin(x)) * 3.0

    closed = jax.make_jaxpr(fn)(jnp.ones(4))
    x = jnp.arange(4.0)
    (out,) = ReplaceFirstTwo(lambda v: [v + 1.0]).run_closed(closed, [x])
    np.testing.assert_allclose(out, (x + 1.0) * 3.0)
    # Not replaced (None): walked as it is.
    (out,) = ReplaceFirstTwo(lambda v: None).run_closed(closed, [x])
    np.testing.assert_allclose(out, fn(x), rtol=1e-6)


def test_a_bad_replacement_or_rule_is_named():
    closed = jax.make_jaxpr(lambda x: jnp.exp(jnp.sin(x)) * 3.0)(jnp.ones(4))
    x = jnp.ones(4)
    with pytest.raises(ValueError, match=r"replacement for 'first two' returned 2 outputs"):
        ReplaceFirstTwo(lambda v: [v, v]).run_closed(closed, [x])
    with pytest.raises(ValueError, match=r"returned shape \(2,\); the function it replaces"):
        ReplaceFirstTwo(lambda v: [v[:2]]).run_closed(closed, [x])

    class TwoOutputs(JaxprWalker):
        def eval_eqn(self, eqn, invals, frame):
            return [invals[0], invals[0]]

    with pytest.raises(TypeError, match=r"rule of 'sin' returned 2 outputs, expected 1"):
        TwoOutputs().run_closed(closed, [x])
    with pytest.raises(TypeError, match=r"jaxpr takes 1 arguments, got 2"):
        JaxprWalker().run_closed(closed, [x, x])


def test_the_default_walk_rebuilds_the_same_program():
    def fn(x, y):
        return jnp.sum(jax.nn.softmax(x @ y, axis=-1) ** 2)

    args = (jnp.ones((3, 4)), jnp.ones((4, 5)))
    closed = jax.make_jaxpr(fn)(*args)
    again = jax.make_jaxpr(lambda *a: JaxprWalker().run_closed(closed, list(a)))(*args)
    assert str(again.jaxpr) == str(closed.jaxpr)


def test_every_transform_is_a_walker():
    """One loop serves them all: autoscale, its constant folding of call bodies,
    unit_scale and simulate_fp8 are walkers with their own rules."""
    for cls in (
        interpreter._Autoscale,
        known_scalars._KnownScalars,
        _transform._UnitScaleRewriter,
        fp8_simulation._Fp8Rewriter,
    ):
        assert issubclass(cls, JaxprWalker), cls
        assert "walk" not in vars(cls) and "run" not in vars(cls), cls


def test_observers_see_autoscale_s_equations_only():
    seen = []

    def observer(eqn, inputs, outputs):
        seen.append((eqn.primitive.name, [type(o).__name__ for o in outputs]))

    x = jsa.as_scaled_array(jnp.full((4,), 3.0))
    with observe_equations(observer):
        jsa.autoscale(lambda v: jnp.sin(v) * 2.0)(x)
        count = len(seen)
        jsa.ops.simulate_fp8(lambda a, b: a @ b)(jnp.ones((2, 2)), jnp.ones((2, 2)))
    assert [name for name, _ in seen] == ["sin", "mul"]
    assert seen[1][1] == ["ScaledArray"]
    assert len(seen) == count  # simulate_fp8's walk is not observed


def test_transforms_commute_through_their_declarations():
    def f(x):
        return x

    for transform in (jsa.autoscale, jsa.ops.simulate_fp8):
        inner, rewrap = unwrap_outer(jax.jit(transform(f)))
        assert inner is f
        assert callable(rewrap(f))
    inner, _ = unwrap_outer(jsa.autoscale(jsa.ops.simulate_fp8(f)))
    assert inner is f
    # A gradient of a transformed function is not the transformed function.
    assert unwrap_outer(jax.grad(jsa.autoscale(f)))[0] is not f


def test_the_module_examples_run():
    import doctest

    from jax_scaled_arithmetics.core import walker

    result = doctest.testmod(walker)
    assert result.attempted >= 10 and result.failed == 0, result
