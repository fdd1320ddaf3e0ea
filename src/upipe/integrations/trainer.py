"""Hugging Face `Trainer` and TRL `SFTTrainer` training a context-parallel model, launched by
torchrun (or `accelerate launch`) as usual.

Legend: B batch, S full sequence, L = S / C local tokens, C ranks holding one sequence
(the context-parallel group), W processes, W / C data-parallel replicas.

    class CPTrainer(ContextParallelMixin, Trainer): ...        # or (..., SFTTrainer)
    trainer = CPTrainer(model=model, args=args, train_dataset=ds, data_collator=collator,
                        context_parallel_group=group,
                        context_parallel=dict(strategy="upipe", tiled_mlp=True,
                                              chunked_loss=True, activation_checkpoint=True))
    trainer.train()

`context_parallel=` holds `apply_context_parallel`'s keywords (but group / mesh): the mixin
converts the model with them before the Trainer sees it. Without it the model must have been
converted already (`apply_context_parallel(model, group=group, ...)`, then the mixin).

What the mixin changes, and why:
1. The batches. accelerate deals every process its own batches; the C ranks of a group must
   read the same one. After the Trainer built a data loader, its batch sampler shard
   (accelerate's `BatchSamplerShard`) is set to the data-parallel coordinates: W / C
   replicas, this rank's replica (transformers neutralises the same shard the same way for
   its `BatchRebalanceSampler`).
2. The collator. The trainer's own collator (transformers' `DataCollatorWithFlattening`,
   `DataCollatorForLanguageModeling`, TRL's, or the user's) is wrapped by
   `ContextParallelCollator`, which turns its full batch into this rank's block.
3. The count of valid labels in evaluation (`compute_loss`); nothing else. The Trainer
   counts the valid labels of the optimizer step over all processes (`num_items_in_batch`,
   from `shift_labels`), the converted model's loss function returns this rank's sum_r / N
   (transformers' formula; TRL's fused head computes the same), the Trainer multiplies it
   by W and DDP averages the gradients: (1/W) sum_r W d(sum_r)/N = d(sum_r sum_r)/N, the
   gradient of the mean over every token of the step; the logged loss, the mean over the
   processes of W sum_r / N, is that mean.
4. The gradients' all-reduce where upipe runs the decoder layers (`tiled_mlp`,
   `activation_checkpoint`) under DDP (accelerate's wrapper for several processes without
   FSDP or DeepSpeed). DDP reduces a parameter's gradient from a hook that may fire once per
   backward; the tiled MLP backpropagates tile by tile (and checkpoints in nested backward
   passes), which fires it once per tile ("Expected to mark a variable ready only once").
   Such a model runs its backward under DDP's `no_sync`, and the mixin averages the
   gradients over the processes itself at the optimizer step's last micro-batch, as DDP
   would (one all-reduce per dtype, after the backward instead of overlapped with it).
   FSDP2 needs nothing of the kind: it reduces a unit's gradients once its backward is done.

Checkpointing: `TrainingArguments(gradient_checkpointing=True)` (in transformers 5.24 an alias
of `activation_checkpointing=True`) goes with the memory features -- upipe takes it over, one
recompute per layer (`upipe.integrations.hf_memory`) -- but its `every_n_layers` / `offload`
keywords would be ignored there, so they raise. accelerate's `fsdp_activation_checkpointing`
with upipe's `activation_checkpoint=True` would recompute every layer twice: the model's first
call raises (`HFMemory.call_problem`).

Under TRL's `SFTTrainer` the loss is TRL's (`trl.trainer.utils.add_fused_lm_head`, put around
the converted model's forward: it calls the decoder stack, upipe's, and computes the log
probabilities from the final hidden states in tiles, without the `[L, V]` logits); upipe's
`chunked_loss` serves the calls with `labels=` that do not ask for TRL's head.

accelerate's own `ParallelismConfig` does not fit: its context-parallel backend is torch's
`context_parallel` (SDPA patched with ring attention, buffers resharded in load-balanced
order) and its sequence-parallel backend DeepSpeed's ALST; neither runs upipe's attention.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from upipe.attention.common import resolve_groups
from upipe.integrations.hf import HFContextParallelAttention, apply_context_parallel, shard_batch
from upipe.loss import IGNORE_INDEX, shift_labels
from upipe.train.parallelize import allreduce_gradients

# keys of a packed batch that describe the full sequence; `shard_batch` recomputes the
# documents from the position ids
_FULL_SEQUENCE_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


class ContextParallelCollator:
    """Wraps a collator: its batch of full sequences becomes this rank's block, in the
    keywords a converted model takes: input_ids, position_ids (+ cu_seq_lens_q/k for packed
    documents), and labels = shift_labels, this rank's labels shifted on the full sequence.

    The wrapped collator returns input_ids `[B, S]` and optionally labels (transformers'
    convention: unshifted, -100 ignored; default: the input ids), position_ids (restarting
    per packed document) and attention_mask. Padding must be on the right (transformers'
    and TRL's default): under causal attention no real token sees a later pad, so the mask
    is dropped and the pads' labels ignored -- the same loss as the masked model. S is
    padded at the end to a multiple of C the same way.
    """

    def __init__(self, collator, *, group=None, mesh=None):
        resolve_groups(group, mesh)
        self.collator, self.group, self.mesh = collator, group, mesh

    def __call__(self, features):
        batch = dict(self.collator(features))
        ids_BS = batch.pop("input_ids")
        labels_BS = batch.pop("labels", ids_BS)
        pos_BS = batch.pop("position_ids", None)
        mask_BS = batch.pop("attention_mask", None)
        for key in _FULL_SEQUENCE_KEYS:
            batch.pop(key, None)
        if batch:
            raise ValueError(
                f"ContextParallelCollator does not know how to shard {sorted(batch)}: the "
                "wrapped collator may return input_ids, labels, position_ids, attention_mask "
                f"and {', '.join(_FULL_SEQUENCE_KEYS)}"
            )
        if mask_BS is not None:
            if bool((mask_BS.diff(dim=-1) > 0).any()):
                raise ValueError(
                    "attention_mask has padding before tokens (left padding); pad on the right "
                    "(tokenizer.padding_side = 'right'), which causal attention never attends to"
                )
            labels_BS = labels_BS.masked_fill(mask_BS == 0, IGNORE_INDEX)
        labels_BS = shift_labels(labels_BS)  # next-token labels, before sharding
        ids_BS, labels_BS, pos_BS = self._pad(ids_BS, labels_BS, pos_BS)
        out = shard_batch(
            ids_BS, labels_BS=labels_BS, position_ids_BS=pos_BS, group=self.group, mesh=self.mesh
        )
        out["shift_labels"] = out["labels"]  # transformers computes a loss only given labels=
        return out

    def _pad(self, ids_BS, labels_BS, pos_BS):
        """Pad S to a multiple of C at the end: ignored labels, positions counting on."""
        C = _group_size(self.group, self.mesh)
        B, S = ids_BS.shape
        extra = -S % C
        if pos_BS is None:
            pos_BS = torch.arange(S).expand(B, S)
        if not extra:
            return ids_BS, labels_BS, pos_BS
        steps_BE = torch.arange(1, extra + 1).expand(B, extra)
        return (
            torch.cat([ids_BS, ids_BS.new_zeros(B, extra)], dim=1),
            torch.cat([labels_BS, labels_BS.new_full((B, extra), IGNORE_INDEX)], dim=1),
            torch.cat([pos_BS, pos_BS[:, -1:] + steps_BE], dim=1),
        )


def _group_size(group, mesh) -> int:
    if group is not None:
        return dist.get_world_size(group)
    return mesh["ring"].size() * mesh["ulysses"].size()


def data_parallel_coordinates(group=None, mesh=None) -> tuple[int, int]:
    """(this rank's data-parallel replica, number of replicas): a mesh's "dp" dim, or for a
    group, the block of C consecutive ranks it must be (as `dist.new_subgroups(C)` makes)."""
    if mesh is not None:
        return mesh["dp"].get_local_rank(), mesh["dp"].size()
    C, W = dist.get_world_size(group), dist.get_world_size()
    ranks = dist.get_process_group_ranks(group)
    if ranks != list(range(ranks[0], ranks[0] + C)) or ranks[0] % C:
        raise ValueError(
            f"the context-parallel group's ranks {ranks} are not {C} consecutive ranks starting "
            f"at a multiple of {C}; make the groups with torch.distributed.new_subgroups({C}) "
            "or pass mesh=upipe.make_mesh(...)"
        )
    return ranks[0] // C, W // C


# the keywords of `apply_context_parallel` that `context_parallel=` may hold (the group or mesh
# come as the mixin's own context_parallel_group= / context_parallel_mesh=)
CONTEXT_PARALLEL_KEYWORDS = tuple(
    name
    for name, p in inspect.signature(apply_context_parallel).parameters.items()
    if p.kind is p.KEYWORD_ONLY and name not in ("group", "mesh")
)


def convert_for_trainer(model, options, *, group=None, mesh=None) -> None:
    """Make `model` context-parallel with `options` (a dict of `CONTEXT_PARALLEL_KEYWORDS`),
    or with None check that `apply_context_parallel` has converted it already.

    The options are a dict of `apply_context_parallel`'s keywords rather than a dataclass of
    their own: those keywords and their checks (`MemoryOptions.problem`, the strategy and head
    rules) then have one home, and a dict is what a JSON / YAML training config holds."""
    converted = isinstance(model, torch.nn.Module) and any(
        isinstance(m, HFContextParallelAttention) for m in model.modules()
    )
    if options is None:
        if not converted:
            raise ValueError(
                "the model is not context-parallel: pass context_parallel=dict(strategy='upipe', "
                "...) (apply_context_parallel's keywords) for the trainer to convert it, or call "
                "apply_context_parallel(model, group=...) before building the trainer"
            )
        return
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"context_parallel= converts the model object before the trainer wraps it: pass "
            f"model= a loaded model (from_pretrained), not {type(model).__name__}"
        )
    if converted:
        raise ValueError(
            "context_parallel= was given for a model that apply_context_parallel has converted "
            "already: drop context_parallel= (the model keeps the options it was converted "
            "with), or pass the unconverted model"
        )
    if not isinstance(options, dict):
        raise ValueError(
            f"context_parallel must be a dict of apply_context_parallel's keywords, got "
            f"{type(options).__name__}"
        )
    unknown = sorted(set(options) - set(CONTEXT_PARALLEL_KEYWORDS))
    if unknown:
        raise ValueError(
            f"context_parallel has unknown keys {unknown}: it takes apply_context_parallel's "
            f"keywords {list(CONTEXT_PARALLEL_KEYWORDS)}; the group or mesh goes in "
            "context_parallel_group= / context_parallel_mesh="
        )
    apply_context_parallel(model, group=group, mesh=mesh, **options)


def _checkpointing_problem(args, model) -> str | None:
    """Why the Trainer's activation checkpointing settings cannot apply to `model`, or None:
    where upipe runs the decoder layers (tiled MLP, its own checkpointing) it checkpoints each
    of them in place of transformers, so transformers' every_n_layers / offload would be
    silently ignored."""
    memory = getattr(model, "upipe_memory", None)
    if not (args.activation_checkpointing and memory and memory.options.layers_replaced):
        return None
    kw = args.activation_checkpointing_kwargs or {}
    if kw.get("every_n_layers", 1) == 1 and not kw.get("offload", False):
        return None
    return (
        f"activation_checkpointing_kwargs={kw}: upipe checkpoints every decoder layer in place "
        "of transformers' checkpointing (its memory features run the layers), so "
        "every_n_layers / offload would be ignored; drop them, and for offload or segments use "
        "context_parallel=dict(activation_checkpoint=True, offload=True, blocks_per_checkpoint=m)"
    )


def _syncs_by_hand(model) -> bool:
    """Whether the Trainer's `model` is DDP around a model whose decoder layers upipe runs
    (the mixin then averages its gradients itself: point 4 of the module docstring)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return False
    memory = getattr(model.module, "upipe_memory", None)
    return memory is not None and memory.options.layers_replaced


class ContextParallelMixin:
    """Put before `transformers.Trainer` or a subclass (TRL's `SFTTrainer`) in the bases of a
    class; its constructor then takes `context_parallel_group=` or `context_parallel_mesh=`
    (as given to `apply_context_parallel`), and `context_parallel=`: a dict of
    `apply_context_parallel`'s other keywords (`CONTEXT_PARALLEL_KEYWORDS`), with which the
    mixin converts `model=` before the Trainer (and TRL's fused LM head) wraps it; without it
    the model must have been converted (`convert_for_trainer`). See the module docstring."""

    def __init__(
        self,
        *args,
        context_parallel_group=None,
        context_parallel_mesh=None,
        context_parallel=None,
        **kwargs,
    ):
        resolve_groups(context_parallel_group, context_parallel_mesh)
        cp = dict(group=context_parallel_group, mesh=context_parallel_mesh)
        model = kwargs.get("model", args[0] if args else None)
        convert_for_trainer(model, context_parallel, **cp)
        super().__init__(*args, **kwargs)
        problem = _checkpointing_problem(self.args, model)
        if problem:
            raise ValueError(problem)
        if not self.args.average_tokens_across_devices:
            raise ValueError(
                "average_tokens_across_devices=False: each rank would divide its loss by its own "
                "token count; keep TrainingArguments(average_tokens_across_devices=True)"
            )
        if not (self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            raise ValueError(
                "the Trainer does not pass num_items_in_batch to this model, so the loss of each "
                "rank would be divided by its own token count; use a model converted by "
                "apply_context_parallel (its forward takes **kwargs)"
            )
        self.data_collator = ContextParallelCollator(self.data_collator, **cp)
        self._replica = data_parallel_coordinates(**cp)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The Trainer's loss, given the count of valid labels on every process also when
        the Trainer has none (evaluation): each rank's loss is then its share of the batch's
        mean as in training (point 3 above), and the mean over the processes the batch's
        mean -- not the mean of the ranks' own means."""
        if num_items_in_batch is None:
            num_items_in_batch = (inputs["shift_labels"] != IGNORE_INDEX).sum()
            dist.all_reduce(num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's step; under DDP with upipe running the layers, the gradients are
        averaged by hand (point 4 above)."""
        if not _syncs_by_hand(model):
            return super().training_step(model, inputs, num_items_in_batch)
        with model.no_sync():
            loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:
            allreduce_gradients(model.module, group=model.process_group)
            W = dist.get_world_size(model.process_group)
            for p in model.module.parameters():
                if p.grad is not None:
                    p.grad.div_(W)
        return loss

    def get_train_dataloader(self):
        return self._per_replica(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._per_replica(super().get_eval_dataloader(eval_dataset))

    def _per_replica(self, loader):
        """The same batches on the ranks of a context-parallel group (point 1 above)."""
        from accelerate.data_loader import BatchSamplerShard

        shard = getattr(loader, "batch_sampler", None)
        if isinstance(shard, BatchSamplerShard):
            shard.process_index, shard.num_processes = self._replica
        elif dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"the data loader of a {type(loader.dataset).__name__} is not sharded by a batch "
                "sampler; context parallelism under the Trainer needs a map-style dataset "
                "(datasets.Dataset, a list)"
            )
        return loader


__all__ = [
    "CONTEXT_PARALLEL_KEYWORDS",
    "ContextParallelCollator",
    "ContextParallelMixin",
    "convert_for_trainer",
    "data_parallel_coordinates",
]
