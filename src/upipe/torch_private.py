"""Every private torch API upipe uses, in one place, each with why no public one fits, and
the torch releases upipe supports.

upipe supports torch 2.11 to 2.15 (`SUPPORTED`; pyproject: `torch>=2.11,<2.16`): CI runs the
full suite on 2.13 and the fast tier on 2.11 and 2.15. Every entry below was read in each of
those releases (2.11.0, 2.13.0, 2.15.0) and is present with the same signature in all of
them (the one difference, `aten._flash_attention_forward`'s extra keyword arguments from
2.13 on, is none that upipe passes). Where 2.13 has a public way, upipe uses it (e.g.
`init_process_group("fake")` for the simulator, without the private `FakeStore`); what
remains is here, each gated:

- imports that a release could move (fake tensors, dispatch modes, pytree, FSDP2's
  `FSDPParam`) are resolved on first use (`__getattr__`): a torch without one fails with an
  error naming the API, this torch and the supported releases, and only where it is used;
- aten's private ops, which upipe calls by position, are checked against the argument names
  upipe passes (`aten_op`) before their first call;
- the flash-attention impl registry (`torch.nn.attention.activate_flash_attention_impl`,
  FA3 / FA4; in 2.11-2.15), where absent, reads as offering no impl, so
  `--attention-kernel fa3/fa4` is refused with its reason and every other kernel runs;
- the cuDNN lse layout is read from this torch's meta kernel (`cudnn_lse_dims`).

`tests/unit/test_torch_private.py` exercises each entry and each gate (with monkeypatched versions
and APIs where a real one is absent), so a torch release that changes one fails there,
loudly, before any user sees it.
"""

from __future__ import annotations

import functools
import importlib
import re

import torch
import torch.nn.attention

SUPPORTED = ((2, 11), (2, 15))
"""The oldest and newest torch releases (major, minor) upipe supports, both included."""

