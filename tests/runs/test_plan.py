"""The planner: simulated memory equals a real run's; the search finds the exact boundary."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from plan_workers import assert_simulated_peak_equals_real
from tiers import matrix
from train_workers import small_config

from upipe.planner.plan import EXTRAPOLATION_DEPTHS, PlanConfig, max_fitting, plan, table
from upipe.planner.step import StepSimulator
from upipe.train import TrainConfig


@pytest.mark.parametrize(
    "peak",
    [
        lambda S: 3 * S + 100,  # linear
        lambda S: S * S / 1000 + S,  # convex
        lambda S: 50 * (S // 700) + S,  # steps
        lambda S: 2000 if S > 5000 else S // 10,  # a cliff
    ],
)
@pytest.mark.parametrize("step", [64, 256])
def test_search_finds_the_exact_boundary(peak, step):
    budget, limit = 7000, 40000
    best, seen = max_fitting(peak, budget, step, limit)
    expect = max(
        (k * step for k in range(1, limit // step + 1) if peak(k * step) <= budget), default=0
    )
    assert best == expect and best % step == 0
    assert len(seen) <= 16  # a search, not a scan
    for first in (2, 16, 1000):  # where it starts changes the lengths tried, not the answer
        assert max_fitting(peak, budget, step, limit, first=first)[0] == expect
    # a length known not to fit (`over`, as the planner's lower bound gives it) keeps the
    # answer and bounds the lengths tried
    for over in {expect // step + 1, expect // step + 2, 2 * expect // step + 3}:
        best, seen = max_fitting(peak, budget, step, limit, over=over)
        assert best == expect and max(seen, default=0) < over * step
    values = [peak(k * step) for k in range(1, limit // step + 1)]
    assert values == sorted(values)  # the functions searched are monotonic


def test_search_is_short_on_a_realistic_peak():
    """Flat (weights, logits chunk) then linear (activations): a few simulations."""
    GiB, step = 2**30, 65536
    peak = lambda S: max(18 * GiB + 100 * S, 10 * GiB + 9000 * S)  # noqa: E731
    best, seen = max_fitting(peak, 75 * GiB, step, 16 * 2**20)
    assert best == max(k * step for k in range(1, 257) if peak(k * step) <= 75 * GiB)
    assert len(seen) <= 5
    # from 16 steps, as the planner starts: 16, 32, then the line's answer and the next
    fast, seen = max_fitting(peak, 75 * GiB, step, 16 * 2**20, first=16)
    assert fast == best and len(seen) == 4


def test_search_edges():
    assert max_fitting(lambda S: S, 10, 64, 10_000)[0] == 0  # not even one granule fits
    assert max_fitting(lambda S: S, 10**9, 64, 1000)[0] == 960  # capped by the limit


CASES = [
    ("ulysses", {}),
    ("upipe", {"fsdp": True}),
    ("ring", {"activation_checkpoint": True, "tiled_mlp": True, "mlp_tile": 128}),
    (
        "upipe",
        {"activation_checkpoint": True, "chunked_loss": True, "loss_chunk": 128, "fsdp": True},
    ),
]


DEPTH_CASES = [
    ("ulysses", {}),
    ("ulysses", {"activation_checkpoint": True, "tiled_mlp": True, "mlp_tile": 256,
                 "fsdp": True, "chunked_loss": True, "loss_chunk": 256, "offload": True}),
    ("upipe", {"activation_checkpoint": True, "fsdp": True}),
    ("ring", {"tiled_mlp": True, "mlp_tile": 256}),
    ("upipe", {"activation_checkpoint": True, "tiled_mlp": True, "mlp_tile": 256,
               "offload": True, "blocks_per_checkpoint": 2, "keep_on_gpu": 1}),
    ("ulysses", {"activation_checkpoint": True, "blocks_per_checkpoint": 3, "fsdp": True}),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,kw",
    matrix(DEPTH_CASES, [f"{s}-kw{i}" for i, (s, _) in enumerate(DEPTH_CASES)], {"ulysses-kw1"}),
)
def test_extrapolated_depth_equals_full_depth(strategy, kw):
    """The planner's shortcut: 3 and 4 checkpoints (+ the kept ones, + a shorter last one)
    extrapolated to the full depth give its device peak and host bytes (8 blocks; 13 with
    checkpoints of 2 blocks, the last kept on the GPU: 4 offloaded + 1 kept + 1 of 1 block;
    16 with checkpoints of 3)."""
    from upipe.model import get_config
    from upipe.planner.plan import extrapolation_depths

    n_layers = {1: 8, 2: 13, 3: 16}[kw.get("blocks_per_checkpoint", 1)]
    model = dataclasses.replace(get_config("tiny"), n_layers=n_layers)
    cfg = small_config(strategy=strategy, nproc=4, **kw)
    depths = extrapolation_depths(cfg, n_layers)
    assert depths == {8: (3, 4), 13: (9, 11), 16: (10, 13)}[n_layers]

    def memory(sim):
        return [(m.peak_bytes, m.host_peak_bytes) for m in map(sim.step, (1024, 4096))]

    with StepSimulator(cfg, 4, model) as full:
        want = memory(full)
    with StepSimulator(cfg, 4, model, depths=depths) as short:
        assert memory(short) == want


SAMPLED_CASES = [
    ("ulysses", 4, {"activation_checkpoint": True, "tiled_mlp": True, "mlp_tile": 96,
                    "fsdp": True, "chunked_loss": True, "loss_chunk": 64, "offload": True}),
    ("upipe", 4, {"tiled_mlp": True, "mlp_tile": 128, "chunked_loss": True,
                  "loss_chunk": 96}),
    ("ring", 4, {"activation_checkpoint": True, "tiled_mlp": True, "mlp_tile": 64}),
    ("usp", 8, {"ring": 4, "tiled_mlp": True, "mlp_tile": 128}),
    ("upipe", 8, {"ring": 4}),  # each UPipe stage a ring
    # bf16 with fp32 masters: the fused op's row chunks (the output projection, and dx
    # summed over the stages' parts), tiles too
    ("upipe", 4, {"dtype": "bfloat16", "fsdp": True, "activation_checkpoint": True}),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,world,kw",
    matrix(
        SAMPLED_CASES,
        [f"{s}-{w}-kw{i}" for i, (s, w, _) in enumerate(SAMPLED_CASES)],
        default={"upipe-4-kw1", "ring-4-kw2"},
    ),
)
def test_sampled_loops_give_the_worst_rank(strategy, world, kw):
    """The simulator's other shortcut (`upipe.planner.sampled`): tile loops -- the tiled
    MLP's, the chunked loss's, the fused UPipe op's row chunks -- run two tiles, a ring its
    diagonal block and every rank's off-diagonal blocks twice. Rank 0's sampled step has
    the peak -- and each phase's peak -- of the worst rank running every iteration."""
    cfg = small_config(strategy=strategy, nproc=world, **kw)
    seq_lens = (1024, 2816)  # 2 .. 11 tiles per rank

    def steps(sample, rank):
        with StepSimulator(cfg, world, sample_loops=sample, rank=rank) as sim:
            return [sim.step(S) for S in seq_lens]

    sampled = steps(True, 0)
    full = [steps(False, rank) for rank in range(world)]
    for i, got in enumerate(sampled):
        per_rank = [ranks[i] for ranks in full]
        assert got.peak_bytes == max(m.peak_bytes for m in per_rank)
        for phase, nbytes in got.phase_bytes.items():
            assert nbytes == max(m.phase_bytes[phase] for m in per_rank)
        assert got.host_peak_bytes == max(m.host_peak_bytes for m in per_rank)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,kw", CASES)
