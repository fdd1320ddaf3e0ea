"""Memory of the attention layer, Ulysses vs UPipe, in JAX (XLA's temp bytes) and PyTorch.

JAX: `upipe.jax.attention_layer` under `jax.shard_map` on C simulated CPU devices; the
jitted forward+backward (`jax.value_and_grad` of sum(y * dy) w.r.t. the parameters and x) is
compiled for abstract inputs -- nothing runs -- and `memory_analysis()` read: temp bytes per
device (every buffer that is neither an argument nor an output; docs/jax.md says what that
includes). PyTorch: one rank of `upipe.ContextParallelAttention` under the fake process
group and `FakeTensorMode` (no data, no compute) with `upipe.MemoryTracker`, as
docs/upipe.md: the per-rank peak of the tensors allocated during forward+backward. Both in
units of one [B, L, D] tensor; a human-readable table, then one JSON document.

    python benchmarks/bench_jax_memory.py   # C = 4, D = 512, H = 16, G = 4, 16, d = 32, S = 16K
    python benchmarks/bench_jax_memory.py --json docs/jax_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def _jax_temp(args, G, strategy, U):
    """(temp, argument, output) bytes per device of the JAX layer's forward+backward."""
    import jax
    from jax.sharding import PartitionSpec as P

    import upipe.jax as uj

    C, B, S, D, H, d = args.devices, 1, args.seq_len, args.dim, args.heads, args.head_dim
    mesh = jax.make_mesh((C,), ("cp",))
    seq = P(None, "cp")

    def spec(shape, sharding=seq, dtype="float32"):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.NamedSharding(mesh, sharding))

    def per_device(params, x, pos):
        kw = dict(strategy=strategy, heads_per_stage=U, block_size=args.block_size)
        return uj.attention_layer(params, x, pos, axis_name="cp", head_dim=d, **kw)

    layer = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), seq, seq), out_specs=seq)

    def loss(params, x, dy, pos):
        return (layer(params, x, pos) * dy).sum()

    shapes = {
        "q_proj": (H * d, D),
        "k_proj": (G * d, D),
        "v_proj": (G * d, D),
        "o_proj": (D, H * d),
    }
    params = {n: spec(s, P()) for n, s in shapes.items()}
    x, dy, pos = spec((B, S, D)), spec((B, S, D)), spec((B, S), dtype="int32")
    mem = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(params, x, dy, pos).compile()
    mem = mem.memory_analysis()
    return mem.temp_size_in_bytes, mem.argument_size_in_bytes, mem.output_size_in_bytes


def _torch_peak(args, G, strategy, U):
    """Per-rank peak bytes of the PyTorch layer's forward+backward (rank 0 of C)."""
    import torch
    from torch._subclasses import FakeTensorMode

    import upipe
    from upipe.memory.simulate import fake_process_group

    C, D, H, d, L = args.devices, args.dim, args.heads, args.head_dim, args.seq_len // args.devices
    with fake_process_group(C) as group, FakeTensorMode():
        layer = upipe.ContextParallelAttention(
            D, H, G, d, group=group, strategy=strategy, heads_per_stage=U
        )
        x = torch.randn(1, L, D, requires_grad=True)
        dy = torch.randn(1, L, D)
        with upipe.MemoryTracker() as mem:
            layer(x, torch.arange(L)[None]).backward(dy)
    return mem.peak_bytes


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=4, help="C: simulated CPU devices / ranks")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, nargs="+", default=[4, 16])
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--heads-per-stage", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--block-size", type=int, default=512, help="the JAX kernel's token block")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    # XLA reads the device count when JAX starts: before the first `import jax`
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import torch

    unit = args.seq_len // args.devices * args.dim * 4  # one fp32 [B, L, D], B = 1
    rows = []
    print(f"{'kv heads':>8} {'method':>12} {'JAX temp':>9} {'vs Ulysses':>10} "
          f"{'PyTorch peak':>12} {'vs Ulysses':>10}   [B,L,D] units")  # fmt: skip
    for G in args.kv_heads:
        methods = [("ulysses", None)] + [("upipe", U) for U in args.heads_per_stage]
        base = None
        for strategy, U in methods:
            t0 = time.perf_counter()
            temp, argument, output = _jax_temp(args, G, strategy, U)
            peak = _torch_peak(args, G, strategy, U)
            row = dict(
                kv_heads=G,
                strategy=strategy,
                heads_per_stage=U,
                jax_temp_bytes=temp,
                jax_argument_bytes=argument,
                jax_output_bytes=output,
                torch_peak_bytes=peak,
                seconds=round(time.perf_counter() - t0, 1),
            )
            base = base or row
            row["jax_vs_ulysses"] = temp / base["jax_temp_bytes"]
            row["torch_vs_ulysses"] = peak / base["torch_peak_bytes"]
            rows.append(row)
            name = strategy if U is None else f"upipe U={U}"
            print(f"{G:>8} {name:>12} {temp / unit:>9.3f} {row['jax_vs_ulysses']:>10.3f} "
                  f"{peak / unit:>12.3f} {row['torch_vs_ulysses']:>10.3f}")  # fmt: skip
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "jax": jax.__version__,
        "torch": torch.__version__,
        "xla_flags": os.environ["XLA_FLAGS"],
        "shape": dict(
            C=args.devices,
            B=1,
            S=args.seq_len,
            D=args.dim,
            H=args.heads,
            d=args.head_dim,
            block_size=args.block_size,
            dtype="float32",
            unit_bytes=unit,
        ),
        "rows": rows,
    }
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