_FUNCTIONS = [
    "SUPPORTED",
    "activate_flash_impl",
    "active_flash_impl",
    "aten_op",
    "cudnn_lse_dims",
    "cudnn_sdpa_ops",
    "current_graph_task_id",
    "flash_impls",
    "flatten_mesh",
    "process_groups",
    "saved_tensor_hooks_active",
    "schema_problem",
    "selective_saved_tensor_hooks",
    "torch_version",
    "unsupported_torch",
]


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a torch version string (this torch's by default): "2.11.0+cu130",
    "2.13.0+cpu" and "2.16.0a0+git1234" give (2, 11), (2, 13) and (2, 16)."""
    text = torch.__version__ if version is None else version
    found = re.match(r"(\d+)\.(\d+)", str(text))
    if found is None:
        raise ValueError(f"cannot read a torch release from the version {text!r}")
    return int(found[1]), int(found[2])


def _supported_text() -> str:
    (a, b), (c, d) = SUPPORTED
    return f"upipe supports torch {a}.{b} to {c}.{d} (pip install 'torch>={a}.{b},<{c}.{d + 1}')"


def unsupported_torch(version: str | None = None) -> str | None:
    """Why this torch (or `version`) is outside `SUPPORTED`, as a message; None inside."""
    release = torch_version(version)
    if SUPPORTED[0] <= release <= SUPPORTED[1]:
        return None
    return f"torch {version or torch.__version__} is untested with upipe: {_supported_text()}"


def _missing(what: str, detail: str) -> str:
    """The error for an API this torch lacks, naming it, this torch and the releases."""
    return f"upipe needs {what}, which torch {torch.__version__} lacks ({detail}); " + (
        unsupported_torch() or _supported_text() + ": please report it"
    )


# name -> (module, attribute): imported on first use (module doc), each with why:
# FakeTensorMode / FakeTensor / unset_fake_temporarily: the planner runs a training step on
# tensors without memory; torch exposes fake tensors only under torch._subclasses.
# TorchDispatchMode / is_traceable_wrapper_subclass: the memory tracker and the simulator see
# every operator (the documented way to write a dispatch mode, still in a private module).
# tree_leaves: the simulator reads the tensors inside a collective's arguments.
# FSDPParam / ShardedState: the planner gives FSDP2's CPU offload its CUDA memory by wrapping
# `FSDPParam.all_gather_inputs` (the host-to-device copy of each shard, which a CPU run does
# not make; `upipe.planner.step._h2d_all_gather_inputs`): FSDP2 has no hook there. The
# planner also swaps `FSDPParam._sharded_param_data` (in 2.11-2.15: the 1-D host shard).
_IMPORTS = {
    "FakeTensorMode": ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    "FakeTensor": ("torch._subclasses.fake_tensor", "FakeTensor"),
    "unset_fake_temporarily": ("torch._subclasses.fake_tensor", "unset_fake_temporarily"),
    "TorchDispatchMode": ("torch.utils._python_dispatch", "TorchDispatchMode"),
    "is_traceable_wrapper_subclass": (
        "torch.utils._python_dispatch", "is_traceable_wrapper_subclass",
    ),
    "tree_leaves": ("torch.utils._pytree", "tree_leaves"),
    "FSDPParam": ("torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam"),
    "ShardedState": ("torch.distributed.fsdp._fully_shard._fsdp_param", "ShardedState"),
}  # fmt: skip
__all__ = [*_FUNCTIONS, *_IMPORTS]


def __getattr__(name: str):
    """The private imports of `_IMPORTS`, resolved on first use with a clear error (module
    doc); a plain module attribute afterwards."""
    if name not in _IMPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _IMPORTS[name]
    try:
        value = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ImportError(_missing(f"{module}.{attr}", str(e))) from e
    globals()[name] = value
    return value


def _private(owner, attr: str, what: str):
    """`owner.attr`, or a RuntimeError naming `what` where this torch lacks it."""
    found = getattr(owner, attr, None)
    if found is None:
        raise RuntimeError(_missing(what, f"no {attr}"))
    return found


def flatten_mesh(mesh, name: str | None = None):
    """`mesh` as a 1-D mesh over all of its ranks (`DeviceMesh._flatten`). A process group
    over a mesh's ranks made by `dist.new_group` would need every rank of the world to call
    it for every block of the mesh; the mesh's own flattening creates it once per block."""
    flatten = _private(mesh, "_flatten", "DeviceMesh._flatten")
    return flatten(name) if name is not None else flatten()


def process_groups() -> list:
    """The process groups alive in this process, the default one included
    (`distributed_c10d._world.pg_map`; torch lists them nowhere public).
    `LocalCluster.end_groups` ends all but the default one on its ranks with it."""
    import torch.distributed.distributed_c10d as c10d

    world = _private(c10d, "_world", "torch.distributed.distributed_c10d._world")
    return list(_private(world, "pg_map", "torch.distributed.distributed_c10d._world.pg_map"))


def saved_tensor_hooks_active() -> bool:
    """Whether default saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`, as
    activation checkpointing and CPU offload install) are active, other than
    `selective_saved_tensor_hooks`: torch offers the context manager but no public query
    (the innermost pair is what `_top_saved_tensors_default_hooks` returns)."""
    top_hooks = _private(
        torch._C._autograd,
        "_top_saved_tensors_default_hooks",
        "torch._C._autograd._top_saved_tensors_default_hooks",
    )
    top = top_hooks(False)
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
    task_id = _private(torch._C, "_current_graph_task_id", "torch._C._current_graph_task_id")
    return task_id()


# --- the flash-attention impl registry (torch.nn.attention; in 2.11-2.15) ------------------


def flash_impls() -> tuple[str, ...]:
    """The flash impls torch can activate ("FA3", "FA4"); () for a torch without the
    registry (module doc: fa3 / fa4 are then refused, every other kernel runs)."""
    lister = getattr(torch.nn.attention, "list_flash_attention_impls", None)
    return tuple(lister()) if lister is not None else ()


def active_flash_impl() -> str | None:
    """The flash impl active in this process ("FA3" / "FA4"), or None for torch's FA2 (and
    on a torch without the registry)."""
    current = getattr(torch.nn.attention, "current_flash_attention_impl", None)
    return current() if current is not None else None


def activate_flash_impl(impl: str) -> None:
    """`torch.nn.attention.activate_flash_attention_impl(impl)`: torch's aten flash ops run
    `impl` in this whole process from now on; a RuntimeError on a torch without it."""
    what = "torch.nn.attention.activate_flash_attention_impl"
    _private(torch.nn.attention, "activate_flash_attention_impl", what)(impl)


# --- aten's private attention ops, called by position ----------------------------------------

# op -> (the arguments upipe passes by position, those it passes by keyword), as upipe's
# kernels call them (upipe.kernels, kernels_cuda, attention.varlen); the same in the
# schemas (native_functions.yaml) of torch 2.11, 2.13 and 2.15
_ATEN_ARGS = {
    "_scaled_dot_product_flash_attention_for_cpu": (
        ("query", "key", "value", "dropout_p", "is_causal"), ("attn_mask", "scale"),
    ),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal"),
        ("attn_mask", "scale"),
    ),
    "_scaled_dot_product_flash_attention": (
        ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask"), ("scale",),
    ),
    "_scaled_dot_product_flash_attention_backward": (
        ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
         "max_q", "max_k", "dropout_p", "is_causal", "philox_seed", "philox_offset"),
        ("scale",),
    ),
    "_scaled_dot_product_efficient_attention": (
        ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal"),
        ("scale",),
    ),
    "_scaled_dot_product_efficient_attention_backward": (
        ("grad_out_", "query", "key", "value", "attn_bias", "out", "logsumexp", "philox_seed",
         "philox_offset", "dropout_p", "grad_input_mask", "is_causal"),
        ("scale",),
    ),
    "_scaled_dot_product_cudnn_attention": (
        ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
         "return_debug_mask"),
        ("scale",),
    ),
    "_scaled_dot_product_cudnn_attention_backward": (
        ("grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset",
         "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal"),
        ("scale",),
    ),
    "_flash_attention_forward": (
        ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
         "is_causal", "return_debug_mask"),
        ("scale",),
    ),
    "_flash_attention_backward": (
        ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
         "max_q", "max_k", "dropout_p", "is_causal", "rng_state", "unused"),
        ("scale",),
    ),
}  # fmt: skip


