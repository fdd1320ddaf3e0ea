"""`--attention-outputs keep|offload`: a checkpoint's recomputation reuses the forward's
attention outputs (`upipe.attention.kept`) -- bit for bit the losses and gradients of
`recompute`, with no attention forward kernel in backward, in every strategy."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from kept_workers import forward_live_bytes, modes
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


@pytest.mark.parametrize(
    "kw,m",
    [
        ({"strategy": "upipe"}, 2),
        ({"strategy": "upipe"}, 3),  # segments of 3 and 1 of the 4 blocks
        ({"strategy": "ulysses"}, 2),
        ({"strategy": "ring"}, 3),
        ({"strategy": "usp"}, 2),
    ],
)
def test_segments_and_offload_bf16(clusters, kw, m):
    """Checkpoints of m blocks, bf16 compute with fp32 masters, 4 blocks: the segment's
    inner blocks are recomputed twice (their inputs without a graph, then each with grad),
    both from the forward's outputs; offloaded to a host arena beside the block inputs,
    the last checkpoint's kept on the device (--keep-on-gpu 1), the same bits."""
    cfg = small_config(**kw, seq_len=256, dtype="bfloat16", blocks_per_checkpoint=m)
    offload = {**OFFLOAD, "keep_on_gpu": 1}
    runs = {
        "recompute": (RECOMPUTE, False),
        "keep": (KEEP, False),
        "offload": (offload, True),
        "plain": ({**PLAIN, "blocks_per_checkpoint": 1}, False),
    }
    results = clusters(4).run(modes, cfg, runs, 4)
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
