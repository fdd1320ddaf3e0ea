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
