"""The benchmark itself: per-rank steps, the driver that sequences them, and the verdicts.

Legend: B batch, S full sequence, L = S / C local tokens, H query heads, G kv heads,
d head dim, C ranks; one memory unit is one `[B, L, H*d]` tensor of the benchmark dtype.

For each sequence length every rank draws the same full q/k/v/dout (with --layer: x/dy,
`upipe.bench.layer`) from the seed; rank 0 computes the float64 reference on one process
(`upipe.kernels`, no S x S matrix). Then
each method, on identical inputs cut into its own layout:
  1. a warm-up call on a few tokens (connections, caches, the tracker's first-use cost);
  2. one forward+backward under `upipe.MemoryTracker` (per-rank peak of the tensors
     allocated inside, inputs excluded) whose outputs and gradients are gathered to rank 0
     and compared with the reference (max|x - ref| / max|ref| over out, dq, dk, dv; with
     --layer over y, dx and the four weight gradients);
then `warmup_rounds` + `repeats` rounds in which the methods take turns (interleaved, so drift
hits all alike); a round's time is the slowest rank's, the result the median round.
A method whose error is above the dtype's tolerance is flagged wrong and not ranked.

The steps are separate `run(fn, ...)` calls so the parent can show progress; what a rank
keeps between them (inputs, the reference, set-up peers) lives in `_STATE`, one per rank
process. `run` is `LocalCluster.run` (spawned gloo ranks) or, under torchrun, every rank
calling the driver itself (`in_process_runner`).
"""

from __future__ import annotations

import dataclasses
import time
import traceback

import torch
import torch.distributed as dist

import upipe
from upipe.bench import report
from upipe.bench.layer import RESULTS as LAYER_RESULTS
from upipe.bench.layer import layer_reference, layer_weights
from upipe.bench.peers import Method
from upipe.kernels import attention_backward, attention_forward

# max|x - ref| / max|ref| above which a method is flagged wrong (fp32: the same kernels
# measure about 1e-6; bf16/fp16: single-device attention alone reaches a few 1e-2 backward).
TOLERANCE = {"float32": 1e-4, "bfloat16": 8e-2, "float16": 2e-2}
RESULTS = {"op": ("out", "dq", "dk", "dv"), "layer": LAYER_RESULTS}
_STATE: dict = {}


