"""Mixed precision: policies and loss scaling, with the API of DeepMind's `jmp`.

Every function handles ScaledArray leaves: casting casts their data and keeps
their scale, loss scaling multiplies their scale and keeps their data.
"""

from .loss_scale import BooleanScalarError as BooleanScalarError
from .loss_scale import DynamicLossScale as DynamicLossScale
from .loss_scale import LossScale as LossScale
from .loss_scale import NoOpLossScale as NoOpLossScale
from .loss_scale import StaticLossScale as StaticLossScale
from .loss_scale import all_finite as all_finite
from .loss_scale import select_tree as select_tree
from .policy import Policy as Policy
from .policy import cast_to_full as cast_to_full
from .policy import cast_to_half as cast_to_half
from .policy import get_policy as get_policy
from .policy import half_dtype as half_dtype

__all__ = [
    "BooleanScalarError",
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "cast_to_full",
    "cast_to_half",
    "get_policy",
    "half_dtype",
    "select_tree",
]
