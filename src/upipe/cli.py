"""Command line: `upipe demo` (more subcommands come with the training stack and planner).

Options are derived from the config dataclasses' fields and docstrings, so the dataclass is
the one source of truth for names, defaults and help.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys

from upipe.demo import DemoConfig, run_demo


def _field_docs(cls) -> dict[str, str]:
    """Docstrings written under dataclass fields (`x: int = 1` then `\"\"\"doc\"\"\"`)."""
    docs, tree = {}, ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = nxt.value.value
    return docs


def add_dataclass_options(parser: argparse.ArgumentParser, cls) -> None:
    """One option per field: `--seq-len N`, `--causal/--no-causal`, `--strategies a b`."""
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_ = f"{docs.get(f.name, '')} (default: {f.default})"
        if f.type in ("bool", bool):
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=docs.get(f.name),
            )
        elif str(f.type).startswith("tuple"):
            parser.add_argument(flag, nargs="+", default=list(f.default), help=help_)
        else:
            parser.add_argument(flag, type=int, default=f.default, help=help_)


def _config(cls, ns):
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def _validate_demo(cfg: DemoConfig) -> str | None:
    from upipe.attention import STRATEGIES

    if cfg.nproc < 1:
        return f"--nproc must be >= 1, got {cfg.nproc}"
    if cfg.seq_len % cfg.nproc:
        return (
            f"--seq-len {cfg.seq_len} must be divisible by --nproc {cfg.nproc}; "
            f"try {cfg.seq_len + (-cfg.seq_len) % cfg.nproc}"
        )
    if cfg.heads % cfg.nproc or cfg.kv_heads % cfg.nproc:
        return (
            f"--heads ({cfg.heads}) and --kv-heads ({cfg.kv_heads}) must be divisible by "
            f"--nproc ({cfg.nproc})"
        )
    if cfg.heads % cfg.kv_heads:
        return f"--kv-heads ({cfg.kv_heads}) must divide --heads ({cfg.heads})"
    unknown = [s for s in cfg.strategies if s not in STRATEGIES]
    if unknown:
        return f"unknown strategies {unknown}; choose from {sorted(STRATEGIES)}"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="upipe",
        description="Memory-efficient context parallelism (UPipe: headwise-chunked Ulysses).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="run context-parallel attention on spawned CPU ranks and check it",
        description=(
            "Spawn N gloo ranks on this machine, run each strategy's forward+backward on a "
            "long random sequence, and compare with float64 attention on one process. Prints "
            "errors, time and per-rank peak memory."
        ),
    )
    add_dataclass_options(demo, DemoConfig)
    demo.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return 0
    if ns.command == "demo":
        cfg = _config(DemoConfig, ns)
        problem = _validate_demo(cfg)
        if problem:
            parser.error(problem)
        run_demo(cfg, json_path=ns.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
