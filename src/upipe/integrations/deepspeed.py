"""UPipe as a drop-in for DeepSpeed-Ulysses: `UPipeDistributedAttention` takes the place of
`deepspeed.sequence.layer.DistributedAttention`, `UPipeSPAttentionHF` that of ALST's
`deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF`; the same
constructor arguments, the same call, the same local attention (the user's own kernel).

Legend: B batch, S full sequence, L = S / C local tokens, H query heads, G kv heads,
g = H / G queries per kv head, U query heads per stage (`heads_per_stage`), h = U / C query
and k kv heads per rank and stage, d head dim, C ranks of the sequence-parallel group.

DeepSpeed exchanges all H heads at once: each rank holds q, k, v and the output for all
S tokens of H / C heads, and the local attention keeps its saved tensors for all of them
until backward. Here the heads go in H / U stages: stage s exchanges its U query heads and
the kv heads they use (`stage_heads`), runs the local attention on h = U / C heads per rank,
exchanges the result back into the output, and keeps nothing: backward recomputes one
stage's exchanges and local attention at a time (activation checkpointing per stage, written
out in `_StagedUlysses` so that each stage's gradients land in place). Memory above q, k, v,
the output and their gradients then holds one stage's buffers (U / H of DeepSpeed's
exchanged tensors) instead of all; the price is the local attention's forward run twice (the
fused `upipe.ContextParallelAttention` avoids that with its own kernel, which saves the
log-sum-exp: see docs/deepspeed.md).

The exchanges are upipe's `seq_to_head` / `head_to_seq` (`upipe.comm`); under GQA each
rank is sent the kv heads of its h query heads (`index_select`; the gradients of a kv head
sent to several ranks or used by several stages are summed in fp32). The function computed
is DeepSpeed's, standard GQA: query head i uses kv head i // g.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

from upipe.attention.common import agree_across_ranks
from upipe.comm import head_to_seq, seq_to_head
from upipe.heads import contiguous_stages


def stage_heads(H: int, G: int, C: int, U: int | None) -> list[tuple[int, torch.Tensor]]:
    """Per stage: (first query head, kv heads to send, rank by rank, C * k indices) -- the
    plan `upipe.heads.contiguous_stages` (its rule: U / C dividing or divided by the H / G
    queries per kv head; ValueError otherwise), the kv heads as index tensors."""
    return [(first, torch.tensor(kv)) for first, kv in contiguous_stages(H, G, C, U)]


def staged_ulysses(q_BLHd, k_BLGd, v_BLGd, attend, *, group, heads_per_stage=None):
    """Ulysses attention in head stages, each recomputed in backward (see the module
    docstring). `attend(q_BShd, k_BSkd, v_BSkd) -> out_BShd` is the local attention on all
    S tokens of this rank's heads (deterministic: no dropout). Returns out `[B, L, H, d]`."""
    H, G, C = q_BLHd.shape[2], k_BLGd.shape[2], dist.get_world_size(group)
    stages = [(first, kv.to(k_BLGd.device)) for first, kv in stage_heads(H, G, C, heads_per_stage)]
    return _StagedUlysses.apply(q_BLHd, k_BLGd, v_BLGd, attend, group, stages)


def _stage_inputs(q_BLHd, k_BLGd, v_BLGd, first, U, kv, group):
    """A stage's q, k, v on all S tokens of this rank's heads: U query heads and the C*k kv
    heads `kv` (rank by rank) exchanged."""
    k_BLKd, v_BLKd = k_BLGd.index_select(2, kv), v_BLGd.index_select(2, kv)
    return tuple(seq_to_head(t, group) for t in (q_BLHd[:, :, first : first + U], k_BLKd, v_BLKd))


