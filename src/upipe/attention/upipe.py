"""UPipe: Ulysses attention run in stages of U heads (headwise chunking).

Legend: B batch, S full sequence, L = S / C local tokens, H query heads, G kv heads,
U heads per stage, u = U / C query heads per rank per stage, k kv heads per rank per round,
d head dim, C group size. Head schedule (rounds of kv heads, stages of query heads):
`upipe.heads`; its slices of tensors: schedule.py.

Forward, for each round: kv_BLkd (the round's kv heads) --seq_to_head--> kv_BSkd; then for
each stage of the round:
    q_BLUd --seq_to_head--> q_BSud;  out_BSud, lse = attention(q_BSud, k_BSkd, v_BSkd)
    out_BSud --head_to_seq--> out_BLUd, written into the preallocated out_BLHd
Backward repeats the exchange per round and stage (q, k, v, out and dout slices are sent
again), runs the kernel backward with the saved lse, sums dk/dv over the round's stages in
fp32 and sends them back once per round.

Heads C does not divide (the uneven split of `upipe.heads`): each rank's own ceil(H/C) or
floor(H/C) query heads, u per stage, with rounds of the kv heads they use; the exchanges take
per-rank counts, the kernel runs per standard-GQA segment (`stage.SegmentedAttention`) and
kv gradients are summed in fp32. The loops below are the same: the rounds (`heads.Round` or
`heads.UnevenRound`) say which heads, counts and attention each stage has.

Live at a time: one round's kv buffers and one stage's buffers -- the head-proportional
intermediates shrink by U / H against Ulysses. Saved for backward: only lse (q, k, v and
out exist anyway). The fused module (fused.py) also folds the projections in. Recomputed
inside an activation checkpoint that keeps attention outputs (`kept.py`), the forward runs
no stage at all: out and the lse are the first forward's.

On a 2-D mesh (`mesh=`: R ring x C ulysses ranks, sequence in the mesh layout of
`upipe.comm`) the all-to-alls run over the ulysses group and gather the ring rank's part of
P = C * L tokens, so each stage's attention is ring attention over the ring group:
    out_BPud, lse = ring_attention(q_BPud, k_BPkd, v_BPkd)     (stage.py, R > 1)
and its backward is the ring backward from the saved out and lse. With R = 1 (or `group=`)
the stage calls the local kernel, exactly as above.
"""

from __future__ import annotations

import torch

from upipe.attention import kept, sinks
from upipe.attention.common import (
    DocumentsArg,
    check_layout,
    check_ring_layout,
    resolve_groups,
    validate_qkv,
)
from upipe.attention.registry import STRATEGIES
from upipe.attention.schedule import add_kv_, put_kv, put_q, select_kv, select_q, stage_attention
from upipe.attention.stage import StageAttention
from upipe.comm import HeadExchange
from upipe.heads import check_heads_per_stage, plan_schedule
from upipe.kernels import acc_dtype


def accumulate(acc, t):
    """acc + t in `acc_dtype`; the first term (acc None) becomes the accumulator, without a
    copy when it already has that dtype (so a round of one stage costs no extra buffer)."""
    if acc is None:
        return t.to(acc_dtype(t.dtype))
    acc += t
    return acc


