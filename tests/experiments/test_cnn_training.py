"""MNIST CNN smoke test: `experiments/mnist/train_cnn.py` runs a few steps in its modes.

On the committed fixture `tests/data/mnist-t10k-first-2000` (the first 2,000 images of the
genuine MNIST test split; the first 1,500 train, the last 500 evaluate): finite losses, the
JSON log (with its accuracy curve) written, the same initialisation and batches in every
mode. Nothing outside the repository is read. The accuracy claims are measured by the
experiment (docs/experiments.md), not here: a few steps say nothing about accuracy.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from experiments import data
from tests.helpers import load_script

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE = REPO_ROOT / "tests" / "data" / "mnist-t10k-first-2000"
N_TRAIN = 1500
STEPS = 3
# The new paths of the CNN: float32, the FP8 simulation, and the autoscaled step with FP8 casts
# (scaled-fp16 is the same step without them; plain, mixed and BF16 modes share the MLP's code,
# tested with the MLP). An autoscaled step compiles for most of the test's time.
MODES = ("fp32", "fp8-plain", "scaled-fp8")

train_cnn = load_script("mnist_train_cnn", "experiments/mnist/train_cnn.py")


@pytest.fixture(scope="module")
def mnist():
    return train_cnn.common.as_features(*data.read_mnist(FIXTURE, "test"))


@pytest.fixture(scope="module")
def runs(mnist, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("mnist_logs")
    results = {}
    for mode in MODES:
        r = train_cnn.train(mode, steps=STEPS, data=mnist, n_train=N_TRAIN, eval_every=2)
        train_cnn.common.write_log(r, out_dir, "cnn", {"steps": STEPS})
        results[mode] = r
    return results, out_dir


def test_cnn_shapes():
    params = jax.eval_shape(train_cnn.init_cnn, jax.random.PRNGKey(0))
    x = jax.ShapeDtypeStruct((5, 784), np.float32)
    assert jax.eval_shape(train_cnn.cnn, params, x).shape == (5, 10)
    n_params = sum(np.prod(p.shape) for p in jax.tree_util.tree_leaves(params))
    assert n_params == 3 * 3 * 16 + 16 + 3 * 3 * 16 * 32 + 32 + 7 * 7 * 32 * 10 + 10 == 20_490


@pytest.mark.slow
def test_every_mode_trains_with_finite_losses(runs):
    results, _ = runs
    for mode, r in results.items():
        assert r.losses.shape == (STEPS,) and np.all(np.isfinite(r.losses)), (mode, r.losses)
        assert np.isfinite(r.test_loss) and 0.0 <= r.accuracy <= 1.0
        assert [step for step, _ in r.curve] == [0, 2, 3]
        assert r.curve[-1][1] == r.accuracy


@pytest.mark.slow
def test_same_initialisation_and_batches(runs):
    """Same parameters at step 0 (same accuracy before training) and the same first batch
    (first losses equal to the precision of each mode)."""
    results, _ = runs
    fp32 = results["fp32"]
    for mode, r in results.items():
        assert r.curve[0][1] == pytest.approx(fp32.curve[0][1], abs=0.002), mode
        assert abs(r.losses[0] - fp32.losses[0]) < 0.05, (mode, r.losses[0], fp32.losses[0])


@pytest.mark.slow
def test_json_logs_are_written(runs):
    results, out_dir = runs
    for mode, r in results.items():
        log = json.loads((out_dir / f"cnn_{mode}.json").read_text())
        assert log["experiment"] == "mnist-cnn" and log["mode"] == mode
        assert log["steps"] == STEPS and log["accuracy"] == r.accuracy
        assert log["curve_steps"] == [0, 2, 3] and len(log["curve_accuracy"]) == 3
        assert log["train_loss"] == [float(v) for v in r.losses]


def test_main_reads_data_dir_and_checks_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (tmp_path / name).write_bytes((FIXTURE / name).read_bytes())
    with pytest.raises(data.ChecksumError, match="not the genuine"):
        train_cnn.main(["--data-dir", str(tmp_path), "--mode", "fp32", "--steps", "1"])
