"""`tiers.matrix`: which cases of a matrix run by default."""

from __future__ import annotations

import pytest
from tiers import matrix


def test_matrix_marks_all_but_the_default_cases():
    params = matrix([(1, "a"), (2, "b"), (3, "c")], ["one", "two", "three"], {"two"})
    assert [p.id for p in params] == ["one", "two", "three"]
    assert [p.values for p in params] == [(1, "a"), (2, "b"), (3, "c")]
    marked = [[m.name for m in p.marks] for p in params]
    assert marked == [["exhaustive"], [], ["exhaustive"]]


def test_a_default_that_is_not_a_case_is_refused():
    with pytest.raises(ValueError, match=r"default cases \['tow'\] are not among"):
        matrix([(1,), (2,)], ["one", "two"], {"tow"})
