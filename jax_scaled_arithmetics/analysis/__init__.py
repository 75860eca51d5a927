"""Diagnostics: program size of (autoscaled) functions, and the range of their values.

Examples:
    >>> import jax.numpy as jnp
    >>> import jax_scaled_arithmetics as jsa
    >>> sum(jsa.analysis.equation_counts(jnp.tanh, jnp.ones(3)).values())
    1
"""

from ._program import equation_counts as equation_counts
from ._program import jaxpr_equation_counts as jaxpr_equation_counts

__all__ = ["equation_counts", "jaxpr_equation_counts"]
