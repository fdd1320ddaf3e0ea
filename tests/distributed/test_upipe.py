"""UPipe (functional and fused module) vs the float64 reference and vs Ulysses."""

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_ulysses import gather
from tolerances import TOL, TOL_SAME_KERNEL, bf16_bound, rel_err
from workers import (
    double_backward_error,
    functional_or_error,
    make_qkv,
    module_reference,
    module_under_hooks,
    reference,
    run_functional,
    run_functional_layout,
    run_module,
    run_module_layout,
)

from upipe.heads import plan_rounds, valid_heads_per_stage

FWD, BWD = TOL[torch.float32]["fwd"], TOL[torch.float32]["bwd"]

CASES = [  # (world_size, H, G, B, U) -- MHA, GQA, MQA, G < C, batch > 1, U in {C, 2C, H}
    (1, 4, 2, 2, 1),
    (1, 4, 1, 1, 4),
    (2, 8, 8, 1, 2),
    (2, 8, 2, 2, 4),
    (2, 8, 1, 1, 2),
    (2, 8, 4, 1, 8),
    (4, 8, 8, 2, 4),
    (4, 8, 8, 1, 8),
    (4, 16, 4, 1, 4),
    (4, 16, 4, 1, 8),
    (4, 16, 4, 1, 16),
    (4, 8, 2, 2, 4),
    (4, 8, 1, 1, 4),
    (4, 8, 1, 1, 8),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world_size,H,G,B,U", CASES)
def test_upipe_matches_reference(clusters, world_size, H, G, B, U, causal):
    shape = dict(B=B, S=16 * world_size, H=H, G=G, d=8)
    kwargs = {"heads_per_stage": U, "causal": causal}
    got = gather(clusters(world_size).run(run_functional, "upipe", shape, kwargs))
    ref = reference(*make_qkv(**shape), causal=causal)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert rel_err(a, r) < (FWD if name == "out" else BWD), name


@pytest.mark.parametrize("U", [4, 8, 16])
def test_upipe_equals_ulysses(clusters, U):
    shape = dict(B=1, S=64, H=16, G=4, d=8)
    ul = gather(clusters(4).run(run_functional, "ulysses", shape, {}))
    up = gather(clusters(4).run(run_functional, "upipe", shape, {"heads_per_stage": U}))
    for a, b in zip(up, ul, strict=True):
        assert rel_err(a, b) < TOL_SAME_KERNEL


def test_default_heads_per_stage_is_group_size():
    assert [len(s) for r in plan_rounds(16, 4, 4, 4) for s in r.stages] == [4] * 4


@pytest.mark.parametrize(
    "H,G,C", [(8, 8, 4), (8, 2, 4), (8, 1, 4), (16, 4, 4), (12, 4, 2), (32, 8, 8)]
)  # even splits; uneven ones (e.g. H=12, G=3 on 4): tests/distributed/test_uneven_heads.py
def test_schedule_covers_each_head_once_with_standard_gqa(H, G, C):
    for U in valid_heads_per_stage(H, G, C):
        rounds = plan_rounds(H, G, C, U)
        heads = sorted(h for r in rounds for s in r.stages for h in s)
        assert heads == list(range(H))
        assert len({kv for r in rounds for kv in r.kv_heads}) == G
        for r in rounds:
            k = len(r.kv_heads) // C
            for s in r.stages:
                u = len(s) // C
                for rank in range(C):  # local query i uses local kv head i // (u / k)
                    mine_q, mine_kv = (
                        s[rank * u : (rank + 1) * u],
                        r.kv_heads[rank * k : (rank + 1) * k],
                    )
                    assert all(
                        h // (H // G) == mine_kv[i // (u // k)] for i, h in enumerate(mine_q)
                    )
        # each kv head is exchanged once per pass when G >= C (once per replica when G < C)
        assert sum(len(r.kv_heads) for r in rounds) == max(G, C)


MODULE_CASES = [  # (world_size, num_heads, num_kv_heads, B, strategy, heads_per_stage)
    (1, 4, 2, 2, "upipe", 1),
    (1, 4, 2, 1, "ulysses", None),
    (2, 8, 2, 2, "upipe", 2),
    (2, 8, 1, 1, "upipe", 4),
    (2, 8, 8, 1, "ulysses", None),
    (4, 8, 8, 1, "upipe", 4),
    (4, 8, 4, 2, "upipe", 8),
    (4, 8, 2, 1, "upipe", 4),
    (4, 8, 1, 1, "upipe", 8),
    (4, 8, 4, 1, "ulysses", None),
]


@pytest.mark.parametrize("world_size,H,G,B,strategy,U", MODULE_CASES)
def test_module_matches_reference(clusters, world_size, H, G, B, strategy, U):
    cfg = dict(B=B, S=16 * world_size, dim=32, num_heads=H, num_kv_heads=G, head_dim=8)
    kwargs = {"strategy": strategy, "heads_per_stage": U}
    res = clusters(world_size).run(run_module, cfg, kwargs)
    ref = module_reference(cfg)
    assert rel_err(torch.cat([r["y"] for r in res], 1), ref["y"]) < FWD
    assert rel_err(torch.cat([r["dx"] for r in res], 1), ref["dx"]) < BWD
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # rank contributions sum to the grad
        assert rel_err(sum(r[name] for r in res), ref[name]) < BWD, name


def test_module_ring_strategy_contiguous_and_heads_not_divisible(clusters):
    cfg = dict(B=2, S=48, dim=24, num_heads=3, num_kv_heads=1, head_dim=8)  # 3 heads on 2 ranks
    res = clusters(2).run(run_module_layout, cfg, {"strategy": "ring"}, "contiguous")
    ref = module_reference(cfg)
    assert rel_err(res[0]["y"], ref["y"]) < FWD
    assert rel_err(res[0]["dx"], ref["dx"]) < BWD
    assert rel_err(sum(r["o_proj"] for r in res), ref["o_proj"]) < BWD


def test_module_interleaved_rope_theta_and_noncausal(clusters):
    cfg = dict(B=1, S=32, dim=32, num_heads=4, num_kv_heads=2, head_dim=8)
    kwargs = {"rope_interleaved": True, "rope_theta": 500.0, "causal": False}
    res = clusters(2).run(run_module, cfg, kwargs)
    ref = module_reference(cfg, causal=False, interleaved=True, theta=500.0)
    assert rel_err(torch.cat([r["y"] for r in res], 1), ref["y"]) < FWD
    assert rel_err(torch.cat([r["dx"] for r in res], 1), ref["dx"]) < BWD
    assert rel_err(sum(r["q_proj"] for r in res), ref["q_proj"]) < BWD


@pytest.mark.parametrize("strategy", ["upipe", "ulysses"])
def test_module_under_saved_tensor_hooks(clusters, strategy):
    """CPU offload / checkpointing hooks see the saved tensors and the result is unchanged."""
    cfg = dict(B=1, S=32, dim=32, num_heads=4, num_kv_heads=2, head_dim=8)
    res = clusters(2).run(module_under_hooks, cfg, {"strategy": strategy})
    ref = module_reference(cfg)
    assert rel_err(torch.cat([r["dx"] for r in res], 1), ref["dx"]) < BWD
    assert rel_err(sum(r["o_proj"] for r in res), ref["o_proj"]) < BWD


@pytest.mark.parametrize("what", ["upipe module", "ulysses"])
def test_second_backward_raises(clusters, what):
    """Ops that free their buffers during backward say so on a second backward."""
    for msg in clusters(2).run(double_backward_error, what):
        assert msg is not None and "retain_graph=True is not supported" in msg


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    C=st.sampled_from([1, 2, 4]),
    H=st.sampled_from([2, 3, 4, 6, 8, 12, 16]),
    G=st.sampled_from([1, 2, 3, 4, 8]),
    U=st.one_of(st.none(), st.integers(1, 16)),
    B=st.integers(1, 2),
    L=st.integers(1, 9),
    causal=st.booleans(),
)
# one token: its q and k gradients are exactly 0 (one key, softmax 1), judged absolutely
@example(C=1, H=2, G=1, U=None, B=1, L=1, causal=True)
def test_property_right_answer_or_clear_error(clusters, C, H, G, U, B, L, causal):
    shape = dict(B=B, S=L * C, H=H, G=G, d=4)
    res = clusters(C).run(
        functional_or_error, "upipe", shape, {"heads_per_stage": U, "causal": causal}
    )
    # any G dividing H and C <= H (split unevenly where C does not divide them)
    valid = H % G == 0 and H >= C and (U or C) in valid_heads_per_stage(H, G, C)
    if not valid:
        assert all(isinstance(r, tuple) and r[0] == "ValueError" for r in res), res
        assert len({r[1] for r in res}) == 1  # the same message on every rank
        return
    got = gather(res)
    ref = reference(*make_qkv(**shape), causal=causal)
    for a, r in zip(got, ref, strict=True):
        assert rel_err(a, r) < BWD


