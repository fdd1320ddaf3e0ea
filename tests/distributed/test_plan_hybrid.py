"""The plan of a hybrid model (Gated DeltaNet and gated attention layers: Qwen3-Next) on the
Hugging Face path: the chunk scan cut short keeps the full loop's memory byte for byte, the
simulated peak equals a real run's, fla's memory stand-in and FLOP counts, the depth
extrapolation by layer pattern, the shipped config, the refusals."""

from __future__ import annotations

import contextlib

import pytest
import torch
from tiers import matrix

pytest.importorskip("transformers")

from upipe.integrations.hf_deltanet import torch_scan  # noqa: E402
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

    return torch_scan(modeling_qwen3_next)


class _Ops(TorchDispatchMode):
    """Counts the operators run in the block."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _torch_scan_call(q, k, v, g, beta):
    """transformers' torch scan through `loops.chunk_scan` (the planner cuts it there): o."""
    from upipe import loops

    return loops.chunk_scan(_torch_scan(), q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]


def _scan_memory(B, S, G, H, d, e, dtype, *, sampled, scan=_torch_scan_call):
    """(forward peak, kept after forward, backward peak, left after backward) in bytes of
    `scan(q, k, v, g, beta)` -> o (default: transformers' torch scan), with the planner's
    shortcut or not; and the operators run."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, S, G, d, generator=gen, dtype=dtype) for _ in "qk")
    v = torch.randn(B, S, H, e, generator=gen, dtype=dtype)
    g, beta = -torch.rand(B, S, H, generator=gen), torch.rand(B, S, H, generator=gen).to(dtype)
    for t in (q, k, v, g, beta):
        t.requires_grad_()
    shortcut = sampled_loops() if sampled else contextlib.nullcontext()
    with shortcut, MemoryTracker() as mem, _Ops() as ops:
        o = scan(q, k, v, g, beta)
        forward, kept = mem.peak_bytes, mem.current_bytes
        mem.peak_bytes = kept
        o.backward(torch.ones_like(o))
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


def _rule_memory(B, S, G, H, d, e, dtype, *, sampled, for_backward, block):
    """`_scan_memory` for upipe's own scan (`upipe.kernels_delta_rule.delta_rule`)."""
    from upipe.kernels_delta_rule import delta_rule

    def scan(*inputs):
        return delta_rule(*inputs, for_backward=for_backward, block=block)

    return _scan_memory(B, S, G, H, d, e, dtype, sampled=sampled, scan=scan)


@pytest.mark.parametrize("for_backward", [False, True])
@pytest.mark.parametrize(
    "B,S,G,H,d,e,dtype,block",
    [
        (1, 640, 2, 4, 16, 16, torch.float32, 16384),  # one block
        (2, 600, 2, 2, 8, 16, torch.bfloat16, 16384),
        (1, 640, 2, 4, 16, 16, torch.float32, 128),  # 5 blocks
        (2, 600, 2, 2, 8, 16, torch.bfloat16, 256),  # 3 blocks, the last partial
    ],
)
def test_cut_recurrence_has_the_full_loops_memory(B, S, G, H, d, e, dtype, block, for_backward):
    """upipe's own scan with its chunk loops cut to 2 chunks and its blocks to 2 blocks
    (`upipe.planner.sampled`) holds the same bytes as with all 10 chunks (and every block)
    at its forward peak, after forward, at its backward peak and after backward, byte for
    byte, and runs as many operators at twice the length."""
    kw = dict(for_backward=for_backward, block=block)
    full, full_ops = _rule_memory(B, S, G, H, d, e, dtype, sampled=False, **kw)
    cut, ops = _rule_memory(B, S, G, H, d, e, dtype, sampled=True, **kw)
    assert cut == full
    assert ops < full_ops
    assert _rule_memory(B, 2 * S, G, H, d, e, dtype, sampled=True, **kw)[1] == ops


FEATURES = dict(
    tiled_mlp=True, mlp_tile=128, chunked_loss=True, loss_chunk=128, activation_checkpoint=True
)  # fmt: skip


