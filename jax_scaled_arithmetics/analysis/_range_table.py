"""Value ranges, the table: one row per recorded tensor (`TensorRange`), and the `RangeTable`
that ranks, summarises and prints them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import ml_dtypes

FORWARD = "forward"
BACKWARD = "backward"
PHASES = (FORWARD, BACKWARD)
_CRITERIA = ("clipped", "flush", "overflow", "nonfinite", "subnormal")


@dataclasses.dataclass(frozen=True)
class TensorRange:
    """Where the data of one floating output of one equation lies.

    Statistics are of the stored data (of a ScaledArray, not its value; of a plain array,
    the array, with scale 1). Fractions are in [0, 1]: `subnormal` and `flush` are fractions
    of the nonzero elements, `nonfinite` and `overflow` fractions of all elements.

    Attributes:
        index: position of the row in the table (evaluation order).
        equation: position of the top-level equation the row belongs to (the equation
            itself, or the `jit`, `scan`... whose body computed it).
        iteration: None for a top-level equation; for an equation of a sub-jaxpr, how many
            times it had run before (a `scan` or `while` body gives one row per iteration).
        primitive: the primitive's name.
        source: the user source line, 'file:line:col (function)'.
        phase: 'forward', or 'backward' for equations of a transposed (`grad`, `vjp`) pass.
        output: position of the output among the equation's outputs.
        dtype: the data's dtype.
        shape: the data's shape.
        scale: the scale (1.0 for a plain array).
        scaled: whether the output is a ScaledArray (False for the plain values a function
            computes apart from its scaled inputs: constants, masks, integer counts).
        rms: root mean square of the data's finite elements (nan if there are none).
        max_abs: largest magnitude of the data's finite elements (nan if there are none).
        subnormal: nonzero elements that are subnormal in the data's dtype (lost precision).
        nonfinite: elements that are inf or nan (overflowed in the data's dtype).
        flush: per format, nonzero elements that round to zero when cast to it.
        overflow: per format, elements whose magnitude is above the format's max.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jnp.array([2.0**-8, 1.0, 500.0], jnp.float16)
        >>> row = jsa.analysis.tensor_ranges(lambda a: a * 2.0, x).rows[0]
        >>> row.primitive, row.phase, row.max_abs, row.overflow["float8_e4m3fn"]
        ('mul', 'forward', 1000.0, 0.3333333333333333)
    """

    index: int
    equation: int
    iteration: int | None
    primitive: str
    source: str
    phase: str
    output: int
    dtype: str
    shape: tuple[int, ...]
    scale: float
    scaled: bool
    rms: float
    max_abs: float
    subnormal: float
    nonfinite: float
    flush: Mapping[str, float]
    overflow: Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class RangeTable:
    """The rows `tensor_ranges` recorded, with helpers to rank, summarise and print them.

    Attributes:
        name: the analysed function's name.
        scaled: whether the function ran on ScaledArrays (False: plain values, scale 1).
        formats: names of the formats whose flush and overflow fractions were recorded.
        rows: one per floating equation output, in evaluation order.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jax_scaled_arithmetics as jsa
        >>> x = jnp.array([2.0**-8, 1.0, 500.0], jnp.float16)  # plain: scale 1
        >>> table = jsa.analysis.tensor_ranges(lambda a: a * 2.0, x)
        >>> [(r.primitive, r.overflow["float8_e4m3fn"]) for r in table.worst(by="overflow")]
        [('mul', 0.3333333333333333)]
        >>> table.summary()["forward"]["max_abs"]
        1000.0
    """

    name: str
    scaled: bool
    formats: tuple[str, ...]
    rows: tuple[TensorRange, ...]

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        return self.to_text()

    def select(
        self, phase: str | None = None, scaled: bool | None = None
    ) -> tuple[TensorRange, ...]:
        """The rows of one pass, 'forward' or 'backward' (None: both), optionally only the
        scaled (True) or plain (False) outputs."""
        if phase is not None and phase not in PHASES:
            raise ValueError(f"Unknown pass {phase!r}: expected 'forward' or 'backward'.")
        return tuple(
            row
            for row in self.rows
            if (phase is None or row.phase == phase) and (scaled is None or row.scaled == scaled)
        )

    def to_dicts(self) -> list[dict[str, Any]]:
        """One flat dict per row (e.g. for `pandas.DataFrame`); per-format fractions are
        keyed '<format>_flush' and '<format>_overflow'."""
        out = []
        for row in self.rows:
            record = {
                f.name: getattr(row, f.name)
                for f in dataclasses.fields(row)
                if f.name not in ("flush", "overflow")
            }
            for name in self.formats:
                record[f"{name}_flush"] = row.flush[name]
                record[f"{name}_overflow"] = row.overflow[name]
            out.append(record)
        return out

    def worst(
        self,
        n: int = 10,
        *,
        by: str = "clipped",
        format: Any = None,
        phase: str | None = None,
    ) -> tuple[TensorRange, ...]:
        """The (at most) `n` rows that lose the most, among those that lose anything.

        Args:
            n: how many rows.
            by: 'clipped' (flush + overflow fractions in `format`), 'flush', 'overflow'
                (in `format`), 'nonfinite' or 'subnormal' (in the data's dtype).
            format: one of the table's formats (default: the first).
            phase: only rows of this pass ('forward' or 'backward').

        Returns:
            Rows with a positive criterion, largest first (ties in evaluation order).
        """
        if by not in _CRITERIA:
            raise ValueError(f"Unknown criterion {by!r}: expected one of {', '.join(_CRITERIA)}.")
        name = self._format_name(format)
        rows = self.rows if phase is None else self.select(phase)

        def key(row: TensorRange) -> float:
            if by == "clipped":
                return row.flush[name] + row.overflow[name]
            if by in ("flush", "overflow"):
                return getattr(row, by)[name]
            return float(getattr(row, by))

        ranked = sorted((row for row in rows if key(row) > 0), key=lambda r: (-key(r), r.index))
        return tuple(ranked[:n])

    def summary(self) -> dict[str, dict[str, float]]:
        """Per pass: number of rows, range of the data (min and max RMS over nonzero rows,
        largest max), range of the scales, and how many rows hold non-finite values or lose
        elements in each format. When some outputs are scaled, over those only (the plain
        values a function computes apart from its scaled inputs, such as a constant mask,
        are what the function asked for, not a choice of scale)."""
        out = {}
        only_scaled = True if any(row.scaled for row in self.rows) else None
        for phase in PHASES:
            rows = self.select(phase, scaled=only_scaled)
            if not rows:
                continue
            rms = [r.rms for r in rows if math.isfinite(r.rms) and r.rms > 0]
            peaks = [r.max_abs for r in rows if math.isfinite(r.max_abs)]
            scales = [r.scale for r in rows if math.isfinite(r.scale) and r.scale > 0]
            stats: dict[str, float] = {
                "rows": len(rows),
                "rms_min": min(rms, default=math.nan),
                "rms_max": max(rms, default=math.nan),
                "max_abs": max(peaks, default=math.nan),
                "scale_min": min(scales, default=math.nan),
                "scale_max": max(scales, default=math.nan),
                "nonfinite_rows": sum(r.nonfinite > 0 for r in rows),
            }
            for name in self.formats:
                stats[f"{name}_flush_rows"] = sum(r.flush[name] > 0 for r in rows)
                stats[f"{name}_overflow_rows"] = sum(r.overflow[name] > 0 for r in rows)
            out[phase] = stats
        return out

    def summary_text(self) -> str:
        """The summary as a few lines of text."""
        lines = [
            f"{self.name}: {len(self.rows)} tensors, "
            f"{'scaled' if self.scaled else 'plain'}; formats {', '.join(self.formats)}"
        ]
        for phase, s in self.summary().items():
            lost = "; ".join(
                f"{name} flush {s[name + '_flush_rows']} overflow {s[name + '_overflow_rows']}"
                for name in self.formats
            )
            lines.append(
                f"  {phase}: {s['rows']} tensors, data rms {_num(s['rms_min'])}.."
                f"{_num(s['rms_max'])}, max {_num(s['max_abs'])}, scale "
                f"{_scale(s['scale_min'])}..{_scale(s['scale_max'])}; rows with non-finite "
                f"{s['nonfinite_rows']}; {lost}"
            )
        return "\n".join(lines)

    def to_text(self, n: int | None = None, *, by: str = "clipped", format: Any = None) -> str:
        """The summary and a fixed-width table of the rows (or of the `worst(n, by, format)`).

        Percentages are shown '-' when zero; sources are shortened to the file's name.
        """
        rows = self.rows if n is None else self.worst(n, by=by, format=format)
        headers = ["#", "pass", "iter", "primitive", "dtype", "shape", "scale", "rms", "max"]
        headers += ["sub%", "nonfin%"]
        for name in self.formats:
            short = name.replace("float8_", "")
            headers += [f"{short}:flush%", f"{short}:ovf%"]
        headers.append("source")
        table = [headers]
        for row in rows:
            cells = [
                str(row.index),
                row.phase[:3],
                "" if row.iteration is None else str(row.iteration),
                row.primitive,
                row.dtype,
                "x".join(map(str, row.shape)) or "()",
                _scale(row.scale),
                _num(row.rms),
                _num(row.max_abs),
                _percent(row.subnormal),
                _percent(row.nonfinite),
            ]
            for name in self.formats:
                cells += [_percent(row.flush[name]), _percent(row.overflow[name])]
            cells.append(_short_source(row.source))
            table.append(cells)
        widths = [max(len(r[i]) for r in table) for i in range(len(headers) - 1)]
        lines = [
            "  ".join(
                c.rjust(w) if i not in (1, 3, 4) else c.ljust(w)
                for i, (c, w) in enumerate(zip(r[:-1], widths))
            )
            + "  "
            + r[-1]
            for r in table
        ]
        return self.summary_text() + "\n" + "\n".join(line.rstrip() for line in lines)

    def _format_name(self, format: Any) -> str:
        if format is None:
            return self.formats[0]
        name = format_name(format)
        if name not in self.formats:
            raise ValueError(
                f"Format {name!r} was not recorded in this table (formats: "
                f"{', '.join(self.formats)}); pass it to tensor_ranges(formats=...)."
            )
        return name


def _num(x: float) -> str:
    return f"{x:.3g}"


def _scale(x: float) -> str:
    """A scale, as 2^k when it is a power of two."""
    if math.isfinite(x) and x > 0 and math.log2(x) == int(math.log2(x)):
        return f"2^{int(math.log2(x))}"
    return _num(x)


def _percent(x: float) -> str:
    if x == 0:
        return "-"
    if not math.isfinite(x):
        return str(x)
    return "<0.1" if x < 1e-3 else f"{100 * x:.1f}"


def _short_source(source: str) -> str:
    path, sep, rest = source.partition(":")
    return os.path.basename(path) + sep + rest


def format_name(fmt: Any) -> str:
    """The canonical name of a floating format given as a name or dtype."""
    try:
        dtype = jnp.dtype(fmt)
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"Unknown format {fmt!r}: expected a floating dtype or its name, such as "
            "'float8_e4m3fn', 'float8_e5m2' or 'float16'."
        )
    return dtype.name


def finfo(name: str) -> Any:
    return ml_dtypes.finfo(jnp.dtype(name))
