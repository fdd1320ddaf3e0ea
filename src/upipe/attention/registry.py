"""The registry of context-parallel strategies: what each one needs, in one place.

Everything above the attention layer reads it: `ContextParallelAttention` (module.py), the
trainer (`upipe.train`), the planner, the benchmark, the demo and the Hugging Face
integration; the ops read their own entry to validate their inputs
(`common.validate_qkv`). Adding a strategy is its op in a file of its own plus one
`Strategy` entry in `STRATEGIES` below (CONTRIBUTING.md has the checklist;
tests/distributed/test_registry.py checks the promise with a strategy defined in the test).

An entry names its op by import path ("module:function"), imported on first use: the ops
import this module for their entries, so this module imports none of them.

The head rules are `upipe.heads`'; `check_heads` applies a strategy's (whether it splits
heads at all) and words it for the caller.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from upipe.heads import few_heads_problem

# kv-head rules over C ranks (the ulysses size), and the rule of query heads:
SPLIT = "split"  # kv heads go with their query heads (Ulysses: shared where a group straddles)
REPLICATE = "replicate"  # as SPLIT, or replicated m = C / G times on an even split (UPipe)
WHOLE = "whole"  # whole heads on every rank (the sequence is split, never the heads)
# SPLIT and REPLICATE accept the same head counts: any G dividing H, with C <= H; where C
# does not divide H or G the heads are split unevenly (`upipe.heads`).


_OPS: dict[str, Callable] = {}
"""The ops named by path, each imported once (a plain dict, which torch.compile traces)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy:
    """What a strategy needs from the code above it."""

    name: str
    impl: str | Callable | None
    """The functional op (`op`), by import path "module:function" or itself; None for "none"
    (no context parallelism: the model's own attention, which takes `cu_seqlens` too)."""
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
    def op(self) -> Callable | None:
        """The functional op `op(q, k, v, *, group | mesh, causal, softmax_scale, backend,
        layout, cu_seqlens, window, sinks)` (every op takes document boundaries,
        `upipe.attention.documents`, a sliding window, `upipe.attention.window`, and sinks,
        `upipe.attention.sinks`), or None."""
        if not isinstance(self.impl, str):
            return self.impl
        if self.impl not in _OPS:
            module, _, name = self.impl.partition(":")
            _OPS[self.impl] = getattr(importlib.import_module(module), name)
        return _OPS[self.impl]

    @property
    def context_parallel(self) -> bool:
        """Whether the sequence is split at all (False: every rank holds whole sequences)."""
        return self.impl is not None

    @property
    def splits_heads(self) -> bool:
        """Whether the query heads are split across the ulysses ranks (evenly where C divides
        H and G, else unevenly: `upipe.heads`)."""
        return self.kv_heads != WHOLE


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            name="none", impl=None, group=False, mesh=False, layout="contiguous", kv_heads=WHOLE
        ),
        Strategy(
            name="ulysses",
            impl="upipe.attention.ulysses:ulysses_attention",
            group=True,
            mesh=True,  # on a mesh the module runs usp_attention
            layout="contiguous",
            kv_heads=SPLIT,
            module="ulysses",
            on_mesh_called="usp",
        ),
        Strategy(
            name="ring",
            impl="upipe.attention.ring:ring_attention",
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
            impl="upipe.attention.usp:usp_attention",
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
            impl="upipe.attention.upipe:upipe_attention",
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


def module_strategies() -> tuple[str, ...]:
    """The strategies `ContextParallelAttention` takes (those that are their own `module`)."""
    return tuple(name for name, s in STRATEGIES.items() if s.module == name)


def get_strategy(name: str, choices=STRATEGIES) -> Strategy:
    """The registry entry of `name`; ValueError naming the choices if it is not in `choices`."""
    if name not in choices:
        raise ValueError(f"unknown strategy {name!r}; choose one of {tuple(choices)}")
    return STRATEGIES[name]


def group_strategies() -> tuple[str, ...]:
    """The strategies whose op takes a 1-D group (the demo runs these)."""
    return tuple(name for name, s in STRATEGIES.items() if s.group and s.context_parallel)


def heads_problem(strategy: str | Strategy, H: int, G: int, C: int) -> str | None:
    """The head rule that H query and G kv heads over C (ulysses) ranks break for `strategy`
    (a name or an entry): "heads" (fewer query heads than ranks, for a strategy that splits
    heads); None if none. Head counts C does not divide are split unevenly (`upipe.heads`;
    the largest rank holds ceil(H/C) heads). That G divides H is the model's rule, checked
    where the model is built (`upipe.heads.kv_problem`)."""
    spec = get_strategy(strategy) if isinstance(strategy, str) else strategy
    if spec.splits_heads and few_heads_problem(H, C) is not None:
        return "heads"
    return None


def check_heads(
    strategy: str | Strategy,
    H: int,
    G: int,
    C: int,
    *,
    size: str,
    query: str = "num_heads",
    whole: str = "strategy='ring'",
    model: str | None = None,
) -> str | None:
    """`heads_problem` as a message (`upipe.heads.few_heads_problem`), or None. `size` names
    C ("context-parallel size", "ulysses size"), `query` H, `whole` the way out (a strategy
    keeping whole heads); with `model` (a command line's model name) the message names it."""
    if heads_problem(strategy, H, G, C) is None:
        return None
    return few_heads_problem(H, C, size=size, query=query, whole=whole, model=model)