@pytest.mark.parametrize("strategy,kwargs", [("ulysses", {}), ("upipe", {"heads_per_stage": 4})])
@pytest.mark.parametrize("causal", [True, False])
def test_zigzag_layout_on_a_group(clusters, strategy, kwargs, causal):
    """Ulysses and UPipe take the ring's zigzag layout too (the exchange restores order)."""
    shape = dict(B=2, S=64, H=8, G=4, d=8)
    res = clusters(4).run(
        run_functional_layout, strategy, shape, {"causal": causal, **kwargs}, "zigzag"
    )
    ref = reference(*make_qkv(**shape), causal=causal)
    for a, r in zip(res[0], ref, strict=True):
        assert rel_err(a, r) < BWD


@pytest.mark.parametrize("strategy", ["upipe", "ulysses", "ring"])
def test_module_zigzag_layout_on_a_group(clusters, strategy):
    cfg = dict(B=1, S=64, dim=32, num_heads=8, num_kv_heads=4, head_dim=8)
    res = clusters(4).run(run_module_layout, cfg, {"strategy": strategy}, "zigzag")
    ref = module_reference(cfg)
    assert rel_err(res[0]["y"], ref["y"]) < FWD
    assert rel_err(res[0]["dx"], ref["dx"]) < BWD
    assert rel_err(sum(r["q_proj"] for r in res), ref["q_proj"]) < BWD


