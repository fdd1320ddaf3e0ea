"""Communication primitives; every function takes its process group explicitly.

Legend: B batch, S full sequence, L = S / C local tokens, H heads (query or kv),
h = H / C heads per rank, d head dim, C group size.

Sequence <-> head all-to-all (the Ulysses exchange). Rank r of the group holds the
contiguous token block r (tokens r*L .. (r+1)*L-1):

    seq_to_head:  x_BLHd  [B, L, H, d] -> x_BShd [B, S, H/C, d]
                  rank r keeps heads r*h .. (r+1)*h-1, for all S tokens
    head_to_seq:  x_BShd  [B, S, H/C, d] -> x_BLHd [B, L, H, d]     (the inverse)

Each is the other's backward (an all-to-all is a permutation of blocks): the strategies'
backwards call the inverse exchange on the gradients. gloo and NCCL split `all_to_all_single`
along dim 0 only, so the destination rank is moved to dim 0 in the send buffer.

Sequence layouts (`shard_sequence` / `unshard_sequence` / `sequence_positions`), for S
tokens on C ranks:

    "contiguous": rank r holds block r of C equal blocks (tokens r*L .. (r+1)*L-1); the
                  layout of the all-to-alls above.
    "zigzag":     the sequence is cut into 2C chunks of L/2 tokens; rank r holds chunks r
                  and 2C-1-r, concatenated. Under a causal mask every rank then does the
                  same amount of work in ring attention (an early and a late chunk each).

On a 2-D mesh (`mesh=`, see `upipe.mesh`; R ring ranks, C ulysses ranks, L = S / (R*C),
P = C*L) the sequence is first split over the ring dim in `layout` (default "zigzag": ring
rank i gets chunks i and 2R-1-i of 2R, P tokens), then that part is split contiguously over
the ulysses dim (ulysses rank j: its tokens j*L .. (j+1)*L-1). `seq_to_head` inside a
ulysses group then gathers exactly the ring rank's part, in order -- the layout that ring
attention over the ring group expects:

    x_BLHd [B, L, H, d] --seq_to_head(ulysses)--> x_BPhd [B, P, H/C, d]  (ring rank's part)

Ring exchange (ring attention): `ring_send_recv(t, group)` sends t to rank r+1 and receives
rank r-1's tensor of the same shape, asynchronously; C successive shifts bring every rank's
block past every rank. Not differentiable: ring attention sends its own gradients.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from upipe.mesh import check_mesh, mesh_coordinates


def _size(group) -> int:
    return dist.get_world_size(group)


def _release(buf: torch.Tensor, *, keep: torch.Tensor) -> None:
    """Free a finished collective's buffer now, on CPU. gloo's work object keeps a reference
    to its tensors for a while after the call returns and drops it on its own thread, which
    would keep the memory alive for a thread-timing-dependent time. On CUDA the collective may
    still be running on its stream when the call returns, so the buffer is left to the
    process group (which keeps it alive until the work completes). `keep` (the caller's
    input or result) is never freed, even where `buf` turned out to share its storage."""
    storage = buf.untyped_storage()
    if buf.device.type == "cpu" and storage._cdata != keep.untyped_storage()._cdata:
        storage.resize_(0)


class Pending:
    """An exchange in flight (`async_op=True`): `wait()` returns its result. Until then the
    collective may still run (on CUDA: on the process group's stream, while the caller's
    stream goes on computing); `wait()` orders the caller's stream after it."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self):
        if self._work is not None:
            self._work.wait()
        finish, self._finish = self._finish, None
        return finish()


class Done(Pending):
    """A result that needs no waiting (C = 1, or a synchronous exchange)."""

    def __init__(self, result):
        super().__init__(None, lambda: result)


class Together(Pending):
    """Several pending exchanges as one: `wait()` returns their results as a tuple."""

    def __init__(self, *parts: Pending):
        super().__init__(None, lambda: tuple(p.wait() for p in parts))


def _exchange(send_CB, group, async_op, finish, keep, splits=None):
    """all_to_all_single of `send_CB` (destination rank first) into a new buffer, then
    `finish(recv_CB)`; with `async_op` as a `Pending`. The send buffer is released once the
    exchange is done (`_release`; never `keep`'s storage, the caller's input).
    `splits`: (elements sent to each rank, elements received from each rank) of a flat
    `send_CB` whose blocks differ in size (`upipe.comm_uneven`); None: C equal blocks."""
    if splits is None:
        recv_CB = torch.empty_like(send_CB)
        sizes = {}
    else:
        in_splits, out_splits = (list(x) for x in splits)
        recv_CB = send_CB.new_empty(sum(out_splits))
        sizes = dict(output_split_sizes=out_splits, input_split_sizes=in_splits)
    work = dist.all_to_all_single(recv_CB, send_CB, group=group, async_op=async_op, **sizes)

    def done():
        _release(send_CB, keep=keep)
        return finish(recv_CB)

    return Pending(work, done) if async_op else done()


