"""`core/_compat.py`'s version branches: each test checks the form the installed JAX takes
(and that `_compat` picked it), so that running the suite on every supported release
(0.10.0 .. 0.12) exercises every branch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_scaled_arithmetics.core import _compat, registry

P = jax.sharding.PartitionSpec


def _scan_eqn():
    jaxpr = jax.make_jaxpr(lambda w, c, xs: jax.lax.scan(lambda c, x: (c * w + x, c * x), c, xs))(
        jnp.float32(0.5), jnp.ones(3), jnp.ones((4, 3))
    )
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is _compat.scan_p]
    return eqn


def test_scan_layout_of_this_jax():
    params = _scan_eqn().params
    # Up to JAX 0.10: counts and a ClosedJaxpr; from 0.11: the flat groups and a Jaxpr.
    assert ("num_consts" in params) == (_compat.JAX_VERSION < (0, 11))
    body, num_consts, num_carry = _compat.scan_layout(params)
    assert isinstance(body, _compat.ClosedJaxpr)
    assert (num_consts, num_carry) == (1, 1)
    assert len(body.in_avals) == 3 and len(body.out_avals) == 2


def test_custom_vjp_bwd_cotangents_of_this_jax():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda cos_x, g: (3.0 * g * cos_x,))
    jaxpr = jax.make_jaxpr(f)(jnp.ones(2))
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is _compat.custom_vjp_call_p]
    eqn.params["fwd_jaxpr_thunk"].call_wrapped(True)  # the bwd rule's output trees
    bwd = eqn.params["bwd"]
    raw = bwd.call_wrapped(jnp.full(2, 0.5), jnp.ones(2))
    # Up to JAX 0.10 the input cotangents; from 0.11 a pair (cotangents, the rule's logs).
    assert (isinstance(raw, tuple) and len(raw) == 2) == (_compat.JAX_VERSION >= (0, 11))
    (ct,) = _compat.call_custom_vjp_bwd(bwd, jnp.full(2, 0.5), jnp.ones(2))
    np.testing.assert_allclose(ct, [1.5, 1.5])


def test_match_varying_of_this_jax():
    # `standard_insert_pvary` in JAX 0.10.0 (and 0.10.1), `auto_insert_reshard` from 0.10.2.
    expected = (
        "auto_insert_reshard" if _compat.JAX_VERSION >= (0, 10, 2) else "standard_insert_pvary"
    )
    assert _compat.INSERT_VARYING == expected
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("i",))

    def body(x, c):
        a, b = _compat.match_varying(x, c)
        assert _compat.varying_axes(_compat.typeof(c)) == frozenset()
        assert _compat.varying_axes(_compat.typeof(b)) == frozenset({"i"})
        return a + b

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))
    np.testing.assert_array_equal(jax.jit(fn)(jnp.ones(2), jnp.float32(2.0)), [3.0, 3.0])


def test_shard_map_in_specs_of_this_jax():
    # On an abstract mesh, from JAX 0.11 `shard_map` infers `in_specs` from the arguments
    # when they are left out; 0.10 needs them.
    mesh = jax.sharding.AbstractMesh((1,), ("i",))
    try:
        fn = jax.shard_map(lambda x: x * 2, mesh=mesh, out_specs=P("i"))
        jax.make_jaxpr(fn)(np.ones(2, np.float32))
        inferred = True
    except (TypeError, ValueError):
        inferred = False
    assert inferred == _compat.SHARD_MAP_INFERS_IN_SPECS


@pytest.mark.parametrize("name", sorted(_compat.PRIMITIVE_RELEASES))
def test_primitive_releases_of_this_jax(name):
    """The release table agrees with the installed JAX (`installed_primitive` raises
    otherwise), and a rule declared for a primitive it lacks is listed, not registered."""
    if name in ("call", "closed_call", "eval_jaxpr"):
        # call_p and closed_call_p are one primitive, named eval_jaxpr, from JAX 0.11.
        new = _compat.JAX_VERSION >= (0, 11)
        assert _compat.closed_call_p.name == ("eval_jaxpr" if new else "closed_call")
        assert _compat.has_primitive(name) == (new if name == "eval_jaxpr" else not new)
        return
    prim = registry.installed_primitive(name)
    assert (prim is not None) == _compat.has_primitive(name)
    info = registry.declared_rules()[name]
    assert info.primitive is prim


def test_optional_rule_registration_checks_the_release_table():
    with pytest.raises(ValueError, match="PRIMITIVE_RELEASES"):
        registry.register_scaled_op("mul", lambda *a, **p: None)
    if _compat.has_primitive("polynomial"):
        with pytest.raises(ValueError, match="already registered"):
            registry.register_scaled_op("polynomial", lambda *a, **p: None)
