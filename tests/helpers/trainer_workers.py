"""Per-rank functions for tests/distributed/test_integrations_trainer.py and
tests/distributed/test_integrations_accelerate.py (module-level: spawned ranks import them)."""

from __future__ import annotations

import types

import torch.distributed as dist
from hf_workers import build_model, make_batch

from upipe.attention.common import forget_agreements

# upipe's memory features at tile sizes below the 32 tokens per rank of a 2-rank batch
FEATURES = dict(tiled_mlp=True, mlp_tile=8, chunked_loss=True, loss_chunk=12)


def mixin_errors(rank, world_size, cases):
    """Each case -> the ValueError message the trainer mixin raised on this rank (None if it
    did not): before the Trainer is built, so no Trainer state is made in the rank."""
    from transformers import Trainer

    from upipe.integrations.hf import apply_context_parallel
    from upipe.integrations.trainer import ContextParallelMixin

    class CPTrainer(ContextParallelMixin, Trainer):
        pass

    group = dist.group.WORLD
    options = {
        "converted_and_options": {},
        "unknown_key": dict(tiled_mpl=True),
        "group_in_options": dict(group=group),
        "options_for_a_name": {},
        "not_converted": None,
    }
    found = {}
    for name in cases:
        model = build_model("llama")
        if name == "converted_and_options":
            apply_context_parallel(model, group=group)
        if name == "options_for_a_name":
            model = "meta-llama/Llama-3.1-8B"
        try:
            CPTrainer(model=model, context_parallel_group=group, context_parallel=options[name])
            found[name] = None
        except ValueError as e:
            found[name] = str(e)
    return found


def checkpointing_kwargs_error(rank, world_size, kwargs, options):
    """`_checkpointing_problem` for TrainingArguments(activation_checkpointing=True,
    activation_checkpointing_kwargs=kwargs) and a model converted with `options`."""
    from transformers import TrainingArguments

    from upipe.integrations.hf import apply_context_parallel
    from upipe.integrations.trainer import _checkpointing_problem

    args = TrainingArguments(
        output_dir="unused",
        activation_checkpointing=True,
        activation_checkpointing_kwargs=kwargs,
        use_cpu=True,
        report_to="none",
    )
    model = apply_context_parallel(build_model("llama"), group=dist.group.WORLD, **options)
    return _checkpointing_problem(args, model)


def fsdp2_like_accelerate(rank, world_size, state, options, accelerate_ac, hf_checkpointing=False):
    """tests/hf_workers' llama converted with `options`, then sharded by FSDP2 the way
    accelerate's `prepare` does it for `fsdp_version: 2` -- accelerate's own functions,
    `fsdp2_apply_ac` (with `accelerate_ac`, its `fsdp_activation_checkpointing`) and
    `fsdp2_prepare_model`: each decoder layer a unit, the embedding one, the final norm and
    lm_head one, the root -- which accelerate does on accelerator devices only (on the CPU it
    runs DDP). One training step's forward and backward as the Trainer runs it (this rank's
    share of the loss given the step's count of labels, times the number of processes; FSDP2
    averages the gradients). Returns the loss summed over the ranks, every parameter's full
    gradient, the attention calls per layer and the FSDP units (module names; a
    CheckpointWrapper's name for the module it wraps); or the ValueError's message.
    `hf_checkpointing`: transformers' gradient checkpointing turned on as well."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model
    from torch.distributed.fsdp import FSDPModule

    from upipe.integrations.hf import apply_context_parallel, shard_batch

    forget_agreements()
    group = dist.group.WORLD
    model = build_model("llama", seed=123)
    model.load_state_dict(state)
    apply_context_parallel(model, group=group, **options)
    model.train()
    if hf_checkpointing:
        model.gradient_checkpointing_enable()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",  # the model's _no_split_modules
        reshard_after_forward=True,
        activation_checkpointing=accelerate_ac,
    )
    # what fsdp2_apply_ac / fsdp2_prepare_model read of the Accelerator (no AcceleratorState
    # is made: on the CPU it would hold no fsdp_plugin)
    accelerator = types.SimpleNamespace(
        state=types.SimpleNamespace(fsdp_plugin=plugin),
        mixed_precision="no",
        is_main_process=rank == 0,
    )
    plugin.set_auto_wrap_policy(model)  # accelerate's order: the policy, AC, then fully_shard
    if plugin.activation_checkpointing:
        model = fsdp2_apply_ac(accelerator, model)
    model = fsdp2_prepare_model(accelerator, model)
    wrapped = "._checkpoint_wrapped_module"
    units = {n.replace(wrapped, "") for n, m in model.named_modules() if isinstance(m, FSDPModule)}
    calls = [0] * len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn  # (through a CheckpointWrapper: its module's)
        attn.register_forward_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    batch = shard_batch(make_batch(), group=group)
    labels = batch.pop("labels")
    count = (labels != -100).sum()
    dist.all_reduce(count, group=group)
    try:
        out = model(**batch, labels=labels, shift_labels=labels, num_items_in_batch=count)
    except ValueError as e:
        return str(e)
    (out.loss * world_size).backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    grads = {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor()
        for n, p in model.named_parameters()
    }
    return loss, grads, calls, sorted(units)
