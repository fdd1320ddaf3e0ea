"""Sequence <-> head all-to-all: exact layouts, round trip, autograd; shard/unshard."""

import pytest
import torch
from workers import comm_roundtrip

import upipe


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("B", [1, 3])
def test_all_to_all_layouts(clusters, world_size, B):
    for res in clusters(world_size).run(comm_roundtrip, B, 5, 4 * world_size, 3):
        assert torch.equal(res["x_BShd"], res["expected_BShd"])
        assert res["roundtrip_exact"] and res["grad_ok"] and res["grad2_ok"] and res["unshard_ok"]


def test_shard_rejects_indivisible_length(clusters):
    res = clusters(2).run(_shard_bad)
    assert all("not divisible by the group size 2" in r and "pad it" in r for r in res)


def _shard_bad(rank, world_size):
    try:
        upipe.shard_sequence(torch.zeros(1, 7, 2), group=torch.distributed.group.WORLD)
    except ValueError as e:
        return str(e)
    return ""
