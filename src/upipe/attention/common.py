"""Input validation shared by the strategies, done on every rank before any collective.

A rank that finds its input invalid must not raise alone: its peers would then wait forever
in the next collective. So each rank checks its own input, then the ranks exchange one small
object -- (error, local shapes) -- and every rank raises the same error, naming the rank
whose input is wrong, or a mismatch between ranks (e.g. different local sequence lengths).

The exchange happens once per distinct call signature (shapes, dtype, options) and group:
an agreed signature is remembered (`_AGREED`), and a later call with the same signature only
runs the local checks -- no collective, no host-device synchronisation, nothing that stops
`torch.compile` (the agreement runs outside the graph: `torch.compiler.disable`). A training
step calls every layer with the same shapes, so the exchange happens at the first step only.
What this gives up: a rank whose input changes to a *new* signature while its peers repeat
an agreed one enters the exchange alone; that is caught by the process group's timeout, not
by a `ValueError`. Inputs that change on every rank together (a new sequence length) are
agreed again before any collective, as on the first call. `forget_agreements()` clears the
memory (e.g. between tests that reuse a group with deliberately inconsistent inputs).
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch
import torch.distributed as dist

from upipe.attention.sinks import check_sinks
from upipe.attention.window import check_window
from upipe.comm import check_layout_name
from upipe.heads import few_heads_problem, kv_problem
from upipe.kernels import check_kernel
from upipe.mesh import check_mesh, validation_group
from upipe.packing import check_cu_seqlens
from upipe.torch_private import saved_tensor_hooks_active


def check_group(group) -> int:
    """The size of `group`, or a TypeError if it is not a usable process group."""
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}; "
            "pass e.g. group=torch.distributed.group.WORLD after init_process_group"
        )
    return dist.get_world_size(group)


def check_qkv_local(q, k, v, *, C: int, causal, softmax_scale, backend, size_name=None):
    """Checks one rank can make without talking to the others. Raises TypeError/ValueError.

    Heads are split over C ranks (C = 1: whole heads on every rank), called `size_name` in
    messages (default: the context-parallel size; on a mesh, the ulysses size): any G
    dividing H with C <= H (`upipe.heads`; heads C does not divide are split unevenly)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D [batch, local_seq, heads, head_dim], got shape "
                f"{tuple(t.shape)}"
            )
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}; cast them alike")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; move them alike")
    if not q.dtype.is_floating_point:
        raise ValueError(f"attention needs floating-point inputs, got {q.dtype}")
    (B, L, H, d), (Bk, Lk, G, dk) = q.shape, k.shape
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if Bk != B:
        raise ValueError(f"batch sizes differ: q has {B}, k/v have {Bk}")
    if Lk != L:
        raise ValueError(f"local sequence lengths differ: q has {L}, k/v have {Lk}")
    if dk != d:
        raise ValueError(f"head dims differ: q has {d}, k/v have {dk}")
    if L == 0 or B == 0:
        raise ValueError(f"empty input: q has shape {tuple(q.shape)}")
    size = size_name or "context-parallel size"
    problem = kv_problem(H, G) or few_heads_problem(H, C, size=size)
    if problem:
        raise ValueError(problem)
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be positive or None, got {softmax_scale}")
    check_kernel(backend, q.device, q.dtype, d)  # the kernel runs here (name, package, limits)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")


# group -> {(cohort, signature)} agreed by all of the group's ranks (see the module doc)
_AGREED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forget_agreements() -> None:
    """Forget every agreed signature: the next call of each layer exchanges its verdict."""
    _AGREED.clear()