class _StagedUlysses(torch.autograd.Function):
    """Forward: the stages without autograd, each written into the output. Backward, stage
    by stage: recompute its exchanges and local attention (with autograd on the exchanged
    q, k, v), backpropagate its part of dout (exchanged like the output: `seq_to_head` is
    the adjoint of `head_to_seq`), exchange dq, dk, dv back and write dq, add dk/dv (in
    fp32: a kv head may serve several stages and ranks) into the gradients. Peak above q,
    k, v, out and their gradients: one stage."""

    @staticmethod
    def forward(ctx, q_BLHd, k_BLGd, v_BLGd, attend, group, stages):
        U = q_BLHd.shape[2] // len(stages)
        out_BLHd = q_BLHd.new_empty(q_BLHd.shape)
        for first, kv in stages:
            q_BShd, k_BSkd, v_BSkd = _stage_inputs(q_BLHd, k_BLGd, v_BLGd, first, U, kv, group)
            out_BShd = attend(q_BShd, k_BSkd, v_BSkd)
            del q_BShd, k_BSkd, v_BSkd
            out_BLHd[:, :, first : first + U] = head_to_seq(out_BShd, group)
            del out_BShd
        ctx.save_for_backward(q_BLHd, k_BLGd, v_BLGd)
        ctx.attend, ctx.group, ctx.stages, ctx.U = attend, group, stages, U
        return out_BLHd

    @staticmethod
    def backward(ctx, dout_BLHd):
        q_BLHd, k_BLGd, v_BLGd = ctx.saved_tensors
        U, group = ctx.U, ctx.group
        dq_BLHd = torch.empty_like(q_BLHd)
        dk_BLGd, dv_BLGd = (torch.zeros_like(t, dtype=torch.float32) for t in (k_BLGd, v_BLGd))
        for first, kv in ctx.stages:
            inputs = _stage_inputs(q_BLHd, k_BLGd, v_BLGd, first, U, kv, group)
            q_BShd, k_BSkd, v_BSkd = (t.detach().requires_grad_() for t in inputs)
            del inputs
            dout_BShd = seq_to_head(dout_BLHd[:, :, first : first + U], group)
            with torch.enable_grad():
                torch.autograd.backward(ctx.attend(q_BShd, k_BSkd, v_BSkd), dout_BShd)
            del dout_BShd
            dq_BLHd[:, :, first : first + U] = head_to_seq(q_BShd.grad, group)
            dk_BLGd.index_add_(2, kv, head_to_seq(k_BSkd.grad, group).float())
            dv_BLGd.index_add_(2, kv, head_to_seq(v_BSkd.grad, group).float())
            del q_BShd, k_BSkd, v_BSkd
        return dq_BLHd, dk_BLGd.to(k_BLGd.dtype), dv_BLGd.to(v_BLGd.dtype), None, None, None


def _agree(group, q, k, v, heads_per_stage):
    """The same ValueError on every rank, before any exchange, for shapes that do not fit."""

    def local():
        if (
            q.dim() != 4
            or k.shape != v.shape
            or q.shape[:2] != k.shape[:2]
            or q.shape[3] != k.shape[3]
        ):
            raise ValueError(
                f"query {tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}: "
                "expected [batch, local tokens, heads, head dim] with the same batch, tokens "
                "and head dim, and key shaped like value"
            )
        stage_heads(q.shape[2], k.shape[2], dist.get_world_size(group), heads_per_stage)

    signature = lambda: {"q": tuple(q.shape), "k": tuple(k.shape), "U": heads_per_stage}  # noqa: E731
    agree_across_ranks(group, local, signature)


class UPipeDistributedAttention(torch.nn.Module):
    """A drop-in for DeepSpeed's `DistributedAttention(local_attention, group, scatter_idx,
    gather_idx)`: `forward(query, key, value, batch_dim_idx, *args, **kwargs)` on this
    rank's tokens, `[B, L, n, d]` (scatter_idx=2, gather_idx=1, batch_dim_idx=0) or
    `[L, B, n, d]` (scatter_idx=2, gather_idx=0, batch_dim_idx=1), calling
    `local_attention(q, k, v, *args, **kwargs)` in the same layout with all S tokens and
    this rank's heads of each stage. `heads_per_stage`: U (default: the group size C).
    """

    def __init__(
        self,
        local_attention,
        sequence_process_group,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream=None,
        num_kv_heads: int | None = None,
        *,
        heads_per_stage: int | None = None,
    ):
        super().__init__()
        if scatter_idx != 2 or gather_idx not in (0, 1):
            raise ValueError(
                f"scatter_idx={scatter_idx}, gather_idx={gather_idx}: supported are the head "
                "dim 2 scattered and the sequence dim (0 or 1) gathered"
            )
        if sp_stream is not None:
            raise ValueError("sp_stream (a CUDA stream to overlap the exchanges) is not used")
        self.local_attn, self.spg = local_attention, sequence_process_group
        self.gather_idx, self.num_kv_heads = gather_idx, num_kv_heads
        self.heads_per_stage = heads_per_stage

    def forward(self, query, key, value, batch_dim_idx: int, rotary_pos_emb=None, *args, **kwargs):
        if batch_dim_idx != 1 - self.gather_idx or rotary_pos_emb is not None:
            raise ValueError(
                f"batch_dim_idx must be {1 - self.gather_idx} (the sequence dim is "
                f"{self.gather_idx}) and rotary_pos_emb None (apply RoPE before the call), got "
                f"{batch_dim_idx} and {type(rotary_pos_emb).__name__}"
            )
        if self.num_kv_heads not in (None, key.shape[2]):
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) != key heads {key.shape[2]}")
        seq_first = self.gather_idx == 0
        flip = (lambda t: t.transpose(0, 1)) if seq_first else (lambda t: t)  # noqa: E731
        q_BLHd, k_BLGd, v_BLGd = flip(query), flip(key), flip(value)
        _agree(self.spg, q_BLHd, k_BLGd, v_BLGd, self.heads_per_stage)

        def attend(q_BShd, k_BSkd, v_BSkd):
            return flip(self.local_attn(flip(q_BShd), flip(k_BSkd), flip(v_BSkd), *args, **kwargs))

        out_BLHd = staged_ulysses(
            q_BLHd, k_BLGd, v_BLGd, attend, group=self.spg, heads_per_stage=self.heads_per_stage
        )
        return flip(out_BLHd)