@pytest.mark.parametrize(
    "world_size,H,G,strategy,U",
    [
        (1, 4, 2, "upipe", 1),
        (2, 8, 2, "upipe", 2),
        (4, 8, 2, "upipe", 4),
        (4, 8, 4, "upipe", 8),
        (4, 8, 1, "upipe", 4),
        (2, 8, 2, "ulysses", None),
    ],
)
def test_module_qk_norm(clusters, world_size, H, G, strategy, U):
    """QK-norm (Qwen3) inside the fused stage, recomputed in backward, incl. its weights."""
    cfg = dict(B=2, S=16 * world_size, dim=32, num_heads=H, num_kv_heads=G, head_dim=8)
    kwargs = {"strategy": strategy, "heads_per_stage": U, "qk_norm": True}
    res = clusters(world_size).run(run_module, cfg, kwargs)
    ref = module_reference(cfg, qk_norm=True)
    assert rel_err(torch.cat([r["y"] for r in res], 1), ref["y"]) < FWD
    assert rel_err(torch.cat([r["dx"] for r in res], 1), ref["dx"]) < BWD
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
        assert rel_err(sum(r[name] for r in res), ref[name]) < BWD, name


@pytest.mark.parametrize(
    ("world_size", "strategy", "U"), [(2, "upipe", 2), (4, "upipe", 4), (2, "ulysses", None)]
)
def test_module_zero_centred_qk_norm(clusters, world_size, strategy, U):
    """norm_offset=1.0 (Gemma 3's, Qwen3-Next's (1 + weight) QK-norm): the layer whose norm
    weights are the reference's minus 1 computes the reference, fp32 and (as well as Ulysses
    with the plain norm) bf16; the norm weights' gradients are the reference's."""
    cfg = dict(B=2, S=16 * world_size, dim=32, num_heads=8, num_kv_heads=2, head_dim=8)
    kwargs = {"strategy": strategy, "heads_per_stage": U, "qk_norm": True, "norm_offset": 1.0}
    ref = module_reference(cfg, qk_norm=True)
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
    errs = {}
    for dtype in (torch.float32, torch.bfloat16):
        res = clusters(world_size).run(run_module, cfg, kwargs, dtype)
        errs[dtype] = {
            "y": rel_err(torch.cat([r["y"] for r in res], 1), ref["y"]),
            "dx": rel_err(torch.cat([r["dx"] for r in res], 1), ref["dx"]),
            **{n: rel_err(sum(r[n] for r in res), ref[n]) for n in names},
        }
    assert errs[torch.float32]["y"] < FWD, errs
    assert max(errs[torch.float32].values()) < BWD, errs
    plain = {"strategy": "ulysses", "qk_norm": True}
    res = clusters(world_size).run(run_module, cfg, plain, torch.bfloat16)
    single = rel_err(torch.cat([r["y"] for r in res], 1), ref["y"])
    assert errs[torch.bfloat16]["y"] <= bf16_bound(single), (single, errs)
    assert max(errs[torch.bfloat16].values()) < TOL[torch.bfloat16]["bwd"], errs


