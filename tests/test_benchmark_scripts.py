"""The GPU measurement script of issue 43 (`benchmarks/gpu_check.py`), run here at tiny
sizes: it must work the first time a GPU is lent."""

import json

import jax
import pytest

from tests.helpers import load_script


@pytest.mark.slow
def test_gpu_check_smoke_writes_every_number(tmp_path):
    gpu_check = load_script("gpu_check", "benchmarks/gpu_check.py")
    out = tmp_path / "gpu.json"
    report = gpu_check.main(["--smoke", "--skip-steps", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    rows = {row["variant"]: row for row in report["gemm_bound"]["rows"]}
    assert set(rows) == {"plain-bf16", "scaled-bf16", "scaled-fp8"}
    # 2 blocks x 2 matmuls, forward and two backward products, less the input's gradient.
    for row in rows.values():
        assert row["dot_generals"] == 11 and row["step_ms"] > 0 and row["kernels"] > 0
    assert rows["scaled-fp8"]["fp8_dot_generals"] == 11
    assert rows["plain-bf16"]["fp8_dot_generals"] == rows["scaled-bf16"]["fp8_dot_generals"] == 0


@pytest.mark.slow
def test_delayed_scaling_benchmark_measures_three_variants():
    bench = load_script("delayed_scaling_bench", "benchmarks/delayed_scaling.py")
    with jax.numpy_rank_promotion("allow"):  # the GPT model broadcasts biases implicitly
        row = bench.measure("block", 4, 1)
    assert row["sites"] > 0
    for variant in ("plain", "dynamic", "delayed"):
        assert row[variant]["kernels"] > 0 and row[variant]["step_ms"] > 0
