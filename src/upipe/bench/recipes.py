"""The whole-recipe methods of `upipe bench --whole-model`: each side's full long-context memory
stack on the same Hugging Face Llama (`upipe.bench.model`).

Legend: B batch, S full sequence, L = S / C local tokens, D width, F MLP width, V vocabulary,
N = B * L, T tokens per MLP tile / loss chunk, C ranks.

  alst-full    DeepSpeed ALST's Hugging Face recipe (deepspeed 0.19.8,
               `deepspeed.runtime.sequence_parallel.ulysses_sp`): `UlyssesSPAttentionHF`
               around sdpa, `TiledMLP` in every MLP (ceil(L / T) tiles of T = --mlp-tile
               tokens), the decoder `model.model(...)` for the final hidden states, then
               `TiledFusedLogitsLoss` (ceil(N / T) chunks of T = --loss-chunk tokens through
               `lm_head`, forward and backward in one pass, "sum" reduction of each chunk's
               cross-entropy sum over the global count of labels; see `full_loss`). With
               --activation-checkpoint: transformers' gradient checkpointing (non-reentrant) and
               deepspeed's `CheckpointHiddenStatesOffload` around the step (its offload of
               the checkpointed inputs: on a CPU it offloads nothing, they are in host memory
               already, which is deepspeed's own rule).
  upipe-full   `upipe.integrations.hf.apply_context_parallel(strategy="upipe",
               tiled_mlp=True, chunked_loss=True, ...)` with the same tile and chunk sizes;
               with --activation-checkpoint `activation_checkpoint=True` and transformers' gradient
               checkpointing on as well (upipe takes it over: one recompute); the loss from
               `model(..., labels=l, shift_labels=l)`.
  upipe-train  upipe's own `upipe.model.CausalLM` of the same architecture holding the same
               weights, parallelized and given the features as `upipe train` does
               (`upipe.train.parallelize`: the fused UPipe attention, tiled MLP, chunked loss,
               with --activation-checkpoint activation checkpointing).
`full_loss` gives what to call backward on (its gradient: this rank's share of the global
mean loss's) and the global mean loss (every rank the same value).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from upipe.loss import IGNORE_INDEX, count_valid, global_count, global_token_mean

FULL_METHODS = ("alst-full", "upipe-full", "upipe-train")


def gradient_checkpointing(model) -> None:
    """transformers' checkpointing of every decoder layer, non-reentrant (its
    `activation_checkpointing_enable`; `gradient_checkpointing_enable` before 5.x)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})


def build_full(name: str, base, group, shape, register, tiled_forward):
    """`name`'s copy of `base` (a `LlamaForCausalLM`) with its recipe installed. `register`
    and `tiled_forward`: ALST's attention and TiledMLP installers of `upipe.bench.model`."""
    if name == "upipe-train":
        return _own_model(base, group, shape)
    model = copy.deepcopy(base)
    if name == "alst-full":
        register(model, "alst", group)
        for layer in model.model.layers:
            layer.mlp.forward = tiled_forward(layer.mlp, shape.mlp_tile)
    else:
        from upipe.integrations.hf import apply_context_parallel

        apply_context_parallel(
            model,
            group=group,
            strategy="upipe",
            tiled_mlp=True,
            mlp_tile=shape.mlp_tile,
            chunked_loss=True,
            loss_chunk=shape.loss_chunk,
            activation_checkpoint=shape.activation_checkpoint,
        )
    if shape.activation_checkpoint:
        gradient_checkpointing(model)
    return model


def _own_model(base, group, shape):
    """upipe's `CausalLM` from `base`'s config and weights, as `upipe train` builds it."""
    from upipe.attention.registry import get_strategy
    from upipe.model import CausalLM, config_from_hf
    from upipe.train.parallelize import (
        ContextParallel,
        MemoryFeatures,
        apply_memory_features,
        parallelize,
    )

    model = CausalLM(config_from_hf(base.config.to_dict()))
    model.load_state_dict(base.state_dict())
    model.train()
    C = dist.get_world_size(group)
    parallelize(model, ContextParallel(spec=get_strategy("upipe"), size=C, group=group))
    features = MemoryFeatures(
        tiled_mlp=shape.mlp_tile,
        loss_chunk=shape.loss_chunk,
        activation_checkpoint=shape.activation_checkpoint,
    )
    return apply_memory_features(model, features, "cpu")


def _chunk_share(lm_head, h_TD, labels_T, *, count):
    """One ALST loss chunk: its logits, their fp32 cross-entropy summed (transformers'
    causal-LM loss upcasts the logits the same way), over the global count of labels."""
    logits_TV = lm_head(h_TD).float()
    ce = F.cross_entropy(logits_TV, labels_T, ignore_index=IGNORE_INDEX, reduction="sum")
    return ce / count


def full_loss(name: str, model, batch, group, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """`name`'s recipe on this rank's `batch`: (what to call backward on, the global mean).

    alst-full divides by the global count inside the chunks: `TiledFusedLogitsLoss` runs
    each chunk's backward in its forward with an incoming gradient of 1 and scales only the
    hidden states' gradient by the gradient it is given later, so a division after it (a mean
    taken outside) would leave `lm_head`'s gradient count times too large (deepspeed 0.19.8;
    measured here: relative error 2.5e2 at 256 tokens). Its output, this rank's share of the
    mean, is then what backward starts from, with a gradient of 1."""
    labels_BL = batch["labels"]
    if name == "upipe-full":
        out = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            labels=labels_BL,
            shift_labels=labels_BL,
        )
        return out.loss, out.loss
    if name == "upipe-train":
        loss_sum = model(batch["input_ids"], batch["position_ids"], labels_BL)
        loss = global_token_mean(loss_sum, count_valid(labels_BL), group)
        return loss, loss
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    count = global_count(count_valid(labels_BL), group)
    h_BLD = model.model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"]
    ).last_hidden_state
    chunks = math.ceil(labels_BL.numel() / shape.loss_chunk)
    share = TiledFusedLogitsLoss.apply(
        functools.partial(_chunk_share, count=count),
        model.lm_head,
        h_BLD,
        labels_BL,
        None,
        chunks,
        [model.lm_head.weight],
        "sum",
    )
    mean = share.detach().clone()
    dist.all_reduce(mean, group=group)
    return share, mean


def full_context(name: str, shape):
    """What wraps `name`'s whole step (forward and backward): ALST's checkpoint offload."""
    if name == "alst-full" and shape.activation_checkpoint:
        from deepspeed.runtime.activation_checkpointing.offload_activations import (
            CheckpointHiddenStatesOffload,
        )

        return CheckpointHiddenStatesOffload()
    return contextlib.nullcontext()