def test_simulated_peak_equals_real_run(clusters, strategy, kw):
    """Same config, 2 gloo ranks for real vs simulated under fake tensors (CPU kernels, as
    in the real run): the simulated peak within 2% of the larger rank's measured one."""
    assert_simulated_peak_equals_real(clusters, small_config(strategy=strategy, nproc=2, **kw))


@pytest.mark.slow
def test_plan_end_to_end_small():
    pc = PlanConfig(
        model="tiny", gpus=2, gpu_memory_gib=0.02, reserve_gib=0.01, granularity=256,
        max_seq_len=8192, strategies=("ulysses", "upipe"), heads_per_stage=(2,), features=("on",),
        mlp_tile=256, loss_chunk=256,
    )  # fmt: skip
    res = plan(pc)
    rows = res["strategies"]
    assert [r["strategy"] for r in rows] == ["ulysses +features", "upipe U=2 +features"]
    for r in rows:
        S = r["max_seq_len"]
        pts = {p["seq_len"]: p["peak_bytes"] for p in r["points"]}
        assert 0 < S < 8192 and pts[S] <= res["budget_bytes"] < pts[S + 256]
    assert "upipe U=2" in table(res)


@pytest.mark.slow
def test_plan_host_memory_budget_and_batch():
    """--host-memory-gib: offloaded block inputs must fit the host too; --batch-size 2
    fits shorter sequences."""
    pc = PlanConfig(
        model="tiny", gpus=2, gpu_memory_gib=0.02, reserve_gib=0.01, granularity=256,
        max_seq_len=8192, strategies=("upipe",), heads_per_stage=(2,), features=("on",),
        mlp_tile=256, loss_chunk=256, jobs=1,
    )  # fmt: skip
    free = plan(pc)["strategies"][0]
    two = plan(dataclasses.replace(pc, batch_size=2))["strategies"][0]  # 2 sequences a step
    assert two["train_config"]["batch_size"] == 2
    assert 0 < two["max_seq_len"] < free["max_seq_len"]
    host = 2**20  # 1 MiB: about 2 x 2048 tokens x 128 x 2 bytes of block inputs
    res = plan(dataclasses.replace(pc, host_memory_gib=host / 2**30))
    row = res["strategies"][0]
    S, pts = row["max_seq_len"], {p["seq_len"]: p for p in row["points"]}
    assert free["limited_by"] == "device memory" and row["limited_by"] == "host memory"
    assert 0 < S < free["max_seq_len"]
    assert pts[S]["host_bytes"] <= host < pts[S + 256]["host_bytes"]
    assert pts[S + 256]["peak_bytes"] <= res["budget_bytes"]  # the device still had room
    assert "(host memory)" in table(res)
    with pytest.raises(ValueError, match="host-memory-gib"):
        plan(dataclasses.replace(pc, host_memory_gib=0.0))


