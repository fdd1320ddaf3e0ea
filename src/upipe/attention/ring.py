"""Ring attention: the sequence stays sharded and K/V blocks travel around the ring.

Legend: B batch, S full sequence, L = S / C local tokens, H query heads, G kv heads,
d head dim, C group size; `kv_2BLGd` is k and v stacked (one message per ring step).

Forward on rank r, for steps i = 0 .. C-1 (the block of source rank s = (r - i) mod C):
    start sending the current kv block to rank r+1 and receiving rank r-1's
    out_i, lse_i = attention(q_BLHd (rows), kv block (keys))     (overlaps the transfer)
    lse = logaddexp(lse, lse_i);  out = exp(lse_old - lse) out + exp(lse_i - lse) out_i
    wait for the next kv block
The merge is in fp32 (fp64 for fp64 inputs); it computes out = sum_i exp(lse_i - lse) out_i
with lse = logsumexp_i lse_i, the softmax over all keys.

Causal blocks (positions from the layout, see `upipe.comm`). Every kernel call is either
fully visible (causal=False) or a same-length diagonal block (causal=True):
- s == r: the local block, causal=True (in both layouts positions increase along L).
- contiguous: s < r fully visible; s > r entirely in the future, skipped.
- zigzag (rank r holds chunks r and 2C-1-r, each L/2 tokens): for s < r, chunks s < r <
  2C-1-r < 2C-1-s, so all queries see exactly the first half of the keys; for s > r,
  chunks r < s < 2C-1-s < 2C-1-r, so only the second half of the queries sees the keys,
  all of them. Each step costs L * L/2, so ranks are balanced.

Backward from the saved q, k, v, out and lse (nothing of the forward is recomputed): the
kernel's backward on a block, given the *final* out and lse, returns that block's share of
the gradients, since P_block = exp(scale * Q K_block^T - lse) and delta = rowsum(dO * O)
are the full softmax's. kv blocks go around the ring again; each block's dK/dV accumulator
(fp32, `dkv_2BLGd`) travels one step behind it, picking up every rank's contribution, and
arrives at its owner after the last step. dq accumulates locally in fp32.

Documents (`cu_seqlens`): a step's block becomes the list of kernel calls of
`documents.block_calls` (one per document meeting both the query and the key segments of
the layout); a step with none is skipped but still passes kv on. out starts at 0 and lse
at -inf, so rows a call leaves out contribute nothing to the merge; in backward each call's
dk/dv is added to the block's travelling accumulator.

Saved for backward: q, k, v (inputs), out, lse. Heads are not split, so any H and G with
G dividing H work (GQA/MQA without expanding K/V). Recomputed inside an activation
checkpoint that keeps attention outputs (`kept.py`), the forward makes no ring pass: out
and lse are the first forward's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from upipe import loops
from upipe.attention import kept, sinks
from upipe.attention.common import (
    DocumentsArg,
    check_layout,
    save_for_backward,
    saved_for_backward,
    validate_qkv,
)
from upipe.attention.documents import block_backend, block_calls, layout_segments
from upipe.attention.registry import STRATEGIES
from upipe.attention.window import block_backward, block_forward, merge_
from upipe.comm import ring_send_recv
from upipe.kernels import acc_dtype

_KV_TAG, _DKV_TAG = 0, 1  # the two exchanges of the backward run concurrently


def _block(layout, causal, rank, src, L):
    """What step `src` computes: (query slice, key slice, causal) along L, or None (skip)."""
    full = slice(0, L)
    if not causal:
        return full, full, False
    if src == rank:
        return full, full, True
    if layout == "contiguous":
        return (full, full, False) if src < rank else None
    if src < rank:
        return full, slice(0, L // 2), False
    return slice(L // 2, L), full, False


def _blocks(layout, causal, L, C, docs, window):
    """What each step computes as a function of (rank, source rank), for `loops.ring_steps`:
    without documents or window `_block`; with document boundaries `docs` or a sliding
    `window` the list of kernel calls (query slice, key slice, causal, (q0, k0)) that
    `documents.block_calls` makes, or None if none."""
    if docs is None and window is None:
        return lambda rank, src: _block(layout, causal, rank, src, L)
    bounds = docs if docs is not None else (0, C * L)

    def block(rank, src):
        q_segs, k_segs = (layout_segments(layout, C, i, L) for i in (rank, src))
        return block_calls(bounds, q_segs, k_segs, causal, window) or None

    return block


def _calls(block, masked):
    """The kernel calls of a step's block (see `_blocks`), each (query slice, key slice,
    causal, (q0, k0)): the call's global positions, which only a window reads
    (`window.block_forward`; without one, unmasked blocks carry (0, 0))."""
    if block is None:
        return ()
    return block if masked else ((*block, (0, 0)),)


def _forward(q_BLHd, k_BLGd, v_BLGd, group, causal, scale, backend, layout, docs=None, window=None):
    C, r, L = dist.get_world_size(group), dist.get_rank(group), q_BLHd.shape[1]
    acc, backend = acc_dtype(q_BLHd.dtype), block_backend(q_BLHd, backend, docs)
    kv_2BLGd = torch.stack((k_BLGd, v_BLGd)) if C > 1 else (k_BLGd, v_BLGd)
    masked = docs is not None or window is not None
    out_BLHd = lse_BHL = None
    if masked:  # rows no call covers yet: out 0, lse -inf (no contribution)
        B, _, H, d = q_BLHd.shape
        out_BLHd = torch.zeros(B, L, H, d, dtype=acc, device=q_BLHd.device)
        lse_BHL = torch.full((B, H, L), float("-inf"), dtype=acc, device=q_BLHd.device)
    steps = _blocks(layout, causal, L, C, docs, window)
    for _, block, receives in loops.ring_steps(C, r, steps):
        pending = ring_send_recv(kv_2BLGd, group, tag=_KV_TAG) if receives else None
        for qs, ks, block_causal, starts in _calls(block, masked):
            part_BLHd, part_lse_BHL = block_forward(
                q_BLHd[:, qs],
                kv_2BLGd[0][:, ks],
                kv_2BLGd[1][:, ks],
                q0=starts[0],
                k0=starts[1],
                causal=block_causal,
                window=window,
                softmax_scale=scale,
                backend=backend,
            )
            if out_BLHd is None:  # step 0: the local block, which covers every query
                out_BLHd = part_BLHd.to(acc).contiguous()
                lse_BHL = part_lse_BHL.to(acc).contiguous()
            else:
                merge_(out_BLHd[:, qs], lse_BHL[:, :, qs], part_BLHd, part_lse_BHL)
            del part_BLHd, part_lse_BHL
        if pending is not None:
            kv_2BLGd = pending.wait()
    return out_BLHd.to(q_BLHd.dtype), lse_BHL


def _backward(dout_BLHd, q_BLHd, k_BLGd, v_BLGd, out_BLHd, lse_BHL, *args, docs=None, window=None):
    group, causal, scale, backend, layout = args
    C, r, L = dist.get_world_size(group), dist.get_rank(group), q_BLHd.shape[1]
    acc, backend = acc_dtype(q_BLHd.dtype), block_backend(q_BLHd, backend, docs)
    kv_2BLGd = torch.stack((k_BLGd, v_BLGd)) if C > 1 else (k_BLGd, v_BLGd)
    dq_BLHd = torch.zeros(q_BLHd.shape, dtype=acc, device=q_BLHd.device)
    dkv_2BLGd = dkv_pending = None
    masked = docs is not None or window is not None
    steps = _blocks(layout, causal, L, C, docs, window)
    for first, block, receives in loops.ring_steps(C, r, steps):
        kv_pending = ring_send_recv(kv_2BLGd, group, tag=_KV_TAG) if receives else None
        pieces = []  # (key slice, dk, dv) of the step's calls, added once the sum arrives
        for qs, ks, block_causal, starts in _calls(block, masked):
            dq, dk, dv = block_backward(
                dout_BLHd[:, qs],
                q_BLHd[:, qs],
                kv_2BLGd[0][:, ks],
                kv_2BLGd[1][:, ks],
                out_BLHd[:, qs],
                lse_BHL[:, :, qs].contiguous(),
                q0=starts[0],
                k0=starts[1],
                causal=block_causal,
                window=window,
                softmax_scale=scale,
                backend=backend,
            )
            dq_BLHd[:, qs] += dq
            pieces.append((ks, dk, dv))
            del dq, dk, dv
        if first and not masked:  # the local block (one call, all keys): the accumulator
            (_, dk, dv), pieces = pieces[0], []
            dkv_2BLGd = torch.stack((dk, dv)).to(acc)
            del dk, dv
        elif first:  # with documents or a window the local block's calls may leave keys out
            dkv_2BLGd = torch.zeros((2, *k_BLGd.shape), dtype=acc, device=k_BLGd.device)
        else:  # the accumulator of this step's block, with the previous ranks' shares
            dkv_2BLGd = dkv_pending.wait()
        while pieces:
            ks, dk, dv = pieces.pop()
            dkv_2BLGd[0][:, ks] += dk
            dkv_2BLGd[1][:, ks] += dv
            del dk, dv
        if C > 1:  # pass it on; after the last step it reaches its owner
            dkv_pending = ring_send_recv(dkv_2BLGd, group, tag=_DKV_TAG)
            dkv_2BLGd = None
        if kv_pending is not None:
            kv_2BLGd = kv_pending.wait()
    del kv_2BLGd
    if dkv_pending is not None:
        dkv_2BLGd = dkv_pending.wait()
    return dq_BLHd.to(q_BLHd.dtype), dkv_2BLGd[0].to(k_BLGd.dtype), dkv_2BLGd[1].to(v_BLGd.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, backend, layout, docs, window, call, sinks_H):
        reused = None if call is None else call.reused()
        if reused is not None:  # a checkpoint's recomputation: the forward's out and lse
            out, lse = reused
        else:
            args = (group, causal, scale, backend, layout)
            out, lse = _forward(q, k, v, *args, docs=docs, window=window)
            if sinks_H is not None:  # after the merge: out' (in place), lse'
                lse = sinks.apply_(out, lse, sinks_H)
            if call is not None:
                call.keep([out, lse])
        del call, reused
        save_for_backward(ctx, keep=(q, k, v, out, sinks_H), free=(lse,))
        ctx.args, ctx.masks = (group, causal, scale, backend, layout), (docs, window)
        return out

    @staticmethod
    def backward(ctx, dout):
        (*keep, sinks_H), free = saved_for_backward(ctx)
        docs, window = ctx.masks
        dout = dout.contiguous()
        dsinks = None  # the rank's L rows of every head: a share of the full gradient
        if sinks_H is not None and ctx.needs_input_grad[11]:
            dsinks = sinks.grad(dout, keep[3], free[0], sinks_H).to(sinks_H.dtype)
        grads = _backward(dout, *keep, *free, *ctx.args, docs=docs, window=window)
        return (*grads, None, None, None, None, None, None, None, None, dsinks)


@torch.compiler.disable  # a clean graph break: see upipe.attention
def ring_attention(
    q,
    k,
    v,
    *,
    group,
    causal=True,
    softmax_scale=None,
    backend=None,
    layout="zigzag",
    cu_seqlens=None,
    window=None,
    sinks=None,
):
    """Attention over a sequence sharded across `group` in `layout`, by ring exchange of K/V.

    q `[B, L, H, d]`, k/v `[B, L, G, d]`: rank r holds its tokens in `layout` -- "zigzag"
    (chunks r and 2C-1-r of 2C; balanced under a causal mask; L must be even) or
    "contiguous" (tokens r*L .. (r+1)*L-1); shard with `upipe.comm.shard_sequence(...,
    layout=layout)`. Returns `[B, L, H, d]`, the rank's rows of full attention over all
    C*L tokens; differentiable w.r.t. q, k, v. Any H and G with G dividing H (query head h
    uses kv head h // (H / G)). `backend` selects the local kernel (see `upipe.kernels`).
    `cu_seqlens`: document boundaries `[0, e_1, ..., S]` of the full sequence (a 1-D integer
    tensor or ints, the same on every rank and batch row; `upipe.packing.check_cu_seqlens`):
    a token attends only to tokens of its own document (documents.py); None: one document.
    `window`: a causal sliding window (token i sees keys i-window+1 .. i, `upipe.attention.
    window`); steps whose keys lie wholly outside it make no kernel call.
    `sinks`: attention sinks `[H]` (gpt-oss, `upipe.attention.sinks`; applied after the
    merge), differentiable, or None; each rank's gradient is its rows' share, the sum over
    the ranks the full gradient.
    """
    docs = DocumentsArg(cu_seqlens)
    validate_qkv(
        q,
        k,
        v,
        strategy=STRATEGIES["ring"],
        group=group,
        causal=causal,
        softmax_scale=softmax_scale,
        backend=backend,
        extra=lambda C: (check_layout(layout, q.shape[1], C), docs.check(C * q.shape[1])),
        extra_signature={"layout": layout, **docs.signature()},
        window=window,
        sinks=sinks,
    )
    args = (group, causal, softmax_scale, backend, layout, docs.bounds, window)
    return _RingAttention.apply(q, k, v, *args, kept.claim("ring", q, k, v), sinks)
