"""UPipe with the projections and RoPE fused into the stage loop (the module's fast path).

Legend: B batch, S full sequence, L = S / C local tokens, N = B * L, D model width,
H query heads, G kv heads, U heads per stage, u = U / C query heads per rank per stage,
n = C * k heads in a round's kv exchange, d head dim, C group size.

Per round (kv heads `kv_idx`) and stage (query heads `q_idx`), on each rank:
    k_BLnd = rope(norm_k(x W_k[kv_idx]^T + b_k)),  v_BLnd = x W_v[kv_idx]^T + b_v
                                                   --seq_to_head-->  k_BSkd, v_BSkd
    q_BLUd = rope(norm_q(x W_q[q_idx]^T + b_q))    --seq_to_head-->  q_BSud
(norm_q/norm_k: the optional QK-norm, RMSNorm over each head's d features; identity without;
b_q/b_k/b_v: the optional projection biases, as in Qwen2, with the heads' rows taken alike)
    out_BSud, lse = attention(q_BSud, k_BSkd, v_BSkd)  --head_to_seq-->  out_BLUd
    y += out_BLUd W_o[:, q_idx]^T                       (fp32 accumulator)
so full-head q/k/v never exist and o_proj needs no full-width input. Saved: x, the weights,
cos/sin, each stage's out_BLUd (needed for dW_o and the kernel's backward) and lse.
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
attention runs (`_staged`), so they travel while the kernel computes; the results are the
same bit for bit, and the extra memory is the next stage's buffers: in backward a send and a
receive buffer for each of its three exchanges, its q and dout before they are packed, and
its W_o columns -- at most (8 + w) U/H of one [B, L, H*d] tensor (w = D / (B*L)), measured
in tests/test_steady_state.py; `default_overlap` says when it is on.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from upipe.attention.common import save_for_backward, saved_for_backward
from upipe.attention.schedule import Round, add_kv_, put_q, select_kv, select_q
from upipe.attention.stage import StageAttention
from upipe.attention.upipe import accumulate
from upipe.comm import Done, HeadExchange, Together
from upipe.gemm import addmm_acc_
from upipe.kernels import acc_dtype, resolve_backend, uses_cuda_kernels
from upipe.rope import apply_rope, apply_rope_backward


@dataclasses.dataclass(frozen=True)
class FusedPlan:
    """The static part of one fused call: what to run, where, and how."""

    rounds: tuple[Round, ...]
    """the head schedule (`schedule.plan_rounds`)"""
    head_dim: int
    ex: HeadExchange
    """the Ulysses exchange (group and sequence layout)"""
    attn: StageAttention
    """each stage's attention: the local kernel, or ring attention over the ring group"""
    rope_interleaved: bool
    norm_eps: float
    """the QK-norm's epsilon"""
    overlap: bool
    """start the next stage's exchanges before the current stage's attention (module doc)"""
    tensor_cores: bool
    """fp32 sums of bf16 products through CUDA's out_dtype GEMM (`upipe.gemm`)"""


def _project(x_ND, w_rows, b_rows):
    """x @ w_rows^T (+ b_rows)."""
    return x_ND @ w_rows.t() if b_rows is None else torch.addmm(b_rows, x_ND, w_rows.t())


