"""Smoke test of `experiments/gpt/train_optimizers.py`: every variant runs a few steps.

On the committed fixture `tests/data/tinyshakespeare-first-4096.txt`, with a tiny model
(1 layer, width 32, context 16, batch 4): finite losses, the weights stored as the variant
says, the same initialisation and batches in every variant, and the JSON log written.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import pytest

from tests.helpers import load_script

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "data" / "tinyshakespeare-first-4096.txt"

train_optimizers = load_script("gpt_train_optimizers", "experiments/gpt/train_optimizers.py")
CONFIG = dataclasses.replace(
    train_optimizers.base.TrainConfig(),
    n_layer=1,
    n_head=2,
    n_embd=32,
    block_size=16,
    batch_size=4,
    steps=3,
    eval_every=2,
    eval_batches=2,
)
WEIGHTS = {
    "fp32": "float32",
    "bf16-nearest": "bfloat16",
    "bf16-stochastic": "bfloat16",
    "bf16-kahan": "bfloat16",
    "ibm8": "float32",  # FP16_169 values, simulated in float32
}


@pytest.fixture(autouse=True)
def _implicit_broadcasting():
    """The model broadcasts biases implicitly, as model code does (the suite raises on it)."""
    with jax.numpy_rank_promotion("allow"):
        yield


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt_optimizers")
    text = FIXTURE.read_text(encoding="ascii")
    with jax.numpy_rank_promotion("allow"):
        logs = {v: train_optimizers.run(v, text, CONFIG, out_dir=out) for v in WEIGHTS}
    return logs, out


@pytest.mark.slow
def test_every_variant_runs(runs):
    logs, out = runs
    assert set(logs) == set(train_optimizers.VARIANTS)
    for name, log in logs.items():
        assert log["weights_dtype"] == WEIGHTS[name]
        assert len(log["train_loss"]) == CONFIG.steps
        assert all(math.isfinite(v) for v in log["train_loss"] + log["val_loss"])
        assert log["val_steps"] == [0, 2, 3]
        assert json.loads((out / f"{name}.json").read_text())["variant"] == name
    assert len({log["init_digest"] for log in logs.values()}) == 1
    assert len({log["batches_digest"] for log in logs.values()}) == 1
    # bfloat16 weights and Adam state: half of float32's bytes (+ quantize's key, Kahan's buffer).
    assert logs["bf16-nearest"]["param_bytes"] * 2 == logs["fp32"]["param_bytes"]
    kahan, stochastic = logs["bf16-kahan"]["state_bytes"], logs["bf16-stochastic"]["state_bytes"]
    assert kahan == stochastic + logs["bf16-kahan"]["param_bytes"]
