"""Module-level functions run on every rank of a LocalCluster by
tests/distributed/test_faults.py."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import time

import torch
import torch.distributed as dist

import upipe
from upipe.torch_private import process_groups
from upipe.train import Trainer, train
from upipe.train.checkpointing import CheckpointError, newest_intact_checkpoint

_GROUPS: list = []


def pid(rank, world_size):
    return os.getpid()


def unpicklable_on(rank, world_size, which: int):
    """Rank `which` returns a lock (which cannot be pickled), the others their rank."""
    import threading

    return threading.Lock() if rank == which else rank


def signal_one_rank(rank, world_size, victim: int, signum: int):
    """Rank `victim` sends itself `signum` (SIGKILL: dies; SIGSTOP: freezes); the others
    wait for it in a barrier."""
    if rank == victim:
        os.kill(os.getpid(), signum)
    dist.barrier()


def groups_and_threads(rank, world_size):
    """(process groups alive in this rank, its threads: gloo keeps 3 a group)."""
    return len(process_groups()), len(os.listdir("/proc/self/task"))


def make_groups(rank, world_size):
    """A mesh's groups and a group of rank 0 alone (kept for `use_groups`); then what
    `groups_and_threads` sees."""
    _GROUPS[:] = [upipe.make_mesh(ulysses=world_size)["ulysses"].get_group(), dist.new_group([0])]
    return groups_and_threads(rank, world_size)


def use_groups(rank, world_size):
    """An all-reduce on each group of `make_groups` this rank is in; how many there are."""
    mine = [g for g in _GROUPS if g is not dist.GroupMember.NON_GROUP_MEMBER]
    for group in mine:
        dist.all_reduce(torch.ones(1), group=group)
    return len(process_groups()) - 1


def sleep(rank, world_size, seconds: float):
    time.sleep(seconds)


def train_quietly(rank, world_size, cfg):
    """(the losses of upipe.train.train(cfg), what it printed to stderr); or the message of
    the CheckpointError it raised."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rows = train(cfg)
    except CheckpointError as e:
        return f"CheckpointError: {e}"
    return [r["loss"] for r in rows], err.getvalue()


def intact(rank, world_size, directory):
    """newest_intact_checkpoint(directory) as every rank sees it."""
    path, skipped = newest_intact_checkpoint(directory)
    return str(path) if path else None, skipped


def _poisoned(forward_backward, bad_step: int):
    """`Trainer.forward_backward` that leaves a NaN in step `bad_step`'s gradients (on every
    rank, after the reduction): what an overflow in the backward would leave."""

    def poisoned(trainer, step):
        loss = forward_backward(trainer, step)
        if step == bad_step:
            next(trainer.master.parameters()).grad.view(-1)[0] = float("nan")
        return loss

    return poisoned


def _state(trainer: Trainer) -> list[torch.Tensor]:
    params = [p.detach().clone() for p in trainer.master.parameters()]
    return params + [t.clone() for s in trainer.optimizer.state.values() for t in s.values()]


def nan_gradient(rank, world_size, cfg, bad_step: int):
    """Steps 0 .. cfg.steps - 1 with a NaN gradient at `bad_step`: each step's "skipped" and
    learning rate, whether the weights and AdamW states after the bad step equal those
    before it, and the last loss; or the message of the error the bad step raised."""
    trainer = Trainer(cfg, torch.device("cpu"))
    trainer.forward_backward = _poisoned(Trainer.forward_backward, bad_step).__get__(trainer)
    skipped, lrs, unchanged, loss = [], [], None, None
    for step in range(cfg.steps):
        before = _state(trainer) if step == bad_step else None
        lrs.append(trainer.lr)
        try:
            m = trainer.step(step)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        skipped.append(m["skipped"])
        loss = m["loss"]
        if before is not None:
            after = _state(trainer)
            unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    return {"skipped": skipped, "lrs": lrs, "unchanged": unchanged, "last_loss": loss}


def train_with_file_size_limit(rank, world_size, cfg, limit_bytes: int):
    """`train_quietly(cfg)` with rank 1's files limited to `limit_bytes`: a write past it
    fails (EFBIG), as on a full disk."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the error, not the signal
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit[1]))
    try:
        return train_quietly(rank, world_size, cfg)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)


def train_with_nan_gradient(rank, world_size, cfg, bad_step: int):
    """upipe.train.train(cfg) with a NaN gradient at `bad_step`: its metrics rows."""
    forward_backward = Trainer.forward_backward
    Trainer.forward_backward = _poisoned(forward_backward, bad_step)  # until the finally
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return train(cfg)
    finally:
        Trainer.forward_backward = forward_backward
