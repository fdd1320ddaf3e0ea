"""Per-rank functions that run upipe with a CUDA kernel backend on CPU under the emulations
of its contract: `backend="cudnn"` (cudnn_emulation.py) and `"fa3"` / `"fa4"` (torch's
impls activated for real, with the stand-in packages and the rerouted ops of
flash_impl_emulation.py), besides the flash / efficient ops (cuda_emulation.py,
varlen_emulation.py) they fall back on. Each returns what the plain worker it wraps returns,
with the kernel calls it made where asked.

Activation is process-wide and these ranks serve the whole test session, so every call
puts torch's FA2 back and removes the stand-ins when done (`flash_impl_emulation.packages`).
"""

from __future__ import annotations

import contextlib

import cuda_emulation
import cudnn_emulation
import document_workers
import flash_impl_emulation
import torch
import torch.distributed as dist
import varlen_emulation
from ring_workers import run_ring
from usp_workers import run_mesh_functional
from workers import run_functional, run_module

import upipe
from upipe.attention.common import forget_agreements


@contextlib.contextmanager
def emulated(kernel):
    """The emulations installed, and for fa3/fa4 the stand-in packages within the block."""
    cuda_emulation.install()
    varlen_emulation.install()
    cudnn_emulation.install()
    flash_impl_emulation.install()
    with flash_impl_emulation.packages() if kernel in ("fa3", "fa4") else contextlib.nullcontext():
        yield


def calls():
    """Every emulated kernel call so far in this process, by (kernel, op)."""
    counts = {("flash varlen", op): n for op, n in varlen_emulation.CALLS.items()}
    counts |= {("cudnn", op): n for op, n in cudnn_emulation.CALLS.items()}
    counts |= {(impl.lower(), op): n for (impl, op), n in flash_impl_emulation.CALLS.items()}
    return counts


def _counted(fn, *args):
    before = calls()
    res = fn(*args)
    made = {key: n - before.get(key, 0) for key, n in calls().items()}
    return res, {key: n for key, n in made.items() if n}


def functional(rank, world_size, kernel, strategy, shape, kwargs, dtype):
    with emulated(kernel):
        kw = {**kwargs, "backend": kernel}
        return _counted(run_functional, rank, world_size, strategy, shape, kw, dtype)


def ring(rank, world_size, kernel, shape, kwargs, dtype):
    with emulated(kernel):
        return run_ring(rank, world_size, shape, {**kwargs, "backend": kernel}, dtype)


def mesh(rank, world_size, kernel, dims, strategy, shape, kwargs, dtype):
    with emulated(kernel):
        kw = {**kwargs, "backend": kernel}
        return run_mesh_functional(rank, world_size, dims, strategy, shape, kw, dtype)


def module(rank, world_size, kernel, cfg, kwargs, dtype):
    with emulated(kernel):
        return _counted(run_module, rank, world_size, cfg, {**kwargs, "backend": kernel}, dtype)


def docs(rank, world_size, kernel, strategy, shape, kwargs, cu, dtype):
    """document_workers.run_docs with `backend=kernel` (None: auto, which is the CPU kernel
    here), and the kernel calls it made."""
    with emulated(kernel):
        kw = {**kwargs, "backend": kernel}
        run = document_workers.run_docs
        return _counted(run, rank, world_size, strategy, shape, kw, cu, dtype)


def module_docs(rank, world_size, kernel, cfg, kwargs, cu, dtype):
    with emulated(kernel):
        kw = {**kwargs, "backend": kernel}
        return document_workers.run_module_docs(rank, world_size, cfg, kw, cu, dtype)


def call_with_backend(rank, world_size, backend):
    """upipe_attention with `backend` on bf16 inputs: (error type, message), or None."""
    forget_agreements()
    q = torch.randn(1, 8, 4, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    try:
        upipe.upipe_attention(q, k, k.clone(), group=dist.group.WORLD, backend=backend)
    except ValueError as e:
        return type(e).__name__, str(e)
    return None