@dataclasses.dataclass(frozen=True)
class _Prep:
    """What happens to projected q or k heads before the exchange: RMSNorm over d with
    weight `norm_w` (QK-norm, as in Qwen3; skipped when None), then RoPE."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool
    norm_w: torch.Tensor | None = None
    eps: float = 1e-6

    def __call__(self, t_BLnd):
        if self.norm_w is not None:
            t_BLnd = F.rms_norm(t_BLnd, (t_BLnd.shape[-1],), self.norm_w, self.eps)
        return apply_rope(t_BLnd, self.cos, self.sin, interleaved=self.interleaved)

    def backward(self, g_BLnd, x_ND, w_rows, b_rows=None):
        """(gradient w.r.t. the projection x w_rows^T + b_rows, gradient of norm_w or None)
        from the gradient w.r.t. this prep's output; the norm's input is recomputed."""
        g_BLnd = apply_rope_backward(g_BLnd, self.cos, self.sin, interleaved=self.interleaved)
        if self.norm_w is None:
            return g_BLnd, None
        with torch.enable_grad():  # the norm's backward, by autograd on the recomputed input
            t_BLnd = _project(x_ND, w_rows, b_rows).view_as(g_BLnd).requires_grad_()
            w = self.norm_w.detach().requires_grad_()
            y_BLnd = F.rms_norm(t_BLnd, (t_BLnd.shape[-1],), w, self.eps)
            return torch.autograd.grad(y_BLnd, (t_BLnd, w), g_BLnd)


class _Layer:
    """One call's input and weights seen per head, and the stage pieces built from them."""

    def __init__(self, x, wq, wk, wv, wo, biases, q_prep, k_prep, plan: FusedPlan):
        B, L, D = x.shape
        d = plan.head_dim
        self.B, self.L, self.D, self.d, self.plan = B, L, D, d, plan
        self.x_ND = x.reshape(B * L, D)
        self.wq_HdD, self.wk_GdD, self.wv_GdD = (w.view(-1, d, D) for w in (wq, wk, wv))
        self.wo_DHd = wo.view(D, -1, d)
        self.bq_Hd, self.bk_Gd, self.bv_Gd = (None if b is None else b.view(-1, d) for b in biases)
        self.q_prep, self.k_prep = q_prep, k_prep

    def q_rows(self, rnd, s):
        """W_q rows of stage s's heads: [U*d, D] (a small copy)."""
        return select_q(self.wq_HdD, 0, rnd, s).flatten(0, 2)

    def q_bias(self, rnd, s):
        return None if self.bq_Hd is None else select_q(self.bq_Hd, 0, rnd, s).flatten()

    def kv_rows(self, w_GdD, rnd):
        """Rows of the round's (virtual) kv heads: [C*k*d, D]."""
        return select_kv(w_GdD, 0, rnd).flatten(0, 1)

    def kv_bias(self, b_Gd, rnd):
        return None if b_Gd is None else select_kv(b_Gd, 0, rnd).flatten()

    def wo_cols(self, rnd, s):
        """W_o columns of stage s's heads: [D, U*d]."""
        return select_q(self.wo_DHd, 1, rnd, s).flatten(1, 3)

    def heads(self, w_rows, b_rows, prep=None):
        """x @ w_rows^T (+ b_rows) as [B, L, n, d], through `prep` (QK-norm, RoPE) if given."""
        t_BLnd = _project(self.x_ND, w_rows, b_rows).view(self.B, self.L, -1, self.d)
        return t_BLnd if prep is None else prep(t_BLnd)

    def kv(self, rnd):
        """The round's k and v, projected and exchanged: [B, S, k, d] each."""
        ex = self.plan.ex
        k_BLkd = self.heads(self.kv_rows(self.wk_GdD, rnd), self.kv_bias(self.bk_Gd, rnd))
        k_BSkd = ex.to_head(self.k_prep(k_BLkd))
        del k_BLkd
        v_BLkd = self.heads(self.kv_rows(self.wv_GdD, rnd), self.kv_bias(self.bv_Gd, rnd))
        return k_BSkd, ex.to_head(v_BLkd)

    def q(self, rnd, s):
        """Stage s's q, projected and exchanged (pending: `wait()` gives [B, S, u, d])."""
        return self.to_head(self.heads(self.q_rows(rnd, s), self.q_bias(rnd, s), self.q_prep))

    def to_head(self, t_BLnd):
        """The exchange of t, pending: started now when overlapping, else done now."""
        if self.plan.overlap:
            return self.plan.ex.to_head(t_BLnd, async_op=True)
        return Done(self.plan.ex.to_head(t_BLnd))

    def gemm_acc_(self, acc, a, b):
        addmm_acc_(acc, a, b, tensor_cores=self.plan.tensor_cores)


def _staged(n, start, overlap):
    """(i, result of start(i)) for i = 0 .. n-1 (each start returns a pending exchange). With
    `overlap`, start(i + 1) is issued before result i is handed out, so its exchange runs
    while the caller works on i; without, after the caller is done with i. Nothing here
    keeps a reference to a result it has handed out (nor may the caller's loop: `enumerate`
    would hold its last item), so the caller's `del` frees it."""
    pending = start(0)
    for i in range(n):
        box = [pending.wait()]
        pending = start(i + 1) if overlap and i + 1 < n else None
        yield i, box.pop()
        if pending is None and i + 1 < n:
            pending = start(i + 1)


