"""GPT training smoke test: every mode of `experiments/gpt/train.py` runs a few steps.

On the committed fixture `tests/data/tinyshakespeare-first-4096.txt` (the first 4,096 bytes
of the genuine corpus), with a tiny model (1 layer, width 32, context 16, batch 4): finite
losses in every mode, the JSON log written, and the same initialisation and batches in every
mode. Nothing outside the repository is read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from experiments import data
from tests.helpers import load_script

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE = REPO_ROOT / "tests" / "data" / "tinyshakespeare-first-4096.txt"
FIXTURE_SHA256 = "bb0fdae1503c07558f53e2e294236b118ffaccdb6d3c44a6c02fde136c525225"

train_gpt = load_script("gpt_train", "experiments/gpt/train.py")

CONFIG = train_gpt.TrainConfig(
    n_layer=1,
    n_head=2,
    n_embd=32,
    block_size=16,
    batch_size=4,
    steps=3,
    eval_every=2,
    eval_batches=2,
)
# Compilation takes most of the test's time: the final loss with the mode's own numerics (one
# more compilation in every mode but fp32, whose own numerics are the float32 evaluation's) is
# checked in fp32 only, and left to the experiment in the other modes.
OWN_NUMERICS = ("fp32",)


@pytest.fixture(autouse=True)
def _implicit_broadcasting():
    """The model broadcasts biases implicitly, as model code does (the suite raises on it)."""
    with jax.numpy_rank_promotion("allow"):
        yield


@pytest.fixture(scope="module")
def text() -> str:
    raw = FIXTURE.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == FIXTURE_SHA256
    return raw.decode("ascii")


@pytest.fixture(scope="module")
def runs(text, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("gpt_logs")
    with jax.numpy_rank_promotion("allow"):
        logs = {}
        for mode in train_gpt.MODES:
            config = dataclasses.replace(CONFIG, own_numerics=mode in OWN_NUMERICS)
            logs[mode] = train_gpt.train(mode, text, config, out_dir=out_dir, progress=False)
    return logs, out_dir


def test_fixture_is_the_start_of_the_corpus(text):
    assert text.startswith("First Citizen:\nBefore we proceed any further, hear me speak.")
    corpus = train_gpt.CharData.from_text(text)
    assert len(corpus.train) == round(0.9 * len(text)) and len(corpus.val) == len(text) - len(
        corpus.train
    )
    assert corpus.vocab == "".join(sorted(set(text)))


@pytest.mark.slow
def test_every_mode_trains_with_finite_losses(runs):
    logs, _ = runs
    assert set(logs) == set(train_gpt.MODES)
    for mode, log in logs.items():
        assert len(log["train_loss"]) == CONFIG.steps
        assert all(math.isfinite(v) for v in log["train_loss"]), (mode, log["train_loss"])
        assert log["val_steps"] == [0, 2, 3]
        assert all(math.isfinite(v) for v in log["val_loss"]), (mode, log["val_loss"])
        if mode in OWN_NUMERICS:
            assert math.isfinite(log["final_val_loss_own_numerics"]), mode
        else:
            assert log["final_val_loss_own_numerics"] is None


@pytest.mark.slow
def test_json_logs_are_written(runs):
    logs, out_dir = runs
    assert sorted(p.name for p in out_dir.glob("*.json")) == sorted(
        f"{mode}.json" for mode in train_gpt.MODES
    )
    for mode, log in logs.items():
        written = json.loads((out_dir / f"{mode}.json").read_text())
        assert written["mode"] == mode and written["experiment"] == "gpt"
        assert written["config"]["n_embd"] == CONFIG.n_embd and written["steps"] == CONFIG.steps
        assert written["lr"] == train_gpt.DEFAULT_MODE_LR.get(mode, CONFIG.lr)
        assert written["final_val_loss"] == log["val_loss"][-1]
        for key in ("train_loss", "val_loss", "tokens_per_s", "wall_s", "init_digest"):
            assert key in written, key


@pytest.mark.slow
def test_same_initialisation_and_batches_in_every_mode(runs):
    logs, _ = runs
    assert len({log["init_digest"] for log in logs.values()}) == 1
    assert len({log["batches_digest"] for log in logs.values()}) == 1
    # The same float32 model on the same first batch: the first losses agree to the
    # precision of each mode (unit-scaled-fp8 is another model: its own loss function).
    first = {mode: log["train_loss"][0] for mode, log in logs.items()}
    scaled = ("scaled-fp16", "scaled-fp8", "scaled-fp8-rowwise", "scaled-mxfp8")
    for mode in ("bf16", "fp8-plain", *scaled):
        assert abs(first[mode] - first["fp32"]) < 0.05, (mode, first)
    initial_val = {mode: log["val_loss"][0] for mode, log in logs.items()}
    for mode in ("bf16", "fp8-plain"):
        assert initial_val[mode] == initial_val["fp32"]
    for mode in scaled:  # float16 values of the same parameters
        assert abs(initial_val[mode] - initial_val["fp32"]) < 1e-3


@pytest.mark.slow
def test_block_scaled_fp8_modes_differ_from_per_tensor(runs):
    """Row-wise and MX block scales change the FP8 rounding: after a few steps the losses
    differ from per-tensor scaled-fp8's (and stay within its precision)."""
    logs, _ = runs
    reference = np.asarray(logs["scaled-fp8"]["val_loss"])
    for mode in ("scaled-fp8-rowwise", "scaled-mxfp8"):
        assert train_gpt.SCALE_LAYOUTS[mode] != "tensor"
        val = np.asarray(logs[mode]["val_loss"])
        assert not np.array_equal(val, reference), mode
        np.testing.assert_allclose(val, reference, atol=0.05)


