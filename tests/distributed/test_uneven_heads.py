"""Head counts the group size does not divide (H or G; e.g. 28 query / 4 kv heads on 8
ranks): Ulysses, UPipe and USP split them unevenly (`upipe.heads`) and still
compute exact attention, forward and backward, against the float64 reference."""

import pytest
import torch
import torch.distributed as dist
from document_workers import doc_reference, run_docs
from tolerances import TOL, TOL_SAME_KERNEL, bf16_bound, rel_err
from usp_workers import run_mesh_functional
from workers import (
    expect_error,
    make_qkv,
    module_reference,
    reference,
    reference_and_one_device,
    run_functional,
    run_functional_layout,
    run_module,
    run_module_layout,
)

import upipe
from upipe import heads
from upipe.attention.registry import check_heads, heads_problem
from upipe.comm import head_to_seq, seq_to_head
from upipe.heads import (
    check_heads_per_stage,
    plan_rounds,
    plan_schedule,
    valid_heads_per_stage,
)

FWD, BWD = TOL[torch.float32]["fwd"], TOL[torch.float32]["bwd"]

# --- the split and the schedule (no ranks) -----------------------------------------------


def test_query_and_kv_ranges_of_qwen25_7b_on_8():
    q = heads.query_ranges(28, 8)
    assert heads.counts(q) == (4, 4, 4, 4, 3, 3, 3, 3)
    assert [s for s, _ in q] == [0, 4, 8, 12, 16, 19, 22, 25]
    kv = [heads.kv_range(s, n, 7) for s, n in q]  # g = 28 / 4 = 7
    assert kv == [(0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 1)]
    # rank 1: heads 4, 5, 6 use kv head 0, head 7 kv head 1: two kernel calls
    assert heads.segments(q[1], kv[1], 7) == ((0, 3, 0, 1), (3, 1, 1, 1))
    assert heads.segments(q[0], kv[0], 7) == ((0, 4, 0, 1),)  # standard: one call
    assert heads.segments((0, 4), (0, 2), 2) == ((0, 4, 0, 2),)  # standard GQA, merged


SCHEDULES = [  # (H, G, C, U)
    (28, 4, 8, 8),
    (28, 4, 8, 16),
    (30, 30, 4, 4),
    (30, 30, 4, 8),
    (30, 6, 4, 32),
    (7, 1, 4, 4),
    (6, 2, 4, 4),
    (12, 3, 2, 2),
    (10, 2, 4, 4),
    (8, 2, 3, 3),
]


