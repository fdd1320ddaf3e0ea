"""Communication primitives; every function takes its process group explicitly.

Legend: B batch, S full sequence, L = S / C local tokens, H heads (query or kv),
h = H / C heads per rank, d head dim, C group size.

Sequence <-> head all-to-all (the Ulysses exchange). Rank r of the group holds the
contiguous token block r (tokens r*L .. (r+1)*L-1):

    seq_to_head:  x_BLHd  [B, L, H, d] -> x_BShd [B, S, H/C, d]
                  rank r keeps heads r*h .. (r+1)*h-1, for all S tokens
    head_to_seq:  x_BShd  [B, S, H/C, d] -> x_BLHd [B, L, H, d]     (the inverse)

Each is the other's backward (an all-to-all is a permutation of blocks), which is what
`SeqToHead` / `HeadToSeq` implement for autograd. gloo and NCCL split `all_to_all_single`
along dim 0 only, so the destination rank is moved to dim 0 in the send buffer.

Sequence layouts (`shard_sequence` / `unshard_sequence` / `sequence_positions`), for S
tokens on C ranks:

    "contiguous": rank r holds block r of C equal blocks (tokens r*L .. (r+1)*L-1); the
                  layout of the all-to-alls above.
    "zigzag":     the sequence is cut into 2C chunks of L/2 tokens; rank r holds chunks r
                  and 2C-1-r, concatenated. Under a causal mask every rank then does the
                  same amount of work in ring attention (an early and a late chunk each).

Ring exchange (ring attention): `ring_send_recv(t, group)` sends t to rank r+1 and receives
rank r-1's tensor of the same shape, asynchronously; C successive shifts bring every rank's
block past every rank. Not differentiable: ring attention sends its own gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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


def seq_to_head(x_BLHd: torch.Tensor, group) -> torch.Tensor:
    """[B, L, H, d] (my tokens, all heads) -> [B, S, H/C, d] (all tokens, my heads)."""
    C = _size(group)
    if C == 1:
        return x_BLHd
    B, L, H, d = x_BLHd.shape
    # send_CBLhd[c] = my tokens for the heads of rank c
    send_CBLhd = x_BLHd.unflatten(2, (C, H // C)).permute(2, 0, 1, 3, 4).contiguous()
    recv_CBLhd = torch.empty_like(send_CBLhd)  # recv[c] = rank c's tokens for my heads
    dist.all_to_all_single(recv_CBLhd, send_CBLhd, group=group)
    _release(send_CBLhd, keep=x_BLHd)
    return recv_CBLhd.transpose(0, 1).reshape(B, C * L, H // C, d)


def head_to_seq(x_BShd: torch.Tensor, group) -> torch.Tensor:
    """[B, S, H/C, d] (all tokens, my heads) -> [B, L, H, d] (my tokens, all heads)."""
    C = _size(group)
    if C == 1:
        return x_BShd
    B, S, h, d = x_BShd.shape
    # send_CBLhd[c] = rank c's tokens for my heads
    send_CBLhd = x_BShd.unflatten(1, (C, S // C)).transpose(0, 1).contiguous()
    recv_CBLhd = torch.empty_like(send_CBLhd)  # recv[c] = my tokens for the heads of rank c
    dist.all_to_all_single(recv_CBLhd, send_CBLhd, group=group)
    _release(send_CBLhd, keep=x_BShd)
    # a copy (made contiguous: when h = 1, reshape may return a strided view of recv)
    out_BLHd = recv_CBLhd.permute(1, 2, 0, 3, 4).reshape(B, S // C, C * h, d).contiguous()
    _release(recv_CBLhd, keep=out_BLHd)
    return out_BLHd


class SeqToHead(torch.autograd.Function):
    """Differentiable `seq_to_head`; its backward is `head_to_seq` of the gradient."""

    @staticmethod
    def forward(ctx, x_BLHd, group):
        ctx.group = group
        return seq_to_head(x_BLHd, group)

    @staticmethod
    def backward(ctx, grad_BShd):
        return head_to_seq(grad_BShd, ctx.group), None


class HeadToSeq(torch.autograd.Function):
    """Differentiable `head_to_seq`; its backward is `seq_to_head` of the gradient."""

    @staticmethod
    def forward(ctx, x_BShd, group):
        ctx.group = group
        return head_to_seq(x_BShd, group)

    @staticmethod
    def backward(ctx, grad_BLHd):
        return seq_to_head(grad_BLHd, ctx.group), None


LAYOUTS = ("contiguous", "zigzag")


def _chunks(n: int, C: int, layout: str, dim: int | None) -> int:
    """Number of chunks the layout cuts a length-n sequence into; ValueError if it can't."""
    where = "" if dim is None else f" (dim {dim})"
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; choose one of {LAYOUTS}")
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


def shard_sequence(
    t: torch.Tensor, *, group, dim: int = 1, layout: str = "contiguous"
) -> torch.Tensor:
    """This rank's part of `t` along `dim` in `layout` (see the module docstring).

    "contiguous": block r of C equal blocks; "zigzag": chunks r and 2C-1-r of 2C equal
    chunks, concatenated. `t` is the full tensor, identical on every rank. Returns a
    contiguous copy.
    """
    C, r = _size(group), dist.get_rank(group)
    n = t.shape[dim]
    c = n // _chunks(n, C, layout, dim)
    if layout == "contiguous":
        return t.narrow(dim, r * c, c).contiguous()
    return torch.cat((t.narrow(dim, r * c, c), t.narrow(dim, (2 * C - 1 - r) * c, c)), dim)


def unshard_sequence(
    t: torch.Tensor, *, group, dim: int = 1, layout: str = "contiguous"
) -> torch.Tensor:
    """Gather every rank's part back into the full tensor along `dim`, in token order.

    The inverse of `shard_sequence` with the same `layout`; not differentiable (use it for
    outputs and checks).
    """
    C = _size(group)
    L = t.shape[dim]
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; choose one of {LAYOUTS}")
    if layout == "zigzag" and L % 2:
        raise ValueError(
            f"layout='zigzag' needs an even local length (two chunks per rank), got {L} "
            f"(dim {dim}); shard with shard_sequence(..., layout='zigzag')"
        )
    if C == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(C)]
    dist.all_gather(parts, t.contiguous(), group=group)
    if layout == "contiguous":
        return torch.cat(parts, dim=dim)
    # full = chunks 0 .. C-1 (first halves by rank), then C .. 2C-1 (second halves, reversed)
    halves = [p.chunk(2, dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def sequence_positions(
    seq_len: int, *, rank: int, world_size: int, layout: str = "contiguous", device=None
) -> torch.Tensor:
    """Global positions (LongTensor `[L]`) of the tokens rank `rank` holds in `layout`.

    `shard_sequence(x, group=..., layout=layout)` equals `x.index_select(1, positions)`:
    use it to shard position ids and labels consistently with the activations.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of size {world_size}")
    c = seq_len // _chunks(seq_len, world_size, layout, dim=None)
    if layout == "contiguous":
        return torch.arange(rank * c, (rank + 1) * c, device=device)
    last = 2 * world_size - 1 - rank
    return torch.cat(
        (
            torch.arange(rank * c, (rank + 1) * c, device=device),
            torch.arange(last * c, (last + 1) * c, device=device),
        )
    )


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
