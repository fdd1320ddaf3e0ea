"""The cost of document masking: upipe_attention and ring_attention with and without
`cu_seqlens`, on N CPU ranks, in the same processes on identical inputs.

Memory: per-rank peak of the tensors allocated during forward+backward (`upipe.MemoryTracker`;
inputs excluded), in units of one [B, L, H*d] tensor. Time: warm-up, then `--repeats` rounds
in which the four runs take turns; a round's time is the slowest rank's forward+backward,
the table shows the median.

    python benchmarks/bench_documents.py                  # C = 4, S = 8192, 8 documents
    python benchmarks/bench_documents.py --seq-len 4096 --docs 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.distributed as dist

import upipe
from upipe.launch import LocalCluster


def _boundaries(S, n, seed):
    """n documents of random lengths (each at least 1 token) covering S tokens."""
    gen = torch.Generator().manual_seed(seed)
    inner = (torch.randperm(S - 1, generator=gen)[: n - 1] + 1).sort().values
    return torch.cat([torch.tensor([0]), inner, torch.tensor([S])])


def _rank(rank, world_size, cfg):
    group = dist.group.WORLD
    B, S, H, G, d = (cfg[k] for k in ("batch", "seq_len", "heads", "kv_heads", "head_dim"))
    gen = torch.Generator().manual_seed(cfg["seed"])
    full = [torch.randn(B, S, n, d, generator=gen) for n in (H, G, G, H)]
    cu = _boundaries(S, cfg["docs"], cfg["seed"])
    runs = {}
    for name, layout in (("upipe", "contiguous"), ("ring", "zigzag")):
        q, k, v, dout = (upipe.shard_sequence(t, group=group, layout=layout) for t in full)
        fn = getattr(upipe, f"{name}_attention")
        for docs in (None, cu):

            def run(fn=fn, q=q, k=k, v=v, dout=dout, layout=layout, docs=docs):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                out = fn(*leaves, group=group, layout=layout, cu_seqlens=docs)
                out.backward(dout)

            runs[f"{name} {'docs' if docs is not None else 'plain'}"] = run
    unit = B * (S // world_size) * H * d * 4
    peaks = {}
    for key, run in runs.items():
        run()  # warm-up (and the one-off agreement on the inputs)
        with upipe.MemoryTracker() as mem:
            run()
        peaks[key] = mem.peak_bytes / unit
    times = {key: [] for key in runs}
    for _ in range(cfg["repeats"]):
        for key, run in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            run()
            t = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[key].append(t.item())
    return {"peak_units": peaks, "seconds": {k: statistics.median(v) for k, v in times.items()}}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cfg = {k: getattr(args, k) for k in ("seq_len", "docs", "batch", "heads", "repeats", "seed")}
    cfg.update(kv_heads=args.kv_heads, head_dim=args.head_dim)
    with LocalCluster(args.world_size, timeout_s=3600) as cluster:
        res = cluster.run(_rank, cfg)
    peaks = {k: max(r["peak_units"][k] for r in res) for k in res[0]["peak_units"]}
    secs = res[0]["seconds"]
    print(
        f"C={args.world_size} S={args.seq_len} docs={args.docs} H={args.heads} "
        f"G={args.kv_heads} d={args.head_dim} B={args.batch} fp32, {platform.processor()}"
    )
    print(f"{'run':<12} {'peak [B,L,H*d]':>15} {'vs plain':>9} {'fwd+bwd s':>10} {'vs plain':>9}")
    for key in peaks:
        base = key.split()[0] + " plain"
        print(
            f"{key:<12} {peaks[key]:>15.3f} {peaks[key] / peaks[base]:>9.3f} "
            f"{secs[key]:>10.3f} {secs[key] / secs[base]:>9.3f}"
        )
    out = {"config": {**cfg, "world_size": args.world_size}, "peak_units": peaks, "seconds": secs}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
