"""Mixture-of-experts MLP: a top-k router, experts as grouped GEMMs, an optional shared
expert, and the load-balancing loss over the whole sequence.

Legend: B batch, T tokens of this call (a rank's L, or one MLP tile of them), N = B T
tokens, D width, E experts, K experts per token, F expert width, M = N K routed rows,
O/I a weight's output/input width.

Routing (`route`): logits z = x W_r^T [N, E]; p = softmax(z) in fp32; each token goes to
the K experts of largest p, weighted by `ROUTER_WEIGHTS` (module `config.ModelConfig`):
"softmax" w = p_topk; "softmax_renorm" w = p_topk / sum p_topk; "topk_softmax"
w = softmax(z_topk). y_n = sum_j w_nj expert_{e_nj}(x_n) (+ shared(x_n)).

Dispatch (`Experts`): the M = N K (token, expert) pairs are sorted by expert (a stable
argsort: static shapes, no data-dependent size, so the planner traces it under fake
tensors), the tokens gathered into that order [M, D], each expert's SwiGLU run on its
contiguous segment by two grouped GEMMs (`grouped_linear`: gate_up [E, 2F, D], down
[E, D, F], Hugging Face's Qwen3-MoE layout), and the rows put back in token order and summed
with their weights (a batched [1, K] x [K, D] product: deterministic, no atomics). The
grouped GEMM is a torch custom op looping over the E segments with `torch.mm(out=)`, one
GEMM per expert and no temporaries: `torch._grouped_mm` would do it in one kernel, but it is
private, CUDA-only in its fake/meta rules (bf16 only, 16-byte strides) and changed across the
torch versions upipe supports (2.11-2.15), so it is not used. The loop reads the segment
ends to the host once per grouped GEMM (a device sync on CUDA: 2 per MoE block forward, 4
in backward); the custom op's fake implementation gives the planner its output shapes.

Load balancing (Switch Transformer eq. 4-6, Mixtral; per block, then the mean over blocks):
    aux_l = E sum_e f_e P_e,  f_e = c_e / n,  P_e = (sum_t m_t p_te) / n,  n = sum_t m_t
with c_e the tokens (with mask m_t = 1) that chose expert e (sum_e f_e = K) and the sums
over *every token of the sequence*: each rank adds its tokens' c, sum m p and n into one
[blocks, 2E + 1] fp64 tensor per model call (`RouterStats`), which is summed over the
context-parallel group once, after the last block (`CausalLM.router_stats_reduce`, set by
`upipe.train.parallelize`). A balanced router gives aux = K. (Hugging Face's
`load_balancing_loss_func` pools the blocks' counts before the product instead.)

The gradient: f is a count (no gradient), so d aux_l / d (sum_t m_t p_te) = E c_e / n^2, the
same constant for every token of the sequence; each rank back-propagates it into its own
tokens' probabilities (`_BalanceGrad`, which injects it where the block's output is
back-propagated, as Megatron-LM's MoEAuxLossAutoScaler does). So the balance loss's
gradient flows through activation checkpointing and the tiled MLP -- which recompute the
block, router included, in backward and carry only the block's output -- with the counts of
the forward; and summing the ranks' gradients gives the single-process gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROUTER_WEIGHTS = ("softmax", "softmax_renorm", "topk_softmax")


@torch.library.custom_op("upipe::grouped_linear", mutates_args=())
def grouped_linear(x_MI: torch.Tensor, w_EOI: torch.Tensor, ends_E: torch.Tensor) -> torch.Tensor:
    """y[a_e:b_e] = x[a_e:b_e] @ w[e]^T for the row segments b_e = ends[e], a_e = b_{e-1}
    (a_0 = 0): expert e's linear layer on its rows. Rows past ends[-1] are not written."""
    y_MO = x_MI.new_empty(x_MI.shape[0], w_EOI.shape[1])
    start = 0
    for e, end in enumerate(ends_E.tolist()):
        if end > start:
            torch.mm(x_MI[start:end], w_EOI[e].t(), out=y_MO[start:end])
        start = end
    return y_MO


@grouped_linear.register_fake
def _grouped_linear_fake(x_MI, w_EOI, ends_E):
    return x_MI.new_empty(x_MI.shape[0], w_EOI.shape[1])


