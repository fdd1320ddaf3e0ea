"""Activation offload: the checkpointed block inputs live in host memory between forward and
backward, copied on a side stream, and each comes back when its block's backward starts.

One `Offloader` serves all the blocks of a model (`CausalLM.offload`, set by
`upipe.train.apply_memory_features` when training on CUDA);
`upipe.model.features.activation_checkpoint` calls it. Forward, block i: `save(x_i, i)`
copies its input into slot i of a host arena.
Backward (blocks i = n-1, ..., 0): `load` brings x_i back to the device, and block i
recomputes its forward and runs its backward. The recomputed graph keeps no device copy of
x_i (`features._Checkpoint`): the block's first norm, which saves it, gets it through
`load` again when its backward runs, after the attention backward -- the step's device peak
at long context -- so that peak holds no block input at all. A block's input is copied back
twice, the host slot read twice (see the cost below).

Segments (`CausalLM.recompute_blocks = m > 1`): one checkpoint is m consecutive blocks, so
only the segment's input is saved; its backward recomputes the inputs of its other m - 1
blocks once, copies each to a scratch slot (the same m - 1 slots serve every segment),
and then runs the blocks' backwards as above, each block's input coming from its slot.
The last K checkpoints may stay on the device (`CausalLM.hidden` offloads the first
n_inputs of them only): they are the first needed in backward, and need no slot.

Host memory: one arena per model, n_inputs + scratch slots of one block input, allocated at
its exact size on the first step and reused by every step (a new one only if the block
input's shape or dtype changes; the old one is freed first):

    host bytes = (n_inputs + scratch) * B * L * D * element_size
    n_inputs = ceil(n_blocks / m) - K,  scratch = m - 1  (K checkpoints kept on the device)

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

Why not bring x_{i-1} back ahead, while block i's backward computes (as upipe did until
2026-11-30): it holds one more `[B, L, D]` through block i's backward, whose attention
backward is the step's device peak at long context (`upipe.planner`; Llama3-8B on 8 GPUs at
6.2M tokens: 5.94 GiB of a 75 GiB budget, about 1 of the 8 `[B, L, D]` units at the peak).
What fetching on demand costs is the copies' time, no longer hidden, twice per block:

    2 * B * L * D * element_size / W_h2d

against the block's backward, whose causal attention alone costs about
3.5 * 2 * S^2 * H * d / C FLOPs per GPU (the recomputed forward, 2 S^2 H d, and the
backward, 2.5 times that). Llama3-8B (D = 4096, H = 32, d = 128) on C = 8 GPUs, at
W_h2d = 50 GB/s and 400 TFLOP/s: at S = 8M (L = 1M) the two copies of 8 GiB take 0.34 s and
the attention 570 s; at S = 1M, 43 ms and 9 s. The copies are well under 1% of the step
wherever offload is worth using.

Streams (CUDA; on the CPU every copy is a plain copy in program order): all copies run on one
side stream, so the copy into a slot (forward) and out of it (backward, and the next step's
forward) are ordered among themselves. Each copy first waits for the work queued so far on
the compute stream (device -> host: x is complete; host -> device: the destination, allocated
on the compute stream, may reuse memory that queued work still uses). x is marked used by the
side stream (`Tensor.record_stream`), so the caching allocator hands its memory out again
only after the copy (if copies lag behind the blocks' compute, short sequences, block inputs
wait on the device for them); a fetched input is used only after the compute
stream waited for its copy's event, so it needs no mark. `copy_(non_blocking=True)` between a
CUDA tensor and page-locked host memory is a `cudaMemcpyAsync` on the current stream
(`copy_kernel_cuda`, `aten/src/ATen/native/cuda/Copy.cu`); torch does not track the lifetime
of host memory it did not allocate, so the arena outlives every copy: it is released only
after `stream.synchronize()`.

Attention outputs (`attention_outputs="offload"`, `upipe.attention.kept`): the outputs and
lse each attention call of a checkpoint keeps for the recomputation go to host memory beside
the checkpoint's input (`save_outputs`, during the forward, right after the call) and come
back when the call is recomputed in backward (`load_outputs`; a segment's inner calls once
more, for the pass that recomputes the inner inputs). They belong to the input's token, so
`release` frees them with it, and a later forward overwriting them makes the load raise.
The n-th call of every checkpoint has an arena of its own: n_inputs slots of that call's
tensors (their shapes, strides and dtypes, each tensor at a multiple of `ALIGN` bytes),
allocated exactly, page-locked and reused as the inputs' arena (a new one when the call's
tensors change). For m blocks per checkpoint with one attention call each:

    host bytes = n_inputs * m * sum over the call's tensors of ceil(nbytes / ALIGN) * ALIGN
               = n_inputs * m * (B * L * H * d * element_size + 4 * B * L * H)   (aligned)

and each comes back with the same on-demand copy as the input, B * L * H * d * element_size
bytes per layer more (Llama3-8B, C = 8, 1M tokens, H * d = D: the input's 1 GiB again).

Legend: B batch, L local sequence, D width, H query heads, d head dim.
"""

