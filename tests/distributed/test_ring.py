"""Ring attention and the sequence layouts: against the float64 full-sequence reference.

Every rank's (out, dq, dk, dv) is compared with the reference rows of exactly the tokens that
rank holds (its positions in the layout), so a rank that merged another rank's queries, or
returned gradients for someone else's keys, fails even if the set of all rows were right.
"""

import re

import pytest
import torch
from ring_workers import (
    layout_errors,
    layout_roundtrip,
    ring_errors,
    ring_shift,
    ring_work,
    run_ring,
)
from tolerances import TOL, bf16_bound, rel_err
from workers import make_qkv, reference, reference_and_one_device

from upipe.comm import sequence_positions

CASES = [  # (world_size, H, G, B); H need not be divisible by the world size
    (1, 4, 4, 2),
    (1, 4, 1, 1),
    (2, 4, 4, 1),
    (2, 4, 2, 2),
    (2, 4, 1, 1),
    (4, 4, 4, 1),
    (4, 8, 2, 2),
    (4, 4, 1, 1),
    (4, 2, 2, 1),
]
NAMES = ("out", "dq", "dk", "dv")


def check_per_rank(results, ref, tol_fwd, tol_bwd):
    """Each rank's shards vs the reference rows at that rank's positions; the max errors."""
    worst = dict.fromkeys(NAMES, 0.0)
    covered = []
    for rank, (pos, got) in enumerate(results):
        covered.append(pos)
        for name, a, r in zip(NAMES, got, ref, strict=True):
            err = rel_err(a, r[:, pos])
            assert err < (tol_fwd if name == "out" else tol_bwd), f"rank {rank} {name}: {err}"
            worst[name] = max(worst[name], err)
    S = ref[0].shape[1]
    assert torch.equal(torch.cat(covered).sort().values, torch.arange(S))  # a partition
    return worst


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world_size,H,G,B", CASES)
def test_ring_matches_reference(clusters, world_size, H, G, B, causal, layout):
    shape = dict(B=B, S=16 * world_size, H=H, G=G, d=8)
    kwargs = {"causal": causal, "layout": layout}
    res = clusters(world_size).run(run_ring, shape, kwargs)
    ref = reference(*make_qkv(**shape), causal=causal)
    check_per_rank(res, ref, TOL[torch.float32]["fwd"], TOL[torch.float32]["bwd"])


def test_ring_zigzag_causal_world4_longer(clusters):
    """The headline configuration with 32 tokens per rank, softmax_scale and GQA."""
    shape = dict(B=2, S=128, H=8, G=2, d=8)
    kwargs = {"causal": True, "layout": "zigzag", "softmax_scale": 0.2}
    res = clusters(4).run(run_ring, shape, kwargs)
    ref = reference(*make_qkv(**shape), causal=True, softmax_scale=0.2)
    check_per_rank(res, ref, TOL[torch.float32]["fwd"], TOL[torch.float32]["bwd"])


def test_ring_under_saved_tensor_hooks(clusters):
    shape = dict(B=1, S=64, H=4, G=2, d=8)
    res = clusters(2).run(run_ring, shape, {"layout": "zigzag"}, torch.float32, True)
    ref = reference(*make_qkv(**shape))
    check_per_rank(res, ref, TOL[torch.float32]["fwd"], TOL[torch.float32]["bwd"])


def test_ring_bf16_as_good_as_one_device(clusters):
    shape = dict(B=1, S=128, H=8, G=4, d=16)
    res = clusters(4).run(run_ring, shape, {"layout": "zigzag"}, torch.bfloat16)
    ref, single = reference_and_one_device(shape, torch.bfloat16)
    for rank, (pos, got) in enumerate(res):
        for name, a, s, r in zip(NAMES, got, single, ref, strict=True):
            bound = bf16_bound(rel_err(s[:, pos], r[:, pos]))
            assert rel_err(a, r[:, pos]) <= bound, f"rank {rank} {name}"


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_layout_roundtrip_and_positions(clusters, world_size, layout):
    S = 8 * world_size
    res = clusters(world_size).run(layout_roundtrip, 2, S, layout)
    for r in res:
        assert r["roundtrip_exact"] and r["positions_match"] and r["pos_ids_match"]
        assert r["dim2_exact"]
    assert torch.equal(torch.cat([r["pos"] for r in res]).sort().values, torch.arange(S))


def test_sequence_positions():
    # zigzag, 4 ranks, 16 tokens: 8 chunks of 2; rank 1 holds chunks 1 and 6
    assert sequence_positions(16, rank=1, world_size=4, layout="zigzag").tolist() == [2, 3, 12, 13]
    assert sequence_positions(16, rank=3, world_size=4).tolist() == [12, 13, 14, 15]
    assert sequence_positions(6, rank=0, world_size=1, layout="zigzag").tolist() == list(range(6))
    pos = sequence_positions(16, rank=0, world_size=4, layout="zigzag")
    assert pos.dtype == torch.long
    with pytest.raises(ValueError, match=r"not divisible by 2 \* group size = 8.*multiple of 8"):
        sequence_positions(12, rank=0, world_size=4, layout="zigzag")
    with pytest.raises(ValueError, match=r"not divisible by the group size 4"):
        sequence_positions(10, rank=0, world_size=4)
    with pytest.raises(ValueError, match=r"unknown sequence layout 'striped'"):
        sequence_positions(16, rank=0, world_size=4, layout="striped")
    with pytest.raises(ValueError, match=r"rank 4 is outside the group of size 4"):
        sequence_positions(16, rank=4, world_size=4)


