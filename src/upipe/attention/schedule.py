"""Which heads each UPipe stage processes: GQA-aware scheduling.

Legend: H query heads, G kv heads, C group size, U heads per stage (`heads_per_stage`),
u = U / C query heads per rank per stage, m = C / G copies of a replicated kv head.

When G < C, kv heads are replicated m = C / G times so that every rank holds one: "virtual"
kv head j is real kv head j // m, and the function is unchanged because query head h uses
real kv head h // (H / G) = (virtual kv head h // (H / C)) // m. With G' = max(G, C) virtual
kv heads, each shared by g' = H / G' query heads:

- a **round** exchanges C * k kv heads, k = max(1, u / g') per rank; rank r gets virtual kv
  heads (round start + r*k ... + k - 1) -- each kv head is projected and sent once per pass;
- a **stage** of the round then sends each rank u' = min(u, g') of the query heads of each
  of its k kv heads -- all g' query heads of a kv head run in the round's back-to-back stages,
  which reuse the round's kv buffers; dK/dV are summed over them before going back once.

Head lists are rank-major, so after the all-to-all rank r holds query heads [u of them]
and kv heads [k], and local query i uses local kv head i // u' (standard GQA locally).
U = H gives one round of one stage: plain Ulysses.

When C does not divide H, or G and C do not divide one another, the heads are split
unevenly instead (`uneven.plan_uneven`: rounds of `uneven.UnevenRound`, which the functions
below accept alike; U then is any multiple of C up to C * ceil(H / C)).

No index tensors: query head h = vk * g' + i sits at (vk, i) of the [G', g'] head grid, and
a stage takes the rectangle rows `first .. first + width - 1` (the round's virtual kv
heads), columns `s * u' .. s * u' + u' - 1` -- a strided view (`select_q`). A round's
virtual kv heads are consecutive real heads, each repeated m times (`select_kv`). Slicing
needs no device tensor built from a Python list, so the stage loops issue no host-device
synchronisation (a `torch.tensor(list, device="cuda")` would copy from pageable memory and
wait for the stream), and under fake tensors and `torch.compile` they are plain views.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from upipe.attention import uneven
from upipe.attention.uneven import UnevenRound


@dataclasses.dataclass(frozen=True)
class Round:
    kv_heads: tuple[int, ...]
    """Real kv head indices, rank-major (C * k entries; repeats when G < C)."""
    stages: tuple[tuple[int, ...], ...]
    """Per stage, the U query head indices, rank-major."""
    first: int
    """The round's first virtual kv head (a row of the [G', g'] head grid)."""
    width: int
    """Virtual kv heads in the round: C * k."""
    replicas: int
    """m: copies of each real kv head (C / G when G < C, else 1)."""
    per_kv: int
    """g': query heads per virtual kv head (columns of the head grid)."""
    stage_width: int
    """u': query heads of each virtual kv head in one stage."""

    # The interface shared with `uneven.UnevenRound` (heads split unevenly over the ranks):
    @property
    def sums_kv(self) -> bool:
        """Whether kv gradients are summed (replicated heads) rather than put in place."""
        return self.replicas > 1

    kv_split = None
    """per-rank kv head counts of the exchange; None: equal (the even exchange)"""

    def q_split(self, s: int) -> None:
        """per-rank query head counts of stage s's exchange; None: equal"""
        return None

    def stage_attention(self, attn, s: int):
        """the attention stage s runs (every rank's heads are standard GQA: `attn` itself)"""
        return attn


def select_q(t: torch.Tensor, dim: int, rnd: Round, stage: int) -> torch.Tensor:
    """Stage `stage` of `rnd`'s query heads of t (H heads at `dim`), as a view with the heads
    at dims (dim, dim + 1) = [width, u']; `.flatten(dim, dim + 1)` lists them in the order of
    `rnd.stages[stage]` (a copy, as the heads are strided). An `UnevenRound`'s: a copy,
    rank-major, as [1, n] at (dim, dim + 1)."""
    if isinstance(rnd, UnevenRound):
        return uneven.gather(t, dim, rnd.stages[stage]).unsqueeze(dim)
    grid = t.unflatten(dim, (-1, rnd.per_kv))
    rows = grid.narrow(dim, rnd.first, rnd.width)
    return rows.narrow(dim + 1, stage * rnd.stage_width, rnd.stage_width)


def put_q(dst: torch.Tensor, dim: int, rnd: Round, stage: int, src: torch.Tensor) -> None:
    """dst's query heads of the stage (H heads at `dim`) <- src (U heads at `dim`)."""
    if isinstance(rnd, UnevenRound):
        return uneven.scatter_(dst, dim, rnd.stages[stage], src)
    view = select_q(dst, dim, rnd, stage)
    view.copy_(src.view(view.shape))


