"""The device mesh for 2-D context parallelism, built once; strategies take groups from it.

    mesh = upipe.make_mesh(ulysses=4, ring=2)          # 8 ranks: 2 ring x 4 ulysses
    mesh["ulysses"].get_group()                        # the all-to-all group (heads)
    mesh["ring"].get_group()                           # the ring group (K/V blocks)

Dims are ("dp", "ring", "ulysses"), ulysses innermost: global rank = (dp_rank * ring +
ring_rank) * ulysses + ulysses_rank, so consecutive ranks (one node, the fast links) form a
ulysses group and the ring spans nodes. The sequence layout on a mesh is described in
`upipe.comm`.

Strategies accept any `DeviceMesh` with dims named "ring" and "ulysses" (other dims, such as
"dp", hold independent replicas); `check_mesh` says what is wrong with one that does not fit.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from upipe.torch_private import flatten_mesh, process_groups

MESH_DIMS = ("dp", "ring", "ulysses")
_MESHES: dict[tuple, tuple] = {}  # (device type, dp, ring, ulysses): (mesh, its dims' groups)


def make_mesh(*, ulysses: int, ring: int = 1, dp: int = 1, device_type: str = "cpu") -> DeviceMesh:
    """A `DeviceMesh` of shape (dp, ring, ulysses) with those dim names over all ranks.

    Call it on every rank, after `torch.distributed.init_process_group`; dp * ring *
    ulysses must equal the world size. `device_type` is "cpu" (gloo) or "cuda" (NCCL).

    A later call with the same arguments returns the same mesh while its process groups
    live (none was ended by `destroy_process_group`; `release_meshes`): `init_device_mesh`
    makes new groups on every call, and each holds its own connections (gloo: sockets and
    three threads, one waking every 10 ms; NCCL: a communicator with its device buffers)
    for the life of the process -- a notebook or test that builds one `upipe.train.Trainer`
    after another kept them all.
    """
    degrees = {"dp": dp, "ring": ring, "ulysses": ulysses}
    for name, val in degrees.items():
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if not dist.is_initialized():
        raise ValueError(
            "make_mesh needs the default process group; call "
            "torch.distributed.init_process_group first (e.g. under torchrun)"
        )
    world = dist.get_world_size()
    if dp * ring * ulysses != world:
        if world % (ring * ulysses) == 0:
            fix = f"use dp={world // (ring * ulysses)}"
        elif world % (dp * ring) == 0:
            fix = f"use ulysses={world // (dp * ring)}"
        else:
            fix = f"choose degrees whose product is {world}, e.g. ulysses={world}, ring=1, dp=1"
        raise ValueError(
            f"dp * ring * ulysses = {dp} * {ring} * {ulysses} = {dp * ring * ulysses} must equal "
            f"the world size ({world}); {fix}"
        )
    for stale in [k for k, (_, groups) in _MESHES.items() if not _groups_live(groups)]:
        del _MESHES[stale]  # (it holds its groups: an ended one's connections with them)
    key = (device_type, dp, ring, ulysses)
    if key in _MESHES:
        return _MESHES[key][0]
    mesh = init_device_mesh(device_type, (dp, ring, ulysses), mesh_dim_names=MESH_DIMS)
    _MESHES[key] = (mesh, [mesh.get_group(name) for name in MESH_DIMS])
    return mesh


def release_meshes() -> None:
    """Forget the meshes `make_mesh` keeps for reuse. The cache holds each mesh's process
    groups, so a kept mesh whose groups were ended (`destroy_process_group`) keeps their connections
    (gloo: threads) until the next `make_mesh` call drops it; `LocalCluster.end_groups`
    calls this on its ranks."""
    _MESHES.clear()


def _groups_live(groups: list) -> bool:
    """Whether each of a mesh's process groups (taken when it was made) is still one of this
    process's: not ended, alone or with the default group. (Not by name: names are counted
    afresh once every group has ended, so a name could find another.)"""
    live = process_groups()
    return all(any(group is g for g in live) for group in groups)


def check_mesh(mesh) -> tuple[int, int]:
    """(ring size, ulysses size) of `mesh`; TypeError/ValueError if it is not usable."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
            f"{type(mesh).__name__}; build one with upipe.make_mesh(ulysses=..., ring=...)"
        )
    names = mesh.mesh_dim_names or ()
    if "ring" not in names or "ulysses" not in names:
        raise ValueError(
            f"mesh needs dims named 'ring' and 'ulysses', got {names}; build it with "
            "upipe.make_mesh(ulysses=..., ring=...)"
        )
    return mesh["ring"].size(), mesh["ulysses"].size()


def mesh_coordinates(mesh) -> tuple[int, int]:
    """This rank's (ring rank, ulysses rank) in `mesh`."""
    return mesh.get_local_rank("ring"), mesh.get_local_rank("ulysses")


def validation_group(mesh):
    """(group over every rank of `mesh`, the global ranks of this rank's ring x ulysses block).

    Input checks exchange their verdict over the whole mesh, so that no rank of any replica
    waits in a collective that a failing rank never joins; shapes need only agree within a
    block (the ranks that compute one attention together).
    """
    if mesh.size() == dist.get_world_size():
        group = dist.group.WORLD
    else:  # a sub-mesh: one group over its ranks (created once and cached by the mesh)
        group = flatten_mesh(mesh).get_group()
    names, coord = mesh.mesh_dim_names, mesh.get_coordinate()
    block = tuple(
        slice(None) if n in ("ring", "ulysses") else c for n, c in zip(names, coord, strict=True)
    )
    return group, tuple(mesh.mesh[block].flatten().tolist())
