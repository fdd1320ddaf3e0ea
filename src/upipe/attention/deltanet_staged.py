"""UPipe for the Gated DeltaNet layer: the heads in stages, each projected, exchanged, scanned
and freed before the next; backward recomputes each stage (upipe.attention.deltanet).

Legend: B batch, S full sequence, L = S / C local tokens, N = B * L, D model width, H value
heads, G key heads, U value heads per stage (all ranks'), u = U / C per rank, d key head
dim, e value head dim, C group size, W a step's packed width.

Stages follow upipe's attention schedule (`upipe.attention.schedule`, value heads in the
place of query heads, key heads in that of kv heads): a round's key heads serve all of its
stages. Forward, per stage s (no graph):

    packed = x W_s^T      rows of the stage's v, b, a (+ the round's q, k on its first stage)
    --one all-to-all-->   this rank's [q | k]? [v | b | a], all S tokens
    o_s = scan(conv(...)) on u value heads  --all-to-all back-->  o_BLUe
    y += gated_norm(o_BLUe, x W_z[s]^T) W_out[:, s]^T                (y: one fp32 [N, D])

the round's q | k channels (this rank's key heads, before the convolution) kept until its
last stage. Saved for backward: x and the weights only -- or, with `stage_inputs="keep"`,
also each stage's received inputs and its z (what the backward would recompute first).
Backward, per stage: the same projection and exchange without a graph (or the kept ones);
then, with one, from leaves at the exchanged inputs, the stage's convolutions, gates, scan,
exchange back, gated norm and output rows are recomputed and differentiated against dy
(`torch.autograd.grad`): that gives dx (through z), the stage's parameter gradients (added
into fp32 accumulators) and the gradients of its exchanged inputs, which go back in one
all-to-all (on the round's last stage with the round's summed dq | dk), then dW_s = d^T x
and dx += d W_s.

Memory (per rank, excluding parameters): x, y, dy, dx (fp32), plus one stage -- its packed
projection in both layouts and the scan's buffers for u value heads (docs/hybrid.md has
the formula and the measurement) -- instead of every head's at once (Ulysses, deltanet.py);
"keep" adds every stage's inputs, B L (2 G d + H (e + 2) + H e) elements (more where key
heads are replicated), from forward to backward. Time: the recomputation repeats each
stage's forward once -- projections and exchange (not with "keep"), convolution, gates,
gated norm and the scan's output (the scan's states are computed once: `for_backward`).
"""

from __future__ import annotations

import torch

from upipe.attention.deltanet_layer import (
    DeltaNetWeights,
    StageWeights,
    add_rows_,
    flat_shape,
    gated_output,
    gather_rows,
    packed_rows,
    packed_to_sequence,
    project_exchange,
    split_keys,
)
from upipe.gemm import addmm_acc_
from upipe.kernels import acc_dtype


def _forward(x, w: DeltaNetWeights, plan, keep: bool):
    """(y, the stages' kept inputs: each step's received inputs and z, if `keep`)."""
    B, L, D = x.shape
    H, G, d, e = w.heads
    x_ND = x.reshape(B * L, D)
    y_ND = torch.zeros(B * L, D, dtype=acc_dtype(x.dtype), device=x.device)
    qk_BSc = None
    kept = []
    for step in plan.steps:
        recv_BSw = project_exchange(x_ND, w, step, plan, step.first, B, L)
        if step.first:
            last = step.last or keep  # (a kept step's inputs hold q | k anyway)
            qk_BSc, vba_BSc = split_keys(recv_BSw, step, plan.rank, d, keep=not last)
        else:
            vba_BSc = recv_BSw
        z_ND = x_ND @ gather_rows(w.z, step.values).t()
        if keep:
            kept += [recv_BSw, z_ND]
        del recv_BSw
        sw = StageWeights.of(w, step, plan.rank)
        out_BLne = gated_output(qk_BSc, vba_BSc, z_ND, sw, step, plan, d, e)
        del vba_BSc, z_ND, sw
        addmm_acc_(y_ND, out_BLne.view(B * L, -1), gather_rows(w.out, step.values),
                   tensor_cores=x.is_cuda)  # fmt: skip
        del out_BLne
        if step.last:
            qk_BSc = None
    return y_ND.to(x.dtype).view(B, L, D), kept


