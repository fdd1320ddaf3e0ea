"""Command-line options derived from keyword-only config dataclasses.

One option per field, named after it (`seq_len` -> `--seq-len`), typed by its annotation,
with the docstring written under the field as help: the dataclass is the one source of truth
for names, defaults and help. `field(metadata={"choices": [...]})` restricts a value.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect

_SCALARS = {"int": int, "float": float, "str": str}


def _field_docs(cls) -> dict[str, str]:
    """Docstrings written under dataclass fields (`x: int = 1` then `\"\"\"doc\"\"\"`)."""
    docs = {}
    for klass in reversed(cls.__mro__[:-1]):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _scalar(annotation: str):
    """`int`, `float | None`, `str` ... -> the converter; None for anything else."""
    parts = [p.strip() for p in str(annotation).split("|") if p.strip() != "None"]
    return _SCALARS.get(parts[0]) if len(parts) == 1 else None


def add_dataclass_options(parser: argparse.ArgumentParser, cls, *, skip=(), groups=None) -> None:
    """One option per field: `--seq-len N`, `--causal/--no-causal`, `--strategies a b`.
    `groups`: {title: field names} -- `--help` lists the options under those titles, in that
    order (a field in no group: under the parser's own "options")."""
    docs = _field_docs(cls)
    where = {}
    for title, names in (groups or {}).items():
        group = parser.add_argument_group(title)
        where.update(dict.fromkeys(names, group))
    unknown = set(where) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"option groups name fields {cls.__name__} lacks: {sorted(unknown)}")
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        add = where.get(f.name, parser).add_argument
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        doc = docs.get(f.name, "")
        # the default said once: by the docstring where it says it, else appended (none for
        # an empty or None default, which the docstring explains or which means "off")
        said = "default" in doc.lower() or default in (None, "", (), [])
        shown = " ".join(map(str, default)) if isinstance(default, tuple | list) else default
        doc = doc if said else f"{doc} (default: {shown})"
        choices = f.metadata.get("choices")
        if str(f.type) in ("bool", "<class 'bool'>", "bool | None"):  # None: the default decides
            add(flag, action=argparse.BooleanOptionalAction, default=default, help=doc)
        elif str(f.type).startswith("tuple"):
            inner = _scalar(str(f.type)[len("tuple[") :].split(",")[0]) or str
            add(
                flag,
                nargs="+",
                type=inner,
                default=list(default),
                choices=choices,
                help=doc,
            )
        else:
            convert = _scalar(f.type)
            if convert is None:
                raise TypeError(f"{cls.__name__}.{f.name}: no option type for {f.type!r}")
            add(
                flag,
                type=convert,
                default=default,
                choices=choices,
                metavar=None if choices else f.name.upper(),
                help=doc,
            )


def config_from_args(cls, ns: argparse.Namespace, **overrides):
    """Build `cls` from parsed options (lists become tuples); `overrides` win."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**{**values, **overrides})
