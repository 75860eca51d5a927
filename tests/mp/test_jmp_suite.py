"""jmp's own test suite, run against `jsa.mp`.

The `jmp` wheel ships its tests (`jmp/_src/policy_test.py`, `loss_scale_test.py`). They
are loaded here from the installed package, unchanged, with `jmp._src.policy` and
`jmp._src.loss_scale` answered by `jsa.mp` (an alias module made for the load; jmp's
code is neither imported nor copied), and their test classes are collected by pytest.

jmp's `test_str` reads a private table of jmp's, `dtype_to_names`, for the dtype names
its `str(policy)` prints (`f16`, `bf16`, `full`). `jsa.mp` prints the dtypes' own names
(`p=float32,c=float16,o=float32`, which both libraries parse back), so the alias holds
those names: the test then checks `jsa.mp`'s format. That is the one documented
difference (docs/training.md).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled_arithmetics.mp as mp

pytest.importorskip("absl.testing.parameterized", reason="jmp's tests are written with absl")

# jmp's own arithmetic: `np.float32(10) / 3**100` (a bound in its min-loss-scale tests)
# overflows in NumPy 2's cast of the Python int; the suite's warnings-as-errors would stop it.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
_JMP = importlib.util.find_spec("jmp")
if _JMP is None or not _JMP.submodule_search_locations:
    pytest.fail("the test extra installs jmp, whose wheel ships the tests run here")
_TESTS = Path(next(iter(_JMP.submodule_search_locations))) / "_src"


def _alias() -> types.ModuleType:
    """`jsa.mp`'s public names, and the one private name jmp's tests read."""
    alias = types.ModuleType("jsa_mp_as_jmp")
    for name in mp.__all__:
        setattr(alias, name, getattr(mp, name))
    names = {np.float16: "float16", jnp.bfloat16: "bfloat16", np.float32: "float32"}
    alias.dtype_to_names = {dtype: (name,) for dtype, name in names.items()}
    alias.dtype_to_names[jnp.float32] = ("float32",)
    return alias


def _load(name: str) -> types.ModuleType:
    """Execute jmp's `name`.py with `from jmp._src import policy/loss_scale` giving the
    alias; `sys.modules` is restored afterwards."""
    saved = {key: sys.modules.get(key) for key in ("jmp", "jmp._src")}
    package, sub = types.ModuleType("jmp"), types.ModuleType("jmp._src")
    sub.policy = sub.loss_scale = _alias()  # type: ignore[attr-defined]
    package._src = sub  # type: ignore[attr-defined]
    sys.modules.update({"jmp": package, "jmp._src": sub})
    try:
        spec = importlib.util.spec_from_file_location(f"jmp_{name}", _TESTS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value
    return module


PolicyTest = _load("policy_test").PolicyTest
LossScaleTest = _load("loss_scale_test").LossScaleTest


def test_every_jmp_test_class_is_collected():
    """Both files hold exactly these test classes (a new one upstream shows up here)."""
    for name, collected in (("policy_test", PolicyTest), ("loss_scale_test", LossScaleTest)):
        module = _load(name)
        classes = [k for k, v in vars(module).items() if k.endswith("Test") and isinstance(v, type)]
        assert classes == [collected.__name__]
        assert sum(n.startswith("test") for n in dir(collected)) >= 20
