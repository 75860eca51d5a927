"""Value ranges: where the data of every tensor a function computes lies, and what a format loses.

`tensor_ranges` runs a function once under `autoscale` with an equation observer, and records
one row per floating output of every equation, forward and backward pass, sub-jaxprs
(`jit`, `scan`, `while`, `cond`, `custom_jvp`...) included (the rows and their table are
in `_range_table`). `plot_ranges` draws the rows against a number format's range.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..core import _compat
from ..core.datatype import ScaledArray, is_floating
from ..core.dtypes import compute_dtype
from ..core.interpreter import autoscale, observe_equations
from ._range_table import BACKWARD, FORWARD, PHASES, RangeTable, TensorRange, finfo, format_name

__all__ = ["plot_ranges", "tensor_ranges"]

# Sources are the innermost frame outside JAX and outside this package.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


# Per format: (half the smallest subnormal: values at most this round to zero; max).
_Limits = tuple[tuple[float, float], ...]


def _stats(xp: Any, data: Any, smallest_normal: float, limits: _Limits) -> tuple[Any, Any]:
    """([rms, max_abs], [nonzero, subnormal, nonfinite, flush_0, overflow_0, ...]) of `data`.

    Magnitudes in float32 (float64 for float64 data), element counts as int32. `xp` is
    `numpy` (concrete data, nothing to compile) or `jax.numpy` (in the graph).
    """
    dtype = compute_dtype(data.dtype)
    x = xp.abs(xp.asarray(data).astype(dtype))
    finite = xp.isfinite(x)
    xf = xp.where(finite, x, 0)
    nfinite = xp.sum(finite, dtype=np.int32)
    peak = xp.max(xf, initial=0)
    norm = xp.where(peak > 0, peak, 1)  # normalise, so that squares do not overflow
    rms = norm * xp.sqrt(xp.sum((xf / norm) ** 2, dtype=dtype) / nfinite)  # nan if none
    peak = xp.where(nfinite > 0, peak, np.nan)
    nonzero = x > 0

    def count(mask: Any) -> Any:
        return xp.sum(mask, dtype=np.int32)

    counts = [count(nonzero), count(nonzero & (x < smallest_normal)), x.size - nfinite]
    for half_subnormal, max_value in limits:
        counts += [count(nonzero & (x <= half_subnormal)), count(x > max_value)]
    magnitudes = xp.stack([xp.asarray(rms, dtype), xp.asarray(peak, dtype)])
    return magnitudes, xp.stack([xp.asarray(c, np.int32) for c in counts])


@dataclasses.dataclass
class _Slot:
    """What is known at trace time of one recorded output."""

    primitive: str
    source: str
    backward: bool
    output: int
    dtype: str
    shape: tuple[int, ...]
    nested: bool
    scaled: bool = False
    step: int = -1  # evaluation order of the concrete equation that ran it
    equation: int = -1


class _Recorder:
    """The equation observer.

    Outputs of top-level equations are concrete: their statistics are computed at once, with
    NumPy. Inside re-traced sub-jaxprs values are tracers: the statistics are computed in
    the graph and sent to the host with `jax.debug.callback`, and the slot waits for the
    next concrete equation (the `jit`, `scan`... that contains it), from which it takes its
    equation number, its pass (backward when either is) and, when it has none, its source.
    A concrete equation without source nor name stack is library code a rule evaluated
    eagerly (e.g. the `jit` inside `jax.nn.relu`'s `custom_jvp`): it waits in the same way.
    """

    def __init__(self, formats: tuple[str, ...], exclude_source: str) -> None:
        self.formats = formats
        self.limits: _Limits = tuple(
            (float(info.smallest_subnormal) / 2, float(info.max))
            for info in (finfo(name) for name in formats)
        )
        self.exclude_source = exclude_source
        self.slots: list[_Slot] = []
        self.nested: list[_Slot] = []  # waiting for the concrete equation that runs them
        self.unassigned: list[_Slot] = []  # waiting for an equation with a source
        self.samples: list[tuple[int, int, np.ndarray, np.ndarray, float]] = []
        self.counts: collections.Counter[int] = collections.Counter()
        self.steps = 0
        self.equations = 0
        self.lock = threading.Lock()

    def record(self, slot: int, magnitudes: Any, counts: Any, scale: Any) -> None:
        with self.lock:
            occurrence = self.counts[slot]
            self.counts[slot] += 1
            sample = (slot, occurrence, np.asarray(magnitudes), np.asarray(counts), float(scale))
            self.samples.append(sample)

    def __call__(self, eqn: Any, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
        if not outputs:
            return
        leaves = [
            leaf
            for out in outputs
            for leaf in ((out.data, out.scale) if isinstance(out, ScaledArray) else (out,))
        ]
        nested = any(_compat.is_tracer(leaf) for leaf in leaves)
        source = _compat.eqn_source_summary(eqn, exclude=self.exclude_source)
        name_stack = _compat.eqn_name_stack(eqn)
        new = []
        for position, out in enumerate(outputs):
            data, scale = (out.data, out.scale) if isinstance(out, ScaledArray) else (out, 1.0)
            if not hasattr(data, "dtype") or not is_floating(data):
                continue
            slot = _Slot(
                primitive=eqn.primitive.name,
                source=source,
                backward="transpose" in name_stack,
                output=position,
                dtype=jnp.dtype(data.dtype).name,
                shape=tuple(np.shape(data)),
                nested=nested,
                scaled=isinstance(out, ScaledArray),
            )
            index = len(self.slots)
            self.slots.append(slot)
            new.append(slot)
            smallest_normal = float(ml_dtypes.finfo(data.dtype).smallest_normal)
            if nested:
                stats = _stats(jnp, data, smallest_normal, self.limits)
                jax.debug.callback(
                    functools.partial(self.record, index), *stats, jnp.asarray(scale)
                )
            else:
                with np.errstate(all="ignore"):
                    stats = _stats(np, np.asarray(data), smallest_normal, self.limits)
                self.record(index, *stats, np.asarray(scale))
        if nested:
            self.nested.extend(new)
            return
        group, self.nested = self.nested + new, []
        for slot in group:
            slot.step = self.steps
        self.steps += 1
        self.unassigned.extend(group)
        if not source and not name_stack:
            return
        for slot in self.unassigned:
            slot.backward = slot.backward or "transpose" in name_stack
            slot.source = slot.source or source
            slot.equation = self.equations
        self.unassigned = []
        self.equations += 1

    def rows(self) -> tuple[TensorRange, ...]:
        for slot in self.unassigned:
            slot.equation = self.equations
        for slot in self.nested:  # never the case: a sub-jaxpr runs inside an equation
            slot.step, slot.equation = self.steps, self.equations

        def order(sample: tuple[Any, ...]) -> tuple[int, ...]:
            slot, occurrence = self.slots[sample[0]], sample[1]
            return (slot.step, not slot.nested, occurrence, sample[0])

        rows = []
        for i, sample in enumerate(sorted(self.samples, key=order)):
            index, occurrence, magnitudes, counts, scale = sample
            slot = self.slots[index]
            size = max(math.prod(slot.shape), 1)
            nonzero = max(int(counts[0]), 1)
            flush = [int(c) / nonzero for c in counts[3::2]]
            overflow = [int(c) / size for c in counts[4::2]]
            rows.append(
                TensorRange(
                    index=i,
                    equation=slot.equation,
                    iteration=occurrence if slot.nested else None,
                    primitive=slot.primitive,
                    source=slot.source,
                    phase=BACKWARD if slot.backward else FORWARD,
                    output=slot.output,
                    dtype=slot.dtype,
                    shape=slot.shape,
                    scale=scale,
                    scaled=slot.scaled,
                    rms=float(magnitudes[0]),
                    max_abs=float(magnitudes[1]),
                    subnormal=int(counts[1]) / nonzero,
                    nonfinite=int(counts[2]) / size,
                    flush=dict(zip(self.formats, flush)),
                    overflow=dict(zip(self.formats, overflow)),
                )
            )
        return tuple(rows)


def _function_name(fun: Any) -> str:
    while isinstance(fun, functools.partial):
        fun = fun.func
    return str(getattr(fun, "__name__", type(fun).__name__))


def tensor_ranges(
    fun: Callable[..., Any],
    *args: Any,
    formats: Iterable[Any] = ("float8_e4m3fn", "float8_e5m2"),
    scaled: bool = True,
    **kwargs: Any,
) -> RangeTable:
    """Run `fun(*args, **kwargs)` once under `autoscale` and record the range of every tensor.

    One row per floating output of every equation the interpreter evaluates, forward and
    backward pass (`fun` may be `jax.grad(loss)`), in evaluation order. Equations inside
    `jit`, `scan`, `while`, `cond`, `custom_jvp`... bodies are recorded too, through
    `jax.debug.callback` (only scalars go to the host): one row per execution, so a loop
    body gives one row per iteration, after the rows of earlier equations and before the
    rows of the loop's own outputs. A row records the data's dtype, shape, scale, RMS and
    largest magnitude, the fractions of elements that are subnormal or non-finite in the
    data's dtype, and, for each of `formats`, the fractions that would flush to zero or
    overflow if the data were cast to it (see `TensorRange`).

    Args:
        fun: the function to analyse, run eagerly (do not wrap the call in `jax.jit`;
            `fun` itself may use `jit`).
        *args: its positional arguments; ScaledArrays or plain arrays.
        formats: formats to compare the data with, names or dtypes.
        scaled: False to convert ScaledArray arguments to plain arrays of their data's
            dtype (`to_array()`) first, so every value is plain (scale 1): the same
            function without scaling, for comparison.
        **kwargs: its keyword arguments.

    Returns:
        A `RangeTable`.

    Raises:
        ValueError: a format is not a floating dtype.
        TypeError: an argument is a tracer (the call is inside a transformation).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jsa.scaled_array(jnp.array([1.0, 2.0, 0.0, 0.125], jnp.float16), 2.0**-20)
        >>> table = jsa.analysis.tensor_ranges(lambda a: a * a, x)
        >>> row = table.rows[0]
        >>> row.primitive, row.phase, row.dtype, row.scale == 2.0**-40, row.max_abs
        ('mul', 'forward', 'float16', True, 4.0)
        >>> row.flush  # 0.125**2 = 2^-6 fits float8_e4m3fn's subnormals (from 2^-9)
        {'float8_e4m3fn': 0.0, 'float8_e5m2': 0.0}
    """
    names = tuple(format_name(fmt) for fmt in formats)
    if not names:
        raise ValueError("tensor_ranges needs at least one format.")
    leaves = jax.tree_util.tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(x, ScaledArray))
    for leaf in leaves:
        inner = (leaf.data, leaf.scale) if isinstance(leaf, ScaledArray) else (leaf,)
        if any(_compat.is_tracer(x) for x in inner):
            raise TypeError(
                "tensor_ranges runs the function eagerly and cannot be called inside jit, "
                "grad or vmap: call it outside, on concrete arrays."
            )
    if not scaled:
        args, kwargs = jax.tree_util.tree_map(
            lambda x: x.to_array() if isinstance(x, ScaledArray) else x,
            (args, kwargs),
            is_leaf=lambda x: isinstance(x, ScaledArray),
        )
    recorder = _Recorder(names, exclude_source=_PACKAGE_DIR)
    with observe_equations(recorder):
        autoscale(fun)(*args, **kwargs)
    jax.effects_barrier()  # every debug callback has run
    return RangeTable(_function_name(fun), scaled, names, recorder.rows())


def plot_ranges(
    table: RangeTable,
    format: Any = None,
    *,
    axes: Sequence[Any] | None = None,
    path: str | os.PathLike[str] | None = None,
    threshold: float = 0.01,
) -> Any:
    """Plot every tensor's data against a format's range, forward and backward pass.

    Two panels; in each, one line per tensor in evaluation order (top to bottom): a dot at
    log2 of the data's RMS and a bar at log2 of its largest magnitude, red where more than
    `threshold` of the elements overflow `format`, orange where more than `threshold` of
    the nonzero elements flush to zero, a red cross at the right edge where the data holds
    inf or nan. The shaded band is the format's range, from its smallest subnormal to its
    max (darker: normal numbers); dashed lines bound the range of the data's dtype (the
    most common one, when it has at most 16 bits).

    Args:
        table: from `tensor_ranges`.
        format: the format to draw (default: the table's first); when the table has no
            statistics for it, points are not coloured.
        axes: two matplotlib Axes to draw in (default: a new Figure).
        path: where to save the figure (e.g. a '.png'), with the Agg backend.
        threshold: the fraction of elements lost above which a point is coloured.

    Returns:
        The matplotlib Figure.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> table = jsa.analysis.tensor_ranges(jnp.tanh, jnp.ones(4, jnp.float16))
        >>> len(jsa.analysis.plot_ranges(table).axes)
        2
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    name = table.formats[0] if format is None else format_name(format)
    info = finfo(name)
    colored = name in table.formats
    lo_sub, lo_normal = math.log2(float(info.smallest_subnormal)), math.log2(float(info.tiny))
    hi = math.log2(float(info.max))
    panels = [table.select(phase) for phase in PHASES]
    dtypes = collections.Counter(r.dtype for r in table.rows).most_common(1)
    data_bounds: list[float] = []
    if dtypes and jnp.dtype(dtypes[0][0]).itemsize <= 2:
        data_info = ml_dtypes.finfo(jnp.dtype(dtypes[0][0]))
        data_bounds = [math.log2(float(data_info.smallest_subnormal)), math.log2(data_info.max)]
    finite = [v for r in table.rows for v in _log2([r.rms, r.max_abs]) if not np.isnan(v)]
    x_lo, x_hi = min([lo_sub, *data_bounds, *finite]) - 2, max([hi, *data_bounds, *finite]) + 2

    if axes is None:
        n = max(len(rows) for rows in panels)
        fig = Figure(figsize=(13, min(max(3.0, 1.5 + 0.1 * n), 16.0)), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, 2, sharex=True)
    elif len(axes) != 2:
        raise ValueError(f"plot_ranges draws two panels: pass two axes, got {len(axes)}.")
    fig = axes[0].figure

    for ax, phase, rows in zip(axes, PHASES, panels):
        ax.axvspan(lo_sub, hi, color="tab:green", alpha=0.12, lw=0)
        ax.axvspan(lo_normal, hi, color="tab:green", alpha=0.2, lw=0)
        for bound in data_bounds:
            ax.axvline(bound, color="0.4", ls="--", lw=0.8)
        y = np.arange(len(rows))
        colors = np.array(
            [
                "tab:red"
                if colored and r.overflow[name] > threshold
                else "tab:orange"
                if colored and r.flush[name] > threshold
                else "tab:blue"
                for r in rows
            ]
        )
        rms, peak = _log2([r.rms for r in rows]), _log2([r.max_abs for r in rows])
        both = ~np.isnan(rms) & ~np.isnan(peak)
        ax.hlines(y[both], rms[both], peak[both], colors="0.6", lw=0.5)
        dense = len(rows) > 100
        for values, symbol, size in (
            (rms, "o", 4 if dense else 14),
            (peak, "|", 12 if dense else 30),
        ):
            ok = ~np.isnan(values)
            ax.scatter(values[ok], y[ok], c=colors[ok], s=size, marker=symbol, zorder=3)
        bad = np.array([r.nonfinite > 0 for r in rows], bool)
        if bad.any():
            ax.scatter(np.full(bad.sum(), x_hi - 1), y[bad], c="tab:red", marker="x", zorder=3)
        ax.set_xlim(x_lo, x_hi)
        ax.set_ylim(max(len(rows), 1) - 0.5, -0.5)
        ax.set_title(f"{phase} pass ({len(rows)} tensors)")
        ax.set_xlabel("log2 |data|")
        if len(rows) <= 40:
            ax.set_yticks(y, [r.primitive for r in rows], fontsize=7)
        if not rows:
            ax.text(0.5, 0.5, f"no {phase}-pass tensors", transform=ax.transAxes, ha="center")
    axes[0].set_ylabel("tensor (evaluation order)")

    def marker(symbol: str, color: str, label: str) -> Line2D:
        return Line2D([], [], marker=symbol, ls="", color=color, label=label)

    handles = [
        Patch(color="tab:green", alpha=0.3, label=f"{name} normal"),
        Patch(color="tab:green", alpha=0.12, label=f"{name} subnormal"),
        marker("o", "tab:blue", "RMS"),
        marker("|", "tab:blue", "max |x|"),
        marker("o", "tab:orange", f"> {threshold:.0%} flush"),
        marker("o", "tab:red", f"> {threshold:.0%} overflow"),
        marker("x", "tab:red", "inf / nan"),
    ]
    if data_bounds:
        handles.append(Line2D([], [], ls="--", color="0.4", label=f"{dtypes[0][0]} range"))
    axes[1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    kind = "scaled" if table.scaled else "plain"
    fig.suptitle(f"{table.name} ({kind}): data of every tensor against {name}")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def _log2(values: Sequence[float]) -> np.ndarray:
    """log2 of positive finite values, nan elsewhere."""
    arr = np.asarray(values, np.float64)
    ok = np.isfinite(arr) & (arr > 0)
    return np.where(ok, np.log2(np.where(ok, arr, 1.0)), np.nan)
