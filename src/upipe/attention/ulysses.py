"""Ulysses attention (DeepSpeed-Ulysses): all-to-all from sequence shards to head shards.

Legend: B batch, S full sequence, L = S / C local tokens, H query heads, G kv heads,
h = H / C and g = G / C heads per rank, d head dim, C group size.

Forward on each rank:
    q_BLHd, k_BLGd, v_BLGd  --seq_to_head-->  q_BShd, k_BSgd, v_BSgd
    out_BShd, lse_BhS = attention(q_BShd, k_BSgd, v_BSgd)       (all S tokens, h heads)
    out_BShd  --head_to_seq-->  out_BLHd
Backward: dout_BLHd -> dout_BShd, the kernel's backward from the saved out/lse, then
dq/dk/dv back to the sequence layout.

Saved for backward: q_BShd, k_BSgd, v_BSgd, out_BShd, lse -- the full-head intermediates
that UPipe (upipe.py) avoids keeping. Backward frees each buffer as soon as it is used (a
lean baseline, so that comparisons with UPipe are fair).
"""

from __future__ import annotations

import torch

from upipe.attention.common import (
    DocumentsArg,
    check_layout,
    save_for_backward,
    saved_for_backward,
    validate_qkv,
)
from upipe.attention.stage import StageAttention
from upipe.comm import HeadExchange


def _forward(q_BLHd, k_BLGd, v_BLGd, ex, attn):
    q_BShd, k_BSgd, v_BSgd = (ex.to_head(t) for t in (q_BLHd, k_BLGd, v_BLGd))
    out_BShd, lse_BhS = attn.forward(q_BShd, k_BSgd, v_BSgd)
    return ex.to_seq(out_BShd), [q_BShd, k_BSgd, v_BSgd, out_BShd, lse_BhS]


def _backward(dout_BLHd, saved, ex, attn):
    """`saved` is a list this function empties, so each buffer dies as soon as it is used."""
    dout_BShd = ex.to_head(dout_BLHd)
    grads_BS = list(attn.backward(dout_BShd, *saved))
    saved.clear()
    del dout_BShd
    grads_BL = []
    while grads_BS:  # convert dq, dk, dv one at a time, freeing each head-layout gradient
        grads_BL.append(ex.to_seq(grads_BS.pop(0)))
    return grads_BL


class UlyssesFunction(torch.autograd.Function):
    """Ulysses (the exchange `ex`, `upipe.comm.HeadExchange`) around any stage attention
    `attn` (stage.py): the local kernel here, ring attention over the ring group in USP."""

    @staticmethod
    def forward(ctx, q, k, v, ex, attn):
        out, saved = _forward(q, k, v, ex, attn)
        save_for_backward(ctx, keep=(), free=saved)  # backward frees them one by one
        ctx.args = (ex, attn)
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = _backward(dout.contiguous(), saved_for_backward(ctx)[1], *ctx.args)
        return (*grads, None, None)


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
):
    """Attention over a sequence sharded across `group`.

    q `[B, L, H, d]`, k/v `[B, L, G, d]`: rank r holds tokens r*L .. (r+1)*L-1 (layout
    "contiguous"), or chunks r and 2C-1-r of 2C ("zigzag", as ring attention; see
    `upipe.comm.shard_sequence`). Returns `[B, L, H, d]`, the rank's rows of full attention
    over all C*L tokens; differentiable
    w.r.t. q, k, v. Needs H and G divisible by the group size C (and G dividing H; query
    head h uses kv head h // (H / G)). `backend` selects the local kernel (see
    `upipe.kernels`); the default follows the device.
    `cu_seqlens`: document boundaries `[0, e_1, ..., S]` of the full sequence (a 1-D integer
    tensor or ints, the same on every rank and batch row; `upipe.comm.check_cu_seqlens`):
    a token attends only to tokens of its own document (`upipe.attention.documents`); None:
    one document (plain attention, unchanged).
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
        extra=lambda C: (check_layout(layout, q.shape[1], C), docs.check(C * q.shape[1])),
        extra_signature={"layout": layout, **docs.signature()},
    )
    ex = HeadExchange(group, layout)
    attn = StageAttention(causal, softmax_scale, backend, docs=docs.bounds)
    return UlyssesFunction.apply(q, k, v, ex, attn)
