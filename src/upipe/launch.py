"""A local gloo cluster: N spawned CPU ranks on 127.0.0.1 that run functions on request.

Used by the CLI's CPU demos and by the tests. It never hangs and says what happened: the
process group has a timeout, every call has a wall-clock limit, and a call fails with a
`DistributedError` whose first line names each rank that failed and how (`RankFailure`):
it raised (its own error, then its traceback), was killed (by which signal), exited, or
stopped answering (its peers time out in their next collective after `pg_timeout_s`; the
rank is then found frozen, e.g. by SIGSTOP, or still running `grace_s` after the first
failure; a loaded machine may need a grace longer than `pg_timeout_s`). The cluster is then
restarted, since its peers may be stuck in a collective. The ranks die with the process
that started them, however it ends (kill -9 included; `die_with_parent`).

    with LocalCluster(4) as cluster:
        results = cluster.run(fn, arg1, arg2)   # fn(rank, world_size, arg1, arg2) on each rank

`fn` must be importable by name (a module-level function) and its arguments and results
picklable; it runs with the default process group initialised (gloo, `world_size` ranks)
and one intra-op thread per rank unless `threads` says otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing import connection as mp_connection

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
GRACE_S = 5.0  # once a rank failed, how long its peers may take to report theirs
POLL_S = 0.5  # how often a call looks for ranks that died without reporting
STOPPED = ("T", "t")  # process states of /proc/<pid>/stat: stopped by a signal, by a tracer


@contextlib.contextmanager
def children_ignore_sigint():
    """Processes started inside the block ignore SIGINT from their first instruction (an
    ignored signal stays ignored across exec, and Python then installs no Ctrl-C handler).
    Ctrl-C in a terminal reaches every process of the foreground group: the process that
    started them alone handles it and stops them, instead of each printing a traceback.
    (Off the main thread, where no handler can be set, the block changes nothing.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def die_with_parent(parent_pid: int | None = None) -> None:
    """End this process as soon as its parent (`parent_pid`, default: the current one) ends,
    however it ends, kill -9 included: on Linux the kernel sends this process SIGKILL
    (`prctl(PR_SET_PDEATHSIG)`; it fires when the *thread* that started this process
    exits, so start ranks from a thread that outlives them, such as the main thread);
    elsewhere a daemon thread polls the parent's pid once a second."""
    parent = os.getppid() if parent_pid is None else parent_pid
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0:
            if os.getppid() != parent:  # it ended before the signal was armed
                os._exit(1)
            return

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """How one rank of a call failed."""

    rank: int
    what: str
    """One of "raised", "killed" (by a signal), "exited" (without reporting), "frozen" (its
    process is stopped), "silent" (still running, no answer), "late" (out of time)."""
    message: str
    """One line: the exception ("ValueError: ...") or what was seen of the process."""
    error_type: str = ""
    """The exception's class as `module.QualName` (raised only)."""
    traceback: str = ""

    def describe(self) -> str:
        return f"raised {self.message}" if self.what == "raised" else self.message


class DistributedError(RuntimeError):
    """A call on a `LocalCluster` failed: `failures` say which ranks and how, `summary` in
    one line; the message is `headline` (what was running: the summary), then the ranks'
    tracebacks."""

    def __init__(self, doing: str, failures: list[RankFailure]):
        self.failures = failures
        self.summary = "; ".join(_grouped(failures))
        self.headline = f"{doing}: {self.summary}"
        details = "".join(
            f"\n--- rank {f.rank} ---\n{f.traceback}" for f in failures if f.traceback
        )
        super().__init__(self.headline + details)


def _grouped(failures: list[RankFailure]) -> list[str]:
    """The failures as phrases ("rank 1 was killed by SIGKILL", "ranks 0, 2 raised
    ValueError: ..."): the ranks that died or stopped first (the likely causes), then the
    others in the order they failed; ranks with the same message together."""
    order = {"killed": 0, "exited": 0, "frozen": 0, "raised": 1, "silent": 2, "late": 2}
    groups: dict[str, list[int]] = {}
    for f in sorted(failures, key=lambda f: order[f.what]):  # stable: arrival order kept
        groups.setdefault(f.describe(), []).append(f.rank)
    return [
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))} {text}"
        for text, ranks in groups.items()
    ]


