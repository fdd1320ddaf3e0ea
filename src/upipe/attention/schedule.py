"""Which heads each UPipe stage processes: GQA-aware scheduling.

Legend: H query heads, G kv heads, C group size, U heads per stage (`heads_per_stage`),
u = U / C query heads per rank per stage.

When G < C, kv heads are replicated R = C / G times so that every rank holds one: "virtual"
kv head j is real kv head j // R, and the function is unchanged because query head h uses
real kv head h // (H / G) = (virtual kv head h // (H / C)) // R. With G' = max(G, C) virtual
kv heads, each shared by g' = H / G' query heads:

- a **round** exchanges C * k kv heads, k = max(1, u / g') per rank; rank r gets virtual kv
  heads (round start + r*k ... + k - 1) -- each kv head is projected and sent once per pass;
- a **stage** of the round then sends each rank u' = min(u, g') of the query heads of each
  of its k kv heads -- all g' query heads of a kv head run in the round's back-to-back stages,
  which reuse the round's kv buffers; dK/dV are summed over them before going back once.

Head lists are rank-major, so after the all-to-all rank r holds query heads [u of them]
and kv heads [k], and local query i uses local kv head i // u' (standard GQA locally).
U = H gives one round of one stage: plain Ulysses.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Round:
    kv_heads: tuple[int, ...]
    """Real kv head indices, rank-major (C * k entries; repeats when G < C)."""
    stages: tuple[tuple[int, ...], ...]
    """Per stage, the U query head indices, rank-major."""


def valid_heads_per_stage(H: int, G: int, C: int) -> list[int]:
    """All supported values of U for these head counts and group size."""
    return [U for U in range(C, H + 1, C) if _problem(H, G, C, U) is None]


def _problem(H: int, G: int, C: int, U: int) -> str | None:
    if H % G or H % C or (G % C and C % G):
        return (
            f"cannot be scheduled: {H} query heads and {G} kv heads need G | H, C | H and "
            f"G, C dividing one another (C = {C})"
        )
    if U % C:
        return f"must be a multiple of the context-parallel size ({C})"
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


def plan_rounds(H: int, G: int, C: int, U: int) -> list[Round]:
    """The stage schedule for validated (H, G, C, U); see the module docstring."""
    R = max(1, C // G)  # replication of each kv head
    Gv = max(G, C)
    gv, u = H // Gv, U // C
    k, up = max(1, u // gv), min(u, gv)  # kv heads per rank per round, q heads per kv head
    rounds = []
    for start in range(0, Gv, C * k):
        virtual = range(start, start + C * k)
        stages = tuple(
            tuple(vk * gv + j + i for vk in virtual for i in range(up)) for j in range(0, gv, up)
        )
        rounds.append(Round(kv_heads=tuple(vk // R for vk in virtual), stages=stages))
    return rounds