def _real_kv(t: torch.Tensor, dim: int, rnd: Round) -> torch.Tensor:
    return t.narrow(dim, rnd.first // rnd.replicas, rnd.width // rnd.replicas)


def select_kv(t: torch.Tensor, dim: int, rnd: Round) -> torch.Tensor:
    """The round's C * k virtual kv heads of t (G real heads at `dim`), in the order of
    `rnd.kv_heads`: a view, or with replicas (G < C) a copy repeating each real head m
    times. An `UnevenRound`'s: every rank's kv heads, rank-major (a copy)."""
    if isinstance(rnd, UnevenRound):
        return uneven.gather(t, dim, rnd.kv)
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
        return uneven.scatter_add_(acc, dim, rnd.kv, g)
    parts = g.unflatten(dim, (-1, rnd.replicas)).sum(dim + 1, dtype=acc.dtype)
    _real_kv(acc, dim, rnd).add_(parts)


def put_kv(dst: torch.Tensor, dim: int, rnd: Round, g: torch.Tensor) -> None:
    """dst's kv heads of the round <- g, for an unreplicated round (each head once)."""
    assert rnd.replicas == 1, "replicated kv heads are summed: use add_kv_"
    _real_kv(dst, dim, rnd).copy_(g)


def valid_heads_per_stage(H: int, G: int, C: int) -> list[int]:
    """All supported values of U for these head counts and group size."""
    top = C * -(-H // C)  # C * ceil(H / C): one stage (on an uneven split)
    return [U for U in range(C, top + 1, C) if _problem(H, G, C, U) is None]


def _problem(H: int, G: int, C: int, U: int) -> str | None:
    if H % G or H < C:
        return (
            f"cannot be scheduled: {H} query heads and {G} kv heads need G | H and at least "
            f"C = {C} query heads"
        )
    if U % C:
        return f"must be a multiple of the context-parallel size ({C})"
    if uneven.is_uneven(H, G, C):  # stages of u = U / C of each rank's heads
        top = C * -(-H // C)
        if top < U:
            return f"must be at most {top} (C x ceil(H / C): one stage of the uneven split)"
        return None
    if U > H or H % U:
        return f"must divide the number of query heads ({H})"
    Gv = max(G, C)
    gv, u = H // Gv, U // C
    if gv % u and (u % gv or (Gv // C) % (u // gv)):
        return (
            f"gives {u} query heads per rank per stage, which must divide or be a multiple of "
            f"the {gv} query heads per kv head (GQA scheduling)"
        )
    return None


def check_heads_per_stage(H: int, G: int, C: int, U) -> int:
    """`U` itself (C when None) if supported, else a ValueError listing the valid values."""
    if U is None:
        U = C
    if isinstance(U, bool) or not isinstance(U, int):
        raise TypeError(f"heads_per_stage must be an int or None, got {type(U).__name__}")
    problem = _problem(H, G, C, U) if U > 0 else "must be positive"
    if problem:
        raise ValueError(
            f"heads_per_stage ({U}) {problem}; valid values for {H} query heads, {G} kv heads "
            f"and group size {C}: {valid_heads_per_stage(H, G, C)}"
        )
    return U


def plan_schedule(H: int, G: int, C: int, U: int, rank: int) -> tuple:
    """The rounds of validated (H, G, C, U) seen from rank `rank`: `plan_rounds` (the same on
    every rank) on an even split, `uneven.plan_uneven` on an uneven one."""
    if uneven.is_uneven(H, G, C):
        return uneven.plan_uneven(H, G, C, U, rank)
    return plan_rounds(H, G, C, U)


@functools.lru_cache(maxsize=256)
def plan_rounds(H: int, G: int, C: int, U: int) -> tuple[Round, ...]:
    """The stage schedule for validated (H, G, C, U); see the module docstring. Cached:
    every layer call with the same head counts gets the same (immutable) schedule."""
    m = max(1, C // G)  # copies of each kv head
    Gv = max(G, C)
    gv, u = H // Gv, U // C
    k, up = max(1, u // gv), min(u, gv)  # kv heads per rank per round, q heads per kv head
    rounds = []
    for start in range(0, Gv, C * k):
        virtual = range(start, start + C * k)
        stages = tuple(
            tuple(vk * gv + j + i for vk in virtual for i in range(up)) for j in range(0, gv, up)
        )
        rounds.append(
            Round(
                kv_heads=tuple(vk // m for vk in virtual),
                stages=stages,
                first=start,
                width=C * k,
                replicas=m,
                per_kv=gv,
                stage_width=up,
            )
        )
    return tuple(rounds)
