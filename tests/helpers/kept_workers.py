"""Per-rank functions for tests/distributed/test_attention_outputs.py (module-level: spawned ranks
import them): training steps of one configuration under each `--attention-outputs` mode, with the
attention kernel calls of the first step counted."""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from upipe.model import get_config
from upipe.train import Trainer
from upipe.train.parallelize import make_offloader

FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class KernelCalls(TorchDispatchMode):
    """Counts the CPU attention kernel's forward and backward calls."""

    def __init__(self):
        super().__init__()
        self.forward = self.backward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.forward += func is FWD
        self.backward += func is BWD
        return func(*args, **(kwargs or {}))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _run(cfg, n_layers, host_offload, steps):
    model_config = dataclasses.replace(get_config(cfg.model), n_layers=n_layers)
    trainer = Trainer(cfg, torch.device("cpu"), model_config=model_config)
    if host_offload:  # what `upipe train` does on CUDA: an arena on the host
        trainer.model.offload = make_offloader(n_layers, cfg.features())
    calls, losses, grads = KernelCalls(), [], []
    for step in range(steps):
        with calls if step == 0 else contextlib.nullcontext():
            losses.append(trainer.forward_backward(step))
        grads.append(
            {n: _full(p.grad).detach().clone() for n, p in trainer.master.named_parameters()}
        )
        trainer.optimizer_step()
    off = trainer.model.offload
    arenas = [] if off is None else [a.arena.nbytes for a in off._outputs]
    return {
        "losses": losses,
        "grads": grads,
        "kernel_calls": (calls.forward, calls.backward),
        "output_arena_bytes": arenas,
    }


def modes(rank, world_size, cfg, runs, n_layers=2, steps=1):
    """`runs`: {name: (TrainConfig overrides, offload to a host arena)}; each trains `steps`
    steps of `cfg` with them, from the same seed. Returns {name: results} (rank's own)."""
    out = {}
    for name, (kw, host_offload) in runs.items():
        out[name] = _run(dataclasses.replace(cfg, **kw), n_layers, host_offload, steps)
        dist.barrier()
    return out


def forward_live_bytes(rank, world_size, cfg, modes_kw, n_layers=2):
    """{mode: bytes live after the loss's forward (graph and kept tensors), before its
    backward}, on this rank, for each of `modes_kw` ({name: TrainConfig overrides}); one
    sequence without document masking."""
    from upipe.memory import MemoryTracker

    out = {}
    for name, kw in modes_kw.items():
        c = dataclasses.replace(cfg, **kw)
        model_config = dataclasses.replace(get_config(c.model), n_layers=n_layers)
        trainer = Trainer(c, torch.device("cpu"), model_config=model_config)
        ((ids, labels, pos, _),) = trainer.batch(0)
        with MemoryTracker() as mem:
            loss = trainer.model(ids, pos, labels)
            out[name] = _settled_bytes(mem)
        loss.backward()
    return out


def _settled_bytes(mem, quiet_s=0.5, limit_s=60.0) -> int:
    """`mem.current_bytes` once it has not changed for `quiet_s` seconds. Gloo's worker thread
    drops its reference to a collective's tensors only after the caller's `wait()` returned
    (ProcessGroupGloo::runLoop ends the work at the end of its loop turn), so a read right after
    the forward raced with the free of the last head exchange's buffers: CI (torch 2.15.0,
    2026-12-06) read 16 KiB over the formula, a fresh-clone run 32 KiB under it. Sleeping
    releases the GIL the free's finalizer needs."""
    deadline = time.monotonic() + limit_s
    seen, since = mem.current_bytes, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        if mem.current_bytes != seen:
            seen, since = mem.current_bytes, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return seen
    raise TimeoutError(f"live bytes still changing {limit_s} s after the forward")


