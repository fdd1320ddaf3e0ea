"""Document boundaries of a packed sequence (the `cu_seqlens` of varlen attention).

Legend: S full sequence (all documents of a row, before sharding).

`check_cu_seqlens` validates the boundaries `[0, e_1, ..., S]` once, at the boundary, and
returns them as host ints; `document_positions` gives the position ids (RoPE) that restart at
every document. Both act on the full sequence; a rank's shard is indexed with
`upipe.comm.sequence_positions`.
"""

from __future__ import annotations

import itertools

import torch


def check_cu_seqlens(cu_seqlens, S: int) -> tuple[int, ...]:
    """Validated document boundaries of a packed sequence of S tokens, as host ints.

    `cu_seqlens` is a 1-D integer tensor (or a sequence of ints) `[0, e_1, ..., S]`:
    document j holds the tokens e_j .. e_{j+1}-1 of the full (unsharded) sequence. It must
    start at 0, end at S and never decrease; a repeated boundary (an empty document, as a
    packer may emit for padding) is allowed and dropped. Returns the boundaries with the
    repeats removed, so every document in the result has at least one token.

    Host-device synchronisation: reading a CUDA tensor's values (`.tolist()`) waits for the
    GPU -- one sync per call. Pass a CPU tensor (data loaders make one) or a tuple of ints,
    or reuse the tuple this returns, and there is none.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(
                f"cu_seqlens must be 1-D [num_docs + 1], got shape {tuple(cu_seqlens.shape)}; "
                "every batch row shares one set of document boundaries"
            )
        if (
            cu_seqlens.dtype.is_floating_point
            or cu_seqlens.dtype.is_complex
            or (cu_seqlens.dtype == torch.bool)
        ):
            raise ValueError(
                f"cu_seqlens must hold integers, got {cu_seqlens.dtype}; use torch.int32 or int64"
            )
        values = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, (tuple, list)) and all(
        isinstance(e, int) and not isinstance(e, bool) for e in cu_seqlens
    ):
        values = list(cu_seqlens)
    else:
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor or a sequence of ints, got "
            f"{type(cu_seqlens).__name__}"
        )
    if len(values) < 2 or values[0] != 0 or values[-1] != S:
        shown = values if len(values) <= 8 else values[:4] + ["..."] + values[-2:]
        raise ValueError(
            f"cu_seqlens must start at 0 and end at the full sequence length {S}, got "
            f"{shown}; pass the boundaries [0, e_1, ..., {S}] of the whole (unsharded) sequence"
        )
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(
                f"cu_seqlens must not decrease, but cu_seqlens[{i - 1}] = {values[i - 1]} > "
                f"cu_seqlens[{i}] = {values[i]}; pass cumulative document lengths"
            )
    return tuple(e for i, e in enumerate(values) if i == 0 or e != values[i - 1])


def document_positions(cu_seqlens, S: int, *, device=None) -> torch.Tensor:
    """Position ids (LongTensor `[S]`) that restart at 0 at every document start.

    positions[t] = t - e_j for e_j <= t < e_{j+1}. Index it with `sequence_positions` to get
    a rank's shard: `document_positions(cu, S)[sequence_positions(S, rank=r, world_size=C)]`.
    """
    bounds = check_cu_seqlens(cu_seqlens, S)
    lengths = torch.tensor([b - a for a, b in itertools.pairwise(bounds)], device=device)
    starts = torch.tensor(bounds[:-1], device=device)
    return torch.arange(S, device=device) - starts.repeat_interleave(lengths)