@torch.library.custom_op("upipe::grouped_linear_weight_grad", mutates_args=())
def grouped_linear_weight_grad(
    dy_MO: torch.Tensor, x_MI: torch.Tensor, ends_E: torch.Tensor
) -> torch.Tensor:
    """dw[e] = dy[a_e:b_e]^T @ x[a_e:b_e], [E, O, I] (zero for an expert without rows)."""
    E, O, I = ends_E.shape[0], dy_MO.shape[1], x_MI.shape[1]  # noqa: E741
    dw_EOI = dy_MO.new_zeros(E, O, I)
    start = 0
    for e, end in enumerate(ends_E.tolist()):
        if end > start:
            torch.mm(dy_MO[start:end].t(), x_MI[start:end], out=dw_EOI[e])
        start = end
    return dw_EOI


@grouped_linear_weight_grad.register_fake
def _weight_grad_fake(dy_MO, x_MI, ends_E):
    return dy_MO.new_empty(ends_E.shape[0], dy_MO.shape[1], x_MI.shape[1])


def _grouped_linear_setup(ctx, inputs, output):
    x_MI, w_EOI, ends_E = inputs
    ctx.save_for_backward(x_MI, w_EOI, ends_E)


def _grouped_linear_backward(ctx, dy_MO):
    """dx = grouped_linear(dy, w^T) (the same op on w's transposed view), dw per segment."""
    x_MI, w_EOI, ends_E = ctx.saved_tensors
    dy_MO = dy_MO.contiguous()
    dx = grouped_linear(dy_MO, w_EOI.transpose(1, 2), ends_E) if ctx.needs_input_grad[0] else None
    dw = grouped_linear_weight_grad(dy_MO, x_MI, ends_E) if ctx.needs_input_grad[1] else None
    return dx, dw, None


grouped_linear.register_autograd(_grouped_linear_backward, setup_context=_grouped_linear_setup)


