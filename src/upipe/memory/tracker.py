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
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        weakref.finalize(storage, self._free, key)
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # views and in-place ops return an input's storage: not an allocation of this region
        inputs = {
            t.untyped_storage()._cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.layout == torch.strided
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            key = t.untyped_storage()._cdata
            if key not in inputs:
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
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.cuda_peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._cuda_base
        return out
