"""The simulator's shortcut through the loops whose iterations repeat the same memory
(`upipe.loops`): the worst rank's peak, at a cost independent of the sequence length and
the ring size.

Under `sampled_loops()` the tile loops (tiled MLP, chunked loss) run their first two tiles
only: the third and later repeat the memory of the second or stay below it. A ring runs its
diagonal block and then, twice each, every off-diagonal block that *any* rank of the ring
computes: ranks differ only in those blocks, and a step's memory depends only on its block
and on whether it receives a next one, so the simulated rank's peak is the worst rank's.
`tests/runs/test_plan.py` compares the peaks with those of the full loops on every rank.

A chunk scan (`loops.chunk_scan`: transformers' `torch_chunk_gated_delta_rule`, the Gated
DeltaNet layer's scan on the CPU) runs the first `SCAN_CHUNKS` of its n chunks, and its graph
holds a stand-in for the others' saved tensors (`_ChunkSampler`). The loop is transformers'
(`for i in range(num_chunks)`), so it is cut short where it looks its `range` up: in the
function's module globals, for the call of one argument equal to the chunk count. An
iteration allocates the same buffers as any other and keeps the same bytes for backward
(the chunk's state and corrected values: R bytes, measured as the storages that iteration 2
saves first -- iteration 0 saves less, as its zero initial state needs no gradient, and
iteration 1 the first slices of tensors made before the loop); the backward walks the
chunks in reverse, each freeing its R. So at the start of iteration 3 one buffer of
(n - 4) R bytes is allocated and attached to what iteration 0 saved first (freed when the
backward has passed iteration 0, as the real chunks' would have been by then): the four
chunks run then stand for chunks 0, 1, 2 and n - 1 forward and for n - 4 .. n - 1 backward,
where the loop's peaks are (the last chunk forward; the first two chunks of the backward,
before the rest is freed), with the same bytes live.
`tests/distributed/test_plan_hybrid.py` compares the scan's peaks forward and backward with
the full loop's, byte for byte.

A chunk recurrence (`loops.chunk_steps`: upipe's own delta rule, `upipe.kernels_delta_rule`,
the Gated DeltaNet layer's default scan off fla) runs its first `RECURRENCE_CHUNKS` chunks,
forward and backward: an iteration writes into slices of buffers allocated before the loop
and allocates nothing, so the loop's bytes are those of its first chunk. Its blocks (a
sequence longer than `upipe.kernels_delta_rule.BLOCK` tokens) are sequence tiles, cut as the
other tile loops are.
`tests/distributed/test_plan_hybrid.py` compares them with the full loop's, byte for byte.

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

import builtins
from collections.abc import Callable
from unittest import mock

import torch

from upipe import loops
from upipe.torch_private import saved_tensor_hooks_active

SCAN_CHUNKS = 4  # chunks of a chunk scan run (module doc)
RECURRENCE_CHUNKS = 2  # chunks of a chunk recurrence run (module doc)
CHUNK = 64  # transformers' chunk size (`torch_chunk_gated_delta_rule`'s default)


def _tile_starts(length: int, tile: int) -> range:
    """The first two tiles of `loops.tile_starts`."""
    return range(0, length, tile)[:2]


def _chunk_steps(n: int) -> range:
    """The first `RECURRENCE_CHUNKS` chunks of `loops.chunk_steps`."""
    return range(n)[:RECURRENCE_CHUNKS]


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


class _ChunkSampler:
    """The shortcut through one call of a chunk scan of n > `SCAN_CHUNKS` chunks (module
    doc): `range` for the scan's module, and the saved-tensor hooks that measure R and hold
    the skipped chunks' buffer."""

    def __init__(self, n: int):
        self.n, self.chunk = n, -1  # the chunk count; the chunk running (-1: not the loop)
        self.saved: set[int] = set()  # storages saved so far
        self.per_chunk = 0  # R: bytes first saved by chunk 2
        self.holder: list | None = None  # what chunk 0 saved first holds the buffer
        self.cut = False  # the loop was found

    def range(self, *args):
        return self._chunks() if args == (self.n,) else builtins.range(*args)

    def _chunks(self):
        self.cut = True
        for i in builtins.range(SCAN_CHUNKS):
            self.chunk = i
            if i == SCAN_CHUNKS - 1 and self.per_chunk:  # (nothing saved: no graph)
                nbytes = (self.n - SCAN_CHUNKS) * self.per_chunk
                self.holder.append(self.like.new_empty(nbytes, dtype=torch.uint8))
            yield i
        self.chunk = -1

    def pack(self, t: torch.Tensor):
        key = t.untyped_storage()._cdata
        if self.chunk == 2 and key not in self.saved:
            self.per_chunk += t.untyped_storage().nbytes()
        self.saved.add(key)
        if self.chunk == 0 and self.holder is None:
            self.holder, self.like = [], t
            return t, self.holder
        return t

    @staticmethod
    def unpack(packed):
        return packed[0] if isinstance(packed, tuple) else packed


def _chunk_scan(reference: Callable, q, *args, **kwargs):
    """`loops.chunk_scan` cut short (module doc): q `[B, S, ...]` in chunks of `CHUNK`."""
    n = -(-q.shape[1] // CHUNK)
    if n <= SCAN_CHUNKS:
        return reference(q, *args, **kwargs)
    if saved_tensor_hooks_active():  # (ours would hide the scan's tensors from them)
        raise RuntimeError("a chunk scan cannot be cut short under other saved-tensor hooks")
    sampler = _ChunkSampler(n)
    hooks = torch.autograd.graph.saved_tensors_hooks(sampler.pack, sampler.unpack)
    with mock.patch.dict(reference.__globals__, {"range": sampler.range}), hooks:
        out = reference(q, *args, **kwargs)
    if not sampler.cut:  # (a later transformers may loop otherwise: say so, never guess)
        raise RuntimeError(
            f"the chunk scan {reference.__qualname__} did not loop over range({n}): "
            "upipe.planner.sampled cannot cut it short"
        )
    return out


def repeated_tiles(tally):
    """Within the block the tile loops (`loops.tile_starts`) run their first tile, their
    second, which `tally` then counts once more for each whole tile after it
    (`tally.mark()` before the second tile runs, `tally.repeat(mark, w - 2)` after it: w
    whole tiles), and a partial last tile. For counting (`upipe.planner.counts`): a whole
    tile after the first does the same work as the second (`upipe.loops`: only the first
    iteration may allocate an output or a `.grad`); ring steps and chunk scans run in full."""

    def tile_starts(length: int, tile: int):
        starts = range(0, length, tile)
        whole = length // tile
        yield from starts[:1]
        if whole > 1:
            mark = tally.mark()
            yield starts[1]
            tally.repeat(mark, whole - 2)
        if len(starts) > max(whole, 1):  # a partial last tile (after a whole one)
            yield starts[-1]

    return mock.patch.object(loops, "tile_starts", tile_starts)


def sampled_loops():
    """Within the block `upipe.loops` takes the shortcut above (for fake tensors only: real
    outputs would be left unwritten or wrong)."""
    return mock.patch.multiple(
        loops,
        tile_starts=_tile_starts,
        ring_steps=_ring_steps,
        chunk_scan=_chunk_scan,
        chunk_steps=_chunk_steps,
    )
