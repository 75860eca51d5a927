"""Where a compiled training step's time goes, kernel by kernel (XLA:CPU's own trace).

For each case of `benchmarks/program_size.py` named with `--cases` and each variant of
`benchmarks/delayed_scaling.py` named with `--variants`, the step is compiled, run
`--warmup` times, then `--rounds` times under `jax.profiler.trace`. XLA's runtime records
one event per kernel it runs (the event's `hlo_op`); the script sums them per kernel and
reports, per step: the kernels run and their time, the kernels XLA:CPU splits into
parallel tasks (an `outer_dimension_partitions` backend config: its parallel task
assignment judges them compute-bound, at more flops than bytes, and worth two threads)
and their time, the median time of a split and of an unsplit kernel of the same shapes,
and the kernels that take longest. The profiler costs time of its own (each event): compare
variants of one run, not with `delayed_scaling.py`'s step times.

Run:
    python benchmarks/kernel_profile.py [--cases zoo-linen,zoo-nnx] [--variants plain,packed]
        [--rounds 50] [--top 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:  # run as a script or loaded by path
    sys.path.insert(0, str(ROOT / "benchmarks"))

import delayed_scaling as DS  # noqa: E402

DEFAULT_CASES = ("zoo-linen", "zoo-nnx", "zoo-equinox")
DEFAULT_VARIANTS = ("plain", "packed")

_KERNEL = re.compile(
    r"^\s*(?:ROOT )?%?([\w.\-]+) = (\([^)]*\)|\S+) (?:fusion|dot|custom-call|copy)\((.*)$"
)


def split_kernels(hlo_text: str) -> dict[str, tuple[str, bool]]:
    """The ENTRY's kernels of an optimized XLA:CPU module: name -> (result shape, whether
    XLA:CPU splits it into parallel tasks)."""
    entry = hlo_text[hlo_text.index("\nENTRY") :]
    kernels = {}
    for line in entry.splitlines():
        match = _KERNEL.match(line)
        if match:
            name, shape, rest = match.groups()
            kernels[name] = (shape.split("{")[0], '"outer_dimension_partitions":["' in rest)
    return kernels


def kernel_times(trace_events: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Microseconds of each run of each kernel, from a perfetto trace's complete events
    (those the runtime names by their `hlo_op`)."""
    times: dict[str, list[float]] = collections.defaultdict(list)
    for event in trace_events:
        op = event.get("args", {}).get("hlo_op")
        if event.get("ph") == "X" and op and event.get("name") == op:
            times[op].append(float(event.get("dur", 0.0)))
    return times


def summarize(
    kernels: dict[str, tuple[str, bool]], times: dict[str, list[float]], rounds: int, top: int
) -> dict[str, Any]:
    """Per-step totals of `times` (`rounds` steps) over the kernels of `kernels`."""
    per_step = {name: sum(runs) / rounds for name, runs in times.items() if name in kernels}
    split = [name for name in per_step if kernels[name][1]]
    split_shapes = {kernels[name][0] for name in split}
    unsplit_alike = [n for n in per_step if not kernels[n][1] and kernels[n][0] in split_shapes]

    def median_us(names: list[str]) -> float | None:
        return statistics.median(per_step[n] for n in names) if names else None

    longest = sorted(per_step, key=per_step.__getitem__, reverse=True)[:top]
    return {
        "kernels_run": len(per_step),
        "kernel_us": sum(per_step.values()),
        "split_kernels": len(split),
        "split_us": sum(per_step[n] for n in split),
        "split_median_us": median_us(split),
        "unsplit_same_shapes_median_us": median_us(unsplit_alike),
        "longest": [
            {"kernel": n, "shape": kernels[n][0], "split": kernels[n][1], "us": per_step[n]}
            for n in longest
        ],
    }


def profile(fun: Any, args: tuple[Any, ...], warmup: int, rounds: int, top: int) -> dict:
    """One compiled step's kernels, run `rounds` times under the profiler."""
    compiled = jax.jit(fun).lower(*args).compile()
    kernels = split_kernels(compiled.as_text())
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            for _ in range(rounds):
                jax.block_until_ready(compiled(*args))
        (path,) = glob.glob(f"{log_dir}/**/*perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as handle:
            trace = json.load(handle)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return {"kernels": len(kernels), **summarize(kernels, kernel_times(events), rounds, top)}


def main(argv: Any = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    print(f"# JAX {jax.__version__}, {jax.devices()[0]}")
    header = f"{'case':<12} {'variant':<14} {'kernels':>7} {'kernel us':>9}"
    print(f"{header} {'split':>5} {'split us':>8}")
    for case_name in [c for c in args.cases.split(",") if c]:
        with jax.numpy_rank_promotion("allow"):  # the GPT model broadcasts biases
            _, steps = DS.variants(case_name, 16)
        for variant in [v for v in args.variants.split(",") if v]:
            with jax.numpy_rank_promotion("allow"):
                row = profile(*steps[variant], args.warmup, args.rounds, args.top)
            row.update(case=case_name, variant=variant)
            rows.append(row)
            print(
                f"{case_name:<12} {variant:<14} {row['kernels_run']:>7} "
                f"{row['kernel_us']:>9.0f} {row['split_kernels']:>5} {row['split_us']:>8.0f}",
                flush=True,
            )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