def _share(rnd, s, C, rank):
    """(offset, count) of `rank`'s heads among stage s's U heads (rank-major)."""
    counts = rnd.q_split(s) or (len(rnd.stages[s]) // C,) * C
    return sum(counts[:rank]), counts[rank]


def stage_sinks(sinks_H, rnd, s, C, rank):
    """`rank`'s sink values `[u]` in stage s of `rnd`, in its q heads' order: the stage's
    heads of the `[1, 1, H, 1]` view (`select_q`, as for q), then the rank's share."""
    stage_U = select_q(sinks_H.view(1, 1, -1, 1), 2, rnd, s).flatten(2, 3).reshape(-1)
    return stage_U.narrow(0, *_share(rnd, s, C, rank))


def put_stage_sinks_(dsinks_H, rnd, s, C, rank, dsink_u):
    """dsinks' entries of stage s's heads <- dsink_u for `rank`'s, zeros for the others'."""
    offset, n = _share(rnd, s, C, rank)
    buf_U = dsinks_H.new_zeros(sum(rnd.q_split(s) or (len(rnd.stages[s]),)))
    buf_U.narrow(0, offset, n).copy_(dsink_u)
    put_q(dsinks_H.view(1, 1, -1, 1), 2, rnd, s, buf_U.view(1, 1, -1, 1))


def _q_heads(t_BLHd, rnd, s):
    """Stage s's query heads of t, as a new contiguous [B, L, U, d] tensor."""
    return select_q(t_BLHd, 2, rnd, s).flatten(2, 3).contiguous()


def _kv_heads(t_BLGd, rnd):
    """The round's (virtual) kv heads of t, as a contiguous [B, L, C*k, d] tensor."""
    return select_kv(t_BLGd, 2, rnd).contiguous()


def _forward(q_BLHd, k_BLGd, v_BLGd, rounds, ex, attn, sinks_H=None):
    out_BLHd = torch.empty_like(q_BLHd)
    lse_list = []
    C, rank = torch.distributed.get_world_size(ex.group), torch.distributed.get_rank(ex.group)
    for rnd in rounds:
        k_BSkd = ex.to_head(_kv_heads(k_BLGd, rnd), rnd.kv_split)
        v_BSkd = ex.to_head(_kv_heads(v_BLGd, rnd), rnd.kv_split)
        for s in range(len(rnd.stages)):
            q_BSud = ex.to_head(_q_heads(q_BLHd, rnd, s), rnd.q_split(s))
            out_BSud, lse_BuS = stage_attention(attn, rnd, s).forward(q_BSud, k_BSkd, v_BSkd)
            del q_BSud
            if sinks_H is not None:  # out' (in place) and lse'
                lse_BuS = sinks.apply_(out_BSud, lse_BuS, stage_sinks(sinks_H, rnd, s, C, rank))
            put_q(out_BLHd, 2, rnd, s, ex.to_seq(out_BSud, rnd.q_split(s)))
            lse_list.append(lse_BuS)
        del k_BSkd, v_BSkd
    return out_BLHd, lse_list


def _backward(dout_BLHd, q_BLHd, k_BLGd, v_BLGd, out_BLHd, lse_list, rounds, ex, attn, sinks_H):
    """(dq, dk, dv, d sinks: this rank's heads, zeros elsewhere; None without sinks)."""
    dq_BLHd = torch.empty_like(q_BLHd)
    C, rank = torch.distributed.get_world_size(ex.group), torch.distributed.get_rank(ex.group)
    dsinks_H = None if sinks_H is None else sinks.zeros_like_sinks(sinks_H, lse_list[0].dtype)
    # kv gradients: each kv head comes back once, unless it is replicated (G < C) or shared
    # by ranks of an uneven split: then its copies are summed, in fp32
    replicated = rounds[0].sums_kv
    if replicated:
        dk_BLGd = torch.zeros(k_BLGd.shape, dtype=acc_dtype(k_BLGd.dtype), device=k_BLGd.device)
        dv_BLGd = torch.zeros_like(dk_BLGd)
    else:
        dk_BLGd, dv_BLGd = torch.empty_like(k_BLGd), torch.empty_like(v_BLGd)
    lse_iter = iter(lse_list)
    for rnd in rounds:
        k_BSkd = ex.to_head(_kv_heads(k_BLGd, rnd), rnd.kv_split)
        v_BSkd = ex.to_head(_kv_heads(v_BLGd, rnd), rnd.kv_split)
        dk32_BSkd = dv32_BSkd = None
        for s in range(len(rnd.stages)):
            q_BSud, out_BSud, dout_BSud = (
                ex.to_head(_q_heads(t, rnd, s), rnd.q_split(s))
                for t in (q_BLHd, out_BLHd, dout_BLHd)
            )
            lse_BuS = next(lse_iter)
            if sinks_H is not None:
                sink_u = stage_sinks(sinks_H, rnd, s, C, rank)
                dsink_u = sinks.grad(dout_BSud, out_BSud, lse_BuS, sink_u)
                put_stage_sinks_(dsinks_H, rnd, s, C, rank, dsink_u)
            dq_BSud, dk_BSkd, dv_BSkd = stage_attention(attn, rnd, s).backward(
                dout_BSud, q_BSud, k_BSkd, v_BSkd, out_BSud, lse_BuS
            )
            del lse_BuS
            del q_BSud, out_BSud, dout_BSud
            dk32_BSkd = accumulate(dk32_BSkd, dk_BSkd)
            dv32_BSkd = accumulate(dv32_BSkd, dv_BSkd)
            del dk_BSkd, dv_BSkd
            put_q(dq_BLHd, 2, rnd, s, ex.to_seq(dq_BSud, rnd.q_split(s)))
        del k_BSkd, v_BSkd
        # the round's dk, dv go back once; each sum is freed as soon as it is sent
        kv_sums = [(dk_BLGd, dk32_BSkd), (dv_BLGd, dv32_BSkd)]
        del dk32_BSkd, dv32_BSkd
        while kv_sums:
            d_BLGd, d32_BSkd = kv_sums.pop(0)
            d_BLkd = ex.to_seq(d32_BSkd.to(k_BLGd.dtype), rnd.kv_split)
            del d32_BSkd
            if replicated:  # fp32 sums of the replicas (bf16 parts, fp32 accumulator)
                add_kv_(d_BLGd, 2, rnd, d_BLkd)
            else:
                put_kv(d_BLGd, 2, rnd, d_BLkd)
            del d_BLkd
    dsinks = None if dsinks_H is None else dsinks_H.to(sinks_H.dtype)
    return dq_BLHd, dk_BLGd.to(k_BLGd.dtype), dv_BLGd.to(v_BLGd.dtype), dsinks


class _UPipeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rounds, ex, attn, call, sinks_H):
        reused = None if call is None else call.reused()
        if reused is not None:  # a checkpoint's recomputation: the forward's out and lse
            out, lse_list = reused[0], reused[1:]
        else:
            out, lse_list = _forward(q, k, v, rounds, ex, attn, sinks_H)
            if call is not None:
                call.keep([out, *lse_list])
        del call, reused
        ctx.save_for_backward(q, k, v, out, sinks_H)
        ctx.lse_list = lse_list
        ctx.args = (rounds, ex, attn)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, sinks_H = ctx.saved_tensors
        sinks_H = sinks_H if ctx.needs_input_grad[7] else None
        dq, dk, dv, dsinks = _backward(
            dout.contiguous(), q, k, v, out, ctx.lse_list, *ctx.args, sinks_H
        )
        return dq, dk, dv, None, None, None, None, dsinks


