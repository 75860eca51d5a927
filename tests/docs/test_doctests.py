"""Every docstring example of the package runs: `doctest.testmod` on each of its modules
(the examples of functions, classes and module docstrings; the examples under constants and
type aliases, which `testmod` does not see, run in tests/docs/test_api_doc.py)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import jax_scaled_arithmetics
from jax_scaled_arithmetics.core import registry


def _modules() -> list[str]:
    names = [jax_scaled_arithmetics.__name__]
    for info in pkgutil.walk_packages(
        jax_scaled_arithmetics.__path__, jax_scaled_arithmetics.__name__ + "."
    ):
        names.append(info.name)
    return sorted(names)


@pytest.fixture
def _rules_restored():
    """An example that registers a rule (`register_scaled_op`'s) leaves the registry as it
    was: other tests of the worker list the rules."""
    rules = dict(registry._RULES)
    yield
    registry._RULES.clear()
    registry._RULES.update(rules)


# Modules whose examples compile whole training steps or sharded programs (3-9 s each, cold,
# on a 2-core machine): their examples run in the slow step.
_HEAVY = {
    "jax_scaled_arithmetics.sharding",
    "jax_scaled_arithmetics.unit_scaling._linear",
    "jax_scaled_arithmetics.unit_scaling._attention",
    "jax_scaled_arithmetics.unit_scaling._optim",
    "jax_scaled_arithmetics.quantization.mx_quantize",
    "jax_scaled_arithmetics.quantization.nvfp4",
    "jax_scaled_arithmetics.optax.quantized",
}


@pytest.mark.parametrize(
    "module_name",
    [pytest.param(name, marks=pytest.mark.slow) if name in _HEAVY else name for name in _modules()],
)
def test_docstring_examples_run(module_name, _rules_restored):
    module = importlib.import_module(module_name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"
