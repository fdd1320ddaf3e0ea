"""upipe's drop-ins for DeepSpeed-Ulysses (`upipe.integrations.deepspeed`) against DeepSpeed's own
modules on identical inputs, and both against the float64 attention of the whole sequence."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")

import deepspeed_workers as W  # noqa: E402
import torch  # noqa: E402
from tolerances import TOL, TOL_SAME_KERNEL, grad_errors, rel_err  # noqa: E402
from workers import make_qkv, reference  # noqa: E402

from upipe.integrations.deepspeed import stage_heads  # noqa: E402

TOL32 = TOL[torch.float32]
MHA = dict(B=2, S=64, H=8, G=8, d=16)
GQA = dict(B=2, S=64, H=8, G=2, d=16)  # 4 query heads per kv head


def _check(results, shape):
    """Rank 0's gathered (out, dq, dk, dv) of both modules: the drop-in equals DeepSpeed's
    module (the same kernel on the same heads) and both the float64 truth."""
    ref = reference(*make_qkv(**shape))
    (ours, _), (theirs, _) = results[0]["upipe"], results[0]["deepspeed"]
    for name, a, b, truth in zip(("out", "dq", "dk", "dv"), ours, theirs, ref, strict=True):
        assert rel_err(a, b) < TOL_SAME_KERNEL, name
        assert rel_err(a, truth) < TOL32["fwd" if name == "out" else "bwd"], name
        assert rel_err(b, truth) < TOL32["fwd" if name == "out" else "bwd"], name


@pytest.mark.parametrize(
    ("shape", "seq_first", "U"),
    [
        (MHA, False, None),  # [B, L, n, d], one head per rank and stage
        (GQA, True, None),  # [L, B, n, d], one query head per rank: both get kv head 0
        (GQA, False, 4),  # two query heads per rank, one kv head each
    ],
)
def test_distributed_attention_dropin_equals_deepspeed(clusters, shape, seq_first, U):
    results = clusters(2).run(W.distributed_attention, shape, seq_first, U)
    _check(results, shape)


@pytest.mark.parametrize("shape", [MHA, GQA])
def test_alst_dropin_equals_deepspeed(clusters, shape):
    results = clusters(2).run(W.sp_attention_hf, shape, None)
    _check(results, shape)


def test_register_with_transformers_matches_unmodified_model(clusters):
    """`UPipeSPAttentionHF.register_with_transformers`, called as ALST's users call
    DeepSpeed's, makes a Hugging Face model sequence-parallel: its logits, loss and summed
    gradients equal the unmodified model's on one process."""
    import hf_workers

    logits, loss, grads, state = hf_workers.reference("llama")
    results = clusters(2).run(W.registered_hf_model, state)
    assert all(r[3] == "UPipeSPAttentionHF" for r in results)
    assert rel_err(torch.cat([r[0] for r in results], dim=1), logits) < TOL32["fwd"]
    assert abs(results[0][1].item() - loss.item()) / loss.item() < TOL32["fwd"]
    errs = grad_errors({n: sum(r[2][n] for r in results) for n in grads}, grads)
    assert max(errs.values()) < TOL32["bwd"], errs


def test_stages_hold_less_than_deepspeed(clusters):
    """Per-rank peak of the tensors allocated in forward+backward (q, k, v, dout made
    before), 2 ranks, 16 heads: 8 stages of U = 2 heads hold less than DeepSpeed's
    all-heads exchange."""
    shape = dict(B=1, S=1024, H=16, G=16, d=32)
    peaks = clusters(2).run(W.distributed_attention, shape, False, 2)
    ours = max(p["upipe"][1] for p in peaks)
    theirs = max(p["deepspeed"][1] for p in peaks)
    assert ours < 0.8 * theirs, (ours, theirs)


def test_stage_heads_gqa():
    # H=8, G=4 (g=2), C=4, U=4: one query head per rank; ranks 0, 1 share kv head 0
    assert [(first, kv.tolist()) for first, kv in stage_heads(8, 4, 4, 4)] == [
        (0, [0, 0, 1, 1]),
        (4, [2, 2, 3, 3]),
    ]
    # U=8: two query heads (one kv head) per rank, one stage
    assert [kv.tolist() for _, kv in stage_heads(8, 4, 4, 8)] == [[0, 1, 2, 3]]


def test_bad_heads_per_stage_raises_on_every_rank(clusters):
    for message in clusters(2).run(W.dropin_error, 3):
        assert message is not None and "heads_per_stage (3) must be a multiple" in message
        assert "valid heads_per_stage for H=8, G=8, C=2: [2, 4, 8]" in message
