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

`shard_sequence` / `unshard_sequence` cut a full sequence into the contiguous layout used
above and gather it back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _size(group) -> int:
    return dist.get_world_size(group)


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
    del send_CBLhd
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
    del send_CBLhd
    # a copy, except when h = 1 where reshape may return a strided view: make it contiguous
    return recv_CBLhd.permute(1, 2, 0, 3, 4).reshape(B, S // C, C * h, d).contiguous()


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


def shard_sequence(t: torch.Tensor, *, group, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous block of `t` along `dim` (rank r gets block r of C equal blocks).

    `t` is the full tensor, identical on every rank. Returns a contiguous copy.
    """
    C, r = _size(group), dist.get_rank(group)
    n = t.shape[dim]
    if n % C:
        raise ValueError(
            f"sequence length {n} (dim {dim}) is not divisible by the group size {C}; "
            f"pad it to a multiple of {C} (e.g. {n + (-n) % C})"
        )
    return t.narrow(dim, r * (n // C), n // C).contiguous()


def unshard_sequence(t: torch.Tensor, *, group, dim: int = 1) -> torch.Tensor:
    """Gather the contiguous blocks of all ranks back into the full tensor along `dim`.

    The inverse of `shard_sequence`; not differentiable (use it for outputs and checks).
    """
    C = _size(group)
    if C == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(C)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
