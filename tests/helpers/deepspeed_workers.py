"""Per-rank functions for tests/distributed/test_integrations_deepspeed.py: DeepSpeed's Ulysses
modules and
upipe's drop-ins on identical inputs (module-level so spawned ranks import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from workers import make_qkv

import upipe


def _init_deepspeed():
    """deepspeed.comm on the gloo group, without the shared-memory all-reduce extension that
    it would otherwise compile on first use (minutes on 2 cores; the modules here only
    all-to-all, which goes to torch.distributed either way)."""
    import logging

    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def forget_sequence_parallel_groups():
    """Undo what ALST's `register_with_transformers` set process-wide besides transformers'
    "sdpa" entry: DeepSpeed's sequence-parallel groups, which it refuses to initialise twice
    (the test clusters' ranks serve several tests)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    parallel_state_sp._SEQUENCE_PARALLEL_GROUP = None
    parallel_state_sp._SEQUENCE_DATA_PARALLEL_GROUP = None


class LocalSDPA(torch.nn.Module):
    """The local attention both modules call: causal SDPA (GQA by `enable_gqa`) on
    `[B, S, n, d]`, or `[S, B, n, d]` when `seq_first`."""

    def __init__(self, seq_first: bool):
        super().__init__()
        self.seq_first = seq_first

    def forward(self, q, k, v):
        perm = (1, 2, 0, 3) if self.seq_first else (0, 2, 1, 3)  # -> [B, n, S, d]
        out = F.scaled_dot_product_attention(
            *(t.permute(*perm) for t in (q, k, v)),
            is_causal=True,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        return out.permute(2, 0, 1, 3) if self.seq_first else out.transpose(1, 2)


def _fwd_bwd(attn_fn, shape, to_layout, from_layout):
    """Forward+backward on this rank's shard of the drawn q/k/v/dout; (out, dq, dk, dv)
    gathered in token order as `[B, S, n, d]`, and the peak of tensors allocated inside."""
    group = dist.group.WORLD
    q, k, v, dout = make_qkv(**shape)
    leaves = [to_layout(upipe.shard_sequence(t, group=group)).requires_grad_() for t in (q, k, v)]
    with upipe.MemoryTracker() as mem:
        out = attn_fn(*leaves)
        out.backward(to_layout(upipe.shard_sequence(dout, group=group)))
    gathered = [
        upipe.unshard_sequence(from_layout(t.detach()), group=group)
        for t in (out, *(x.grad for x in leaves))
    ]
    return gathered, mem.peak_bytes


def distributed_attention(rank, world_size, shape, seq_first, heads_per_stage):
    """DeepSpeed's DistributedAttention and UPipeDistributedAttention, the same local
    attention, `[B, L, n, d]` or `[L, B, n, d]`: {name: (results, peak bytes)}."""
    from deepspeed.sequence.layer import DistributedAttention

    from upipe.integrations.deepspeed import UPipeDistributedAttention

    _init_deepspeed()
    group, gather = dist.group.WORLD, 0 if seq_first else 1
    flip = (lambda t: t.transpose(0, 1).contiguous()) if seq_first else (lambda t: t)
    local = LocalSDPA(seq_first)
    modules = {
        "deepspeed": DistributedAttention(local, group, scatter_idx=2, gather_idx=gather),
        "upipe": UPipeDistributedAttention(
            local, group, scatter_idx=2, gather_idx=gather, heads_per_stage=heads_per_stage
        ),
    }
    return {
        name: _fwd_bwd(lambda q, k, v, m=m: m(q, k, v, 1 - gather), shape, flip, flip)
        for name, m in modules.items()
    }


class _HFAttentionModule(torch.nn.Module):
    """What transformers' attention functions read from the attention module."""

    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def sp_attention_hf(rank, world_size, shape, heads_per_stage):
    """ALST's UlyssesSPAttentionHF and UPipeSPAttentionHF around transformers' sdpa
    attention function, HF's `[B, n, L, d]` q/k/v: {name: (results, peak bytes)}."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from upipe.integrations.deepspeed import UPipeSPAttentionHF

    _init_deepspeed()
    group = dist.group.WORLD
    B, S, H, G, d = (shape[k] for k in "BSHGd")
    L = S // world_size
    common = dict(
        attn=sdpa_attention_forward,
        batch_size=B,
        attn_head_count=H,
        attn_head_size=d,
        kv_head_count=G,
        num_hidden_layers=1,
        process_group=group,
        seq_length_is_variable=True,
    )
    modules = {
        "deepspeed": UlyssesSPAttentionHF(**common),
        "upipe": UPipeSPAttentionHF(**common, heads_per_stage=heads_per_stage),
    }
    module = _HFAttentionModule(H // G).train()
    positions = (torch.arange(L) + rank * L).expand(B, L)
    to_hf = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731

    def call(m):
        def fn(q, k, v):
            out, _ = m(module, q, k, v, None, position_ids=positions)
            return out.unflatten(2, (H, d)).transpose(1, 2)  # [B, H, L, d] like q

        return fn

    return {name: _fwd_bwd(call(m), shape, to_hf, to_hf) for name, m in modules.items()}


def dropin_error(rank, world_size, heads_per_stage):
    """UPipeDistributedAttention with a heads_per_stage that does not fit: the message."""
    from upipe.attention.common import forget_agreements
    from upipe.integrations.deepspeed import UPipeDistributedAttention

    forget_agreements()
    m = UPipeDistributedAttention(LocalSDPA(False), dist.group.WORLD, 2, 1, heads_per_stage=3)
    q = torch.randn(1, 8, 8, 4)
    try:
        m(q, q, q, 0)
    except ValueError as e:
        return str(e)
    return None


def registered_hf_model(rank, world_size, state):
    """tests/hf_workers' llama (sdpa) made sequence-parallel by
    `UPipeSPAttentionHF.register_with_transformers`, as ALST's users call DeepSpeed's: the
    registered module's class, this rank's logits, the loss and the parameter gradients.
    transformers' "sdpa" entry is restored afterwards (it is process-wide)."""
    from hf_workers import build_model, make_batch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from upipe.integrations.deepspeed import UPipeSPAttentionHF
    from upipe.integrations.hf import causal_lm_loss, shard_batch

    _init_deepspeed()
    group = dist.group.WORLD
    model = build_model("llama", seed=123, attn_implementation="sdpa").train()
    model.load_state_dict(state)
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        UPipeSPAttentionHF.register_with_transformers(
            model_name_or_path=model,
            core_attn_implementation="sdpa",
            sequence_parallel_size=world_size,
            micro_batch_size=2,
            seq_length_is_variable=True,
        )
        import inspect

        registered = inspect.getclosurevars(ALL_ATTENTION_FUNCTIONS["sdpa"]).nonlocals["uattn"]
        batch = shard_batch(make_batch(), group=group)
        labels = batch.pop("labels")
        logits = model(**batch).logits
        loss = causal_lm_loss(logits, labels, group=group)
        loss.backward()
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        forget_sequence_parallel_groups()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads, type(registered).__name__
