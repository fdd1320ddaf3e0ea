"""Every private torch API upipe uses, in one place, each with why no public one fits.

upipe is tested on torch 2.13 only (pyproject pins it). Where 2.13 has a public way, upipe
uses it (e.g. `init_process_group("fake")` for the simulator, without the private
`FakeStore`); what remains is here, and `tests/test_torch_private.py` exercises each entry,
so a torch release that changes one fails there, loudly, before any user sees it.
"""

from __future__ import annotations

import functools

import torch
from torch._subclasses import FakeTensorMode
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = [
    "FakeTensor",
    "FakeTensorMode",
    "FSDPParam",
    "ShardedState",
    "TorchDispatchMode",
    "cudnn_lse_dims",
    "cudnn_sdpa_ops",
    "current_graph_task_id",
    "flatten_mesh",
    "is_traceable_wrapper_subclass",
    "saved_tensor_hooks_active",
    "selective_saved_tensor_hooks",
    "unset_fake_temporarily",
]
# FakeTensorMode / FakeTensor / unset_fake_temporarily: the planner runs a training step on
# tensors without memory; torch exposes fake tensors only under torch._subclasses.
# TorchDispatchMode / is_traceable_wrapper_subclass: the memory tracker sees every operator
# (the documented way to write a dispatch mode, still in a private module path).
# FSDPParam / ShardedState: the planner gives FSDP2's CPU offload its CUDA memory by wrapping
# `FSDPParam.all_gather_inputs` (the host-to-device copy of each shard, which a CPU run does
# not make; `upipe.planner.step._h2d_all_gather_inputs`): FSDP2 has no hook there.


def flatten_mesh(mesh, name: str | None = None):
    """`mesh` as a 1-D mesh over all of its ranks (`DeviceMesh._flatten`). A process group
    over a mesh's ranks made by `dist.new_group` would need every rank of the world to call
    it for every block of the mesh; the mesh's own flattening creates it once per block."""
    return mesh._flatten(name) if name is not None else mesh._flatten()


def saved_tensor_hooks_active() -> bool:
    """Whether default saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`, as
    activation checkpointing and CPU offload install) are active, other than
    `selective_saved_tensor_hooks`: torch offers the context manager but no public query
    (the innermost pair is what `_top_saved_tensors_default_hooks` returns)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        return False
    return getattr(top[0], "outer_hooks_active", True)


def selective_saved_tensor_hooks(pack, unpack):
    """`saved_tensors_hooks(pack, unpack)` for hooks that act on a few known tensors and pass
    every other one through unchanged (`pack(t) is t`): `saved_tensor_hooks_active` then
    answers as outside them, so code that keeps intermediates out of `save_for_backward`
    while no hooks want to see them (upipe's attention ops, to free them early) still
    does."""
    pack.outer_hooks_active = saved_tensor_hooks_active()
    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def current_graph_task_id() -> int:
    """The running autograd graph task (-1 outside backward): the planner uses it to tell a
    backward's allocations from the forward's; no public equivalent."""
    return torch._C._current_graph_task_id()


# aten's cuDNN attention ops as `upipe.kernels_cuda` calls them, by position: torch 2.13's
# schemas (native_functions.yaml); other versions are checked against them at first use
_CUDNN_SDPA_ARGS = {
    "_scaled_dot_product_cudnn_attention": (
        "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
        "return_debug_mask", "scale",
    ),
    "_scaled_dot_product_cudnn_attention_backward": (
        "grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset",
        "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale",
    ),
}  # fmt: skip


@functools.cache
def cudnn_sdpa_ops():
    """(forward, backward): aten's `_scaled_dot_product_cudnn_attention` and its backward,
    the only way to reach cuDNN's attention with its log-sum-exp (F.scaled_dot_product_attention
    returns no lse), after checking that this torch's schemas take the arguments upipe
    passes by position -- a torch that reorders them fails here, naming the op, instead of
    misreading an argument."""
    ops = []
    for name, want in _CUDNN_SDPA_ARGS.items():
        op = getattr(torch.ops.aten, name).default
        got = tuple(a.name for a in op._schema.arguments)
        if got != want:
            raise RuntimeError(
                f"torch {torch.__version__}'s aten::{name} takes {got}, not the {want} upipe "
                "passes (torch 2.13's): upipe.kernels_cuda needs updating for this torch"
            )
        ops.append(op)
    return tuple(ops)


@functools.cache
def cudnn_lse_dims() -> int:
    """How many dims the lse of aten's cuDNN forward has: 4 (`[B, H, S, 1]`, torch 2.13's
    cudnn/MHA.cpp `run_cudnn_SDP_fprop`), or 3 (`[B, H, S]`, as older MHA.cpp sources
    allocated it). Read from this torch's meta kernel of the op, which mirrors the CUDA op's
    outputs (torch.compile relies on it), so no GPU is needed to know it."""
    forward, _ = cudnn_sdpa_ops()
    q = torch.empty(1, 1, 2, 8, device="meta", dtype=torch.bfloat16)
    try:
        return forward(q, q, q, None, True)[1].dim()
    except NotImplementedError:  # no meta kernel: the layout of torch 2.13's CUDA op
        return 4