def test_layout_errors(clusters):
    for r in clusters(2).run(layout_errors):
        assert re.search(
            r"length 6 \(dim 1\) is not divisible by 2 \* group size = 4.*e\.g\. 8",
            r["zigzag length"],
        )
        assert "unknown sequence layout 'striped'" in r["unknown"]
        assert "needs an even local length" in r["unshard odd"] and "got 3" in r["unshard odd"]
        assert "unknown sequence layout 'x'" in r["unshard unknown"]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ring_send_recv_shifts(clusters, world_size):
    for rank, seen in enumerate(clusters(world_size).run(ring_shift)):
        for k, (a, b, shape, dtype) in enumerate(seen, start=1):
            src = (rank - k) % world_size
            assert (a, b) == (src, 10 + src) and shape == (2, 3) and dtype == torch.float64


def _visible(calls):
    """Query-key pairs a rank computed; causal calls count their lower triangle."""
    return sum(q * (q + 1) // 2 if c else q * k for q, k, c in calls)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_causal_work_skips_the_future_and_zigzag_balances(clusters, layout):
    C, S = 4, 32
    L = S // C
    calls = clusters(C).run(ring_work, S, layout, True)
    for rank_calls in calls:
        assert all(q == k for q, k, c in rank_calls if c)  # causal only on diagonal blocks
        assert sum(c for *_, c in rank_calls) == 1
    # no wasted work: exactly the S(S+1)/2 visible pairs in total
    assert sum(_visible(c) for c in calls) == S * (S + 1) // 2
    work = [_visible(c) for c in calls]
    if layout == "zigzag":
        assert work == [L * (L + 1) // 2 + (C - 1) * L * L // 2] * C
        assert all(len(c) == C for c in calls)
    else:
        assert work == [L * (L + 1) // 2 + r * L * L for r in range(C)]
        assert [len(c) for c in calls] == [r + 1 for r in range(C)]
    # not causal: every rank computes C full blocks
    for rank_calls in clusters(C).run(ring_work, S, layout, False):
        assert rank_calls == [(L, L, False)] * C


def _same(x, C):
    return [x] * C


BAD = [  # (description, (shapes by rank, kwargs by rank), error type, pattern)
    (
        "unknown layout",
        (_same(((1, 8, 4, 8), (1, 8, 4, 8)), 2), _same({"layout": "striped"}, 2)),
        "ValueError",
        r"unknown sequence layout 'striped'; choose one of \('contiguous', 'zigzag'\)",
    ),
    (
        "odd local length for zigzag",
        (_same(((1, 7, 4, 8), (1, 7, 4, 8)), 2), _same({"layout": "zigzag"}, 2)),
        "ValueError",
        r"layout='zigzag' needs an even local sequence length .* got 7; pad the full "
        r"sequence to a multiple of 2 \* group size = 4, or use layout='contiguous'",
    ),
    (
        "layout differs between ranks",
        (_same(((1, 8, 4, 8), (1, 8, 4, 8)), 2), [{"layout": "zigzag"}, {"layout": "contiguous"}]),
        "ValueError",
        r"ranks disagree.*layout: rank 0 has zigzag, rank 1 has contiguous",
    ),
    (
        "one rank's layout is unknown",
        (_same(((1, 8, 4, 8), (1, 8, 4, 8)), 2), [{}, {"layout": "ring"}]),
        "ValueError",
        r"unknown sequence layout 'ring'",
    ),
    (
        "kv heads do not divide query heads",
        (_same(((1, 8, 4, 8), (1, 8, 3, 8)), 2), _same({}, 2)),
        "ValueError",
        r"kv heads \(3\) must divide query heads \(4\)",
    ),
    (
        "local lengths differ between ranks",
        ([((1, 8, 4, 8),) * 2, ((1, 6, 4, 8),) * 2], _same({}, 2)),
        "ValueError",
        r"ranks disagree.*q shape",
    ),
]
GOOD = [  # accepted by the ring although Ulysses would reject them
    ("heads not divisible by the group", (_same(((1, 8, 3, 8), (1, 8, 1, 8)), 2), _same({}, 2))),
    (
        "odd local length, contiguous",
        (_same(((1, 7, 2, 8), (1, 7, 2, 8)), 2), _same({"layout": "contiguous"}, 2)),
    ),
]


def test_ring_validation_on_every_rank(clusters):
    res = clusters(2).run(ring_errors, [c[1] for c in BAD] + [c[1] for c in GOOD])
    for rank, errors in enumerate(res):
        for (name, _, err, pattern), got in zip(BAD, errors[: len(BAD)], strict=True):
            assert got is not None, f"rank {rank} did not raise for {name}"
            assert got[0] == err and re.search(pattern, got[1]), (name, got)
            if name == "one rank's layout is unknown" and rank == 0:
                assert "rank 1 of the group rejected its input" in got[1]
        for (name, _), got in zip(GOOD, errors[len(BAD) :], strict=True):
            assert got is None, (name, got)
