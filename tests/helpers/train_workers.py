"""Module-level functions run on every rank of a LocalCluster by tests/runs/test_train.py."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from upipe.train import TrainConfig, Trainer

# a small corpus that is on every checkout: the package's own (non-empty) source files, not
# the directory (its __pycache__ holds binary files, which --data refuses)
_SRC = Path(__file__).resolve().parents[2] / "src" / "upipe"
CORPUS = ",".join(sorted(str(p) for p in _SRC.rglob("*.py") if p.stat().st_size))


def small_config(**kw) -> TrainConfig:
    """A tiny run on upipe's own sources. With evaluation, 30% of the files are held out
    (the default 1% of ~100 files may hold out none, depending on which files exist: their
    hashes decide)."""
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
