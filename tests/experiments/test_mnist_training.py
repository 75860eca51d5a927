"""MNIST training: scaled FP16 Adam matches float32; plain FP16 Adam does not train.

Runs `experiments/mnist/train_mlp.py` on the genuine MNIST test split (first
8,000 images train, last 2,000 evaluate), 300 Adam steps of batch 128 on a
784-128-128-10 MLP, with the same initialisation and batch order in every mode.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "experiments" / "mnist" / "train_mlp.py"
CONFIG = {"steps": 300, "batch_size": 128, "lr": 1e-3, "seed": 0, "hidden": (128, 128)}


def _load_script():
    spec = importlib.util.spec_from_file_location("mnist_train_mlp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


train_mlp = _load_script()


@pytest.fixture(scope="module")
def mnist():
    # The MNIST files live in ../shared/data/mnist beside the clone; a missing file fails here.
    return train_mlp.load_mnist(train_mlp.DEFAULT_DATA_DIR)


@pytest.fixture(scope="module")
def results(mnist):
    return {
        mode: train_mlp.train(mode, data=mnist, **CONFIG)
        for mode in ("fp32", "scaled-fp16", "plain-fp16")
    }


def test_load_mnist(mnist):
    images, labels = mnist
    assert images.shape == (10000, 784) and images.dtype == np.float32
    assert labels.shape == (10000,) and labels.dtype == np.int32
    assert images.min() == 0.0 and images.max() == 1.0
    assert set(np.unique(labels).tolist()) == set(range(10))
    assert labels[:5].tolist() == [7, 2, 1, 0, 4]  # the well-known first test labels


def test_load_mnist_missing_directory_fails(tmp_path):
    with pytest.raises(FileNotFoundError, match="MNIST"):
        train_mlp.load_mnist(tmp_path)


def test_float32_baseline_learns(results):
    r = results["fp32"]
    assert r.accuracy > 0.93, r.accuracy
    assert np.all(np.isfinite(r.losses))
    assert r.losses[-20:].mean() < 0.3 * r.losses[:20].mean()


def test_scaled_fp16_matches_float32(results):
    """FP16 parameters and Adam state, no loss scaling: within 1 point of float32."""
    fp32, scaled = results["fp32"], results["scaled-fp16"]
    assert np.all(np.isfinite(scaled.losses))
    assert abs(scaled.accuracy - fp32.accuracy) <= 0.01, (scaled.accuracy, fp32.accuracy)
    np.testing.assert_allclose(scaled.losses[:5], fp32.losses[:5], rtol=2e-2)


def test_plain_fp16_adam_is_unstable(results):
    """Plain FP16 Adam: eps=1e-8 is 0 in float16 and most second-moment increments underflow.

    Their update is `mu / (0 + 0)`: infinite (or NaN where mu is 0 too), so the
    parameters and the loss are NaN from the second step on.
    """
    plain, fp32 = results["plain-fp16"], results["fp32"]
    assert plain.first_nan_step is not None and plain.first_nan_step <= 2
    assert plain.accuracy < fp32.accuracy - 0.5


def test_fp16_adam_diagnostics(mnist):
    images, labels = mnist
    params = train_mlp.init_mlp(train_mlp.jax.random.PRNGKey(0), [784, *CONFIG["hidden"], 10])
    diag = train_mlp.fp16_adam_diagnostics(params, images[:128], labels[:128])
    assert diag["eps_in_float16"] == 0.0
    assert diag["nu_underflow"] > 0.5, diag
