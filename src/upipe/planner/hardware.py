"""The GPUs the time model knows: each preset's rates, every one with its source, the attention
rates per kernel, and measured rates from `benchmarks/gpu_check.py` in their place.

A preset (`Hardware`) holds what `upipe.planner.timing.predict` divides by: the dense bf16
GEMM rate, HBM bandwidth, NVLink, network and host-link bandwidths, and for each attention
kernel that runs on that GPU (`upipe.kernels_select`: flash, cudnn, fa3, fa4, flash_attn,
efficient) its forward and backward FLOP/s (`KernelRate`, causal bf16, head dim 128, long
sequences), each rate with the paper, datasheet or blog it comes from (`sources`,
`KernelRate.source`). A kernel that does not run on the GPU (FA3 off Hopper, FA4 on Ampere) is
absent from `kernels`; one that runs but has no published rate at hand has `None` rates, and
both are refused with a ValueError (`Hardware.kernel_rate`) rather than guessed.

The published attention figures are micro-benchmarks at 16K tokens (the FlashAttention-3
paper's Figures 5 and 6: batch x sequence = 16K tokens, 16 heads of d = 128); a rank of an
8-GPU job at 128K-1M tokens runs far longer sequences with 1-4 heads per call, so they are
predictions until a GPU measures the job's own shapes (`benchmarks/gpu_check.py`, part
"kernels", whose JSON `with_measured_rates` reads: `upipe plan --recommend --rates-from`).

`auto` (`resolve_kernel`) is what `kernels_select.auto_kernel` picks for the preset's compute
capability and bf16 among the kernels every CUDA build of torch ships (flash, cudnn,
efficient: FA3, FA4 and flash-attn 2 are separate installs the planner cannot see): cudnn on
Hopper and Blackwell, flash on Ampere.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from upipe.kernels_select import CUDA_KERNELS, auto_order

GB = 1e9
STOCK_KERNELS = ("flash", "cudnn", "efficient")  # in every CUDA build of torch (cuDNN inside)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelRate:
    """One attention kernel's achieved FLOP/s on one GPU (causal, bf16, d = 128, the five
    backward products counted as FlashAttention's papers count them: 2.5x the forward)."""

    forward: float | None
    """Forward FLOP/s; None: no published figure at hand."""
    backward: float | None
    """Backward FLOP/s; None: no published figure at hand."""
    source: str
    """Where both numbers come from (paper, figure, configuration), or why they are None."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """The rates the time model assumes for one GPU model (achieved, not peak, where a
    source gives both), per GPU unless said otherwise; `sources` names each one's origin."""

    name: str
    capability: tuple[int, int]
    """CUDA compute capability (what `kernels_select` decides by)."""
    memory_bytes: float
    """Device memory (the datasheet's GB, 1e9 bytes)."""
    gemm: float
    """bf16 dense GEMM FLOP/s (cuBLAS, large shapes)."""
    kernels: dict[str, KernelRate]
    """Attention rates per kernel that runs on this GPU (module doc)."""
    hbm: float
    """Device memory bytes/s of memory-bound kernels."""
    all_to_all: float
    """Bytes/s one GPU sends into an all-to-all inside a node (NVLink)."""
    collective: float
    """All-gather / reduce-scatter / all-reduce bus bytes/s inside a node (NVLink)."""
    p2p: float
    """Bytes/s of ring attention's send to the next rank inside a node (NVLink)."""
    inter_node: float
    """Bytes/s per GPU between nodes (its network adapter)."""
    gpus_per_node: int = 8
    """GPUs that share NVLink: a process group with ranks on several nodes crosses the
    network (ranks r and r' share a node iff r // gpus_per_node == r' // gpus_per_node)."""
    host_link: float
    """Host <-> device bytes/s per GPU, page-locked memory, each direction."""
    host_memory: float
    """Host memory bytes/s per GPU for work on host tensors (an optimizer step on the CPU:
    the node's DRAM bandwidth shared by its GPUs' processes)."""
    sources: dict[str, str]
    """Where each rate field's number comes from (every field in `RATE_FIELDS`)."""

    def kernel_rate(self, kernel: str) -> KernelRate:
        """`kernel`'s rates here (after `resolve_kernel`); ValueError if it does not run on
        this GPU or has no rate."""
        if kernel not in CUDA_KERNELS:
            raise ValueError(
                f"unknown attention kernel {kernel!r}: use one of auto, {', '.join(CUDA_KERNELS)}"
            )
        if kernel not in self.kernels:
            runs = ", ".join(self.kernels)
            raise ValueError(
                f"attention kernel {kernel!r} does not run on {self.name} (sm{self._sm}): "
                f"{_ABSENT.get(kernel, 'not built for it')}; use one of {runs} (or auto)"
            )
        rate = self.kernels[kernel]
        if rate.forward is None or rate.backward is None:
            raise ValueError(
                f"no published {kernel!r} attention rate on {self.name} ({rate.source}); "
                "measure it (benchmarks/gpu_check.py) and pass --rates-from gpu_check.json"
                + (
                    f", or use a kernel with rates: {', '.join(self.rated())}"
                    if self.rated()
                    else f" (no kernel on {self.name} has published rates for both directions)"
                )
            )
        return rate

    def rated(self) -> list[str]:
        """The kernels with both rates."""
        return [k for k, r in self.kernels.items() if None not in (r.forward, r.backward)]

    @property
    def _sm(self) -> str:
        return "".join(map(str, self.capability))


