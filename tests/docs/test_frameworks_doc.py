"""docs/frameworks.md: every snippet runs, trains, and ends with finite float16 parameters."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics as jsa

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "frameworks.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M)
NAMES = ["linen", "nnx", "equinox"]


def test_one_snippet_per_framework():
    assert len(BLOCKS) == len(NAMES)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(NAMES)), ids=NAMES)
def test_snippet_runs_and_trains(index, capsys):
    namespace: dict = {}
    exec(compile(BLOCKS[index], f"frameworks.md ({NAMES[index]})", "exec"), namespace)
    loss = float(jsa.asarray(namespace["loss"], jnp.float32))
    assert np.isfinite(loss) and 0.0 < loss < 5.0
    trained = {"linen": lambda n: n["state"].params, "nnx": lambda n: n["params"]}
    tree = trained.get(NAMES[index], lambda n: n["model"])(namespace)
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, jsa.ScaledArray))
    scaled = [leaf for leaf in leaves if isinstance(leaf, jsa.ScaledArray)]
    assert scaled and all(leaf.dtype == jnp.float16 for leaf in scaled)
    assert all(np.all(np.isfinite(jsa.asarray(leaf, jnp.float32))) for leaf in scaled)
    out = capsys.readouterr().out
    if NAMES[index] == "linen":
        assert out.strip().endswith("()")  # no promotion to float32
    if NAMES[index] == "nnx":
        assert out.strip().endswith("Param")
    if NAMES[index] == "equinox":
        assert out.strip().endswith("0.1")
