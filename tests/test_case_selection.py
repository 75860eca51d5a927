"""The default run's selection of parametrized cases (tests/conftest.py): every value of
every parameter at least once (or, for `one_case` tests, the first case), the other cases
marked `slow`."""

import itertools

from tests.conftest import _beyond_each_choice, _left_for_the_slow_step, _value_key


def _cases(**axes):
    names = list(axes)
    return [
        (values, {(name, _value_key(v)) for name, v in zip(names, values)})
        for values in itertools.product(*axes.values())
    ]


def test_each_value_once_and_fewest_cases_on_a_product():
    cases = _cases(dtype=["float32", "float16", "bfloat16"], jit=[False, True], scale=[1, 2**-20])
    left = _beyond_each_choice(cases)
    kept = [values for values, _ in cases if values not in left]
    assert len(kept) == 3  # the largest axis: every dtype, with both jit modes and scales
    for axis in range(3):
        assert {values[axis] for values in kept} == {values[axis] for values, _ in cases}


def test_unhashable_values_and_single_axes_keep_every_case():
    cases = _cases(shape=[[2, 3], [4], [2, 3, 4]])
    assert _beyond_each_choice(cases) == []


def test_equal_values_of_different_types_are_different_values():
    cases = _cases(x=[1, 1.0, True])
    assert _beyond_each_choice(cases) == []


def test_one_case_keeps_the_first_case_only():
    cases = _cases(dtype=["float32", "float16"], jit=[False, True])
    left = _left_for_the_slow_step(cases, one_case=True)
    assert left == [values for values, _ in cases[1:]]
    assert _left_for_the_slow_step(cases, one_case=False) == _beyond_each_choice(cases)
    assert len(_beyond_each_choice(cases)) == 2
