"""The suite's setup: tests/helpers on the import path (workers, emulations, tolerances),
hypothesis' fixed examples, the shared local gloo clusters by world size, the tests of
tests/runs marked slow, and the xdist grouping of the cluster tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from upipe.launch import LocalCluster

# the helpers of every tier (`from tolerances import rel_err`, `from workers import ...`);
# spawned ranks inherit the path, so they unpickle the workers' functions by the same names
HELPERS = Path(__file__).resolve().parent / "helpers"
RUNS = Path(__file__).resolve().parent / "runs"
sys.path.insert(0, str(HELPERS))

# Property tests (hypothesis) draw the same examples on every run, so that the suite cannot
# fail at random ("ci", the default); `make test-explore SEED=n` draws other ones ("explore":
# random, from the seed), to find new failing cases -- each found one becomes a fixed case.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False, database=None)
settings.load_profile("ci")


@pytest.fixture(scope="session")
def clusters():
    """`clusters(n)` -> a running LocalCluster of n gloo ranks, shared by the whole session;
    the process groups a test makes on them end with the test (`_end_the_tests_groups`)."""
    running: dict[int, LocalCluster] = {}

    def get(n: int) -> LocalCluster:
        if n not in running:
            running[n] = LocalCluster(n, timeout_s=240, pg_timeout_s=60)
            running[n].start()
        return running[n]

    get.running = running
    yield get
    for c in running.values():
        c.close()


@pytest.fixture(autouse=True)
def _end_the_tests_groups(request):
    """After a test of the shared clusters, the meshes and groups it made end on their ranks
    (`LocalCluster.end_groups`: each idle gloo group wakes its thread 100 times a second;
    left alive, the groups of the session's tests took a third of the CPU time)."""
    yield
    if "clusters" in request.fixturenames:
        for cluster in request.getfixturevalue("clusters").running.values():
            cluster.end_groups()


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
        if Path(item.path).resolve().parent == RUNS:
            item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    """Each xdist worker computes on its share of the cores (torch's default, one intra-op
    thread per core in every worker, oversubscribes them: two workers on two cores ran
    tests/runs/test_timing.py and tests/unit/test_memory_model.py in 83 s with the default,
    67 s with one thread each, 2026-12-02). Spawned ranks set their own count
    (`upipe.launch`)."""
    if hasattr(config, "workerinput"):
        import torch

        workers = int(config.workerinput["workercount"])
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, cores // workers))
    _refuse_ungrouped_xdist(config)


def _refuse_ungrouped_xdist(config):
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
