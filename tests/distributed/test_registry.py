"""The registry's promise: a new strategy is one file (its op) and one registry entry, and
nothing else names it. Checked with a toy strategy defined here -- K/V all-gathered, then
local attention -- registered for the test only, run through `ContextParallelAttention`
(against the float64 layer), the trainer's validation and the planner's simulation.

Legend: B batch, L local tokens, S = C * L, H query heads, G kv heads, d head dim, C ranks.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tolerances import TOL, rel_err
from workers import module_reference, run_module

from upipe.attention.common import check_layout, validate_qkv
from upipe.attention.registry import (
    STRATEGIES,
    WHOLE,
    Strategy,
    check_heads,
    get_strategy,
    module_strategies,
)

FWD, BWD = TOL[torch.float32]["fwd"], TOL[torch.float32]["bwd"]


# --- the toy strategy: what a contributor writes (its file) ---------------------------------


class _AllGather(torch.autograd.Function):
    """[B, L, G, d] -> [B, S, G, d], every rank's block in rank order; backward: the sum of
    all ranks' gradients, this rank's block (an all-reduce, then a slice)."""

    @staticmethod
    def forward(ctx, t_BLGd, group):
        parts = [torch.empty_like(t_BLGd) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t_BLGd.contiguous(), group=group)
        ctx.group = group
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, g_BSGd):
        g_BSGd = g_BSGd.contiguous()
        dist.all_reduce(g_BSGd, group=ctx.group)
        L = g_BSGd.shape[1] // dist.get_world_size(ctx.group)
        return g_BSGd.narrow(1, dist.get_rank(ctx.group) * L, L), None


def allgather_attention(
    q,
    k,
    v,
    *,
    group,
    causal=True,
    softmax_scale=None,
    backend=None,
    layout="contiguous",
    cu_seqlens=None,
    window=None,
    sinks=None,
):
    """Rank r's queries (tokens r*L ..) against all S keys, gathered: `[B, L, H, d]`."""

    def extra(C):
        check_layout(layout, q.shape[1], C)
        if layout != "contiguous" or cu_seqlens is not None or window or sinks is not None:
            raise ValueError("the toy takes a contiguous layout and plain attention only")

    validate_qkv(
        q,
        k,
        v,
        strategy=TOY,
        group=group,
        causal=causal,
        softmax_scale=softmax_scale,
        backend=backend,
        extra=extra,
        extra_signature={"layout": layout},
    )
    L = q.shape[1]
    k_BSGd, v_BSGd = (_AllGather.apply(t, group) for t in (k, v))
    first = dist.get_rank(group) * L
    mask_LS = None
    if causal:  # query first + i sees keys 0 .. first + i
        mask_LS = torch.ones(L, k_BSGd.shape[1], dtype=torch.bool, device=q.device).tril(first)
    out = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k_BSGd, v_BSGd)),
        attn_mask=mask_LS,
        scale=softmax_scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)


TOY = Strategy(  # ... and its registry entry
    name="allgather",
    impl=allgather_attention,
    group=True,
    mesh=False,
    layout="contiguous",
    kv_heads=WHOLE,
    module="allgather",
)


@contextlib.contextmanager
def registered():
    """The entry in `STRATEGIES` while the block runs (in this process)."""
    STRATEGIES[TOY.name] = TOY
    try:
        yield
    finally:
        del STRATEGIES[TOY.name]


# --- the checks ------------------------------------------------------------------------------


def _toy_modules(rank, world_size, cfgs):
    with registered():
        return [run_module(rank, world_size, cfg, {"strategy": "allgather"}) for cfg in cfgs]


def test_toy_runs_through_the_layer(clusters):
    """`ContextParallelAttention(strategy="allgather")` against the float64 layer, fp32: GQA,
    and a single query head on 2 ranks (the entry keeps whole heads, so its head rule is not
    Ulysses')."""
    cfgs = [
        dict(B=2, S=16, dim=32, num_heads=4, num_kv_heads=2, head_dim=8),
        dict(B=1, S=16, dim=8, num_heads=1, num_kv_heads=1, head_dim=8),
    ]
    res = clusters(2).run(_toy_modules, cfgs)
    for i, cfg in enumerate(cfgs):
        ref = module_reference(cfg)
        got = [r[i] for r in res]
        assert rel_err(torch.cat([r["y"] for r in got], 1), ref["y"]) < FWD
        assert rel_err(torch.cat([r["dx"] for r in got], 1), ref["dx"]) < BWD
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert rel_err(sum(r[name] for r in got), ref[name]) < BWD, name


def test_toy_is_known_wherever_strategies_are_listed():
    """Registered, the entry is the layer's, the trainer's and the head check's; removed, it
    is unknown again (nothing else names it)."""
    from train_workers import small_config

    from upipe.train.config import padded_length, validate

    with registered():
        assert "allgather" in module_strategies()
        assert get_strategy("allgather") is TOY and TOY.op is allgather_attention
        assert check_heads("allgather", 1, 1, 8, size="context-parallel size") is None
        cfg = small_config(strategy="allgather", nproc=4)
        assert validate(cfg, 4) is None
        assert cfg.degrees(4) == (1, 1, 4) and padded_length(cfg, 4) == 128
        problem = validate(small_config(strategy="allgather", nproc=4, heads_per_stage=4), 4)
        assert "--heads-per-stage applies to --strategy upipe only" in problem
    assert "allgather" not in module_strategies()
    with pytest.raises(ValueError, match="unknown strategy 'allgather'"):
        get_strategy("allgather")


@pytest.mark.slow
def test_toy_in_the_planners_simulation():
    """The planner simulates a training step of the toy (fake tensors, a fake process group)
    with no line of the planner naming it: its gathered K/V grow with the sequence."""
    from train_workers import small_config

    from upipe.planner.step import StepSimulator

    with registered(), StepSimulator(small_config(strategy="allgather", nproc=4), 4) as sim:
        short, long = sim.step(512), sim.step(1024)
    assert 0 < short.persistent_bytes < short.peak_bytes < long.peak_bytes


def test_every_entry_resolves_its_op():
    """The built-in entries name their ops by import path; each resolves to the public op."""
    import upipe

    for name, spec in STRATEGIES.items():
        if spec.context_parallel:
            assert spec.op is getattr(upipe, f"{name}_attention"), name
        else:
            assert spec.op is None
