"""`upipe.cli.stops`: Ctrl-C and SIGTERM end every command with one line and 130 / 143."""

from __future__ import annotations

import os
import signal

import pytest

import upipe.cli.bench
import upipe.cli.demo
from upipe.cli import main
from upipe.cli.stops import Terminated, sigterm_raises, stoppable

STOPS = [(KeyboardInterrupt, 130, "Ctrl-C (SIGINT)"), (Terminated, 143, "SIGTERM")]


def test_sigterm_raises_inside_the_block_only():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated), sigterm_raises():
        os.kill(os.getpid(), signal.SIGTERM)  # (the handler runs before the next line)
        pytest.fail("SIGTERM did not raise")
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("error,code,by", STOPS)
def test_stoppable_says_one_line(capsys, error, code, by):
    def handler():
        raise error

    assert stoppable("demo", handler) == code
    assert capsys.readouterr().err == f"\nupipe demo: stopped by {by}\n"


@pytest.mark.parametrize("command", ["bench", "demo"])
@pytest.mark.parametrize("error,code,by", STOPS)
def test_bench_and_demo_are_stoppable(monkeypatch, capsys, command, error, code, by):
    def run_bench(cfg):
        raise error

    monkeypatch.setattr(getattr(upipe.cli, command), "run_bench", run_bench)
    assert main([command, "--nproc", "2", "--seq-lens", "64"]) == code
    assert capsys.readouterr().err == f"\nupipe {command}: stopped by {by}\n"
