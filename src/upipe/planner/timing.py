"""Step time on named GPUs, predicted from what one simulated training step counts.

Counting (`count_step`). One rank's step runs under `upipe.planner.step.StepSimulator`
(the code of `upipe train` under fake tensors) with three dispatch modes on top:
- `_Counter`: FLOPs by the formulas of `torch.utils.flop_counter` (`flop_registry`), with
  formulas for the ops it does not know: the CPU flash-attention kernel that stands in for
  CUDA's (`_FLOPS`: torch's own SDPA formulas, halved for a causal call), the in-place
  `addmm_` (the chunked loss's dW) and the MoE experts' grouped GEMMs (upipe's and torch's
  `_grouped_mm`, transformers' experts: 2 M O I for M = N K routed rows: a token costs its
  K experts, not all E); bytes copied between device and
  host (the offload arena lives on `step.HOST_DEVICE` in the simulation), bytes of ops that
  run on host tensors, and the bytes every other (memory-bound) op on the device reads and
  writes;
- `upipe.memory.simulate.CollectiveLog`: every collective's op, bytes and group;
- the out_dtype GEMMs of the fused UPipe op, which the simulation's CUDA stand-in
  (`step._cuda_addmm_acc_`) runs without dispatching any op: 2 N K M each;
- the Gated DeltaNet layers' scans (a hybrid model's, on CUDA: fla's kernels, whose memory
  `upipe.planner.deltanet` simulates without dispatching their work) by the formulas of
  `upipe.planner.deltanet` ("deltanet_flops"), timed at the dense GEMM rate (a lower bound
  for Triton kernels).
The simulator cuts tile and ring loops short and extrapolates the depth, which keeps the
memory and not the counts; so `count_step` runs the full loops (`sample_loops=False`) at
three short lengths S_k = k u (k = 2, 3, 4; u: whole MLP tiles and loss chunks per rank, see
`_count_setup`) and at two depths n0 < n1 (those the planner extrapolates from). Every
count c is exactly
    c(n, S) = (a0 + a1 S + a2 S^2) + n (b0 + b1 S + b2 S^2)
(blocks are identical; the GEMMs and every byte grow linearly with the tokens, attention
with S^2), so the three lengths fix the parabola and the two depths the line, both in exact
rational arithmetic; `tests/runs/test_timing.py` checks the result against closed forms and
against a fourth length and a third depth.

Time model (`predict`), per rank, with the rates of a `Hardware` preset
(`upipe.planner.hardware`: every rate with its source; R_fwd and R_bwd those of the chosen
attention kernel on that GPU):
    compute   = F_gemm / R_gemm + F_attn_fwd / R_fwd + F_attn_bwd / R_bwd + B_mem / W_hbm
                + F_deltanet / R_gemm
    step      = compute + t_a2a + t_allreduce + t_h2d + t_host + max(0, t_fsdp - compute)
                + max(0, t_p2p - t_attn) + max(0, t_d2h - compute) + max(0, t_fsdp_copies - compute)
- all-to-alls (Ulysses / UPipe exchanges) are exposed: each stage waits for its exchange
  (`attention.fused.default_overlap` overlaps them only up to 64K gathered tokens, where
  this model is pessimistic);
- FSDP's all-gathers and reduce-scatters (t_fsdp) run on their own streams, prefetched,
  behind the compute; ring attention's send/recv (t_p2p) behind its attention;
- offload: the block inputs go to the host on a side stream during forward (t_d2h, hidden),
  but come back on demand in backward (t_h2d, exposed; `upipe.model.offload`);
- FSDP's offload (`--fsdp-offload`): each shard's host-to-device copy runs in the
  all-gather's copy-in stream, each gradient shard's copy to the host in the
  reduce-scatter's, both prefetched or asynchronous (t_fsdp_copies, hidden), but the
  optimizer step on host tensors runs after the backward (t_host, exposed; host memory
  bandwidth only: the CPU's arithmetic is not modelled).
Collective times: bytes x (C-1)/C / W for all-to-all, all-gather, reduce-scatter (C ranks;
2 (C-1)/C for all-reduce), bytes / W for a send (a recv is the sender's time); W is NVLink's
inside a node, the inter-node link's for a group that spans nodes (an all-to-all sends the
off-node share (C - c)/C at that rate while the on-node share moves over NVLink, c ranks
per node).

Left out: host-side overheads (kernel launches, Python), which matter at short sequences
only; the GEMMs' own memory traffic (compute-bound at these sizes); norms under the CUDA
stand-in (`step._FusedRMSNorm` allocates its outputs and dispatches no kernel, so its reads
and writes, about 4 bytes per activation element per norm, are not counted). The model is
not validated on a GPU (none was lent); `docs/plan.md` compares it with
`benchmarks/step_time_model.py`'s hand-written model.

Legend: S sequence, L = S / C tokens per rank, C group size, n blocks, u length unit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from fractions import Fraction
from unittest import mock

import torch
from torch.utils.flop_counter import flop_registry, shape_wrapper

from upipe.memory.simulate import CollectiveLog
from upipe.memory.tracker import _plain_tensors
from upipe.model import moe  # noqa: F401  (registers torch.ops.upipe.grouped_linear)
from upipe.planner import deltanet as deltanet_module
from upipe.planner import step as step_module
from upipe.planner.hardware import (  # noqa: F401  (the presets, also reached from here)
    A100,
    B200,
    H100,
    H200,
    HARDWARE,
    Hardware,
    get_hardware,
    resolve_kernel,
)
from upipe.planner.sampled import repeated_tiles
from upipe.planner.step import HOST_DEVICE, StepSimulator
from upipe.torch_private import TorchDispatchMode

_ATTN_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_ATTN_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_aten = torch.ops.aten
# allocations and reshapes: no kernel reads or writes memory
_FREE = {_aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty, _aten._unsafe_view}
_WRITE_ONLY = {_aten.copy_, _aten.fill_, _aten.zero_}  # their first argument is not read
_COPIES = {_aten.copy_, _aten._to_copy, _aten.clone}


def _attention_forward(q, k, v, dropout_p=0.0, is_causal=False, **_):
    """The SDPA forward count of `torch.utils.flop_counter` (Q K^T and P V over the H query
    heads: 2 B H Sq Sk (d + dv)), halved when causal: the kernel skips the blocks above the
    diagonal, so it does S (S + 1) / 2 of the S^2 pairs. Written here rather than called:
    torch 2.11's `sdpa_flop_count` asserts equal query and kv head counts (GQA fails)."""
    (b, h, s_q, d), (_, _, s_k, _), d_v = q, k, v[-1]
    return 2 * b * h * s_q * s_k * (d + d_v) // (2 if is_causal else 1)


