"""`AutoScaleConfig`: the settings `autoscale` reads while it interprets a function.

The configuration in force is a JAX configuration state that `jax.jit` keys its cache on
(as it does `jax.default_matmul_precision`): a jitted autoscaled function called under
another configuration is traced again under it, never run as the program of the first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _compat

__all__ = ["AutoScaleConfig", "Pow2RoundMode", "ScalePolicy", "get_autoscale_config"]


class Pow2RoundMode(enum.IntEnum):
    """How scales are rounded to powers of two.

    - `NONE`: no rounding, scales take any float value.
    - `DOWN`: the largest power of two not above the value (the default).
    - `UP`: the smallest power of two not below the value.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jsa.as_scaled_array(jnp.array([3.0, 5.0], jnp.float16))
        >>> with jsa.AutoScaleConfig(rounding_mode=jsa.Pow2RoundMode.UP):
        ...     y = jsa.autoscale(lambda a: a * 3.0)(x)
        >>> y.scale  # 3 rounded up (DOWN, the default, gives 2)
        Array(4., dtype=float32)
    """

    NONE = 0
    DOWN = 1
    UP = 2


class ScalePolicy(enum.Enum):
    """How the rules of sums and contractions (reduce_sum, dot_general, conv...) choose
    their output scale.

    - `DYNAMIC` (the default): the power of two of the output's largest finite
      magnitude, one reduction over the output (which a contraction or a sum makes
      smaller than its inputs, or as large). Scales then track the data through any
      model, forward and backward: the data's largest magnitude is in [1, 2) after
      every sum and contraction, whatever the static estimates would have said.
    - `STATIC`: the unit-scaling estimate, `sqrt(N)` for a sum of N terms and
      `sa * sb * sqrt(K)` for a contraction over K, computed at trace time. Free at run
      time, and right for unit-scaled models (whose ops keep unit variance); on other
      models the data drifts from unit range, so rescale it yourself
      (`jsa.ops.dynamic_rescale_*`).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jsa.as_scaled_array(jnp.array([3.0, 5.0], jnp.float16))
        >>> jsa.autoscale(jnp.sum)(x)  # DYNAMIC: the data's largest magnitude in [1, 2)
        ScaledArray(data=Array(1., dtype=float16), scale=Array(8., dtype=float32))
        >>> with jsa.AutoScaleConfig(policy=jsa.ScalePolicy.STATIC):
        ...     jsa.autoscale(jnp.sum)(x)  # sqrt(2), rounded down to 1
        ScaledArray(data=Array(8., dtype=float16), scale=Array(1., dtype=float32))
    """

    DYNAMIC = "dynamic"
    STATIC = "static"


@dataclasses.dataclass(frozen=True)
class AutoScaleConfig:
    """Settings of the `autoscale` interpreter, usable as a context manager.

    Args:
        rounding_mode: power-of-two rounding of the scales that rules compute.
        scale_dtype: dtype of the scales given to promoted unscaled inputs.
        check: verify that every rule returns the dtype and shape of the plain
            primitive (a cheap, trace-time check; useful when writing rules).
        policy: how sums and contractions choose their output scale
            (:class:`ScalePolicy`; dynamic by default).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jsa.as_scaled_array(jnp.array([1.0, 2.0]))
        >>> with jsa.AutoScaleConfig(rounding_mode=jsa.Pow2RoundMode.NONE):
        ...     y = jsa.autoscale(lambda a: a + a)(x)
        >>> float(y.scale)  # sqrt(2), not rounded
        1.4142135381698608
    """

    rounding_mode: Pow2RoundMode = Pow2RoundMode.DOWN
    scale_dtype: Any = np.float32
    check: bool = False
    policy: ScalePolicy = ScalePolicy.DYNAMIC

    def __post_init__(self) -> None:
        if not isinstance(self.rounding_mode, Pow2RoundMode):
            raise TypeError(f"rounding_mode must be a Pow2RoundMode, got {self.rounding_mode!r}.")
        if not isinstance(self.policy, ScalePolicy):
            raise TypeError(f"policy must be a ScalePolicy, got {self.policy!r}.")
        if not np.issubdtype(np.dtype(self.scale_dtype), np.floating):
            raise TypeError(f"scale_dtype must be a floating dtype, got {self.scale_dtype!r}.")
        # One spelling per dtype (np.float32, "float32", jnp.float32 are one key of jit's
        # cache); a frozen dataclass sets its field this way.
        object.__setattr__(self, "scale_dtype", np.dtype(self.scale_dtype))

    def __enter__(self) -> AutoScaleConfig:
        _ENTERED.stack.append(_IN_FORCE.swap_local(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        _IN_FORCE.set_local(_ENTERED.stack.pop())


# The configuration in force: a thread's innermost `AutoScaleConfig` context, else the
# process default. Part of jit's cache key and of JAX's trace context.
_IN_FORCE = _compat.program_state(
    "jax_scaled_arithmetics_autoscale_config",
    AutoScaleConfig(),
    "The AutoScaleConfig in force (set with `with jsa.AutoScaleConfig(...)`).",
)


class _Entered(threading.local):
    """Per thread: what each entered `AutoScaleConfig` context replaced, innermost last."""

    def __init__(self) -> None:
        self.stack: list[Any] = []


_ENTERED = _Entered()


def get_autoscale_config() -> AutoScaleConfig:
    """The configuration in force (the innermost `AutoScaleConfig` context)."""
    config: AutoScaleConfig = _IN_FORCE.value
    return config


@contextlib.contextmanager
def default_config(config: AutoScaleConfig) -> Iterator[None]:
    """Replace the process's default configuration (under every context), e.g. in a test
    session."""
    previous = _IN_FORCE.get_global()
    _IN_FORCE.set_global(config)
    try:
        yield
    finally:
        _IN_FORCE.set_global(previous)
