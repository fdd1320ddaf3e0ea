"""The parallelize step: swap each block's attention for a context-parallel one, switch the
memory features on, and shard with FSDP2. The model code stays parallelism-free.

Strategies (C = context-parallel size = ring x ulysses):
- "none": every rank holds whole sequences (C = 1; ranks are data-parallel replicas);
- "ulysses", "upipe": all-to-all over C ranks (heads split), contiguous sequence shards;
  "upipe" on a mesh with ring > 1 runs each stage's attention as ring attention;
- "ring": ring attention over C ranks, zigzag shards (load-balanced causal work);
- "usp": Ulysses inside groups of `ulysses` ranks, ring across them (2-D, zigzag ring dim).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from torch import nn

from upipe.attention.module import ContextParallelAttention
from upipe.attention.registry import Strategy
from upipe.comm import sequence_positions
from upipe.model.features import ATTENTION_OUTPUTS
from upipe.model.llama import Attention, CausalLM
from upipe.model.offload import Offloader
from upipe.torch_private import flatten_mesh


@dataclasses.dataclass(kw_only=True)
class ContextParallel:
    """Where this rank's tokens sit: the group or mesh the attention communicates over, and
    the strategy's registry entry (resolved once, by the caller)."""

    spec: Strategy
    size: int
    group: object = None
    mesh: object = None
    layout: str = "contiguous"

    @property
    def strategy(self) -> str:
        return self.spec.name

    def positions(self, seq_len: int, device=None) -> torch.Tensor:
        """Global positions `[L]` of this rank's tokens of a length-`seq_len` sequence."""
        if self.size == 1:
            return torch.arange(seq_len, device=device)
        if self.mesh is not None:
            return sequence_positions(seq_len, mesh=self.mesh, layout=self.layout, device=device)
        return sequence_positions(
            seq_len,
            rank=dist.get_rank(self.group),
            world_size=self.size,
            layout=self.layout,
            device=device,
        )


def context_parallel(spec: Strategy, mesh) -> ContextParallel:
    """The `ContextParallel` of strategy `spec` (its registry entry) on a `upipe.make_mesh`
    mesh (dims dp, ring, ulysses)."""
    R, U = mesh["ring"].size(), mesh["ulysses"].size()
    if not spec.context_parallel:
        return ContextParallel(spec=spec, size=1)
    if R > 1 and U > 1:
        return ContextParallel(spec=spec, size=R * U, mesh=mesh, layout="zigzag")
    dim = spec.group_dim
    return ContextParallel(
        spec=spec, size=mesh[dim].size(), group=mesh[dim].get_group(), layout=spec.layout
    )


def parallelize(
    model: CausalLM, cp: ContextParallel, *, heads_per_stage: int | None = None, backend=None
) -> CausalLM:
    """Replace every block's `Attention` by a `ContextParallelAttention` of `cp.strategy`
    holding the *same* parameter objects (nothing is copied), and give an MoE model the sum
    over the context-parallel group of its routing statistics (`router_stats_reduce`).
    Returns `model`."""
    spec = cp.spec
    if model.config.n_experts:
        model.router_stats_reduce = sequence_sum(cp)
    if spec.module is None:
        return model
    for block in model.model.layers:
        old: Attention = block.self_attn
        new = ContextParallelAttention(
            model.config.hidden_size,
            old.num_heads,
            old.num_kv_heads,
            old.head_dim,
            group=cp.group,
            mesh=cp.mesh,
            layout=cp.layout,
            strategy=spec.module,
            heads_per_stage=heads_per_stage if spec.heads_per_stage else None,
            rope_theta=old.rope_theta,
            rope_scaling=old.rope_scaling,
            qk_norm=old.q_norm is not None,
            norm_eps=old.norm_eps,
            backend=backend,
            window=old.window,
            device="meta",
        )
        for name, child in old.named_children():
            setattr(new, name, child)  # the same Linear / RMSNorm modules, same parameters
        block.self_attn = new
    return model


def sequence_sum(cp: ContextParallel):
    """A function summing a tensor in place over the ranks that hold the parts of the same
    sequences (None for C = 1): one all-reduce over the group, or on a (ring, ulysses) mesh
    one over each dimension in turn -- the sum over the grid, the same on every rank (every
    ulysses group adds the same ring sums in the same order), without a flattened group."""
    if cp.size == 1:
        return None
    groups = (
        [cp.group] if cp.mesh is None else [cp.mesh[d].get_group() for d in ("ring", "ulysses")]
    )

    def reduce(t: torch.Tensor) -> None:
        for group in groups:
            dist.all_reduce(t, group=group)

    return reduce


