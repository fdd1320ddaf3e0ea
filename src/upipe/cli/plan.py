"""`upipe plan`: the planner's search with a progress bar, a table, JSON and a plot (the
search itself is `upipe.planner.plan.plan`)."""

from __future__ import annotations

import importlib.util
import json

from tqdm import tqdm

from upipe.cli.options import add_dataclass_options, config_from_args
from upipe.planner import plan as planner


def add_command(sub) -> None:
    """`upipe plan` (see `upipe.cli`)."""
    parser = sub.add_parser(
        "plan",
        help="longest trainable context per strategy on given GPUs (simulated, no GPU needed)",
        description=planner.__doc__.split("\n\n")[0],
    )
    add_dataclass_options(parser, planner.PlanConfig)
    parser.set_defaults(handler=_handle)


def _handle(ns, parser) -> int:
    pc = config_from_args(planner.PlanConfig, ns)
    if pc.gpus < 1 or pc.granularity < 1 or pc.gpu_memory_gib <= 0:
        parser.error("--gpus, --granularity and --gpu-memory-gib must be positive")
    if pc.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'upipe[train]' (or matplotlib)")
    bar = tqdm(desc="plan", unit="step" if pc.jobs == 1 else "candidate")

    def progress(label, S, peak):
        bar.set_postfix_str(f"{label} S={S} peak={peak / planner.GiB:.1f}GiB")
        bar.update()

    try:
        res = planner.plan(pc, progress)
    except ValueError as e:
        bar.close()
        parser.error(str(e))
    bar.close()
    print(planner.table(res))
    if pc.json:
        with open(pc.json, "w") as f:
            json.dump(res, f, indent=1)
    if pc.plot:
        planner.plot(res, pc.plot)
    return 0
