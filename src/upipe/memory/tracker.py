"""Peak live tensor memory over a region of code, the same way on CPU and CUDA.

`MemoryTracker` is a `TorchDispatchMode`: every tensor an operator returns inside the region
has its storage counted once unless it is an input's storage (views, in-place ops), and a
weakref finalizer on the storage takes its bytes off again when it is freed. `peak_bytes`
is the highest sum reached: the memory of tensors *allocated inside the region*, so inputs
and parameters created before it are excluded, while gradients, activations and
communication buffers are counted. On CUDA it
also reads the caching allocator's `max_memory_allocated` over the region, which agrees up
to allocator rounding and the kernels' internal workspaces.

    with MemoryTracker() as mem:
        loss = model(x).sum(); loss.backward()
    mem.peak_bytes

Storages resized in place (`UntypedStorage.resize_`, which FSDP2 uses to free and re-allocate
its unsharded parameters around every all-gather) are followed too: while a tracker is
active, `torch.UntypedStorage.resize_` is wrapped to report the new size (restored on exit).
A storage allocated before the region and grown inside it counts from then on.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

_ACTIVE: list[MemoryTracker] = []  # trackers inside their `with` block (innermost last)
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_
_DEVICE = torch.ops.prim.device.default  # `t.device` of a subclass: dispatched, allocates nothing


def _tracked_resize(storage, nbytes):
    old = storage.nbytes()
    out = _ORIGINAL_RESIZE(storage, nbytes)
    for tracker in _ACTIVE:
        tracker._resized(storage, old, storage.nbytes())
    return out


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
        """`device`: on CUDA, also read the allocator's peak. `count`: an optional predicate
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
        self._live: dict[int, int] = {}
        self._cuda_base = 0

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
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _tracked_resize
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        _ACTIVE.remove(self)
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.cuda_peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._cuda_base
        return out