def _device(rank: int, device: str) -> torch.device:
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())  # set from LOCAL_RANK
    return torch.device("cpu")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def _agree(ok: bool, reason: str | None, group) -> str | None:
    """Every rank's (ok, reason) -> the first failure's reason on all ranks, or None."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (ok, reason), group=group)
    return next((r for o, r in everyone if not o), None)


def step_setup(rank, world_size, methods: list[Method], device: str) -> dict[str, str]:
    """Set up each method on this rank; returns {name: reason} for those that failed."""
    group = dist.group.WORLD
    dev = _device(rank, device)
    _STATE.clear()
    _STATE["methods"] = {}
    failed = {}
    for m in methods:
        try:
            m.setup(group, dev)
            ok, reason = True, None
        except Exception as exc:  # a peer that cannot run here is skipped, not fatal
            ok, reason = False, _first_line(exc)
        reason = _agree(ok, reason, group)
        if reason is None:
            _STATE["methods"][m.name] = m
        else:
            failed[m.name] = reason
    return failed


def step_inputs(
    rank, world_size, shape: dict, seed: int, dtype: str, device: str, causal, layer,
    variants=((None, False),), check=True,
):  # fmt: skip
    """Draw this sequence length's full inputs (same on every rank): q, k, v, dout, or with
    `layer` x and dy `[B, S, H*d]`; with `check` rank 0 also computes the float64 reference
    (with `layer` one per variant (window, sinks): the layer with that sliding window and
    sinks, if given). Returns nothing."""
    dev = _device(rank, device)
    gen = torch.Generator().manual_seed(seed)
    B, S, H, G, d = (shape[k] for k in "BSHGd")
    if layer:
        full = [torch.randn(B, S, H * d, generator=gen) for _ in range(2)]
    else:
        full = [torch.randn(B, S, n, d, generator=gen) for n in (H, G, G, H)]
    _STATE["full"] = [t.to(dev, getattr(torch, dtype)) for t in full]
    _STATE["reference"] = None
    if rank == 0 and check:  # on the CPU (the fused CUDA kernels have no float64)
        threads = torch.get_num_threads()
        torch.set_num_threads(max(threads, world_size))  # the other ranks wait meanwhile
        full64 = [t.cpu().double() for t in _STATE["full"]]
        if layer:  # (the sinks are drawn after the projections: the same weights)
            _STATE["reference"] = {
                (window, sinks): layer_reference(
                    *full64, layer_weights(seed, H, G, d, sinks), H=H, G=G, causal=causal,
                    window=window,
                )
                for window, sinks in variants
            }  # fmt: skip
        else:
            q64, k64, v64, do64 = full64
            out64, lse = attention_forward(q64, k64, v64, causal=causal)
            grads = attention_backward(do64, q64, k64, v64, out64, lse, causal=causal)
            _STATE["reference"] = (out64, *grads)
        torch.set_num_threads(threads)
    dist.barrier()


def _leaves(m: Method, n: int | None = None):
    """The method's local inputs (fresh leaves) and output gradient, cut to n local tokens
    if given."""
    local = [m.shard(t) for t in _STATE["full"]]
    if n is not None:
        local = [t[:, :n] for t in local]
    return m.leaves(local)


def _fwd_bwd(m: Method, leaves, dout, causal: bool):
    with m.context():
        out = m(*leaves, causal=causal)
        out.backward(dout)
    return out


def step_measure(rank, world_size, name: str, causal: bool) -> dict:
    """Warm-up, then one tracked forward+backward of `name`; rank 0 returns its errors."""
    group = dist.group.WORLD
    m = _STATE["methods"][name]
    try:
        with upipe.MemoryTracker():  # warm-up, including the tracker's first use
            _fwd_bwd(m, *_leaves(m, n=min(64, _STATE["full"][0].shape[1] // world_size)), causal)
        leaves, dout = _leaves(m)
        dist.barrier(group)
        with upipe.MemoryTracker(leaves[0].device) as mem:
            out = _fwd_bwd(m, leaves, dout, causal)
        ok, reason = True, None
    except Exception as exc:
        ok, reason = False, _first_line(exc) + "\n" + traceback.format_exc(limit=-3)
    reason = _agree(ok, reason, group)
    if reason is not None:
        return {"failed": reason}
    peak = mem.peak_bytes if mem.cuda_peak_bytes is None else mem.cuda_peak_bytes
    results = m.results(out, leaves)
    peaks = [None] * world_size
    dist.all_gather_object(peaks, peak, group=group)
    if rank != 0:
        return {}
    reference = _STATE["reference"]
    if isinstance(reference, dict):  # --layer: the method's variant's
        reference = reference[m.variant]
    if reference is None:  # not checked at this length (--reference-up-to)
        return {"peak_bytes_per_rank": peaks, "rel_err": {}}
    errors = {
        key: ((got.cpu().double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        for key, got, ref in zip(
            getattr(m, "result_names", RESULTS[m.inputs]), results, reference, strict=True
        )
    }
    return {"peak_bytes_per_rank": peaks, "rel_err": errors}


def step_round(rank, world_size, names: list[str], causal: bool) -> dict[str, float]:
    """One timing round: each method's forward+backward in turn; this rank's seconds."""
    group = dist.group.WORLD
    seconds = {}
    for name in names:
        m = _STATE["methods"][name]
        leaves, dout = _leaves(m)
        dist.barrier(group)
        if leaves[0].is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        _fwd_bwd(m, leaves, dout, causal)
        if leaves[0].is_cuda:
            torch.cuda.synchronize()
        seconds[name] = time.perf_counter() - t0
    return seconds


def in_process_runner(fn, *args):
    """`run` for torchrun: this rank runs `fn` itself; every rank returns all ranks' results."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = fn(rank, world_size, *args)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return everyone


@dataclasses.dataclass
class Plan:
    """What the driver runs: the shape, and the methods that passed the static checks."""

    seq_lens: tuple[int, ...]
    nproc: int
    B: int
    H: int
    G: int
    d: int
    dtype: str
    causal: bool
    device: str
    warmup_rounds: int
    repeats: int
    seed: int
    methods: list[Method]
    layer: bool = False
    variants: tuple = ((None, False),)
    """--layer: (window, sinks) of each layer variant measured (a window None: none)"""
    reference_up_to: int = 0
    """check against the float64 reference at lengths up to this only (0: all)"""


