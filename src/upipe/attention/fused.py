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
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from upipe.attention.common import save_for_backward, saved_for_backward
from upipe.attention.stage import StageAttention
from upipe.attention.upipe import accumulate
from upipe.comm import HeadExchange
from upipe.kernels import acc_dtype
from upipe.rope import apply_rope, apply_rope_backward


def _index(heads, device):
    return torch.tensor(heads, dtype=torch.long, device=device)


def _rows(w_ndD, idx):
    """Weight rows of the listed heads: [n, d, D] -> [len(idx) * d, D] (a small copy)."""
    return w_ndD.index_select(0, idx).flatten(0, 1)


def _bias_rows(b_n, idx, d):
    """Bias entries of the listed heads: [n * d] -> [len(idx) * d]; None without a bias."""
    return None if b_n is None else b_n.view(-1, d).index_select(0, idx).flatten()


def _project(x_ND, w_rows, b_rows):
    """x @ w_rows^T (+ b_rows)."""
    return x_ND @ w_rows.t() if b_rows is None else torch.addmm(b_rows, x_ND, w_rows.t())


def _addmm_(acc32, a, b):
    """acc32 += a @ b in the accumulator's dtype (fp32 or wider: no half-precision sums)."""
    acc32.addmm_(a.to(acc32.dtype), b.to(acc32.dtype))


class _DxAccumulator:
    """dx = sum of g @ w[idx] over the projection gradients g, built as late as pays off.

    Parts (each small: a stage's or a round's heads) wait while the stage outputs they
    replace are being freed, so the two share one budget. At the end of a round -- when the
    round's kv buffers are gone -- dx is allocated (fp32) once the waiting parts are as big
    as it, and from then on every part is folded in as soon as it is made.
    """

    def __init__(self, N, D, dtype, device):
        self.shape, self.dtype, self.device = (N, D), acc_dtype(dtype), device
        self.dx32_ND = None
        self.waiting, self.waiting_bytes = [], 0

    def add(self, g_Nn, w_ndD, idx):
        self.waiting.append((g_Nn, w_ndD, idx))
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
            g_Nn, w_ndD, idx = self.waiting.pop()
            _addmm_(self.dx32_ND, g_Nn, _rows(w_ndD, idx))
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
            for g_Nn, w_ndD, idx in self.waiting:
                _addmm_(acc32, g_Nn[r0 : r0 + step], _rows(w_ndD, idx))
            dx_ND[r0 : r0 + step] = acc32
            del acc32
        self.waiting, self.waiting_bytes = [], 0
        return dx_ND


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

    def backward(self, g_BLnd, x_ND, w_ndD, idx, b_rows=None):
        """(gradient w.r.t. the projection x w[idx]^T + b_rows, gradient of norm_w or None)
        from the gradient w.r.t. this prep's output; the norm's input is recomputed."""
        g_BLnd = apply_rope_backward(g_BLnd, self.cos, self.sin, interleaved=self.interleaved)
        if self.norm_w is None:
            return g_BLnd, None
        with torch.enable_grad():  # the norm's backward, by autograd on the recomputed input
            t_BLnd = _project(x_ND, _rows(w_ndD, idx), b_rows).view_as(g_BLnd).requires_grad_()
            w = self.norm_w.detach().requires_grad_()
            y_BLnd = F.rms_norm(t_BLnd, (t_BLnd.shape[-1],), w, self.eps)
            return torch.autograd.grad(y_BLnd, (t_BLnd, w), g_BLnd)


def _heads_of(x_ND, w_rows, B, L, d, prep=None, b_rows=None):
    """x @ w_rows^T (+ b_rows) as [B, L, n, d], through `prep` (QK-norm, RoPE) if given."""
    t_BLnd = _project(x_ND, w_rows, b_rows).view(B, L, -1, d)
    return t_BLnd if prep is None else prep(t_BLnd)


def _kv_round(x_ND, wk_GdD, wv_GdD, biases, kv_idx, B, L, d, k_prep, ex):
    _, bk, bv = biases
    k_BLkd = _heads_of(x_ND, _rows(wk_GdD, kv_idx), B, L, d, k_prep, _bias_rows(bk, kv_idx, d))
    k_BSkd = ex.to_head(k_BLkd)
    del k_BLkd
    v_BSkd = ex.to_head(
        _heads_of(x_ND, _rows(wv_GdD, kv_idx), B, L, d, None, _bias_rows(bv, kv_idx, d))
    )
    return k_BSkd, v_BSkd


def _q_stage(x_ND, wq_HdD, bq, q_idx, B, L, d, q_prep, ex):
    return ex.to_head(
        _heads_of(x_ND, _rows(wq_HdD, q_idx), B, L, d, q_prep, _bias_rows(bq, q_idx, d))
    )