RATE_FIELDS = (
    *("memory_bytes", "gemm", "hbm", "all_to_all", "collective", "p2p", "inter_node"),
    *("host_link", "host_memory"),
)
_ABSENT = {
    "fa3": "FlashAttention-3 is Hopper-only (torch's FA3 impl requires compute capability 9.0)",
    "fa4": "FlashAttention-4 runs on sm90 and sm100 only (torch's FA4 impl: 9.0 or 10.0)",
}


def resolve_kernel(kernel: str, hw: Hardware) -> str:
    """`kernel`, or for "auto" the kernel `kernels_select.auto_kernel` picks on `hw` for bf16
    among the stock kernels (module doc)."""
    if kernel != "auto":
        hw.kernel_rate(kernel)  # (refuses an unknown or absent one)
        return kernel
    for k in auto_order(hw.capability[0], torch.bfloat16):
        if k in STOCK_KERNELS and k in hw.kernels:
            return k
    raise ValueError(f"no stock attention kernel runs on {hw.name}")  # (every preset has one)


# The FlashAttention-3 paper (Shah et al., arXiv 2407.08608, H100 80GB SXM5, BF16, CUDA 12.3,
# cuDNN 9.1.1, flash-attn 2.5.8, clock fixed at 1830 MHz): Figure 5(d), forward with causal
# mask, head dim 128, at 16K tokens; Figure 6(b), backward, head dim 128, 16K tokens -- the
# paper's backward figures are without causal mask (it publishes no causal backward); at the
# 128K-1M tokens of a long-context job the masked share of a kernel's blocks (the diagonal)
# is negligible, so the unmasked rate is the one that applies there.
_FA3_PAPER = "FlashAttention-3 paper (arXiv 2407.08608), H100 SXM5 BF16, d = 128, 16K tokens"
_H100_KERNELS = {
    # torch's aten flash ops run FlashAttention-2's kernels (vendored in
    # aten/src/ATen/native/transformers/cuda/flash_attn): the paper's FlashAttention-2 bars
    "flash": KernelRate(
        forward=335e12,
        backward=322e12,
        source=f"{_FA3_PAPER}: FlashAttention-2, Fig. 5(d) causal forward 335, Fig. 6(b) "
        "backward (no causal figure published) 322 TFLOP/s; torch's flash ops are FA2's kernels",
    ),
    "flash_attn": KernelRate(
        forward=335e12,
        backward=322e12,
        source=f"{_FA3_PAPER}: FlashAttention-2 (flash-attn 2.5.8), Fig. 5(d) causal forward "
        "335, Fig. 6(b) backward (no causal figure published) 322 TFLOP/s",
    ),
    "cudnn": KernelRate(
        forward=539e12,
        backward=516e12,
        source=f"{_FA3_PAPER}: cuDNN 9.1.1, Fig. 5(d) causal forward 539, Fig. 6(b) backward "
        "(no causal figure published) 516 TFLOP/s",
    ),
    "fa3": KernelRate(
        forward=616e12,
        backward=561e12,
        source=f"{_FA3_PAPER}: FlashAttention-3, Fig. 5(d) causal forward 616, Fig. 6(b) "
        "backward (no causal figure published) 561 TFLOP/s",
    ),
    "fa4": KernelRate(
        forward=None,
        backward=None,
        source="no published sm90 figure at hand (the FlashAttention-4 paper, arXiv "
        "2603.05451, reports B200)",
    ),
    "efficient": KernelRate(
        forward=None,
        backward=None,
        source="no published H100 figure at hand for torch's memory-efficient kernel",
    ),
}

