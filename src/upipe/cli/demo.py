"""`upipe demo`: each strategy on spawned CPU ranks, checked against float64 on one process
(the run itself is `upipe.demo.run_demo`)."""

from __future__ import annotations

from upipe.cli.options import add_dataclass_options, config_from_args
from upipe.demo import DemoConfig, run_demo, validate


def add_command(sub) -> None:
    """`upipe demo` (see `upipe.cli`)."""
    parser = sub.add_parser(
        "demo",
        help="run context-parallel attention on spawned CPU ranks and check it",
        description=(
            "Spawn N gloo ranks on this machine, run each strategy's forward+backward on a "
            "long random sequence, and compare with float64 attention on one process. Prints "
            "errors, time and per-rank peak memory."
        ),
    )
    add_dataclass_options(parser, DemoConfig)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.set_defaults(handler=_handle)


def _handle(ns, parser) -> int:
    cfg = config_from_args(DemoConfig, ns)
    problem = validate(cfg)
    if problem:
        parser.error(problem)
    run_demo(cfg, json_path=ns.json)
    return 0
