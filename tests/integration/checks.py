"""Run a real program under autoscale, forward and backward, and compare with plain float32.

The inputs are ScaledArrays representing ordinary values (data = value / scale,
exact for power-of-two scales), so the program sees the same values as the plain
float32 reference; every floating output must come back as a ScaledArray.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_scaled_arithmetics as jsa
from tests.helpers import represented

DEFAULT_SCALE = 2.0**-12


def scale_tree(tree: Any, scale: float = DEFAULT_SCALE, dtype: Any = None) -> Any:
    """Every floating leaf as a ScaledArray with the given scale (same represented value)."""
    return jsa.as_scaled_array(tree, scale=np.float32(scale), dtype=dtype)


def _weights(leaf: Any) -> Any:
    return jnp.cos(jnp.arange(leaf.size, dtype=jnp.float32)).reshape(leaf.shape)


def loss_cotangent(out: Any) -> Any:
    """Cotangent of the outputs for the loss `sum(w * y + y**2 / 2)` over floating outputs.

    It depends on the outputs (`w + y`), so backward passes carry scaled values all
    the way; integer outputs get float0 cotangents.
    """

    def ct(leaf: Any) -> Any:
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            return (_weights(leaf) + leaf.astype(jnp.float32)).astype(leaf.dtype)
        return np.zeros(leaf.shape, jax.dtypes.float0)

    return jax.tree_util.tree_map(ct, out)


def _is_scaled(x: Any) -> bool:
    return isinstance(x, jsa.ScaledArray)


def assert_all_scaled(tree: Any, what: str) -> None:
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_scaled)
    for path, leaf in leaves:
        if isinstance(leaf, jsa.ScaledArray):
            continue
        if jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise AssertionError(
                f"{what}{jax.tree_util.keystr(path)} is a plain {type(leaf).__name__}, "
                f"not a ScaledArray."
            )


def assert_tree_close(
    actual: Any, expected: Any, rtol: float, what: str = "output", atol: float = 0.0
) -> None:
    """Leafwise comparison; the absolute tolerance is `rtol * max |expected|` or `atol`."""
    act = jax.tree_util.tree_leaves_with_path(actual, is_leaf=_is_scaled)
    exp = jax.tree_util.tree_leaves(expected)
    assert len(act) == len(exp), (len(act), len(exp))
    for (path, a), e in zip(act, exp, strict=True):
        e = np.asarray(e)
        try:
            if jnp.issubdtype(e.dtype, jnp.floating):
                e = e.astype(np.float64)
                tol = max(rtol * float(np.max(np.abs(e), initial=0.0)), atol)
                np.testing.assert_allclose(represented(a), e, rtol=rtol, atol=tol)
            else:
                np.testing.assert_array_equal(np.asarray(a), e)
        except AssertionError as err:
            raise AssertionError(f"{what}{jax.tree_util.keystr(path)}: {err}") from None


def check_forward_backward(
    fn: Callable[[Any], Any],
    params: Any,
    rtol: float = 1e-5,
    scale: float = DEFAULT_SCALE,
    backward: bool = True,
    atol: float = 0.0,
) -> None:
    """`autoscale` of `fn` and of its backward pass, on scaled `params`, match float32.

    `fn` takes one pytree of floating arrays (everything else is closed over). The
    forward outputs and the gradients (of `sum(w * y + y**2 / 2)`) come from one
    autoscaled, jitted program, so that the check compiles it once.
    """

    def forward_backward(p: Any) -> Any:
        if not backward:
            return fn(p), None
        out, pullback = jax.vjp(fn, p)
        return out, pullback(loss_cotangent(out))[0]

    scaled = scale_tree(params, scale)
    out, grads = jax.jit(jsa.autoscale(forward_backward))(scaled)
    expected_out, expected_grads = jax.jit(forward_backward)(params)
    assert_all_scaled(out, "output")
    assert_tree_close(out, expected_out, rtol, atol=atol)
    if backward:
        assert_all_scaled(grads, "gradient")
        assert_tree_close(grads, expected_grads, rtol, "gradient", atol=atol)