from __future__ import annotations

import math
import weakref

import torch

ALIGN = 64
"""Bytes: each attention output kept in host memory starts at a multiple of this."""


class Offloader:
    """Host slots for `n_inputs` checkpointed inputs (one per checkpoint: a block, or a
    segment of blocks) and `scratch` more for the inputs a segment recomputes in its
    backward (`features._Checkpoint`: slots n_inputs, ..., n_inputs + scratch - 1, reused by
    every segment), on `host` (the CPU; the planner's simulation uses the meta device), with
    the copies scheduled as in the module doc.

    Each input serves one backward, which may `load` it more than once and then `release`s
    the slot; a forward that writes a slot again before the earlier backward released it
    makes that backward's `load` raise.
    """

    def __init__(self, n_inputs: int, host: str | torch.device = "cpu", *, scratch: int = 0):
        if n_inputs < 1 or scratch < 0:
            raise ValueError(
                f"n_inputs must be >= 1 (one slot per checkpointed input) and scratch >= 0, "
                f"got {n_inputs}, {scratch}"
            )
        self.n_inputs, self.scratch, self.host = n_inputs, scratch, torch.device(host)
        self.n_slots = n_inputs + scratch
        self.arena: torch.Tensor | None = None
        """`[n_slots * B * L * D]` on `host`: slot i holds checkpoint i's input."""
        self._slot: tuple[torch.Size, torch.dtype] | None = None  # the input's shape, dtype
        self._owner: list[object | None] = [None] * self.n_slots  # the token a slot holds
        self._stream = None  # CUDA side stream of the copies
        self._unpin = None  # unregisters the arena (CUDA)
        self._outputs: list[_OutputArena] = []  # attention call n of each checkpoint: [n]

    def save(self, x_BLD: torch.Tensor, index: int) -> object:
        """Forward of checkpoint `index` (or a segment's backward, for a scratch slot): copy
        its input into slot `index`; returns the token that `load` takes back."""
        if not 0 <= index < self.n_slots:
            raise ValueError(f"slot index {index} out of range for {self.n_slots} slots")
        if x_BLD.is_cuda and self._stream is None:
            self._stream = torch.cuda.Stream(x_BLD.device)
        if self._slot != (x_BLD.shape, x_BLD.dtype):
            self._new_arena(x_BLD)
        _copy(self._view(index), x_BLD, self._stream)
        token = self._owner[index] = object()
        return token

    def load(self, token: object, index: int, device: torch.device) -> torch.Tensor:
        """Backward of checkpoint `index`: its input on `device`, ready to use on the current stream
        (a new copy at each call)."""
        if self._owner[index] is not token:
            raise RuntimeError(
                f"the offloaded input of block {index} was overwritten by a later forward (or "
                "already used by a backward); run each backward before the next forward"
            )
        shape, dtype = self._slot
        x_BLD = torch.empty(shape, dtype=dtype, device=device)  # on the compute stream
        _wait(_copy(x_BLD, self._view(index), self._stream), device)
        return x_BLD

    def release(self, token: object, index: int) -> None:
        """End of checkpoint `index`'s backward: its slot (and its attention outputs' slots)
        may be written again."""
        if self._owner[index] is token:
            self._owner[index] = None
        for arena in self._outputs:
            if index < len(arena.owner) and arena.owner[index] is token:
                arena.owner[index] = None

    def outputs(self, token: object, index: int, device: torch.device) -> _HostOutputs:
        """Where checkpoint `index`'s kept attention outputs go (`kept.KeptOutputs`'s host):
        beside its input, which `save` gave `token`; they come back to `device`."""
        if not 0 <= index < self.n_inputs:
            raise ValueError(f"checkpoint index {index} out of range for {self.n_inputs} inputs")
        return _HostOutputs(self, token, index, device)

    def save_outputs(self, tensors, index: int, call: int, token: object) -> None:
        """Forward of checkpoint `index`: copy what its attention call `call` keeps into slot
        `index` of that call's arena, owned by `token` (the checkpoint input's)."""
        if any(t.is_cuda for t in tensors) and self._stream is None:
            self._stream = torch.cuda.Stream(tensors[0].device)
        while len(self._outputs) <= call:
            self._outputs.append(_OutputArena())
        arena = self._outputs[call]
        layout = _layout(tensors)
        if arena.layout != layout:
            arena.make(self, layout, self.n_inputs, self.host, self._stream)
        for dst, src in zip(arena.views(index), tensors, strict=True):
            _copy(dst, src, self._stream)
        arena.owner[index] = token

    def load_outputs(self, token: object, index: int, call: int, device) -> list[torch.Tensor]:
        """Backward of checkpoint `index`: attention call `call`'s kept tensors on `device`
        (their shapes and strides), ready on the current stream (new copies at each call)."""
        arena = self._outputs[call] if call < len(self._outputs) else None
        if arena is None or arena.owner[index] is not token:
            raise RuntimeError(
                f"the offloaded attention outputs of checkpoint {index} (call {call}) were "
                "overwritten by a later forward (or by a checkpoint whose attention outputs "
                "have other shapes); run each backward before the next forward"
            )
        event, out = None, []
        for (shape, stride, dtype, _), src in zip(arena.layout[0], arena.views(index), strict=True):
            out.append(torch.empty_strided(shape, stride, dtype=dtype, device=device))
            event = _copy(out[-1], src, self._stream)
        _wait(event, device)
        return out

    def _view(self, index: int) -> torch.Tensor:
        shape, _ = self._slot
        n = shape.numel()
        return self.arena[index * n : (index + 1) * n].view(shape)

    def _new_arena(self, like: torch.Tensor) -> None:
        """An arena for `like`'s shape and dtype, exact size; the old one is freed first."""
        if self._unpin is not None:
            self._unpin()
        self.arena = self._unpin = None
        self._owner = [None] * self.n_slots
        self.arena = torch.empty(self.n_slots * like.numel(), dtype=like.dtype, device=self.host)
        self._slot = (like.shape, like.dtype)
        if self._stream is not None:
            self._unpin = _pin(self, self.arena, self._stream)


