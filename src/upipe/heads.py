"""Every head rule and head plan of upipe, stated once; plain Python (no torch), so that the
JAX port (`upipe.jax`) and anything that only plans (the planner, the CLI's checks) can use it.

Legend: H query heads, G kv heads, g = H / G query heads per kv head, C the ranks the heads
are split over (the context-parallel size; on a mesh the ulysses size), U heads per stage
(`heads_per_stage`), u = U / C query heads per rank per stage, k kv heads per rank per
round, m = C / G copies of a replicated kv head, G' = max(G, C) virtual kv heads each shared
by g' = H / G' query heads.

**Rules** (each caller words the numbers in its own names: `query=`, `kv=`, `size=`):
- `kv_problem`: G divides H; query head h uses kv head h // g (standard GQA).
- `few_heads_problem`: a strategy that splits heads needs C <= H (every rank gets one).
- `is_uneven`: the *even* split needs C | H and G, C dividing one another (G < C: each kv
  head replicated m times); any other counts are split unevenly (below).
  `even_ulysses`: C | H and C | G, the split of plain Ulysses with no replication.
  `even_problem`: the even split's rule in words, for code that runs only on it.
- `stage_problem` / `valid_heads_per_stage` / `check_heads_per_stage`: U is a multiple of
  C; on an even split U | H and u divides or is a multiple of g' (GQA scheduling); on an
  uneven one U <= C * ceil(H / C). The ValueError lists the valid values.

**Plans** (what a rank exchanges and computes; head lists are rank-major):

*Even split, UPipe's GQA-aware stages* (`plan_rounds`, `Round`). When G < C, kv heads are
replicated so that every rank holds one: virtual kv head j is real kv head j // m, and the
function is unchanged because query head h uses real kv head h // g = (virtual kv head
h // (H / C)) // m. A **round** exchanges C * k kv heads, k = max(1, u / g') per rank; rank
r gets virtual kv heads (round start + r*k ... + k - 1) -- each kv head is projected and sent
once per pass. A **stage** of the round then sends each rank u' = min(u, g') of the query
heads of each of its k kv heads -- all g' query heads of a kv head run in the round's
back-to-back stages, which reuse the round's kv buffers; dK/dV are summed over them before
going back once. After the exchange rank r holds u query heads and its k kv heads, and local
query i uses local kv head i // u' (standard GQA locally). U = H is one round of one stage:
plain Ulysses. Heads as a grid: query head h = vk * g' + i sits at (vk, i) of the [G', g']
grid, and a stage is the rectangle rows `first .. first + width - 1`, columns
`s * u' .. s * u' + u' - 1` -- a strided view of a tensor (`upipe.attention.schedule`).

*Uneven split* (H not a multiple of C, or G and C not dividing one another; e.g.
Qwen2.5-7B's 28 query and 4 kv heads on 8 GPUs). **Query heads** (as DeepSpeed-Ulysses):
rank c gets a contiguous range of ceil(H / C) heads if c < H mod C, else floor(H / C)
(`query_ranges`). **kv heads follow**: rank c needs kv heads (first // g) .. (last // g)
of its range (`kv_range`) -- a kv head whose query heads straddle two ranks goes to both (a
copy each), and its gradient comes back from both and is summed (fp32). Per rank: ceil(H/C)
query heads, at most ceil(H/C)/g + 2 kv heads. Locally a rank's heads need not be standard
GQA (4 query heads 4..7 with g = 7: heads 4, 5, 6 use kv head 0, head 7 kv head 1), so they
are cut into **segments** (`segments`), runs of kv heads with the same number of query heads
each, and the kernel runs once per segment; a rank whose heads are standard runs one call.
Ulysses on it: `ulysses_split`. UPipe on it (`plan_uneven`, `UnevenRound`): stage s gives
each rank the next u of its own query heads (the last stages give fewer, or none, to the
ranks with floor(H/C) heads); a round is a run of stages whose kv heads fit, on every rank,
in K heads -- K the most one stage needs -- exchanged once and reused by the round's stages,
their dK/dV summed (fp32) and sent back once per round. Memory: the largest rank holds
ceil(H/C) (Ulysses) or u (UPipe) query heads, against H/C or u on an even split.

*The DeepSpeed drop-in's stages* (`contiguous_stages`): stage s holds query heads s*U ..
s*U + U - 1 in order, and each rank the kv heads of its share.

*The planner's candidates*: `stage_candidates` (U = C and 2C), `usp_ulysses_size`.

Plans are tuples of ints (no index tensors), so a stage loop that slices by them issues no
host-device synchronisation, and they are cached: every layer call with the same head
counts gets the same (immutable) plan.
"""

from __future__ import annotations

import dataclasses
import functools
import math

# --- rules ---------------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    """The positive divisors of n, ascending."""
    return [i for i in range(1, n + 1) if n % i == 0]


