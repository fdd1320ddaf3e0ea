"""Per-rank functions for tests/distributed/test_deltanet.py: one Gated DeltaNet layer of
transformers
(Qwen3-Next's or Qwen3.5's) against the same layer run by upipe on a split sequence."""

from __future__ import annotations

import importlib
import itertools
import sys
import types

import torch
import torch.distributed as dist

from upipe.comm import shard_sequence

D = 64
# 4 value heads over 2 key heads of 8, 4 conv taps; the layer's own config keys
LAYER = dict(
    hidden_size=D,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    num_hidden_layers=1,
    layer_types=["linear_attention"],
    vocab_size=16,
)
KINDS = {"next": "Qwen3NextConfig", "3.5": "Qwen3_5TextConfig"}
SEQ, BATCH = 128, 2  # two chunks of the scan (64 tokens)


def hf_layer(kind, **heads):
    """A transformers Gated DeltaNet layer, random, its A = exp(A_log) in (0.01, 0.2) (slow
    decays: the state carries across shards) and norm weight and dt_bias off their init."""
    import transformers

    config = getattr(transformers, KINDS[kind])(**{**LAYER, **heads})
    module = importlib.import_module(
        "transformers.models." + ("qwen3_next.modeling_qwen3_next" if kind == "next" else
                                  "qwen3_5.modeling_qwen3_5")
    )  # fmt: skip
    cls = module.Qwen3NextGatedDeltaNet if kind == "next" else module.Qwen3_5GatedDeltaNet
    torch.manual_seed(0)
    layer = cls(config, layer_idx=0).float()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(0.01, 0.2, generator=gen).log())
            elif name in ("dt_bias", "norm.weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.mul_(3.0)  # the init's 0.02 std gives near-zero projections
    return layer


def inputs():
    gen = torch.Generator().manual_seed(2)
    return torch.randn(BATCH, SEQ, D, generator=gen), torch.randn(BATCH, SEQ, D, generator=gen)


def reference(kind, docs=None, dtype=torch.float32, **heads):
    """The unconverted layer on the whole sequence (or on each document alone), in `dtype`:
    y, dx and the parameter gradients for `inputs()`."""
    layer = hf_layer(kind, **heads).to(dtype)
    x, dy = (t.to(dtype) for t in inputs())
    x.requires_grad_()
    pieces = [(0, SEQ)] if docs is None else list(itertools.pairwise(docs))
    y = torch.cat([layer(x[:, a:b]) for a, b in pieces], dim=1)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def run_layer(rank, world_size, cases):
    """Each case (kind, strategy, heads_per_stage, docs, heads, backend, dtype) through
    upipe's layer on this rank's block of `inputs()`: (y, dx, parameter gradients summed over
    the ranks, the line of the layer's repr that names its strategy). A strategy
    "upipe+keep" is UPipe with stage_inputs="keep"."""
    from upipe.integrations.hf_deltanet import HFContextParallelDeltaNet

    group = dist.group.WORLD
    found = []
    for kind, spec, U, docs, heads, backend, dtype in cases:
        strategy, _, keep = spec.partition("+")
        module = HFContextParallelDeltaNet(
            hf_layer(kind, **heads).to(dtype), group=group, strategy=strategy,
            heads_per_stage=U, state={"docs": docs}, stage_inputs=keep or "recompute",
        )  # fmt: skip
        module.scan_backend = backend
        x, dy = (shard_sequence(t.to(dtype), group=group) for t in inputs())
        x.requires_grad_()
        y = module(x)
        y.backward(dy)
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g, group=group)
        found.append((y.detach(), x.grad, grads, repr(module).splitlines()[1]))
    return found


# -- a stand-in for flash-linear-attention, with the contract of its chunk_gated_delta_rule --


def fla_stand_in(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):  # fmt: skip
    """fla.ops.gated_delta_rule.chunk_gated_delta_rule's contract (fla-org/flash-linear-
    attention, fla/ops/gated_delta_rule/chunk.py at 92396f2): q, k, v [B, T, H, K|V] with one
    head count; g, beta [B, T, H]; cu_seqlens (int64, [N + 1], q's device) only with B = 1;
    scale None: K ** -0.5; returns (o in q's dtype, final state or None). Computed here by the
    token-by-token recurrence in float64 (differentiable), restarting at each sequence of
    cu_seqlens."""
    B, T, H, K = q.shape
    assert k.shape == q.shape and v.shape[:3] == (B, T, H), "one head count for q, k, v"
    assert g.shape == beta.shape == (B, T, H)
    assert initial_state is None and not output_final_state and not kwargs
    if cu_seqlens is not None:
        assert B == 1, "fla: the batch size is expected to be 1 with cu_seqlens"
        assert cu_seqlens.dtype == torch.int64 and cu_seqlens.device == q.device
        bounds = cu_seqlens.tolist()
    else:
        bounds = [0, T]
    scale = K**-0.5 if scale is None else scale
    q64, k64, v64, g64, b64 = (t.double() for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q64, k64 = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q64, k64))
    outs = []
    for a, e in itertools.pairwise(bounds):
        state = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64)
        for t in range(a, e):
            state = state * g64[:, t].exp()[..., None, None]
            kt, vt = k64[:, t], v64[:, t]
            delta = (vt - (state * kt[..., None]).sum(-2)) * b64[:, t, :, None]
            state = state + kt[..., None] * delta[..., None, :]
            outs.append((state * (q64[:, t] * scale)[..., None]).sum(-2))
    return torch.stack(outs, dim=1).to(q.dtype), None


def install_fla_stand_in():
    """Register `fla.ops.gated_delta_rule` with the stand-in in this process."""
    if "fla" in sys.modules:
        return
    for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module
    sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = fla_stand_in


def run_layer_fla(rank, world_size, cases):
    """`run_layer` with the scan through fla's contract (the stand-in)."""
    install_fla_stand_in()
    return run_layer(rank, world_size, cases)


def op_errors(rank, world_size, cases):
    """Each bad call of `upipe.attention.gated_deltanet` -> its ValueError message on this
    rank (None if it did not raise)."""
    from upipe.attention.common import forget_agreements
    from upipe.attention.deltanet import gated_deltanet
    from upipe.integrations.hf_deltanet import HFContextParallelDeltaNet

    group = dist.group.WORLD
    module = HFContextParallelDeltaNet(
        hf_layer("3.5"), group=group, strategy="upipe", heads_per_stage=None, state={}
    )
    x = shard_sequence(inputs()[0], group=group)
    found = {}
    for name in cases:
        forget_agreements()
        kw = dict(group=group, reference=module.reference)
        arg = x
        if name == "width":
            arg = x[..., :-1]
        elif name == "dtype":
            arg = x.double()
        elif name == "strategy":
            kw["strategy"] = "ring"
        elif name == "stages":
            kw["heads_per_stage"] = 3
        elif name == "reference":
            kw["reference"], kw["backend"] = None, "torch"
        elif name == "backend":
            kw["backend"] = "triton"
        elif name == "stage_inputs":
            kw["stage_inputs"] = "offload"
        elif name == "documents_rank1" and rank == 1:
            kw["cu_seqlens"] = (0, 5, SEQ - 1)
        try:
            gated_deltanet(arg, module.weights(), **kw)
            found[name] = None
        except ValueError as e:
            found[name] = str(e)
    return found
