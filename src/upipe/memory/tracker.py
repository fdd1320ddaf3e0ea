"""Peak live tensor memory over a region of code, the same way on CPU and CUDA.

`MemoryTracker` is a `TorchDispatchMode`: every tensor an operator returns inside the region
has its storage counted once unless it is an input's storage (views, in-place ops), and a
weakref finalizer on the storage takes its bytes off again when it is freed. `peak_bytes`
is the highest sum reached: the memory of tensors *allocated inside the region*, so inputs
and parameters created before it are excluded, while gradients, activations and
communication buffers are counted.

    with MemoryTracker() as mem:
        loss = model(x).sum(); loss.backward()
    mem.peak_bytes

Storages resized in place (`UntypedStorage.resize_`, which FSDP2 uses to free and re-allocate
its unsharded parameters around every all-gather) are followed too: while a tracker is
active, `torch.UntypedStorage.resize_` is wrapped to report the new size (restored on exit).
A storage allocated before the region and grown inside it counts from then on.

On CUDA (`MemoryTracker(device)`) it also reads the caching allocator's peaks over the region,
both relative to the bytes allocated when the region starts (`torch.cuda.memory_allocated`):
`cuda_peak_bytes` from `max_memory_allocated` (agrees with `peak_bytes` up to allocator
rounding and the kernels' internal workspaces) and `cuda_reserved_peak_bytes` from
`max_memory_reserved` (adds cached free blocks and fragmentation; NCCL's buffers show here,
and the out-of-memory decision is made on reserved memory).

How the CUDA peaks of nested trackers stay exact (torch 2.13 sources): each statistic is a
`c10::CachingAllocator::Stat` (c10/core/Allocator.h) whose `increase` sets
peak = max(current, peak) and whose `reset_peak` sets peak = current;
`DeviceCachingAllocator::resetPeakStats` (c10/cuda/CUDACachingAllocator.cpp) resets every
statistic of the device, allocated and reserved bytes alike, and `torch.cuda.
max_memory_allocated` / `max_memory_reserved` (torch/cuda/memory.py) read the
"allocated_bytes.all.peak" / "reserved_bytes.all.peak" entries of `memory_stats()`. So there is
one peak per device and process, with no history: the peak over a region can only be read
as "the peak since the last reset", and a reset wipes it for everyone. Hence, per device:
- on entering, a tracker first hands the peak since the last reset to the trackers already
  active on the device (that stretch of time lies inside all of their regions), then resets;
- on exiting, it reads the peak since the last reset and hands it to itself and to every
  tracker still active (no reset: the next reader's stretch then starts earlier, at a
  time still inside its region, which can only repeat a value it has already seen).
The stretches between consecutive resets tile each tracker's region, and each one is read
by every tracker whose region contains it, so each tracker's peak is the maximum over
exactly its region, at any nesting (or overlap) of trackers. Code that calls
`torch.cuda.reset_peak_memory_stats` itself inside a tracked region loses the trackers the
peak before its call; and after a tracked region, `max_memory_allocated` counts from the
last tracker's entry.
"""

from __future__ import annotations

import weakref

import torch

from upipe.torch_private import TorchDispatchMode, is_traceable_wrapper_subclass

_ACTIVE: list[MemoryTracker] = []  # trackers inside their `with` block (innermost last)
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_
_DEVICE = torch.ops.prim.device.default  # `t.device` of a subclass: dispatched, allocates nothing


def _tracked_resize(storage, nbytes):
    old = storage.nbytes()
    out = _ORIGINAL_RESIZE(storage, nbytes)
    for tracker in _ACTIVE:
        tracker._resized(storage, old, storage.nbytes())
    return out


def _read_cuda_peaks(index: int) -> None:
    """Hand the device's allocated and reserved peaks since its last reset to every active
    tracker on CUDA device `index` (see the module doc)."""
    torch.cuda.synchronize(index)
    peaks = torch.cuda.max_memory_allocated(index), torch.cuda.max_memory_reserved(index)
    for tracker in _ACTIVE:
        if tracker._cuda_index == index:
            tracker._cuda_peaks = [
                max(a, b) for a, b in zip(tracker._cuda_peaks, peaks, strict=True)
            ]


def _plain_tensors(tree, found: list | None = None) -> list:
    """The strided tensors holding memory in `tree` (nested lists, tuples and dicts of an
    operator's arguments or results): a wrapper subclass such as DTensor has no memory of
    its own (its storage would claim the *global* size), so its inner tensors (a DTensor's
    local shard) stand for it. (A plain recursion: `tree_leaves` costs more than many ops.)"""
    found = [] if found is None else found
    if isinstance(tree, torch.Tensor):
        if is_traceable_wrapper_subclass(tree):
            names, _ = tree.__tensor_flatten__()
            _plain_tensors([getattr(tree, n) for n in names], found)
        elif tree.layout == torch.strided:
            found.append(tree)
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            _plain_tensors(x, found)
    elif isinstance(tree, dict):
        for x in tree.values():
            _plain_tensors(x, found)
    return found


