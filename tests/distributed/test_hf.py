"""Hugging Face integration: converted models against the unmodified model on one process."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

import hf_workers as W  # noqa: E402
from tolerances import TOL, grad_errors, rel_err  # noqa: E402

ARCHS = tuple(W.ARCHITECTURES)
TOL32 = TOL[torch.float32]


@functools.cache
def _reference(arch):
    return W.reference(arch)


@functools.cache
def _packed_reference(arch):
    return W.packed_reference(arch)


def _check(results, arch, reference=_reference):
    """Logits (blocks concatenated by rank), loss and summed gradients vs the reference."""
    logits, loss, grads, _ = reference(arch)
    errs = {
        "logits": rel_err(torch.cat([r[0] for r in results], dim=1), logits),
        "loss": max(abs(r[1].item() - loss.item()) / loss.item() for r in results),
    }
    for r in results:  # same parameters, same names: the weights were taken over, not copied
        assert list(r[2]) == list(grads)
    summed = {n: sum(r[2][n] for r in results) for n in grads}
    errs["grads"] = max(grad_errors(summed, grads).values())
    assert errs["logits"] < TOL32["fwd"], errs
    assert errs["loss"] < TOL32["fwd"], errs
    assert errs["grads"] < TOL32["bwd"], errs
    return errs


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", ["upipe", "ulysses"])
@pytest.mark.parametrize("arch", ARCHS)
def test_matches_unmodified_model(clusters, arch, strategy, world):
    # alternate loading the checkpoint before and after the conversion
    load_after = (ARCHS.index(arch) + world) % 2 == 0
    state = _reference(arch)[3]
    results = clusters(world).run(W.run_context_parallel, arch, strategy, state, load_after)
    assert f"strategy='{strategy}'" in results[0][3]
    _check(results, arch)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_mesh_2x2_matches_unmodified_model(clusters, arch):
    state = _reference(arch)[3]
    results = clusters(4).run(W.run_context_parallel, arch, "upipe", state, False, (2, 2))
    _check(results, arch)


@pytest.mark.parametrize(
    ("arch", "strategy", "world"),
    [
        ("llama", "upipe", 4),
        ("qwen3", "ulysses", 2),
        ("olmo2", "upipe", 4),
        ("phi3", "upipe", 2),
        ("qwen3_moe", "ulysses", 2),
        ("mixtral", "upipe", 4),
    ],
)
def test_packed_documents_match_each_document_alone(clusters, arch, strategy, world):
    """Packed rows (position ids restarting per document, boundaries from shard_batch) equal
    the unmodified model run on each document separately: logits, loss, gradients."""
    state = _packed_reference(arch)[3]
    results = clusters(world).run(W.run_packed, arch, strategy, state)
    _check(results, arch, reference=_packed_reference)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_loss_is_transformers_loss(clusters, world):
    """causal_lm_loss and the model's own loss (labels= with shift_labels=) are the same
    number on every rank: total / count, transformers' formula -- on one process, given the
    unmodified model's logits, exactly its loss. With num_items_in_batch each rank returns
    its share, as transformers' loss does; the shares add up to the loss."""
    logits, loss, _, state = _reference("llama")
    results = clusters(world).run(W.model_losses, "llama", state, logits)
    ours, own, _, on_reference = results[0]
    for r in results:  # bit for bit the same on every rank
        assert (r[0], r[1], r[3]) == (ours, own, on_reference)
    assert own == ours
    if world == 1:
        assert on_reference == loss.item()
    for value in (ours, on_reference, sum(r[2] for r in results)):
        assert abs(value - loss.item()) / loss.item() < TOL32["fwd"]


ERRORS = {
    "dynamic_rope": "rope type 'dynamic' is not supported",
    "unsupported_model": "LlamaModel is not supported",
    "heads": "heads_per_stage (3)",
    "padding": "attention_mask with padding is not supported",
    "padding_rank0": "attention_mask with padding is not supported",
    "no_positions": "position_ids are required",
    "labels": "labels= would give a loss over this rank's tokens only",
    "shift_labels_shape": "shift_labels must be this rank's [2, 32] labels",
    "autocast": "autocast (mixed precision",
    "packed": "packed sequences",
    "documents_vs_positions": "position_ids do not restart at 0 at the documents",
}


def test_unsupported_raise_on_every_rank(clusters):
    found = clusters(2).run(W.expect_errors, tuple(ERRORS))
    for rank, by_case in enumerate(found):
        for case, expected in ERRORS.items():
            assert by_case[case] is not None, f"rank {rank}: {case} did not raise"
            assert expected in by_case[case], (rank, case, by_case[case])


def test_import_needs_no_transformers():
    import subprocess
    import sys

    code = "import sys, upipe.integrations.hf; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
