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
numbered in program order. A site in the body of a `scan` is a site at each iteration
(layers stacked and scanned hold a scale each): the scan takes the held scales of its rows
as one more scanned input and returns the body's measured scales as one more stacked
output; the body of a checkpointed function (`jax.checkpoint`, where autodiff puts a
checkpointed layer's backward pass) likewise, as one more input and output. Scans and
checkpoints nest. Those inside a `while` loop, a conditional (`cond`), a custom derivative
or a `jit` with shardings keep the dynamic scale (their bodies are traced apart from the
step). A `jit` without shardings is inlined, so its sites count.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat
from .datatype import unstack_scalars
from .interpreter import autoscale, tracing_a_scaled_function
from .scale_arithmetic import (
    SCALE_MAX,
    SCALE_MIN,
    UNSTACK_PIECE,
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


class _Recorder:
    """The rows of one trace: the sites of a `delayed_scaling` call's own trace, or of one
    trace of a scan's or checkpoint's body within it.

    A row is a site (a sum or contraction) of this trace, or a row of a group: the sites of
    the body of a `scan` (one row per site and iteration) or of a `jax.checkpoint` traced
    within this trace. `expected` are the rows this trace should make (a history's, or the
    part of them a body makes), None when making a history."""

    where = "the step"

    def __init__(self, expected: tuple[str, ...] | None) -> None:
        self.trace = _compat.current_trace()
        self.expected = expected
        # In program order: ("site", measured, factor), or ("rows", scales) for a group's
        # rows (a float32 vector, iteration-major).
        self.entries: list[tuple[Any, ...]] = []
        self.descriptions: list[str] = []
        self.ordinals: collections.Counter[str] = collections.Counter()
        self.held_pieces: dict[int, list[Any]] = {}  # `_held_scale`'s, by their first row

    def covers(self) -> bool:
        """Whether a value computed now belongs to this recorder's trace (not to the body
        of a loop, conditional or checkpoint traced within it)."""
        return _compat.current_trace() is self.trace

    @property
    def holding(self) -> bool:
        """Whether the sites take held scales (a step), rather than their own (`init`)."""
        return self.expected is not None

    def _held_rows(self, start: int, count: int) -> Any:
        """The held scales of rows `start` to `start + count` (a float32 vector)."""
        raise NotImplementedError

    def refuse(self, message: str) -> None:
        """A history made for another program: raised here (a body defers it, see
        `_BodyRecorder`)."""
        raise ValueError(
            f"This ScaleHistory was made for another program: {message}. Make a history "
            f"for this step with its `init`."
        )

    def _check_row(self, index: int, description: str) -> bool:
        """Whether row `index` of the history is `description` (else `refuse`)."""
        expected = self.expected
        assert expected is not None
        if index < len(expected) and expected[index] == description:
            return True
        found = expected[index] if index < len(expected) else "no site"
        self.refuse(
            f"site {index} of {self.where} is a sum or contraction of {description} here, "
            f"{found} in the history ({len(expected)} sites)"
        )
        return False

    def record(self, measured: Any, factor: Any, description: str) -> Any:
        """Record a site's measurement, `measured * factor`: its output (whose largest
        finite magnitude the next history takes), or its dynamic scale (`scale_of_magnitude`
        maps both to the scale). Returns the site's held scale, or None when making a
        history."""
        index = len(self.descriptions)
        self.entries.append(("site", measured, factor))
        self.descriptions.append(description)
        if not self.holding:
            return None
        if not self._check_row(index, description):
            return np.float32(1.0)  # a body's trace that a refusal will discard
        return self._held_scale(index)

    def _held_scale(self, index: int) -> Any:
        """Row `index`'s held scale, a scalar. The rows are split into scalars a piece at a
        time (`unstack_scalars`: on XLA:CPU one kernel per piece, each scalar a buffer of its
        own): a slice of the vector fused into every kernel that reads it would make those
        kernels differ from site to site, and XLA:CPU compiles each distinct kernel on its
        own (the zoo steps compiled 1.3-1.9x slower); a kernel per site was 90 more kernels
        on the zoo linen step."""
        assert self.expected is not None
        start = index - index % UNSTACK_PIECE
        if start not in self.held_pieces:
            count = min(UNSTACK_PIECE, len(self.expected) - start)
            self.held_pieces[start] = unstack_scalars(self._held_rows(start, count))
        return self.held_pieces[start][index - start]

    def group(self, kind: str, length: int) -> _Group | None:
        """The rows of a body traced within this trace: a `scan`'s (`length` iterations) or
        a checkpoint's (`length` 1). None for an empty scan."""
        if length < 1:
            return None
        ordinal = self.ordinals[kind]
        self.ordinals[kind] += 1
        group = _Group(self, kind, ordinal, length, len(self.descriptions))
        if self.expected is None:
            return group
        rows, index = self.expected, group.index
        count = 0
        while index + count < len(rows) and rows[index + count].startswith(group.header):
            count += 1
        if not count and index < len(rows) and rows[index].startswith(group.family):
            self.refuse(
                f"site {index} of {self.where} is {rows[index]!r} in the history, a {kind} "
                f"of {length} iterations here"
            )
        if count % length:
            self.refuse(
                f"{count} rows of {group.header.rstrip(', :')} from site {index} of "
                f"{self.where}, not a multiple of its {length} iterations"
            )
            count = 0
        per = count // length
        prefix = len(group.row_prefix(0))
        group.expected = tuple(row[prefix:] for row in rows[index : index + per])
        if per:
            group.held = self._held_rows(index, count).reshape(length, per)
        return group

    def add_rows(self, scales: Any, descriptions: Sequence[str]) -> None:
        """A group's rows, measured at every iteration (`scales`, iteration-major)."""
        index = len(self.descriptions)
        if self.holding:
            for offset, description in enumerate(descriptions):
                self._check_row(index + offset, description)
        self.entries.append(("rows", scales))
        self.descriptions.extend(descriptions)

    def measured_scales(self) -> Any:
        """This trace's scales, one per row, as a float32 vector (None without rows): every
        site's largest magnitude from one primitive (whose XLA:GPU form finishes all the
        reductions in one kernel), then their scales; a group's rows as its body measured
        them."""
        if not self.entries:
            return None
        operands = [op for entry in self.entries if entry[0] == "site" for op in entry[1:]]
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


class _SiteRecorder(_Recorder):
    """The rows of one `delayed_scaling` call's trace: their held scales from its history."""

    def __init__(self, history: ScaleHistory | None, margin: int) -> None:
        super().__init__(None if history is None else tuple(history.sites))
        self.history = history
        self.margin = np.float32(2.0**margin)
        self.held: Any = None
        if history is not None:
            shape = np.shape(history.scales)
            if len(shape) != 2 or shape[0] != len(history.sites) or shape[1] < 1:
                raise ValueError(
                    f"A ScaleHistory's scales are one [sites, length] array: "
                    f"{len(history.sites)} sites here, scales of shape {shape}."
                )

    def _held_rows(self, start: int, count: int) -> Any:
        if self.held is None:  # every row's, in one kernel, at the first site
            assert self.history is not None
            self.held = _held_scales(self.history.scales, self.margin)
        return self.held[start : start + count]

    def next_history(self, history: ScaleHistory) -> ScaleHistory:
        """`history` with this call's scales as its newest step (the oldest dropped)."""
        if len(self.descriptions) != len(history.sites):
            raise ValueError(
                f"This ScaleHistory was made for another program: {len(history.sites)} sums "
                f"and contractions in the history, {len(self.descriptions)} in this step. "
                f"Make a history for this step with its `init`."
            )
        older = jnp.asarray(history.scales, jnp.float32)
        newest = self.measured_scales()
        if newest is None:
            return ScaleHistory(older, history.sites)
        return ScaleHistory(
            jnp.concatenate([newest[:, None], older[:, :-1]], axis=1), history.sites
        )

    def first_history(self, length: int) -> ScaleHistory:
        """A history of `length` steps, each this call's scales."""
        newest = self.measured_scales()
        if newest is None:
            return ScaleHistory(jnp.zeros((0, length), jnp.float32), ())
        scales = jnp.broadcast_to(newest[:, None], (len(self.descriptions), length))
        return ScaleHistory(scales, tuple(self.descriptions))


class _BodyRecorder(_Recorder):
    """The rows of one trace of a group's body: their held scales come in as the body's
    extra input (`held`, one per row), their scales go out as its extra output.

    A loop's body is traced until its carries' types settle, and only the last trace is
    kept: an earlier one may have other sites (an unscaled carry makes no site). So a body
    defers a refusal (`mismatch`), which its group raises once the body is final."""

    def __init__(self, held: Any, expected: tuple[str, ...] | None, where: str) -> None:
        super().__init__(expected)
        self.held = held
        self.where = where
        self.mismatch: str | None = None

    def refuse(self, message: str) -> None:
        if self.mismatch is None:
            self.mismatch = message

    def _held_rows(self, start: int, count: int) -> Any:
        return self.held[start : start + count]


class _Group:
    """The rows of one body traced within a recorded trace: a `scan`'s (a row per site of
    its body and iteration, named `scan <n> (<L> iterations), iteration <i>: <site>`) or a
    checkpoint's (`checkpoint <n>: <site>`). `trace_body` wraps each trace of the body,
    `check` refuses a history the final body does not match, and `finish` takes the
    scales the body measured, stacked over the iterations."""

    def __init__(self, parent: _Recorder, kind: str, ordinal: int, length: int, index: int) -> None:
        self.parent = parent
        self.kind = kind
        self.ordinal = ordinal
        self.length = length
        self.index = index
        self.expected: tuple[str, ...] | None = None  # the body's rows, from the history
        self.held: Any = None  # [length, rows of the body], when the history has rows
        self.body: _BodyRecorder | None = None

    @property
    def family(self) -> str:
        return f"{self.kind} {self.ordinal} "

    @property
    def header(self) -> str:
        if self.kind == "scan":
            return f"scan {self.ordinal} ({self.length} iterations), "
        return f"{self.kind} {self.ordinal}: "

    def row_prefix(self, iteration: int) -> str:
        if self.kind == "scan":
            return f"{self.header}iteration {iteration}: "
        return self.header

    @property
    def count(self) -> int:
        """The body's rows (per iteration) in the history."""
        return 0 if self.expected is None else len(self.expected)

    @property
    def takes_held(self) -> bool:
        """Whether the body takes the held scales as an extra input (a scan: scanned)."""
        return self.held is not None

    @property
    def measures(self) -> bool:
        """Whether the body returns its measured scales as an extra output."""
        return self.body is not None and bool(self.body.entries)

    @contextlib.contextmanager
    def trace_body(self, held: Any) -> Iterator[_BodyRecorder]:
        """Record the rows of the body being traced now (one round of a fixed point)."""
        expected = self.expected if self.parent.holding else None
        where = f"{self.header.rstrip(', :')} (in {self.parent.where})"
        self.body = body = _BodyRecorder(held, expected, where)
        with _recorded(body):
            yield body
        if expected is not None and len(body.descriptions) != len(expected):
            body.refuse(
                f"{len(body.descriptions)} sums and contractions in {where} here, "
                f"{len(expected)} in the history"
            )

    def check(self) -> None:
        """Refuse the history (in the parent's way) if the final body did not match it."""
        if self.body is not None and self.body.mismatch is not None:
            self.parent.refuse(self.body.mismatch)

    def finish(self, stacked: Any) -> None:
        """The body's scales at every iteration (`[length, rows]`) become the rows."""
        assert self.body is not None
        if not self.body.entries:
            return
        rows = [
            self.row_prefix(i) + description
            for i in range(self.length)
            for description in self.body.descriptions
        ]
        self.parent.add_rows(jnp.reshape(stacked, (-1,)), rows)


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
    sooner). A sum or contraction in the body of a `scan` has a row of the history per
    iteration, one in a checkpointed function a row of its own. Those inside `while`
    loops, conditionals, custom derivatives and `jit`s with shardings keep dynamic scales;
    a `jit` without shardings is inlined.

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