# H100 SXM5 80GB (NVIDIA H100 datasheet: 80 GB HBM3 at 3.35 TB/s, 989 TFLOP/s bf16 dense,
# NVLink4 900 GB/s, PCIe Gen5): the compute, HBM and NVLink rates of
# benchmarks/step_time_model.py (same sources).
H100 = Hardware(
    name="h100",
    capability=(9, 0),
    memory_bytes=80 * GB,
    gemm=650e12,
    kernels=_H100_KERNELS,
    hbm=3.0e12,
    all_to_all=200e9,
    collective=300e9,
    p2p=300e9,
    inter_node=40e9,
    host_link=50e9,
    host_memory=45e9,
    sources={
        "memory_bytes": "NVIDIA H100 datasheet (SXM5): 80 GB HBM3",
        "gemm": "NVIDIA H100 datasheet: 989 TFLOP/s bf16 dense peak, x ~0.66 achieved by "
        "cuBLAS on large shapes (our derating, as benchmarks/step_time_model.py)",
        "hbm": "NVIDIA H100 datasheet: 3.35 TB/s HBM3, x 0.9 for streaming kernels",
        "all_to_all": "NCCL's NVLink4 ceiling ~370 GB/s bus bandwidth (NVIDIA/nccl-tests#212), "
        "~55% in an all-to-all of 4-34 MB per peer with its layout copies",
        "collective": "NCCL all-gather / reduce-scatter ~300 GB/s bus bandwidth on NVLink4 "
        "(NVIDIA/nccl-tests#212: ~370 GB/s ceiling), large messages",
        "p2p": "our estimate: a ring's send to its NVLink4 neighbour at the all-gather's rate",
        "inter_node": "DGX H100: one 400 Gb/s ConnectX-7 per GPU, 50 GB/s x 0.8",
        "host_link": "PCIe Gen5 x16: 64 GB/s raw per direction, ~50 GB/s page-locked copies",
        "host_memory": "DGX H100: 2 x 8 channels DDR5-4800 = 614 GB/s per node, / 8 GPUs x ~0.6",
    },
)

# H200 SXM 141GB (NVIDIA H200 datasheet: the H100's 989 TFLOP/s bf16 dense and 900 GB/s
# NVLink, HBM3e 141 GB at 4.8 TB/s): the same compute die and clocks, so the H100's compute,
# attention and link rates (an assumption: the attention papers measured H100s).
H200 = dataclasses.replace(
    H100,
    name="h200",
    memory_bytes=141 * GB,
    hbm=4.3e12,
    kernels={
        k: dataclasses.replace(r, source=f"{r.source}; the H100's figure (same GH100 die, clocks)")
        for k, r in _H100_KERNELS.items()
    },
    sources={
        **H100.sources,
        "memory_bytes": "NVIDIA H200 datasheet (SXM): 141 GB HBM3e",
        "gemm": "NVIDIA H200 datasheet: 989 TFLOP/s bf16 dense (the H100's), x ~0.66 as H100",
        "hbm": "NVIDIA H200 datasheet: 4.8 TB/s HBM3e, x 0.9 for streaming kernels",
    },
)

