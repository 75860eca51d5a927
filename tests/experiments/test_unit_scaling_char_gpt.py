"""Smoke test of `experiments/unit_scaling/char_gpt.py` and `plot_transfer.py`.

On the committed fixture `tests/data/tinyshakespeare-first-4096.txt`, with a tiny model (1
layer, width 32, context 16, batch 4, 3 steps): each mode and the u-muP optimiser run with
finite losses, the JSON log is written, and the transfer summary reads the logs back.
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

char_gpt = load_script("unit_scaling_char_gpt", "experiments/unit_scaling/char_gpt.py")
plot_transfer = load_script(
    "unit_scaling_plot_transfer", "experiments/unit_scaling/plot_transfer.py"
)
CONFIG = dataclasses.replace(
    char_gpt.Config(),
    n_layer=1,
    n_head=2,
    n_embd=32,
    block_size=16,
    batch_size=4,
    steps=3,
    eval_every=2,
    eval_batches=2,
)


@pytest.fixture(autouse=True)
def _implicit_broadcasting():
    """The model broadcasts biases implicitly, as model code does (the suite raises on it)."""
    with jax.numpy_rank_promotion("allow"):
        yield


@pytest.mark.slow
def test_modes_run_and_the_u_mup_optimiser_reads_the_model(tmp_path):
    text = FIXTURE.read_text(encoding="ascii")
    runs = [
        char_gpt.train("fp32", 1e-3, CONFIG, text, log=lambda _: None),
        char_gpt.train("unit-fp8", 2e-2, CONFIG, text, log=lambda _: None),
        char_gpt.train(
            "unit", 0.5, CONFIG, text, umup=True, unit_options={"readout": "umup"}, log=print
        ),
    ]
    for run in runs:
        assert math.isfinite(run["final_val_loss"])
        assert len(run["train_curve"]) == CONFIG.steps
        assert [step for step, _ in run["val_curve"]] == [0, 2, 3]
        # A unit-scaled model and the float32 one start near log(vocabulary), not far off.
        assert run["val_curve"][0][1] < 2 * math.log(run["config"]["vocab_size"])
    assert runs[2]["umup"] and runs[2]["unit_options"] == {"readout": "'umup'"}
    for run, tag in zip(runs, ("-sp", "", "-umup"), strict=True):
        name = f"{run['mode']}{tag}-lr{run['lr']:g}.json"
        (tmp_path / name).write_text(json.dumps(run))
    lines = plot_transfer.summary(plot_transfer.load(tmp_path))
    assert any(line.startswith("umup width 32 depth 1: best lr 0.5") for line in lines), lines
