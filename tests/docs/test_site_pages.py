"""The site's hand-written pages: the getting-started page carries the README's quickstart
unchanged, every name the migration page offers exists, and the examples of the home and
distributed-training pages run."""

import importlib
import pathlib
import re

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _section(text: str, heading: str) -> str:
    return re.search(rf"^{heading}\n.*?(?=^## |\Z)", text, re.S | re.M).group(0).rstrip()


def test_getting_started_has_the_readme_quickstart():
    readme = (ROOT / "README.md").read_text()
    page = (ROOT / "docs" / "getting_started.md").read_text()
    assert _section(page, "## Quickstart") == _section(readme, "## Quickstart"), (
        "docs/getting_started.md: copy the README's Quickstart section again"
    )


def test_every_name_on_the_migration_page_exists():
    text = (ROOT / "docs" / "migration.md").read_text()
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| `jax_scalify")]
    rows += [line.split("|") for line in text.splitlines() if line.startswith("| (none)")]
    ours = [name for row in rows for name in re.findall(r"`(jsa(?:\.\w+)+)`", row[2])]
    assert len(ours) > 40
    package = importlib.import_module("jax_scaled_arithmetics")
    for name in ours:
        obj = package
        for part in name.split(".")[1:]:
            assert hasattr(obj, part), f"migration.md names {name}, which does not exist"
            obj = getattr(obj, part)


def test_the_home_page_example_runs():
    text = (ROOT / "docs" / "index.md").read_text()
    (block,) = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    namespace: dict = {}
    exec(compile(block, "docs/index.md", "exec"), namespace)
    x, y = namespace["x"], namespace["y"]
    jsa = namespace["jsa"]
    assert isinstance(y, jsa.ScaledArray)  # as the page says: float16 data, float32 scale
    assert (str(y.data.dtype), str(y.scale.dtype)) == ("float16", "float32")
    assert float(y.scale) == 2.0 * float(x.scale)  # the power of two 2 goes into the scale


@pytest.mark.slow
def test_the_distributed_page_examples_run_on_a_mesh(capsys):
    text = (ROOT / "docs" / "distributed.md").read_text()
    sharded, fsdp = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    namespace: dict = {}
    with jax.numpy_rank_promotion("allow"):  # the page's bias adds broadcast, as users write
        exec(compile(sharded, "docs/distributed.md", "exec"), namespace)
    jsa, grads, mesh = namespace["jsa"], namespace["grads"], namespace["mesh"]
    assert mesh.size == 4  # tests/conftest.py: four CPU devices
    assert isinstance(grads["w"], jsa.ScaledArray)
    assert grads["w"].data.sharding.spec == namespace["P"]("fsdp", None)
    assert grads["w"].data.dtype == "float16"

    namespace = {}
    with jax.numpy_rank_promotion("allow"):
        exec(compile(fsdp, "docs/distributed.md", "exec"), namespace)
    params, loss_fn, x, y = (namespace[name] for name in ("params", "loss_fn", "x", "y"))
    with jax.numpy_rank_promotion("allow"):
        first = float(loss_fn(namespace["params32"], x, y))
    last = float(capsys.readouterr().out)
    assert last < 0.8 * first  # five FSDP Adam steps with FP8 gathers train
    assert float(jsa.asarray(namespace["loss"])) == last
    assert params["w"].data.dtype == "float16"
