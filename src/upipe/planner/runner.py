"""Candidates simulated `jobs` at a time, the longest first, each result handed back as it
finishes (so that a caller can write its partial table and JSON, and Ctrl-C leaves them).

Each candidate runs in a process of its own (spawned: a simulator holds the process's
default process group, and a fresh interpreter holds nothing of the parent's). The order
is the longest expected first (`cost`), so that the workers end together: on 2 workers the
last candidates to start are the short ones. On an exception, Ctrl-C included, the pool's
processes are terminated (`multiprocessing.Pool.__exit__`) and the exception propagates.
The workers ignore SIGINT (`upipe.launch.children_ignore_sigint`): the caller alone
handles Ctrl-C.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Sequence

from upipe.launch import children_ignore_sigint


def cost(kw: dict, depths: Sequence[int]) -> float:
    """A candidate's expected seconds, relative: blocks simulated, x 2 for UPipe's stages,
    x 2 with activation checkpointing (every block forward again); order only."""
    return (
        sum(depths)
        * (2 if kw.get("heads_per_stage") else 1)
        * (2 if kw.get("activation_checkpoint") else 1)
    )


def _call(task):
    key, fn, args = task
    return key, fn(*args)


def run_all(fn: Callable, tasks: list[tuple[object, tuple]], jobs: int, done: Callable):
    """`fn(*args)` for each `(key, args)` of `tasks` (in that order: sort them first),
    `jobs` at a time in processes of their own (in this process if jobs is 1); `done(key,
    result)` in this process as each finishes."""
    if jobs == 1 or len(tasks) < 2:
        for key, args in tasks:
            done(key, fn(*args))
        return
    keys = [key for key, _ in tasks]  # (sent as indices: a key may not survive pickling)
    with children_ignore_sigint():
        pool = mp.get_context("spawn").Pool(min(jobs, len(tasks)))
    with pool:
        work = [(i, fn, args) for i, (_, args) in enumerate(tasks)]
        for i, result in pool.imap_unordered(_call, work):
            done(keys[i], result)