class UPipeSPAttentionHF(UlyssesSPAttentionHF):
    """A drop-in for ALST's `UlyssesSPAttentionHF`: the same constructor (plus
    `heads_per_stage`) and `register_with_transformers`; called by transformers as its
    attention function on `[B, n, L, d]` q/k/v, it calls the core attention `attn` (sdpa,
    flash-attention, ...) on each stage's heads and returns `(out [B, L, H*d], None)`."""

    def __init__(self, *args, heads_per_stage: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.heads_per_stage = heads_per_stage

    def forward(self, module, query, key, value, attention_mask, *args, **kwargs):
        if not module.training and self.disable_in_eval:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        if attention_mask is not None:
            raise ValueError(
                "attention_mask: ALST's wrapper drops masks (causality comes from the core "
                "attention, documents from position_ids); register with register_with_transformers"
            )
        if "position_ids" not in kwargs:
            raise ValueError("position_ids are required (the core attention reads the full ones)")
        positions = [torch.empty_like(kwargs["position_ids"]) for _ in range(self.world_size)]
        dist.all_gather(positions, kwargs["position_ids"].contiguous(), group=self.process_group)
        kwargs["position_ids"] = torch.cat(positions, dim=1)  # what the core attention sees
        q_BLHd, k_BLGd, v_BLGd = (t.transpose(1, 2) for t in (query, key, value))
        _agree(self.process_group, q_BLHd, k_BLGd, v_BLGd, self.heads_per_stage)

        def attend(q_BShd, k_BSkd, v_BSkd):
            with _kv_groups(module, q_BShd.shape[2] // k_BSkd.shape[2]):
                out_BShd, _ = self.attn(
                    module, *(t.transpose(1, 2) for t in (q_BShd, k_BSkd, v_BSkd)), None,
                    *args, **kwargs,
                )  # fmt: skip
            return out_BShd

        out_BLHd = staged_ulysses(
            q_BLHd, k_BLGd, v_BLGd, attend, group=self.process_group,
            heads_per_stage=self.heads_per_stage,
        )  # fmt: skip
        return out_BLHd.flatten(2), None

    @classmethod
    def register_with_transformers(cls, *args, heads_per_stage: int | None = None, **kwargs):
        """`UlyssesSPAttentionHF.register_with_transformers` (same arguments, same return),
        then the module it registered becomes a `UPipeSPAttentionHF`: DeepSpeed builds its
        own class by name there, and the subclass adds only `heads_per_stage` and `forward`."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        mpu = super().register_with_transformers(*args, **kwargs)
        if mpu is not None:
            bound = inspect.signature(UlyssesSPAttentionHF.register_with_transformers).bind(
                *args, **kwargs
            )
            wrapper = ALL_ATTENTION_FUNCTIONS[bound.arguments["core_attn_implementation"]]
            module = inspect.getclosurevars(wrapper).nonlocals["uattn"]
            module.__class__ = cls
            module.heads_per_stage = heads_per_stage
        return mpu


@contextlib.contextmanager
def _kv_groups(module, groups: int):
    """`module.num_key_value_groups` (which transformers' attention functions read to repeat
    kv heads) set to this stage's query heads per kv head for the call."""
    saved = module.num_key_value_groups
    module.num_key_value_groups = groups
    try:
        yield
    finally:
        module.num_key_value_groups = saved


__all__ = ["UPipeDistributedAttention", "UPipeSPAttentionHF", "stage_heads", "staged_ulysses"]
