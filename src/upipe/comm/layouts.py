"""Sequence layouts: which tokens each rank holds, and the shards themselves.

Legend: B batch, S full sequence, L = S / C local tokens, C group size; on a 2-D mesh R ring
ranks, C ulysses ranks, L = S / (R*C), P = C*L tokens per ring rank.

For S tokens on C ranks (`LAYOUTS`):

    "contiguous": rank r holds block r of C equal blocks (tokens r*L .. (r+1)*L-1).
    "zigzag":     the sequence is cut into 2C chunks of L/2 tokens; rank r holds chunks r
                  and 2C-1-r, concatenated. Under a causal mask every rank then does the
                  same amount of work in ring attention (an early and a late chunk each).

    shard_sequence:    t [B, S, ...] (whole, the same on every rank) -> t [B, L, ...], this
                       rank's tokens in `layout` (a copy; backward: local, through slices)
    unshard_sequence:  t [B, L, ...] -> t [B, S, ...] in token order (an all-gather; the
                       inverse; not differentiable: for outputs and checks)
    sequence_positions: the global positions [L] of a rank's tokens, so that
                       shard_sequence(x) == x.index_select(1, positions)

On a 2-D mesh (`mesh=`, see `upipe.mesh`) the sequence is first split over the ring dim in
`layout` (default "zigzag": ring rank i gets chunks i and 2R-1-i of 2R, P tokens), then that
part is split contiguously over the ulysses dim (ulysses rank j: its tokens j*L ..
(j+1)*L-1). The head exchange inside a ulysses group (`upipe.comm.exchange.seq_to_head`)
then gathers exactly the ring rank's part, in order -- the layout that ring attention over
the ring group expects:

    x_BLHd [B, L, H, d] --seq_to_head(ulysses)--> x_BPhd [B, P, H/C, d]  (ring rank's part)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from upipe.mesh import check_mesh, mesh_coordinates

LAYOUTS = ("contiguous", "zigzag")


def check_layout_name(layout) -> None:
    """ValueError unless `layout` is one of LAYOUTS (the one place this error is raised)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; choose one of {LAYOUTS}")


def _chunks(n: int, C: int, layout: str, dim: int | None) -> int:
    """Number of chunks the layout cuts a length-n sequence into; ValueError if it can't."""
    where = "" if dim is None else f" (dim {dim})"
    check_layout_name(layout)
    if layout == "contiguous":
        if n % C:
            raise ValueError(
                f"sequence length {n}{where} is not divisible by the group size {C}; "
                f"pad it to a multiple of {C} (e.g. {n + (-n) % C})"
            )
        return C
    if n % (2 * C):
        raise ValueError(
            f"sequence length {n}{where} is not divisible by 2 * group size = {2 * C} "
            f"(layout='zigzag' cuts it into 2C chunks); pad it to a multiple of {2 * C} "
            f"(e.g. {n + (-n) % (2 * C)}) or use layout='contiguous'"
        )
    return 2 * C


def _check_mesh_length(n: int, R: int, C: int, layout: str, dim: int | None) -> None:
    """ValueError unless a length-n sequence splits over R ring x C ulysses ranks."""
    check_layout_name(layout)
    m = R * (C if layout == "contiguous" else math.lcm(2, C))  # ring chunks, then C parts
    if n % m:
        where = "" if dim is None else f" (dim {dim})"
        how = "2R chunks" if layout == "zigzag" else "R parts"
        raise ValueError(
            f"sequence length {n}{where} does not split over ring {R} x ulysses {C} in "
            f"layout={layout!r} (the ring dim cuts it into {how}, each ring part is split "
            f"over {C} ulysses ranks); pad it to a multiple of {m} (e.g. {n + (-n) % m})"
        )


def _layout_and_groups(group, mesh, layout):
    """Resolve the group/mesh arguments: (layout, [(size, rank, group, layout)] outer first)."""
    if (group is None) == (mesh is None):
        raise ValueError("pass exactly one of group= (1-D) or mesh= (2-D: ring x ulysses)")
    if group is not None:
        layout = layout or "contiguous"
        return layout, [(dist.get_world_size(group), dist.get_rank(group), group, layout)]
    R, C = check_mesh(mesh)
    i, j = mesh_coordinates(mesh)
    layout = layout or "zigzag"
    ring, ulysses = mesh["ring"].get_group(), mesh["ulysses"].get_group()
    return layout, [(R, i, ring, layout), (C, j, ulysses, "contiguous")]


