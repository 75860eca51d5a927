"""Program size: the equations of a function's jaxpr, by primitive, sub-jaxprs included."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax

from ..core import _compat

__all__ = ["equation_counts", "jaxpr_equation_counts", "sub_jaxprs"]


def sub_jaxprs(param: Any) -> list[Any]:
    """The jaxprs an equation parameter holds (a Jaxpr, a ClosedJaxpr, or a tuple of them)."""
    subs = param if isinstance(param, (tuple, list)) else (param,)
    out = []
    for sub in subs:
        inner = getattr(sub, "jaxpr", sub)
        if isinstance(inner, _compat.Jaxpr):
            out.append(inner)
    return out


def jaxpr_equation_counts(jaxpr: Any) -> collections.Counter[str]:
    """Equations of `jaxpr` (a Jaxpr or ClosedJaxpr) by primitive name, sub-jaxprs counted.

    A higher-order equation (jit, scan, cond, custom_jvp_call...) counts once itself, plus
    the equations of every jaxpr among its params.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> jaxpr = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(3))
        >>> sorted(jsa.analysis.jaxpr_equation_counts(jaxpr).items())
        [('mul', 1), ('sin', 1)]
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    counts: collections.Counter[str] = collections.Counter()
    stack = [jaxpr]
    while stack:
        current = stack.pop()
        for eqn in current.eqns:
            counts[eqn.primitive.name] += 1
            for param in eqn.params.values():
                stack.extend(sub_jaxprs(param))
    return counts


def equation_counts(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> collections.Counter[str]:
    """Equations of `fun`'s jaxpr on `args`, by primitive name, sub-jaxprs counted.

    A measure of program size: what XLA receives grows with it, and so does the time
    to compile. Compare a function under `jsa.autoscale` with the plain one.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> counts = jsa.analysis.equation_counts(lambda x: jnp.sin(x) * 2, jnp.ones(3))
        >>> sorted(counts.items())
        [('mul', 1), ('sin', 1)]
    """
    return jaxpr_equation_counts(jax.make_jaxpr(fun)(*args, **kwargs))
