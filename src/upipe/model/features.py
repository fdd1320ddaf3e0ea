"""Memory features that do not change the math: sequence-tiled recomputation and activation
checkpointing with optional offload of the saved input to host memory.

Both are "reentrant" autograd Functions: forward runs `fn` without recording a graph, and
backward re-runs it on the saved input with grad enabled and back-propagates through it, so
parameter gradients accumulate into `.grad` directly (as in `torch.utils.checkpoint` with
`use_reentrant=True`). The input must require grad for backward to run; it always does
inside a model (it derives from the embedding weights).

Legend: B batch, L local sequence, D width, T tile tokens.
"""

from __future__ import annotations

import torch

from upipe import loops


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
    """y = fn(x, *args) keeping only x (on `offload` if given) for backward."""

    @staticmethod
    def forward(ctx, x, fn, offload, *args):
        ctx.fn, ctx.args, ctx.device = fn, args, x.device
        if offload is None or torch.device(offload) == x.device:
            ctx.save_for_backward(x)
            ctx.host = None
        else:  # async device -> pinned host copy, ordered on the current stream
            pin = x.device.type == "cuda"
            ctx.host = torch.empty(x.shape, dtype=x.dtype, device=offload, pin_memory=pin)
            ctx.host.copy_(x, non_blocking=pin)
        return fn(x, *args)

    @staticmethod
    def backward(ctx, dy):
        if ctx.host is None:
            (x,) = ctx.saved_tensors
        else:
            x = ctx.host.to(ctx.device, non_blocking=True)
            ctx.host = None
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            y = ctx.fn(x, *ctx.args)
        torch.autograd.backward(y, dy)
        return (x.grad, None, None) + (None,) * len(ctx.args)


def checkpoint(fn, x: torch.Tensor, *args, offload: str | torch.device | None = None):
    """`fn(x, *args)` saving only x for backward (recomputing the rest there).

    `offload`: a device (normally "cpu" when x is on CUDA) that holds the saved x between
    forward and backward; None keeps it where it is. `args` are not differentiated
    (positions and the like).
    """
    if not (torch.is_grad_enabled() and x.requires_grad):
        return fn(x, *args)
    return _Checkpoint.apply(x, fn, offload, *args)
