"""What a scaled step's per-tensor scales cost as arguments and results of `jax.jit`.

A scaled training step takes and returns a float32 scalar scale beside each ScaledArray
(parameters, optimizer moments): one argument and one result more per tensor, each a buffer
the runtime hands over and back on every call. For each case of
`benchmarks/program_size.py` named with `--cases` (default: the three zoo training steps,
float16 data with `scale_optimizer(adam)`), three variants of one training step:

- plain: `jax.jit(step)` on float32 arrays;
- scaled: `jax.jit(jsa.autoscale(step))` on ScaledArrays, as users call it;
- one vector: the same autoscaled step, jitted with its ScaledArray trees packed by
  `jsa.tree.pack_scales` (each top-level argument and result: the scalar scales of its
  ScaledArrays stacked into one vector; the data arrays unchanged; the values are the
  scaled step's, exactly).

Measured: the compiled program's kernels (program_size's `hlo_counts`), its arguments and
results, and the median step time of the three compiled steps run in turn (`--iters`
rounds after a warm-up). One process: compare the ratios of one run. The difference
between the scaled and the one-vector steps is what carrying a step's scales together
saves (docs/benchmarks.md, "What the zoo's steps pay for besides kernels").

Run:
    python benchmarks/scale_results.py [--cases zoo-linen,zoo-nnx] [--iters 300]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import jax_scaled_arithmetics as jsa

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:  # run as a script or loaded by path
    sys.path.insert(0, str(ROOT / "benchmarks"))

import delayed_scaling as DS  # noqa: E402
import program_size as PS  # noqa: E402

DEFAULT_CASES = ("zoo-linen", "zoo-nnx", "zoo-equinox")


def _buffers(tree: Any) -> int:
    return len(jax.tree_util.tree_leaves(tree))


def measure(case_name: str, iters: int, dtype: str | None = None) -> dict[str, Any]:
    """One case's three variants (`dtype`: the scaled data's, default the case's own)."""
    builder, default_dtype = PS.CASES[case_name]
    dtype = dtype or default_dtype
    case = builder(jnp.dtype(dtype))
    scaled_step = jax.jit(case.step("scaled"))
    stepped, packed_args = DS.packed_step(case.step("scaled"), case.args("scaled"))
    variants = {
        "plain": (jax.jit(case.step("plain")), case.args("plain")),
        "scaled": (scaled_step, case.args("scaled")),
        "one vector": (jax.jit(stepped), packed_args),
    }
    row: dict[str, Any] = {"case": case_name, "dtype": dtype}
    runnable = {}
    with jax.numpy_rank_promotion("allow"):  # some models broadcast biases implicitly
        for name, (fun, args) in variants.items():
            compiled = fun.lower(*args).compile()
            out = compiled(*args)
            row[name] = {
                "kernels": PS.hlo_counts(compiled.as_text())[0],
                "arguments": _buffers(args),
                "results": _buffers(out),
            }
            runnable[name] = (compiled, args)
        same = jax.tree_util.tree_map(
            lambda a, b: bool(jnp.array_equal(a, b, equal_nan=True)),
            jsa.tree.unpack_scales(runnable["one vector"][0](*packed_args)),
            scaled_step(*case.args("scaled")),
        )
    row["same_values"] = all(jax.tree_util.tree_leaves(same))
    for name, seconds in DS.median_times(runnable, iters).items():
        row[name]["step_ms"] = 1e3 * seconds
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    print(f"# {platform.node()} {platform.machine()}, JAX {jax.__version__}, {jax.devices()[0]}")
    print(
        f"{'case':<12} {'variant':<10} {'kernels':>7} {'arguments':>9} {'results':>7} "
        f"{'step ms':>8} {'x plain':>7}"
    )
    rows = []
    for case_name in args.cases.split(","):
        row = measure(case_name, args.iters)
        rows.append(row)
        for variant in ("plain", "scaled", "one vector"):
            v = row[variant]
            print(
                f"{case_name:<12} {variant:<10} {v['kernels']:>7} {v['arguments']:>9} "
                f"{v['results']:>7} {v['step_ms']:>8.3f} "
                f"{v['step_ms'] / row['plain']['step_ms']:>7.2f}"
            )
        print(f"{case_name:<12} same values: {row['same_values']}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
