"""Run one rank of a C-rank job in this process, with no peers: the fake process group.

Under `fake_process_group(C)` collectives return at once without moving data (received
buffers keep whatever they held), so values are meaningless but every tensor is allocated
and freed exactly as on rank `rank` of a real C-rank job -- with no communication thread
deciding when buffers are released. That makes per-rank peak memory exact and repeatable,
and with `torch._subclasses.FakeTensorMode` it needs no real memory at all.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """Initialise the default process group as the fake backend for the `with` block."""
    if dist.is_initialized():
        raise RuntimeError(
            "a default process group already exists; simulate in a process of its own"
        )
    dist.init_process_group("fake", rank=rank, world_size=world_size)  # built into torch 2.13
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
