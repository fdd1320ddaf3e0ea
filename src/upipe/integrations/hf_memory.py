"""upipe's memory features for Hugging Face causal LMs: tiled MLP, a chunked loss that never
builds the logits, and activation checkpointing with offload of the checkpointed inputs.

Legend: B batch, L tokens of this rank, D width, V vocabulary, N = B * L, T tile tokens,
n decoder layers, m layers per checkpoint.

    apply_context_parallel(model, group=group, tiled_mlp=True, chunked_loss=True,
                           activation_checkpoint=True, offload=True)     # or, without the
    apply_memory_features(model, group=group, tiled_mlp=True, ...)       # attention swap

The options mean what `upipe train`'s flags of the same names mean (`MemoryOptions`), and
run the same code (`upipe.model.features`, `upipe.loss`, `upipe.model.offload`):

- `tiled_mlp`: each decoder layer's post-attention norm, its own `mlp` module and the
  residual add run in tiles of `mlp_tile` tokens, recomputed in backward, whose gradient is
  written into the incoming one (`features.tiled_recompute(..., residual=True)`): the
  `[B, L, F]` intermediates never exist and the layer's backward holds one `[B, L, D]`
  gradient. Any token-wise `mlp` works (dense or mixture-of-experts: it is called on
  `[B, T, D]` tiles).
- `chunked_loss`: with `labels=`/`shift_labels=`, the model's forward computes the loss
  from the final hidden states through its own `lm_head` in chunks of `loss_chunk` tokens,
  forward and backward in one pass (`upipe.loss.cross_entropy_sum`), and returns it with
  `logits=None`; the `[N, V]` logits and their fp32 copy never exist. The value is the
  same as without it: the global token mean (`upipe.integrations.hf.causal_lm_loss`), or
  with transformers' `num_items_in_batch` this rank's sum over that count. Without labels
  the model returns logits as before (`logits_to_keep` included).
- With `tiled_mlp` or `activation_checkpoint` the layers' first norm and the final norm
  keep only their input for backward, and run (and are recomputed in backward) in tiles of
  `mlp_tile` tokens, as the MLP does (`features.tiled_recompute`). transformers' RMSNorm is
  Python: its backward over all L tokens holds six fp32 `[L, D]` temporaries (pow, the
  products, the fp32 copy; the planner found them at the peak of the HF path: 52.5 of 74.8
  GiB for Llama-3.1-8B at 4.6M tokens on 8 GPUs), where CUDA's fused norm keeps x and one
  scalar per row; in tiles they are `[mlp_tile, D]`. The norm is row-wise, so the tiles
  compute the same values as the whole.
- `activation_checkpoint`: the decoder layers are checkpointed by upipe (one input kept per
  checkpoint of `blocks_per_checkpoint` layers; `features.activation_checkpoint`).
  `offload`: on CUDA those inputs live in one page-locked host arena (`Offloader`), but the
  last `keep_on_gpu` checkpoints'. transformers' own gradient checkpointing
  (`gradient_checkpointing_enable()`, the Trainer's `gradient_checkpointing=True`) is taken
  over: its layers are checkpointed once, by upipe, instead of twice.

How: the decoder stack's and each decoder layer's `forward` are replaced on the instances
(`model.model.forward`, `layer.forward`; with `chunked_loss` also `model.forward`), so no
class, no other model and no library global changes, and module hooks (FSDP2's) still run
around every call. The stack runs what transformers' decoders of the supported architectures
(`upipe.integrations.hf_archs`) run -- embedding, rotary embedding (per layer type where the
model has them), the layers, the final norm -- and each layer what their decoder layers run
(pre-norm `h = x + attn(norm_1(x))`, `y = h + mlp(norm_2(h))`, or OLMo's post-norm form:
`hf_archs.layer_forward`), in the same order (the tests compare with the unconverted model).
It builds no attention mask: every attention it runs under is causal without one (upipe's,
ALST's drop-ins, sdpa and flash), and `eager` / `flex_attention`, which need the mask, are
refused. What the stack does not do -- caches, `output_hidden_states`, `output_attentions`,
padding masks -- is refused per call with a ValueError.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types

import torch
import torch.distributed as dist
from torch import nn

from upipe.attention.common import agree_across_ranks
from upipe.integrations.hf_archs import (
    architecture,
    layer_forward,
    memory_problem,
    rotary_embeddings,
)
from upipe.loss import IGNORE_INDEX, count_valid, cross_entropy_sum, global_token_mean
from upipe.model.features import activation_checkpoint, tiled_recompute
from upipe.model.offload import Offloader
from upipe.train.parallelize import MemoryFeatures, check_memory_features

log = logging.getLogger("upipe")

# attention implementations that need transformers' mask, which the stack does not build
MASKED_ATTENTION = ("eager", "flex_attention")


@dataclasses.dataclass(kw_only=True, frozen=True)
class MemoryOptions:
    """The memory features of a Hugging Face model; names and meanings as `upipe train`'s
    flags (`upipe.train.TrainConfig`)."""

    tiled_mlp: bool = False
    """Run each decoder layer's MLP (with its norm and residual) in sequence tiles,
    recomputed in backward."""
    mlp_tile: int = 1024
    """Tokens per MLP tile."""
    chunked_loss: bool = False
    """With labels, compute the loss from the hidden states in chunks (no [L, V] logits;
    the model returns logits=None)."""
    loss_chunk: int = 1024
    """Tokens per loss chunk."""
    activation_checkpoint: bool = False
    """Checkpoint the decoder layers (keep only each checkpoint's input)."""
    blocks_per_checkpoint: int = 1
    """Decoder layers per checkpoint (one input kept per m layers)."""
    offload: bool = False
    """Keep the checkpointed inputs in host memory (CUDA; needs activation_checkpoint)."""
    keep_on_gpu: int = 0
    """With offload: the inputs of the last K checkpoints stay on the device."""
    attention_outputs: str = "recompute"
    """With activation_checkpoint, what the recomputation does about the attention: "recompute"
    (call its kernel again), "keep" (reuse the forward's outputs and lse, kept on the device),
    "offload" (kept in host memory beside the offloaded inputs; needs offload)."""

    @property
    def layers_replaced(self) -> bool:
        """Whether the decoder stack and layers run upipe's forward (module doc)."""
        return self.tiled_mlp or self.activation_checkpoint

    def problem(self, n_layers: int) -> str | None:
        """The first problem of these options for a model of `n_layers` decoder layers, as a
        message naming the option and the fix; None if there is none."""
        for name in ("mlp_tile", "loss_chunk", "blocks_per_checkpoint"):
            if getattr(self, name) < 1:
                return f"{name} must be >= 1, got {getattr(self, name)}"
        if self.keep_on_gpu < 0:
            return f"keep_on_gpu must be >= 0, got {self.keep_on_gpu}"
        shared = MemoryFeatures(
            activation_checkpoint=self.activation_checkpoint,
            offload=self.offload,
            attention_outputs=self.attention_outputs,
        )
        problem = check_memory_features(shared, flag=_keyword)
        if problem:
            return problem
        m = self.blocks_per_checkpoint
        if m > 1 and not self.activation_checkpoint:
            return f"blocks_per_checkpoint={m} needs activation_checkpoint=True"
        if self.keep_on_gpu and not self.offload:
            return (
                f"keep_on_gpu={self.keep_on_gpu} keeps some offloaded inputs on the GPU: it "
                "needs offload=True"
            )
        checkpoints = -(-n_layers // m)
        if self.offload and self.keep_on_gpu >= checkpoints:
            return (
                f"keep_on_gpu={self.keep_on_gpu} keeps all {checkpoints} checkpoints ({n_layers} "
                f"layers / {m} per checkpoint) on the GPU: use at most {checkpoints - 1}, or "
                "offload=False"
            )
        return None


class HFMemory:
    """What `apply_memory_features` installed on a model, as `model.upipe_memory`.

    `offload`: the `Offloader` the checkpoints use, on CUDA only (on the CPU the inputs are
    in host memory already, as in `upipe train`); a test may set one to run the offload path
    on the CPU (host copies of host tensors, the arena a separate tensor)."""

    def __init__(self, options: MemoryOptions, n_layers: int, group):
        self.options, self.group = options, group
        m = options.blocks_per_checkpoint
        self.n_inputs = -(-n_layers // m) - options.keep_on_gpu  # checkpoints offloaded
        self.offload: Offloader | None = None
        self.arch = None  # the model's `hf_archs.Arch` where upipe runs its layers
        self._took_over = False

    def offloader(self, x_BLD: torch.Tensor) -> Offloader | None:
        if self.offload is None and self.options.offload and x_BLD.is_cuda:
            scratch = self.options.blocks_per_checkpoint - 1
            self.offload = Offloader(self.n_inputs, "cpu", scratch=scratch)
        return self.offload

    def checkpointing(self, base, layers) -> int:
        """Layers per checkpoint in this call: 0 without checkpointing. transformers' own
        gradient checkpointing (on in training mode) becomes upipe's, one layer each."""
        if self.options.activation_checkpoint:
            return self.options.blocks_per_checkpoint
        if base.training and any(
            getattr(layer, "gradient_checkpointing", False) for layer in layers
        ):
            if not self._took_over:
                log.info(
                    "upipe checkpoints the decoder layers in place of transformers' gradient "
                    "checkpointing (one recompute; activation_checkpoint=True adds offload "
                    "and segments)"
                )
                self._took_over = True
            return 1
        return 0

    def call_problem(self, base, kwargs) -> str | None:
        """The first reason the stack cannot run this call of the decoder stack (`kwargs`),
        or None."""
        if not self.options.layers_replaced:
            return None
        cfg = base.config
        for name in ("output_hidden_states", "output_attentions"):
            if kwargs.get(name) or getattr(cfg, name, False):
                return (
                    f"{name}=True is not supported with tiled_mlp / activation_checkpoint "
                    "(upipe runs the decoder stack itself); leave it off"
                )
        if kwargs.get("use_cache") or any(
            kwargs.get(k) is not None for k in ("cache", "past_key_values")
        ):
            return (
                "use_cache=True / a cache (generation) is not supported with upipe's memory "
                "features"
            )
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(mask.bool().all()):
            return (
                "attention_mask with padding is not supported with upipe's memory features "
                "(causal attention over the whole sequence); pass attention_mask=None and mark "
                f"padded positions with labels = {IGNORE_INDEX}"
            )
        if cfg._attn_implementation in MASKED_ATTENTION:
            return (
                f"attn_implementation {cfg._attn_implementation!r} needs transformers' causal "
                "mask, which upipe's decoder stack does not build: use 'sdpa' (or a flash "
                "implementation)"
            )
        return self._double_checkpoint_problem(base.layers)

    def _double_checkpoint_problem(self, layers) -> str | None:
        """Layers (or modules in them) wrapped by torch's `checkpoint_wrapper` (accelerate's
        `fsdp_activation_checkpointing`, torch's `apply_activation_checkpointing`) that upipe
        checkpoints as well would be recomputed twice. (Recognised by class name, as the
        architectures are: torch keeps the wrapper in a private module; FSDP2 subclasses it.)"""
        if not any(
            c.__name__ == "CheckpointWrapper"
            for layer in layers
            for m in layer.modules()
            for c in type(m).__mro__
        ):
            return None
        if self.options.activation_checkpoint:
            ours, fix = "activation_checkpoint=True", "activation_checkpoint=False"
        elif any(getattr(layer, "gradient_checkpointing", False) for layer in layers):
            ours = "transformers' gradient checkpointing, which upipe takes over"
            fix = "gradient_checkpointing=False"
        else:
            return None
        return (
            "the decoder layers are wrapped by torch's checkpoint_wrapper (accelerate's "
            f"fsdp_activation_checkpointing) and upipe checkpoints them too ({ours}): each layer "
            "would be recomputed twice; turn one off: fsdp_activation_checkpointing: false in the "
            "accelerate config (TrainingArguments(fsdp_config={'activation_checkpointing': "
            f"False}})), or {fix}"
        )

    def run_layers(self, base, layers, x_BLD, position_embeddings, args):
        """The decoder layers on x (each with its cos/sin), checkpointed as `checkpointing`
        says."""
        fns = [
            functools.partial(_call_layer, layer, cos_sin)
            for layer, cos_sin in zip(layers, position_embeddings, strict=True)
        ]
        m = self.checkpointing(base, layers) if torch.is_grad_enabled() else 0
        if not m:
            for fn in fns:
                x_BLD = fn(x_BLD, *args)
            return x_BLD
        ours = self.options.activation_checkpoint  # (not transformers' taken over)
        offload = self.offloader(x_BLD) if ours else None
        outputs = self.options.attention_outputs if ours else "recompute"
        for j, start in enumerate(range(0, len(fns), m)):
            slot = offload if offload is not None and j < offload.n_inputs else None
            x_BLD = activation_checkpoint(
                fns[start : start + m],
                x_BLD,
                *args,
                offload=slot,
                index=j,
                attention_outputs=outputs,
            )
        return x_BLD


def _keyword(name: str) -> str:
    """How `check_memory_features` spells a field here: as apply_context_parallel's keyword."""
    return {"attention_outputs": "attention_outputs="}.get(name, f"{name}=True")


def window_problem(cfg, S: int) -> str | None:
    """Why a model with config `cfg` cannot attend over S tokens under another library's
    attention (`apply_memory_features`: its sliding window is shorter, and the stack builds
    no mask that would apply it), or None. (`apply_context_parallel` applies windows.)"""
    window = sliding_window(cfg)
    if window is not None and window < S:
        return (
            f"sliding-window attention is not supported by apply_memory_features (another "
            f"library's attention, no mask): the sequence ({S} tokens) is longer than "
            f"config.sliding_window ({window}); use apply_context_parallel (it applies the "
            f"window), or a sequence of at most {window} tokens"
        )
    return None


def sliding_window(cfg) -> int | None:
    """The window of the model's sliding-window layers, or None if it has none."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


def _call_layer(layer, position_embeddings, x_BLD, position_ids, kwargs):
    """One decoder layer through its module call (so FSDP2's hooks run)."""
    return layer(
        x_BLD, position_embeddings=position_embeddings, position_ids=position_ids, **kwargs
    )


def _decoder_stack(
    base,
    memory: HFMemory,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    cache=None,
    inputs_embeds=None,
    use_cache=None,
    _upipe_final_norm=True,
    **kwargs,
):
    """The decoder stack's forward (module doc); its input hook has checked the call.
    `_upipe_final_norm=False` (from the chunked loss, which runs the norm in its chunks):
    the last layer's output, not normalised."""
    from transformers.modeling_outputs import BaseModelOutputWithPast, MoeModelOutputWithPast

    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids or inputs_embeds")
    x_BLD = base.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    if position_ids is None:
        position_ids = torch.arange(x_BLD.shape[1], device=x_BLD.device).unsqueeze(0)
    cos_sin = rotary_embeddings(base, x_BLD, position_ids)
    layers = list(base.layers[: base.config.num_hidden_layers])
    x_BLD = memory.run_layers(base, layers, x_BLD, cos_sin, (position_ids, kwargs))
    if _upipe_final_norm:
        x_BLD = tiled_recompute(base.norm, x_BLD, memory.options.mlp_tile)
    if memory.arch.router:  # (the MoE causal LMs read its router_logits: upipe's, hf_moe)
        return MoeModelOutputWithPast(last_hidden_state=x_BLD, router_logits=None)
    return BaseModelOutputWithPast(last_hidden_state=x_BLD)


def chunked_call_problem(logits_to_keep, return_dict) -> str | None:
    """Why a model call with labels cannot take the chunked loss, or None."""
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        return (
            f"logits_to_keep={logits_to_keep!r} with labels=: chunked_loss=True computes the "
            "loss over every token and returns no logits; call without labels to get the kept "
            "logits"
        )
    if return_dict is False:
        return (
            "return_dict=False with chunked_loss=True: the loss comes with logits=None in a "
            "ModelOutput; call with return_dict=True (the default)"
        )
    return None


def _causal_lm(model, memory: HFMemory, hf_forward, input_ids=None, labels=None, **kwargs):
    """The causal LM's forward with `chunked_loss`: with labels, the loss from the final
    hidden states in chunks and logits=None; without, transformers' own forward."""
    if labels is None:
        return hf_forward(input_ids=input_ids, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    shift_labels = kwargs.pop("shift_labels", None)
    ignore_index = kwargs.pop("ignore_index", IGNORE_INDEX)
    if shift_labels is None and memory.group is None:  # one process: as transformers does
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[:, 1:]
    if shift_labels is None:  # (apply_context_parallel's input hook says so first)
        raise ValueError(
            "chunked_loss=True over a split sequence takes the labels shifted on the whole "
            "sequence: pass shift_labels= (each rank's shard of them) along with labels="
        )
    num_items = kwargs.pop("num_items_in_batch", None)
    problem = chunked_call_problem(kwargs.pop("logits_to_keep", 0), kwargs.pop("return_dict", None))
    if problem:  # (apply_context_parallel's input hook raises it on every rank first)
        raise ValueError(problem)
    base = model.model
    # the final norm runs in the loss's chunks where upipe runs the stack -- unless its
    # parameters are an FSDP2 unit's, sharded until that unit's call (accelerate makes the
    # norm and lm_head one): it runs in the stack then, its call gathering them
    norm_sharded = any(hasattr(p, "full_tensor") for p in base.norm.parameters())
    norm_in_loss = memory.options.layers_replaced and not norm_sharded
    out = base(
        input_ids=input_ids, **kwargs, **({"_upipe_final_norm": False} if norm_in_loss else {})
    )
    # through lm_head's own call, so that what wraps it acts as on the logits' path: FSDP2
    # gathers its weight before and reduces its gradient after (`_head`)
    spec = (
        shift_labels,
        memory.options.loss_chunk,
        ignore_index,
        base.norm if norm_in_loss else None,
    )
    loss_sum = model.get_output_embeddings()(out.last_hidden_state, _upipe_loss=spec)
    loss = token_mean(loss_sum, shift_labels, num_items, memory.group, ignore_index)
    return CausalLMOutputWithPast(loss=loss, logits=None)


def _head(head, head_forward, hidden_BLD, _upipe_loss=None):
    """lm_head's forward: its own (the logits) -- or, given `_upipe_loss` (labels, chunk
    tokens, ignore index, the final norm or None), the chunked loss's sum through its weight
    (`upipe.loss.cross_entropy_sum`)."""
    if _upipe_loss is None:
        return head_forward(hidden_BLD)
    labels_BL, chunk, ignore_index, norm = _upipe_loss
    return cross_entropy_sum(
        hidden_BLD,
        head.weight,
        labels_BL,
        chunk_tokens=chunk,
        ignore_index=ignore_index,
        bias_V=head.bias,
        norm=norm,
    )


def token_mean(loss_sum, labels_BL, num_items_in_batch, group, ignore_index=IGNORE_INDEX):
    """The loss of a converted model from its sum over this rank's labels: the token mean
    over `group` (`causal_lm_loss`; without a group this process's), or with transformers'
    `num_items_in_batch` (the Trainer's count of valid labels over every rank and micro-batch
    of the step) this rank's share sum / count, as transformers' `ForCausalLMLoss` computes
    it."""
    if num_items_in_batch is None and group is None:
        return loss_sum / count_valid(labels_BL, ignore_index)
    if num_items_in_batch is None:
        return global_token_mean(loss_sum, count_valid(labels_BL, ignore_index), group)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss_sum.device)
    return loss_sum / num_items_in_batch


def model_problem(model, options: MemoryOptions) -> str | None:
    """The first reason `options` cannot apply to `model`, or None."""
    base = model.model
    problem = options.problem(len(base.layers))
    if problem:
        return problem
    if getattr(model, "upipe_memory", None) is not None:
        return "upipe's memory features were already applied to this model"
    if options.layers_replaced:
        try:
            arch = architecture(model)
        except ValueError as e:
            return f"tiled_mlp / activation_checkpoint run upipe's decoder layers: {e}"
        problem = memory_problem(model, arch)
        if problem:
            return problem
    if options.chunked_loss and getattr(model.config, "final_logit_softcapping", None):
        return (
            f"final_logit_softcapping={model.config.final_logit_softcapping} with "
            "chunked_loss=True: the chunked loss takes the logits from lm_head alone, without "
            "the soft-capping; use chunked_loss=False (the model's own logits apply it)"
        )
    if options.chunked_loss:
        head = model.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            return (
                f"chunked_loss=True computes the loss through the model's lm_head as a "
                f"torch.nn.Linear, got {type(head).__name__}: use chunked_loss=False"
            )
    return None


def install(model, options: MemoryOptions, group) -> HFMemory:
    """Install `options` on `model` (checked by `model_problem`); returns its HFMemory."""
    base = model.model
    memory = HFMemory(options, len(base.layers), group)
    model.upipe_memory = memory
    if options.layers_replaced:
        memory.arch = architecture(model)
        base.forward = functools.partial(_decoder_stack, base, memory)
        forward = layer_forward(memory.arch)
        for layer in base.layers:
            layer.forward = functools.partial(forward, layer, memory)
    if options.chunked_loss:
        hf_forward = model.forward

        @functools.wraps(type(model).forward)  # its signature: the Trainer reads it
        def forward(self, *args, **kwargs):
            return _causal_lm(self, memory, hf_forward, *args, **kwargs)

        model.forward = types.MethodType(forward, model)
        head = model.get_output_embeddings()
        head.forward = functools.partial(_head, head, head.forward)
    return memory


def apply_memory_features(model, *, group=None, **options):
    """upipe's memory features on a Hugging Face causal LM whose attention is someone else's
    -- DeepSpeed's or upipe's drop-ins for ALST (`upipe.integrations.deepspeed`), or none
    (one process) -- in place; returns the model. `apply_context_parallel` takes the same
    options itself: use this only without it.

    `options`: the fields of `MemoryOptions`. `group`: the sequence-parallel group the
    sequence is split over (each rank's `shift_labels` and position ids are its shard's, as
    ALST's data loader adapter makes them); the chunked loss is then the mean over the
    group's tokens (or, given `num_items_in_batch`, this rank's share), and each call is
    checked on every rank of it before the model runs (a ValueError on all of them). Without
    a group the loss is this process's mean, and labels= alone are shifted as transformers
    shifts them."""
    opts = MemoryOptions(**options)
    problem = model_problem(model, opts)
    if problem:
        raise ValueError(problem)
    memory = install(model, opts, group)
    C = 1 if group is None else dist.get_world_size(group)

    def check(module, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        x = kwargs.get("inputs_embeds") if x is None else x

        def local():
            if x is None or x.dim() < 2:
                raise ValueError("pass input_ids [batch, local_seq] or inputs_embeds")
            problem = window_problem(module.config, C * x.shape[1])
            problem = problem or memory.call_problem(module, kwargs)
            if problem:
                raise ValueError(problem)

        if group is None:
            local()
        else:
            agree_across_ranks(group, local, lambda: {"local batch x tokens": tuple(x.shape[:2])})

    model.model.register_forward_pre_hook(check, with_kwargs=True)
    return model
