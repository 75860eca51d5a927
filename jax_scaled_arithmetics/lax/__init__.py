"""Scaled rules for `jax.lax` primitives, and the scaling primitives.

Importing this package registers every rule. Public names: the scaling
operations `set_scaling`, `stop_scaling`, `get_data_scale`, `rebalance`, and
`apply_to_data` (an elementwise function of the stored data).
"""

from . import block_rules as block_rules
from . import callbacks as callbacks
from . import collectives as collectives
from . import complex_values as complex_values
from . import control_flow as control_flow
from . import custom_derivatives as custom_derivatives
from . import elementwise as elementwise
from . import indexing as indexing
from . import linalg as linalg
from . import linalg_decompositions as linalg_decompositions
from . import linear_solve as linear_solve
from . import optimizer_guard as optimizer_guard
from . import reductions as reductions
from . import shape as shape
from . import transcendental as transcendental
from .scaling_primitives import apply_to_data as apply_to_data
from .scaling_primitives import get_data_scale as get_data_scale
from .scaling_primitives import rebalance as rebalance
from .scaling_primitives import set_scaling as set_scaling
from .scaling_primitives import stop_scaling as stop_scaling

__all__ = ["apply_to_data", "get_data_scale", "rebalance", "set_scaling", "stop_scaling"]
