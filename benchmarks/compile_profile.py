"""Where a training step's compile time goes on XLA:CPU: HLO passes against the rest.

The first call of a scaled step is mostly XLA's compile (docs/benchmarks.md, "Where the cost
targets stand"). XLA times each HLO pass and the whole compile in its own log; this script
turns that log on for one compile (`TF_CPP_VMODULE=hlo_pass_pipeline=1,cpu_compiler=1`) and
splits `compile()` of each case of `benchmarks/program_size.py` into

- XLA's HLO passes (its "Running HLO passes" phase), which grow with the module's
  instructions;
- the rest of XLA's compile ("Compiling ... for CPU using JIT" less the passes): code
  generation (LLVM, once per distinct kernel), buffer assignment, the runtime's thunks;
- what `compile()` spends outside XLA's timer: the StableHLO module converted to HLO,
  the executable loaded (its kernels linked);

with the innermost passes that take longest (a nested pipeline counted once). Each (case,
variant) compiles in a fresh subprocess (no compilation cache), `--repeat` times with the
variants alternated; the table gives medians, the JSON every run. The log costs some time of
its own: compare plain and scaled of one run.

Run:
    python benchmarks/compile_profile.py [--cases gpt2-adam,zoo-linen] [--repeat 3]
        [--top 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:  # run as a script or loaded by path
    sys.path.insert(0, str(ROOT / "benchmarks"))

DEFAULT_CASES = ("gpt2-adam", "zoo-linen", "zoo-equinox")
_START = "compile_profile: compile starts"
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_PASS = re.compile(r"HLO pass: (\S+) time: ([\d.]+) (us|ms|s)\b")
_PIPELINE = re.compile(r"Running HLO pass pipeline on module \S+: (\S+)")
_PHASE = re.compile(r"\] (Running HLO passes on|Compiling) \[?\S+ .*?time: ([\d.]+) (us|ms|s)\b")


def parse_log(log: str) -> dict[str, Any]:
    """XLA's times of the compile logged after the child's start marker.

    Returns `{"xla_compile_s", "passes_s", "by_pass"}`: XLA's whole compile of the module
    and its HLO pass phase (the last such lines: the step's module is compiled last), and
    the time of each innermost pass summed over its runs; a pass that is itself a pipeline
    (XLA logs a nested pipeline as a pass of its parent) is left out, its own passes being
    counted.
    """
    if _START in log:
        log = log.split(_START, 1)[1]
    phases: dict[str, float] = {}
    for phase, value, unit in _PHASE.findall(log):
        phases[phase] = float(value) * _UNITS[unit]
    pipelines = set(_PIPELINE.findall(log))
    by_pass: collections.Counter[str] = collections.Counter()
    for name, value, unit in _PASS.findall(log):
        if name not in pipelines:
            by_pass[name] += float(value) * _UNITS[unit]
    return {
        "xla_compile_s": phases.get("Compiling", float("nan")),
        "passes_s": phases.get("Running HLO passes on", float("nan")),
        "by_pass": dict(by_pass),
    }


def _child(case_name: str, variant: str, dtype: str) -> None:
    import jax
    import jax.numpy as jnp
    import program_size as PS

    jax.config.update("jax_enable_compilation_cache", False)
    case = PS.CASES[case_name][0](jnp.dtype(dtype))
    lowered = jax.jit(case.step(variant)).lower(*case.args(variant))
    print(_START, file=sys.stderr, flush=True)
    start = time.perf_counter()
    lowered.compile()
    print(json.dumps({"compile_s": time.perf_counter() - start}), flush=True)


def profile(case_name: str, variant: str, dtype: str, timeout: float = 900) -> dict[str, Any]:
    """One compile of `case_name`'s `variant` step in a fresh process, with XLA's timing log:
    `{"compile_s"` (wall, `compile()`), `"xla_compile_s", "passes_s", "rest_s",
    "outside_s", "by_pass"}`."""
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="0",
        TF_CPP_VMODULE="hlo_pass_pipeline=1,cpu_compiler=1",
        JAX_PLATFORMS="cpu",
    )
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", case_name, variant, dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        raise RuntimeError(f"{case_name} {variant}: {tail[0][:300]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1]) | parse_log(proc.stderr)
    result["rest_s"] = result["xla_compile_s"] - result["passes_s"]
    result["outside_s"] = result["compile_s"] - result["xla_compile_s"]
    return result


def _median_row(runs: list[dict[str, Any]], top: int) -> dict[str, Any]:
    keys = ("compile_s", "xla_compile_s", "passes_s", "rest_s", "outside_s")
    row: dict[str, Any] = {key: statistics.median(r[key] for r in runs) for key in keys}
    names = {name for r in runs for name in r["by_pass"]}
    medians = {n: statistics.median(r["by_pass"].get(n, 0.0) for r in runs) for n in names}
    row["top_passes"] = dict(sorted(medians.items(), key=lambda kv: -kv[1])[:top])
    return row


def main(argv: Any = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--top", type=int, default=6, help="passes listed per variant")
    parser.add_argument("--json", help="write every run and the medians here")
    args = parser.parse_args(argv)

    import program_size as PS

    report: dict[str, Any] = {"machine": PS.machine(), "cases": {}}
    for name in args.cases.split(","):
        dtype = PS.CASES[name][1]
        runs: dict[str, list[dict[str, Any]]] = {"plain": [], "scaled": []}
        for _ in range(args.repeat):
            for variant in runs:
                runs[variant].append(profile(name, variant, dtype))
        report["cases"][name] = {
            "dtype": dtype,
            "runs": runs,
            "median": {v: _median_row(r, args.top) for v, r in runs.items()},
        }
    header = "| case | variant | compile() (s) | HLO passes (s) | rest of XLA's (s) | outside (s) |"
    print(header + " longest passes (s) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for name, numbers in report["cases"].items():
        for variant, row in numbers["median"].items():
            passes = ", ".join(f"{k} {v:.2f}" for k, v in row["top_passes"].items())
            print(
                f"| {name} | {variant} | {row['compile_s']:.2f} | {row['passes_s']:.2f} | "
                f"{row['rest_s']:.2f} | {row['outside_s']:.2f} | {passes} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--_child":
        _child(*sys.argv[2:])
    else:
        main()
