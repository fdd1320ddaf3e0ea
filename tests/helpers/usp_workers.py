"""Per-rank functions for the 2-D mesh tests (USP, UPipe on a mesh, the mesh layout)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from workers import MODULE_ARGS, make_module_inputs, make_qkv, make_weights

import upipe
from upipe.attention.common import forget_agreements
from upipe.comm import seq_to_head, sequence_positions, shard_sequence, unshard_sequence


def mesh_of(dims):
    """The (dp, ring, ulysses) mesh (`make_mesh` returns the one made earlier while its
    groups live; the groups a test makes end after it, `tests/conftest.py`)."""
    dp, ring, ulysses = dims
    return upipe.make_mesh(ulysses=ulysses, ring=ring, dp=dp)


def run_mesh_functional(rank, world_size, dims, strategy, shape, kwargs, dtype=torch.float32):
    """Forward+backward of usp_attention or upipe_attention(mesh=) on this rank's part.

    Each dp replica gets its own data (seed = dp rank). Returns (dp rank, this rank's token
    positions, [out, dq, dk, dv] as fp64).
    """
    mesh = mesh_of(dims)
    dp = mesh.get_local_rank("dp")
    layout = kwargs.get("layout", "zigzag")
    q, k, v, dout = make_qkv(**shape, seed=dp, dtype=dtype)
    leaves = [shard_sequence(t, mesh=mesh, layout=layout).requires_grad_() for t in (q, k, v)]
    out = getattr(upipe, f"{strategy}_attention")(*leaves, mesh=mesh, **kwargs)
    out.backward(shard_sequence(dout, mesh=mesh, layout=layout))
    pos = sequence_positions(shape["S"], mesh=mesh, layout=layout)
    return dp, pos, [t.detach().double() for t in (out, *(x.grad for x in leaves))]


def run_mesh_module(rank, world_size, dims, cfg, kwargs):
    """Forward+backward of ContextParallelAttention(mesh=) on this rank's part.

    Returns this rank's positions, its y and dx rows and its weight-gradient contributions.
    """
    mesh = mesh_of(dims)
    layout = kwargs.get("layout")
    x, dy, pos_ids = make_module_inputs(**cfg)
    layer = upipe.ContextParallelAttention(*(cfg.get(a) for a in MODULE_ARGS), mesh=mesh, **kwargs)
    with torch.no_grad():
        for n, t in make_weights(cfg).items():
            getattr(layer, n).weight.copy_(t)
    xs = shard_sequence(x, mesh=mesh, layout=layout).requires_grad_()
    y = layer(xs, shard_sequence(pos_ids, mesh=mesh, layout=layout))
    y.backward(shard_sequence(dy, mesh=mesh, layout=layout))
    grads = {n: getattr(layer, n).weight.grad.double() for n in ("q_proj", "k_proj", "v_proj")}
    grads["o_proj"] = layer.o_proj.weight.grad.double()
    pos = sequence_positions(cfg["S"], mesh=mesh, layout=layout)
    return {"pos": pos, "y": y.detach().double(), "dx": xs.grad.double(), **grads}


def mesh_layout(rank, world_size, dims, B, S):
    """Both layouts on the mesh: round trips, positions, and what the ulysses gather holds."""
    mesh = mesh_of(dims)
    R, U = mesh["ring"].size(), mesh["ulysses"].size()
    ring_rank = mesh.get_local_rank("ring")
    full = torch.arange(B * S * 3, dtype=torch.float64).view(B, S, 3)  # value = its index
    out = {}
    for layout in ("zigzag", "contiguous"):
        part = shard_sequence(full, mesh=mesh, layout=layout)
        pos = sequence_positions(S, mesh=mesh, layout=layout)
        # token positions as a [1, L, U, 1] tensor, exchanged like q: after seq_to_head every
        # rank holds its ring rank's P = U * L tokens
        pos_BLHd = pos.double()[None, :, None, None].expand(1, -1, U, 1).contiguous()
        gathered = seq_to_head(pos_BLHd, mesh["ulysses"].get_group())[0, :, 0, 0].long()
        full_t = full.transpose(1, 2)
        out[layout] = {
            "pos": pos,
            "roundtrip_exact": torch.equal(unshard_sequence(part, mesh=mesh, layout=layout), full),
            "positions_match": torch.equal(part, full.index_select(1, pos)),
            "dim2_exact": torch.equal(
                unshard_sequence(
                    shard_sequence(full_t, mesh=mesh, dim=2, layout=layout),
                    mesh=mesh,
                    dim=2,
                    layout=layout,
                ),
                full_t,
            ),
            "gathered": gathered,
            "ring_positions": sequence_positions(S, rank=ring_rank, world_size=R, layout=layout),
        }
    out["default_is_zigzag"] = torch.equal(
        shard_sequence(full, mesh=mesh), shard_sequence(full, mesh=mesh, layout="zigzag")
    )
    out["coords"] = (mesh.get_local_rank("dp"), ring_rank, mesh.get_local_rank("ulysses"))
    return out


def _error(call):
    forget_agreements()  # a first call: ranks whose inputs differ must exchange verdicts
    try:
        call()
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


def make_mesh_errors(rank, world_size):
    """make_mesh with bad degrees: (type, message) per case (world size 4)."""
    cases = {
        "product": dict(ulysses=3),
        "product dp": dict(ulysses=2, ring=1, dp=3),
        "product neither": dict(ulysses=3, ring=3, dp=1),
        "zero": dict(ulysses=2, ring=0),
        "bool": dict(ulysses=True),
        "float": dict(ulysses=2.0, ring=2),
    }
    return {name: _error(lambda kw=kw: upipe.make_mesh(**kw)) for name, kw in cases.items()}


def meshes_made(rank, world_size):
    """make_mesh called again with the same degrees, with others, and after the groups of the
    first ended: (same mesh?, new groups of each call), with `dist.destroy_process_group`."""
    from upipe.torch_private import process_groups

    def groups_of(call):
        before = len(process_groups())
        return call(), len(process_groups()) - before

    first, made = groups_of(lambda: upipe.make_mesh(ulysses=2, ring=2))
    again, made_again = groups_of(lambda: upipe.make_mesh(ulysses=2, ring=2))
    other, made_other = groups_of(lambda: upipe.make_mesh(ulysses=4))
    for group in process_groups():
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    after, made_after = groups_of(lambda: upipe.make_mesh(ulysses=2, ring=2))
    dist.all_reduce(torch.ones(1), group=after.get_group("ring"))  # its groups work
    return {
        "again": (again is first, made_again),
        "other": (other is not first, made_other),
        "after end": (after is not first, made_after == made),
        "first": made,
    }


def mesh_call_errors(rank, world_size):
    """Bad group/mesh arguments and inputs on a 2x2 mesh: (type, message) per case, or None.

    Every case is called on every rank; a case that raised on some ranks only would hang the
    next collective (and time the test out).
    """
    mesh, world = mesh_of((1, 2, 2)), dist.group.WORLD
    ok = torch.randn(1, 4, 4, 8)  # [B, L, H, d]
    mine = torch.randn(1, 6 if rank == 3 else 4, 4, 8)  # rank 3's local length differs
    cases = {
        "shard neither": lambda: shard_sequence(torch.zeros(1, 8)),
        "shard both": lambda: shard_sequence(torch.zeros(1, 8), group=world, mesh=mesh),
        "shard length": lambda: shard_sequence(torch.zeros(1, 6), mesh=mesh),
        "unshard both": lambda: unshard_sequence(torch.zeros(1, 2), group=world, mesh=mesh),
        "positions both": lambda: sequence_positions(8, rank=0, world_size=4, mesh=mesh),
        "positions neither": lambda: sequence_positions(8),
        "usp not a mesh": lambda: upipe.usp_attention(ok, ok, ok, mesh=world),
        "usp heads": lambda: upipe.usp_attention(*(torch.randn(1, 4, 1, 8),) * 3, mesh=mesh),
        "usp kv heads": lambda: upipe.usp_attention(ok, *(torch.randn(1, 4, 3, 8),) * 2, mesh=mesh),
        "usp one rank differs": lambda: upipe.usp_attention(mine, mine, mine, mesh=mesh),
        "upipe both": lambda: upipe.upipe_attention(ok, ok, ok, group=world, mesh=mesh),
        "upipe layout on group": lambda: upipe.upipe_attention(
            ok, ok, ok, group=world, layout="diagonal"
        ),
        "upipe heads_per_stage": lambda: upipe.upipe_attention(
            ok, ok, ok, mesh=mesh, heads_per_stage=3
        ),
        "module both": lambda: upipe.ContextParallelAttention(16, 4, 2, group=world, mesh=mesh),
        "module layout on group": lambda: upipe.ContextParallelAttention(
            16, 4, 2, group=world, layout="diagonal"
        ),
        "module heads": lambda: upipe.ContextParallelAttention(
            16, 1, 1, mesh=mesh, strategy="ulysses"
        ),
    }
    return {name: _error(call) for name, call in cases.items()}


def mesh_replica_errors(rank, world_size):
    """On a dp=2 x ulysses=2 mesh: replicas may differ in shape; an error in one replica
    reaches every rank of the mesh."""
    mesh = mesh_of((2, 1, 2))
    dp = mesh.get_local_rank("dp")
    t = torch.randn(1, 4 + 2 * dp, 4, 8)  # replica 1 has longer shards: fine
    bad = torch.randn(1, 4, 1 if rank == 3 else 4, 8)  # rank 3 (replica 1): 1 head on 2 ranks
    return {
        "replicas differ": _error(lambda: upipe.usp_attention(t, t, t, mesh=mesh)),
        "one replica bad": _error(lambda: upipe.usp_attention(bad, bad, bad, mesh=mesh)),
    }


def mesh_functional_or_error(rank, world_size, dims, strategy, shape, kwargs):
    """run_mesh_functional, or (error type name, message) for a TypeError/ValueError."""
    try:
        return run_mesh_functional(rank, world_size, dims, strategy, shape, kwargs)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
