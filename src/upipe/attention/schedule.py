"""The head plans of `upipe.heads` applied to tensors: which heads of q, k, v (and of the
weights, outputs and gradients) each UPipe stage or Ulysses exchange takes and puts back.

Legend: H query heads, G kv heads, C group size, U heads per stage, u' query heads of each
virtual kv head in a stage, m copies of a replicated kv head; `dim` is where the heads sit.

A round is an even split's `heads.Round` or an uneven split's `heads.UnevenRound`:
- even: stage s of a round is the rectangle rows `first .. first + width - 1`, columns
  `s * u' .. s * u' + u' - 1` of the [G', g'] head grid -- a strided view (`select_q`); the
  round's virtual kv heads are consecutive real heads, each repeated m times (`select_kv`);
- uneven: every rank's contiguous range of heads, rank-major (`gather` / `scatter_` /
  `scatter_add_`: copies of slices).
No index tensors: slicing needs no device tensor built from a Python list, so the stage loops
issue no host-device synchronisation (a `torch.tensor(list, device="cuda")` would copy from
pageable memory and wait for the stream), and under fake tensors and `torch.compile` they are
plain views.
"""

from __future__ import annotations

import torch

from upipe.attention.stage import SegmentedAttention
from upipe.heads import Ranges, Round, UnevenRound


def gather(t: torch.Tensor, dim: int, ranges: Ranges) -> torch.Tensor:
    """The heads of every rank's range, rank-major, at `dim` (a new contiguous tensor)."""
    return torch.cat([t.narrow(dim, s, n) for s, n in ranges], dim)


def scatter_(dst: torch.Tensor, dim: int, ranges: Ranges, src: torch.Tensor) -> None:
    """dst's heads of the ranges <- src (rank-major at `dim`); the ranges must not overlap."""
    off = 0
    for s, n in ranges:
        dst.narrow(dim, s, n).copy_(src.narrow(dim, off, n))
        off += n


def scatter_add_(dst: torch.Tensor, dim: int, ranges: Ranges, src: torch.Tensor) -> None:
    """dst's heads of the ranges += src (rank-major), in dst's dtype; overlaps add up."""
    off = 0
    for s, n in ranges:
        dst.narrow(dim, s, n).add_(src.narrow(dim, off, n))
        off += n


def stage_attention(attn, rnd, s: int):
    """The attention stage s of `rnd` runs: `attn` itself where every rank's heads are
    standard GQA, else one call per segment (`stage.SegmentedAttention`)."""
    segs = rnd.segments(s)
    return attn if segs is None else SegmentedAttention(attn, segs)


def select_q(t: torch.Tensor, dim: int, rnd: Round, stage: int) -> torch.Tensor:
    """Stage `stage` of `rnd`'s query heads of t (H heads at `dim`), as a view with the heads
    at dims (dim, dim + 1) = [width, u']; `.flatten(dim, dim + 1)` lists them in the order of
    `rnd.stages[stage]` (a copy, as the heads are strided). An `UnevenRound`'s: a copy,
    rank-major, as [1, n] at (dim, dim + 1)."""
    if isinstance(rnd, UnevenRound):
        return gather(t, dim, rnd.stages[stage]).unsqueeze(dim)
    grid = t.unflatten(dim, (-1, rnd.per_kv))
    rows = grid.narrow(dim, rnd.first, rnd.width)
    return rows.narrow(dim + 1, stage * rnd.stage_width, rnd.stage_width)


def put_q(dst: torch.Tensor, dim: int, rnd: Round, stage: int, src: torch.Tensor) -> None:
    """dst's query heads of the stage (H heads at `dim`) <- src (U heads at `dim`)."""
    if isinstance(rnd, UnevenRound):
        return scatter_(dst, dim, rnd.stages[stage], src)
    view = select_q(dst, dim, rnd, stage)
    view.copy_(src.view(view.shape))


def _real_kv(t: torch.Tensor, dim: int, rnd: Round) -> torch.Tensor:
    return t.narrow(dim, rnd.first // rnd.replicas, rnd.width // rnd.replicas)


def select_kv(t: torch.Tensor, dim: int, rnd: Round) -> torch.Tensor:
    """The round's C * k virtual kv heads of t (G real heads at `dim`), in the order of
    `rnd.kv_heads`: a view, or with replicas (G < C) a copy repeating each real head m
    times. An `UnevenRound`'s: every rank's kv heads, rank-major (a copy)."""
    if isinstance(rnd, UnevenRound):
        return gather(t, dim, rnd.kv)
    real = _real_kv(t, dim, rnd)
    if rnd.replicas == 1:
        return real
    shape = list(real.shape)
    shape.insert(dim + 1, rnd.replicas)
    return real.unsqueeze(dim + 1).expand(shape).flatten(dim, dim + 1)


def add_kv_(acc: torch.Tensor, dim: int, rnd: Round, g: torch.Tensor) -> None:
    """In place: acc's kv heads of the round (G at `dim`) += g (C * k at `dim`), the m
    replicas of a head summed in acc's dtype (fp32 accumulators take bf16 parts)."""
    if isinstance(rnd, UnevenRound):
        return scatter_add_(acc, dim, rnd.kv, g)
    parts = g.unflatten(dim, (-1, rnd.replicas)).sum(dim + 1, dtype=acc.dtype)
    _real_kv(acc, dim, rnd).add_(parts)


def put_kv(dst: torch.Tensor, dim: int, rnd: Round, g: torch.Tensor) -> None:
    """dst's kv heads of the round <- g, for an unreplicated round (each head once)."""
    assert rnd.replicas == 1, "replicated kv heads are summed: use add_kv_"
    _real_kv(dst, dim, rnd).copy_(g)
