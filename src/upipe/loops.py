"""Loops whose iterations repeat the same memory, and the memory simulator's shortcut
through them.

- Sequence tiles (`tile_starts`): each iteration of the tiled MLP's and the chunked loss's
  loops (`upipe.model.features._TiledRecompute`, `upipe.loss._ChunkedCrossEntropy`, forward
  and backward) allocates and frees the same buffers -- one tile's -- writes its slice of an
  output allocated once and accumulates gradients in place. Only the first iteration can
  differ (it may allocate the output or a `.grad`), and the last, the only one that can be
  a partial tile, is no larger.
- Ring steps (`ring_steps`, `upipe.attention.ring`): a step receives the next kv block (the
  backward also a dk/dv accumulator) into buffers of fixed shapes and attends to a block
  whose shapes depend only on which query and key halves meet, so a step's memory depends
  only on its block and on whether it receives a next one (every step but the last does).

So in a run of tiles, the third and later repeat the memory of the second or stay below
it. Under `sampled()` -- used by `upipe.planner.step`, where nothing is computed -- the tile
loops run their first two tiles only, and a ring runs its diagonal block and then, twice
each, every off-diagonal block that *any* rank of the ring computes: the simulated rank's
peak is then the worst rank's (ranks differ only in those blocks), and a simulated step
costs the same at any sequence length and ring size. `tests/test_plan.py` compares the
peaks with those of the full loops on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

_sampled = False


def tile_starts(length: int, tile: int) -> Sequence[int]:
    """Offsets of the tiles of `tile` tokens covering `length` tokens (all of them, unless
    under `sampled()`)."""
    offsets = range(0, length, tile)
    return offsets[:2] if _sampled else offsets


def ring_steps(C: int, rank: int, block: Callable[[int, int], object]) -> list[tuple]:
    """The steps of `rank` in a ring of C: (first, block, receives) with `block(rank, src)`
    the block computed at the step that holds source rank src's kv, and `receives` whether
    the step also receives the next kv block. Normally steps i = 0 .. C-1 with
    src = (rank - i) mod C; under `sampled()` see the module doc."""
    steps = [(i == 0, block(rank, (rank - i) % C), i + 1 < C) for i in range(C)]
    if not _sampled:
        return steps
    blocks, receive = [], []  # each off-diagonal block of any rank; received after anywhere?
    for r in range(C):
        for i in range(1, C):
            b = block(r, (r - i) % C)
            if b not in blocks:  # (==, not hash: blocks hold slices)
                blocks.append(b)
                receive.append(False)
            receive[blocks.index(b)] |= i + 1 < C
    return steps[:1] + [
        (False, b, rec) for b, rec in zip(blocks, receive, strict=True) for _ in (0, 1)
    ]


@contextlib.contextmanager
def sampled():
    """Within the block, the loops above take the simulator's shortcut (see the module doc;
    for fake tensors only: real outputs would be left unwritten or wrong)."""
    global _sampled
    before, _sampled = _sampled, True
    try:
        yield
    finally:
        _sampled = before
