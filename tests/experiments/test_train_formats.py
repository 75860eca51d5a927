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

train_formats = load_script("mnist_train_formats", "experiments/mnist/train_formats.py")


@pytest.fixture(scope="module")
def mnist():
    train_mlp = sys.modules["experiments.mnist.train_mlp"]
    return train_mlp.as_features(*data.read_mnist(FIXTURE, "test"))


def test_configurations():
    names = [c.name for c in train_formats.configs()]
    assert names[0] == "fp32" and len(names) == 11
    assert "posit8_es0-scaled" in names and "nf4-unscaled" in names


def test_quantizers_round_to_the_format():
    w = jnp.asarray(np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32) * 1e-3)
    q = jax.jit(train_formats.quantizer(train_formats.Config("posit8_es0", scaled=False)))
    assert np.isin(np.asarray(q(w)), posit_values(8, 0)).all()
    assert (np.abs(np.asarray(q(w))) == 2.0**-6).all()  # all below minpos: unscaled is crude
    qs = jax.jit(train_formats.quantizer(train_formats.Config("posit8_es0", scaled=True)))
    error = np.sqrt(np.mean((np.asarray(qs(w)) - np.asarray(w)) ** 2) / np.mean(np.asarray(w) ** 2))
    assert error < 0.03
    qn = jax.jit(train_formats.quantizer(train_formats.Config("nf4", scaled=True)))
    out = np.asarray(qn(w))
    ratios = out / (np.abs(out).max() or 1)
    assert len(np.unique(out)) <= 16 and np.isin(np.round(ratios, 6), np.round(NF4, 6)).any()
    grads = jax.jit(jax.grad(lambda v: jnp.sum(qs(v) * 2.0)))(w)  # straight-through
    np.testing.assert_array_equal(np.asarray(grads), np.full(w.shape, 2.0))


@pytest.mark.slow
def test_main_trains_and_writes_results(tmp_path, monkeypatch, mnist):
    """A few steps of fp32 and posit8_es0, unscaled and scaled (the NF4 quantisers are
    tested above): losses finite and falling, accuracies above chance, the JSON log."""
    monkeypatch.setattr(train_formats, "load_mnist", lambda data_dir=None: mnist)
    out = tmp_path / "results.json"
    argv = ["--formats", "posit8_es0", "--steps", "20", "--batch-size", "64"]
    argv += ["--hidden", "16", "--n-train", "1500", "--out", str(out)]
    results = train_formats.main(argv)
    names = ["fp32", "posit8_es0-unscaled", "posit8_es0-scaled"]
    assert [r.config for r in results] == names
    for r in results:
        assert np.all(np.isfinite(r.losses)), r.config
        assert r.losses[-3:].mean() < r.losses[:3].mean(), r.config
        assert 0.2 < r.accuracy <= 1.0, r.config  # 20 steps: above chance (0.1)
    log = json.loads(out.read_text())
    assert log["config"]["steps"] == 20 and log["config"]["n_test"] == 500
    assert [r["config"] for r in log["results"]] == names
    assert all(0 <= r["ptq_accuracy"] <= 1 for r in log["results"])
    assert log["results"][0]["ptq_accuracy"] == log["results"][0]["accuracy"]  # fp32