def _process_state(pid: int) -> str | None:
    """The state letter of `/proc/<pid>/stat` ("R", "S", "T" stopped, ...); None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _worker(rank, world_size, port, timeouts, threads, parent_pid, tasks, results):
    """One rank. `timeouts` = (start, pg): how long the ranks may take to meet (their
    start-up, importing torch, can differ by seconds on a loaded machine: the store waits
    that long), and the process group's timeout for every collective after that. `port`:
    the parent's store (`LocalCluster.start`). `results`: this rank's own pipe to the
    parent (`LocalCluster.start` says why its own)."""
    die_with_parent(parent_pid)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    start_s, pg_timeout_s = timeouts
    try:
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            is_master=False,
            timeout=datetime.timedelta(seconds=max(start_s, pg_timeout_s)),
        )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
    except Exception as e:
        results.send((rank, False, _report(e)))
        return
    results.send((rank, True, "ready"))
    while True:
        try:
            task = tasks.get()  # (unpickled here: a function this process cannot import raises)
            if task is None:
                break
            fn, args = task
            # (pickled here, before anything is written: a result that cannot be pickled
            # is reported as this rank's error)
            results.send((rank, True, fn(rank, world_size, *args)))
        except BaseException as e:
            results.send((rank, False, _report(e)))
    dist.destroy_process_group()
    _exit_now(results)


def _end_groups(rank, world_size) -> int:
    """`LocalCluster.end_groups` on one rank: how many groups it ended."""
    import torch.distributed as dist

    from upipe.mesh import release_meshes
    from upipe.torch_private import process_groups

    release_meshes()  # (they hold their groups)
    made = [g for g in process_groups() if g is not dist.group.WORLD]
    for group in made:
        dist.destroy_process_group(group)
    return len(made)


def _exit_now(results) -> None:
    """End this rank without the interpreter's finalization, which with torch loaded takes
    seconds (measured 4-14 s a process on a loaded 2-core machine, 2026-12-02) and which
    `LocalCluster.close` would wait for: first the exit handlers run, as a normal exit would
    (the results were written by `send` itself: nothing is left to flush)."""
    import atexit

    results.close()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _report(e: BaseException) -> tuple[str, str, str]:
    """(one line "Type: first line of the message", `module.QualName`, the traceback)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    kind = type(e)
    line = f"{kind.__name__}: {first}" if first else kind.__name__
    return line, f"{kind.__module__}.{kind.__qualname__}", traceback.format_exc()


