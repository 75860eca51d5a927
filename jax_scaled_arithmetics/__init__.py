"""JAX Scaled Arithmetics: low-precision deep learning with scaled arrays.

Examples:
    >>> import jax.numpy as jnp
    >>> import jax_scaled_arithmetics as jsa
    >>> x = jsa.as_scaled_array(jnp.array([1.0, 2.0], jnp.float16))
    >>> jsa.autoscale(lambda a: a * 2.0)(x).to_array()
    Array([2., 4.], dtype=float16)
"""

from . import _flax_registration
from . import analysis as analysis
from . import lax as lax
from . import mp as mp
from . import ops as ops
from . import quantization as quantization
from . import sharding as sharding
from . import tree as tree
from . import unit_scaling as unit_scaling
from .core.config import AutoScaleConfig as AutoScaleConfig
from .core.config import Pow2RoundMode as Pow2RoundMode
from .core.config import ScalePolicy as ScalePolicy
from .core.datatype import ScaledArray as ScaledArray
from .core.datatype import as_scaled_array as as_scaled_array
from .core.datatype import asarray as asarray
from .core.datatype import is_scaled_leaf as is_scaled_leaf
from .core.datatype import scaled_array as scaled_array
from .core.delayed import ScaleHistory as ScaleHistory
from .core.delayed import delayed_scaling as delayed_scaling
from .core.interpreter import autoscale as autoscale
from .core.interpreter import scalify as scalify
from .core.registry import coverage as coverage
from .core.registry import register_scaled_op as register_scaled_op
from .core.vmap import scaled_axes as scaled_axes
from .core.vmap import vmap as vmap

__version__ = "0.1.0"

# ScaledArray and MXArray with `flax.serialization`: now if Flax is imported, else when it is.
_flax_registration.install()


def __getattr__(name: str):
    # `jsa.optax` needs optax, which the core does not depend on; `jsa.checkpoint` imports
    # Flax when it is installed: import them on first use.
    if name in ("checkpoint", "optax"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AutoScaleConfig",
    "analysis",
    "Pow2RoundMode",
    "ScaleHistory",
    "ScalePolicy",
    "ScaledArray",
    "as_scaled_array",
    "asarray",
    "autoscale",
    "checkpoint",
    "coverage",
    "delayed_scaling",
    "is_scaled_leaf",
    "lax",
    "mp",
    "ops",
    "optax",
    "quantization",
    "register_scaled_op",
    "scaled_array",
    "scalify",
    "sharding",
    "scaled_axes",
    "tree",
    "unit_scaling",
    "vmap",
]
