"""The error helper every accuracy test uses: relative, with an absolute floor."""

import torch
from tolerances import REL_ERR_FLOOR, TOL, bf16_bound, rel_err


def test_zero_reference_is_judged_absolutely():
    """A reference that is exactly 0 (the q gradient of a row seeing one key) with fp32
    rounding noise on the result, gathered to float64 as the tests gather results: the error
    is the noise over the floor, not over ~0."""
    ref = torch.zeros(4, 8, dtype=torch.float64)
    noisy = torch.full((4, 8), 5e-7, dtype=torch.float32).double()
    assert abs(rel_err(noisy, ref) - 5e-7 / REL_ERR_FLOOR) < 1e-12
    assert rel_err(noisy, ref) < TOL[torch.float32]["bwd"]


def test_floor_does_not_hide_wrong_answers():
    """Above the floor the error stays relative; a wrong answer fails at any scale."""
    ref = torch.randn(64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert rel_err(ref.float(), ref) < 1e-7
    assert rel_err((ref * 1.001).float(), ref) > 9e-4
    wrong = torch.full((4,), 1e-3, dtype=torch.float32)  # nonzero where the truth is 0
    assert rel_err(wrong, torch.zeros(4, dtype=torch.float64)) > 100 * TOL[torch.float32]["bwd"]


def test_scale_lowers_the_floor():
    """A quantity whose operands are small (a loss gradient over many tokens) passes their
    scale, so the floor does not loosen its check."""
    ref = torch.full((4,), 1e-4, dtype=torch.float64)
    off = (ref * 1.01).float()
    assert rel_err(off, ref) < 1e-5 * 1.01  # against the floor 1: looks 1000x better
    assert abs(rel_err(off, ref, scale=1e-4) - 1e-2) < 1e-4  # against max|ref|: 1%


def test_bf16_bound_is_a_multiple_with_a_floor_and_one_rounding_per_extra_partial():
    assert bf16_bound(1e-4) == 1e-3  # the floor
    assert bf16_bound(3e-3) == 6e-3  # twice one device's error
    assert bf16_bound(3e-3, summed=3) == 6e-3 + 2 * 2.0**-9
