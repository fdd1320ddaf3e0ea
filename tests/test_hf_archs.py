"""The architectures beyond Llama/Qwen (upipe.integrations.hf_archs, hf_moe): the router aux
loss of MoE models over a split sequence, the memory features through MoE blocks and OLMo's
post-norm layers, and the refusals of what is not supported yet. (Parity of each architecture
with its unmodified model: tests/test_hf.py.)"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

import hf_arch_workers as W  # noqa: E402
from conftest import TOL, grad_errors  # noqa: E402

TOL32 = TOL[torch.float32]


@functools.cache
def _router_reference(arch):
    return W.router_reference(arch)


@pytest.mark.parametrize(
    ("arch", "world", "options"),
    [
        ("qwen3_moe", 2, {}),
        ("mixtral", 4, {}),
        ("mixtral", 2, dict(chunked_loss=True, loss_chunk=12)),
    ],
)
def test_router_aux_loss_is_the_whole_sequence_s(clusters, arch, world, options):
    """output_router_logits=True: every rank's aux loss is the unmodified model's over the
    whole sequence (not transformers' over the rank's shard, which differs), and the loss
    with coef * aux and every gradient (summed over the ranks) are the unmodified model's."""
    loss, aux, grads, state = _router_reference(arch)
    results = clusters(world).run(W.run_router_loss, arch, state, options)
    for r_loss, r_aux, r_grads, shard_aux in results:
        assert abs(r_aux.item() - aux.item()) <= TOL32["fwd"] * aux.item(), (r_aux, aux)
        assert abs(r_loss.item() - loss.item()) <= TOL32["fwd"] * loss.item(), (r_loss, loss)
        # transformers' aux over the shard alone would fail the first check by far
        assert abs(shard_aux.item() - aux.item()) > 10 * TOL32["fwd"] * aux.item()
        assert list(r_grads) == list(grads)
    errs = grad_errors({n: sum(r[2][n] for r in results) for n in grads}, grads)
    assert max(errs.values()) < TOL32["bwd"], errs


ERRORS = {
    "gpt_oss": "GptOssForCausalLM needs attention sinks (a learned sink logit per head, "
    "self_attn.sinks) and sliding-window layers (layer_types: 1 of 2 'sliding_attention', "
    "sliding_window=16), not supported yet",
    "gemma3": "Gemma3ForCausalLM needs sliding-window layers",
    "gemma3_full": "Gemma3ForCausalLM needs the softmax scale query_pre_attn_scalar ** -0.5",
    "aux_with_tiles": "output_router_logits=True (the router aux loss) with tiled_mlp",
    "aux_rank0": "router aux loss",
    "jitter": "router_jitter_noise=0.1 with tiled_mlp / activation_checkpoint",
    "olmo3_window": "longer than config.sliding_window (16)",
}


def test_unsupported_raise_on_every_rank(clusters):
    found = clusters(2).run(W.arch_errors, tuple(ERRORS))
    for rank, by_case in enumerate(found):
        for case, expected in ERRORS.items():
            assert by_case[case] is not None, f"rank {rank}: {case} did not raise"
            assert expected in by_case[case], (rank, case, by_case[case])
