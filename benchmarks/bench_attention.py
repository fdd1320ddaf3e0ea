"""Ulysses vs UPipe (and ring) on N CPU ranks: per-rank peak memory and fwd+bwd time.

Uses only upipe's public API. Every method runs in the same processes on identical inputs:
memory first (one pass each under `upipe.MemoryTracker`), then timing -- warm-up, then
`--repeats` rounds in which the methods take turns (interleaved, so drift hits all alike).
A round's time is the slowest rank's forward+backward; the table shows the median round.

    python benchmarks/bench_attention.py                       # the issue's configuration
    python benchmarks/bench_attention.py --mode functional --methods ulysses upipe ring usp
    python benchmarks/bench_attention.py --seq-len 4096 --repeats 2 --json out.json

Modes: "module" times `ContextParallelAttention` (projections, RoPE, attention, o_proj; the
x gradient and the weight gradients); "functional" times `*_attention(q, k, v)` alone
(usp on a ring-of-2 x ulysses-C/2 mesh).
Memory is the peak of tensors allocated during forward+backward (inputs and parameters
excluded), in bytes and in units of one [B, L, D] tensor of the input dtype.
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


def _method_key(name, U):
    return name if U is None else f"{name}(U={U})"


def _parse_methods(methods, C):
    """'upipe' -> U = C; 'upipe:8' -> U = 8; others as given."""
    out = []
    for m in methods:
        name, _, u = m.partition(":")
        out.append((name, int(u) if u else (C if name == "upipe" else None)))
    return out


def _rank(rank, world_size, cfg):
    group = dist.group.WORLD
    C = world_size
    keys = ("batch", "seq_len", "dim", "heads", "kv_heads", "head_dim")
    B, S, D, H, G, d = (cfg[k] for k in keys)
    L = S // C
    gen = torch.Generator().manual_seed(cfg["seed"])
    methods = _parse_methods(cfg["methods"], C)

    if cfg["mode"] == "module":
        layers = {}
        for name, U in methods:
            torch.manual_seed(cfg["seed"])  # identical weights for every method
            layers[(name, U)] = upipe.ContextParallelAttention(
                D, H, G, d, group=group, strategy=name, heads_per_stage=U
            )
        x = torch.randn(B, L, D, generator=gen)
        pos = upipe.shard_sequence(torch.arange(S).expand(B, S), group=group)
        dy = torch.randn(B, L, D, generator=gen)

        def prepare(key, n=L):
            """The inputs of one step (made outside the measured region), and the step."""
            xs = x[:, :n].clone().requires_grad_()
            layer = layers[key]
            layer.zero_grad(set_to_none=True)
            return lambda: layer(xs, pos[:, :n]).backward(dy[:, :n])
    else:
        q = torch.randn(B, L, H, d, generator=gen)
        k = torch.randn(B, L, G, d, generator=gen)
        v = torch.randn(B, L, G, d, generator=gen)
        dout = torch.randn(B, L, H, d, generator=gen)

        mesh = None
        if any(name == "usp" for name, _ in methods):
            mesh = upipe.make_mesh(ring=2, ulysses=C // 2)

        def prepare(key, n=L):
            """The inputs of one step (made outside the measured region), and the step."""
            name, U = key
            leaves = [t[:, :n].clone().requires_grad_() for t in (q, k, v)]
            if name == "usp":  # ring of 2 x ulysses C/2 (timing and memory: layout-agnostic)
                return lambda: upipe.usp_attention(*leaves, mesh=mesh).backward(dout[:, :n])
            kw = {"heads_per_stage": U} if name == "upipe" else {}
            fn = getattr(upipe, f"{name}_attention")
            return lambda: fn(*leaves, group=group, **kw).backward(dout[:, :n])

    unit = B * L * D * 4
    memory, times = {}, {key: [] for key in methods}
    for key in methods:
        prepare(key, n=min(L, 64))()  # warm-up: connections, allocator, caches
        step = prepare(key)
        with upipe.MemoryTracker() as mem:
            step()
        memory[key] = mem.peak_bytes
    for _ in range(cfg["warmup"]):
        for key in methods:
            prepare(key)()
    for _ in range(cfg["repeats"]):
        for key in methods:
            step = prepare(key)
            dist.barrier(group)
            t0 = time.perf_counter()
            step()
            times[key].append(time.perf_counter() - t0)
    peaks = [None] * C
    dist.all_gather_object(peaks, (memory, times), group=group)
    if rank:
        return None
    rows = []
    for key in methods:
        per_rank_mem = [p[0][key] for p in peaks]
        rounds = [max(p[1][key][i] for p in peaks) for i in range(cfg["repeats"])]
        rows.append(
            {
                "method": _method_key(*key),
                "peak_bytes_per_rank": per_rank_mem,
                "peak_units_BLD": max(per_rank_mem) / unit,
                "seconds_per_round": rounds,
                "median_seconds": statistics.median(rounds),
            }
        )
    base = rows[0]
    for r in rows:
        r["memory_vs_" + base["method"]] = r["peak_units_BLD"] / base["peak_units_BLD"]
        r["time_vs_" + base["method"]] = r["median_seconds"] / base["median_seconds"]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="CPU ranks (gloo)")
    p.add_argument("--mode", choices=("module", "functional"), default="module")
    p.add_argument(
        "--methods",
        nargs="+",
        default=["ulysses", "upipe", "upipe:8", "upipe:16"],
        help="first one is the baseline; upipe:U sets heads_per_stage",
    )
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument(
        "--kv-heads", type=int, nargs="+", default=[4, 16], help="one benchmark per value"
    )
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the JSON document here too")
    a = p.parse_args(argv)
    if a.seq_len % a.nproc:
        p.error(f"--seq-len {a.seq_len} must be divisible by --nproc {a.nproc}")

    doc = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_threads_per_rank": 1,
            "torch": torch.__version__,
            "upipe": upipe.__version__,
            "backend": "gloo",
        },
        "runs": [],
    }
    with LocalCluster(a.nproc, timeout_s=3600) as cluster:
        for G in a.kv_heads:
            cfg = dict(vars(a), kv_heads=G)
            print(
                f"running {a.mode}: S={a.seq_len} C={a.nproc} D={a.dim} H={a.heads} G={G} "
                f"d={a.head_dim}, methods {a.methods} ...",
                flush=True,
            )
            rows = cluster.run(_rank, cfg)[0]
            doc["runs"].append({"config": cfg, "results": rows})
            base = rows[0]["method"]
            print(
                f"\n{'method':<16}{'peak [B,L,D]':>13}{'peak MiB':>10}{'mem vs ' + base:>16}"
                f"{'median s':>10}{'time vs ' + base:>17}"
            )
            for r in rows:
                print(
                    f"{r['method']:<16}{r['peak_units_BLD']:>13.2f}"
                    f"{max(r['peak_bytes_per_rank']) / 2**20:>10.1f}"
                    f"{r['memory_vs_' + base]:>16.3f}{r['median_seconds']:>10.2f}"
                    f"{r['time_vs_' + base]:>17.3f}"
                )
            print()
    text = json.dumps(doc, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
