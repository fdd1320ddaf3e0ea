"""Hugging Face `transformers` causal LMs, made context-parallel in one call.

Legend: B batch, S full sequence, L = S / C local tokens, D model width, V vocabulary,
d head dim, C ranks the sequence is split over (group size, or ring x ulysses on a mesh).

    model = LlamaForCausalLM.from_pretrained(path)   # or another of hf_archs.ARCHITECTURES
    apply_context_parallel(model, group=dist.group.WORLD)   # strategy="upipe" by default
    batch = shard_batch(input_ids_BS, group=dist.group.WORLD)
    labels_BL = batch.pop("labels")
    logits_BLV = model(**batch).logits            # input_ids, position_ids (+ documents)
    loss = causal_lm_loss(logits_BLV, labels_BL, group=dist.group.WORLD)
    loss.backward()      # parameter gradients: this rank's share; sum them over the ranks

`apply_context_parallel` puts a `HFContextParallelAttention` in place of each decoder layer's
`self_attn`. It holds the model's own `q_proj`/`k_proj`/`v_proj`/`o_proj` (Phi-3's fused
`qkv_proj`; Qwen3's, OLMo's and Gemma 3's `q_norm`/`k_norm`; gpt-oss's `sinks`:
`upipe.integrations.hf_archs`) modules and parameters -- the same objects, so no weight is
copied or permuted and the state-dict keys are unchanged: a checkpoint loads before or after
the call. A hybrid model's Gated DeltaNet layers (`linear_attn`: Qwen3-Next, Qwen3.5) get a
`HFContextParallelDeltaNet` the same way (`upipe.integrations.hf_deltanet`). Each layer's
sliding window (where the model applies `config.sliding_window`) and softmax scale are the
model's, so any sequence length is exact. RoPE comes from the model itself: its rotary
embedding turns the *global* position ids of this rank's tokens into cos/sin (rope scaling
"linear", "llama3", "yarn" included), which the decoder layers hand to the attention. Nothing
is imported from `transformers` at import time; models are recognised by class name.

Packed sequences (several documents in one row, as transformers' `DataCollatorWithFlattening`
makes them): position ids restart at 0 at each document. `shard_batch(input_ids,
position_ids_BS=...)` finds the documents in the full sequence's position ids and returns
their boundaries as transformers' flash-attention keywords `cu_seq_lens_q`/`cu_seq_lens_k`
(`[0, e_1, ..., S]` of the *full* sequence, a CPU tensor, the same on every rank), which the
model hands to every attention layer: a token then attends only within its document
(`upipe.attention.documents`), and the label of each document's last token is ignored.
The model's attention implementation is set to "upipe" (registered with transformers'
`AttentionInterface`; it has no mask function), so transformers builds no `[L, L]` mask,
packed or not.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from upipe.attention.common import agree_across_ranks, resolve_groups
from upipe.comm import shard_sequence
from upipe.integrations import hf_moe
from upipe.integrations.hf_archs import (
    ARCHITECTURES,
    Arch,
    architecture,
    config_problem,
    rope_types,
)
from upipe.integrations.hf_attention import HFContextParallelAttention
from upipe.integrations.hf_deltanet import HFContextParallelDeltaNet, deltanet_problem
from upipe.integrations.hf_memory import (
    MemoryOptions,
    apply_memory_features,
    chunked_call_problem,
    install,
    model_problem,
    token_mean,
)
from upipe.loss import IGNORE_INDEX, shift_labels
from upipe.mesh import mesh_coordinates
from upipe.packing import check_cu_seqlens, document_positions
from upipe.torch_private import flatten_mesh

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# rope types whose cos/sin depend only on the position (not on the local sequence length)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# the attention implementation a converted model is set to (see the module docstring)
ATTN_IMPLEMENTATION = "upipe"


def _check_model(model) -> Arch:
    """The model's `hf_archs.Arch`; ValueError for what cannot be converted."""
    arch = architecture(model)
    cfg, base = model.config, model.model
    if any(
        isinstance(getattr(layer, "self_attn", None), HFContextParallelAttention)
        or isinstance(getattr(layer, "linear_attn", None), HFContextParallelDeltaNet)
        for layer in base.layers
    ):
        raise ValueError("apply_context_parallel was already applied to this model")
    for rope_type in rope_types(base.rotary_emb):
        if rope_type in STATIC_ROPE_TYPES:
            continue
        raise ValueError(
            f"rope type {rope_type!r} is not supported: its cos/sin depend on the local sequence "
            f"length, which differs from the full one under context parallelism; supported: "
            f"{STATIC_ROPE_TYPES}"
        )
    problem = config_problem(cfg)
    if problem:
        raise ValueError(problem)
    if getattr(cfg, "attention_dropout", 0.0):
        raise ValueError(
            f"attention_dropout ({cfg.attention_dropout}) is not supported; set "
            "model.config.attention_dropout = 0.0"
        )
    for layer in base.layers:
        mixer = getattr(layer, "linear_attn", None)
        problem = mixer is not None and deltanet_problem(mixer)
        if problem:
            raise ValueError(problem)
    return arch