def _attention_backward(dout, q, k, v, out, lse, dropout_p=0.0, is_causal=False, **_):
    """The SDPA backward count of `torch.utils.flop_counter` (five products: S = Q K^T again,
    dO V^T, P^T dO, dS K, dS^T Q: 2 B H Sq Sk (3 d + 2 dv), 2.5x the forward for d = dv),
    halved when causal."""
    (b, h, s_q, d), (_, _, s_k, _), d_v = q, k, v[-1]
    return 2 * b * h * s_q * s_k * (3 * d + 2 * d_v) // (2 if is_causal else 1)


def _addmm_(acc, a, b, **_):
    """acc += a @ b in place: 2 N K M, as torch's `addmm` formula counts the out-of-place op."""
    return 2 * a[0] * a[1] * b[1]


def _grouped_linear(x, w, ends, **_):
    """The MoE experts' grouped GEMM (`upipe.model.moe.grouped_linear`): every one of the M
    routed rows times its expert's [O, I] matrix, 2 M O I -- K experts' worth per token,
    not E."""
    return 2 * x[0] * w[1] * w[2]


def _grouped_linear_weight_grad(dy, x, ends, **_):
    """Its weight gradient: dw[e] = dy_e^T x_e summed over the segments, 2 M O I."""
    return 2 * dy[0] * dy[1] * x[1]


def _grouped_mm(a, b, offs=None, **_):
    """torch's grouped GEMM (`aten._grouped_mm`, transformers' MoE experts under
    experts_implementation "grouped_mm"), the groups of rows given by `offs`: each row (or
    column) meets only its group's matrix, so
    - a `[M, K]` x b `[E, K, N]` -> `[M, N]` (forward; and the input gradient): 2 M K N;
    - a `[K, M]` x b `[M, N]` split along M -> `[E, K, N]` (the weight gradient): 2 K M N;
    - a `[E, M, K]` x b `[K, N]` split along N -> `[M, N]`: 2 M K N;
    - a `[E, M, K]` x b `[E, K, N]` (batched): 2 E M K N."""
    if len(a) == 2:
        return 2 * a[0] * a[1] * b[-1]
    if len(b) == 2:
        return 2 * a[1] * a[2] * b[1]
    return 2 * a[0] * a[1] * a[2] * b[2]