@pytest.mark.parametrize("H,G,C,U", SCHEDULES)
def test_uneven_plan_runs_every_head_once_with_its_kv_head(H, G, C, U):
    g = H // G
    q = heads.query_ranges(H, C)
    plans = [plan_schedule(H, G, C, U, r) for r in range(C)]
    assert all(len(p) == len(plans[0]) for p in plans)
    seen = [0] * H
    for i, rnd in enumerate(plans[0]):
        for r in range(C):
            assert plans[r][i].kv == rnd.kv and plans[r][i].stages == rnd.stages  # global part
        assert max(rnd.kv_split) <= max(1, -(-(U // C) // g) + 1)  # K: one stage's kv heads
        for s, ranges in enumerate(rnd.stages):
            assert sum(rnd.q_split(s)) <= U
            for r, (first, n) in enumerate(ranges):
                assert q[r][0] <= first and first + n <= q[r][0] + q[r][1]  # its own heads
                k0, nk = rnd.kv[r]
                for h in range(first, first + n):
                    seen[h] += 1
                    assert k0 <= h // g < k0 + nk  # the round holds the kv head it uses
                segs = plans[r][i].stage_segments[s]
                assert sum(nq for _, nq, _, _ in segs) == n
                for q0, nq, s0, ns in segs:  # each segment is standard GQA over its kv heads
                    assert nq % ns == 0
                    for j in range(nq):
                        assert (first + q0 + j) // g == k0 + s0 + j // (nq // ns)
    assert seen == [1] * H


def test_even_heads_keep_the_even_schedule():
    for H, G, C, U in ((16, 4, 4, 4), (8, 1, 4, 4), (8, 8, 2, 4)):
        assert all(plan_schedule(H, G, C, U, r) is plan_rounds(H, G, C, U) for r in range(C))
    assert heads.ulysses_split(16, 4, 4, 0) is None


def test_head_rules():
    assert heads_problem("ulysses", 28, 4, 8) is None
    assert heads_problem("upipe", 30, 30, 4) is None
    assert heads_problem("usp", 7, 1, 2) is None
    assert heads_problem("upipe", 2, 1, 4) == "heads"
    msg = check_heads("ulysses", 2, 1, 4, size="context-parallel size")
    assert "num_heads (2) must be at least the context-parallel size (4)" in msg
    assert "strategy='ring'" in msg
    assert heads_problem("ring", 2, 1, 4) is None
    assert check_heads_per_stage(30, 30, 4, None) == 4
    assert valid_heads_per_stage(30, 30, 4) == [4, 8, 12, 16, 20, 24, 28, 32]
    assert valid_heads_per_stage(28, 4, 8) == [8, 16, 24, 32]
    with pytest.raises(ValueError, match=r"heads_per_stage \(36\) must be at most 32.*\[4, 8"):
        check_heads_per_stage(30, 30, 4, 36)
    with pytest.raises(ValueError, match=r"heads_per_stage \(6\) must be a multiple of"):
        check_heads_per_stage(30, 30, 4, 6)


# --- the exchange ------------------------------------------------------------------------


def _exchange_checks(rank, world_size, counts, layout):
    group = dist.group.WORLD
    B, L, d = 2, 4, 3
    n, S = sum(counts), L * world_size
    full = torch.arange(B * S * n * d, dtype=torch.float64).view(B, S, n, d)
    x_BLnd = upipe.shard_sequence(full, group=group, layout=layout)
    x_BSad = seq_to_head(x_BLnd, group, layout, counts=counts)
    first = sum(counts[:rank])
    expected = full[:, :, first : first + counts[rank]]
    back = head_to_seq(x_BSad, group, layout, counts=counts)
    w = torch.randn(
        x_BSad.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)
    )
    y = torch.randn(x_BLnd.shape, dtype=torch.float64)
    dots = torch.stack(
        [
            (seq_to_head(y, group, layout, counts=counts) * w).sum(),
            (y * head_to_seq(w, group, layout, counts=counts)).sum(),
        ]
    )
    dist.all_reduce(dots, group=group)
    pending = seq_to_head(x_BLnd, group, layout, counts=counts, async_op=True)
    return {
        "to_head": torch.equal(x_BSad, expected),
        "roundtrip": torch.equal(back, x_BLnd),
        "adjoint": torch.allclose(dots[0], dots[1], rtol=1e-12),
        "async": torch.equal(pending.wait(), expected),
    }


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("counts", [(2, 0, 3, 1), (2, 2, 1, 1)])
def test_uneven_exchange(clusters, counts, layout):
    for r in clusters(4).run(_exchange_checks, counts, layout):
        assert all(r.values()), r


# --- the functional ops, fp32 vs float64 -------------------------------------------------

FUNCTIONAL = [  # (strategy, C, H, G, kwargs)
    ("ulysses", 2, 7, 1, {}),
    ("ulysses", 4, 7, 1, {}),
    ("ulysses", 4, 6, 2, {}),
    ("ulysses", 4, 10, 2, {}),
    ("ulysses", 4, 8, 2, {}),  # H even, kv heads shared by rank pairs
    ("ulysses", 4, 6, 6, {}),
    ("upipe", 2, 7, 1, {}),
    ("upipe", 4, 7, 1, {"heads_per_stage": 8}),
    ("upipe", 4, 6, 2, {}),
    ("upipe", 4, 10, 2, {}),
    ("upipe", 4, 10, 2, {"heads_per_stage": 12}),  # one stage: uneven Ulysses
    ("upipe", 4, 6, 6, {}),
    ("upipe", 2, 6, 3, {}),  # G and C do not divide one another
]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("strategy,C,H,G,kwargs", FUNCTIONAL)
def test_functional_matches_reference(clusters, strategy, C, H, G, kwargs, causal, layout):
    shape = dict(B=2, S=8 * C, H=H, G=G, d=8)
    kw = {**kwargs, "causal": causal}
    got = clusters(C).run(run_functional_layout, strategy, shape, kw, layout)[0]
    ref = reference(*make_qkv(**shape), causal=causal)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert rel_err(a, r) < (FWD if name == "out" else BWD), name


@pytest.mark.parametrize("C,H,G", [(4, 6, 2), (2, 7, 1)])
def test_upipe_equals_ulysses(clusters, C, H, G):
    shape = dict(B=1, S=8 * C, H=H, G=G, d=8)
    a = clusters(C).run(run_functional, "ulysses", shape, {})
    b = clusters(C).run(run_functional, "upipe", shape, {})
    for ra, rb in zip(a, b, strict=True):
        for ta, tb in zip(ra, rb, strict=True):
            assert rel_err(tb, ta) <= TOL_SAME_KERNEL


@pytest.mark.parametrize("strategy", ["ulysses", "upipe"])
def test_bf16_as_good_as_one_device(clusters, strategy):
    shape = dict(B=1, S=64, H=6, G=2, d=16)
    got = clusters(4).run(run_functional, strategy, shape, {}, torch.bfloat16)
    got = [torch.cat(parts, dim=1) for parts in zip(*got, strict=True)]
    ref, single = reference_and_one_device(shape, torch.bfloat16)
    for a, s, r in zip(got, single, ref, strict=True):
        assert rel_err(a, r) <= bf16_bound(rel_err(s, r))


@pytest.mark.parametrize("strategy", ["ulysses", "upipe"])
def test_documents(clusters, strategy):
    shape = dict(B=2, S=32, H=6, G=2, d=8)
    cu = [0, 5, 5, 19, 32]
    got = clusters(4).run(run_docs, strategy, shape, {}, cu)[0]
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, doc_reference(shape, cu), strict=True):
        assert rel_err(a, r) < (FWD if name == "out" else BWD), name


@pytest.mark.parametrize("H,G", [(6, 3), (5, 1)])
def test_usp_on_a_mesh(clusters, H, G):
    shape = dict(B=1, S=32, H=H, G=G, d=8)
    got = clusters(4).run(run_mesh_functional, (1, 2, 2), "usp", shape, {})
    ref = reference(*make_qkv(**shape))
    for _, pos, res in got:
        for name, a, r in zip(("out", "dq", "dk", "dv"), res, ref, strict=True):
            assert rel_err(a, r[:, pos]) < (FWD if name == "out" else BWD), name


QWEN25_7B = [  # 28 query and 4 kv heads on 8 ranks (4, 4, 4, 4, 3, 3, 3, 3 query heads)
    ("ulysses", {}, "contiguous"),
    ("upipe", {}, "zigzag"),
    ("upipe", {"heads_per_stage": 16}, "contiguous"),
]


@pytest.mark.slow
@pytest.mark.parametrize("strategy,kwargs,layout", QWEN25_7B)
def test_qwen25_7b_heads_on_8_ranks(clusters, strategy, kwargs, layout):
    shape = dict(B=1, S=64, H=28, G=4, d=8)
    got = clusters(8).run(run_functional_layout, strategy, shape, kwargs, layout)[0]
    for name, a, r in zip(
        ("out", "dq", "dk", "dv"), got, reference(*make_qkv(**shape)), strict=True
    ):
        assert rel_err(a, r) < (FWD if name == "out" else BWD), name


# --- the module --------------------------------------------------------------------------

MODULE = [  # (C, H, G, kwargs, layout)
    # Qwen2.5-7B's heads on 8 ranks (slow: the only other user of an 8-rank cluster)
    pytest.param(8, 28, 4, {"strategy": "upipe"}, "contiguous", marks=pytest.mark.slow),
    (4, 6, 2, {"strategy": "ulysses"}, "contiguous"),
    (4, 6, 2, {"strategy": "upipe"}, "contiguous"),
    (4, 6, 2, {"strategy": "upipe", "overlap": True}, "zigzag"),
    (4, 6, 6, {"strategy": "upipe", "heads_per_stage": 8}, "contiguous"),
    (2, 7, 1, {"strategy": "upipe", "qk_norm": True}, "contiguous"),
    (2, 7, 1, {"strategy": "ulysses"}, "zigzag"),
]


@pytest.mark.parametrize("C,H,G,kwargs,layout", MODULE)
def test_module_matches_reference(clusters, C, H, G, kwargs, layout):
    cfg = dict(B=2, S=8 * C, dim=32, num_heads=H, num_kv_heads=G, head_dim=8)
    qk_norm = kwargs.get("qk_norm", False)
    ref = module_reference(cfg, qk_norm=qk_norm)
    if layout == "contiguous":
        got = clusters(C).run(run_module, cfg, kwargs)
        y, dx = (torch.cat([r[n] for r in got], dim=1) for n in ("y", "dx"))
        names = ("q_proj", "k_proj", "v_proj", "o_proj") + (("q_norm", "k_norm") if qk_norm else ())
    else:
        got = clusters(C).run(run_module_layout, cfg, kwargs, layout)
        y, dx = got[0]["y"], got[0]["dx"]
        names = ("q_proj", "o_proj")
    assert rel_err(y, ref["y"]) < FWD and rel_err(dx, ref["dx"]) < BWD
    for n in names:  # each rank's share of a weight gradient; their sum is the gradient
        assert rel_err(sum(r[n] for r in got), ref[n]) < BWD, n


# --- what still cannot work --------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ulysses", "upipe"])
def test_fewer_heads_than_ranks_raise_on_every_rank(clusters, strategy):
    shapes = ((1, 8, 1, 8),) * 3
    for r in clusters(2).run(expect_error, strategy, shapes, {}):
        assert r is not None and r[0] == "ValueError"
        assert "query heads (1) must be at least the context-parallel size (2)" in r[1]


def test_trainer_accepts_uneven_heads():
    from train_workers import small_config

    from upipe.train.config import validate

    assert validate(small_config(strategy="ulysses", nproc=3), 3) is None  # 8 heads on 3
    assert validate(small_config(strategy="upipe", nproc=3), 3) is None
    assert validate(small_config(strategy="ulysses", model="tiny-qwen3"), 4) is None  # G=2 on 4
    assert "fewer than the ulysses size 16" in validate(
        small_config(strategy="ulysses", nproc=16), 16
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["ulysses", "upipe"])
def test_cuda_path_emulated(clusters, strategy, dtype):
    """backend="cuda" (the CUDA-only kernels emulated on CPU, `tests/helpers/cuda_emulation.py`):
    the segment calls pass the kernels' contract (views of a rank's heads)."""
    import cuda_emulation
    import cuda_workers

    cuda_emulation.install()
    shape = dict(B=1, S=64, H=10, G=2, d=8)  # rank 1: heads 3, 4 | 5 -> two kernel calls
    res = clusters(4).run(cuda_workers.functional, strategy, shape, {}, dtype)
    got = [torch.cat(parts, dim=1) for parts in zip(*res, strict=True)]
    ref, one = reference_and_one_device(shape, dtype, backend="cuda")
    for name, a, s, r in zip(("out", "dq", "dk", "dv"), got, one, ref, strict=True):
        if dtype == torch.float32:
            assert rel_err(a, r) < (FWD if name == "out" else BWD), name
        else:
            assert rel_err(a, r) <= bf16_bound(rel_err(s, r)), name


# --- memory: the largest rank's share ----------------------------------------------------


def _head_layout_peak(rank, world_size, H):
    """Peak bytes of the head-layout buffers ([B, S, *, d]) of one Ulysses fwd+bwd (MHA)."""
    from upipe.memory.tracker import MemoryTracker

    S = 64
    q, k, v, dout = make_qkv(B=1, S=S, H=H, G=H, d=8)
    group = dist.group.WORLD
    leaves = [upipe.shard_sequence(t, group=group).requires_grad_() for t in (q, k, v)]
    dout = upipe.shard_sequence(dout, group=group)
    with MemoryTracker(count=lambda t: t.dim() == 4 and t.shape[1] == S) as mem:
        upipe.ulysses_attention(*leaves, group=group).backward(dout)
    return mem.counted_peak_bytes


def test_head_layout_memory_follows_each_ranks_share(clusters):
    """6 heads on 4 ranks (2, 2, 1, 1): a rank's head-layout buffers are proportional to its
    own heads, and the largest rank's equal those of an even split of 8 heads (2 per rank)
    -- the peak is ceil(H/C) / (H/C) = 4/3 of an even 1.5-head share."""
    uneven_peaks = clusters(4).run(_head_layout_peak, 6)
    even_peaks = clusters(4).run(_head_layout_peak, 8)
    assert uneven_peaks[0] == uneven_peaks[1] == 2 * uneven_peaks[2] == 2 * uneven_peaks[3]
    assert uneven_peaks[0] == even_peaks[0] > 0