class LocalCluster:
    """`world_size` spawned gloo ranks; see the module docstring."""

    def __init__(
        self,
        world_size: int,
        *,
        timeout_s: float = 300.0,
        pg_timeout_s: float = 60.0,
        threads: int = 1,
        env: dict[str, str] | None = None,
        grace_s: float = GRACE_S,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if pg_timeout_s <= 0:
            raise ValueError(f"pg_timeout_s must be > 0, got {pg_timeout_s}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.pg_timeout_s = pg_timeout_s
        self.grace_s = grace_s
        self.threads = threads
        self.env = env or {}
        self._procs: list = []
        self._store = None  # the ranks' TCPStore, served from this process while they run

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, kind, error, tb):
        # leaving on an exception (Ctrl-C, say): the ranks may be busy with a task and would
        # not read the request to leave, so they are killed at once
        self.close(wait_s=0.0 if kind is not None else 10.0)

    def start(self) -> None:
        import torch.distributed as dist

        ctx = mp.get_context("spawn")
        # the ranks' store is served from here, bound at once to a port the OS picks: a port
        # found free here and bound by rank 0 only once it had imported torch (seconds later
        # on a loaded machine) could be taken meanwhile by another process's connection --
        # EADDRINUSE in a fresh-clone run, 2026-12-07
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = self._store.port
        # each rank reports through a pipe of its own, written by its main thread: through one
        # shared Queue, a rank stopped or killed while its feeder thread held the queue's
        # write lock (between the write of its last report and the lock's release) kept
        # every other rank's report out, and the call waited out its grace period (killed
        # peer) or its whole limit (frozen peer): twice in fresh-clone runs, 2026-12-06
        pipes = [ctx.Pipe(duplex=False) for _ in range(self.world_size)]
        self._results = [reader for reader, _ in pipes]
        # tasks go through SimpleQueues: their put pickles in the caller's thread, so a task
        # that cannot be pickled raises in `run` at once (a Queue's feeder thread would print
        # the error and the ranks would wait for a task that never comes)
        self._tasks = [ctx.SimpleQueue() for _ in range(self.world_size)]
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            self._procs = [
                ctx.Process(
                    target=_worker,
                    args=(
                        r,
                        self.world_size,
                        port,
                        (self.timeout_s, self.pg_timeout_s),
                        self.threads,
                        os.getpid(),
                        self._tasks[r],
                        pipes[r][1],
                    ),
                    daemon=True,
                )
                for r in range(self.world_size)
            ]
            with children_ignore_sigint():  # Ctrl-C stops them through this process
                for p in self._procs:
                    p.start()
        finally:
            for _, writer in pipes:  # the ranks hold theirs: a rank's end reads as EOF here
                writer.close()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            self._collect(self.timeout_s, "starting the ranks")
        except BaseException:  # __exit__ is not called when __enter__ raises
            self.close(wait_s=0.0)
            raise

    def close(self, *, wait_s: float = 10.0) -> None:
        """Stop the ranks: ask them to leave, wait up to `wait_s`, then kill what is left."""
        for q in getattr(self, "_tasks", []):
            with contextlib.suppress(OSError, ValueError):
                q.put(None)
        deadline = time.monotonic() + wait_s
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
        for reader in getattr(self, "_results", []):
            reader.close()
        self._results = []
        self._store = None  # (its server stops with the last reference)

    def _unanswered(self, rank: int, *, out_of_time: float | None) -> RankFailure:
        """What is seen of a rank that gave no answer (`out_of_time`: the call's limit ran
        out, else its peers failed and it did not report within the grace period)."""
        p = self._procs[rank]
        if not p.is_alive():
            code = p.exitcode
            if code is not None and code < 0:
                name = signal.Signals(-code).name
                return RankFailure(rank, "killed", f"was killed by {name} (pid {p.pid})")
            return RankFailure(rank, "exited", f"exited with status {code} without reporting")
        if _process_state(p.pid) in STOPPED:
            return RankFailure(
                rank,
                "frozen",
                f"is frozen: its process {p.pid} is stopped (SIGSTOP or a debugger); its "
                f"peers give up waiting for it after their {self.pg_timeout_s:g} s timeout",
            )
        if out_of_time is not None:
            return RankFailure(rank, "late", f"did not finish within {out_of_time:g} s")
        return RankFailure(
            rank, "silent", f"was still running {self.grace_s:g} s after the first failure"
        )

    def _collect(self, timeout_s: float, doing: str) -> list:
        out: dict[int, object] = {}
        failures: dict[int, RankFailure] = {}  # in the order they were seen
        deadline = time.monotonic() + timeout_s
        grace_end = None
        while len(out) + len(failures) < self.world_size:
            if failures and grace_end is None:
                grace_end = time.monotonic() + self.grace_s
            end = deadline if grace_end is None else min(deadline, grace_end)
            left = end - time.monotonic()
            if left <= 0:
                break
            waiting = [r for r in range(self.world_size) if r not in out and r not in failures]
            readers = {self._results[r]: r for r in waiting}
            ready = mp_connection.wait(list(readers), timeout=min(POLL_S, left))
            for reader in ready:
                r = readers[reader]
                try:
                    rank, ok, value = reader.recv()
                except EOFError:  # its end closed with no report: the process ended
                    self._procs[r].join(POLL_S)
                    failures[r] = self._unanswered(r, out_of_time=None)
                    continue
                if ok:
                    out[rank] = value
                else:
                    failures[rank] = RankFailure(rank, "raised", *value)
            if ready:
                continue
            for r in waiting:  # a rank that died or froze says nothing: look
                if not self._procs[r].is_alive():
                    failures[r] = self._unanswered(r, out_of_time=None)
            if failures and all(_process_state(self._procs[r].pid) in STOPPED for r in waiting):
                break  # the rest are frozen: no use waiting out the grace period
        missing = [r for r in range(self.world_size) if r not in out and r not in failures]
        out_of_time = None if failures else timeout_s
        for r in missing:
            failures[r] = self._unanswered(r, out_of_time=out_of_time)
        if failures:
            self.close(wait_s=2)  # ranks that reported leave; the rest are killed
            raise DistributedError(doing, list(failures.values()))
        return [out[r] for r in range(self.world_size)]

    def end_groups(self) -> list[int]:
        """End every process group of the ranks but the default one (a mesh's, `new_group`'s,
        made by earlier calls); returns how many each rank ended. Each idle gloo group keeps
        a thread that wakes every 10 ms (gloo's tcp `Loop::run`: `epoll_wait` with a 10 ms
        timeout): the groups of a few hundred calls on one cluster (81 on each of 4 ranks,
        2026-12-06) took a third of two cores' time from the calls. Safe between calls:
        every rank finished the previous call, so no peer still reads from a group's
        sockets. A call that holds on to a mesh or group for a later call (as `upipe bench`
        does) must not have it ended in between. Ranks that are not running (never
        started, or stopped by a failed call) have none: []."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            return []
        return self.run(_end_groups)

    def run(self, fn, *args, timeout_s: float | None = None) -> list:
        """Run `fn(rank, world_size, *args)` on every rank; returns the results by rank."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self.start()
        for q in self._tasks:
            try:
                q.put((fn, args))
            except Exception as e:  # pickling: nothing was sent (it fails alike for every rank)
                name = getattr(fn, "__qualname__", repr(fn))
                raise TypeError(
                    f"cannot send {name} to the ranks: {type(e).__name__}: {e}; pass a "
                    "module-level function and picklable arguments"
                ) from e
        return self._collect(timeout_s or self.timeout_s, f"running {fn.__name__}")
