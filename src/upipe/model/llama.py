"""A Llama-3 / Qwen3-style decoder: RMSNorm, RoPE, SwiGLU MLP, GQA, optional QK-norm; with
`n_experts` a mixture-of-experts MLP in every block (`upipe.model.moe`, as Qwen3-MoE).

Legend: B batch, L tokens this process holds, D width, H query heads, G kv heads, d head
dim, F MLP width, V vocabulary.

Parameter names follow Hugging Face (`model.embed_tokens`, `model.layers.N.self_attn.q_proj`,
`...mlp.gate_proj`, `model.norm`, `lm_head`), so checkpoints map by name. The model knows
nothing about parallelism: every block's `self_attn` is a plain single-process `Attention`
until `upipe.train.parallelize` swaps in a `ContextParallelAttention` holding the same
parameters. Inputs are token ids with their *global* positions, so the same code runs on a
whole sequence or on one rank's shard of it.

Memory features (settable attributes, off by default, none changes the math):
`CausalLM.recompute_blocks` (blocks per checkpoint; + `offload`, an
`upipe.model.offload.Offloader`, and `attention_outputs`), `MLP.tile_tokens`,
`CausalLM.loss_chunk_tokens`.

MoE: each call of the model collects its routing sums in one `moe.RouterStats` (tile by
tile, with the tiled MLP), sums them over the ranks holding the other tokens of the
sequence (`CausalLM.router_stats_reduce`) after the last block, and back-propagates the
load-balancing loss from there (`CausalLM.aux_loss_scale`, `CausalLM.router_aux_loss`).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from upipe.loss import IGNORE_INDEX, cross_entropy_sum
from upipe.model.config import ModelConfig
from upipe.model.features import activation_checkpoint, tiled_recompute
from upipe.model.moe import MoE, RouterStats
from upipe.model.offload import Offloader
from upipe.packing import check_cu_seqlens
from upipe.rope import apply_rope, rope_cos_sin


class Attention(nn.Module):
    """Causal GQA self-attention over the whole sequence in this process (no parallelism).

    `window` (the layer's sliding window, `ModelConfig.layer_window`): query tiles of
    `window` rows, each one SDPA call over its keys i-window+1 .. i with a [tile, tile +
    window - 1] boolean mask -- O(L * window) work and a mask the size of one tile, not L^2
    (the context-parallel strategies tile without masks: `upipe.attention.window`)."""

    def __init__(self, cfg: ModelConfig, window: int | None = None):
        super().__init__()
        D, H, G, d = cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = H, G, d
        self.window = window
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        self.q_proj = nn.Linear(D, H * d, bias=False)
        self.k_proj = nn.Linear(D, G * d, bias=False)
        self.v_proj = nn.Linear(D, G * d, bias=False)
        self.o_proj = nn.Linear(H * d, D, bias=False)
        self.norm_eps = cfg.norm_eps
        self.q_norm = nn.RMSNorm(d, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(d, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self, x_BLD: torch.Tensor, position_ids_BL: torch.Tensor, cu_seqlens=None
    ) -> torch.Tensor:
        """`cu_seqlens`: document boundaries `[0, e_1, ..., L]` (1-D integer tensor or ints,
        shared by the batch rows): causal attention within each document only, one kernel
        call per document on its rows (no L x L mask). None: one document."""
        B, L, _ = x_BLD.shape
        d = self.head_dim
        cos, sin = rope_cos_sin(
            position_ids_BL, d, theta=self.rope_theta, scaling=self.rope_scaling, dtype=x_BLD.dtype
        )
        q_BLHd = self.q_proj(x_BLD).view(B, L, -1, d)
        k_BLGd = self.k_proj(x_BLD).view(B, L, -1, d)
        if self.q_norm is not None:
            q_BLHd, k_BLGd = self.q_norm(q_BLHd), self.k_norm(k_BLGd)
        q_BLHd, k_BLGd = apply_rope(q_BLHd, cos, sin), apply_rope(k_BLGd, cos, sin)
        v_BLGd = self.v_proj(x_BLD).view(B, L, -1, d)
        q_BHLd, k_BGLd, v_BGLd = (t.transpose(1, 2) for t in (q_BLHd, k_BLGd, v_BLGd))
        bounds = (0, L) if cu_seqlens is None else check_cu_seqlens(cu_seqlens, L)
        parts = [  # one causal call per document (or its window tiles): its rows and keys only
            part
            for a, b in itertools.pairwise(bounds)
            for part in self._document(*(t[:, :, a:b] for t in (q_BHLd, k_BGLd, v_BGLd)))
        ]
        out_BHLd = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        return self.o_proj(out_BHLd.transpose(1, 2).flatten(2))

    def _document(self, q_BHTd, k_BGTd, v_BGTd) -> list[torch.Tensor]:
        """One document's outputs, in row order: one causal call, or the window's tiles
        (class doc): rows a .. a+w-1 over keys a-w+1 .. a+w-1, key j visible to row i iff
        0 <= i - j < w."""
        T, w = q_BHTd.shape[2], self.window
        if w is None or w >= T:
            return [
                F.scaled_dot_product_attention(
                    q_BHTd, k_BGTd, v_BGTd, is_causal=True, enable_gqa=True
                )
            ]
        i = torch.arange(w, device=q_BHTd.device)[:, None]  # row offset in the tile
        j = torch.arange(2 * w - 1, device=q_BHTd.device)[None]  # key offset from a - w + 1
        band_tk = (j <= i + w - 1) & (j >= i)  # (a + i) - (a - w + 1 + j) in [0, w)
        parts = []
        for a in range(0, T, w):
            lo, rows = max(0, a - w + 1), min(w, T - a)
            mask = band_tk[:rows, lo - (a - w + 1) : w - 1 + rows]
            kv = (t[:, :, lo : a + rows] for t in (k_BGTd, v_BGTd))
            parts.append(
                F.scaled_dot_product_attention(
                    q_BHTd[:, :, a : a + rows], *kv, attn_mask=mask, enable_gqa=True
                )
            )
        return parts


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). `tile_tokens` (set: the tiled MLP feature) is read
    by `Block`, which then runs the norm, this MLP and the residual add in sequence tiles,
    recomputed in backward (the [B, L, F] intermediates never exist)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.hidden_size, bias=False)
        self.tile_tokens: int | None = None

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_BLD)) * self.up_proj(x_BLD))


class Block(nn.Module):
    """h = x + attn(norm(x)), then h + mlp(norm(h)) (pre-norm residual block).

    With the tiled MLP (`mlp.tile_tokens`) the second half, norm included, runs in sequence
    tiles (`features.tiled_recompute(..., residual=True)`): only h is saved for it (not
    also norm(h)), and its backward writes dh = dy + J^T dy into dy, so a block's backward
    holds one [B, L, D] gradient where plain autograd holds two (dy, kept by the engine
    until the block's node returns, and the sum)."""

    def __init__(self, cfg: ModelConfig, window: int | None = None):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg, window)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

    def forward(
        self,
        x_BLD: torch.Tensor,
        position_ids_BL: torch.Tensor,
        cu_seqlens=None,
        router_mask_BL: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`router_mask_BL` (MoE only): the tokens that count in the router's balance."""
        # cu_seqlens only when given: an attention module swapped in needs not know it
        kw = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        h_BLD = x_BLD + self.self_attn(self.input_layernorm(x_BLD), position_ids_BL, **kw)
        rows = (router_mask_BL,) if isinstance(self.mlp, MoE) else ()
        if self.mlp.tile_tokens is None:
            return h_BLD + self._mlp_rows(h_BLD, *rows)
        return tiled_recompute(
            self._mlp_rows, h_BLD, self.mlp.tile_tokens, residual=True, token_args=rows
        )

    def _mlp_rows(self, h_BTD: torch.Tensor, *rows) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(h_BTD), *rows)


class Decoder(nn.Module):
    """Embedding, blocks and final norm (Hugging Face's `model.` prefix)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, cfg.layer_window(i)) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        if cfg.n_experts:
            for i, block in enumerate(self.layers):  # each MoE block's row in RouterStats
                block.mlp.block = i


class CausalLM(nn.Module):
    """`forward(input_ids, position_ids, labels=None)`: the logits [B, L, V] without labels;
    with labels, the *sum* of the next-token losses over valid labels (fp32 scalar; divide by
    the global count of valid labels, see `upipe.loss.global_token_mean`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.recompute_blocks: int = 0
        """Activation checkpointing: 0 (or False) off; m (True = 1) checkpoints of m
        consecutive blocks each, only their inputs saved (`features.activation_checkpoint`)."""
        self.offload: Offloader | None = None
        """Keeps the inputs of the first `offload.n_inputs` checkpoints in host memory (the
        others stay on the device)."""
        self.attention_outputs: str = "recompute"
        """With checkpointing: "keep" (or "offload": beside the offloaded inputs) reuses each
        attention layer's forward outputs in its recomputation, which then runs no attention
        kernel (`features.activation_checkpoint`); "recompute" calls it again."""
        self.loss_chunk_tokens: int | None = None
        self.router_stats_reduce = None
        """MoE: a function summing a tensor in place over the processes that hold the other
        tokens of the same sequences (the context-parallel group; set by
        `upipe.train.parallelize`), so that the balance is that of whole sequences; None:
        this process holds whole sequences."""
        self.aux_loss_scale: float = 1.0
        """MoE: the factor of this call's balance loss in the objective being
        back-propagated: its gradient is that of `aux_loss_scale * router_aux_loss_coef *
        router_aux_loss` (the trainer sets 1 / the model calls of an optimizer step on all
        data-parallel ranks: the objective's balance term is the mean over its calls)."""
        self.router_aux_loss: torch.Tensor | None = None
        """MoE: the balance loss of the last call (module `moe`: the mean over the blocks
        of E sum_e f_e P_e, over the whole sequence; fp32 0-d, no gradient), the same on
        every rank of the sequence; None for a dense model."""

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init from `seed` alone (same weights on every process and device):
        normal(0, 0.02) matrices and embeddings, ones for norms, in parameter-name order.
        Sharded parameters (DTensors: FSDP2 on the meta device, then `to_empty`) get their
        shard of the same values: each full matrix is drawn on the host, one at a time, and
        every rank keeps its own part (no communication)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
                continue
            full = torch.empty(p.shape, dtype=torch.float32, device="cpu")
            full = full.normal_(0.0, 0.02, generator=gen).to(p.dtype)
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(full)

    def hidden(
        self,
        input_ids_BL: torch.Tensor,
        position_ids_BL: torch.Tensor,
        *,
        cu_seqlens=None,
        final_norm: bool = True,
        router_mask_BL: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last block's output, through the final norm unless `final_norm` is False.
        `router_mask_BL` (MoE): the tokens that count in the balance loss (None: all)."""
        norm = self.model.norm if final_norm else torch.nn.Identity()
        if isinstance(cu_seqlens, torch.Tensor):  # read once here, not once per layer
            cu_seqlens = tuple(cu_seqlens.tolist()) if cu_seqlens.dim() == 1 else cu_seqlens
        h_BLD = self.model.embed_tokens(input_ids_BL)
        args = (position_ids_BL, cu_seqlens)
        if self.config.n_experts:
            args += (router_mask_BL,)
            stats = self._start_router_stats(h_BLD.device)
        h_BLD = self._blocks(h_BLD, args)
        if self.config.n_experts:
            self.router_aux_loss = stats.finish(self.router_stats_reduce)
        return norm(h_BLD)

    def _start_router_stats(self, device) -> RouterStats:
        """A fresh `RouterStats` for this call, handed to every MoE block."""
        cfg = self.config
        weight = cfg.router_aux_loss_coef * self.aux_loss_scale / cfg.n_layers
        stats = RouterStats(cfg.n_layers, cfg.n_experts, weight, device)
        for block in self.model.layers:
            block.mlp.stats = stats
        return stats

    def _blocks(self, h_BLD: torch.Tensor, args: tuple) -> torch.Tensor:
        if not self.recompute_blocks:
            for block in self.model.layers:
                h_BLD = block(h_BLD, *args)
            return h_BLD
        m, blocks = int(self.recompute_blocks), list(self.model.layers)
        for j, start in enumerate(range(0, len(blocks), m)):  # checkpoint j: m blocks
            offload = (
                self.offload if self.offload is not None and j < self.offload.n_inputs else None
            )
            h_BLD = activation_checkpoint(
                blocks[start : start + m],
                h_BLD,
                *args,
                offload=offload,
                index=j,
                attention_outputs=self.attention_outputs,
            )
        return h_BLD

    def forward(self, input_ids_BL, position_ids_BL, labels_BL=None, *, cu_seqlens=None):
        """`cu_seqlens`: document boundaries `[0, e_1, ..., S]` of the full (unsharded)
        sequence, the same for every batch row: attention stays within each document (pass
        position ids restarting per document, `upipe.packing.document_positions`). A CUDA
        tensor is read to the host once per call (one sync); a CPU tensor or ints: none."""
        if labels_BL is None:
            return self.lm_head(self.hidden(input_ids_BL, position_ids_BL, cu_seqlens=cu_seqlens))
        # MoE: the router's balance counts the tokens the loss counts (not the padding)
        kw = dict(cu_seqlens=cu_seqlens)
        if self.config.n_experts:
            kw["router_mask_BL"] = labels_BL != IGNORE_INDEX
        if self.loss_chunk_tokens is None:
            h_BLD = self.hidden(input_ids_BL, position_ids_BL, **kw)
            return cross_entropy_sum(h_BLD, self.lm_head.weight, labels_BL)
        # chunked: the final norm runs inside the loss's chunks (no normalised [B, L, D])
        h_BLD = self.hidden(input_ids_BL, position_ids_BL, final_norm=False, **kw)
        return cross_entropy_sum(
            h_BLD,
            self.lm_head.weight,
            labels_BL,
            chunk_tokens=self.loss_chunk_tokens,
            norm=self.model.norm,
        )
