"""Hybrid decoders (Gated DeltaNet layers and gated full attention: Qwen3-Next, Qwen3.5,
Qwen3.5-MoE) converted by apply_context_parallel, against the unmodified model on one
process: loss and every parameter gradient, Ulysses and UPipe, packed documents, the router
aux loss, the memory options; and the refusals."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

import hybrid_workers as W  # noqa: E402
from tolerances import TOL, grad_errors  # noqa: E402

LOSS_TOL = 1e-6  # relative, fp32 (the bar; the measured errors are below 1e-7)
GRAD_TOL = TOL[torch.float32]["bwd"]
FEATURES = dict(tiled_mlp=True, mlp_tile=24, chunked_loss=True, loss_chunk=24,
                activation_checkpoint=True, model_loss=True)  # fmt: skip


@functools.cache
def _reference(arch, packed=False, router=False):
    return W.reference(arch, packed, router)


# per world size and architecture: (strategy, heads_per_stage, packed, options)
CASES = {
    2: {
        "qwen3_next": [
            ("upipe", None, False, {}),
            ("ulysses", None, True, {}),
            ("upipe", None, False, {"router": True}),  # the aux loss over the whole sequence
            # stage inputs kept for backward, under checkpointing (saved through its hooks)
            (
                "upipe",
                4,
                True,
                {**FEATURES, "blocks_per_checkpoint": 2, "linear_stage_inputs": "keep"},
            ),
            (
                "ulysses",
                None,
                False,
                {"activation_checkpoint": True, "attention_outputs": "keep", "offload": True},
            ),
        ],  # fmt: skip
        "qwen3_5": [("ulysses", None, False, {}), ("upipe", None, True, {})],
        "qwen3_5_moe": [("upipe", None, True, {}), ("ulysses", None, False, {})],
    },
    4: {
        "qwen3_next": [("ulysses", None, False, {}), ("upipe", None, True, {})],
        # 6 value heads over 3 key heads: uneven on 4 ranks
        "qwen3_5": [
            ("upipe", None, False, {}),
            ("ulysses", None, True, {}),
            ("upipe", None, True, {**FEATURES, "linear_heads_per_stage": 8}),
        ],  # fmt: skip
        "qwen3_5_moe": [("upipe", None, False, FEATURES), ("ulysses", None, True, {})],
    },
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("arch", list(W.ARCHITECTURES))
def test_matches_unmodified_model(clusters, arch, world):
    """Loss within 1e-6 and every parameter gradient (summed over the ranks) within 1e-5 of
    the unmodified model's -- on each document alone for packed rows."""
    cases = CASES[world][arch]
    results = clusters(world).run(W.run_cases, arch, _reference(arch)[2], cases)
    for i, (strategy, _, packed, options) in enumerate(cases):
        loss, grads, _ = _reference(arch, packed, options.get("router", False))
        per_rank = [r[i] for r in results]
        for r_loss, r_grads, layer in per_rank:
            assert abs(r_loss.item() - loss.item()) <= LOSS_TOL * loss.item(), (cases[i], r_loss)
            assert list(r_grads) == list(grads)  # the model's own parameters, by name
            assert f"strategy='{strategy}'" in layer
        errs = grad_errors({n: sum(r[1][n] for r in per_rank) for n in grads}, grads)
        worst = max(errs, key=errs.get)
        assert errs[worst] < GRAD_TOL, (cases[i], worst, errs[worst])


ERRORS = {
    "ring": "strategy='ring' is not supported for hybrid models",
    "mesh_ring": "a mesh with a ring dim of 2 is not supported for hybrid models",
    "value_heads": "value heads (2) must be at least the context-parallel size (4)",
    "stages": "Gated DeltaNet (4 value heads, 2 key heads): heads_per_stage (3)",
    "stage_inputs": "linear_stage_inputs must be one of ('recompute', 'keep'), got 'drop'",
    "key_heads": "key heads (3) must divide value heads (4); valid key heads: [1, 2, 4]",
    "activation": "with activation 'gelu' is not supported",
    "vision": "convert its text model, Qwen3_5ForCausalLM",
    "documents_rank0": "cu_seqlens must start at 0 and end at the full sequence length 128",
}


def test_refusals_raise_on_every_rank(clusters):
    found = clusters(4).run(W.hybrid_errors, tuple(ERRORS))
    for rank, by_case in enumerate(found):
        for case, expected in ERRORS.items():
            assert by_case[case] is not None, f"rank {rank}: {case} did not raise"
            assert expected in by_case[case], (rank, case, by_case[case])
