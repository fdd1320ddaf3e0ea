"""`upipe bench`: upipe against the peers on identical inputs (the measurement is
`upipe.bench.run_bench`); on CPU it spawns the ranks, under torchrun it uses them."""

from __future__ import annotations

import os

import upipe.bench
from upipe.bench import BenchConfig, run_bench, validate
from upipe.cli.options import add_dataclass_options, config_from_args


def add_command(sub) -> None:
    """`upipe bench` (see `upipe.cli`)."""
    parser = sub.add_parser(
        "bench",
        help="benchmark upipe against DeepSpeed-Ulysses, yunchang, torch context_parallel",
        description=upipe.bench.__doc__.split("\n\n")[0]
        + " See `upipe.bench` for what is measured.",
    )
    add_dataclass_options(parser, BenchConfig)
    parser.set_defaults(handler=_handle)


def _handle(ns, parser) -> int:
    cfg = config_from_args(BenchConfig, ns)
    nproc = cfg.nproc if cfg.device == "cpu" else int(os.environ.get("WORLD_SIZE", "1"))
    problem = validate(cfg, nproc)
    if problem:
        parser.error(problem)
    if cfg.device == "cuda" and "RANK" not in os.environ:
        parser.error(
            "--device cuda runs under torchrun: torchrun --nproc-per-node N -m upipe bench"
        )
    run_bench(cfg)
    return 0
