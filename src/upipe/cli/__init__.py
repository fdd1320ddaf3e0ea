"""Command line: `upipe COMMAND` (train, demo, bench, plan); every command lives here.

The library packages (`upipe.train`, `upipe.bench`, `upipe.planner`) hold no
parser, read no environment variable and launch nothing: each command module here defines
`add_command(subparsers)`, which builds the command's parser (options derived from the
library's config dataclass, see `upipe.cli.options`) and sets `handler(ns, parser) -> int`
as its default; the handler validates, launches and calls the library. A bad option ends in
`parser.error(...)`: a one-line message and exit status 2, never a traceback. Ctrl-C and
SIGTERM end every command with one line and exit status 130 / 143 (`upipe.cli.stops`).
"""

from __future__ import annotations

import argparse

from upipe.cli import bench, demo, plan, stops, train

COMMANDS = (train, demo, bench, plan)  # in the order `upipe --help` lists them


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="upipe",
        description="Memory-efficient context parallelism (UPipe: headwise-chunked Ulysses).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_command(sub)
    for name, command_parser in sub.choices.items():
        # a bad option prints this line and the message, not the ~40-line usage of every option
        command_parser.usage = f"upipe {name} [options]  (upipe {name} --help lists them)"
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return 0
    return stops.stoppable(ns.command, ns.handler, ns, sub_parser(parser, ns.command))


def sub_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of `command`, so its errors print its own usage line."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]
