"""The Gated DeltaNet layer (the linear attention of Qwen3-Next and Qwen3.5) over a sequence
split across ranks, by heads: Ulysses, and UPipe's stages (deltanet_staged.py).

Legend: B batch, S full sequence, L = S / C local tokens, N = B * L, D model width, H value
heads, G key heads (value head i reads key head i // (H / G)), d key head dim, e value head
dim, K conv taps, C group size, n heads of a stage (all ranks'), W packed width.

The layer, per token (transformers' `Qwen3NextGatedDeltaNet` / `Qwen3_5GatedDeltaNet`):

    q, k = x W_q^T, x W_k^T (G heads of d)   v, z = x W_v^T, x W_z^T (H heads of e)
    b, a = x W_b^T, x W_a^T (one per value head)
    q, k, v = SiLU(causal depthwise conv of each channel over the sequence, K taps)
    beta = sigmoid(b),   g = -exp(A_log) softplus(a + dt_bias)                  (fp32)
    o = gated delta rule(q, k, v, g, beta)                        (`upipe.kernels_deltanet`)
    y = (RMSNorm_e(o) * w_norm * SiLU(z)) W_out^T

Everything between the projections and the gated norm is independent per head and needs
the whole sequence, so it runs after one all-to-all to the head layout, exactly:

    x_ND --(rows of every rank's heads, rank-major)--> packed_BLW   (one GEMM)
    packed_BLW --seq->head (one all-to-all)--> [q | k | v | b | a] of my heads, all S tokens
    conv, gates, scan on my heads                               --> o_BShe
    o_BShe --head->seq--> o_BLne;   y = gated norm(o, x W_z^T) W_out^T

Rank c's block of the packed projection holds q, k rows of its key heads and v, b, a rows
of its value heads, so all of a rank's inputs travel in one exchange (widths may differ per
rank: an uneven split); z stays in the sequence layout, where the norm and the gate are
applied (a per-token product: sending z would double the exchange for nothing).

Heads: the schedule of upipe's attention (`upipe.heads.plan_schedule`) with
the value heads as its query heads and the key heads as its kv heads: key heads go with
their value heads (replicated where G < C, shared by neighbouring ranks on an uneven split,
their gradients summed), each rank's heads of a stage are one contiguous range. Ulysses is
the schedule's one stage of all heads; UPipe (`heads_per_stage`) runs U value heads at a
time (`deltanet_staged`). Parameter gradients are this rank's share (sum them over ranks).

Weights (`DeltaNetWeights`) are the model's own parameters seen per head, heads first:
views, except where a model interleaves heads that a stage separates (Qwen3-Next's
in_proj_qkvz groups q, k, v, z per key head), where a stage's rows are copied out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from upipe.attention.common import DocumentsArg, agree_across_ranks, check_group
from upipe.attention.deltanet_layer import (
    DeltaNetPlan,
    DeltaNetWeights,
    plan_steps,
    ulysses_deltanet,
)
from upipe.attention.deltanet_staged import staged_deltanet
from upipe.comm import HeadExchange
from upipe.heads import check_heads_per_stage, few_heads_problem, kv_problem
from upipe.kernels_deltanet import Scan, resolve_scan_backend


def all_heads(H: int, C: int) -> int:
    """U of one stage of every head (Ulysses): C * ceil(H / C)."""
    return C * -(-H // C)


STAGE_INPUTS = ("recompute", "keep")
"""What UPipe's stages do with their inputs for backward (`gated_deltanet`)."""

WORDS = dict(query="value heads", kv="key heads")
"""The attention's head rules (`upipe.heads`) hold for value heads over key heads."""


def heads_problem(H: int, G: int, C: int) -> str | None:
    """Why H value heads over G key heads cannot be split over C ranks, or None."""
    return kv_problem(H, G, **WORDS) or few_heads_problem(H, C, query="value heads", whole=None)


