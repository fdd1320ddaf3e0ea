"""The time model's counts equal closed forms for the full step (though the simulator cuts
loops short and extrapolates depth), its time formulas, `upipe plan --recommend`'s pick and
the command it prints."""

from __future__ import annotations

import dataclasses
import shlex

import pytest
from tiers import matrix

from upipe.cli import build_parser, main
from upipe.cli.options import config_from_args
from upipe.model import CausalLM, get_config
from upipe.planner.plan import PlanConfig
from upipe.planner.recommend import (
    TIE,
    RecommendConfig,
    _pick,
    recommend,
    table,
    torchrun_command,
)
from upipe.planner.step import StepSimulator
from upipe.planner.timing import H100, _count, count_step, get_hardware, predict
from upipe.torch_private import FakeTensorMode
from upipe.train.config import TrainConfig, validate

C, S, UNIT, E = 2, 256, 64, 2  # ranks, tokens counted at, count unit, bytes per bf16
MODEL = dataclasses.replace(get_config("tiny"), n_layers=6)  # deeper than the depths 3, 4


def _config(strategy, **kw):
    kw = dict(strategy=strategy, nproc=C, fsdp=True, dtype="bfloat16", seq_len=UNIT, **kw)
    return TrainConfig(model="tiny", plot=None, **kw)


def _closed_forms(strategy, recompute, mlp=False):
    """Per rank and step (L = S / C tokens, causal attention counted as half of S^2):
    block forward GEMMs 2 L D (H + 2G) d (q, k, v) + 2 L H d D (o) + 3 x 2 L D F (MLP),
    backward twice that; head 2 L D V forward, twice backward; attention forward
    2 S^2 H d / C, backward 2.5x. Recomputation adds forwards: checkpointing the block's,
    the fused UPipe op the projections of q, k, v, the tiled MLP its MLP (the chunked loss
    computes its gradients in its forward: its head costs what the plain one does).
    All-to-all bytes per layer call (unit L d E): Ulysses (2H + 2G) each way, UPipe 2H + 2G
    forward, 4H + 4G backward (it sends q, k, v and out again)."""
    D, H, G, d, F, V, n = (getattr(MODEL, a) for a in ("hidden_size", "n_heads", "n_kv_heads",
                           "head_dim", "ffn_dim", "vocab_size", "n_layers"))  # fmt: skip
    L = S // C
    qkv, o, ffn, head = 2 * L * D * (H + 2 * G) * d, 2 * L * H * d * D, 6 * L * D * F, 2 * L * D * V
    block = qkv + o + ffn
    gemm = n * 3 * block + 3 * head + n * recompute * block
    gemm += n * qkv * (strategy == "upipe") + n * ffn * mlp
    attention = n * 2 * S * S * H * d // C
    unit = n * L * d * E
    forward, backward = {"ulysses": (24, 24), "upipe": (24, 48), "ring": (0, 0)}[strategy]
    return {
        "gemm_flops": gemm,
        "attention_forward_flops": attention * (1 + recompute),
        "attention_backward_flops": attention * 5 // 2,
        "all_to_all": (forward * (1 + recompute) + backward) * unit,
    }


