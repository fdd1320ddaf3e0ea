"""Ulysses attention (DeepSpeed-Ulysses): all-to-all from sequence shards to head shards.

Legend: B batch, S full sequence, L = S / C local tokens, H query heads, G kv heads,
h = H / C query and k = G / C kv heads per rank, d head dim, C group size.

Forward on each rank:
    q_BLHd, k_BLGd, v_BLGd  --seq_to_head-->  q_BShd, k_BSkd, v_BSkd
    out_BShd, lse_BhS = attention(q_BShd, k_BSkd, v_BSkd)       (all S tokens, h heads)
    out_BShd  --head_to_seq-->  out_BLHd
Backward: dout_BLHd -> dout_BShd, the kernel's backward from the saved out/lse, then
dq/dk/dv back to the sequence layout.

Uneven heads (C not dividing H or G; `upipe.heads.ulysses_split`): rank r gets ceil(H/C) or
floor(H/C) query heads (h is its count) and the k kv heads they use, which neighbouring
ranks may share; the exchanges take per-rank counts (`upipe.comm.exchange`), the kernel runs
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

from upipe.attention import kept, sinks
from upipe.attention.common import (
    DocumentsArg,
    check_layout,
    save_for_backward,
    saved_for_backward,
    validate_qkv,
)
from upipe.attention.registry import STRATEGIES
from upipe.attention.schedule import gather, scatter_add_
from upipe.attention.stage import SegmentedAttention, StageAttention
from upipe.comm import HeadExchange
from upipe.heads import counts, ulysses_split
from upipe.kernels import acc_dtype


def split_attention(H, G, group, attn):
    """(this rank's uneven split over `group` or None, and `attn` for it)."""
    split = ulysses_split(H, G, dist.get_world_size(group), dist.get_rank(group))
    return split, attn if split is None else SegmentedAttention(attn, split.segments)


class _Exchanges:
    """The exchanges of one Ulysses call: even (`split` None) or uneven
    (`heads.UlyssesSplit`: per-rank counts, kv heads gathered per rank and their gradients
    summed back)."""

    def __init__(self, ex, split):
        self.ex, self.split = ex, split
        self.q_counts = None if split is None else counts(split.q)
        self.kv_counts = None if split is None else counts(split.kv)
        self.kv_shared = split is not None and split.kv_shared

    def q_to_head(self, t_BLHd):
        return self.ex.to_head(t_BLHd, self.q_counts)

    def kv_to_head(self, t_BLGd):
        sent = gather(t_BLGd, 2, self.split.kv) if self.kv_shared else t_BLGd
        return self.ex.to_head(sent, self.kv_counts)

    def q_to_seq(self, t_BShd):
        return self.ex.to_seq(t_BShd, self.q_counts)

    def kv_to_seq(self, t_BSkd, G):
        t_BLnd = self.ex.to_seq(t_BSkd, self.kv_counts)
        if not self.kv_shared:
            return t_BLnd
        B, L, _, d = t_BLnd.shape  # each rank's copy of a shared kv head adds up, in fp32
        acc_BLGd = t_BLnd.new_zeros(B, L, G, d, dtype=acc_dtype(t_BLnd.dtype))
        scatter_add_(acc_BLGd, 2, self.split.kv, t_BLnd)
        del t_BLnd
        return acc_BLGd.to(t_BSkd.dtype)


def _forward(q_BLHd, k_BLGd, v_BLGd, ex, attn, reused=None, sink_h=None):
    """`reused`: [out_BShd, lse] of an earlier forward (a checkpoint's), in place of the
    kernel's. `sink_h`: the rank's heads' sinks (`upipe.attention.sinks`), or None."""
    q_BShd = ex.q_to_head(q_BLHd)
    k_BSkd, v_BSkd = ex.kv_to_head(k_BLGd), ex.kv_to_head(v_BLGd)
    if reused is not None:
        out_BShd, lse_BhS = reused
    else:
        out_BShd, lse_BhS = attn.forward(q_BShd, k_BSkd, v_BSkd)
        if sink_h is not None:  # out' and lse' (in place on out)
            lse_BhS = sinks.apply_(out_BShd, lse_BhS, sink_h)
    return ex.q_to_seq(out_BShd), [q_BShd, k_BSkd, v_BSkd, out_BShd, lse_BhS]


def _backward(dout_BLHd, saved, ex, attn, G, sink_h=None):
    """`saved` is a list this function empties, so each buffer dies as soon as it is used.
    With `sink_h` (the rank's heads' sinks) the last item is their gradient `[h]`."""
    dout_BShd = ex.q_to_head(dout_BLHd)
    dsink_h = None if sink_h is None else sinks.grad(dout_BShd, saved[3], saved[4], sink_h)
    grads_BS = list(attn.backward(dout_BShd, *saved))
    saved.clear()
    del dout_BShd
    grads_BL = [ex.q_to_seq(grads_BS.pop(0))]
    while grads_BS:  # convert dk, dv one at a time, freeing each head-layout gradient
        grads_BL.append(ex.kv_to_seq(grads_BS.pop(0), G))
    return grads_BL, dsink_h


class UlyssesFunction(torch.autograd.Function):
    """Ulysses (the exchange `ex`, `upipe.comm.HeadExchange`) around any stage attention
    `attn` (stage.py): the local kernel here, ring attention over the ring group in USP.
    `split`: the uneven head split of this rank (`heads.ulysses_split`), None when even;
    `attn` must then be the split's `SegmentedAttention` (`split_attention`). `call`: the
    op's `kept.Call` inside an activation checkpoint (its forward keeps out_BShd and lse,
    its recomputation reuses them), else None. `sinks_H`: `[H]` attention sinks
    (`upipe.attention.sinks`), or None; its gradient holds this rank's heads' (zeros
    elsewhere: summed over the ranks it is the full one)."""

    @staticmethod
    def forward(ctx, q, k, v, ex, attn, split=None, call=None, sinks_H=None):
        exs = _Exchanges(ex, split)
        C, rank = dist.get_world_size(ex.group), dist.get_rank(ex.group)
        heads = sinks.head_range(q.shape[2], C, rank)
        sink_h = None if sinks_H is None else sinks_H.narrow(0, *heads)
        reused = None if call is None else call.reused()
        out, saved = _forward(q, k, v, exs, attn, reused, sink_h)
        if call is not None and reused is None:
            call.keep(saved[3:])  # out_BShd, lse (with sinks: out', lse')
        del call, reused
        keep = () if sinks_H is None else (sinks_H,)
        save_for_backward(ctx, keep=keep, free=saved)  # backward frees them one by one
        ctx.args, ctx.heads = (exs, attn, k.shape[2]), heads
        return out

    @staticmethod
    def backward(ctx, dout):
        keep, saved = saved_for_backward(ctx)
        sinks_H = keep[0] if keep and ctx.needs_input_grad[7] else None
        sink_h = None if sinks_H is None else sinks_H.narrow(0, *ctx.heads)
        grads, dsink_h = _backward(dout.contiguous(), saved, *ctx.args, sink_h)
        dsinks_H = None
        if dsink_h is not None:  # this rank's heads; zeros elsewhere
            dsinks_H = sinks.zeros_like_sinks(sinks_H, dsink_h.dtype)
            dsinks_H.narrow(0, *ctx.heads).copy_(dsink_h)
            dsinks_H = dsinks_H.to(sinks_H.dtype)
        return (*grads, None, None, None, None, dsinks_H)


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
    sinks=None,
):
    """Attention over a sequence sharded across `group`.

    q `[B, L, H, d]`, k/v `[B, L, G, d]`: rank r holds tokens r*L .. (r+1)*L-1 (layout
    "contiguous"), or chunks r and 2C-1-r of 2C ("zigzag", as ring attention; see
    `upipe.comm.shard_sequence`). Returns `[B, L, H, d]`, the rank's rows of full attention
    over all C*L tokens; differentiable
    w.r.t. q, k, v. G must divide H (query head h uses kv head h // (H / G)) and C must be
    at most H; when C does not divide H or G the heads are split unevenly (ceil(H/C) or
    floor(H/C) query heads per rank, `upipe.heads`). `backend` selects the local
    kernel (see `upipe.kernels`); the default follows the device.
    `cu_seqlens`: document boundaries `[0, e_1, ..., S]` of the full sequence (a 1-D integer
    tensor or ints, the same on every rank and batch row; `upipe.packing.check_cu_seqlens`):
    a token attends only to tokens of its own document (`upipe.attention.documents`); None:
    one document (plain attention, unchanged).
    `window`: a causal sliding window (token i sees keys i-window+1 .. i; None: none), with
    work proportional to it (`upipe.attention.window`).
    `sinks`: attention sinks `[H]` (gpt-oss: one logit per query head added to every row's
    softmax denominator, `upipe.attention.sinks`), differentiable; None: none. Its gradient
    on each rank holds the rank's heads (zeros elsewhere): summed over the ranks, as the
    trainer sums replicated parameters' gradients, it is the full gradient.
    """
    docs = DocumentsArg(cu_seqlens)
    validate_qkv(
        q,
        k,
        v,
        strategy=STRATEGIES["ulysses"],
        group=group,
        causal=causal,
        softmax_scale=softmax_scale,
        backend=backend,
        extra=lambda C: (check_layout(layout, q.shape[1], C), docs.check(C * q.shape[1])),
        extra_signature={"layout": layout, **docs.signature()},
        window=window,
        sinks=sinks,
    )
    ex = HeadExchange(group, layout)
    attn = StageAttention(causal, softmax_scale, backend, docs=docs.bounds, window=window)
    split, attn = split_attention(q.shape[2], k.shape[2], group, attn)
    call = kept.claim("ulysses", q, k, v)
    return UlyssesFunction.apply(q, k, v, ex, attn, split, call, sinks)
