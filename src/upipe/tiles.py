"""Sequence tiles: where the tiled MLP and the chunked loss start each tile, and the memory
simulator's shortcut through those loops.

Each iteration of the two loops (`upipe.model.features._TiledRecompute`,
`upipe.loss._ChunkedCrossEntropy`, forward and backward) allocates and frees the same
buffers -- one tile's -- writes its slice of an output allocated once and accumulates
gradients in place. Only the first iteration can differ (it may allocate the output or a
`.grad`), and the last, the only one that can be a partial tile, is no larger: iterations
3 .. n repeat the memory of iteration 2 or stay below it. Under `sampled()` -- used by
`upipe.memory.step`, where nothing is computed -- `starts` yields the first two tiles only:
a simulated step then costs the same at any sequence length, and its peak memory is
unchanged (`tests/test_plan.py` compares peaks with and without).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

_sampled = False


def starts(length: int, tile: int) -> Sequence[int]:
    """Offsets of the tiles of `tile` tokens covering `length` tokens (all of them, unless
    under `sampled()`)."""
    offsets = range(0, length, tile)
    return offsets[:2] if _sampled else offsets


@contextlib.contextmanager
def sampled():
    """Within the block, the tile loops visit their first two tiles only (for simulation
    under fake tensors: real outputs would be left unwritten)."""
    global _sampled
    before, _sampled = _sampled, True
    try:
        yield
    finally:
        _sampled = before