CASES = [
    ("ulysses", {}),
    ("ulysses", {"activation_checkpoint": True}),
    ("upipe", {}),
    ("upipe", {"activation_checkpoint": True, "heads_per_stage": 2}),
    ("ring", {"activation_checkpoint": True}),
    ("ulysses", {"activation_checkpoint": True, "offload": True, "tiled_mlp": True,
                 "mlp_tile": 32, "chunked_loss": True, "loss_chunk": 32}),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,kw",
    matrix(CASES, [f"{s}-kw{i}" for i, (s, _) in enumerate(CASES)], {"upipe-kw2", "ring-kw4"}),
)
def test_counts_equal_closed_forms(strategy, kw):
    counts = count_step(_config(strategy, **kw), C, MODEL, S, unit=UNIT, depths=(3, 4))
    flags = [kw.get(f, False) for f in ("activation_checkpoint", "tiled_mlp")]
    want = _closed_forms(strategy, *flags)
    for key in ("gemm_flops", "attention_forward_flops", "attention_backward_flops"):
        assert counts[key] == want[key], key
    assert counts.get("all_to_all@0,1", 0) == want["all_to_all"]
    assert counts["host_compute_bytes"] == 0
    if strategy == "ring":  # kv blocks around the ring: a send for each recv
        assert counts["send@0,1"] == counts["recv@0,1"] > 0
    if kw.get("offload"):  # each block input: to the host in forward, back twice in backward
        block_input = MODEL.n_layers * (S // C) * MODEL.hidden_size * E
        assert counts["device_to_host_bytes"] == block_input
        assert counts["host_to_device_bytes"] == 2 * block_input
    else:
        assert counts["device_to_host_bytes"] == counts["host_to_device_bytes"] == 0


KEPT = ["upipe", "ulysses", "ring"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", matrix([(s,) for s in KEPT], KEPT, {"ring"}))
def test_time_model_counts_one_attention_forward(strategy):
    """The planner's counts of a checkpointed step with `keep` (the closed forms
    above): the attention forward FLOPs of one forward per layer and step (those of a step
    without checkpointing), the backward's unchanged; the fused UPipe op's recomputation
    also skips the q/k/v projections and their all-to-alls, the ring's its ring pass."""
    S = 256
    cfg = _config(strategy, activation_checkpoint=True, attention_outputs="keep")
    kept = count_step(cfg, C, MODEL, S, unit=UNIT, depths=(3, 4))
    recompute, plain = _closed_forms(strategy, True), _closed_forms(strategy, False)
    assert kept["attention_forward_flops"] == plain["attention_forward_flops"]
    assert kept["attention_forward_flops"] * 2 == recompute["attention_forward_flops"]
    assert kept["attention_backward_flops"] == recompute["attention_backward_flops"]
    D, H, G, d, n = (getattr(MODEL, a) for a in ("hidden_size", "n_heads", "n_kv_heads",
                     "head_dim", "n_layers"))  # fmt: skip
    L = S // C
    qkv = 2 * L * D * (H + 2 * G) * d  # the fused forward's projections, per layer
    fused = strategy == "upipe"
    assert kept["gemm_flops"] == recompute["gemm_flops"] - n * qkv * fused
    a2a = plain if fused else recompute  # the fused op's recomputation exchanges nothing
    assert kept.get("all_to_all@0,1", 0) == a2a["all_to_all"]
    if strategy == "ring":  # per layer: the k/v block sent once in the forward (C = 2) and
        kv, dkv = 2 * L * G * d * 2, 2 * L * G * d * 4  # once in backward, with C fp32 dk/dv
        assert kept["send@0,1"] == n * (2 * kv + C * dkv)  # (recompute: 3 kv)


@pytest.mark.slow
def test_fsdp_bytes():
    """FSDP2, per step: each block's bf16 parameters all-gathered twice (forward, and again
    for its backward after resharding), the root's (embedding, final norm, head) once; the
    fp32 gradients of all reduce-scattered once. Shards are padded to equal rows: the
    embedding's and the head's V = 257 rows to 258 on 2 ranks. With --fsdp-offload each fp32
    shard is copied to the device before each all-gather, each gradient shard to the host,
    and the optimizer step runs on host tensors."""
    cfg = _config("ulysses", fsdp_offload=True)
    counts = count_step(cfg, C, MODEL, S, unit=UNIT, depths=(3, 4))
    with FakeTensorMode():
        block = sum(p.numel() for p in CausalLM(MODEL).model.layers[0].parameters())
    D, V, n = MODEL.hidden_size, MODEL.vocab_size, MODEL.n_layers
    root = MODEL.num_params() - n * block + 2 * D * (-V % C)  # (padded)
    assert counts["all_gather@0,1"] == E * (2 * n * block + root)
    assert counts["reduce_scatter@0,1"] == 4 * (n * block + root)
    assert counts["fsdp_host_to_device_bytes"] == 4 * (2 * n * block + root) // C
    assert counts["fsdp_device_to_host_bytes"] == 4 * (n * block + root) // C
    assert counts["host_compute_bytes"] > 0 == counts["host_to_device_bytes"]


@pytest.mark.slow
@pytest.mark.exhaustive  # (the fits' exactness by default: test_plan_speed's count equality)
def test_fits_are_exact_at_a_fourth_length_and_full_depth():
    """The parabola through three lengths and the line through two depths give what the
    full-depth model counts at a fourth length (every count, bytes included)."""
    cfg = _config(
        "upipe", heads_per_stage=4, activation_checkpoint=True, tiled_mlp=True, mlp_tile=32
    )
    fitted = count_step(cfg, C, MODEL, 5 * 128, unit=UNIT, depths=(3, 4))
    with StepSimulator(cfg, C, MODEL, sample_loops=False) as sim:
        assert fitted == _count(sim, 5 * 128)


def test_time_model():
    flash = H100.kernel_rate("flash")  # one second of forward, two of backward
    counts = {"gemm_flops": H100.gemm, "attention_forward_flops": flash.forward}
    counts.update(attention_backward_flops=2 * flash.backward, memory_bytes=H100.hbm)
    counts.update(host_compute_bytes=0)
    counts.update(host_to_device_bytes=H100.host_link, device_to_host_bytes=H100.host_link)
    counts.update(fsdp_host_to_device_bytes=0, fsdp_device_to_host_bytes=0)
    counts["all_to_all@0,1,2,3,4,5,6,7"] = 8 * H100.all_to_all / 7  # 7/8 leave the GPU: 1 s
    counts["all_gather@0,1,2,3,4,5,6,7"] = 8 * H100.collective / 7  # 1 s, hidden behind compute
    t = predict(counts, H100, "flash")
    assert (t["gemm"], t["attention"], t["memory_bound"]) == pytest.approx((1, 3, 1))
    assert (t["all_to_all"], t["fsdp_exposed"], t["device_to_host_exposed"]) == pytest.approx(
        (1, 0, 0)
    )
    assert t["host_to_device"] == pytest.approx(1) and t["step"] == pytest.approx(7)
    counts["all_gather@0,1,2,3,4,5,6,7"] *= 6  # 6 s of FSDP behind 5 s of compute
    counts["all_to_all@0,8"] = 2 * H100.inter_node  # two nodes: off-node half at their rate
    t = predict(counts, H100, "flash")
    assert t["fsdp_exposed"] == pytest.approx(1) and t["all_to_all"] == pytest.approx(2)


@pytest.fixture(scope="module")
def recommended():
    """ulysses and none at 2048 tokens on 2 ranks; budgets from a first run: one where both
    fit, one where only the smaller peak fits."""
    pc = PlanConfig(model="tiny", gpus=2, strategies=("ulysses", "none"), features=("off",))
    pc = dataclasses.replace(pc, granularity=UNIT, jobs=1, reserve_gib=0, gpu_memory_gib=1)
    rc = RecommendConfig(recommend=True, seq_len=2048)
    both = recommend(pc, rc)
    peaks = sorted(r["peak_bytes"] for r in both["candidates"])
    tight = dataclasses.replace(pc, gpu_memory_gib=(peaks[0] + peaks[1]) / 2 / 2**30)
    return both, recommend(tight, rc), rc


@pytest.mark.slow
def test_recommend_picks_the_fastest_that_fits(recommended):
    both, tight, rc = recommended
    rows = {r["strategy"]: r for r in both["candidates"]}
    assert all(r["fits"] for r in rows.values()) and len(rows) == 2
    step = {s: r["seconds"]["step"] for s, r in rows.items()}
    assert both["fastest"] == min(step, key=step.get) == both["candidates"][0]["strategy"]
    slow, fast = sorted(step, key=step.get, reverse=True)
    assert step[slow] > (1 + TIE) * step[fast]  # not a tie: the pick is the faster one
    assert both["pick"] == fast
    small = min(rows, key=lambda s: rows[s]["peak_bytes"])
    assert tight["pick"] == small  # the other does not fit, whatever its speed
    other = next(r for r in tight["candidates"] if r["strategy"] != small)
    assert not other["fits"] and "device peak" in other["reason"] and "seconds" not in other
    assert f"pick: {tight['pick']}" in table(tight) and tight["command"] in table(tight)


def test_within_a_tie_the_pick_has_more_headroom():
    rows = [
        {"strategy": "a", "seconds": {"step": 100.0}, "peak_bytes": 70},
        {"strategy": "b", "seconds": {"step": 100.5}, "peak_bytes": 30},
        {"strategy": "c", "seconds": {"step": 102.0}, "peak_bytes": 10},
    ]
    assert _pick(rows)["strategy"] == "b" and _pick([]) is None


def _parsed(command: str, gpus: int):
    words = shlex.split(command)
    assert words[0] == "torchrun" and words[words.index("-m") + 1] == "upipe.train"
    ns = build_parser().parse_args(["train", *words[words.index("-m") + 2 :]])
    return config_from_args(TrainConfig, ns)


@pytest.mark.slow
def test_printed_command_parses(recommended):
    both, _, rc = recommended
    pick = next(r for r in both["candidates"] if r["strategy"] == both["pick"])
    cfg = _parsed(both["command"], 2)
    assert both["command"].startswith("torchrun --nproc-per-node 2 -m upipe.train --device cuda")
    want = TrainConfig(**{**pick["train_config"], "seq_len": rc.seq_len, "device": "cuda"})
    assert dataclasses.replace(cfg, nproc=want.nproc) == want
    assert validate(cfg, 2) is None
    kw = {**pick["train_config"], "activation_checkpoint": True, "offload": True}
    cmd = torchrun_command(kw, 16, 2**20, 8)
    assert cmd.startswith("torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d")
    cfg = _parsed(cmd, 16)
    assert cfg.offload and cfg.activation_checkpoint and cfg.seq_len == 2**20


@pytest.mark.parametrize(
    "args,message",
    [
        (["--recommend", "--seq-len", "4096", "--hardware", "mi300x"], "invalid choice: 'mi300x'"),
        (
            ["--recommend", "--seq-len", "4096", "--hardware", "a100", "--attention-kernel", "fa3"],
            "'fa3' does not run on a100",
        ),
        (["--recommend"], "--recommend needs --seq-len"),
        (["--seq-len", "4096"], "add --recommend"),
        (["--rates-from", "gpu_check.json"], "--rates-from times what --recommend plans for"),
        (["--recommend", "--seq-len", "4096", "--dtype", "float32"], "use --dtype bfloat16"),
    ],
)
def test_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["plan", "--model", "tiny", "--gpus", "2", *args])
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_unknown_hardware():
    with pytest.raises(ValueError, match="unknown hardware 'mi300x': use one of h100, h200, a1"):
        get_hardware("mi300x")