def _shard(t, C, r, dim, layout):
    c = t.shape[dim] // _chunks(t.shape[dim], C, layout, dim)
    if layout == "contiguous":
        return t.narrow(dim, r * c, c)
    return torch.cat((t.narrow(dim, r * c, c), t.narrow(dim, (2 * C - 1 - r) * c, c)), dim)


def shard_sequence(
    t: torch.Tensor, *, group=None, mesh=None, dim: int = 1, layout: str | None = None
) -> torch.Tensor:
    """This rank's part of `t` along `dim` in `layout` (see the module docstring).

    group= (1-D; default layout "contiguous"): block r of C equal blocks, or with "zigzag"
    chunks r and 2C-1-r of 2C equal chunks, concatenated. mesh= (2-D; default "zigzag"):
    the ring rank's part in `layout`, then this ulysses rank's contiguous block of it.
    Exactly one of group/mesh. `t` is the full tensor, identical on every rank. Returns a
    contiguous copy: `[B, S, ...] -> [B, L, ...]` (dim 1). No communication; backward (local
    autograd through slices) puts the gradient at this rank's tokens, zeros elsewhere.
    """
    layout, levels = _layout_and_groups(group, mesh, layout)
    if mesh is not None:
        _check_mesh_length(t.shape[dim], levels[0][0], levels[1][0], layout, dim)
    for C, r, _, level_layout in levels:
        t = _shard(t, C, r, dim, level_layout)
    return t.contiguous()


def _unshard(t, C, group, dim, layout):
    if C == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(C)]
    dist.all_gather(parts, t.contiguous(), group=group)
    if layout == "contiguous":
        return torch.cat(parts, dim=dim)
    # full = chunks 0 .. C-1 (first halves by rank), then C .. 2C-1 (second halves, reversed)
    halves = [p.chunk(2, dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def unshard_sequence(
    t: torch.Tensor, *, group=None, mesh=None, dim: int = 1, layout: str | None = None
) -> torch.Tensor:
    """Gather every rank's part back into the full tensor along `dim`, in token order.

    The inverse of `shard_sequence` with the same group or mesh and `layout`: `[B, L, ...]
    -> [B, S, ...]` (dim 1), an all-gather (on a mesh: over the ulysses dim, then over the
    ring dim); not differentiable (use it for outputs and checks).
    """
    layout, levels = _layout_and_groups(group, mesh, layout)
    check_layout_name(layout)
    n = t.shape[dim] * (levels[1][0] if mesh is not None else 1)  # a ring rank's length
    if layout == "zigzag" and n % 2:
        what = f"{t.shape[dim]}" if mesh is None else f"{t.shape[dim]} x ulysses {levels[1][0]}"
        raise ValueError(
            f"layout='zigzag' needs an even local length (two chunks per rank), got {what} "
            f"(dim {dim}); shard with shard_sequence(..., layout='zigzag')"
        )
    for C, _, g, level_layout in reversed(levels):
        t = _unshard(t, C, g, dim, level_layout)
    return t


def _positions(n: int, C: int, r: int, layout: str, device) -> torch.Tensor:
    c = n // _chunks(n, C, layout, dim=None)
    if layout == "contiguous":
        return torch.arange(r * c, (r + 1) * c, device=device)
    last = 2 * C - 1 - r
    return torch.cat(
        (
            torch.arange(r * c, (r + 1) * c, device=device),
            torch.arange(last * c, (last + 1) * c, device=device),
        )
    )


def sequence_positions(
    seq_len: int,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    mesh=None,
    layout: str | None = None,
    device=None,
) -> torch.Tensor:
    """Global positions (LongTensor `[L]`) of the tokens a rank holds in `layout`.

    Either rank= and world_size= (1-D; default layout "contiguous"), or mesh= (2-D, this
    rank's place in the mesh; default "zigzag"). `shard_sequence(x, group=..., layout=...)`
    (or `mesh=...`) equals `x.index_select(1, positions)`: use it to shard position ids and
    labels consistently with the activations.
    """
    if mesh is not None:
        if rank is not None or world_size is not None:
            raise ValueError("pass either rank= and world_size= (1-D) or mesh= (2-D), not both")
        R, C = check_mesh(mesh)
        i, j = mesh_coordinates(mesh)
        layout = layout or "zigzag"
        _check_mesh_length(seq_len, R, C, layout, dim=None)
        part = _positions(seq_len, R, i, layout, device)
        return part.narrow(0, j * (part.numel() // C), part.numel() // C)
    if rank is None or world_size is None:
        raise ValueError("pass rank= and world_size= (1-D) or mesh= (2-D)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of size {world_size}")
    return _positions(seq_len, world_size, rank, layout or "contiguous", device)
