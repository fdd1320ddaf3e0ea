"""The commands the documentation shows: every `upipe ...`, `torchrun ...`, `make ...` and
`python benchmarks/...` line in the fenced code blocks of README.md, CONTRIBUTING.md and
docs/*.md, and every `upipe COMMAND ...` in their inline code. Read by
tests/unit/test_documented_options.py (each parsed by the real parsers) and
tests/runs/test_documented_commands.py (each run at a tiny size).

A code block's lines are commands once a trailing backslash joins the next line and `#`
starts a comment (shell rules, `shlex`); a line whose first word is none of those programs
(Python code, a command's printed output such as `upipe U=8 +on ...`) is not a command.
Placeholders written in capitals stand for a value (`PLACEHOLDERS`).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = ("train", "plan", "bench", "demo")  # upipe's
# the values the capitalised placeholders of the docs stand for
PLACEHOLDERS = {
    "N": "1048576",
    "W": "512",
    "MODEL": "llama3-8b",
    "CONFIG": "llama-3.1-8b",
    "NAME": "llama-3.1-8b",
    "NODE0": "127.0.0.1",
    "HEAD_NODE": "127.0.0.1",
}
# where the docs show an old spelling on purpose: the glossary's table of renamed options
OLD_SPELLINGS = ("## Renamed options",)


@dataclasses.dataclass(frozen=True)
class Command:
    where: str
    """file:line of the command's first line."""
    text: str
    """The command as the docs show it (continuation lines joined, comment dropped)."""
    argv: tuple[str, ...]
    """Its words, placeholders substituted."""
    block: int | None
    """Which fenced code block of its file it is in (None: inline code): the commands of one
    block run in order, in one directory (a checkpoint written by one, resumed by the next)."""

    @property
    def program(self) -> str:
        """ "upipe", "torchrun", "make" or "script" (python benchmarks/X.py)."""
        first = self.argv[0]
        if first == "upipe":
            return "upipe"
        if first in ("torchrun", "make"):
            return first
        return "script"


def _words(line: str) -> list[str] | None:
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # (an unbalanced quote: not a command line)
        return None
    return [PLACEHOLDERS.get(w, w) for w in words]


def _is_command(words: list[str]) -> bool:
    if not words:
        return False
    first = words[0]
    if first == "upipe":
        return len(words) > 1 and words[1] in COMMANDS
    if first in ("torchrun", "make"):
        return True
    return first.endswith("python") and len(words) > 1 and words[1].startswith("benchmarks/")


def _blocks(text: str):
    """(first line number, body) of each fenced code block."""
    for m in re.finditer(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        yield text.count("\n", 0, m.start(1)) + 1, m.group(1)


def documented_commands() -> list[Command]:
    found = []
    for path in DOCS:
        text = path.read_text()
        name = path.relative_to(ROOT)
        for b, (first, body) in enumerate(_blocks(text)):
            lines = body.split("\n")
            i = 0
            while i < len(lines):
                start, line = i, lines[i]
                while line.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip()[:-1] + " " + lines[i].strip()
                i += 1
                words = _words(line)
                if words and _is_command(words):
                    shown = shlex.join(shlex.split(line, comments=True))
                    found.append(Command(f"{name}:{first + start}", shown, tuple(words), b))
        prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text,
                       flags=re.S | re.M)  # fmt: skip
        for marker in OLD_SPELLINGS:  # (up to the next section)
            if marker in prose:
                head, tail = prose.split(marker, 1)
                rest = tail.split("\n## ", 1)
                kept = "\n## " + rest[1] if len(rest) > 1 else ""
                prose = head + "\n" * rest[0].count("\n") + kept
        for m in re.finditer(r"`(upipe (?:" + "|".join(COMMANDS) + r")(?: [^`]*)?)`", prose):
            span = m.group(1)
            if span[len("upipe ") :].split(" ")[0].endswith(":") or "..." in span:
                continue  # printed output ("upipe train: error: ..."), or an elided command
            words = _words(span)
            if words:
                line = prose.count("\n", 0, m.start()) + 1
                found.append(Command(f"{name}:{line}", span, tuple(words), None))
    return found