def _forward(x, wq, wk, wv, wo, biases, q_prep, k_prep, rounds, d, ex, attn):
    """Returns y `[B, L, D]`, the per-stage outputs out_BLUd and the per-stage lse."""
    B, L, D = x.shape
    x_ND = x.reshape(B * L, D)
    wq_HdD, wk_GdD, wv_GdD = wq.view(-1, d, D), wk.view(-1, d, D), wv.view(-1, d, D)
    wo_DHd = wo.view(D, -1, d)
    y32_ND = torch.zeros(B * L, D, dtype=acc_dtype(x.dtype), device=x.device)
    out_slices, lse_list = [], []
    for rnd in rounds:
        kv_idx = _index(rnd.kv_heads, x.device)
        k_BSkd, v_BSkd = _kv_round(x_ND, wk_GdD, wv_GdD, biases, kv_idx, B, L, d, k_prep, ex)
        for stage in rnd.stages:
            q_idx = _index(stage, x.device)
            q_BSud = _q_stage(x_ND, wq_HdD, biases[0], q_idx, B, L, d, q_prep, ex)
            out_BSud, lse_BuS = attn.forward(q_BSud, k_BSkd, v_BSkd)
            del q_BSud
            out_BLUd = ex.to_seq(out_BSud)
            del out_BSud
            _addmm_(y32_ND, out_BLUd.view(B * L, -1), wo_DHd.index_select(1, q_idx).flatten(1).t())
            out_slices.append(out_BLUd)
            lse_list.append(lse_BuS)
        del k_BSkd, v_BSkd
    return y32_ND.view(B, L, D).to(x.dtype), out_slices, lse_list