def schema_problem(schema, positional, keywords) -> str | None:
    """Why an op of `schema` cannot take `positional` argument names by position and
    `keywords` by keyword (e.g. a release that reorders, renames or drops one); None if it
    can. Arguments the schema has beyond them must have defaults (later releases add some)."""
    pos = [a for a in schema.arguments if not a.kwarg_only]
    kw = {a.name for a in schema.arguments if a.kwarg_only}
    names = tuple(a.name for a in pos[: len(positional)])
    if names != tuple(positional):
        return f"takes {names} first, not the {tuple(positional)} upipe passes"
    required = [a.name for a in pos[len(positional) :] if not a.has_default_value()]
    if required:
        return f"also requires {tuple(required)}, which upipe does not pass"
    absent = [k for k in keywords if k not in kw]
    if absent:
        return f"takes no keyword {tuple(absent)}"
    return None


@functools.cache
def aten_op(name: str):
    """aten's `name` op (default overload), after checking that this torch's schema takes the
    arguments upipe passes (`_ATEN_ARGS`): a torch that renames, reorders or lacks one fails
    here, naming the op, instead of misreading an argument."""
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        raise RuntimeError(_missing(f"aten::{name}", "no such op"))
    op = packet.default
    problem = schema_problem(op._schema, *_ATEN_ARGS[name])
    if problem:
        raise RuntimeError(
            f"torch {torch.__version__}'s aten::{name} {problem}: upipe's call of it needs "
            f"updating for this torch ({_supported_text()})"
        )
    return op


def cudnn_sdpa_ops():
    """(forward, backward): aten's `_scaled_dot_product_cudnn_attention` and its backward,
    the only way to reach cuDNN's attention with its log-sum-exp
    (F.scaled_dot_product_attention returns no lse), schema-checked (`aten_op`)."""
    return (
        aten_op("_scaled_dot_product_cudnn_attention"),
        aten_op("_scaled_dot_product_cudnn_attention_backward"),
    )


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
