"""One prepared script for a lent GPU: the CUDA paths of what exists, checked and measured.

    python benchmarks/gpu_check.py --out gpu_check.json          # on a CUDA machine
    python benchmarks/gpu_check.py --device cpu                  # the same logic on CPU

1. Kernels: every backend available on the device (cuda, flash_attn) vs the float64
   reference, forward and backward, fp32/bf16, causal and not, MHA/GQA.
2. Strategies at world size 1 (a real single-rank process group: nccl on CUDA, gloo on
   CPU): ulysses, upipe, ring and the fused module vs the float64 reference.
3. Memory: `upipe.MemoryTracker` peak vs `torch.cuda.max_memory_allocated` over the same
   region (fused UPipe module fwd+bwd).
4. One rank of a C-rank job under the fake process group with real device memory: the
   module's per-rank peak for ulysses vs upipe at a long sequence.
Prints a table per part and writes one JSON document (`--out`). Record results with the
date and hardware in docs/gpu.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform

import torch
import torch.distributed as dist

import upipe
from upipe.kernels import attention_backward, attention_forward
from upipe.memory.simulate import fake_process_group


def rel_err(a, ref):
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _qkv(B, S, H, G, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(B, S, n, d, generator=g) for n in (H, G, G, H)]
    return [t.to(device=device, dtype=dtype) for t in ts]


def _reference(q, k, v, dout, causal):
    args = [t.double().cpu() for t in (q, k, v)]
    out, lse = attention_forward(*args, causal=causal, backend="reference")
    grads = attention_backward(
        dout.double().cpu(), *args, out, lse, causal=causal, backend="reference"
    )
    return (out, *grads)


def check_kernels(device):
    backends = ["cpu"] if device.type == "cpu" else ["cuda"]
    if device.type == "cuda" and importlib.util.find_spec("flash_attn"):
        backends.append("flash_attn")
    rows = []
    for backend in backends:
        for dtype in (torch.float32, torch.bfloat16):
            if backend == "flash_attn" and dtype == torch.float32:
                continue  # flash-attn kernels are half precision only
            for causal in (True, False):
                for G in (8, 2):
                    q, k, v, dout = _qkv(2, 512, 8, G, 64, dtype, device)
                    ref = _reference(q, k, v, dout, causal)
                    case = dict(backend=backend, dtype=str(dtype), causal=causal, G=G)
                    try:
                        out, lse = attention_forward(q, k, v, causal=causal, backend=backend)
                        grads = attention_backward(
                            dout, q, k, v, out, lse, causal=causal, backend=backend
                        )
                        errs = [
                            rel_err(a.cpu(), r) for a, r in zip((out, *grads), ref, strict=True)
                        ]
                        rows.append(
                            {**case, "ok": True, "err_out": errs[0], "err_grads": max(errs[1:])}
                        )
                    except Exception as e:  # report, don't stop: this is the check
                        rows.append(
                            {**case, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
                        )
    return rows


def check_strategies(device):
    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    group, rows = dist.group.WORLD, []
    try:
        q, k, v, dout = _qkv(1, 1024, 8, 2, 64, torch.float32, device)
        ref = _reference(q, k, v, dout, True)
        for name in ("ulysses", "upipe", "ring"):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = getattr(upipe, f"{name}_attention")(*leaves, group=group)
            out.backward(dout)
            errs = [
                rel_err(a.detach().cpu(), r)
                for a, r in zip((out, *(x.grad for x in leaves)), ref, strict=True)
            ]
            rows.append(dict(strategy=name, err_out=errs[0], err_grads=max(errs[1:])))
    finally:
        dist.destroy_process_group()
    return rows


def check_tracker(device):
    with fake_process_group(1) as group:
        layer = upipe.ContextParallelAttention(1024, 16, 4, group=group, device=device)
        x = torch.randn(1, 8192, 1024, device=device, requires_grad=True)
        pos = torch.arange(8192, device=device)[None]
        dy = torch.randn_like(x)
        with upipe.MemoryTracker(device) as mem:
            layer(x, pos).backward(dy)
    return dict(tracker_peak_bytes=mem.peak_bytes, cuda_peak_bytes=mem.cuda_peak_bytes)


def check_fake_rank(device, C=8, S=262144):
    rows = []
    for strategy in ("ulysses", "upipe"):
        with fake_process_group(C) as group:
            layer = upipe.ContextParallelAttention(
                4096, 32, 8, group=group, strategy=strategy, device=device, dtype=torch.bfloat16
            )
            L = S // C
            x = torch.randn(1, L, 4096, device=device, dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn_like(x)
            with upipe.MemoryTracker(device) as mem:
                layer(x, torch.arange(L, device=device)[None]).backward(dy)
            rows.append(
                dict(
                    strategy=strategy,
                    C=C,
                    S=S,
                    peak_bytes=mem.peak_bytes,
                    cuda_peak_bytes=mem.cuda_peak_bytes,
                )
            )
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="write the JSON document here too")
    p.add_argument("--fake-seq-len", type=int, default=262144)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    doc = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    for name, fn in (
        ("kernels", lambda: check_kernels(device)),
        ("strategies_world1", lambda: check_strategies(device)),
        ("tracker_vs_allocator", lambda: check_tracker(device)),
        ("fake_pg_rank", lambda: check_fake_rank(device, S=a.fake_seq_len)),
    ):
        try:
            doc[name] = fn()
        except Exception as e:
            doc[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(f"== {name}\n{json.dumps(doc[name], indent=1)}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
