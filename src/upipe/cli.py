"""Command line: `upipe COMMAND` (demo, train, bench, plan).

Each command lives in its own module, which defines `add_command(subparsers)`: it builds the
command's parser (options derived from a config dataclass, see `upipe.options`) and sets
`handler(ns, parser) -> int` as its default. A bad option ends in `parser.error(...)`: a
one-line message and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# modules defining `add_command(subparsers)`, in the order `upipe --help` lists them
COMMANDS = ("upipe.train", "upipe.demo", "upipe.bench", "upipe.planner.plan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="upipe",
        description="Memory-efficient context parallelism (UPipe: headwise-chunked Ulysses).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).add_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return 0
    return ns.handler(ns, sub_parser(parser, ns.command)) or 0


def sub_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of `command`, so its errors print its own usage line."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


if __name__ == "__main__":
    sys.exit(main())
