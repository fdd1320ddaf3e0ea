"""Per-rank functions for tests/test_hf_archs.py (module-level: spawned ranks import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from hf_workers import BASE_CONFIG, build_model, make_batch

# the aux loss weighed heavily, so that a wrong aux gradient shows in every router's gradient
AUX = dict(router_aux_loss_coef=0.5)


def router_reference(arch):
    """The unmodified MoE model on one process with output_router_logits=True: its loss (the
    token mean plus coef * aux), its aux loss, the parameter gradients, the state dict."""
    model = build_model(arch, **AUX)
    ids = make_batch()
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

    if name == "gpt_oss":
        model = _tiny(
            "GptOssConfig", "GptOssForCausalLM", num_local_experts=4, head_dim=8,
            layer_types=["sliding_attention", "full_attention"], sliding_window=16,
            rope_parameters=dict(rope_type="default", rope_theta=1e4),
        )  # fmt: skip
        apply_context_parallel(model, group=group)
    elif name == "gemma3":
        model = _tiny("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8, sliding_window=16)
        apply_context_parallel(model, group=group)
    elif name == "gemma3_full":  # every layer full attention: the rest still blocks it
        model = _tiny(
            "Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8,
            layer_types=["full_attention", "full_attention"],
        )  # fmt: skip
        apply_context_parallel(model, group=group)
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
    elif name == "olmo3_window":  # a sliding layer whose window is shorter than the sequence
        model = apply_context_parallel(build_model("olmo3", sliding_window=16), group=group)
        batch = shard_batch(make_batch(), group=group)
        batch.pop("labels")
        model(**batch)
