"""`upipe plan`: the planner's search with a progress bar, a table, JSON and a plot (the
search itself is `upipe.planner.plan.plan`); with --recommend, the fastest configuration
that fits at --seq-len and its torchrun command (`upipe.planner.recommend`)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os

from tqdm import tqdm

from upipe.cli.options import add_dataclass_options, config_from_args
from upipe.cli.stops import stopped
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
    if pc.gpus < 1 or pc.granularity < 1 or (pc.gpu_memory_gib or 1) <= 0:
        parser.error("--gpus, --granularity and --gpu-memory-gib must be positive")
    if pc.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'upipe[train]' (or matplotlib)")

    def line(row):
        if row.get("problem"):
            return f"{row['strategy']}: n/a"
        S = row["max_seq_len"]
        return f"{row['strategy']}: {S:,} tokens" if S else f"{row['strategy']}: does not fit"

    res, status = _run(pc, parser, planner.plan, planner.table, line)
    if pc.plot and res is not None:
        planner.plot(res, pc.plot)
    return status


def _recommend(pc, rc, parser) -> int:
    if not rc.recommend:
        what = "--seq-len is the length" if rc.seq_len is not None else "--rates-from times what"
        parser.error(f"{what} --recommend plans for: add --recommend")
    if pc.plot:
        parser.error("--plot draws the longest-context search: leave it out with --recommend")
    if pc.features == planner.PlanConfig().features:  # not given: the grid
        pc = dataclasses.replace(pc, features=recommender.GRID)

    def line(row):
        if row.get("problem"):
            return f"{row['strategy']}: n/a"
        fits = "fits" if row["fits"] else f"does not fit ({row['reason']})"
        return f"{row['strategy']}: {fits}, peak {row['peak_bytes'] / planner.GiB:.1f} GiB"

    search = functools.partial(recommender.recommend, rc=rc)
    return _run(pc, parser, search, recommender.table, line, name="recommend")[1]


def _run(pc, parser, search, table, line, name="plan"):
    """`search(pc, progress)` under a progress bar over the candidates (their number, the
    total, from `progress(None, res)`), each finished candidate's `line(row)` printed above
    the bar and the JSON rewritten with the results so far (`"finished": false` until the
    end); then the table. A ValueError becomes the parser's error. Returns the results and
    the exit status. On Ctrl-C or SIGTERM (`upipe.cli.stops`): one line, the lines of the
    candidates that finished and the partial JSON; returns None and 130 / 143."""
    bar, partial = tqdm(desc=name, unit="candidate"), {}

    def progress(row, res):
        partial["res"] = res
        if row is None:  # before the first: the candidates to simulate
            bar.total = sum(not r.get("problem") for r in _rows(res))
            bar.refresh()
            return
        bar.write(line(row))
        bar.update()
        _write(pc.json, res, finished=False)

    try:
        res = search(pc, progress=progress)
    except ValueError as e:
        bar.close()
        parser.error(str(e))
    except KeyboardInterrupt as e:
        bar.close()
        res = partial.get("res")
        done = [r for r in _rows(res or {}) if not r.get("problem") and _finished(r)]
        kept = f"; partial results: {pc.json}" if res and pc.json else ""
        many = "candidate" if len(done) == 1 else "candidates"
        status = stopped("plan", e, f" after {len(done)} {many}{kept}")
        for r in done:
            print(line(r))
        if res:
            _write(pc.json, res, finished=False)
        return None, status
    bar.close()
    print(table(res))
    _write(pc.json, res, finished=True)
    return res, 0


def _rows(res: dict) -> list[dict]:
    return res.get("strategies", res.get("candidates", []))


def _finished(row: dict) -> bool:
    return "max_seq_len" in row or "fits" in row


def _write(path, res: dict, *, finished: bool) -> None:
    """The results so far to `path` (if given), atomically (a stop never leaves half a file)."""
    if not path:
        return
    tmp = f"{path}.partial"
    with open(tmp, "w") as f:
        json.dump({**res, "finished": finished}, f, indent=1)
    os.replace(tmp, path)
