"""Memory features that do not change the math: sequence-tiled recomputation and activation
checkpointing with optional offload of the saved input to host memory (`upipe.model.offload`).

Both are "reentrant" autograd Functions: forward runs `fn` without recording a graph, and
backward re-runs it on the saved input with grad enabled and back-propagates through it, so
parameter gradients accumulate into `.grad` directly (as in `torch.utils.checkpoint` with
`use_reentrant=True`). The input must require grad for backward to run; it always does
inside a model (it derives from the embedding weights).

Legend: B batch, L local sequence, D width, T tile tokens.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge

from upipe import loops
from upipe.model.offload import Offloader


def _tiled(fn, x_BLD: torch.Tensor, tile: int) -> torch.Tensor:
    """y[:, s:s+T] = fn(x[:, s:s+T]), one tile's intermediates alive at a time, written into
    an output allocated once."""
    y_BLD = None
    for s in loops.tile_starts(x_BLD.shape[1], tile):
        y_BTD = fn(x_BLD[:, s : s + tile])
        if y_BLD is None:
            y_BLD = y_BTD.new_empty(*x_BLD.shape[:2], *y_BTD.shape[2:])
        y_BLD[:, s : s + tile] = y_BTD
        del y_BTD
    return y_BLD


class _TiledRecompute(torch.autograd.Function):
    """y[:, s:s+T] = fn(x[:, s:s+T]) tile by tile; nothing but x is saved.

    Forward holds one tile's intermediates at a time (for a SwiGLU MLP: three [B, T, F]
    tensors instead of three [B, L, F]); backward recomputes each tile and back-propagates
    its slice of the output gradient, writing dx tile by tile.
    """

    @staticmethod
    def forward(ctx, x_BLD, fn, tile):
        ctx.fn, ctx.tile = fn, tile
        ctx.save_for_backward(x_BLD)
        return _tiled(fn, x_BLD, tile)

    @staticmethod
    def backward(ctx, dy_BLD):
        (x_BLD,) = ctx.saved_tensors
        dx_BLD = torch.empty_like(x_BLD)
        for s in loops.tile_starts(x_BLD.shape[1], ctx.tile):
            x_BTD = x_BLD[:, s : s + ctx.tile].detach().requires_grad_()
            with torch.enable_grad():
                y_BTD = ctx.fn(x_BTD)
            torch.autograd.backward(y_BTD, dy_BLD[:, s : s + ctx.tile])
            dx_BLD[:, s : s + ctx.tile] = x_BTD.grad
            del x_BTD, y_BTD
        return dx_BLD, None, None


def tiled_recompute(fn, x_BLD: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    """`fn(x)` for a position-wise `fn` (an MLP), computed and recomputed in sequence tiles
    of `tile_tokens`; without grad it simply runs tile by tile."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1, got {tile_tokens}")
    if x_BLD.shape[1] <= tile_tokens:
        return fn(x_BLD)
    if not (torch.is_grad_enabled() and x_BLD.requires_grad):  # e.g. a checkpointed forward
        return _tiled(fn, x_BLD, tile_tokens)
    return _TiledRecompute.apply(x_BLD, fn, tile_tokens)


class _Checkpoint(torch.autograd.Function):
    """y = fn(x, *args) keeping only x (in the offloader's host slot `index` if given).

    Backward recomputes y with grad, releases it (its backward needs only its graph, not its
    values: one [B, L, D] less while the block's backward runs, the room the offloader's
    prefetch of the next block input takes), and back-propagates dy through the graph.
    """

    @staticmethod
    def forward(ctx, x_BLD, fn, offload, index, *args):
        ctx.fn, ctx.args, ctx.offload, ctx.index = fn, args, offload, index
        if offload is None:
            ctx.save_for_backward(x_BLD)
        else:
            ctx.device, ctx.token = x_BLD.device, offload.save(x_BLD, index)
        return fn(x_BLD, *args)

    @staticmethod
    def backward(ctx, dy_BLD):
        if ctx.offload is None:
            (x_BLD,) = ctx.saved_tensors
        else:
            x_BLD = ctx.offload.load(ctx.token, ctx.index, ctx.device)
        x_BLD = x_BLD.detach().requires_grad_()
        with torch.enable_grad():
            y_BLD = ctx.fn(x_BLD, *ctx.args)
        y_edge = get_gradient_edge(y_BLD)
        del y_BLD
        if ctx.offload is not None:
            ctx.offload.prefetch(ctx.index - 1, ctx.device)
        torch.autograd.backward(y_edge, dy_BLD)
        return (x_BLD.grad, None, None, None) + (None,) * len(ctx.args)


def activation_checkpoint(
    fn, x_BLD: torch.Tensor, *args, offload: Offloader | None = None, index: int | None = None
) -> torch.Tensor:
    """`fn(x, *args)` saving only x for backward (recomputing the rest there).

    `offload`: the model's `Offloader`, which keeps x in host memory between forward and
    backward, in slot `index` (the block's position in forward order; in this block's
    backward the offloader brings back block index - 1's input ahead); None keeps x where it
    is. `args` are not differentiated (positions and the like).
    """
    if offload is not None and not (isinstance(offload, Offloader) and isinstance(index, int)):
        raise ValueError(
            f"offload must be an upipe Offloader, with the block's index, or None; got "
            f"offload={offload!r}, index={index!r}"
        )
    if not (torch.is_grad_enabled() and x_BLD.requires_grad):
        return fn(x_BLD, *args)
    return _Checkpoint.apply(x_BLD, fn, offload, index, *args)
