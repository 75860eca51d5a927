"""Modules renamed by role still import under their old names, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import sys

import pytest

import jax_scaled_arithmetics as jsa
from jax_scaled_arithmetics._renamed import RENAMED_MODULES


@pytest.fixture
def forget_old_names(monkeypatch):
    """Each test imports the old names afresh (the first import of each one warns)."""
    for old in RENAMED_MODULES:
        monkeypatch.delitem(sys.modules, old, raising=False)
        parent, _, name = old.rpartition(".")
        monkeypatch.delitem(vars(sys.modules[parent]), name, raising=False)


@pytest.mark.parametrize("old", sorted(RENAMED_MODULES))
def test_an_old_module_name_imports_the_renamed_module_and_warns(old, forget_old_names):
    new = RENAMED_MODULES[old]
    with pytest.warns(DeprecationWarning, match=rf"`{old}` is renamed `{new}`") as record:
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    # The module keeps its own identity: a second name, not a second copy.
    assert module.__name__ == new and module.__spec__.name == new
    assert all(w.filename == __file__ for w in record)  # points at the importing code


def test_old_names_work_in_each_import_form(forget_old_names):
    with pytest.warns(DeprecationWarning, match="lax.blocks` is renamed") as record:
        from jax_scaled_arithmetics.lax import blocks
    assert blocks is jsa.lax.block_rules
    assert record[0].filename == __file__
    with pytest.warns(DeprecationWarning, match="ops.rescaling` is renamed"):
        rescale = jsa.ops.rescaling.dynamic_rescale_max
    assert rescale is jsa.ops.dynamic_rescale_max
    with pytest.warns(DeprecationWarning, match="core.blocks` is renamed"):
        import jax_scaled_arithmetics.core.blocks as core_blocks
    assert core_blocks.to_per_tensor is jsa.core.block_scales.to_per_tensor


def test_an_unknown_attribute_of_a_package_is_still_an_error():
    with pytest.raises(AttributeError, match="lax' has no attribute 'nope'"):
        jsa.lax.nope  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("jax_scaled_arithmetics.lax.nope")
