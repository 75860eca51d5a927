"""Kernels, compile time and step time of `jsa.delayed_scaling` against the dynamic step.

For each case of `benchmarks/program_size.py` named with `--cases` (default: the 2-block
char GPT's Adam step and the three zoo training steps, float16 data with
`scale_optimizer(adam)` where program_size says so), five variants of one training step:

- plain: `jax.jit(step)` on float32 arrays;
- dynamic: `jax.jit(jsa.autoscale(step))`, every sum and contraction at its own dynamic
  scale (`ScalePolicy.DYNAMIC`);
- packed: the dynamic step taking and returning its ScaledArray trees packed by
  `jsa.tree.pack_scales` (`packed_step`: each tree's scales as one vector; same values);
- delayed: `jax.jit(jsa.delayed_scaling(step))`, its top-level sums and contractions at the
  scales of a history made by `step.init` (`--history` steps long);
- delayed-packed: the delayed step with its ScaledArray trees packed as in "packed".

Measured: the sites of the delayed step (sums and contractions with a history), the compiled
program's kernels and instructions (program_size's `hlo_counts` of the optimized HLO), the
kernels one call launches (`launched_kernels`: a loop's body once per iteration), its
kernels by kind (`kernel_kinds`), its distinct fused kernels (`distinct_fusions`: what
XLA:CPU generates code for), the
lower + compile time, and the median step time of the five compiled steps run in turn
(`--iters` rounds after a warm-up). One process: compare the ratios of one run.

Run:
    python benchmarks/delayed_scaling.py [--cases gpt2-adam,zoo-linen] [--iters 20]
        [--history 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import jax_scaled_arithmetics as jsa

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:  # run as a script or loaded by path
    sys.path.insert(0, str(ROOT / "benchmarks"))

import program_size as PS  # noqa: E402

DEFAULT_CASES = ("gpt2-adam", "zoo-linen", "zoo-nnx", "zoo-equinox")
VARIANTS = ("plain", "dynamic", "packed", "delayed", "delayed-packed")


def _compiled(
    fun: Any, args: tuple[Any, ...], compiler_options: dict[str, Any] | None = None
) -> tuple[Any, float, dict[str, Any]]:
    start = time.perf_counter()
    compiled = jax.jit(fun).lower(*args).compile(compiler_options=compiler_options)
    seconds = time.perf_counter() - start
    hlo = compiled.as_text()
    kernels, instructions = PS.hlo_counts(hlo)
    counts = {
        "kernels": kernels,
        "launched": PS.launched_kernels(hlo),
        "distinct": PS.distinct_fusions(hlo)[1],
        "instructions": instructions,
        "by_kind": dict(PS.kernel_kinds(hlo).most_common()),
    }
    return compiled, seconds, counts


def median_times(steps: dict[str, tuple[Any, tuple[Any, ...]]], iters: int) -> dict[str, float]:
    """Median seconds of each compiled step, run in turn (`iters` rounds after 3 warm-up)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(iters + 3):
        for name, (compiled, args) in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            if round_ >= 3:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _packed(tree: Any) -> Any:
    """`jsa.tree.pack_scales(tree)` where `tree` holds a ScaledArray (a batch stays as is)."""
    if any(isinstance(leaf, jsa.ScaledArray) for leaf in jsa.tree.leaves(tree)):
        return jsa.tree.pack_scales(tree)
    return tree


def packed_step(step: Any, args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """`step` (an autoscaled step) taking and returning its ScaledArray trees packed with
    `jsa.tree.pack_scales` (each top-level argument and result): the function and its
    arguments."""

    def stepped(*packed: Any) -> Any:
        out = step(*jsa.tree.unpack_scales(packed))
        return tuple(_packed(o) for o in out) if isinstance(out, tuple) else _packed(out)

    return stepped, tuple(_packed(a) for a in args)


def delayed_packed_step(delayed: Any, args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """`delayed` (a `jsa.delayed_scaling` step; `args` its history and the step's
    arguments) taking and returning its ScaledArray trees packed, as `packed_step`."""

    def stepped(history: Any, *packed: Any) -> Any:
        out, history = delayed(history, *jsa.tree.unpack_scales(packed))
        out = tuple(_packed(o) for o in out) if isinstance(out, tuple) else _packed(out)
        return out, history

    return stepped, (args[0], *(_packed(a) for a in args[1:]))


def variants(
    case_name: str, history_length: int, dtype: str | None = None
) -> tuple[dict[str, Any], dict[str, tuple[Any, tuple[Any, ...]]]]:
    """A case's plain, dynamic, packed and delayed steps with their arguments (`dtype`: the
    scaled data's, default the case's own), and the start of its row (case, dtype, sites)."""
    builder, default_dtype = PS.CASES[case_name]
    dtype = dtype or default_dtype
    case = builder(jnp.dtype(dtype))
    step = case.scaled_step or case.plain_step
    delayed = jsa.delayed_scaling(step, history_length=history_length)
    _, history = jax.jit(delayed.init)(*case.scaled_args)
    steps = {
        "plain": (case.plain_step, case.plain_args),
        "dynamic": (jsa.autoscale(step), case.scaled_args),
        "packed": packed_step(jsa.autoscale(step), case.scaled_args),
        "delayed": (delayed, (history, *case.scaled_args)),
        "delayed-packed": delayed_packed_step(delayed, (history, *case.scaled_args)),
    }
    return {"case": case_name, "dtype": dtype, "sites": len(history.sites)}, steps


def measure(
    case_name: str,
    history_length: int,
    iters: int,
    dtype: str | None = None,
    *,
    only: tuple[str, ...] = VARIANTS,
    compiler_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One case's variants (`dtype`: the scaled data's, default the case's own; `only`:
    those of `VARIANTS` to measure), compiled with XLA's `compiler_options` if given."""
    row, steps = variants(case_name, history_length, dtype)
    runnable = {}
    for name, (fun, args) in steps.items():
        if name not in only:
            continue
        compiled, seconds, counts = _compiled(fun, args, compiler_options)
        row[name] = {"compile_s": seconds, **counts}
        runnable[name] = (compiled, args)
    for name, seconds in median_times(runnable, iters).items():
        row[name]["step_ms"] = 1e3 * seconds
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--history", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    print(f"# {platform.node()} {platform.machine()}, JAX {jax.__version__}, {jax.devices()[0]}")
    header = f"{'case':<12} {'sites':>5} {'variant':<14} {'kernels':>7} {'x plain':>7}"
    print(
        header + f" {'launched':>8} {'x plain':>7} {'distinct':>8} {'compile s':>9} "
        f"{'step ms':>8} {'x plain':>7}"
    )
    rows = []
    for case_name in args.cases.split(","):
        row = measure(case_name, args.history, args.iters)
        rows.append(row)
        plain = row["plain"]
        for variant in VARIANTS:
            v = row[variant]
            print(
                f"{case_name:<12} {row['sites']:>5} {variant:<14} {v['kernels']:>7} "
                f"{v['kernels'] / plain['kernels']:>7.2f} {v['launched']:>8} "
                f"{v['launched'] / plain['launched']:>7.2f} {v['distinct']:>8} "
                f"{v['compile_s']:>9.2f} "
                f"{v['step_ms']:>8.2f} {v['step_ms'] / plain['step_ms']:>7.2f}"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