@torch.compiler.disable  # a clean graph break: see upipe.attention
def upipe_attention(
    q,
    k,
    v,
    *,
    group=None,
    mesh=None,
    heads_per_stage=None,
    causal=True,
    softmax_scale=None,
    backend=None,
    layout=None,
    cu_seqlens=None,
    window=None,
    sinks=None,
):
    """Ulysses attention in stages of `heads_per_stage` heads; same contract and result.

    q `[B, L, H, d]`, k/v `[B, L, G, d]`; returns `[B, L, H, d]`. With `group` (C ranks) the
    sequence is sharded in `layout`: "contiguous" (default; rank r holds tokens r*L ..
    (r+1)*L-1) or "zigzag" (chunks r and 2C-1-r of 2C). With `mesh`
    (dims "ring" and "ulysses", see `upipe.make_mesh`) it is in the mesh layout of
    `upipe.comm` (`shard_sequence(x, mesh=mesh, layout=layout)`; `layout` is the ring dim's,
    default "zigzag"), the all-to-alls run over the ulysses dim (C = its size) and each
    stage's attention is ring attention over the ring dim. Exactly one of group/mesh.
    `heads_per_stage` (U) defaults to C (one head per rank per stage); any multiple of C that
    divides H and fits the GQA schedule (see `upipe.heads`); U = H is plain
    Ulysses. G may be smaller than C (kv heads are replicated) if it divides C. Other head
    counts (C not dividing H, or G and C not dividing one another; C <= H) are split
    unevenly (`upipe.heads`): U is then any multiple of C up to C * ceil(H / C),
    u = U / C of each rank's ceil(H/C) or floor(H/C) heads per stage.
    `cu_seqlens`: document boundaries `[0, e_1, ..., S]` of the full sequence (a 1-D integer
    tensor or ints, the same on every rank and batch row; `upipe.packing.check_cu_seqlens`):
    a token attends only to tokens of its own document (`upipe.attention.documents`); None:
    one document (plain attention, unchanged).
    `window`: a causal sliding window (token i sees keys i-window+1 .. i; None: none), with
    work proportional to it (`upipe.attention.window`).
    `sinks`: attention sinks `[H]` (gpt-oss, `upipe.attention.sinks`; applied per stage,
    after the stage's ring merge on a mesh), differentiable, or None. Each rank's gradient
    holds its heads' share over its rows (zeros elsewhere); summed over the ranks, as the
    trainer sums replicated parameters' gradients, it is the full gradient.
    """
    ulysses, ring_group, R, agree = resolve_groups(group, mesh)
    docs = DocumentsArg(cu_seqlens)

    def extra(C):
        check_heads_per_stage(q.shape[2], k.shape[2], C, heads_per_stage)
        if mesh is None:
            check_layout(layout or "contiguous", q.shape[1], C)
        else:
            check_ring_layout(layout or "zigzag", C * q.shape[1], R, C)
        docs.check(R * C * q.shape[1])

    validate_qkv(
        q,
        k,
        v,
        strategy=STRATEGIES["upipe"],
        group=ulysses,
        causal=causal,
        softmax_scale=softmax_scale,
        backend=backend,
        extra=extra,
        extra_signature={"heads_per_stage": heads_per_stage, "layout": layout, **docs.signature()},
        agree=agree,
        window=window,
        sinks=sinks,
    )
    H, G, C = q.shape[2], k.shape[2], torch.distributed.get_world_size(ulysses)
    U = check_heads_per_stage(H, G, C, heads_per_stage)
    rounds = plan_schedule(H, G, C, U, torch.distributed.get_rank(ulysses))
    kernel = (causal, softmax_scale, backend)
    if mesh is None:  # the layout is the all-to-all's
        ex = HeadExchange(ulysses, layout or "contiguous")
        attn = StageAttention(*kernel, docs=docs.bounds, window=window)
    else:  # the layout is the ring's; each ulysses group splits its part contiguously
        ex = HeadExchange(ulysses)
        attn = StageAttention(
            *kernel, ring_group, layout or "zigzag", docs=docs.bounds, window=window
        )
    call = kept.claim("upipe", q, k, v)
    return _UPipeAttention.apply(q, k, v, rounds, ex, attn, call, sinks)
