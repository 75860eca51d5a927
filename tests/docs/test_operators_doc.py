import pathlib

from tests.helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load_generator():
    return load_script("gen_operators_doc", "scripts/gen_operators_doc.py")


def test_operators_doc_is_current():
    import re

    import jax

    generator = _load_generator()
    committed = (ROOT / "docs" / "operators.md").read_text()
    generated_with = re.search(r"Generated with JAX ([0-9.]+)", committed).group(1)
    if generated_with == jax.__version__:
        assert committed == generator.render(), (
            "docs/operators.md is stale: run `python scripts/gen_operators_doc.py`"
        )
    else:
        # Another JAX release (the CI's minimum-version run): every primitive this release
        # has is listed with the same status as in the committed file.
        rows = {
            line.split("|")[1].strip(" `"): line
            for line in committed.splitlines()
            if line.startswith("| `")
        }
        for line in generator.render().splitlines():
            if line.startswith("| `"):
                name = line.split("|")[1].strip(" `")
                assert rows.get(name) == line, f"docs/operators.md differs for {name}"


def test_operators_doc_lists_every_registered_rule_as_supported():
    import jax_scaled_arithmetics as jsa

    text = (ROOT / "docs" / "operators.md").read_text()
    for name in jsa.coverage():
        assert f"| `{name}` | supported |" in text
