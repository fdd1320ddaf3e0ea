"""The head exchange (sequence <-> head all-to-all, the Ulysses exchange) for even and uneven
head splits, synchronous or asynchronous; every function takes its process group explicitly.

Legend: B batch, S full sequence, L = S / C local tokens, H heads (query or kv) of the
sequence layout, d head dim, C group size; a = the heads this rank gets, counts[c] those of
rank c (rank-major: rank c's heads are H entries off_c .. off_c + counts[c] - 1, off_c =
counts[0] + ... + counts[c-1]). Even split (counts=None): a = H / C for every rank.

    seq_to_head:  x_BLHd [B, L, H, d] -> x_BSad [B, S, a, d]
                  forward: rank r keeps its heads (r*a .. (r+1)*a - 1 on an even split), for
                  all S tokens, in sequence order
    head_to_seq:  x_BSad [B, S, a, d] -> x_BLHd [B, L, H, d]      (the inverse)

Backward: an all-to-all is a permutation of blocks, so each exchange's adjoint is the other
one; the strategies' backwards call the inverse exchange on the gradients (these functions
are not differentiable themselves). Rank r's L tokens are those of the sequence `layout`
(`upipe.comm.layouts`): contiguous block r, or zigzag chunks r and 2C-1-r, which the
exchange puts back in sequence order (one copy).

One `all_to_all_single` per call (gloo and NCCL split dim 0 only, so the destination rank is
moved to dim 0 of the send buffer): on an even split with C equal blocks [C, B, L, a, d];
on an uneven one (`upipe.heads`: H or G not a multiple of C) with per-rank split sizes on a
flat heads-first buffer, so rank c's block is one contiguous run of counts[c] heads. A count
may be 0 (a rank with no head in a stage sends and receives empty blocks). With all counts
equal the uneven exchange gives the even one's result; the even one is used whenever
`counts` is None (its buffers need no reordering).

`async_op=True` returns a `Pending` whose `wait()` gives the result: the collective may run
(on CUDA: on the process group's stream) while the caller computes. Send buffers are
released as soon as the exchange is done (`_release`), so a stage loop holds one stage's
buffers at a time.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


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


def _exchange(send, group, async_op, finish, keep, splits=None):
    """all_to_all_single of `send` (destination rank first) into a new buffer, then
    `finish(recv)`; with `async_op` as a `Pending`. The send buffer is released once the
    exchange is done (never `keep`'s storage, the caller's input). `splits`: (elements sent
    to each rank, elements received from each rank) of a flat `send` whose blocks differ in
    size; None: C equal blocks."""
    if splits is None:
        recv = torch.empty_like(send)
        sizes = {}
    else:
        in_splits, out_splits = (list(x) for x in splits)
        recv = send.new_empty(sum(out_splits))
        sizes = dict(output_split_sizes=out_splits, input_split_sizes=in_splits)
    work = dist.all_to_all_single(recv, send, group=group, async_op=async_op, **sizes)

    def done():
        _release(send, keep=keep)
        return finish(recv)

    return Pending(work, done) if async_op else done()


def _in_sequence_order(recv_CBLad: torch.Tensor, layout: str) -> torch.Tensor:
    """[C, B, L, a, d] (rank c's tokens for my heads) -> [B, S, a, d] in sequence order;
    the received buffer is released where a copy was made (zigzag)."""
    C, B, L, a, d = recv_CBLad.shape
    if layout == "zigzag":  # chunk c < C is rank c's first half, chunk 2C-1-c its second
        halves_C2BLad = recv_CBLad.unflatten(2, (2, L // 2)).transpose(1, 2)
        chunks_2CBLad = torch.cat([halves_C2BLad[:, 0], halves_C2BLad[:, 1].flip(0)])
        _release(recv_CBLad, keep=chunks_2CBLad)
        return chunks_2CBLad.transpose(0, 1).reshape(B, C * L, a, d)
    return recv_CBLad.transpose(0, 1).reshape(B, C * L, a, d)


def _blocks_by_rank(x_BSad: torch.Tensor, C: int, layout: str) -> torch.Tensor:
    """[B, S, a, d] in sequence order -> [C, B, L, a, d], block c = rank c's tokens in
    `layout` (a contiguous copy: the send buffer of the head -> sequence exchange)."""
    S = x_BSad.shape[1]
    if layout == "zigzag":  # rank c's tokens: chunk c, then chunk 2C-1-c
        chunks_B2Cad = x_BSad.unflatten(1, (2 * C, S // (2 * C)))
        pairs_BC2ad = torch.stack([chunks_B2Cad[:, :C], chunks_B2Cad[:, C:].flip(1)], dim=2)
        return pairs_BC2ad.flatten(2, 3).transpose(0, 1).contiguous()
    return x_BSad.unflatten(1, (C, S // C)).transpose(0, 1).contiguous()


def seq_to_head(x_BLHd, group, layout="contiguous", *, counts=None, async_op=False):
    """[B, L, H, d] (my tokens in `layout`, every rank's heads, rank-major) -> [B, S, a, d]
    (all tokens in sequence order, my a heads). `counts`: heads per rank (uneven split;
    None: H / C each). Backward: `head_to_seq` of the gradient. With `async_op` returns a
    `Pending` whose `wait()` gives the result."""
    C = dist.get_world_size(group)
    if C == 1:
        return Done(x_BLHd) if async_op else x_BLHd
    B, L, H, d = x_BLHd.shape
    if counts is None:
        a = H // C
        # send_CBLad[c] = my tokens for the heads of rank c
        send = x_BLHd.unflatten(2, (C, a)).permute(2, 0, 1, 3, 4).contiguous()
        splits = None

        def blocks(recv):  # recv[c] = rank c's tokens for my heads
            return recv
    else:
        assert len(counts) == C and sum(counts) == H, (counts, H)
        a, per_head = counts[dist.get_rank(group)], B * L * d
        send = x_BLHd.permute(2, 0, 1, 3).contiguous().view(-1)  # rank c's heads: one run
        splits = ([c * per_head for c in counts], [a * per_head] * C)

        def blocks(recv):  # block c = rank c's tokens for my heads, [a, B, L, d]
            return recv.view(C, a, B, L, d).permute(0, 2, 3, 1, 4)

    def finish(recv):
        return _in_sequence_order(blocks(recv), layout)

    return _exchange(send, group, async_op, finish, x_BLHd, splits)


def head_to_seq(x_BSad, group, layout="contiguous", *, counts=None, async_op=False):
    """[B, S, a, d] (all tokens in sequence order, my heads) -> [B, L, H, d] (my tokens in
    `layout`, every rank's heads, rank-major): the inverse of `seq_to_head` with the same
    `counts`. Backward: `seq_to_head` of the gradient. With `async_op` returns a
    `Pending`."""
    C = dist.get_world_size(group)
    if C == 1:
        return Done(x_BSad) if async_op else x_BSad
    B, S, a, d = x_BSad.shape
    L = S // C
    send_CBLad = _blocks_by_rank(x_BSad, C, layout)
    if counts is None:
        splits = None

        def finish(recv_CBLad):  # recv[c] = my tokens for the heads of rank c
            # a copy (made contiguous: when a = 1, reshape may return a strided view of recv)
            out_BLHd = recv_CBLad.permute(1, 2, 0, 3, 4).reshape(B, L, C * a, d).contiguous()
            _release(recv_CBLad, keep=out_BLHd)
            return out_BLHd
    else:
        per_head = B * L * d
        splits = ([a * per_head] * C, [c * per_head for c in counts])
        send_CBLad = send_CBLad.view(-1)

        def finish(recv):  # rank c's block: my tokens for its counts[c] heads, [B, L, n, d]
            out_BLHd = recv.new_empty(B, L, sum(counts), d)
            off = 0
            for n_c in counts:
                block = recv.narrow(0, off * per_head, n_c * per_head).view(B, L, n_c, d)
                out_BLHd.narrow(2, off, n_c).copy_(block)
                off += n_c
            _release(recv, keep=out_BLHd)
            return out_BLHd

    return _exchange(send_CBLad, group, async_op, finish, x_BSad, splits)


@dataclasses.dataclass(frozen=True)
class HeadExchange:
    """The head exchange over `group` for a sequence sharded in `layout`: `to_head` is
    `seq_to_head`, `to_seq` is `head_to_seq` (`counts`: heads per rank on an uneven split,
    None on an even one)."""

    group: dist.ProcessGroup
    layout: str = "contiguous"

    def to_head(self, x_BLHd: torch.Tensor, counts=None, *, async_op: bool = False):
        return seq_to_head(x_BLHd, self.group, self.layout, counts=counts, async_op=async_op)

    def to_seq(self, x_BSad: torch.Tensor, counts=None, *, async_op: bool = False):
        return head_to_seq(x_BSad, self.group, self.layout, counts=counts, async_op=async_op)