def candidate(world=2, **kw):
    from upipe.train import TrainConfig

    base = dict(strategy="upipe", nproc=world, fsdp=True, dtype="bfloat16",
                master_dtype="bfloat16", heads_per_stage=world, seq_len=1024)  # fmt: skip
    return TrainConfig(**{**base, **kw})


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    matrix(
        [({},), ({"strategy": "ulysses", "heads_per_stage": None, **FEATURES},)],
        ["upipe", "ulysses-features"],
        default={"ulysses-features"},
    ),
)
def test_simulated_peak_equals_real_run(clusters, kw):
    """The tiny Qwen3-Next converted, sharded and stepped for real on 2 gloo ranks (bf16: the
    experts' grouped GEMM has no fp32 fake kernel) by the planner's own `build_model` and
    `HFJob`, and simulated under fake tensors with the CPU kernels (the torch scan cut short
    at 8 and 16 chunks): the simulated peak within 2% of the larger rank's measured one."""
    from plan_hf_workers import real_hf_peak

    from upipe.planner.hf import HFStepSimulator

    seq_lens = [512, 1024]
    cfg = candidate(**kw)
    fields = ("strategy", "nproc", "fsdp", "dtype", "master_dtype", "heads_per_stage", *FEATURES)
    per_rank = clusters(2).run(real_hf_peak, {k: getattr(cfg, k) for k in fields}, TINY_NEXT,
                               seq_lens)  # fmt: skip
    real = [max(p) for p in zip(*per_rank, strict=True)]
    with HFStepSimulator(cfg, 2, TINY_NEXT, kernels="cpu") as sim:
        simulated = [sim.step(S).peak_bytes for S in seq_lens]
    for r, s in zip(real, simulated, strict=True):
        assert abs(s - r) <= 0.02 * r, (real, simulated)


