"""Checkpoints of a training run that verify themselves: torch distributed checkpoint (DCP),
one directory per step (`step_00000012`), written by every rank together.

What is saved: the masters (the weights the optimizer updates, sharded or not), the
optimizer's state and the LR scheduler's. `Trainer.save` / `Trainer.load_latest` call these.

Writing is atomic: DCP writes into a hidden `.step_00000012.partial`; the ranks then read
the files back (each rank a share of them) and record each file's size and SHA-256 in
`checksums.json`; rank 0 reads DCP's `.metadata` back and only then renames the directory
to `step_00000012` (replacing an older one of the same step). A run killed while saving
leaves only a partial directory, which nothing reads and the next save removes.

Loading verifies: `load_latest_checkpoint` takes the newest `step_*` directory whose files
all match `checksums.json` (each rank checks a share; one all-gather gives every rank every
verdict, so all ranks load the same checkpoint or all raise); a corrupt, truncated or
incomplete one is skipped with a one-line reason naming it, and the next older one is tried.
If checkpoints exist but none is intact: `CheckpointError`.

Why by hand: DCP records no checksum and publishes a directory in place, file by file; a
data file with random bytes in it loads without error (the resumed run trains on garbage),
and a truncated one fails deep inside its reader. SHA-256 (`hashlib`): any tool can check
it (`sha256sum FILE`), and it reads at disk speed (measured in docs/train.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

CHECKSUMS = "checksums.json"


class CheckpointError(RuntimeError):
    """No intact checkpoint to resume from, or one could not be written; the message names
    the checkpoints and what is wrong with each."""


def _state(master: torch.nn.Module, optimizer, scheduler) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(master, optimizer)
    return {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict()}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _one(value):
    """`value` as rank 0 has it, on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _everyone(value) -> list:
    """`value` of every rank, by rank, on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def save_checkpoint(
    directory: str | Path, step: int, master: torch.nn.Module, optimizer, scheduler
) -> Path:
    """Save `master`, `optimizer` and `scheduler` after `step` steps (every rank calls it);
    returns the directory, published once complete and checksummed (module docstring).
    A failure on any rank (a full disk, say) is a `CheckpointError` on every rank, and
    nothing is published."""
    import torch.distributed.checkpoint as dcp

    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(directory)
    final = root / f"step_{step:08d}"
    partial = root / f".{final.name}.partial"
    if rank == 0:  # saves killed before they were published
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".step_*.partial"):
            shutil.rmtree(stale)
    dist.barrier()
    try:  # DCP gathers every rank's failures and raises them on every rank
        dcp.save(_state(master, optimizer, scheduler), checkpoint_id=str(partial))
    except dcp.CheckpointException as e:
        failed, (error, _) = min(e.failures.items())
        raise CheckpointError(_unsaved(final, f"rank {failed}: {_line(error)}")) from None
    names = _one(sorted(p.name for p in partial.iterdir()) if rank == 0 else None)
    try:
        mine = {n: {"bytes": (partial / n).stat().st_size, "sha256": _sha256(partial / n)}
                for n in names[rank::world]}  # fmt: skip
    except OSError as e:
        mine = f"rank {rank}: {_line(e)}"
    shares = _everyone(mine)
    problem = next((share for share in shares if isinstance(share, str)), None)
    if rank == 0 and problem is None:
        try:
            _publish(partial, final, {n: v for share in shares for n, v in share.items()})
        except OSError as e:
            problem = f"rank 0: {_line(e)}"
    problem = _one(problem)  # every rank learns whether it was published
    if problem:
        raise CheckpointError(_unsaved(final, problem))
    return final


def _line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"


def _unsaved(final: Path, problem: str) -> str:
    free = shutil.disk_usage(final.parent).free / 2**20
    return (
        f"checkpoint {final} not written ({problem}); nothing was published, older "
        f"checkpoints are intact; {free:.0f} MiB free there"
    )


def _publish(partial: Path, final: Path, files: dict) -> None:
    """Rank 0: read DCP's index back, write `checksums.json`, rename `partial` to `final`."""
    import torch.distributed.checkpoint as dcp

    dcp.FileSystemReader(str(partial)).read_metadata()
    with (partial / CHECKSUMS).open("w") as f:
        json.dump({"files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(partial)
    if final.exists():  # an older save of this step (a run resumed from before it)
        old = final.with_name(f".{final.name}.replaced")
        final.rename(old)
        partial.rename(final)
        shutil.rmtree(old)
    else:
        partial.rename(final)
    _fsync_dir(final.parent)


def verify_checkpoint(path: str | Path, *, share: tuple[int, int] = (0, 1)) -> str | None:
    """What is wrong with checkpoint directory `path`, in one line, or None when every file
    that `checksums.json` lists has its recorded size and SHA-256. `share` = (i, n): check
    only files i, i + n, i + 2n, ... of the sorted list (rank i of n ranks)."""
    path = Path(path)
    try:
        listed = json.loads((path / CHECKSUMS).read_text())["files"]
    except FileNotFoundError:
        return f"no {CHECKSUMS} (not completely written, or by an older upipe)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{CHECKSUMS} is unreadable ({type(e).__name__}: {e})"
    i, n = share
    for name in sorted(listed)[i::n]:
        want, file = listed[name], path / name
        try:
            size = file.stat().st_size
            if size != want["bytes"]:
                return f"{name} has {size} bytes, {want['bytes']} were written (truncated?)"
            if _sha256(file) != want["sha256"]:
                return f"{name} is corrupt (its SHA-256 differs from {CHECKSUMS})"
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as e:
            return f"{name} is unreadable ({e})"
    return None


def newest_intact_checkpoint(directory: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under `directory` that every rank verified (None if there is
    none), and one line per newer one skipped ("DIR/step_N: what is wrong"). A collective:
    rank 0 lists the candidates, each rank checks its share of each, all see every verdict."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(directory)
    listed = sorted(
        (p for p in root.glob("step_*") if p.name[5:].isdigit()) if root.is_dir() else (),
        reverse=True,
    )
    candidates = _one([str(p) for p in listed] if rank == 0 else None)
    skipped = []
    for path in map(Path, candidates):
        problems = [p for p in _everyone(verify_checkpoint(path, share=(rank, world))) if p]
        if not problems:
            return path, skipped
        skipped.append(f"{path}: {problems[0]}")
    return None, skipped


def load_latest_checkpoint(
    directory: str | Path,
    master: torch.nn.Module,
    optimizer,
    scheduler,
) -> tuple[int | None, list[str]]:
    """Load the newest intact checkpoint under `directory` into `master`, `optimizer` and
    `scheduler` (`newest_intact_checkpoint`). Returns its step (None, nothing loaded, if
    the directory holds no checkpoint) and the newer ones skipped, one line each;
    `CheckpointError` if there are checkpoints but none is intact. The scheduler gets the
    saved state, its schedule included (`upipe.train.loop.LRSchedule`); the caller sets the
    next rate (`Trainer.load_latest`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path, skipped = newest_intact_checkpoint(directory)
    if path is None:
        if skipped:
            raise CheckpointError(
                f"no intact checkpoint to resume from in {directory}: "
                + "; ".join(skipped)
                + " (move them away to start over)"
            )
        return None, []
    state = _state(master, optimizer, scheduler)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        master,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    scheduler.load_state_dict(state["scheduler"])
    return int(path.name.split("_")[1]), skipped
