"""Pure pieces of the scenario's figures."""

import pytest

from vericache.bench.scenario_metrics import overlap_s


@pytest.mark.parametrize("a,b,want", [
    ([], [(0, 1)], 0.0),
    ([(0, 1)], [(0, 1)], 1.0),
    ([(0, 1), (2, 3)], [(0.5, 2.5)], 1.0),
    ([(0, 10)], [(1, 2), (3, 4), (9, 12)], 3.0),
    ([(2, 3), (0, 1)], [(1, 2)], 0.0),
])
def test_overlap_s(a, b, want):
    assert overlap_s(a, b) == pytest.approx(want)
    assert overlap_s(b, a) == pytest.approx(want)
