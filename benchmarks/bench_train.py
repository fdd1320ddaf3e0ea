"""Training runs side by side: strategies and memory features on the same data and weights.

    .venv/bin/python benchmarks/bench_train.py                       # the docs/train.md tables
    .venv/bin/python benchmarks/bench_train.py --seq-len 8192 --steps 20 --features ""
    .venv/bin/python benchmarks/bench_train.py --strategies --features "" \
        --precisions fp32,mixed,bf16 --seq-len 512 --steps 40 --lr 1e-3   # precision curves

For each strategy (none runs on one process, the others on --nproc gloo ranks) it trains
--steps steps of the tiny model and reports the loss curve, median tokens/s and the per-rank
peak memory of a step; then, for --features-strategy, each memory feature alone and all
together for --feature-steps steps, with the peak saved; then, with --precisions, the
--precision-strategy run in fp32, in mixed precision (bf16 compute, fp32 master weights,
gradients and AdamW states) and all in bf16, with each curve's distance from fp32. A table,
one JSON document (--json) and a PNG of the loss curves (--plot).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from upipe.launch import LocalCluster
from upipe.plot import Panel, Series, save_plot
from upipe.train import TrainConfig, train
from upipe.train.config import validate

FEATURES = {
    "tiled_mlp": {"tiled_mlp": True},
    "chunked_loss": {"chunked_loss": True},
    "checkpoint": {"activation_checkpoint": True},
    "fsdp": {"fsdp": True},
    "all": {"tiled_mlp": True, "chunked_loss": True, "activation_checkpoint": True, "fsdp": True},
}
PRECISIONS = {
    "fp32": {},
    "mixed": {"dtype": "bfloat16"},
    "bf16": {"dtype": "bfloat16", "master_dtype": "bfloat16"},
}


def _rank(rank, world_size, cfg):
    return train(cfg)


def run(cfg: TrainConfig, nproc: int) -> list[dict]:
    problem = validate(cfg, nproc)
    if problem:
        raise SystemExit(problem)
    with LocalCluster(nproc, timeout_s=6 * 3600, pg_timeout_s=1800) as cluster:
        return cluster.run(_rank, cfg)[0]


def summarize(name: str, history: list[dict]) -> dict:
    steady = history[1:] or history  # the first step pays for warm-up
    return {
        "run": name,
        "losses": [r["loss"] for r in history],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in history),
    }


def build_parser() -> argparse.ArgumentParser:
    """This script's options (tests/unit/test_documented_options.py parses the documented
    commands with it)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--strategies", nargs="*", default=["none", "ulysses", "upipe"])
    ap.add_argument("--features", default=",".join(FEATURES), help="comma-separated; '' none")
    ap.add_argument("--features-strategy", default="upipe")
    ap.add_argument("--feature-steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--warmup-steps", type=int, default=TrainConfig.warmup_steps)
    ap.add_argument("--min-lr-ratio", type=float, default=TrainConfig.min_lr_ratio)
    ap.add_argument("--precisions", default="", help=f"comma-separated of {','.join(PRECISIONS)}")
    ap.add_argument("--precision-strategy", default="none")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--plot", metavar="PATH")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    base = TrainConfig(
        model=args.model,
        seq_len=args.seq_len,
        steps=args.steps,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        min_lr_ratio=args.min_lr_ratio,
        plot=None,
    )
    rows = []
    for strategy in args.strategies:
        nproc = 1 if strategy == "none" else args.nproc
        print(f"== {strategy} on {nproc} process(es)", flush=True)
        cfg = dataclasses.replace(base, strategy=strategy, nproc=nproc)
        rows.append({**summarize(strategy, run(cfg, nproc)), "nproc": nproc})
    feature_rows = []
    names = [f for f in args.features.split(",") if f]
    if names:
        fs = args.features_strategy
        cfg = dataclasses.replace(base, strategy=fs, nproc=args.nproc, steps=args.feature_steps)
        for name in ["off", *names]:
            print(f"== {fs} with {name}", flush=True)
            hist = run(dataclasses.replace(cfg, **FEATURES.get(name, {})), args.nproc)
            feature_rows.append(summarize(name, hist))
    precision_rows = []
    for name in [p for p in args.precisions.split(",") if p]:
        ps = args.precision_strategy
        nproc = 1 if ps == "none" else args.nproc
        print(f"== {ps} in {name}", flush=True)
        cfg = dataclasses.replace(base, strategy=ps, nproc=nproc, **PRECISIONS[name])
        precision_rows.append(summarize(name, run(cfg, nproc)))
    print(format_tables(rows, feature_rows, args))
    if precision_rows:
        print(format_precisions(precision_rows, args))
    doc = {
        "config": vars(args),
        "strategies": rows,
        "features": feature_rows,
        "precisions": precision_rows,
    }
    print(json.dumps(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    if args.plot:
        plot(rows, args)


def format_tables(rows, feature_rows, args) -> str:
    mib = 2**20
    out = [
        f"{args.model}, S={args.seq_len}, {args.steps} steps",
        f"{'strategy':<9} {'procs':>5} {'loss step 1':>11} {'loss last':>9} "
        f"{'tokens/s':>9} {'peak MiB/rank':>13}",
    ]
    for r in rows:
        out.append(
            f"{r['run']:<9} {r['nproc']:>5} {r['losses'][0]:>11.4f} {r['losses'][-1]:>9.4f} "
            f"{r['tokens_per_s']:>9.0f} {r['peak_memory_bytes'] / mib:>13.1f}"
        )
    if feature_rows:
        off = feature_rows[0]["peak_memory_bytes"]
        out += [
            "",
            f"memory features ({args.features_strategy}, {args.nproc} ranks, "
            f"{args.feature_steps} steps)",
            f"{'feature':<13} {'peak MiB/rank':>13} {'saved':>7} {'tokens/s':>9} {'loss last':>9}",
        ]
        for r in feature_rows:
            p = r["peak_memory_bytes"]
            out.append(
                f"{r['run']:<13} {p / mib:>13.1f} {1 - p / off:>7.1%} "
                f"{r['tokens_per_s']:>9.0f} {r['losses'][-1]:>9.4f}"
            )
    return "\n".join(out)


def format_precisions(rows, args) -> str:
    """Each precision's loss curve against the first row's (fp32): largest and mean gap."""
    ref = rows[0]["losses"]
    half = len(ref) // 2
    out = [
        "",
        f"precision ({args.precision_strategy}, lr {args.lr:g}; gaps vs {rows[0]['run']}, nats)",
        f"{'run':<6} {'loss last':>9} {'max gap':>9} {'mean gap, 2nd half':>18} "
        f"{'peak MiB/rank':>13}",
    ]
    for r in rows:
        gaps = [abs(a - b) for a, b in zip(r["losses"], ref, strict=True)]
        out.append(
            f"{r['run']:<6} {r['losses'][-1]:>9.4f} {max(gaps):>9.2e} "
            f"{sum(gaps[half:]) / max(1, len(gaps) - half):>18.2e} "
            f"{r['peak_memory_bytes'] / 2**20:>13.1f}"
        )
    return "\n".join(out)


def plot(rows, args) -> None:
    series = [
        Series(
            label=f"{r['run']} ({r['nproc']} proc)",
            xs=list(range(1, len(r["losses"]) + 1)),
            ys=r["losses"],
            style={"alpha": 0.8},
        )
        for r in rows
    ]
    title = f"{args.model}, S={args.seq_len}: same curve for every strategy"
    panel = Panel(series=series, xlabel="step", ylabel="loss (nats/token)", title=title)
    if save_plot(args.plot, [panel], size=(6, 3.5)):
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
