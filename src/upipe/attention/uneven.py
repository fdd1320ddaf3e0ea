"""Heads split unevenly over the ranks: H not a multiple of C, or G and C not dividing one
another (e.g. Qwen2.5-7B, 28 query and 4 kv heads, on 8 GPUs; 30 heads on 4).

Legend: H query heads, G kv heads, g = H / G query heads per kv head, C group size,
U heads per stage, u = U / C query heads per rank per stage.

**Query heads** (as DeepSpeed-Ulysses): rank c gets a contiguous range of ceil(H / C)
heads if c < H mod C, else floor(H / C). **kv heads follow**: query head h uses kv head
h // g, so rank c needs kv heads (first // g) .. (last // g) of its range -- a kv head
whose query heads straddle two ranks goes to both (a copy each), and its gradient comes
back from both and is summed (fp32). Per rank: ceil(H/C) query heads, at most
ceil(H/C)/g + 2 kv heads (G < C: one, or two where a boundary falls inside a group).

Locally, query head i of a rank need not use kv head i // (h / k) (standard GQA): with 4
query heads 4..7 and g = 7, heads 4, 5, 6 use kv head 0 and head 7 kv head 1. The rank's
heads are then cut into **segments**, runs of kv heads with the same number of query heads
each, and the kernel runs once per segment (`stage.SegmentedAttention`); a rank whose
heads are standard runs one call, as on an even split.

**UPipe** on such a split (`UnevenRound`, `plan_uneven`): stage s gives each rank the next
u of its own query heads (the last stages give fewer, or none, to the ranks with floor(H/C)
heads). A **round** is a run of stages whose kv heads fit, on every rank, in K heads --
K the most one stage needs -- exchanged once and reused by the round's stages; the dK/dV
of its stages are summed (fp32) and sent back once per round (a kv head spanning two
rounds of a rank comes back from both and is summed).

Memory: every buffer in the head layout holds ceil(H/C) (Ulysses) or u (UPipe) query heads
on the largest rank, against H/C or u on an even split: the peak rises by the largest
rank's share, ceil(H/C) / (H/C) of the head-proportional buffers (docs/upipe.md).

Heads are picked by contiguous ranges (`gather` / `scatter_` / `scatter_add_`: copies of
slices), never index tensors, so nothing synchronises the host with the device.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from upipe.attention.stage import SegmentedAttention

Ranges = tuple[tuple[int, int], ...]
"""Per rank, a contiguous range of heads: (first, count)."""
Segment = tuple[int, int, int, int]
"""(first query head, query heads, first kv head, kv heads), local to a rank: standard GQA."""


def is_uneven(H: int, G: int, C: int) -> bool:
    """Whether the heads need the uneven split (the even one needs C | H and G, C dividing
    one another; Ulysses alone needs C | G, which `ulysses_split` checks)."""
    return bool(H % C or (G % C and C % G))


def query_ranges(H: int, C: int) -> Ranges:
    """Rank c's query heads: ceil(H / C) for c < H mod C, floor(H / C) after, in order."""
    counts = [H // C + (c < H % C) for c in range(C)]
    return tuple((sum(counts[:c]), n) for c, n in enumerate(counts))


def kv_range(first: int, count: int, g: int) -> tuple[int, int]:
    """The kv heads used by query heads first .. first + count - 1: (first kv head, count)."""
    if count == 0:
        return (first // g, 0)
    lo, hi = first // g, (first + count - 1) // g + 1
    return (lo, hi - lo)


def counts(ranges: Ranges) -> tuple[int, ...]:
    return tuple(n for _, n in ranges)


def consecutive(ranges: Ranges) -> bool:
    """Whether the ranges follow one another (the rank-major list is the tensor itself)."""
    return all(s == sum(n for _, n in ranges[:c]) for c, (s, _) in enumerate(ranges))


def segments(q: tuple[int, int], kv: tuple[int, int], g: int) -> tuple[Segment, ...]:
    """Standard-GQA runs of a rank's query heads `q` over its kv heads `kv` (module doc)."""
    (q0, nq), (k0, nk) = q, kv
    out: list[list[int]] = []
    for j in range(k0, k0 + nk):
        a, b = max(q0, j * g), min(q0 + nq, (j + 1) * g)
        if a >= b:
            continue
        if out and out[-1][1] == (b - a) * out[-1][3] and out[-1][2] + out[-1][3] == j - k0:
            out[-1][1] += b - a
            out[-1][3] += 1
        else:
            out.append([a - q0, b - a, j - k0, 1])
    return tuple(tuple(s) for s in out)


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


@dataclasses.dataclass(frozen=True)
class UlyssesSplit:
    """The uneven Ulysses split of one rank (`ulysses_split`)."""

    q: Ranges
    kv: Ranges
    segments: tuple[Segment, ...]
    """this rank's kernel calls"""

    @property
    def kv_shared(self) -> bool:
        """Whether a kv head goes to more than one rank (or the ranges skip none in order)."""
        return not consecutive(self.kv)


@functools.lru_cache(maxsize=256)
def ulysses_split(H: int, G: int, C: int, rank: int) -> UlyssesSplit | None:
    """Rank `rank`'s uneven Ulysses split, or None where the even exchange applies (C divides
    H and G)."""
    if H % C == 0 and G % C == 0:
        return None
    g = H // G
    q = query_ranges(H, C)
    kv = tuple(kv_range(s, n, g) for s, n in q)
    return UlyssesSplit(q=q, kv=kv, segments=segments(q[rank], kv[rank], g))


@dataclasses.dataclass(frozen=True)
class UnevenRound:
    """A UPipe round on an uneven split: the schedule's `Round` interface for
    `schedule.select_q` etc. (module doc)."""

    kv: Ranges
    """per rank, the round's kv heads"""
    stages: tuple[Ranges, ...]
    """per stage, per rank, its query heads"""
    stage_segments: tuple[tuple[Segment, ...], ...]
    """per stage, this rank's kernel calls"""
    sums_kv = True
    """kv gradients are summed into fp32 accumulators (kv heads may repeat)"""

    @property
    def kv_split(self) -> tuple[int, ...]:
        return counts(self.kv)

    def q_split(self, s: int) -> tuple[int, ...]:
        return counts(self.stages[s])

    def stage_attention(self, attn, s: int):
        return SegmentedAttention(attn, self.stage_segments[s])


def _union(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    if a[1] == 0:
        return b
    if b[1] == 0:
        return a
    lo = min(a[0], b[0])
    return (lo, max(a[0] + a[1], b[0] + b[1]) - lo)


@functools.lru_cache(maxsize=256)
def plan_uneven(H: int, G: int, C: int, U: int, rank: int) -> tuple[UnevenRound, ...]:
    """UPipe's rounds and stages for an uneven split, seen from rank `rank` (module doc).
    U is a multiple of C (u = U / C heads per rank per stage), at most C * ceil(H / C)."""
    g, u = H // G, U // C
    q = query_ranges(H, C)
    n_stages = -(-q[0][1] // u)
    stages = [
        tuple((s0 + min(i * u, n), max(0, min(u, n - i * u))) for s0, n in q)
        for i in range(n_stages)
    ]
    kv_of = [tuple(kv_range(s, n, g) for s, n in st) for st in stages]
    K = max(n for st in kv_of for _, n in st)  # kv heads per rank per round
    rounds, first = [], 0
    while first < n_stages:
        kv, last = kv_of[first], first + 1
        while last < n_stages:
            grown = tuple(_union(a, b) for a, b in zip(kv, kv_of[last], strict=True))
            if max(n for _, n in grown) > K:
                break
            kv, last = grown, last + 1
        mine = kv[rank]
        rounds.append(
            UnevenRound(
                kv=kv,
                stages=tuple(stages[first:last]),
                stage_segments=tuple(segments(st[rank], mine, g) for st in stages[first:last]),
            )
        )
        first = last
    return tuple(rounds)
