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
