"""Every command in the docs' code blocks runs as documented, shrunk to a tiny size: it exits
with status 0. The commands of one code block run in order in one directory (a checkpoint
written by one is resumed by the next). Their arguments are also parsed, without running,
by tests/unit/test_documented_options.py, which is where a renamed option shows first.

Shrinking (`shrink`): each option of `TINY` that a command names takes its tiny value, and
the command gets those of `ADDED` it does not name -- sizes only (tokens, steps, ranks,
heads, model, memory budget, candidates searched), never what the command does. A command
that cannot run here even so is in `SKIPPED`, matched by a piece of its text, with the
reason; `test_the_skip_list_is_current` keeps that list free of stale entries.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from documented import ROOT, documented_commands

from upipe.cli import main

# option -> its tiny value, for every command that names it (a list: all its values)
TINY = {
    "train": {"--seq-len": "256", "--steps": "2", "--nproc": "2", "--checkpoint-every": "1",
              "--eval-every": "1", "--model": "tiny"},
    "plan": {"--model": "tiny", "--gpus": "2", "--gpu-memory-gib": "0.02", "--seq-len": "256"},
    "bench": {"--nproc": "2", "--seq-lens": ["256"], "--head-dim": "8", "--repeats": "1",
              "--vocab-size": "256", "--mlp-size": "64", "--mlp-tile": "64",
              "--loss-chunk": "64", "--layers": "1"},
    "benchmarks/bench_train.py": {"--seq-len": "256", "--steps": "2", "--nproc": "2"},
}  # fmt: skip
TINY["demo"] = TINY["bench"]
# options added where the command does not name them: its defaults' sizes, shrunk
ADDED = {
    "train": {"--seq-len": "256", "--steps": "2", "--nproc": "2"},
    # one candidate (the first strategy and feature set named, else upipe without features),
    # a search bounded at 2,048 tokens, no reserve out of a 0.02 GiB budget
    "plan": {"--model": "tiny", "--gpus": "2", "--gpu-memory-gib": "0.02", "--reserve-gib": "0",
             "--granularity": "1024", "--max-seq-len": "2048", "--strategies": "upipe",
             "--features": "off"},
    "bench": {"--nproc": "2", "--seq-lens": "256", "--repeats": "1", "--warmup-rounds": "0",
              "--head-dim": "8"},
    "benchmarks/bench_train.py": {"--seq-len": "256", "--steps": "2", "--nproc": "2"},
}  # fmt: skip
ADDED["demo"] = ADDED["bench"]
KEEP_FIRST = {"plan": ("--strategies", "--features")}  # lists cut to their first entry

# a pattern found in a command's text (`re.search`) -> why it does not run here
SKIPPED = {
    r"^make train$": "make installs .venv first (pip: a download); the `upipe train` it runs, "
    "with the same defaults, runs here as README's first upipe command",
    r"^make test(-exhaustive)?$": "the whole suite",
    r"--tokenizer tok/ --data docs\.jsonl": "needs a local tokenizer directory and a data file "
    "(docs/data.md)",
    r"--init-from-hf \./Qwen3-0\.6B": "needs a Hugging Face model directory (a download)",
    r"--device cuda": "a GPU",
    r" train(_1m)?\.py$": "a user's own script on 8 GPUs (docs/hf.md)",
    r"--hf-config": "simulates the Hugging Face model of a shipped config (billions of "
    "parameters, not shrinkable): minutes per candidate",
    r"--model qwen3-30b-a3b": "plans a 30B mixture-of-experts model (not shrinkable): minutes",
    r"bench_train\.py( --seq-len 16384 --steps 10 --plot docs/train_16k\.png)?$": "8 training "
    "runs (3 strategies, 5 feature sets): over 20 s at any size",
}


# the README's commands that run in the exhaustive tier (with those of docs/), and why
EXHAUSTIVE = {
    r"^upipe bench$": "every method and every installed peer (the longest README command; "
    "tests/distributed/test_bench.py runs the bench by default)",
}


def _reason(table: dict[str, str], text: str) -> str | None:
    """The reason of the first pattern of `table` (`SKIPPED`, `EXHAUSTIVE`) found in `text`."""
    return next((why for pattern, why in table.items() if re.search(pattern, text)), None)


RUN = [c for c in documented_commands() if c.block is not None]


def shrink(argv: tuple[str, ...]) -> list[str]:
    """The command's words with `TINY`'s values (a --resume: one step more than the run it
    resumes), `ADDED`'s options and `KEEP_FIRST`'s lists."""
    if argv[0] == "upipe":
        head, command, words = ["upipe", argv[1]], argv[1], list(argv[2:])
    else:  # python benchmarks/X.py ...
        head, command, words = [sys.executable, str(ROOT / argv[1])], argv[1], list(argv[2:])
    tiny, out, i = dict(TINY.get(command, {})), [], 0
    if "--resume" in words:  # one step more than the run it resumes
        tiny["--steps"] = str(int(tiny["--steps"]) + 1)
    named = set()
    while i < len(words):
        word = words[i]
        out.append(word)
        i += 1
        values = []
        while i < len(words) and not words[i].startswith("--"):
            values.append(words[i])
            i += 1
        named.add(word)
        if word in tiny:
            value = tiny[word]
            if word == "--model" and values and values[0].startswith("tiny"):
                value = values[0]  # a tiny preset of its own (tiny-qwen3, tiny-moe)
            values = value if isinstance(value, list) else [value]
        elif word in KEEP_FIRST.get(command, ()):
            values = values[:1]
        out += values
    for option, value in ADDED.get(command, {}).items():
        if option not in named:
            out += [option, value]
    return head + out


def test_the_skip_list_is_current():
    for pattern in (*SKIPPED, *EXHAUSTIVE):
        assert any(re.search(pattern, c.text) for c in RUN), pattern


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    """One working directory per code block (with a docs/ for outputs written there)."""
    made = {}

    def get(command):
        key = (command.where.split(":")[0], command.block)
        if key not in made:
            made[key] = tmp_path_factory.mktemp("block")
            (made[key] / "docs").mkdir()
        return made[key]

    return get


# the commands of one code block on one xdist worker, in their order (a block's checkpoint
# written by one command is resumed by the next, in the block's directory of that worker);
# the README's in the default run (but `EXHAUSTIVE`'s), those of docs/ in the exhaustive tier
BLOCKS = [
    pytest.param(
        c,
        marks=[pytest.mark.xdist_group(f"{c.where.split(':')[0]}#{c.block}")]
        + (
            [pytest.mark.exhaustive]
            if not c.where.startswith("README.md:") or _reason(EXHAUSTIVE, c.text)
            else []
        ),
    )
    for c in RUN
]


@pytest.mark.parametrize("command", BLOCKS, ids=[c.where for c in RUN])
def test_documented_command_runs(command, directories, monkeypatch, capfd):
    why = _reason(SKIPPED, command.text)
    if why:
        pytest.skip(why)
    argv = shrink(command.argv)
    cwd = directories(command)
    if argv[0] != "upipe":  # a benchmark script, in a process of its own
        res = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=cwd)
        assert res.returncode == 0, (argv, res.stderr[-3000:])
        return
    monkeypatch.chdir(cwd)
    try:
        code = main(argv[1:])
    except SystemExit as e:  # (argparse's errors)
        code = e.code
    err = capfd.readouterr().err
    assert code == 0, (command.where, argv, err[-3000:])
