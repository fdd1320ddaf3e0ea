"""Ulysses attention (DeepSpeed-Ulysses): all-to-all from sequence shards to head shards.

Legend: B batch, S full sequence, L = S / C local tokens, H query heads, G kv heads,
h = H / C query and k = G / C kv heads per rank, d head dim, C group size.

Forward on each rank:
    q_BLHd, k_BLGd, v_BLGd  --seq_to_head-->  q_BShd, k_BSkd, v_BSkd
    out_BShd, lse_BhS = attention(q_BShd, k_BSkd, v_BSkd)       (all S tokens, h heads)
    out_BShd  --head_to_seq-->  out_BLHd
Backward: dout_BLHd -> dout_BShd, the kernel's backward from the saved out/lse, then
dq/dk/dv back to the sequence layout.

Uneven heads (C not dividing H or G; `upipe.attention.uneven`): rank r gets ceil(H/C) or
floor(H/C) query heads (h is its count) and the k kv heads they use, which neighbouring
ranks may share; the exchanges take per-rank counts (`upipe.comm_uneven`), the kernel runs
per standard-GQA segment of the rank's heads, and a shared kv head's gradients from its
ranks are summed in fp32. With C dividing H and G the even code runs, unchanged.

Saved for backward: q_BShd, k_BSkd, v_BSkd, out_BShd, lse -- the full-head intermediates
that UPipe (upipe.py) avoids keeping. Backward frees each buffer as soon as it is used (a
lean baseline, so that comparisons with UPipe are fair). Recomputed inside an activation
checkpoint that keeps attention outputs (`kept.py`), the forward exchanges q, k, v and the
output as above but takes out_BShd and lse from the first forward instead of the kernel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from upipe.attention import kept, uneven
from upipe.attention.common import (
    DocumentsArg,
    check_layout,
    save_for_backward,
    saved_for_backward,
    validate_qkv,
)
from upipe.attention.stage import SegmentedAttention, StageAttention
from upipe.comm import HeadExchange
from upipe.comm_uneven import to_head, to_seq
from upipe.kernels import acc_dtype


def split_attention(H, G, group, attn):
    """(this rank's uneven split over `group` or None, and `attn` for it)."""
    split = uneven.ulysses_split(H, G, dist.get_world_size(group), dist.get_rank(group))
    return split, attn if split is None else SegmentedAttention(attn, split.segments)


class _Exchanges:
    """The exchanges of one Ulysses call: even (`split` None: `ex` for every tensor) or
    uneven (`uneven.UlyssesSplit`: per-rank counts, kv heads gathered per rank and their
    gradients summed back)."""

    def __init__(self, ex, split):
        self.ex, self.split = ex, split

    def q_to_head(self, t_BLHd):
        if self.split is None:
            return self.ex.to_head(t_BLHd)
        return to_head(self.ex, t_BLHd, uneven.counts(self.split.q))

    def kv_to_head(self, t_BLGd):
        if self.split is None:
            return self.ex.to_head(t_BLGd)
        sent = uneven.gather(t_BLGd, 2, self.split.kv) if self.split.kv_shared else t_BLGd
        return to_head(self.ex, sent, uneven.counts(self.split.kv))

    def q_to_seq(self, t_BShd):
        if self.split is None:
            return self.ex.to_seq(t_BShd)
        return to_seq(self.ex, t_BShd, uneven.counts(self.split.q))

    def kv_to_seq(self, t_BSkd, G):
        if self.split is None:
            return self.ex.to_seq(t_BSkd)
        t_BLnd = to_seq(self.ex, t_BSkd, uneven.counts(self.split.kv))
        if not self.split.kv_shared:
            return t_BLnd
        B, L, _, d = t_BLnd.shape  # each rank's copy of a shared kv head adds up, in fp32
        acc_BLGd = t_BLnd.new_zeros(B, L, G, d, dtype=acc_dtype(t_BLnd.dtype))
        uneven.scatter_add_(acc_BLGd, 2, self.split.kv, t_BLnd)
        del t_BLnd
        return acc_BLGd.to(t_BSkd.dtype)


def _forward(q_BLHd, k_BLGd, v_BLGd, ex, attn, reused=None):
    """`reused`: [out_BShd, lse] of an earlier forward (a checkpoint's), in place of the
    kernel's."""
    q_BShd = ex.q_to_head(q_BLHd)
    k_BSkd, v_BSkd = ex.kv_to_head(k_BLGd), ex.kv_to_head(v_BLGd)
    out_BShd, lse_BhS = attn.forward(q_BShd, k_BSkd, v_BSkd) if reused is None else reused
    return ex.q_to_seq(out_BShd), [q_BShd, k_BSkd, v_BSkd, out_BShd, lse_BhS]


def _backward(dout_BLHd, saved, ex, attn, G):
    """`saved` is a list this function empties, so each buffer dies as soon as it is used."""
    dout_BShd = ex.q_to_head(dout_BLHd)
    grads_BS = list(attn.backward(dout_BShd, *saved))
    saved.clear()
    del dout_BShd
    grads_BL = [ex.q_to_seq(grads_BS.pop(0))]
    while grads_BS:  # convert dk, dv one at a time, freeing each head-layout gradient
        grads_BL.append(ex.kv_to_seq(grads_BS.pop(0), G))
    return grads_BL


class UlyssesFunction(torch.autograd.Function):
    """Ulysses (the exchange `ex`, `upipe.comm.HeadExchange`) around any stage attention
    `attn` (stage.py): the local kernel here, ring attention over the ring group in USP.
    `split`: the uneven head split of this rank (`uneven.ulysses_split`), None when even;
    `attn` must then be the split's `SegmentedAttention` (`split_attention`). `call`: the
    op's `kept.Call` inside an activation checkpoint (its forward keeps out_BShd and lse,
    its recomputation reuses them), else None."""

    @staticmethod
    def forward(ctx, q, k, v, ex, attn, split=None, call=None):
        exs = _Exchanges(ex, split)
        reused = None if call is None else call.reused()
        out, saved = _forward(q, k, v, exs, attn, reused)
        if call is not None and reused is None:
            call.keep(saved[3:])  # out_BShd, lse
        del call, reused
        save_for_backward(ctx, keep=(), free=saved)  # backward frees them one by one
        ctx.args = (exs, attn, k.shape[2])
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = _backward(dout.contiguous(), saved_for_backward(ctx)[1], *ctx.args)
        return (*grads, None, None, None, None)


@torch.compiler.disable  # a clean graph break: see upipe.attention
def ulysses_attention(
    q,
    k,
    v,
    *,
    group,
    causal=True,
    softmax_scale=None,
    backend=None,
    layout="contiguous",
    cu_seqlens=None,
    window=None,
):
    """Attention over a sequence sharded across `group`.

    q `[B, L, H, d]`, k/v `[B, L, G, d]`: rank r holds tokens r*L .. (r+1)*L-1 (layout
    "contiguous"), or chunks r and 2C-1-r of 2C ("zigzag", as ring attention; see
    `upipe.comm.shard_sequence`). Returns `[B, L, H, d]`, the rank's rows of full attention
    over all C*L tokens; differentiable
    w.r.t. q, k, v. G must divide H (query head h uses kv head h // (H / G)) and C must be
    at most H; when C does not divide H or G the heads are split unevenly (ceil(H/C) or
    floor(H/C) query heads per rank, `upipe.attention.uneven`). `backend` selects the local
    kernel (see `upipe.kernels`); the default follows the device.
    `cu_seqlens`: document boundaries `[0, e_1, ..., S]` of the full sequence (a 1-D integer
    tensor or ints, the same on every rank and batch row; `upipe.packing.check_cu_seqlens`):
    a token attends only to tokens of its own document (`upipe.attention.documents`); None:
    one document (plain attention, unchanged).
    `window`: a causal sliding window (token i sees keys i-window+1 .. i; None: none), with
    work proportional to it (`upipe.attention.window`).
    """
    docs = DocumentsArg(cu_seqlens)
    validate_qkv(
        q,
        k,
        v,
        group=group,
        causal=causal,
        softmax_scale=softmax_scale,
        backend=backend,
        replicate_kv=False,
        uneven=True,
        extra=lambda C: (check_layout(layout, q.shape[1], C), docs.check(C * q.shape[1])),
        extra_signature={"layout": layout, **docs.signature()},
        window=window,
    )
    ex = HeadExchange(group, layout)
    attn = StageAttention(causal, softmax_scale, backend, docs=docs.bounds, window=window)
    split, attn = split_attention(q.shape[2], k.shape[2], group, attn)
    return UlyssesFunction.apply(q, k, v, ex, attn, split, kept.claim("ulysses", q, k, v))
