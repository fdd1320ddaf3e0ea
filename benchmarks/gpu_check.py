"""One prepared script for a lent GPU: the CUDA paths of upipe, checked and measured.

    python benchmarks/gpu_check.py --out gpu_check.json     # one H200: about 3-4 minutes
    python benchmarks/gpu_check.py --device cpu             # the same logic, small sizes

Record a run's tables and JSON in docs/gpu.md, with the date and the hardware. Each part
runs on its own: an error is recorded (in its row, or for the whole part) and the next
part runs; the JSON document is rewritten after every part, so a run cut short keeps
what it measured.

1. kernels: every backend on the device (cpu; or cuda in bf16 and fp32 and flash_attn in
   bf16 when installed) vs float64 attention, causal and not, MHA and GQA, fwd+bwd.
2. strategies: ulysses, upipe, ring, usp (a 1 x 1 mesh) and `ContextParallelAttention`
   (upipe, ulysses, ring) on a real one-rank process group (nccl on CUDA, gloo on CPU),
   bf16 and fp32, fwd+bwd vs float64, pass/fail against tests/conftest.py's tolerances.
3. tracker: `MemoryTracker` (nested in an outer tracker) vs `max_memory_allocated` and
   `max_memory_reserved` over the same region, a fused UPipe layer's fwd+bwd.
4. rank: one rank of an 8-GPU Llama3-8B job at 1M tokens (fake process group, real device
   memory), ulysses vs upipe (U=8): measured peaks vs the closed form
   (`upipe.memory.model`) and the planner's simulation of the same layer.
5. speed: UPipe vs Ulysses layer fwd+bwd time, same per-rank shapes at 128K and 1M tokens.

Budget (`attention_flops`: the attention dominates parts 4 and 5; at an effective 350
TFLOP/s in bf16 on an H200): part 4 runs 2 layers at 1M tokens, 8 ranks (h = 4 heads per
rank): 2 x 3.9 PFLOP, about 23 s; part 5 runs 2 layers x 4 times at 1M and 2 x 6 times at
128K: 32 PFLOP, about 92 s; parts 1-3 cost seconds (start-up, first kernel calls).
`estimate_s` in the JSON holds these per part, next to the measured `<part>_elapsed_s`.

Legend: B batch, S sequence (the whole job's), L = S / 8 tokens per rank, D width, H query
heads, G kv heads, h = H / 8 query heads per rank after the all-to-all, d head dim.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import platform
import statistics
import time
import traceback

import torch
import torch.distributed as dist
from torch._subclasses import FakeTensorMode

import upipe
from upipe.kernels import attention_backward, attention_forward, default_backend
from upipe.memory.model import LayerShape, ulysses_peak_units, upipe_peak_units
from upipe.memory.simulate import fake_process_group
from upipe.planner.step import StepTracker
from upipe.rope import apply_rope, rope_cos_sin

# Relative error bounds, copied from tests/conftest.py (TOL, bf16_bound): fp32 1e-5; a bf16
# kernel under 1.5e-2 forward and 5e-2 backward; a bf16 strategy at most 2x as wrong as one
# device running the same kernel (floor 1e-3); a bf16 layer under 5e-2 in every output (the
# bound tests/test_upipe.py::test_module_bf16_as_good_as_ulysses asserts).
TOL = {
    torch.float32: {"fwd": 1e-5, "bwd": 1e-5},
    torch.bfloat16: {"fwd": 1.5e-2, "bwd": 5e-2, "factor": 2.0, "floor": 1e-3},
}
TFLOPS_H200 = 350e12  # effective bf16 attention fwd+bwd throughput assumed for the budget
LLAMA3_8B = dict(D=4096, H=32, G=8, d=128)  # attention layer: width, q heads, kv heads, head dim
GPUS, U = 8, 8  # the job simulated in parts 4 and 5, and UPipe's heads per stage
SIZES = {  # per part; "quick" for CPU (a smoke test), "full" for a GPU
    "full": dict(
        kernel=dict(B=2, S=2048, H=8, d=128),
        strategy=dict(B=2, S=2048, D=1024, H=8, G=2, d=128),
        tracker=dict(S=32768, **LLAMA3_8B),
        rank=dict(S=2**20, **LLAMA3_8B),
        speed=dict(S=(2**17, 2**20), reps=(5, 3), **LLAMA3_8B),
    ),
    "quick": dict(
        kernel=dict(B=2, S=256, H=8, d=32),
        strategy=dict(B=2, S=256, D=128, H=4, G=2, d=32),
        tracker=dict(S=2048, D=256, H=8, G=2, d=32),
        rank=dict(S=4096, D=512, H=16, G=8, d=32),
        speed=dict(S=(1024, 4096), reps=(2, 1), D=512, H=16, G=8, d=32),
    ),
}


def attention_flops(B, S, h, d, causal=True):
    """Forward+backward FLOPs of attention over S tokens with h heads (a rank's share): the
    forward's two S x S matmuls (Q K^T, P V) cost 2 * 2 * B * h * S^2 * d, the backward's five
    (Q K^T again, dV, dP, dQ, dK) 2.5 times that; a causal mask halves both."""
    return 3.5 * 4 * B * S**2 * h * d / (2 if causal else 1)


def estimate_s(sizes) -> dict:
    """Seconds of attention per part at `TFLOPS_H200` (the module doc's budget)."""
    r, sp = sizes["rank"], sizes["speed"]
    rank = 2 * attention_flops(1, r["S"], r["H"] // GPUS, r["d"])  # ulysses, upipe: once each
    speed = sum(  # ulysses, upipe: a warm-up and `reps` timed runs each
        2 * (1 + n) * attention_flops(1, S, sp["H"] // GPUS, sp["d"])
        for S, n in zip(sp["S"], sp["reps"], strict=True)
    )
    return {"rank": rank / TFLOPS_H200, "speed": speed / TFLOPS_H200}


def rel_err(a, ref):
    ref = ref.double()
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def randn(*shape, device, seed=0):
    """fp32 normal values, the same on every device (drawn on the CPU)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def attention_fp64(q, k, v, causal):
    """softmax(q k^T / sqrt(d)) v written out in fp64; query head h uses kv head h // (H/G)."""
    H, G, S = q.shape[2], k.shape[2], q.shape[1]
    k, v = (t.double().repeat_interleave(H // G, 2) for t in (k, v))
    s = torch.einsum("bshd,bthd->bhst", q.double(), k) / q.shape[-1] ** 0.5
    if causal:
        mask = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return torch.einsum("bhst,bthd->bshd", s.softmax(-1), v)


def grads_fp64(fn, inputs, dout):
    """fn(*inputs) in fp64 and its gradients w.r.t. the inputs: the ground truth."""
    leaves = [t.double().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(dout.double())
    return [out.detach(), *(t.grad for t in leaves)]


def check(got, truth, tols):
    """Errors of `got` against `truth` and err/tol (passes when <= 1) for one row."""
    errs = [rel_err(a, r) for a, r in zip(got, truth, strict=True)]
    worst = max(e / t for e, t in zip(errs, tols, strict=True))
    return dict(err_out=errs[0], err_grads=max(errs[1:]), err_over_tol=worst, ok=worst <= 1)


def fwd_bwd(fn, leaves, dout):
    """fn(*leaves) and the gradients of <out, dout> w.r.t. the leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach(), *(t.grad for t in leaves)]


def row(case, fn, *args):
    """`case` with fn(*args)'s results, or with the error: one failure never hides the rest."""
    try:
        return {**case, **fn(*args)}
    except Exception as e:
        return {**case, "ok": False, "error": f"{type(e).__name__}: {e}"[:400]}


# --- 1. kernels -------------------------------------------------------------------------


def check_kernels(device, s):
    cases = [("cpu", torch.float32), ("cpu", torch.bfloat16)]
    if device.type == "cuda":
        cases = [("cuda", torch.bfloat16), ("cuda", torch.float32)]
        if importlib.util.find_spec("flash_attn"):
            cases.append(("flash_attn", torch.bfloat16))  # half precision only
    rows = []
    for causal in (True, False):
        for G in (s["H"], s["H"] // 4):
            q, k, v, dout = (
                randn(s["B"], s["S"], n, s["d"], device=device, seed=i)
                for i, n in enumerate((s["H"], G, G, s["H"]))
            )
            truth = grads_fp64(functools.partial(attention_fp64, causal=causal), (q, k, v), dout)
            for backend, dtype in cases:
                case = dict(backend=backend, dtype=str(dtype)[6:], causal=causal, H=s["H"], G=G)
                rows.append(row(case, _kernel_case, backend, dtype, causal, (q, k, v, dout), truth))
    return rows


def _kernel_case(backend, dtype, causal, inputs, truth):
    q, k, v, dout = (t.to(dtype) for t in inputs)
    out, lse = attention_forward(q, k, v, causal=causal, backend=backend)
    grads = attention_backward(dout, q, k, v, out, lse, causal=causal, backend=backend)
    return check((out, *grads), truth, [TOL[dtype]["fwd"]] + 3 * [TOL[dtype]["bwd"]])


# --- 2. strategies at world size 1 ------------------------------------------------------


def check_strategies(device, s):
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        group = dist.group.WORLD
        mesh = upipe.make_mesh(ulysses=1, ring=1, device_type=device.type)
        rows = []
        for dtype in (torch.float32, torch.bfloat16):
            rows += _strategy_rows(device, s, dtype, group, mesh)
        return rows
    finally:
        dist.destroy_process_group()


def _strategy_rows(device, s, dtype, group, mesh):
    """At one rank every sequence layout is the identity: full tensors go in and come out."""
    B, S, H, G, d, D = (s[n] for n in ("B", "S", "H", "G", "d", "D"))
    q, k, v, dout = (randn(B, S, n, d, device=device, seed=i) for i, n in enumerate((H, G, G, H)))
    truth = grads_fp64(functools.partial(attention_fp64, causal=True), (q, k, v), dout)
    qkv, dout = [t.to(dtype) for t in (q, k, v)], dout.to(dtype)
    tols = [TOL[dtype]["fwd"]] + 3 * [TOL[dtype]["bwd"]]
    if dtype == torch.bfloat16:  # as bad as one device in bf16 at most (conftest.bf16_bound)
        one = fwd_bwd(_Kernel.apply, qkv, dout)
        b = TOL[dtype]
        tols = [
            max(b["factor"] * rel_err(a, r), b["floor"]) for a, r in zip(one, truth, strict=True)
        ]
    fns = {
        "ulysses_attention": lambda q, k, v: upipe.ulysses_attention(q, k, v, group=group),
        "upipe_attention": lambda q, k, v: upipe.upipe_attention(q, k, v, group=group),
        "ring_attention": lambda q, k, v: upipe.ring_attention(q, k, v, group=group),
        "usp_attention": lambda q, k, v: upipe.usp_attention(q, k, v, mesh=mesh),
    }
    rows = []
    for name, fn in fns.items():
        case = dict(strategy=name, dtype=str(dtype)[6:])
        rows.append(row(case, _strategy_case, fn, qkv, dout, truth, tols))
    # the layer: weights and inputs drawn in fp32, truth in fp64
    x, dy = randn(B, S, D, device=device, seed=10), randn(B, S, D, device=device, seed=11)
    pos = torch.arange(S, device=device).expand(B, S)
    w = [randn(n * d, D, device=device, seed=12 + i) / D**0.5 for i, n in enumerate((H, G, G))] + [
        randn(D, H * d, device=device, seed=15) / (H * d) ** 0.5
    ]
    truth = grads_fp64(lambda x, *w: _layer_fp64(x, pos, *w, d), (x, *w), dy)
    for strategy in ("upipe", "ulysses", "ring"):
        case = dict(strategy=f"module {strategy}", dtype=str(dtype)[6:])
        rows.append(row(case, _module_case, s, strategy, dtype, group, (x, dy, pos), w, truth))
    return rows


def _strategy_case(fn, qkv, dout, truth, tols):
    return check(fwd_bwd(fn, qkv, dout), truth, tols)


def _module_case(s, strategy, dtype, group, inputs, weights, truth):
    """The layer in `dtype` with the given weights vs its fp64 truth: y, dx and the weight
    gradients, each under the bf16 layer bound (tests/test_upipe.py) or fp32's."""
    x, dy, pos = inputs
    layer = upipe.ContextParallelAttention(
        s["D"], s["H"], s["G"], s["d"], group=group, strategy=strategy, device=x.device, dtype=dtype
    )
    projs = (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj)
    with torch.no_grad():
        for p, t in zip(projs, weights, strict=True):
            p.weight.copy_(t)
    x = x.to(dtype, copy=True).requires_grad_()  # a leaf of its own (fp32: not the input)
    y = layer(x, pos)
    y.backward(dy.to(dtype))
    got = [y.detach(), x.grad, *(p.weight.grad for p in projs)]
    return check(got, truth, [TOL[dtype]["bwd"]] * len(got))


class _Kernel(torch.autograd.Function):
    """The local kernel (default backend) on the full sequence, causal: one device's result."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = attention_forward(q, k, v, causal=True)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        return attention_backward(dout, *ctx.saved_tensors, causal=True)


def _layer_fp64(x, pos, wq, wk, wv, wo, d):
    """Llama attention layer in fp64: projections, RoPE (HF convention), causal attention."""
    B, S, _ = x.shape
    cos, sin = rope_cos_sin(pos, d, dtype=torch.float64)
    q, k, v = ((x @ w.t()).view(B, S, -1, d) for w in (wq, wk, wv))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return attention_fp64(q, k, v, True).flatten(2) @ wo.t()


# --- 3. the tracker vs the allocator ----------------------------------------------------


def check_tracker(device, s):
    """An outer tracker sees a large buffer, freed before an inner tracker wraps a UPipe
    layer's fwd+bwd: each must report its own region's peak (the inner's reset must not
    wipe the outer's), and the inner's CUDA peaks must equal the raw counters."""
    cuda = device.type == "cuda"
    with fake_process_group(1) as group:
        layer = _layer(s, group, "upipe", device)
        x, dy, pos = _inputs(s["S"], s["D"], device)
        with upipe.MemoryTracker(device) as warm:  # first use: cuBLAS workspaces, autotuning
            layer(x, pos).backward(dy)
        big = 2 * warm.peak_bytes // 2**21 * 2**21 + 2**21  # above the layer's peak, 2 MiB units
        if cuda:
            torch.cuda.empty_cache()
        with upipe.MemoryTracker(device) as outer:
            buf = torch.empty(big, dtype=torch.uint8, device=device)
            del buf
            base = torch.cuda.memory_allocated(device) if cuda else 0
            with upipe.MemoryTracker(device) as inner:
                layer(x, pos).backward(dy)
            if cuda:  # the inner region's raw counters (not reset since it began)
                raw = [torch.cuda.max_memory_allocated(device) - base]
                raw.append(torch.cuda.max_memory_reserved(device) - base)
    res = dict(
        big_bytes=big,
        tracker=inner.peak_bytes,
        tracker_outer=outer.peak_bytes,
        cuda_alloc=inner.cuda_peak_bytes,
        cuda_reserved=inner.cuda_reserved_peak_bytes,
        cuda_alloc_outer=outer.cuda_peak_bytes,
    )
    ok = outer.peak_bytes == max(big, inner.peak_bytes)
    if cuda:
        res.update(raw_max_alloc=raw[0], raw_max_reserved=raw[1])
        res["tracker/alloc"] = inner.peak_bytes / inner.cuda_peak_bytes
        ok &= [inner.cuda_peak_bytes, inner.cuda_reserved_peak_bytes] == raw
        ok &= outer.cuda_peak_bytes == max(big, inner.cuda_peak_bytes)
    return [{**res, "ok": ok}]


def _layer(s, group, strategy, device):
    """A bf16 attention layer of shape `s`; UPipe with U heads per stage on the 8-rank job."""
    U_kw = {"heads_per_stage": U} if strategy == "upipe" and group.size() == GPUS else {}
    return upipe.ContextParallelAttention(
        s["D"],
        s["H"],
        s["G"],
        s["d"],
        group=group,
        strategy=strategy,
        device=device,
        dtype=torch.bfloat16,
        **U_kw,
    )


def _inputs(L, D, device):
    """x, dy `[1, L, D]` in bf16 and the positions `[1, L]`."""
    x = torch.randn(1, L, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    return x, torch.randn_like(x), torch.arange(L, device=device)[None]


# --- 4. one rank of the 8-GPU job -------------------------------------------------------


def check_rank(device, s):
    L = s["S"] // GPUS
    sh = LayerShape(B=1, L=L, D=s["D"], H=s["H"], G=s["G"], d=s["d"], C=GPUS, elem_bytes=2)
    rows = []
    for strategy in ("ulysses", "upipe"):
        units = ulysses_peak_units(sh) if strategy == "ulysses" else upipe_peak_units(sh, U)
        case = dict(strategy=strategy, S=s["S"], L=L)
        rows.append(row(case, _rank_case, s, strategy, L, device, round(units * sh.unit_bytes)))
    return rows


def _rank_case(s, strategy, L, device, formula):
    simulated = _simulate(s, strategy, L)
    mem = _measure(s, strategy, L, device)
    res = {
        "formula": formula,
        "simulated": simulated,
        "tracker": mem.peak_bytes,
        "cuda_alloc": mem.cuda_peak_bytes,
        "cuda_reserved": mem.cuda_reserved_peak_bytes,
        "tracker/formula": mem.peak_bytes / formula,
    }
    if mem.cuda_peak_bytes is not None:
        res["alloc/simulated"] = mem.cuda_peak_bytes / simulated
        res["reserved/simulated"] = mem.cuda_reserved_peak_bytes / simulated
    return res


def _simulate(s, strategy, L):
    """The planner's prediction: rank 0 of the layer under fake tensors and the fake process
    group, with flash-attn's backward workspaces counted (`StepTracker`)."""
    with fake_process_group(GPUS) as group, FakeTensorMode(allow_non_fake_inputs=True):
        layer = _layer(s, group, strategy, "cpu")
        x, dy, pos = _inputs(L, s["D"], "cpu")
        with StepTracker(cuda_workspaces=True, fake=True) as mem:
            layer(x, pos).backward(dy)
    return mem.peak_bytes


def _measure(s, strategy, L, device):
    """The same rank with real device memory: fwd+bwd under `MemoryTracker` after a short
    warm-up (the first call allocates cuBLAS workspaces)."""
    with fake_process_group(GPUS) as group:
        layer = _layer(s, group, strategy, device)
        x, _, pos = _inputs(64, s["D"], device)
        layer(x, pos).sum().backward()
        layer.zero_grad(set_to_none=True)
        x, dy, pos = _inputs(L, s["D"], device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with upipe.MemoryTracker(device) as mem:
            layer(x, pos).backward(dy)
    return mem


# --- 5. speed ---------------------------------------------------------------------------


def check_speed(device, s, deadline):
    rows = []
    for S, reps in zip(s["S"], s["reps"], strict=True):
        L, times = S // GPUS, {}
        for strategy in ("ulysses", "upipe"):
            with fake_process_group(GPUS) as group:
                layer = _layer(s, group, strategy, device)
                x, dy, pos = _inputs(L, s["D"], device)
                step = functools.partial(_fwd_bwd_layer, layer, x, pos, dy)
                times[strategy] = _median_s(step, device, reps, deadline)
        flops = attention_flops(1, S, s["H"] // GPUS, s["d"])
        rows.append(
            dict(
                S=S,
                L=L,
                ulysses_s=times["ulysses"],
                upipe_s=times["upipe"],
                **{"upipe/ulysses": times["upipe"] / times["ulysses"]},
                attn_tflops_ulysses=flops / times["ulysses"] / 1e12,
            )
        )
    return rows


def _fwd_bwd_layer(layer, x, pos, dy):
    layer(x, pos).backward(dy)


def _median_s(fn, device, reps, deadline):
    """Median seconds of fn() after one warm-up call (CUDA events on a GPU); fewer
    repetitions when the warm-up says they would run past `deadline`."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if time.monotonic() + times[-1] > deadline:
            break
    return statistics.median(times)


# --- driver -----------------------------------------------------------------------------


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, int) and abs(v) >= 2**20:
        return f"{v / 2**30:.3f}G"
    return "-" if v is None else str(v)


def print_table(name, result, elapsed):
    print(f"\n== {name} ({elapsed:.1f} s)")
    if isinstance(result, dict):  # the part failed as a whole
        print(result["error"])
        return
    cols = list(dict.fromkeys(k for r in result for k in r if k != "error"))
    cells = [
        [_fmt(r.get(c)) if c != "ok" else "ok" if r[c] else "FAIL" for c in cols] for r in result
    ]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for r, x in zip(result, cells, strict=True):
        line = "  ".join(c.rjust(w) for c, w in zip(x, widths, strict=True))
        print(line + (f"  {r['error']}" if "error" in r else ""))


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="small sizes (always on CPU)")
    p.add_argument("--out", help="write the JSON document here")
    p.add_argument("--budget-s", type=float, default=450.0, help="skip parts started later")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sizes = SIZES["quick" if a.quick or device.type == "cpu" else "full"]
    doc = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "platform": platform.platform(),
        "attention_backend_bf16": default_backend(device, torch.bfloat16),  # parts 3-5
        "sizes": sizes,
        "estimate_s": estimate_s(sizes),
        "note": "parts 4-5 run one rank under the fake process group: communication is free",
    }
    t_start = time.monotonic()
    deadline = t_start + a.budget_s
    parts = {
        "kernels": lambda: check_kernels(device, sizes["kernel"]),
        "strategies": lambda: check_strategies(device, sizes["strategy"]),
        "tracker": lambda: check_tracker(device, sizes["tracker"]),
        "rank": lambda: check_rank(device, sizes["rank"]),
        "speed": lambda: check_speed(device, sizes["speed"], deadline),
    }
    for name, fn in parts.items():
        t0 = time.monotonic()
        try:
            if t0 > deadline:
                raise TimeoutError(f"skipped: past the --budget-s of {a.budget_s:.0f} s")
            doc[name] = fn()
        except Exception as e:
            doc[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"}
        doc[f"{name}_elapsed_s"] = time.monotonic() - t0
        print_table(name, doc[name], doc[f"{name}_elapsed_s"])
        if a.out:
            with open(a.out, "w") as f:
                json.dump(doc, f, indent=1)
    estimate = ", ".join(f"{k} {v:.3g} s" for k, v in doc["estimate_s"].items())
    print(f"\ntotal {time.monotonic() - t_start:.1f} s; attention at 350 TFLOP/s: {estimate}")


if __name__ == "__main__":
    main()
