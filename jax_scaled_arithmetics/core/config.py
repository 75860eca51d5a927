"""`AutoScaleConfig`: the settings `autoscale` reads while it interprets a function."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["AutoScaleConfig", "Pow2RoundMode", "ScalePolicy", "get_autoscale_config"]


class Pow2RoundMode(enum.IntEnum):
    """How scales are rounded to powers of two.

    - `NONE`: no rounding, scales take any float value.
    - `DOWN`: the largest power of two not above the value (the default).
    - `UP`: the smallest power of two not below the value.
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

    def __enter__(self) -> AutoScaleConfig:
        _stack().append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _stack().pop()


class _ConfigState(threading.local):
    def __init__(self) -> None:
        self.stack: list[AutoScaleConfig] = [AutoScaleConfig()]


_STATE = _ConfigState()


def _stack() -> list[AutoScaleConfig]:
    return _STATE.stack


def get_autoscale_config() -> AutoScaleConfig:
    """The configuration in force (the innermost `AutoScaleConfig` context)."""
    return _stack()[-1]


@contextlib.contextmanager
def default_config(config: AutoScaleConfig) -> Iterator[None]:
    """Replace the bottom (default) configuration, e.g. in a test session."""
    stack = _stack()
    previous = stack[0]
    stack[0] = config
    try:
        yield
    finally:
        stack[0] = previous
