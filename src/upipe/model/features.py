"""Memory features that do not change the math: sequence-tiled recomputation and activation
checkpointing with optional offload of the saved input to host memory (`upipe.model.offload`).

Both are "reentrant" autograd Functions: forward runs `fn` without recording a graph, and
backward re-runs it on the saved input with grad enabled and back-propagates through it, so
parameter gradients accumulate into `.grad` directly (as in `torch.utils.checkpoint` with
`use_reentrant=True`). The input must require grad for backward to run; it always does
inside a model (it derives from the embedding weights).

A checkpoint's recomputation need not call the attention kernels again: with
`attention_outputs="keep"` the forward keeps each attention op's outputs and lse (what its
backward needs) and the recomputation reuses them (`upipe.attention.kept`: the hand-off,
what each op keeps, the memory it costs); "offload" keeps them in the offloader's host
memory beside the checkpoint's input. The results are the same bit for bit.

Legend: B batch, L local sequence, D width, T tile tokens.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.graph import get_gradient_edge

from upipe import loops
from upipe.attention import kept
from upipe.model.offload import Offloader
from upipe.torch_private import selective_saved_tensor_hooks


def _rows(token_args: tuple, s: int, tile: int) -> tuple:
    """The tile [s, s + tile) of each per-token argument `[B, L, ...]` (None stays None)."""
    return tuple(None if a is None else a[:, s : s + tile] for a in token_args)


def _tiled(fn, x_BLD: torch.Tensor, tile: int, token_args: tuple = ()) -> torch.Tensor:
    """y[:, s:s+T] = fn(x[:, s:s+T], *token_args[:, s:s+T]), one tile's intermediates alive
    at a time, written into an output allocated once."""
    y_BLD = None
    for s in loops.tile_starts(x_BLD.shape[1], tile):
        y_BTD = fn(x_BLD[:, s : s + tile], *_rows(token_args, s, tile))
        if y_BLD is None:
            y_BLD = y_BTD.new_empty(*x_BLD.shape[:2], *y_BTD.shape[2:])
        y_BLD[:, s : s + tile] = y_BTD
        del y_BTD
    return y_BLD


class _TiledRecompute(torch.autograd.Function):
    """y[:, s:s+T] = fn(x[:, s:s+T]) tile by tile (with `residual`: x + fn(x)); nothing but
    x is saved.

    Forward holds one tile's intermediates at a time (for a SwiGLU MLP: three [B, T, F]
    tensors instead of three [B, L, F]); backward recomputes each tile and back-propagates
    its slice of the output gradient, writing dx tile by tile.

    `residual`: the gradient dx = dy + J_fn^T dy is written into dy itself, tile by tile
    (each tile's dy is read by its own backward first), and dy is returned as dx: no second
    [B, L, D] gradient exists. The autograd engine keeps the gradient it passes to a node
    alive until the node returns, so only writing into it spares that memory. This is
    sound when this node is dy's only consumer -- true for a block output that feeds the
    next block (or the final norm), whose gradient is that node's freshly made output; a
    gradient hook or `retain_grad` on y gets its own copy before this runs. A gradient that
    is a view or not contiguous (an expanded `sum()` gradient) is copied first.
    """

    @staticmethod
    def forward(ctx, x_BLD, fn, tile, residual, token_args):
        ctx.fn, ctx.tile, ctx.residual, ctx.token_args = fn, tile, residual, token_args
        ctx.save_for_backward(x_BLD)
        y_BLD = _tiled(fn, x_BLD, tile, token_args)
        return y_BLD.add_(x_BLD) if residual else y_BLD

    @staticmethod
    def backward(ctx, dy_BLD):
        (x_BLD,) = ctx.saved_tensors
        if not ctx.residual:
            dx_BLD = torch.empty_like(x_BLD)
        elif dy_BLD._base is None and dy_BLD.is_contiguous():
            dx_BLD = dy_BLD
        else:  # a view (of a larger gradient) or an expanded one: not ours to write
            dx_BLD = dy_BLD = dy_BLD.clone()
        for s in loops.tile_starts(x_BLD.shape[1], ctx.tile):
            x_BTD = x_BLD[:, s : s + ctx.tile].detach().requires_grad_()
            with torch.enable_grad():
                y_BTD = ctx.fn(x_BTD, *_rows(ctx.token_args, s, ctx.tile))
            torch.autograd.backward(y_BTD, dy_BLD[:, s : s + ctx.tile])
            if ctx.residual:  # dy_T (read above) becomes dy_T + J^T dy_T, in place
                dx_BLD[:, s : s + ctx.tile] += x_BTD.grad
            else:
                dx_BLD[:, s : s + ctx.tile] = x_BTD.grad
            del x_BTD, y_BTD
        return dx_BLD, None, None, None, None


def tiled_recompute(
    fn, x_BLD: torch.Tensor, tile_tokens: int, *, residual: bool = False, token_args=()
):
    """`fn(x)` for a position-wise `fn` (an MLP with the norm before it), computed and
    recomputed in sequence tiles of `tile_tokens`; `residual`: `x + fn(x)`, its backward
    writing dx into the incoming gradient (see `_TiledRecompute`). A sequence of one tile
    runs plainly; without grad it simply runs tile by tile. `token_args`: per-token
    tensors `[B, L, ...]` (or None) that `fn` takes after x, each sliced to the tile (not
    differentiated: the MoE router's mask of the tokens that count in its balance)."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1, got {tile_tokens}")
    token_args = tuple(token_args)
    if x_BLD.shape[1] <= tile_tokens:
        return x_BLD + fn(x_BLD, *token_args) if residual else fn(x_BLD, *token_args)
    if not (torch.is_grad_enabled() and x_BLD.requires_grad):  # e.g. a checkpointed forward
        y_BLD = _tiled(fn, x_BLD, tile_tokens, token_args)
        return y_BLD.add_(x_BLD) if residual else y_BLD
    return _TiledRecompute.apply(x_BLD, fn, tile_tokens, residual, token_args)


ATTENTION_OUTPUTS = ("recompute", "keep", "offload")
"""What a checkpoint's recomputation does about its attention calls (`activation_checkpoint`)."""


class _Checkpoint(torch.autograd.Function):
    """y = f_m(... f_1(x, *args) ..., *args) for the segment `fns` = (f_1, ..., f_m), keeping
    only x (in the offloader's host slot `index` if given).

    Backward first recomputes, without a graph, the inputs of f_2, ..., f_m (kept on the
    device, or with offload each in a scratch host slot of its own), then for j = m, ..., 1
    recomputes f_j with grad from its input, releases the output (its backward needs only
    its graph, not its values: one [B, L, D] less while f_j's backward runs), and
    back-propagates the gradient through it. Only one f_j's graph exists at a time, so a
    segment of m blocks holds m - 1 block inputs more than one block does (none with
    offload) and runs the forwards of f_1, ..., f_{m-1} once more.

    `outputs` ("keep", "offload": `activation_checkpoint`): the forward's attention outputs
    (`kept.KeptOutputs`, on the device or beside x in the offloader) serve every
    recomputation -- the inputs' pass reads those of f_1, ..., f_{m-1}, f_j's recomputation
    with grad takes f_j's -- so no attention kernel runs in backward but the backward's own.
    """

    @staticmethod
    def forward(ctx, x_BLD, fns, offload, index, outputs, *args):
        ctx.fns, ctx.args, ctx.offload, ctx.index = fns, args, offload, index
        if offload is None:
            ctx.save_for_backward(x_BLD)
        else:
            ctx.device, ctx.token = x_BLD.device, offload.save(x_BLD, index)
        ctx.kept = None  # inside another checkpoint's pass its calls are that one's (kept.py)
        if outputs != "recompute" and not kept.active():
            to_host = outputs == "offload" and offload is not None
            host = offload.outputs(ctx.token, index, x_BLD.device) if to_host else None
            ctx.kept = kept.KeptOutputs(host)
        for j, fn in enumerate(fns):
            with _pass(ctx.kept, j):
                x_BLD = fn(x_BLD, *args)
        return x_BLD

    @staticmethod
    def backward(ctx, dy_BLD):
        offload, args = ctx.offload, ctx.args
        if offload is None:
            x_BLD = ctx.saved_tensors[0].detach()  # (not back into the graph it came from)
            loads = [lambda x_BLD=x_BLD: x_BLD]
        else:
            slots = [(ctx.token, ctx.index)]
            loads = [lambda: offload.load(ctx.token, ctx.index, ctx.device)]
        if len(ctx.fns) > 1:  # the inputs of f_2, ..., f_m
            with torch.no_grad():
                x_BLD = loads[0]()
                for j, fn in enumerate(ctx.fns[:-1]):
                    with _pass(ctx.kept, j, take=False):
                        x_BLD = fn(x_BLD, *args)
                    if offload is None:
                        loads.append(lambda x_BLD=x_BLD: x_BLD)
                        continue
                    slot = (offload.save(x_BLD, offload.n_inputs + j), offload.n_inputs + j)
                    slots.append(slot)
                    loads.append(lambda slot=slot: offload.load(*slot, ctx.device))
                del x_BLD
        # the engine keeps the segment's dy alive until this returns: each inner block's
        # dx is copied into it (if dy is ours to write, see `_TiledRecompute`), so the
        # segment's backward holds one [B, L, D] gradient, as a single block's does
        held = dy_BLD if dy_BLD._base is None and dy_BLD.is_contiguous() else None
        from_host = offload is not None
        for j in reversed(range(len(ctx.fns))):  # (each input let go once its block is done)
            replay = _pass(ctx.kept, j, take=True)
            dy_BLD = _recompute_backward(ctx.fns[j], args, loads.pop(), dy_BLD, from_host, replay)
            if dy_BLD is None:  # y did not depend on x: the earlier blocks get no gradient
                break
            if (
                j
                and held is not None
                and dy_BLD.untyped_storage()._cdata != held.untyped_storage()._cdata
            ):
                dy_BLD = held.copy_(dy_BLD)
        if ctx.kept is not None:
            ctx.kept.release()  # (what a function left untaken: none when it ran through)
        if offload is not None:
            for token, index in slots:
                offload.release(token, index)
        return (dy_BLD, None, None, None, None) + (None,) * len(args)


def _pass(outputs: kept.KeptOutputs | None, j: int, *, take: bool | None = None):
    """Function j's pass over `outputs` (module `upipe.attention.kept`): its forward
    (`take` None) records them, a recomputation replays them (`take`: and removes them, for
    the backward that follows); without kept outputs, nothing."""
    if outputs is None:
        return contextlib.nullcontext()
    if take is None:
        return outputs.recording(j)
    return outputs.replaying(j, take=take)


def _recompute_backward(fn, args, load, dy_BLD, from_host: bool, replay=None):
    """Recompute y = fn(x, *args) on x = `load()`, back-propagate `dy` through it, and return
    dx (None when y does not depend on x). x enters the recomputed graph as a non-leaf
    (`_Input`), so the graph holds it only where it saves it; `from_host`: the hooks keep
    those as promises of `load()`, so the device copy is freed as soon as the recomputation
    is done with it. `replay`: the context the recomputation runs in (the kept attention
    outputs' pass, `_pass`)."""
    sink = []  # x's gradient
    anchor = torch.empty(0, requires_grad=True)
    with torch.enable_grad():
        x_BLD = _Input.apply(anchor, load(), sink)
        with (
            _from_host(x_BLD, load) if from_host else contextlib.nullcontext(),
            replay or contextlib.nullcontext(),
        ):
            y_BLD = fn(x_BLD, *args)
        del x_BLD
    y_edge = get_gradient_edge(y_BLD)
    del y_BLD
    torch.autograd.backward(y_edge, dy_BLD)
    return sink[0] if sink else None


class _Input(torch.autograd.Function):
    """x as it enters a recomputed graph, from a placeholder leaf `anchor` (which gets no
    gradient): its gradient is appended to `sink` instead of kept on a leaf, so the graph
    does not hold x itself (an autograd leaf would: its gradient accumulator keeps it)."""

    @staticmethod
    def forward(ctx, anchor, x_BLD, sink):
        ctx.sink = sink
        return x_BLD.view_as(x_BLD)

    @staticmethod
    def backward(ctx, dx_BLD):
        ctx.sink.append(dx_BLD)
        return None, None, None


def _from_host(x_BLD: torch.Tensor, load):
    """While recomputing: a saved x (the block's first norm saves it; or an alias of it with
    x's shape, as module hooks make) is kept as a promise, fulfilled by `load()` -- a fresh
    copy from the host -- when the backward needs it (see `upipe.model.offload`). Any other
    saved tensor, a differently shaped view of x included, is saved as usual. The copy is
    made once and kept until the recomputed graph is freed."""
    promise, loaded = object(), []
    key, geometry = x_BLD.untyped_storage()._cdata, _geometry(x_BLD)

    def pack(t):
        if t.untyped_storage()._cdata == key and _geometry(t) == geometry:
            return promise
        return t

    def unpack(packed):
        if packed is not promise:
            return packed
        if not loaded:  # once: the CPU's composite RMSNorm saves x twice
            loaded.append(load())
        return loaded[0]

    return selective_saved_tensor_hooks(pack, unpack)


def _geometry(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.storage_offset(), t.dtype


def activation_checkpoint(
    fns,
    x_BLD: torch.Tensor,
    *args,
    offload: Offloader | None = None,
    index: int | None = None,
    attention_outputs: str = "recompute",
) -> torch.Tensor:
    """`fn(x, *args)` -- or, for a sequence `fns` = (f_1, ..., f_m), the segment
    f_m(... f_1(x, *args) ..., *args) -- saving only x for backward (recomputing the rest
    there, one function at a time: see `_Checkpoint`).

    `offload`: the model's `Offloader`, which keeps x in host memory between forward and
    backward, in slot `index` (the segment's position in forward order; the inputs a
    segment recomputes in backward go to its scratch slots); None keeps x where it is.
    `args` are not differentiated (positions and the like).

    `attention_outputs` (`ATTENTION_OUTPUTS`): what the recomputation does about the upipe
    attention ops the functions call (a `ContextParallelAttention`, any strategy, or the
    functional ops): "recompute" calls their kernels again; "keep" reuses the outputs and
    lse the forward made, kept on the device from each call's forward to its backward;
    "offload" keeps them in `offload`'s host memory beside x instead (on the device for a
    checkpoint without `offload`). Bit-identical results, one attention forward less per
    layer and step; the cost per attention layer (formula in `upipe.attention.kept`) is one
    `[B, L, H*d]` tensor plus an fp32 lse of B * L * H elements. The functions must make
    the same attention calls each time they run (checked).
    """
    fns = tuple(fns) if isinstance(fns, (list, tuple)) else (fns,)
    if not fns:
        raise ValueError("activation_checkpoint needs at least one function")
    if attention_outputs not in ATTENTION_OUTPUTS:
        raise ValueError(
            f"attention_outputs must be one of {ATTENTION_OUTPUTS}, got {attention_outputs!r}"
        )
    if offload is not None:
        if not (isinstance(offload, Offloader) and isinstance(index, int)):
            raise ValueError(
                f"offload must be an upipe Offloader, with the segment's index, or None; got "
                f"offload={offload!r}, index={index!r}"
            )
        if len(fns) - 1 > offload.scratch:
            raise ValueError(
                f"a segment of {len(fns)} functions recomputes {len(fns) - 1} inputs in "
                f"backward, but the Offloader has {offload.scratch} scratch slots: make it "
                f"with scratch={len(fns) - 1}"
            )
    if not (torch.is_grad_enabled() and x_BLD.requires_grad):
        for fn in fns:
            x_BLD = fn(x_BLD, *args)
        return x_BLD
    return _Checkpoint.apply(x_BLD, fns, offload, index, attention_outputs, *args)
