"""The default run's share of a table (`tests/helpers.pairwise_cover`) covers every pair."""

from __future__ import annotations

import itertools

import numpy as np

from tests import helpers


def _pairs(case):
    return {
        (i, repr(case[i]), j, repr(case[j])) for i, j in itertools.combinations(range(len(case)), 2)
    }


def test_pairwise_cover_holds_every_pair_in_fewer_cases():
    cases = [
        (f, d, layout, jit)
        for f in ("a", "b", "c", "d")
        for d in (np.float32, np.float16, "bf16")
        for layout in ((1, 1), (8, 1), (8, 2), (2, 2), ())
        for jit in (False, True)
    ]
    chosen = helpers.pairwise_cover(cases)
    kept = [c for c in cases if chosen(*c)]
    assert set().union(*map(_pairs, kept)) == set().union(*map(_pairs, cases))
    assert len(kept) <= 25 < len(cases)  # at least the 4 x 5 (function, layout) pairs
    params = helpers.pairwise_params(cases)
    assert sum(not p.marks for p in params) == len(kept)
    assert all(m.name == "slow" for p in params for m in p.marks)
