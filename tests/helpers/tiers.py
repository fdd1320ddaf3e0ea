"""A test matrix split between the tiers: its representative cases run in `make test`, the
rest are marked `exhaustive` (`make test-exhaustive`, which CI runs after `make test`)."""

from __future__ import annotations

import pytest


def matrix(cases, ids, default) -> list:
    """`pytest.param`s of `cases` (each a tuple of arguments) named by `ids`, every case whose
    id is not in `default` marked exhaustive. Every id of `default` must be a case (a renamed
    case must not move the whole matrix out of the default run)."""
    ids = list(ids)
    missing = set(default) - set(ids)
    if missing:
        raise ValueError(f"default cases {sorted(missing)} are not among {ids}")
    return [
        pytest.param(*case, id=i, marks=() if i in default else pytest.mark.exhaustive)
        for case, i in zip(cases, ids, strict=True)
    ]
