"""The registry of context-parallel strategies: what each one needs, in one place.

Everything above the attention layer reads it: `ContextParallelAttention` (module.py), the
trainer (`upipe.train`), the planner, the benchmark, the demo and the Hugging Face
integration. Adding a strategy is its op in a file of its own plus one `Strategy` entry in
`STRATEGIES` below (CONTRIBUTING.md has the checklist).

The head rules live here once: `heads_problem` says which one a head count breaks, and
`check_heads` words it for the caller (constructor arguments or command-line options).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from upipe.attention.ring import ring_attention
from upipe.attention.ulysses import ulysses_attention
from upipe.attention.upipe import upipe_attention
from upipe.attention.usp import usp_attention

# kv-head rules over C ranks (the ulysses size), and the rule of query heads:
SPLIT = "split"  # kv heads go with their query heads (Ulysses: shared where a group straddles)
REPLICATE = "replicate"  # as SPLIT, or replicated m = C / G times on an even split (UPipe)
WHOLE = "whole"  # whole heads on every rank (the sequence is split, never the heads)
# SPLIT and REPLICATE accept the same head counts: any G dividing H, with C <= H; where C
# does not divide H or G the heads are split unevenly (`upipe.attention.uneven`).


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy:
    """What a strategy needs from the code above it."""

    name: str
    op: Callable | None
    """The functional op `op(q, k, v, *, group | mesh, causal, softmax_scale, backend,
    layout, cu_seqlens, window)` (every op takes document boundaries,
    `upipe.attention.documents`, and a sliding window, `upipe.attention.window`);
    None for "none" (no context parallelism: the model's own attention, which takes
    `cu_seqlens` too)."""
    group: bool
    """Takes a 1-D `group=` (C ranks)."""
    mesh: bool
    """Takes a 2-D `mesh=` (dims ring x ulysses, `upipe.make_mesh`)."""
    layout: str
    """Default sequence layout on a group (on a mesh the ring dim is always "zigzag")."""
    kv_heads: str
    """Rule for the kv heads G over the C ranks: SPLIT, REPLICATE or WHOLE."""
    heads_per_stage: bool = False
    """Takes `heads_per_stage` (U heads of all ranks per stage)."""
    module: str | None = None
    """The `ContextParallelAttention` strategy the trainer and HF swap in (None: no swap)."""
    group_dim: str = "ulysses"
    """The mesh dim a 1-D group of this strategy is (ring-only strategies: "ring")."""
    ring_size: int | None = 1
    """The trainer's default ring size, at most the context-parallel size (None: all of
    it). Plain data, so that an entry pickles (the benchmark sends it to its ranks)."""

    def default_ring(self, cp: int) -> int:
        """The trainer's default ring size on `cp` context-parallel ranks."""
        return cp if self.ring_size is None else min(self.ring_size, cp)

    needs_ring_and_ulysses: bool = False
    """Only runs on a mesh with ring > 1 and ulysses > 1 (e.g. USP)."""
    on_mesh_called: str | None = None
    """The trainer's name for this strategy on a mesh with ring > 1, if another one."""

    @property
    def context_parallel(self) -> bool:
        """Whether the sequence is split at all (False: every rank holds whole sequences)."""
        return self.op is not None

    @property
    def splits_heads(self) -> bool:
        """Whether the query heads are split across the ulysses ranks (evenly where C divides
        H and G, else `upipe.attention.uneven`)."""
        return self.kv_heads != WHOLE


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            name="none", op=None, group=False, mesh=False, layout="contiguous", kv_heads=WHOLE
        ),
        Strategy(
            name="ulysses",
            op=ulysses_attention,
            group=True,
            mesh=True,  # on a mesh the module runs usp_attention
            layout="contiguous",
            kv_heads=SPLIT,
            module="ulysses",
            on_mesh_called="usp",
        ),
        Strategy(
            name="ring",
            op=ring_attention,
            group=True,
            mesh=False,
            layout="zigzag",
            kv_heads=WHOLE,
            module="ring",
            group_dim="ring",
            ring_size=None,
        ),
        Strategy(
            name="usp",
            op=usp_attention,
            group=False,
            mesh=True,
            layout="zigzag",
            kv_heads=SPLIT,
            module="ulysses",
            ring_size=2,
            needs_ring_and_ulysses=True,
        ),
        Strategy(
            name="upipe",
            op=upipe_attention,
            group=True,
            mesh=True,
            layout="contiguous",
            kv_heads=REPLICATE,
            heads_per_stage=True,
            module="upipe",
        ),
    )
}
"""Every strategy by name, in the order the planner reports them."""

MODULE_STRATEGIES = tuple(name for name, s in STRATEGIES.items() if s.module == name)
"""The strategies `ContextParallelAttention` takes."""


def get_strategy(name: str, choices=STRATEGIES) -> Strategy:
    """The registry entry of `name`; ValueError naming the choices if it is not in `choices`."""
    if name not in choices:
        raise ValueError(f"unknown strategy {name!r}; choose one of {tuple(choices)}")
    return STRATEGIES[name]


def group_strategies() -> tuple[str, ...]:
    """The strategies whose op takes a 1-D group (the demo runs these)."""
    return tuple(name for name, s in STRATEGIES.items() if s.group and s.op is not None)


def heads_problem(name: str, H: int, G: int, C: int) -> str | None:
    """The head rule of strategy `name` that H query and G kv heads over C (ulysses) ranks
    break: "heads" (fewer query heads than ranks, for a strategy that splits heads); None if
    none. Head counts C does not divide are split unevenly (`upipe.attention.uneven`; the
    largest rank holds ceil(H/C) heads). That G divides H is the model's rule, checked
    where the model is built."""
    s = STRATEGIES[name]
    if s.splits_heads and H < C:
        return "heads"
    return None


# How each caller names things: a ValueError from a constructor, or a command-line message.
MODULE_WORDS = {
    "heads": "num_heads ({H}) must be at least the {size} ({C}): every rank gets a query "
    "head; use a size of at most {H}, or strategy='ring' (whole heads on every rank)",
}
CLI_WORDS = {
    "heads": "{what} has {H} heads, fewer than the {size} {C}; use a size of at most {H}, or "
    "--strategy ring",
}


def check_heads(
    name: str, H: int, G: int, C: int, *, size: str, words=MODULE_WORDS, what: str = ""
) -> str | None:
    """`heads_problem` as a message in `words` (MODULE_WORDS or CLI_WORDS), or None. `size`
    names C ("context-parallel size", "ulysses size"); `what` names the model (CLI_WORDS)."""
    problem = heads_problem(name, H, G, C)
    if problem is None:
        return None
    return words[problem].format(name=name, H=H, G=G, C=C, size=size, what=what)