def test_heads_per_stage_defaults_to_C_and_2C():
    from upipe.model import get_config
    from upipe.planner.plan import candidates

    def labels(**kw):
        pc = PlanConfig(model="llama3-8b", strategies=("upipe",), features=("off",), **kw)
        return [r[0] for r in candidates(pc, get_config("llama3-8b"))]

    assert labels(gpus=8) == ["upipe U=8", "upipe U=16"]
    # 2C = 64 > the model's 32 heads; beyond 8 GPUs also a ring across 8-GPU nodes
    assert labels(gpus=32) == ["upipe U=32", "upipe 4x8 U=8", "upipe 4x8 U=16"]
    assert labels(gpus=16, upipe_rings=(1,)) == ["upipe U=16", "upipe U=32"]
    assert labels(gpus=8, heads_per_stage=(16, 32)) == ["upipe U=16", "upipe U=32"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,strategy,features,fsdp",
    [
        ("tiny-qwen3", "upipe", "mlp+loss+recompute", False),  # QK-norm, U = 2C
        ("tiny", "ring", "loss+recompute+ckpt2", True),  # one checkpoint of both blocks
    ],
)
def test_plan_on_cpu_predicts_a_real_run(clusters, model, strategy, features, fsdp):
    """`upipe plan --device cpu` on configurations no other test tuned the simulation to:
    the planned longest length, trained for real on 2 gloo ranks, peaks within 2% of the
    plan's peak and inside the budget."""
    from plan_workers import real_peak

    pc = PlanConfig(
        model=model, gpus=2, gpu_memory_gib=0.03, reserve_gib=0.01, granularity=256,
        max_seq_len=16384, strategies=(strategy,), heads_per_stage=(4,), features=(features,),
        mlp_tile=256, loss_chunk=256, fsdp=fsdp, device="cpu", jobs=1,
    )  # fmt: skip
    res = plan(pc)
    (row,) = res["strategies"]
    S = row["max_seq_len"]
    assert 0 < S < pc.max_seq_len and row["limited_by"] == "device memory"
    planned = {p["seq_len"]: p["peak_bytes"] for p in row["points"]}[S]
    cfg = TrainConfig(**row["train_config"], plot=None)
    (real,) = [max(p) for p in zip(*clusters(2).run(real_peak, cfg, [S]), strict=True)]
    assert abs(planned - real) <= 0.02 * real, (planned, real)
    assert real <= res["budget_bytes"]


