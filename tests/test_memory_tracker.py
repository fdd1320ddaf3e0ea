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
