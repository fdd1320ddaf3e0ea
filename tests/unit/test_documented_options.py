"""Every command the docs show parses with the real parsers, in this process: an option that
was renamed or removed (argparse's exit status 2) fails here, with the file and line. A
command in a code block is parsed whole; one in inline code often names an option without
its value (`upipe bench --baseline`), so there each option named must exist. The commands
themselves run, shrunk, in tests/runs/test_documented_commands.py."""

from __future__ import annotations

import functools
import importlib.util
import re

import pytest
from documented import ROOT, documented_commands
from torch.distributed.run import get_args_parser

from upipe.cli import build_parser, sub_parser

COMMANDS = documented_commands()
upipe_parser = functools.cache(build_parser)  # (parsing leaves a parser as it was)


def _make_targets() -> tuple[set[str], set[str]]:
    """The Makefile's targets and the variables it reads (`NAME ?= ...`)."""
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z][\w.-]*):(?!=)", text, flags=re.M))
    return targets, set(re.findall(r"^([A-Z_]+) \?=", text, flags=re.M))


@functools.cache
def _script_parser(path: str):
    """benchmarks/X.py's `build_parser()` (imported, not run)."""
    spec = importlib.util.spec_from_file_location(f"documented_{path}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert hasattr(module, "build_parser"), (
        f"{path} is run by a documented command: give it build_parser() (its argparse "
        "parser) so that the command can be checked"
    )
    return module.build_parser()


def parse(argv: tuple[str, ...]) -> None:
    """Parse a documented command's arguments as the program it names would (SystemExit 2
    for an unknown option)."""
    if argv[0] == "upipe":
        upipe_parser().parse_args(list(argv[1:]))
    elif argv[0] == "make":
        targets, variables = _make_targets()
        for word in argv[1:]:
            name = word.split("=", 1)[0]
            assert (name in variables) if "=" in word else (word in targets), word
    elif argv[0] == "torchrun":
        ns = get_args_parser().parse_args(list(argv[1:]))
        args = list(ns.training_script_args)
        if ns.module and ns.training_script in ("upipe.train", "upipe"):
            upipe = ns.training_script == "upipe.train"
            upipe_parser().parse_args(["train", *args] if upipe else args)
        elif ns.training_script.startswith("benchmarks/"):
            _script_parser(ns.training_script).parse_args(args)
        # else: a user's own script (docs/hf.md's train.py), not ours to parse
    else:  # python benchmarks/X.py ...
        _script_parser(argv[1]).parse_args(list(argv[2:]))


def test_the_docs_show_commands_of_every_kind():
    kinds = {c.program for c in COMMANDS}
    assert kinds == {"upipe", "torchrun", "make", "script"}, kinds
    assert len(COMMANDS) > 60, len(COMMANDS)


def options_exist(argv: tuple[str, ...]) -> list[str]:
    """The options of `upipe COMMAND ...` that its parser does not have."""
    parser = sub_parser(upipe_parser(), argv[1])
    known = parser._option_string_actions  # every spelling: --x, --no-x, -h
    return [w for w in argv[2:] if w.startswith("-") and w.split("=")[0] not in known]


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_every_documented_command_parses(command):
    if command.block is None:
        unknown = options_exist(command.argv)
        assert not unknown, f"{command.where}: `{command.text}`: no option {unknown}"
        return
    try:
        parse(command.argv)
    except SystemExit as e:
        if e.code != 0:  # (0: --help)
            pytest.fail(f"{command.where}: `{command.text}` does not parse (exit {e.code})")


def test_a_removed_option_fails_the_check():
    with pytest.raises(SystemExit) as e:
        parse(("upipe", "bench", "--model", "--hybrid"))  # (now --whole-model)
    assert e.value.code == 2
    assert options_exist(("upipe", "bench", "--model", "--hybrid")) == ["--model"]
