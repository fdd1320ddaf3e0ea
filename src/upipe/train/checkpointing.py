"""Checkpoints of a training run: torch distributed checkpoint (DCP), one directory per step
(`step_00000012`), written by every rank together; a directory counts once its `.metadata`
exists (DCP writes it last), so a run killed mid-save resumes from the previous one.

What is saved: the masters (the weights the optimizer updates, sharded or not), the
optimizer's state and the LR scheduler's. `Trainer.save` / `Trainer.load_latest` call these.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


def _state(master: torch.nn.Module, optimizer, scheduler) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(master, optimizer)
    return {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict()}


def save_checkpoint(
    directory: str | Path, step: int, master: torch.nn.Module, optimizer, scheduler
) -> Path:
    """Save `master`, `optimizer` and `scheduler` after `step` steps; returns the directory."""
    import torch.distributed.checkpoint as dcp

    path = Path(directory) / f"step_{step:08d}"
    dcp.save(_state(master, optimizer, scheduler), checkpoint_id=str(path))
    return path


def load_latest_checkpoint(
    directory: str | Path,
    master: torch.nn.Module,
    optimizer,
    scheduler,
    schedule: Callable[[int], float],
) -> int | None:
    """Load the newest complete checkpoint under `directory` into `master`, `optimizer` and
    `scheduler`; returns its step (None, nothing loaded, if there is none). The learning rate is
    then set from the step reached and `schedule` (this run's LR multiplier per step)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    root = Path(directory)
    done = sorted(p for p in root.glob("step_*") if (p / ".metadata").exists())
    if not done:
        return None
    state = _state(master, optimizer, scheduler)
    dcp.load(state, checkpoint_id=str(done[-1]))
    set_state_dict(
        master,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    scheduler.load_state_dict(state["scheduler"])
    # the next rate from the step reached and *this* run's schedule (the checkpoint's
    # optimizer holds the rate of the run that saved it; with a larger --steps the
    # resumed run continues along its own, longer cosine)
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = base * schedule(scheduler.last_epoch)
    return int(done[-1].name.split("_")[1])
