"""The command line run as a user runs it, for tests/runs: `upipe ...` in a fresh interpreter,
stopped midway by a signal, and torchrun "nodes" on this machine. Every call has a timeout."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time


def upipe(*args: str, timeout: float = 600, cwd=None) -> subprocess.CompletedProcess:
    """`python -m upipe ARGS` to its end: exit status, stdout and stderr."""
    return subprocess.run(
        [sys.executable, "-m", "upipe", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def _terminal_sigint():
    # as in a terminal: a shell's background job (CI's, say) starts with SIGINT ignored,
    # which the child would inherit, and Python then installs no Ctrl-C handler
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(proc: subprocess.Popen, text: str, timeout: float) -> str:
    """Read `proc`'s stderr until `text` appears (or its end, or `timeout`): what was read."""
    deadline, seen = time.monotonic() + timeout, ""
    while text not in seen and time.monotonic() < deadline:
        char = proc.stderr.read(1)
        if not char:
            break
        seen += char
    return seen


def stop_midway(
    args,
    *,
    after: str,
    sig: str,
    group: bool = False,
    delay: float = 0.0,
    cwd=None,
    timeout: float = 240,
) -> tuple[int, str, str]:
    """Start `upipe ARGS`, wait until its stderr shows `after` (then `delay` seconds), send
    `sig` ("SIGINT",
    "SIGTERM") -- to its whole process group with `group`, as Ctrl-C in a terminal does, else
    to the process alone, as `kill` does -- and wait for its end: (exit status, stdout, all
    of stderr). A command still running 120 s after the signal is aborted (SIGABRT, with
    `PYTHONFAULTHANDLER` set: every thread's Python stack on its stderr) and the test fails
    with that stack (a stop that hangs, once in about 20 full runs on 2026-12-06, not
    reproduced in 15 runs of the test alone: the stack is the evidence to keep)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "upipe", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        start_new_session=True,
        preexec_fn=_terminal_sigint,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    try:
        seen = wait_for(proc, after, timeout)
        assert after in seen, seen[-3000:]
        time.sleep(delay)
        number = getattr(signal, sig)
        os.killpg(proc.pid, number) if group else proc.send_signal(number)
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            # its output is still open: the command runs, or it ended and a process it
            # started holds the pipes; which ones (its session's), before the abort
            session = _session_processes(proc.pid)
            proc.send_signal(signal.SIGABRT)
            try:
                out, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                err = "(nothing more: its pipes stayed open)"
            raise AssertionError(
                f"upipe {' '.join(args)} still ran 120 s after {sig} (exit status "
                f"{proc.poll()}); the processes of its session:\n{session}\nits stacks:\n"
                f"{err[-8000:]}"
            ) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    return proc.returncode, out, seen + err


def _session_processes(sid: int) -> str:
    """`ps` lines (pid, parent, state, age, command) of the processes in session `sid`."""
    try:
        ps = subprocess.run(
            ["ps", "-o", "pid,ppid,stat,etime,args", "-s", str(sid)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:  # (no ps on this machine)
        return f"(ps: {e})"
    return ps.stdout + ps.stderr


def free_port() -> int:
    """A port free now and below the kernel's ephemeral range, which torchrun's first agent
    binds seconds later (once it has imported torch). A port from bind(0) lies in that range,
    where the kernel also picks the local port of every outgoing connection (gloo opens many):
    one could take it meanwhile (upipe.launch.LocalCluster hit EADDRINUSE that way,
    2026-12-07). Below the range only an explicit bind can, and the port is drawn at random
    from thousands."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default; elsewhere the draw below is still a free port
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low} in 200 draws")


class Node:
    """One torchrun "node" on this machine: its process (agent and rank in a session of their
    own, so that `kill` ends both, as a machine that dies) and its output so far, read by
    threads as it comes."""

    def __init__(self, argv: list[str], cwd):
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
            start_new_session=True,
        )  # fmt: skip
        self.out, self.err = [], []
        self._readers = [
            threading.Thread(target=self._drain, args=(stream, into), daemon=True)
            for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for t in self._readers:
            t.start()

    @staticmethod
    def _drain(stream, into: list[str]) -> None:
        for line in iter(stream.readline, ""):
            into.append(line)

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        """The exit status, once the process and its output have ended."""
        code = self.proc.wait(timeout=timeout)
        for t in self._readers:
            t.join(timeout=10)
        return code


def torchrun_nodes(node_args: list[list[str]], *, cwd) -> list[Node]:
    """One torchrun "node" per entry of `node_args`, each of one rank running `-m
    upipe.train` with that entry's options, meeting by c10d rendezvous on 127.0.0.1 (as
    docs/train.md's multi-node section runs two machines). The first node hosts the
    rendezvous store, as the node at the endpoint's address does on real machines (on one
    machine each would try; one that dies would take the others' store with it). The nodes'
    ranks follow their order of arrival at the rendezvous, not their order here."""
    endpoint = f"127.0.0.1:{free_port()}"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(node_args)),
              "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", endpoint]  # fmt: skip
    return [
        Node([*launch, "--rdzv-conf", f"is_host={int(i == 0)}", "-m", "upipe.train", *args], cwd)
        for i, args in enumerate(node_args)
    ]


def wait_until(condition, timeout: float, every: float = 0.2) -> bool:
    """Poll `condition()` until it is true or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(every)
    return bool(condition())


def end_all(nodes: list[Node]) -> None:
    """Kill what is left of `nodes` and reap them."""
    for node in nodes:
        node.kill()
    for node in nodes:
        node.wait(timeout=60)
