"""Module-level functions run on every rank of a LocalCluster by tests/runs/test_train.py."""

from __future__ import annotations

import torch
import torch.distributed as dist
from corpus import corpus_path
from tolerances import grad_errors

from upipe.train import TrainConfig, Trainer

CORPUS = corpus_path()  # (made-up text, the same after every edit: `corpus`)


LOSS_TOL, GRAD_TOL = 1e-5, 2e-5  # one run's losses and step-1 gradients vs another's


def check_training(res, ref) -> None:
    """`train_steps`' results `res` equal `ref`'s: every loss within LOSS_TOL, every
    parameter's step-1 gradient within GRAD_TOL (relative)."""
    for a, b in zip(res["losses"], ref["losses"], strict=True):
        assert abs(a - b) / abs(b) < LOSS_TOL, (res["losses"], ref["losses"])
    for name, err in grad_errors(res["grads"], ref["grads"]).items():
        assert err < GRAD_TOL, name


def small_config(**kw) -> TrainConfig:
    """A tiny run on the tests' corpus. With evaluation, 30% of the documents are held out
    (the default 1% of its 120 documents may hold out none: their hashes decide)."""
    base = dict(model="tiny", seq_len=128, steps=3, lr=1e-2, data=CORPUS, plot=None)
    if kw.get("eval_every"):
        base["eval_fraction"] = 0.3
    return TrainConfig(**{**base, **kw})


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train_steps(rank, world_size, cfg: TrainConfig, memory: bool = False):
    """Losses of cfg.steps steps, and the (full, summed over ranks) gradients of step 1."""
    trainer = Trainer(cfg, torch.device("cpu"))
    losses, grads, peaks = [], None, []
    for step in range(cfg.steps):
        if memory:
            peaks.append(trainer.step(step)["peak_memory_bytes"])
            continue
        losses.append(trainer.forward_backward(step))
        if step == 0:
            grads = {
                n: _full(p.grad).detach().clone() for n, p in trainer.master.named_parameters()
            }
        trainer.optimizer_step()
    if memory:
        all_peaks = [None] * world_size
        dist.all_gather_object(all_peaks, max(peaks))
        return max(all_peaks)
    return {"losses": losses, "grads": grads}


def train_and_save(rank, world_size, cfg: TrainConfig):
    """upipe.train.train(cfg): rank 0's per-step metrics."""
    from upipe.train import train

    return [row["loss"] for row in train(cfg)]


def weights_after(rank, world_size, cfg: TrainConfig, group_decay: float | None = None):
    """The masters after cfg.steps steps (full tensors). `group_decay`: instead, torch's AdamW
    with the weights of two or more dimensions in a group of that weight_decay and the rest
    in one without (the reference for --weight-decay)."""
    from torch.optim.lr_scheduler import LambdaLR

    trainer = Trainer(cfg, torch.device("cpu"))
    if group_decay is not None:
        params = list(trainer.master.parameters())
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": group_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        trainer.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
        trainer.scheduler = LambdaLR(trainer.optimizer, trainer.schedule)
    for step in range(cfg.steps):
        trainer.step(step)
    return {n: _full(p).detach().clone() for n, p in trainer.master.named_parameters()}


def build_memory(rank, world_size, cfg: TrainConfig):
    """(peak bytes while the Trainer is built, its parameters' full and local bytes)."""
    from upipe.memory import MemoryTracker

    with MemoryTracker() as mem:
        trainer = Trainer(cfg, torch.device("cpu"))
    params = list(trainer.model.parameters())
    full = sum(_full(p).nbytes for p in params)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in params)
    weights = {n: _full(p).detach() for n, p in trainer.master.named_parameters()}
    return mem.peak_bytes, full, local, weights
