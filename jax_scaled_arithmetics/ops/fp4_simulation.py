"""`simulate_fp4`: run a function with its linear layers' matmuls in a 4-bit training recipe."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..core import _compat
from ..core.rewrite import rewrite_call, sub_jaxprs
from ..core.walker import Frame, JaxprWalker
from .fp4_matmul import FP4_RECIPES, fp4_matmul, recipe_block_size

__all__ = ["simulate_fp4"]


def _linear_operands(eqn: Any, block: int) -> bool | None:
    """For a `dot_general` that is a linear layer's ``x (..., K) @ w`` with ``w`` (K, N)
    (False) or ``(N, K)`` (True, a transposed weight such as a tied embedding), whose K, N
    and tokens `block` divides: whether `w` is transposed; None for any other equation."""
    if eqn.primitive.name != "dot_general":
        return None
    (lhs_c, rhs_c), (lhs_b, rhs_b) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval for v in eqn.invars)
    if lhs_b or rhs_b or rhs.ndim != 2 or lhs.ndim < 1 or tuple(lhs_c) != (lhs.ndim - 1,):
        return None
    if tuple(rhs_c) not in ((0,), (1,)):
        return None
    if not all(jnp.issubdtype(a.dtype, jnp.floating) for a in (lhs, rhs)):
        return None
    k = lhs.shape[-1]
    n = rhs.shape[1 - rhs_c[0]]
    tokens = math.prod(lhs.shape[:-1])
    if k % block or n % block or tokens % block:
        return None
    return tuple(rhs_c) == (1,)


def _count_linear(jaxpr: Any, block: int) -> int:
    count = 0
    for eqn in jaxpr.eqns:
        if _linear_operands(eqn, block) is not None:
            count += 1
        else:
            count += sum(_count_linear(inner, block) for inner in sub_jaxprs(eqn))
    return count


class _Fp4Rewriter(JaxprWalker):
    """Linear-layer matmuls become `fp4_matmul`s, in program order; the ones
    `high_precision(index, count)` picks, and every other equation, are kept."""

    def __init__(self, key: Any, options: dict[str, Any], high_precision: Any, count: int):
        self.key = key
        self.options = options
        self.high_precision = high_precision
        self.count = count
        self.index = 0

    def eval_eqn(self, eqn: Any, invals: list[Any], frame: Frame) -> list[Any]:
        block = recipe_block_size(self.options["recipe"])
        transposed = _linear_operands(eqn, block)
        if transposed is None:
            if eqn.primitive is _compat.scan_p and self.key is not None:
                body, _, _ = _compat.scan_layout(eqn.params)
                if _count_linear(body.jaxpr, block):
                    return self._scan_with_fresh_bits(eqn.params, invals, frame.context)
            return self.eval_higher_order(eqn, invals, frame.context)
        index = self.index
        self.index += 1
        if self.high_precision(index, self.count):
            return self.eval_higher_order(eqn, invals, frame.context)
        x, w = invals
        key = None if self.key is None else jax.random.fold_in(self.key, index)
        y = fp4_matmul(x, w.T if transposed else w, key, **self.options)
        return [y.astype(eqn.outvars[0].aval.dtype)]

    def _scan_with_fresh_bits(self, params: Any, invals: list[Any], context: Any) -> list[Any]:
        """A `scan` whose body holds linear matmuls, rebuilt so that iteration `i` draws
        from ``fold_in(key, i)``: each layer of a scanned stack, each step of a loop, gets
        its own random bits."""
        body, num_consts, num_carry = _compat.scan_layout(params)
        consts = invals[:num_consts]
        carry = invals[num_consts : num_consts + num_carry]
        xs = invals[num_consts + num_carry :]
        outer_key = self.key

        def step(c: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            iteration, *x = x
            self.key = jax.random.fold_in(outer_key, iteration)
            try:
                outs = self.run_closed(body, [*consts, *c, *x], context)
            finally:
                self.key = outer_key
            return outs[:num_carry], outs[num_carry:]

        carry_out, ys = jax.lax.scan(
            step,
            carry,
            [jnp.arange(params["length"], dtype=jnp.uint32), *xs],
            length=params["length"],
            reverse=params["reverse"],
            unroll=params["unroll"],
        )
        return [*carry_out, *ys]


def _first_and_last(index: int, count: int) -> bool:
    return index in (0, count - 1)


def simulate_fp4(
    fn: Callable[..., Any],
    *,
    recipe: str = "nvfp4",
    hadamard: bool = True,
    stochastic_gradients: bool = True,
    weight_blocks: str = "2d",
    high_precision: str | Callable[[int, int], bool] | None = "first_and_last",
    scale_rounding: str = "up",
) -> Callable[..., Any]:
    """`fn` with its linear layers' matmuls computed as a 4-bit training recipe does.

    Every `dot_general` of `fn` that is a linear layer, ``x (..., K) @ w`` with a 2-D
    weight ``w (K, N)`` (or ``(N, K)`` contracted on its second axis, a tied embedding),
    with K, N and the number of tokens multiples of the recipe's block size (16 for
    ``"nvfp4"`` and ``"fp4_tensor"``, 32 for ``"mxfp4"``), becomes `jsa.ops.fp4_matmul`
    (4-bit operands in its forward and both backward matmuls, 2D weight blocks,
    stochastically rounded gradients, a random Hadamard transform on the weight gradient's
    operands; each switchable with the same-named arguments, `scale_rounding` for
    MXFP4's E8M0 scales). Other matmuls (attention's batched products, shapes the block
    size does not divide) stay as they are, as the recipes keep them in higher precision.
    `high_precision` keeps some linear layers too: `"first_and_last"` (the default, as the
    NVFP4 recipe keeps the first and last layers), None, or a predicate
    ``(index, count) -> bool`` on the linear matmuls in program order.

    The returned function takes a `key=` keyword (a PRNG key; required unless both
    `hadamard` and `stochastic_gradients` are off): matmul `i` draws from
    ``fold_in(key, i)``, so pass a new key each step; inside a `scan` (a stack of layers
    run as a loop), iteration `t` folds `t` into the key first, so every iteration draws
    new bits. Use `jax.grad` outside: `jax.grad(simulate_fp4(f))`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> f = jsa.ops.simulate_fp4(lambda x, w: x @ w, high_precision=None)
        >>> y = f(jnp.ones((16, 32)), jnp.full((32, 16), 0.3), key=jax.random.key(0))
        >>> round(float(y[0, 0]), 4)  # 0.3 is on the NVFP4 grid of its tensor scale
        9.6
        >>> g = jsa.ops.simulate_fp4(lambda x, w: x @ w, recipe="mxfp4", high_precision=None)
        >>> float(g(jnp.ones((32, 32)), jnp.full((32, 32), 0.3), key=jax.random.key(0))[0, 0])
        8.0
    """
    if not callable(fn):
        raise TypeError(f"simulate_fp4 expects a callable, got {type(fn).__name__}.")
    if recipe not in FP4_RECIPES:
        raise ValueError(f"simulate_fp4: recipe must be one of {FP4_RECIPES}, got {recipe!r}")
    if weight_blocks not in ("2d", "1d"):
        raise ValueError(f"simulate_fp4: weight_blocks must be '2d' or '1d', got {weight_blocks!r}")
    if high_precision == "first_and_last":
        keep: Callable[[int, int], bool] = _first_and_last
    elif high_precision is None:
        keep = lambda index, count: False  # noqa: E731
    elif callable(high_precision):
        keep = high_precision
    else:
        raise ValueError(
            "simulate_fp4: high_precision must be 'first_and_last', None or a predicate "
            f"(index, count) -> bool, got {high_precision!r}"
        )
    if scale_rounding not in ("up", "floor"):
        raise ValueError(
            f"simulate_fp4: scale_rounding must be 'up' or 'floor', got {scale_rounding!r}"
        )
    options = {
        "recipe": recipe,
        "scale_rounding": scale_rounding,
        "hadamard": bool(hadamard),
        "stochastic_gradients": bool(stochastic_gradients),
        "weight_blocks": weight_blocks,
    }

    @functools.wraps(fn)
    def wrapped(*args: Any, key: Any = None, **kwargs: Any) -> Any:
        def make_walker(closed: Any) -> _Fp4Rewriter:
            block = recipe_block_size(recipe)
            return _Fp4Rewriter(key, options, keep, _count_linear(closed.jaxpr, block))

        return rewrite_call("simulate_fp4", fn, make_walker, args, kwargs)

    return wrapped