@dataclasses.dataclass(kw_only=True)
class MemoryFeatures:
    tiled_mlp: int | None = None
    """Run the MLP in sequence tiles of this many tokens, recomputed in backward."""
    loss_chunk: int | None = None
    """Compute the cross-entropy this many tokens at a time (no [L, V] logits)."""
    activation_checkpoint: bool = False
    """Activation checkpointing (only each checkpoint's input is kept)."""
    blocks_per_checkpoint: int = 1
    """Blocks per checkpoint m: one input saved per m blocks, m - 1 more recomputed and held
    during the checkpoint's backward (`upipe.model.features._Checkpoint`)."""
    offload: bool = False
    """Keep the checkpointed inputs in host memory (CUDA; needs activation_checkpoint)."""
    keep_on_gpu: int = 0
    """With offload: the inputs of the last K checkpoints stay on the device."""
    attention_outputs: str = "recompute"
    """With activation_checkpoint: "keep" -- the recomputation in backward reuses each
    attention layer's forward outputs and lse (kept on the device from its forward to its
    backward: one [B, L, H*d] tensor plus B * L * H fp32 per layer) and calls no attention
    kernel; "offload" -- the same, kept in host memory beside the offloaded block inputs
    (needs offload); "recompute" -- call the kernel again. Bit-identical results
    (`upipe.model.features.activation_checkpoint`, `upipe.attention.kept`)."""


def check_memory_features(features: MemoryFeatures, flag=str) -> str | None:
    """The first combination of `features` that cannot run, as a message naming the fix (the
    one home of these rules); `flag(field name)` says how a field is spelt (`upipe train`:
    as its option)."""
    ckpt, off, out = (flag(n) for n in ("activation_checkpoint", "offload", "attention_outputs"))
    if features.offload and not features.activation_checkpoint:
        return f"{off} keeps the checkpointed block inputs on the host; add {ckpt}"
    mode = features.attention_outputs
    if mode not in ATTENTION_OUTPUTS:
        return f"{out} must be one of {', '.join(ATTENTION_OUTPUTS)}, got {mode!r}"
    if mode != "recompute" and not features.activation_checkpoint:
        return (
            f"{out} {mode} hands each attention layer's forward outputs to the recomputation "
            f"of activation checkpointing; add {ckpt}"
        )
    if mode == "offload" and not features.offload:
        return (
            f"{out} offload keeps them in host memory beside the offloaded block inputs; add "
            f"{off} (or keep them on the device: {out} keep)"
        )
    return None


def apply_memory_features(model: CausalLM, features: MemoryFeatures, device) -> CausalLM:
    """Switch the features on (the model's attributes; see `upipe.model.llama`)."""
    problem = check_memory_features(features)
    if problem:
        raise ValueError(problem)
    for block in model.model.layers:
        block.mlp.tile_tokens = features.tiled_mlp
    model.loss_chunk_tokens = features.loss_chunk
    model.recompute_blocks = features.activation_checkpoint and features.blocks_per_checkpoint
    model.attention_outputs = features.attention_outputs
    on_device = torch.device(device).type not in ("cpu", "meta")
    offload = features.offload and on_device  # (on the CPU the inputs are in host memory already)
    model.offload = make_offloader(len(model.model.layers), features) if offload else None
    return model


