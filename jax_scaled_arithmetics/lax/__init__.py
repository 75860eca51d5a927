"""Scaled rules for `jax.lax` primitives, and the scaling primitives.

Importing this package registers every rule. Public names: the scaling
operations `set_scaling`, `stop_scaling`, `get_data_scale`, `rebalance`, and
`apply_to_data` (an elementwise function of the stored data).
"""

from . import blocks as blocks
from . import collectives as collectives
from . import complex_values as complex_values
from . import control_flow as control_flow
from . import elementwise as elementwise
from . import indexing as indexing
from . import linalg as linalg
from . import linalg_decompositions as linalg_decompositions
from . import optimizer_guard as optimizer_guard
from . import reductions as reductions
from . import shape as shape
from . import transcendental as transcendental
from .scaling import apply_to_data as apply_to_data
from .scaling import get_data_scale as get_data_scale
from .scaling import rebalance as rebalance
from .scaling import set_scaling as set_scaling
from .scaling import stop_scaling as stop_scaling

__all__ = ["apply_to_data", "get_data_scale", "rebalance", "set_scaling", "stop_scaling"]