@pytest.mark.slow
def test_fp4_modes_start_from_fp32_and_differ_by_ingredient(runs):
    """The 4-bit modes: float32 evaluation of the same initial parameters; the first training
    loss within 4-bit precision of fp32's; each ablation changes the trajectory."""
    logs, _ = runs
    for mode in train_gpt.FP4_RECIPES:
        assert logs[mode]["val_loss"][0] == logs["fp32"]["val_loss"][0], mode
        assert abs(logs[mode]["train_loss"][0] - logs["fp32"]["train_loss"][0]) < 0.1, mode
    trajectories = {mode: tuple(logs[mode]["train_loss"][1:]) for mode in train_gpt.FP4_RECIPES}
    assert len(set(trajectories.values())) == len(trajectories), trajectories


@pytest.mark.slow
def test_fp4_mode_draws_new_bits_each_step(text):
    """The 4-bit step's key comes from the step count carried in its state: the same
    parameters and batch give another gradient at the next step."""
    corpus = train_gpt.CharData.from_text(text)
    model = CONFIG.model(len(corpus.vocab))
    params = train_gpt._init_params(jax.random.PRNGKey(0), model)
    with jax.numpy_rank_promotion("allow"):
        run = train_gpt.setup_mode("nvfp4-1d-weights", params, model, 1e-3)
        x, y = train_gpt.windows(corpus.train, np.arange(4)[:, None] * 50, CONFIG.block_size)
        opt_state, count = run.state
        x, y = x[:, 0], y[:, 0]
        a, state, loss_a = run.step(run.params, (opt_state, count), x, y)
        again, _, _ = run.step(run.params, (opt_state, count), x, y)
        b, _, loss_b = run.step(run.params, (opt_state, count + 1), x, y)
    assert int(state[1]) == 1 and float(loss_a) == float(loss_b)  # forward: no random bits
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    for u, v in zip(leaves_a, jax.tree_util.tree_leaves(again), strict=True):
        np.testing.assert_array_equal(u, v)
    assert any(not np.array_equal(u, v) for u, v in zip(leaves_a, leaves_b, strict=True))


def test_batches_are_fixed_by_the_seed(text):
    corpus = train_gpt.CharData.from_text(text)
    a = train_gpt.train_offsets(len(corpus.train), CONFIG)
    b = train_gpt.train_offsets(len(corpus.train), CONFIG)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (CONFIG.steps, CONFIG.batch_size)
    assert a.max() + CONFIG.block_size < len(corpus.train)
    val = train_gpt.eval_offsets(len(corpus.val), CONFIG)
    assert val.shape == (CONFIG.eval_batches, CONFIG.batch_size)
    assert val.max() + CONFIG.block_size < len(corpus.val)


def test_unknown_mode_fails(text):
    with pytest.raises(ValueError, match="Unknown mode 'fp5'; choose from fp32, bf16"):
        train_gpt.train("fp5", text, CONFIG, progress=False)


def test_main_reads_data_dir_and_checks_it(tmp_path, monkeypatch):
    """`--data-dir` with a text that is not the genuine corpus: a checksum error, no training
    and no download."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "input.txt").write_bytes(FIXTURE.read_bytes())
    expected = data.TINYSHAKESPEARE.sha256
    with pytest.raises(data.ChecksumError, match=f"not the genuine .*expected SHA-256 {expected}"):
        train_gpt.main(["--data-dir", str(tmp_path), "--mode", "fp32", "--steps", "1"])


@pytest.mark.slow
def test_delayed_modes_start_with_the_dynamic_step_and_stay_close(runs):
    """The delayed modes' first step is the dynamic step that makes the history (the same
    loss to the bit); the later steps, at held scales, stay within the mode's precision."""
    logs, _ = runs
    for mode in train_gpt.DELAYED_MODES:
        dynamic = logs[mode.removesuffix("-delayed")]
        assert logs[mode]["train_loss"][0] == dynamic["train_loss"][0], mode
        np.testing.assert_allclose(
            logs[mode]["train_loss"], dynamic["train_loss"], atol=0.05, err_msg=mode
        )


@pytest.mark.slow
def test_scanned_layers_train_as_the_unrolled_model_delayed_too(text):
    """`--scan-layers`: the blocks stacked and run as a `lax.scan`. float32 trains as the
    unrolled model does; the delayed FP16 mode's first step is the scanned dynamic step's,
    and the later ones stay within its precision."""
    config = dataclasses.replace(CONFIG, n_layer=2, own_numerics=False)
    scanned = dataclasses.replace(config, scan_layers=True)
    logs = {}
    with jax.numpy_rank_promotion("allow"):
        for mode in ("fp32", "scaled-fp16", "scaled-fp16-delayed"):
            logs[mode] = train_gpt.train(mode, text, scanned, progress=False)
        unrolled = train_gpt.train("fp32", text, config, progress=False)
    np.testing.assert_allclose(logs["fp32"]["train_loss"], unrolled["train_loss"], rtol=1e-5)
    delayed, dynamic = logs["scaled-fp16-delayed"], logs["scaled-fp16"]
    assert delayed["train_loss"][0] == dynamic["train_loss"][0]
    np.testing.assert_allclose(delayed["train_loss"], dynamic["train_loss"], atol=0.05)
    assert delayed["config"]["scan_layers"] is True