def make_offloader(n_layers: int, features: MemoryFeatures, host="cpu") -> Offloader:
    """The offloader of `features` for `n_layers` blocks: a slot for each checkpoint but the
    last K, and m - 1 scratch slots (m blocks per checkpoint):

        n_inputs = ceil(n_layers / m) - K,  scratch = m - 1
    """
    m = features.blocks_per_checkpoint
    n_inputs = -(-n_layers // m) - features.keep_on_gpu
    if n_inputs < 1:
        raise ValueError(
            f"keep_on_gpu {features.keep_on_gpu} keeps every one of the {-(-n_layers // m)} "
            "checkpoints on the device: keep fewer, or turn offload off"
        )
    return Offloader(n_inputs, host, scratch=m - 1)


def apply_fsdp(
    model: CausalLM, mesh, *, param_dtype: torch.dtype | None = None, offload: bool = False
) -> CausalLM:
    """FSDP2 over every rank of `mesh` (data x context): each block is one unit, the root
    holds embeddings, final norm and head. Parameters, gradients and optimizer states are
    sharded across the context-parallel ranks too. Gradients are *summed* over ranks (divide
    factor 1): each rank's loss is already its share of the global token mean.

    `param_dtype`: the compute dtype, if it differs from the parameters' (mixed precision):
    the sharded parameters (the optimizer's masters), their gradients and the AdamW states
    keep the parameters' dtype (fp32); each unit's parameters are all-gathered and cast to
    `param_dtype` for its forward and backward only (`MixedPrecisionPolicy(param_dtype,
    reduce_dtype=fp32)`), and the gradients are reduce-scattered and accumulated in fp32.

    `offload`: FSDP2's `CPUOffloadPolicy` for every unit: the sharded parameters (the
    masters), their gradients and the optimizer states live in host memory; the device holds
    only what a running unit needs. The caller materialises the sharded parameters on the
    CPU (`model.to_empty(device="cpu")`: FSDP2 refuses others). What happens on CUDA (torch
    2.13, `torch/distributed/fsdp/_fully_shard/`), per unit:
    - forward and backward: each sharded parameter is copied host-to-device
      (`FSDPParam.all_gather_inputs`: `.to(device, non_blocking=True)`, a full-precision
      device copy of the shard, then the cast to `param_dtype`), in the all-gather copy-in
      stream, into the all-gather; the unsharded parameters are freed after the unit as
      without offload. (Offload turns off the fused foreach cast-and-copy of
      `_get_param_all_gather_inputs`: one copy and one cast per parameter.)
    - after the reduce-scatter (`_fsdp_collectives.foreach_reduce`, in the reduce-scatter
      stream) each gradient shard is copied device-to-host, into pinned memory with
      `non_blocking=True` when the gradient is new (not accumulated) and no
      post-accumulate-grad hook is set, else synchronously (the CPU waits). The device's
      reduce-scatter output is released right after the copy is queued (later work in
      that stream runs after it); the CPU waits for each pending copy's event at the end
      of backward (`FSDPParamGroup.finalize_backward`), before the optimizer reads the
      gradient. With gradient accumulation the later micro-batches copy synchronously and
      add into the host gradient on the CPU.
    - `clip_grad_norm_` and AdamW then run on CPU tensors (AdamW's per-parameter loop:
      foreach and fused need device tensors): the update costs host memory bandwidth, no
      device memory. The norm's reduction over ranks is a collective on CPU tensors, which
      needs a CPU backend next to NCCL (`init_process_group("cuda:nccl,cpu:gloo")`, as
      `upipe train` does with --fsdp-offload); so do DCP's checkpoints and
      `full_tensor()` (--save-hf), which read and write the host shards.
    `pin_memory` is set only on CUDA: pinned buffers (the parameter shards, each gradient's
    copy) come from CUDA's caching host allocator, which rounds each up to a power of two
    and keeps freed blocks for reuse; AdamW's states (`zeros_like` of a shard) are pageable.
    On the CPU (gloo) the policy's copies are to the same device (no copy), and the cast
    runs per parameter: the same values as without offload (`tests/runs/test_fsdp_offload.py`)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mp = MixedPrecisionPolicy()
    if param_dtype is not None:
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else None
    flat = flatten_mesh(mesh, "fsdp") if mesh.ndim > 1 else mesh
    for unit in [*model.model.layers, model]:
        fully_shard(unit, mesh=flat, mp_policy=mp, offload_policy=policy or OffloadPolicy())
    for unit in [*model.model.layers, model]:  # the settings are per unit
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    return model


class MasterWeights:
    """Mixed precision without FSDP: `model` (the compute copy, e.g. bf16) runs forward and
    backward; `master` (a module of the same structure in fp32, never run) holds the weights
    the optimizer updates. The scheme of Megatron-LM (`Float16OptimizerWithFloat16Params`
    and its DDP's `main_grad`):

    - each compute gradient is added into the master's fp32 `.grad` as soon as autograd
      has accumulated it (a post-accumulate-grad hook) and then freed, so gradients are
      accumulated -- over micro-batches too -- and all-reduced in fp32, and the compute-
      dtype gradients never all exist at once;
    - the optimizer (and its states) and the checkpoint see only the fp32 masters;
    - after each optimizer step `copy_to_model` rounds the masters into the compute copy.

    Bytes per parameter: 4 master + 4 gradient + 8 AdamW + 2 compute copy = 18 (16 in fp32,
    8 in all-bf16), measured by `tests/runs/test_mixed_precision.py`.

    Why a persistent compute copy and not something lighter: `torch.autocast` is a different
    recipe (fp32 weights, each matmul casting its operands on every call and keeping
    non-matmul ops in fp32); the fused UPipe op and the ring take the weights and call aten
    kernels directly, and the memory features re-run modules inside backward (reentrant
    checkpoint, tiled MLP), where an autocast region or a `functional_call` swap of the
    weights has ended. A compute copy in the model makes every kernel see exactly the dtypes
    it sees under FSDP2's `param_dtype=bf16`: one compute path with and without FSDP.
    """

    def __init__(self, model: nn.Module, master: nn.Module):
        named = dict(model.named_parameters())
        masters = dict(master.named_parameters())
        if named.keys() != masters.keys():
            raise ValueError("the master module must have the compute model's parameters")
        self.model, self.master = model, master
        self.pairs = [(named[n], masters[n]) for n in named]
        for p, m in self.pairs:
            p.register_post_accumulate_grad_hook(functools.partial(_fold_grad, m))
        self.copy_to_model()

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the master weights into the compute copy."""
        for p, m in self.pairs:
            p.copy_(m)


def _fold_grad(master: torch.Tensor, p: torch.Tensor) -> None:
    """Add `p`'s gradient into `master.grad` (in the master's dtype) and free it."""
    if master.grad is None:
        master.grad = p.grad.to(master.dtype)
    else:
        master.grad.add_(p.grad)
    p.grad = None


def allreduce_gradients(model: nn.Module, group=None) -> None:
    """Without FSDP: sum every gradient over all ranks (one flat buffer per dtype)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        for g, part in zip(same, flat.split([g.numel() for g in same]), strict=True):
            g.copy_(part.view_as(g))