def route(logits_NE: torch.Tensor, k: int, weights: str):
    """(p [N, E], expert ids [N, K], weights [N, K]) of the module doc's routing, p and the
    weights in fp32 (fp64 for fp64 logits)."""
    acc = torch.promote_types(logits_NE.dtype, torch.float32)
    probs_NE = torch.softmax(logits_NE.to(acc), dim=-1)
    if weights == "topk_softmax":
        top_NK, idx_NK = logits_NE.topk(k, dim=-1)
        return probs_NE, idx_NK, torch.softmax(top_NK.to(acc), dim=-1)
    w_NK, idx_NK = probs_NE.topk(k, dim=-1)
    if weights == "softmax_renorm":
        w_NK = w_NK / w_NK.sum(dim=-1, keepdim=True)
    return probs_NE, idx_NK, w_NK


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the shared expert (`shared_expert.{gate,up,down}_proj`)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """E SwiGLU experts as 3-D parameters: gate_up_proj [E, 2F, D] (gate rows first, then up),
    down_proj [E, D, F]; `forward` is the module doc's dispatch."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x_ND, idx_NK, w_NK):
        """sum_j w_nj down_e(silu(gate_e x_n) * up_e x_n), e = idx_nj. The weight scales the
        hidden activation before down_proj (linear: the same function), so that its gradient
        needs the saved [M, F] product silu * up, not the [M, D] output of down_proj (less
        for experts narrower than the model, F < D, as in Qwen3-MoE and DeepSeek)."""
        (N, K), E = idx_NK.shape, self.gate_up_proj.shape[0]
        e_M = idx_NK.reshape(-1)
        order_M = torch.argsort(e_M, stable=True)  # sorted row -> its (token, slot) pair
        ones_M = torch.ones_like(e_M)
        ends_E = torch.zeros(E, dtype=e_M.dtype, device=e_M.device).scatter_add_(0, e_M, ones_M)
        ends_E = ends_E.cumsum(0)
        x_MD = x_ND.index_select(0, order_M // K)
        gate_MF, up_MF = grouped_linear(x_MD, self.gate_up_proj, ends_E).chunk(2, dim=-1)
        w_M1 = w_NK.reshape(-1).index_select(0, order_M).to(x_ND.dtype).unsqueeze(1)
        h_MF = F.silu(gate_MF) * up_MF * w_M1
        del x_MD, gate_MF, up_MF
        y_MD = grouped_linear(h_MF, self.down_proj, ends_E)
        arange_M = torch.arange(order_M.numel(), device=order_M.device)
        rank_M = torch.empty_like(order_M).scatter_(0, order_M, arange_M)  # pair -> its row
        return y_MD.index_select(0, rank_M).view(N, K, -1).sum(1)  # in token order


class RouterStats:
    """One model call's routing sums of every MoE block (module doc): `sums` [blocks, 2E + 1]
    fp64 = (c_e, sum_t m_t p_te, n) per block. Open while the call's forward adds its
    tokens (tile by tile, if tiled); `finish` sums it over the ranks and closes it, after
    which the blocks' recomputations in backward add nothing and read the gradient.

    `weight`: d objective / d aux_l for each block l (the loss coefficient over the number
    of blocks, times the caller's scale)."""

    def __init__(self, n_blocks: int, n_experts: int, weight: float, device):
        self.E, self.weight, self.open = n_experts, weight, True
        self.sums = torch.zeros(n_blocks, 2 * n_experts + 1, dtype=torch.float64, device=device)
        self.grad_lE = self.aux_l = None

    @torch.no_grad()
    def add(self, block: int, idx_NK, probs_NE, mask_N1) -> None:
        E, K = self.E, idx_NK.shape[1]
        m_N1 = mask_N1.double()
        self.sums[block, :E].scatter_add_(0, idx_NK.reshape(-1), m_N1.expand(-1, K).reshape(-1))
        self.sums[block, E : 2 * E] += (probs_NE.double() * m_N1).sum(0)
        self.sums[block, 2 * E] += m_N1.sum()

    @torch.no_grad()
    def finish(self, reduce=None) -> torch.Tensor:
        """Sum over the ranks (`reduce`: in place, None for one process), close, and return
        the balance loss, the mean of aux_l over the blocks (fp32 0-d)."""
        if reduce is not None:
            reduce(self.sums)
        E = self.E
        c_lE, psum_lE = self.sums[:, :E], self.sums[:, E : 2 * E]
        n_l1 = self.sums[:, 2 * E :].clamp_min(1.0)  # no token with a label: aux = 0
        self.aux_l = E * (c_lE * psum_lE).sum(1) / n_l1.squeeze(1) ** 2
        self.grad_lE = self.weight * E * c_lE / n_l1**2  # d aux_l / d psum_le (fp64)
        self.open = False
        return self.aux_l.mean().float()


class _BalanceGrad(torch.autograd.Function):
    """y unchanged; backward adds the balance loss's gradient to the block's probability sum
    (module doc): d objective / d psum_e = weight E c_e / n^2, from the closed stats."""

    @staticmethod
    def forward(ctx, y_ND, psum_E, stats, block):
        ctx.stats, ctx.block, ctx.dtype = stats, block, psum_E.dtype
        return y_ND.view_as(y_ND)

    @staticmethod
    def backward(ctx, dy_ND):
        assert not ctx.stats.open, "a model call's backward ran before its forward finished"
        return dy_ND, ctx.stats.grad_lE[ctx.block].to(ctx.dtype), None, None


class MoE(nn.Module):
    """The MoE MLP of a block: `gate` (the router, [E, D]), `experts`, `shared_expert`.

    `forward(x [B, T, D], mask [B, T] or None)`; `mask`: the tokens that count in the
    balance (those with a label; None: all). `tile_tokens` (the tiled MLP, read by `Block`)
    as for the dense MLP: the router runs on each tile with its experts and is recomputed
    in backward. `stats` / `block`: the current call's `RouterStats` and this block's row
    in it, set by `CausalLM`; without stats (a module called on its own) no balance loss."""

    def __init__(self, cfg):
        super().__init__()
        D, E = cfg.hidden_size, cfg.n_experts
        self.k, self.router_weights = cfg.experts_per_token, cfg.router_weights
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = Experts(E, D, cfg.expert_ffn_dim)
        F_s = cfg.shared_expert_ffn_dim
        self.shared_expert = SwiGLU(D, F_s) if F_s else None
        self.tile_tokens: int | None = None
        self.stats: RouterStats | None = None
        self.block = 0

    def forward(self, x_BTD: torch.Tensor, mask_BT: torch.Tensor | None = None) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        probs_NE, idx_NK, w_NK = route(self.gate(x_ND), self.k, self.router_weights)
        y_ND = self.experts(x_ND, idx_NK, w_NK)
        if self.shared_expert is not None:
            y_ND = y_ND + self.shared_expert(x_ND)
        stats = self.stats
        if stats is not None:
            mask_N1 = (
                torch.ones_like(probs_NE[:, :1])
                if mask_BT is None
                else mask_BT.reshape(-1, 1).to(probs_NE.dtype)
            )
            if stats.open:
                stats.add(self.block, idx_NK, probs_NE.detach(), mask_N1)
            if stats.weight and torch.is_grad_enabled() and probs_NE.requires_grad:
                psum_E = (probs_NE * mask_N1).sum(0)
                y_ND = _BalanceGrad.apply(y_ND, psum_E, stats, self.block)
        return y_ND.view(B, T, D)