def _layer_and_input(strategy="upipe", seed=0, dtype=torch.float32, **kw):
    """A ContextParallelAttention over the world (H = 4, G = 2, d = 8; `kw` its options) and
    this rank's input x (requiring grad) and positions, from `seed`."""
    import upipe

    group = dist.group.WORLD
    torch.manual_seed(seed)
    layer = upipe.ContextParallelAttention(
        32, 4, 2, group=group, strategy=strategy, dtype=dtype, **kw
    )
    layout = layer.layout
    x = torch.randn(2, 16 * dist.get_world_size(), 32, dtype=dtype)
    pos = torch.arange(x.shape[1]).expand(2, -1)
    xs = upipe.shard_sequence(x, group=group, layout=layout).requires_grad_()
    return layer, xs, upipe.shard_sequence(pos, group=group, layout=layout)


def misuse(rank, world_size):
    """{case: the RuntimeError message} of checkpointed functions that do not make the same
    attention calls in their recomputation, or write into a kept output."""
    import upipe
    from upipe.model.features import activation_checkpoint

    layer, x, pos = _layer_and_input()
    runs = []

    def more_calls(x, pos):  # one call in forward, two when recomputed
        runs.append(1)
        y = layer(x, pos)
        return y + layer(x, pos) if len(runs) > 1 else y

    def other_shape(x, pos):  # the recomputation attends over half the batch
        runs.append(1)
        return layer(x[:1], pos[:1]) if len(runs) > 1 else layer(x, pos)

    def writes_into(x, pos):  # the ring op returns the tensor it keeps
        out = upipe.ring_attention(*(x.view(*x.shape[:2], 4, 8),) * 3, group=dist.group.WORLD)
        return out.mul_(2).flatten(2)

    out = {}
    for name, fn in (("more", more_calls), ("shape", other_shape), ("in place", writes_into)):
        runs.clear()
        try:
            activation_checkpoint(fn, x, pos, attention_outputs="keep").sum().backward()
        except RuntimeError as e:
            out[name] = str(e)
    return out


def nested(rank, world_size, strategy):
    """A checkpointed function that checkpoints its attention again, both keeping: the
    gradients of x and the weights are `recompute`'s bit for bit; kernel forward calls."""
    from upipe.model.features import activation_checkpoint

    results = {}
    for mode in ("recompute", "keep"):
        layer, x, pos = _layer_and_input(strategy)

        def inner(h, pos, layer=layer):
            return h + layer(h, pos)

        def outer(h, pos, mode=mode, inner=inner):
            h = activation_checkpoint(inner, h * 1.5, pos, attention_outputs=mode)
            return torch.tanh(h)

        calls = KernelCalls()
        with calls:
            activation_checkpoint(outer, x, pos, attention_outputs=mode).square().sum().backward()
        grads = [x.grad] + [p.grad for p in layer.parameters()]
        results[mode] = (grads, calls.forward)
    (ref, n_ref), (got, n_got) = results["recompute"], results["keep"]
    return all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)), n_ref, n_got


def cuda_path(rank, world_size, strategy, dtype):
    """`backend="cuda"` under the emulation of the CUDA-only ops (tests/helpers/cuda_emulation.py),
    a checkpointed layer: (keep's gradients are recompute's bit for bit, forward kernel
    calls of recompute, of keep)."""
    import cuda_emulation

    from upipe.model.features import activation_checkpoint

    cuda_emulation.install()
    results = {}
    for mode in ("recompute", "keep"):
        layer, x, pos = _layer_and_input(strategy, dtype=dtype, backend="cuda")
        calls = _CudaKernelCalls()
        with calls:
            y = activation_checkpoint(
                lambda h, pos, layer=layer: torch.tanh(layer(h, pos)), x, pos,
                attention_outputs=mode,
            )  # fmt: skip
            y.float().square().sum().backward()
        results[mode] = ([x.grad] + [p.grad for p in layer.parameters()], calls.forward)
    (ref, n_ref), (got, n_got) = results["recompute"], results["keep"]
    return all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)), n_ref, n_got


class _CudaKernelCalls(TorchDispatchMode):
    """Counts the forward calls of CUDA's SDPA kernels (flash, memory-efficient)."""

    FORWARD = (
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
    )

    def __init__(self):
        super().__init__()
        self.forward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.forward += func in self.FORWARD
        return func(*args, **(kwargs or {}))