def check_stages(H: int, G: int, C: int, heads_per_stage, name="heads_per_stage") -> int:
    """`heads_per_stage` (None: C) checked for these heads (the schedule's rules, value heads
    for query heads and key heads for kv heads), as a ValueError naming the layer and the
    keyword `name` it came from."""
    problem = heads_problem(H, G, C)
    if problem is None:
        try:
            return check_heads_per_stage(H, G, C, heads_per_stage, name=name, **WORDS)
        except ValueError as e:
            problem = str(e)
    raise ValueError(f"Gated DeltaNet ({H} value heads, {G} key heads): {problem}")


@torch.compiler.disable  # a clean graph break: see upipe.attention
def gated_deltanet(
    x,
    weights: DeltaNetWeights,
    *,
    group,
    reference=None,
    strategy="upipe",
    heads_per_stage=None,
    cu_seqlens=None,
    backend=None,
    eps=1e-6,
    stage_inputs="recompute",
):
    """The Gated DeltaNet layer (module doc) on this rank's tokens x `[B, L, D]` (contiguous
    layout: rank r holds tokens r*L .. (r+1)*L-1): y `[B, L, D]`, differentiable w.r.t. x and
    the weights.

    `strategy`: "ulysses" (all heads at once, autograd; peak with every head's scan buffers)
    or "upipe" (`heads_per_stage` U value heads at a time, recomputed in backward:
    `upipe.attention.deltanet_staged`). `reference`: the model's torch implementation of
    the chunked rule (transformers' `torch_chunk_gated_delta_rule`), for `backend` "torch"
    (`upipe.kernels_deltanet.SCAN_BACKENDS`; None: "fla" on CUDA where installed, else
    "upipe", upipe's own). `cu_seqlens`: document
    boundaries `[0, e_1, ..., S]` of the full sequence (the state and the convolution
    restart at each). `eps`: the gated norm's. `stage_inputs` (UPipe): "recompute" (only x
    and the weights kept for backward) or "keep" (each stage's exchanged inputs and z kept
    too: no projection or exchange in backward, more memory; `deltanet_staged`). Checked on
    every rank before any collective.
    """
    C = check_group(group)
    docs = DocumentsArg(cu_seqlens)
    H, G, d, e = weights.heads
    found = {}

    def local():
        if strategy not in ("ulysses", "upipe"):
            raise ValueError(f"strategy must be 'ulysses' or 'upipe', got {strategy!r}")
        if stage_inputs not in STAGE_INPUTS:
            raise ValueError(f"stage_inputs must be one of {STAGE_INPUTS}, got {stage_inputs!r}")
        U = all_heads(H, C) if strategy == "ulysses" else heads_per_stage
        found["U"] = check_stages(H, G, C, U)
        D = weights.q.shape[-1]
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != D:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be [batch, local_seq, {D}], got {got}")
        if x.dtype != weights.q.dtype:
            raise ValueError(f"x has dtype {x.dtype} but the weights have {weights.q.dtype}")
        docs.check(C * x.shape[1])
        found["backend"] = resolve_scan_backend(backend, x.device)
        if found["backend"] == "torch" and reference is None:
            raise ValueError(
                "the 'torch' scan needs reference= (transformers' torch_chunk_gated_delta_rule)"
            )

    def signature():
        return {"x shape": tuple(x.shape), "dtype": str(x.dtype), "U": found["U"],
                "backend": found["backend"], "stage_inputs": stage_inputs,
                **docs.signature()}  # fmt: skip

    agree_across_ranks(group, local, signature)
    rank = dist.get_rank(group)
    plan = DeltaNetPlan(
        steps=plan_steps(H, G, C, found["U"], rank),
        ex=HeadExchange(group, "contiguous"),
        rank=rank,
        eps=eps,
        scan=Scan(found["backend"], reference, docs.bounds),
    )
    if strategy == "ulysses":
        return ulysses_deltanet(x, weights, plan)
    return staged_deltanet(x, weights, plan, stage_inputs)


__all__ = [
    "STAGE_INPUTS",
    "DeltaNetWeights",
    "all_heads",
    "check_stages",
    "gated_deltanet",
    "heads_problem",
]
