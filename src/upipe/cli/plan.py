"""`upipe plan`: the planner's search with a progress bar, a table, JSON and a plot (the
search itself is `upipe.planner.plan.plan`); with --recommend, the fastest configuration
that fits at --seq-len and its torchrun command (`upipe.planner.recommend`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

from tqdm import tqdm

from upipe.cli.options import add_dataclass_options, config_from_args
from upipe.planner import plan as planner
from upipe.planner import recommend as recommender


def add_command(sub) -> None:
    """`upipe plan` (see `upipe.cli`)."""
    parser = sub.add_parser(
        "plan",
        help="longest trainable context per strategy on given GPUs (simulated, no GPU needed)",
        description=planner.__doc__.split("\n\n")[0],
    )
    add_dataclass_options(parser, planner.PlanConfig)
    add_dataclass_options(parser.add_argument_group("recommend"), recommender.RecommendConfig)
    parser.set_defaults(handler=_handle)


def _handle(ns, parser) -> int:
    pc = config_from_args(planner.PlanConfig, ns)
    rc = config_from_args(recommender.RecommendConfig, ns)
    if rc.recommend or rc.seq_len is not None or rc.rates_from is not None:
        return _recommend(pc, rc, parser)
    if pc.gpus < 1 or pc.granularity < 1 or pc.gpu_memory_gib <= 0:
        parser.error("--gpus, --granularity and --gpu-memory-gib must be positive")
    if pc.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'upipe[train]' (or matplotlib)")
    bar = tqdm(desc="plan", unit="step" if pc.jobs == 1 else "candidate")

    def progress(label, S, peak):
        bar.set_postfix_str(f"{label} S={S} peak={peak / planner.GiB:.1f}GiB")
        bar.update()

    res = _run(bar, parser, lambda: planner.plan(pc, progress), planner.table, pc.json)
    if pc.plot:
        planner.plot(res, pc.plot)
    return 0


def _recommend(pc, rc, parser) -> int:
    if not rc.recommend:
        what = "--seq-len is the length" if rc.seq_len is not None else "--rates-from times what"
        parser.error(f"{what} --recommend plans for: add --recommend")
    if pc.plot:
        parser.error("--plot draws the longest-context search: leave it out with --recommend")
    if pc.features == planner.PlanConfig().features:  # not given: the grid
        pc = dataclasses.replace(pc, features=recommender.GRID)
    bar = tqdm(desc="recommend", unit="candidate")

    def progress(label):
        bar.set_postfix_str(label)
        bar.update()

    _run(bar, parser, lambda: recommender.recommend(pc, rc, progress), recommender.table, pc.json)
    return 0


def _run(bar, parser, search, table, json_path):
    """`search()` under the progress bar (a ValueError becomes the parser's error), then its
    table printed and its results written to `json_path` if given."""
    try:
        res = search()
    except ValueError as e:
        bar.close()
        parser.error(str(e))
    bar.close()
    print(table(res))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    return res