class _DxAccumulator:
    """dx = sum of g @ rows() over the projection gradients g, built as late as pays off.

    Parts (each small: a stage's or a round's heads; `rows` makes the weight rows on
    demand) wait while the stage outputs they replace are being freed, so the two share one
    budget. At the end of a round -- when the round's kv buffers are gone -- dx is allocated
    (fp32) once the waiting parts are as big as it, and from then on every part is folded in
    as soon as it is made.
    """

    def __init__(self, layer: _Layer, dtype):
        self.shape, self.dtype, self.layer = (layer.B * layer.L, layer.D), acc_dtype(dtype), layer
        self.device = layer.x_ND.device
        self.dx32_ND = None
        self.waiting, self.waiting_bytes = [], 0

    def add(self, g_Nn, rows):
        self.waiting.append((g_Nn, rows))
        self.waiting_bytes += g_Nn.numel() * g_Nn.element_size()
        if self.dx32_ND is not None:
            self._fold()

    def end_round(self):
        if self.waiting_bytes >= self.shape[0] * self.shape[1] * self.dtype.itemsize:
            self._fold()

    def _fold(self):
        if self.dx32_ND is None:
            self.dx32_ND = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        while self.waiting:
            g_Nn, rows = self.waiting.pop()
            self.layer.gemm_acc_(self.dx32_ND, g_Nn, rows())
            del g_Nn
        self.waiting_bytes = 0

    def result(self, dtype, row_chunks=8):
        """dx in `dtype`. If no part was folded yet (bf16: the parts never reach the size of
        an fp32 dx), dx is built in row chunks, each summed over all parts in fp32, so no
        full fp32 buffer is needed."""
        if self.dx32_ND is not None or not self.waiting:
            self._fold()
            return self.dx32_ND.to(dtype)
        N, D = self.shape
        dx_ND = torch.empty(N, D, dtype=dtype, device=self.device)
        step = -(-N // row_chunks)
        for r0 in range(0, N, step):
            acc32 = torch.zeros(min(step, N - r0), D, dtype=self.dtype, device=self.device)
            for g_Nn, rows in self.waiting:
                self.layer.gemm_acc_(acc32, g_Nn[r0 : r0 + step], rows())
            dx_ND[r0 : r0 + step] = acc32
            del acc32
        self.waiting, self.waiting_bytes = [], 0
        return dx_ND


def _forward(layer: _Layer):
    """Returns y `[B, L, D]`, the per-stage outputs out_BLUd and the per-stage lse."""
    plan, N = layer.plan, layer.B * layer.L
    y32_ND = torch.zeros(N, layer.D, dtype=acc_dtype(layer.x_ND.dtype), device=layer.x_ND.device)
    out_slices, lse_list = [], []
    for rnd in plan.rounds:
        k_BSkd, v_BSkd = layer.kv(rnd)
        stages = _staged(len(rnd.stages), functools.partial(layer.q, rnd), plan.overlap)
        for s, q_BSud in stages:
            out_BSud, lse_BuS = plan.attn.forward(q_BSud, k_BSkd, v_BSkd)
            del q_BSud
            out_BLUd = plan.ex.to_seq(out_BSud)
            del out_BSud
            layer.gemm_acc_(y32_ND, out_BLUd.view(N, -1), layer.wo_cols(rnd, s).t())
            out_slices.append(out_BLUd)
            lse_list.append(lse_BuS)
        del k_BSkd, v_BSkd
    return y32_ND.view(layer.B, layer.L, layer.D).to(layer.x_ND.dtype), out_slices, lse_list


def _backward_exchanges(layer: _Layer, dy_ND, dwo_DHd, out_slices, rnd, s):
    """Stage s's backward inputs in the head layout, pending: q (recomputed), out (saved)
    and dout = dy W_o[:, heads] (never built for all heads); also writes the stage's dW_o."""
    B, L, N, D, d = layer.B, layer.L, layer.B * layer.L, layer.D, layer.d
    q = layer.q(rnd, s)
    out_BLUd = out_slices.pop(0)
    dout_BLUd = (dy_ND @ layer.wo_cols(rnd, s)).view(B, L, -1, d)
    put_q(dwo_DHd, 1, rnd, s, (dy_ND.t() @ out_BLUd.view(N, -1)).view(D, -1, d))
    out = layer.to_head(out_BLUd)
    del out_BLUd
    dout = layer.to_head(dout_BLUd)
    del dout_BLUd
    return Together(q, out, dout)


def _backward(dy, x, biases, layer: _Layer, out_slices, lse_list):
    """Gradients (dx, dwq, dwk, dwv, dwo, d q_norm, d k_norm, dbq, dbk, dbv), the norm and
    bias gradients None where absent. Empties `out_slices` and `lse_list` as it goes.

    Memory: each stage's saved output is freed once its stage is done, and the projection
    gradients dq (and per round dk, dv) wait in the sequence layout until they are as big as
    dx (`_DxAccumulator`), so the saved outputs still to use and the gradients already made
    share about one [B, L, H*d] budget instead of needing out and dx side by side.
    """
    plan, ex = layer.plan, layer.plan.ex
    N, D, d = layer.B * layer.L, layer.D, layer.d
    x_ND, dy_ND = layer.x_ND, dy.reshape(N, D)
    acc = acc_dtype(x.dtype)
    dwq_HdD, dwo_DHd = torch.empty_like(layer.wq_HdD), torch.empty_like(layer.wo_DHd)
    # kv weight gradients: replicas (G < C) add up, so accumulate them in fp32
    dwk32_GdD = torch.zeros(layer.wk_GdD.shape, dtype=acc, device=x.device)
    dwv32_GdD = torch.zeros_like(dwk32_GdD)
    dx = _DxAccumulator(layer, x.dtype)
    dnorm32 = {"q": None, "k": None}  # QK-norm weight gradients, summed over heads in fp32
    bq, bk, bv = biases
    dbq_Hd = None if bq is None else torch.empty_like(layer.bq_Hd)
    # kv bias gradients: replicas add up, as for the weights (fp32)
    db32 = {
        name: None if b is None else torch.zeros(b.shape, dtype=acc, device=x.device)
        for name, b in (("k", layer.bk_Gd), ("v", layer.bv_Gd))
    }
    for rnd in plan.rounds:
        k_BSkd, v_BSkd = layer.kv(rnd)
        dk32_BSkd = dv32_BSkd = None
        start = functools.partial(_backward_exchanges, layer, dy_ND, dwo_DHd, out_slices, rnd)
        for s, (q_BSud, out_BSud, dout_BSud) in _staged(len(rnd.stages), start, plan.overlap):
            dq_BSud, dk_BSkd, dv_BSkd = plan.attn.backward(
                dout_BSud, q_BSud, k_BSkd, v_BSkd, out_BSud, lse_list.pop(0)
            )
            del dout_BSud, q_BSud, out_BSud
            dk32_BSkd = accumulate(dk32_BSkd, dk_BSkd)
            dv32_BSkd = accumulate(dv32_BSkd, dv_BSkd)
            del dk_BSkd, dv_BSkd
            dq_BLUd = ex.to_seq(dq_BSud)
            del dq_BSud
            dq_BLUd, dnorm = layer.q_prep.backward(
                dq_BLUd, x_ND, layer.q_rows(rnd, s), layer.q_bias(rnd, s)
            )
            dnorm32["q"] = _add_norm_grad(dnorm32["q"], dnorm)
            dq_NUd = dq_BLUd.view(N, -1)
            put_q(dwq_HdD, 0, rnd, s, (dq_NUd.t() @ x_ND).view(-1, d, D))
            if dbq_Hd is not None:
                put_q(dbq_Hd, 0, rnd, s, dq_NUd.sum(0).view(-1, d))
            dx.add(dq_NUd, functools.partial(layer.q_rows, rnd, s))
            del dq_BLUd, dq_NUd
        del k_BSkd, v_BSkd
        # the round's dk, dv go back once; each sum is freed as soon as it is sent
        kv_sums = [
            (dk32_BSkd, layer.wk_GdD, dwk32_GdD, layer.k_prep, "k", layer.bk_Gd),
            (dv32_BSkd, layer.wv_GdD, dwv32_GdD, None, "v", layer.bv_Gd),
        ]
        del dk32_BSkd, dv32_BSkd
        while kv_sums:
            d32_BSkd, w_GdD, dw32_GdD, prep, name, b_Gd = kv_sums.pop(0)
            g_BLnd = ex.to_seq(d32_BSkd.to(x.dtype))
            del d32_BSkd
            if prep is not None:
                rows, b_rows = layer.kv_rows(w_GdD, rnd), layer.kv_bias(b_Gd, rnd)
                g_BLnd, dnorm = prep.backward(g_BLnd, x_ND, rows, b_rows)
                dnorm32["k"] = _add_norm_grad(dnorm32["k"], dnorm)
                del rows
            g_Nn = g_BLnd.view(N, -1)
            add_kv_(dw32_GdD, 0, rnd, (g_Nn.t() @ x_ND).view(-1, d, D))
            if db32[name] is not None:
                add_kv_(db32[name], 0, rnd, g_Nn.sum(0).view(-1, d))
            dx.add(g_Nn, functools.partial(layer.kv_rows, w_GdD, rnd))
            del g_BLnd, g_Nn
        dx.end_round()
    wq, wk = layer.wq_HdD, layer.wk_GdD
    return (
        dx.result(x.dtype).view_as(x),
        dwq_HdD.flatten(0, 1),
        dwk32_GdD.to(wk.dtype).flatten(0, 1),
        dwv32_GdD.to(wk.dtype).flatten(0, 1),
        dwo_DHd.flatten(1),
        *(None if g is None else g.to(wq.dtype) for g in (dnorm32["q"], dnorm32["k"])),
        None if dbq_Hd is None else dbq_Hd.flatten(),
        *(
            None if g is None else g.to(b.dtype).flatten()
            for g, b in ((db32["k"], bk), (db32["v"], bv))
        ),
    )


def _add_norm_grad(acc32, g):
    return None if g is None else accumulate(acc32, g)


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
    measured in tests/test_steady_state.py), which at U = C is a large part of what UPipe
    saves. So long sequences, where memory is the point, run without; short ones, where the
    exchanges are a visible share of the time and memory is plentiful, run with.
    """
    if x.device.type != "cuda":
        return False  # gloo: the exchange and the kernel compete for the same cores
    return torch.distributed.get_world_size(group) * x.shape[1] <= OVERLAP_MAX_TOKENS


class _FusedUPipe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wq, wk, wv, wo, q_norm, k_norm, bq, bk, bv, cos, sin, plan):
        layer = _Layer(
            x, wq, wk, wv, wo, (bq, bk, bv), *_preps(cos, sin, q_norm, k_norm, plan), plan
        )
        y, out_slices, lse_list = _forward(layer)
        # backward frees the stage outputs and lse stage by stage
        keep = (x, wq, wk, wv, wo, q_norm, k_norm, bq, bk, bv, cos, sin)
        save_for_backward(ctx, keep=keep, free=out_slices + lse_list)
        ctx.plan = plan
        return y

    @staticmethod
    def backward(ctx, dy):
        (x, wq, wk, wv, wo, q_norm, k_norm, bq, bk, bv, cos, sin), stashed = saved_for_backward(ctx)
        plan = ctx.plan
        n = len(stashed) // 2
        out_slices, lse_list = stashed[:n], stashed[n:]
        del stashed
        biases = (bq, bk, bv)
        layer = _Layer(x, wq, wk, wv, wo, biases, *_preps(cos, sin, q_norm, k_norm, plan), plan)
        grads = _backward(dy.contiguous(), x, biases, layer, out_slices, lse_list)
        return (*grads, None, None, None)


def _preps(cos, sin, q_norm, k_norm, plan):
    return (
        _Prep(cos, sin, plan.rope_interleaved, q_norm, plan.norm_eps),
        _Prep(cos, sin, plan.rope_interleaved, k_norm, plan.norm_eps),
    )


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
    q_bias=None,
    k_bias=None,
    v_bias=None,
    layout="contiguous",
    ring_group=None,
    ring_layout="zigzag",
    overlap=None,
):
    """y = o_proj(UPipe(rope(q_proj(x)), rope(k_proj(x)), v_proj(x))) with everything staged.

    x `[B, L, D]` (this rank's shard), weights in `torch.nn.Linear` layout (wq `[H*d, D]`,
    wk/wv `[G*d, D]`, wo `[D, H*d]`), cos/sin `[B, L, d]` for the shard's global positions,
    `rounds` from `upipe.attention.schedule.plan_rounds`. `q_norm`/`k_norm` (weights `[d]`):
    QK-norm, RMSNorm of each projected head before RoPE (Qwen3), recomputed in backward.
    `q_bias` `[H*d]`, `k_bias`/`v_bias` `[G*d]`: projection biases (Qwen2), added before
    QK-norm and RoPE.
    The all-to-alls run over `group`
    for a sequence sharded in `layout`; with `ring_group` (a 2-D mesh: x in the mesh layout
    of `upipe.comm`, contiguous within the ulysses group, `ring_layout` across the ring) each
    stage's attention is ring attention over it. `overlap`: start each next stage's
    exchanges during the current stage's attention (see the module doc; None:
    `default_overlap`).
    Inputs are not validated here: `ContextParallelAttention` does that.
    """
    kernel = resolve_backend(backend, x.device, x.dtype)
    plan = FusedPlan(
        rounds=tuple(rounds),
        head_dim=head_dim,
        ex=HeadExchange(group, layout),
        attn=StageAttention(causal, softmax_scale, backend, ring_group, ring_layout),
        rope_interleaved=rope_interleaved,
        norm_eps=norm_eps,
        overlap=default_overlap(x, group) if overlap is None else bool(overlap),
        tensor_cores=uses_cuda_kernels(kernel),
    )
    return _FusedUPipe.apply(
        x, wq, wk, wv, wo, q_norm, k_norm, q_bias, k_bias, v_bias, cos, sin, plan
    )
