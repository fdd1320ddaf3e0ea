"""The simulator's shortcut through the loops whose iterations repeat the same memory
(`upipe.loops`): the worst rank's peak, at a cost independent of the sequence length and
the ring size.

Under `sampled_loops()` the tile loops (tiled MLP, chunked loss) run their first two tiles
only: the third and later repeat the memory of the second or stay below it. A ring runs its
diagonal block and then, twice each, every off-diagonal block that *any* rank of the ring
computes: ranks differ only in those blocks, and a step's memory depends only on its block
and on whether it receives a next one, so the simulated rank's peak is the worst rank's.
`tests/runs/test_plan.py` compares the peaks with those of the full loops on every rank.

Why the simulator substitutes the loops rather than the loops having a mode: the shortcut
leaves real outputs unwritten or wrong, so no compute code may ever be left in it. Here it
exists only on the simulator's own path: `StepSimulator.step` swaps these functions into
`upipe.loops` for one simulated step, inside its fake process group and `FakeTensorMode`
(nothing real is computed there; the simulator refuses to start in a process that has a
process group), as it swaps in the memory of CUDA's RMSNorm (`upipe.planner.step._kernels`).
Ring attention, the loss, the tiled MLP and `upipe.loops` keep no state and no switch. An
explicit argument would instead travel through the model, the attention module and every
strategy's signature for a concern of the simulator alone; a context variable would keep a
hidden mode in the compute path. The iterations run are those of the former module switch,
so the plans are byte-identical and as fast.
"""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

from upipe import loops


def _tile_starts(length: int, tile: int) -> range:
    """The first two tiles of `loops.tile_starts`."""
    return range(0, length, tile)[:2]


def _ring_steps(C: int, rank: int, block: Callable[[int, int], object]) -> list[tuple]:
    """`loops.ring_steps` cut short: the first step (the diagonal block), then every
    off-diagonal block of any rank twice, receiving if any rank receives after it."""
    blocks, receive = [], []  # each off-diagonal block of any rank; received after anywhere?
    for r in range(C):
        for i in range(1, C):
            b = block(r, (r - i) % C)
            if b not in blocks:  # (==, not hash: blocks hold slices)
                blocks.append(b)
                receive.append(False)
            receive[blocks.index(b)] |= i + 1 < C
    twice = [(False, b, rec) for b, rec in zip(blocks, receive, strict=True) for _ in (0, 1)]
    return [(True, block(rank, rank), C > 1), *twice]


def sampled_loops():
    """Within the block `upipe.loops` takes the shortcut above (for fake tensors only: real
    outputs would be left unwritten or wrong)."""
    return mock.patch.multiple(loops, tile_starts=_tile_starts, ring_steps=_ring_steps)
