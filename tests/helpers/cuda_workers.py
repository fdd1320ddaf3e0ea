"""Per-rank functions that run upipe's `backend="cuda"` path on CPU, with the CUDA-only aten
ops replaced by their emulation (cuda_emulation.py), and that count what a layer call
issues: collectives, all-to-all bytes and host-device synchronisations."""

from __future__ import annotations

import collections
import contextlib

import cuda_emulation
import torch
import torch.distributed as dist
from ring_workers import run_ring
from torch.utils._python_dispatch import TorchDispatchMode
from usp_workers import run_mesh_functional
from workers import MODULE_ARGS, make_module_inputs, make_weights, run_functional, run_module

import upipe
from upipe.attention.common import forget_agreements

CUDA = {"backend": "cuda"}


def functional(rank, world_size, strategy, shape, kwargs, dtype):
    cuda_emulation.install()
    return run_functional(rank, world_size, strategy, shape, {**kwargs, **CUDA}, dtype)


def ring(rank, world_size, shape, kwargs, dtype):
    cuda_emulation.install()
    return run_ring(rank, world_size, shape, {**kwargs, **CUDA}, dtype)


def mesh(rank, world_size, dims, strategy, shape, kwargs, dtype):
    cuda_emulation.install()
    return run_mesh_functional(rank, world_size, dims, strategy, shape, {**kwargs, **CUDA}, dtype)


def module(rank, world_size, cfg, kwargs, dtype):
    cuda_emulation.install()
    return run_module(rank, world_size, cfg, {**kwargs, **CUDA}, dtype)


# --- counting ------------------------------------------------------------------------------

COLLECTIVES = (
    "all_to_all_single",
    "all_gather_object",
    "all_gather",
    "all_reduce",
    "broadcast",
    "barrier",
    "batch_isend_irecv",
)


class _HostSyncs(TorchDispatchMode):
    """Counts the operators that synchronise the host with a CUDA device: a tensor built from
    Python data (`torch.tensor(list)` -> lift_fresh; on CUDA a blocking copy from pageable
    memory) and reading a value back (`.item()`, `.tolist()`, `bool(t)` ->
    _local_scalar_dense)."""

    SYNCS = (torch.ops.aten.lift_fresh.default, torch.ops.aten._local_scalar_dense.default)

    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCS:
            self.counts[f"host sync: {func.__name__}"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting():
    """Counts collectives (by name; `async` for all_to_all_single with async_op=True),
    all-to-all bytes sent by this rank, and host syncs, inside the block."""
    counts = collections.Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[name] += 1
            if name == "all_to_all_single":
                send = args[1] if len(args) > 1 else kwargs["input"]
                counts["all_to_all bytes"] += send.numel() * send.element_size()
                counts["async"] += bool(kwargs.get("async_op", False))
            return fn(*args, **kwargs)

        return counted

    tolist = torch.Tensor.tolist

    def counted_tolist(t):
        counts["host sync: tolist"] += 1
        return tolist(t)

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    torch.Tensor.tolist = counted_tolist
    try:
        with _HostSyncs(counts):
            yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        torch.Tensor.tolist = tolist


def count_layer(rank, world_size, cfg, kwargs, calls=2):
    """Counts of each of `calls` forward+backward calls of one ContextParallelAttention layer
    (the first agrees on the inputs across ranks; later ones are the steady state)."""
    cuda_emulation.install()
    forget_agreements()  # the first call exchanges the verdict, whatever ran before
    group = dist.group.WORLD
    dtype = kwargs.pop("dtype", torch.bfloat16)
    x, dy, pos = make_module_inputs(**cfg, dtype=dtype)
    layer = upipe.ContextParallelAttention(
        *(cfg.get(a) for a in MODULE_ARGS), group=group, dtype=dtype, **kwargs
    )
    with torch.no_grad():
        for n, t in make_weights(cfg, dtype=dtype).items():
            getattr(layer, n).weight.copy_(t)
    xs = upipe.shard_sequence(x, group=group).requires_grad_()
    ps, dys = upipe.shard_sequence(pos, group=group), upipe.shard_sequence(dy, group=group)
    out = []
    for _ in range(calls):
        with counting() as counts:
            layer(xs, ps).backward(dys)
        out.append(dict(counts))
    return out


def overlap_pair(rank, world_size, cfg, kwargs, dtype):
    """The fused module's forward+backward with overlap off and on, each as (y, dx and the
    weight gradients; peak bytes of the layer call alone; counts)."""
    from upipe.memory import MemoryTracker

    group = dist.group.WORLD
    x, dy, pos = make_module_inputs(**cfg, dtype=dtype)
    xs, ps, dys = (upipe.shard_sequence(t, group=group) for t in (x, pos, dy))
    out = []
    for overlap in (False, True):
        layer = upipe.ContextParallelAttention(
            *(cfg.get(a) for a in MODULE_ARGS), group=group, dtype=dtype, overlap=overlap, **kwargs
        )
        with torch.no_grad():
            for n, t in make_weights(cfg, dtype=dtype).items():
                getattr(layer, n).weight.copy_(t)
        layer(xs, ps)  # agree on the inputs first: the counted call is the steady state
        xl = xs.clone().requires_grad_()
        with MemoryTracker() as mem, counting() as counts:
            y = layer(xl, ps)
            y.backward(dys)
        grads = {n: getattr(layer, n).weight.grad for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        out.append(({"y": y.detach(), "dx": xl.grad, **grads}, mem.peak_bytes, dict(counts)))
    return out


def compiled_model(rank, world_size, strategy, backend):
    """A small model (linear, attention layer, linear) eager and under torch.compile: the
    outputs and input gradients of both, and why dynamo broke its graph."""
    torch.manual_seed(0)
    group = dist.group.WORLD
    attn = upipe.ContextParallelAttention(32, 4, 2, group=group, strategy=strategy)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 32), _WithPositions(attn), torch.nn.Linear(32, 32)
    )
    x = torch.randn(1, 16, 32, requires_grad=True)
    results = []
    for fn in (model, torch.compile(model, backend=backend)):
        x.grad = None
        y = fn(x)
        y.square().sum().backward()
        results.append((y.detach(), x.grad.clone()))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    return results, [str(b.reason).split("\n")[0] for b in explained.break_reasons]


class _WithPositions(torch.nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x):
        rank = dist.get_rank(self.attn.group)
        pos = torch.arange(x.shape[1])[None] + rank * x.shape[1]
        return self.attn(x, pos)


def agreement_device(rank, world_size):
    """The validation exchange runs under `torch.cuda.device(<the inputs' GPU>)` (recorded
    by a stand-in, no GPU here), so NCCL's all_gather_object stages its bytes on the right
    GPU even if the job never called torch.cuda.set_device."""
    from unittest import mock

    from upipe.attention import common

    entered = []

    @contextlib.contextmanager
    def device(d):
        entered.append(d)
        yield

    forget_agreements()
    gpu = torch.device("cuda", rank)
    with mock.patch.object(torch.cuda, "device", device):
        common.agree_across_ranks(dist.group.WORLD, lambda: None, lambda: {"n": 1}, None, gpu)
        common.agree_across_ranks(dist.group.WORLD, lambda: None, lambda: {"n": 1}, None, gpu)
    return entered
