"""upipe's memory features on Hugging Face models (`apply_context_parallel(tiled_mlp=...,
chunked_loss=..., activation_checkpoint=..., offload=...)`): loss and every parameter
gradient against the unmodified model on one process."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

import hf_memory_workers as W  # noqa: E402
from hf_workers import SEQ  # noqa: E402
from tolerances import TOL, grad_errors  # noqa: E402

TOL32 = TOL[torch.float32]
ALL = dict(tiled_mlp=True, mlp_tile=8, chunked_loss=True, loss_chunk=12, activation_checkpoint=True)
MHA = {"num_key_value_heads": 8}


@functools.cache
def _reference(arch, bounds=None, config=()):
    return W.reference_loss_and_grads(arch, bounds, **dict(config))


def _check(results, reference, *, logits_none):
    loss, grads, _ = reference
    for r_loss, r_grads, no_logits, _ in results:
        assert abs(r_loss.item() - loss.item()) <= 1e-6 * loss.item(), (r_loss, loss)
        assert no_logits == logits_none
        assert list(r_grads) == list(grads)
    errs = grad_errors({n: sum(r[1][n] for r in results) for n in grads}, grads)
    assert max(errs.values()) < TOL32["bwd"], errs


CASES = [  # (arch, world, options, run): each feature alone, then together
    ("llama", 2, dict(tiled_mlp=True, mlp_tile=8), {}),
    ("qwen3", 4, dict(chunked_loss=True, loss_chunk=5), {}),
    ("qwen2", 2, dict(activation_checkpoint=True), {}),
    ("llama", 4, dict(activation_checkpoint=True, blocks_per_checkpoint=2), {}),
    ("mistral", 2, ALL, {}),
    ("llama", 4, dict(ALL, config=MHA), {}),
    ("qwen3", 2, dict(ALL, blocks_per_checkpoint=2, offload=True), {"offload": True}),
    ("llama", 2, dict(ALL, offload=True, keep_on_gpu=1), {"offload": True}),
    ("qwen2", 4, ALL, {"num_items": True}),
    # MoE blocks in tiles (routing per token), OLMo's post-norm layers, Phi-3's fused qkv
    ("mixtral", 2, ALL, {}),
    ("qwen3_moe", 4, dict(ALL, blocks_per_checkpoint=2), {}),
    ("olmo2", 2, ALL, {}),
    ("olmo3", 4, dict(tiled_mlp=True, mlp_tile=8, activation_checkpoint=True), {}),
    ("phi3", 4, ALL, {}),
]


@pytest.mark.parametrize("arch,world,options,run", CASES)
def test_features_match_unmodified_model(clusters, arch, world, options, run):
    config = tuple(options.get("config", {}).items())
    reference = _reference(arch, None, config)
    results = clusters(world).run(W.run_with_features, arch, reference[2], dict(options), run)
    if "num_items" in run:  # each rank's share of the mean: the shares add up to it
        total = sum(r[0] for r in results)
        results = [(total, *r[1:]) for r in results]
    _check(results, reference, logits_none=options.get("chunked_loss", False))
    m = options.get("blocks_per_checkpoint", 1)
    # attention runs once in forward and once more in the checkpoint's recompute; in a
    # segment all but the last layer once more, to rebuild the next one's input
    per_layer = [1] if not options.get("activation_checkpoint") else [3] * (m - 1) + [2]
    assert results[0][3] == (per_layer * 2)[:2]


@pytest.mark.parametrize("world", [2, 4])
def test_packed_documents_with_every_feature(clusters, world):
    bounds = (0, 5, 6, 30, SEQ)
    reference = _reference("llama", bounds)
    run = {"packed": bounds}
    results = clusters(world).run(W.run_with_features, "llama", reference[2], dict(ALL), run)
    _check(results, reference, logits_none=True)


@pytest.mark.parametrize(
    "world,options,run",
    [
        (2, dict(ALL, attention_outputs="keep"), {}),
        (4, dict(ALL, blocks_per_checkpoint=2, attention_outputs="keep"), {}),
        (2, dict(ALL, offload=True, attention_outputs="offload"), {"offload": True}),
    ],
)
def test_kept_attention_outputs_are_bit_identical(clusters, world, options, run):
    """attention_outputs="keep" / "offload": the recomputation reuses each attention call's
    outputs -- the same loss and gradients, bit for bit, as recomputing them."""
    reference, run = _reference("qwen3"), dict(run, kernel_calls=True)
    kept = clusters(world).run(W.run_with_features, "qwen3", reference[2], dict(options), run)
    plain = dict(options, attention_outputs="recompute")
    recomputed = clusters(world).run(W.run_with_features, "qwen3", reference[2], plain, run)
    for (loss, grads, _, k), (loss_r, grads_r, _, r) in zip(kept, recomputed, strict=True):
        assert torch.equal(loss, loss_r)
        assert all(torch.equal(grads[n], grads_r[n]) for n in grads_r)
        # kernel calls (forward, backward): recomputing, a segment of m layers runs 3m - 1
        # layer forwards (the first m - 1 once more, to rebuild the next input); kept, only
        # the m of the forward call the kernel
        m = options.get("blocks_per_checkpoint", 1)
        assert k[1] == r[1] and k[0] * (3 * m - 1) == r[0] * m, (k, r)
    _check(kept, reference, logits_none=True)


def test_transformers_gradient_checkpointing_is_taken_over(clusters):
    """gradient_checkpointing_enable() with upipe's features: each layer recomputed once (by
    upipe), not twice; the same loss and gradients."""
    reference = _reference("llama")
    opts = dict(tiled_mlp=True, mlp_tile=8, chunked_loss=True, loss_chunk=12)
    results = clusters(2).run(W.run_with_features, "llama", reference[2], opts, {"hf_gc": True})
    _check(results, reference, logits_none=True)
    assert results[0][3] == [2, 2]


@pytest.mark.parametrize("dropin", ["upipe", "deepspeed"])
def test_deepspeed_dropin_with_upipe_features(clusters, dropin):
    """ALST's recipe with upipe's pieces: the drop-in attention for `UlyssesSPAttentionHF`
    (or DeepSpeed's own), plus upipe's tiled MLP, chunked loss and checkpointing
    (`apply_memory_features`)."""
    pytest.importorskip("deepspeed")
    reference = _reference("llama")
    results = clusters(2).run(W.dropin_with_features, reference[2], dict(ALL), dropin)
    _check(results, reference, logits_none=True)


ERRORS = {
    "offload_alone": "offload=True keeps the checkpointed block inputs on the host; add "
    "activation_checkpoint=True",
    "outputs_alone": "attention_outputs= keep hands each attention layer's forward outputs",
    "keep_all": "keep_on_gpu=2 keeps all 2 checkpoints (2 layers / 1 per checkpoint) on the GPU",
    "segments_alone": "blocks_per_checkpoint=2 needs activation_checkpoint=True",
    "tile": "mlp_tile must be >= 1, got 0",
    "backend": "unknown attention backend 'nope'",
    "head_not_linear": "lm_head as a torch.nn.Linear, got Sequential: use chunked_loss=False",
    "twice": "upipe's memory features were already applied to this model",
    "return_dict": "return_dict=False with chunked_loss=True",
    "logits_to_keep": "logits_to_keep=1 with labels=",
    "hidden_states": "output_hidden_states=True is not supported",
}


def test_bad_options_raise_on_every_rank(clusters):
    found = clusters(2).run(W.feature_errors, tuple(ERRORS))
    for rank, by_case in enumerate(found):
        for case, expected in ERRORS.items():
            assert by_case[case] is not None, f"rank {rank}: {case} did not raise"
            assert expected in by_case[case], (rank, case, by_case[case])


def test_chunked_loss_through_a_sharded_lm_head(clusters):
    """lm_head an FSDP2 unit of its own, sharded outside its call: its gradient is the full
    one on every rank (the loss runs inside lm_head's call)."""
    reference = _reference("llama")
    results = clusters(2).run(W.fsdp2_head_alone, reference[2], dict(ALL))
    loss, grads, _ = reference
    for r_loss, r_grads, _, _ in results:
        assert abs(r_loss.item() - loss.item()) <= 1e-6 * loss.item()
        errs = grad_errors(r_grads, grads)
        assert max(errs.values()) < TOL32["bwd"], errs
