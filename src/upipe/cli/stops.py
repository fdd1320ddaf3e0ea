"""Ctrl-C and SIGTERM in every command: one line naming the signal, exit status 128 + its
number (130, 143), no traceback.

`upipe.cli.main` runs each command's handler under `stoppable`. SIGTERM is turned into an
exception where Ctrl-C's KeyboardInterrupt would be raised (`Terminated`, a subclass), so the
same `with` blocks and `finally` clauses run for both: spawned ranks are stopped by their
`LocalCluster`, a planner's pool by `multiprocessing.Pool.__exit__`, and the queues'
semaphores are released (SIGTERM's default action would end the process at once and leave
them to multiprocessing's resource tracker, which warns about "leaked semaphore objects").
Under torchrun SIGTERM keeps its default action: torchrun's agent stops its ranks with it,
and a rank blocked in a collective would not run a Python handler until the collective ends.

A command that has more to say (which ranks were stopped, where its partial results are)
catches KeyboardInterrupt itself and returns `stopped(command, e, detail)`; anything else
reaches `stoppable`, which says the line alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be."""


def _raise_terminated(signum, frame):
    raise Terminated


def signal_of(e: KeyboardInterrupt) -> signal.Signals:
    """The signal that raised `e`: SIGTERM for `Terminated`, else SIGINT (Ctrl-C)."""
    return signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT


def stopped(command: str, e: KeyboardInterrupt, detail: str = "") -> int:
    """Say on stderr, in one line, that `upipe command` was stopped by `e`'s signal (then
    `detail`, e.g. ": the ranks were stopped"); the exit status, 128 + the signal's number."""
    sig = signal_of(e)
    by = "Ctrl-C (SIGINT)" if sig == signal.SIGINT else sig.name
    print(f"\nupipe {command}: stopped by {by}{detail}", file=sys.stderr, flush=True)
    return 128 + sig


@contextlib.contextmanager
def sigterm_raises():
    """SIGTERM raises `Terminated` inside the block (not under torchrun: module docstring;
    nor off the main thread, where Python runs no signal handler); the previous handler is
    restored after it."""
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ
    if under_torchrun or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stoppable(command: str, handler, *args) -> int:
    """`handler(*args)`'s exit status, or on Ctrl-C / SIGTERM `stopped(command, ...)`'s."""
    with sigterm_raises():
        try:
            return handler(*args) or 0
        except KeyboardInterrupt as e:
            return stopped(command, e)
