"""Document masking for packed sequences: which kernel calls a block of attention makes.

Legend: B batch, S full sequence, P tokens a stage attends over (S, or a ring rank's part
on a mesh), L tokens of a ring block, u query heads, k kv heads, d head dim, C ring size.

A packed sequence holds documents e_j .. e_{j+1}-1 (`bounds` = (0, e_1, ..., S), validated
by `upipe.packing.check_cu_seqlens`, no empty document). Query i sees key t iff both lie in
the same document and, when causal, t <= i. Nothing builds that S x S mask: every kernel
call covers one document's rows of a query range against the same document's rows of a key
range, so the calls together are exactly the mask and memory stays O(L).

Ranges come in *segments*: runs of tokens contiguous in the global sequence, placed at a
local offset. After the Ulysses exchange the P tokens are one segment (the all-to-all puts
zigzag chunks back in order); a ring rank's tokens are one segment ("contiguous") or two
("zigzag": chunks r and 2C-1-r). Two segments of the same layout are equal or disjoint, so
for a document d, a query segment Q and a key segment K (causal):
    Q == K:               rows Q∩d vs keys K∩d, a same-length diagonal block (causal call);
    K entirely before Q:  rows Q∩d vs keys K∩d, all visible (non-causal call);
    K entirely after Q:   nothing.
A query row that no call of a ring block covers (its document does not reach the keys)
keeps out = 0, lse = -inf in the block, which the ring's lse merge treats as no
contribution; the local block covers every row (each token sees itself), so the final lse
is finite.

Kernel calls are the existing `upipe.kernels` ones on sub-ranges (any backend). Their
number is the number of (document, segment pair) intersections: about (documents +
segments) per block. The whole-sequence case (`local_forward`) with a kernel that has a
varlen call -- flash, fa3 and fa4, fp16/bf16 -- instead makes one varlen kernel call for all
documents and batch rows (varlen.py); cudnn, efficient, flash_attn and cpu make one dense
call per document. `auto` resolves with `documents=True` here and in ring.py: it takes the
varlen flash kernel where it would take cudnn for a dense call, as cuDNN compiles an
execution graph per distinct shape (`upipe.kernels_select`); an explicit backend="cudnn"
runs per document.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from upipe.attention import varlen
from upipe.attention.window import block_backward, block_forward, reaches
from upipe.kernels import acc_dtype, attention_backward, attention_forward, prepare_kernel


@dataclasses.dataclass(frozen=True)
class Segment:
    """`length` tokens at global positions start .. start+length-1, local offset `at`."""

    at: int
    start: int
    length: int


def layout_segments(layout: str, C: int, r: int, L: int) -> tuple[Segment, ...]:
    """The segments of rank r of C holding L tokens in `layout` (`upipe.comm`)."""
    if layout == "contiguous":
        return (Segment(0, r * L, L),)
    c = L // 2
    return (Segment(0, r * c, c), Segment(c, (2 * C - 1 - r) * c, c))


def block_calls(bounds, q_segs, k_segs, causal: bool, window=None) -> list[tuple]:
    """The kernel calls (query slice, key slice, causal, (q0, k0)) of attention from the
    tokens of `q_segs` to those of `k_segs` under the document mask (module doc), q0 and k0
    the global positions of the call's first row and key; [] if none. With a sliding
    `window` (`upipe.attention.window`) calls whose rows see none of their keys are left
    out; the others still span the document's rows and keys (the window applies inside)."""
    calls = []
    for qs in q_segs:
        for ks in k_segs:
            same = qs.start == ks.start
            if causal and not same and ks.start > qs.start:
                continue  # keys entirely in the future
            lo, hi = max(qs.start, ks.start), min(qs.start + qs.length, ks.start + ks.length)
            for a, b in itertools.pairwise(bounds):
                q0, q1 = max(a, qs.start), min(b, qs.start + qs.length)
                k0, k1 = max(a, ks.start), min(b, ks.start + ks.length)
                if q0 >= q1 or k0 >= k1:
                    continue
                assert same or lo >= hi, "segments must be equal or disjoint"
                if not reaches(q0, q1 - q0, k0, k1 - k0, window):
                    continue
                q_sl = slice(q0 - qs.start + qs.at, q1 - qs.start + qs.at)
                k_sl = slice(k0 - ks.start + ks.at, k1 - ks.start + ks.at)
                calls.append((q_sl, k_sl, causal and same, (q0, k0)))
    return calls


