"""Moved and renamed public names keep working for one minor release, with a
`DeprecationWarning` that names the new name (CONTRIBUTING.md, "Deprecations")."""

from __future__ import annotations

import pytest

import jax_scaled_arithmetics as jsa
import jax_scaled_arithmetics.unit_scaling as U


@pytest.mark.parametrize("name", ["simulate_fp8", "simulate_fp4"])
def test_simulate_transforms_moved_to_ops(name):
    with pytest.warns(DeprecationWarning, match=rf"jsa.unit_scaling.{name} .* use jsa.ops.{name}"):
        old = getattr(U, name)
    assert old is getattr(jsa.ops, name)
    assert name not in U.__all__ and name in jsa.ops.__all__


def test_a_missing_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'simulate_fp16'"):
        U.simulate_fp16  # noqa: B018
