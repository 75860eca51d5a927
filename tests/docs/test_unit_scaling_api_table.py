"""docs/unit_scaling.md's table of the reference's functional API against ours: every op it
lists as ours exists in `jsa.unit_scaling` and takes the arguments the table names (the
reference's side was read from its 0.3.5 sources when the table was written)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import jax_scaled_arithmetics.unit_scaling as U

DOC = Path(__file__).resolve().parents[2] / "docs" / "unit_scaling.md"


def _rows() -> list[tuple[str, list[str]]]:
    text = DOC.read_text()
    table = text.split("## The ops and the reference's functional API", 1)[1].split("\n\n")[2]
    rows = []
    for line in table.splitlines()[2:]:
        reference, ours = line.split("|")[1:3]
        if "the same" in ours:  # the reference's names, kept
            rows += [(name, []) for name in re.findall(r"`(\w+)`", reference)]
        for name, args in re.findall(r"`U\.(\w+)(?:\(([^)]*)\))?`", ours):
            names = [
                a.strip().split("=")[0]
                for a in args.split(",")
                if a.strip() not in ("", "*", "...")
            ]
            rows.append((name, names))
    return rows


ROWS = _rows()


def test_the_table_lists_every_op():
    listed = {name for name, _ in ROWS}
    assert len(listed) >= 20
    assert {"linear", "gelu", "softmax", "cross_entropy", "scaled_dot_product_attention"} <= listed


@pytest.mark.parametrize("name, arguments", ROWS, ids=[r[0] for r in ROWS])
def test_each_listed_op_takes_the_listed_arguments(name, arguments):
    parameters = inspect.signature(getattr(U, name)).parameters
    missing = [a for a in arguments if a not in parameters]
    assert not missing, f"U.{name} has no parameter {missing}"