# A100 SXM4 80GB (NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, 80 GB HBM2e at 2.04 TB/s,
# NVLink3 600 GB/s, PCIe Gen4). No FA3 / FA4 (Hopper and Blackwell kernels).
_FA2_PAPER = "FlashAttention-2 paper (arXiv 2307.08691), A100 80GB SXM4"
A100 = Hardware(
    name="a100",
    capability=(8, 0),
    memory_bytes=80 * GB,
    gemm=220e12,
    kernels={
        "flash": KernelRate(
            forward=228e12,
            backward=197e12,
            source=f"{_FA2_PAPER}, Sec. 4.1: forward up to 73%, backward up to 63% of the 312 "
            "TFLOP/s peak (228 / 197 TFLOP/s, its best configurations); torch's flash ops are "
            "FA2's kernels",
        ),
        "flash_attn": KernelRate(
            forward=228e12,
            backward=197e12,
            source=f"{_FA2_PAPER}, Sec. 4.1: forward up to 73%, backward up to 63% of the 312 "
            "TFLOP/s peak (228 / 197 TFLOP/s, its best configurations)",
        ),
        "cudnn": KernelRate(forward=None, backward=None, source="no published A100 figure at hand"),
        "efficient": KernelRate(
            forward=None,
            backward=None,
            source="no published A100 figure at hand for torch's memory-efficient kernel",
        ),
    },
    hbm=1.8e12,
    all_to_all=133e9,
    collective=200e9,
    p2p=200e9,
    inter_node=20e9,
    host_link=25e9,
    host_memory=30e9,
    sources={
        "memory_bytes": "NVIDIA A100 datasheet (SXM4 80GB): 80 GB HBM2e",
        "gemm": "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense peak, x ~0.7 achieved (our "
        "derating)",
        "hbm": "NVIDIA A100 datasheet: 2.04 TB/s HBM2e, x 0.9",
        "all_to_all": "NVLink3 600 GB/s = 2/3 of NVLink4: the H100's achieved rate x 2/3",
        "collective": "NVLink3 600 GB/s = 2/3 of NVLink4: the H100's achieved rate x 2/3",
        "p2p": "NVLink3: the H100's estimate x 2/3",
        "inter_node": "DGX A100: one 200 Gb/s ConnectX-6 per GPU, 25 GB/s x 0.8",
        "host_link": "PCIe Gen4 x16: 32 GB/s raw per direction, ~25 GB/s page-locked copies",
        "host_memory": "DGX A100: 2 x 8 channels DDR4-3200 = 410 GB/s per node, / 8 GPUs x ~0.6",
    },
)

# B200 (HGX/DGX B200: 180 GB HBM3e at 8 TB/s per GPU, NVLink5 1.8 TB/s, 2.25 PFLOP/s bf16
# dense). No FA3 (Hopper-only). Published attention rates at hand: only FlashAttention-4's
# forward headline; the rest are measured by benchmarks/gpu_check.py (--rates-from).
_FA4_PAPER = "FlashAttention-4 paper (Zadouri et al., arXiv 2603.05451), B200 BF16"
B200 = Hardware(
    name="b200",
    capability=(10, 0),
    memory_bytes=180 * GB,
    gemm=1485e12,
    kernels={
        "fa4": KernelRate(
            forward=1613e12,
            backward=None,
            source=f"{_FA4_PAPER}: forward up to 1613 TFLOP/s (abstract; its best "
            "configuration); no backward figure at hand",
        ),
        "cudnn": KernelRate(
            forward=None,
            backward=None,
            source=f"no figure at hand ({_FA4_PAPER} gives FA4 'up to 1.3x over cuDNN 9.13', "
            "not cuDNN's rate)",
        ),
        "flash": KernelRate(forward=None, backward=None, source="no published B200 figure at hand"),
        "flash_attn": KernelRate(
            forward=None, backward=None, source="no published B200 figure at hand"
        ),
        "efficient": KernelRate(
            forward=None, backward=None, source="no published B200 figure at hand"
        ),
    },
    hbm=7.2e12,
    all_to_all=400e9,
    collective=600e9,
    p2p=600e9,
    inter_node=40e9,
    host_link=50e9,
    host_memory=54e9,
    sources={
        "memory_bytes": "NVIDIA DGX B200 datasheet: 1,440 GB HBM3e for 8 GPUs = 180 GB each",
        "gemm": "2.25 PFLOP/s bf16 dense (NVIDIA DGX B200 datasheet: 72 PFLOP/s FP8 training "
        "for 8 GPUs; the FlashAttention-4 blog, together.ai: 'from 1 to 2.25 PFLOPs'), x ~0.66 "
        "as H100 (our derating)",
        "hbm": "NVIDIA DGX B200 datasheet: 64 TB/s HBM3e for 8 GPUs = 8 TB/s each, x 0.9",
        "all_to_all": "NVLink5 1.8 TB/s = 2x NVLink4: the H100's achieved rate x 2",
        "collective": "NVLink5 1.8 TB/s = 2x NVLink4: the H100's achieved rate x 2",
        "p2p": "NVLink5: the H100's estimate x 2",
        "inter_node": "DGX B200: one 400 Gb/s ConnectX-7 per GPU, 50 GB/s x 0.8",
        "host_link": "PCIe Gen5 x16 (DGX B200): ~50 GB/s page-locked copies, as H100",
        "host_memory": "DGX B200: 2 x 8 channels DDR5-5600 = 717 GB/s per node, / 8 GPUs x ~0.6",
    },
)