def hybrid_split_problem(strategy: str, ring: int) -> str | None:
    """Why a hybrid model (Gated DeltaNet layers) cannot run `strategy` on a mesh with a
    ring dim of `ring` (1: a group, or no ring), or None: its linear layers are split by
    heads only (the sequence split of issue 29 is not built). `upipe plan` refuses the same
    candidates with this message (`upipe.planner.hf.hybrid_problem`)."""
    if strategy != "ring" and ring <= 1:
        return None
    what = "strategy='ring'" if strategy == "ring" else f"a mesh with a ring dim of {ring}"
    return (
        f"{what} is not supported for hybrid models (Gated DeltaNet layers): their linear "
        "layers are split by heads (Ulysses / UPipe), not along the sequence; use "
        "strategy='upipe' or 'ulysses' on a group (or a mesh with ring=1)"
    )


def _check_hybrid(arch: Arch, strategy, mesh) -> None:
    """Hybrid models (Gated DeltaNet layers) split their linear layers by heads only."""
    problem = arch.hybrid and hybrid_split_problem(
        strategy, 1 if mesh is None else mesh["ring"].size()
    )
    if problem:
        raise ValueError(problem)


def _sequence_group(group, mesh):
    """The process group over all ranks holding one sequence (a mesh's ring x ulysses)."""
    if group is not None:
        return group
    block = mesh["ring", "ulysses"]
    return (
        dist.group.WORLD
        if block.size() == dist.get_world_size()
        else flatten_mesh(block).get_group()
    )


def _block_index(group, mesh) -> tuple[int, int]:
    """(this rank's block of the contiguous sequence, number of blocks)."""
    if group is not None:
        return dist.get_rank(group), dist.get_world_size(group)
    i, j = mesh_coordinates(mesh)
    U = mesh["ulysses"].size()
    return i * U + j, mesh["ring"].size() * U


def _check_documents(cu_q, cu_k, pos_BL, block: int, S: int) -> tuple[int, ...]:
    """The documents of a packed call, validated: boundaries of the full sequence of S tokens
    (the same for queries and keys), and this rank's position ids restarting at each.

    One host read of the boundaries (`check_cu_seqlens`; none for a CPU tensor, which
    `shard_batch` returns) and one of a boolean (the positions check) per model call."""
    if cu_q is None or cu_k is None:
        raise ValueError("pass both cu_seq_lens_q and cu_seq_lens_k (the same tensor)")
    bounds = check_cu_seqlens(cu_q, S)
    if cu_k is not cu_q and check_cu_seqlens(cu_k, S) != bounds:
        raise ValueError(
            "cu_seq_lens_k differs from cu_seq_lens_q: self-attention over packed documents "
            "takes the same boundaries for both"
        )
    L = pos_BL.shape[1]
    want_L = document_positions(bounds, S, device=pos_BL.device)[block * L : (block + 1) * L]
    if not bool((pos_BL == want_L).all()):
        raise ValueError(
            "position_ids do not restart at 0 at the documents of cu_seq_lens_q (this rank's "
            f"tokens {block * L}..{(block + 1) * L - 1}); take both from shard_batch"
        )
    return bounds