def test_grouped_mm_flops_are_those_of_its_groups():
    """`timing._grouped_mm` (the MoE experts' grouped GEMM) counts what one matrix product
    per group counts (`torch.utils.flop_counter`), forward and both gradients."""
    from torch.utils.flop_counter import FlopCounterMode

    from upipe.planner.timing import _FORMULAS

    gen = torch.Generator().manual_seed(0)
    ends = [3, 3, 9, 12]  # rows of 4 experts (one empty)
    x = torch.randn(12, 16, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 8, 16, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    formula = _FORMULAS[torch.ops.aten._grouped_mm]
    counted = []

    class Grouped(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._grouped_mm.default:
                counted.append(formula(*args, out_val=out))
            return out

    with Grouped():
        y = torch.nn.functional.grouped_mm(
            x, w.transpose(-2, -1), offs=torch.tensor(ends, dtype=torch.int32)
        )
        y.backward(torch.randn(y.shape, generator=gen, dtype=y.dtype))
    with FlopCounterMode(display=False) as per_group:
        starts = [0, *ends[:-1]]
        for e, (a, b) in enumerate(zip(starts, ends, strict=True)):
            x[a:b].detach() @ w[e].detach().t()  # forward
            torch.randn(b - a, 8) @ w[e].detach().float()  # input gradient
            torch.randn(8, b - a) @ x[a:b].detach().float()  # weight gradient
    assert len(counted) == 3 and sum(counted) == per_group.get_total_flops()


@pytest.mark.slow
def test_deltanet_flops_are_counted_per_scan():
    """The time model's count of a step of the tiny Qwen3-Next (CUDA kernels: fla's, by
    formula): per rank, each of the 3 DeltaNet layers runs U = 2 value heads in 2 stages of
    1 head per rank, each stage's scan forward, again in backward (recomputed), and its
    backward -- over all S tokens."""
    from upipe.planner import deltanet
    from upipe.planner.hardware import H100
    from upipe.planner.hf import shapes
    from upipe.planner.timing import count_step, predict

    S, d, e = 4096, 32, 32
    counts = count_step(candidate(), 2, shapes(TINY_NEXT), S, unit=256, depths=(4,), hf=TINY_NEXT)
    per_stage = 2 * deltanet.forward_flops(1, S, 1, d, e) + deltanet.backward_flops(1, S, 1, d, e)
    assert counts["deltanet_flops"] == 3 * 2 * per_stage
    assert predict(counts, H100)["deltanet"] == counts["deltanet_flops"] / H100.gemm


def test_depths_step_by_whole_layer_patterns():
    """`extrapolation_depths` with a layer period p: whole patterns and whole checkpoints,
    at least 3 patterns (and 3 + K checkpoints), plus the model's remainder; p = 1 as before."""
    from upipe.planner.plan import extrapolation_depths

    def depths(period, n=48, **kw):
        return extrapolation_depths(candidate(**kw), n, period)

    assert depths(1) == (3, 4) and depths(1, n=13, **FEATURES, blocks_per_checkpoint=2) == (7, 9)
    assert depths(4) == (12, 16) and depths(4, n=50) == (14, 18)
    assert depths(4, **FEATURES, blocks_per_checkpoint=2) == (12, 16)
    assert depths(4, **FEATURES, blocks_per_checkpoint=3) == (36, 48)  # lcm(3, 4) = 12
    assert depths(4, **FEATURES, offload=True, keep_on_gpu=10) == (16, 20)  # 13 checkpoints


@pytest.mark.slow
@pytest.mark.exhaustive  # (the default run: the dense depth shortcut, tests/runs/test_plan.py)
def test_extrapolated_depth_equals_full_depth():
    """A hybrid of a 2-layer pattern (Gated DeltaNet, then attention), 10 layers: its peak
    and host bytes extrapolated from 6 and 8 layers (3 and 4 patterns) equal the full
    depth's (CUDA kernels, every memory option)."""
    from upipe.planner.hf import HFStepSimulator, layer_period
    from upipe.planner.plan import extrapolation_depths

    hf = {**TINY_NEXT, "num_hidden_layers": 10, "full_attention_interval": 2}
    cfg = candidate(**FEATURES, offload=True)
    depths = extrapolation_depths(cfg, 10, layer_period(hf))
    assert depths == (6, 8)

    def memory(sim):
        return [(m.peak_bytes, m.host_peak_bytes) for m in map(sim.step, (1024, 4096))]

    with HFStepSimulator(cfg, 2, hf) as full:
        want = memory(full)
    with HFStepSimulator(cfg, 2, hf, depths=depths) as short:
        assert memory(short) == want


def test_layer_period():
    """The period of a config's layers: 1 for a dense model, the full-attention interval
    (times the MoE step) for a hybrid, None where layer_types or mlp_only_layers break it."""
    from upipe.planner.hf import layer_period, load_hf_config

    assert layer_period(load_hf_config("qwen3-8b")) == 1
    assert layer_period(TINY_NEXT) == 4
    assert layer_period({**TINY_NEXT, "full_attention_interval": 3, "decoder_sparse_step": 2}) == 6
    assert layer_period({**TINY_NEXT, "mlp_only_layers": [0]}) is None
    odd = ["linear_attention", "full_attention", "full_attention", "linear_attention"]
    assert layer_period({**TINY_NEXT, "layer_types": odd}) is None


def test_shipped_qwen3_next():
    """qwen3-next-80b-a3b loads and builds (on the meta device) the model of its published
    card: 48 layers, 12 x (3 Gated DeltaNet + 1 gated attention), 512 experts (10 per
    token) and a shared one in every layer, 80B parameters (79.67B counted), the rotary
    embedding over 64 of the 256 head dims."""
    import transformers

    from upipe.planner.hf import build_config, is_hybrid, load_hf_config

    hf = load_hf_config("qwen3-next-80b-a3b")
    config = build_config(hf)
    assert is_hybrid(hf)
    assert config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 12
    with torch.device("meta"):
        model = transformers.Qwen3NextForCausalLM(config)
    assert 79.6e9 < sum(p.numel() for p in model.parameters()) < 80e9
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (512, 2 * 512, 2048)
    assert model.model.rotary_emb.inv_freq.numel() == 64 // 2


def test_hybrid_refusals(capsys):
    """Ring and USP (the DeltaNet layers split by heads only), heads per stage the DeltaNet
    schedule cannot run, fp32 experts, and --recommend on the CPU are refused with the
    reason."""
    from upipe.cli import main
    from upipe.integrations.hf import hybrid_split_problem
    from upipe.planner.hf import hf_problem

    ring = hf_problem(candidate(strategy="ring"), TINY_NEXT, 2)
    assert ring == f"--strategies ring: {hybrid_split_problem('ring', 2)}"
    usp = hf_problem(candidate(strategy="usp", ring=2), TINY_NEXT, 4)
    assert usp.endswith("a mesh with a ring dim of 2 is not supported for hybrid models "
                        "(Gated DeltaNet layers): their linear layers are split by heads "
                        "(Ulysses / UPipe), not along the sequence; use strategy='upipe' or "
                        "'ulysses' on a group (or a mesh with ring=1)")  # fmt: skip
    upipe_ring = candidate(ring=2, heads_per_stage=2)
    assert "ring dim of 2" in hf_problem(upipe_ring, TINY_NEXT, 4)
    assert "heads_per_stage (3)" in hf_problem(candidate(heads_per_stage=3), TINY_NEXT, 2)
    assert "in bfloat16" in hf_problem(candidate(dtype="float32", master_dtype="float32"),
                                       TINY_NEXT, 2)  # fmt: skip
    assert hf_problem(candidate(), TINY_NEXT, 2) is None
    with pytest.raises(SystemExit):
        main(["plan", "--hf-config", "qwen3-next-80b-a3b", "--recommend", "--seq-len",
              "65536", "--device", "cpu", "--fsdp", "--gpus", "2", "--jobs", "1"])  # fmt: skip
    assert "use --device cuda" in capsys.readouterr().err
