"""The GPU measurements of issue 43 in one run: a few minutes, one JSON.

Run it whenever a GPU is lent (it runs on a CPU too, slowly; `--smoke` is a tiny version of
every part, for checking the script):

    python benchmarks/gpu_check.py --json gpu.json [--smoke] [--iters 20]

Parts:

1. `steps`: plain vs dynamic (`jax.jit(jsa.autoscale(step))`) vs packed (the dynamic step
   with its ScaledArray trees packed by `jsa.tree.pack_scales`) vs delayed
   (`jsa.delayed_scaling`) vs delayed and packed training steps, by
   `benchmarks/delayed_scaling.py`'s `measure`:
   kernels of the compiled program (`program_size.hlo_counts`) and those one step launches
   (`program_size.launched_kernels`: a scanned model's layers once per iteration), lower +
   compile time and the
   median step time, and the kernels by kind (`program_size.kernel_kinds`: GEMMs, reductions
   to a scalar, kernels that write one scalar, ...). Cases: the zoo's Flax linen, NNX and
   Equinox steps and the 2-block char GPT's Adam step, with float16 and bfloat16 data;
   GPT-2-small's shape with float16 data, unrolled and as a `lax.scan` over its layers
   (where `delayed_scaling` holds a scale per layer).
2. `gemm_bound`: a step whose time is its matmuls: `--blocks` residual MLP blocks
   (`h + gelu(h @ w1) @ w2`, width `--width`, hidden 4x) on `--tokens` tokens, the gradient
   of a mean square and an SGD update. Variants: plain bfloat16 (`jax.jit`), scaled
   bfloat16 and scaled FP8 (E4M3 data for parameters and inputs; under `autoscale` every
   matmul of FP8 data is a `dot_general` of FP8 operands with a float32 result), and both
   scaled steps under `jsa.delayed_scaling` (no data waits for a reduction of a GEMM's
   output; each output's largest magnitude is measured for the next step). Reported:
   step time, compile time, kernels, the FP8 `dot_general`s of the lowered program and, from
   the optimized HLO, the cuBLAS(Lt) GEMM calls and how many of them take FP8 operands.

3. `cublas_steps`: the plain and delayed-packed steps of the char GPT and the zoo linen
   step again, compiled with `xla_gpu_enable_triton_gemm` off (every GEMM a cuBLAS call):
   XLA:GPU merges a site's measurement of a GEMM output with another reader of it only
   when the GEMM is not a Triton fusion (docs/benchmarks.md, "Delayed scales on XLA:GPU"),
   and the autotuner picks per GEMM; this shows what the choice costs or saves.

The JSON holds the device, JAX's version, the git commit and every number; nothing is
asserted (tests/benchmarks check the script on the CPU with `--smoke`).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_scaled_arithmetics as jsa

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:  # run as a script or loaded by path
    sys.path.insert(0, str(ROOT / "benchmarks"))

import delayed_scaling  # noqa: E402

STEP_CASES = (
    ("zoo-linen", "float16"),
    ("zoo-nnx", "float16"),
    ("zoo-equinox", "float16"),
    ("gpt2-adam", "float16"),
    ("zoo-linen", "bfloat16"),
    ("zoo-nnx", "bfloat16"),
    ("zoo-equinox", "bfloat16"),
    ("gpt2-adam", "bfloat16"),
    ("gpt2-small", "float16"),
    ("gpt2-small-scan", "float16"),
)
SMOKE_STEP_CASES = (("zoo-linen", "float16"),)
CUBLAS_STEP_CASES = (("gpt2-adam", "float16"), ("zoo-linen", "float16"))
CUBLAS_VARIANTS = ("plain", "delayed-packed")
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}


def step_rows(cases: Any, iters: int, **measure_options: Any) -> list[dict[str, Any]]:
    rows = []
    for case, dtype in cases:
        try:
            rows.append(delayed_scaling.measure(case, 16, iters, dtype=dtype, **measure_options))
        except Exception as error:  # noqa: BLE001  (one failing case does not end the run)
            rows.append({"case": case, "dtype": dtype, "error": f"{type(error).__name__}: {error}"})
        print(json.dumps(rows[-1]), flush=True)
    return rows


# --- the GEMM-bound step ---------------------------------------------------------------------


def _gemm_params(width: int, blocks: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    hidden = 4 * width
    return [
        {
            "w1": (rng.standard_normal((width, hidden)) / np.sqrt(width)).astype(np.float32),
            "w2": (rng.standard_normal((hidden, width)) / np.sqrt(hidden)).astype(np.float32),
        }
        for _ in range(blocks)
    ]


def _gemm_loss(params: Any, x: Any) -> Any:
    h = x
    for block in params:
        h = h + jax.nn.gelu(h @ block["w1"]) @ block["w2"]
    return jnp.mean(jnp.square(h.astype(jnp.float32)))


def _gemm_step(params: Any, x: Any) -> Any:
    loss, grads = jax.value_and_grad(_gemm_loss)(params, x)
    new = jax.tree_util.tree_map(lambda p, g: p - (1e-3 * g).astype(p.dtype), params, grads)
    return new, loss


def _fp8_dots(lowered_text: str) -> tuple[int, int]:
    """(dot_generals, those with two FP8 operands) of a lowered StableHLO module."""
    dots = [line for line in lowered_text.splitlines() if "stablehlo.dot_general" in line]
    fp8 = [line for line in dots if len(re.findall(r"xf8E\w+>", line.split("->")[0])) >= 2]
    return len(dots), len(fp8)


def _gemm_calls(hlo_text: str) -> tuple[int, int]:
    """(cuBLAS/cuBLASLt GEMM custom calls, those with FP8 operands) of an optimized HLO."""
    calls = [line for line in hlo_text.splitlines() if 'custom_call_target="__cublas' in line]
    fp8 = [line for line in calls if re.search(r"f8e\w+\[", line.split("custom-call(")[-1])]
    return len(calls), len(fp8)


def gemm_rows(width: int, tokens: int, blocks: int, iters: int) -> list[dict[str, Any]]:
    params32 = _gemm_params(width, blocks)
    x32 = np.random.default_rng(1).standard_normal((tokens, width)).astype(np.float32)
    bf16 = jnp.bfloat16
    fp8 = jnp.float8_e4m3fn
    variants = {
        "plain-bf16": (
            _gemm_step,
            (
                jax.tree_util.tree_map(lambda a: jnp.asarray(a, bf16), params32),
                jnp.asarray(x32, bf16),
            ),
        ),
        "scaled-bf16": (
            jsa.autoscale(_gemm_step),
            (jsa.as_scaled_array(params32, dtype=bf16), jsa.as_scaled_array(x32, dtype=bf16)),
        ),
        "scaled-fp8": (
            jsa.autoscale(_gemm_step),
            (jsa.as_scaled_array(params32, dtype=fp8), jsa.as_scaled_array(x32, dtype=fp8)),
        ),
    }
    for dtype_name in ("bf16", "fp8"):  # the same steps at delayed scales
        _, args = variants[f"scaled-{dtype_name}"]
        delayed = jsa.delayed_scaling(_gemm_step)
        _, history = jax.jit(delayed.init)(*args)
        variants[f"delayed-{dtype_name}"] = (delayed, (history, *args))
    rows = []
    compiled_steps = {}
    for name, (fun, args) in variants.items():
        start = time.perf_counter()
        lowered = jax.jit(fun).lower(*args)
        compiled = lowered.compile()
        compile_s = time.perf_counter() - start
        hlo = compiled.as_text()
        kernels, instructions = delayed_scaling.PS.hlo_counts(hlo)
        by_kind = dict(delayed_scaling.PS.kernel_kinds(hlo).most_common())
        dots, fp8_dots = _fp8_dots(lowered.as_text())
        gemms, fp8_gemms = _gemm_calls(hlo)
        rows.append(
            {
                "variant": name,
                "compile_s": compile_s,
                "kernels": kernels,
                "instructions": instructions,
                "by_kind": by_kind,
                "dot_generals": dots,
                "fp8_dot_generals": fp8_dots,
                "gemm_calls": gemms,
                "fp8_gemm_calls": fp8_gemms,
            }
        )
        compiled_steps[name] = (compiled, args)
    medians = delayed_scaling.median_times(compiled_steps, iters)
    flops = 2 * 3 * 2 * tokens * width * 4 * width * blocks  # 2 matmuls, fwd + 2 bwd each
    for row in rows:
        seconds = medians[row["variant"]]
        row["step_ms"] = 1e3 * seconds
        row["tflops"] = flops / seconds / 1e12
        print(json.dumps(row), flush=True)
    return rows


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return ""


def main(argv: Any = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one step case")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--skip-steps", action="store_true", help="only the GEMM-bound part")
    args = parser.parse_args(argv)
    if args.smoke:
        args.width, args.tokens, args.blocks, args.iters = 64, 128, 2, 2
    report: dict[str, Any] = {
        "device": str(jax.devices()[0]),
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "commit": _git_commit(),
        "smoke": args.smoke,
    }
    print(json.dumps(report), flush=True)
    if not args.skip_steps:
        report["steps"] = step_rows(SMOKE_STEP_CASES if args.smoke else STEP_CASES, args.iters)
        report["cublas_steps"] = step_rows(
            SMOKE_STEP_CASES if args.smoke else CUBLAS_STEP_CASES,
            args.iters,
            only=CUBLAS_VARIANTS,
            compiler_options=NO_TRITON_GEMM,
        )
    report["gemm_bound"] = {
        "width": args.width,
        "tokens": args.tokens,
        "blocks": args.blocks,
        "rows": gemm_rows(args.width, args.tokens, args.blocks, args.iters),
    }
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
