"""The pieces the fused UPipe op (fused.py) is built from: one call's input and weights seen
per head, the q/k preparation (QK-norm, RoPE) and its backward, the fp32 input-gradient
accumulator, and the stage loop with optional overlap.

Legend: B batch, S full sequence, L local tokens, N = B * L, D model width, H query heads,
G kv heads, U heads per stage, u = U / C query heads per rank per stage, k kv heads per rank
per round, n heads of a projection slice, d head dim, C group size.

Heads are picked by slicing (`schedule.select_q` / `select_kv`) -- no index tensors, so no
host-device synchronisation per stage.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from upipe import loops
from upipe.attention.schedule import select_kv, select_q
from upipe.attention.stage import StageAttention
from upipe.comm import Done, HeadExchange
from upipe.gemm import addmm_acc_
from upipe.heads import Round
from upipe.kernels import acc_dtype
from upipe.rope import apply_rope, apply_rope_backward


@dataclasses.dataclass(frozen=True)
class FusedPlan:
    """The static part of one fused call: what to run, where, and how."""

    rounds: tuple[Round, ...]
    """the head schedule (`heads.plan_schedule`: even or uneven rounds)"""
    head_dim: int
    ex: HeadExchange
    """the Ulysses exchange (group and sequence layout)"""
    attn: StageAttention
    """each stage's attention: the local kernel, or ring attention over the ring group"""
    rope_interleaved: bool
    norm_eps: float
    """the QK-norm's epsilon"""
    norm_offset: float
    """the QK-norm multiplies by norm_offset + weight (`rms_norm`)"""
    overlap: bool
    """start the next stage's exchanges before the current stage's attention (module doc)"""
    tensor_cores: bool
    """fp32 sums of bf16 products through CUDA's out_dtype GEMM (`upipe.gemm`)"""


def _project(x_ND, w_rows, b_rows):
    """x @ w_rows^T (+ b_rows)."""
    return x_ND @ w_rows.t() if b_rows is None else torch.addmm(b_rows, x_ND, w_rows.t())


def rms_norm(t, weight, eps: float, offset: float = 0.0):
    """RMSNorm over the last dim, times `offset + weight`.

    offset 0: torch's `F.rms_norm` (Llama, Qwen3). offset 1: the zero-centred form of Gemma 3
    and Qwen3-Next (transformers' `Gemma3RMSNorm`, `Qwen3NextRMSNorm`; the weight starts at
    0), computed as they compute it -- x / sqrt(mean(x^2) + eps) * (1 + weight) in fp32,
    rounded once to t's dtype -- so that a bf16 weight near 0 is not rounded after adding 1."""
    if not offset:
        return F.rms_norm(t, (t.shape[-1],), weight, eps)
    normed = F.rms_norm(t.float(), (t.shape[-1],), None, eps)
    return (normed * (offset + weight.float())).to(t.dtype)


@dataclasses.dataclass(frozen=True)
class Prep:
    """What happens to projected q or k heads before the exchange: RMSNorm over d with
    weight `norm_w` (QK-norm, as in Qwen3; times `offset + norm_w`: `rms_norm`; skipped
    when norm_w is None), then RoPE."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool
    norm_w: torch.Tensor | None = None
    eps: float = 1e-6
    offset: float = 0.0

    def __call__(self, t_BLnd):
        if self.norm_w is not None:
            t_BLnd = rms_norm(t_BLnd, self.norm_w, self.eps, self.offset)
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
            y_BLnd = rms_norm(t_BLnd, w, self.eps, self.offset)
            return torch.autograd.grad(y_BLnd, (t_BLnd, w), g_BLnd)


class StagedLayer:
    """One call's input and weights seen per head, and the stage pieces built from them."""

    def __init__(self, x, wq, wk, wv, wo, biases, q_prep, k_prep, plan: FusedPlan):
        B, L, D = x.shape
        d = plan.head_dim
        self.B, self.L, self.D, self.d, self.plan = B, L, D, d, plan
        self.x, self.x_ND = x, x.reshape(B * L, D)
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
        ex, split = self.plan.ex, rnd.kv_split
        k_BLkd = self.heads(self.kv_rows(self.wk_GdD, rnd), self.kv_bias(self.bk_Gd, rnd))
        k_BSkd = ex.to_head(self.k_prep(k_BLkd), split)
        del k_BLkd
        v_BLkd = self.heads(self.kv_rows(self.wv_GdD, rnd), self.kv_bias(self.bv_Gd, rnd))
        return k_BSkd, ex.to_head(v_BLkd, split)

    def q(self, rnd, s):
        """Stage s's q, projected and exchanged (pending: `wait()` gives [B, S, u, d])."""
        q_BLUd = self.heads(self.q_rows(rnd, s), self.q_bias(rnd, s), self.q_prep)
        return self.to_head(q_BLUd, rnd.q_split(s))

    def to_head(self, t_BLnd, counts=None):
        """The exchange of t (per-rank head `counts` on an uneven split), pending: started
        now when overlapping, else done now."""
        if self.plan.overlap:
            return self.plan.ex.to_head(t_BLnd, counts, async_op=True)
        return Done(self.plan.ex.to_head(t_BLnd, counts))

    def gemm_acc_(self, acc, a, b):
        addmm_acc_(acc, a, b, tensor_cores=self.plan.tensor_cores)


def staged(n, start, overlap):
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


class DxAccumulator:
    """dx = sum of g @ rows() over the projection gradients g, built as late as pays off.

    Parts (each small: a stage's or a round's heads; `rows` makes the weight rows on
    demand) wait while the stage outputs they replace are being freed, so the two share one
    budget. At the end of a round -- when the round's kv buffers are gone -- dx is allocated
    (fp32) once the waiting parts are as big as it, and from then on every part is folded in
    as soon as it is made.
    """

    def __init__(self, layer: StagedLayer, dtype):
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
        for r0 in loops.tile_starts(N, step):
            acc32 = torch.zeros(min(step, N - r0), D, dtype=self.dtype, device=self.device)
            for g_Nn, rows in self.waiting:
                self.layer.gemm_acc_(acc32, g_Nn[r0 : r0 + step], rows())
            dx_ND[r0 : r0 + step] = acc32
            del acc32
        self.waiting, self.waiting_bytes = [], 0
        return dx_ND
