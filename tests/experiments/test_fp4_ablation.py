"""The 4-bit ablation's analysis scripts: `experiments/gpt/plot_fp4.py` (tables and targets
from the logs) and `experiments/gpt/ranges_fp4.py` (the matmul-output gradients it stores
in 4 bits)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import load_script

plot_fp4 = load_script("gpt_plot_fp4", "experiments/gpt/plot_fp4.py")
ranges_fp4 = load_script("gpt_ranges_fp4", "experiments/gpt/ranges_fp4.py")
train_gpt = load_script("gpt_train", "experiments/gpt/train.py")


def _log(mode: str, seed: int, final: float) -> dict:
    return {
        "experiment": "gpt",
        "mode": mode,
        "config": {"seed": seed, "n_layer": 4, "n_embd": 128, "batch_size": 16},
        "val_steps": [0, 200, 400],
        "val_loss": [4.2, 2.6, final],
        "final_val_loss": final,
    }


def _write(folder, logs):
    folder.mkdir()
    for log in logs:
        (folder / f"{log['mode']}.json").write_text(json.dumps(log))


def test_tables_compute_gaps_and_targets(tmp_path):
    finals = {  # seed -> mode -> final validation loss
        0: {"fp32": 2.0, "nvfp4": 2.02, "mxfp4": 2.07, "fp4-tensor": 2.5, "nvfp4-nearest": 2.03},
        1: {"fp32": 2.0, "nvfp4": 2.04, "mxfp4": 2.05, "fp4-tensor": 2.6},
    }
    for seed, modes in finals.items():
        _write(tmp_path / f"s{seed}", [_log(m, seed, v) for m, v in modes.items()])
    runs = plot_fp4.load_seeds([tmp_path / "s0", tmp_path / "s1"])
    assert sorted(runs) == [0, 1] and runs[1]["mxfp4"]["final_val_loss"] == 2.05
    gaps = plot_fp4.relative_gaps(runs)
    assert gaps["nvfp4"] == pytest.approx({0: 0.01, 1: 0.02})
    table = plot_fp4.results_table(runs)
    assert "| `nvfp4` | 2.020 (+1.00%) | 2.040 (+2.00%) | +1.50% |" in table
    assert "<= 1.5% each seed: missed" in table  # seed 1 is 2% behind
    assert "<= 3.0% each seed: missed" in table  # mxfp4 seed 0: 3.5%
    assert ">= 5x nvfp4's gap: 18.3x, met" in table  # mean gaps 27.5% and 1.5%
    assert "no-hadamard" not in table  # modes without logs are left out
    ablation = plot_fp4.ablation_table(runs)
    assert "| `nvfp4-nearest` vs `nvfp4` | +0.010 | - | +0.010 |" in ablation
    plot_fp4.plot_fp4(runs, tmp_path / "fp4.png")
    assert (tmp_path / "fp4.png").stat().st_size > 0


@pytest.mark.slow
def test_output_gradients_are_the_linear_outputs_gradients():
    """Summed over the tokens, each captured output gradient is its bias's gradient."""
    config = train_gpt.TrainConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=2)
    model = config.model(40)
    params = train_gpt._init_params(jax.random.PRNGKey(0), model)
    x = jax.random.randint(jax.random.key(1), (2, 16), 0, 40)
    y = jnp.roll(x, -1, axis=1)
    grads = ranges_fp4.output_gradients(params, x, y, model)
    assert sorted(grads) == sorted(f"block 0 {n[:-2]}" for n in ranges_fp4.LINEAR_BIASES)
    with jax.numpy_rank_promotion("allow"):
        reference = jax.grad(ranges_fp4.gpt.loss_fn)(params, x, y, model)["blocks"][0]
    for name in ranges_fp4.LINEAR_BIASES:
        g = grads[f"block 0 {name[:-2]}"]
        assert g.shape == (32, reference[name].shape[0])
        np.testing.assert_allclose(g.sum(axis=0), reference[name], rtol=1e-5, atol=1e-7)
    errors = ranges_fp4.scaling_errors({"g": grads["block 0 fc"]})
    assert errors["E2M1, no scale"]["g"][1] > 0.9  # unscaled E2M1 flushes small gradients
    assert errors["NVFP4 along features"]["g"][0] < errors["E2M1, one scale per tensor"]["g"][0]


def test_plot_modes_are_the_training_modes():
    """The plot script lists the modes without importing the training script (no JAX):
    its list must stay the training script's."""
    assert plot_fp4.FP4_MODES == ("fp32", *train_gpt.FP4_RECIPES)
    assert set(plot_fp4.ABLATIONS) <= set(train_gpt.FP4_RECIPES)
    assert {full for full, _ in plot_fp4.ABLATIONS.values()} <= set(train_gpt.FP4_RECIPES)
