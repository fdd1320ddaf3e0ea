"""Where a training run writes: every output path checked before the first step, and the
metrics file.

`check_outputs(cfg)`: --metrics-file, --plot, --checkpoint-dir, --tensorboard and --save-hf
can be written, so a bad path stops the run at its start, not after step 1 (metrics), at
the first checkpoint or after the last step (plot). The directory (a file's parent) is
created if missing and a temporary file is created in it and removed; an existing output
file must be a writable file.

The metrics file has one JSON line per step, strict JSON (`allow_nan=False`: no NaN or inf
ever reaches it). A run first rewrites it to the steps it keeps: none for a fresh run, those
up to the checkpoint a resumed run starts from, so no step is listed twice. A last line torn
by a killed run (unterminated, not JSON) is dropped with a note; any other bad line is a
ValueError naming the file and line.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def _unwritable(path: Path, *, directory: bool) -> str | None:
    """Why `path` (a file, or with `directory` a directory) cannot be written, or None."""
    folder = path if directory else path.parent
    try:
        if not directory and path.is_dir():
            return "is a directory"
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        if not existing.is_dir():
            return f"{existing} is a file, not a directory"
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
        if not directory and path.exists() and not os.access(path, os.W_OK):
            return "is not writable"
    except OSError as e:
        return f"cannot be written there ({e.strerror or e})"
    return None


def check_outputs(cfg) -> str | None:
    """The first output path of `cfg` (a `TrainConfig`) that cannot be written, as a message
    naming the option and the path, or None."""
    outputs = (
        ("--metrics-file", cfg.metrics_file, False),
        ("--plot", cfg.plot, False),
        ("--checkpoint-dir", cfg.checkpoint_dir, True),
        ("--tensorboard", cfg.tensorboard, True),
        ("--save-hf", cfg.save_hf, True),
    )
    for flag, path, directory in outputs:
        problem = path and _unwritable(Path(path), directory=directory)
        if problem:
            return f"{flag} {path}: {problem}; choose a writable path"
    return None


def json_line(row: dict) -> str:
    """One metrics row as a JSON line (ValueError on NaN or inf: strict JSON)."""
    return json.dumps(row, allow_nan=False) + "\n"


def read_metrics(path: str | Path) -> tuple[list[dict], str | None]:
    """The rows of the metrics file `path` (none if it does not exist), and a note if its
    last line was torn (unterminated and not JSON: dropped). Any other line that is not a
    JSON object with an integer "step" is a ValueError naming the file and line."""
    path = Path(path)
    if not path.exists():
        return [], None
    lines = path.read_bytes().split(b"\n")
    rows, note = [], None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError('not an object with an integer "step"')
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError included
            if n == len(lines):  # no newline after it: the write was cut short
                note = f"{path}:{n}: dropped a torn last line ({len(line)} bytes)"
                continue
            raise ValueError(
                f"metrics file {path}:{n}: not a metrics line ({e}); fix or delete the line, "
                "or move the file away"
            ) from None
        rows.append(row)
    return rows, note


def write_metrics(path: str | Path, rows: list[dict]) -> None:
    """Replace the metrics file with `rows`, atomically (a temporary file renamed over it)."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text("".join(json_line(r) for r in rows))
    os.replace(partial, path)


def append_metrics(path: str | Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json_line(row))
