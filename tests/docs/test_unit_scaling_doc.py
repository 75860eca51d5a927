"""docs/unit_scaling.md: the op reference is current and the examples run and say what they show."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import load_script

DOC = Path(__file__).resolve().parents[2] / "docs" / "unit_scaling.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def test_op_reference_is_current():
    generator = load_script("gen_unit_scaling_doc", "scripts/gen_unit_scaling_doc.py")
    text = DOC.read_text()
    assert text == generator.render(text), (
        "docs/unit_scaling.md is stale: run `python scripts/gen_unit_scaling_doc.py`"
    )
    import jax_scaled_arithmetics.unit_scaling as U

    for name in U.__all__:
        if name != "Constraint":
            assert f"### `U.{name}`" in text, name


@pytest.fixture(scope="module")
def printed():
    import contextlib
    import io

    namespace: dict = {"__name__": "unit_scaling_doc"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i, block in enumerate(BLOCK.findall(DOC.read_text())):
            exec(compile(block, f"{DOC.name}[python block {i}]", "exec"), namespace)
    lines = dict(line.split(":", 1) for line in out.getvalue().splitlines())
    return {key: value.strip() for key, value in lines.items()}


@pytest.mark.slow
def test_examples_run_and_show_unit_scale(printed):
    assert 8.0 < float(printed["plain std"]) < 11.0
    assert 0.9 < float(printed["unit-scaled std"]) < 1.1
    assert 1.0 < float(printed["logits std"]) < 2.0
    kernel_stds = [float(v) for v in re.findall(r"[0-9.]+", printed["kernel gradient std"])[1::2]]
    assert kernel_stds and all(0.8 < v < 2.5 for v in kernel_stds)
    assert 0.8 < float(printed["block output std"]) < 1.25
    assert 0.7 < float(printed["stream gradient std"]) < 1.3
    fp8 = re.findall(r"[0-9.]+", printed["FP8 unit-scaled loss"])
    assert len(fp8) == 2 and 1.0 < float(fp8[1]) < 10.0


@pytest.mark.slow
def test_optim_example(printed):
    """The u-muP optimizer section: the multipliers of the rules, a loss that falls, and the
    same optimizer with a float16 scaled state."""
    kernels = printed["u-muP kernel multipliers"]
    assert kernels == "{'Dense_0': 0.0357, 'Dense_1': 0.0625, 'Dense_2': 1.0}"
    read = "{'Dense_0': 'weight', 'Dense_1': 'weight', 'Dense_2': 'output'}"
    assert printed["read from the program"] == read
    first, last = (float(v) for v in printed["u-muP AdamW loss, first and last step"].split())
    assert last < 0.5 * first
    assert printed["u-muP AdamW scaled step, first moment"] == "ScaledArray float16"