def drive(run, plan: Plan, progress=None) -> tuple[list[dict], dict[str, str]]:
    """Run the benchmark through `run(fn, *args) -> per-rank results`.

    Returns (rows, failed): one row per (sequence length, method) that ran, and
    {method: reason} for methods that could not be set up or failed on a run.
    `progress(text)` is called after each step (the CLI's progress bar).
    """
    tick = progress or (lambda text: None)
    failed = run(step_setup, plan.methods, plan.device)[0]
    tick("set up")
    names = [m.name for m in plan.methods if m.name not in failed]
    rows = []
    for S in plan.seq_lens:
        shape = {"B": plan.B, "S": S, "H": plan.H, "G": plan.G, "d": plan.d}
        inputs = (plan.seed, plan.dtype, plan.device, plan.causal, plan.layer)
        check = not plan.reference_up_to or plan.reference_up_to >= S
        run(step_inputs, shape, *inputs, plan.variants, check)
        tick(f"S={S}: reference")
        measured = {}
        for name in list(names):
            res = run(step_measure, name, plan.causal)[0]
            if "failed" in res:
                failed[name] = f"S={S}: {res['failed']}"
                names.remove(name)
            else:
                measured[name] = res
            tick(f"S={S}: {name} memory+error")
        rounds = {name: [] for name in names}
        for i in range(plan.warmup_rounds + plan.repeats):
            per_rank = run(step_round, names, plan.causal)
            if i >= plan.warmup_rounds:
                for name in names:
                    rounds[name].append(max(r[name] for r in per_rank))
            tick(f"S={S}: round {i + 1}")
        elsize = torch.empty((), dtype=getattr(torch, plan.dtype)).element_size()
        unit = plan.B * (S // plan.nproc) * plan.H * plan.d * elsize  # one [B, L, D]
        for name in names:
            rows.append(report.result_row(S, name, measured[name], rounds[name], unit))
    return rows, failed


def baseline_candidates(cfg, defaults: tuple[str, ...]) -> tuple[str, ...]:
    """The methods that may be the ratios' baseline, in order: --baseline alone if given,
    else the benchmark's Ulysses-like `defaults` and then --methods (the first that ran is
    the baseline)."""
    return (cfg.baseline,) if cfg.baseline else (*defaults, *cfg.methods)


def judge(rows: list[dict], dtype: str, baseline: str | dict[str, str] | None) -> None:
    """Flag wrong methods, rank the right ones per sequence length (1 = least memory /
    fastest), and add to each right row its baseline's name and its ratios over the
    baseline, `this / baseline` (memory and time; < 1: leaner / faster than the baseline).
    `baseline`: the baseline method's name, or each method's (a --layer variant's is the
    baseline's same variant); None: no ratios."""
    tol = TOLERANCE[dtype]
    if not isinstance(baseline, dict):
        baseline = {r["method"]: baseline for r in rows} if baseline else {}
    for S in sorted({r["seq_len"] for r in rows}):
        at = [r for r in rows if r["seq_len"] == S]
        for r in at:
            # None: not checked (no reference at this length: `upipe bench --whole-model`)
            r["correct"] = None if r["max_rel_err"] is None else r["max_rel_err"] <= tol
            r["tolerance"] = tol
            r["rank_memory"] = r["rank_time"] = None
            r["baseline"] = baseline.get(r["method"])
            r["memory_over_baseline"] = r["time_over_baseline"] = None
        good = [r for r in at if r["correct"] is not False]
        for i, r in enumerate(sorted(good, key=lambda r: r["peak_units_BLD"])):
            r["rank_memory"] = i + 1
        timed = [r for r in good if r["median_seconds"] is not None]
        for i, r in enumerate(sorted(timed, key=lambda r: r["median_seconds"])):
            r["rank_time"] = i + 1
        by_name = {r["method"]: r for r in good}
        for r in good:
            base = by_name.get(r["baseline"])
            if base is None:
                continue
            r["memory_over_baseline"] = r["peak_units_BLD"] / base["peak_units_BLD"]
            if r["median_seconds"] and base["median_seconds"]:
                r["time_over_baseline"] = r["median_seconds"] / base["median_seconds"]
