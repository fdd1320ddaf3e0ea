"""The attention one stage runs after the Ulysses all-to-all: local, or ring over a group.

Legend: B batch, P tokens after the all-to-all (the full sequence S on a 1-D group; a ring
rank's part of a 2-D mesh), u query heads, k kv heads, d head dim.

The staged loops (upipe.py, fused.py) and USP (usp.py) call one pair on the gathered
q_BPud, k_BPkd, v_BPkd:
    forward(q, k, v) -> (out_BPud, lse_BuP)
    backward(dout, q, k, v, out, lse) -> (dq, dk, dv)         (from the saved out and lse)
Without a ring group it is the local kernel (`upipe.kernels`); with one, ring attention
over it (ring.py's `_forward`/`_backward`, the P tokens in `layout` across the ring).
With document boundaries `docs` (global, validated: `upipe.packing.check_cu_seqlens`) or a
sliding `window` (`upipe.attention.window`) the local kernel runs once per document, in
the window's calls (`documents.local_forward`; the P tokens are the whole sequence in
order) and the ring per block as `documents.block_calls` says.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from upipe.attention import documents, ring
from upipe.kernels import acc_dtype, attention_backward, attention_forward


@dataclasses.dataclass(frozen=True)
class StageAttention:
    """Local attention, or with `ring_group` ring attention over it; see the module doc."""

    causal: bool
    scale: float | None
    """softmax scale; None for 1 / sqrt(d)"""
    backend: str | None
    """local kernel (`upipe.kernels.BACKENDS`); None (auto) follows the device and dtype"""
    ring_group: dist.ProcessGroup | None = None
    """the ring (None: local attention over the P tokens)"""
    layout: str = "zigzag"
    """how the P tokens of the ring ranks interleave (`upipe.comm.LAYOUTS`)"""
    docs: tuple[int, ...] | None = None
    """document boundaries in the full sequence (None: one document)"""
    window: int | None = None
    """causal sliding window (`upipe.attention.window`; None: none)"""

    def _masked(self) -> bool:
        return self.docs is not None or self.window is not None

    def _bounds(self, P):
        return self.docs if self.docs is not None else (0, P)

    def forward(self, q, k, v):
        if self.ring_group is None:
            kw = dict(causal=self.causal, softmax_scale=self.scale, backend=self.backend)
            if self._masked():
                bounds = self._bounds(q.shape[1])
                return documents.local_forward(q, k, v, bounds, window=self.window, **kw)
            return attention_forward(q, k, v, **kw)
        args = (self.ring_group, self.causal, self.scale, self.backend, self.layout)
        return ring._forward(q, k, v, *args, docs=self.docs, window=self.window)

    def backward(self, dout, q, k, v, out, lse):
        if self.ring_group is None:
            kw = dict(causal=self.causal, softmax_scale=self.scale, backend=self.backend)
            if self._masked():
                bounds, w = self._bounds(q.shape[1]), self.window
                return documents.local_backward(dout, q, k, v, out, lse, bounds, window=w, **kw)
            return attention_backward(dout, q, k, v, out, lse, **kw)
        args = (self.ring_group, self.causal, self.scale, self.backend, self.layout)
        return ring._backward(dout, q, k, v, out, lse, *args, docs=self.docs, window=self.window)


@dataclasses.dataclass(frozen=True)
class SegmentedAttention:
    """`attn` on a rank's heads of an uneven split (`upipe.heads.segments`), where local
    query head i need not use kv head i // (u / k): one call per segment (q0, nq, k0, nk),
    each standard GQA -- query heads q0 .. q0+nq-1 over kv heads k0 .. k0+nk-1. One segment
    covering all heads is a plain call; none (a rank without a head this stage) is no call.
    The outputs are concatenated (a copy), the gradients written into per-stage buffers;
    kv heads no segment uses get zero gradients."""

    attn: StageAttention
    segments: tuple[tuple[int, int, int, int], ...]

    def _whole(self, q, k) -> bool:
        return len(self.segments) == 1 and self.segments[0] == (0, q.shape[2], 0, k.shape[2])

    def forward(self, q, k, v):
        if self._whole(q, k):
            return self.attn.forward(q, k, v)
        B, P, _, _ = q.shape
        outs, lses = (
            [q.new_empty(B, P, 0, q.shape[3])],
            [q.new_empty(B, 0, P, dtype=acc_dtype(q.dtype))],
        )
        for q0, nq, k0, nk in self.segments:
            out, lse = self.attn.forward(
                q.narrow(2, q0, nq), k.narrow(2, k0, nk), v.narrow(2, k0, nk)
            )
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs, 2), torch.cat(lses, 1)

    def backward(self, dout, q, k, v, out, lse):
        if self._whole(q, k):
            return self.attn.backward(dout, q, k, v, out, lse)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for q0, nq, k0, nk in self.segments:
            rows = [t.narrow(2, q0, nq) for t in (dout, q)]
            kv = [t.narrow(2, k0, nk) for t in (k, v)]
            grads = self.attn.backward(*rows, *kv, out.narrow(2, q0, nq), lse.narrow(1, q0, nq))
            for buf, part, (a, n) in zip(
                (dq, dk, dv), grads, ((q0, nq), (k0, nk), (k0, nk)), strict=True
            ):
                buf.narrow(2, a, n).copy_(part)
        return dq, dk, dv
