"""Activation offload: the checkpointed block inputs live in host memory between forward and
backward, copied on a side stream, and each comes back one block ahead of its backward.

One `Offloader(n_blocks)` serves all the blocks of a model (`CausalLM.offload`, set by
`upipe.train.apply_memory_features` when training on CUDA);
`upipe.model.features.activation_checkpoint` calls it. Forward, block i: `save(x_i, i)`
copies its input into slot i of a host arena.
Backward (blocks i = n-1, ..., 0): `load` returns x_i on the device (fetched then only for
the last block; the others were prefetched), block i recomputes its forward, and
`prefetch(i - 1)` starts bringing back x_{i-1} while block i's backward computes.

Host memory: one arena per model, `n_blocks` slots of one block input, allocated at its exact
size on the first step and reused by every step (a new one only if the block input's shape or
dtype changes; the old one is freed first):

    host bytes = n_blocks * B * L * D * element_size

(Llama3-8B, 8 GPUs, 7.08M tokens: 32 * 884,736 * 4096 * 2 bytes = 216 GiB per GPU), which
is what `upipe plan` counts (`upipe.planner.step`: the arena on the meta device). Why not
`torch.empty(..., pin_memory=True)` per block, as before: it goes through torch's caching
host allocator (`CachingHostAllocatorImpl::allocate` in `aten/src/ATen/core/
CachingHostAllocator.h`), which rounds every request up to a power of two
(`c10::llvm::PowerOf2Ceil`) and caches freed blocks: a 4.19-6.75 GiB block input takes
8 GiB, so 256 GiB per GPU where 134-216 GiB are needed. torch 2.13 can skip the rounding
above `pinned_max_round_threshold_mb` (and the caching above `pinned_max_cached_size_mb`) of
`PYTORCH_ALLOC_CONF`, but that is a process-wide setting, read from the environment, for
every pinned allocation; `pinned_use_cuda_host_register:True` registers the *rounded* size
(`allocWithCudaHostRegister(ptr, roundSize)`, `aten/src/ATen/cuda/CachingHostAllocator.cpp`).
So the arena is ordinary pageable memory of the exact size (`torch.empty` on the host),
page-locked in place with `cudaHostRegister(ptr, nbytes, cudaHostRegisterDefault)` (via
`torch.cuda.cudart()`, `torch/csrc/cuda/shared/cudart.cpp`; torch's own register path
registers `malloc`ed memory the same way), which pins the pages holding those bytes and no
more, and is `cudaHostUnregister`ed, once the side stream is done with it, before it is
freed. Registering is slow (every page is faulted in and pinned) but happens once per run.

Device memory: while block i's backward runs, x_{i-1} is already on the device, one
`[B, L, D]` more than fetching each input when its block needs it:

    prefetch bytes = B * L * D * element_size    (6.75 GiB in the example above)

The recomputed output y_i is released before block i's backward (`features._Checkpoint`: its
backward needs only its graph), and that pays for it: x_{i-1} takes y_i's place, so the
device peak is that of fetching on demand with y_i kept alive, as upipe did before the
prefetch (the planner's simulated peaks with offload are unchanged). `tests/test_offload.py`
measures the one `[B, L, D]`.

Streams (CUDA; on the CPU every copy is a plain copy in program order): all copies run on one
side stream, so the copy into a slot (forward) and out of it (backward, and the next step's
forward) are ordered among themselves. Each copy first waits for the work queued so far on
the compute stream (device -> host: x is complete; host -> device: the destination, allocated
on the compute stream, may reuse memory that queued work still uses). x is marked used by the
side stream (`Tensor.record_stream`), so the caching allocator hands its memory out again
only after the copy (if copies lag behind the blocks' compute, short sequences, block inputs
wait on the device for them); a prefetched input is used, or dropped, only after the compute
stream waited for its copy's event, so it needs no mark. `copy_(non_blocking=True)` between a
CUDA tensor and page-locked host memory is a `cudaMemcpyAsync` on the current stream
(`copy_kernel_cuda`, `aten/src/ATen/native/cuda/Copy.cu`); torch does not track the lifetime
of host memory it did not allocate, so the arena outlives every copy: it is released only
after `stream.synchronize()`.

Legend: B batch, L local sequence, D width.
"""

from __future__ import annotations

import weakref

import torch


