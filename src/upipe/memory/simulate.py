"""Run one rank of a C-rank job in this process, with no peers: the fake process group.

Under `fake_process_group(C)` collectives return at once without moving data (received
buffers keep whatever they held), so values are meaningless but every tensor is allocated
and freed exactly as on rank `rank` of a real C-rank job -- with no communication thread
deciding when buffers are released. That makes per-rank peak memory exact and repeatable,
and with `torch._subclasses.FakeTensorMode` it needs no real memory at all.

`CollectiveLog` records what the collectives would move: every collective reaches the
dispatcher as a `c10d` operator (with the fake backend too), so a dispatch mode sees each
call with its buffers and its process group.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from upipe.torch_private import TorchDispatchMode, tree_leaves

# c10d operator -> (collective, index of the argument whose bytes it counts)
_C10D = {
    "alltoall_base_": ("all_to_all", 1),  # (output, input, group, ...): what this rank sends
    "alltoall_": ("all_to_all", 1),
    "_allgather_base_": ("all_gather", 0),  # (output, input, group, ...): the gathered whole
    "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),  # (output, input, ...): the whole input
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
}


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


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective call of this rank."""

    op: str
    """all_to_all, all_gather, reduce_scatter, all_reduce, broadcast, send or recv."""
    nbytes: int
    """Bytes of its whole buffer: what this rank sends (all_to_all, send, its part
    included), the gathered output (all_gather), the input before reduction
    (reduce_scatter), the tensor (all_reduce, broadcast) or what it receives (recv)."""
    ranks: tuple[int, ...]
    """Global ranks of the process group (its size: `len(ranks)`)."""


class CollectiveLog(TorchDispatchMode):
    """Within the block, every collective this process issues is appended to `calls` as a
    `Collective` (and still runs). Collectives `_C10D` does not know (barrier, gather to
    one rank, ...) raise, so none is silently left out."""

    def __init__(self):
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func.__name__.split(".")[0] != "barrier":
            name = func.__name__.split(".")[0]
            if name not in _C10D:
                raise NotImplementedError(f"CollectiveLog: no byte count for c10d.{name}")
            op, index = _C10D[name]
            group = next(a for a in args if isinstance(a, torch.ScriptObject))
            ranks = dist.get_process_group_ranks(dist.ProcessGroup.unbox(group))
            leaves = tree_leaves(args[index])
            nbytes = sum(t.numel() * t.element_size() for t in leaves)
            self.calls.append(Collective(op=op, nbytes=nbytes, ranks=tuple(ranks)))
        return func(*args, **kwargs)
