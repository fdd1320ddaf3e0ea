"""Hugging Face `Trainer` and TRL `SFTTrainer` training a model that `apply_context_parallel`
converted, launched by torchrun as usual.

Legend: B batch, S full sequence, L = S / C local tokens, C ranks holding one sequence
(the context-parallel group), W processes, W / C data-parallel replicas.

    apply_context_parallel(model, group=group)
    class CPTrainer(ContextParallelMixin, Trainer): ...        # or (..., SFTTrainer)
    trainer = CPTrainer(model=model, args=args, train_dataset=ds, data_collator=collator,
                        context_parallel_group=group)
    trainer.train()

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

accelerate's own `ParallelismConfig` does not fit: its context-parallel backend is torch's
`context_parallel` (SDPA patched with ring attention, buffers resharded in load-balanced
order) and its sequence-parallel backend DeepSpeed's ALST; neither runs upipe's attention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from upipe.attention.common import resolve_groups
from upipe.integrations.hf import shard_batch
from upipe.loss import IGNORE_INDEX, shift_labels

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


class ContextParallelMixin:
    """Put before `transformers.Trainer` or a subclass (TRL's `SFTTrainer`) in the bases of a
    class; its constructor then takes `context_parallel_group=` or `context_parallel_mesh=`
    (as given to `apply_context_parallel`). See the module docstring."""

    def __init__(self, *args, context_parallel_group=None, context_parallel_mesh=None, **kwargs):
        resolve_groups(context_parallel_group, context_parallel_mesh)
        super().__init__(*args, **kwargs)
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
        cp = dict(group=context_parallel_group, mesh=context_parallel_mesh)
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


__all__ = ["ContextParallelCollator", "ContextParallelMixin", "data_parallel_coordinates"]
