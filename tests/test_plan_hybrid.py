"""The plan of a hybrid model (Gated DeltaNet and gated attention layers: Qwen3-Next) on the
Hugging Face path: the chunk scan cut short keeps the full loop's memory byte for byte, the
simulated peak equals a real run's, fla's memory stand-in and FLOP counts, the depth
extrapolation by layer pattern, the shipped config, the refusals."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

pytest.importorskip("transformers")

from upipe.memory.tracker import MemoryTracker  # noqa: E402
from upipe.planner.sampled import sampled_loops  # noqa: E402
from upipe.torch_private import TorchDispatchMode  # noqa: E402

# a tiny Qwen3-Next: 4 layers (3 Gated DeltaNet with 4 value / 2 key heads of 32, then gated
# attention with 4 / 2 heads of 16), 4 experts (2 per token) and a shared one; D = 64. The
# DeltaNet layers' scan buffers set the peak (they grow with all S tokens of a head)
TINY_NEXT = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=64,
    intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=320, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
)  # fmt: skip


def _torch_scan():
    from transformers.models.qwen3_next import modeling_qwen3_next

    return inspect.unwrap(modeling_qwen3_next.torch_chunk_gated_delta_rule)


class _Ops(TorchDispatchMode):
    """Counts the operators run in the block."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _scan_memory(B, S, G, H, d, e, dtype, *, sampled):
    """(forward peak, kept after forward, backward peak, left after backward) in bytes of
    transformers' torch scan through `loops.chunk_scan`, with the planner's shortcut or not;
    and the operators run."""
    from upipe import loops

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, S, G, d, generator=gen, dtype=dtype) for _ in "qk")
    v = torch.randn(B, S, H, e, generator=gen, dtype=dtype)
    g, beta = -torch.rand(B, S, H, generator=gen), torch.rand(B, S, H, generator=gen).to(dtype)
    for t in (q, k, v, g, beta):
        t.requires_grad_()
    shortcut = sampled_loops() if sampled else contextlib.nullcontext()
    with shortcut, MemoryTracker() as mem, _Ops() as ops:
        o = loops.chunk_scan(_torch_scan(), q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        forward, kept = mem.peak_bytes, mem.current_bytes
        mem.peak_bytes = kept
        o[0].backward(torch.ones_like(o[0]))
        return (forward, kept, mem.peak_bytes, mem.current_bytes), ops.count


@pytest.mark.parametrize(
    "B,S,G,H,d,e,dtype",
    [
        (1, 640, 2, 4, 16, 16, torch.float32),  # 10 chunks, key heads repeated
        (2, 600, 2, 2, 8, 16, torch.bfloat16),  # padded to 10 chunks, batch 2
        (1, 1024, 1, 2, 32, 32, torch.float32),  # 16 chunks
    ],
)
def test_cut_scan_has_the_full_scans_memory(B, S, G, H, d, e, dtype):
    """transformers' torch scan run for 4 of its chunks (`upipe.planner.sampled`) holds the
    same bytes as the whole loop at its forward peak, after forward, at its backward peak and
    after backward, byte for byte (real tensors, one process), and runs as many operators at
    twice the length."""
    full, _ = _scan_memory(B, S, G, H, d, e, dtype, sampled=False)
    cut, ops = _scan_memory(B, S, G, H, d, e, dtype, sampled=True)
    assert cut == full
    assert _scan_memory(B, 2 * S, G, H, d, e, dtype, sampled=True)[1] == ops
