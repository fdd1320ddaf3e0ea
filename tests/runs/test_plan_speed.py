"""The planner's shortcuts give what the exhaustive paths give: `counts.count_in` (two
lengths, in the memory's own simulator) equals `timing.count_step` (three lengths, its own
simulators), the simulator's warm-up without a step leaves the state a step leaves, and
the search's answers equal a scan of every length."""

from __future__ import annotations

import dataclasses

import pytest
from tiers import matrix

from upipe.model import get_config
from upipe.planner.counts import count_in
from upipe.planner.plan import PlanConfig, candidates, extrapolation_depths, plan
from upipe.planner.search import device_floor, max_fitting
from upipe.planner.step import StepSimulator
from upipe.planner.timing import count_step
from upipe.train.config import TrainConfig

MODEL = dataclasses.replace(get_config("tiny"), n_layers=8)  # deeper than every depth pair
FEATURES = ("off", "on", "on+ckpt2+fsdp-offload", "on+gpu1+aoff", "loss+recompute+keep")


def _candidates(world, strategies):
    pc = PlanConfig(
        model="tiny", gpus=world, granularity=64, strategies=strategies, features=FEATURES,
        heads_per_stage=(2 * world,), mlp_tile=32, loss_chunk=32,
    )  # fmt: skip
    return [(label, kw) for label, kw, problem in candidates(pc, MODEL) if problem is None]


def _covering():
    """The (world, label, kw) cases: every strategy without features (its attention's
    counts), every feature set on UPipe (the op with the most loops: stages, kv rounds, the
    fused projections), and every feature set once more on another strategy -- each feature
    set on two strategies, each strategy with two feature sets or more, instead of all 23
    pairs (each case is 7-23 s of simulation on 2 CPU cores, 2026-12-02). UPipe runs with
    U = 2C: two stages, the loop without the cost of more."""
    other = {  # a feature set's second strategy
        "features": "none", "on+ckpt2+fsdp-offload": "ring", "on+gpu1+aoff": "ulysses",
        "loss+recompute+keep": "usp",
    }  # fmt: skip
    picked = []
    for world, strategies in ((2, ("none", "ulysses", "upipe", "ring")), (4, ("usp",))):
        for label, kw in _candidates(world, strategies):
            features = label.split(" +")[1] if " +" in label else "off"
            if features == "off" or kw["strategy"] in ("upipe", other.get(features)):
                picked.append((world, label, kw))
    return picked


CASES = _covering()


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,label,kw",
    matrix(CASES, [f"{w}-{label}" for w, label, _ in CASES], default={"2-upipe U=4 +features"}),
)
def test_counts_in_the_memory_simulator_equal_count_step(world, label, kw):
    """Every count (FLOPs, collective bytes, host copies, memory-bound bytes) at 1024 tokens
    (whole tiles and chunks, 16 per rank: on the lattice, where `count_in` counts the length
    itself with the tiles after the second repeated), every strategy and memory feature set
    (checkpoints of 2 blocks, kept inputs, FSDP2's offload, attention outputs kept or
    offloaded): the same integers. The memory step at that length runs first, as in
    `--recommend`.

    The same simulator also checks its warm-up (`step._warm_up`: FSDP2's units unsharded and
    resharded, one optimizer step on zero gradients, no forward or backward): the memory
    step right after it equals the one after the whole steps `count_in` ran -- every field
    of `StepMemory`, the largest tensors at the peak included."""
    cfg = TrainConfig(**kw, plot=None)
    depths = extrapolation_depths(cfg, MODEL.n_layers)
    S, unit = 8 * 128, kw["seq_len"]
    want = count_step(cfg, world, MODEL, S, unit=unit, depths=depths)
    with StepSimulator(cfg, world, MODEL, depths=depths) as sim:
        first = sim.step(S, explain=True)
        got = count_in(sim, cfg, world, MODEL, S, unit=unit, depths=depths)
        assert sim.step(S, explain=True) == first
    assert got == want


OFF_LATTICE = [case for case in CASES if case[1] in (
    "upipe U=4 +features", "usp 2x2 +loss+recompute+keep",
)]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,label,kw",
    matrix(
        OFF_LATTICE,
        [f"{w}-{label}" for w, label, _ in OFF_LATTICE],
        default={"4-usp 2x2 +loss+recompute+keep"},
    ),
)
def test_counts_off_the_lattice_equal_count_step(world, label, kw):
    """Off `count_step`'s lattice (1056 tokens: 16.5 MLP tiles and loss chunks per rank)
    `count_in` fits two lengths (the third where the attention check fails) instead of
    counting the length itself: the same integers as `count_step`'s three."""
    cfg = TrainConfig(**kw, plot=None)
    depths = extrapolation_depths(cfg, MODEL.n_layers)
    S, unit = 8 * 128 + 32, kw["seq_len"]
    want = count_step(cfg, world, MODEL, S, unit=unit, depths=depths)
    with StepSimulator(cfg, world, MODEL, depths=depths) as sim:
        got = count_in(sim, cfg, world, MODEL, S, unit=unit, depths=depths)
    assert got == want


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,label,kw",
    matrix(CASES[2:4], [f"{w}-{n}" for w, n, _ in CASES[2:4]], default={"2-ulysses"}),
)
def test_warm_up_leaves_what_a_step_leaves_on_cpu_kernels(world, label, kw):
    """The warm-up check of `test_counts_in_the_memory_simulator_equal_count_step` (on CUDA's
    kernels, every case there) on the CPU's kernels without FSDP (fp32 masters beside the
    bf16 model): a measured step right after the warm-up equals one after a whole unmeasured
    step at the shortest length."""
    cfg = TrainConfig(**{**kw, "fsdp": False}, plot=None)
    depths = extrapolation_depths(cfg, MODEL.n_layers)
    with StepSimulator(cfg, world, MODEL, depths=depths, kernels="cpu") as sim:
        first = sim.step(1024, explain=True)
        sim.step(sim._shortest())  # a whole step, unmeasured
        assert sim.step(1024, explain=True) == first


