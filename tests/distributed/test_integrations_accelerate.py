"""A converted Hugging Face model under FSDP2 as accelerate applies it (`fsdp_version: 2`):
accelerate's own `fsdp2_apply_ac` and `fsdp2_prepare_model` on 2 gloo ranks -- accelerate
itself sets up FSDP on accelerator devices only and runs DDP on the CPU (docs/hf.md) -- with
upipe's memory features: the loss and every parameter's gradient against the unmodified model
on one process, and accelerate's activation checkpointing with upipe's refused."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import hf_memory_workers  # noqa: E402
import trainer_workers as W  # noqa: E402
from tolerances import TOL, grad_errors  # noqa: E402

TOL32 = TOL[torch.float32]
# accelerate's FSDP2 units: the root, each decoder layer, the embedding, the tail group
UNITS = ["", "lm_head", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]


@functools.cache
def _reference():
    return hf_memory_workers.reference_loss_and_grads("llama")


@pytest.mark.parametrize(
    "options,accelerate_ac,calls",
    [
        # upipe's checkpointing (and offload) inside accelerate's FSDP2 units: one recompute
        (dict(W.FEATURES, activation_checkpoint=True, offload=True), False, [2, 2]),
        # accelerate's checkpointing around upipe's layers (tiled MLP, chunked loss)
        (W.FEATURES, True, [2, 2]),
    ],
)
def test_fsdp2_as_accelerate_applies_it(clusters, options, accelerate_ac, calls):
    loss, grads, state = _reference()
    results = clusters(2).run(W.fsdp2_like_accelerate, state, dict(options), accelerate_ac)
    for r_loss, r_grads, r_calls, units in results:
        assert units == UNITS, units
        assert abs(r_loss.item() - loss.item()) <= TOL32["fwd"] * loss.item(), (r_loss, loss)
        assert list(r_grads) == list(grads)
        errors = grad_errors(r_grads, grads)
        assert max(errors.values()) < TOL32["bwd"], errors
        assert r_calls == calls  # forward, and once more in backward


@pytest.mark.parametrize(
    "options,hf_checkpointing,ours,fix",
    [
        (dict(W.FEATURES, activation_checkpoint=True), False, "activation_checkpoint=True",
         "activation_checkpoint=False"),
        (W.FEATURES, True, "transformers' gradient checkpointing, which upipe takes over",
         "gradient_checkpointing=False"),
    ],
)  # fmt: skip
def test_accelerate_and_upipe_checkpointing_together_raise_on_every_rank(
    clusters, options, hf_checkpointing, ours, fix
):
    state = _reference()[2]
    results = clusters(2).run(W.fsdp2_like_accelerate, state, options, True, hf_checkpointing)
    for message in results:
        assert isinstance(message, str), message
        assert "checkpoint_wrapper (accelerate's fsdp_activation_checkpointing)" in message
        assert f"({ours}): each layer would be recomputed twice" in message
        assert "fsdp_activation_checkpointing: false" in message
        assert message.endswith(f"or {fix}")