class _HostOutputs:
    """Checkpoint `index`'s attention outputs in `offloader`'s host memory, by the call's
    position in the checkpoint (`save(call, tensors)`, `load(call)`): the host of
    `upipe.attention.kept.KeptOutputs`."""

    def __init__(self, offloader: Offloader, token: object, index: int, device):
        self.offloader, self.token, self.index, self.device = offloader, token, index, device

    def save(self, call: int, tensors) -> None:
        self.offloader.save_outputs(tensors, self.index, call, self.token)

    def load(self, call: int) -> list[torch.Tensor]:
        return self.offloader.load_outputs(self.token, self.index, call, self.device)


class _OutputArena:
    """The host arena of one attention call's kept tensors: a slot per offloaded checkpoint,
    each holding the tensors of `layout` (`_layout`), in one exact-size byte tensor."""

    def __init__(self):
        self.layout = None  # (((shape, stride, dtype, byte offset), ...), slot bytes)
        self.arena: torch.Tensor | None = None
        self.owner: list[object | None] = []
        self._unpin = None

    def make(self, offloader, layout, n_slots: int, host, stream) -> None:
        """A new arena for `layout` (the old one freed first)."""
        if self._unpin is not None:
            self._unpin()
        self.arena = self._unpin = None
        self.arena = torch.empty(n_slots * layout[1], dtype=torch.uint8, device=host)
        self.layout, self.owner = layout, [None] * n_slots
        if stream is not None:
            self._unpin = _pin(offloader, self.arena, stream)

    def views(self, index: int) -> list[torch.Tensor]:
        """Slot `index`'s tensors, viewed in the arena with their shapes and strides."""
        tensors, slot = self.layout
        out = []
        for shape, stride, dtype, offset in tensors:
            start = index * slot + offset
            n = math.prod(shape) * dtype.itemsize
            flat = self.arena[start : start + n].view(dtype)
            out.append(flat.as_strided(shape, stride, flat.storage_offset()))
        return out


def _layout(tensors) -> tuple:
    """Where each of `tensors` lies in an arena slot: (((shape, stride, dtype, byte offset),
    ...), slot bytes). A tensor that fills its extent densely (any dimension order: the CPU
    kernel's lse is a transposed one) keeps its strides, so it comes back as it was; any
    other comes back contiguous."""
    entries, offset = [], 0
    for t in tensors:
        entries.append((tuple(t.shape), _dense_strides(t), t.dtype, offset))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return tuple(entries), offset


def _dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """t's strides if its elements fill exactly t.numel() consecutive places, else the
    contiguous strides of its shape."""
    expected = 1
    for i in sorted(range(t.dim()), key=lambda i: (t.stride(i), -t.size(i))):
        if t.size(i) > 1 and t.stride(i) != expected:
            contiguous, n = [], 1
            for size in reversed(t.shape):
                contiguous.insert(0, n)
                n *= max(size, 1)
            return tuple(contiguous)
        expected *= t.size(i)
    return t.stride()


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