def _backward(dy, x, w: DeltaNetWeights, plan, kept):
    """(dx, gradient of each weight in `DeltaNetWeights` order); `kept`: the forward's kept
    stage inputs, or empty (recomputed)."""
    B, L, D = x.shape
    H, G, d, e = w.heads
    acc = acc_dtype(x.dtype)
    x_ND, dy_ND = x.reshape(B * L, D), dy.reshape(B * L, D)
    dx_ND = torch.zeros(B * L, D, dtype=acc, device=x.device)
    grads = {name: torch.zeros(flat_shape(t), dtype=acc, device=t.device)
             for name, t in zip(_NAMES, w.tensors(), strict=True)}  # fmt: skip
    qk_BSc = dqk_BSc = None
    for i, step in enumerate(plan.steps):
        if kept:
            recv_BSw, z_ND = kept[2 * i], kept[2 * i + 1]
        else:
            recv_BSw = project_exchange(x_ND, w, step, plan, step.first, B, L)
            z_ND = x_ND @ gather_rows(w.z, step.values).t()
        if step.first:
            last = step.last or bool(kept)
            qk_BSc, vba_BSc = split_keys(recv_BSw, step, plan.rank, d, keep=not last)
            qk_BSc = qk_BSc.detach().requires_grad_()
            dqk_BSc = torch.zeros(qk_BSc.shape, dtype=acc, device=x.device)
        else:
            vba_BSc = recv_BSw
        del recv_BSw
        vba_BSc = vba_BSc.detach().requires_grad_()
        z_rows, out_rows = (gather_rows(t, step.values) for t in (w.z, w.out))
        z_ND = z_ND.detach().requires_grad_()
        leaves = [
            t.detach().requires_grad_() for t in StageWeights.of(w, step, plan.rank).tensors()
        ]
        with torch.enable_grad():
            sw = StageWeights(*leaves)
            out_BLne = gated_output(qk_BSc, vba_BSc, z_ND, sw, step, plan, d, e, True)
            # y = out W_out[s]^T: the output rows' gradient and dout by hand (no [N, D] root)
            dout_BLne = (dy_ND @ out_rows.t()).view(out_BLne.shape)
            dqk, dvba_BSc, dz_ND, *dparams = torch.autograd.grad(
                out_BLne, [qk_BSc, vba_BSc, z_ND, *leaves], dout_BLne, materialize_grads=True
            )
        del sw, leaves, vba_BSc, dout_BLne
        add_rows_(grads["out"], step.values, out_BLne.detach().view(B * L, -1).t() @ dy_ND)
        del out_BLne
        add_rows_(grads["z"], step.values, dz_ND.t() @ x_ND)
        addmm_acc_(dx_ND, dz_ND, z_rows, tensor_cores=x.is_cuda)
        del dz_ND, z_ND, z_rows, out_rows
        dqk_BSc += dqk
        del dqk
        StageWeights.add_grads(grads, dparams, step, plan.rank, d)
        del dparams
        _send_back(x_ND, w, step, plan, dvba_BSc, dqk_BSc if step.last else None, grads, dx_ND)
        del dvba_BSc
        if step.last:
            qk_BSc = dqk_BSc = None
    return dx_ND.to(x.dtype).view_as(x), [
        g.view(t.shape).to(t.dtype) for g, t in zip(grads.values(), w.tensors(), strict=True)
    ]


_NAMES = tuple(f.name for f in DeltaNetWeights.__dataclass_fields__.values())


def _send_back(x_ND, w, step, plan, dvba_BSc, dqk_BSc, grads, dx_ND):
    """The step's input gradients to the sequence layout in one exchange (the round's dq | dk
    with them on its last stage), then the projection rows' gradients and dx."""
    H, G, d, e = w.heads
    keys = dqk_BSc is not None
    parts = ([dqk_BSc.to(dvba_BSc.dtype)] if keys else []) + [dvba_BSc]
    d_BSw = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    widths = step.widths(keys, d, e)
    d_NW = packed_to_sequence(d_BSw.contiguous(), widths, plan.ex).view(x_ND.shape[0], -1)
    del d_BSw, parts
    rows_WD = packed_rows(w, step, keys)
    addmm_acc_(dx_ND, d_NW, rows_WD, tensor_cores=x_ND.is_cuda)
    del rows_WD
    drows_WD = d_NW.t() @ x_ND
    off = 0
    for kr, vr in zip(step.keys, step.values, strict=True):
        names = (("q", kr), ("k", kr)) if keys else ()
        for name, r in (*names, ("v", vr), ("b", vr), ("a", vr)):
            rows = r[1] * grads[name].shape[1]  # heads x rows per head
            add_rows_(grads[name], (r,), drows_WD[off : off + rows])
            off += rows
    assert off == drows_WD.shape[0], (off, tuple(drows_WD.shape))


class _StagedDeltaNet(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, keep, *tensors):
        y, kept = _forward(x, DeltaNetWeights.of(tensors), plan, keep)
        ctx.save_for_backward(x, *tensors, *kept)  # (through saved-tensor hooks: offload)
        ctx.plan, ctx.n_weights = plan, len(tensors)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, *rest = ctx.saved_tensors
        tensors, kept = rest[: ctx.n_weights], rest[ctx.n_weights :]
        dx, grads = _backward(dy.contiguous(), x, DeltaNetWeights.of(tensors), ctx.plan, kept)
        return dx, None, None, *grads


def staged_deltanet(x, w: DeltaNetWeights, plan, stage_inputs="recompute"):
    """UPipe's Gated DeltaNet (module doc) for a validated call of
    `upipe.attention.deltanet.gated_deltanet`; `stage_inputs` "keep": save each stage's
    exchanged inputs and z for backward instead of recomputing them."""
    return _StagedDeltaNet.apply(x, plan, stage_inputs == "keep", *w.tensors())
