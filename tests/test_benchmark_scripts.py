"""The measurement scripts of issue 43 (`benchmarks/gpu_check.py`, `delayed_scaling.py`,
`scale_results.py`, `compile_profile.py`, `kernel_profile.py`, `weight_gradient_layout.py`,
`largest_magnitudes.py`, `program_size.kernel_kinds`), run here at tiny sizes or on
recorded output: they must work the first time a GPU is lent, and read XLA's output
right."""

import json

import jax
import pytest

import jax_scaled_arithmetics as jsa
from tests.helpers import load_script


@pytest.mark.slow
def test_gpu_check_smoke_writes_every_number(tmp_path):
    gpu_check = load_script("gpu_check", "benchmarks/gpu_check.py")
    out = tmp_path / "gpu.json"
    report = gpu_check.main(["--smoke", "--skip-steps", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    rows = {row["variant"]: row for row in report["gemm_bound"]["rows"]}
    assert set(rows) == {"plain-bf16", "scaled-bf16", "scaled-fp8", "delayed-bf16", "delayed-fp8"}
    # 2 blocks x 2 matmuls, forward and two backward products, less the input's gradient.
    for row in rows.values():
        assert row["dot_generals"] == 11 and row["step_ms"] > 0 and row["kernels"] > 0
        assert sum(row["by_kind"].values()) == row["kernels"]
    assert rows["scaled-fp8"]["fp8_dot_generals"] == rows["delayed-fp8"]["fp8_dot_generals"] == 11
    for variant in ("plain-bf16", "scaled-bf16", "delayed-bf16"):
        assert rows[variant]["fp8_dot_generals"] == 0


@pytest.mark.slow
def test_gpu_check_measures_the_steps_with_cublas_gemms():
    gpu_check = load_script("gpu_check", "benchmarks/gpu_check.py")
    (row,) = gpu_check.step_rows(
        gpu_check.SMOKE_STEP_CASES,
        1,
        only=gpu_check.CUBLAS_VARIANTS,
        compiler_options=gpu_check.NO_TRITON_GEMM,
    )
    assert "error" not in row, row.get("error")
    measured = set(row) - {"case", "dtype", "sites"}
    assert measured == set(gpu_check.CUBLAS_VARIANTS) == {"plain", "delayed-packed"}
    for variant in measured:
        assert row[variant]["kernels"] > 0 and row[variant]["step_ms"] > 0


@pytest.mark.slow
def test_delayed_scaling_benchmark_measures_five_variants():
    bench = load_script("delayed_scaling_bench", "benchmarks/delayed_scaling.py")
    with jax.numpy_rank_promotion("allow"):  # the GPT model broadcasts biases implicitly
        row = bench.measure("block", 4, 1)
    assert row["sites"] > 0
    assert set(bench.VARIANTS) == {"plain", "dynamic", "packed", "delayed", "delayed-packed"}
    for variant in bench.VARIANTS:
        assert row[variant]["kernels"] > 0 and row[variant]["step_ms"] > 0
        assert sum(row[variant]["by_kind"].values()) == row[variant]["kernels"]
        assert 0 < row[variant]["distinct"] < row[variant]["kernels"]
    # Unpacked in one kernel per 32, the packed steps' scales keep their readers alike.
    assert row["delayed-packed"]["distinct"] <= row["delayed"]["distinct"] + 5


@pytest.mark.slow
@pytest.mark.parametrize("case", ["block", "zoo-linen", "zoo-nnx", "zoo-equinox"])
def test_scale_results_benchmark_carries_the_scales_in_one_vector(case):
    """The step with its trees packed by `jsa.tree.pack_scales` (a linen `TrainState`, an
    NNX `State` and optax state, an Equinox module with its non-array fields) computes the
    scaled step's values, with one scale buffer per tree."""
    bench = load_script("scale_results_bench", "benchmarks/scale_results.py")
    with jax.numpy_rank_promotion("allow"):  # the GPT model broadcasts biases implicitly
        row = bench.measure(case, 2)
    assert row["same_values"]  # the one-vector step computes the scaled step's values
    scaled, packed = row["scaled"], row["one vector"]
    # Every ScaledArray's scale was an argument (and a result) of its own; now one vector.
    assert packed["arguments"] < scaled["arguments"] and packed["results"] < scaled["results"]
    assert scaled["arguments"] - packed["arguments"] == scaled["results"] - packed["results"]
    for variant in ("plain", "scaled", "one vector"):
        assert row[variant]["kernels"] > 0 and row[variant]["step_ms"] > 0


# An optimized XLA:GPU module as `compiled.as_text()` writes it (fusion bodies left out).
GPU_HLO = """HloModule jit_step, entry_computation_layout={...}

ENTRY %main.1 (x.1: f32[512,128], w.1: f8e4m3fn[128,64], s.1: f32[]) -> (f32[], f32[512], f32[64,512]) {
  %x.1 = f32[512,128]{1,0} parameter(0), metadata={op_name="x"}
  %w.1 = f8e4m3fn[128,64]{1,0} parameter(1), metadata={op_name="w"}
  %s.1 = f32[] parameter(2), metadata={op_name="s"}
  %constant.1 = f32[] constant(2)
  %input_reduce_fusion = f32[256]{0} fusion(%x.1), kind=kInput, calls=%fused_reduce
  %input_reduce_fusion.1 = f32[] fusion(%input_reduce_fusion), kind=kInput, calls=%fused_reduce.1
  %loop_and_fusion = s32[] fusion(%input_reduce_fusion.1), kind=kLoop, calls=%fused_and
  %bitcast.1 = f32[] bitcast(%loop_and_fusion)
  %loop_multiply_fusion = f32[] fusion(%input_reduce_fusion.1, %s.1), kind=kLoop, calls=%fm
  %loop_convert_fusion = f8e4m3fn[512,128]{1,0} fusion(%x.1, %loop_multiply_fusion), kind=kLoop, calls=%fc
  %gemm_fusion_dot = f32[512,64]{1,0} fusion(%loop_convert_fusion, %w.1), kind=kCustom, calls=%g, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %custom-call.1 = (f32[512,128]{1,0}, s8[1024]{0}) custom-call(%x.1, %x.1), custom_call_target="__cublas$gemm"
  %get-tuple-element.1 = f32[512,128]{1,0} get-tuple-element(%custom-call.1), index=0
  %input_reduce_fusion.2 = (f32[512]{0}, f32[512,128]{1,0}) fusion(%get-tuple-element.1), kind=kInput, calls=%fr
  %get-tuple-element.2 = f32[512]{0} get-tuple-element(%input_reduce_fusion.2), index=0
  %copy.1 = f32[64,512]{0,1} copy(%gemm_fusion_dot)
  ROOT %tuple.1 = (f32[], f32[512]{0}, f32[64,512]{0,1}) tuple(%bitcast.1, %get-tuple-element.2, %copy.1)
}
"""  # noqa: E501


def test_kernel_kinds_sorts_the_kernels_of_an_xla_gpu_module():
    program_size = load_script("program_size", "benchmarks/program_size.py")
    kinds = program_size.kernel_kinds(GPU_HLO)
    assert kinds == {
        "reduction to a tensor": 1,
        "reduction to a scalar": 1,
        "scalar: step outputs": 1,  # read by the root tuple only, through a bitcast
        "scalar: read by kernels": 1,
        "elementwise on tensors": 1,
        "gemm (fp8)": 1,  # two float8 operands
        "gemm": 1,  # the cuBLAS call on float32 operands
        "reduction, several outputs": 1,
        "copy": 1,
    }
    assert sum(kinds.values()) == program_size.hlo_counts(GPU_HLO)[0]


def test_kernel_kinds_sorts_every_kernel_of_a_compiled_step():
    """On this machine's backend too: every kernel `hlo_counts` counts has one kind."""
    program_size = load_script("program_size", "benchmarks/program_size.py")

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jax.numpy.sum(jax.numpy.tanh(x @ w) ** 2))(w)

    w = jax.numpy.ones((32, 16))
    x = jax.numpy.ones((8, 32))
    hlo = jax.jit(step).lower(w, x).compile().as_text()
    kinds = program_size.kernel_kinds(hlo)
    assert sum(kinds.values()) == program_size.hlo_counts(hlo)[0] > 0
    # A dynamic scale's largest magnitude is a reduction to a scalar on every backend.
    x16 = jsa.as_scaled_array(jax.numpy.full((64, 64), 3.0), dtype=jax.numpy.float16)
    rescaled = jax.jit(jsa.autoscale(lambda v: jsa.ops.dynamic_rescale_max(v * 5.0)))
    kinds = program_size.kernel_kinds(rescaled.lower(x16).compile().as_text())
    assert kinds["reduction to a scalar"] >= 1, kinds


def test_launched_kernels_counts_a_loop_body_per_iteration():
    """A scan's body runs its kernels once per iteration: the ENTRY computation holds one
    `while` whatever the length, and `launched_kernels` counts its body times the trip count
    (and its condition once more)."""
    program_size = load_script("program_size", "benchmarks/program_size.py")
    w = jax.numpy.ones((16, 16))

    def layers(n):
        def f(x):
            return jax.lax.scan(lambda c, _: (jax.numpy.sin(c @ w) * 2.0, None), x, None, n)[0]

        return jax.jit(f).lower(jax.numpy.ones((4, 16))).compile().as_text()

    three, six = layers(3), layers(6)
    assert program_size.hlo_counts(three)[0] == program_size.hlo_counts(six)[0]
    per_iteration = (program_size.launched_kernels(six) - program_size.launched_kernels(three)) // 3
    assert per_iteration >= 2  # the product, and the sine (its condition too, on some backends)
    assert program_size.launched_kernels(six) == (
        program_size.launched_kernels(three) + 3 * per_iteration
    )
    assert program_size.launched_kernels(three) >= program_size.hlo_counts(three)[0] + 2


def test_program_size_reports_kernels_by_kind():
    """`measure_variant` of the MLP case: the kernels by kind add up to the kernels, and
    the scaled step's scalar kernels (its materialised scales) are among them."""
    program_size = load_script("program_size", "benchmarks/program_size.py")
    case = program_size.case_mlp(jax.numpy.dtype("float32"))
    numbers = {}
    for variant in ("plain", "scaled"):
        reported = {}
        with jax.numpy_rank_promotion("allow"):  # the benchmark's models broadcast biases
            program_size.measure_variant(case, variant, reported.__setitem__, memory=False)
        numbers[variant] = reported
    for reported in numbers.values():
        assert sum(reported["hlo_kernel_kinds"].values()) == reported["hlo_kernels"]
        assert 0 <= reported["hlo_scalar_kernels"] <= reported["hlo_kernels"]
    assert numbers["scaled"]["hlo_scalar_kernels"] > numbers["plain"]["hlo_scalar_kernels"]


# XLA's timing log of a compile, as `TF_CPP_VMODULE=hlo_pass_pipeline=1,cpu_compiler=1`
# writes it: an earlier module's compile, the child's marker, then the step's.
XLA_LOG = """I1129 10:00:00.1 1 cpu_compiler.cc:2198] Compiling [jit_other] for CPU using JIT time: 9 s (9 us) (cumulative: 9 s, max: 9 s, #called: 1)
compile_profile: compile starts
I1129 10:00:01.1 1 hlo_pass_pipeline.cc:303] Running HLO pass pipeline on module jit_step: cpu
I1129 10:00:01.2 1 hlo_pass_pipeline.cc:303] Running HLO pass pipeline on module jit_step: simplification
I1129 10:00:01.3 1 hlo_pass_pipeline.cc:206] HLO pass: algsimp time: 40 ms (40000 us) (cumulative: 40 ms, max: 40 ms, #called: 1)
I1129 10:00:01.4 1 hlo_pass_pipeline.cc:206] HLO pass: algsimp time: 10 ms (10000 us) (cumulative: 50 ms, max: 40 ms, #called: 2)
I1129 10:00:01.5 1 hlo_pass_pipeline.cc:206] HLO pass: dce time: 500 us (500 us) (cumulative: 500 us, max: 500 us, #called: 1)
I1129 10:00:01.6 1 hlo_pass_pipeline.cc:206] HLO pass: simplification time: 60 ms (60000 us) (cumulative: 60 ms, max: 60 ms, #called: 1)
I1129 10:00:01.7 1 hlo_pass_pipeline.cc:206] HLO pass: copy-insertion time: 1.5 s (1500000 us) (cumulative: 1.5 s, max: 1.5 s, #called: 1)
I1129 10:00:01.8 1 cpu_compiler.cc:1314] Running HLO passes on [jit_step] for CPU time: 1.7 s (1700000 us) (cumulative: 1.7 s, max: 1.7 s, #called: 1)
I1129 10:00:02.9 1 cpu_compiler.cc:2198] Compiling [jit_step] for CPU using JIT time: 2.5 s (2500000 us) (cumulative: 11.5 s, max: 9 s, #called: 2)
"""  # noqa: E501


def test_compile_profile_reads_xla_timing_log():
    """The step's compile only (after the marker); passes summed over their runs, a nested
    pipeline's own line left out."""
    bench = load_script("compile_profile", "benchmarks/compile_profile.py")
    parsed = bench.parse_log(XLA_LOG)
    assert (parsed["xla_compile_s"], parsed["passes_s"]) == (2.5, 1.7)
    assert parsed["by_pass"] == pytest.approx({"algsimp": 0.05, "dce": 5e-4, "copy-insertion": 1.5})


@pytest.mark.slow
def test_compile_profile_splits_a_compile():
    bench = load_script("compile_profile", "benchmarks/compile_profile.py")
    run = bench.profile("block", "scaled", "float32")
    assert 0 < run["passes_s"] < run["xla_compile_s"] and run["rest_s"] > 0
    assert run["outside_s"] == pytest.approx(run["compile_s"] - run["xla_compile_s"])
    assert run["compile_s"] >= run["xla_compile_s"] * 0.9  # wall time around XLA's own
    assert {"algsimp", "fusion", "copy-insertion"} <= set(run["by_pass"])


# The ENTRY of an optimized XLA:CPU module (one split kernel) and the runtime's trace events.
CPU_HLO = """HloModule jit_step

ENTRY %main.2 (a.1: f32[], b.1: f32[4,64]) -> (f16[4,64], f32[4,64]) {
  %a.1 = f32[] parameter(0)
  %b.1 = f32[4,64]{1,0} parameter(1)
  %multiply_fusion = f32[4,64]{1,0} fusion(%a.1, %b.1), kind=kLoop, calls=%f1, backend_config={"outer_dimension_partitions":[]}
  %convert_divide_fusion = f16[4,64]{1,0} fusion(%a.1, %b.1), kind=kLoop, calls=%f2, backend_config={"outer_dimension_partitions":["2"]}
  ROOT %tuple = (f16[4,64]{1,0}, f32[4,64]{1,0}) tuple(%convert_divide_fusion, %multiply_fusion)
}
"""  # noqa: E501


def _event(name, dur, op=True):
    return {"ph": "X", "name": name, "dur": dur, "args": {"hlo_op": name} if op else {}}


TRACE = [
    _event("convert_divide_fusion", 20.0),
    _event("end: convert_divide_fusion", 0.2, op=False),
    _event("multiply_fusion", 2.0),
    _event("convert_divide_fusion", 30.0),
    _event("multiply_fusion", 1.0),
    _event("ThunkExecutor::Execute", 99.0, op=False),
]


def test_kernel_profile_sums_each_kernel_and_the_split_ones():
    bench = load_script("kernel_profile", "benchmarks/kernel_profile.py")
    kernels = bench.split_kernels(CPU_HLO)
    assert kernels == {
        "multiply_fusion": ("f32[4,64]", False),
        "convert_divide_fusion": ("f16[4,64]", True),
    }
    times = bench.kernel_times(TRACE)
    assert dict(times) == {"convert_divide_fusion": [20.0, 30.0], "multiply_fusion": [2.0, 1.0]}
    summary = bench.summarize(kernels, times, rounds=2, top=1)
    assert summary["kernels_run"] == 2 and summary["kernel_us"] == pytest.approx(26.5)
    assert (summary["split_kernels"], summary["split_us"]) == (1, 25.0)
    assert summary["longest"] == [
        {"kernel": "convert_divide_fusion", "shape": "f16[4,64]", "split": True, "us": 25.0}
    ]


@pytest.mark.slow
def test_kernel_profile_times_the_kernels_of_a_compiled_step():
    bench = load_script("kernel_profile", "benchmarks/kernel_profile.py")
    rows = bench.main(["--cases", "block", "--variants", "plain,packed", "--warmup", "1"])
    for row in rows:
        assert 0 < row["kernels_run"] <= row["kernels"] and row["kernel_us"] > 0
        assert 0 <= row["split_us"] <= row["kernel_us"]


@pytest.mark.slow
def test_weight_gradient_layout_benchmark_finds_the_copies_it_removes():
    bench = load_script("weight_gradient_layout", "benchmarks/weight_gradient_layout.py")
    row = bench.measure("nnx", 1)
    assert set(bench.VARIANTS) == {"plain", "unfused", "fused"}
    copies = {variant: row[variant]["transposing_copies"] for variant in bench.VARIANTS}
    # Unfused, XLA:CPU writes each weight gradient transposed (2 Linear layers).
    assert copies["fused"] == copies["plain"] < copies["unfused"], copies
    assert row["fused"]["kernels"] <= row["unfused"]["kernels"]
    assert row["largest_difference"] < 1e-6
    for variant in bench.VARIANTS:
        assert row[variant]["step_ms"] > 0


def test_largest_magnitudes_benchmark_times_both_forms():
    bench = load_script("largest_magnitudes_bench", "benchmarks/largest_magnitudes.py")
    count, elements, grouped_ms, alone_ms = bench.time_both(bench.MODELS["zoo linen"], 1)
    assert (count, elements) == (56, 2 * 19_456)  # two moments of the 28 parameters
    assert grouped_ms > 0 and alone_ms > 0