def kv_problem(H: int, G: int, *, query: str = "query heads", kv: str = "kv heads") -> str | None:
    """Why G kv heads do not fit H query heads (G must divide H), or None; `query` and `kv`
    name the two counts as the caller's arguments do."""
    if G >= 1 and H % G == 0:
        return None
    return f"{kv} ({G}) must divide {query} ({H}); valid {kv}: {divisors(H)}"


def few_heads_problem(
    H: int,
    C: int,
    *,
    size: str = "context-parallel size",
    query: str = "query heads",
    whole: str | None = "ring attention",
    model: str | None = None,
) -> str | None:
    """Why H query heads cannot be split over C ranks (every rank needs one: C <= H), or None.
    `size` names C, `whole` the way to keep whole heads on every rank (None: there is none);
    with `model` (a command line's model name) the message names the model."""
    if H >= C:
        return None
    if whole is None:
        return (
            f"{query} ({H}) must be at least the {size} ({C}): every rank gets one; use a "
            f"size of at most {H}"
        )
    if model is not None:
        return (
            f"{model} has {H} heads, fewer than the {size} {C}; use a size of at most {H}, "
            f"or {whole}"
        )
    return (
        f"{query} ({H}) must be at least the {size} ({C}): every rank gets a query head; use "
        f"a size of at most {H}, or {whole} (whole heads on every rank)"
    )


def is_uneven(H: int, G: int, C: int) -> bool:
    """Whether the heads need the uneven split: the even one needs C | H and G, C dividing
    one another."""
    return bool(H % C or (G % C and C % G))


def even_ulysses(H: int, G: int, C: int) -> bool:
    """Whether plain Ulysses splits the heads evenly with no kv head replicated: C | H, C | G."""
    return H % C == 0 and G % C == 0


def even_problem(H: int, G: int, C: int, *, size: str = "group size") -> str | None:
    """Why the heads have no even split over C ranks (`is_uneven`), in words, for code that
    runs only on an even split; None if they have one."""
    if H % C:
        return f"the {size} ({C}) must divide the query heads ({H}); use a size in {divisors(H)}"
    if G % C and C % G:
        sizes = [c for c in divisors(H) if G % c == 0 or c % G == 0]
        return (
            f"the kv heads ({G}) and the {size} ({C}) must divide one another (kv heads are "
            f"split across ranks, or replicated when fewer); use a size in {sizes}"
        )
    return None


