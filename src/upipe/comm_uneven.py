"""The Ulysses exchange when the ranks get different numbers of heads (H or G not a multiple
of C, e.g. 28 query heads on 8 ranks); every function takes its process group explicitly.

Legend: B batch, S full sequence, L = S / C local tokens, d head dim, C group size,
n heads in the sequence layout (all ranks' heads, listed rank-major), a = counts[r] heads
that this rank r gets; counts[c] heads for rank c, at offsets off_c = counts[0] + ... +
counts[c-1] of the rank-major list.

    seq_to_head_uneven:  x_BLnd [B, L, n, d] -> x_BSad [B, S, a, d]
                         rank c gets heads off_c .. off_c + counts[c] - 1, for all S tokens
    head_to_seq_uneven:  x_BSad [B, S, a, d] -> x_BLnd [B, L, n, d]      (the inverse)

Each is the other's adjoint, so a strategy's backward calls the inverse exchange on the
gradients, as with the even exchange (`upipe.comm.seq_to_head` / `head_to_seq`), which
this equals when every count is the same (and which is used then: `to_head` / `to_seq`
with counts=None). `all_to_all_single` with input and output split sizes on flat buffers
(gloo and NCCL split dim 0 only): the send buffer of `seq_to_head_uneven` is heads-first,
so rank c's block is one contiguous run; what arrives has the even layout (every block
holds this rank's a heads) and is put in sequence order by the even code. A count may be
0 (a rank with no head this stage sends and receives empty blocks).

Which heads a rank gets, and the kv heads shared by neighbouring ranks, is decided above
(`upipe.attention.uneven`): the caller lists the heads rank-major and passes the counts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from upipe.comm import (
    Done,
    HeadExchange,
    _blocks_by_rank,
    _exchange,
    _in_sequence_order,
    _release,
)


def seq_to_head_uneven(x_BLnd, counts, group, layout="contiguous", *, async_op=False):
    """[B, L, n, d] (my tokens; rank c's counts[c] heads, rank-major) -> [B, S, a, d] (all
    tokens in sequence order, my a = counts[rank] heads). `layout` as in `seq_to_head`."""
    C = dist.get_world_size(group)
    if C == 1:
        return Done(x_BLnd) if async_op else x_BLnd
    B, L, n, d = x_BLnd.shape
    assert len(counts) == C and sum(counts) == n, (counts, n)
    a = counts[dist.get_rank(group)]
    per_head = B * L * d
    send_nBLd = x_BLnd.permute(2, 0, 1, 3).contiguous()  # rank c's heads: one run

    def finish(recv):  # block c = rank c's tokens for my heads, [a, B, L, d]
        recv_CBLad = recv.view(C, a, B, L, d).permute(0, 2, 3, 1, 4)
        return _in_sequence_order(recv_CBLad, layout)

    splits_in = [c * per_head for c in counts]
    splits_out = [a * per_head] * C
    splits = (splits_in, splits_out)
    return _exchange(send_nBLd.view(-1), group, async_op, finish, x_BLnd, splits)


def head_to_seq_uneven(x_BSad, counts, group, layout="contiguous", *, async_op=False):
    """[B, S, a, d] (all tokens in order, my heads) -> [B, L, n, d] (my tokens in `layout`,
    every rank's heads, rank-major: the inverse of `seq_to_head_uneven`)."""
    C = dist.get_world_size(group)
    if C == 1:
        return Done(x_BSad) if async_op else x_BSad
    B, S, a, d = x_BSad.shape
    L = S // C
    send_CBLad = _blocks_by_rank(x_BSad, C, layout)
    per_head = B * L * d

    def finish(recv):  # rank c's block: my tokens for its counts[c] heads, [B, L, counts[c], d]
        out_BLnd = recv.new_empty(B, L, sum(counts), d)
        off = 0
        for n_c in counts:
            block = recv.narrow(0, off * per_head, n_c * per_head).view(B, L, n_c, d)
            out_BLnd.narrow(2, off, n_c).copy_(block)
            off += n_c
        _release(recv, keep=out_BLnd)
        return out_BLnd

    splits_in = [a * per_head] * C
    splits_out = [c * per_head for c in counts]
    splits = (splits_in, splits_out)
    return _exchange(send_CBLad.view(-1), group, async_op, finish, x_BSad, splits)


def to_head(ex: HeadExchange, x_BLnd, counts=None, *, async_op=False):
    """`ex.to_head(x)` (the even exchange) when `counts` is None, else the uneven one."""
    if counts is None:
        return ex.to_head(x_BLnd, async_op=async_op)
    return seq_to_head_uneven(x_BLnd, counts, ex.group, ex.layout, async_op=async_op)


def to_seq(ex: HeadExchange, x_BSad, counts=None, *, async_op=False):
    """`ex.to_seq(x)` (the even exchange) when `counts` is None, else the uneven one."""
    if counts is None:
        return ex.to_seq(x_BSad, async_op=async_op)
    return head_to_seq_uneven(x_BSad, counts, ex.group, ex.layout, async_op=async_op)


def empty_heads(like: torch.Tensor, dim: int) -> torch.Tensor:
    """A tensor like `like` with no heads at `dim` (what a rank without a head holds)."""
    shape = list(like.shape)
    shape[dim] = 0
    return like.new_empty(shape)
