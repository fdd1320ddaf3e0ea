"""UPipe with the projections and RoPE fused into the stage loop (the module's fast path).

Legend: B batch, S full sequence, L = S / C local tokens, N = B * L, D model width,
H query heads, G kv heads, U heads per stage, u = U / C query heads per rank per stage,
n = C * k heads in a round's kv exchange, d head dim, C group size.

Per round (kv heads `kv_idx`) and stage (query heads `q_idx`), on each rank:
    k_BLnd = rope(norm_k(x W_k[kv_idx]^T + b_k)),  v_BLnd = x W_v[kv_idx]^T + b_v
                                                   --seq_to_head-->  k_BSkd, v_BSkd
    q_BLUd = rope(norm_q(x W_q[q_idx]^T + b_q))    --seq_to_head-->  q_BSud
(norm_q/norm_k: the optional QK-norm, RMSNorm over each head's d features, times weight or
1 + weight (zero-centred: Gemma 3, Qwen3-Next); identity without;
b_q/b_k/b_v: the optional projection biases, as in Qwen2, with the heads' rows taken alike)
    out_BSud, lse = attention(q_BSud, k_BSkd, v_BSkd)  --head_to_seq-->  out_BLUd
    y = sum over stages of out_BLUd W_o[:, q_idx]^T    (after the stages, in row chunks,
                                                        summed in fp32: `_o_proj`)
so full-head q/k/v never exist and o_proj needs no full-width input. Saved: x, the weights,
cos/sin, each stage's out_BLUd (needed for dW_o and the kernel's backward) and lse.
Recomputed inside an activation checkpoint that keeps attention outputs (`kept.py`), the
forward is only the sum into y, from the stage outputs and lse the first forward kept.
On a 2-D mesh `group` is the ulysses group, S becomes the ring rank's P = C * L tokens and
`attention` is ring attention over the ring group (stage.py).

Backward per round and stage recomputes q/k/v from x, and never builds the full dout:
    dout_BLUd = dy W_o[:, q_idx],       dW_o[:, q_idx] = dy^T out_BLUd
    dq, dk, dv = attention_backward(...)                (dk, dv summed over the round in fp32)
    dq_BLUd = rope^T(head_to_seq(dq)),  dW_q[q_idx] = dq^T x,   dx += dq_BLUd W_q[q_idx]
and per round dW_k, dW_v, dx += dk W_k[kv_idx] + dv W_v[kv_idx]; dx is one fp32 buffer,
built at the end from the waiting projection gradients (see `_backward`).
Parameter gradients are this rank's contribution (their sum over ranks is the full gradient).

Heads are picked by slicing (`schedule.select_q` / `select_kv`): no index tensors, so no
host-device synchronisation per stage. With `overlap` the next stage's exchanges (forward:
its q; backward: its q, out and dout) are started asynchronously before the current stage's
attention runs (`staged_layer.staged`), so they travel while the kernel computes; the
results are the same bit for bit, and the extra memory is the next stage's buffers: in
backward a send and a receive buffer for each of its three exchanges, its q and dout before
they are packed, and its W_o columns -- at most (8 + w) U/H of one [B, L, H*d] tensor
(w = D / (B*L)), measured in tests/distributed/test_steady_state.py; `default_overlap` says when it
is
on.
"""

from __future__ import annotations

import functools

import torch

from upipe import loops
from upipe.attention import kept, sinks
from upipe.attention.common import save_for_backward, saved_for_backward
from upipe.attention.schedule import add_kv_, put_q, stage_attention
from upipe.attention.stage import StageAttention
from upipe.attention.staged_layer import DxAccumulator, FusedPlan, Prep, StagedLayer, staged
from upipe.attention.upipe import accumulate, put_stage_sinks_, stage_sinks
from upipe.comm import HeadExchange, Together
from upipe.kernels import acc_dtype, resolve_backend, uses_cuda_kernels


def _rank(plan: FusedPlan):
    return torch.distributed.get_world_size(plan.ex.group), torch.distributed.get_rank(
        plan.ex.group
    )