def seq_to_head(x_BLHd: torch.Tensor, group, layout: str = "contiguous", *, async_op: bool = False):
    """[B, L, H, d] (my tokens, all heads) -> [B, S, H/C, d] (all tokens, my heads).

    The tokens come out in sequence order: with layout="zigzag" (rank r holds chunks r and
    2C-1-r) the received chunks are put back in order (one copy). With `async_op` returns a
    `Pending` whose `wait()` gives the result.
    """
    C = _size(group)
    if C == 1:
        return Done(x_BLHd) if async_op else x_BLHd
    B, L, H, d = x_BLHd.shape
    # send_CBLhd[c] = my tokens for the heads of rank c
    send_CBLhd = x_BLHd.unflatten(2, (C, H // C)).permute(2, 0, 1, 3, 4).contiguous()

    def finish(recv_CBLhd):  # recv[c] = rank c's tokens for my heads
        return _in_sequence_order(recv_CBLhd, layout)

    return _exchange(send_CBLhd, group, async_op, finish, keep=x_BLHd)


def _in_sequence_order(recv_CBLhd: torch.Tensor, layout: str) -> torch.Tensor:
    """[C, B, L, h, d] (rank c's tokens for my heads) -> [B, S, h, d] in sequence order;
    the received buffer is released where a copy was made (zigzag)."""
    C, B, L, h, d = recv_CBLhd.shape
    if layout == "zigzag":  # chunk c < C is rank c's first half, chunk 2C-1-c its second
        halves_C2BLhd = recv_CBLhd.unflatten(2, (2, L // 2)).transpose(1, 2)
        chunks_2CBLhd = torch.cat([halves_C2BLhd[:, 0], halves_C2BLhd[:, 1].flip(0)])
        _release(recv_CBLhd, keep=chunks_2CBLhd)
        return chunks_2CBLhd.transpose(0, 1).reshape(B, C * L, h, d)
    return recv_CBLhd.transpose(0, 1).reshape(B, C * L, h, d)


def head_to_seq(x_BShd: torch.Tensor, group, layout: str = "contiguous", *, async_op: bool = False):
    """[B, S, H/C, d] (all tokens in order, my heads) -> [B, L, H, d] (my tokens, all heads),
    my tokens being those of `layout` (the inverse of `seq_to_head`). With `async_op`
    returns a `Pending`."""
    C = _size(group)
    if C == 1:
        return Done(x_BShd) if async_op else x_BShd
    B, S, h, d = x_BShd.shape
    send_CBLhd = _blocks_by_rank(x_BShd, C, layout)

    def finish(recv_CBLhd):  # recv[c] = my tokens for the heads of rank c
        # a copy (made contiguous: when h = 1, reshape may return a strided view of recv)
        out_BLHd = recv_CBLhd.permute(1, 2, 0, 3, 4).reshape(B, S // C, C * h, d).contiguous()
        _release(recv_CBLhd, keep=out_BLHd)
        return out_BLHd

    return _exchange(send_CBLhd, group, async_op, finish, keep=x_BShd)


def _blocks_by_rank(x_BShd: torch.Tensor, C: int, layout: str) -> torch.Tensor:
    """[B, S, h, d] in sequence order -> [C, B, L, h, d], block c = rank c's tokens in
    `layout` (a contiguous copy: the send buffer of the head -> sequence exchange)."""
    S = x_BShd.shape[1]
    if layout == "zigzag":  # rank c's tokens: chunk c, then chunk 2C-1-c
        chunks_B2Cchd = x_BShd.unflatten(1, (2 * C, S // (2 * C)))
        pairs_BC2chd = torch.stack([chunks_B2Cchd[:, :C], chunks_B2Cchd[:, C:].flip(1)], dim=2)
        return pairs_BC2chd.flatten(2, 3).transpose(0, 1).contiguous()
    return x_BShd.unflatten(1, (C, S // C)).transpose(0, 1).contiguous()


@dataclasses.dataclass(frozen=True)
class HeadExchange:
    """The Ulysses exchange over `group` for a sequence sharded in `layout`."""

    group: dist.ProcessGroup
    layout: str = "contiguous"

    def to_head(self, x_BLHd: torch.Tensor, *, async_op: bool = False):
        return seq_to_head(x_BLHd, self.group, self.layout, async_op=async_op)

    def to_seq(self, x_BShd: torch.Tensor, *, async_op: bool = False):
        return head_to_seq(x_BShd, self.group, self.layout, async_op=async_op)


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
        return layout, [(_size(group), dist.get_rank(group), group, layout)]
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
    contiguous copy.
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

    The inverse of `shard_sequence` with the same group or mesh and `layout` (on a mesh: an
    all-gather over the ulysses dim, then over the ring dim); not differentiable (use it for
    outputs and checks).
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


class RingRecv:
    """A pending `ring_send_recv`: `wait()` blocks until both transfers are done and returns
    the received tensor. Holds the sent tensor until then (the transport reads it)."""

    def __init__(self, works, sent: torch.Tensor, received: torch.Tensor):
        self._works, self._sent, self._received = works, sent, received

    def wait(self) -> torch.Tensor:
        for w in self._works:
            w.wait()
        self._works, self._sent = [], None
        return self._received


def ring_send_recv(t: torch.Tensor, group, *, tag: int = 0) -> RingRecv:
    """Send `t` to the next rank of `group` and receive the previous rank's tensor.

    Forward only (not differentiable). Layout: unchanged -- every rank passes a tensor of
    the same shape and dtype; after k successive shifts rank r holds the tensor that rank
    (r - k) mod C started with. Asynchronous: returns at once, with a `RingRecv` whose
    `wait()` gives the received tensor, so compute can overlap the transfer. `t` must not be
    modified until then. Concurrent exchanges (e.g. K/V blocks and their gradients) need
    distinct `tag`s (gloo matches messages by tag; NCCL keeps issue order). With C = 1 the
    rank receives its own `t`.
    """
    C = _size(group)
    if C == 1:
        return RingRecv([], t, t)
    r = dist.get_rank(group)
    sent = t.contiguous()
    received = torch.empty_like(sent)
    ops = [
        dist.P2POp(dist.isend, sent, dist.get_global_rank(group, (r + 1) % C), group, tag),
        dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (r - 1) % C), group, tag),
    ]
    return RingRecv(dist.batch_isend_irecv(ops), sent, received)
