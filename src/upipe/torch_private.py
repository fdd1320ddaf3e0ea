"""Every private torch API upipe uses, in one place, each with why no public one fits.

upipe is tested on torch 2.13 only (pyproject pins it). Where 2.13 has a public way, upipe
uses it (e.g. `init_process_group("fake")` for the simulator, without the private
`FakeStore`); what remains is here, and `tests/test_torch_private.py` exercises each entry,
so a torch release that changes one fails there, loudly, before any user sees it.
"""

from __future__ import annotations

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