HARDWARE = {hw.name: hw for hw in (H100, H200, A100, B200)}


def get_hardware(name: str) -> Hardware:
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}: use one of {', '.join(HARDWARE)}")
    return HARDWARE[name]


def measured_rates(doc: dict) -> dict[str, tuple[float, float]]:
    """{kernel: (forward, backward) FLOP/s} from a gpu_check.json document (part "kernels":
    one row per kernel and shape with `fwd_ms`, `fwd_tflops`, `bwd_ms`, `bwd_tflops`): over
    the rows that were timed and passed their check (`ok`), each kernel's FLOPs over its
    time, so the longest shapes weigh most."""
    flops: dict[str, list[float]] = {}
    for row in doc.get("parts", {}).get("kernels", {}).get("rows", []):
        if row.get("ok") is not True or not row.get("runs") or "fwd_tflops" not in row:
            continue
        acc = flops.setdefault(row["kernel"], [0.0, 0.0, 0.0, 0.0])
        for i, way in enumerate(("fwd", "bwd")):
            seconds = row[f"{way}_ms"] / 1e3
            acc[2 * i] += row[f"{way}_tflops"] * 1e12 * seconds
            acc[2 * i + 1] += seconds
    return {k: (f / tf, b / tb) for k, (f, tf, b, tb) in flops.items()}


def with_measured_rates(hw: Hardware, path: str) -> Hardware:
    """`hw` with the attention rates measured by `benchmarks/gpu_check.py` (its --out JSON at
    `path`) in place of the published ones, kernel by kernel where measured, and the host link
    by the offloaded block's host-to-device copy (part "block", `h2d_gbps`) where measured;
    each replaced rate's source names the run. ValueError for a dry run (its rates mean
    nothing), for a run on another GPU model, or for a file that measured nothing."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--rates-from {path}: cannot read a gpu_check.json ({e})") from e
    if doc.get("dry_run"):
        raise ValueError(
            f"--rates-from {path} is a dry run (gpu_check.py --dry-run: CPU stand-ins, its rates "
            "mean nothing); use the JSON of a run on the GPU"
        )
    device = str(doc.get("environment", {}).get("device", ""))
    if hw.name not in device.lower():
        raise ValueError(
            f"--rates-from {path} was measured on {device or 'an unnamed device'}, not on "
            f"{hw.name}: pass the --hardware of that GPU "
            f"({', '.join(n for n in HARDWARE if n in device.lower()) or 'none of the presets'})"
        )
    where = f"measured by benchmarks/gpu_check.py on {device}, {doc.get('date', 'undated')}"
    kernels = dict(hw.kernels)
    for kernel, (fwd, bwd) in measured_rates(doc).items():
        kernels[kernel] = KernelRate(
            forward=fwd, backward=bwd, source=f"{where} ({path}, part kernels)"
        )
    h2d = [
        r["h2d_gbps"]
        for r in doc.get("parts", {}).get("block", {}).get("rows", [])
        if r.get("h2d_gbps") and not r.get("error")
    ]
    if kernels == hw.kernels and not h2d:
        raise ValueError(
            f"--rates-from {path} holds no timed kernel row that passed its check and no host "
            "copy rate: nothing to replace"
        )
    changes: dict = {"kernels": kernels}
    sources = dict(hw.sources)
    if h2d:
        changes["host_link"] = min(h2d) * GB
        sources["host_link"] = f"{where} ({path}, part block: host-to-device copy)"
    return dataclasses.replace(hw, **changes, sources=sources)
