"""`experiments/gpt/train_sharded.py`: the FSDP GPT on the test session's 4 CPU devices.

On the committed fixture `tests/data/tinyshakespeare-first-4096.txt`, with a tiny model (1
layer, width 32, context 16, batch 8): every recipe trains with finite losses on 4 devices,
float32 on 4 devices matches 1 device, the logs are written, and the collectives of a step
move FP8 parameters and BF16 gradients (bytes read from the HLO).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.helpers import load_script

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE = REPO_ROOT / "tests" / "data" / "tinyshakespeare-first-4096.txt"

sharded = load_script("gpt_train_sharded", "experiments/gpt/train_sharded.py")
CONFIG = sharded.single.TrainConfig(
    n_layer=1,
    n_head=2,
    n_embd=32,
    block_size=16,
    batch_size=8,
    steps=3,
    eval_every=3,
    eval_batches=1,
)


@pytest.fixture(autouse=True)
def _implicit_broadcasting():
    """The model broadcasts biases implicitly, as model code does (the suite raises on it)."""
    with jax.numpy_rank_promotion("allow"):
        yield


# Training runs of the experiment: the slow step (the default run checks the recipe's
# collectives in tests/test_sharding.py::test_fsdp_moves_one_byte_per_parameter_and_bf16_gradients
# and its values in ::test_fsdp_under_autoscale_with_fp8_gathers_and_bf16_reductions).
@pytest.mark.slow
def test_every_recipe_trains_on_four_devices_and_float32_matches_one(tmp_path):
    text = FIXTURE.read_text()
    devices = jax.devices()[:4]
    logs = {r: sharded.train(r, text, devices, CONFIG, out_dir=tmp_path) for r in sharded.RECIPES}
    for recipe, log in logs.items():
        assert all(math.isfinite(v) for v in log["train_loss"] + log["val_loss"]), recipe
        assert json.loads((tmp_path / f"{recipe}-4dev.json").read_text())["devices"] == 4
    one = sharded.train("fp32", text, devices[:1], CONFIG)
    np.testing.assert_allclose(one["val_loss"], logs["fp32"]["val_loss"], rtol=1e-5)
    # FP8 gathers and BF16 gradients change the loss by little after 3 steps.
    np.testing.assert_allclose(logs["fp8-fsdp"]["val_loss"], one["val_loss"], atol=0.02)


@pytest.mark.slow  # compiles every recipe's GPT step; see the note above
def test_collective_bytes_of_a_step():
    report = sharded.hlo_report(sharded.RECIPES, jax.devices()[:4], CONFIG)
    fp32, bf16, fp8 = (report[r]["partitioned"] for r in sharded.RECIPES)
    assert fp32["all-gather"] > 0 and fp32["count"]["all-gather"] == fp8["count"]["all-gather"]
    assert bf16["all-gather"] * 2 == fp32["all-gather"]
    assert fp8["all-gather"] * 4 == fp32["all-gather"]  # 1 byte an entry
    assert fp8["reduce-scatter"] * 2 == fp32["reduce-scatter"]  # bfloat16 gradients
    # Every gathered or reduced tensor agrees on its scale with one 4-byte all-reduce.
    assert fp8["all-reduce"] >= 4 * (fp8["count"]["all-gather"] + fp8["count"]["reduce-scatter"])
    assert fp8["all-reduce"] <= 4 * fp8["count"]["all-reduce"]  # scalars only


def test_parse_collectives_reads_types_and_bytes():
    hlo = """
  %all-gather.1 = u8[64,32]{1,0} all-gather(u8[16,32]{1,0} %p), dimensions={0}
  %rs = bf16[4]{0} reduce-scatter(bf16[16]{0} %g), dimensions={0}
  %ar = (s32[], f32[]) all-reduce(s32[] %a, f32[] %b), to_apply=%max
  %add = f32[4]{0} add(f32[4]{0} %x, f32[4]{0} %y)
"""
    found = sharded.parse_collectives(hlo)
    assert [(c["kind"], c["bytes"]) for c in found] == [
        ("all-gather", 64 * 32),
        ("reduce-scatter", 8),
        ("all-reduce", 8),
    ]


@pytest.mark.slow
def test_optimizer_state_is_sharded_like_the_parameters():
    model = CONFIG.model(65)
    params32 = sharded.single._init_params(jax.random.PRNGKey(0), model)  # noqa: SLF001
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), (sharded.AXIS,))
    run = sharded.setup("fp8-fsdp", params32, model, 1e-3, mesh)
    w = run.params["blocks"][0]["fc"]
    mu = run.state[0].mu["blocks"][0]["fc"]  # scale_optimizer(adam): ScaleByAdamState
    assert w.data.sharding.spec == mu.data.sharding.spec == run.specs["blocks"][0]["fc"]
    assert w.scale.sharding.spec == mu.scale.sharding.spec == jax.sharding.PartitionSpec()
