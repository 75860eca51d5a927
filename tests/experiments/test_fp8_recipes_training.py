"""Smoke test of `experiments/mnist/train_fp8_recipes.py` on the committed MNIST fixture.

A few Adam steps of a small MLP in every mode (fp32, per-tensor, row-wise and MX FP8,
MXFP6, MXFP4): losses finite and falling, accuracies above chance, the modes' forward
passes really quantised; `main` writes its JSON log. Nothing outside the repository is
read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import data
from tests.helpers import load_script

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE = REPO_ROOT / "tests" / "data" / "mnist-t10k-first-2000"

recipes = load_script("mnist_train_fp8_recipes", "experiments/mnist/train_fp8_recipes.py")


@pytest.fixture(scope="module")
def mnist():
    train_mlp = sys.modules["experiments.mnist.train_mlp"]
    return train_mlp.as_features(*data.read_mnist(FIXTURE, "test"))


def test_modes_and_padding():
    assert list(recipes.MODES) == [
        "fp32",
        "tensorwise-fp8",
        "rowwise-fp8",
        "mxfp8",
        "mxfp6",
        "mxfp4",
    ]
    padded = recipes.pad_features(np.ones((2, 784), np.float32))
    assert padded.shape == (2, 800) and padded[:, 784:].sum() == 0
    with pytest.raises(ValueError, match="Unknown mode"):
        recipes.train("fp16")


@pytest.mark.slow
def test_main_trains_every_mode_and_writes_results(tmp_path, monkeypatch, mnist):
    monkeypatch.setattr(recipes, "load_mnist", lambda data_dir=None: mnist)
    out = tmp_path / "results.json"
    argv = ["--steps", "12", "--batch-size", "64", "--hidden", "32"]
    argv += ["--n-train", "1500", "--out", str(out)]
    results = recipes.main(argv)
    assert [r.mode for r in results] == list(recipes.MODES)
    for r in results:
        assert np.all(np.isfinite(r.losses)), r.mode
        assert r.losses[-3:].mean() < r.losses[:3].mean(), r.mode
        assert 0.2 < r.accuracy <= 1.0, r.mode  # 12 steps: above chance (0.1)
        if r.mode != "fp32":  # the recipes really quantise: other losses than float32's
            assert not np.allclose(r.losses, results[0].losses, rtol=1e-6), r.mode
    log = json.loads(out.read_text())
    assert log["config"]["steps"] == 12 and log["config"]["n_test"] == 500
    assert [r["mode"] for r in log["results"]] == list(recipes.MODES)
