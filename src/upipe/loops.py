"""Loops whose iterations repeat the same memory.

- Sequence tiles (`tile_starts`): each iteration of the tiled MLP's loops and of the chunked
  loss's (`upipe.model.features._TiledRecompute` forward and backward,
  `upipe.loss._FusedChunkedCrossEntropy` forward), of the blocks of upipe's own delta rule
  (`upipe.kernels_delta_rule`: forward, and the backward's pass for the states and its
  reverse pass; the states and the input gradients allocated whole before them), and of
  the fused UPipe op's row chunks
  (the output projection summed over the stages, `upipe.attention.fused._o_proj`, and dx
  summed over the stages' parts, `staged_layer.DxAccumulator.result`: an fp32 accumulator
  of one chunk's rows each) allocates and frees the same buffers -- one tile's -- writes
  its slice of an output allocated once and accumulates gradients in place. Only the
  first iteration can differ (it may allocate the output or a `.grad`), and the last, the
  only one that can be a partial tile, is no larger.
- Ring steps (`ring_steps`, `upipe.attention.ring`): a step receives the next kv block (the
  backward also a dk/dv accumulator) into buffers of fixed shapes and attends to a block
  whose shapes depend only on which query and key halves meet, so a step's memory depends
  only on its block and on whether it receives a next one (every step but the last does).
- Chunk scans (`chunk_scan`, `upipe.kernels_deltanet`): transformers' torch implementation of
  the chunked gated delta rule (`torch_chunk_gated_delta_rule`) runs a Python loop over the
  64-token chunks of the sequence; every iteration allocates the same buffers and saves the
  same for backward (the chunk's state and corrected values), reading slices of tensors
  allocated once before the loop.

- Chunk recurrences (`chunk_steps`, `upipe.kernels_delta_rule`): the loop across the
  chunks of upipe's own delta rule, forward and backward, writes each chunk's state and
  corrected values (forward) or their gradients (backward) into slices of tensors allocated
  once before the loop and updates one carried state in place: an iteration allocates
  nothing.

All always run every iteration: what the compute code computes depends on its arguments
alone. The planner's simulator, where nothing is computed, relies on the repetition to run
fewer iterations: for one simulated step it substitutes these functions
(`upipe.planner.sampled`). So call them through the module (`loops.tile_starts(...)`, not
`from upipe.loops import tile_starts`), which `tests/distributed/test_layers.py` checks.
"""

from __future__ import annotations

from collections.abc import Callable


def tile_starts(length: int, tile: int) -> range:
    """Offsets of the tiles of `tile` tokens covering `length` tokens."""
    return range(0, length, tile)


def ring_steps(C: int, rank: int, block: Callable[[int, int], object]) -> list[tuple]:
    """The steps of `rank` in a ring of C: (first, block, receives) with `block(rank, src)`
    the block computed at the step that holds source rank src's kv, and `receives` whether
    the step also receives the next kv block: steps i = 0 .. C-1 with src = (rank - i) mod C."""
    return [(i == 0, block(rank, (rank - i) % C), i + 1 < C) for i in range(C)]


def chunk_steps(n: int) -> range:
    """The chunks 0 .. n-1 of a chunk recurrence (module doc)."""
    return range(n)


def chunk_scan(reference: Callable, *args, **kwargs):
    """`reference(*args, **kwargs)`: a chunked scan (transformers'
    `torch_chunk_gated_delta_rule`) whose loop over chunks repeats its memory (module doc)."""
    return reference(*args, **kwargs)
