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


# The smallest reference magnitude an error is taken relative to: the size of the operands.
# Rounding noise is relative to the operands and the intermediate sums a kernel forms, not to
# the result: where the result cancels to (near) zero -- the q/k gradients of a row that sees
# one key (a one-token sequence, a window of 1), which are exactly 0 in float64 -- fp32 leaves
# noise of order eps * |operands| (measured up to 5e-7 on this machine's CPU kernel, exactly 0
# on others: the vector width decides), and dividing it by max|ref| ~ 0 reported 1e22 for a
# right answer. The tests draw unit-scale operands (randn), so the floor is 1 times `scale`
# for every dtype (results are gathered to float64 for judging, so the dtype of the result
# says nothing of the dtype it was computed in). A wrong answer is still off by a sizeable
# part of the operands' scale, far above any tolerance of `TOL`.
REL_ERR_FLOOR = 1.0


def rel_err(actual: torch.Tensor, ref: torch.Tensor, *, scale: float = 1.0) -> float:
    """max|actual - ref| / max(max|ref|, REL_ERR_FLOOR * scale).

    `scale`: the magnitude of the operands the judged quantity is computed from, where that
    is not 1 (e.g. a loss gradient divided by the token count)."""
    ref = ref.double()
    floor = REL_ERR_FLOOR * scale
    return ((actual.double() - ref).abs().max() / ref.abs().max().clamp_min(floor)).item()


# A model's gradients (and weights) are small without being degenerate -- the loss is a mean
# over many tokens, the weights are initialised at std 0.02 -- so each is judged relative to
# itself down to this fraction of the largest of them, and absolutely below it.
MODEL_FLOOR = 1e-2


def grad_errors(grads: dict, ref: dict) -> dict[str, float]:
    """`rel_err` of each named tensor of a model (gradients; a checkpoint's weights) against
    the reference's, its floor `MODEL_FLOOR` times the largest reference magnitude of all of
    them (not the operands' scale 1 of `rel_err`: a gradient of 1e-3 judged against 1 would
    pass a 1% error)."""
    largest = max(g.abs().max().item() for g in ref.values())
    return {n: rel_err(grads[n], g, scale=MODEL_FLOOR * largest) for n, g in ref.items()}


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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test` runs two workers, `--dist loadgroup`), every test that
    uses the shared `clusters` runs on one worker, so that one set of gloo clusters is
    started (each cluster's ranks import torch: seconds each) and two workers' clusters never
    compete for the two cores; the other tests (unit tests, planner simulations, training
    runs) are shared out between both workers."""
    for item in items:
        if "clusters" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("clusters"))


def pytest_configure(config):
    """pytest-xdist 3.8 groups tests by a suffix of their node ids, which pytest 9.2 no longer
    keeps (pytest-dev/pytest-xdist#1386): the cluster tests would spread silently over both
    workers (each starting its own clusters, competing for the cores). Refuse at once."""
    if config.getoption("dist", "no") != "loadgroup" or hasattr(config, "workerinput"):
        return
    import xdist

    def version(text: str) -> tuple[int, int]:
        return tuple(int(part) for part in text.split(".")[:2])

    if version(pytest.__version__) >= (9, 2) and version(xdist.__version__) <= (3, 8):
        raise pytest.UsageError(
            f"pytest-xdist {xdist.__version__}'s --dist loadgroup does not group tests under "
            f"pytest {pytest.__version__}: install pytest<9.2 (pip install -e '.[dev]'), or "
            "run in one process (make test WORKERS=0)"
        )