def _kernel(q, backend) -> str:
    """The kernel of a document-masked call: resolved for documents (module doc), checked,
    and for fa3/fa4 activated (the varlen call goes to the aten op directly)."""
    return prepare_kernel(backend, q.device, q.dtype, q.shape[-1], documents=True)


def block_backend(q, backend, docs):
    """The backend of a ring's per-block calls: `backend`, or with documents (`docs` not
    None) the kernel resolved for documents (module doc)."""
    return backend if docs is None else _kernel(q, backend)


def _doc_forward(q, k, v, a, *, causal, softmax_scale, backend, window):
    """One document's (out, lse), its first token at position `a`: the plain kernel call,
    or the sliding window's calls (`upipe.attention.window`)."""
    return block_forward(
        q,
        k,
        v,
        q0=a,
        k0=a,
        causal=causal,
        window=window,
        softmax_scale=softmax_scale,
        backend=backend,
    )


def local_forward(q_BPud, k_BPkd, v_BPkd, bounds, *, causal, softmax_scale, backend, window=None):
    """(out_BPud, lse_BuP) of attention over P tokens in sequence order, document-masked:
    one kernel call per document (each row lies in exactly one, so no merge), or one varlen
    call for all of them where the kernel has one (module doc, varlen.py). `window`: a
    causal sliding window inside each document (`upipe.attention.window`)."""
    kw = dict(causal=causal, softmax_scale=softmax_scale, backend=backend)
    if len(bounds) == 2 and window is None:  # one document: plain attention, no copies
        return attention_forward(q_BPud, k_BPkd, v_BPkd, **kw)
    kw["backend"] = kernel = _kernel(q_BPud, backend)
    if varlen.use_varlen(kernel, window):
        return varlen.forward(
            q_BPud,
            k_BPkd,
            v_BPkd,
            bounds,
            causal=causal,
            softmax_scale=softmax_scale,
            window=window,
        )
    if len(bounds) == 2:
        return _doc_forward(q_BPud, k_BPkd, v_BPkd, 0, window=window, **kw)
    B, P, u, _ = q_BPud.shape
    out_BPud = torch.empty_like(q_BPud)
    lse_BuP = torch.empty(B, u, P, dtype=acc_dtype(q_BPud.dtype), device=q_BPud.device)
    for a, b in itertools.pairwise(bounds):
        o, lse = _doc_forward(
            q_BPud[:, a:b], k_BPkd[:, a:b], v_BPkd[:, a:b], a, window=window, **kw
        )
        out_BPud[:, a:b] = o
        lse_BuP[:, :, a:b] = lse
        del o, lse
    return out_BPud, lse_BuP


def local_backward(dout, q, k, v, out, lse, bounds, *, causal, softmax_scale, backend, window=None):
    """(dq, dk, dv) of `local_forward` from its saved out and lse, per document (or in one
    varlen call where `local_forward` made one)."""
    kw = dict(causal=causal, softmax_scale=softmax_scale, backend=backend)
    if len(bounds) == 2 and window is None:
        return attention_backward(dout, q, k, v, out, lse, **kw)
    kw["backend"] = kernel = _kernel(q, backend)
    if varlen.use_varlen(kernel, window):
        kw.pop("backend")
        return varlen.backward(dout, q, k, v, out, lse, bounds, window=window, **kw)
    if len(bounds) == 2:
        return block_backward(dout, q, k, v, out, lse, q0=0, k0=0, window=window, **kw)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for a, b in itertools.pairwise(bounds):
        rows = slice(a, b)
        grads = block_backward(
            dout[:, rows],
            q[:, rows],
            k[:, rows],
            v[:, rows],
            out[:, rows],
            lse[:, :, rows].contiguous(),
            q0=a,
            k0=a,
            window=window,
            **kw,
        )
        for acc, g in zip((dq, dk, dv), grads, strict=True):
            acc[:, rows] = g
        del grads
    return dq, dk, dv
