"""Per-rank functions for tests/distributed/test_hf_archs.py (module-level: spawned ranks import
them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from hf_workers import (
    BASE_CONFIG,
    BATCH,
    PACKED_BOUNDS,
    SEQ,
    build_model,
    make_batch,
    model_in,
    summing_router_grads,
)

# the aux loss weighed heavily, so that a wrong aux gradient shows in every router's gradient
AUX = dict(router_aux_loss_coef=0.5)


def router_reference(arch, dtype=torch.float32, router_sums=None):
    """The unmodified MoE model on one process with output_router_logits=True: its loss (the
    token mean plus coef * aux), its aux loss, the parameter gradients, the state dict
    (float64: the same weights, computed in float64); `router_sums`:
    `hf_workers.summing_router_grads`."""
    model = model_in(arch, dtype, **AUX)
    ids = make_batch()
    with summing_router_grads(model, router_sums):
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.loss.detach(), out.aux_loss.detach(), grads, model.state_dict()


def run_router_loss(rank, world_size, arch, state, options):
    """The converted model's own loss with output_router_logits=True; returns the loss, the
    aux loss, the gradients, and transformers' aux over this rank's router logits alone."""
    import importlib

    from upipe.integrations.hf import apply_context_parallel, shard_batch

    group = dist.group.WORLD
    model = build_model(arch, seed=123, **AUX)
    model.load_state_dict(state)
    apply_context_parallel(model, group=group, **options)
    batch = shard_batch(make_batch(), group=group)
    labels = batch.pop("labels")
    out = model(**batch, labels=labels, shift_labels=labels, output_router_logits=True)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    hf = importlib.import_module(type(model).__module__)
    cfg = model.config
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    shard_aux = hf.load_balancing_loss_func(out.router_logits, experts, cfg.num_experts_per_tok)
    return out.loss.detach(), out.aux_loss.detach(), grads, shard_aux.detach()


def arch_errors(rank, world_size, cases):
    """Each case -> the ValueError message it raised on this rank (None if it did not)."""
    from upipe.attention.common import forget_agreements

    found = {}
    for name in cases:
        forget_agreements()
        try:
            _arch_error(name, dist.group.WORLD)
            found[name] = None
        except ValueError as e:
            found[name] = str(e)
    return found


def _tiny(config_name, model_name, **extra):
    import transformers

    config = getattr(transformers, config_name)(**{**BASE_CONFIG, **extra})
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).float().eval()


def _arch_error(name, group):
    from upipe.integrations.hf import apply_context_parallel, shard_batch

    if name == "gemma2":
        model = _tiny("Gemma2Config", "Gemma2ForCausalLM", head_dim=8)
        apply_context_parallel(model, group=group)
    elif name == "gemma3_multimodal":
        import transformers

        vision = dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14,
        )  # fmt: skip
        config = transformers.Gemma3Config(
            text_config={**BASE_CONFIG, "head_dim": 8}, vision_config=vision, mm_tokens_per_image=4
        )
        apply_context_parallel(transformers.Gemma3ForConditionalGeneration(config), group=group)
    elif name == "softcapping":
        apply_context_parallel(build_model("gemma3", attn_logit_softcapping=20.0), group=group)
    elif name == "bidirectional":
        model = build_model("gemma3", use_bidirectional_attention=True)
        apply_context_parallel(model, group=group)
    elif name == "final_softcapping_chunked":
        model = build_model("gemma3", final_logit_softcapping=30.0)
        apply_context_parallel(model, group=group, chunked_loss=True)
    elif name == "aux_with_tiles":
        model = apply_context_parallel(build_model("mixtral"), group=group, tiled_mlp=True)
        batch = shard_batch(make_batch(), group=group)
        labels = batch.pop("labels")
        model(**batch, labels=labels, shift_labels=labels, output_router_logits=True)
    elif name == "aux_rank0":  # one rank asks for the aux loss: every rank must raise
        model = apply_context_parallel(build_model("qwen3_moe"), group=group)
        batch = shard_batch(make_batch(), group=group)
        batch.pop("labels")
        model(**batch, output_router_logits=dist.get_rank() == 0)
    elif name == "jitter":
        model = build_model("mixtral", router_jitter_noise=0.1)
        apply_context_parallel(model, group=group, activation_checkpoint=True)
    elif name == "memory_features_window":  # another library's attention: no window applied
        from upipe.integrations.hf_memory import apply_memory_features

        model = apply_memory_features(build_model("olmo3_window"), group=group, tiled_mlp=True)
        batch = shard_batch(make_batch(), group=group)
        batch.pop("labels")
        model(**batch)


def run_cases(rank, world_size, arch, state, cases):
    """The converted model on each case (strategy, packed documents or not, apply_context_parallel
    options, mesh shape or None), loaded with the reference `state`: its own loss (labels=
    with shift_labels=) and backward; returns per case (logits or None under chunked_loss,
    loss, parameter gradients)."""
    import upipe
    from upipe.integrations.hf import apply_context_parallel, shard_batch
    from upipe.packing import document_positions

    results = []
    for strategy, packed, options, mesh_shape in cases:
        if mesh_shape is None:
            cp = dict(group=dist.group.WORLD)
        else:
            cp = dict(mesh=upipe.make_mesh(ring=mesh_shape[0], ulysses=mesh_shape[1]))
        model = build_model(arch, seed=123)
        model.load_state_dict(state)
        apply_context_parallel(model, strategy=strategy, **cp, **options)
        positions = document_positions(PACKED_BOUNDS, SEQ).expand(BATCH, SEQ) if packed else None
        batch = shard_batch(make_batch(), position_ids_BS=positions, **cp)
        labels = batch.pop("labels")
        out = model(**batch, labels=labels, shift_labels=labels)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        logits = None if out.logits is None else out.logits.detach()
        results.append((logits, out.loss.detach(), grads))
    return results