def _backward(
    dy, x, wq, wk, wv, wo, biases, q_prep, k_prep, out_slices, lse_list, rounds, d, ex, attn
):
    """Gradients (dx, dwq, dwk, dwv, dwo, d q_norm, d k_norm, dbq, dbk, dbv), the norm and
    bias gradients None where absent. Empties `out_slices` and `lse_list` as it goes.

    Memory: each stage's saved output is freed once its stage is done, and the projection
    gradients dq (and per round dk, dv) wait in the sequence layout until they are as big as
    dx (`_DxAccumulator`), so the saved outputs still to use and the gradients already made
    share about one [B, L, H*d] budget instead of needing out and dx side by side.
    """
    B, L, D = x.shape
    x_ND, dy_ND = x.reshape(B * L, D), dy.reshape(B * L, D)
    wq_HdD, wk_GdD, wv_GdD = wq.view(-1, d, D), wk.view(-1, d, D), wv.view(-1, d, D)
    wo_DHd = wo.view(D, -1, d)
    dwq_HdD, dwo_DHd = torch.empty_like(wq_HdD), torch.empty_like(wo_DHd)
    # kv weight gradients: replicas (G < C) add up, so accumulate them in fp32
    dwk32_GdD = torch.zeros(wk_GdD.shape, dtype=acc_dtype(x.dtype), device=x.device)
    dwv32_GdD = torch.zeros_like(dwk32_GdD)
    dx = _DxAccumulator(B * L, D, x.dtype, x.device)
    dnorm32 = {"q": None, "k": None}  # QK-norm weight gradients, summed over heads in fp32
    bq, bk, bv = biases
    dbq_Hd = None if bq is None else torch.empty_like(bq).view(-1, d)
    # kv bias gradients: replicas add up, as for the weights (fp32)
    db32 = {
        name: None
        if b is None
        else torch.zeros(b.numel() // d, d, dtype=acc_dtype(x.dtype), device=x.device)
        for name, b in (("k", bk), ("v", bv))
    }
    for rnd in rounds:
        kv_idx = _index(rnd.kv_heads, x.device)
        k_BSkd, v_BSkd = _kv_round(x_ND, wk_GdD, wv_GdD, biases, kv_idx, B, L, d, k_prep, ex)
        dk32_BSkd = dv32_BSkd = None
        for stage in rnd.stages:
            q_idx = _index(stage, x.device)
            q_BSud = _q_stage(x_ND, wq_HdD, biases[0], q_idx, B, L, d, q_prep, ex)
            out_BLUd = out_slices.pop(0)
            wo_cols = wo_DHd.index_select(1, q_idx).flatten(1)  # [D, U*d]
            dout_BLUd = (dy_ND @ wo_cols).view(B, L, -1, d)
            dwo_DHd.index_copy_(1, q_idx, (dy_ND.t() @ out_BLUd.view(B * L, -1)).view(D, -1, d))
            out_BSud = ex.to_head(out_BLUd)
            del out_BLUd
            dout_BSud = ex.to_head(dout_BLUd)
            del dout_BLUd
            dq_BSud, dk_BSkd, dv_BSkd = attn.backward(
                dout_BSud, q_BSud, k_BSkd, v_BSkd, out_BSud, lse_list.pop(0)
            )
            del dout_BSud, q_BSud, out_BSud
            dk32_BSkd = accumulate(dk32_BSkd, dk_BSkd)
            dv32_BSkd = accumulate(dv32_BSkd, dv_BSkd)
            del dk_BSkd, dv_BSkd
            dq_BLUd = ex.to_seq(dq_BSud)
            del dq_BSud
            dq_BLUd, dnorm = q_prep.backward(dq_BLUd, x_ND, wq_HdD, q_idx, _bias_rows(bq, q_idx, d))
            dnorm32["q"] = _add_norm_grad(dnorm32["q"], dnorm)
            dq_NUd = dq_BLUd.view(B * L, -1)
            dwq_HdD.index_copy_(0, q_idx, (dq_NUd.t() @ x_ND).view(-1, d, D))
            if dbq_Hd is not None:
                dbq_Hd.index_copy_(0, q_idx, dq_NUd.sum(0).view(-1, d))
            dx.add(dq_NUd, wq_HdD, q_idx)
            del dq_BLUd, dq_NUd
        del k_BSkd, v_BSkd
        # the round's dk, dv go back once; each sum is freed as soon as it is sent
        kv_sums = [
            (dk32_BSkd, wk_GdD, dwk32_GdD, k_prep, "k", bk),
            (dv32_BSkd, wv_GdD, dwv32_GdD, None, "v", bv),
        ]
        del dk32_BSkd, dv32_BSkd
        while kv_sums:
            d32_BSkd, w_GdD, dw32_GdD, prep, name, b = kv_sums.pop(0)
            g_BLnd = ex.to_seq(d32_BSkd.to(x.dtype))
            del d32_BSkd
            if prep is not None:
                g_BLnd, dnorm = prep.backward(g_BLnd, x_ND, w_GdD, kv_idx, _bias_rows(b, kv_idx, d))
                dnorm32["k"] = _add_norm_grad(dnorm32["k"], dnorm)
            g_Nn = g_BLnd.view(B * L, -1)
            dw32_GdD.index_add_(0, kv_idx, (g_Nn.t() @ x_ND).view(-1, d, D).to(dw32_GdD.dtype))
            if db32[name] is not None:
                db32[name].index_add_(0, kv_idx, g_Nn.sum(0).view(-1, d).to(db32[name].dtype))
            dx.add(g_Nn, w_GdD, kv_idx)
            del g_BLnd, g_Nn
        dx.end_round()
    return (
        dx.result(x.dtype).view(B, L, D),
        dwq_HdD.view_as(wq),
        dwk32_GdD.to(wk.dtype).view_as(wk),
        dwv32_GdD.to(wv.dtype).view_as(wv),
        dwo_DHd.view_as(wo),
        *(None if g is None else g.to(wq.dtype) for g in (dnorm32["q"], dnorm32["k"])),
        None if dbq_Hd is None else dbq_Hd.view_as(bq),
        *(
            None if g is None else g.to(b.dtype).view_as(b)
            for g, b in ((db32["k"], bk), (db32["v"], bv))
        ),
    )


def _add_norm_grad(acc32, g):
    return None if g is None else accumulate(acc32, g)


class _FusedUPipe(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        wq,
        wk,
        wv,
        wo,
        q_norm,
        k_norm,
        bq,
        bk,
        bv,
        cos,
        sin,
        interleaved,
        eps,
        rounds,
        d,
        ex,
        attn,
    ):
        q_prep = _Prep(cos, sin, interleaved, q_norm, eps)
        k_prep = _Prep(cos, sin, interleaved, k_norm, eps)
        biases = (bq, bk, bv)
        y, out_slices, lse_list = _forward(
            x, wq, wk, wv, wo, biases, q_prep, k_prep, rounds, d, ex, attn
        )
        # backward frees the stage outputs and lse stage by stage
        keep = (x, wq, wk, wv, wo, q_norm, k_norm, bq, bk, bv, cos, sin)
        save_for_backward(ctx, keep=keep, free=out_slices + lse_list)
        ctx.args = (interleaved, eps, rounds, d, ex, attn)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x, wq, wk, wv, wo, q_norm, k_norm, bq, bk, bv, cos, sin), stashed = saved_for_backward(ctx)
        interleaved, eps, rounds, d, ex, attn = ctx.args
        n = len(stashed) // 2
        out_slices, lse_list = stashed[:n], stashed[n:]
        del stashed
        grads = _backward(
            dy.contiguous(),
            x,
            wq,
            wk,
            wv,
            wo,
            (bq, bk, bv),
            _Prep(cos, sin, interleaved, q_norm, eps),
            _Prep(cos, sin, interleaved, k_norm, eps),
            out_slices,
            lse_list,
            rounds,
            d,
            ex,
            attn,
        )
        return (*grads, *([None] * 8))


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
    stage's attention is ring attention over it. Inputs are not validated here:
    `ContextParallelAttention` does that.
    """
    ex = HeadExchange(group, layout)
    attn = StageAttention(causal, softmax_scale, backend, ring_group, ring_layout)
    return _FusedUPipe.apply(
        x,
        wq,
        wk,
        wv,
        wo,
        q_norm,
        k_norm,
        q_bias,
        k_bias,
        v_bias,
        cos,
        sin,
        rope_interleaved,
        norm_eps,
        rounds,
        head_dim,
        ex,
        attn,
    )
