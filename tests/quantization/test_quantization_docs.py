from pathlib import Path

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[2]


def load_generator():
    return load_script("gen_formats_doc", "scripts/gen_formats_doc.py")


def test_committed_formats_doc_is_up_to_date():
    gen = load_generator()
    committed = (ROOT / "docs" / "formats.md").read_text(encoding="utf-8")
    assert committed == gen.content(), "run: python scripts/gen_formats_doc.py"


def test_generator_check_mode(tmp_path, capsys):
    gen = load_generator()
    out = tmp_path / "formats.md"
    assert gen.main(["--check", "--output", str(out)]) == 1  # missing
    assert gen.main(["--output", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == gen.content()
    assert gen.main(["--check", "--output", str(out)]) == 0
    out.write_text(gen.content() + "edited\n", encoding="utf-8")
    assert gen.main(["--check", "--output", str(out)]) == 1
    assert "is stale" in capsys.readouterr().out


def test_doc_lists_every_preset():
    gen = load_generator()
    from jax_scaled_arithmetics.quantization import FORMATS

    text = gen.content()
    for name in FORMATS:
        assert f"| `{name}` |" in text
    assert "| `float8_e4m3fn` | 8 | 4 | 3 | 7 | 448 | 2^-6 | 2^-9 | no | yes |" in text


def test_doc_has_posits_nf4_comparison_and_mnist():
    gen = load_generator()
    from jax_scaled_arithmetics.quantization import NF4, POSIT_FORMATS

    text = gen.content()
    for name in POSIT_FORMATS:
        assert f"| `{name}` |" in text
    assert "| `posit8_es0` | 8 | 0 | 2 | 64 | 2^-6 | 5 | 2^-5 | 255 |" in text
    assert "26 (es=0), 27 (es=1), 28 (es=2), 17 (es=3)" in text
    assert "| 8+ | 0.0795803 |" in text and len(NF4) == 16
    assert "| 1e-3, scaled |" in text and "## Posits or float8?" in text
    assert "| `nf4` | scaled |" in text and "| `fp32` | - |" in text
