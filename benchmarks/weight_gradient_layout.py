"""What writing each weight gradient in the weights' layout saves a scaled training step.

Autodiff writes the gradient of `x @ w` with respect to `w` as
`transpose(dot_general(g, x))`. `autoscale` computes such a product with its operands
swapped, whose output is the transpose's (`_Autoscale.groups` in `core/interpreter.py`);
before, XLA:CPU wrote each scaled weight gradient transposed, in a strided copy of its own.
For each case of `benchmarks/program_size.py` named with `--cases`, three variants of one
training step:

- plain: `jax.jit(step)` on float32 arrays;
- unfused: `jax.jit(jsa.autoscale(step))` traced with the fusion off (the interpreter's
  `groups` finding nothing: the product and its transpose bound as two equations);
- fused: the same step as users run it.

Measured: the compiled program's kernels, its transposing copies (`copy`/`transpose`
kernels on tensors), the largest difference between the two scaled variants' outputs
(relative to each output's largest magnitude; the products sum in another order, and after
an Adam step an element whose gradient rounds to 0 in one order and not in the other has
moved by the learning rate), and the median
step time of the three compiled steps run in turn (`--iters` rounds after a warm-up). One
process: compare the ratios of one run (docs/benchmarks.md, "Weight gradients in the
weights' layout").

Run:
    python benchmarks/weight_gradient_layout.py [--cases mlp,cnn] [--iters 60]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_scaled_arithmetics.core import interpreter

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:  # run as a script or loaded by path
    sys.path.insert(0, str(ROOT / "benchmarks"))

import delayed_scaling as DS  # noqa: E402
import program_size as PS  # noqa: E402

DEFAULT_CASES = ("mlp", "cnn", "nnx", "block", "gpt-adam", "zoo-equinox")
VARIANTS = ("plain", "unfused", "fused")


def transposing_copies(hlo: str) -> int:
    """Kernels of the optimized HLO's entry computation that copy or transpose a tensor."""
    entry = hlo[hlo.index("ENTRY") :]
    count = 0
    for line in entry.splitlines()[1:]:
        match = re.match(r"\s*%?(\S+) = (\S+) ([\w-]+)\(", line)
        if match is None or "[]" in match.group(2):
            continue
        name, op = match.group(1), match.group(3)
        count += op in ("copy", "transpose") or name.startswith(("copy", "transpose"))
    return count


def _unfused(step: Any, args: Any) -> Any:
    """`step` lowered with the interpreter's product-and-transpose fusion off."""
    found = interpreter._Autoscale.groups
    interpreter._Autoscale.groups = lambda self, jaxpr, context: ()  # type: ignore[method-assign]
    try:
        return jax.jit(step).lower(*args)
    finally:
        interpreter._Autoscale.groups = found  # type: ignore[method-assign]


def _relative_difference(a: Any, b: Any) -> float:
    """max |a - b| over max |b|, in float32 (0 for two zero arrays)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    peak = float(np.max(np.abs(b))) if b.size else 0.0
    return float(np.max(np.abs(a - b))) / peak if peak else float(np.any(a != b))


def measure(case_name: str, iters: int) -> dict[str, Any]:
    """One case's three variants."""
    builder, dtype = PS.CASES[case_name]
    case = builder(jnp.dtype(dtype))
    row: dict[str, Any] = {"case": case_name, "dtype": dtype}
    runnable = {}
    with jax.numpy_rank_promotion("allow"):  # some models broadcast biases implicitly
        lowered = {
            "plain": jax.jit(case.step("plain")).lower(*case.args("plain")),
            "unfused": _unfused(case.step("scaled"), case.args("scaled")),
            "fused": jax.jit(case.step("scaled")).lower(*case.args("scaled")),
        }
        outputs = {}
        for name, low in lowered.items():
            compiled = low.compile()
            args = case.args("plain" if name == "plain" else "scaled")
            outputs[name] = compiled(*args)
            hlo = compiled.as_text()
            row[name] = {
                "kernels": PS.hlo_counts(hlo)[0],
                "transposing_copies": transposing_copies(hlo),
            }
            runnable[name] = (compiled, args)
    row["largest_difference"] = max(
        jax.tree_util.tree_leaves(
            jax.tree_util.tree_map(_relative_difference, outputs["unfused"], outputs["fused"])
        )
    )
    for name, seconds in DS.median_times(runnable, iters).items():
        row[name]["step_ms"] = 1e3 * seconds
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    print(f"# {platform.node()} {platform.machine()}, JAX {jax.__version__}, {jax.devices()[0]}")
    print(f"{'case':<12} {'variant':<8} {'kernels':>7} {'copies':>6} {'step ms':>9} {'x plain':>7}")
    rows = []
    for case_name in args.cases.split(","):
        row = measure(case_name, args.iters)
        rows.append(row)
        for variant in VARIANTS:
            v = row[variant]
            print(
                f"{case_name:<12} {variant:<8} {v['kernels']:>7} {v['transposing_copies']:>6} "
                f"{v['step_ms']:>9.3f} {v['step_ms'] / row['plain']['step_ms']:>7.2f}"
            )
        print(f"{case_name:<12} largest difference unfused/fused: {row['largest_difference']:.2g}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
