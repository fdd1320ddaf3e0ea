"""`upipe demo`: context-parallel attention on N spawned CPU ranks, checked against one process.

Each rank draws the same random q/k/v and output gradient for the full sequence, keeps its
contiguous shard, and runs forward+backward of each strategy under a `MemoryTracker`. Rank 0
then gathers the outputs and gradients and compares them with single-process attention on
the full sequence computed in float64 (same CPU flash kernel, no S x S matrix).
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch
import torch.distributed as dist

from upipe.attention.registry import check_heads, get_strategy, group_strategies
from upipe.comm import shard_sequence, unshard_sequence
from upipe.kernels import attention_backward, attention_forward
from upipe.memory import MemoryTracker


@dataclasses.dataclass(kw_only=True)
class DemoConfig:
    nproc: int = 4
    """Number of CPU ranks (gloo) to spawn."""
    seq_len: int = 16384
    """Full sequence length S (split into nproc contiguous shards)."""
    heads: int = 16
    """Query heads H."""
    kv_heads: int = 4
    """Key/value heads G (G < H is grouped-query attention)."""
    head_dim: int = 32
    """Head dimension d."""
    batch: int = 1
    """Batch size B."""
    causal: bool = True
    """Causal masking."""
    strategies: tuple[str, ...] = ("ulysses", "upipe", "ring")
    """Strategies to run, in order (upipe with one head per rank per stage; ring in the
    load-balanced zigzag layout)."""
    seed: int = 0
    """Seed for the random inputs."""


def _inputs(cfg: DemoConfig):
    gen = torch.Generator().manual_seed(cfg.seed)
    B, S, H, G, d = cfg.batch, cfg.seq_len, cfg.heads, cfg.kv_heads, cfg.head_dim
    q = torch.randn(B, S, H, d, generator=gen)
    k = torch.randn(B, S, G, d, generator=gen)
    v = torch.randn(B, S, G, d, generator=gen)
    dout = torch.randn(B, S, H, d, generator=gen)
    return q, k, v, dout


def _rel_err(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def _rank_main(rank, world_size, cfg: DemoConfig):
    group = dist.group.WORLD
    full = _inputs(cfg)
    shards = {
        name: [shard_sequence(t, group=group, layout=get_strategy(name).layout) for t in full]
        for name in cfg.strategies
    }
    for name in cfg.strategies:  # warm-up: connections, allocator, caches
        warm = [t[:, : min(64, t.shape[1])].clone().requires_grad_() for t in shards[name][:3]]
        with MemoryTracker():  # its first use costs seconds
            get_strategy(name).op(*warm, group=group, causal=cfg.causal).sum().backward()
    runs = []
    for name in cfg.strategies:
        q, k, v, dout = shards[name]
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        dist.barrier()
        t0 = time.perf_counter()
        with MemoryTracker() as mem:
            out = get_strategy(name).op(*leaves, group=group, causal=cfg.causal)
            out.backward(dout)
        seconds = time.perf_counter() - t0
        results = [
            unshard_sequence(t, group=group, layout=get_strategy(name).layout)
            for t in (out.detach(), *(x.grad for x in leaves))
        ]
        peaks = [None] * world_size
        dist.all_gather_object(peaks, mem.peak_bytes, group=group)
        runs.append((name, seconds, peaks, results))
        del out, leaves
    if rank != 0:
        return None
    q64, k64, v64, do64 = (t.double() for t in full)
    out64, lse64 = attention_forward(q64, k64, v64, causal=cfg.causal)
    reference = (out64, *attention_backward(do64, q64, k64, v64, out64, lse64, causal=cfg.causal))
    unit = full[0].numel() // world_size * full[0].element_size()  # one [B, L, H*d] tensor
    return [
        {
            "strategy": name,
            "seconds_fwd_bwd": seconds,
            "peak_bytes_per_rank": peaks,
            "peak_units_BLD": max(peaks) / unit,
            "rel_err": dict(
                zip(
                    ("out", "dq", "dk", "dv"),
                    [_rel_err(r, ref) for r, ref in zip(results, reference, strict=True)],
                    strict=True,
                )
            ),
        }
        for name, seconds, peaks, results in runs
    ]


def format_table(rows, cfg: DemoConfig) -> str:
    lines = [
        f"S={cfg.seq_len} tokens on {cfg.nproc} ranks (L={cfg.seq_len // cfg.nproc} each), "
        f"B={cfg.batch} H={cfg.heads} G={cfg.kv_heads} d={cfg.head_dim} fp32 "
        f"causal={cfg.causal}; errors are max|x - ref| / max|ref| vs float64 on one process",
        f"{'strategy':<10} {'fwd+bwd s':>9} {'peak MiB/rank':>13} {'units [B,L,D]':>13} "
        f"{'err out':>9} {'err dq':>9} {'err dk':>9} {'err dv':>9}",
    ]
    for r in rows:
        e = r["rel_err"]
        lines.append(
            f"{r['strategy']:<10} {r['seconds_fwd_bwd']:>9.2f} "
            f"{max(r['peak_bytes_per_rank']) / 2**20:>13.1f} {r['peak_units_BLD']:>13.2f} "
            f"{e['out']:>9.1e} {e['dq']:>9.1e} {e['dk']:>9.1e} {e['dv']:>9.1e}"
        )
    return "\n".join(lines)


def validate(cfg: DemoConfig) -> str | None:
    """The first problem with `cfg` as a one-line message naming the fix, or None."""
    if cfg.nproc < 1:
        return f"--nproc must be >= 1, got {cfg.nproc}"
    if cfg.seq_len % cfg.nproc:
        return (
            f"--seq-len {cfg.seq_len} must be divisible by --nproc {cfg.nproc}; "
            f"try {cfg.seq_len + (-cfg.seq_len) % cfg.nproc}"
        )
    if cfg.heads % cfg.kv_heads:
        return f"--kv-heads ({cfg.kv_heads}) must divide --heads ({cfg.heads})"
    unknown = [s for s in cfg.strategies if s not in group_strategies()]
    if unknown:
        return f"unknown strategies {unknown}; choose from {sorted(group_strategies())}"
    for name in cfg.strategies:
        problem = check_heads(name, cfg.heads, cfg.kv_heads, cfg.nproc, size="--nproc")
        if problem:
            return f"--heads {cfg.heads}, --kv-heads {cfg.kv_heads}: {problem}"
    return None


def run_demo(cfg: DemoConfig, *, json_path: str | None = None) -> list[dict]:
    """Spawn `cfg.nproc` ranks, run the demo, print a table (and write JSON if asked)."""
    from upipe.launch import LocalCluster

    print(f"spawning {cfg.nproc} gloo ranks ...", flush=True)
    with LocalCluster(cfg.nproc, timeout_s=1800) as cluster:
        rows = cluster.run(_rank_main, cfg)[0]
    print(format_table(rows, cfg))
    doc = {"config": dataclasses.asdict(cfg), "results": rows}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {json_path}")
    return rows
