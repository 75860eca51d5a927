"""The Python blocks of docs/training.md run, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(text: str) -> list[str]:
    return BLOCK.findall(text)


def test_doc_has_the_three_ways():
    text = DOC.read_text()
    for title in ("## (a)", "## (b)", "## (c)"):
        assert title in text
    assert len(python_blocks(text)) >= 4


@pytest.mark.slow
def test_training_doc_blocks_run(capsys):
    namespace: dict = {"__name__": "training_doc"}
    for i, block in enumerate(python_blocks(DOC.read_text())):
        exec(compile(block, f"{DOC.name}[python block {i}]", "exec"), namespace)
    out = capsys.readouterr().out
    for way in ("(a) jsa.mp", "(b) scaled FP16", "(c) FP8 casts"):
        assert way in out
