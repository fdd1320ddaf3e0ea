"""The architectures beyond Llama/Qwen (upipe.integrations.hf_archs, hf_moe): sliding windows
shorter than the sequence, Gemma 3 and gpt-oss against the unmodified transformers model
(every strategy, packed documents, the memory features), the router aux loss of MoE models
over a split sequence, and the refusals of what is not supported. (Parity of the
architectures without windows: tests/distributed/test_hf.py.)"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

import hf_arch_workers as W  # noqa: E402
import hf_workers  # noqa: E402
from tolerances import TOL, rel_err  # noqa: E402

TOL32 = TOL[torch.float32]
LOSS_TOL = 1e-6  # relative, fp32: the converted model's loss vs the unmodified model's

# the memory features all at once: MLP and loss in tiles, checkpoints keeping attention outputs
MEMORY = dict(
    tiled_mlp=True, mlp_tile=8, chunked_loss=True, loss_chunk=12, activation_checkpoint=True,
    attention_outputs="keep",
)  # fmt: skip


def _unmodified(arch, packed=False, dtype=torch.float32, router_sums=None):
    """`hf_workers.packed_reference` if `packed`, else `hf_workers.reference`."""
    run = hf_workers.packed_reference if packed else hf_workers.reference
    return run(arch, dtype=dtype, router_sums=router_sums)


_reference = functools.cache(_unmodified)


def _grad_errors(grads_by_rank: list, truth: dict, router_sums: dict) -> dict:
    """Per parameter, the error of the gradient summed over the ranks against float64:
    max|actual - ref| / max|ref| (a gradient judged against its own largest entry, with no
    floor: stricter than `grad_errors`' floor for model gradients, which are small) -- except a
    router's bias (gpt-oss), whose gradient is sum_t g_t over the tokens' router-logit gradients
    and cancels (|sum_t g_t| is 1/18 to 1/46 of sum_t |g_t| here): it is judged per expert
    against sum_t |g_t| (`hf_workers.summing_router_grads`), the scale of the fp32 rounding
    any order of that sum has. (Against its own largest entry it is 1.7e-5 to 3.1e-5 off
    float64 where the unmodified fp32 model is 0.97e-5, though the per-token g_t are as close
    in both -- 2.8e-6 (unmodified) and 3.0e-6 to 4.6e-6 (converted) of their largest entry --
    and the unmodified model's own sums over 16-token blocks are off by up to 1.7e-5 of the
    whole sum's largest entry: a random walk of rounding, which its full sum happens to
    cancel; measured 2026-12-07.)"""
    errs = {}
    for n, ref in truth.items():
        actual = sum(r[n] for r in grads_by_rank)
        if n in router_sums:
            diff = (actual.double() - ref.double()).abs()
            errs[n] = (diff / router_sums[n].double().clamp_min(1e-300)).max().item()
        else:
            errs[n] = rel_err(actual, ref, scale=0.0)
    return errs


# Measured `_grad_errors` (2026-12-07), every case of both tests: at most 5.9e-6, router biases
# at most 1.0e-6. Another CPU rounds fp32 otherwise (vector width, blocking), and the
# unmodified fp32 model itself is up to 1.1e-5 off float64 on other batches of the same size
# (a q_proj weight): a gradient may be OWN_ERROR_FACTOR x the unmodified fp32 model's own
# `_grad_errors` here where that exceeds 1e-5.
OWN_ERROR_FACTOR = 5


def _allowed(own: dict, truth: dict, router_sums: dict) -> dict:
    """Per parameter, the `_grad_errors` allowed in fp32: 1e-5, or OWN_ERROR_FACTOR x the
    unmodified fp32 model's own error where that is larger."""
    own_errs = _grad_errors([own], truth, router_sums)
    return {n: max(TOL32["bwd"], OWN_ERROR_FACTOR * e) for n, e in own_errs.items()}


@functools.cache
def _truth(arch, packed):
    """The unmodified model in float64 (same weights), and the errors allowed (`_allowed`)."""
    sums = {}
    truth = _unmodified(arch, packed, torch.float64, router_sums=sums)
    return truth, sums, _allowed(_reference(arch, packed)[2], truth[2], sums)


def _cases(world):
    """(strategy, packed, options, mesh shape) of one cluster call."""
    cases = [
        ("upipe", False, {}, None),
        ("ulysses", False, {}, None),
        ("ring", False, {}, None),
        ("upipe", True, {}, None),
        ("ring" if world == 4 else "ulysses", True, MEMORY, None),
        ("upipe", False, MEMORY, None),
    ]
    return cases + [("upipe", True, {}, (2, 2))] if world == 4 else cases  # UPipe x ring


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("arch", tuple(hf_workers.WINDOWED))
def test_windowed_architectures_match_unmodified_model(clusters, arch, world):
    """Sliding windows (12 tokens) shorter than each shard and the sequence, Gemma 3 (softmax
    scale, (1 + w) norms, sandwich norms, a RoPE per layer type) and gpt-oss (sinks, biases,
    experts): the converted model's loss within 1e-6 (relative) of the unmodified model's in
    float64, its logits and every parameter gradient (summed over the ranks) within 1e-5
    (`_grad_errors`, `_allowed`) -- under every strategy, with packed documents (against the
    model run on each document alone), and with the memory features; the window is not
    ignored (the model without it computes another loss)."""
    state = _reference(arch)[3]
    cases = _cases(world)
    results = clusters(world).run(W.run_cases, arch, state, cases)
    for i, (strategy, packed, options, mesh) in enumerate(cases):
        (logits, loss, grads, _), router_sums, allowed = _truth(arch, packed)
        case = (strategy, packed, bool(options), mesh)
        per_rank = [r[i] for r in results]
        for _, r_loss, r_grads in per_rank:
            assert abs(r_loss.item() - loss.item()) <= LOSS_TOL * loss.item(), (case, r_loss, loss)
            assert list(r_grads) == list(grads), case  # the model's own parameters
        if not options.get("chunked_loss"):
            got = torch.cat([r[0] for r in per_rank], dim=1)  # contiguous blocks, by rank
            assert rel_err(got, logits) < TOL32["fwd"], case
        errs = _grad_errors([r[2] for r in per_rank], grads, router_sums)
        assert all(errs[n] <= allowed[n] for n in grads), (case, errs, allowed)
    unwindowed = hf_workers.build_model(arch, sliding_window=hf_workers.SEQ)
    ids = hf_workers.make_batch()
    other = unwindowed(input_ids=ids, labels=ids).loss.item()
    loss = _reference(arch)[1].item()
    assert abs(other - loss) > 1e-3 * loss, (other, loss)


@functools.cache
def _router_reference(arch):
    """The unmodified model with output_router_logits=True in fp32, its gradients in float64
    (same weights), its routers' sum_t |g_t| (`_grad_errors`), and the errors allowed
    (`_allowed`)."""
    sums = {}
    truth = W.router_reference(arch, torch.float64, router_sums=sums)[2]
    fp32 = W.router_reference(arch)
    return fp32, truth, sums, _allowed(fp32[2], truth, sums)


@pytest.mark.parametrize(
    ("arch", "world", "options"),
    [
        ("qwen3_moe", 2, {}),
        ("mixtral", 4, {}),
        ("mixtral", 2, dict(chunked_loss=True, loss_chunk=12)),
        ("gpt_oss", 4, dict(chunked_loss=True, loss_chunk=12)),  # with windows and sinks
    ],
)
def test_router_aux_loss_is_the_whole_sequence_s(clusters, arch, world, options):
    """output_router_logits=True: every rank's aux loss is the unmodified model's over the
    whole sequence (not transformers' over the rank's shard, which differs), and the loss
    with coef * aux are the unmodified model's, and every gradient (summed over the ranks) is
    within 1e-5 of the float64 model's (`_grad_errors`, `_allowed`)."""
    (loss, aux, grads, state), truth, router_sums, allowed = _router_reference(arch)
    results = clusters(world).run(W.run_router_loss, arch, state, options)
    for r_loss, r_aux, r_grads, shard_aux in results:
        assert abs(r_aux.item() - aux.item()) <= TOL32["fwd"] * aux.item(), (r_aux, aux)
        assert abs(r_loss.item() - loss.item()) <= TOL32["fwd"] * loss.item(), (r_loss, loss)
        # transformers' aux over the shard alone would fail the first check by far
        assert abs(shard_aux.item() - aux.item()) > 10 * TOL32["fwd"] * aux.item()
        assert list(r_grads) == list(grads)
    errs = _grad_errors([r[2] for r in results], truth, router_sums)
    assert all(errs[n] <= allowed[n] for n in truth), (errs, allowed)


ERRORS = {
    "gemma2": "Gemma2ForCausalLM is not supported: its attention logit soft-capping "
    "(attn_logit_softcapping=50.0: tanh on every score)",
    "gemma3_multimodal": "Gemma3ForConditionalGeneration is not supported: the image tokens",
    "softcapping": "attn_logit_softcapping=20.0 (tanh on every attention score) is not supported",
    "bidirectional": "use_bidirectional_attention=True is not supported",
    "final_softcapping_chunked": "final_logit_softcapping=30.0 with chunked_loss=True",
    "aux_with_tiles": "output_router_logits=True (the router aux loss) with tiled_mlp",
    "aux_rank0": "router aux loss",
    "jitter": "router_jitter_noise=0.1 with tiled_mlp / activation_checkpoint",
    "memory_features_window": "sliding-window attention is not supported by "
    "apply_memory_features (another library's attention, no mask): the sequence (64 tokens) "
    "is longer than config.sliding_window (12)",
}


def test_unsupported_raise_on_every_rank(clusters):
    found = clusters(2).run(W.arch_errors, tuple(ERRORS))
    for rank, by_case in enumerate(found):
        for case, expected in ERRORS.items():
            assert by_case[case] is not None, f"rank {rank}: {case} did not raise"
            assert expected in by_case[case], (rank, case, by_case[case])