def stage_problem(
    H: int, G: int, C: int, U: int, *, query: str = "query heads", kv: str = "kv heads"
) -> str | None:
    """Why U heads per stage do not fit (H, G, C), completing "heads_per_stage (U) ...", or
    None (module doc); `query` and `kv` name the two head counts (a Gated DeltaNet's value
    and key heads follow the same rules)."""
    if H % G or H < C:
        return (
            f"cannot be scheduled: {H} {query} and {G} {kv} need G | H and at least C = {C} {query}"
        )
    if U % C:
        return f"must be a multiple of the context-parallel size ({C})"
    if is_uneven(H, G, C):  # stages of u = U / C of each rank's heads
        top = C * -(-H // C)
        if top < U:
            return f"must be at most {top} (C x ceil(H / C): one stage of the uneven split)"
        return None
    if U > H or H % U:
        return f"must divide the number of {query} ({H})"
    gv, u = H // max(G, C), U // C
    if gv % u and (u % gv or (max(G, C) // C) % (u // gv)):
        return (
            f"gives {u} {query} per rank per stage, which must divide or be a multiple of "
            f"the {gv} {query} per one of the {kv} (GQA scheduling)"
        )
    return None


def valid_heads_per_stage(
    H: int, G: int, C: int, *, query: str = "query heads", kv: str = "kv heads"
) -> list[int]:
    """All supported values of U for these head counts and group size."""
    top = C * -(-H // C)  # C * ceil(H / C): one stage (on an uneven split)
    words = dict(query=query, kv=kv)
    return [U for U in range(C, top + 1, C) if stage_problem(H, G, C, U, **words) is None]


def check_heads_per_stage(
    H: int,
    G: int,
    C: int,
    U,
    *,
    name: str = "heads_per_stage",
    query: str = "query heads",
    kv: str = "kv heads",
) -> int:
    """`U` itself (C when None) if supported, else a ValueError listing the valid values;
    `name` names U, `query` and `kv` the head counts, as the caller's arguments do."""
    if U is None:
        U = C
    if isinstance(U, bool) or not isinstance(U, int):
        raise TypeError(f"{name} must be an int or None, got {type(U).__name__}")
    words = dict(query=query, kv=kv)
    problem = stage_problem(H, G, C, U, **words) if U > 0 else "must be positive"
    if problem:
        raise ValueError(
            f"{name} ({U}) {problem}; valid values for {H} {query}, {G} {kv} and group size "
            f"{C}: {valid_heads_per_stage(H, G, C, **words)}"
        )
    return U


# --- the uneven split ----------------------------------------------------------------------

Ranges = tuple[tuple[int, int], ...]
"""Per rank, a contiguous range of heads: (first, count)."""
Segment = tuple[int, int, int, int]
"""(first query head, query heads, first kv head, kv heads), local to a rank: standard GQA."""


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
    """The head count of each rank's range."""
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
    """Rank `rank`'s uneven Ulysses split, or None where the even exchange applies
    (`even_ulysses`)."""
    if even_ulysses(H, G, C):
        return None
    g = H // G
    q = query_ranges(H, C)
    kv = tuple(kv_range(s, n, g) for s, n in q)
    return UlyssesSplit(q=q, kv=kv, segments=segments(q[rank], kv[rank], g))


# --- UPipe's rounds and stages -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Round:
    """A round of the even split's schedule (`plan_rounds`)."""

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

    # The interface shared with `UnevenRound` (heads split unevenly over the ranks):
    @property
    def sums_kv(self) -> bool:
        """Whether kv gradients are summed (replicated heads) rather than put in place."""
        return self.replicas > 1

    kv_split = None
    """per-rank kv head counts of the exchange; None: equal (the even exchange)"""

    def q_split(self, s: int) -> None:
        """per-rank query head counts of stage s's exchange; None: equal"""
        return None

    def segments(self, s: int) -> None:
        """this rank's kernel calls in stage s (`Segment`s); None: one standard-GQA call"""
        return None


@dataclasses.dataclass(frozen=True)
class UnevenRound:
    """A UPipe round on an uneven split (`plan_uneven`), with `Round`'s interface."""

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

    def segments(self, s: int) -> tuple[Segment, ...]:
        return self.stage_segments[s]


def plan_schedule(H: int, G: int, C: int, U: int, rank: int) -> tuple:
    """The rounds of validated (H, G, C, U) seen from rank `rank`: `plan_rounds` (the same on
    every rank) on an even split, `plan_uneven` on an uneven one."""
    if is_uneven(H, G, C):
        return plan_uneven(H, G, C, U, rank)
    return plan_rounds(H, G, C, U)


@functools.lru_cache(maxsize=256)
def plan_rounds(H: int, G: int, C: int, U: int) -> tuple[Round, ...]:
    """The stage schedule of an even split for validated (H, G, C, U) (module doc)."""
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


# --- the DeepSpeed drop-in's stages and the planner's candidates ----------------------------


def contiguous_stages(H: int, G: int, C: int, U: int | None) -> list[tuple[int, list[int]]]:
    """Per stage of the DeepSpeed drop-in (`upipe.integrations.deepspeed`): (first query head,
    the kv heads sent, rank by rank: C * k of them). Stage s holds query heads s*U .. s*U +
    U - 1; rank r gets h = U / C of them, from s*U + r*h, and the kv heads they use (i // g).
    Every rank must get as many kv heads, so h divides g (k = 1) or g divides h (k = h / g).
    U defaults to C; a ValueError lists the valid values otherwise."""
    U = C if U is None else U
    problem = kv_problem(H, G, query="the query heads H", kv="kv heads G")
    g = 0 if problem else H // G

    def aligned(h: int) -> bool:
        return g % h == 0 or h % g == 0

    valid = [u for u in range(C, H + 1, C) if H % u == 0 and g and aligned(u // C)]
    if not problem and (U < 1 or U % C or H % U or not aligned(U // C)):
        problem = (
            f"heads_per_stage ({U}) must be a multiple of the group size ({C}) dividing the "
            f"query heads ({H}), with U / C dividing or divided by the {g} queries per kv head"
        )
    if problem:
        raise ValueError(f"{problem}; valid heads_per_stage for H={H}, G={G}, C={C}: {valid}")
    h = U // C
    ranges = [[kv_range(first + r * h, h, g) for r in range(C)] for first in range(0, H, U)]
    return [
        (first, [i for lo, n in kv for i in range(lo, lo + n)])
        for first, kv in zip(range(0, H, U), ranges, strict=True)
    ]


def stage_candidates(H: int, C: int) -> tuple[int, ...]:
    """The heads per stage the planner tries by default: C and 2C (one and two heads per rank
    per stage), those at most H."""
    return tuple(U for U in (C, 2 * C) if U <= H)


def usp_ulysses_size(n: int, G: int) -> int:
    """The ulysses size the planner gives USP on n GPUs: as many ranks as the kv heads allow
    (gcd(n, G): every rank keeps whole kv heads), halved where that would leave no ring."""
    uly = math.gcd(n, G)
    return uly if uly < n else max(1, uly // 2)