@pytest.mark.parametrize("strategy", ["upipe", "ulysses", "ring"])
def test_module_softmax_scale(clusters, strategy):
    """softmax_scale (Gemma 3's query_pre_attn_scalar ** -0.5) reaches every strategy's op."""
    cfg = dict(B=1, S=32, dim=32, num_heads=8, num_kv_heads=2, head_dim=8)
    kwargs = {"strategy": strategy, "softmax_scale": 0.2, "layout": "contiguous"}
    res = clusters(2).run(run_module, cfg, kwargs)
    ref = module_reference(cfg, scale=0.2)
    assert rel_err(torch.cat([r["y"] for r in res], 1), ref["y"]) < FWD
    for name in ("dx", "q_proj", "k_proj"):
        got = torch.cat([r["dx"] for r in res], 1) if name == "dx" else sum(r[name] for r in res)
        assert rel_err(got, ref[name]) < BWD, name
    assert rel_err(res[0]["y"], module_reference(cfg)["y"][:, :16]) > 1e-2  # the scale matters


def test_zero_centred_norm_is_transformers_gemma3_norm():
    """staged_layer.rms_norm with offset 1 is transformers' Gemma3RMSNorm (also Qwen3-Next's)
    bit for bit, in fp32 and bf16; offset 0 is torch's RMSNorm."""
    pytest.importorskip("transformers")
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from upipe.attention.staged_layer import rms_norm

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        t = (3 * torch.randn(4, 5, 16, generator=gen)).to(dtype)
        norm = Gemma3RMSNorm(16, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(0.1 * torch.randn(16, generator=gen))
            assert torch.equal(rms_norm(t, norm.weight, 1e-6, 1.0), norm(t)), dtype
            plain = torch.nn.RMSNorm(16, eps=1e-6).to(dtype)
            assert torch.equal(rms_norm(t, plain.weight, 1e-6), plain(t)), dtype


def test_module_bf16_as_good_as_ulysses(clusters):
    """bf16: the fused op (fp32 sums over stages, dx built in fp32 row chunks) is at least
    about as accurate as the plain Ulysses layer in bf16."""
    cfg = dict(B=1, S=64, dim=64, num_heads=16, num_kv_heads=4, head_dim=8)
    ref = module_reference(cfg)
    errs = {}
    for strategy in ("ulysses", "upipe"):
        res = clusters(4).run(run_module, cfg, {"strategy": strategy}, torch.bfloat16)
        errs[strategy] = {
            "y": rel_err(torch.cat([r["y"] for r in res], 1), ref["y"]),
            "dx": rel_err(torch.cat([r["dx"] for r in res], 1), ref["dx"]),
            **{n: rel_err(sum(r[n] for r in res), ref[n]) for n in ("q_proj", "k_proj", "o_proj")},
        }
    for name, err in errs["upipe"].items():
        assert err <= bf16_bound(errs["ulysses"][name]), (name, errs)
    assert max(errs["upipe"].values()) < TOL[torch.bfloat16]["bwd"], errs
