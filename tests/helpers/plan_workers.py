"""Run on every rank of a LocalCluster by tests/runs/test_plan.py: a real step's peak memory."""

from __future__ import annotations

import types

import torch

from upipe.planner.step import StepTracker, _measure, _synthetic_batch
from upipe.train import Trainer


def real_peak(rank, world_size, cfg, seq_lens, synthetic=False):
    """Per-rank device peak of steps at `seq_lens` (after a warm-up step), counted like the
    simulator counts: every storage the trainer allocated since it was built.

    `synthetic`: feed the planner's batches (`planner.step._synthetic_batch`) instead of the
    corpus, so that the data pipeline's token buffers -- host memory on a GPU, not part of
    the step the planner plans, but counted on the CPU -- are the same on both sides (they
    grow with the corpus read: about 150 KB of the 7.5 MB peak of a 512-token test step,
    which is 2% there and nothing at real lengths)."""
    mem = StepTracker()
    with mem:
        trainer = Trainer(cfg, torch.device("cpu"))
    trainer.tracker = mem
    if synthetic:
        trainer.batch = types.MethodType(_synthetic_batch, trainer)
    peaks = []
    for S in [seq_lens[0], *seq_lens]:  # the first step warms up (optimizer states)
        trainer.positions_L = trainer.cp.positions(S)
        peaks.append(_measure(trainer, S).peak_bytes)
    return peaks[1:]


def assert_simulated_peak_equals_real(clusters, cfg, seq_lens=(512, 2048)):
    """`cfg` on 2 gloo ranks for real (on the planner's batches) vs simulated under fake
    tensors (CPU kernels, as in the real run): the simulated peak within 2% of the larger
    rank's measured one, per length (measured: within 0.01%)."""
    from upipe.planner.step import StepSimulator

    seq_lens = list(seq_lens)
    real = [max(p) for p in zip(*clusters(2).run(real_peak, cfg, seq_lens, True), strict=True)]
    with StepSimulator(cfg, 2, kernels="cpu") as sim:
        simulated = [sim.step(S).peak_bytes for S in seq_lens]
    for r, s in zip(real, simulated, strict=True):
        assert abs(s - r) <= 0.02 * r, (real, simulated)
