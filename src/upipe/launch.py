"""A local gloo cluster: N spawned CPU ranks on 127.0.0.1 that run functions on request.

Used by the CLI's CPU demos and by the tests. It never hangs: the process group has a
timeout, every call has a wall-clock limit, and a rank that raises fails the call with its
traceback (the cluster is then restarted, since its peers may be stuck in a collective).

    with LocalCluster(4) as cluster:
        results = cluster.run(fn, arg1, arg2)   # fn(rank, world_size, arg1, arg2) on each rank

`fn` must be importable by name (a module-level function) and its arguments and results
picklable; it runs with the default process group initialised (gloo, `world_size` ranks)
and one intra-op thread per rank unless `threads` says otherwise.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback


class DistributedError(RuntimeError):
    """A rank of a `LocalCluster` raised, or the call ran past its time limit."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, pg_timeout_s, threads, tasks, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
    except Exception:
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


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
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.pg_timeout_s = pg_timeout_s
        self.threads = threads
        self.env = env or {}
        self._procs: list = []

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
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
                        self.pg_timeout_s,
                        self.threads,
                        self._tasks[r],
                        self._results,
                    ),
                    daemon=True,
                )
                for r in range(self.world_size)
            ]
            for p in self._procs:
                p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self._collect(self.timeout_s, "starting the ranks")

    def close(self) -> None:
        for q in getattr(self, "_tasks", []):
            with contextlib.suppress(OSError, ValueError):
                q.put(None)
        deadline = time.monotonic() + 10
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []

    def _collect(self, timeout_s: float, what: str) -> list:
        out: dict[int, object] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(out) + len(failures) < self.world_size:
            # once a rank failed, its peers get a short grace period to report, then go
            limit = deadline if not failures else min(deadline, time.monotonic() + 5)
            try:
                rank, ok, value = self._results.get(timeout=max(0.01, limit - time.monotonic()))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if time.monotonic() < limit and not dead:
                    continue
                self.close()
                missing = sorted(set(range(self.world_size)) - set(out) - set(failures))
                msg = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
                raise DistributedError(
                    f"{what}: ranks {missing} did not answer within {timeout_s:.0f} s"
                    + (f" (dead: {dead})" if dead else "")
                    + msg
                ) from None
            (out if ok else failures)[rank] = value
        if failures:
            self.close()
            msg = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise DistributedError(f"{what}: {len(failures)} rank(s) raised:{msg}")
        return [out[r] for r in range(self.world_size)]

    def run(self, fn, *args, timeout_s: float | None = None) -> list:
        """Run `fn(rank, world_size, *args)` on every rank; returns the results by rank."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self.start()
        for q in self._tasks:
            q.put((fn, args))
        return self._collect(timeout_s or self.timeout_s, f"running {fn.__name__}")