class Offloader:
    """Host slots for the inputs of `n_blocks` checkpointed blocks on `host` (the CPU; the
    planner's simulation uses the meta device), with the copies scheduled as in the module doc.

    Each block input is used by at most one backward: `load` frees the slot, and a forward that
    writes a slot again before the earlier backward loaded it makes that load raise.
    """

    def __init__(self, n_blocks: int, host: str | torch.device = "cpu"):
        if n_blocks < 1:
            raise ValueError(f"n_blocks must be >= 1 (one slot per block), got {n_blocks}")
        self.n_blocks, self.host = n_blocks, torch.device(host)
        self.arena: torch.Tensor | None = None
        """`[n_blocks * B * L * D]` on `host`: slot i holds block i's input."""
        self._slot: tuple[torch.Size, torch.dtype] | None = None  # the block input's shape, dtype
        self._owner: list[object | None] = [None] * n_blocks  # the token whose input a slot holds
        self._pending: tuple | None = None  # (token, x_BLD, event): an input brought back ahead
        self._stream = None  # CUDA side stream of the copies
        self._unpin = None  # unregisters the arena (CUDA)

    def save(self, x_BLD: torch.Tensor, index: int) -> object:
        """Forward of block `index`: copy its input into slot `index`; returns the token that
        `load` takes back."""
        if not 0 <= index < self.n_blocks:
            raise ValueError(f"block index {index} out of range for {self.n_blocks} blocks")
        self._drop_pending()  # a forward: an input brought back ahead is of no use any more
        if x_BLD.is_cuda and self._stream is None:
            self._stream = torch.cuda.Stream(x_BLD.device)
        if self._slot != (x_BLD.shape, x_BLD.dtype):
            self._new_arena(x_BLD)
        _copy(self._view(index), x_BLD, self._stream)
        token = self._owner[index] = object()
        return token

    def load(self, token: object, index: int, device: torch.device) -> torch.Tensor:
        """Backward of block `index`: its input on `device`, ready to use on the current stream."""
        if self._owner[index] is not token:
            raise RuntimeError(
                f"the offloaded input of block {index} was overwritten by a later forward (or "
                "already used by a backward); run each backward before the next forward"
            )
        if self._pending is None or self._pending[0] is not token:
            self._drop_pending()
            self._fetch(index, device)
        _, x_BLD, event = self._pending
        self._pending = self._owner[index] = None
        _wait(event, device)
        return x_BLD

    def prefetch(self, index: int, device: torch.device) -> None:
        """Start bringing block `index`'s input back to `device` (called in the backward of
        block index + 1, once it has recomputed its forward); nothing if index < 0."""
        if index >= 0 and self._owner[index] is not None and self._pending is None:
            self._fetch(index, device)

    def _fetch(self, index: int, device: torch.device) -> None:
        """Start copying slot `index` into a new tensor on `device`: the pending input."""
        shape, dtype = self._slot
        x_BLD = torch.empty(shape, dtype=dtype, device=device)  # on the compute stream
        self._pending = (self._owner[index], x_BLD, _copy(x_BLD, self._view(index), self._stream))

    def _view(self, index: int) -> torch.Tensor:
        shape, _ = self._slot
        n = shape.numel()
        return self.arena[index * n : (index + 1) * n].view(shape)

    def _new_arena(self, like: torch.Tensor) -> None:
        """An arena for `like`'s shape and dtype, exact size; the old one is freed first."""
        if self._unpin is not None:
            self._unpin()
        self.arena = self._unpin = None
        self._owner = [None] * self.n_blocks
        self.arena = torch.empty(self.n_blocks * like.numel(), dtype=like.dtype, device=self.host)
        self._slot = (like.shape, like.dtype)
        if self._stream is not None:
            self._unpin = _pin(self, self.arena, self._stream)

    def _drop_pending(self) -> None:
        if self._pending is not None:
            _, x_BLD, event = self._pending
            _wait(event, x_BLD.device)  # its memory is reused only after the copy
            self._pending = None


# The CUDA calls (stream, events, host registration); `stream` is None without CUDA.


def _copy(dst: torch.Tensor, src: torch.Tensor, stream):
    """dst.copy_(src); on CUDA on `stream`, after the work queued so far on the compute stream.
    Returns the event that marks the copy's end (None without CUDA)."""
    if stream is None:
        dst.copy_(src)
        return None
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    if src.is_cuda:
        src.record_stream(stream)  # its memory is not reused before the copy is done
    return stream.record_event()


def _wait(event, device: torch.device) -> None:
    """The compute stream of `device` waits for `event` (a copy's end) before what follows."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def _pin(owner, arena: torch.Tensor, stream):
    """Page-lock `arena` in place (exactly its pages); returns the finalizer that unregisters
    it, which also runs when `owner` is collected."""
    cudart = torch.cuda.cudart()
    with torch.cuda.device(stream.device):
        try:
            torch.cuda.check_error(cudart.cudaHostRegister(arena.data_ptr(), arena.nbytes, 0))
        except RuntimeError as e:
            gib = arena.nbytes / 2**30
            raise RuntimeError(f"page-locking the {gib:.2f} GiB offload arena failed: {e}") from e
    return weakref.finalize(owner, _unpin, arena, stream)


def _unpin(arena: torch.Tensor, stream) -> None:
    stream.synchronize()  # no copy reads or writes the pages any more
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(arena.data_ptr()))