@pytest.mark.slow
def test_counts_fall_back_where_the_simulator_differs():
    """Not extrapolated (the simulator runs the full depth, the counts 3 and 4 blocks), or a
    length of one MLP tile per rank (counted without tiles): nothing, for count_step."""
    (kw,) = [kw for label, kw in _candidates(2, ("ulysses",)) if label == "ulysses +features"]
    cfg = TrainConfig(**kw, plot=None)
    depths = extrapolation_depths(cfg, MODEL.n_layers)
    with StepSimulator(cfg, 2, MODEL) as sim:
        assert count_in(sim, cfg, 2, MODEL, 1024, unit=kw["seq_len"], depths=depths) is None
    with StepSimulator(cfg, 2, MODEL, depths=depths) as sim:
        assert cfg.tiled_mlp and count_in(sim, cfg, 2, MODEL, 64, unit=64, depths=depths) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("strategy", ["none", "ulysses", "ring"])
def test_device_floor_is_below_the_simulated_peak(strategy, dtype):
    """The search's first length rests on `device_floor` being a lower bound of the peak
    (a length it rules out is never tried first): without the chunked loss, where it counts
    the fp32 logits and their log-softmax, and with the vocabulary large enough that they
    are most of the peak."""
    model = dataclasses.replace(MODEL, vocab_size=16384)
    kw = dict(strategy=strategy, nproc=2, dtype=dtype, seq_len=512, mlp_tile=32, loss_chunk=32)
    cfg = TrainConfig(**kw, plot=None)
    with StepSimulator(cfg, 2, model, depths=extrapolation_depths(cfg, model.n_layers)) as sim:
        peak = sim.step(512).peak_bytes
    floor = device_floor(cfg, 2, model)
    logits = 512 // (1 if strategy == "none" else 2) * 16384 * 8  # (none: 2 dp ranks)
    assert logits < floor <= peak, (floor, peak)


@pytest.mark.parametrize("first", [1, 16])
def test_search_with_parts_finds_the_exact_boundary(first):
    """Parts (a device phase that is flat then steep, a host line): the answer is where the
    first of them leaves the budget, wherever the search starts, in a few evaluations."""
    step, budget = 64, 1000

    def parts(S):
        return (max(600, S // 4 - 900), 100 + S // 20, 300 + S // 100)

    best, seen = max_fitting(parts, budget, step, 64 * 1024, first=first)
    assert best == max(k * step for k in range(1, 1025) if max(parts(k * step)) <= budget)
    assert len(seen) <= 12  # a search, not a scan (1,024 lengths)


@pytest.mark.slow
@pytest.mark.exhaustive  # (the default run: test_plan.py's boundaries of two plans)
def test_plan_answers_equal_a_scan_of_every_length():
    """`plan`'s answers (from 16 steps, per-part guesses, the lower bound's first length) are
    those of simulating every multiple of the granularity up to the limit, for candidates
    limited by the device and by the host. (Granularity 512 up to 4,608 tokens, just above the
    longest answer: 9 lengths a candidate.)"""
    pc = PlanConfig(
        model="tiny", gpus=2, gpu_memory_gib=0.02, reserve_gib=0.01, granularity=512,
        max_seq_len=4608, strategies=("ulysses", "upipe", "none"), heads_per_stage=(2,),
        features=("off", "on"), mlp_tile=256, loss_chunk=256, host_memory_gib=2**20 / 2**30,
        jobs=1,
    )  # fmt: skip
    res = plan(pc)
    budget, host = res["budget_bytes"], pc.host_memory_gib * 2**30
    for row in res["strategies"]:
        cfg = TrainConfig(**row["train_config"], plot=None)
        depths = extrapolation_depths(cfg, get_config("tiny").n_layers)
        with StepSimulator(cfg, 2, depths=depths) as sim:
            fits = [
                S
                for S in range(pc.granularity, pc.max_seq_len + 1, pc.granularity)
                if (m := sim.step(S)).peak_bytes <= budget and m.host_peak_bytes <= host
            ]
        want = max(fits, default=0)
        assert row["max_seq_len"] == want, row["strategy"]
        assert fits == list(range(pc.granularity, want + 1, pc.granularity))  # (monotonic)
    assert {r["limited_by"] for r in res["strategies"]} >= {"device memory", "host memory"}
