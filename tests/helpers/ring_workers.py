"""Per-rank functions for the ring attention and sequence layout tests (spawned ranks)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from workers import make_qkv

import upipe.attention.ring as ring
from upipe.attention.common import forget_agreements
from upipe.comm import ring_send_recv, sequence_positions, shard_sequence, unshard_sequence


def run_ring(rank, world_size, shape, kwargs, dtype=torch.float32, hooks=False):
    """Forward+backward of ring attention on this rank's shard in kwargs["layout"].

    Returns this rank's token positions and its (out, dq, dk, dv) shards as fp64 tensors.
    `hooks`: run under saved-tensor hooks (saved tensors offloaded to CPU).
    """
    group = dist.group.WORLD
    layout = kwargs["layout"]
    q, k, v, dout = make_qkv(**shape, dtype=dtype)
    leaves = [shard_sequence(t, group=group, layout=layout).requires_grad_() for t in (q, k, v)]
    with torch.autograd.graph.save_on_cpu() if hooks else contextlib.nullcontext():
        out = ring.ring_attention(*leaves, group=group, **kwargs)
    out.backward(shard_sequence(dout, group=group, layout=layout))
    pos = sequence_positions(shape["S"], rank=rank, world_size=world_size, layout=layout)
    return pos, [t.detach().double() for t in (out, *(x.grad for x in leaves))]


def layout_roundtrip(rank, world_size, B, S, layout):
    """shard/unshard of known data; positions vs the shard; position-id sharding."""
    group = dist.group.WORLD
    full = torch.arange(B * S * 3, dtype=torch.float64).view(B, S, 3)  # value = its index
    part = shard_sequence(full, group=group, layout=layout)
    pos = sequence_positions(S, rank=rank, world_size=world_size, layout=layout)
    pos_ids = torch.arange(S)[None].expand(B, S) + 100  # position ids [B, S]
    return {
        "roundtrip_exact": torch.equal(unshard_sequence(part, group=group, layout=layout), full),
        "positions_match": torch.equal(part, full.index_select(1, pos)),
        "pos_ids_match": torch.equal(
            shard_sequence(pos_ids, group=group, layout=layout), pos[None].expand(B, -1) + 100
        ),
        "dim2_exact": torch.equal(
            unshard_sequence(
                shard_sequence(full.transpose(1, 2), group=group, dim=2, layout=layout),
                group=group,
                dim=2,
                layout=layout,
            ),
            full.transpose(1, 2),
        ),
        "pos": pos,
    }


def ring_shift(rank, world_size):
    """C shifts of two concurrent exchanges (distinct tags); what each rank held at each step."""
    group = dist.group.WORLD
    a = torch.full((2, 3), float(rank))
    b = torch.full((5,), 10.0 + rank, dtype=torch.float64)
    seen = []
    for _ in range(world_size):
        pa = ring_send_recv(a, group, tag=0)
        pb = ring_send_recv(b, group, tag=1)
        b = pb.wait()
        a = pa.wait()
        seen.append((a[0, 0].item(), b[0].item(), a.shape, b.dtype))
    return seen


def ring_errors(rank, world_size, cases):
    """Call ring attention with per-rank ((q shape, kv shape), kwargs); (type, message) or None.

    Every case is a pair of lists indexed by rank.
    """
    group = dist.group.WORLD
    out = []
    for shapes, kwargs in cases:
        (q_shape, kv_shape), kw = shapes[rank], kwargs[rank]
        q, kv = torch.randn(*q_shape), torch.randn(*kv_shape)
        forget_agreements()  # a first call: ranks whose inputs differ must exchange verdicts
        try:
            ring.ring_attention(q, kv, kv, group=group, **kw)
            out.append(None)
        except (TypeError, ValueError) as e:
            out.append((type(e).__name__, str(e)))
    return out


def layout_errors(rank, world_size):
    """shard/unshard with a bad layout or length: the messages."""
    group = dist.group.WORLD
    calls = {
        "zigzag length": lambda: shard_sequence(torch.zeros(1, 6, 2), group=group, layout="zigzag"),
        "unknown": lambda: shard_sequence(torch.zeros(1, 8, 2), group=group, layout="striped"),
        "unshard odd": lambda: unshard_sequence(torch.zeros(1, 3, 2), group=group, layout="zigzag"),
        "unshard unknown": lambda: unshard_sequence(torch.zeros(1, 4), group=group, layout="x"),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def ring_work(rank, world_size, S, layout, causal):
    """Record every kernel call of a forward: [(queries, keys, causal)] (the ring's blocks go
    through `window.block_forward`, which calls the kernel)."""
    from upipe.attention import window

    calls = []
    original = window.attention_forward

    def recording(q, k, v, **kw):
        calls.append((q.shape[1], k.shape[1], kw["causal"]))
        return original(q, k, v, **kw)

    window.attention_forward = recording
    try:
        q = torch.randn(1, S // world_size, 2, 8)
        ring.ring_attention(q, q, q, group=dist.group.WORLD, causal=causal, layout=layout)
    finally:
        window.attention_forward = original
    return calls
