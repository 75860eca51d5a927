"""Generate the op reference of docs/unit_scaling.md from the public names of jsa.unit_scaling.

Each entry is the op's signature and the first paragraphs of its docstring (what it
computes and its forward and backward factors), up to its `Args:` section.

Usage:
    python scripts/gen_unit_scaling_doc.py          # rewrite the generated part of the doc
    python scripts/gen_unit_scaling_doc.py --check  # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import jax_scaled_arithmetics.unit_scaling as U

DOC = Path(__file__).resolve().parents[1] / "docs" / "unit_scaling.md"
BEGIN, END = "<!-- BEGIN GENERATED OPS -->", "<!-- END GENERATED OPS -->"
SECTIONS = ("Args:", "Returns:", "Raises:", "Examples:")


def _description(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    kept = []
    for paragraph in doc.split("\n\n"):
        if paragraph.lstrip().startswith(SECTIONS):
            break
        items: list[list[str]] = []  # a bullet list keeps one line per item
        for line in paragraph.splitlines():
            if not items or line.lstrip().startswith("- "):
                items.append([])
            items[-1].append(line.strip())
        kept.append("\n".join(" ".join(item) for item in items))
    return "\n\n".join(kept)


def render_ops() -> str:
    """The generated block: one entry per public callable of `jsa.unit_scaling`."""
    entries = []
    for name in sorted(U.__all__, key=str.lower):
        obj = getattr(U, name)
        if not callable(obj) or not inspect.isfunction(obj):
            continue
        signature = str(inspect.signature(obj)).replace("'", '"')
        entries.append(f"### `U.{name}`\n\n`{name}{signature}`\n\n{_description(obj)}\n")
    return "\n".join(entries)


def render(text: str) -> str:
    """`text` (the doc) with its generated block replaced."""
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + render_ops() + text[stop:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the doc is stale")
    args = parser.parse_args()
    current = DOC.read_text()
    wanted = render(current)
    if args.check:
        if wanted != current:
            print(f"{DOC} is stale: run python scripts/gen_unit_scaling_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