class MemoryTracker(TorchDispatchMode):
    """Counts live tensor storages allocated inside the `with` block; see the module doc."""

    def __init__(self, device: torch.device | str | None = None, *, count=None):
        """`device`: on CUDA, also read the allocator's peaks. `count`: an optional predicate
        on tensors; `counted_peak_bytes` is then the peak of the storages allocated in the
        region that some op output accepted by `count` has used (from that moment on), e.g.
        head-layout buffers: `count=lambda t: t.dim() == 4 and t.shape[1] == S`."""
        super().__init__()
        self.device = torch.device(device) if device is not None else None
        self.count = count
        self.counted_bytes = 0
        self.counted_peak_bytes = 0
        self._counted: set[int] = set()
        self.current_bytes = 0
        self.peak_bytes = 0
        self.cuda_peak_bytes: int | None = None
        """CUDA: `max_memory_allocated` over the region minus `memory_allocated` at its start."""
        self.cuda_reserved_peak_bytes: int | None = None
        """CUDA: `max_memory_reserved` over the region minus `memory_allocated` at its start."""
        self._live: dict[int, int] = {}
        self._cuda_index: int | None = None  # the CUDA device while in the region
        self._cuda_base = 0
        self._cuda_peaks = [0, 0]  # allocated, reserved: the highest seen in the region

    def _free(self, key: int) -> None:
        nbytes = self._live.pop(key, 0)
        self.current_bytes -= nbytes
        if key in self._counted:
            self._counted.discard(key)
            self.counted_bytes -= nbytes

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type != "meta":  # meta: shapes without memory (a model before FSDP)
            self._count(t)

    def _count(self, t: torch.Tensor) -> None:
        """Count t's storage from now until it is freed (once)."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        weakref.finalize(storage, self._free, key)
        self.current_bytes += nbytes
        self._grew()

    def _grew(self) -> None:
        """`current_bytes` just grew (an allocation or a storage resize): note the peak.
        Subclasses extend this one place to keep more about the peak."""
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _resized(self, storage, old: int, new: int) -> None:
        key = storage._cdata
        if key not in self._live:
            if new <= old:
                return  # shrinking a storage this region never counted
            self._live[key] = old  # allocated before the region: counted from its growth on
            self.current_bytes += old
            weakref.finalize(storage, self._free, key)
        self.current_bytes += new - self._live[key]
        if key in self._counted:
            self.counted_bytes += new - self._live[key]
        self._live[key] = new
        self._grew()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE or (func.is_view and self.count is None):  # allocate nothing
            return func(*args, **kwargs)
        return self._run(func, args, kwargs, _plain_tensors((args, kwargs)))

    def _run(self, func, args, kwargs, inputs: list) -> object:
        """`func(*args, **kwargs)`, counting the storages of its results that are not among
        those of `inputs` (its tensor arguments; views and in-place ops return those)."""
        out = func(*args, **kwargs)
        input_keys = {t.untyped_storage()._cdata for t in inputs}
        for t in _plain_tensors(out):
            key = t.untyped_storage()._cdata
            if key not in input_keys:
                self._track(t)
            counts = self.count is not None and key in self._live and key not in self._counted
            if counts and self.count(t):
                self._counted.add(key)
                self.counted_bytes += self._live[key]
                self.counted_peak_bytes = max(self.counted_peak_bytes, self.counted_bytes)
        return out

    def __enter__(self):
        if self.device is not None and self.device.type == "cuda":
            index = self.device.index
            self._cuda_index = torch.cuda.current_device() if index is None else index
            _read_cuda_peaks(self._cuda_index)  # for the trackers already active (not self)
            torch.cuda.reset_peak_memory_stats(self._cuda_index)
            self._cuda_base = torch.cuda.memory_allocated(self._cuda_index)
            self._cuda_peaks = [self._cuda_base, self._cuda_base]
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _tracked_resize
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self._cuda_index is not None:
            _read_cuda_peaks(self._cuda_index)  # for self and the trackers still active
            self.cuda_peak_bytes, self.cuda_reserved_peak_bytes = (
                peak - self._cuda_base for peak in self._cuda_peaks
            )
            self._cuda_index = None
        _ACTIVE.remove(self)
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE
        return out
