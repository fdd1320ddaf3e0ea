"""Ulysses attention vs the float64 full-sequence reference, forward and backward."""

import pytest
import torch
from tolerances import TOL, bf16_bound, rel_err
from workers import make_qkv, reference, reference_and_one_device, run_functional

CASES = [  # (world_size, H, G, B)
    (1, 4, 4, 1),
    (1, 4, 2, 2),
    (1, 4, 1, 1),
    (2, 4, 4, 2),
    (2, 4, 2, 1),
    (2, 8, 2, 1),
    (4, 8, 8, 1),
    (4, 8, 4, 2),
    (4, 16, 4, 1),
]


def gather(results):
    """Per-rank (out, dq, dk, dv) shards -> full-sequence tensors."""
    return [torch.cat(parts, dim=1) for parts in zip(*results, strict=True)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world_size,H,G,B", CASES)
def test_ulysses_matches_reference(clusters, world_size, H, G, B, causal):
    shape = dict(B=B, S=24 * world_size, H=H, G=G, d=8)
    got = gather(clusters(world_size).run(run_functional, "ulysses", shape, {"causal": causal}))
    ref = reference(*make_qkv(**shape), causal=causal)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert rel_err(a, r) < TOL[torch.float32]["fwd" if name == "out" else "bwd"], name


def test_ulysses_softmax_scale(clusters):
    shape = dict(B=1, S=32, H=4, G=2, d=8)
    got = gather(clusters(2).run(run_functional, "ulysses", shape, {"softmax_scale": 0.05}))
    ref = reference(*make_qkv(**shape), softmax_scale=0.05)
    assert max(rel_err(a, r) for a, r in zip(got, ref, strict=True)) < 1e-5


@pytest.mark.parametrize("strategy", ["ulysses", "upipe"])
def test_bf16_as_good_as_one_device(clusters, strategy):
    shape = dict(B=1, S=128, H=8, G=4, d=16)
    got = gather(clusters(4).run(run_functional, strategy, shape, {}, torch.bfloat16))
    ref, single = reference_and_one_device(shape, torch.bfloat16)
    for a, s, r in zip(got, single, ref, strict=True):
        assert rel_err(a, r) <= bf16_bound(rel_err(s, r))