def _forward(layer: StagedLayer, sinks_H=None):
    """Returns y `[B, L, D]`, the per-stage outputs out_BLUd and the per-stage lse (with
    `sinks_H`, `upipe.attention.sinks`: out' and lse')."""
    plan = layer.plan
    out_slices, lse_list, stage_ids = [], [], []
    C, rank = _rank(plan)
    for rnd in plan.rounds:
        k_BSkd, v_BSkd = layer.kv(rnd)
        stages = staged(len(rnd.stages), functools.partial(layer.q, rnd), plan.overlap)
        for s, q_BSud in stages:
            out_BSud, lse_BuS = stage_attention(plan.attn, rnd, s).forward(q_BSud, k_BSkd, v_BSkd)
            del q_BSud
            if sinks_H is not None:  # out' (in place) and lse'
                lse_BuS = sinks.apply_(out_BSud, lse_BuS, stage_sinks(sinks_H, rnd, s, C, rank))
            out_slices.append(plan.ex.to_seq(out_BSud, rnd.q_split(s)))
            del out_BSud
            lse_list.append(lse_BuS)
            stage_ids.append((rnd, s))
        del k_BSkd, v_BSkd
    return _o_proj(layer, out_slices, stage_ids), out_slices, lse_list


def _stage_ids(plan: FusedPlan) -> list:
    """(round, stage) of every stage, in the order `_forward` runs them."""
    return [(rnd, s) for rnd in plan.rounds for s in range(len(rnd.stages))]


