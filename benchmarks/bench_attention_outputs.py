"""A checkpointed training step with `--attention-outputs keep` vs `recompute`, in one run.

    .venv/bin/python benchmarks/bench_attention_outputs.py                 # docs/train.md
    .venv/bin/python benchmarks/bench_attention_outputs.py --document-mask --rounds 6

On --nproc gloo ranks (`LocalCluster`) one Trainer of the --model preset, activation
checkpointing per block, --seq-len tokens per sequence, runs rounds of two forward+backward
passes on the same batch: one with each mode, alternating which goes first, the gradients
cleared before each; after both, their losses and gradients are compared bit for bit and
the optimizer steps once (the same for both modes: timed apart). The first --warmup rounds
are not timed. A pass's time is the slowest rank's (the ranks wait for each other at every
all-to-all anyway). Reported: the median pass of each mode and their ratio, the optimizer
step, the median of the rounds' keep / recompute ratios (robust to a load that drifts
between rounds), the attention kernel calls of a pass (counted on rank 0), and the attention
FLOPs the planner's time model counts for each mode (`upipe.planner.timing.count_step`,
CPU kernels). A table, then one JSON document (--json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from upipe.launch import LocalCluster
from upipe.model import get_config
from upipe.planner.timing import count_step
from upipe.train import TrainConfig, Trainer
from upipe.train.config import padded_length, validate

MODES = ("recompute", "keep")
_KERNEL = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class _KernelCalls(TorchDispatchMode):
    """Counts the CPU attention forward kernel's calls."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is _KERNEL
        return func(*args, **(kwargs or {}))


def _timed(fn) -> float:
    """Seconds of fn() on the slowest rank."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    seconds = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def _rank(rank, world_size, cfg: TrainConfig, rounds: int, warmup: int):
    trainer = Trainer(cfg, torch.device("cpu"))
    params = list(trainer.master.parameters())
    times = {m: [] for m in MODES}
    optimizer, identical = [], True
    for r in range(warmup + rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        results = {}
        for mode in order:
            trainer.model.attention_outputs = mode
            for p in params:
                p.grad = None
            box = []
            seconds = _timed(lambda box=box, r=r: box.append(trainer.forward_backward(r)))
            results[mode] = (box[0], [p.grad.clone() for p in params])
            if r >= warmup:
                times[mode].append(seconds)
        (loss_a, grads_a), (loss_b, grads_b) = results.values()
        identical &= loss_a == loss_b and all(map(torch.equal, grads_a, grads_b))
        t = _timed(trainer.optimizer_step)
        if r >= warmup:
            optimizer.append(t)
    calls = {}
    for mode in MODES:  # one more pass each, untimed: the attention kernel calls
        trainer.model.attention_outputs = mode
        with _KernelCalls() as counter:
            trainer.forward_backward(warmup + rounds)
        calls[mode] = counter.calls
    flag = torch.tensor(int(identical))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return {"times": times, "optimizer": optimizer, "identical": bool(flag), "calls": calls}


def counted_flops(cfg: TrainConfig, nproc: int) -> dict:
    """{mode: (attention forward, backward FLOPs)} of rank 0's step, as the planner counts
    them (the simulated step, CPU kernels, one sequence of one document)."""
    model = get_config(cfg.model)
    unit = padded_length(dataclasses.replace(cfg, seq_len=1), nproc) * 64
    out = {}
    for mode in MODES:
        c = dataclasses.replace(cfg, attention_outputs=mode, document_mask=False)
        counts = count_step(
            c, nproc, model, cfg.seq_len, unit=unit, depths=(model.n_layers,), kernels="cpu"
        )
        out[mode] = (counts["attention_forward_flops"], counts["attention_backward_flops"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--strategy", default="upipe")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds (one pass per mode)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--document-mask", action="store_true", help="mask the packed documents")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    cfg = TrainConfig(
        model=args.model, strategy=args.strategy, seq_len=args.seq_len, nproc=args.nproc,
        activation_checkpoint=True, document_mask=args.document_mask, plot=None,
    )  # fmt: skip
    problem = validate(cfg, args.nproc)
    if problem:
        raise SystemExit(problem)
    with LocalCluster(args.nproc, timeout_s=6 * 3600, pg_timeout_s=1800) as cluster:
        res = cluster.run(_rank, cfg, args.rounds, args.warmup)[0]
    flops = counted_flops(cfg, args.nproc)
    median = {m: statistics.median(res["times"][m]) for m in MODES}
    paired = [k / r for k, r in zip(res["times"]["keep"], res["times"]["recompute"], strict=True)]
    doc = {
        "config": vars(args),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "median_pass_s": median,
        "keep_over_recompute": median["keep"] / median["recompute"],
        "keep_over_recompute_per_round": statistics.median(paired),
        "optimizer_s": statistics.median(res["optimizer"]),
        "passes_s": res["times"],
        "bit_identical": res["identical"],
        "attention_kernel_calls": res["calls"],
        "counted_attention_flops": {
            m: {"forward": f, "backward": b} for m, (f, b) in flops.items()
        },
    }
    print(table(doc))
    print(json.dumps(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)


def table(doc: dict) -> str:
    c, opt = doc["config"], doc["optimizer_s"]
    lines = [
        f"{c['model']}, {c['strategy']}, S = {c['seq_len']:,} on {c['nproc']} ranks, "
        f"checkpointing per block, documents {'masked' if c['document_mask'] else 'not masked'}"
        f"; {c['rounds']} interleaved rounds (median); optimizer step {opt:.3f} s",
        f"{'mode':<10} {'fwd+bwd s':>9} {'step s':>7} {'vs recompute':>12} {'kernel calls':>12} "
        f"{'attn fwd GFLOP':>14} {'attn bwd GFLOP':>14}",
    ]
    base = doc["median_pass_s"]["recompute"] + opt
    for mode in MODES:
        t = doc["median_pass_s"][mode]
        fl = doc["counted_attention_flops"][mode]
        lines.append(
            f"{mode:<10} {t:>9.3f} {t + opt:>7.3f} {(t + opt) / base:>12.3f} "
            f"{doc['attention_kernel_calls'][mode]:>12} {fl['forward'] / 1e9:>14.2f} "
            f"{fl['backward'] / 1e9:>14.2f}"
        )
    lines.append(
        f"keep / recompute, median of the rounds' ratios (fwd+bwd): "
        f"{doc['keep_over_recompute_per_round']:.3f}; losses and gradients bit-identical: "
        f"{doc['bit_identical']}"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