@pytest.mark.slow
@pytest.mark.exhaustive  # (Llama3-8B's simulated steps, for docs/plan.md's units)
def test_block_backward_units():
    """The squeezed block backward (docs/plan.md): Llama3-8B on 8 x 80 GiB with every memory
    feature, bf16 with fp32 masters: [L, D] bf16 units at the step's device peak (its growth
    from 4M to 6M tokens over the growth of one [L, D]) -- UPipe U = 8 at most 6.33 (9.33
    before the squeeze), Ulysses 12.08 (15.08)."""
    from upipe.model import get_config
    from upipe.planner.plan import candidates

    model = get_config("llama3-8b")
    pc = PlanConfig(gpus=8, strategies=("ulysses", "upipe"), heads_per_stage=(8,))
    units = {}
    for label, kw, _ in candidates(dataclasses.replace(pc, features=("on",)), model):
        with StepSimulator(
            TrainConfig(**kw, plot=None), 8, model, depths=EXTRAPOLATION_DEPTHS
        ) as sim:
            a, b = (sim.step(S).peak_bytes for S in (4 * 2**20, 6 * 2**20))
        units[label] = (b - a) / (2 * 2**20 // 8 * model.hidden_size * 2)
    assert units["upipe U=8 +features"] <= 6.34, units
    assert units["ulysses +features"] <= 12.09, units


def test_feature_sets():
    from upipe.model import get_config
    from upipe.planner.plan import candidates

    feats = ("off", "on", "mlp+recompute", "offload", "on+ckpt2+gpu1", "recompute+gpu1")
    pc = PlanConfig(model="tiny", gpus=2, strategies=("ulysses",), features=feats)
    rows = candidates(pc, get_config("tiny"))
    assert [r[0] for r in rows] == [
        "ulysses", "ulysses +features", "ulysses +mlp+recompute", "ulysses +offload",
        "ulysses +on+ckpt2+gpu1", "ulysses +recompute+gpu1",
    ]  # fmt: skip
    (_, off, _), (_, on, _), (_, some, ok), (_, _, problem), (_, more, all_kept), (_, _, keep) = (
        rows
    )
    features = ("tiled_mlp", "chunked_loss", "activation_checkpoint", "offload")
    assert not any(off.get(k) for k in features)
    assert all(on[k] for k in features)
    assert some["tiled_mlp"] and some["activation_checkpoint"] and not some.get("chunked_loss")
    assert ok is None and "--activation-checkpoint" in problem  # offload needs checkpointing
    assert all(more[k] for k in features)  # tiny has 2 blocks: 1 checkpoint of 2
    assert "keeps all 1 checkpoints (2 blocks / 2 per checkpoint) on the GPU" in all_kept
    assert (more["blocks_per_checkpoint"], more["keep_on_gpu"]) == (2, 1)
    assert keep == "--keep-on-gpu 1 keeps some offloaded inputs on the GPU: it needs --offload"
    for bad in ("tiles", "ckpt0", "gpu"):
        with pytest.raises(ValueError, match=f"unknown '{bad}'"):
            candidates(dataclasses.replace(pc, features=(f"on+{bad}",)), get_config("tiny"))


def test_cuda_rms_norm_footprint():
    """Under kernels="cuda" every F.rms_norm (model norms, the fused op's QK-norm) keeps what
    CUDA's fused kernel keeps: the output and one fp32 rstd per row; the CPU composite
    keeps fp32 copies of x."""
    from upipe.memory import MemoryTracker
    from upipe.planner.step import _kernels

    x = torch.randn(64, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(16, dtype=torch.bfloat16, requires_grad=True)
    kept = {}
    for kind in ("cuda", "cpu"):
        with _kernels(kind), MemoryTracker() as mem:
            y = torch.nn.functional.rms_norm(x, (16,), w, 1e-6)
        kept[kind] = mem.current_bytes
        y.sum().backward()
        assert x.grad.shape == x.shape and w.grad.shape == w.shape
        del y
    assert kept["cuda"] == x.nbytes + 64 * 8 * 4
    assert kept["cpu"] > 2 * x.nbytes
    assert torch.nn.functional.rms_norm.__module__ == "torch.nn.functional"  # restored


def test_candidates_on_an_odd_gpu_count():
    """6 GPUs: ring and USP are validated at a length they can split (lcm(64K, 12)), Ulysses
    and UPipe split the 32 heads unevenly (6, 6, 5, 5, 5, 5), and on 48 GPUs (more than
    the heads) the problems name the model planned, not the training default."""
    from upipe.model import get_config
    from upipe.planner.plan import candidates

    def rows(gpus):
        pc = PlanConfig(model="llama3-8b", gpus=gpus, features=("on",), heads_per_stage=(gpus,))
        return {label: (kw, why) for label, kw, why in candidates(pc, get_config("llama3-8b"))}

    six = rows(6)
    assert all(why is None for _, why in six.values()), six
    assert six["ring +features"][0]["seq_len"] == 196608
    assert (
        "llama3-8b has 32 heads, fewer than the ulysses size 48" in rows(48)["ulysses +features"][1]
    )
