"""Delayed scaling: sums and contractions take their output scale from earlier steps.

Under `ScalePolicy.DYNAMIC` the output scale of every sum and contraction is the power of
two of that output's largest finite magnitude: the data waits for a reduction over the
whole output. :func:`delayed_scaling` takes the scale from a history of the scales the
same sum or contraction had at the previous steps instead (Transformer Engine's
`DelayedScaling` recipe, with power-of-two scales), so the output's data does not wait
for its own reduction; the reduction still runs, for the next step's history, off the
data's path. The history is an explicit value (:class:`ScaleHistory`) that the step takes
and returns, carried in the training state like an optimizer state.

Each sum and contraction that the step's program runs at its top level is a *site*,
numbered in program order. A site in the body of a top-level `scan` is a site at each
iteration (layers stacked and scanned hold a scale each): the scan takes the held scales
of its rows as one more scanned input and returns the body's measured scales as one more
stacked output. Those inside a `while` loop, a conditional (`cond`), a checkpointed
function (`jax.checkpoint`), a custom derivative, a `jit` with shardings or a scan within a
scan's body keep the dynamic scale (their bodies are traced apart from the step). A `jit`
without shardings is inlined, so its sites count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat, block_scales
from .interpreter import autoscale, tracing_a_scaled_function
from .scale_arithmetic import (
    SCALE_MAX,
    SCALE_MIN,
    largest_finite_magnitudes_p,
    scale_of_magnitude,
)

__all__ = ["ScaleHistory", "delayed_scaling", "recording", "site_recorder"]


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class ScaleHistory:
    """The output scales of a step's sums and contractions at its last steps.

    Attributes:
        scales: one float32 array `[sites, length]`: row `i` holds site `i`'s dynamic
            scale (the power of two of its output's largest finite magnitude) at each of
            the last `length` steps, newest first. One array, so that a step computes all
            its held scales in one small kernel and writes the new history in one more
            (docs/benchmarks.md, "Delayed scaling").
        sites: one description per site (the output's dtype and shape; a scan body's
            site once per iteration, as `scan 0 (12 iterations), iteration 3: float16[8,
            64]`), in program order; static (part of a compiled program's key), and
            checked at every call so that a history is never read by a program it was not
            made for.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> step = jsa.delayed_scaling(lambda a: jnp.sum(a * a), history_length=4)
        >>> _, history = step.init(jsa.as_scaled_array(jnp.array([3.0, 4.0], jnp.float16)))
        >>> history.sites  # one sum: its output's dtype and shape
        ('float32[]',)
        >>> history.scales  # 25 is at scale 16, four steps long
        Array([[16., 16., 16., 16.]], dtype=float32)
    """

    scales: Any
    sites: tuple[str, ...]

    def tree_flatten(self) -> tuple[tuple[Any], tuple[str, ...]]:
        return (self.scales,), self.sites

    @classmethod
    def tree_unflatten(cls, sites: tuple[str, ...], children: Sequence[Any]) -> ScaleHistory:
        return cls(children[0], sites)

    def as_matrix(self) -> Any:
        """The scales as a float32 `[sites, length]` array (`scales`)."""
        return jnp.asarray(self.scales, jnp.float32)


def _held_scales(scales: Any, margin: np.float32) -> Any:
    """Each site's held scale: its largest in `scales`, times the margin, clamped to
    `[SCALE_MIN, SCALE_MAX]`; one vector, computed in one kernel."""
    held = jnp.max(jnp.asarray(scales, jnp.float32), axis=1) * margin
    return jnp.clip(held, np.float32(SCALE_MIN), np.float32(SCALE_MAX))


class _SiteRecorder:
    """The sites of one call's trace: the held scales it reads, the scales it measures.

    A row of the history is a site at the call's top level, or a site of the body of a
    top-level `scan` at one iteration (`scan_group`): the body's sites are measured in the
    body, their scales stacked over the iterations as the scan's extra output."""

    def __init__(self, history: ScaleHistory | None, margin: int) -> None:
        self.trace = _compat.current_trace()
        self.history = history
        self.margin = np.float32(2.0**margin)
        # In program order: ("site", measured, factor), or ("rows", scales) for a scan
        # body's sites at every iteration (a float32 vector, iteration-major).
        self.entries: list[tuple[Any, ...]] = []
        self.descriptions: list[str] = []
        self.held: Any = None
        self.scans = 0
        if history is not None:
            shape = np.shape(history.scales)
            if len(shape) != 2 or shape[0] != len(history.sites) or shape[1] < 1:
                raise ValueError(
                    f"A ScaleHistory's scales are one [sites, length] array: "
                    f"{len(history.sites)} sites here, scales of shape {shape}."
                )

    def covers(self) -> bool:
        """Whether a value computed now belongs to the recorded call's own trace (not to
        the body of a loop, conditional or checkpoint traced within it)."""
        return _compat.current_trace() is self.trace

    @property
    def holding(self) -> bool:
        """Whether the sites take held scales (a step), rather than their own (`init`)."""
        return self.history is not None

    def _held_scales(self) -> Any:
        if self.held is None:  # every site's, in one kernel, at the first site
            assert self.history is not None
            self.held = _held_scales(self.history.scales, self.margin)
        return self.held

    def _check_row(self, index: int, description: str) -> None:
        assert self.history is not None
        sites = self.history.sites
        if index >= len(sites) or sites[index] != description:
            found = sites[index] if index < len(sites) else "no site"
            raise ValueError(
                f"This ScaleHistory was made for another program: site {index} is a sum or "
                f"contraction of {description} here, {found} in the history ({len(sites)} "
                f"sites). Make a history for this step with its `init`."
            )

    def record(self, measured: Any, factor: Any, description: str) -> Any:
        """Record a site's measurement, `measured * factor`: its output (whose largest
        finite magnitude the next history takes), or its dynamic scale (`scale_of_magnitude`
        maps both to the scale). Returns the site's held scale, or None when making a
        history."""
        index = len(self.descriptions)
        self.entries.append(("site", measured, factor))
        self.descriptions.append(description)
        if self.history is None:
            return None
        self._check_row(index, description)
        # On XLA:CPU each site's scale is read from a kernel of its own: a slice of the
        # vector fused into every kernel that reads it would make those kernels differ
        # from site to site, and XLA:CPU compiles each distinct kernel on its own (the zoo
        # steps compiled 1.3-1.9x slower).
        return block_scales.materialize_scalar_on_cpu(self._held_scales()[index])

    def scan_group(self, length: int) -> _ScanSites | None:
        """The sites of a top-level scan's body, one row per site and iteration: their held
        scales (`[length, sites]`, read from the history's rows of this scan) and the
        recorder the body is traced with. None for an empty scan."""
        if length < 1:
            return None
        ordinal, self.scans = self.scans, self.scans + 1
        prefix = f"scan {ordinal} ({length} iterations)"
        index = len(self.descriptions)
        held = None
        count = 0
        if self.history is not None:
            sites = self.history.sites
            while index + count < len(sites) and sites[index + count].startswith(prefix + ","):
                count += 1
            if not count and index < len(sites) and sites[index].startswith(f"scan {ordinal} ("):
                raise ValueError(
                    f"This ScaleHistory was made for another program: site {index} is "
                    f"{sites[index]!r} in the history, a scan of {length} iterations here. "
                    f"Make a history for this step with its `init`."
                )
            if count % length:
                raise ValueError(
                    f"This ScaleHistory was made for another program: {count} rows of "
                    f"{prefix} from site {index}, not a multiple of its iterations. Make a "
                    f"history for this step with its `init`."
                )
            if count:
                held = self._held_scales()[index : index + count].reshape(length, -1)
        return _ScanSites(self, prefix, length, index, count // length, held)

    def add_rows(self, scales: Any, descriptions: Sequence[str]) -> None:
        """A scan's body sites, measured at every iteration (`scales`, iteration-major)."""
        index = len(self.descriptions)
        if self.history is not None:
            for offset, description in enumerate(descriptions):
                self._check_row(index + offset, description)
        self.entries.append(("rows", scales))
        self.descriptions.extend(descriptions)

    def _measured_scales(self) -> Any:
        """This call's scales, one per row, as a float32 vector: every top-level site's
        largest magnitude from one primitive (whose XLA:GPU form finishes all the
        reductions in one kernel), then their scales; a scan body's rows as the scan
        measured them."""
        operands = [
            operand for entry in self.entries if entry[0] == "site" for operand in entry[1:]
        ]
        sites = None
        if operands:
            magnitudes = largest_finite_magnitudes_p.bind(*_compat.match_varying(*operands))
            sites = scale_of_magnitude(magnitudes)
        if all(entry[0] == "site" for entry in self.entries):
            return sites
        pieces: list[Any] = []
        start = run = 0
        for entry in [*self.entries, ("end",)]:
            if entry[0] == "site":
                run += 1
                continue
            if run:
                assert sites is not None
                pieces.append(sites[start : start + run])
                start, run = start + run, 0
            if entry[0] == "rows":
                pieces.append(jnp.asarray(entry[1], jnp.float32))
        return jnp.concatenate(pieces)

    def next_history(self, history: ScaleHistory) -> ScaleHistory:
        """`history` with this call's scales as its newest step (the oldest dropped)."""
        if len(self.descriptions) != len(history.sites):
            raise ValueError(
                f"This ScaleHistory was made for another program: {len(history.sites)} sums "
                f"and contractions in the history, {len(self.descriptions)} in this step. "
                f"Make a history for this step with its `init`."
            )
        older = jnp.asarray(history.scales, jnp.float32)
        if not self.descriptions:
            return ScaleHistory(older, history.sites)
        newest = self._measured_scales()[:, None]
        return ScaleHistory(jnp.concatenate([newest, older[:, :-1]], axis=1), history.sites)

    def first_history(self, length: int) -> ScaleHistory:
        """A history of `length` steps, each this call's scales."""
        if not self.descriptions:
            return ScaleHistory(jnp.zeros((0, length), jnp.float32), ())
        newest = self._measured_scales()[:, None]
        scales = jnp.broadcast_to(newest, (len(self.descriptions), length))
        return ScaleHistory(scales, tuple(self.descriptions))


class _BodyRecorder:
    """The sites of one trace of a scan's body: their held scales come in as the body's
    extra input (`held`, one per site), their scales go out as its extra output."""

    def __init__(self, held: Any, count: int | None) -> None:
        self.trace = _compat.current_trace()
        self.held = held
        self.count = count  # the history's sites per iteration (None: making a history)
        self.entries: list[tuple[Any, Any]] = []
        self.descriptions: list[str] = []

    def covers(self) -> bool:
        return _compat.current_trace() is self.trace

    @property
    def holding(self) -> bool:
        return self.count is not None

    def record(self, measured: Any, factor: Any, description: str) -> Any:
        index = len(self.entries)
        self.entries.append((measured, factor))
        self.descriptions.append(description)
        if self.count is None:
            return None
        if index >= self.count:
            raise ValueError(
                f"This ScaleHistory was made for another program: a scan body has "
                f"{index + 1} or more sums and contractions here, {self.count} in the "
                f"history. Make a history for this step with its `init`."
            )
        return block_scales.materialize_scalar_on_cpu(self.held[index])

    def scan_group(self, length: int) -> None:
        """A scan within a scan's body keeps dynamic scales."""
        return None

    def measured_scales(self) -> Any:
        """The body's sites' scales at this iteration (a float32 vector), or None."""
        if not self.entries:
            return None
        operands = [operand for pair in self.entries for operand in pair]
        magnitudes = largest_finite_magnitudes_p.bind(*_compat.match_varying(*operands))
        return scale_of_magnitude(magnitudes)


class _ScanSites:
    """The rows of one top-level scan: `trace_body` wraps each trace of its body, `finish`
    takes the stacked scales the scan returned."""

    def __init__(
        self, parent: _SiteRecorder, prefix: str, length: int, index: int, count: int, held: Any
    ) -> None:
        self.parent = parent
        self.prefix = prefix
        self.length = length
        self.index = index
        self.count = count
        self.held = held  # [length, count] or None
        self.body: _BodyRecorder | None = None

    @property
    def takes_held(self) -> bool:
        """Whether the body takes the held scales as an extra scanned input."""
        return self.held is not None

    @contextlib.contextmanager
    def trace_body(self, held_slice: Any) -> Iterator[_BodyRecorder]:
        """Record the sites of the body being traced now (one round of a fixed point)."""
        count = self.count if self.parent.holding else None
        self.body = body = _BodyRecorder(held_slice, count)
        with _recorded(body):
            yield body
        if count is not None and len(body.entries) != count:
            raise ValueError(
                f"This ScaleHistory was made for another program: a scan body has "
                f"{len(body.entries)} sums and contractions here, {count} in the history. "
                f"Make a history for this step with its `init`."
            )

    def finish(self, stacked: Any) -> None:
        """The body's scales at every iteration (`[length, sites]`) become the scan's rows."""
        assert self.body is not None
        if not self.body.entries:
            return
        rows = [
            f"{self.prefix}, iteration {i}: {description}"
            for i in range(self.length)
            for description in self.body.descriptions
        ]
        self.parent.add_rows(jnp.reshape(stacked, (-1,)), rows)


_Recorder = _SiteRecorder | _BodyRecorder


class _Recording(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Recorder] = []


_RECORDING = _Recording()


def site_recorder() -> _Recorder | None:
    """The recorder of the `delayed_scaling` call being traced, when a value computed now
    is one of its sites (its own trace); else None (no such call, or inside a body)."""
    if not _RECORDING.stack:
        return None
    recorder = _RECORDING.stack[-1]
    return recorder if recorder.covers() else None


def recording() -> bool:
    """Whether a `delayed_scaling` call is being traced in the current trace."""
    return site_recorder() is not None


@contextlib.contextmanager
def _recorded(recorder: _Recorder) -> Iterator[None]:
    _RECORDING.stack.append(recorder)
    try:
        yield
    finally:
        _RECORDING.stack.pop()


def delayed_scaling(
    fun: Callable[..., Any],
    *,
    history_length: int = 16,
    margin: int = 0,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
) -> Callable[..., Any]:
    """`autoscale(fun)` whose sums and contractions take their output scales from a history.

    The returned `step(history, *args, **kwargs)` returns `(fun's outputs, new history)`:
    each sum and contraction at the top level of `fun`'s program takes the largest scale
    of its `history_length` previous steps, times `2**margin`, as its output scale, and
    its current dynamic scale goes into the new history. `step.init(*args, **kwargs)` runs
    the first step with dynamic scales and returns `(outputs, history)`, the history
    filled with that step's scales.

    A held scale is a power of two at or below an earlier output's largest magnitude, so
    the data's largest magnitude is below `2 * growth / 2**margin`, where `growth` is how
    much larger the output is now than at its largest in the history: float16 data
    overflows only where an output grows by `2**15` (bfloat16: `2**127`) within
    `history_length` steps. Outputs that shrink use less of the data format's range
    instead (an output 2**10 times smaller than its largest in the history has float16
    data below 2**-9, so its small entries reach float16's subnormals 10 binades
    sooner). A sum or contraction in the body of a top-level `scan` has a row of the
    history per iteration. Those inside `while` loops, conditionals, checkpointed
    functions, custom derivatives, `jit`s with shardings and scans within a scan's body
    keep dynamic scales; a `jit` without shardings is inlined.

    Args:
        fun: the step to transform, as for :func:`autoscale`.
        history_length: how many previous steps' scales each site keeps (at least 1).
        margin: a power of two of headroom (0: none; negative: less range, more
            precision).
        static_argnums, static_argnames: as for :func:`autoscale`.

    Raises:
        ValueError: `history_length` below 1, a history made for another program
            (other sums and contractions, shapes or dtypes), or the step called inside
            `jsa.autoscale`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> step = jsa.delayed_scaling(lambda w, x: w @ x)
        >>> w = jsa.as_scaled_array(jnp.full((2, 2), 3.0, jnp.float16))
        >>> x = jsa.as_scaled_array(jnp.array([1.0, 1.0], jnp.float16))
        >>> y, history = step.init(w, x)  # dynamic: 6 is data 1.5 at scale 4
        >>> history.sites, history.scales[0][:4]  # one site, its scale at every step
        (('float16[2]',), Array([4., 4., 4., 4.], dtype=float32))
        >>> y, history = jax.jit(step)(history, w, 2 * x)  # 12 at the held scale 4: data 3
        >>> y
        ScaledArray(data=Array([3., 3.], dtype=float16), scale=Array(4., dtype=float32))
        >>> history.scales[0][:3]  # the new step's own scale, then the older ones
        Array([8., 4., 4.], dtype=float32)
    """
    if not isinstance(history_length, int) or history_length < 1:
        raise ValueError(f"history_length must be an int of at least 1, got {history_length!r}.")
    if not isinstance(margin, int):
        raise TypeError(f"margin must be an int (a power of two), got {margin!r}.")
    scaled = autoscale(fun, static_argnums=static_argnums, static_argnames=static_argnames)

    def refuse_inside_autoscale() -> None:
        # Inside an autoscaled function, `scaled` is `fun` itself, traced before any rule
        # runs: no site would be recorded.
        if tracing_a_scaled_function():
            raise ValueError(
                "A delayed_scaling step was called inside jsa.autoscale; call it outside "
                "(it runs `fun` under autoscale itself)."
            )

    @functools.wraps(fun)
    def step(history: ScaleHistory, *args: Any, **kwargs: Any) -> tuple[Any, ScaleHistory]:
        if not isinstance(history, ScaleHistory):
            raise TypeError(
                f"The first argument of a delayed_scaling step is its ScaleHistory (from "
                f"`step.init`), got {type(history).__name__}."
            )
        refuse_inside_autoscale()
        recorder = _SiteRecorder(history, margin)
        with _recorded(recorder):
            out = scaled(*args, **kwargs)
            return out, recorder.next_history(history)

    def init(*args: Any, **kwargs: Any) -> tuple[Any, ScaleHistory]:
        refuse_inside_autoscale()
        recorder = _SiteRecorder(None, margin)
        with _recorded(recorder):
            out = scaled(*args, **kwargs)
        return out, recorder.first_history(history_length)

    step.init = init  # type: ignore[attr-defined]
    return step
