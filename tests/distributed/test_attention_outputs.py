"""`--attention-outputs keep|offload`: a checkpoint's recomputation reuses the forward's
attention outputs (`upipe.attention.kept`) -- bit for bit the losses and gradients of
`recompute`, with no attention forward kernel in backward, in every strategy."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from kept_workers import cuda_path, forward_live_bytes, misuse, modes, nested
from train_workers import small_config

from upipe.train.config import validate

RECOMPUTE = {"activation_checkpoint": True, "attention_outputs": "recompute"}
KEEP = {"activation_checkpoint": True, "attention_outputs": "keep"}
OFFLOAD = {"activation_checkpoint": True, "offload": True, "attention_outputs": "offload"}
PLAIN = {"activation_checkpoint": False}  # no recomputation: the forward kernel calls of a step


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """JSON lines of documents of 1 to 40 words: several per row of 256 tokens, so document
    masking cuts every shard."""
    rng = random.Random(0)
    words = ("ring", "heads", "stage", "kept", "a", "of")
    texts = [" ".join(rng.choices(words, k=rng.choice((1, 5, 12, 40)))) for _ in range(300)]
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def _same(a, b) -> bool:
    """Losses and every gradient bit for bit."""
    return a["losses"] == b["losses"] and all(
        torch.equal(g[n], h[n]) for g, h in zip(a["grads"], b["grads"], strict=True) for n in g
    )


def _check(results, modes_kept=("keep",)):
    """Every rank: each kept mode is `recompute` bit for bit, calls the attention forward
    kernel exactly as often as a step without checkpointing, and its backward kernel as
    often as `recompute`; `recompute` calls the forward kernel more often."""
    for rank in results:
        ref, plain = rank["recompute"], rank["plain"]
        assert ref["kernel_calls"][0] > plain["kernel_calls"][0]
        for mode in modes_kept:
            run = rank[mode]
            assert _same(run, ref), mode
            assert run["kernel_calls"] == (plain["kernel_calls"][0], ref["kernel_calls"][1])


@pytest.mark.parametrize(
    "world,kw",
    [
        (4, {"strategy": "upipe"}),  # the fused op
        (4, {"strategy": "ulysses"}),
        (4, {"strategy": "ring"}),
        (4, {"strategy": "usp"}),  # 2 x 2: Ulysses around ring attention
        (4, {"strategy": "upipe", "ring": 2}),  # each fused stage a ring attention
        (3, {"strategy": "upipe"}),  # uneven heads: 8 query, 4 kv heads on 3 ranks
        (3, {"strategy": "ulysses"}),
    ],
)
def test_every_strategy_with_documents_fp32(clusters, short_documents, world, kw):
    cfg = small_config(**kw, seq_len=96 * world, data=short_documents)
    runs = {"recompute": (RECOMPUTE, False), "keep": (KEEP, False), "plain": (PLAIN, False)}
    _check(clusters(world).run(modes, cfg, runs))


@pytest.mark.slow  # (8-12 s a case)
@pytest.mark.parametrize(
    "kw,m",
    [
        ({"strategy": "upipe"}, 2),
        ({"strategy": "upipe"}, 3),  # segments of 3 and 1 of the 4 blocks
        ({"strategy": "ulysses"}, 2),
        ({"strategy": "ring"}, 3),
    ],
)
def test_segments_and_offload_bf16(clusters, kw, m):
    """Checkpoints of m blocks, bf16 compute with fp32 masters, 4 blocks: the segment's
    inner blocks are recomputed twice (their inputs without a graph, then each with grad),
    both from the forward's outputs; offloaded to a host arena beside the block inputs,
    the last checkpoint's kept on the device (--keep-on-gpu 1), the same bits; two steps,
    the second reusing the arenas of the first."""
    cfg = small_config(**kw, seq_len=256, dtype="bfloat16", blocks_per_checkpoint=m)
    offload = {**OFFLOAD, "keep_on_gpu": 1}
    runs = {
        "recompute": (RECOMPUTE, False),
        "keep": (KEEP, False),
        "offload": (offload, True),
        "plain": ({**PLAIN, "blocks_per_checkpoint": 1}, False),
    }
    results = clusters(4).run(modes, cfg, runs, 4, 2)  # 4 blocks, 2 steps
    _check(results, ("keep", "offload"))
    n_inputs = -(-4 // m) - 1  # offloaded checkpoints: all but the last
    for rank in results:  # an arena per attention call of a checkpoint, a slot per input
        per_layer = _per_layer_bytes(1, 256 // 4, 8, 16, 2)  # bf16
        assert rank["offload"]["output_arena_bytes"] == [n_inputs * per_layer] * m


def _problem(world=2, **kw):
    return validate(dataclasses.replace(small_config(), **kw), world)


def test_validation_messages():
    assert _problem(attention_outputs="keep") == (
        "--attention-outputs keep hands each attention layer's forward outputs to the "
        "recomputation of activation checkpointing; add --activation-checkpoint"
    )
    assert _problem(activation_checkpoint=True, attention_outputs="offload") == (
        "--attention-outputs offload keeps them in host memory beside the offloaded block "
        "inputs; add --offload (or keep them on the device: --attention-outputs keep)"
    )
    assert _problem(strategy="none", **KEEP) == (
        "--attention-outputs keep reuses what upipe's attention ops keep; --strategy none runs "
        "the model's own attention (torch's SDPA): use --attention-outputs recompute"
    )
    assert _problem(**KEEP) is None and _problem(**OFFLOAD) is None


def _per_layer_bytes(B, L, H, d, element_size) -> int:
    """What one attention layer keeps (`upipe.attention.kept`): out in the compute dtype,
    the lse in fp32."""
    return B * L * H * d * element_size + 4 * B * L * H


@pytest.mark.parametrize("strategy", ["upipe", "ulysses", "ring"])
def test_kept_bytes_are_the_formula(clusters, strategy):
    """After the forward, `keep` holds exactly the formula's bytes per layer more than
    `recompute` on every rank (tiny model: H = 8, d = 16; 4 layers; S = 256 on 4 ranks)."""
    cfg = small_config(strategy=strategy, seq_len=256, document_mask=False)
    live = clusters(4).run(forward_live_bytes, cfg, {"recompute": RECOMPUTE, "keep": KEEP}, 4)
    for rank in live:
        assert rank["keep"] - rank["recompute"] == 4 * _per_layer_bytes(1, 64, 8, 16, 4)


def test_misuse_raises(clusters):
    """Recomputations that make other attention calls than the forward, and a kept output
    written into, raise (on every rank) instead of reusing the wrong tensors."""
    for msgs in clusters(2).run(misuse):
        assert msgs["more"].startswith(
            "the recomputation of checkpointed function 0 made attention call 1 as "
            "('fused_upipe', ((2, 16, 32), 'torch.float32')"
        )
        assert msgs["more"].endswith(
            "its forward made no such call; a checkpointed function must make the same "
            "attention calls each time it runs (use attention_outputs='recompute' for one that "
            "does not)"
        )
        assert "made attention call 0 as ('fused_upipe', ((1, 16, 32)" in msgs["shape"]
        assert msgs["in place"].startswith(
            "an attention output kept for the recomputation of checkpointed function 0 was "
            "modified in place after the op returned it"
        )


@pytest.mark.parametrize("strategy", ["upipe", "ring"])
def test_nested_checkpoints(clusters, strategy):
    """Only the outermost checkpoint keeps: the inner one, met in the outer's recomputation,
    leaves its attention call to the outer's pass. Bit-identical gradients; the kernel runs
    in the forward and once more in the inner checkpoint's own recomputation (recompute:
    three times)."""
    for same, n_recompute, n_keep in clusters(2).run(nested, strategy):
        assert same
        assert n_keep * 3 == n_recompute * 2


def test_offloaded_outputs_come_back_as_they_were():
    """The offloader's attention-output arena: one exact-size slot per offloaded checkpoint
    (each tensor at a multiple of 64 bytes), dense tensors come back with their strides (the
    CPU kernel's lse is a transposed one), others contiguous, all bit for bit; they belong to
    the input's token: released with it, and overwritten by a later forward's."""
    from upipe.model.offload import ALIGN, Offloader

    off = Offloader(2)
    token = off.save(torch.randn(1, 8, 4), 1)
    gen = torch.Generator().manual_seed(0)
    lse = torch.randn(1, 3, 8, generator=gen).transpose(1, 2)  # dense, not contiguous
    part = torch.randn(4, 10, generator=gen)[:, :6]  # not dense
    half = torch.randn(2, 5, generator=gen).to(torch.bfloat16)
    off.save_outputs([lse, part, half], 1, 0, token)
    back = off.load_outputs(token, 1, 0, torch.device("cpu"))
    for a, b in zip(back, (lse, part, half), strict=True):
        assert torch.equal(a, b) and a.dtype == b.dtype
    assert back[0].stride() == lse.stride() and back[1].is_contiguous()
    assert ALIGN == 64 and off._outputs[0].arena.nbytes == 2 * (128 + 128 + 64)
    off.release(token, 1)
    with pytest.raises(RuntimeError, match="outputs of checkpoint 1 .call 0. were overwritten"):
        off.load_outputs(token, 1, 0, torch.device("cpu"))
    first = off.save(torch.randn(1, 8, 4), 1)
    off.save_outputs([lse], 1, 0, first)  # another layout: a new arena
    second = off.save(torch.randn(1, 8, 4), 1)
    off.save_outputs([lse], 1, 0, second)
    with pytest.raises(RuntimeError, match="run each backward before the next forward"):
        off.load_outputs(first, 1, 0, torch.device("cpu"))
    assert torch.equal(off.load_outputs(second, 1, 0, torch.device("cpu"))[0], lse)


def test_offloaded_outputs_cuda_calls_in_order(monkeypatch):
    """The stream, event and registration calls of the attention outputs' arena on CUDA
    (logging stand-ins, real copies, as tests/distributed/test_offload.py does for the inputs):
    registered
    at its exact size when first written, each copy on the side stream after the compute
    stream's work, the compute stream waits for the last copy back before using them, and
    the arena is unregistered after the side stream is done when the offloader goes."""
    import contextlib

    from test_offload import _FakeStream

    from upipe.model.offload import Offloader

    log = []
    compute = _FakeStream("compute", log)
    cudart = type("cudart", (), {})()
    cudart.cudaHostRegister = lambda ptr, n, flags: log.append(("register", n))
    cudart.cudaHostUnregister = lambda ptr: log.append(("unregister",))
    side_copy = contextlib.contextmanager(lambda s: (log.append((s.name, "copies")), (yield)))
    for name, fake in [
        ("current_stream", lambda device: compute),
        ("stream", side_copy),
        ("cudart", lambda: cudart),
        ("check_error", lambda res: None),
        ("device", lambda device: contextlib.nullcontext()),
    ]:
        monkeypatch.setattr(torch.cuda, name, fake)
    off = Offloader(1)
    off._stream = _FakeStream("side", log)  # as a CUDA input would create it
    out, lse = torch.randn(2, 64, 4), torch.randn(2, 4, 64)
    token = off.save(torch.randn(2, 64, 8), 0)
    off.save_outputs([out, lse], 0, 0, token)
    back = off.load_outputs(token, 0, 0, torch.device("cpu"))
    assert torch.equal(back[0], out) and torch.equal(back[1], lse)
    del off
    copy = [("side", "waits for", "compute"), ("side", "copies")]
    assert log == [
        ("register", 2 * 64 * 8 * 4), *copy, ("side", "records", 0),  # the input
        ("register", 2 * 64 * 4 * 4 * 2),  # out and lse: 2 KiB each
        *copy, ("side", "records", 1), *copy, ("side", "records", 2),
        *copy, ("side", "records", 3), *copy, ("side", "records", 4),  # back
        ("compute", "waits for event", 4),
        ("host", "synchronizes with", "side"), ("unregister",),
        ("host", "synchronizes with", "side"), ("unregister",),
    ]  # fmt: skip


def test_library_errors():
    """The library's spelling of the same rules (`MemoryFeatures`, `activation_checkpoint`)."""
    from upipe.model import CausalLM, get_config
    from upipe.model.features import activation_checkpoint
    from upipe.train.parallelize import MemoryFeatures, apply_memory_features

    model = CausalLM(get_config("tiny"))
    cases = [
        (
            MemoryFeatures(attention_outputs="keep"),
            "attention_outputs keep hands each attention layer's forward outputs to the "
            "recomputation of activation checkpointing; add activation_checkpoint",
        ),
        (
            MemoryFeatures(activation_checkpoint=True, attention_outputs="offload"),
            "attention_outputs offload keeps them in host memory beside the offloaded block "
            "inputs; add offload (or keep them on the device: attention_outputs keep)",
        ),
        (
            MemoryFeatures(activation_checkpoint=True, attention_outputs="twice"),
            "attention_outputs must be one of recompute, keep, offload, got 'twice'",
        ),
    ]
    for features, message in cases:
        with pytest.raises(ValueError) as e:
            apply_memory_features(model, features, "cpu")
        assert str(e.value) == message
    apply_memory_features(model, MemoryFeatures(**KEEP), "cpu")
    assert model.attention_outputs == "keep" and model.recompute_blocks == 1
    x = torch.randn(1, 4, 2, requires_grad=True)
    with pytest.raises(ValueError, match="attention_outputs must be one of .'recompute', 'keep'"):
        activation_checkpoint(torch.sin, x, attention_outputs="kept")


@pytest.mark.slow
def test_planner_counts_the_kept_outputs():
    """The simulated step (2 blocks of Llama3-8B's head shapes, 64K tokens on 2 ranks, bf16,
    checkpointed, inputs offloaded): offloaded, the kept outputs add exactly the formula's bytes per
    block to the host arena and nothing to the device peak; kept on the device, they raise
    its peak by at most that per block."""
    from upipe.model import get_config
    from upipe.planner.step import StepSimulator
    from upipe.train import TrainConfig

    model = dataclasses.replace(
        get_config("llama3-8b"), n_layers=2, hidden_size=512, ffn_dim=1792,
        head_dim=16, vocab_size=512,
    )  # fmt: skip
    kw = dict(
        strategy="upipe", nproc=2, dtype="bfloat16", activation_checkpoint=True, offload=True,
        plot=None,
    )  # fmt: skip
    steps = {}
    for mode in ("recompute", "keep", "offload"):
        with StepSimulator(TrainConfig(**kw, attention_outputs=mode), 2, model) as sim:
            steps[mode] = sim.step(65536)
    per_layer = _per_layer_bytes(1, 32768, 32, 16, 2)
    rec, keep, off = steps["recompute"], steps["keep"], steps["offload"]
    assert off.host_peak_bytes - rec.host_peak_bytes == 2 * per_layer
    assert off.peak_bytes == rec.peak_bytes and keep.host_peak_bytes == rec.host_peak_bytes
    assert rec.peak_bytes < keep.peak_bytes <= rec.peak_bytes + 2 * per_layer


@pytest.mark.slow
def test_feature_tokens_and_recommend():
    """`keep` and `aoff` in --features (upipe plan's grammar); `--recommend` picks kept
    attention outputs when they fit: the step without the recomputed attention forward is
    the faster."""
    from upipe.model import get_config
    from upipe.planner.plan import PlanConfig, candidates, feature_set
    from upipe.planner.recommend import GRID, RecommendConfig, recommend

    assert feature_set("on+keep")["attention_outputs"] == "keep"
    assert feature_set("on+aoff")["attention_outputs"] == "offload"
    assert "attention_outputs" not in feature_set("on")
    assert {"on+keep", "on+aoff", "on+fsdp-offload+aoff"} <= set(GRID)
    pc = PlanConfig(model="tiny", gpus=2, strategies=("ulysses", "none"), jobs=1)
    pc = dataclasses.replace(pc, features=("recompute+keep", "keep", "recompute+aoff"))
    rows = {label: problem for label, _, problem in candidates(pc, get_config("tiny"))}
    assert rows["ulysses +recompute+keep"] is None
    assert "add --activation-checkpoint" in rows["ulysses +keep"]
    assert "add --offload" in rows["ulysses +recompute+aoff"]
    assert "--strategy none runs the model's own attention" in rows["none +recompute+keep"]
    with pytest.raises(ValueError, match="unknown 'kept'"):
        feature_set("on+kept")

    pc = dataclasses.replace(
        pc, strategies=("ulysses",), features=("recompute", "recompute+keep"), granularity=64,
        reserve_gib=0, gpu_memory_gib=1,
    )  # fmt: skip
    rc = RecommendConfig(recommend=True, seq_len=8192)
    roomy = recommend(pc, rc)
    assert roomy["pick"] == roomy["fastest"] == "ulysses +recompute+keep"
    row = {r["strategy"]: r for r in roomy["candidates"]}
    kept, again = row["ulysses +recompute+keep"], row["ulysses +recompute"]
    assert kept["seconds"]["attention"] < again["seconds"]["attention"]
    assert "--attention-outputs keep" in roomy["command"]
    # the price: a higher peak (a budget below it and the recomputation is picked, as any
    # candidate that does not fit is passed over: tests/runs/test_timing.py)
    assert kept["peak_bytes"] > again["peak_bytes"]


@pytest.mark.parametrize(
    "strategy,dtype",
    [("upipe", torch.bfloat16), ("ulysses", torch.float32), ("ring", torch.bfloat16)],
)
def test_cuda_path(clusters, strategy, dtype):
    """The CUDA kernels' path (`backend="cuda"`, emulated on CPU: flash for bf16, the
    memory-efficient kernel for fp32): keep is recompute bit for bit, with half the forward
    kernel calls."""
    for same, n_recompute, n_keep in clusters(2).run(cuda_path, strategy, dtype):
        assert same and n_keep > 0 and 2 * n_keep == n_recompute
