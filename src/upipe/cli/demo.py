"""`upipe demo`: upipe's strategies on spawned CPU ranks, checked against float64 on one
process: `upipe bench` (`upipe.bench.run_bench`) with `upipe.bench.DemoConfig`'s defaults."""

from __future__ import annotations

from upipe.bench import DemoConfig, run_bench, validate
from upipe.cli.options import add_dataclass_options, config_from_args


def add_command(sub) -> None:
    """`upipe demo` (see `upipe.cli`)."""
    parser = sub.add_parser(
        "demo",
        help="run context-parallel attention on spawned CPU ranks and check it",
        description=(
            "Spawn N gloo ranks on this machine, run each of upipe's strategies forward+"
            "backward on a long random sequence, and compare with float64 attention on one "
            "process. Prints errors, time and per-rank peak memory. The same run as "
            "`upipe bench`, with fewer methods, one length and one round by default."
        ),
    )
    add_dataclass_options(parser, DemoConfig, skip=("device",))
    parser.set_defaults(handler=_handle)


def _handle(ns, parser) -> int:
    cfg = config_from_args(DemoConfig, ns)
    problem = validate(cfg, cfg.nproc)
    if problem:
        parser.error(problem)
    run_bench(cfg)
    return 0
