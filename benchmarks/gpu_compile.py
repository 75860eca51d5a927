"""XLA:GPU's compiled training steps, compiled on a machine without a GPU.

JAX compiles for a GPU it does not have from a description of the device (a deviceless
compile: `jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)`,
then `jax.jit(f).trace(*abstract_args).lower().compile()`): XLA:GPU's whole pipeline runs
(fusion, layout, GEMM rewriting, code generation to PTX), without autotuning (GEMMs get
XLA's default choice) and nothing runs. So kernel counts and the form of each kernel can be
read on a CPU between the sessions that are lent a GPU; times cannot.

The target is an H200 (`H200_TARGET`: compute capability 9.0, 132 SMs; what the lent device
is). Checked against the lent H200 (its JAX 0.11.2, library at git `acbccbc`): the 1-block
char GPT's plain Adam step has 80 kernels there and here, its scaled step 298 there and 296
here (JAX 0.12); 2 blocks 135 and 135, 519 and 515.

Per case of `benchmarks/program_size.py`, five variants of one step: plain (`jax.jit`),
dynamic (`jsa.autoscale`), packed (the dynamic step with its ScaledArray trees passed and
returned as `jsa.tree.pack_scales` packs them), delayed (`jsa.delayed_scaling`) and
delayed-packed (both).
Reported: kernels (the `hlo_counts` of program_size: the ENTRY computation's), the kernels
one call launches (its `launched_kernels`: a loop body once per iteration, as a model
written as a `lax.scan` over layers runs its layers) and kernels by kind (its
`kernel_kinds`): GEMMs (and how many have two FP8 operands), reductions (to a scalar, to a
tensor, with several outputs), elementwise kernels on scalars (read only by the step's
outputs, or by other kernels), on tensors, and the rest by opcode. `--gemm` adds the
GEMM-bound step of `benchmarks/gpu_check.py` (plain bfloat16, scaled bfloat16, scaled FP8).

Setup, once (about 3 GB of CUDA libraries; no GPU or driver needed):

    pip install "jax-cuda12-plugin[with-cuda]==$(python -c 'import jax; print(jax.__version__)')"

Run (the plugin's start-up check wants a driver: the script sets
`JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`, which skips it, unless the variable is set):

    python benchmarks/gpu_compile.py [--cases gpt-adam,zoo-linen] [--dtype float16]
        [--gemm] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_scaled_arithmetics as jsa  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:  # run as a script or loaded by path
    sys.path.insert(0, str(ROOT / "benchmarks"))

import delayed_scaling  # noqa: E402
import gpu_check  # noqa: E402
import program_size as PS  # noqa: E402

DEFAULT_CASES = ("gpt-adam", "gpt2-adam", "zoo-linen", "zoo-nnx", "zoo-equinox")

# The device XLA:GPU compiles for (xla.GpuTargetConfigProto, text format): an H200 SXM.
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150000000000
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability { major: 9 minor: 0 }
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H200"
"""


def gpu_sharding() -> jax.sharding.Sharding:
    """A sharding on one device of the deviceless H200 target."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", target_config=H200_TARGET, topology="1x1x1"
    )
    mesh = topologies.make_mesh(topology, (1,), ("device",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def abstract(tree: Any, sharding: jax.sharding.Sharding) -> Any:
    """`ShapeDtypeStruct`s of `tree`'s leaves (ScaledArrays by their data and scale) placed
    by `sharding`; Python numbers stay weakly typed, as `jit` sees them."""

    def leaf(x: Any) -> jax.ShapeDtypeStruct:
        weak = isinstance(x, (int, float)) and not isinstance(x, bool)
        x = x if hasattr(x, "dtype") else jnp.asarray(x)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding, weak_type=weak)

    return jax.tree_util.tree_map(leaf, tree)


def _compile(fun: Any, args: Any, sharding: jax.sharding.Sharding) -> dict[str, Any]:
    start = time.perf_counter()
    hlo = jax.jit(fun).trace(*abstract(args, sharding)).lower().compile().as_text()
    kernels, instructions = PS.hlo_counts(hlo)
    return {
        "kernels": kernels,
        "launched": PS.launched_kernels(hlo),
        "instructions": instructions,
        "by_kind": dict(PS.kernel_kinds(hlo).most_common()),
        "cpu_compile_s": time.perf_counter() - start,
    }


def step_row(case_name: str, dtype: str | None, sharding: Any, history: int = 16) -> dict:
    """Plain, dynamic, packed, delayed and delayed-packed variants of one program_size case."""
    row, steps = delayed_scaling.variants(case_name, history, dtype)
    for name, (fun, args) in steps.items():
        row[name] = _compile(fun, args, sharding)
    return row


def gemm_rows(width: int, tokens: int, blocks: int, sharding: Any) -> list[dict[str, Any]]:
    """gpu_check's GEMM-bound step: plain bfloat16, scaled bfloat16 and scaled FP8."""
    params = gpu_check._gemm_params(width, blocks)
    x = np.ones((tokens, width), np.float32)
    step, scaled_step = gpu_check._gemm_step, jsa.autoscale(gpu_check._gemm_step)
    bf16, fp8 = jnp.bfloat16, jnp.float8_e4m3fn
    variants = {
        "plain-bf16": (step, jax.tree_util.tree_map(lambda a: a.astype(bf16), (params, x))),
        "scaled-bf16": (scaled_step, jsa.as_scaled_array((params, x), dtype=bf16)),
        "scaled-fp8": (scaled_step, jsa.as_scaled_array((params, x), dtype=fp8)),
    }
    return [{"variant": name, **_compile(*variant, sharding)} for name, variant in variants.items()]


def main(argv: Any = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--dtype", default=None, help="scaled data dtype (default: the case's)")
    parser.add_argument("--gemm", action="store_true", help="add the GEMM-bound step")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    sharding = gpu_sharding()
    report: dict[str, Any] = {
        "target": "NVIDIA H200 (deviceless)",
        "jax": jax.__version__,
        "commit": gpu_check._git_commit(),
        "steps": [],
    }
    for case_name in [c for c in args.cases.split(",") if c]:
        row = step_row(case_name, args.dtype, sharding)
        print(json.dumps(row), flush=True)
        report["steps"].append(row)
    if args.gemm:
        report["gemm_bound"] = gemm_rows(args.width, args.tokens, args.blocks, sharding)
        for row in report["gemm_bound"]:
            print(json.dumps(row), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
