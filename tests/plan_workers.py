"""Run on every rank of a LocalCluster by tests/test_plan.py: a real step's peak memory."""

from __future__ import annotations

import torch

from upipe.planner.step import StepTracker, _measure
from upipe.train import Trainer


def real_peak(rank, world_size, cfg, seq_lens):
    """Per-rank device peak of steps at `seq_lens` (after a warm-up step), counted like the
    simulator counts: every storage the trainer allocated since it was built."""
    mem = StepTracker()
    with mem:
        trainer = Trainer(cfg, torch.device("cpu"))
    trainer.tracker = mem
    peaks = []
    for S in [seq_lens[0], *seq_lens]:  # the first step warms up (optimizer states)
        trainer.positions_L = trainer.cp.positions(S)
        peaks.append(_measure(trainer, S).peak_bytes)
    return peaks[1:]


def assert_simulated_peak_equals_real(clusters, cfg, seq_lens=(512, 2048)):
    """`cfg` on 2 gloo ranks for real vs simulated under fake tensors (CPU kernels, as in the
    real run): the simulated peak within 2% of the larger rank's measured one, per length."""
    from upipe.planner.step import StepSimulator

    seq_lens = list(seq_lens)
    real = [max(p) for p in zip(*clusters(2).run(real_peak, cfg, seq_lens), strict=True)]
    with StepSimulator(cfg, 2, kernels="cpu") as sim:
        simulated = [sim.step(S).peak_bytes for S in seq_lens]
    for r, s in zip(real, simulated, strict=True):
        assert abs(s - r) <= 0.02 * r, (real, simulated)
