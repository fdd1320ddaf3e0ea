"""Per-rank functions for tests/distributed/test_hf_memory.py (module-level: spawned ranks import
them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from hf_workers import BATCH, SEQ, build_model, make_batch

from upipe.packing import document_positions


def reference_loss_and_grads(arch, bounds=None, **overrides):
    """The unmodified model on one process, fp32: its own loss (labels=), or with document
    `bounds` each document alone; the parameter gradients; the state dict."""
    import torch.nn.functional as F

    model = build_model(arch, **overrides)
    ids = make_batch()
    if bounds is None:
        loss = model(input_ids=ids, labels=ids).loss
    else:
        loss_sum, count = 0.0, 0
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            if b - a > 1:
                part = model(input_ids=ids[:, a:b]).logits
                loss_sum = loss_sum + F.cross_entropy(
                    part[:, :-1].flatten(0, 1), ids[:, a + 1 : b].flatten(), reduction="sum"
                )
                count += ids.shape[0] * (b - a - 1)
        loss = loss_sum / count
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, model.state_dict()


def run_with_features(rank, world_size, arch, state, options, run):
    """One forward + backward of the converted model with memory `options`, the loss from
    the model itself (labels= with shift_labels=). `run`: "packed" (documents), "hf_gc"
    (transformers' gradient checkpointing also on), "offload" (an Offloader set to run the
    offload path on the CPU), "num_items" (the Trainer's count given). Returns the loss, the
    gradients, whether logits came back, and the attention calls per layer."""
    from upipe.integrations.hf import apply_context_parallel, shard_batch
    from upipe.model.offload import Offloader

    group = dist.group.WORLD
    overrides = options.pop("config", {})
    model = build_model(arch, seed=123, **overrides)
    model.load_state_dict(state)
    apply_context_parallel(model, group=group, **options)
    if "hf_gc" in run:
        model.gradient_checkpointing_enable()
        model.train()
    if "offload" in run:
        m = options.get("blocks_per_checkpoint", 1)
        n = -(-len(model.model.layers) // m) - options.get("keep_on_gpu", 0)
        model.upipe_memory.offload = Offloader(n, "cpu", scratch=m - 1)
    calls = [0] * len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    positions = None
    if "packed" in run:
        positions = document_positions(run["packed"], SEQ).expand(BATCH, SEQ)
    batch = shard_batch(make_batch(), position_ids_BS=positions, group=group)
    labels = batch.pop("labels")
    kw = {}
    if "num_items" in run:
        count = (labels != -100).sum()
        dist.all_reduce(count, group=group)
        kw["num_items_in_batch"] = count
    from kept_workers import KernelCalls

    kernel = KernelCalls()
    with kernel:
        out = model(**batch, labels=labels, shift_labels=labels, **kw)
        out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if "offload" in run:
        arena = model.upipe_memory.offload.arena
        assert arena is not None and arena.numel() == (n + m - 1) * labels.numel() * 64
    if "kernel_calls" in run:
        calls = (kernel.forward, kernel.backward)
    return out.loss.detach(), grads, out.logits is None, calls


def feature_errors(rank, world_size, cases):
    """Each case -> the ValueError message it raised on this rank (None if it did not)."""
    from upipe.attention.common import forget_agreements

    found = {}
    for name in cases:
        forget_agreements()
        try:
            _feature_error(name, dist.group.WORLD)
            found[name] = None
        except ValueError as e:
            found[name] = str(e)
    return found


def _feature_error(name, group):
    from upipe.integrations.hf import apply_context_parallel, shard_batch

    model = build_model("llama")
    at_apply = {
        "offload_alone": dict(offload=True),
        "keep_all": dict(activation_checkpoint=True, offload=True, keep_on_gpu=2),
        "segments_alone": dict(blocks_per_checkpoint=2),
        "tile": dict(tiled_mlp=True, mlp_tile=0),
        "backend": dict(backend="nope"),
        "outputs_alone": dict(attention_outputs="keep"),
    }
    if name in at_apply:
        apply_context_parallel(model, group=group, **at_apply[name])
        return
    if name == "head_not_linear":
        model.lm_head = torch.nn.Sequential(model.lm_head)
        apply_context_parallel(model, group=group, chunked_loss=True)
        return
    if name == "twice":
        from upipe.integrations.hf_memory import apply_memory_features

        apply_context_parallel(model, group=group, tiled_mlp=True)
        apply_memory_features(model, group=group, tiled_mlp=True)
        return
    apply_context_parallel(model, group=group, chunked_loss=True, activation_checkpoint=True)
    batch = shard_batch(make_batch(), group=group)
    labels = batch.pop("labels")
    kw = dict(labels=labels, shift_labels=labels)
    if name == "return_dict":
        kw["return_dict"] = False
    elif name == "logits_to_keep":
        kw["logits_to_keep"] = 1
    elif name == "hidden_states" and dist.get_rank() == 0:  # every rank must still raise
        kw["output_hidden_states"] = True
    model(**batch, **kw)


def dropin_with_features(rank, world_size, state, options, dropin="upipe"):
    """tests/hf_workers' llama made sequence-parallel by upipe's drop-in for ALST
    (`UPipeSPAttentionHF.register_with_transformers`), or with `dropin="deepspeed"` by ALST's
    own `UlyssesSPAttentionHF`, with upipe's memory features added by
    `apply_memory_features`; the loss from the model (shift_labels=); returns the loss and
    the parameter gradients."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from deepspeed_workers import _init_deepspeed, forget_sequence_parallel_groups
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from upipe.integrations.deepspeed import UPipeSPAttentionHF
    from upipe.integrations.hf import shard_batch
    from upipe.integrations.hf_memory import apply_memory_features

    _init_deepspeed()
    group = dist.group.WORLD
    model = build_model("llama", seed=123, attn_implementation="sdpa").train()
    model.load_state_dict(state)
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    attention = {"upipe": UPipeSPAttentionHF, "deepspeed": UlyssesSPAttentionHF}[dropin]
    try:
        attention.register_with_transformers(
            model_name_or_path=model,
            core_attn_implementation="sdpa",
            sequence_parallel_size=world_size,
            micro_batch_size=BATCH,
            seq_length_is_variable=True,
        )
        apply_memory_features(model, group=group, **options)
        batch = shard_batch(make_batch(), group=group)
        labels = batch.pop("labels")
        out = model(**batch, labels=labels, shift_labels=labels)
        out.loss.backward()
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        forget_sequence_parallel_groups()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.loss.detach(), grads, out.logits is None, []


def fsdp2_head_alone(rank, world_size, state, options):
    """The converted model under FSDP2 with lm_head a unit of its own (each decoder layer one,
    the root holding the embedding and the final norm): the chunked loss goes through
    lm_head's call, so FSDP2 gathers its weight and reduce-scatters its gradient as on the
    logits' path. Returns the loss summed over the ranks and every parameter's full
    gradient."""
    from torch.distributed.fsdp import fully_shard

    from upipe.integrations.hf import apply_context_parallel, shard_batch

    group = dist.group.WORLD
    model = build_model("llama", seed=123)
    model.load_state_dict(state)
    apply_context_parallel(model, group=group, **options)
    for unit in [*model.model.layers, model.lm_head, model]:
        fully_shard(unit)
    batch = shard_batch(make_batch(), group=group)
    labels = batch.pop("labels")
    out = model(**batch, labels=labels, shift_labels=labels)
    (out.loss * world_size).backward()  # FSDP2 averages the gradients over the ranks
    loss = out.loss.detach().clone() / world_size
    dist.all_reduce(loss, group=group)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return loss, grads, True, []