@torch.compiler.disable
def agree_across_ranks(group, local_check, signature_fn, cohort=None, device=None) -> None:
    """Run `local_check()` here, then make every rank of `group` raise the same error.

    `signature_fn()` describes what all ranks must agree on (shapes, dtype, options); it is
    only called when the local check passed. `cohort` (any hashable; default: one for all)
    limits that agreement to the ranks passing the same cohort -- on a mesh, the ranks of
    one ring x ulysses block -- while errors still reach every rank of `group`. One
    all_gather_object the first time a signature is seen, none after (module doc). On
    NCCL the exchange runs on `device` (the inputs' GPU), whatever the current device is:
    `all_gather_object` stages its bytes on `torch.cuda.current_device()`, which is GPU 0
    on every rank of a job that never called `torch.cuda.set_device`.
    """
    error, signature = None, None
    try:
        local_check()
        signature = signature_fn()
    except (TypeError, ValueError) as e:
        error = e
    C = dist.get_world_size(group)
    if C == 1 or dist.get_backend(group) == "fake":  # simulated peers: all of them are this rank
        if error is not None:
            raise error
        return
    key = None if error is not None else (cohort, tuple(signature.items()))
    if key is not None and key in _AGREED.get(group, ()):
        return
    reports = [None] * C
    payload = (type(error).__name__, str(error)) if error is not None else None
    on_gpu = isinstance(device, torch.device) and device.type == "cuda"
    with torch.cuda.device(device) if on_gpu else contextlib.nullcontext():
        dist.all_gather_object(reports, (payload, signature, cohort), group=group)
    for rank, (err, _, _) in enumerate(reports):
        if err is not None:
            if error is not None:
                raise error
            cls = TypeError if err[0] == "TypeError" else ValueError
            raise cls(f"rank {rank} of the group rejected its input: {err[1]}")
    first = {}  # cohort -> the first rank reporting it
    for rank, (_, sig, coh) in enumerate(reports):
        r0 = first.setdefault(coh, rank)
        ref = reports[r0][1]
        if sig != ref:
            diff = ", ".join(
                f"{key}: rank {r0} has {ref[key]}, rank {rank} has {sig[key]}"
                for key in sig
                if sig[key] != ref[key]
            )
            raise ValueError(
                f"ranks disagree on their inputs ({diff}); every rank must pass the same "
                "options and an equal-length shard of the sequence (pad the sequence to a "
                "multiple of the group size)"
            )
    _AGREED.setdefault(group, set()).add(key)


class DocumentsArg:
    """A strategy's `cu_seqlens` argument on its way through validation.

    `check(S)` is a local check (run inside `agree_across_ranks`, so a bad value raises the
    same ValueError on every rank): it validates the boundaries for a full sequence of S
    tokens (`upipe.packing.check_cu_seqlens`) and keeps them, as host ints, in `bounds` (None
    without documents). The agreed signature records only *whether* documents are given:
    the boundaries are data that change every batch, and comparing them across ranks would
    cost an exchange per call. Ranks passing different boundaries therefore get wrong
    results, not a hang -- no collective depends on them (every ring step communicates,
    whatever it computes)."""

    def __init__(self, cu_seqlens):
        self.cu_seqlens, self.bounds = cu_seqlens, None

    def check(self, S: int) -> None:
        if self.cu_seqlens is not None:
            self.bounds = check_cu_seqlens(self.cu_seqlens, S)

    def signature(self) -> dict:
        return {"documents": self.cu_seqlens is not None}


def check_ring_layout(layout, P: int, R: int, C: int) -> None:
    """The ring dim's layout on a mesh of R ring x C ulysses ranks: a known one, and zigzag
    needs an even number P = C * L of tokens per ring rank (its two chunks)."""
    check_layout_name(layout)
    if layout == "zigzag" and R > 1 and P % 2:
        raise ValueError(
            f"layout='zigzag' needs an even number of tokens per ring rank (ulysses size "
            f"{C} x local length {P // C} = {P}; two chunks each); pad the full sequence to "
            f"a multiple of {R * math.lcm(2, C)}, or use layout='contiguous'"
        )


def check_layout(layout, L, C):
    """The sequence layout of a 1-D group of C ranks holding L tokens each."""
    check_layout_name(layout)
    if layout == "zigzag" and L % 2:
        raise ValueError(
            f"layout='zigzag' needs an even local sequence length (each rank holds two "
            f"chunks of L/2 tokens), got {L}; pad the full sequence to a multiple "
            f"of 2 * group size = {2 * C}, or use layout='contiguous'"
        )


