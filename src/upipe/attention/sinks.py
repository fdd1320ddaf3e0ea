"""Attention sinks (gpt-oss): one learned logit per query head in every row's softmax.

Legend: B batch, P rows a rank holds after its exchange (the full sequence S under
Ulysses / UPipe, a ring rank's part on a mesh, L on a ring), H query heads, u query heads of
a rank (in a stage), d head dim, C group size.

transformers' `GptOssAttention` (models/gpt_oss/modeling_gpt_oss.py, `eager_attention_forward`)
holds `sinks` `[H]` (an `nn.Parameter` in the model's dtype) and appends sink_h as an extra
logit column to every row of head h's scores before the softmax, then drops that column:
the sink is a key with no value. With s_ij the scaled scores of the keys row i may see and
lse_i = log sum_j exp(s_ij) the kernel's log-sum-exp:

    lse'_i = logaddexp(lse_i, sink_h),   p'_ij = exp(s_ij - lse'_i),
    out'_i = sum_j p'_ij v_j = out_i * exp(lse_i - lse'_i)                   (`apply_`)

computed in fp32 after the attention over all keys (for a ring: after its merge), so every
strategy's kernels run unchanged. The op then keeps out' and lse' (for its backward and for
a checkpoint's recomputation, `kept.py`).

Backward. The kernel's backward given out' and lse' is the sink-augmented one: it rebuilds
P' = exp(s - lse'), and its delta_i = rowsum(dO_i * O'_i) is that softmax's (the sink column
has no value, so it adds nothing to dP or to dV), hence dS = P' (dP - delta) gives exact
dq, dk, dv. For the sink: d lse'_i / d sink = exp(sink - lse'_i) =: p'_i,sink, so
d out'_i / d sink = -sum_j p'_ij p'_i,sink v_j = -p'_i,sink out'_i and

    d sink_h = -sum over batch b and rows i of exp(sink_h - lse'_bhi) * delta_bhi     (`grad`)

Placement. A rank sums over the rows it holds for the heads it holds: under Ulysses / UPipe
all S rows of its heads (the complete gradient of those heads), on a ring its L rows of
every head, on a mesh its ring part of its heads. Each op returns a `[H]` gradient with
those entries filled and zeros elsewhere, so the sum over the context-parallel ranks is the
true gradient -- the convention of every replicated parameter in upipe (the fused op's
weight gradients too), and what the trainer does: FSDP2 with divide factor 1 and
`allreduce_gradients` both *sum* over the dp x cp ranks (`upipe.train.parallelize`).

A rank's sink values are picked like its q heads, by views of the `[H]` tensor (a narrow for
Ulysses' contiguous head range here; `schedule.select_q` / `put_q` on a `[1, 1, H, 1]` view
for a UPipe stage, `upipe.stage_sinks`), never by index tensors: no host-device
synchronisation (schedule.py).
"""

from __future__ import annotations

import torch

from upipe.heads import query_ranges

ROW_CHUNKS = 8  # fp32 temporaries cover 1 / ROW_CHUNKS of a rank's rows at a time


def check_sinks(sinks, H: int, device) -> None:
    """A ValueError unless `sinks` is None or a floating `[H]` tensor on `device`."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise ValueError(f"sinks must be a [num_heads] tensor or None, got {type(sinks).__name__}")
    if tuple(sinks.shape) != (H,):
        raise ValueError(
            f"sinks must have shape [num_heads] = ({H},) (one logit per query head), got "
            f"{tuple(sinks.shape)}; pass the layer's full sinks parameter, not a rank's heads"
        )
    if not sinks.dtype.is_floating_point:
        raise ValueError(f"sinks must be a floating-point tensor, got {sinks.dtype}; cast it")
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {device}; move it alike")


def _row_steps(P: int):
    step = max(1, -(-P // ROW_CHUNKS))
    return ((r0, min(P, r0 + step)) for r0 in range(0, P, step))


def apply_(out_BPud: torch.Tensor, lse_BuP: torch.Tensor, sink_u: torch.Tensor) -> torch.Tensor:
    """In place: out <- out * exp(lse - lse') (fp32 math, row chunk by row chunk); returns
    lse' = logaddexp(lse, sink) `[B, u, P]` (a new tensor in lse's dtype)."""
    new_BuP = torch.logaddexp(lse_BuP, sink_u.to(lse_BuP.dtype)[None, :, None])
    w_BPu1 = torch.exp(lse_BuP - new_BuP).transpose(1, 2).unsqueeze(-1)
    for r0, r1 in _row_steps(out_BPud.shape[1]):
        rows = out_BPud[:, r0:r1]
        rows.copy_(rows.to(lse_BuP.dtype) * w_BPu1[:, r0:r1])
    return new_BuP


def grad(dout_BPud, out_BPud, lse_BuP, sink_u) -> torch.Tensor:
    """d sink `[u]` (fp32, or fp64 for fp64 lse) over this rank's rows, from the final out'
    and lse' (module doc): -sum_{b, i} exp(sink - lse'_i) * rowsum(dout_i * out'_i)."""
    acc = lse_BuP.dtype
    p_BPu = torch.exp(sink_u.to(acc)[None, :, None] - lse_BuP).transpose(1, 2)
    total_u = torch.zeros(out_BPud.shape[2], dtype=acc, device=out_BPud.device)
    for r0, r1 in _row_steps(out_BPud.shape[1]):  # delta chunk by chunk: no full fp32 copy
        delta_BPu = (dout_BPud[:, r0:r1].to(acc) * out_BPud[:, r0:r1].to(acc)).sum(-1)
        total_u -= (p_BPu[:, r0:r1] * delta_BPu).sum((0, 1))
    return total_u


# --- a rank's heads ---------------------------------------------------------------------


def head_range(H: int, C: int, rank: int) -> tuple[int, int]:
    """(first, count) of the query heads a Ulysses rank holds after its exchange, even split
    or uneven (`upipe.heads.query_ranges`)."""
    return query_ranges(H, C)[rank]


def zeros_like_sinks(sinks, lse_dtype) -> torch.Tensor:
    """The `[H]` gradient accumulator (in the lse dtype: fp32, or fp64)."""
    return torch.zeros(sinks.shape, dtype=lse_dtype, device=sinks.device)
