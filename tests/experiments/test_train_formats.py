"""Smoke test of `experiments/mnist/train_formats.py` on the committed MNIST fixture.

A few Adam steps of a small MLP per format configuration: losses finite and falling,
weights (and activations) really rounded to the format in the forward pass; `main` writes
its JSON log. Nothing outside the repository is read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import data
from jax_scaled_arithmetics.quantization import NF4, posit_values
from tests.helpers import load_script

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE = REPO_ROOT / "tests" / "data" / "mnist-t10k-first-2000"
SMALL = {"steps": 8, "batch_size": 64, "hidden": (32,), "n_train": 1500}

train_formats = load_script("mnist_train_formats", "experiments/mnist/train_formats.py")


@pytest.fixture(scope="module")
def mnist():
    train_mlp = sys.modules["experiments.mnist.train_mlp"]
    return train_mlp.as_features(*data.read_mnist(FIXTURE, "test"))


def test_configurations():
    names = [c.name for c in train_formats.configs()]
    assert names[0] == "fp32" and len(names) == 11
    assert "posit8_es0-scaled" in names and "nf4-unscaled" in names


@pytest.mark.parametrize("name", ["posit8_es0-scaled", "float8_e5m2-unscaled"])
def test_a_few_steps_train(name, mnist):
    config = next(c for c in train_formats.configs() if c.name == name)
    r = train_formats.train(config, data=mnist, **SMALL)
    assert r.config == name and np.all(np.isfinite(r.losses))
    assert r.losses[-3:].mean() < r.losses[:3].mean()
    assert 0.3 < r.accuracy <= 1.0  # 8 steps: well above chance


def test_forward_rounds_weights_and_activations():
    w = jnp.asarray(np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32) * 1e-3)
    q = train_formats.quantizer(train_formats.Config("posit8_es0", scaled=False))
    assert np.isin(np.asarray(q(w)), posit_values(8, 0)).all()
    assert (np.abs(np.asarray(q(w))) == 2.0**-6).all()  # all below minpos: unscaled is crude
    qs = train_formats.quantizer(train_formats.Config("posit8_es0", scaled=True))
    error = np.sqrt(np.mean((np.asarray(qs(w)) - np.asarray(w)) ** 2) / np.mean(np.asarray(w) ** 2))
    assert error < 0.03
    qn = train_formats.quantizer(train_formats.Config("nf4", scaled=True))
    out = np.asarray(qn(w))
    ratios = out / (np.abs(out).max() or 1)
    assert len(np.unique(out)) <= 16 and np.isin(np.round(ratios, 6), np.round(NF4, 6)).any()
    grads = jax.grad(lambda v: jnp.sum(qs(v) * 2.0))(w)  # straight-through
    np.testing.assert_array_equal(np.asarray(grads), np.full(w.shape, 2.0))


def test_main_writes_results(tmp_path, monkeypatch, mnist):
    monkeypatch.setattr(train_formats, "load_mnist", lambda data_dir=None: mnist)
    out = tmp_path / "results.json"
    argv = ["--formats", "nf4", "--steps", "6", "--hidden", "16", "--n-train", "1500"]
    argv += ["--out", str(out)]
    results = train_formats.main(argv)
    assert [r.config for r in results] == ["fp32", "nf4-unscaled", "nf4-scaled"]
    log = json.loads(out.read_text())
    assert log["config"]["steps"] == 6 and log["config"]["n_test"] == 500
    assert len(log["results"]) == 3
    assert all(0 <= r["accuracy"] <= 1 and 0 <= r["ptq_accuracy"] <= 1 for r in log["results"])
    assert log["results"][0]["ptq_accuracy"] == log["results"][0]["accuracy"]  # fp32
