"""USP (unified sequence parallelism): Ulysses inside a ulysses group, ring across groups.

Legend: B batch, S full sequence, R ring size, C ulysses size, L = S / (R * C) local tokens,
P = C * L tokens of a ring rank, H query heads, G kv heads, h = H / C query and k = G / C
kv heads per rank, d head dim.

The sequence is in the mesh layout of `upipe.comm` (`shard_sequence(x, mesh=mesh)`): the
ring dim splits it in `layout` (zigzag: ring rank i holds chunks i and 2R-1-i of 2R), the
ulysses dim splits each ring rank's part contiguously. Forward on each rank:
    q_BLHd, k_BLGd, v_BLGd  --seq_to_head(ulysses)-->  q_BPhd, k_BPkd, v_BPkd
        (the ring rank's P tokens, in its layout order, for h query and k kv heads)
    out_BPhd, lse_BhP = ring attention over the ring group (ring.py, via stage.py)
    out_BPhd  --head_to_seq(ulysses)-->  out_BLHd
Backward: dout_BLHd -> dout_BPhd, the ring backward from the saved out and lse (kv blocks
and their gradient accumulators travel the ring again), then dq/dk/dv back to the sequence
layout. With R = 1 this is Ulysses (the local kernel, no ring), with C = 1 ring attention.
Heads C does not divide are split unevenly as in Ulysses (`upipe.heads`); the
ranks of a ring share their ulysses index, so they hold the same heads, and each standard-
GQA segment of them is one ring attention.

Saved for backward: q_BPhd, k_BPkd, v_BPkd, out_BPhd, lse (as Ulysses, over P tokens);
backward frees each as soon as it is used. The autograd function is Ulysses' own
(`ulysses.UlyssesFunction`) with ring attention as its stage attention.
"""

from __future__ import annotations

import torch

from upipe.attention import kept
from upipe.attention.common import DocumentsArg, check_ring_layout, resolve_groups, validate_qkv
from upipe.attention.registry import STRATEGIES
from upipe.attention.stage import StageAttention
from upipe.attention.ulysses import UlyssesFunction, split_attention
from upipe.comm import HeadExchange
from upipe.mesh import check_mesh


@torch.compiler.disable  # a clean graph break: see upipe.attention
def usp_attention(
    q,
    k,
    v,
    *,
    mesh,
    causal=True,
    softmax_scale=None,
    backend=None,
    layout="zigzag",
    cu_seqlens=None,
    window=None,
    sinks=None,
):
    """Attention over a sequence sharded across a 2-D mesh: Ulysses x ring.

    q `[B, L, H, d]`, k/v `[B, L, G, d]`: this rank's tokens in the mesh layout
    (`upipe.comm.shard_sequence(x, mesh=mesh, layout=layout)`). `mesh` has dims "ring" and
    "ulysses" (`upipe.make_mesh`); any other dim (dp) holds independent replicas. Returns
    `[B, L, H, d]`, the rank's rows of full attention over all R*C*L tokens; differentiable
    w.r.t. q, k, v. G must divide H (query head h uses kv head h // (H / G)) and the ulysses
    size C be at most H (heads C does not divide are split unevenly, as in Ulysses); with
    layout="zigzag" and R > 1, C*L must be even. `backend` selects the local kernel (see
    `upipe.kernels`).
    `cu_seqlens`: document boundaries `[0, e_1, ..., S]` of the full sequence (a 1-D integer
    tensor or ints, the same on every rank and batch row; `upipe.packing.check_cu_seqlens`):
    a token attends only to tokens of its own document (`upipe.attention.documents`); None:
    one document (plain attention, unchanged).
    `window`: a causal sliding window (token i sees keys i-window+1 .. i; None: none), with
    work proportional to it (`upipe.attention.window`).
    `sinks`: attention sinks `[H]` (`upipe.attention.sinks`; applied after each ring's
    merge), or None; each rank's gradient holds its heads' share over its rows, the sum
    over the mesh's ranks is the full gradient.
    """
    check_mesh(mesh)
    ulysses, ring_group, R, agree = resolve_groups(None, mesh)
    docs = DocumentsArg(cu_seqlens)

    def extra(C):
        check_ring_layout(layout, C * q.shape[1], R, C)
        docs.check(R * C * q.shape[1])

    validate_qkv(
        q,
        k,
        v,
        strategy=STRATEGIES["usp"],
        group=ulysses,
        causal=causal,
        softmax_scale=softmax_scale,
        backend=backend,
        extra=extra,
        extra_signature={"layout": layout, **docs.signature()},
        agree=agree,
        window=window,
        sinks=sinks,
    )
    kernel = (causal, softmax_scale, backend, ring_group, layout)
    attn = StageAttention(*kernel, docs=docs.bounds, window=window)
    split, attn = split_attention(q.shape[2], k.shape[2], ulysses, attn)
    call = kept.claim("usp", q, k, v)
    return UlyssesFunction.apply(q, k, v, HeadExchange(ulysses), attn, split, call, sinks)
