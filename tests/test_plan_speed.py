"""The planner's shortcuts give what the exhaustive paths give: `counts.count_in` (two
lengths, in the memory's own simulator) equals `timing.count_step` (three lengths, its own
simulators), and the search's answers equal a scan of every length."""

from __future__ import annotations

import dataclasses

import pytest

from upipe.model import get_config
from upipe.planner.counts import count_in
from upipe.planner.plan import PlanConfig, candidates, extrapolation_depths
from upipe.planner.step import StepSimulator
from upipe.planner.timing import count_step
from upipe.train.config import TrainConfig

MODEL = dataclasses.replace(get_config("tiny"), n_layers=8)  # deeper than every depth pair
FEATURES = ("off", "on", "on+ckpt2+fsdp-offload", "on+gpu1+aoff", "loss+recompute+keep")


def _candidates(world, strategies):
    pc = PlanConfig(
        model="tiny", gpus=world, granularity=64, strategies=strategies, features=FEATURES,
        heads_per_stage=(world,), mlp_tile=32, loss_chunk=32,
    )  # fmt: skip
    return [(label, kw) for label, kw, problem in candidates(pc, MODEL) if problem is None]


CASES = [
    *((2, label, kw) for label, kw in _candidates(2, ("none", "ulysses", "upipe", "ring"))),
    *((4, label, kw) for label, kw in _candidates(4, ("usp",))),
]


@pytest.mark.slow
@pytest.mark.parametrize("world,label,kw", CASES, ids=[f"{w}-{label}" for w, label, _ in CASES])
def test_counts_in_the_memory_simulator_equal_count_step(world, label, kw):
    """Every count (FLOPs, collective bytes, host copies, memory-bound bytes) at 1024 tokens
    (whole tiles and chunks), every strategy and memory feature set (checkpoints of 2
    blocks, kept inputs, FSDP2's offload, attention outputs kept or offloaded): the same
    integers. The memory step at that length runs first, as in `--recommend`."""
    cfg = TrainConfig(**kw, plot=None)
    depths = extrapolation_depths(cfg, MODEL.n_layers)
    S, unit = 8 * 128, kw["seq_len"]
    want = count_step(cfg, world, MODEL, S, unit=unit, depths=depths)
    with StepSimulator(cfg, world, MODEL, depths=depths) as sim:
        sim.step(S)
        got = count_in(sim, cfg, world, MODEL, S, unit=unit, depths=depths)
    assert got == want


@pytest.mark.slow
def test_counts_fall_back_where_the_simulator_differs():
    """Not extrapolated (the simulator runs the full depth, the counts 3 and 4 blocks), or a
    length of one MLP tile per rank (counted without tiles): nothing, for count_step."""
    _, label, kw = CASES[4]
    cfg = TrainConfig(**kw, plot=None)
    depths = extrapolation_depths(cfg, MODEL.n_layers)
    with StepSimulator(cfg, 2, MODEL) as sim:
        assert count_in(sim, cfg, 2, MODEL, 1024, unit=kw["seq_len"], depths=depths) is None
    with StepSimulator(cfg, 2, MODEL, depths=depths) as sim:
        assert cfg.tiled_mlp and count_in(sim, cfg, 2, MODEL, 64, unit=64, depths=depths) is None