_FLOPS = {
    _ATTN_FWD: _attention_forward,
    _ATTN_BWD: _attention_backward,
    _aten.addmm_: _addmm_,
    torch.ops.upipe.grouped_linear: _grouped_linear,
    torch.ops.upipe.grouped_linear_weight_grad: _grouped_linear_weight_grad,
    _aten._grouped_mm: _grouped_mm,
}
_CATEGORY = {_ATTN_FWD: "attention_forward_flops", _ATTN_BWD: "attention_backward_flops"}
_FORMULAS = {**flop_registry, **{op: shape_wrapper(f) for op, f in _FLOPS.items()}}


COUNTED = (  # what `_Counter` counts (and collectives: "op@ranks" bytes)
    *("gemm_flops", "attention_forward_flops", "attention_backward_flops", "memory_bytes"),
    *("host_to_device_bytes", "device_to_host_bytes", "host_compute_bytes"),
    *("fsdp_host_to_device_bytes", "fsdp_device_to_host_bytes"),
)


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class _Counter(TorchDispatchMode):
    """Counts per op run in the block (`counts`): FLOPs by torch's formulas
    (`torch.utils.flop_counter.flop_registry`, plus `_FLOPS`) as "gemm_flops",
    "attention_forward_flops" or "attention_backward_flops"; and bytes:
    - "host_to_device_bytes" / "device_to_host_bytes": copies of block inputs between the
      offload arena (on `HOST_DEVICE`) and the device;
    - "fsdp_host_to_device_bytes" / "fsdp_device_to_host_bytes": copies of FSDP's offloaded
      state (`--fsdp-offload`: fake CPU tensors the simulation's tracker counts as host
      memory, `is_host`), the shards before their all-gather, the gradient shards after;
    - "host_compute_bytes": ops whose tensors all live on the host (read + written), such
      as the optimizer step with FSDP's offload;
    - "memory_bytes": every other op on the device that is not counted in FLOPs, a
      collective or an allocation: its inputs read, its outputs written, as one eager
      kernel does.
    Bytes are those of the tensors holding memory: a DTensor's local shard, not its global
    size (`memory.tracker._plain_tensors`).
    An op is classified when the next one starts (or at the end): by then the tracker above
    this mode has registered its outputs, so `is_host` knows where they live.

    Why not `FlopCounterMode` itself: its `ModuleTracker` puts hooks on every module call,
    which fail inside autograd Functions that run modules in their forward (the tiled MLP:
    "Expected gradient function to be set"); its formulas are what we need, and its mode is
    this one's first half."""

    def __init__(self, is_host):
        super().__init__()
        self.is_host, self.pending = is_host, None
        self.counts = dict.fromkeys(COUNTED, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.settle()
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in _FORMULAS:
            flops = _FORMULAS[packet](*args, **kwargs, out_val=out)
            self.counts[_CATEGORY.get(packet, "gemm_flops")] += flops
        elif not (func.is_view or packet in _FREE or func.namespace in ("c10d", "prim")):
            read, written = _plain_tensors((args, kwargs)), _plain_tensors(out)
            self.pending = (packet, read[1:] if packet in _WRITE_ONLY else read, written)
        return out

    def settle(self) -> None:
        """Classify the last op (class doc)."""
        if self.pending is None:
            return
        packet, read, written = self.pending
        self.pending = None
        host = {self.is_host(t) for t in read + written}
        if packet in _COPIES and host == {True, False}:
            arena = any(t.device.type == HOST_DEVICE for t in read + written)
            way = "device_to_host" if self.is_host(written[0]) else "host_to_device"
            self.counts[f"{'' if arena else 'fsdp_'}{way}_bytes"] += _nbytes(read)
        else:
            kind = "host_compute_bytes" if host == {True} else "memory_bytes"
            self.counts[kind] += _nbytes(read) + _nbytes(written)


class _Repeats:
    """What `sampled.repeated_tiles` asks of the counting: `mark()` the counts so far,
    `repeat(mark, times)` adds what was counted since the mark `times` more (`_Counter`'s
    counts and the collectives logged)."""

    def __init__(self, counter: _Counter, log: CollectiveLog):
        self.counter, self.log = counter, log

    def mark(self) -> tuple[dict[str, int], int]:
        self.counter.settle()
        return dict(self.counter.counts), len(self.log.calls)

    def repeat(self, mark: tuple[dict[str, int], int], times: int) -> None:
        self.counter.settle()
        (counts, n_calls), now = mark, self.counter.counts
        for key in list(now):
            now[key] += (now[key] - counts.get(key, 0)) * times
        self.log.calls.extend(self.log.calls[n_calls:] * times)


def _count(
    sim: StepSimulator, seq_len: int, depth: int | None = None, *, repeat_tiles: bool = False
) -> dict[str, int]:
    """Counts of one simulated step at `seq_len`: `_Counter`'s, and the bytes of each
    collective as "op@ranks" (ranks: the group's global ranks). `depth`: of that job of
    `sim` only, with the full loops (else every job of `sim`, its loops as `sim` runs them);
    `repeat_tiles`: the tile loops run two tiles, the second counted for the others too
    (`sampled.repeated_tiles`: exact where every tile is whole)."""
    trackers = [trainer.tracker for trainer in sim.trainers.values()]

    def is_host(t: torch.Tensor) -> bool:
        return t.device.type == HOST_DEVICE or any(m.is_host(t) for m in trackers)

    counter, log = _Counter(is_host), CollectiveLog()
    stand_in = step_module._cuda_addmm_acc_

    def addmm_acc_(acc, a, b, *, tensor_cores):
        """The simulation's stand-in for CUDA's out_dtype GEMM dispatches no op: count it."""
        counter.counts["gemm_flops"] += 2 * a.shape[0] * a.shape[1] * b.shape[1]  # acc += a b
        return stand_in(acc, a, b, tensor_cores=tensor_cores)

    def account(kind: str, flops: int) -> None:
        """fla's kernels in the simulation dispatch no op: their FLOPs by formula."""
        counter.counts["deltanet_flops"] = counter.counts.get("deltanet_flops", 0) + flops

    patches = contextlib.ExitStack()
    patches.enter_context(mock.patch.object(step_module, "_cuda_addmm_acc_", addmm_acc_))
    patches.enter_context(mock.patch.object(deltanet_module, "_account", account))
    if repeat_tiles:
        patches.enter_context(repeated_tiles(_Repeats(counter, log)))
    with patches, counter, log:
        if depth is None:
            sim.step(seq_len)
        else:
            sim.step(seq_len, depth=depth, sample_loops=False)
    counter.settle()
    counts = dict(counter.counts)
    for c in log.calls:
        key = f"{c.op}@{','.join(map(str, c.ranks))}"
        counts[key] = counts.get(key, 0) + c.nbytes
    return counts


def _through(xs, ys, x) -> Fraction:
    """The polynomial of degree len(xs) - 1 through the points (xs, ys), at x (Lagrange)."""
    total = Fraction(0)
    for i, (xi, yi) in enumerate(zip(xs, ys, strict=True)):
        term = Fraction(yi)
        for j, xj in enumerate(xs):
            if j != i:
                term *= Fraction(x - xj, xi - xj)
        total += term
    return total


COUNT_MULTIPLES = (2, 3, 4)  # the lengths counted, in units: three points fix a parabola


def _count_setup(cfg, world: int, seq_len: int, unit: int):
    """The config and lengths to count `cfg` at `seq_len` with: S_k = k U (k in
    `COUNT_MULTIPLES`), U the least multiple of `unit` whose L = U / C (C context-parallel
    ranks) is a multiple of the MLP tile and the loss chunk, so that every count length has
    whole tiles and chunks and at least two tiles: the per-tile work (a tile's weight
    gradients added into .grad) grows with L / tile, linearly. A sequence of one tile runs
    the MLP plainly (`features.tiled_recompute`), so if `seq_len`'s L is that short the
    count runs without tiles (the same ops)."""
    dp = cfg.degrees(world)[0]
    C = world // dp
    U = unit
    if cfg.tiled_mlp and seq_len // C <= cfg.mlp_tile:
        cfg = dataclasses.replace(cfg, tiled_mlp=False)
    for on, tokens in ((cfg.tiled_mlp, cfg.mlp_tile), (cfg.chunked_loss, cfg.loss_chunk)):
        U = math.lcm(U, C * tokens) if on else U
    return cfg, [k * U for k in COUNT_MULTIPLES]


def count_step(cfg, world: int, model, seq_len: int, *, unit: int, depths, kernels="cuda", hf=None):
    """Exact counts (module doc) of rank 0's training step of `cfg` (a `TrainConfig`) on
    `world` ranks at `seq_len` tokens: simulated in full at three lengths (`_count_setup`;
    `unit`: a valid length of `cfg`) and at the two `depths` (the model's own if it is not
    deeper), then fitted. Returns {name: count} (`_count`'s names). Exact for FLOPs,
    collectives and host copies at any length; the memory-bound bytes also need `seq_len`'s
    L to be whole MLP tiles and loss chunks (else they are off by a part of one tile's).
    `hf`: count the Hugging Face model of this config.json dict instead of upipe's own
    (`upipe.planner.hf.HFStepSimulator`; `model` its shapes; the depths whole layer
    patterns, `upipe.planner.plan.simulated_depths`)."""
    from upipe.planner.hf import HFStepSimulator

    n_layers = model.n_layers
    depths = tuple(depths) if max(depths) < n_layers else (n_layers,)
    cfg, xs = _count_setup(cfg, world, seq_len, unit)
    runs = []
    for n in depths:
        kw = dict(depths=(n,), sample_loops=False, kernels=kernels)
        job = (cfg, world, hf) if hf else (cfg, world, model)
        with (HFStepSimulator if hf else StepSimulator)(*job, **kw) as sim:
            runs.append([_count(sim, S) for S in xs])
    out = {}
    for key in sorted({k for at_depth in runs for c in at_depth for k in c}):
        ys = [_through(xs, [c.get(key, 0) for c in at_depth], seq_len) for at_depth in runs]
        if len(ys) == 2:  # c(n) = c(n1) + (c(n1) - c(n0)) (n - n1) / (n1 - n0)
            (n0, n1), y0, y1 = depths, *ys
            ys = [y1 + (y1 - y0) * Fraction(n_layers - n1, n1 - n0)]
        out[key] = round(ys[0])
    return out


def _collective_seconds(op: str, ranks: list[int], nbytes: int, hw: Hardware) -> float:
    """Seconds of one rank's share of a step's collectives of one kind on one group (module
    doc): inside a node at NVLink's rates, across nodes at the inter-node link's."""
    C = len(ranks)
    on_node = sum(r // hw.gpus_per_node == ranks[0] // hw.gpus_per_node for r in ranks)
    if op == "recv" or C == 1:
        return 0.0
    if op == "all_to_all":
        if on_node == C:
            return nbytes * (C - 1) / C / hw.all_to_all
        return max(
            nbytes * (on_node - 1) / C / hw.all_to_all, nbytes * (C - on_node) / C / hw.inter_node
        )
    rate = (hw.p2p if op == "send" else hw.collective) if on_node == C else hw.inter_node
    share = {"send": 1, "broadcast": 1, "all_reduce": 2 * (C - 1) / C}.get(op, (C - 1) / C)
    return nbytes * share / rate


def predict(counts: dict[str, int], hw: Hardware, kernel: str = "auto") -> dict[str, float]:
    """Seconds per training step on one rank by part (module doc), the attention at the rates
    of `kernel` on `hw` (`hardware.resolve_kernel`: auto is the stock kernel auto picks
    there); "step" is their total."""
    rate = hw.kernel_rate(resolve_kernel(kernel, hw))
    t = {
        "gemm": counts["gemm_flops"] / hw.gemm,
        "attention": counts["attention_forward_flops"] / rate.forward
        + counts["attention_backward_flops"] / rate.backward,
        "memory_bound": counts["memory_bytes"] / hw.hbm,
    }
    if counts.get("deltanet_flops"):  # fla's Triton kernels at the dense GEMM rate (a bound)
        t["deltanet"] = counts["deltanet_flops"] / hw.gemm
    compute = sum(t.values())
    comm = dict.fromkeys(("all_to_all", "fsdp", "p2p", "all_reduce"), 0.0)
    for key, nbytes in counts.items():
        if "@" in key:
            op, ranks = key.split("@")
            part = {"all_gather": "fsdp", "reduce_scatter": "fsdp", "send": "p2p", "recv": "p2p"}
            seconds = _collective_seconds(op, [int(r) for r in ranks.split(",")], nbytes, hw)
            comm[part.get(op, "all_to_all" if op == "all_to_all" else "all_reduce")] += seconds
    t["all_to_all"], t["all_reduce"] = comm["all_to_all"], comm["all_reduce"]
    t["fsdp_exposed"] = max(0.0, comm["fsdp"] - compute)
    t["p2p_exposed"] = max(0.0, comm["p2p"] - t["attention"])
    t["host_to_device"] = counts["host_to_device_bytes"] / hw.host_link
    t["device_to_host_exposed"] = max(0.0, counts["device_to_host_bytes"] / hw.host_link - compute)
    fsdp_copies = counts["fsdp_host_to_device_bytes"] + counts["fsdp_device_to_host_bytes"]
    t["fsdp_copies_exposed"] = max(0.0, fsdp_copies / hw.host_link - compute)
    t["host_compute"] = counts["host_compute_bytes"] / hw.host_memory
    t["step"] = sum(t.values())
    return t
