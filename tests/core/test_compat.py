"""`core/_compat.py`'s version branches, each form checked whatever JAX runs the tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_scaled_arithmetics.core import _compat


def _scan_eqn():
    jaxpr = jax.make_jaxpr(lambda w, c, xs: jax.lax.scan(lambda c, x: (c * w + x, c * x), c, xs))(
        jnp.float32(0.5), jnp.ones(3), jnp.ones((4, 3))
    )
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is _compat.scan_p]
    return eqn


def test_scan_layout_of_this_jax():
    body, num_consts, num_carry = _compat.scan_layout(_scan_eqn().params)
    assert isinstance(body, _compat.ClosedJaxpr)
    assert (num_consts, num_carry) == (1, 1)
    assert len(body.in_avals) == 3 and len(body.out_avals) == 2


def test_scan_layout_of_both_param_forms():
    body = _compat.scan_layout(_scan_eqn().params)[0]
    # Up to JAX 0.10: counts and a ClosedJaxpr; from 0.11: the flat groups and a Jaxpr.
    old = {"jaxpr": body, "num_consts": 1, "num_carry": 1}
    new = {"jaxpr": body.jaxpr, "ft_in": ((None,), (None,), (None,))}
    for params in (old, new):
        closed, num_consts, num_carry = _compat.scan_layout(params)
        assert closed.jaxpr is body.jaxpr and (num_consts, num_carry) == (1, 1)


class _Bwd:
    def __init__(self, out):
        self.out = out

    def call_wrapped(self, *args):
        return self.out


def test_custom_vjp_bwd_cotangents_of_both_forms():
    cts = [jnp.ones(2), jnp.zeros(3)]
    assert _compat.call_custom_vjp_bwd(_Bwd(cts), 1.0) == cts  # up to JAX 0.10
    assert _compat.call_custom_vjp_bwd(_Bwd((cts, None)), 1.0) == cts  # 0.11: with logs
    assert _compat.call_custom_vjp_bwd(_Bwd((cts, {"a": 1})), 1.0) == cts
