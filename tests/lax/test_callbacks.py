"""Callbacks, barriers, names and placement under autoscale (lax/callbacks.py)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import io_callback

import jax_scaled_arithmetics as jsa
from tests.helpers import (
    assert_close,
    make_scaled,
    represented,
)
from tests.lax.test_control_flow import (
    V,
    _jaxpr_text,
)

# --- callbacks and other higher-order primitives ---------------------------------------------


def test_debug_print_and_callback_see_represented_values(capsys):
    seen = []

    def fn(x):
        jax.debug.print("value={v}", v=x)
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), x * 2)
        return x

    x = make_scaled(np.array([1.0, 1.5]), np.float16, 2.0**40)
    jax.jit(jsa.autoscale(fn))(x)
    jax.effects_barrier()
    printed = capsys.readouterr().out
    values = [float(v) for v in re.findall(r"[-\d.]+e[+-]\d+", printed)]
    np.testing.assert_allclose(values, [2.0**40, 1.5 * 2.0**40], rtol=1e-6)
    np.testing.assert_allclose(seen[-1], [2.0**41, 3 * 2.0**40], rtol=1e-6)


def test_pure_and_io_callbacks_receive_values():
    def fn(x):
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        a = jax.pure_callback(lambda v: np.cos(v).astype(v.dtype), shape, x)
        b = io_callback(lambda v: (v * 2).astype(v.dtype), shape, x)
        return a, b

    x = make_scaled(V, np.float32, 2.0**-10)
    a, b = jsa.autoscale(fn)(x)
    np.testing.assert_allclose(a, np.cos(represented(x)), rtol=1e-6)
    np.testing.assert_allclose(b, 2 * represented(x), rtol=1e-6)


def test_checkpoint_name_policy_and_placement():
    policy = jax.checkpoint_policies.save_only_these_names("hidden")

    def fn(x):
        h = checkpoint_name(jnp.sin(x) * 2, "hidden")
        h = jax.lax.with_sharding_constraint(h, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        return jnp.sum(jax.device_put(h) * x)

    loss = jax.checkpoint(fn, policy=policy)
    x = make_scaled(V, np.float32, 2.0**-20)
    g = jax.jit(jsa.autoscale(jax.grad(loss)))(x)
    assert_close(g, jax.grad(loss)(jnp.asarray(represented(x))), 1e-5)
    text = _jaxpr_text(jsa.autoscale(jax.grad(loss)), x)
    assert "name=hidden" in text


def test_dce_sink_keeps_data_and_scale():
    x = make_scaled(np.arange(1.0, 5.0), np.float16, 2.0**-9)

    def fn(a):
        jax.lax.dce_sink(a * 3)
        return a + 1

    jaxpr = jax.make_jaxpr(jsa.autoscale(fn))(x).jaxpr
    sunk = [e.invars[0].aval.dtype for e in jaxpr.eqns if e.primitive.name == "dce_sink"]
    assert sorted(map(str, sunk)) == ["float16", "float32"]
    assert_close(jax.jit(jsa.autoscale(fn))(x), represented(x) + 1, 1e-3)
