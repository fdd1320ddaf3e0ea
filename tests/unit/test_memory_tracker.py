"""The memory tracker counts exactly the tensors allocated inside its region."""

import torch

from upipe.memory import MemoryTracker


def test_counts_allocations_not_views_or_inputs():
    x = torch.randn(1000, 250)  # 1 MB, allocated before the region: not counted
    mb = 1000 * 250 * 4
    with MemoryTracker() as mem:
        y = x * 2  # +1 MB
        y.t()[:10], y.view(-1)[:10]  # views: nothing
        y.add_(1)  # in place: nothing
        z = torch.cat([y, y])  # +2 MB -> peak 3 MB
        del z  # -2 MB
        w = y + 1  # +1 MB
    assert mem.peak_bytes == 3 * mb
    assert mem.current_bytes == 2 * mb
    del y, w
    assert mem.current_bytes == 0


def test_autograd_region_matches_hand_count():
    # forward: x*2 and exp's output (saved) coexist -> 2 MB; backward: exp's output and its
    # gradient, then that gradient and x.grad -> 2 MB; plus two 4-byte scalars (sum, its grad)
    x = torch.randn(1000, 1000, requires_grad=True)
    with MemoryTracker() as mem:
        (x * 2).exp().sum().backward()
    assert mem.peak_bytes == 2 * x.numel() * 4 + 8
    assert mem.current_bytes == x.numel() * 4  # x.grad


def test_storage_resizes_are_followed():
    # FSDP2 frees an unsharded parameter with storage.resize_(0) and re-allocates it in place
    t = torch.empty(100)  # 400 B allocated before the region
    with MemoryTracker() as mem:
        t.untyped_storage().resize_(800)  # grown inside: counted from here on
        assert mem.current_bytes == 800
        t.untyped_storage().resize_(0)
        assert mem.current_bytes == 0
        u = torch.empty(50)
        u.untyped_storage().resize_(0)
        u.untyped_storage().resize_(200)
    assert mem.peak_bytes == 800 and mem.current_bytes == 200
    assert torch.UntypedStorage.resize_ is not None and "tracked" not in str(
        torch.UntypedStorage.resize_
    )  # the wrapper is removed on exit


def test_dtensor_counts_its_local_shard():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from upipe.memory.simulate import fake_process_group

    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (4,))
        full = torch.zeros(64, 8)
        with MemoryTracker() as mem:
            shard = distribute_tensor(full, mesh, [Shard(0)])  # 16 x 8 fp32 per rank
            state = torch.zeros_like(shard)  # an optimizer state: another local shard
        assert mem.current_bytes == 2 * 16 * 8 * 4, mem.current_bytes
        del shard, state


def test_meta_tensors_hold_no_memory():
    with MemoryTracker() as mem:
        x = torch.empty(1024, 1024, device="meta")
        y = torch.empty(256, dtype=torch.float32)
    assert mem.peak_bytes == y.nbytes and x.is_meta


class FakeCudaAllocator:
    """The statistics of CUDA's caching allocator for one device, as torch 2.13 keeps them
    (c10/core/Allocator.h `Stat`: increase sets peak = max(current, peak), reset_peak sets
    peak = current; `resetPeakStats` resets allocated and reserved alike): freed blocks stay
    reserved (cached) and are reused before new segments are reserved."""

    def __init__(self):
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def malloc(self, nbytes):
        self.allocated += nbytes
        self.reserved = max(self.reserved, self.allocated)  # a new segment when the cache is short
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, nbytes):
        self.allocated -= nbytes

    def reset_peak_memory_stats(self, device=None):
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def install(self, monkeypatch):
        """Replace the torch.cuda functions the tracker calls with this allocator's."""
        for name, fn in {
            "synchronize": lambda device=None: None,
            "current_device": lambda: 0,
            "reset_peak_memory_stats": self.reset_peak_memory_stats,
            "memory_allocated": lambda device=None: self.allocated,
            "max_memory_allocated": lambda device=None: self.peak_allocated,
            "max_memory_reserved": lambda device=None: self.peak_reserved,
        }.items():
            monkeypatch.setattr(torch.cuda, name, fn)


def test_nested_cuda_peaks_are_exact(monkeypatch):
    """An inner tracker's reset must not wipe the outer tracker's earlier peak, and the inner
    one must not see the outer's peak from before it started."""
    gpu = FakeCudaAllocator()
    gpu.install(monkeypatch)
    gpu.malloc(100)  # live before both regions
    with MemoryTracker("cuda") as outer:
        gpu.malloc(1000)
        gpu.free(1000)  # outer's peak: +1000, and 1100 bytes reserved from here on
        gpu.malloc(50)  # kept: the inner region starts at 150 allocated
        with MemoryTracker("cuda:0") as inner:
            gpu.malloc(200)
            with MemoryTracker("cuda") as innermost:  # starts at 350
                gpu.malloc(300)
                gpu.free(300)
            gpu.free(200)
            gpu.malloc(10)
        gpu.malloc(700)  # after inner, below outer's earlier peak
    assert innermost.cuda_peak_bytes == 300 and innermost.cuda_reserved_peak_bytes == 1100 - 350
    assert inner.cuda_peak_bytes == 500 and inner.cuda_reserved_peak_bytes == 1100 - 150
    assert outer.cuda_peak_bytes == 1000 and outer.cuda_reserved_peak_bytes == 1000


def test_overlapping_cuda_peaks_are_exact(monkeypatch):
    """Regions that overlap without nesting (entered a, b; exited a, b) get their own peaks."""
    gpu = FakeCudaAllocator()
    gpu.install(monkeypatch)
    a, b = MemoryTracker("cuda"), MemoryTracker("cuda")
    a.__enter__()
    gpu.malloc(400)
    gpu.free(400)
    b.__enter__()
    gpu.malloc(100)
    a.__exit__(None, None, None)
    gpu.malloc(200)
    b.__exit__(None, None, None)
    assert a.cuda_peak_bytes == 400 and b.cuda_peak_bytes == 300
    assert a.cuda_reserved_peak_bytes == 400 and b.cuda_reserved_peak_bytes == 400


def test_cpu_tracker_reads_no_cuda(monkeypatch):
    gpu = FakeCudaAllocator()
    gpu.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: 1 / 0)
    with MemoryTracker() as mem, MemoryTracker("cpu") as mem_cpu:
        torch.empty(10)
    assert mem.cuda_peak_bytes is None and mem_cpu.cuda_reserved_peak_bytes is None
