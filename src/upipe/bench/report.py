"""The benchmark's outputs: a readable table, the JSON document's machine block, the plot."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys

import torch

import upipe
from upipe.bench.peers import Method
from upipe.plot import Panel, Series, save_plot


def machine(device: str, nproc: int, threads: int, methods: list[Method]) -> dict:
    """Where and with what the benchmark ran: versions of everything compared, the machine."""
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "upipe": upipe.__version__,
        "device": device,
        "backend": "nccl" if device == "cuda" else "gloo",
        "ranks": nproc,
        "threads_per_rank": threads,
        "versions": {m.name: m.version() for m in methods},
    }
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def ratios_line(baseline: str | None, asked: str, variants: bool) -> str:
    """What the ratio columns are: this method over `baseline` (None: none ran; `asked`:
    --baseline's value, '' for the default)."""
    if baseline is None:
        return f"no ratios: the baseline {asked} did not run" if asked else "no ratios"
    each = " (each variant over its own variant of it)" if variants else ""
    return (
        f"mem ratio, time ratio = this method / {baseline}{each} (< 1: leaner / faster than "
        f"{baseline}; --baseline names another)"
    )


def table(rows: list[dict], skipped: dict[str, str], *, header: str, ratios: str) -> str:
    """One block per sequence length, then the skipped methods with their reasons; `ratios`
    (`ratios_line`) under the header. Rows of `upipe bench --whole-model` (with
    `add_growth`'s "kib_per_added_token") also show that and the loss's own error."""
    model = any("kib_per_added_token" in r for r in rows)
    width = max([20, *(len(r["method"]) + 2 for r in rows)])  # (--layer --variants: long)
    lines = [header, ratios]
    for S in sorted({r["seq_len"] for r in rows}):
        lines += [
            "",
            f"S = {S}",
            f"{'method':<{width}}{'peak MiB':>10}{'[B,L,D]':>9}"
            + (f"{'KiB/token':>10}" if model else "")
            + (f"{'step s':>9}" if model else "")
            + f"{'median s':>10}"
            + (f"{'loss err':>9}" if model else "")
            + f"{'max err':>9}{'mem #':>6}{'time #':>7}{'mem ratio':>11}{'time ratio':>11}",
        ]
        for r in (r for r in rows if r["seq_len"] == S):
            tail = (
                ""
                if r["correct"] is not False
                else f"  WRONG: error {r['max_rel_err']:.1e} > {r['tolerance']:.0e}, not ranked"
            )
            growth = _fmt(r.get("kib_per_added_token"), ".2f") if model else None
            lines.append(
                f"{r['method']:<{width}}{r['peak_mib']:>10.1f}{r['peak_units_BLD']:>9.2f}"
                + (f"{growth:>10}" if model else "")
                + (f"{_fmt(r.get('tracked_step_seconds'), '.1f'):>9}" if model else "")
                + f"{_fmt(r['median_seconds'], '.2f'):>10}"
                + (f"{_fmt(r['rel_err'].get('loss'), '.1e'):>9}" if model else "")
                + f"{_fmt(r['max_rel_err'], '.1e'):>9}"
                f"{_fmt(r['rank_memory'], 'd'):>6}{_fmt(r['rank_time'], 'd'):>7}"
                f"{_fmt(r['memory_over_baseline'], '.3f'):>11}"
                f"{_fmt(r['time_over_baseline'], '.3f'):>11}{tail}"
            )
    if skipped:
        lines += ["", "skipped:"]
        lines += [f"  {name}: {why}" for name, why in skipped.items()]
    return "\n".join(lines)


def _seconds(row: dict) -> float | None:
    """The median round's seconds, else (`upipe bench --whole-model --repeats 0`) the tracked
    step's."""
    if row["median_seconds"] is not None:
        return row["median_seconds"]
    return row.get("tracked_step_seconds")


def plot(rows: list[dict], path: str, *, title: str) -> None:
    """Peak memory per rank and median fwd+bwd time vs sequence length, a line per method
    (a method flagged wrong at any length is drawn dashed and labelled so)."""
    memory, time = [], []
    markers = "osD^vPX*"
    for i, name in enumerate(dict.fromkeys(r["method"] for r in rows)):
        mine = sorted((r for r in rows if r["method"] == name), key=lambda r: r["seq_len"])
        wrong = any(r["correct"] is False for r in mine)
        # methods with equal memory overlap: shrinking markers keep each one visible
        style = {
            "linestyle": "--" if wrong else "-",
            "marker": markers[i % len(markers)],
            "markersize": max(3, 11 - 1.2 * i),
            "markerfacecolor": "none",
        }
        label = name + (" (WRONG)" if wrong else "")
        xs = [r["seq_len"] for r in mine]
        memory.append(Series(label=label, xs=xs, ys=[r["peak_mib"] for r in mine], style=style))
        timed = [r for r in mine if _seconds(r) is not None]
        time.append(
            Series(
                label=label,
                xs=[r["seq_len"] for r in timed],
                ys=[_seconds(r) for r in timed],
                style=style,
            )
        )
    length = "sequence length S (tokens)"
    rounds = all(r["median_seconds"] is not None for r in rows)
    seconds = "median fwd+bwd (s)" if rounds else "tracked step (s; no timed rounds)"
    panels = [
        Panel(series=memory, xlabel=length, ylabel="peak memory per rank (MiB)", xlog=True),
        Panel(series=time, xlabel=length, ylabel=seconds, xlog=True),
    ]
    for panel in panels:
        panel.ylog = True
    save_plot(path, panels, title=title, size=(11, 4.2), legend_below=True)


def result_row(seq_len: int, name: str, measured: dict, seconds: list, unit: int) -> dict:
    """One method's result at one length: its per-rank peaks (bytes, MiB of the largest, in
    units of `unit` bytes), the seconds of its interleaved rounds and their median, and its
    errors vs the reference (`measured`: "peak_bytes_per_rank", "rel_err")."""
    peaks = measured["peak_bytes_per_rank"]
    extra = {k: measured[k] for k in ("tracked_step_seconds", "loss") if k in measured}
    return {
        "seq_len": seq_len,
        "method": name,
        "peak_bytes_per_rank": peaks,
        "peak_mib": max(peaks) / 2**20,
        "peak_units_BLD": max(peaks) / unit,
        "seconds_per_round": seconds,
        "median_seconds": statistics.median(seconds) if seconds else None,
        "rel_err": measured["rel_err"],
        "max_rel_err": max(measured["rel_err"].values(), default=None),
        **extra,
    }


def add_growth(rows: list[dict], nproc: int) -> None:
    """Add to each row from a method's second length on "kib_per_added_token": the growth
    of its per-rank peak (max over the ranks) from the method's previous length, in KiB per
    token added to each rank's shard, (peak(S) - peak(S')) / 1024 / ((S - S') / nproc);
    None at the first length."""
    for name in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == name), key=lambda r: r["seq_len"])
        mine[0]["kib_per_added_token"] = None
        for prev, r in zip(mine, mine[1:], strict=False):
            added = (r["seq_len"] - prev["seq_len"]) / nproc
            grown = max(r["peak_bytes_per_rank"]) - max(prev["peak_bytes_per_rank"])
            r["kib_per_added_token"] = grown / 1024 / added


def publish(doc: dict, skipped: dict, cfg, say, *, header: str, title: str) -> None:
    """Print the table of `doc["results"]`, write `cfg.json` (the whole `doc`) and the plot
    `cfg.plot` if asked, saying where."""
    rows = doc["results"]
    ratios = ratios_line(doc["baseline"], cfg.baseline, cfg.layer and cfg.variants)
    say(table(rows, skipped, header=header, ratios=ratios))
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(doc, f, indent=2)
        say(f"wrote {os.path.abspath(cfg.json)}")
    if cfg.plot and rows:
        plot(rows, cfg.plot, title=title)
        say(f"wrote {os.path.abspath(cfg.plot)}")
