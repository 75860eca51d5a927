import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load_generator():
    spec = importlib.util.spec_from_file_location(
        "gen_operators_doc", ROOT / "scripts" / "gen_operators_doc.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_operators_doc_is_current():
    generator = _load_generator()
    committed = (ROOT / "docs" / "operators.md").read_text()
    assert committed == generator.render(), (
        "docs/operators.md is stale: run `python scripts/gen_operators_doc.py`"
    )


def test_operators_doc_lists_every_registered_rule_as_supported():
    import jax_scaled_arithmetics as jsa

    text = (ROOT / "docs" / "operators.md").read_text()
    for name in jsa.coverage():
        assert f"| `{name}` | supported |" in text
