"""The command line: help, the demo at a small size, clear errors for bad options, and
Ctrl-C / SIGTERM in every command."""

import json
import re

import pytest
from commands import stop_midway
from commands import upipe as _upipe


@pytest.mark.slow
def test_help():
    res = _upipe("--help")
    assert res.returncode == 0 and "demo" in res.stdout


@pytest.mark.slow
def test_demo_small(tmp_path):
    out = tmp_path / "demo.json"
    res = _upipe(
        "demo",
        "--nproc",
        "2",
        "--seq-lens",
        "256",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--json",
        str(out),
    )
    assert res.returncode == 0, res.stderr
    assert "peak MiB" in res.stdout
    doc = json.loads(out.read_text())
    assert [row["method"] for row in doc["results"]] == ["ulysses", "upipe(U=2)", "ring"]
    for row in doc["results"]:
        assert row["method"] in res.stdout and len(row["peak_bytes_per_rank"]) == 2
        assert all(p > 0 for p in row["peak_bytes_per_rank"])
        assert max(row["rel_err"].values()) < 1e-5


@pytest.mark.slow
def test_bad_option_is_a_message_not_a_traceback():
    res = _upipe("demo", "--nproc", "4", "--seq-lens", "1001")
    assert res.returncode == 2
    assert "--seq-lens [1001] must be multiples of 2 * nproc = 8; try [1008]" in res.stderr
    assert "Traceback" not in res.stderr


def test_train_help_groups_every_option_once():
    import dataclasses

    from upipe.cli.train import OPTION_GROUPS
    from upipe.train.config import TrainConfig

    grouped = [name for names in OPTION_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(f.name for f in dataclasses.fields(TrainConfig))
    res = _upipe("train", "--help")
    assert res.returncode == 0
    positions = [res.stdout.index(f"\n{title}:") for title in OPTION_GROUPS]
    assert positions == sorted(positions)
    memory = res.stdout[positions[4] : positions[5]]  # the "memory features" section
    assert "--activation-checkpoint" in memory and "--lr" not in memory


def test_each_default_is_said_once_and_errors_are_two_lines(capsys):
    """Every option of every command names its default at most once (the docstring's own
    words or the appended one, none for an empty default); a bad option prints one usage
    line and the message, not the usage of every option."""
    import re

    import pytest

    from upipe.cli import COMMANDS, build_parser, main

    parser = build_parser()
    sub = next(a for a in parser._actions if hasattr(a, "choices") and a.choices)
    for name in (c.__name__.rsplit(".", 1)[1] for c in COMMANDS):
        for action in sub.choices[name]._actions:
            said = len(re.findall("default", action.help or "", flags=re.IGNORECASE))
            assert said <= 1, (name, action.option_strings, action.help)
            assert "(default: )" not in (action.help or "")
    with pytest.raises(SystemExit):
        main(["train", "--steps", "-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "usage: upipe train [options]  (upipe train --help lists them)",
        "upipe train: error: --steps must be >= 1, got -1",
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,after,delay,sig,code,said",
    [
        (["demo", "--nproc", "2", "--seq-lens", "16384"], "set up", 0, "SIGINT", 130,
         r"upipe demo: stopped by Ctrl-C \(SIGINT\)"),
        pytest.param(
            ["bench", "--nproc", "2", "--seq-lens", "16384", "--methods", "ulysses", "upipe",
             "--json", "", "--plot", ""], "set up", 0, "SIGTERM", 143,
            "upipe bench: stopped by SIGTERM",
            marks=pytest.mark.exhaustive,  # (by default: SIGTERM to upipe train, test_train.py)
        ),
        (["plan", "--device", "cpu", "--model", "tiny", "--gpus", "2", "--strategies", "ulysses",
          "upipe", "--features", "off", "--json", "p.json"], "/3", 3, "SIGINT", 130,
         r"upipe plan: stopped by Ctrl-C \(SIGINT\) after \d+ candidates?; partial results: "
         "p.json"),
    ],
)  # fmt: skip
def test_a_stopped_command_says_so_and_leaks_nothing(tmp_path, args, after, delay, sig, code, said):
    """Ctrl-C (to the whole process group, as a terminal sends it: the spawned ranks and the
    planner's workers ignore it, their parent stops them) or SIGTERM while the command works
    (the demo and the bench once their ranks are set up, the plan 3 s into its candidates):
    one line (`said`, a pattern), exit 128 + the signal, no traceback, no leaked-semaphore
    warning."""
    group = sig == "SIGINT"
    got, _, err = stop_midway(args, after=after, sig=sig, group=group, delay=delay, cwd=tmp_path)
    assert got == code, err[-2000:]
    assert any(re.fullmatch(said, line) for line in err.splitlines()), err[-2000:]
    assert "Traceback" not in err and "leaked" not in err, err[-2000:]
