"""Per-rank functions for tests/test_hf_memory.py (module-level: spawned ranks import them)."""

from __future__ import annotations

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
    out = model(**batch, labels=labels, shift_labels=labels, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if "offload" in run:
        arena = model.upipe_memory.offload.arena
        assert arena is not None and arena.numel() == (n + m - 1) * labels.numel() * 64
    return out.loss.detach(), grads, out.logits is None, calls
