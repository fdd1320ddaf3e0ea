"""The GPU test machine's one prepared command: upipe's CUDA paths checked exact, then timed.

    PYTHONPATH=src python3 benchmarks/gpu_check.py --out $OUT/gpu_check.json  # one H200, < 8 min
    PYTHONPATH=src python3 benchmarks/gpu_check.py --dry-run --out /tmp/dry.json  # CPU, tiny
    PYTHONPATH=src python3 benchmarks/gpu_check.py --estimate  # the time budget; runs nothing

docs/gpu.md says how it runs on our GPU test machine (one H200, torch 2.11 with CUDA 13, no
installs, no internet) and how its output becomes that page's tables.

Parts, in this order, each in a time box (`BOX`: shares of `--budget-s`):
1. exact       every CUDA kernel that can run here (flash, cudnn, efficient, flash_attn, fa3,
               fa4) vs float64 at small shapes: fp16 and bf16 (and fp32 for efficient),
               causal and not, MHA and GQA, forward and backward.
2. strategies  ulysses, upipe, ring, usp (a 1 x 1 mesh) and the layer
               `ContextParallelAttention` (upipe, ulysses, ring) on a real one-rank process
               group (NCCL) under each kernel, bf16 and fp32, dense and packed documents, vs
               float64 (the tolerances of tests/helpers/tolerances.py).
3. kernels     forward and backward TFLOP/s of each kernel at Llama3-8B's per-rank attention
               shapes in an 8-GPU job (`SIZES`: Ulysses' at 128K tokens, a UPipe stage's at
               128K and 1M), each call also checked against float64 on sampled rows
               (`sampled_truth`).
4. layer       the fused UPipe layer (U = 8) vs Ulysses: one rank of the 8-GPU job at 128K
               and 1M tokens under the fake process group (every buffer allocated as on that
               rank, no communication): fwd+bwd time, max_memory_allocated / reserved, the
               tracker's peak and the planner's prediction.
5. block       one Llama3-8B decoder block (UPipe attention) with activation checkpointing
               and its input offloaded to host memory, vs the plain block: the same results
               on a one-rank group; time, peak memory, what forward keeps on the device and
               the copies' rates at the 1M-token job's rank.

A row that cannot run -- a kernel whose package is missing, an out-of-memory, any error -- is
recorded with its reason and the next row runs; one that no longer fits its part's box is
recorded as skipped. The JSON is rewritten (atomically) after every row, `<out>.md` (the
table rows for docs/gpu.md) with it, so a run cut short keeps what it measured; a watchdog
ends the run `--grace-s` after the budget, writing where it stopped: BUDGET_S + GRACE_S after
main() starts, which with the imports before it stays under LIMIT_S, 8 minutes.

Time budget (`estimate_s`, `--estimate`): a part's seconds are its FLOPs over published rates
(`RATES`; an H200 computes as fast as an H100), plus `ROW_S` per row of parts 1-2 and
`STARTUP_S`, allowances for what FLOPs do not count. While it runs, each kernel's measured /
predicted ratio rescales its later predictions, so the 1M-token rows are sized from the
128K ones.

`--dry-run`: every part's code on the CPU at tiny sizes, in seconds: the CUDA-only aten ops
through the test suite's CPU emulations of their contracts (tests/helpers/cuda_emulation.py,
cudnn_emulation.py, varlen_emulation.py, flash_impl_emulation.py with its stand-in FA3/FA4
packages; fp32 math on full score matrices), gloo for NCCL, host timers for CUDA events, the
tracker alone for the allocator's counters, the offloader's plain host copies for its CUDA
streams and page-locked arena. It proves that the script runs end to end and judges what it
should (every row, table, time box and the watchdog); its times and rates mean nothing.

Legend: B batch, S the job's sequence (all ranks), C = 8 ranks, L = S / C tokens per rank, D
width, H query heads, G kv heads, h / g query / kv heads in one kernel call, d head dim, F MLP
width, U heads per UPipe stage, R sampled rows, T tail keys.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import functools
import importlib.metadata
import json
import os
import pathlib
import platform
import statistics
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
from torch._subclasses import FakeTensorMode

import upipe
from upipe import kernels_select
from upipe.attention.registry import get_strategy
from upipe.kernels import attention_backward, attention_forward, check_kernel
from upipe.kernels_select import CUDA_KERNELS, IMPL, active_flash_impl, kernel_problem
from upipe.memory.model import LayerShape, ulysses_peak_units, upipe_peak_units
from upipe.memory.simulate import fake_process_group
from upipe.model.config import ModelConfig, get_config
from upipe.model.llama import CausalLM
from upipe.planner.step import StepTracker
from upipe.planner.timing import H200
from upipe.rope import apply_rope, rope_cos_sin
from upipe.train.parallelize import ContextParallel, MemoryFeatures, make_offloader, parallelize

C, U = 8, 8  # the job: ranks, and UPipe's heads per stage (1 query head per rank per stage)
LLAMA3_8B = get_config("llama3-8b", n_layers=1, vocab_size=256)  # one block, tiny vocabulary
TINY = ModelConfig(  # the same head counts (U = 8 on 8 ranks runs alike), tiny widths
    vocab_size=256, hidden_size=256, n_layers=1, n_heads=32, n_kv_heads=8, head_dim=8, ffn_dim=512
)
SIZES = {
    "full": dict(
        exact=dict(B=2, S=2048, H=8, d=128),
        strategies=dict(B=2, S=2048, D=1024, H=8, G=2, d=128),
        # (job tokens S, q heads h, kv heads g, timed repeats): per rank of Llama3-8B (H = 32,
        # G = 8) on C = 8, Ulysses attends over all S tokens with H/C = 4 query heads and
        # G/C = 1 kv head; a UPipe stage (U = 8) with U/C = 1 query head and its kv head
        kernels=dict(
            shapes=((2**17, 4, 1, 5), (2**17, 1, 1, 5), (2**20, 1, 1, 3)), d=128, R=32, T=32
        ),
        layer=dict(jobs=((2**17, 5), (2**20, 2)), model=LLAMA3_8B),  # (S, timed repeats)
        block=dict(S=2**20, check_L=8192, model=LLAMA3_8B),
    ),
    "dry": dict(
        exact=dict(B=2, S=64, H=4, d=16),
        strategies=dict(B=2, S=64, D=64, H=4, G=2, d=16),
        kernels=dict(shapes=((256, 4, 1, 2), (256, 1, 1, 2), (512, 1, 1, 1)), d=16, R=8, T=8),
        layer=dict(jobs=((512, 2), (1024, 1)), model=TINY),
        block=dict(S=1024, check_L=64, model=TINY),
    ),
}
PARTS = ("exact", "strategies", "kernels", "layer", "block")
BOX = dict(exact=0.10, strategies=0.16, kernels=0.24, layer=0.28, block=0.17)
"""Each part's time box, as a share of `--budget-s` (the remaining 5%: the last row's overrun)."""
LIMIT_S = 480.0  # the whole command on one H200 (issue 26: under 8 minutes)
BUDGET_S, GRACE_S = 430.0, 20.0  # the boxes' total, and the watchdog after it: both from main()

# Budget rates, FLOP/s (forward, backward), bf16, causal, d = 128, long sequences, on an H100
# (an H200 computes alike: upipe.planner.timing.H200). Published, or assumed where said:
RATES = {
    "flash": (335e12, 300e12),  # torch's FA2: FlashAttention-3 paper (arXiv 2407.08608),
    "flash_attn": (335e12, 300e12),  # as upipe.planner.timing.H100; flash-attn 2: the same
    "cudnn": (540e12, 516e12),  # cuDNN 9 attention, as issue 26 quotes it
    "fa3": (616e12, 540e12),  # FlashAttention-3 paper, causal, d = 128
    "fa4": (616e12, 540e12),  # assumed FA3's (no published sm90 figure at hand)
    "efficient": (200e12, 180e12),  # assumed 0.6x FA2 (FA2 paper: xformers' kernel on A100)
    "cpu": (1e10, 1e10),  # the dry run's kernel: a placeholder, rescaled by measurement
}
GEMM = H200.gemm  # bf16 GEMM FLOP/s (upipe.planner.timing: the datasheet's x 0.66)
HOST_LINK = H200.host_link  # page-locked host <-> device bytes/s (PCIe Gen5, ~50 GB/s)
ROW_S = 0.5  # allowance per row of parts 1-2: launches, first calls, cuDNN graph builds
STARTUP_S = 20.0  # allowance: imports before main(), the CUDA context, NCCL's start

# Relative error bounds, from tests/helpers/tolerances.py (TOL, bf16_bound, REL_ERR_FLOOR): fp32
# 1e-5; a
# half-precision kernel under 1.5e-2 forward and 5e-2 backward; a strategy in half precision
# at most 2x as wrong as one device running the same kernel (floor 1e-3); a layer in bf16
# under 5e-2 in every output (tests/distributed/test_upipe.py::test_module_bf16_as_good_as_ulysses).
TOL = {"fp32": (1e-5, 1e-5), "half": (1.5e-2, 5e-2)}
HALF_FACTOR, HALF_FLOOR = 2.0, 1e-3
REL_ERR_FLOOR = {torch.float32: 1e-2, torch.float16: 1e-1, torch.bfloat16: 1e-1}


# --- FLOPs and the time budget -----------------------------------------------------------------


def attention_flops(S: int, h: int, d: int, B: int = 1) -> tuple[float, float]:
    """(forward, backward) FLOPs of causal attention over S tokens with h query heads, one
    multiply-add = 2 FLOPs. Forward: Q K^T and P V, 2 S^2 d each per head, halved by the
    causal mask: 2 B h S^2 d. Backward: five such products (Q K^T recomputed, dV = P^T dO,
    dP = dO V^T, dQ = dS K, dK = dS^T Q), 2.5 times the forward (FlashAttention's count)."""
    forward = 2.0 * B * h * S * S * d
    return forward, 2.5 * forward


def gemm_flops(L: int, cfg: ModelConfig, mlp: bool) -> float:
    """fwd+bwd FLOPs of a block's matrix products on L tokens: the forward's projections
    2 L D (2 H + 2 G) d (q, k, v, o) and with `mlp` the MLP's 3 x 2 L D F; backward twice
    the forward (dx and dW)."""
    D, F = cfg.hidden_size, cfg.ffn_dim
    fwd = 2 * L * D * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    return 3 * (fwd + (3 * 2 * L * D * F if mlp else 0))


def attention_s(kernel: str, S: int, h: int, d: int, forwards: int = 1) -> float:
    """Seconds of causal attention fwd+bwd at `RATES` (`forwards` = 2: recomputed once)."""
    (rate_f, rate_b), (fwd, bwd) = RATES[kernel], attention_flops(S, h, d)
    return forwards * fwd / rate_f + bwd / rate_b


def layer_s(kernel: str, S: int, cfg: ModelConfig) -> float:
    """Seconds of one rank's attention layer fwd+bwd in the C-rank job of S tokens."""
    attention = attention_s(kernel, S, cfg.n_heads // C, cfg.head_dim)
    return attention + gemm_flops(S // C, cfg, mlp=False) / GEMM


def block_s(kernel: str, S: int, cfg: ModelConfig, checkpointed: bool) -> float:
    """Seconds of one rank's decoder block fwd+bwd; checkpointed: its forward once more (a
    third more matrix work) and the input's copy to the host and back (`upipe.model.offload`;
    the norm's second fetch not counted)."""
    L, again = S // C, int(checkpointed)
    attention = attention_s(kernel, S, cfg.n_heads // C, cfg.head_dim, forwards=1 + again)
    gemm = gemm_flops(L, cfg, mlp=True) * (1 + again / 3) / GEMM
    return attention + gemm + again * 2 * L * cfg.hidden_size * 2 / HOST_LINK


def estimate_s(sizes: dict, kernels=("flash", "cudnn", "efficient"), auto="cudnn") -> dict:
    """Predicted seconds per part: each row the part runs at `RATES`, `GEMM` and `HOST_LINK`,
    for `kernels` (those on our H200: fa3, fa4, flash_attn are not installed) and the
    layer's and block's kernel `auto` (auto's choice on sm90 without FA3)."""
    n_exact = sum(4 * (3 if k == "efficient" else 2) for k in kernels)  # dtypes x causal x G
    n_strategies = 2 * 7 * (len(kernels) + 1)  # (dense, docs) x strategies x (bf16..., fp32)
    sk, sl, sb = sizes["kernels"], sizes["layer"], sizes["block"]
    kernel_runs = [
        (1 + n) * attention_s(k, S, h, sk["d"]) for k in kernels for S, h, _, n in sk["shapes"]
    ]
    return {
        "startup": STARTUP_S,
        "exact": n_exact * ROW_S,
        "strategies": n_strategies * ROW_S,
        "kernels": sum(kernel_runs),
        "layer": sum(2 * (1 + n) * layer_s(auto, S, sl["model"]) for S, n in sl["jobs"]),
        "block": sum(block_s(auto, sb["S"], sb["model"], ck) for ck in (False, True)),
    }


class Budget:
    """The run's deadline, the current part's box, and predictions rescaled by measurement:
    `slow[kernel]` = measured / predicted seconds of that kernel's last timed work."""

    def __init__(self, total_s: float):
        self.start = time.monotonic()
        self.total_s, self.end = total_s, self.start + total_s
        self.part_end, self.slow = self.end, {}

    def open(self, part: str) -> None:
        self.part_end = min(time.monotonic() + BOX[part] * self.total_s, self.end)

    def left(self) -> float:
        return self.part_end - time.monotonic()

    def predict(self, kernel: str, seconds: float) -> float:
        return seconds * self.slow.get(kernel, 1.0)

    def observe(self, kernel: str, predicted: float, measured: float) -> None:
        self.slow[kernel] = measured / predicted

    def runs(self, one_s: float, want: int) -> int:
        """How many runs of `one_s` seconds, up to `want`, still fit in the part's box."""
        return max(0, min(want, int(self.left() / max(one_s, 1e-9))))

    def skip(self, need_s: float) -> str | None:
        """Why work of `need_s` seconds is not started (the box would overflow), or None."""
        if need_s <= self.left():
            return None
        return f"time box: needs ~{need_s:.3g} s, {max(self.left(), 0):.3g} s left in the part"


# --- the run: report, clock, rows --------------------------------------------------------------


class Run:
    """What the parts share: the device and sizes, the budget, auto's bf16 kernel, and the
    JSON document -- rewritten atomically, with its Markdown beside it, after every row (one
    lock orders the rows and the watchdog's last write)."""

    def __init__(self, device, sizes, budget, auto, path, doc):
        self.device, self.sizes, self.budget, self.auto = device, sizes, budget, auto
        self.cuda = device.type == "cuda"
        self.path, self.doc, self.lock, self.part = path, doc, threading.Lock(), None

    def open(self, part: str) -> None:
        self.part = part
        self.budget.open(part)
        with self.lock:
            self.doc["parts"][part] = {"rows": []}
        print(f"\n== {part}", flush=True)

    def add(self, case: dict, fn=None, need_s: float = 0.0, skipped: str | None = None) -> dict:
        """Record `case` with fn()'s results; skipped (with why) if `need_s` seconds no longer
        fit in the part's box; with the error if fn raises (after an out-of-memory the
        allocator's cache is emptied for the next row). Torch's FA2 is restored after."""
        skipped, oom = skipped or self.budget.skip(need_s), False
        if skipped:
            r = {**case, "skipped": skipped}
        else:
            try:
                r = {**case, **fn()}
            except Exception as e:
                oom = isinstance(e, torch.cuda.OutOfMemoryError)
                r = {**case, "ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        if oom:  # (once the exception and the frames holding its tensors are gone)
            torch.cuda.empty_cache()
        restore_impl()
        with self.lock:
            self.doc["parts"][self.part]["rows"].append(r)
            self.save()
        took = time.monotonic() - self.budget.start
        print(f"[{took:6.1f} s] " + "  ".join(f"{k}={_fmt(v)}" for k, v in r.items()), flush=True)
        return r

    def close(self, **fields) -> None:
        with self.lock:
            self.doc["parts"][self.part].update(fields)
            self.save()

    def save(self) -> None:
        """Write the JSON and the Markdown (callers hold the lock)."""
        if self.path is None:
            return
        for path, text in (
            (self.path, json.dumps(self.doc, indent=1)),
            (md_path(self.path), markdown(self.doc)),
        ):
            with open(f"{path}.tmp", "w") as f:
                f.write(text)
            os.replace(f"{path}.tmp", path)

    def time(self, fn):
        """(fn(), seconds): CUDA events around it on a GPU (the work it queued on the
        stream), the host's clock on the CPU."""
        if not self.cuda:
            t0 = time.perf_counter()
            return fn(), time.perf_counter() - t0
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end) / 1e3

    def kernels(self, d: int) -> list[str]:
        """The CUDA kernels that run bf16 attention of head dim d here, torch's flash impls
        last (activating one reroutes torch's flash ops process-wide until `restore_impl`);
        a skipped row for each other one, with why."""
        order = sorted(CUDA_KERNELS, key=lambda k: k in IMPL)
        why = {k: kernel_problem(k, self.device, torch.bfloat16, d) for k in order}
        for k in order:
            if why[k]:
                self.add({"kernel": k}, skipped=why[k])
        return [k for k in order if why[k] is None]


def md_path(json_path: str) -> str:
    p = pathlib.Path(json_path)
    return str(p.with_suffix(".md") if p.suffix == ".json" else p.with_name(p.name + ".md"))


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else "-" if v is None else str(v)


def restore_impl() -> None:
    """Torch's own FA2 again after an fa3/fa4 row, and upipe's choices forgotten (where this
    torch cannot, later flash rows say why: the impl is still active)."""
    restore = getattr(torch.nn.attention, "restore_flash_attention_impl", None)
    if active_flash_impl() is not None and restore is not None:
        restore()
        kernels_select.forget()


# --- numerics shared by the parts ---------------------------------------------------------------


def randn(*shape, device, seed, dtype=torch.float32):
    """Normal values drawn on `device` from `seed` (fresh inputs for every check)."""
    gen = torch.Generator(device).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=device, dtype=dtype)


def rel_err(a, ref) -> float:
    """max|a - ref| / max(max|ref|, floor): tests/helpers/tolerances.py's rel_err."""
    floor = REL_ERR_FLOOR.get(a.dtype, REL_ERR_FLOOR[torch.float32])
    ref = ref.double()
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(floor)).item()


def judge(got, truth, bounds) -> dict:
    """Errors of `got` (out, then gradients) vs `truth`, and the worst error / bound."""
    errs = [rel_err(a, r) for a, r in zip(got, truth, strict=True)]
    worst = max(e / b for e, b in zip(errs, bounds, strict=True))
    return dict(err_out=errs[0], err_grads=max(errs[1:]), err_over_tol=worst, ok=worst <= 1)


def tols(dtype, n: int = 4) -> list[float]:
    """The kernel bounds for out and n - 1 gradients in `dtype`."""
    fwd, bwd = TOL["fp32" if dtype == torch.float32 else "half"]
    return [fwd] + [bwd] * (n - 1)


def attention_fp64(q, k, v, causal=True, bounds=None):
    """softmax(q k^T / sqrt(d)) v in fp64, q `[B, S, H, d]`, k/v `[B, S, G, d]` (query head j
    uses kv head j // (H / G)); `bounds`: packed documents (0, e_1, ..., S), each query sees
    only its own document's keys."""
    H, G, S = q.shape[2], k.shape[2], q.shape[1]
    k, v = (t.double().repeat_interleave(H // G, 2) for t in (k, v))
    s = torch.einsum("bshd,bthd->bhst", q.double(), k) / q.shape[-1] ** 0.5
    seen = torch.ones(S, S, dtype=torch.bool, device=q.device)
    seen = seen.tril() if causal else seen
    if bounds is not None:
        doc = torch.bucketize(
            torch.arange(S, device=q.device),
            torch.tensor(bounds[1:-1], device=q.device),
            right=True,
        )
        seen &= doc[:, None] == doc[None, :]
    return torch.einsum("bhst,bthd->bshd", s.masked_fill(~seen, float("-inf")).softmax(-1), v)


def grads_fp64(fn, inputs, dout):
    """fn(*inputs) in fp64 and its gradients w.r.t. the inputs: the ground truth."""
    leaves = [t.double().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(dout.double())
    return [out.detach(), *(t.grad for t in leaves)]


def fwd_bwd(fn, leaves, dout):
    """fn(*leaves) and the gradients of <out, dout> w.r.t. the leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach(), *(t.grad for t in leaves)]


def kernel_fwd_bwd(kernel, q, k, v, dout, causal=True):
    """The kernel's (out, dq, dk, dv), its backward from the saved out and lse."""
    out, lse = attention_forward(q, k, v, causal=causal, backend=kernel)
    return (out, *attention_backward(dout, q, k, v, out, lse, causal=causal, backend=kernel))


# --- 1. kernels vs float64 ---------------------------------------------------------------------


def part_exact(run: Run) -> None:
    s, dev = run.sizes["exact"], run.device
    half = (torch.bfloat16, torch.float16)
    kernels = run.kernels(s["d"])
    for causal in (True, False):
        for G in (s["H"], s["H"] // 4):
            shapes = [(s["B"], s["S"], n, s["d"]) for n in (s["H"], G, G, s["H"])]
            inputs = [randn(*sh, device=dev, seed=i) for i, sh in enumerate(shapes)]
            attn = functools.partial(attention_fp64, causal=causal)
            truth = grads_fp64(attn, inputs[:3], inputs[3])
            for kernel in kernels:
                for dtype in (torch.float32, *half) if kernel == "efficient" else half:
                    case = dict(kernel=kernel, dtype=str(dtype)[6:], causal=causal, H=s["H"], G=G)
                    qkvo = [t.to(dtype) for t in inputs]
                    run.add(case, functools.partial(_exact_case, kernel, qkvo, causal, truth))


def _exact_case(kernel, qkvo, causal, truth):
    return judge(kernel_fwd_bwd(kernel, *qkvo, causal=causal), truth, tols(qkvo[0].dtype))


# --- 2. strategies on one rank -----------------------------------------------------------------


@contextlib.contextmanager
def one_rank_group(device):
    """A real process group of one rank (NCCL on CUDA, gloo on the CPU), destroyed after."""
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def part_strategies(run: Run) -> None:
    """At one rank every sequence layout is the identity: full tensors go in and come out.
    One set of inputs (and its fp64 truth) per case of documents, judged under every kernel."""
    s, S = run.sizes["strategies"], run.sizes["strategies"]["S"]
    cases = [(k, torch.bfloat16) for k in run.kernels(s["d"])] + [("efficient", torch.float32)]
    with one_rank_group(run.device) as group:
        mesh = upipe.make_mesh(ulysses=1, ring=1, device_type=run.device.type)
        for docs in (None, (0, S // 4, S // 4 + S // 8, S)):  # 3 documents: S/4, S/8, 5S/8
            qkv = _qkv_truth(run.device, s, docs)
            layer = _layer_truth(run.device, s, docs)
            for kernel, dtype in cases:
                case = dict(kernel=kernel, dtype=str(dtype)[6:], documents=docs is not None)
                _strategy_rows(run, case, kernel, dtype, group, mesh, docs, *qkv)
                for strategy in ("upipe", "ulysses", "ring"):
                    run.add(
                        {**case, "strategy": f"module {strategy}"},
                        functools.partial(
                            _module_case, s, strategy, kernel, dtype, group, docs, *layer
                        ),
                    )


def _qkv_truth(device, s, docs):
    B, S, H, G, d = (s[n] for n in ("B", "S", "H", "G", "d"))
    inputs = [randn(B, S, n, d, device=device, seed=20 + i) for i, n in enumerate((H, G, G, H))]
    fn = functools.partial(attention_fp64, causal=True, bounds=docs)
    return inputs, grads_fp64(fn, inputs[:3], inputs[3])


def _strategy_rows(run, case, kernel, dtype, group, mesh, docs, inputs, truth):
    """Each functional strategy vs the fp64 truth; in half precision at most HALF_FACTOR
    times as wrong as one device running the kernel, one call per document
    (conftest.bf16_bound)."""
    q, k, v, dout = (t.to(dtype) for t in inputs)
    bounds = tols(dtype)
    if dtype != torch.float32:
        edges = docs or (0, q.shape[1])
        parts = [
            kernel_fwd_bwd(kernel, *(t[:, a:b] for t in (q, k, v, dout)))
            for a, b in zip(edges, edges[1:], strict=False)
        ]
        one = [torch.cat(ts, 1) for ts in zip(*parts, strict=True)]
        bounds = [
            max(HALF_FACTOR * rel_err(a, r), HALF_FLOOR) for a, r in zip(one, truth, strict=True)
        ]
    kw = dict(backend=kernel, cu_seqlens=docs)
    fns = {
        "ulysses_attention": lambda q, k, v: upipe.ulysses_attention(q, k, v, group=group, **kw),
        "upipe_attention": lambda q, k, v: upipe.upipe_attention(q, k, v, group=group, **kw),
        "ring_attention": lambda q, k, v: upipe.ring_attention(q, k, v, group=group, **kw),
        "usp_attention": lambda q, k, v: upipe.usp_attention(q, k, v, mesh=mesh, **kw),
    }
    for name, fn in fns.items():
        run.add(
            {**case, "strategy": name},
            lambda fn=fn: judge(fwd_bwd(fn, (q, k, v), dout), truth, bounds),
        )


def _layer_truth(device, s, docs):
    """Layer inputs and weights drawn in fp32, and the layer's fp64 truth."""
    B, S, H, G, d, D = (s[n] for n in ("B", "S", "H", "G", "d", "D"))
    x, dy = randn(B, S, D, device=device, seed=30), randn(B, S, D, device=device, seed=31)
    pos = (
        torch.arange(S, device=device)
        if docs is None
        else upipe.document_positions(docs, S, device=device)
    )
    pos = pos.expand(B, S)
    w = [randn(n * d, D, device=device, seed=32 + i) / D**0.5 for i, n in enumerate((H, G, G))]
    w.append(randn(D, H * d, device=device, seed=35) / (H * d) ** 0.5)
    truth = grads_fp64(lambda x, *w: _layer_fp64(x, pos, *w, d=d, docs=docs), (x, *w), dy)
    return (x, dy, pos), w, truth


def _layer_fp64(x, pos, wq, wk, wv, wo, *, d, docs):
    """Llama attention layer in fp64: projections, RoPE (HF convention), causal attention."""
    B, S, _ = x.shape
    cos, sin = rope_cos_sin(pos, d, dtype=torch.float64)
    q, k, v = ((x @ w.t()).view(B, S, -1, d) for w in (wq, wk, wv))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return attention_fp64(q, k, v, True, docs).flatten(2) @ wo.t()


def _module_case(s, strategy, kernel, dtype, group, docs, inputs, weights, truth):
    """The layer in `dtype` with the given weights vs its fp64 truth: y, dx and the weight
    gradients, each under the kernel's backward bound (fp32's, or the bf16 layer bound)."""
    x, dy, pos = inputs
    layer = upipe.ContextParallelAttention(
        s["D"], s["H"], s["G"], s["d"], group=group, strategy=strategy, backend=kernel,
        layout="contiguous", device=x.device, dtype=dtype,
    )  # fmt: skip
    projs = (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj)
    with torch.no_grad():
        for p, t in zip(projs, weights, strict=True):
            p.weight.copy_(t)
    x = x.to(dtype, copy=True).requires_grad_()  # a leaf of its own (fp32: not the input)
    y = layer(x, pos, cu_seqlens=docs)
    y.backward(dy.to(dtype))
    got = [y.detach(), x.grad, *(p.weight.grad for p in projs)]
    return judge(got, truth, [tols(dtype)[-1]] * len(got))


# --- 3. kernel speed at the job's per-rank shapes ----------------------------------------------


def sampled_truth(q, k, v, dout, rows, T):
    """fp64 causal attention on the query rows `rows` (sorted, ending with the last T rows):
    out and dq `[R, h, d]` of those rows, and dk, dv `[T, g, d]` of the last T keys, which
    only the last T queries see (key t is visible to query i iff t <= i). Per query head j
    (kv head j // (h / g)), from its rows of the score matrix only:
        P = softmax(scale Q_r K^T, masked),  O_r = P V,  dP = dO_r V^T,
        dS = P * (dP - rowsum(dO_r * O_r)),  dQ_r = scale dS K,
        dV_tail = P[tail, tail]^T dO_tail,   dK_tail = scale dS[tail, tail]^T Q_tail."""
    S, h, d, g = q.shape[1], q.shape[2], q.shape[3], k.shape[2]
    scale, f64 = d**-0.5, torch.float64
    out, dq = (torch.empty(len(rows), h, d, dtype=f64, device=q.device) for _ in range(2))
    dk, dv = (torch.zeros(T, g, d, dtype=f64, device=q.device) for _ in range(2))
    hidden = torch.arange(S, device=q.device)[None, :] > rows[:, None]
    for j in range(h):
        kv = j // (h // g)
        K, V = k[0, :, kv].to(f64), v[0, :, kv].to(f64)
        Q, dO = q[0, rows, j].to(f64), dout[0, rows, j].to(f64)
        P = (Q @ K.T).mul_(scale).masked_fill_(hidden, float("-inf")).softmax(-1)
        out[:, j] = o = P @ V
        dS = (dO @ V.T).sub_((dO * o).sum(-1, keepdim=True)).mul_(P)
        dq[:, j] = dS @ K * scale
        dv[:, kv] += P[-T:, -T:].T @ dO[-T:]
        dk[:, kv] += dS[-T:, -T:].T @ Q[-T:] * scale
        del P, dS
    return out, dq, dk, dv


def vector_err(a, ref) -> float:
    """The worst relative error of any head vector, max|a - ref| / max|ref| along d: a late
    row's output is ~S^-1/2 of an early one's, so one norm for all would hide its errors."""
    ref = ref.double()
    diff = (a.double() - ref).abs().amax(-1)
    return (diff / ref.abs().amax(-1).clamp_min(1e-30)).max().item()


def part_kernels(run: Run) -> None:
    s, dev = run.sizes["kernels"], run.device
    d = s["d"]
    kernels = run.kernels(d)
    for S, h, g, reps in s["shapes"]:
        pick = torch.randperm(S - s["T"], generator=torch.Generator().manual_seed(S + h))
        rows = torch.cat([pick[: s["R"]].sort().values, torch.arange(S - s["T"], S)]).to(dev)
        shapes = ((1, S, h, d), (1, S, g, d), (1, S, g, d), (1, S, h, d))
        qkvo = [
            randn(*sh, device=dev, seed=40 + i, dtype=torch.bfloat16) for i, sh in enumerate(shapes)
        ]
        truth = sampled_truth(*qkvo, rows, s["T"])
        for kernel in kernels:
            predicted = attention_s(kernel, S, h, d)
            run.add(
                dict(kernel=kernel, S=S, h=h, g=g),
                functools.partial(_speed_case, run, kernel, qkvo, rows, truth, reps, predicted),
                need_s=2 * run.budget.predict(kernel, predicted),  # a warm-up and one timed
            )
        del qkvo, truth


def _speed_case(run, kernel, qkvo, rows, truth, reps, predicted):
    """A warm-up call checked against the sampled truth, then up to `reps` timed forwards and
    backwards (medians); TFLOP/s by `attention_flops`."""
    q, k, v, dout = qkvo
    T = truth[2].shape[0]
    fwd = functools.partial(attention_forward, q, k, v, causal=True, backend=kernel)
    bwd = functools.partial(attention_backward, dout, q, k, v, causal=True, backend=kernel)
    (out, lse), t0 = run.time(fwd)
    (dq, dk, dv), t1 = run.time(functools.partial(bwd, out, lse))
    got = (out[0, rows], dq[0, rows], dk[0, -T:], dv[0, -T:])
    errs = [vector_err(a, r) for a, r in zip(got, truth, strict=True)]
    del out, lse, dq, dk, dv, got
    times = []
    for _ in range(run.budget.runs(t0 + t1, reps)):
        (out, lse), tf = run.time(fwd)
        times.append((tf, run.time(functools.partial(bwd, out, lse))[1]))
        del out, lse
    res = dict(warmup_s=t0 + t1, runs=len(times))
    if times:
        (F, B), f, b = (
            attention_flops(*q.shape[1:]),
            *map(statistics.median, zip(*times, strict=True)),
        )
        res.update(fwd_ms=f * 1e3, fwd_tflops=F / f / 1e12, bwd_ms=b * 1e3, bwd_tflops=B / b / 1e12)
    run.budget.observe(kernel, predicted, f + b if times else t0 + t1)
    return {**res, **judge_errs(errs, tols(torch.bfloat16))}


def judge_errs(errs, bounds) -> dict:
    worst = max(e / b for e, b in zip(errs, bounds, strict=True))
    return dict(err_out=errs[0], err_grads=max(errs[1:]), err_over_tol=worst, ok=worst <= 1)


# --- 4. the layer: UPipe vs Ulysses on one rank of the job -------------------------------------


def _layer(cfg, group, strategy, device):
    """The Llama attention layer of `cfg` in bf16 on `group`; UPipe with U heads per stage,
    without overlap (its default from 128K tokens on: the warm-up at 64 takes the same path)."""
    return upipe.ContextParallelAttention(
        cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, group=group,
        strategy=strategy, heads_per_stage=U if strategy == "upipe" else None, overlap=False,
        rope_theta=cfg.rope_theta, device=device, dtype=torch.bfloat16,
    )  # fmt: skip


def _inputs(L, D, device, seed=50):
    """x, dy `[1, L, D]` bf16 and rank 0's positions `[1, L]` (tokens 0 .. L-1)."""
    x = randn(1, L, D, device=device, seed=seed, dtype=torch.bfloat16).requires_grad_()
    dy = randn(1, L, D, device=device, seed=seed + 1, dtype=torch.bfloat16)
    return x, dy, torch.arange(L, device=device)[None]


def part_layer(run: Run) -> None:
    """Per job length: Ulysses, then UPipe (U = 8), each measured and predicted."""
    cfg, kernel = run.sizes["layer"]["model"], run.auto
    D, H, G, d = cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    for S, reps in run.sizes["layer"]["jobs"]:
        shape = LayerShape(B=1, L=S // C, D=D, H=H, G=G, d=d, C=C, elem_bytes=2)
        ulysses_s = None
        for strategy in ("ulysses", "upipe"):
            predicted = layer_s(kernel, S, cfg)
            r = run.add(
                dict(strategy=strategy, S=S, L=S // C, kernel=kernel),
                functools.partial(
                    _layer_case, run, cfg, strategy, shape, reps, predicted, ulysses_s
                ),
                need_s=2 * run.budget.predict(kernel, predicted),  # the tracked run, one timed
            )
            ulysses_s = r.get("fwd_bwd_s")


def _layer_case(run, cfg, strategy, shape, reps, predicted, ulysses_s):
    """One rank's layer fwd+bwd: a 64-token warm-up, one run under the tracker (the peaks),
    up to `reps` timed runs (median; over `ulysses_s`, Ulysses' time, if given); then the
    closed form and the planner's simulation."""
    with fake_process_group(C) as group:
        layer = _layer(cfg, group, strategy, run.device)
        x, dy, pos = _inputs(64, cfg.hidden_size, run.device)
        layer(x, pos).backward(dy)  # first use: cuBLAS workspaces, kernels loaded
        layer.zero_grad(set_to_none=True)
        x, dy, pos = _inputs(shape.L, cfg.hidden_size, run.device)
        step = lambda: layer(x, pos).backward(dy)
        if run.cuda:
            torch.cuda.empty_cache()
        with upipe.MemoryTracker(run.device) as mem:
            first = run.time(step)[1]
        run.budget.observe(run.auto, predicted, first)
        times = [run.time(step)[1] for _ in range(run.budget.runs(first, reps))]
    units = ulysses_peak_units(shape) if strategy == "ulysses" else upipe_peak_units(shape, U)
    res = dict(
        fwd_bwd_s=statistics.median(times) if times else first,
        runs=len(times),
        tracker=mem.peak_bytes,
        cuda_alloc=mem.cuda_peak_bytes,
        cuda_reserved=mem.cuda_reserved_peak_bytes,
        formula=round(units * shape.unit_bytes),
        planner=_planner(cfg, strategy, shape.L, run.auto),
    )
    for name in ("tracker", "cuda_alloc", "cuda_reserved"):
        if res[name] is not None:
            res[f"{name}/planner"] = res[name] / res["planner"]
    flops = sum(attention_flops(shape.L * C, shape.H // C, shape.d))  # the layer's attention
    res["attention_tflops"] = flops / res["fwd_bwd_s"] / 1e12  # over the whole layer's time
    if ulysses_s is not None:
        res["time/ulysses"] = res["fwd_bwd_s"] / ulysses_s
    return res


def _planner(cfg, strategy, L, kernel) -> int:
    """The planner's prediction of the same rank's peak: the layer under fake tensors and the
    fake process group, `kernel`'s backward workspaces counted (`StepTracker`)."""
    with fake_process_group(C) as group, FakeTensorMode(allow_non_fake_inputs=True):
        layer = _layer(cfg, group, strategy, "cpu")
        x, dy, pos = _inputs(L, cfg.hidden_size, "cpu")
        with StepTracker(cuda_workspaces=True, fake=True, attention_kernel=kernel) as mem:
            layer(x, pos).backward(dy)
    return mem.peak_bytes


# --- 5. an offloaded checkpointed block --------------------------------------------------------


def _block_model(cfg, group, device):
    """A one-block `CausalLM` of `cfg` in bf16, its attention UPipe over `group` as
    `upipe train` swaps it in (`parallelize`): U = 8 on 8 ranks, U = C else; no overlap."""
    with torch.device(device):
        model = CausalLM(cfg).to(torch.bfloat16)
    size = dist.get_world_size(group)
    cp = ContextParallel(spec=get_strategy("upipe"), size=size, group=group)
    parallelize(model, cp, heads_per_stage=U if size == C else None)
    model.model.layers[0].self_attn.overlap = False  # (as `_layer`)
    return model


def _features(model, offloaded: bool) -> None:
    """Plain, or activation checkpointing with the block input offloaded: what the trainer's
    `apply_memory_features` sets on CUDA (set here on the CPU too, where its copies are
    plain host copies)."""
    model.recompute_blocks = int(offloaded)
    on = MemoryFeatures(activation_checkpoint=True, offload=True)
    model.offload = make_offloader(len(model.model.layers), on) if offloaded else None


def _block_step(model, ids, pos, dy, mem=None) -> dict:
    """fwd+bwd of the block (its output y, the final norm's); with a tracker `mem`, the
    bytes that forward left for backward (live after forward, y itself not counted)."""
    y = model.hidden(ids, pos)
    kept = None if mem is None else mem.current_bytes - y.nbytes
    y.backward(dy)
    return {"y": y.detach(), "kept": kept}


def part_block(run: Run) -> None:
    s, kernel = run.sizes["block"], run.auto
    cfg, L = s["model"], s["S"] // C
    run.add(
        dict(check="offloaded vs plain, one rank", L=s["check_L"]),
        lambda: _block_check(run, cfg, s["check_L"]),
    )
    with fake_process_group(C) as group:
        model = _block_model(cfg, group, run.device)
        for offloaded in (False, True):
            predicted = block_s(kernel, s["S"], cfg, offloaded)
            run.add(
                dict(
                    variant="checkpointed, offloaded" if offloaded else "plain",
                    S=s["S"],
                    L=L,
                    kernel=kernel,
                ),
                functools.partial(_block_case, run, model, offloaded, L, predicted),
                need_s=run.budget.predict(kernel, predicted),
            )


def _block_check(run, cfg, L) -> dict:
    """On a real one-rank group: the plain block twice (the kernels' run-to-run spread e0),
    then offloaded and checkpointed, which must match the first plain run within
    max(2 e0, 1e-3) in the output and every parameter gradient (0 on deterministic kernels)."""
    with one_rank_group(run.device) as group:
        model = _block_model(cfg, group, run.device)
        gen = torch.Generator().manual_seed(60)
        ids = torch.randint(0, cfg.vocab_size, (1, L), generator=gen).to(run.device)
        pos = torch.arange(L, device=run.device)[None]
        dy = randn(1, L, cfg.hidden_size, device=run.device, seed=61, dtype=torch.bfloat16)
        results = []
        for offloaded in (False, False, True):
            _features(model, offloaded)
            model.zero_grad(set_to_none=True)
            y = _block_step(model, ids, pos, dy)["y"]
            results.append([y, *(p.grad.clone() for p in model.parameters() if p.grad is not None)])
    spread = max(rel_err(a, b) for a, b in zip(results[1], results[0], strict=True))
    err = max(rel_err(a, b) for a, b in zip(results[2], results[0], strict=True))
    bound = max(HALF_FACTOR * spread, HALF_FLOOR)
    return dict(spread=spread, err=err, bound=bound, bitwise=err == 0, ok=err <= bound)


def _block_case(run, model, offloaded, L, predicted) -> dict:
    """A 64-token warm-up, the host arena sized for L (as a first training step makes it),
    one run under the tracker: time, peaks, what forward keeps for backward; offloaded, also
    the input's copy to the host and back, each timed alone."""
    cfg, dev = model.config, run.device
    _features(model, offloaded)

    def batch(n, seed):
        ids = torch.randint(
            0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed)
        )
        dy = randn(1, n, cfg.hidden_size, device=dev, seed=seed, dtype=torch.bfloat16)
        return ids.to(dev), torch.arange(n, device=dev)[None], dy

    _block_step(model, *batch(64, 62))
    model.zero_grad(set_to_none=True)
    ids, pos, dy = batch(L, 63)
    x = torch.empty(1, L, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    if offloaded:
        model.offload.release(model.offload.save(x, 0), 0)  # the arena, at its size
    if run.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    with upipe.MemoryTracker(dev) as mem:
        step, took = run.time(lambda: _block_step(model, ids, pos, dy, mem))
    run.budget.observe(run.auto, predicted, took)
    model.zero_grad(set_to_none=True)
    res = dict(fwd_bwd_s=took, tracker=mem.peak_bytes, kept_after_forward=step["kept"])
    res.update(cuda_alloc=mem.cuda_peak_bytes, cuda_reserved=mem.cuda_reserved_peak_bytes)
    return {**res, **(_copy_rates(model.offload, x) if offloaded else {})}


def _copy_rates(offload, x) -> dict:
    """GB/s of the offloader's copy of x to its host slot and back, the host's clock around
    each (synchronised: the copies run on the offloader's side stream)."""
    sync = torch.cuda.synchronize if x.is_cuda else lambda: None
    sync()
    t0 = time.perf_counter()
    token = offload.save(x, 0)
    sync()
    t1 = time.perf_counter()
    offload.load(token, 0, x.device)
    sync()
    t2 = time.perf_counter()
    offload.release(token, 0)
    return dict(d2h_gbps=x.nbytes / (t1 - t0) / 1e9, h2d_gbps=x.nbytes / (t2 - t1) / 1e9)


# --- the tables for docs/gpu.md ------------------------------------------------------------------


BYTES = {"cuda_alloc", "cuda_reserved", "tracker", "planner", "kept_after_forward"}


def _cell(key):
    """A cell: row[key] formatted (GiB for byte counts), "" where the row has none."""
    fmt = (lambda v: f"{v / 2**30:.3g}") if key in BYTES else _fmt
    return lambda r: "" if r.get(key) is None else fmt(r[key])


def _pair(a, b):
    return lambda r: f"{_fmt(r[a])} / {_fmt(r[b])}" if a in r else ""


def _verdict(r):
    """A judged row's verdict; a measurement without a verdict shows none."""
    if "skipped" in r:
        return "skipped"
    return "" if "ok" not in r else "ok" if r["ok"] else "**FAIL**"


ERRS = [("err out", _cell("err_out")), ("err grads", _cell("err_grads"))]
END = [("err / tol", _cell("err_over_tol")), ("", _verdict)]
NOTE = [("note", lambda r: r.get("skipped") or r.get("error") or "")]
TABLES = {  # part -> (title, [(column, cell)])
    "exact": (
        "Kernels vs float64 (small shapes)",
        [("kernel", _cell("kernel")), ("dtype", _cell("dtype")), ("causal", _cell("causal"))]
        + [("H / G", _pair("H", "G")), *ERRS, *END, *NOTE],
    ),
    "strategies": (
        "Strategies on one rank vs float64",
        [("strategy", _cell("strategy")), ("kernel", _cell("kernel")), ("dtype", _cell("dtype"))]
        + [("documents", _cell("documents")), *ERRS, *END, *NOTE],
    ),
    "kernels": (
        "Kernels at Llama3-8B's per-rank shapes on 8 GPUs (bf16, causal, d = 128)",
        [("kernel", _cell("kernel")), ("job tokens", _cell("S")), ("q / kv heads", _pair("h", "g"))]
        + [("fwd ms", _cell("fwd_ms")), ("fwd TFLOP/s", _cell("fwd_tflops"))]
        + [("bwd ms", _cell("bwd_ms")), ("bwd TFLOP/s", _cell("bwd_tflops"))]
        + [("runs", _cell("runs")), ("sampled err / tol", _cell("err_over_tol"))]
        + [("", _verdict), *NOTE],
    ),
    "layer": (
        "Attention layer, one rank of 8 (Llama3-8B, bf16): Ulysses vs UPipe (U = 8)",
        [("job tokens", _cell("S")), ("strategy", _cell("strategy")), ("kernel", _cell("kernel"))]
        + [("fwd+bwd s", _cell("fwd_bwd_s")), ("vs Ulysses", _cell("time/ulysses"))]
        + [("attention TFLOP/s", _cell("attention_tflops"))]
        + [("max allocated GiB", _cell("cuda_alloc")), ("max reserved GiB", _cell("cuda_reserved"))]
        + [("tracker GiB", _cell("tracker")), ("planner GiB", _cell("planner"))]
        + [("allocated / planner", _cell("cuda_alloc/planner")), *NOTE],
    ),
    "block": (
        "One Llama3-8B decoder block (UPipe attention), one rank of 8, bf16",
        [("variant", lambda r: r.get("variant") or r.get("check", "")), ("job tokens", _cell("S"))]
        + [("fwd+bwd s", _cell("fwd_bwd_s")), ("max allocated GiB", _cell("cuda_alloc"))]
        + [("tracker GiB", _cell("tracker")), ("kept for bwd GiB", _cell("kept_after_forward"))]
        + [
            ("to host / back GB/s", _pair("d2h_gbps", "h2d_gbps")),
            ("err (bound)", _pair("err", "bound")),
        ]
        + [("", _verdict), *NOTE],
    ),
}


def markdown(doc: dict) -> str:
    """The table rows for docs/gpu.md: a heading naming the run, then one table per part."""
    env, dry = doc["environment"], " -- DRY RUN (CPU emulation: numbers mean nothing)"
    lines = [
        f"#### {doc['date']}: {env['device']}, torch {env['torch']}, CUDA {env['cuda']}, "
        f"cuDNN {env['cudnn']}{dry if doc['dry_run'] else ''}",
        "",
        f"{_fmt(doc.get('elapsed_s'))} s of a {doc['budget_s']:.0f} s budget"
        + (f"; ABORTED: {doc['aborted']}" if "aborted" in doc else "")
        + "; " + ", ".join(f"auto {k}: {v}" for k, v in doc["auto"].items()) + ".",
    ]  # fmt: skip
    for part, body in doc["parts"].items():
        title, cols = TABLES[part]
        note = f"; {body['error']}" if "error" in body else ""
        lines += ["", f"**{title}** ({_fmt(body.get('elapsed_s'))} s{note})", ""]
        lines += ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
        for r in body["rows"]:
            cells = [str(cell(r)).replace("|", "/").replace("\n", " ")[:160] for _, cell in cols]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --- driver ------------------------------------------------------------------------------------


def dry_run_setup() -> None:
    """The test suite's CPU emulations of the CUDA-only ops, in this process (module doc)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "helpers"))
    import cudnn_emulation
    import flash_impl_emulation

    flash_impl_emulation.install_packages()  # the stand-in FA3 / FA4 packages
    flash_impl_emulation.install()  # flash, efficient, varlen, out_dtype GEMMs, FA3/FA4 impls
    cudnn_emulation.install()
    kernels_select.forget()


def packages() -> dict:
    """The installed distributions this process imported, with versions: what the GPU
    machine must have (the rest of its top-level modules are the standard library's)."""
    dists = importlib.metadata.packages_distributions()
    names = {n for m in list(sys.modules) if "." not in m for n in dists.get(m, ())}
    return {n: importlib.metadata.version(n) for n in sorted(names)}


def environment(device) -> dict:
    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({platform.machine()})",
        "capability": torch.cuda.get_device_capability(device) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def watchdog(run: Run, after_s: float) -> threading.Timer:
    """Ends the process `after_s` from now: every thread's stack to stderr, then the JSON
    with where it stopped, exit status 3."""

    def fire():
        with contextlib.suppress(Exception):  # (stderr may have no file descriptor)
            faulthandler.dump_traceback(all_threads=True)
        run.lock.acquire(timeout=10)
        run.doc["aborted"] = f"the watchdog, {after_s:.0f} s after the start, in part {run.part}"
        run.doc["elapsed_s"] = time.monotonic() - run.budget.start
        run.save()
        print(f"\nABORTED by {run.doc['aborted']}", flush=True)
        os._exit(3)

    timer = threading.Timer(after_s, fire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", help="the JSON, rewritten after every row (and its .md beside it)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, emulated CUDA ops")
    p.add_argument("--estimate", action="store_true", help="print the time budget, run nothing")
    p.add_argument("--budget-s", type=float, help=f"the time boxes' total ({BUDGET_S:.0f} s)")
    p.add_argument("--grace-s", type=float, default=GRACE_S, help="watchdog: this after it")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="only these")
    a = p.parse_args(argv)
    budget_s = BUDGET_S if a.budget_s is None else a.budget_s
    if a.estimate:
        estimate = estimate_s(SIZES["full"])
        for part, sec in estimate.items():
            box = f"box {BOX[part] * budget_s:.0f} s" if part in BOX else "allowance"
            print(f"{part:11s} {sec:6.1f} s  ({box})")
        total = sum(estimate.values())
        print(f"{'total':11s} {total:6.1f} s  (budget {budget_s:.0f} s, +{a.grace_s:.0f} s grace)")
        return
    if a.dry_run:
        dry_run_setup()
        torch.set_num_threads(1)  # nothing is measured; one thread runs steadiest on a shared CPU
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        raise SystemExit("no CUDA device here: run the same code on the CPU with --dry-run")
    sizes, budget = SIZES["dry" if a.dry_run else "full"], Budget(budget_s)
    d = sizes["layer"]["model"].head_dim
    auto = {str(t)[6:]: check_kernel("auto", device, t, d) for t in (torch.bfloat16, torch.float32)}
    doc = {
        "command": ["gpu_check.py", *(sys.argv[1:] if argv is None else argv)],
        "date": datetime.date.today().isoformat(),
        "dry_run": a.dry_run,
        "environment": environment(device),
        "auto": auto,
        "budget_s": budget_s,
        "boxes_s": {k: v * budget_s for k, v in BOX.items()},
        "estimate_s": estimate_s(sizes, auto=auto["bfloat16"]),
        "parts": {},
    }
    if a.out:
        pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    run = Run(device, sizes, budget, auto["bfloat16"], a.out, doc)
    timer = watchdog(run, budget_s + a.grace_s)
    parts = dict(exact=part_exact, strategies=part_strategies, kernels=part_kernels)
    parts.update(layer=part_layer, block=part_block)
    for part in a.parts:
        t0, fields = time.monotonic(), {}
        run.open(part)
        try:
            parts[part](run)
        except Exception as e:  # the part as a whole (say, a process group that cannot start)
            fields["error"] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc()
        restore_impl()
        run.close(elapsed_s=time.monotonic() - t0, **fields)
    timer.cancel()
    with run.lock:
        doc.update(packages=packages(), elapsed_s=time.monotonic() - budget.start)
        run.save()
    print("\n" + markdown(doc))
    rows = [r for body in doc["parts"].values() for r in body["rows"]]
    failed, skipped = sum(r.get("ok") is False for r in rows), sum("skipped" in r for r in rows)
    print(f"total {doc['elapsed_s']:.1f} s: {len(rows)} rows, {failed} failed, {skipped} skipped")


if __name__ == "__main__":
    main()
