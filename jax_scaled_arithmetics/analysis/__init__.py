"""Diagnostics: program size of (autoscaled) functions, and the range of their values.

Examples:
    >>> import jax.numpy as jnp
    >>> import jax_scaled_arithmetics as jsa
    >>> sum(jsa.analysis.equation_counts(jnp.tanh, jnp.ones(3)).values())
    1
    >>> table = jsa.analysis.tensor_ranges(jnp.tanh, jnp.ones(3, jnp.float16))
    >>> [(row.primitive, row.phase, row.dtype) for row in table.rows]
    [('tanh', 'forward', 'float16')]
"""

from ._program import equation_counts as equation_counts
from ._program import jaxpr_equation_counts as jaxpr_equation_counts
from ._promotion import DtypePromotion as DtypePromotion
from ._promotion import PromotionReport as PromotionReport
from ._promotion import dtype_promotions as dtype_promotions
from ._range_table import RangeTable as RangeTable
from ._range_table import TensorRange as TensorRange
from ._ranges import plot_ranges as plot_ranges
from ._ranges import tensor_ranges as tensor_ranges

__all__ = [
    "DtypePromotion",
    "PromotionReport",
    "RangeTable",
    "dtype_promotions",
    "TensorRange",
    "equation_counts",
    "jaxpr_equation_counts",
    "plot_ranges",
    "tensor_ranges",
]
