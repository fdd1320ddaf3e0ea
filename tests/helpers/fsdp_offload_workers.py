"""Run on every rank of a LocalCluster by tests/runs/test_fsdp_offload.py."""

from __future__ import annotations

import contextlib
import io

import torch

from upipe.train import Trainer, train


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def steps_and_state(rank, world_size, cfg, nan_step: int):
    """`Trainer.step` for cfg.steps steps, a NaN written into one gradient element on every
    rank in step `nan_step` (an overflow's trace), then one evaluation: the step metrics,
    the held-out loss, and the full masters and AdamW states after the last step (with
    where the masters, gradients and states of the last step lived)."""
    trainer = Trainer(cfg, torch.device("cpu"))
    forward_backward = trainer.forward_backward
    where = set()

    def poisoned(step):
        loss = forward_backward(step)
        grads = [p.grad for p in trainer.master.parameters()]
        where.update(str(t.device) for t in grads + list(trainer.master.parameters()))
        if step == nan_step:
            g = grads[0]
            (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("nan")
        return loss

    trainer.forward_backward = poisoned
    rows = [trainer.step(step) for step in range(cfg.steps)]
    for row in rows:
        del row["seconds"]
    names = [n for n, _ in trainer.master.named_parameters()]
    weights = {n: _full(p).detach() for n, p in trainer.master.named_parameters()}
    states = {
        (names[i], k): _full(t)
        for i, p in enumerate(trainer.master.parameters())
        for k, t in trainer.optimizer.state[p].items()
    }
    where.update(str(t.device) for t in states.values())
    return rows, trainer.evaluate(), weights, states, sorted(where)


def train_rows(rank, world_size, cfg):
    """upipe.train.train(cfg)'s metrics rows (its progress output silenced)."""
    with contextlib.redirect_stderr(io.StringIO()):
        return train(cfg)