def resolve_groups(group, mesh):
    """The process groups a strategy uses, from exactly one of `group` (1-D) or `mesh` (2-D).

    Returns (ulysses group, ring group or None when the ring size is 1, ring size, `agree`
    for `validate_qkv`: None on a group, on a mesh (group over all of its ranks, cohort of
    ranks whose inputs must agree)).
    """
    if (group is None) == (mesh is None):
        raise ValueError("pass exactly one of group= (1-D) or mesh= (2-D: ring x ulysses)")
    if group is not None:
        check_group(group)
        return group, None, 1, None
    R, _ = check_mesh(mesh)
    ring = mesh["ring"].get_group() if R > 1 else None
    return mesh["ulysses"].get_group(), ring, R, validation_group(mesh)


def validate_qkv(
    q,
    k,
    v,
    *,
    strategy,
    group,
    causal,
    softmax_scale,
    backend,
    extra=None,
    extra_signature=None,
    agree=None,
    window=None,
    sinks=None,
):
    """Full validation of a strategy's (q, k, v) on every rank.

    `strategy`: the op's registry entry (`registry.Strategy`): its heads are split over
    `group` (its size C) if it splits heads (`splits_heads`), else whole on every rank (ring
    attention). The verdict is exchanged over `group`, or over `agree` = (group, cohort)
    from `resolve_groups` on a mesh (messages then call C the ulysses size).
    `extra_signature` adds options all ranks must agree on. `extra` is an optional
    callable(C) with strategy-specific local checks, called once the common checks passed
    (so q, k, v are valid 4-D tensors by then). `window`: the strategy's sliding window
    (`upipe.attention.window.check_window`), which all ranks must agree on. `sinks`: the
    attention sinks (`upipe.attention.sinks.check_sinks`: `[H]`, floating, on q's device),
    whose presence all ranks must agree on.
    """
    C = check_group(group)

    def local():
        check_qkv_local(
            q,
            k,
            v,
            C=C if strategy.splits_heads else 1,
            causal=causal,
            softmax_scale=softmax_scale,
            backend=backend,
            size_name=None if agree is None else "ulysses size",
        )
        check_window(window, causal)
        check_sinks(sinks, q.shape[2], q.device)
        if extra is not None:
            extra(C)

    def signature():
        return {
            "q shape": tuple(q.shape),
            "k shape": tuple(k.shape),
            "dtype": str(q.dtype),
            "device type": q.device.type,
            "causal": causal,
            "softmax_scale": softmax_scale,
            "backend": backend,
            "window": window,
            "sinks": sinks is not None,
            **(extra_signature or {}),
        }

    agree_group, cohort = agree or (group, None)
    device = q.device if isinstance(q, torch.Tensor) else None
    agree_across_ranks(agree_group, local, signature, cohort, device)


def _saved_tensor_hooks_active() -> bool:
    return saved_tensor_hooks_active()


def save_for_backward(ctx, keep, free) -> None:
    """Save tensors for backward; those in `free`, backward may release one by one.

    `keep` (inputs, weights) goes through `ctx.save_for_backward` as usual. Without
    saved-tensor hooks, `free` is kept as plain references on `ctx` that `saved_for_backward`
    hands over, so backward can drop each intermediate as soon as it is used. Under hooks
    (activation checkpointing, CPU offload) `free` goes through `ctx.save_for_backward` too,
    so the hooks see it, and is released when backward returns.
    """
    keep, free = list(keep), list(free)
    ctx.n_keep = len(keep)
    if _saved_tensor_hooks_active():
        ctx.stash = None
        ctx.save_for_backward(*keep, *free)
    else:
        ctx.stash = free
        ctx.save_for_backward(*keep)


def saved_for_backward(ctx) -> tuple[list, list]:
    """(keep, free) as given to `save_for_backward`; the caller owns both lists."""
    saved = list(ctx.saved_tensors)
    if ctx.stash is None:
        return saved[: ctx.n_keep], saved[ctx.n_keep :]
    if ctx.stash is False:
        raise RuntimeError(
            "backward through this attention op ran twice; it frees its buffers during the "
            "first backward (retain_graph=True is not supported)"
        )
    stash, ctx.stash = ctx.stash, False
    return saved, stash
