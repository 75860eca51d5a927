"""`custom_linear_solve` under autoscale (lax/linear_solve.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa
from tests.helpers import (
    assert_close,
)
from tests.lax.test_control_flow import (
    RNG,
    V,
    X,
    _diag_solve,
)


def _cg_solve(a, v):
    return jax.scipy.sparse.linalg.cg(lambda x: a @ x, v, tol=1e-6)[0]


@pytest.mark.parametrize("solver", [_diag_solve, _cg_solve], ids=["diag", "cg"])
@pytest.mark.one_case
def test_custom_linear_solve_forward_and_implicit_gradients(solver):
    """The solve is kept (cg's while loop has no reverse-mode): gradients are implicit."""
    a = RNG.normal(size=(3, 3)).astype(np.float32)
    mat = np.abs(V) + 1 if solver is _diag_solve else a @ a.T + 3 * np.eye(3, dtype=np.float32)
    b = X[0]
    sa = jsa.as_scaled_array(mat, scale=np.float32(2.0**20))
    sb = jsa.as_scaled_array(b, scale=np.float32(2.0**-10))
    loss = lambda m, v: jnp.sum(solver(m, v) * jnp.arange(3.0))  # noqa: E731

    def solve_and_grad(m, v):  # one program for both
        return solver(m, v), jax.grad(loss, argnums=(0, 1))(m, v)

    out, grads = jax.jit(jsa.autoscale(solve_and_grad))(sa, sb)
    ref, expected = jax.jit(solve_and_grad)(mat, b)
    assert isinstance(out, jsa.ScaledArray)
    assert_close(out, ref, 1e-4)
    for g, e in zip(grads, expected, strict=True):
        assert_close(g, e, 1e-4)

    def data_loss(md, vd):
        return jsa.autoscale(loss)(jsa.ScaledArray(md, sa.scale), jsa.ScaledArray(vd, sb.scale))

    grads = jax.jit(jax.grad(lambda *d: data_loss(*d).to_array(), argnums=(0, 1)))(sa.data, sb.data)
    for g, e, s in zip(grads, expected, (sa.scale, sb.scale), strict=True):
        assert_close(np.asarray(g) / np.float64(s), e, 1e-4)