def _model_call(kwargs) -> dict:
    """What the decoder stack's input hook needs of the model call's keywords."""
    shifted = kwargs.get("shift_labels")
    return {
        "labels": kwargs.get("labels") is not None,
        "shift_labels": None if shifted is None else tuple(shifted.shape),
        "logits_to_keep": kwargs.get("logits_to_keep", 0),
        "return_dict": kwargs.get("return_dict"),
        "router_logits": kwargs.get("output_router_logits"),
    }


def _input_hook(state):
    """A forward pre-hook for the decoder stack (`model.model`): checks the call on every
    rank, and makes every rank raise the same ValueError, before any collective."""

    def hook(module, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
        pos = kwargs.get("position_ids")
        mask = kwargs.get("attention_mask")
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        # the model call's labels= / shift_labels= (shape) / logits_to_keep / return_dict, as
        # noted by the model's own pre-hook: a wrapper such as TRL's fused head consumes them
        # before calling the decoder stack
        call, state["call"] = state["call"], _model_call({})
        labels_given, shifted = call["labels"], call["shift_labels"]
        router = state["router"] is not None and state["router"].wanted(call["router_logits"])
        block, n_blocks = _block_index(state["group"], state["mesh"])
        state["docs"] = None

        def local():
            if labels_given and shifted is None:
                raise ValueError(
                    "labels= would give a loss over this rank's tokens only: transformers shifts "
                    "them within the shard, losing the label of its last token (the next rank's "
                    "first); pass the labels shard_batch returns (already shifted) as "
                    "shift_labels= (and labels=, which transformers needs to compute a loss), or "
                    "call the model without labels and use causal_lm_loss"
                )
            if kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
                raise ValueError("past_key_values / use_cache=True (generation) are not supported")
            if x is None or x.dim() < 2:
                raise ValueError("pass input_ids [batch, local_seq] or inputs_embeds")
            if torch.is_autocast_enabled(x.device.type):
                raise ValueError(
                    "autocast (mixed precision: the Trainer's bf16=True / fp16=True) is not "
                    "supported: the fused attention takes the weights in their own dtype; load "
                    "the model in torch.bfloat16 and train with bf16=False, or train in fp32"
                )
            B, L = x.shape[:2]
            if not isinstance(pos, torch.Tensor):
                raise ValueError(
                    "position_ids are required: the global positions of this rank's tokens "
                    "(shard_batch returns them); without them every rank would start at 0"
                )
            if pos.dim() != 2 or pos.shape[1] != L or pos.shape[0] not in (1, B):
                raise ValueError(f"position_ids must be [{B}, {L}], got {tuple(pos.shape)}")
            if shifted is not None and shifted != (B, L):
                raise ValueError(
                    f"shift_labels must be this rank's [{B}, {L}] labels (shard_batch's), got "
                    f"{list(shifted)}"
                )
            if cu_q is not None or cu_k is not None:
                state["docs"] = _check_documents(cu_q, cu_k, pos, block, n_blocks * L)
            elif L > 1 and not bool((pos.diff(dim=-1) == 1).all()):
                raise ValueError(
                    "position_ids restart inside this rank's shard: for packed sequences "
                    "(positions restarting per document) pass the documents' boundaries too, "
                    "as cu_seq_lens_q/cu_seq_lens_k: shard_batch(input_ids, "
                    "position_ids_BS=...) returns them"
                )
            if mask is not None and (mask.dim() != 2 or not bool(mask.bool().all())):
                raise ValueError(
                    "attention_mask with padding is not supported (causal attention over the "
                    "whole sequence only); pass attention_mask=None and mark padded positions "
                    f"with labels = {IGNORE_INDEX}"
                )
            problem = state["memory"].call_problem(module, kwargs)
            if problem is None and labels_given and state["memory"].options.chunked_loss:
                problem = chunked_call_problem(call["logits_to_keep"], call["return_dict"])
            problem = problem or hf_moe.problem(state["model"], router)
            if problem:
                raise ValueError(problem)

        def signature():
            B, L = x.shape[:2]
            sig = {"local batch x tokens": (B, L), "router aux loss": router}
            if state["docs"] is not None:  # positions checked against the documents
                return {**sig, "documents": True}
            # a sequence continues across the ranks: rank block r starts at offset + r * L
            offsets = tuple((pos[:, 0] - block * L).tolist())  # (once per model call)
            return {**sig, "position offset": offsets}

        group, cohort = state["agree"] or (state["ulysses"], None)
        agree_across_ranks(group, local, signature, cohort)

    return hook


def _never_called(module, *args, **kwargs):
    raise RuntimeError(
        "the 'upipe' attention implementation is never called: apply_context_parallel puts "
        "HFContextParallelAttention in place of each layer's self_attn"
    )


def _use_upipe_attention(model) -> None:
    """Set the model's attention implementation to "upipe": registered with transformers'
    `AttentionInterface` (its extension point for custom attention) and absent from its mask
    functions, so that transformers builds no attention mask (see the module docstring)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _never_called)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


def apply_context_parallel(
    model,
    *,
    group=None,
    mesh=None,
    strategy="upipe",
    heads_per_stage=None,
    linear_heads_per_stage=None,
    linear_stage_inputs="recompute",
    backend=None,
    tiled_mlp=False,
    mlp_tile=1024,
    chunked_loss=False,
    loss_chunk=1024,
    activation_checkpoint=False,
    blocks_per_checkpoint=1,
    offload=False,
    keep_on_gpu=0,
    attention_outputs="recompute",
):
    """Make a Hugging Face causal LM context-parallel, in place; returns the model.

    Supported: `upipe.integrations.hf_archs.ARCHITECTURES` (Llama, Mistral, Qwen2, Qwen3,
    Qwen3-MoE, Mixtral, OLMo 2 / 3, Phi-3, Gemma 3, gpt-oss, and the hybrids Qwen3-Next,
    Qwen3.5, Qwen3.5-MoE; sliding windows, attention sinks, per-layer-type RoPE; what each
    needs is there, and why Gemma 2 and Gemma 3's multimodal model are refused). MoE models'
    router aux loss (`output_router_logits=True`) is the whole sequence's
    (`upipe.integrations.hf_moe`). Exactly one of `group` (1-D) or `mesh` (2-D, ring x
    ulysses, `upipe.make_mesh`). `strategy`: "upipe" (the fused staged op; `heads_per_stage`
    as in `ContextParallelAttention`), "ulysses" (USP on a mesh) or "ring" (group only). A
    hybrid's Gated DeltaNet layers (`upipe.integrations.hf_deltanet`) are split by heads with
    the same strategy -- "upipe" in stages of `linear_heads_per_stage` value heads (default:
    `heads_per_stage`; `linear_stage_inputs` "keep": each stage's exchanged inputs kept for
    backward instead of recomputed -- faster, more memory: docs/hybrid.md), "ulysses" all at
    once; "ring" and meshes with a ring dim are refused.
    `backend`: the local attention kernel (`upipe.kernels.BACKENDS`; None: "auto", by device,
    dtype and head dim, as in `ContextParallelAttention`).
    Each rank then holds a contiguous block of the sequence (`shard_batch`), calls the model
    with `position_ids`, and computes the loss with `causal_lm_loss` -- or lets the model do
    it: `model(..., labels=l, shift_labels=l)` with `l` shard_batch's (already shifted)
    labels returns the same loss (`model.loss_function` is set to upipe's; with transformers'
    `num_items_in_batch` it is this rank's share, as the Trainer expects: see
    `upipe.integrations.trainer`). Also sets the model's attention implementation to "upipe"
    (so transformers builds no `[L, L]` mask that would go unused) and `config.use_cache =
    False`.

    The memory features (`upipe.integrations.hf_memory.MemoryOptions`; names and meanings
    as `upipe train`'s flags): `tiled_mlp` (tiles of `mlp_tile` tokens), `chunked_loss`
    (chunks of `loss_chunk` tokens; the model then returns the loss with logits=None),
    `activation_checkpoint` (`blocks_per_checkpoint` layers per checkpoint), `offload` (the
    checkpointed inputs in host memory on CUDA, but the last `keep_on_gpu` checkpoints'),
    `attention_outputs` ("keep" / "offload": the recomputation reuses each attention layer's
    forward outputs instead of calling its kernel again).

    Raises ValueError for unsupported models and options (attention logit soft-capping,
    bidirectional attention, dynamic rope, attention dropout, padding masks, labels= without
    shift_labels=, generation, combinations of the memory features that do not go together).
    """
    arch = _check_model(model)
    _check_hybrid(arch, strategy, mesh)
    options = MemoryOptions(
        tiled_mlp=tiled_mlp,
        mlp_tile=mlp_tile,
        chunked_loss=chunked_loss,
        loss_chunk=loss_chunk,
        activation_checkpoint=activation_checkpoint,
        blocks_per_checkpoint=blocks_per_checkpoint,
        offload=offload,
        keep_on_gpu=keep_on_gpu,
        attention_outputs=attention_outputs,
    )
    problem = model_problem(model, options)
    if problem:
        raise ValueError(problem)
    cfg, base = model.config, model.model
    ulysses, _, _, agree = resolve_groups(group, mesh)
    state = {
        "group": group,
        "mesh": mesh,
        "ulysses": ulysses,
        "agree": agree,
        "call": _model_call({}),
        "docs": None,
    }
    linear = ((heads_per_stage, "heads_per_stage") if linear_heads_per_stage is None
              else (linear_heads_per_stage, "linear_heads_per_stage"))  # fmt: skip
    for layer in base.layers:
        if getattr(layer, "linear_attn", None) is not None:  # a hybrid's Gated DeltaNet
            layer.linear_attn = HFContextParallelDeltaNet(
                layer.linear_attn, group=ulysses, strategy=strategy, heads_per_stage=linear[0],
                state=state, keyword=linear[1], stage_inputs=linear_stage_inputs,
            )  # fmt: skip
            continue
        layer.self_attn = HFContextParallelAttention(
            layer.self_attn,
            cfg,
            arch,
            group=group,
            mesh=mesh,
            strategy=strategy,
            heads_per_stage=heads_per_stage,
            backend=backend,
            state=state,
        )
    _use_upipe_attention(model)
    cfg.use_cache = False

    def note_call(module, args, kwargs):
        state["call"] = _model_call(kwargs)

    model.register_forward_pre_hook(note_call, with_kwargs=True)
    sequence_group = _sequence_group(group, mesh)
    model.loss_function = functools.partial(_model_loss, group=sequence_group)
    state["memory"] = install(model, options, sequence_group)
    state["model"] = model
    state["router"] = hf_moe.install(model, sequence_group)  # MoE: the whole sequence's aux
    base.register_forward_pre_hook(_input_hook(state), with_kwargs=True)
    return model


def shard_batch(input_ids_BS, *, labels_BS=None, position_ids_BS=None, group=None, mesh=None):
    """This rank's block of a batch: {"input_ids", "labels", "position_ids"}, each `[B, L]`,
    plus "cu_seq_lens_q"/"cu_seq_lens_k" for packed sequences.

    `input_ids_BS` is the full batch, identical on every rank. Labels are the next tokens
    (`upipe.loss.shift_labels`, taken *before* sharding, so the last token of a block is
    labelled with the first of the next) unless given; position ids default to 0 .. S-1.
    Position ids that restart (a step other than +1, as transformers' packing makes them)
    mark documents: their boundaries `[0, e_1, ..., S]` (int32, on the CPU, the same for
    every row -- a ValueError otherwise) are returned as cu_seq_lens_q/k, and the label of
    each document's last token (the next document's first token) becomes -100.
    Pass the same group/mesh as to `apply_context_parallel`; pass everything but "labels" to
    the model.
    """
    resolve_groups(group, mesh)
    B, S = input_ids_BS.shape
    labels_BS = shift_labels(input_ids_BS) if labels_BS is None else labels_BS
    bounds = None
    if position_ids_BS is None:
        position_ids_BS = torch.arange(S, device=input_ids_BS.device).expand(B, S)
    else:
        bounds = packed_boundaries(position_ids_BS)
    kw = dict(group=group) if group is not None else dict(mesh=mesh, layout="contiguous")
    if bounds is not None:
        labels_BS = labels_BS.clone()
        labels_BS[:, [e - 1 for e in bounds[1:-1]]] = IGNORE_INDEX
    batch = {
        "input_ids": shard_sequence(input_ids_BS, **kw),
        "labels": shard_sequence(labels_BS, **kw),
        "position_ids": shard_sequence(position_ids_BS, **kw),
    }
    if bounds is not None:
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = cu_seqlens
    return batch


def packed_boundaries(position_ids_BS) -> tuple[int, ...] | None:
    """Document boundaries `(0, e_1, ..., S)` from full-sequence position ids: a document
    starts where the position does not follow the previous one (+1), as in transformers'
    packed-sequence detection; None for one document. Rows must agree."""
    step_BS = position_ids_BS.diff(dim=-1) != 1
    if not bool(step_BS.any()):
        return None
    if position_ids_BS.shape[0] > 1 and not bool((step_BS == step_BS[:1]).all()):
        raise ValueError(
            "packed rows have different document boundaries; upipe masks documents with one "
            "set of boundaries per batch: pass one row per call (batch size 1) or rows packed "
            "alike"
        )
    S = position_ids_BS.shape[-1]
    inner = (torch.nonzero(step_BS[0]).flatten() + 1).tolist()
    return (0, *inner, S)


def causal_lm_loss(logits_BLV, labels_BL, *, group=None, mesh=None):
    """Cross-entropy averaged over the valid tokens (labels != -100) of the whole sequence.

    The value is the global mean on every rank, total / count as transformers computes it
    (`upipe.loss.global_token_mean`); its gradient is this rank's share, so the parameter
    gradients summed over the ranks are those of the single-process loss.
    """
    return _global_mean(logits_BLV, labels_BL, _sequence_group(group, mesh))


def _global_mean(logits_BLV, labels_BL, group, ignore_index=IGNORE_INDEX):
    loss_sum = _cross_entropy_sum(logits_BLV, labels_BL, ignore_index)
    return token_mean(loss_sum, labels_BL, None, group, ignore_index)


def _cross_entropy_sum(logits_BLV, labels_BL, ignore_index=IGNORE_INDEX):
    return F.cross_entropy(
        logits_BLV.flatten(0, 1).float(),
        labels_BL.flatten(),
        ignore_index=ignore_index,
        reduction="sum",
    )


def _model_loss(
    logits, labels, vocab_size, num_items_in_batch=None, ignore_index=IGNORE_INDEX,
    shift_labels=None, *, group, **kwargs,
):  # fmt: skip
    """A converted model's `loss_function` (transformers calls it with the model's `labels=`
    and keywords; the input hook has made sure `shift_labels` -- this rank's labels, shifted
    on the full sequence -- came with them).

    With `num_items_in_batch` (transformers' Trainer passes the count of valid labels of
    every rank and micro-batch of the optimizer step): this rank's share, sum / count, as
    transformers' `ForCausalLMLoss` computes it; the Trainer multiplies it by the number of
    processes and DDP averages the gradients, so the step's gradient is the global mean's.
    Without: the mean over the whole sequence on every rank (`causal_lm_loss`)."""
    loss_sum = _cross_entropy_sum(logits, shift_labels, ignore_index)
    return token_mean(loss_sum, shift_labels, num_items_in_batch, group, ignore_index)


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "MemoryOptions",
    "HFContextParallelAttention",
    "apply_context_parallel",
    "apply_memory_features",
    "causal_lm_loss",
    "packed_boundaries",
    "shard_batch",
]
