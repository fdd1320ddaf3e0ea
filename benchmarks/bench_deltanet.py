"""The Gated DeltaNet layer split by heads: per-rank peak memory and time of UPipe's stages
against all heads at once (Ulysses) and against the unsharded layer (docs/hybrid.md).

    .venv/bin/python benchmarks/bench_deltanet.py --world 4 --seq-len 16384 --repeats 3

A method is STRATEGY[:U][+keep][@SCAN]: `upipe:4+keep` keeps each stage's inputs for
backward (`stage_inputs="keep"`); `--methods ulysses@torch upipe:4@torch` times both with
transformers' own torch scan (without @, the automatic backend: upipe's own on the CPU).

Legend: B batch, S sequence, L = S / C tokens per rank, D width, H value heads, G key heads,
d = e head dims, U value heads per stage, C ranks.

One transformers `Qwen3NextGatedDeltaNet` layer (random weights, fp32) with upipe's
`HFContextParallelDeltaNet` in its place on C gloo ranks; forward + backward on x `[B, L,
D]` with dy. Memory: `upipe.MemoryTracker` over one forward+backward -- y, dx, the weight
gradients and every buffer, not x, dy or the weights -- in units of one `[B, L, D]` tensor
of that run (the unsharded layer: L = S, one process). Time: untracked, the median over
`--repeats` rounds of the slowest rank, methods interleaved within each round, after a
warm-up round. A human-readable table,
then one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


def _layer(args):
    import transformers
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = transformers.Qwen3NextConfig(
        hidden_size=args.hidden,
        linear_num_key_heads=args.key_heads,
        linear_num_value_heads=args.value_heads,
        linear_key_head_dim=args.head_dim,
        linear_value_head_dim=args.head_dim,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    return Qwen3NextGatedDeltaNet(config, layer_idx=0).float()


def _inputs(args, L):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.seq_len, args.hidden, generator=gen)
    dy = torch.randn(1, args.seq_len, args.hidden, generator=gen)
    r = dist.get_rank() if dist.is_initialized() else 0
    return x[:, r * L : (r + 1) * L].contiguous(), dy[:, r * L : (r + 1) * L].contiguous()


def _peak(module, x, dy) -> int:
    """Peak bytes of one forward + backward (`upipe.MemoryTracker`)."""
    from upipe.memory import MemoryTracker

    x = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    with MemoryTracker() as mem:
        module(x).backward(dy)
    return mem.peak_bytes


def _seconds(module, x, dy) -> float:
    """Seconds of one forward + backward, untracked: the tracker's Python hook on every
    operator costs the same per call however small the tensor, so it would weigh on a
    method by its number of calls (UPipe's stages make more, smaller ones), not its work."""
    x = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    module(x).backward(dy)
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - start


def _modules(args, group):
    from upipe.integrations.hf_deltanet import HFContextParallelDeltaNet

    out = {}
    for method in args.methods:
        spec, _, scan = method.partition("@")
        spec, _, keep = spec.partition("+")
        strategy, _, U = spec.partition(":")
        out[method] = HFContextParallelDeltaNet(
            _layer(args),
            group=group,
            strategy=strategy,
            heads_per_stage=int(U) if U else None,
            state={"docs": None},
            stage_inputs=keep or "recompute",
        )
        out[method].scan_backend = scan or None
    return out


def run_rank(rank, world_size, args):
    """Every method's peak (one tracked pass each), then interleaved timing rounds (the
    first warms up); this rank's peaks and times."""
    modules = _modules(args, dist.group.WORLD)
    x, dy = _inputs(args, args.seq_len // world_size)
    peaks = {m: _peak(module, x, dy) for m, module in modules.items()}
    times = {m: [] for m in modules}
    for round_ in range(args.repeats + 1):
        for method, module in modules.items():
            seconds = _seconds(module, x, dy)
            if round_:  # (round 0 warms up)
                times[method].append(seconds)
    return {m: (peaks[m], times[m]) for m in modules}


def unsharded(args):
    """The transformers layer itself on the whole sequence, one process: its peak, and one
    timed round after a warm-up (it is C times slower than a rank, and not the comparison
    timed)."""
    layer = _layer(args)
    x, dy = _inputs(args, args.seq_len)
    peak = _peak(layer, x, dy)
    _seconds(layer, x, dy)
    return peak, [_seconds(layer, x, dy)]


def main(argv=None):
    from upipe.launch import LocalCluster

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--key-heads", type=int, default=4)
    p.add_argument("--value-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=["ulysses", "upipe:4", "upipe:8"],
                   help="STRATEGY[:U][+keep][@SCAN]: ulysses or upipe, U value heads per "
                   "stage, +keep: stage_inputs='keep', the scan backend "
                   "(upipe.kernels_deltanet; default: automatic)")  # fmt: skip
    p.add_argument("--no-unsharded", action="store_true", help="skip the one-process layer")
    p.add_argument("--json", help="also write the JSON document here")
    args = p.parse_args(argv)
    C, S, D = args.world, args.seq_len, args.hidden
    unit = {"sharded": S // C * D * 4, "unsharded": S * D * 4}  # one fp32 [B, L, D]
    with LocalCluster(C, timeout_s=3600) as cluster:
        per_rank = cluster.run(run_rank, args)
    rows = {}
    for method in args.methods:
        peak = max(r[method][0] for r in per_rank)
        times = (r[method][1] for r in per_rank)
        rounds = [max(t) for t in zip(*times, strict=True)]  # each round: the slowest rank
        rows[method] = {"peak_bytes": peak, "units": peak / unit["sharded"],
                        "seconds": statistics.median(rounds), "rounds": rounds}  # fmt: skip
    if not args.no_unsharded:
        peak, times = unsharded(args)
        rows["unsharded"] = {"peak_bytes": peak, "units": peak / unit["unsharded"],
                             "seconds": statistics.median(times)}  # fmt: skip
    base = rows.get(args.methods[0])
    print(f"C = {C}, S = {S}, D = {D}, H = {args.value_heads}, G = {args.key_heads}, "
          f"d = e = {args.head_dim}, fp32; unit: one [B, L, D] = {unit['sharded'] / 2**20:.2f}"
          f" MiB (unsharded: L = S, {unit['unsharded'] / 2**20:.2f} MiB)")  # fmt: skip
    print(f"{'method':<16} {'peak MiB':>9} {'[B,L,D]':>8} {'vs first':>10} {'fwd+bwd s':>10}"
          f" {'vs first':>10}")  # fmt: skip
    for method, row in rows.items():
        rel_m = row["peak_bytes"] / base["peak_bytes"] if base else float("nan")
        rel_t = row["seconds"] / base["seconds"] if base else float("nan")
        print(f"{method:<16} {row['peak_bytes'] / 2**20:>9.2f} {row['units']:>8.3f} "
              f"{rel_m:>10.3f} {row['seconds']:>10.3f} {rel_t:>10.3f}")  # fmt: skip
    doc = {"args": vars(args), "rows": rows, "torch": torch.__version__}
    print(json.dumps(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
