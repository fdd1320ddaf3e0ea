"""Shared fixtures: local gloo clusters by world size, and the tolerance table."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings

from upipe.launch import LocalCluster

# Property tests (hypothesis) draw the same examples on every run, so that the suite cannot
# fail at random ("ci", the default); `make test-explore SEED=n` draws other ones ("explore":
# random, from the seed), to find new failing cases -- each found one becomes a fixed case.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False, database=None)
settings.load_profile("ci")

# Relative error bounds, max|actual - ref| / max|ref|, against a float64 reference.
# fp32: all strategies run the same fp32 kernel as a single process would (measured errors
# are ~1e-6). bf16: the kernel itself must stay under "fwd"/"bwd" (single-device bf16
# attention vs float64 measures about 2e-3 to 7e-3 forward, up to 3e-2 backward); a
# distributed strategy in bf16 may be at most "factor" times as wrong as one device running
# the same kernel on the full sequence -- `bf16_bound` below.
TOL = {
    torch.float32: {"fwd": 1e-5, "bwd": 1e-5},
    torch.bfloat16: {"fwd": 1.5e-2, "bwd": 5e-2, "factor": 2.0, "floor": 1e-3},
}
# UPipe vs Ulysses on identical inputs: the same kernel on the same data, up to the order of
# fp32 sums (projections accumulated per stage).
TOL_SAME_KERNEL = 2e-6


# The smallest reference magnitude an error is taken relative to, by the dtype of the result
# judged. The tests draw unit-scale inputs (randn), so a result that is not degenerate has
# max|ref| of order 1; one that is (near) zero -- the gradient of a one-token attention, which
# is exactly 0 -- holds only the rounding noise of unit-scale operands (fp32: ~1e-8), and
# dividing that by max|ref| ~ 1e-30 reported 1e22 for a right answer. Below the floor the
# error is therefore absolute: max|actual - ref| / FLOOR. Each floor is the magnitude at which
# that dtype's rounding noise on unit-scale operands stays well under the tolerance of `TOL`
# (fp32: the one-token case's 1e-8 / 1e-2 = 1e-6, against 1e-5).
REL_ERR_FLOOR = {
    torch.float64: 1e-6,
    torch.float32: 1e-2,
    torch.float16: 1e-1,
    torch.bfloat16: 1e-1,
}


def rel_err(actual: torch.Tensor, ref: torch.Tensor, *, scale: float = 1.0) -> float:
    """max|actual - ref| / max(max|ref|, REL_ERR_FLOOR[actual.dtype] * scale).

    `scale`: the magnitude the judged quantity has at unit-scale inputs, where that is not 1
    (e.g. a loss gradient divided by the token count)."""
    ref = ref.double()
    floor = REL_ERR_FLOOR.get(actual.dtype, REL_ERR_FLOOR[torch.float32]) * scale
    return ((actual.double() - ref).abs().max() / ref.abs().max().clamp_min(floor)).item()


def grad_errors(grads: dict, ref: dict) -> dict[str, float]:
    """`rel_err` of each parameter gradient against the reference's, at the scale of all of
    them: a model's gradients are small (the loss is a mean over many tokens) without being
    degenerate, so the floor is taken relative to the largest of them."""
    scale = max(g.abs().max().item() for g in ref.values())
    return {n: rel_err(grads[n], g, scale=scale) for n, g in ref.items()}


def bf16_bound(single_device_err: float) -> float:
    """Allowed bf16 error of a strategy: a multiple of what one device in bf16 gets wrong."""
    return max(TOL[torch.bfloat16]["factor"] * single_device_err, TOL[torch.bfloat16]["floor"])


@pytest.fixture(scope="session")
def clusters():
    """`clusters(n)` -> a running LocalCluster of n gloo ranks, shared by the whole session."""
    running: dict[int, LocalCluster] = {}

    def get(n: int) -> LocalCluster:
        if n not in running:
            running[n] = LocalCluster(n, timeout_s=240, pg_timeout_s=60)
            running[n].start()
        return running[n]

    yield get
    for c in running.values():
        c.close()
