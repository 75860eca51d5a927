"""Unit scaling: ops whose outputs and gradients have unit variance for unit inputs.

Each op has separate forward and backward scale factors (Python floats computed at trace
time from shapes). Imported in the docs as `U`:

Examples:
    >>> import jax
    >>> import jax_scaled_arithmetics.unit_scaling as U
    >>> x = jax.random.normal(jax.random.key(0), (512, 256))
    >>> w = jax.random.normal(jax.random.key(1), (256, 256))
    >>> round(float(U.gelu(U.linear(x, w), constraint=None).std()), 1)
    1.0
"""

from .._deprecation import moved_names
from . import _optim as optim
from ._activations import gelu as gelu
from ._activations import silu as silu
from ._activations import silu_glu as silu_glu
from ._attention import scaled_dot_product_attention as scaled_dot_product_attention
from ._dropout import dropout as dropout
from ._embedding import embedding as embedding
from ._fwd_bwd import Constraint as Constraint
from ._fwd_bwd import apply_constraint as apply_constraint
from ._fwd_bwd import scale_bwd as scale_bwd
from ._fwd_bwd import scale_fwd as scale_fwd
from ._linear import conv1d as conv1d
from ._linear import conv2d as conv2d
from ._linear import dot_general as dot_general
from ._linear import linear as linear
from ._linear import linear_readout as linear_readout
from ._linear import matmul as matmul
from ._losses import cross_entropy as cross_entropy
from ._losses import mse_loss as mse_loss
from ._norms import layer_norm as layer_norm
from ._norms import rms_norm as rms_norm
from ._params import parameter_specs as parameter_specs
from ._residual import add as add
from ._residual import residual_add as residual_add
from ._residual import residual_apply as residual_apply
from ._residual import residual_split as residual_split
from ._residual import transformer_residual_scaling_rule as transformer_residual_scaling_rule
from ._softmax import softmax as softmax
from ._transform import unit_init as unit_init
from ._transform import unit_scale as unit_scale

__all__ = [
    "Constraint",
    "add",
    "apply_constraint",
    "conv1d",
    "conv2d",
    "cross_entropy",
    "dot_general",
    "dropout",
    "embedding",
    "gelu",
    "layer_norm",
    "linear",
    "linear_readout",
    "matmul",
    "mse_loss",
    "optim",
    "parameter_specs",
    "residual_add",
    "residual_apply",
    "residual_split",
    "rms_norm",
    "scale_bwd",
    "scale_fwd",
    "scaled_dot_product_attention",
    "silu",
    "silu_glu",
    "softmax",
    "transformer_residual_scaling_rule",
    "unit_init",
    "unit_scale",
]

# Moved to `jsa.ops` (quantisation transforms live with the FP8/FP4 recipes they apply).
__getattr__ = moved_names(
    __name__,
    {
        "simulate_fp4": ("jax_scaled_arithmetics.ops", "simulate_fp4"),
        "simulate_fp8": ("jax_scaled_arithmetics.ops", "simulate_fp8"),
    },
)