def _o_proj(layer: StagedLayer, out_slices, stage_ids, row_chunks: int = 8):
    """y = sum over stages of out_s W_o[:, heads_s]^T `[B, L, D]`, summed in fp32 and rounded
    once, one row chunk at a time: the stage outputs are saved for backward anyway, so y
    needs no full fp32 accumulator (2 [B, L, D] in bf16 units) while the stages run, only
    one of N / row_chunks rows at the end."""
    N, D = layer.B * layer.L, layer.D
    y_ND = torch.empty(N, D, dtype=layer.x_ND.dtype, device=layer.x_ND.device)
    step = -(-N // row_chunks)
    for r0 in loops.tile_starts(N, step):
        acc32 = torch.zeros(min(step, N - r0), D, dtype=acc_dtype(y_ND.dtype), device=y_ND.device)
        for out_BLUd, (rnd, s) in zip(out_slices, stage_ids, strict=True):
            out_rows = out_BLUd.view(N, -1)[r0 : r0 + step]
            layer.gemm_acc_(acc32, out_rows, layer.wo_cols(rnd, s).t())
        y_ND[r0 : r0 + step] = acc32
        del acc32
    return y_ND.view(layer.B, layer.L, D)


def _backward_exchanges(layer: StagedLayer, dy_ND, dwo_DHd, out_slices, rnd, s):
    """Stage s's backward inputs in the head layout, pending: q (recomputed), out (saved)
    and dout = dy W_o[:, heads] (never built for all heads); also writes the stage's dW_o."""
    B, L, N, D, d = layer.B, layer.L, layer.B * layer.L, layer.D, layer.d
    q = layer.q(rnd, s)
    out_BLUd = out_slices.pop(0)
    dout_BLUd = (dy_ND @ layer.wo_cols(rnd, s)).view(B, L, -1, d)
    put_q(dwo_DHd, 1, rnd, s, (dy_ND.t() @ out_BLUd.view(N, -1)).view(D, -1, d))
    out = layer.to_head(out_BLUd, rnd.q_split(s))
    del out_BLUd
    dout = layer.to_head(dout_BLUd, rnd.q_split(s))
    del dout_BLUd
    return Together(q, out, dout)


class _Grads:
    """The parameter gradients being built: dW_q, dW_o written per stage; dW_k, dW_v and the
    kv biases' summed in fp32 (replicated kv heads, G < C, add up); the QK-norm weights'
    summed over heads in fp32."""

    def __init__(self, layer: StagedLayer):
        acc, dev = acc_dtype(layer.x.dtype), layer.x.device
        self.wq_HdD, self.wo_DHd = torch.empty_like(layer.wq_HdD), torch.empty_like(layer.wo_DHd)
        self.w32 = {n: torch.zeros(layer.wk_GdD.shape, dtype=acc, device=dev) for n in "kv"}
        self.bq_Hd = None if layer.bq_Hd is None else torch.empty_like(layer.bq_Hd)
        kv_biases = (("k", layer.bk_Gd), ("v", layer.bv_Gd))
        self.b32 = {
            n: None if b is None else torch.zeros(b.shape, dtype=acc, device=dev)
            for n, b in kv_biases
        }
        self.norm32 = {"q": None, "k": None}

    def add_norm(self, name, g):
        if g is not None:
            self.norm32[name] = accumulate(self.norm32[name], g)

    def result(self, layer: StagedLayer, dx_ND):
        """(dx, dwq, dwk, dwv, dwo, d q_norm, d k_norm, dbq, dbk, dbv), None where absent."""
        w = layer.wk_GdD.dtype  # (the layer's parameters share one dtype)
        return (
            dx_ND.view_as(layer.x),
            self.wq_HdD.flatten(0, 1),
            *(self.w32[n].to(w).flatten(0, 1) for n in "kv"),
            self.wo_DHd.flatten(1),
            *(None if g is None else g.to(w) for g in self.norm32.values()),
            None if self.bq_Hd is None else self.bq_Hd.flatten(),
            *(None if g is None else g.to(w).flatten() for g in self.b32.values()),
        )


def _backward(dy, layer: StagedLayer, out_slices, lse_list, sinks_H=None):
    """Gradients (dx, dwq, dwk, dwv, dwo, d q_norm, d k_norm, dbq, dbk, dbv, d sinks), the
    norm, bias and sink gradients None where absent (d sinks: this rank's heads, zeros
    elsewhere). Empties `out_slices` and `lse_list` as it goes.

    Memory: each stage's saved output is freed once its stage is done, and the projection
    gradients dq (and per round dk, dv) wait in the sequence layout until they are as big as
    dx (`DxAccumulator`), so the saved outputs still to use and the gradients already made
    share about one [B, L, H*d] budget instead of needing out and dx side by side.
    """
    plan, ex = layer.plan, layer.plan.ex
    N, D, d = layer.B * layer.L, layer.D, layer.d
    x_ND, dy_ND = layer.x_ND, dy.reshape(N, D)
    grads, dx = _Grads(layer), DxAccumulator(layer, layer.x.dtype)
    C, rank = _rank(plan)
    dsinks_H = None if sinks_H is None else sinks.zeros_like_sinks(sinks_H, lse_list[0].dtype)
    for rnd in plan.rounds:
        k_BSkd, v_BSkd = layer.kv(rnd)
        dk32_BSkd = dv32_BSkd = None
        start = functools.partial(_backward_exchanges, layer, dy_ND, grads.wo_DHd, out_slices, rnd)
        for s, (q_BSud, out_BSud, dout_BSud) in staged(len(rnd.stages), start, plan.overlap):
            lse_BuS = lse_list.pop(0)
            if sinks_H is not None:
                sink_u = stage_sinks(sinks_H, rnd, s, C, rank)
                dsink_u = sinks.grad(dout_BSud, out_BSud, lse_BuS, sink_u)
                put_stage_sinks_(dsinks_H, rnd, s, C, rank, dsink_u)
            dq_BSud, dk_BSkd, dv_BSkd = stage_attention(plan.attn, rnd, s).backward(
                dout_BSud, q_BSud, k_BSkd, v_BSkd, out_BSud, lse_BuS
            )
            del lse_BuS
            del dout_BSud, q_BSud, out_BSud
            dk32_BSkd = accumulate(dk32_BSkd, dk_BSkd)
            dv32_BSkd = accumulate(dv32_BSkd, dv_BSkd)
            del dk_BSkd, dv_BSkd
            dq_BLUd = ex.to_seq(dq_BSud, rnd.q_split(s))
            del dq_BSud
            dq_BLUd, dnorm = layer.q_prep.backward(
                dq_BLUd, x_ND, layer.q_rows(rnd, s), layer.q_bias(rnd, s)
            )
            grads.add_norm("q", dnorm)
            dq_NUd = dq_BLUd.view(N, -1)
            put_q(grads.wq_HdD, 0, rnd, s, (dq_NUd.t() @ x_ND).view(-1, d, D))
            if grads.bq_Hd is not None:
                put_q(grads.bq_Hd, 0, rnd, s, dq_NUd.sum(0).view(-1, d))
            dx.add(dq_NUd, functools.partial(layer.q_rows, rnd, s))
            del dq_BLUd, dq_NUd
        del k_BSkd, v_BSkd
        # the round's dk, dv go back once; each sum is freed as soon as it is sent
        kv_sums = [("k", dk32_BSkd), ("v", dv32_BSkd)]
        del dk32_BSkd, dv32_BSkd
        while kv_sums:
            _send_back_kv(layer, rnd, *kv_sums.pop(0), grads, dx)
        dx.end_round()
    dsinks = None if dsinks_H is None else dsinks_H.to(sinks_H.dtype)
    return (*grads.result(layer, dx.result(layer.x.dtype)), dsinks)


def _send_back_kv(layer: StagedLayer, rnd, name, d32_BSkd, grads: _Grads, dx: DxAccumulator):
    """The round's summed dk (name "k") or dv ("v") back to the sequence layout, through the
    k preparation's backward, into dW, the bias gradient and dx. Frees the sum once sent."""
    N, D, d = layer.B * layer.L, layer.D, layer.d
    w_GdD, b_Gd = (layer.wk_GdD, layer.bk_Gd) if name == "k" else (layer.wv_GdD, layer.bv_Gd)
    g_BLnd = layer.plan.ex.to_seq(d32_BSkd.to(layer.x.dtype), rnd.kv_split)
    del d32_BSkd
    if name == "k":
        rows, b_rows = layer.kv_rows(w_GdD, rnd), layer.kv_bias(b_Gd, rnd)
        g_BLnd, dnorm = layer.k_prep.backward(g_BLnd, layer.x_ND, rows, b_rows)
        grads.add_norm("k", dnorm)
        del rows
    g_Nn = g_BLnd.view(N, -1)
    add_kv_(grads.w32[name], 0, rnd, (g_Nn.t() @ layer.x_ND).view(-1, d, D))
    if grads.b32[name] is not None:
        add_kv_(grads.b32[name], 0, rnd, g_Nn.sum(0).view(-1, d))
    dx.add(g_Nn, functools.partial(layer.kv_rows, w_GdD, rnd))


OVERLAP_MAX_TOKENS = 65536


def default_overlap(x, group) -> bool:
    """Overlap by default on CUDA when the gathered sequence S = C * L has at most
    `OVERLAP_MAX_TOKENS` tokens.

    What overlap can hide is a stage's exchange behind its attention. Per stage (u = U/C
    query heads per rank, E bytes per element, all-to-all bandwidth W per GPU, attention
    throughput F): the q exchange moves about E * L * U * d bytes, the causal attention
    forward costs 2 * S^2 * u * d FLOPs, so
        exchange / attention = (E * L * U * d / W) / (2 * S^2 * u * d / F) = E * F / (2 * W * S)
    -- for bf16 at F = 500 TFLOP/s and W = 150 GB/s (NVLink all-to-all), 3333 / S: 5% at
    64K tokens, 0.3% at 1M. Its price is 8 stage buffers (8 U/H of one [B, L, H*d] tensor,
    measured in tests/distributed/test_steady_state.py), which at U = C is a large part of what
    UPipe
    saves. So long sequences, where memory is the point, run without; short ones, where the
    exchanges are a visible share of the time and memory is plentiful, run with.
    """
    if x.device.type != "cuda":
        return False  # gloo: the exchange and the kernel compete for the same cores
    return torch.distributed.get_world_size(group) * x.shape[1] <= OVERLAP_MAX_TOKENS


class _FusedUPipe(torch.autograd.Function):
    """Tensors are separate arguments (autograd differentiates only those); the static part
    of the call is one `FusedPlan`."""

    @staticmethod
    def forward(ctx, x, wq, wk, wv, wo, q_norm, k_norm, bq, bk, bv, cos, sin, plan, call, sinks_H):
        tensors = (x, wq, wk, wv, wo, q_norm, k_norm, bq, bk, bv, cos, sin)
        layer = _layer(plan, *tensors)
        reused = None if call is None else call.reused()
        if reused is not None:  # a checkpoint's recomputation: the forward's stage outputs
            n = len(reused) // 2
            out_slices, lse_list = reused[:n], reused[n:]
            del reused
            y = _o_proj(layer, out_slices, _stage_ids(plan))
        else:
            y, out_slices, lse_list = _forward(layer, sinks_H)
            if call is not None:  # a checkpoint's forward: kept for its recomputation
                call.keep(out_slices + lse_list)
        del call
        # backward frees the stage outputs and lse stage by stage
        save_for_backward(ctx, keep=(*tensors, sinks_H), free=out_slices + lse_list)
        ctx.plan = plan
        return y

    @staticmethod
    def backward(ctx, dy):
        (*tensors, sinks_H), stashed = saved_for_backward(ctx)
        sinks_H = sinks_H if ctx.needs_input_grad[14] else None
        n = len(stashed) // 2
        out_slices, lse_list = stashed[:n], stashed[n:]
        del stashed
        layer = _layer(ctx.plan, *tensors)
        *grads, dsinks = _backward(dy.contiguous(), layer, out_slices, lse_list, sinks_H)
        return (*grads, None, None, None, None, dsinks)


def _layer(plan, x, wq, wk, wv, wo, q_norm, k_norm, bq, bk, bv, cos, sin) -> StagedLayer:
    rope = (cos, sin, plan.rope_interleaved)
    preps = (Prep(*rope, w, plan.norm_eps, plan.norm_offset) for w in (q_norm, k_norm))
    return StagedLayer(x, wq, wk, wv, wo, (bq, bk, bv), *preps, plan)


@torch.compiler.disable  # a clean graph break: see upipe.attention
def fused_upipe_attention(
    x,
    wq,
    wk,
    wv,
    wo,
    cos,
    sin,
    *,
    rounds,
    head_dim,
    group,
    causal=True,
    softmax_scale=None,
    backend=None,
    rope_interleaved=False,
    q_norm=None,
    k_norm=None,
    norm_eps=1e-6,
    norm_offset=0.0,
    q_bias=None,
    k_bias=None,
    v_bias=None,
    layout="contiguous",
    ring_group=None,
    ring_layout="zigzag",
    overlap=None,
    docs=None,
    window=None,
    sinks=None,
):
    """y = o_proj(UPipe(rope(q_proj(x)), rope(k_proj(x)), v_proj(x))) with everything staged.

    x `[B, L, D]` (this rank's shard), weights in `torch.nn.Linear` layout (wq `[H*d, D]`,
    wk/wv `[G*d, D]`, wo `[D, H*d]`), cos/sin `[B, L, d]` for the shard's global positions,
    `rounds` from `upipe.heads.plan_schedule` (this rank's). `q_norm`/`k_norm`
    (weights `[d]`): QK-norm, RMSNorm of each projected head before RoPE (Qwen3), recomputed
    in backward; it multiplies by `norm_offset` + weight (1.0: the zero-centred norm of Gemma 3
    and Qwen3-Next, `staged_layer.rms_norm`).
    `q_bias` `[H*d]`, `k_bias`/`v_bias` `[G*d]`: projection biases (Qwen2), added before
    QK-norm and RoPE.
    The all-to-alls run over `group`
    for a sequence sharded in `layout`; with `ring_group` (a 2-D mesh: x in the mesh layout
    of `upipe.comm`, contiguous within the ulysses group, `ring_layout` across the ring) each
    stage's attention is ring attention over it. `overlap`: start each next stage's
    exchanges during the current stage's attention (see the module doc; None:
    `default_overlap`). `docs`: validated document boundaries of the full sequence
    (`upipe.packing.check_cu_seqlens`; a tuple of ints) -- each stage's attention is then
    document-masked, forward and recomputed backward alike; None: one document. `window`:
    a validated causal sliding window (`upipe.attention.window`), or None. `sinks`: `[H]`
    attention sinks (`upipe.attention.sinks`), or None; its gradient holds this rank's heads
    (zeros elsewhere), like the weights' a share of the full gradient.
    Inputs are not validated here: `ContextParallelAttention` does that. Inside an
    activation checkpoint that keeps attention outputs, the forward keeps the stage outputs
    and lse and the recomputation reuses them (`upipe.attention.kept`).
    """
    kernel = resolve_backend(backend, x.device, x.dtype, head_dim=head_dim)
    plan = FusedPlan(
        rounds=tuple(rounds),
        head_dim=head_dim,
        ex=HeadExchange(group, layout),
        attn=StageAttention(causal, softmax_scale, backend, ring_group, ring_layout, docs, window),
        rope_interleaved=rope_interleaved,
        norm_eps=norm_eps,
        norm_offset=norm_offset,
        overlap=default_overlap(x, group) if overlap is None else bool(overlap),
        tensor_cores=uses_cuda_kernels(kernel),
    )
    call = kept.claim("fused_upipe", x, wq, wk, wv, wo)
    return _FusedUPipe.apply(
        x, wq, wk, wv, wo, q_norm, k_norm, q_bias, k_bias, v_bias, cos, sin, plan, call, sinks
    )
